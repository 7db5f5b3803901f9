//! Remote members that lose their link and come back, with the real binary:
//! - network namespace: nbdkit, qemu-nbd or a second mdkit serves a file inside a namespace
//!   the test creates (veth pair, its own addresses), reached through a delaying TCP proxy in
//!   the test (+1 ms round trip; no netem on this kernel). raid1 of a local file and that
//!   export under a verifying writer; the veth goes down for ~10 s and up again: zero verify
//!   errors and zero client-visible errors, the member is failed quickly (remote_timeout_ms)
//!   and re-added by itself once the client reconnects, the catch-up copies exactly the chunks
//!   the bitmap recorded during the outage (mdkit's count, and the server's own count where it
//!   keeps one: nbdkit's log, the remote mdkit's export statistics), events are raised, check
//!   reports 0 mismatches and `mdadm --examine` accepts both members;
//! - a remote member whose server is gone when the service starts: the array starts degraded
//!   without it (listed as missing, with the reason; DegradedArray), writes go on, and when the
//!   server returns the member is re-added and caught up from the bitmap.

use crate::common;
use crate::remote::{
    BITMAP_CHUNK, Load, SIZE, check, detail, has_state, logged, mdadm_examine, member, nbdkit, sparse, wait_settled,
    wait_until,
};

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Server, mdkit_ok, require_tool};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A network namespace with a veth pair (host side `host_if`, namespace side `ns_if`) and
/// addresses `host_ip`/`ns_ip`; deleted on drop (with any process still inside).
struct NetNs {
    name: String,
    host_if: String,
    ns_if: String,
    ns_ip: String,
    procs: Vec<Child>,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

impl NetNs {
    /// `None` (with the reason printed) when namespaces cannot be created here.
    fn create() -> Option<NetNs> {
        // Unique per test too: the tests of one process run side by side.
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let seq = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = (std::process::id() * 8 + seq % 8) % 50_000;
        let name = format!("mdkit-t{id}");
        if let Err(e) = ip(&["netns", "add", &name]) {
            eprintln!("SKIP: network namespaces not permitted here ({e})");
            return None;
        }
        let (a, b) = (id / 250 % 250 + 1, id % 250);
        let ns = NetNs {
            host_if: format!("mkh{id}"),
            ns_if: format!("mkn{id}"),
            ns_ip: format!("10.{a}.{b}.2"),
            name,
            procs: Vec::new(),
        };
        let host_ip = format!("10.{a}.{b}.1/30");
        let ns_cidr = format!("{}/30", ns.ns_ip);
        let steps: [&[&str]; 7] = [
            &["link", "add", &ns.host_if, "type", "veth", "peer", "name", &ns.ns_if],
            &["link", "set", &ns.ns_if, "netns", &ns.name],
            &["addr", "add", &host_ip, "dev", &ns.host_if],
            &["link", "set", &ns.host_if, "up"],
            &["-n", &ns.name, "addr", "add", &ns_cidr, "dev", &ns.ns_if],
            &["-n", &ns.name, "link", "set", &ns.ns_if, "up"],
            &["-n", &ns.name, "link", "set", "lo", "up"],
        ];
        for s in steps {
            ip(s).unwrap_or_else(|e| panic!("setting up the namespace: {e}"));
        }
        Some(ns)
    }

    /// Takes the namespace side of the link down or up.
    fn set_link(&self, up: bool) {
        ip(&["-n", &self.name, "link", "set", &self.ns_if, if up { "up" } else { "down" }]).unwrap();
    }

