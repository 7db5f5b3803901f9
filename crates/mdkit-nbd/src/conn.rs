//! The transmission phase of one connection.
//!
//! ```text
//!   socket ──► reader task ──(validate, read payload into IoBuf)──► one task per request
//!                                                                        │ device I/O
//!   socket ◄── writer task ◄──── bounded channel of replies ◄────────────┘
//! ```
//!
//! The reader parses and validates requests and spawns one task per request, so requests run
//! concurrently and complete in any order. Each reply goes into a bounded channel; the writer
//! takes every reply that is ready and sends them with one vectored write (headers from a small
//! inline array, read data straight from the device's buffer). Two limits bound a connection:
//! requests in flight (a semaphore) and payload bytes in flight (a second semaphore in 4 KiB
//! units). A permit is returned only once its reply has been written to the socket, so a client
//! that stops reading stalls only itself.

use std::io::{self, IoSlice};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use mdkit_io::{BlockDevice, IoBuf, SharedBuf, WriteFlags, ZeroFlags};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};

use crate::export::ExportState;
use crate::handshake::Negotiated;
use crate::proto::*;
use crate::reader::RequestReader;

/// Replies written per vectored write at most (two iovecs each, well under IOV_MAX).
const WRITE_BATCH_MAX: usize = 256;
/// Unit of the in-flight byte budget.
const BYTE_PERMIT_UNIT: u64 = 4096;
/// Longest error message sent in a structured error chunk.
const ERROR_MESSAGE_MAX_BYTES: usize = 1024;
/// Chunk used when zeroes have to be written as data.
const ZERO_CHUNK_BYTES: u64 = 1 << 20;

/// Per-connection limits, from [`crate::ServerOptions`].
#[derive(Clone, Copy, Debug)]
pub struct ConnLimits {
    pub max_in_flight_requests: usize,
    pub max_in_flight_bytes: usize,
    pub max_payload_bytes: u32,
}

/// Why the transmission phase ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Ending {
    /// NBD_CMD_DISC.
    Disconnect,
    /// Client closed the socket between requests.
    Eof,
    /// Server shutdown.
    Shutdown,
}

/// State shared by the reader and the request tasks of one connection.
struct Conn {
    export: Arc<ExportState>,
    structured: bool,
    block_size_committed: bool,
    /// Advertised minimum block (what a committed client aligns to).
    min_block_bytes: u64,
    max_payload_bytes: u32,
    size_bytes: u64,
    replies: mpsc::Sender<Reply>,
}

/// Held by a request until its reply has been written.
struct Permits {
    _request: OwnedSemaphorePermit,
    _bytes: Option<OwnedSemaphorePermit>,
}

/// A parsed, validated request handed to a request task.
struct Request {
    kind: u16,
    flags: u16,
    cookie: u64,
    offset_bytes: u64,
    len_bytes: u64,
    payload: Option<SharedBuf>,
}

//------------------------------------------------------------------------------------------------

