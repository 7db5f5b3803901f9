//! The NBD member backend against real servers: nbdkit (file plugin, on a Unix socket, with
//! and without structured replies, with a 4 KiB minimum block, slowed by its delay filter)
//! and qemu-nbd (TCP loopback, named export). Data written through the client is checked in
//! the backing file; killing the server under load fails every request in flight with the
//! typed `Disconnected` error, later requests fail at once, and the device reconnects by
//! itself once a server listens again; a request the server does not answer in time fails
//! with `Timeout`.

use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mdkit_io::nbd_client::NbdClientOptions;
use mdkit_io::{
    BlockDevice, BlockDeviceExt, IoBuf, NbdClientError, NbdDevice, NbdErrorKind, SharedBuf, WriteFlags, ZeroFlags,
};

fn require_tool(tool: &str, package: &str) {
    let found = std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()));
    assert!(found, "`{tool}` not found: install the Debian package `{package}`");
}

/// A server process, killed on drop.
struct Peer {
    child: Child,
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn wait_for(what: &str, mut ready: impl FnMut() -> bool) {
    let t = Instant::now();
    while !ready() {
        assert!(t.elapsed() < Duration::from_secs(20), "{what} not ready");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `nbdkit [args] -U SOCKET` in the foreground, once its socket exists.
fn nbdkit(socket: &Path, args: &[&str]) -> Peer {
    require_tool("nbdkit", "nbdkit");
    let _ = std::fs::remove_file(socket);
    let child = Command::new("nbdkit")
        .args(["-f", "-U"])
        .arg(socket)
        .args(args)
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn nbdkit");
    // The socket file appears at bind(), before listen(): wait until it takes connections.
    wait_for("nbdkit", || std::os::unix::net::UnixStream::connect(socket).is_ok());
    Peer { child }
}

fn sparse_file(dir: &Path, name: &str, size: u64) -> PathBuf {
    let p = dir.join(name);
    std::fs::File::create(&p).unwrap().set_len(size).unwrap();
    p
}

fn unix_uri(export: &str, socket: &Path) -> String {
    format!("nbd+unix:///{export}?socket={}", socket.display())
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 9) as u8).collect()
}

fn file_at(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    std::fs::File::open(path).unwrap().read_exact_at(&mut v, offset).unwrap();
    v
}

fn kind_of(e: &io::Error) -> Option<NbdErrorKind> {
    NbdClientError::of(e).map(|n| n.kind)
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// Writes (plain and FUA), reads back, checks the backing file, trims and zeroes.
async fn exercise(dev: &NbdDevice, backing: &Path) {
    let a = pattern(1, 64 << 10);
    let b = pattern(2, 4096);
    dev.write_slice(0, &a, WriteFlags::NONE).await.unwrap();
    dev.write_slice(1 << 20, &b, WriteFlags::FUA).await.unwrap();
    dev.flush().await.unwrap();
    assert_eq!(dev.read_vec(0, a.len()).await.unwrap(), a);
    assert_eq!(dev.read_vec(1 << 20, b.len()).await.unwrap(), b);
    assert_eq!(file_at(backing, 0, a.len()), a, "data reached the server's file");
    assert_eq!(file_at(backing, 1 << 20, b.len()), b);
    // Many requests at once, more than the in-flight bound.
    let writes = (0..200u64).map(|i| {
        let data = pattern(i as u8, 4096);
        async move { dev.write_slice((2 << 20) + i * 4096, &data, WriteFlags::NONE).await }
    });
    for r in futures_join(writes).await {
        r.unwrap();
    }
    for i in [0u64, 77, 199] {
        assert_eq!(dev.read_vec((2 << 20) + i * 4096, 4096).await.unwrap(), pattern(i as u8, 4096));
    }
    let topo = dev.topology();
    if topo.supports_write_zeroes {
        dev.write_zeroes(0, 8192, ZeroFlags { fua: true, no_unmap: true }).await.unwrap();
        assert!(dev.read_vec(0, 8192).await.unwrap().iter().all(|&x| x == 0));
        assert_eq!(dev.read_vec(8192, 4096).await.unwrap(), a[8192..12288]);
    }
    if topo.supports_discard {
        dev.discard(16384, 16384).await.unwrap();
    }
    // Out of range: refused locally, nothing sent, the link stays up.
    let e = dev.read(topo.size_bytes, IoBuf::zeroed(4096)).await.1.unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    assert!(dev.link().up);
}

/// Joins futures on the current task (no extra dependency).
async fn futures_join<F: std::future::Future>(futs: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let handles: Vec<_> = futs.into_iter().map(Box::pin).collect();
    let mut out = Vec::with_capacity(handles.len());
    let mut pending: Vec<Option<std::pin::Pin<Box<F>>>> = handles.into_iter().map(Some).collect();
    let mut results: Vec<Option<F::Output>> = (0..pending.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut all = true;
        for (slot, res) in pending.iter_mut().zip(results.iter_mut()) {
            if let Some(f) = slot {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => {
                        *res = Some(v);
                        *slot = None;
                    }
                    std::task::Poll::Pending => all = false,
                }
            }
        }
        if all { std::task::Poll::Ready(()) } else { std::task::Poll::Pending }
    })
    .await;
    out.extend(results.into_iter().map(|r| r.expect("completed")));
    out
}

