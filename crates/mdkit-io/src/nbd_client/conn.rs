//! One established connection in transmission phase: a writer task that sends requests in
//! the order they were queued (batched into one socket write while more are queued), a reader
//! task that matches replies to requests by cookie, and the table of requests in flight.
//!
//! A request's buffer and its slot of the in-flight bound live in the table, not in the
//! caller's future: a caller that gives up (drops its future, or times out) does not free a
//! buffer the reader may still be filling, and the slot is returned only when the server has
//! answered or the connection is gone.
//!
//! The connection closes on the first error (EOF, reset, protocol violation, a timed-out
//! request): every request still in the table completes with `Disconnected` (or `Timeout` for
//! the one that timed out), and `on_lost` is told once, so the device can reconnect.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot, watch};

use super::error::{NbdClientError, NbdErrorKind};
use super::handshake::ExportInfo;
use super::proto::*;
use crate::buf::{IoBuf, SharedBuf};

pub type ReadHalf = Box<dyn AsyncRead + Send + Unpin>;
pub type WriteHalf = Box<dyn AsyncWrite + Send + Unpin>;

/// A request queued for the writer.
pub struct Outgoing {
    header: [u8; REQUEST_HEADER_BYTES],
    payload: Option<SharedBuf>,
}

/// What the reader hands back to the caller.
pub struct Reply {
    /// The read buffer (reads only); `None` if it was lost with the connection.
    pub buf: Option<IoBuf>,
    pub result: Result<(), NbdClientError>,
}

struct Pending {
    op: &'static str,
    offset_bytes: u64,
    len_bytes: u32,
    buf: Option<IoBuf>,
    /// Bytes of a structured read covered so far.
    covered_bytes: u64,
    error: Option<NbdClientError>,
    tx: oneshot::Sender<Reply>,
    _slot: OwnedSemaphorePermit,
}

/// State shared by the connection's tasks and its callers.
pub struct ConnCore {
    target: String,
    info: ExportInfo,
    pending: Mutex<HashMap<u64, Pending>>,
    next_cookie: AtomicU64,
    slots: Arc<Semaphore>,
    /// `Some(reason)` once the connection is closing.
    closed: watch::Sender<Option<String>>,
}

impl ConnCore {
    fn err(&self, kind: NbdErrorKind, op: &'static str, detail: impl Into<String>) -> NbdClientError {
        NbdClientError::new(kind, &self.target, op, detail)
    }

    pub fn close_reason(&self) -> Option<String> {
        self.closed.borrow().clone()
    }

    /// Starts closing the connection (first reason wins).
    pub fn close(&self, reason: &str) {
        self.closed.send_if_modified(|r| {
            if r.is_some() {
                return false;
            }
            *r = Some(reason.to_string());
            true
        });
        self.slots.close();
    }

    /// Completes every request still in flight with `Disconnected`.
    fn fail_all(&self, reason: &str) {
        let drained: Vec<Pending> = self.pending.lock().drain().map(|(_, p)| p).collect();
        for p in drained {
            let e = self.err(NbdErrorKind::Disconnected, p.op, reason).at(p.offset_bytes);
            let _ = p.tx.send(Reply { buf: p.buf, result: Err(e) });
        }
    }
}

/// A connection handle; dropping the last one ends the writer (which sends `NBD_CMD_DISC`).
pub struct Conn {
    out: mpsc::Sender<Outgoing>,
    pub core: Arc<ConnCore>,
    pub id: u64,
}

