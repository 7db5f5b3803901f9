//! Listeners, connections, the export table and graceful shutdown.

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::{Notify, watch};
use tokio::task::AbortHandle;

use crate::admission::{AdmissionCounters, AdmissionLimits, AdmissionSnapshot, ConnTable};
use crate::budget::{BudgetSnapshot, PayloadBudget};
use crate::conn::{self, ConnLimits, Ending};
use crate::export::{Export, ExportState, ExportStatsSnapshot};
use crate::handshake;
use crate::proto::DEFAULT_MAX_PAYLOAD_BYTES;

/// Tunables of the server; every limit a client could otherwise push on.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Requests being processed per connection (the client's queue depth is cut to this).
    pub max_in_flight_requests: usize,
    /// Payload bytes (read or write) being processed per connection.
    pub max_in_flight_bytes: usize,
    /// Largest READ/WRITE payload accepted; advertised in NBD_INFO_BLOCK_SIZE.
    pub max_payload_bytes: u32,
    /// Payload bytes (read or write buffers) alive at once over all connections; see
    /// [`crate::budget`]. Raised to 4/3 of `max_payload_bytes` when smaller.
    pub payload_budget_bytes: u64,
    /// Connections served at once (see [`crate::admission`]).
    pub max_connections: usize,
    /// Connections from one IP address at once (Unix sockets are exempt).
    pub max_connections_per_peer: usize,
    /// Connections still in the handshake at once; a new one cuts the oldest.
    pub max_handshakes: usize,
    /// Time allowed from accept to the end of option haggling.
    pub handshake_timeout: Duration,
    /// A WRITE payload that receives no byte for this long ends its connection (returning
    /// the payload budget it held; see [`crate::budget`]).
    pub payload_stall_timeout: Duration,
    /// Accept TCP listeners on non-loopback addresses. NBD has no authentication and mdkit
    /// no TLS: anyone who reaches the port can read and write every export.
    pub allow_remote: bool,
}

/// Default of [`ServerOptions::handshake_timeout`]: a real client needs milliseconds.
pub const HANDSHAKE_TIMEOUT_DEFAULT: Duration = Duration::from_secs(5);
/// Default of [`ServerOptions::payload_stall_timeout`].
pub const PAYLOAD_STALL_TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);
/// Default of [`ServerOptions::payload_budget_bytes`].
pub const PAYLOAD_BUDGET_BYTES_DEFAULT: u64 = 64 << 20;

impl Default for ServerOptions {
    fn default() -> ServerOptions {
        ServerOptions {
            max_in_flight_requests: 128,
            max_in_flight_bytes: 64 << 20,
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            payload_budget_bytes: PAYLOAD_BUDGET_BYTES_DEFAULT,
            max_connections: 384,
            max_connections_per_peer: 64,
            max_handshakes: 64,
            handshake_timeout: HANDSHAKE_TIMEOUT_DEFAULT,
            payload_stall_timeout: PAYLOAD_STALL_TIMEOUT_DEFAULT,
            allow_remote: false,
        }
    }
}

impl ServerOptions {
    fn admission_limits(&self) -> AdmissionLimits {
        AdmissionLimits {
            max_connections: self.max_connections,
            max_connections_per_peer: self.max_connections_per_peer,
            max_handshakes: self.max_handshakes,
        }
    }
}

/// Where to listen: `127.0.0.1:10809`, `[::1]:10809` or `unix:/path/to/socket`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ListenAddr {
    Tcp(String),
    Unix(PathBuf),
}

impl FromStr for ListenAddr {
    type Err = String;
    fn from_str(s: &str) -> Result<ListenAddr, String> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(format!("listen address {s:?}: empty socket path"));
            }
            return Ok(ListenAddr::Unix(PathBuf::from(path)));
        }
        let Some((host, port)) = s.rsplit_once(':') else {
            return Err(format!("listen address {s:?}: expected HOST:PORT or unix:PATH"));
        };
        if host.is_empty() || port.parse::<u16>().is_err() {
            return Err(format!("listen address {s:?}: expected HOST:PORT or unix:PATH"));
        }
        Ok(ListenAddr::Tcp(s.to_string()))
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListenAddr::Tcp(a) => write!(f, "{a}"),
            ListenAddr::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// Outcome of [`NbdServer::shutdown`].
