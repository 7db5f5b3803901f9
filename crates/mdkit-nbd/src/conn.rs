//! The transmission phase of one connection.
//!
//! ```text
//!            ┌───────────────────── one task per connection ─────────────────────┐
//!   socket ─►│ reader: every header the socket had, payloads into aligned IoBufs │
//!            │   └─► RequestSet: requests run as futures of this task            │
//!            │         └─► device I/O, submitted under one Plug per poll         │
//!   socket ◄─│ writer: every reply that became ready, in one writev              │
//!            └───────────────────────────────────────────────────────────────────┘
//! ```
//!
//! Requests run concurrently and complete in any order, but not as tasks of their own: the
//! connection task polls a request only when its waker fired ([`RequestSet`]). One poll of the
//! connection parses every request the last socket read brought in, starts them all, submits
//! their member I/O with one `io_uring_enter` per member (the poll runs under a
//! [`mdkit_io::Plug`]), and writes every reply that became ready with one `writev`. That keeps
//! the syscalls and wake-ups per request low: at queue depth 32 a batch of requests costs one
//! socket read, one submission and one socket write, and no request crosses a thread or a
//! channel. A connection's work runs on one thread; several connections (NBD multi-conn) spread
//! over the runtime's workers.
//!
//! Two limits bound a connection: requests in flight (parsed and not yet answered on the
//! socket) and payload bytes in flight (in 4 KiB units). When either is reached the reader stops
//! until replies have been written, so a client that stops reading stalls only itself. On top,
//! every READ/WRITE payload takes its bytes from the server-wide [`PayloadBudget`] before its
//! buffer is allocated (a WRITE announced but not sent costs nothing until then), and gives
//! them back with the per-connection bytes once its reply is on the socket. Requests
//! already started always run to completion, even when the connection ends early (bad input,
//! socket error, DISC, shutdown); their replies are written while the socket works.

use std::collections::VecDeque;
use std::future::{Future, poll_fn};
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use mdkit_io::{BlockDevice, IoBuf, SharedBuf, WriteFlags, ZeroFlags};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::watch;

use crate::block_status::{StatusRequest, block_status};
use crate::budget::{BUDGET_UNIT_BYTES, BudgetWaiter, PayloadBudget};
use crate::export::ExportState;
use crate::handshake::Negotiated;
use crate::latency::RequestClass;
use crate::meta_context::MetaContext;
use crate::proto::*;
use crate::reader::{PayloadProgress, RequestReader};
use crate::stall::StallWatch;
use crate::taskset::RequestSet;

/// Socket buffers handed to one vectored write at most (two per reply; IOV_MAX is 1024).
const WRITE_IOVECS_MAX: usize = 512;
/// Requests admitted plus replies collected per poll of the connection before it yields to
/// other tasks (fairness between connections on a worker).
const WORK_PER_POLL_MAX: usize = 512;
/// Longest error message sent in a structured error chunk.
const ERROR_MESSAGE_MAX_BYTES: usize = 1024;
/// Chunk used when zeroes have to be written as data.
const ZERO_CHUNK_BYTES: u64 = 1 << 20;