    /// Runs `cmd args` inside the namespace (killed on drop).
    fn spawn(&mut self, cmd: &str, args: &[&str]) {
        let child = Command::new("ip")
            .args(["netns", "exec", &self.name, cmd])
            .args(args)
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn in the namespace");
        self.procs.push(child);
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        for c in &mut self.procs {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = ip(&["netns", "del", &self.name]);
        // Normally gone with its peer; this covers a namespace that was not deleted.
        let _ = ip(&["link", "del", &self.host_if]);
    }
}

/// A TCP proxy on 127.0.0.1 to `upstream` that holds every server→client byte back by
/// `delay` (the added round-trip time). Runs on `rt` until the runtime is dropped.
fn delaying_proxy(rt: &tokio::runtime::Runtime, upstream: SocketAddr, delay: Duration) -> u16 {
    let listener = rt.block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
    let port = listener.local_addr().unwrap().port();
    rt.spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            tokio::spawn(proxy_one(client, upstream, delay));
        }
    });
    port
}

async fn proxy_one(client: TcpStream, upstream: SocketAddr, delay: Duration) {
    let Ok(Ok(server)) = tokio::time::timeout(Duration::from_secs(3), TcpStream::connect(upstream)).await else {
        return;
    };
    // Like mdkit's client: a connection given up is reset, its unsent bytes discarded (a
    // partition that heals must not deliver writes whose requests already failed).
    let _ = (client.set_nodelay(true), server.set_nodelay(true));
    // (Deprecated because a non-zero linger blocks the dropping thread; zero never does.)
    #[allow(deprecated)]
    let _ = server.set_linger(Some(Duration::ZERO));
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let up = async move {
        let _ = tokio::io::copy(&mut cr, &mut sw).await;
        let _ = sw.shutdown().await;
    };
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let read_down = async move {
        let mut buf = vec![0u8; 256 << 10];
        while let Ok(n) = sr.read(&mut buf).await {
            if n == 0 || tx.send((tokio::time::Instant::now() + delay, buf[..n].to_vec())).is_err() {
                break;
            }
        }
    };
    let write_down = async move {
        while let Some((due, data)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if cw.write_all(&data).await.is_err() {
                break;
            }
        }
        let _ = cw.shutdown().await;
    };
    // Either side closing ends the connection (a silent upstream is dropped with the client).
    tokio::select! {
        _ = up => {}
        _ = async { tokio::join!(read_down, write_down) } => {}
    }
}

fn remote_link(d: &Value) -> &Value {
    &d["remote_members"][0]
}

fn data_bytes_written(log: &Path, data_offset_bytes: u64) -> u64 {
    logged(log, "Write").iter().filter(|(off, _)| *off >= data_offset_bytes).map(|(_, n)| n).sum()
}

/// The NBD server on the far side of the link.
#[derive(Clone, Copy, Debug)]
enum Remote {
    Nbdkit,
    QemuNbd,
    Mdkit,
}

/// How the test reads the data the remote server was asked to write.
enum WriteCount {
    /// nbdkit's log filter: every request with its offset.
    NbdkitLog(PathBuf),
    /// The remote mdkit's export statistics (bytes of every write, metadata included).
    MdkitStatus(PathBuf),
    /// qemu-nbd keeps no count; mdkit's own count and the check stand alone.
    None,
}

impl WriteCount {
    /// Bytes written so far at or past `data_offset_bytes` (nbdkit), or in all (mdkit).
    fn bytes(&self, data_offset_bytes: u64) -> Option<u64> {
        match self {
            WriteCount::NbdkitLog(log) => Some(data_bytes_written(log, data_offset_bytes)),
            WriteCount::MdkitStatus(socket) => {
                let out =
                    Command::new(common::MDKIT).args(["status", "--json", "--socket"]).arg(socket).output().unwrap();
                assert!(out.status.success(), "remote mdkit status: {}", String::from_utf8_lossy(&out.stderr));
                let st: Value = serde_json::from_slice(&out.stdout).unwrap();
                let export = st["exports"].as_array().and_then(|e| e.iter().find(|x| x["name"] == "remote"));
                Some(
                    export.unwrap_or_else(|| panic!("no export `remote` in {st:#}"))["stats"]["written_bytes"]
                        .as_u64()
                        .unwrap(),
                )
            }
            WriteCount::None => None,
        }
    }
}

