//! Hostile clients against an in-process server at default settings: sockets that never
//! finish the handshake, clients that announce 32 MiB writes and stop sending, a flood from
//! many addresses. A well-behaved client must still get served, and the process must stay
//! within the documented memory bound (docs/CONFIG.md, `[nbd]`).
//!
//! Loopback is all of 127.0.0.0/8 on Linux, so each group of clients binds its own source
//! addresses to look like distinct peers.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use mdkit_io::MemDevice;
use mdkit_nbd::{Export, ListenAddr, NbdServer, ServerOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

const MIB: u64 = 1 << 20;
/// What the documentation promises for the whole process at default settings.
const RSS_BOUND_BYTES: u64 = 256 * MIB;
const IDLE_SOCKETS: usize = 1000;
const STALLED_WRITERS: usize = 256;
/// Stalled writers per source address (below the default per-peer limit).
const WRITERS_PER_PEER: usize = 32;
/// Payload bytes each stalled writer sends of its announced 32 MiB before it stops.
const STALLED_SENT_BYTES: usize = 1 << 20;
/// Hang guard only; nothing asserts on how long anything took.
const HANG_GUARD: Duration = Duration::from_secs(60);

const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const REQUEST_MAGIC: u32 = 0x2560_9513;

fn raise_fd_limit(want: u64) {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local rlimit.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        if lim.rlim_cur < want {
            lim.rlim_cur = want.min(lim.rlim_max);
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
        }
    }
    assert!(lim.rlim_cur >= want, "RLIMIT_NOFILE hard limit {} is below the {want} this test needs", lim.rlim_max);
}

/// Peak resident set size of this process (server and clients alike).
fn peak_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).expect("VmHWM in /proc/self/status");
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

async fn serve(options: ServerOptions) -> (NbdServer, SocketAddr) {
    let server = NbdServer::new(options);
    let device = Arc::new(MemDevice::new("ram", 64 * MIB));
    server.add_export(Export { name: "d".into(), description: String::new(), device, read_only: false }).unwrap();
    let ListenAddr::Tcp(addr) = server.listen(&"127.0.0.1:0".parse().unwrap()).await.unwrap() else {
        unreachable!("asked for TCP")
    };
    (server, addr.parse().unwrap())
}

async fn connect_from(source: Ipv4Addr, addr: SocketAddr) -> TcpStream {
    let s = TcpSocket::new_v4().unwrap();
    s.bind(SocketAddr::new(IpAddr::V4(source), 0)).unwrap();
    s.connect(addr).await.unwrap()
}

/// Fixed newstyle handshake with NBD_OPT_GO "d" (simple replies).
async fn handshake(s: &mut TcpStream) {
    let mut hello = [0u8; 18];
    s.read_exact(&mut hello).await.unwrap();
    let mut out = 3u32.to_be_bytes().to_vec();
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&7u32.to_be_bytes());
    out.extend_from_slice(&7u32.to_be_bytes());
    out.extend_from_slice(&1u32.to_be_bytes());
    out.push(b'd');
    out.extend_from_slice(&0u16.to_be_bytes());
    s.write_all(&out).await.unwrap();
    loop {
        let mut h = [0u8; 20];
        s.read_exact(&mut h).await.unwrap();
        let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
        let mut data = vec![0u8; len];
        s.read_exact(&mut data).await.unwrap();
        match kind {
            1 => return,
            3 => {}
            k => panic!("NBD_OPT_GO failed: reply type {k:#x}"),
        }
    }
}

fn request_header(kind: u16, cookie: u64, offset: u64, len: u32) -> Vec<u8> {
    let mut b = REQUEST_MAGIC.to_be_bytes().to_vec();
    b.extend_from_slice(&0u16.to_be_bytes());
    b.extend_from_slice(&kind.to_be_bytes());
    b.extend_from_slice(&cookie.to_be_bytes());
    b.extend_from_slice(&offset.to_be_bytes());
    b.extend_from_slice(&len.to_be_bytes());
    b
}

