//! [`NbdDevice`]: a member on a remote NBD server (nbdkit, qemu-nbd, nbd-server, another
//! mdkit), reached by a member URI (see [`uri`]).
//!
//! ```text
//!   BlockDevice calls ──► Conn::request ──► writer task ──► socket ──► server
//!          ▲               (in-flight slot,                              │
//!          └──── oneshot ◄── reader task (cookie → request) ◄────────────┘
//! ```
//! - Handshake ([`handshake`]): fixed newstyle, structured replies when offered, `NBD_OPT_GO`
//!   with `NBD_INFO_BLOCK_SIZE` (the export's minimum block becomes the logical block, its
//!   maximum payload the largest request).
//! - Member interface → wire: `flush` → `NBD_CMD_FLUSH` (a no-op when the server has no
//!   volatile cache to flush, i.e. does not offer it); a FUA write → `NBD_CMD_FLAG_FUA`, or
//!   write + flush when the server lacks FUA; `discard` → `NBD_CMD_TRIM` and `write_zeroes` →
//!   `NBD_CMD_WRITE_ZEROES` (with `NO_HOLE` for `no_unmap`) only when offered, else
//!   `Unsupported`.
//! - At most `max_in_flight` requests are on the wire; more wait for a slot.
//! - Every request has a deadline (`request_timeout`); one that passes drops the connection
//!   (NBD cannot cancel a request, so the connection's state is unknown).
//! - A lost connection fails every request in flight with [`NbdErrorKind::Disconnected`], and
//!   requests made while it is down fail at once with the same error (failfast: md fails the
//!   member instead of stalling the array). In the background the device reconnects with
//!   exponential backoff (`reconnect_delay_min` doubling to `reconnect_delay_max`) to the same
//!   export, which must still have the same size and block size; [`NbdDevice::link`] tells
//!   whether the link is up, when the server last answered, what is outstanding (requests and
//!   bytes: the member's lag) and how often it was lost and re-established.
//! - Dropping the device ends its connection with `NBD_CMD_DISC` once queued requests are sent.

mod conn;
pub mod error;
pub mod handshake;
pub mod proto;
pub mod uri;

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::net::{TcpStream, UnixStream};

use self::conn::{Conn, ReadHalf, Reply, WriteHalf};
pub use self::error::{NbdClientError, NbdErrorKind};
pub use self::handshake::ExportInfo;
use self::proto::*;
pub use self::uri::{NbdAddress, NbdUri, is_nbd_uri};
use crate::buf::{IoBuf, SharedBuf};
use crate::device::{BlockDevice, IoFuture, IoOp, ReadResult, Topology, WriteFlags, ZeroFlags, check_io, unsupported};

/// Largest request mdkit sends (the spec's default payload limit).
const MAX_IO_BYTES: u32 = 32 << 20;
/// TRIM and WRITE_ZEROES lengths are 32 bits: longer ranges go in pieces of this size.
const RANGE_PIECE_BYTES: u64 = 1 << 30;

/// Tunables of the client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NbdClientOptions {
    /// Requests on the wire at once.
    pub max_in_flight: u32,
    /// A request without a reply after this long drops the connection.
    pub request_timeout: Duration,
    /// Connecting plus the handshake must finish within this.
    pub connect_timeout: Duration,
    /// First delay before a reconnect attempt; doubles after each failed attempt ...
    pub reconnect_delay_min: Duration,
    /// ... up to this.
    pub reconnect_delay_max: Duration,
}

impl Default for NbdClientOptions {
    fn default() -> NbdClientOptions {
        NbdClientOptions {
            max_in_flight: 64,
            request_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            reconnect_delay_min: Duration::from_millis(100),
            reconnect_delay_max: Duration::from_secs(5),
        }
    }
}