/// Starts `kind` inside `ns`, serving `file` as the default export on the namespace address,
/// port 10809; returns how to count what it writes.
fn serve_in_namespace(ns: &mut NetNs, kind: Remote, dir: &Path, file: &Path) -> WriteCount {
    let ip = ns.ns_ip.clone();
    let file_s = file.to_str().unwrap();
    match kind {
        Remote::Nbdkit => {
            require_tool("nbdkit", "nbdkit");
            let log = dir.join("nbdkit.log");
            let logfile = format!("logfile={}", log.display());
            ns.spawn("nbdkit", &["-f", "-i", &ip, "-p", "10809", "--filter=log", "file", file_s, &logfile]);
            WriteCount::NbdkitLog(log)
        }
        Remote::QemuNbd => {
            require_tool("qemu-nbd", "qemu-utils");
            // Persistent, any number of clients: the connection cut by the outage may still be
            // open on this side when mdkit reconnects.
            ns.spawn("qemu-nbd", &["-f", "raw", "-b", &ip, "-p", "10809", "-x", "", "-t", "-e", "0", file_s]);
            WriteCount::None
        }
        Remote::Mdkit => {
            let data_dir = dir.join("remote-mdkit");
            let config = dir.join("remote-mdkit.toml");
            let body = format!(
                "data_dir = \"{}\"\n[nbd]\nlisten = [\"{ip}:10809\"]\nallow_remote = true\ndefault_export = \"remote\"\n\
                 [[volume]]\nname = \"remote\"\nkind = \"file\"\npath = \"{file_s}\"\n\
                 [[export]]\nname = \"remote\"\nvolume = \"remote\"\n",
                data_dir.display()
            );
            std::fs::write(&config, body).unwrap();
            ns.spawn(common::MDKIT, &["serve", "--config", config.to_str().unwrap()]);
            WriteCount::MdkitStatus(data_dir.join("mdkit.sock"))
        }
    }
}

#[test]
fn link_down_for_ten_seconds_in_a_namespace_then_automatic_readd_copies_only_dirty_chunks() {
    link_down_then_automatic_readd(Remote::Nbdkit);
}

#[test]
fn link_down_with_a_qemu_nbd_remote_then_automatic_readd_copies_only_dirty_chunks() {
    link_down_then_automatic_readd(Remote::QemuNbd);
}

#[test]
fn link_down_with_an_mdkit_remote_then_automatic_readd_copies_only_dirty_chunks() {
    link_down_then_automatic_readd(Remote::Mdkit);
}

