//! Entry points for the fuzz targets in `fuzz/` (and their seed corpus): the server's real
//! handshake and request-stream code, fed from a byte string instead of a socket. Replies go
//! to a counting sink. Nothing here may panic, hang or allocate from a size the input chose
//! beyond the server's limits; that is what the fuzzers check.
//!
//! Built for speed (the campaign runs 10^7 inputs per target on two cores): the servers (one
//! writable, one read-only, each with a RAM export) and the current-thread runtime are made
//! once per thread and serve every input.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use tokio::io::AsyncWrite;
use tokio::sync::watch;

use crate::budget::PayloadBudget;
use crate::conn::{self, ConnLimits};
use crate::handshake::{self, Negotiated};
use crate::meta_context::{MetaContext, encode_meta_request};
use crate::proto::*;
use crate::{Export, NbdServer, ServerOptions};

/// Size of the fuzzed export (small: every request is cheap).
pub const EXPORT_BYTES: u64 = 1 << 20;
/// Largest payload the fuzzed server accepts (small: no input makes it allocate much).
pub const MAX_PAYLOAD_BYTES: u32 = 256 << 10;

/// What one run did.
#[derive(Debug, PartialEq, Eq)]
pub struct Outcome {
    /// The handshake reached transmission (handshake target) / the stream ended cleanly
    /// (requests target).
    pub completed: bool,
    /// Bytes the server sent.
    pub reply_bytes: usize,
}

/// Runs the handshake over `client_bytes` (everything the client sends, from its flags on).
pub fn handshake(client_bytes: &[u8]) -> Outcome {
    let server = server(false);
    let sent = Arc::new(AtomicUsize::new(0));
    let mut stream = tokio::io::join(client_bytes, CountingSink(sent.clone()));
    let r = runtime().block_on(handshake::negotiate(&mut stream, server.shared(), "fuzz", 0));
    Outcome { completed: matches!(r, Ok(Some(_))), reply_bytes: sent.load(Ordering::Relaxed) }
}

/// Runs the transmission phase over `stream`. The first byte picks the negotiated state:
/// bit 0 structured replies, bit 1 block sizes committed, bit 2 read-only export, bit 3
/// `base:allocation` selected (with structured replies; BLOCK_STATUS is refused without).
pub fn requests(stream: &[u8]) -> Outcome {
    let (&mode, rest) = stream.split_first().unwrap_or((&0, &[]));
    let server = server(mode & 4 != 0);
    let export = server.shared().find_export("").expect("the fuzz server has a default export");
    let structured = mode & 1 != 0;
    let flags = export.transmission_flags(structured);
    let contexts = if structured && mode & 8 != 0 { vec![MetaContext::Allocation] } else { Vec::new() };
    let neg = Negotiated { export, structured, block_size_committed: mode & 2 != 0, flags, contexts };
    let limits = ConnLimits {
        max_in_flight_requests: 16,
        max_in_flight_bytes: 1 << 20,
        max_payload_bytes: MAX_PAYLOAD_BYTES,
        budget: Arc::new(PayloadBudget::new(2 << 20, MAX_PAYLOAD_BYTES)),
        payload_stall_timeout: std::time::Duration::from_secs(30),
    };
    let (_shutdown_tx, shutdown_rx) = watch::channel(false);
    let sent = Arc::new(AtomicUsize::new(0));
    let reader = io::Cursor::new(rest.to_vec());
    let r = runtime().block_on(conn::serve(reader, CountingSink(sent.clone()), neg, limits, shutdown_rx, "fuzz"));
    Outcome { completed: r.is_ok(), reply_bytes: sent.load(Ordering::Relaxed) }
}

/// This thread's fuzzed server: writable or read-only export `d` (the default export).
fn server(read_only: bool) -> &'static NbdServer {
    thread_local! {
        static SERVERS: [&'static NbdServer; 2] =
            [false, true].map(|ro| &*Box::leak(Box::new(new_server(ro))));
    }
    SERVERS.with(|s| s[usize::from(read_only)])
}