pub async fn serve<R, W>(
    reader: R,
    writer: W,
    neg: Negotiated,
    limits: ConnLimits,
    mut shutdown: watch::Receiver<bool>,
    peer: &str,
) -> io::Result<Ending>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (tx, rx) = mpsc::channel::<Reply>(limits.max_in_flight_requests + 1);
    let requests = Arc::new(Semaphore::new(limits.max_in_flight_requests));
    let writer = AbortOnDrop(tokio::spawn(write_replies(writer, rx, requests.clone(), limits.max_in_flight_requests)));
    let topo = neg.export.topology();
    let bs = neg.export.block_sizes(limits.max_payload_bytes);
    let conn = Arc::new(Conn {
        structured: neg.structured,
        block_size_committed: neg.block_size_committed,
        min_block_bytes: u64::from(bs.min_bytes),
        max_payload_bytes: bs.max_payload_bytes,
        size_bytes: topo.size_bytes,
        export: neg.export,
        replies: tx,
    });
    let byte_units = (limits.max_in_flight_bytes as u64 / BYTE_PERMIT_UNIT).max(u64::from(bs.max_payload_bytes) / BYTE_PERMIT_UNIT + 2);
    let bytes = Arc::new(Semaphore::new(byte_units as usize));
    let mut rd = RequestReader::new(reader);

    let ending = loop {
        if *shutdown.borrow() {
            break Ok(Ending::Shutdown);
        }
        let header = tokio::select! {
            biased;
            _ = shutdown.changed() => break Ok(Ending::Shutdown),
            h = rd.read_header() => h,
        };
        let header = match header {
            Ok(Some(h)) => RequestHeader::parse(&h),
            Ok(None) => break Ok(Ending::Eof),
            Err(e) => break Err(e),
        };
        if header.magic != REQUEST_MAGIC {
            // Nothing after a bad magic can be trusted to be a request boundary.
            break Err(io::Error::new(io::ErrorKind::InvalidData, format!("bad request magic {:#x}", header.magic)));
        }
        let request_permit = requests.clone().acquire_owned().await.expect("semaphore is never closed");
        match admit(&conn, &mut rd, &header, &bytes, &mut shutdown).await {
            Ok(Admitted::Run(req, byte_permit)) => {
                let permits = Permits { _request: request_permit, _bytes: byte_permit };
                conn.export.stats.in_flight.fetch_add(1, Ordering::Relaxed);
                let conn = conn.clone();
                tokio::spawn(async move {
                    let reply = execute(&conn, req).await;
                    conn.export.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
                    // Fails only when the writer is gone (socket dead); nothing left to do then.
                    let _ = conn.replies.send(reply.with_permits(permits)).await;
                });
            }
            Ok(Admitted::Refused(reply)) => {
                conn.export.stats.errors.fetch_add(1, Ordering::Relaxed);
                let permits = Permits { _request: request_permit, _bytes: None };
                let _ = conn.replies.send(reply.with_permits(permits)).await;
            }
            Ok(Admitted::RefusedThenClose(reply, why)) => {
                conn.export.stats.errors.fetch_add(1, Ordering::Relaxed);
                let _ = conn.replies.send(reply).await;
                break Err(io::Error::new(io::ErrorKind::InvalidData, why));
            }
            Ok(Admitted::Disconnect) => break Ok(Ending::Disconnect),
            Ok(Admitted::Shutdown) => break Ok(Ending::Shutdown),
            Err(e) => break Err(e),
        }
    };
    if let Err(e) = &ending {
        tracing::warn!(peer, export = %conn.export.export.name, "closing connection: {e}");
    }
    // In-flight requests finish and their replies are written; the writer ends when the last
    // request task drops its handle on the channel.
    drop(conn);
    let written = writer.join().await;
    match (&ending, written) {
        (Ok(_), Err(e)) => Err(e),
        _ => ending,
    }
}

enum Admitted {
    Run(Request, Option<OwnedSemaphorePermit>),
    Refused(Reply),
    /// The stream cannot be resynchronised (e.g. a write payload over the limit): reply, close.
    RefusedThenClose(Reply, String),
    Disconnect,
    Shutdown,
}