/// The link's state, for status and tests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkStatus {
    pub up: bool,
    /// Why it went down last (kept after it came back).
    pub last_loss: Option<String>,
    /// Connections lost since the device was opened.
    pub losses: u64,
    /// Successful reconnects since the device was opened.
    pub reconnects: u64,
    /// When the server last answered (a reply or a completed handshake), Unix milliseconds.
    pub last_contact_unix_ms: u64,
    /// Requests waiting for a reply (or a slot), and the bytes they carry or ask for.
    pub outstanding_requests: u64,
    pub outstanding_bytes: u64,
}

enum Link {
    Up(Arc<Conn>),
    Down(String),
}

struct Shared {
    uri: NbdUri,
    name: String,
    opts: NbdClientOptions,
    info: ExportInfo,
    topo: Topology,
    link: Mutex<Link>,
    last_loss: Mutex<Option<String>>,
    next_conn_id: AtomicU64,
    losses: AtomicU64,
    reconnects: AtomicU64,
    last_contact_unix_ms: AtomicU64,
    outstanding_requests: AtomicU64,
    outstanding_bytes: AtomicU64,
    closing: AtomicBool,
}

/// A block device on an NBD server. See the module documentation.
pub struct NbdDevice {
    shared: Arc<Shared>,
}

impl NbdDevice {
    /// Parses `uri` and connects.
    pub async fn connect(uri: &str, opts: NbdClientOptions) -> Result<NbdDevice, NbdClientError> {
        NbdDevice::connect_uri(NbdUri::parse(uri)?, opts).await
    }

    pub async fn connect_uri(uri: NbdUri, opts: NbdClientOptions) -> Result<NbdDevice, NbdClientError> {
        let (halves, info) = open_socket(&uri, &opts).await?;
        let shared = Arc::new(Shared {
            name: uri.to_string(),
            topo: topology(&info),
            uri,
            opts,
            info,
            link: Mutex::new(Link::Down("connecting".into())),
            last_loss: Mutex::new(None),
            next_conn_id: AtomicU64::new(1),
            losses: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
            last_contact_unix_ms: AtomicU64::new(0),
            outstanding_requests: AtomicU64::new(0),
            outstanding_bytes: AtomicU64::new(0),
            closing: AtomicBool::new(false),
        });
        shared.install(halves, info);
        tracing::debug!(member = %shared.name, size_bytes = info.size_bytes, flags = info.transmission_flags,
            structured = info.structured_replies, "NBD member connected");
        Ok(NbdDevice { shared })
    }

    /// What the server said about the export at the first connection.
    pub fn export_info(&self) -> ExportInfo {
        self.shared.info
    }

    pub fn link(&self) -> LinkStatus {
        let s = &self.shared;
        LinkStatus {
            up: matches!(&*s.link.lock(), Link::Up(_)),
            last_loss: s.last_loss.lock().clone(),
            losses: s.losses.load(Ordering::Relaxed),
            reconnects: s.reconnects.load(Ordering::Relaxed),
            last_contact_unix_ms: s.last_contact_unix_ms.load(Ordering::Relaxed),
            outstanding_requests: s.outstanding_requests.load(Ordering::Relaxed),
            outstanding_bytes: s.outstanding_bytes.load(Ordering::Relaxed),
        }
    }
}

impl Drop for NbdDevice {
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::Release);
        // The writer sends NBD_CMD_DISC once the last handle (and queued request) is gone.
        *self.shared.link.lock() = Link::Down("closed".into());
    }
}