/// Per-connection limits, from [`crate::ServerOptions`], and the server-wide payload budget.
#[derive(Clone, Debug)]
pub struct ConnLimits {
    pub max_in_flight_requests: usize,
    pub max_in_flight_bytes: usize,
    pub max_payload_bytes: u32,
    pub budget: Arc<PayloadBudget>,
    /// A WRITE payload that receives no byte for this long ends the connection.
    pub payload_stall_timeout: Duration,
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

/// What the requests of one connection share (read-only).
struct Conn {
    export: Arc<ExportState>,
    structured: bool,
    block_size_committed: bool,
    /// Advertised minimum block (what a committed client aligns to).
    min_block_bytes: u64,
    max_payload_bytes: u32,
    size_bytes: u64,
    /// Meta contexts selected for this export (BLOCK_STATUS answers these).
    contexts: Vec<MetaContext>,
}

/// A parsed, validated request.
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
    shutdown: watch::Receiver<bool>,
    peer: &str,
) -> io::Result<Ending>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let topo = neg.export.topology();
    let bs = neg.export.block_sizes(limits.max_payload_bytes);
    let conn = Arc::new(Conn {
        structured: neg.structured,
        block_size_committed: neg.block_size_committed,
        min_block_bytes: u64::from(bs.min_bytes),
        max_payload_bytes: bs.max_payload_bytes,
        size_bytes: topo.size_bytes,
        contexts: neg.contexts,
        export: neg.export,
    });
    // Always room for one request of the largest payload, whatever the configured budget.
    let byte_units = (limits.max_in_flight_bytes as u64 / BUDGET_UNIT_BYTES)
        .max(u64::from(bs.max_payload_bytes) / BUDGET_UNIT_BYTES + 2);
    let max_requests = limits.max_in_flight_requests.max(1);
    let mut c = Connection {
        conn: conn.clone(),
        rd: RequestReader::new(reader),
        out: ReplyWriter::new(writer),
        running: RequestSet::new(max_requests),
        start: run_request,
        read_state: ReadState::Header,
        reading: true,
        ending: None,
        shutdown: Box::pin(shutdown_requested(shutdown)),
        max_requests,
        max_units: byte_units,
        requests_in_flight: 0,
        units_in_flight: 0,
        budget: BudgetWaiter::new(limits.budget),
        stall: StallWatch::new(limits.payload_stall_timeout),
        write_error: None,
        close_step: CloseStep::Flush,
    };
    // Every poll of the connection runs under a plug: the member I/O of all the requests it
    // starts goes to the kernel together (see `mdkit_io::plug`).
    let ending = mdkit_io::plugged(poll_fn(|cx| c.poll(cx))).await;
    if let Err(e) = &ending {
        tracing::warn!(peer, export = %conn.export.export.name, "closing connection: {e}");
    }
    ending
}

async fn shutdown_requested(mut rx: watch::Receiver<bool>) {
    loop {
        if *rx.borrow_and_update() {
            return;
        }
        if rx.changed().await.is_err() {
            // The server is gone without a shutdown: nothing will ever be signalled.
            std::future::pending::<()>().await;
        }
    }
}

async fn run_request(conn: Arc<Conn>, req: Request, units: u32) -> Reply {
    let mut reply = execute(&conn, req).await;
    reply.units = units;
    reply
}