/// Validates a request, reads (or skips) its payload, and decides what to do with it.
async fn admit<R: AsyncRead + Unpin>(
    conn: &Conn,
    rd: &mut RequestReader<R>,
    h: &RequestHeader,
    bytes: &Arc<Semaphore>,
    shutdown: &mut watch::Receiver<bool>,
) -> io::Result<Admitted> {
    let is_write = h.kind == CMD_WRITE;
    if is_write && h.len_bytes > conn.max_payload_bytes {
        let msg = format!(
            "WRITE of {} bytes exceeds the {}-byte maximum payload; closing the connection",
            h.len_bytes, conn.max_payload_bytes
        );
        let reply = Reply::error(h.cookie, EINVAL, &msg, conn.structured);
        return Ok(Admitted::RefusedThenClose(reply, msg));
    }
    if h.kind == CMD_DISC {
        return Ok(Admitted::Disconnect);
    }
    if let Err((errno, msg)) = validate(conn, h) {
        if is_write {
            read_cancellable(rd.discard(u64::from(h.len_bytes)), shutdown).await?;
        }
        tracing::debug!(export = %conn.export.export.name, "refused request: {msg}");
        return Ok(Admitted::Refused(Reply::error(h.cookie, errno, &msg, conn.structured)));
    }
    let byte_permit = if matches!(h.kind, CMD_READ | CMD_WRITE) {
        let units = u64::from(h.len_bytes).div_ceil(BYTE_PERMIT_UNIT).max(1) as u32;
        Some(bytes.clone().acquire_many_owned(units).await.expect("semaphore is never closed"))
    } else {
        None
    };
    let payload = if is_write {
        let mut buf = IoBuf::uninit_contents(h.len_bytes as usize);
        match read_cancellable(rd.read_payload(buf.as_mut_slice()), shutdown).await {
            Ok(()) => Some(buf.freeze()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(Admitted::Shutdown),
            Err(e) => return Err(e),
        }
    } else {
        None
    };
    let req = Request {
        kind: h.kind,
        flags: h.flags,
        cookie: h.cookie,
        offset_bytes: h.offset_bytes,
        len_bytes: u64::from(h.len_bytes),
        payload,
    };
    Ok(Admitted::Run(req, byte_permit))
}

/// Runs a payload read unless the server shuts down first (then `Interrupted`).
async fn read_cancellable<F: Future<Output = io::Result<()>>>(f: F, shutdown: &mut watch::Receiver<bool>) -> io::Result<()> {
    if *shutdown.borrow() {
        return Err(io::Error::new(io::ErrorKind::Interrupted, "server shutting down"));
    }
    tokio::select! {
        r = f => r,
        _ = shutdown.changed() => Err(io::Error::new(io::ErrorKind::Interrupted, "server shutting down")),
    }
}

/// Checks a request against the protocol and the export. Returns the error to reply with.
fn validate(conn: &Conn, h: &RequestHeader) -> Result<(), (u32, String)> {
    let name = command_name(h.kind);
    let allowed_flags = match h.kind {
        CMD_READ => CMD_FLAG_FUA | if conn.structured { CMD_FLAG_DF } else { 0 },
        CMD_WRITE | CMD_FLUSH | CMD_TRIM => CMD_FLAG_FUA,
        CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
        _ => return Err((EINVAL, format!("unsupported command type {} ({name})", h.kind))),
    };
    if h.flags & !allowed_flags != 0 {
        return Err((EINVAL, format!("command flags {:#x} are not valid for {name}", h.flags)));
    }
    let writes = matches!(h.kind, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    if writes && conn.export.export.read_only {
        return Err((EPERM, format!("{name} on read-only export {:?}", conn.export.export.name)));
    }
    let (off, len) = (h.offset_bytes, u64::from(h.len_bytes));
    if h.kind == CMD_FLUSH {
        if off != 0 || len != 0 {
            return Err((EINVAL, format!("FLUSH with offset {off} and length {len} (both must be 0)")));
        }
        return Ok(());
    }
    if len == 0 {
        return Err((EINVAL, format!("{name} of zero bytes at offset {off}")));
    }
    if h.kind == CMD_READ && h.len_bytes > conn.max_payload_bytes {
        let errno = if conn.structured { EOVERFLOW } else { EINVAL };
        return Err((errno, format!("READ of {len} bytes exceeds the {}-byte maximum payload", conn.max_payload_bytes)));
    }
    let in_bounds = off.checked_add(len).is_some_and(|end| end <= conn.size_bytes);
    if !in_bounds {
        let errno = if matches!(h.kind, CMD_WRITE | CMD_WRITE_ZEROES) { ENOSPC } else { EINVAL };
        return Err((errno, format!("{name} of {len} bytes at offset {off} is beyond the end of the export ({} bytes)", conn.size_bytes)));
    }
    if conn.block_size_committed && (off % conn.min_block_bytes != 0 || len % conn.min_block_bytes != 0) {
        return Err((
            EINVAL,
            format!("{name} of {len} bytes at offset {off} is not aligned to the negotiated {}-byte minimum block", conn.min_block_bytes),
        ));
    }
    Ok(())
}

//------------------------------------------------------------------------------------------------
// Request execution

async fn execute(conn: &Conn, req: Request) -> Reply {
    let stats = &conn.export.stats;
    let result = match req.kind {
        CMD_READ => match read(conn, req.offset_bytes, req.len_bytes).await {
            Ok(data) => {
                stats.reads.fetch_add(1, Ordering::Relaxed);
                stats.read_bytes.fetch_add(req.len_bytes, Ordering::Relaxed);
                return Reply::read_data(req.cookie, req.offset_bytes, data, conn.structured);
            }
            Err(e) => Err(e),
        },
        CMD_WRITE => {
            let payload = req.payload.expect("the reader attaches the payload of every WRITE");
            let r = write(conn, req.offset_bytes, payload, req.flags & CMD_FLAG_FUA != 0).await;
            if r.is_ok() {
                stats.writes.fetch_add(1, Ordering::Relaxed);
                stats.written_bytes.fetch_add(req.len_bytes, Ordering::Relaxed);
            }
            r
        }
        CMD_FLUSH => {
            let r = conn.export.export.device.flush().await.map_err(|e| (errno_from_io(&e), e.to_string()));
            if r.is_ok() {
                stats.flushes.fetch_add(1, Ordering::Relaxed);
            }
            r
        }
        CMD_TRIM => {
            let r = trim(conn, req.offset_bytes, req.len_bytes, req.flags & CMD_FLAG_FUA != 0).await;
            if r.is_ok() {
                stats.trims.fetch_add(1, Ordering::Relaxed);
            }
            r
        }
        CMD_WRITE_ZEROES => {
            let r = write_zeroes(conn, req.offset_bytes, req.len_bytes, req.flags).await;
            if r.is_ok() {
                stats.write_zeroes.fetch_add(1, Ordering::Relaxed);
            }
            r
        }
        _ => unreachable!("validate() admits only the commands handled above"),
    };
    match result {
        Ok(()) => Reply::ok(req.cookie),
        Err((errno, msg)) => {
            stats.errors.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(export = %conn.export.export.name, cookie = req.cookie, "request failed: {msg}");
            Reply::error(req.cookie, errno, &msg, conn.structured)
        }
    }
}

type OpResult<T> = Result<T, (u32, String)>;

fn io_err(e: io::Error) -> (u32, String) {
    (errno_from_io(&e), e.to_string())
}

/// The device-block-aligned span covering `[off, off + len)`.
fn aligned_span(off: u64, len: u64, block: u64) -> (u64, u64) {
    let start = off / block * block;
    let end = (off + len).div_ceil(block) * block;
    (start, end)
}

async fn read(conn: &Conn, off: u64, len: u64) -> OpResult<SharedBuf> {
    let dev = &conn.export.export.device;
    let block = conn.export.device_block_bytes();
    let (start, end) = aligned_span(off, len, block);
    let buf = read_device(dev.as_ref(), start, (end - start) as usize).await.map_err(io_err)?;
    let data = buf.freeze();
    if start == off && end - start == len {
        Ok(data)
    } else {
        let skip = (off - start) as usize;
        Ok(data.slice(skip..skip + len as usize))
    }
}

/// Reads `len` bytes at a device-aligned offset, split at the device's maximum I/O size.
async fn read_device(dev: &dyn BlockDevice, off: u64, len: usize) -> io::Result<IoBuf> {
    let max_io = dev.topology().max_io_bytes.max(4096) as usize;
    let mut rest = IoBuf::uninit_contents(len);
    if len <= max_io {
        let (buf, r) = dev.read(off, rest).await;
        return r.map(|()| buf);
    }
    let mut done: Option<IoBuf> = None;
    let mut pos = off;
    while !rest.is_empty() {
        let piece = rest.split_to(rest.len().min(max_io));
        let n = piece.len();
        let (piece, r) = dev.read(pos, piece).await;
        r?;
        pos += n as u64;
        match &mut done {
            None => done = Some(piece),
            Some(d) => {
                if let Err(piece) = d.unsplit(piece) {
                    // Cannot happen: pieces are consecutive views of one allocation.
                    return Err(io::Error::other(format!("{}: read buffer pieces out of order ({piece:?})", dev.name())));
                }
            }
        }
    }
    Ok(done.expect("len > max_io > 0, so at least one piece was read"))
}

async fn write_device(dev: &dyn BlockDevice, off: u64, data: SharedBuf, fua: bool) -> io::Result<()> {
    let max_io = dev.topology().max_io_bytes.max(4096) as usize;
    let flags = if fua { WriteFlags::FUA } else { WriteFlags::NONE };
    if data.len() <= max_io {
        return dev.write(off, data, flags).await;
    }
    let mut at = 0usize;
    while at < data.len() {
        let n = (data.len() - at).min(max_io);
        dev.write(off + at as u64, data.slice(at..at + n), flags).await?;
        at += n;
    }
    Ok(())
}

async fn write(conn: &Conn, off: u64, payload: SharedBuf, fua: bool) -> OpResult<()> {
    let dev = conn.export.export.device.as_ref();
    let block = conn.export.device_block_bytes();
    let len = payload.len() as u64;
    let (start, end) = aligned_span(off, len, block);
    if start == off && end == off + len {
        let _g = conn.export.gate.write(start..end).await;
        return write_device(dev, off, payload, fua).await.map_err(io_err);
    }
    // Read-modify-write of the covering blocks, exclusive against every other write to them.
    conn.export.stats.rmw_cycles.fetch_add(1, Ordering::Relaxed);
    let _g = conn.export.gate.rmw(start..end).await;
    let mut buf = read_device(dev, start, (end - start) as usize).await.map_err(io_err)?;
    let skip = (off - start) as usize;
    buf.as_mut_slice()[skip..skip + payload.len()].copy_from_slice(payload.as_slice());
    write_device(dev, start, buf.freeze(), fua).await.map_err(io_err)
}

async fn trim(conn: &Conn, off: u64, len: u64, fua: bool) -> OpResult<()> {
    let dev = conn.export.export.device.as_ref();
    if !dev.topology().supports_discard {
        // Not advertised, and advisory anyway: nothing to do.
        return Ok(());
    }
    let block = conn.export.device_block_bytes();
    // Trim is a hint: round inward rather than touching partial blocks.
    let start = off.div_ceil(block) * block;
    let end = (off + len) / block * block;
    if start < end {
        let _g = conn.export.gate.write(start..end).await;
        dev.discard(start, end - start).await.map_err(io_err)?;
    }
    if fua {
        dev.flush().await.map_err(io_err)?;
    }
    Ok(())
}

async fn write_zeroes(conn: &Conn, off: u64, len: u64, flags: u16) -> OpResult<()> {
    let dev = conn.export.export.device.as_ref();
    let topo = dev.topology();
    let block = conn.export.device_block_bytes();
    let fua = flags & CMD_FLAG_FUA != 0;
    let zflags = ZeroFlags { fua, no_unmap: flags & CMD_FLAG_NO_HOLE != 0 };
    let (start, end) = aligned_span(off, len, block);
    let aligned = start == off && end == off + len;
    if flags & CMD_FLAG_FAST_ZERO != 0 && !(aligned && topo.supports_write_zeroes) {
        // "Fast" means the device's native zeroing (hole punch / unmap / zero op) covers the
        // whole request; writing zero buffers or read-modify-write is not fast.
        return Err((ENOTSUP, format!("WRITE_ZEROES of {len} bytes at offset {off} cannot be done faster than a write")));
    }
    if aligned {
        let _g = conn.export.gate.write(start..end).await;
        return zero_aligned(dev, start, end - start, zflags).await.map_err(io_err);
    }
    conn.export.stats.rmw_cycles.fetch_add(1, Ordering::Relaxed);
    let _g = conn.export.gate.rmw(start..end).await;
    // Partial first and last blocks are patched; whole blocks between are zeroed natively.
    let req_end = off + len;
    if end - start == block {
        return zero_partial(dev, start, off, req_end, block, fua).await.map_err(io_err);
    }
    let mut mid_start = start;
    let mut mid_end = end;
    if off > start {
        zero_partial(dev, start, off, start + block, block, fua).await.map_err(io_err)?;
        mid_start = start + block;
    }
    if req_end < end {
        zero_partial(dev, end - block, end - block, req_end, block, fua).await.map_err(io_err)?;
        mid_end = end - block;
    }
    if mid_start < mid_end {
        zero_aligned(dev, mid_start, mid_end - mid_start, zflags).await.map_err(io_err)?;
    }
    Ok(())
}

/// Zeroes `[from, to)` inside the block at `block_start` by read-modify-write.
async fn zero_partial(dev: &dyn BlockDevice, block_start: u64, from: u64, to: u64, block: u64, fua: bool) -> io::Result<()> {
    if from >= to {
        return Ok(());
    }
    let mut buf = read_device(dev, block_start, block as usize).await?;
    let a = (from - block_start) as usize;
    let b = (to - block_start) as usize;
    buf.as_mut_slice()[a..b].fill(0);
    write_device(dev, block_start, buf.freeze(), fua).await
}

async fn zero_aligned(dev: &dyn BlockDevice, off: u64, len: u64, flags: ZeroFlags) -> io::Result<()> {
    if dev.topology().supports_write_zeroes {
        return dev.write_zeroes(off, len, flags).await;
    }
    let chunk = len.min(ZERO_CHUNK_BYTES);
    let zeroes = SharedBuf::zeroed(chunk as usize);
    let mut at = 0u64;
    while at < len {
        let n = (len - at).min(chunk);
        write_device(dev, off + at, zeroes.slice(0..n as usize), flags.fua).await?;
        at += n;
    }
    Ok(())
}

//------------------------------------------------------------------------------------------------
// Replies and the writer

/// Reply header bytes: inline for the fixed-size headers, on the heap for error messages.
enum Head {
    Inline { bytes: [u8; 28], len: u8 },
    Heap(Vec<u8>),
}

pub(crate) struct Reply {
    head: Head,
    data: Option<SharedBuf>,
    _permits: Option<Permits>,
}

impl Reply {
    fn inline(parts: &[&[u8]]) -> Reply {
        let mut bytes = [0u8; 28];
        let mut len = 0usize;
        for p in parts {
            bytes[len..len + p.len()].copy_from_slice(p);
            len += p.len();
        }
        Reply { head: Head::Inline { bytes, len: len as u8 }, data: None, _permits: None }
    }

    fn ok(cookie: u64) -> Reply {
        Reply::inline(&[&simple_reply(0, cookie)])
    }

    fn read_data(cookie: u64, offset_bytes: u64, data: SharedBuf, structured: bool) -> Reply {
        let mut r = if structured {
            let len = u32::try_from(data.len() + 8).expect("reads are bounded by the maximum payload");
            Reply::inline(&[&structured_header(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, cookie, len), &offset_bytes.to_be_bytes()])
        } else {
            Reply::inline(&[&simple_reply(0, cookie)])
        };
        r.data = Some(data);
        r
    }

    fn error(cookie: u64, errno: u32, msg: &str, structured: bool) -> Reply {
        debug_assert_ne!(errno, 0);
        if !structured {
            return Reply::inline(&[&simple_reply(errno, cookie)]);
        }
        let mut end = msg.len().min(ERROR_MESSAGE_MAX_BYTES);
        while !msg.is_char_boundary(end) {
            end -= 1;
        }
        let msg = &msg.as_bytes()[..end];
        let mut v = Vec::with_capacity(STRUCTURED_HEADER_BYTES + 6 + msg.len());
        v.extend_from_slice(&structured_header(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, cookie, 6 + msg.len() as u32));
        v.extend_from_slice(&errno.to_be_bytes());
        v.extend_from_slice(&(msg.len() as u16).to_be_bytes());
        v.extend_from_slice(msg);
        Reply { head: Head::Heap(v), data: None, _permits: None }
    }

    fn with_permits(mut self, p: Permits) -> Reply {
        self._permits = Some(p);
        self
    }

    fn head(&self) -> &[u8] {
        match &self.head {
            Head::Inline { bytes, len } => &bytes[..usize::from(*len)],
            Head::Heap(v) => v,
        }
    }
}

/// Drains the reply channel into the socket, batching every ready reply into one writev.
///
/// `requests` is the connection's in-flight semaphore (a permit is held from dispatch until
/// the reply is written), so `max - available - batch` is the number of requests whose replies
/// are still to come. When some are, the writer yields once before writing: request tasks that
/// were woken by the same completion batch then add their replies, and one `writev` carries
/// them all. Each `writev` on a TCP socket costs a loopback transmit and a wake-up of the
/// client, so fewer, larger writes are what makes QD32 cheap. With nothing else outstanding
/// (QD1) the reply goes out at once.
async fn write_replies<W: AsyncWrite + Unpin>(
    mut w: W,
    mut rx: mpsc::Receiver<Reply>,
    requests: Arc<Semaphore>,
    max_in_flight: usize,
) -> io::Result<()> {
    let mut batch: Vec<Reply> = Vec::with_capacity(WRITE_BATCH_MAX);
    loop {
        if rx.recv_many(&mut batch, WRITE_BATCH_MAX).await == 0 {
            break;
        }
        let outstanding = max_in_flight.saturating_sub(requests.available_permits());
        if outstanding > batch.len() && batch.len() < WRITE_BATCH_MAX {
            tokio::task::yield_now().await;
            while batch.len() < WRITE_BATCH_MAX {
                match rx.try_recv() {
                    Ok(r) => batch.push(r),
                    Err(_) => break,
                }
            }
        }
        write_batch(&mut w, &batch).await?;
        // Dropping the replies returns their permits: only now is the request finished.
        batch.clear();
    }
    w.flush().await?;
    // Closing our side tells the client we are done (after DISC or at shutdown).
    let _ = w.shutdown().await;
    Ok(())
}

async fn write_batch<W: AsyncWrite + Unpin>(w: &mut W, batch: &[Reply]) -> io::Result<()> {
    let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(batch.len() * 2);
    for r in batch {
        slices.push(IoSlice::new(r.head()));
        if let Some(d) = &r.data {
            slices.push(IoSlice::new(d.as_slice()));
        }
    }
    let mut rest: &mut [IoSlice<'_>] = &mut slices;
    while !rest.is_empty() {
        let n = w.write_vectored(rest).await?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "socket accepted no reply bytes"));
        }
        IoSlice::advance_slices(&mut rest, n);
    }
    Ok(())
}