async fn simple_reply(s: &mut TcpStream, cookie: u64) -> u32 {
    let mut r = [0u8; 16];
    s.read_exact(&mut r).await.unwrap();
    assert_eq!(u64::from_be_bytes(r[8..16].try_into().unwrap()), cookie);
    u32::from_be_bytes(r[4..8].try_into().unwrap())
}

/// Handshake, write, read back, disconnect.
async fn good_client(addr: SocketAddr) {
    let mut s = connect_from(Ipv4Addr::LOCALHOST, addr).await;
    handshake(&mut s).await;
    let data: Vec<u8> = (0..64 << 10).map(|i: u32| (i % 251) as u8).collect();
    let mut w = request_header(1, 1, 1 << 20, data.len() as u32);
    w.extend_from_slice(&data);
    s.write_all(&w).await.unwrap();
    assert_eq!(simple_reply(&mut s, 1).await, 0, "good client's write failed");
    s.write_all(&request_header(0, 2, 1 << 20, data.len() as u32)).await.unwrap();
    assert_eq!(simple_reply(&mut s, 2).await, 0, "good client's read failed");
    let mut back = vec![0u8; data.len()];
    s.read_exact(&mut back).await.unwrap();
    assert!(back == data, "good client read back different data");
    s.write_all(&request_header(2, 3, 0, 0)).await.unwrap();
}

/// Polls `cond` (a counter of the server) until it holds; the hang guard ends a test that
/// never gets there.
async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    tokio::time::timeout(HANG_GUARD, async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("hang guard: never saw {what}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sockets_and_stalled_writers_do_not_lock_out_a_good_client_nor_blow_memory() {
    raise_fd_limit(4 * (IDLE_SOCKETS + STALLED_WRITERS) as u64 + 256);
    let options = ServerOptions::default();
    let budget_limit = options.payload_budget_bytes;
    let (server, addr) = serve(options).await;

    // 256 established clients, 32 per address, each announcing a 32 MiB write and sending
    // only its first MiB. Handshakes one at a time so they never compete for handshake slots.
    let sent = Arc::new(vec![0xa5u8; STALLED_SENT_BYTES]);
    let mut stalled = Vec::new();
    for i in 0..STALLED_WRITERS {
        let mut s = connect_from(Ipv4Addr::new(127, 0, 0, 2 + (i / WRITERS_PER_PEER) as u8), addr).await;
        handshake(&mut s).await;
        let sent = sent.clone();
        stalled.push(tokio::spawn(async move {
            s.write_all(&request_header(1, 9, 0, 32 << 20)).await.unwrap();
            // The server reads this only once the budget grants the request; the socket
            // buffers may fill first, which stalls this task just the same.
            s.write_all(&sent).await.unwrap();
            std::future::pending::<()>().await;
        }));
    }
    // One writer holds a 32 MiB grant; every other one waits for budget, unallocated. (Without
    // the budget, each would read its MiB into a 32 MiB buffer: stop as soon as that shows.)
    until("255 writers waiting for payload budget", || {
        server.payload_budget().waits >= 255 || peak_rss_bytes() >= RSS_BOUND_BYTES
    })
    .await;
    let peak_rss = peak_rss_bytes();
    assert!(
        peak_rss < RSS_BOUND_BYTES,
        "peak RSS {} MiB is over the {} MiB bound",
        peak_rss >> 20,
        RSS_BOUND_BYTES >> 20
    );
    assert_eq!(server.connection_count(), STALLED_WRITERS);

    // 1,000 sockets from 250 addresses that connect and never say a word.
    let mut idle = Vec::new();
    for i in 0..IDLE_SOCKETS {
        idle.push(connect_from(Ipv4Addr::new(127, 0, 1, 1 + (i % 250) as u8), addr).await);
    }
    until("the idle flood accepted", || server.connections_accepted() >= (STALLED_WRITERS + IDLE_SOCKETS) as u64).await;

    tokio::time::timeout(HANG_GUARD, good_client(addr)).await.expect("hang guard: good client never finished");

    let admission = server.admission_stats();
    assert!(admission.handshakes_evicted > 0, "the idle flood should have been cut: {admission:?}");
    let budget = server.payload_budget();
    assert!(budget.peak_bytes <= budget_limit, "payload budget exceeded: {budget:?}");
    let peak_rss = peak_rss_bytes();
    assert!(
        peak_rss < RSS_BOUND_BYTES,
        "peak RSS {} MiB is over the {} MiB bound",
        peak_rss >> 20,
        RSS_BOUND_BYTES >> 20
    );
    eprintln!("peak RSS {} MiB, budget {budget:?}, admission {admission:?}", peak_rss >> 20);
    for t in stalled {
        t.abort();
    }
    drop(idle);
}

#[tokio::test]
async fn a_silent_client_is_cut_at_the_handshake_timeout() {
    assert!(ServerOptions::default().handshake_timeout <= Duration::from_secs(10), "default timeout is not short");
    let options = ServerOptions { handshake_timeout: Duration::from_millis(100), ..ServerOptions::default() };
    let (server, addr) = serve(options).await;
    let mut s = connect_from(Ipv4Addr::LOCALHOST, addr).await;
    let mut hello = [0u8; 18];
    s.read_exact(&mut hello).await.unwrap();
    let mut rest = Vec::new();
    let n = tokio::time::timeout(HANG_GUARD, s.read_to_end(&mut rest)).await.expect("hang guard: never cut");
    assert_eq!(n.unwrap(), 0, "the server sent something to a silent client");
    until("the timeout counted", || server.admission_stats().handshakes_timed_out == 1).await;
    until("the slot freed", || server.connection_count() == 0).await;
}

#[tokio::test]
async fn one_address_gets_its_share_and_no_more() {
    let options = ServerOptions { max_connections_per_peer: 3, ..ServerOptions::default() };
    let (server, addr) = serve(options).await;
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut s = connect_from(Ipv4Addr::new(127, 0, 0, 7), addr).await;
        handshake(&mut s).await;
        held.push(s);
    }
    let mut fourth = connect_from(Ipv4Addr::new(127, 0, 0, 7), addr).await;
    let mut buf = Vec::new();
    let n = tokio::time::timeout(HANG_GUARD, fourth.read_to_end(&mut buf)).await.expect("hang guard");
    assert_eq!(n.unwrap(), 0, "a fourth connection from one address must be closed at accept");
    assert_eq!(server.admission_stats().refused_per_peer, 1);
    // Another address is not affected.
    good_client(addr).await;
}