/// Where the reader is inside the request stream. A request counts as in flight from its
/// header on (so `Budget`, `Payload` and `Discard` hold a slot).
enum ReadState {
    Header,
    /// Waiting for payload-byte budget (READ/WRITE).
    Budget {
        h: RequestHeader,
        units: u32,
    },
    /// Reading a WRITE payload.
    Payload {
        h: RequestHeader,
        units: u32,
        buf: IoBuf,
        progress: PayloadProgress,
    },
    /// Skipping the payload of a refused WRITE, then sending `reply`.
    Discard {
        left: u64,
        reply: Reply,
    },
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum CloseStep {
    Flush,
    Shutdown,
    Done,
}

/// What a write of replies released.
#[derive(Default)]
struct Written {
    requests: usize,
    units: u64,
}

struct Connection<R, W, F: Future<Output = Reply>> {
    conn: Arc<Conn>,
    rd: RequestReader<R>,
    out: ReplyWriter<W>,
    running: RequestSet<F>,
    /// Builds a request's future (`run_request`; a fn pointer so the set has one future type).
    start: fn(Arc<Conn>, Request, u32) -> F,
    read_state: ReadState,
    /// False once no more requests are read (DISC, EOF, bad input, shutdown, socket error).
    reading: bool,
    /// Why reading stopped.
    ending: Option<io::Result<Ending>>,
    shutdown: Pin<Box<dyn Future<Output = ()> + Send>>,
    max_requests: usize,
    max_units: u64,
    /// Requests parsed and not yet answered on the socket (≤ `max_requests`).
    requests_in_flight: usize,
    /// Payload budget held by those requests, in [`BUDGET_UNIT_BYTES`]s (≤ `max_units`); the
    /// same units are held in the server-wide budget.
    units_in_flight: u64,
    budget: BudgetWaiter,
    stall: StallWatch,
    /// The socket failed: replies are dropped from then on.
    write_error: Option<io::Error>,
    close_step: CloseStep,
}

impl<R, W, F> Connection<R, W, F>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
    F: Future<Output = Reply>,
{
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<Ending>> {
        let mut work = 0usize;
        loop {
            let mut progress = false;
            if self.reading && self.shutdown.as_mut().poll(cx).is_ready() {
                self.stop_reading(Ok(Ending::Shutdown));
            }
            // 1. Start every request that is already buffered (limits permitting).
            while self.reading && work < WORK_PER_POLL_MAX {
                if self.poll_admit(cx).is_pending() {
                    break;
                }
                progress = true;
                work += 1;
            }
            // 2. Poll the requests whose I/O made progress; collect their replies.
            while work < WORK_PER_POLL_MAX {
                let Poll::Ready(Some(reply)) = self.running.poll_next(cx) else { break };
                self.conn.export.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
                self.queue_reply(reply);
                progress = true;
                work += 1;
            }
            // 3. The member I/O started above goes to the kernel before the socket write, so
            //    the disk works while the replies are sent.
            mdkit_io::plug::flush();
            // 4. Send every reply that is ready, in as few writes as the socket allows.
            if self.write_error.is_none() && !self.out.is_empty() {
                match self.out.poll_write(cx) {
                    Poll::Ready(Ok(w)) => {
                        self.release(w);
                        progress = true;
                    }
                    Poll::Ready(Err(e)) => {
                        self.write_error = Some(e);
                        let dropped = self.out.drop_queued();
                        self.release(dropped);
                        self.stop_reading(Ok(Ending::Eof));
                        progress = true;
                    }
                    Poll::Pending => {}
                }
            }
            if !self.reading && self.running.is_empty() && self.out.is_empty() {
                return self.poll_close(cx);
            }
            if work >= WORK_PER_POLL_MAX {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            if !progress {
                return Poll::Pending;
            }
        }
    }

    /// Advances the reader by one step: a request started, a refusal queued or the end of
    /// reading. `Pending` while waiting for the socket or for a limit (the replies being
    /// written wake the task again).
    fn poll_admit(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            match std::mem::replace(&mut self.read_state, ReadState::Header) {
                ReadState::Header => {
                    if self.requests_in_flight >= self.max_requests {
                        return Poll::Pending;
                    }
                    let raw = match ready!(self.rd.poll_header(cx)) {
                        Ok(Some(raw)) => raw,
                        Ok(None) => return self.end_reading(Ok(Ending::Eof)),
                        Err(e) => return self.end_reading(Err(e)),
                    };
                    let h = RequestHeader::parse(&raw);
                    if let Some(next) = self.admit_header(h) {
                        self.read_state = next;
                        continue;
                    }
                    return Poll::Ready(());
                }
                ReadState::Budget { h, units } => {
                    if self.units_in_flight + u64::from(units) > self.max_units
                        || self.budget.poll_take(cx, u64::from(units)).is_pending()
                    {
                        self.read_state = ReadState::Budget { h, units };
                        return Poll::Pending;
                    }
                    // The buffer is allocated only now that the server-wide budget granted it.
                    self.units_in_flight += u64::from(units);
                    if h.kind == CMD_WRITE {
                        let buf = IoBuf::uninit_contents(h.len_bytes as usize);
                        self.stall.payload_started();
                        self.read_state = ReadState::Payload { h, units, buf, progress: PayloadProgress::default() };
                        continue;
                    }
                    self.dispatch(h, None, units);
                    return Poll::Ready(());
                }
                ReadState::Payload { h, units, mut buf, mut progress } => {
                    let r = self.rd.poll_payload(cx, buf.as_mut_slice(), &mut progress);
                    if r.is_pending() && self.stall.poll_stalled(cx, progress.filled) {
                        let e = io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!(
                                "WRITE of {} bytes at offset {}: no payload byte for {:?} ({} received); \
                                 closing the connection",
                                h.len_bytes,
                                h.offset_bytes,
                                self.stall.timeout(),
                                progress.filled
                            ),
                        );
                        self.read_state = ReadState::Payload { h, units, buf, progress };
                        return self.end_reading(Err(e));
                    }
                    self.read_state = ReadState::Payload { h, units, buf, progress };
                    match ready!(r) {
                        Ok(()) => {
                            let ReadState::Payload { h, units, buf, .. } =
                                std::mem::replace(&mut self.read_state, ReadState::Header)
                            else {
                                unreachable!("state set just above")
                            };
                            self.dispatch(h, Some(buf.freeze()), units);
                            return Poll::Ready(());
                        }
                        Err(e) => return self.end_reading(Err(e)),
                    }
                }
                ReadState::Discard { mut left, reply } => {
                    let r = self.rd.poll_discard(cx, &mut left);
                    self.read_state = ReadState::Discard { left, reply };
                    match ready!(r) {
                        Ok(()) => {
                            let ReadState::Discard { reply, .. } =
                                std::mem::replace(&mut self.read_state, ReadState::Header)
                            else {
                                unreachable!("state set just above")
                            };
                            self.queue_reply(reply);
                            return Poll::Ready(());
                        }
                        Err(e) => return self.end_reading(Err(e)),
                    }
                }
            }
        }
    }