#[derive(Debug, Default)]
pub struct ShutdownReport {
    /// Connections still busy when the grace period ended (their tasks were aborted).
    pub connections_aborted: usize,
    /// Exports whose flush failed, with the error.
    pub flush_errors: Vec<(String, io::Error)>,
}

/// The NBD server: a table of exports and any number of listeners. Cheap to clone.
#[derive(Clone)]
pub struct NbdServer {
    shared: Arc<Shared>,
}

pub struct Shared {
    pub options: ServerOptions,
    exports: RwLock<BTreeMap<String, Arc<ExportState>>>,
    default_export: RwLock<Option<String>>,
    shutdown_tx: watch::Sender<bool>,
    connections: Mutex<ConnTable>,
    admission: AdmissionCounters,
    budget: Arc<PayloadBudget>,
    next_connection_id: AtomicU64,
    connections_accepted: AtomicU64,
    connections_done: Notify,
    listeners: Mutex<Vec<(ListenAddr, AbortHandle)>>,
    /// Where connections run (round robin); empty = on the runtime that accepted them.
    connection_runtimes: RwLock<Vec<tokio::runtime::Handle>>,
    next_runtime: AtomicU64,
}

impl Shared {
    pub fn is_shutting_down(&self) -> bool {
        *self.shutdown_tx.borrow()
    }

    /// Looks an export up by name; the empty name means the default export.
    pub fn find_export(&self, name: &str) -> Option<Arc<ExportState>> {
        let exports = self.exports.read();
        if name.is_empty() {
            let default = self.default_export.read();
            return default.as_ref().and_then(|d| exports.get(d).cloned());
        }
        exports.get(name).cloned()
    }

    pub fn exports_snapshot(&self) -> Vec<Arc<ExportState>> {
        self.exports.read().values().cloned().collect()
    }

    /// Connection `id` has negotiated: it no longer counts as a handshake, so a newer one can
    /// no longer cut it. Called before the reply that ends the handshake is written: once the
    /// client has that reply it may rightly count on its connection.
    pub fn handshake_done(&self, id: u64) {
        self.connections.lock().handshake_done(id);
    }

    /// Takes connection `id` into the table as accept does (tests drive `negotiate` directly).
    #[cfg(test)]
    pub(crate) fn insert_connection(&self, id: u64, abort: tokio::task::AbortHandle) {
        self.connections.lock().insert(id, abort, None);
    }

    /// Whether connection `id` is still negotiating.
    #[cfg(test)]
    pub(crate) fn is_handshaking(&self, id: u64) -> bool {
        self.connections.lock().is_handshaking(id)
    }
}

impl NbdServer {
    pub fn new(options: ServerOptions) -> NbdServer {
        assert!(options.max_in_flight_requests > 0, "max_in_flight_requests must be positive");
        let (shutdown_tx, _) = watch::channel(false);
        let budget = Arc::new(PayloadBudget::new(options.payload_budget_bytes, options.max_payload_bytes));
        NbdServer {
            shared: Arc::new(Shared {
                options,
                exports: RwLock::new(BTreeMap::new()),
                default_export: RwLock::new(None),
                shutdown_tx,
                connections: Mutex::new(ConnTable::default()),
                admission: AdmissionCounters::default(),
                budget,
                next_connection_id: AtomicU64::new(1),
                connections_accepted: AtomicU64::new(0),
                connections_done: Notify::new(),
                listeners: Mutex::new(Vec::new()),
                connection_runtimes: RwLock::new(Vec::new()),
                next_runtime: AtomicU64::new(0),
            }),
        }
    }