impl Conn {
    /// Starts the tasks of an established connection. `on_lost` runs once when it closes.
    pub fn start(
        id: u64,
        target: &str,
        info: ExportInfo,
        max_in_flight: u32,
        (r, w): (ReadHalf, WriteHalf),
        on_lost: impl FnOnce(String) + Send + 'static,
    ) -> Conn {
        let n = max_in_flight.max(1) as usize;
        let (tx, rx) = mpsc::channel(n);
        let core = Arc::new(ConnCore {
            target: target.to_string(),
            info,
            pending: Mutex::new(HashMap::with_capacity(n)),
            next_cookie: AtomicU64::new(1),
            slots: Arc::new(Semaphore::new(n)),
            closed: watch::channel(None).0,
        });
        tokio::spawn(writer(core.clone(), BufWriter::with_capacity(256 << 10, w), rx));
        tokio::spawn(reader(core.clone(), BufReader::with_capacity(256 << 10, r), on_lost));
        Conn { out: tx, core, id }
    }

    /// Sends one request and waits for its reply (or the connection's end, or `timeout`).
    #[allow(clippy::too_many_arguments, reason = "one wire request: every field is needed")]
    pub async fn request(
        &self,
        op: &'static str,
        cmd: u16,
        flags: u16,
        offset_bytes: u64,
        len_bytes: u32,
        payload: Option<SharedBuf>,
        buf: Option<IoBuf>,
        timeout: std::time::Duration,
    ) -> Reply {
        let core = &self.core;
        let down = |buf, reason: Option<String>| Reply {
            buf,
            result: Err(core
                .err(NbdErrorKind::Disconnected, op, reason.unwrap_or_else(|| "connection closed".into()))
                .at(offset_bytes)),
        };
        let Ok(slot) = core.slots.clone().acquire_owned().await else {
            return down(buf, core.close_reason());
        };
        let cookie = core.next_cookie.fetch_add(1, Ordering::Relaxed);
        let (tx, mut rx) = oneshot::channel();
        let p = Pending { op, offset_bytes, len_bytes, buf, covered_bytes: 0, error: None, tx, _slot: slot };
        core.pending.lock().insert(cookie, p);
        let header = request_header(flags, cmd, cookie, offset_bytes, len_bytes);
        if core.close_reason().is_some() || self.out.send(Outgoing { header, payload }).await.is_err() {
            // Not sent: take the request back unless the closing side already completed it.
            if let Some(p) = core.pending.lock().remove(&cookie) {
                return down(p.buf, core.close_reason());
            }
        }
        match tokio::time::timeout(timeout, &mut rx).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(_)) => down(None, core.close_reason()),
            Err(_) => {
                let why = format!("no reply within {timeout:?}");
                core.close(&format!("{op} at byte {offset_bytes}: {why}"));
                let buf = rx.await.ok().and_then(|r| r.buf);
                Reply { buf, result: Err(core.err(NbdErrorKind::Timeout, op, why).at(offset_bytes)) }
            }
        }
    }
}

async fn writer(core: Arc<ConnCore>, mut w: BufWriter<WriteHalf>, mut rx: mpsc::Receiver<Outgoing>) {
    let mut closed = core.closed.subscribe();
    loop {
        let next = tokio::select! {
            m = rx.recv() => m,
            _ = closed.wait_for(Option::is_some) => break,
        };
        let Some(first) = next else {
            // Every handle is gone: a polite goodbye; the reader sees EOF.
            let disc = request_header(0, CMD_DISC, 0, 0, 0);
            let _ = w.write_all(&disc).await;
            let _ = w.flush().await;
            let _ = w.shutdown().await;
            core.close("closed by the client");
            break;
        };
        let mut batch = Some(first);
        let mut result = Ok(());
        while let Some(m) = batch.take() {
            result = send_one(&mut w, &m).await;
            if result.is_err() {
                break;
            }
            batch = rx.try_recv().ok();
        }
        if result.is_ok() {
            result = w.flush().await;
        }
        if let Err(e) = result {
            core.close(&format!("sending: {e}"));
            break;
        }
    }
}

async fn send_one(w: &mut BufWriter<WriteHalf>, m: &Outgoing) -> std::io::Result<()> {
    w.write_all(&m.header).await?;
    if let Some(p) = &m.payload {
        w.write_all(p.as_slice()).await?;
    }
    Ok(())
}