    /// Decides what a freshly read header leads to. Returns the next reader state when the
    /// request needs more reading (budget, payload, discard); `None` when it was handled.
    fn admit_header(&mut self, h: RequestHeader) -> Option<ReadState> {
        let stats = &self.conn.export.stats;
        if h.magic != REQUEST_MAGIC {
            // Nothing after a bad magic can be trusted to be a request boundary.
            let e = io::Error::new(io::ErrorKind::InvalidData, format!("bad request magic {:#x}", h.magic));
            self.stop_reading(Err(e));
            return None;
        }
        let is_write = h.kind == CMD_WRITE;
        if is_write && h.len_bytes > self.conn.max_payload_bytes {
            // The stream cannot be resynchronised without reading the whole payload: reply, close.
            let msg = format!(
                "WRITE of {} bytes exceeds the {}-byte maximum payload; closing the connection",
                h.len_bytes, self.conn.max_payload_bytes
            );
            stats.errors.fetch_add(1, Ordering::Relaxed);
            self.requests_in_flight += 1;
            self.queue_reply(Reply::error(h.cookie, EINVAL, &msg, self.conn.structured));
            self.stop_reading(Err(io::Error::new(io::ErrorKind::InvalidData, msg)));
            return None;
        }
        if h.kind == CMD_DISC {
            self.stop_reading(Ok(Ending::Disconnect));
            return None;
        }
        self.requests_in_flight += 1;
        if let Err((errno, msg)) = validate(&self.conn, &h) {
            stats.errors.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(export = %self.conn.export.export.name, "refused request: {msg}");
            let reply = Reply::error(h.cookie, errno, &msg, self.conn.structured);
            if is_write {
                return Some(ReadState::Discard { left: u64::from(h.len_bytes), reply });
            }
            self.queue_reply(reply);
            return None;
        }
        if matches!(h.kind, CMD_READ | CMD_WRITE) {
            let units = u64::from(h.len_bytes).div_ceil(BUDGET_UNIT_BYTES).max(1) as u32;
            return Some(ReadState::Budget { h, units });
        }
        self.dispatch(h, None, 0);
        None
    }

