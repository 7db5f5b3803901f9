//! Listeners, connections, the export table and graceful shutdown.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io;
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

use crate::conn::{self, ConnLimits, Ending};
use crate::export::{Export, ExportState, ExportStatsSnapshot};
use crate::handshake;
use crate::proto::MAX_PAYLOAD_BYTES_DEFAULT;

/// Tunables of the server; every limit a client could otherwise push on.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Requests being processed per connection (the client's queue depth is cut to this).
    pub max_in_flight_requests: usize,
    /// Payload bytes (read or write) being processed per connection.
    pub max_in_flight_bytes: usize,
    /// Largest READ/WRITE payload accepted; advertised in NBD_INFO_BLOCK_SIZE.
    pub max_payload_bytes: u32,
    /// Connections served at once; further ones are closed at accept.
    pub max_connections: usize,
    /// Time allowed from accept to the end of option haggling.
    pub handshake_timeout: Duration,
}

impl Default for ServerOptions {
    fn default() -> ServerOptions {
        ServerOptions {
            max_in_flight_requests: 128,
            max_in_flight_bytes: 64 << 20,
            max_payload_bytes: MAX_PAYLOAD_BYTES_DEFAULT,
            max_connections: 256,
            handshake_timeout: Duration::from_secs(30),
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
    connections: Mutex<HashMap<u64, AbortHandle>>,
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
}

impl NbdServer {
    pub fn new(options: ServerOptions) -> NbdServer {
        assert!(options.max_in_flight_requests > 0, "max_in_flight_requests must be positive");
        let (shutdown_tx, _) = watch::channel(false);
        NbdServer {
            shared: Arc::new(Shared {
                options,
                exports: RwLock::new(BTreeMap::new()),
                default_export: RwLock::new(None),
                shutdown_tx,
                connections: Mutex::new(HashMap::new()),
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
                let bound = ListenAddr::Tcp(l.local_addr()?.to_string());
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
                let left: Vec<AbortHandle> = self.shared.connections.lock().values().cloned().collect();
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
                spawn_connection(s, peer.to_string(), &shared);
            }
            Err(e) => accept_error(e).await,
        }
    }
}

async fn accept_unix(l: UnixListener, shared: Arc<Shared>) {
    loop {
        match l.accept().await {
            Ok((s, _)) => spawn_connection(s, "unix".to_string(), &shared),
            Err(e) => accept_error(e).await,
        }
    }
}

async fn accept_error(e: io::Error) {
    // EMFILE and friends: back off instead of spinning.
    tracing::warn!("accept failed: {e}");
    tokio::time::sleep(Duration::from_millis(100)).await;
}

fn spawn_connection<S: Transport>(stream: S, peer: String, shared: &Arc<Shared>) {
    let mut conns = shared.connections.lock();
    if conns.len() >= shared.options.max_connections {
        tracing::warn!(%peer, limit = shared.options.max_connections, "connection limit reached; closing new connection");
        return;
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
            run_connection(stream, &peer, &s2).await;
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
                        run_connection(stream, &peer, &s2).await
                    }
                    Err(e) => tracing::warn!(%peer, "attaching the connection to its thread: {e}"),
                }
            })
        }
    };
    conns.insert(id, task.abort_handle());
}

struct ConnectionGuard {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.shared.connections.lock().remove(&self.id);
        self.shared.connections_done.notify_waiters();
    }
}

async fn run_connection<S: Transport>(mut stream: S, peer: &str, shared: &Arc<Shared>) {
    let mut shutdown = shared.shutdown_tx.subscribe();
    let negotiated = tokio::select! {
        r = tokio::time::timeout(shared.options.handshake_timeout, handshake::negotiate(&mut stream, shared, peer)) => r,
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