async fn reader(core: Arc<ConnCore>, mut r: BufReader<ReadHalf>, on_lost: impl FnOnce(String)) {
    let mut closed = core.closed.subscribe();
    let reason = tokio::select! {
        e = read_replies(&core, &mut r) => e,
        _ = closed.wait_for(Option::is_some) => String::new(),
    };
    core.close(&reason);
    let reason = core.close_reason().unwrap_or(reason);
    // The link is marked down (and the loss counted) before the requests in flight hear of it.
    on_lost(reason.clone());
    core.fail_all(&reason);
}

/// Reads replies until the connection fails; returns why.
async fn read_replies(core: &ConnCore, r: &mut BufReader<ReadHalf>) -> String {
    loop {
        let magic = match r.read_u32().await {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return "the server closed the connection".into();
            }
            Err(e) => return format!("receiving: {e}"),
        };
        let step = match magic {
            SIMPLE_REPLY_MAGIC => simple_reply(core, r).await,
            STRUCTURED_REPLY_MAGIC if core.info.structured_replies => structured_chunk(core, r).await,
            m => Err(format!("protocol error: reply magic {m:#010x}")),
        };
        if let Err(e) = step {
            return e;
        }
    }
}

fn io_err(e: std::io::Error) -> String {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        "the server closed the connection in the middle of a reply".into()
    } else {
        format!("receiving: {e}")
    }
}

fn take_pending(core: &ConnCore, cookie: u64) -> Result<Pending, String> {
    core.pending.lock().remove(&cookie).ok_or_else(|| format!("protocol error: reply for unknown cookie {cookie}"))
}

async fn simple_reply(core: &ConnCore, r: &mut BufReader<ReadHalf>) -> Result<(), String> {
    let errno = r.read_u32().await.map_err(io_err)?;
    let cookie = r.read_u64().await.map_err(io_err)?;
    let mut p = take_pending(core, cookie)?;
    if errno == 0 && p.op == "read" {
        let mut buf = p.buf.take().unwrap_or_else(|| IoBuf::zeroed(p.len_bytes as usize));
        let res = r.read_exact(buf.as_mut_slice()).await;
        p.buf = Some(buf);
        if let Err(e) = res {
            put_back(core, cookie, p);
            return Err(io_err(e));
        }
    }
    if errno == ESHUTDOWN {
        put_back(core, cookie, p);
        return Err(shutting_down(""));
    }
    let result = if errno == 0 { Ok(()) } else { Err(server_error(core, &p, errno, String::new())) };
    let _ = p.tx.send(Reply { buf: p.buf, result });
    Ok(())
}

/// ESHUTDOWN: the server is going away (the NBD spec asks the client to disconnect). The
/// caller leaves the request pending and closes the connection with this reason: every
/// request in flight fails as on a lost link (`Disconnected`), so a member comes back by
/// reconnecting instead of staying failed, and closing lets the server finish its shutdown.
fn shutting_down(msg: &str) -> String {
    let msg = if msg.is_empty() { String::new() } else { format!(": {msg}") };
    format!("the server is shutting down (ESHUTDOWN{msg})")
}

fn put_back(core: &ConnCore, cookie: u64, p: Pending) {
    core.pending.lock().insert(cookie, p);
}

fn server_error(core: &ConnCore, p: &Pending, errno: u32, msg: String) -> NbdClientError {
    core.err(NbdErrorKind::Server { errno }, p.op, msg).at(p.offset_bytes)
}