    fn dispatch(&mut self, h: RequestHeader, payload: Option<SharedBuf>, units: u32) {
        let req = Request {
            kind: h.kind,
            flags: h.flags,
            cookie: h.cookie,
            offset_bytes: h.offset_bytes,
            len_bytes: u64::from(h.len_bytes),
            payload,
        };
        self.conn.export.stats.in_flight.fetch_add(1, Ordering::Relaxed);
        let future = (self.start)(self.conn.clone(), req, units);
        let pushed = self.running.push(future);
        // Invariant: running ≤ requests_in_flight ≤ max_requests = the set's capacity.
        assert!(pushed.is_ok(), "request set full with {} requests in flight", self.requests_in_flight);
    }

    fn queue_reply(&mut self, reply: Reply) {
        if self.write_error.is_some() {
            // Nobody will read it: the request is finished as far as the limits go.
            self.release(Written { requests: 1, units: u64::from(reply.units) });
        } else {
            self.out.push(reply);
        }
    }

    fn release(&mut self, w: Written) {
        debug_assert!(w.requests <= self.requests_in_flight && w.units <= self.units_in_flight);
        self.requests_in_flight -= w.requests;
        self.units_in_flight -= w.units;
        self.budget.budget().give_back(w.units);
    }

    fn end_reading(&mut self, ending: io::Result<Ending>) -> Poll<()> {
        self.stop_reading(ending);
        Poll::Ready(())
    }

    /// Stops reading requests; a request half read (its slot and budget taken) is dropped.
    fn stop_reading(&mut self, ending: io::Result<Ending>) {
        if !self.reading {
            return;
        }
        self.reading = false;
        self.ending = Some(ending);
        match std::mem::replace(&mut self.read_state, ReadState::Header) {
            ReadState::Header => {}
            ReadState::Budget { .. } => {
                self.requests_in_flight -= 1;
                self.budget.stop_waiting();
            }
            ReadState::Discard { .. } => self.requests_in_flight -= 1,
            ReadState::Payload { units, .. } => {
                self.release(Written { requests: 1, units: u64::from(units) });
            }
        }
    }