/// Connects and runs the handshake within the connect timeout.
async fn open_socket(
    uri: &NbdUri,
    opts: &NbdClientOptions,
) -> Result<((ReadHalf, WriteHalf), ExportInfo), NbdClientError> {
    let target = uri.to_string();
    let attempt = async {
        let connect_err = |e: io::Error| NbdClientError::new(NbdErrorKind::Connect, &target, "connect", e.to_string());
        match &uri.address {
            NbdAddress::Tcp { host, port } => {
                let mut s = TcpStream::connect((host.as_str(), *port)).await.map_err(connect_err)?;
                s.set_nodelay(true).map_err(connect_err)?;
                // A dropped connection is reset, and what it had not sent yet is discarded:
                // requests failed with it must never reach the server later (after a
                // partition heals, behind a catch-up that already wrote newer data).
                // (Deprecated because a non-zero linger blocks the dropping thread; zero never does.)
                #[allow(deprecated)]
                let linger = s.set_linger(Some(std::time::Duration::ZERO));
                linger.map_err(connect_err)?;
                let info = handshake::handshake(&mut s, &target, &uri.export).await?;
                let (r, w) = s.into_split();
                Ok(((Box::new(r) as ReadHalf, Box::new(w) as WriteHalf), info))
            }
            NbdAddress::Unix { socket } => {
                let mut s = UnixStream::connect(socket)
                    .await
                    .map_err(|e| connect_err(io::Error::new(e.kind(), format!("{}: {e}", socket.display()))))?;
                let info = handshake::handshake(&mut s, &target, &uri.export).await?;
                let (r, w) = s.into_split();
                Ok(((Box::new(r) as ReadHalf, Box::new(w) as WriteHalf), info))
            }
        }
    };
    tokio::time::timeout(opts.connect_timeout, attempt).await.unwrap_or_else(|_| {
        Err(NbdClientError::new(
            NbdErrorKind::Connect,
            &target,
            "connect",
            format!("no answer within {:?}", opts.connect_timeout),
        ))
    })
}

fn topology(info: &ExportInfo) -> Topology {
    let lbs = info.min_block_bytes.max(512);
    let max_io = info.max_block_bytes.min(MAX_IO_BYTES) / lbs * lbs;
    let trim = info.has(FLAG_SEND_TRIM);
    Topology {
        size_bytes: info.size_bytes / u64::from(lbs) * u64::from(lbs),
        logical_block_bytes: lbs,
        physical_block_bytes: info.preferred_block_bytes.clamp(lbs, 65536),
        optimal_io_bytes: info.preferred_block_bytes.clamp(4096, 1 << 20),
        max_io_bytes: max_io.max(lbs),
        supports_fua: info.has(FLAG_SEND_FUA),
        volatile_cache: info.has(FLAG_SEND_FLUSH),
        supports_discard: trim,
        supports_write_zeroes: info.has(FLAG_SEND_WRITE_ZEROES),
        discard_granularity_bytes: if trim { info.preferred_block_bytes.max(lbs) } else { 0 },
        rotational: info.has(FLAG_ROTATIONAL),
    }
}

/// One request counted in the link's outstanding requests and bytes until dropped (also when
/// the caller drops the request's future before the reply).
struct Outstanding<'a> {
    shared: &'a Shared,
    bytes: u64,
}