/// raid1 of a local file and `kind` in a namespace, under a verifying writer; the link goes
/// down for ten seconds and up again.
fn link_down_then_automatic_readd(kind: Remote) {
    require_tool("mdadm", "mdadm");
    let Some(mut ns) = NetNs::create() else { return };
    let dir = tempfile::Builder::new().prefix("mdkit-link-").tempdir_in("/var/tmp").unwrap();
    let remote_file = dir.path().join("remote.img");
    sparse(&remote_file, SIZE);
    let count = serve_in_namespace(&mut ns, kind, dir.path(), &remote_file);
    let upstream: SocketAddr = format!("{}:10809", ns.ns_ip).parse().unwrap();
    wait_until(&format!("{kind:?} in the namespace"), Duration::from_secs(20), || {
        std::net::TcpStream::connect_timeout(&upstream, Duration::from_millis(500)).is_ok()
    });
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let port = delaying_proxy(&rt, upstream, Duration::from_millis(1));
    let uri = format!("nbd://127.0.0.1:{port}/");
    let body = format!(
        r#"
[[volume]]
name = "r"
kind = "md"
members = ["r-local.img", "{uri}"]
member_size = "64MiB"
create = true
level = "raid1"
assume_clean = true
bitmap_chunk = "1MiB"
remote_timeout_ms = 1000
[[export]]
name = "r"
volume = "r"
"#
    );
    let srv = Server::start(&body);
    let d = detail(&srv, "r");
    assert!(has_state(member(&d, &uri), "in_sync"), "{d:#}");
    assert_eq!(remote_link(&d)["link"], "up", "{d:#}");
    let data_offset_bytes = member(&d, &uri)["data_offset_sectors"].as_u64().unwrap() * 512;

    let load = Load::start(&rt, &srv.uri("r"), 4, 16 << 20);
    wait_until("writes before the outage", Duration::from_secs(60), || load.writes() >= 200);
    let down_at = Instant::now();
    ns.set_link(false);
    wait_until("remote member failed", Duration::from_secs(30), || {
        has_state(member(&detail(&srv, "r"), &uri), "faulty")
    });
    let at_failure = load.writes();
    wait_until("writes during the outage", Duration::from_secs(60), || load.writes() >= at_failure + 200);
    let d = detail(&srv, "r");
    assert_eq!((d["degraded"].as_u64(), remote_link(&d)["link"].as_str()), (Some(1), Some("down")), "{d:#}");
    let text = mdkit_ok(&srv, &["detail", "r"]);
    assert!(text.contains("Remote links") && text.contains(&format!("{uri}  link down")), "{text}");
    // Ten seconds of outage, then the writers stop between two writes so the set of dirty
    // chunks is fixed while the member catches up.
    std::thread::sleep(Duration::from_secs(10).saturating_sub(down_at.elapsed()));
    load.pause();
    let d = detail(&srv, "r");
    let dirty = d["bitmap"]["needed_chunks"].as_u64().unwrap();
    assert!((1..=16).contains(&dirty), "writes to the first 16 MiB dirty 1..=16 chunks of 1 MiB: {d:#}");
    let written_before = count.bytes(data_offset_bytes);
    ns.set_link(true);
    wait_until("automatic re-add", Duration::from_secs(60), || remote_link(&detail(&srv, "r"))["auto_readds"] == 1);
    let d = wait_settled(&srv, "r");
    assert!(has_state(member(&d, &uri), "in_sync"), "{d:#}");
    let link = remote_link(&d);
    assert!(link["link"] == "up" && link["reconnects"].as_u64() >= Some(1), "{link:#}");
    let copied = (d["sync"]["copied_chunks"].as_u64().unwrap(), d["sync"]["copied_bytes"].as_u64().unwrap());
    eprintln!("{kind:?}: outage: {dirty} dirty chunks; catch-up copied {copied:?}");
    assert_eq!(copied, (dirty, dirty * BITMAP_CHUNK), "the catch-up copies exactly the dirty chunks");
    let server_saw = written_before.zip(count.bytes(data_offset_bytes)).map(|(a, b)| b - a);
    eprintln!("{kind:?}: the server's own count of bytes written during the catch-up: {server_saw:?}");
    match (&count, server_saw) {
        (WriteCount::NbdkitLog(_), Some(n)) => {
            assert_eq!(n, dirty * BITMAP_CHUNK, "nbdkit saw only the dirty chunks written")
        }
        // The export's count includes the superblock and bitmap updates of the re-add: a few
        // 4 KiB blocks, never another chunk (a full rebuild would be the whole 64 MiB).
        (WriteCount::MdkitStatus(_), Some(n)) => assert!(
            (dirty * BITMAP_CHUNK..dirty * BITMAP_CHUNK + BITMAP_CHUNK / 2).contains(&n),
            "the remote mdkit wrote {n} bytes for {dirty} dirty chunks"
        ),
        _ => {}
    }
    // Writers go on after the catch-up; then every block reads back as last written.
    load.resume();
    let resumed = load.writes();
    wait_until("writes after the catch-up", Duration::from_secs(60), || load.writes() >= resumed + 100);
    assert!(load.finish(&rt) > 0);
    assert_eq!(check(&srv, "r"), 0, "mismatches after the catch-up");
    let log_text = srv.log_text();
    for ev in ["Fail event detected on md device r", "DegradedArray event detected on md device r", "SpareActive"] {
        assert!(log_text.contains(ev), "no {ev:?} in the log:\n{log_text}");
    }
    let local = srv.path("r-local.img");
    let mut srv = srv;
    assert!(srv.signal_and_wait(libc::SIGTERM, Duration::from_secs(30)).success(), "{}", srv.log_text());
    for f in [&remote_file, &local] {
        let ex = mdadm_examine(f);
        assert!(ex.contains("Raid Level : raid1") && ex.contains("correct") && ex.contains("State : clean"), "{ex}");
    }
}