    /// Everything answered: flush and close our side of the socket, then report the ending.
    fn poll_close(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<Ending>> {
        debug_assert_eq!((self.requests_in_flight, self.units_in_flight), (0, 0));
        if self.write_error.is_none() && self.close_step == CloseStep::Flush {
            if let Err(e) = ready!(self.out.poll_flush(cx)) {
                self.write_error = Some(e);
            }
            self.close_step = CloseStep::Shutdown;
        }
        if self.write_error.is_none() && self.close_step == CloseStep::Shutdown {
            // Closing our side tells the client we are done (after DISC or at shutdown).
            let _ = ready!(self.out.poll_shutdown(cx));
        }
        self.close_step = CloseStep::Done;
        let ending = self.ending.take().unwrap_or(Ok(Ending::Eof));
        Poll::Ready(match (ending, self.write_error.take()) {
            (Ok(_), Some(e)) => Err(e),
            (ending, _) => ending,
        })
    }
}

impl<R, W, F: Future<Output = Reply>> Drop for Connection<R, W, F> {
    fn drop(&mut self) {
        // A connection cut mid-way (task aborted at the end of the shutdown grace) still
        // returns what its requests held to the server-wide budget.
        self.budget.budget().give_back(self.units_in_flight);
    }
}

//------------------------------------------------------------------------------------------------

/// Checks a request against the protocol and the export. Returns the error to reply with.
fn validate(conn: &Conn, h: &RequestHeader) -> Result<(), (u32, String)> {
    let name = command_name(h.kind);
    let allowed_flags = match h.kind {
        CMD_READ => CMD_FLAG_FUA | if conn.structured { CMD_FLAG_DF } else { 0 },
        CMD_WRITE | CMD_FLUSH | CMD_TRIM => CMD_FLAG_FUA,
        CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
        CMD_BLOCK_STATUS => CMD_FLAG_REQ_ONE,
        _ => return Err((EINVAL, format!("unsupported command type {} ({name})", h.kind))),
    };
    if h.flags & !allowed_flags != 0 {
        return Err((EINVAL, format!("command flags {:#x} are not valid for {name}", h.flags)));
    }
    if h.kind == CMD_BLOCK_STATUS && conn.contexts.is_empty() {
        return Err((
            EINVAL,
            format!(
                "BLOCK_STATUS without a meta context: NBD_OPT_SET_META_CONTEXT must select one for export {:?} \
                 before it is opened",
                conn.export.export.name
            ),
        ));
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
        return Err((
            errno,
            format!("READ of {len} bytes exceeds the {}-byte maximum payload", conn.max_payload_bytes),
        ));
    }
    let in_bounds = off.checked_add(len).is_some_and(|end| end <= conn.size_bytes);
    if !in_bounds {
        let errno = if matches!(h.kind, CMD_WRITE | CMD_WRITE_ZEROES) { ENOSPC } else { EINVAL };
        return Err((
            errno,
            format!(
                "{name} of {len} bytes at offset {off} is beyond the end of the export ({} bytes)",
                conn.size_bytes
            ),
        ));
    }
    if conn.block_size_committed && (off % conn.min_block_bytes != 0 || len % conn.min_block_bytes != 0) {
        return Err((
            EINVAL,
            format!(
                "{name} of {len} bytes at offset {off} is not aligned to the negotiated {}-byte minimum block",
                conn.min_block_bytes
            ),
        ));
    }
    Ok(())
}

//------------------------------------------------------------------------------------------------
// Request execution

async fn execute(conn: &Conn, req: Request) -> Reply {
    let started = std::time::Instant::now();
    let class = match req.kind {
        CMD_READ => RequestClass::Read,
        CMD_WRITE => RequestClass::Write,
        CMD_FLUSH => RequestClass::Flush,
        _ => RequestClass::Other,
    };
    let reply = execute_timed(conn, req).await;
    conn.export.stats.latency.histogram(class).record(started.elapsed());
    reply
}

async fn execute_timed(conn: &Conn, req: Request) -> Reply {
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
        CMD_BLOCK_STATUS => {
            let sr = StatusRequest {
                cookie: req.cookie,
                offset_bytes: req.offset_bytes,
                len_bytes: req.len_bytes,
                flags: req.flags,
            };
            match block_status(&conn.export, &conn.contexts, sr).await {
                Ok(chunks) => {
                    stats.block_status.fetch_add(1, Ordering::Relaxed);
                    return Reply::chunks(chunks);
                }
                Err(e) => Err(e),
            }
        }
        _ => unreachable!("validate() admits only the commands handled above"),
    };
    match result {
        Ok(()) => Reply::ok(req.cookie),
        Err((errno, msg)) => {
            stats.errors.fetch_add(1, Ordering::Relaxed);
            let command = command_name(req.kind);
            let name = &conn.export.export.name;
            conn.export.failures.failed(name, command, req.offset_bytes, req.len_bytes, errno, &msg);
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
                    return Err(io::Error::other(format!(
                        "{}: read buffer pieces out of order ({piece:?})",
                        dev.name()
                    )));
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
        return Err((
            ENOTSUP,
            format!("WRITE_ZEROES of {len} bytes at offset {off} cannot be done faster than a write"),
        ));
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
async fn zero_partial(
    dev: &dyn BlockDevice,
    block_start: u64,
    from: u64,
    to: u64,
    block: u64,
    fua: bool,
) -> io::Result<()> {
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
    /// Payload budget the request held, returned once the reply is on the socket.
    units: u32,
}

impl Reply {
    fn inline(parts: &[&[u8]]) -> Reply {
        let mut bytes = [0u8; 28];
        let mut len = 0usize;
        for p in parts {
            bytes[len..len + p.len()].copy_from_slice(p);
            len += p.len();
        }
        Reply { head: Head::Inline { bytes, len: len as u8 }, data: None, units: 0 }
    }

    /// Structured reply chunks already encoded (BLOCK_STATUS).
    fn chunks(bytes: Vec<u8>) -> Reply {
        Reply { head: Head::Heap(bytes), data: None, units: 0 }
    }

    fn ok(cookie: u64) -> Reply {
        Reply::inline(&[&simple_reply(0, cookie)])
    }

    fn read_data(cookie: u64, offset_bytes: u64, data: SharedBuf, structured: bool) -> Reply {
        let mut r = if structured {
            let len = u32::try_from(data.len() + 8).expect("reads are bounded by the maximum payload");
            Reply::inline(&[
                &structured_header(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, cookie, len),
                &offset_bytes.to_be_bytes(),
            ])
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
        Reply { head: Head::Heap(v), data: None, units: 0 }
    }

    fn head(&self) -> &[u8] {
        match &self.head {
            Head::Inline { bytes, len } => &bytes[..usize::from(*len)],
            Head::Heap(v) => v,
        }
    }

    fn data(&self) -> &[u8] {
        self.data.as_ref().map_or(&[], |d| d.as_slice())
    }

    fn len_bytes(&self) -> usize {
        self.head().len() + self.data().len()
    }
}

/// The socket's sending side and the replies waiting for it. Replies go out in the order they
/// became ready; every call writes as many as the socket takes, with vectored writes (headers
/// from the replies' inline arrays, read data straight from the device's buffers).
struct ReplyWriter<W> {
    w: W,
    queue: VecDeque<Reply>,
    /// Bytes of `queue.front()` already written (a partial write).
    front_sent_bytes: usize,
}

impl<W: AsyncWrite + Unpin> ReplyWriter<W> {
    fn new(w: W) -> ReplyWriter<W> {
        ReplyWriter { w, queue: VecDeque::new(), front_sent_bytes: 0 }
    }

    fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    fn push(&mut self, reply: Reply) {
        self.queue.push_back(reply);
    }

    /// Writes queued replies until the queue is empty or the socket is full. `Ready` when
    /// something was written (with what finished), `Pending` when nothing could be.
    fn poll_write(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<Written>> {
        let mut done = Written::default();
        let mut wrote_any = false;
        while !self.queue.is_empty() {
            let r = {
                let mut iov = [IoSlice::new(&[]); WRITE_IOVECS_MAX];
                let mut count = 0;
                let mut skip = self.front_sent_bytes;
                'replies: for reply in &self.queue {
                    for part in [reply.head(), reply.data()] {
                        if skip >= part.len() {
                            skip -= part.len();
                            continue;
                        }
                        iov[count] = IoSlice::new(&part[skip..]);
                        skip = 0;
                        count += 1;
                        if count == WRITE_IOVECS_MAX {
                            break 'replies;
                        }
                    }
                }
                Pin::new(&mut self.w).poll_write_vectored(cx, &iov[..count])
            };
            match r {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::WriteZero,
                        "socket accepted no reply bytes",
                    )));
                }
                Poll::Ready(Ok(n)) => {
                    wrote_any = true;
                    self.advance(n, &mut done);
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending if wrote_any => break,
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(done))
    }

    /// Accounts `n` written bytes: finished replies leave the queue (dropping a reply returns
    /// its buffer to the pool).
    fn advance(&mut self, mut n: usize, done: &mut Written) {
        while n > 0 {
            let Some(front) = self.queue.front() else {
                debug_assert!(false, "socket took more bytes than were queued");
                return;
            };
            let left = front.len_bytes() - self.front_sent_bytes;
            if n < left {
                self.front_sent_bytes += n;
                return;
            }
            n -= left;
            self.front_sent_bytes = 0;
            if let Some(r) = self.queue.pop_front() {
                done.requests += 1;
                done.units += u64::from(r.units);
            }
        }
    }

    /// Drops every queued reply (the socket failed); returns what they held.
    fn drop_queued(&mut self) -> Written {
        let mut w = Written::default();
        for r in self.queue.drain(..) {
            w.requests += 1;
            w.units += u64::from(r.units);
        }
        self.front_sent_bytes = 0;
        w
    }

    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.w).poll_flush(cx)
    }

    fn poll_shutdown(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.w).poll_shutdown(cx)
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
