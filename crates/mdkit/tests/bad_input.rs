//! Malformed and hostile NBD input against the real `mdkit serve`, with a raw client that
//! writes protocol bytes by hand. Every case checks the documented reply (the "Replies to bad
//! input" table of crates/mdkit-nbd/README.md), and throughout, a healthy client on another
//! connection keeps writing and verifying its own data, and a "victim" range that bad requests
//! aim at must stay unchanged.

use crate::common;

use std::net::Shutdown;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;

use common::raw::*;
use common::{Server, pattern};

const SIZE: u64 = 16 << 20;
const VICTIM: u64 = 1 << 20;
const VICTIM_LEN: usize = 64 << 10;
const SCRATCH: u64 = 4 << 20;
const HEALTHY: u64 = 8 << 20;

const CONFIG: &str = r#"
[[volume]]
name = "vol0"
kind = "file"
path = "vol0.img"
size = "16MiB"
[[export]]
name = "default"
volume = "vol0"
[[export]]
name = "ro"
volume = "vol0"
read_only = true
"#;

/// Writes and verifies its own range in a loop on its own connection until told to stop.
fn healthy_client(addr: String, stop: Arc<AtomicBool>, rounds: Arc<AtomicU64>) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        let mut c = Raw::open(&addr, "default", false, true);
        let mut i = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let off = HEALTHY + (i % 64) * 65536;
            let data = pattern(i, 65536);
            assert_eq!(c.write(i, off, &data), 0, "healthy write {i}");
            assert_eq!(c.read(i, off, 65536).expect("healthy read"), data, "healthy data {i}");
            i += 1;
            rounds.store(i, Ordering::Relaxed);
        }
    })
}

#[test]
fn malformed_input_gets_documented_replies_and_harms_nobody() {
    let srv = Server::start_opts("default_export = \"default\"", CONFIG);
    let addr = srv.tcp.clone();
    let victim = pattern(7, VICTIM_LEN);
    {
        let mut c = Raw::open(&addr, "default", false, false);
        assert_eq!(c.write(1, VICTIM, &victim), 0);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicU64::new(0));
    let healthy = healthy_client(addr.clone(), stop.clone(), rounds.clone());

    handshake_garbage_and_truncation(&addr);
    option_limits_and_errors(&addr);
    transmission_simple_replies(&addr);
    transmission_structured_replies(&addr);
    committed_block_size(&addr);
    read_only_export(&addr);
    unaligned_requests_use_read_modify_write(&addr);
    concurrent_sub_block_writes_do_not_lose_updates(&addr);
    stalled_and_vanishing_clients(&addr);
    connection_ending_requests(&addr);

    stop.store(true, Ordering::Relaxed);
    healthy.join().expect("the healthy client failed while bad clients ran");
    assert!(rounds.load(Ordering::Relaxed) > 10, "the healthy client made too little progress");

    let mut c = Raw::open(&addr, "default", false, false);
    assert!(
        c.read(9, VICTIM, VICTIM_LEN as u32).unwrap() == victim,
        "the victim range was modified by a refused request"
    );
    let st = srv.export_stats("default");
    assert!(st["errors"].as_u64().unwrap() >= 20, "refused requests are counted: {st}");
    assert!(st["rmw_cycles"].as_u64().unwrap() > 0, "{st}");
    let log = srv.log_text();
    assert!(!log.contains("panicked"), "server panicked:\n{log}");
}

fn handshake_garbage_and_truncation(addr: &str) {
    // An HTTP request where client flags belong: unknown flag bits → the server hangs up.
    let mut r = Raw::connect(addr);
    r.greeting();
    r.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    r.expect_closed();

    // Unknown client flag bit alone.
    let mut r = Raw::connect(addr);
    r.greeting();
    r.send(&0x21u32.to_be_bytes());
    r.expect_closed();

    // Truncated client flags, then gone; and a client that connects and never speaks.
    let mut r = Raw::connect(addr);
    r.greeting();
    r.send(&[0, 0]);
    drop(r);
    let idle = Raw::connect(addr);

    // Bad option magic.
    let mut r = Raw::start(addr);
    r.send(&[0xde; 16]);
    r.expect_closed();

    // Truncated option header, then gone.
    let mut r = Raw::start(addr);
    r.send(&IHAVEOPT.to_be_bytes()[..5]);
    drop(r);
    drop(idle);
}

