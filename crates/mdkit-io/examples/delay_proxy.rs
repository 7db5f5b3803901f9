//! A TCP proxy on 127.0.0.1 that holds every server→client byte back by a round-trip time:
//! the added network latency for bench/remote.sh (this kernel has no netem).
//!
//!   cargo run --release -p mdkit-io --example delay_proxy -- LISTEN_PORT UPSTREAM_PORT RTT_MS
//!
//! The whole delay goes on the replies, as in the test suite's proxy (remote_link.rs): a
//! request is answered RTT later than without the proxy. Plain threads and `thread::sleep`
//! (nanosleep), three per connection: tokio's timer ticks in whole milliseconds, which turned
//! a 1 ms round trip into 4 ms. It replaced a Python asyncio proxy that capped fio at 11,294
//! 4 KiB writes/s at 1 ms (QD32 allows 32,000).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::mpsc::sync_channel;
use std::thread;
use std::time::{Duration, Instant};

/// Reply pieces read but not yet forwarded, per connection (backpressure beyond).
const QUEUED_PIECES_MAX: usize = 4096;

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let [_, listen, upstream, rtt_ms] = &args[..] else {
        eprintln!("usage: delay_proxy LISTEN_PORT UPSTREAM_PORT RTT_MS");
        std::process::exit(2);
    };
    let (Ok(listen), Ok(upstream), Ok(rtt_ms)) =
        (listen.parse::<u16>(), upstream.parse::<u16>(), rtt_ms.parse::<f64>())
    else {
        eprintln!("delay_proxy: ports must be 1-65535 and RTT_MS a number of milliseconds");
        std::process::exit(2);
    };
    let rtt = Duration::from_secs_f64(rtt_ms.max(0.0) / 1000.0);
    for client in TcpListener::bind(("127.0.0.1", listen))?.incoming() {
        let Ok(client) = client else { continue };
        let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else { continue };
        let _ = (client.set_nodelay(true), server.set_nodelay(true));
        proxy(client, server, rtt)?;
    }
    Ok(())
}

/// Starts the threads of one connection: requests straight through, replies `rtt` late.
fn proxy(client: TcpStream, server: TcpStream, rtt: Duration) -> std::io::Result<()> {
    let (mut up_from, mut up_to) = (client.try_clone()?, server.try_clone()?);
    thread::spawn(move || {
        let _ = std::io::copy(&mut up_from, &mut up_to);
        let _ = up_to.shutdown(Shutdown::Both);
    });
    let (tx, rx) = sync_channel::<(Instant, Vec<u8>)>(QUEUED_PIECES_MAX);
    let mut down_from = server;
    thread::spawn(move || {
        let mut buf = vec![0u8; 256 << 10];
        while let Ok(n) = down_from.read(&mut buf) {
            if n == 0 || tx.send((Instant::now() + rtt, buf[..n].to_vec())).is_err() {
                break;
            }
        }
    });
    let mut down_to = client;
    thread::spawn(move || {
        for (due, data) in rx {
            thread::sleep(due.saturating_duration_since(Instant::now()));
            if down_to.write_all(&data).is_err() {
                break;
            }
        }
        let _ = down_to.shutdown(Shutdown::Both);
    });
    Ok(())
}