#[tokio::test]
async fn remote_listeners_need_an_explicit_opt_in() {
    let server = NbdServer::new(ServerOptions::default());
    let e = server.listen(&"0.0.0.0:0".parse().unwrap()).await.unwrap_err();
    assert!(e.to_string().contains("allow_remote"), "{e}");
    assert!(server.listeners().is_empty());
    let open = NbdServer::new(ServerOptions { allow_remote: true, ..ServerOptions::default() });
    open.listen(&"0.0.0.0:0".parse().unwrap()).await.unwrap();
    assert_eq!(open.listeners().len(), 1);
}

#[tokio::test]
async fn a_writer_that_stops_mid_payload_is_cut_and_its_budget_returned() {
    let options = ServerOptions { payload_stall_timeout: Duration::from_millis(100), ..ServerOptions::default() };
    let (server, addr) = serve(options).await;
    let mut s = connect_from(Ipv4Addr::LOCALHOST, addr).await;
    handshake(&mut s).await;
    let mut w = request_header(1, 1, 0, 8 << 20);
    w.extend_from_slice(&[7u8; 64 << 10]);
    s.write_all(&w).await.unwrap();
    until("the write granted", || server.payload_budget().used_bytes == 8 * MIB).await;
    let mut rest = Vec::new();
    let n = tokio::time::timeout(HANG_GUARD, s.read_to_end(&mut rest)).await.expect("hang guard: never cut");
    assert_eq!(n.unwrap(), 0, "no reply is owed for a write that never arrived");
    until("the budget returned", || server.payload_budget().used_bytes == 0).await;
    assert_eq!(server.payload_budget().peak_bytes, 8 * MIB);
}