fn option_limits_and_errors(addr: &str) {
    let mut r = Raw::start(addr);
    // Oversized but skippable option data: NBD_REP_ERR_TOO_BIG, session continues.
    r.option(OPT_GO, &vec![0u8; 20_000]);
    assert_eq!(r.option_reply().1, REP_ERR_TOO_BIG);
    r.option(4242, &[1, 2, 3]);
    let (opt, kind, _) = r.option_reply();
    assert_eq!((opt, kind), (4242, REP_ERR_UNSUP));
    r.option(OPT_STARTTLS, &[]);
    assert_eq!(r.option_reply().1, REP_ERR_UNSUP);
    r.option(OPT_LIST, &[0]);
    assert_eq!(r.option_reply().1, REP_ERR_INVALID);
    r.option(OPT_STRUCTURED_REPLY, &[0]);
    assert_eq!(r.option_reply().1, REP_ERR_INVALID);
    r.option(OPT_INFO, &Raw::info_data("no-such-export", &[]));
    let (_, kind, msg) = r.option_reply();
    assert_eq!(kind, REP_ERR_UNKNOWN);
    assert!(String::from_utf8_lossy(&msg).contains("no-such-export"));
    // GO whose name length runs past the data.
    let mut bad = Raw::info_data("default", &[]);
    bad[0..4].copy_from_slice(&1000u32.to_be_bytes());
    r.option(OPT_GO, &bad);
    assert_eq!(r.option_reply().1, REP_ERR_INVALID);
    // GO with an odd number of info bytes.
    let mut bad = Raw::info_data("default", &[3]);
    bad.push(0);
    r.option(OPT_GO, &bad);
    assert_eq!(r.option_reply().1, REP_ERR_INVALID);
    // LIST works and names both exports.
    r.option(OPT_LIST, &[]);
    let mut names = Vec::new();
    loop {
        let (_, kind, data) = r.option_reply();
        if kind == REP_ACK {
            break;
        }
        assert_eq!(kind, REP_SERVER);
        let n = u32::from_be_bytes(data[0..4].try_into().unwrap()) as usize;
        names.push(String::from_utf8(data[4..4 + n].to_vec()).unwrap());
    }
    assert_eq!(names, ["default", "ro"]);
    // After all that, GO still succeeds on this connection.
    let (size, _) = r.go("default", false, false);
    assert_eq!(size, SIZE);
    assert!(r.read(1, 0, 512).is_ok());

    // An option length of ~4 GiB: hang up at once (nothing allocated, nothing waited for).
    let mut r = Raw::start(addr);
    let mut b = IHAVEOPT.to_be_bytes().to_vec();
    b.extend_from_slice(&OPT_GO.to_be_bytes());
    b.extend_from_slice(&0xffff_fff0u32.to_be_bytes());
    r.send(&b);
    r.expect_closed();

    // EXPORT_NAME for an unknown export: the protocol gives no way to refuse but hanging up.
    let mut r = Raw::start(addr);
    r.option(OPT_EXPORT_NAME, b"nope");
    r.expect_closed();

    // EXPORT_NAME that works (no zero padding: NO_ZEROES was negotiated).
    let mut r = Raw::start(addr);
    r.option(OPT_EXPORT_NAME, b"default");
    assert_eq!(r.u64(), SIZE);
    let flags = r.u16();
    assert_eq!(flags & 1, 1, "HAS_FLAGS");
    assert!(r.read(2, 0, 4096).is_ok());

    // ABORT: ACK, then the server closes.
    let mut r = Raw::start(addr);
    r.option(OPT_ABORT, &[]);
    assert_eq!(r.option_reply().1, REP_ACK);
    r.expect_closed();
}

fn expect_err(r: &mut Raw, cookie: u64, want: u32, what: &str) {
    let (err, c) = r.simple_reply();
    assert_eq!(c, cookie, "{what}: cookie");
    assert_eq!(err, want, "{what}: error");
}