    pub fn options(&self) -> &ServerOptions {
        &self.shared.options
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Adds an export. Names must be non-empty, at most 4096 bytes and unique.
    pub fn add_export(&self, export: Export) -> io::Result<()> {
        if export.name.is_empty() || export.name.len() > handshake::NAME_MAX_BYTES || export.name.contains('\0') {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("invalid export name {:?}", export.name)));
        }
        let mut exports = self.shared.exports.write();
        if exports.contains_key(&export.name) {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("export {:?} already exists", export.name),
            ));
        }
        tracing::info!(export = %export.name, device = export.device.name(), read_only = export.read_only, "export added");
        exports.insert(export.name.clone(), Arc::new(ExportState::new(export)));
        Ok(())
    }

    /// Removes an export from the table; connections already using it keep it until they end.
    pub fn remove_export(&self, name: &str) -> bool {
        self.shared.exports.write().remove(name).is_some()
    }

    /// Runs each new connection on one of these runtimes (round robin) instead of the runtime
    /// that accepted it — typically [`crate::ConnectionThreads`], one current-thread runtime per
    /// core, so a connection's requests and member I/O stay on one thread. An empty list (the
    /// default) keeps connections on the accepting runtime.
    pub fn set_connection_runtimes(&self, runtimes: Vec<tokio::runtime::Handle>) {
        *self.shared.connection_runtimes.write() = runtimes;
    }

    /// The export that the empty name (`nbd://host/`) selects.
    pub fn set_default_export(&self, name: Option<String>) {
        *self.shared.default_export.write() = name;
    }

    /// Per-export counters, by export name.
    pub fn export_stats(&self) -> Vec<(String, ExportStatsSnapshot)> {
        self.shared.exports.read().iter().map(|(n, e)| (n.clone(), e.stats.snapshot())).collect()
    }

    /// Connections currently open (handshake or transmission).
    pub fn connection_count(&self) -> usize {
        self.shared.connections.lock().len()
    }

    pub fn connections_accepted(&self) -> u64 {
        self.shared.connections_accepted.load(Ordering::Relaxed)
    }

    /// Connections refused or cut by the limits of [`crate::admission`].
    pub fn admission_stats(&self) -> AdmissionSnapshot {
        self.shared.admission.snapshot()
    }

    /// The server-wide payload budget: limit, use, peak.
    pub fn payload_budget(&self) -> BudgetSnapshot {
        self.shared.budget.snapshot()
    }

    pub fn listeners(&self) -> Vec<ListenAddr> {
        self.shared.listeners.lock().iter().map(|(a, _)| a.clone()).collect()
    }

    /// Starts listening; returns the bound address (with the real port when 0 was asked for).
    /// A stale Unix socket file (nobody listening) is replaced; a live one is an error.
    pub async fn listen(&self, addr: &ListenAddr) -> io::Result<ListenAddr> {
        if self.shared.is_shutting_down() {
            return Err(io::Error::other("server is shutting down"));
        }
        let (bound, task) = match addr {
            ListenAddr::Tcp(a) => {
                let l = TcpListener::bind(a).await.map_err(|e| io::Error::new(e.kind(), format!("bind {a}: {e}")))?;
                let local = l.local_addr()?;
                check_exposure(a, local.ip(), self.shared.options.allow_remote)?;
                let bound = ListenAddr::Tcp(local.to_string());
                let shared = self.shared.clone();
                (bound, tokio::spawn(accept_tcp(l, shared)))
            }
            ListenAddr::Unix(p) => {
                if p.exists() {
                    if UnixStream::connect(p).await.is_ok() {
                        return Err(io::Error::new(
                            io::ErrorKind::AddrInUse,
                            format!("{}: a server is already listening", p.display()),
                        ));
                    }
                    std::fs::remove_file(p)
                        .map_err(|e| io::Error::new(e.kind(), format!("remove stale {}: {e}", p.display())))?;
                }
                let l = UnixListener::bind(p)
                    .map_err(|e| io::Error::new(e.kind(), format!("bind {}: {e}", p.display())))?;
                let shared = self.shared.clone();
                (addr.clone(), tokio::spawn(accept_unix(l, shared)))
            }
        };
        tracing::info!(listen = %bound, "NBD listening");
        self.shared.listeners.lock().push((bound.clone(), task.abort_handle()));
        Ok(bound)
    }

    /// Graceful shutdown: stop accepting, stop reading new requests, let in-flight requests
    /// finish and their replies go out (for at most `grace`, then connections are cut), then
    /// flush every export's device.
    pub async fn shutdown(&self, grace: Duration) -> ShutdownReport {
        let mut report = ShutdownReport::default();
        self.shared.shutdown_tx.send_replace(true);
        for (addr, task) in self.shared.listeners.lock().drain(..) {
            task.abort();
            if let ListenAddr::Unix(p) = addr {
                let _ = std::fs::remove_file(p);
            }
        }
        let deadline = tokio::time::Instant::now() + grace;
        loop {
            let done = self.shared.connections_done.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            if self.shared.connections.lock().is_empty() {
                break;
            }
            if tokio::time::timeout_at(deadline, done).await.is_err() {
                let left: Vec<AbortHandle> = self.shared.connections.lock().abort_handles();
                report.connections_aborted = left.len();
                tracing::warn!(connections = left.len(), "grace period over: cutting connections");
                for h in left {
                    h.abort();
                }
                break;
            }
        }
        let mut seen: Vec<*const ()> = Vec::new();
        for e in self.shared.exports_snapshot() {
            let ptr = Arc::as_ptr(&e.export.device) as *const ();
            if seen.contains(&ptr) {
                continue;
            }
            seen.push(ptr);
            if let Err(err) = e.export.device.flush().await {
                tracing::error!(export = %e.export.name, "flush at shutdown failed: {err}");
                report.flush_errors.push((e.export.name.clone(), err));
            }
        }
        report
    }
}