fn small_opts() -> NbdClientOptions {
    NbdClientOptions { max_in_flight: 8, ..NbdClientOptions::default() }
}

#[test]
fn nbdkit_file_over_unix_socket_with_and_without_structured_replies() {
    let dir = tempfile::tempdir().unwrap();
    let file = sparse_file(dir.path(), "remote.img", 16 << 20);
    let sock = dir.path().join("nbdkit.sock");
    for extra in [&[][..], &["--no-sr"][..]] {
        let mut args = extra.to_vec();
        args.extend(["file", file.to_str().unwrap()]);
        let _srv = nbdkit(&sock, &args);
        rt().block_on(async {
            let dev = NbdDevice::connect(&unix_uri("", &sock), small_opts()).await.unwrap();
            assert_eq!(dev.export_info().structured_replies, extra.is_empty(), "{extra:?}");
            let t = dev.topology();
            assert_eq!((t.size_bytes, t.logical_block_bytes), (16 << 20, 512));
            assert!(t.supports_fua && t.volatile_cache && t.supports_write_zeroes && t.supports_discard, "{t:?}");
            exercise(&dev, &file).await;
        });
    }
}

#[test]
fn block_size_from_nbd_info_block_size() {
    let dir = tempfile::tempdir().unwrap();
    let file = sparse_file(dir.path(), "remote.img", 8 << 20);
    let sock = dir.path().join("nbdkit.sock");
    let args = [
        "--filter=blocksize-policy",
        "file",
        file.to_str().unwrap(),
        "blocksize-minimum=4096",
        "blocksize-preferred=65536",
        "blocksize-maximum=1048576",
    ];
    let _srv = nbdkit(&sock, &args);
    rt().block_on(async {
        let dev = NbdDevice::connect(&unix_uri("", &sock), small_opts()).await.unwrap();
        let t = dev.topology();
        assert_eq!((t.logical_block_bytes, t.optimal_io_bytes, t.max_io_bytes), (4096, 65536, 1 << 20), "{t:?}");
        // Below the export's minimum block: refused locally.
        let e = dev.write_slice(512, &[1u8; 512], WriteFlags::NONE).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        exercise(&dev, &file).await;
    });
}