/// Aborts the writer if the connection task itself is aborted (forced shutdown), so a client
/// that never reads cannot keep it alive.
struct AbortOnDrop(tokio::task::JoinHandle<io::Result<()>>);

impl AbortOnDrop {
    async fn join(mut self) -> io::Result<()> {
        let r = (&mut self.0).await;
        match r {
            Ok(r) => r,
            Err(e) => Err(io::Error::other(format!("reply writer task failed: {e}"))),
        }
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_span_covers_the_request() {
        assert_eq!(aligned_span(0, 4096, 512), (0, 4096));
        assert_eq!(aligned_span(1, 1, 512), (0, 512));
        assert_eq!(aligned_span(511, 2, 512), (0, 1024));
        assert_eq!(aligned_span(4095, 4098, 4096), (0, 12288));
    }

    #[test]
    fn error_reply_truncates_long_messages_on_char_boundaries() {
        let msg = "é".repeat(2000);
        let r = Reply::error(5, EIO, &msg, true);
        let h = r.head();
        let msg_len = u16::from_be_bytes([h[24], h[25]]) as usize;
        assert!(msg_len <= ERROR_MESSAGE_MAX_BYTES);
        assert!(std::str::from_utf8(&h[26..26 + msg_len]).is_ok());
        assert_eq!(u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize, 6 + msg_len);
        let s = Reply::error(5, EIO, "x", false);
        assert_eq!(s.head().len(), SIMPLE_REPLY_BYTES);
    }
}