fn transmission_simple_replies(addr: &str) {
    let mut r = Raw::open(addr, "default", false, false);
    let vic = VICTIM;

    r.request(0, CMD_READ, 10, 0, 0, &[]);
    expect_err(&mut r, 10, EINVAL, "zero-length read");
    r.request(0, CMD_WRITE, 11, vic, 0, &[]);
    expect_err(&mut r, 11, EINVAL, "zero-length write");
    r.request(0, CMD_READ, 12, SIZE - 512, 1024, &[]);
    expect_err(&mut r, 12, EINVAL, "read past the end");
    r.request(0, CMD_READ, 13, u64::MAX - 100, 512, &[]);
    expect_err(&mut r, 13, EINVAL, "read with offset+length overflow");
    r.request(0, CMD_WRITE, 14, SIZE - 512, 1024, &[0xee; 1024]);
    expect_err(&mut r, 14, ENOSPC, "write past the end");
    r.request(0, CMD_WRITE_ZEROES, 15, SIZE, 512, &[]);
    expect_err(&mut r, 15, ENOSPC, "write-zeroes past the end");
    r.request(0, CMD_TRIM, 16, SIZE - 4096, 8192, &[]);
    expect_err(&mut r, 16, EINVAL, "trim past the end");
    r.request(0, 99, 17, vic, 512, &[]);
    expect_err(&mut r, 17, EINVAL, "unknown command");
    r.request(0, CMD_CACHE, 18, vic, 512, &[]);
    expect_err(&mut r, 18, EINVAL, "CACHE (not advertised)");
    r.request(0, CMD_BLOCK_STATUS, 19, vic, 512, &[]);
    expect_err(&mut r, 19, EINVAL, "BLOCK_STATUS without meta context");
    r.request(1 << 12, CMD_READ, 20, vic, 512, &[]);
    expect_err(&mut r, 20, EINVAL, "unknown flag on READ");
    r.request(FLAG_NO_HOLE, CMD_WRITE, 21, vic, 4096, &[0xee; 4096]);
    expect_err(&mut r, 21, EINVAL, "NO_HOLE on WRITE (payload skipped, nothing written)");
    r.request(4, CMD_READ, 22, vic, 512, &[]);
    expect_err(&mut r, 22, EINVAL, "DF without structured replies");
    r.request(0, CMD_FLUSH, 23, 4096, 0, &[]);
    expect_err(&mut r, 23, EINVAL, "FLUSH with an offset");
    r.request(0, CMD_READ, 24, 0, (32 << 20) + 512, &[]);
    expect_err(&mut r, 24, EINVAL, "read over the maximum payload");
    r.request(FLAG_FAST_ZERO, CMD_WRITE_ZEROES, 25, vic + 1, 100, &[]);
    expect_err(&mut r, 25, ENOTSUP, "FAST_ZERO that would need read-modify-write");
    r.request(0, CMD_FLUSH, 26, 0, 0, &[]);
    expect_err(&mut r, 26, 0, "plain FLUSH");
    r.request(FLAG_FUA, CMD_FLUSH, 27, 0, 0, &[]);
    expect_err(&mut r, 27, 0, "FLUSH with FUA (clients do send it)");
    // Out of order pipelining: many requests, replies matched by cookie.
    for i in 0..64u64 {
        r.request(0, CMD_READ, 1000 + i, SCRATCH + i * 4096, 4096, &[]);
    }
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..64 {
        let (err, c) = r.simple_reply();
        assert_eq!(err, 0);
        r.recv(4096);
        assert!(seen.insert(c));
    }
    assert_eq!(seen.len(), 64);

    // A write payload over the maximum: EINVAL, then the server hangs up (it cannot skip 64 MiB
    // of a payload it refuses to buffer without trusting the client).
    r.request(0, CMD_WRITE, 30, 0, 64 << 20, &[]);
    expect_err(&mut r, 30, EINVAL, "write over the maximum payload");
    r.expect_closed();

    // Bad request magic: nothing after it can be framed, so the server hangs up.
    let mut r = Raw::open(addr, "default", false, false);
    r.send(&[0x11; 28]);
    r.expect_closed();
}