async fn structured_chunk(core: &ConnCore, r: &mut BufReader<ReadHalf>) -> Result<(), String> {
    let flags = r.read_u16().await.map_err(io_err)?;
    let kind = r.read_u16().await.map_err(io_err)?;
    let cookie = r.read_u64().await.map_err(io_err)?;
    let len = r.read_u32().await.map_err(io_err)?;
    // The entry stays in the table while its chunks arrive, so a connection that dies in
    // between still completes it.
    let mut p = take_pending(core, cookie)?;
    if u64::from(len) > u64::from(p.len_bytes) + 64 + u64::from(u16::MAX) {
        let why = format!("protocol error: {len}-byte chunk for a {}-byte request", p.len_bytes);
        put_back(core, cookie, p);
        return Err(why);
    }
    let res = chunk_body(core, r, &mut p, kind, len).await;
    match res {
        Err(e) => {
            put_back(core, cookie, p);
            Err(e)
        }
        Ok(()) if flags & REPLY_FLAG_DONE == 0 => {
            put_back(core, cookie, p);
            Ok(())
        }
        Ok(()) => {
            let result = match p.error.take() {
                Some(e) => Err(e),
                None if p.op == "read" && p.covered_bytes != u64::from(p.len_bytes) => {
                    return Err(format!(
                        "protocol error: read at byte {} of {} bytes answered with {} bytes",
                        p.offset_bytes, p.len_bytes, p.covered_bytes
                    ));
                }
                None => Ok(()),
            };
            let _ = p.tx.send(Reply { buf: p.buf, result });
            Ok(())
        }
    }
}

/// Reads one chunk's payload into the request `p`.
async fn chunk_body(
    core: &ConnCore,
    r: &mut BufReader<ReadHalf>,
    p: &mut Pending,
    kind: u16,
    len: u32,
) -> Result<(), String> {
    match kind {
        REPLY_TYPE_NONE if len == 0 => Ok(()),
        REPLY_TYPE_OFFSET_DATA | REPLY_TYPE_OFFSET_HOLE if p.op == "read" => {
            let off = r.read_u64().await.map_err(io_err)?;
            let n = if kind == REPLY_TYPE_OFFSET_DATA {
                u64::from(len.checked_sub(8).ok_or("protocol error: short OFFSET_DATA chunk")?)
            } else if len == 12 {
                u64::from(r.read_u32().await.map_err(io_err)?)
            } else {
                return Err(format!("protocol error: OFFSET_HOLE chunk of {len} bytes"));
            };
            let start =
                off.checked_sub(p.offset_bytes).filter(|s| s + n <= u64::from(p.len_bytes)).ok_or_else(|| {
                    format!("protocol error: chunk at byte {off} (+{n}) outside the read at byte {}", p.offset_bytes)
                })?;
            let mut buf = p.buf.take().unwrap_or_else(|| IoBuf::zeroed(p.len_bytes as usize));
            let range = start as usize..(start + n) as usize;
            let res = if kind == REPLY_TYPE_OFFSET_DATA {
                r.read_exact(&mut buf.as_mut_slice()[range]).await.map(|_| ())
            } else {
                buf.as_mut_slice()[range].fill(0);
                Ok(())
            };
            p.buf = Some(buf);
            res.map_err(io_err)?;
            p.covered_bytes += n;
            Ok(())
        }
        k if k & REPLY_TYPE_ERROR_BIT != 0 && len >= 6 => {
            let mut d = vec![0u8; len as usize];
            r.read_exact(&mut d).await.map_err(io_err)?;
            let errno = u32::from_be_bytes(d[0..4].try_into().expect("4 bytes"));
            let msg_len = usize::from(u16::from_be_bytes([d[4], d[5]]));
            let msg = d.get(6..6 + msg_len).map(|m| String::from_utf8_lossy(m).into_owned()).unwrap_or_default();
            if errno == ESHUTDOWN {
                return Err(shutting_down(&msg)); // the caller puts the request back
            }
            let mut e = core.err(NbdErrorKind::Server { errno }, p.op, msg).at(p.offset_bytes);
            if k == REPLY_TYPE_ERROR_OFFSET
                && let Some(o) = d.get(6 + msg_len..14 + msg_len)
            {
                e.offset_bytes = Some(u64::from_be_bytes(o.try_into().expect("8 bytes")));
            }
            p.error.get_or_insert(e);
            Ok(())
        }
        k => Err(format!("protocol error: unexpected chunk type {k} ({len} bytes) for a {}", p.op)),
    }
}