#[test]
fn qemu_nbd_named_export_over_tcp_loopback() {
    require_tool("qemu-nbd", "qemu-utils");
    let dir = tempfile::tempdir().unwrap();
    let file = sparse_file(dir.path(), "remote.img", 16 << 20);
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let child = Command::new("qemu-nbd")
        .args(["-f", "raw", "-x", "mirror", "-b", "127.0.0.1", "-p", &port.to_string(), "-t", "--cache=none"])
        .arg(&file)
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn qemu-nbd");
    let _srv = Peer { child };
    wait_for("qemu-nbd", || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
    rt().block_on(async {
        let uri = format!("nbd://127.0.0.1:{port}/mirror");
        let dev = NbdDevice::connect(&uri, small_opts()).await.unwrap();
        assert!(dev.export_info().structured_replies);
        exercise(&dev, &file).await;
        drop(dev);
        let e = NbdDevice::connect(&format!("nbd://127.0.0.1:{port}/nosuch"), small_opts()).await.err().unwrap();
        assert_eq!(e.kind, NbdErrorKind::ExportRefused, "{e}");
        assert!(e.to_string().contains("nosuch"), "{e}");
    });
}

#[test]
fn connect_errors_are_typed_and_name_the_target() {
    let dir = tempfile::tempdir().unwrap();
    rt().block_on(async {
        let uri = unix_uri("x", &dir.path().join("nobody.sock"));
        let e = NbdDevice::connect(&uri, small_opts()).await.err().unwrap();
        assert_eq!(e.kind, NbdErrorKind::Connect);
        assert!(e.to_string().starts_with(&uri), "{e}");
        let e = NbdDevice::connect("nbds://h/x", small_opts()).await.err().unwrap();
        assert_eq!(e.kind, NbdErrorKind::InvalidUri);
        // Not an NBD server: a listener that says something else.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            let (mut s, _) = l.accept().await.unwrap();
            let _ = s.write_all(b"SSH-2.0-OpenSSH_9.2\r\n").await;
        });
        let e = NbdDevice::connect(&format!("nbd://127.0.0.1:{port}/"), small_opts()).await.err().unwrap();
        assert_eq!(e.kind, NbdErrorKind::Handshake);
        assert!(e.to_string().contains("not an NBD server"), "{e}");
    });
}

#[test]
fn server_killed_under_load_fails_requests_fast_then_reconnects() {
    let dir = tempfile::tempdir().unwrap();
    let file = sparse_file(dir.path(), "remote.img", 16 << 20);
    let sock = dir.path().join("nbdkit.sock");
    let srv = nbdkit(&sock, &["file", file.to_str().unwrap()]);
    let rt = rt();
    let dev = Arc::new(rt.block_on(NbdDevice::connect(&unix_uri("", &sock), small_opts())).unwrap());
    // Writers that run until the link drops.
    use std::sync::atomic::{AtomicU64, Ordering};
    let done: Arc<Vec<AtomicU64>> = Arc::new((0..8).map(|_| AtomicU64::new(0)).collect());
    let mut writers = Vec::new();
    for w in 0..8u64 {
        let (dev, done) = (dev.clone(), done.clone());
        writers.push(rt.spawn(async move {
            for i in 0u64.. {
                let off = (w * 256 + i % 256) * 4096;
                if let Err(e) = dev.write(off, SharedBuf::from_slice(&pattern(w as u8, 4096)), WriteFlags::NONE).await {
                    return e;
                }
                done[w as usize].fetch_add(1, Ordering::Relaxed);
            }
            unreachable!("writes until the link drops")
        }));
    }
    // Every writer has written some, then the server dies under them.
    wait_for("writes", || done.iter().all(|d| d.load(Ordering::Relaxed) >= 10));
    drop(srv);
    let errors: Vec<io::Error> = rt.block_on(async {
        let mut v = Vec::new();
        for w in writers {
            v.push(w.await.unwrap());
        }
        v
    });
    for e in &errors {
        assert_eq!(kind_of(e), Some(NbdErrorKind::Disconnected), "{e}");
        assert_eq!(e.kind(), io::ErrorKind::NotConnected);
    }
    let link = dev.link();
    assert!(!link.up && link.losses == 1, "{link:?}");
    assert_eq!((link.outstanding_requests, link.outstanding_bytes), (0, 0), "failed requests are not outstanding");
    assert!(link.last_contact_unix_ms > 0, "replies before the loss were contact: {link:?}");
    // While down: requests fail at once, typed.
    let (buf, r) = rt.block_on(dev.read(0, IoBuf::zeroed(4096)));
    assert_eq!((buf.len(), kind_of(&r.unwrap_err())), (4096, Some(NbdErrorKind::Disconnected)));
    // A server on the same socket again: the device reconnects by itself.
    let _srv = nbdkit(&sock, &["file", file.to_str().unwrap()]);
    wait_for("reconnect", || dev.link().up);
    assert_eq!(dev.link().reconnects, 1);
    rt.block_on(async {
        dev.write_slice(0, &pattern(9, 4096), WriteFlags::FUA).await.unwrap();
        assert_eq!(dev.read_vec(0, 4096).await.unwrap(), pattern(9, 4096));
    });
}