fn transmission_structured_replies(addr: &str) {
    let mut r = Raw::open(addr, "default", true, false);
    r.request(0, CMD_READ, 40, SIZE - 512, 1024, &[]);
    let c = r.chunk();
    assert_eq!((c.cookie, c.kind, c.flags & 1), (40, 0x8001, 1), "error chunk, DONE");
    assert_eq!(c.errno(), EINVAL);
    assert!(c.message().contains("beyond the end"), "{}", c.message());
    r.request(0, CMD_READ, 41, 0, (32 << 20) + 4096, &[]);
    let c = r.chunk();
    assert_eq!((c.kind, c.errno()), (0x8001, EOVERFLOW), "oversized structured read");
    r.request(0, CMD_WRITE, 42, SIZE, 512, &[1; 512]);
    let c = r.chunk();
    assert_eq!((c.cookie, c.errno()), (42, ENOSPC));
    r.request(4, CMD_READ, 43, VICTIM, 4096, &[]);
    let c = r.chunk();
    assert_eq!((c.cookie, c.kind, c.flags & 1), (43, 1, 1), "one OFFSET_DATA chunk with DONE");
    assert_eq!(u64::from_be_bytes(c.payload[0..8].try_into().unwrap()), VICTIM);
    assert_eq!(c.payload.len(), 8 + 4096);
    // Unaligned read: the data chunk starts exactly at the requested offset.
    r.request(0, CMD_READ, 44, VICTIM + 3, 10, &[]);
    let c = r.chunk();
    assert_eq!(u64::from_be_bytes(c.payload[0..8].try_into().unwrap()), VICTIM + 3);
    assert_eq!(&c.payload[8..], &pattern(7, VICTIM_LEN)[3..13]);
}

fn committed_block_size(addr: &str) {
    // The client asked for NBD_INFO_BLOCK_SIZE in GO, so it promised to align: refuse.
    let mut r = Raw::open(addr, "default", false, true);
    r.request(0, CMD_READ, 50, 1, 512, &[]);
    expect_err(&mut r, 50, EINVAL, "misaligned read after committing to block sizes");
    r.request(0, CMD_WRITE, 51, VICTIM + 1, 100, &[0xee; 100]);
    expect_err(&mut r, 51, EINVAL, "misaligned write after committing to block sizes");
    assert!(r.read(52, 0, 512).is_ok());
}

fn read_only_export(addr: &str) {
    let mut r = Raw::open(addr, "ro", false, false);
    r.request(0, CMD_WRITE, 60, VICTIM, 4096, &[0xee; 4096]);
    expect_err(&mut r, 60, EPERM, "write on a read-only export");
    r.request(0, CMD_TRIM, 61, VICTIM, 4096, &[]);
    expect_err(&mut r, 61, EPERM, "trim on a read-only export");
    r.request(0, CMD_WRITE_ZEROES, 62, VICTIM, 4096, &[]);
    expect_err(&mut r, 62, EPERM, "write-zeroes on a read-only export");
    assert_eq!(r.read(63, VICTIM, 4096).unwrap(), pattern(7, VICTIM_LEN)[..4096]);
}

fn unaligned_requests_use_read_modify_write(addr: &str) {
    let mut r = Raw::open(addr, "default", false, false);
    let base = pattern(99, 16384);
    assert_eq!(r.write(70, SCRATCH, &base), 0);
    let mut model = base.clone();
    for (i, (off, len)) in [(1usize, 1usize), (511, 2), (4000, 5000), (10001, 3)].into_iter().enumerate() {
        let data = pattern(200 + i as u64, len);
        assert_eq!(r.write(71 + i as u64, SCRATCH + off as u64, &data), 0, "unaligned write {off}+{len}");
        model[off..off + len].copy_from_slice(&data);
    }
    // Unaligned write-zeroes spanning partial head, whole middle and partial tail blocks.
    r.request(0, CMD_WRITE_ZEROES, 80, SCRATCH + 100, 2000, &[]);
    expect_err(&mut r, 80, 0, "unaligned write-zeroes");
    model[100..2100].fill(0);
    r.request(FLAG_FUA, CMD_WRITE_ZEROES, 81, SCRATCH + 12289, 10, &[]);
    expect_err(&mut r, 81, 0, "sub-block write-zeroes with FUA");
    model[12289..12299].fill(0);
    // Unaligned trim is rounded inward: only whole blocks inside may change.
    r.request(0, CMD_TRIM, 82, SCRATCH + 16383, 1, &[]);
    expect_err(&mut r, 82, 0, "sub-block trim (a no-op)");
    assert!(r.read(83, SCRATCH, 16384).unwrap() == model, "read-modify-write result");
    assert_eq!(r.read(84, SCRATCH + 4001, 7).unwrap(), model[4001..4008]);
}