#[test]
fn remote_member_unreachable_at_start_is_missing_then_readded_when_it_answers() {
    require_tool("nbdkit", "nbdkit");
    let dir = tempfile::Builder::new().prefix("mdkit-miss-").tempdir_in("/var/tmp").unwrap();
    let remote_file = dir.path().join("remote.img");
    sparse(&remote_file, SIZE);
    let sock: PathBuf = dir.path().join("remote.sock");
    let log = dir.path().join("nbdkit.log");
    let mut peer = nbdkit(&remote_file, &sock, &log);
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    let body = format!(
        r#"
[[volume]]
name = "m"
kind = "md"
members = ["m-local.img", "{uri}"]
member_size = "64MiB"
create = true
level = "raid1"
assume_clean = true
bitmap_chunk = "1MiB"
[[export]]
name = "m"
volume = "m"
"#
    );
    let srv = Server::start(&body);
    assert!(has_state(member(&detail(&srv, "m"), &uri), "in_sync"));
    // The server is gone when the service starts again: the array starts degraded without it.
    let mut srv = srv;
    assert!(srv.signal_and_wait(libc::SIGTERM, Duration::from_secs(30)).success(), "{}", srv.log_text());
    peer.kill();
    let _ = std::fs::remove_file(&sock);
    let data_dir = std::mem::replace(&mut srv.dir, tempfile::tempdir().unwrap());
    let srv = Server::start_with_config(data_dir, srv.config_path.clone());
    let d = detail(&srv, "m");
    assert_eq!(d["degraded"], 1, "{d:#}");
    let missing = &d["missing"][0];
    assert_eq!(missing["member"], uri.as_str(), "{d:#}");
    assert!(missing["reason"].as_str().unwrap().starts_with(&format!("{uri} unreachable: ")), "{missing:#}");
    assert_eq!(remote_link(&d)["link"], "missing", "{d:#}");
    let text = mdkit_ok(&srv, &["detail", "m"]);
    assert!(text.contains("missing") && text.contains("unreachable"), "{text}");
    wait_until("DegradedArray", Duration::from_secs(10), || {
        srv.log_text().contains("DegradedArray event detected on md device m")
    });
    // Writes while it is away: 3 MiB at 8 MiB dirty 3 chunks.
    common::nbd_write_at(&srv, "m", 8 << 20, &common::pattern(3, 3 << 20));
    let dirty = detail(&srv, "m")["bitmap"]["needed_chunks"].as_u64().unwrap();
    assert_eq!(dirty, 3);
    // The server comes back: the member is re-added and only the dirty chunks are copied.
    let _peer = nbdkit(&remote_file, &sock, &log);
    wait_until("automatic re-add", Duration::from_secs(60), || remote_link(&detail(&srv, "m"))["auto_readds"] == 1);
    let d = wait_settled(&srv, "m");
    assert!(has_state(member(&d, &uri), "in_sync") && d["missing"].as_array().unwrap().is_empty(), "{d:#}");
    assert_eq!(d["sync"]["copied_chunks"], dirty, "{d:#}");
    assert_eq!(
        common::read_file_at(
            &remote_file,
            member(&d, &uri)["data_offset_sectors"].as_u64().unwrap() * 512 + (8 << 20),
            3 << 20
        ),
        common::pattern(3, 3 << 20)
    );
    assert_eq!(check(&srv, "m"), 0);
    wait_until("SpareActive", Duration::from_secs(10), || {
        srv.log_text().contains("SpareActive event detected on md device m")
    });
}