fn new_server(read_only: bool) -> NbdServer {
    let options = ServerOptions { max_payload_bytes: MAX_PAYLOAD_BYTES, ..ServerOptions::default() };
    let server = NbdServer::new(options);
    let device = Arc::new(mdkit_io::MemDevice::new("fuzz", EXPORT_BYTES));
    let export = Export { name: "d".into(), description: "fuzzed".into(), device, read_only };
    server.add_export(export).expect("a fresh server takes its first export");
    server.set_default_export(Some("d".into()));
    server
}

fn runtime() -> &'static tokio::runtime::Runtime {
    thread_local! {
        static RT: &'static tokio::runtime::Runtime = Box::leak(Box::new(
            tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a current-thread runtime"),
        ));
    }
    RT.with(|rt| *rt)
}

/// A socket's sending side that takes everything and counts it.
struct CountingSink(Arc<AtomicUsize>);

impl AsyncWrite for CountingSink {
    fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.0.fetch_add(buf.len(), Ordering::Relaxed);
        Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

//------------------------------------------------------------------------------------------------
// Seeds (fuzz/corpus/*): well-formed client streams the fuzzers start from.

fn option(out: &mut Vec<u8>, option: u32, data: &[u8]) {
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

fn info_request(name: &[u8], infos: &[u16]) -> Vec<u8> {
    let mut v = (name.len() as u32).to_be_bytes().to_vec();
    v.extend_from_slice(name);
    v.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for i in infos {
        v.extend_from_slice(&i.to_be_bytes());
    }
    v
}

/// Client handshakes: GO with block sizes after structured replies and LIST; INFO then
/// EXPORT_NAME; ABORT.
pub fn seed_handshakes() -> Vec<Vec<u8>> {
    let flags = (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes();
    let mut go = flags.to_vec();
    option(&mut go, OPT_STRUCTURED_REPLY, &[]);
    option(&mut go, OPT_LIST, &[]);
    option(&mut go, OPT_GO, &info_request(b"d", &[INFO_BLOCK_SIZE, INFO_NAME, INFO_DESCRIPTION]));
    let mut export_name = FLAG_C_FIXED_NEWSTYLE.to_be_bytes().to_vec();
    option(&mut export_name, OPT_INFO, &info_request(b"", &[]));
    option(&mut export_name, OPT_EXPORT_NAME, b"d");
    let mut abort = flags.to_vec();
    option(&mut abort, 99, b"unknown");
    option(&mut abort, OPT_ABORT, &[]);
    // Meta contexts: LIST everything, SET allocation (plus an unknown and a changed-since
    // query the export cannot answer), then GO.
    let mut meta = flags.to_vec();
    option(&mut meta, OPT_STRUCTURED_REPLY, &[]);
    option(&mut meta, OPT_LIST_META_CONTEXT, &encode_meta_request("d", &[]));
    let queries = ["base:allocation", "x-other:thing", "x-mdkit:changed-since:1"];
    option(&mut meta, OPT_SET_META_CONTEXT, &encode_meta_request("d", &queries));
    option(&mut meta, OPT_GO, &info_request(b"d", &[]));
    vec![go, export_name, abort, meta]
}

fn request(out: &mut Vec<u8>, kind: u16, flags: u16, offset_bytes: u64, len_bytes: u32) {
    out.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&kind.to_be_bytes());
    out.extend_from_slice(&(out.len() as u64).to_be_bytes());
    out.extend_from_slice(&offset_bytes.to_be_bytes());
    out.extend_from_slice(&len_bytes.to_be_bytes());
}

/// Request streams (first byte: the mode of [`requests`]): aligned write, read, flush, DISC;
/// an unaligned write, trim and write-zeroes with structured replies.
pub fn seed_requests() -> Vec<Vec<u8>> {
    let mut plain = vec![0u8];
    request(&mut plain, CMD_WRITE, CMD_FLAG_FUA, 4096, 4096);
    plain.extend(std::iter::repeat_n(0x5a, 4096));
    request(&mut plain, CMD_READ, 0, 4096, 4096);
    request(&mut plain, CMD_FLUSH, 0, 0, 0);
    request(&mut plain, CMD_DISC, 0, 0, 0);
    let mut structured = vec![1u8];
    request(&mut structured, CMD_WRITE, 0, 1000, 100);
    structured.extend(std::iter::repeat_n(0xa5, 100));
    request(&mut structured, CMD_TRIM, 0, 0, 8192);
    request(&mut structured, CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 512, 3000);
    request(&mut structured, CMD_READ, CMD_FLAG_DF, 0, 65536);
    // Block status with `base:allocation` selected: whole export, REQ_ONE, past the end.
    let mut status = vec![1u8 | 8];
    request(&mut status, CMD_WRITE, 0, 8192, 4096);
    status.extend(std::iter::repeat_n(0x11, 4096));
    request(&mut status, CMD_BLOCK_STATUS, 0, 0, EXPORT_BYTES as u32);
    request(&mut status, CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 4096, 65536);
    request(&mut status, CMD_BLOCK_STATUS, 0, EXPORT_BYTES - 512, 1024);
    vec![plain, structured, status]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_handshakes_negotiate_or_abort() {
        let seeds = seed_handshakes();
        let outcomes: Vec<bool> = seeds.iter().map(|s| handshake(s).completed).collect();
        assert_eq!(outcomes, [true, true, false, true]);
        assert!(handshake(&seeds[2]).reply_bytes > 18, "unknown option and ABORT are answered");
        // Truncated anywhere: never completes, never panics.
        for cut in 0..seeds[0].len() {
            assert!(!handshake(&seeds[0][..cut]).completed, "cut at {cut}");
        }
    }

    /// Regenerates the committed seed corpus: `cargo test -p mdkit-nbd --lib write_seed_corpus
    /// -- --ignored`.
    #[test]
    #[ignore = "writes fuzz/corpus; run by hand when the seeds change"]
    fn write_seed_corpus() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
        for (target, seeds) in [("nbd_handshake", seed_handshakes()), ("nbd_requests", seed_requests())] {
            let dir = root.join(target);
            std::fs::create_dir_all(&dir).unwrap();
            for (i, seed) in seeds.iter().enumerate() {
                std::fs::write(dir.join(format!("seed-{i}")), seed).unwrap();
            }
        }
    }

    #[test]
    fn seed_requests_are_answered() {
        let seeds = seed_requests();
        let plain = requests(&seeds[0]);
        // WRITE, READ (+4096 data), FLUSH: three simple replies, then DISC ends cleanly.
        assert_eq!(plain, Outcome { completed: true, reply_bytes: 3 * SIMPLE_REPLY_BYTES + 4096 });
        let structured = requests(&seeds[1]);
        assert!(structured.completed);
        assert!(structured.reply_bytes > 65536, "{structured:?}");
        // WRITE (16), status of the whole export: hole, 4 KiB data, hole (20 + 4 + 3 × 8),
        // REQ_ONE: one hole (20 + 4 + 8), past the end: an error chunk (20 + 6 + message).
        let status = requests(&seeds[2]);
        assert!(status.completed);
        assert!(status.reply_bytes > 16 + 48 + 32 + 26, "{status:?}");
        // The same stream without a selected context: three error chunks instead.
        let mut unselected = seeds[2].clone();
        unselected[0] = 1;
        assert!(requests(&unselected).reply_bytes != status.reply_bytes);
        // A header announcing the largest payload, then nothing: ends without a reply.
        let mut stalled = vec![0u8];
        request(&mut stalled, CMD_WRITE, 0, 0, MAX_PAYLOAD_BYTES);
        assert_eq!(requests(&stalled), Outcome { completed: false, reply_bytes: 0 });
    }
}