/// Two connections write single bytes into the same blocks, pipelined: with a per-connection
/// (or no) lock, one read-modify-write would undo the other's byte.
fn concurrent_sub_block_writes_do_not_lose_updates(addr: &str) {
    let region = SCRATCH + (1 << 20);
    let mut z = Raw::open(addr, "default", false, false);
    assert_eq!(z.write(90, region, &[0u8; 2048]), 0);
    let handles: Vec<_> = (0..2u64)
        .map(|who| {
            let addr = addr.to_string();
            thread::spawn(move || {
                let mut r = Raw::open(&addr, "default", false, false);
                // Connection 0 writes even bytes, connection 1 odd bytes, of four 512-byte blocks.
                for i in 0..1024u64 {
                    let off = region + i * 2 + who;
                    r.request(0, CMD_WRITE, i, off, 1, &[(who as u8 + 1) * 0x40 + (i % 32) as u8]);
                }
                for _ in 0..1024 {
                    assert_eq!(r.simple_reply().0, 0);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let got = z.read(91, region, 2048).unwrap();
    for (i, b) in got.iter().enumerate() {
        let who = (i % 2) as u8;
        let want = (who + 1) * 0x40 + ((i / 2) % 32) as u8;
        assert_eq!(*b, want, "byte {i} lost an update");
    }
}

fn stalled_and_vanishing_clients(addr: &str) {
    // A write header whose payload never (fully) arrives, aimed at the victim range.
    let mut stalled = Raw::open(addr, "default", false, false);
    stalled.request(0, CMD_WRITE, 100, VICTIM, 4096, &[0xee; 100]);
    // Meanwhile others are served.
    let mut other = Raw::open(addr, "default", false, false);
    assert_eq!(other.write(101, SCRATCH + (2 << 20), &[5; 4096]), 0);
    assert_eq!(other.read(102, SCRATCH + (2 << 20), 4096).unwrap(), vec![5; 4096]);
    drop(stalled);

    // A client that pipelines writes and vanishes without reading a single reply, mid-request.
    let mut gone = Raw::open(addr, "default", false, false);
    for i in 0..32u64 {
        gone.request(0, CMD_WRITE, i, SCRATCH + (3 << 20) + i * 4096, 4096, &[9; 4096]);
    }
    gone.request(0, CMD_WRITE, 99, SCRATCH + (3 << 20), 4096, &[9; 10]);
    gone.s.shutdown(Shutdown::Both).unwrap();
    drop(gone);

    // A client that vanishes with reads in flight (the server's replies hit a closed socket).
    let mut gone = Raw::open(addr, "default", true, false);
    for i in 0..32u64 {
        gone.request(0, CMD_READ, i, 0, 1 << 20, &[]);
    }
    drop(gone);

    let mut after = Raw::open(addr, "default", false, false);
    assert!(after.read(103, 0, 4096).is_ok(), "server still serves new clients");
}

fn connection_ending_requests(addr: &str) {
    // DISC: outstanding requests are answered, then the server closes.
    let mut r = Raw::open(addr, "default", false, false);
    r.request(0, CMD_WRITE, 110, SCRATCH, 4096, &[3; 4096]);
    r.request(0, CMD_DISC, 111, 0, 0, &[]);
    assert_eq!(r.simple_reply(), (0, 110));
    r.expect_closed();
}