/// Unix-socket "servers" that accept connections and never answer (a hung NBD server: the
/// kernel accepts, the process is stopped). Records, at each listener's first accept, whether
/// every connection the other listeners accepted before was still open.
struct SilentServers {
    accepted: std::sync::Arc<parking_lot::Mutex<Vec<std::os::unix::net::UnixStream>>>,
    overlapped: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl SilentServers {
    fn start(socks: &[PathBuf]) -> SilentServers {
        let accepted = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
        let overlapped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        for sock in socks {
            let _ = std::fs::remove_file(sock);
            let listener = std::os::unix::net::UnixListener::bind(sock).unwrap();
            let (accepted, overlapped) = (accepted.clone(), overlapped.clone());
            std::thread::spawn(move || {
                let mut first = true;
                for stream in listener.incoming().flatten() {
                    let mut held = accepted.lock();
                    if first && held.iter().any(|s| !still_open(s)) {
                        overlapped.store(false, std::sync::atomic::Ordering::Release);
                    }
                    first = false;
                    held.push(stream);
                }
            });
        }
        SilentServers { accepted, overlapped }
    }
}

/// The peer has not closed this connection (a non-blocking peek finds no end of file).
fn still_open(s: &std::os::unix::net::UnixStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut b = [0u8; 1];
    // SAFETY: a one-byte peek into a local buffer on the stream's own open fd.
    let n = unsafe { libc::recv(s.as_raw_fd(), b.as_mut_ptr().cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    n > 0 || (n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::WouldBlock)
}

/// Two remote members whose servers hang (accept, never answer) when the service starts: they
/// are connected at once, not one after the other (each used to cost the full connect
/// timeout before the next began: 10 s per member with the control socket and NBD listener
/// down meanwhile), and the array starts degraded without them.
#[test]
fn hung_remote_servers_at_start_are_connected_to_at_once() {
    require_tool("nbdkit", "nbdkit");
    let dir = tempfile::Builder::new().prefix("mdkit-hung-").tempdir_in("/var/tmp").unwrap();
    let socks: Vec<PathBuf> = (0..2).map(|i| dir.path().join(format!("r{i}.sock"))).collect();
    let mut peers: Vec<_> = (0..2)
        .map(|i| {
            let file = dir.path().join(format!("r{i}.img"));
            sparse(&file, SIZE);
            nbdkit(&file, &socks[i], &dir.path().join(format!("r{i}.log")))
        })
        .collect();
    let uris: Vec<String> = socks.iter().map(|s| format!("nbd+unix:///?socket={}", s.display())).collect();
    let body = format!(
        "[[volume]]\nname = \"m\"\nkind = \"md\"\nmembers = [\"m-local.img\", \"{}\", \"{}\"]\nmember_size = \"64MiB\"\n\
         create = true\nlevel = \"raid1\"\nassume_clean = true\nremote_timeout_ms = 1000\n",
        uris[0], uris[1]
    );
    let mut srv = Server::start(&body);
    assert!(srv.signal_and_wait(libc::SIGTERM, Duration::from_secs(30)).success(), "{}", srv.log_text());
    for p in &mut peers {
        p.kill();
    }
    let hung = SilentServers::start(&socks);
    let data_dir = std::mem::replace(&mut srv.dir, tempfile::tempdir().unwrap());
    let srv = Server::start_with_config(data_dir, srv.config_path.clone());
    let d = detail(&srv, "m");
    assert_eq!(d["missing"].as_array().map(Vec::len), Some(2), "{d:#}");
    assert!(hung.accepted.lock().len() >= 2, "both servers were connected to");
    assert!(
        hung.overlapped.load(std::sync::atomic::Ordering::Acquire),
        "the second hung server was connected to only after the first connection was given up"
    );
}