#[test]
fn unanswered_request_times_out_and_the_link_is_rebuilt() {
    let dir = tempfile::tempdir().unwrap();
    let file = sparse_file(dir.path(), "remote.img", 4 << 20);
    let sock = dir.path().join("nbdkit.sock");
    // Reads take 30 s; writes are immediate.
    let _srv = nbdkit(&sock, &["--filter=delay", "file", file.to_str().unwrap(), "rdelay=30"]);
    let opts = NbdClientOptions { request_timeout: Duration::from_millis(300), ..small_opts() };
    rt().block_on(async {
        let dev = NbdDevice::connect(&unix_uri("", &sock), opts).await.unwrap();
        dev.write_slice(0, &pattern(3, 4096), WriteFlags::NONE).await.unwrap();
        let (buf, r) = dev.read(0, IoBuf::zeroed(4096)).await;
        let e = r.unwrap_err();
        assert_eq!((buf.len(), kind_of(&e), e.kind()), (4096, Some(NbdErrorKind::Timeout), io::ErrorKind::TimedOut));
        let link = dev.link();
        assert!(link.losses == 1, "a timed-out request drops the connection: {link:?}");
        let t = Instant::now();
        while !dev.link().up {
            assert!(t.elapsed() < Duration::from_secs(20), "no reconnect");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        dev.write_slice(4096, &pattern(4, 4096), WriteFlags::FUA).await.unwrap();
        assert_eq!(file_at(&file, 4096, 4096), pattern(4, 4096));
        // A read the server sits on is outstanding (with its bytes) until it times out.
        let (r, seen) = tokio::join!(dev.read(8192, IoBuf::zeroed(4096)), async {
            let mut seen = (0, 0);
            while dev.link().outstanding_requests == 0 && dev.link().losses == 1 {
                tokio::task::yield_now().await;
            }
            let l = dev.link();
            if l.losses == 1 {
                seen = (l.outstanding_requests, l.outstanding_bytes);
            }
            seen
        });
        assert!(r.1.is_err());
        assert_eq!(seen, (1, 4096), "the hung read, outstanding");
        let l = dev.link();
        assert_eq!((l.outstanding_requests, l.outstanding_bytes), (0, 0));
    });
}

/// A server shutting down answers ESHUTDOWN (nbdkit on SIGTERM with requests in flight). The
/// NBD spec asks the client to disconnect: the request fails as on a lost link (typed
/// `Disconnected`, not a server error that would fail an md member for good), the connection
/// closes (so the server can exit) and the device reconnects by itself.
#[test]
fn eshutdown_drops_the_link_and_the_device_reconnects() {
    let dir = tempfile::tempdir().unwrap();
    let file = sparse_file(dir.path(), "remote.img", 4 << 20);
    let sock = dir.path().join("nbdkit.sock");
    let trigger = dir.path().join("shutting-down");
    let error_file = format!("error-file={}", trigger.display());
    let args = ["--filter=error", "file", file.to_str().unwrap(), "error=ESHUTDOWN", "error-rate=1", &error_file];
    let _srv = nbdkit(&sock, &args);
    rt().block_on(async {
        let dev = NbdDevice::connect(&unix_uri("", &sock), small_opts()).await.unwrap();
        dev.write_slice(0, &pattern(1, 4096), WriteFlags::NONE).await.unwrap();
        std::fs::write(&trigger, b"").unwrap();
        let e = dev.write_slice(4096, &pattern(2, 4096), WriteFlags::NONE).await.unwrap_err();
        assert_eq!(kind_of(&e), Some(NbdErrorKind::Disconnected), "{e}");
        assert!(e.to_string().contains("ESHUTDOWN"), "{e}");
        let link = dev.link();
        assert_eq!(link.losses, 1, "{link:?}");
        std::fs::remove_file(&trigger).unwrap();
        let t = Instant::now();
        while !dev.link().up {
            assert!(t.elapsed() < Duration::from_secs(20), "no reconnect: {:?}", dev.link());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        dev.write_slice(4096, &pattern(3, 4096), WriteFlags::FUA).await.unwrap();
        assert_eq!(file_at(&file, 4096, 4096), pattern(3, 4096));
    });
}