/// Refuses a listener that remote hosts can reach unless `allow_remote` is set, and warns when
/// it is: NBD has no authentication, and mdkit does not speak TLS.
fn check_exposure(asked: &str, ip: IpAddr, allow_remote: bool) -> io::Result<()> {
    if ip.is_loopback() {
        return Ok(());
    }
    if !allow_remote {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "listen {asked}: {ip} is not a loopback address; NBD has no authentication or encryption, \
                 so anyone who can reach it can read and overwrite every export. Set `[nbd] allow_remote = true` \
                 to listen there anyway, or use 127.0.0.1, [::1] or unix:PATH"
            ),
        ));
    }
    tracing::warn!(listen = asked, %ip, "NBD listening on a non-loopback address (allow_remote): no authentication, no encryption");
    Ok(())
}

//------------------------------------------------------------------------------------------------

/// A stream that can be split into independently owned halves without a lock, and moved to
/// another runtime (detached from this runtime's reactor, attached to the other's).
trait Transport: AsyncRead + AsyncWrite + AsRawFd + Unpin + Send + Sized + 'static {
    type R: AsyncRead + Unpin + Send + 'static;
    type W: AsyncWrite + Unpin + Send + 'static;
    type Std: Send + 'static;
    fn into_halves(self) -> (Self::R, Self::W);
    fn detach(self) -> io::Result<Self::Std>;
    /// Must run inside the runtime that is to drive the stream.
    fn attach(s: Self::Std) -> io::Result<Self>;
}

impl Transport for TcpStream {
    type R = tokio::net::tcp::OwnedReadHalf;
    type W = tokio::net::tcp::OwnedWriteHalf;
    type Std = std::net::TcpStream;
    fn into_halves(self) -> (Self::R, Self::W) {
        self.into_split()
    }
    fn detach(self) -> io::Result<Self::Std> {
        self.into_std()
    }
    fn attach(s: Self::Std) -> io::Result<Self> {
        TcpStream::from_std(s)
    }
}

impl Transport for UnixStream {
    type R = tokio::net::unix::OwnedReadHalf;
    type W = tokio::net::unix::OwnedWriteHalf;
    type Std = std::os::unix::net::UnixStream;
    fn into_halves(self) -> (Self::R, Self::W) {
        self.into_split()
    }
    fn detach(self) -> io::Result<Self::Std> {
        self.into_std()
    }
    fn attach(s: Self::Std) -> io::Result<Self> {
        UnixStream::from_std(s)
    }
}

async fn accept_tcp(l: TcpListener, shared: Arc<Shared>) {
    loop {
        match l.accept().await {
            Ok((s, peer)) => {
                if let Err(e) = s.set_nodelay(true) {
                    tracing::warn!(%peer, "TCP_NODELAY: {e}");
                }
                spawn_connection(s, Some(peer.ip()), peer.to_string(), &shared);
            }
            Err(e) => accept_error(e).await,
        }
    }
}

async fn accept_unix(l: UnixListener, shared: Arc<Shared>) {
    loop {
        match l.accept().await {
            Ok((s, _)) => spawn_connection(s, None, "unix".to_string(), &shared),
            Err(e) => accept_error(e).await,
        }
    }
}

async fn accept_error(e: io::Error) {
    // EMFILE and friends: back off instead of spinning.
    tracing::warn!("accept failed: {e}");
    tokio::time::sleep(Duration::from_millis(100)).await;
}