impl<'a> Outstanding<'a> {
    fn new(shared: &'a Shared, bytes: u64) -> Outstanding<'a> {
        shared.outstanding_requests.fetch_add(1, Ordering::Relaxed);
        shared.outstanding_bytes.fetch_add(bytes, Ordering::Relaxed);
        Outstanding { shared, bytes }
    }
}

impl Drop for Outstanding<'_> {
    fn drop(&mut self) {
        self.shared.outstanding_requests.fetch_sub(1, Ordering::Relaxed);
        self.shared.outstanding_bytes.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

impl Shared {
    /// Starts a connection and makes it the current one.
    fn install(self: &Arc<Self>, halves: (ReadHalf, WriteHalf), info: ExportInfo) {
        let id = self.next_conn_id.fetch_add(1, Ordering::Relaxed);
        let weak = Arc::downgrade(self);
        let on_lost = move |reason: String| {
            if let Some(s) = weak.upgrade() {
                s.lost(id, reason);
            }
        };
        let conn = Arc::new(Conn::start(id, &self.name, info, self.opts.max_in_flight, halves, on_lost));
        let core = conn.core.clone();
        self.touch();
        *self.link.lock() = Link::Up(conn);
        // A connection that died before it was current was ignored by `lost`.
        if let Some(reason) = core.close_reason() {
            self.lost(id, reason);
        }
    }

    /// Connection `id` closed: mark the link down and start reconnecting (once per loss).
    fn lost(self: &Arc<Self>, id: u64, reason: String) {
        {
            let mut link = self.link.lock();
            if !matches!(&*link, Link::Up(c) if c.id == id) {
                return;
            }
            *link = Link::Down(reason.clone());
        }
        self.losses.fetch_add(1, Ordering::Relaxed);
        *self.last_loss.lock() = Some(reason.clone());
        if self.closing.load(Ordering::Acquire) {
            return;
        }
        tracing::warn!(member = %self.name, "NBD link lost: {reason}; reconnecting in the background");
        tokio::spawn(reconnect(Arc::downgrade(self)));
    }

    fn conn(&self, op: &'static str, offset_bytes: u64) -> Result<Arc<Conn>, NbdClientError> {
        match &*self.link.lock() {
            Link::Up(c) => Ok(c.clone()),
            Link::Down(reason) => {
                Err(NbdClientError::new(NbdErrorKind::Disconnected, &self.name, op, reason.clone()).at(offset_bytes))
            }
        }
    }

    /// The server answered just now.
    fn touch(&self) {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
        self.last_contact_unix_ms.store(now as u64, Ordering::Relaxed);
    }

    async fn request(
        &self,
        (op, cmd, flags): (&'static str, u16, u16),
        offset_bytes: u64,
        len_bytes: u32,
        payload: Option<SharedBuf>,
        buf: Option<IoBuf>,
    ) -> Reply {
        let c = match self.conn(op, offset_bytes) {
            Ok(c) => c,
            Err(e) => return Reply { buf, result: Err(e) },
        };
        // TRIM and WRITE_ZEROES carry no payload: only reads and writes count as bytes.
        let bytes = if matches!(cmd, CMD_READ | CMD_WRITE) { u64::from(len_bytes) } else { 0 };
        let r = {
            let _counted = Outstanding::new(self, bytes);
            c.request(op, cmd, flags, offset_bytes, len_bytes, payload, buf, self.opts.request_timeout).await
        };
        if matches!(&r.result, Ok(()) | Err(NbdClientError { kind: NbdErrorKind::Server { .. }, .. })) {
            self.touch();
        }
        r
    }

    async fn simple(&self, what: (&'static str, u16, u16), offset_bytes: u64, len_bytes: u32) -> io::Result<()> {
        self.request(what, offset_bytes, len_bytes, None, None).await.result.map_err(io::Error::from)
    }

    async fn flush(&self) -> io::Result<()> {
        if !self.info.has(FLAG_SEND_FLUSH) {
            return Ok(());
        }
        self.simple(("flush", CMD_FLUSH, 0), 0, 0).await
    }

    /// TRIM or WRITE_ZEROES over a range of any length, in 32-bit pieces.
    async fn ranged(&self, what: (&'static str, u16, u16), offset_bytes: u64, len_bytes: u64) -> io::Result<()> {
        let mut pos = offset_bytes;
        let end = offset_bytes + len_bytes;
        while pos < end {
            let n = (end - pos).min(RANGE_PIECE_BYTES);
            self.simple(what, pos, n as u32).await?;
            pos += n;
        }
        Ok(())
    }
}

async fn reconnect(weak: Weak<Shared>) {
    let Some(mut delay) = weak.upgrade().map(|s| s.opts.reconnect_delay_min) else {
        return;
    };
    loop {
        tokio::time::sleep(delay).await;
        let Some(s) = weak.upgrade() else {
            return;
        };
        if s.closing.load(Ordering::Acquire) {
            return;
        }
        match open_socket(&s.uri, &s.opts).await {
            Ok((halves, info))
                if info.size_bytes == s.info.size_bytes && info.min_block_bytes == s.info.min_block_bytes =>
            {
                s.install(halves, info);
                s.reconnects.fetch_add(1, Ordering::Relaxed);
                tracing::info!(member = %s.name, "NBD link up again");
                return;
            }
            Ok((_, info)) => tracing::warn!(
                member = %s.name,
                "export changed (size {} → {} bytes, minimum block {} → {}); not using it",
                s.info.size_bytes, info.size_bytes, s.info.min_block_bytes, info.min_block_bytes
            ),
            Err(e) => tracing::debug!(member = %s.name, "reconnect failed: {e}"),
        }
        delay = (delay * 2).min(s.opts.reconnect_delay_max);
    }
}

impl BlockDevice for NbdDevice {
    fn name(&self) -> &str {
        &self.shared.name
    }

    fn topology(&self) -> Topology {
        self.shared.topo
    }

    fn read(&self, offset_bytes: u64, buf: IoBuf) -> IoFuture<'_, ReadResult> {
        Box::pin(async move {
            let s = &self.shared;
            let len = buf.len();
            if let Err(e) = check_io(&s.name, &s.topo, IoOp::Read, offset_bytes, len as u64) {
                return (buf, Err(e));
            }
            let r = s.request(("read", CMD_READ, 0), offset_bytes, len as u32, None, Some(buf)).await;
            let buf = r.buf.filter(|b| b.len() == len).unwrap_or_else(|| IoBuf::zeroed(len));
            (buf, r.result.map_err(io::Error::from))
        })
    }

    fn write(&self, offset_bytes: u64, buf: SharedBuf, flags: WriteFlags) -> IoFuture<'_, io::Result<()>> {
        Box::pin(async move {
            let s = &self.shared;
            check_io(&s.name, &s.topo, IoOp::Write, offset_bytes, buf.len() as u64)?;
            let native_fua = flags.fua && s.info.has(FLAG_SEND_FUA);
            let cmd_flags = if native_fua { CMD_FLAG_FUA } else { 0 };
            let len = buf.len() as u32;
            let r = s.request(("write", CMD_WRITE, cmd_flags), offset_bytes, len, Some(buf), None).await;
            r.result.map_err(io::Error::from)?;
            if flags.fua && !native_fua {
                s.flush().await?;
            }
            Ok(())
        })
    }

    fn flush(&self) -> IoFuture<'_, io::Result<()>> {
        Box::pin(self.shared.flush())
    }

    fn discard(&self, offset_bytes: u64, len_bytes: u64) -> IoFuture<'_, io::Result<()>> {
        Box::pin(async move {
            let s = &self.shared;
            check_io(&s.name, &s.topo, IoOp::Discard, offset_bytes, len_bytes)?;
            if !s.info.has(FLAG_SEND_TRIM) {
                return Err(unsupported(&s.name, IoOp::Discard));
            }
            s.ranged(("trim", CMD_TRIM, 0), offset_bytes, len_bytes).await
        })
    }

    fn write_zeroes(&self, offset_bytes: u64, len_bytes: u64, flags: ZeroFlags) -> IoFuture<'_, io::Result<()>> {
        Box::pin(async move {
            let s = &self.shared;
            check_io(&s.name, &s.topo, IoOp::WriteZeroes, offset_bytes, len_bytes)?;
            if !s.info.has(FLAG_SEND_WRITE_ZEROES) {
                return Err(unsupported(&s.name, IoOp::WriteZeroes));
            }
            let native_fua = flags.fua && s.info.has(FLAG_SEND_FUA);
            let mut f = if flags.no_unmap { CMD_FLAG_NO_HOLE } else { 0 };
            if native_fua {
                f |= CMD_FLAG_FUA;
            }
            s.ranged(("write_zeroes", CMD_WRITE_ZEROES, f), offset_bytes, len_bytes).await?;
            if flags.fua && !native_fua {
                s.flush().await?;
            }
            Ok(())
        })
    }
}