fn spawn_connection<S: Transport>(stream: S, peer_ip: Option<IpAddr>, peer: String, shared: &Arc<Shared>) {
    let mut conns = shared.connections.lock();
    match conns.admit(&shared.options.admission_limits(), peer_ip, &shared.admission) {
        Ok(None) => {}
        Ok(Some(oldest_handshake)) => {
            tracing::debug!(%peer, "handshake slots full; cutting the oldest handshake");
            oldest_handshake.abort();
        }
        Err(refusal) => {
            tracing::warn!(%peer, ?refusal, "connection limit reached; closing new connection");
            return;
        }
    }
    shared.connections_accepted.fetch_add(1, Ordering::Relaxed);
    let id = shared.next_connection_id.fetch_add(1, Ordering::Relaxed);
    let s2 = shared.clone();
    let runtime = {
        let rts = shared.connection_runtimes.read();
        let n = shared.next_runtime.fetch_add(1, Ordering::Relaxed);
        (!rts.is_empty()).then(|| rts[(n % rts.len() as u64) as usize].clone())
    };
    // The map lock is held across spawn + insert, so the task's own removal (which takes the
    // same lock) always happens after the insert.
    let task = match runtime {
        None => tokio::spawn(async move {
            let _guard = ConnectionGuard { shared: s2.clone(), id };
            run_connection(stream, id, &peer, &s2).await;
        }),
        Some(rt) => {
            let detached = match stream.detach() {
                Ok(d) => d,
                Err(e) => {
                    tracing::warn!(%peer, "moving the connection to a connection thread: {e}");
                    return;
                }
            };
            rt.spawn(async move {
                let _guard = ConnectionGuard { shared: s2.clone(), id };
                match S::attach(detached) {
                    Ok(stream) => {
                        let _watch = crate::threads::watch_socket(stream.as_raw_fd());
                        run_connection(stream, id, &peer, &s2).await
                    }
                    Err(e) => tracing::warn!(%peer, "attaching the connection to its thread: {e}"),
                }
            })
        }
    };
    conns.insert(id, task.abort_handle(), peer_ip);
}

struct ConnectionGuard {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.shared.connections.lock().remove(self.id);
        self.shared.connections_done.notify_waiters();
    }
}

async fn run_connection<S: Transport>(mut stream: S, id: u64, peer: &str, shared: &Arc<Shared>) {
    let mut shutdown = shared.shutdown_tx.subscribe();
    let negotiated = tokio::select! {
        r = tokio::time::timeout(shared.options.handshake_timeout, handshake::negotiate(&mut stream, shared, peer, id)) => r,
        _ = shutdown.wait_for(|v| *v) => return,
    };
    let neg = match negotiated {
        Ok(Ok(Some(n))) => n,
        Ok(Ok(None)) => return,
        Ok(Err(e)) => {
            tracing::warn!(peer, "handshake failed: {e}");
            return;
        }
        Err(_) => {
            shared.admission.handshakes_timed_out.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(peer, "handshake timed out");
            return;
        }
    };
    let export = neg.export.clone();
    tracing::debug!(peer, export = %export.export.name, structured = neg.structured, flags = neg.flags, "transmission");
    export.stats.connections.fetch_add(1, Ordering::Relaxed);
    let limits = ConnLimits {
        max_in_flight_requests: shared.options.max_in_flight_requests,
        max_in_flight_bytes: shared.options.max_in_flight_bytes,
        max_payload_bytes: shared.options.max_payload_bytes,
        budget: shared.budget.clone(),
        payload_stall_timeout: shared.options.payload_stall_timeout,
    };
    let (r, w) = stream.into_halves();
    let result = conn::serve(r, w, neg, limits, shutdown, peer).await;
    export.stats.connections.fetch_sub(1, Ordering::Relaxed);
    match result {
        Ok(Ending::Disconnect) | Ok(Ending::Eof) => tracing::debug!(peer, "client disconnected"),
        Ok(Ending::Shutdown) => tracing::debug!(peer, "connection closed for shutdown"),
        Err(e) => tracing::debug!(peer, "connection ended: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_addresses_parse() {
        assert_eq!("127.0.0.1:10809".parse::<ListenAddr>().unwrap(), ListenAddr::Tcp("127.0.0.1:10809".into()));
        assert_eq!("[::1]:1".parse::<ListenAddr>().unwrap(), ListenAddr::Tcp("[::1]:1".into()));
        assert_eq!("unix:/tmp/x.sock".parse::<ListenAddr>().unwrap(), ListenAddr::Unix("/tmp/x.sock".into()));
        for bad in ["", "unix:", "localhost", "host:99999", ":80"] {
            assert!(bad.parse::<ListenAddr>().is_err(), "{bad}");
        }
        assert_eq!(ListenAddr::Unix("/a".into()).to_string(), "unix:/a");
    }
}
