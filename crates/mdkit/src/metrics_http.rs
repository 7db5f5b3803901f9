//! A tiny HTTP/1.1 responder for `GET /metrics` (one request per connection, then close).
//!
//! Bounded: at most [`MAX_CONNECTIONS`] scrapes at once (more wait in the kernel backlog),
//! request head at most [`MAX_REQUEST_BYTES`], and each connection gets [`CONNECTION_TIMEOUT`]
//! for reading the request and writing the answer.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use crate::service::Service;

pub const MAX_CONNECTIONS: usize = 8;
pub const MAX_REQUEST_BYTES: usize = 8192;
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);

/// The running endpoint; stops accepting when dropped. Its address is logged
/// (`metrics endpoint: http://ADDR/metrics`), which is how a port-0 listener is found.
pub struct MetricsServer {
    task: JoinHandle<()>,
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl MetricsServer {
    pub async fn start(addr: SocketAddr, svc: Arc<Service>) -> Result<MetricsServer> {
        let listener = TcpListener::bind(addr).await.with_context(|| format!("metrics listener {addr}"))?;
        let local_addr = listener.local_addr().context("metrics listener address")?;
        tracing::info!(%local_addr, "metrics endpoint: http://{local_addr}/metrics");
        let task = tokio::spawn(accept_loop(listener, svc));
        Ok(MetricsServer { task })
    }
}

async fn accept_loop(listener: TcpListener, svc: Arc<Service>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else { return };
        let (stream, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("metrics: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let svc = svc.clone();
        tokio::spawn(async move {
            if tokio::time::timeout(CONNECTION_TIMEOUT, serve(stream, &svc)).await.is_err() {
                tracing::debug!(%peer, "metrics: connection timed out");
            }
            drop(permit);
        });
    }
}

/// What a request head asks for.
#[derive(Debug, PartialEq, Eq)]
enum Request {
    Metrics { head_only: bool },
    NotFound,
    BadMethod,
    Malformed,
}

fn parse_request(head: &str) -> Request {
    let mut words = head.lines().next().unwrap_or("").split_whitespace();
    let (Some(method), Some(target), Some(version)) = (words.next(), words.next(), words.next()) else {
        return Request::Malformed;
    };
    if !version.starts_with("HTTP/1.") {
        return Request::Malformed;
    }
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        _ => return Request::BadMethod,
    };
    match target.split('?').next() {
        Some("/metrics") => Request::Metrics { head_only },
        _ => Request::NotFound,
    }
}

/// Reads up to the blank line ending the request head; `None` if it is too long or cut off.
async fn read_head(stream: &mut TcpStream) -> Option<String> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && !buf.windows(2).any(|w| w == b"\n\n") {
        if buf.len() >= MAX_REQUEST_BYTES {
            return None;
        }
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    String::from_utf8(buf).ok()
}

async fn serve(mut stream: TcpStream, svc: &Arc<Service>) {
    let request = match read_head(&mut stream).await {
        Some(head) => parse_request(&head),
        None => Request::Malformed,
    };
    let (status, content_type, body, head_only) = match request {
        Request::Metrics { head_only } => match crate::metrics::render(svc).await {
            Ok(text) => ("200 OK", crate::metrics::CONTENT_TYPE, text, head_only),
            Err(e) => {
                tracing::error!("metrics: {e:#}");
                ("500 Internal Server Error", "text/plain", format!("{e:#}\n"), false)
            }
        },
        Request::NotFound => ("404 Not Found", "text/plain", "only /metrics is served\n".into(), false),
        Request::BadMethod => ("405 Method Not Allowed", "text/plain", "use GET\n".into(), false),
        Request::Malformed => ("400 Bad Request", "text/plain", "bad or oversized request\n".into(), false),
    };
    let mut reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    if !head_only {
        reply.push_str(&body);
    }
    let _ = stream.write_all(reply.as_bytes()).await;
    let _ = stream.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_lines_parse() {
        assert_eq!(parse_request("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"), Request::Metrics { head_only: false });
        assert_eq!(parse_request("HEAD /metrics?x=1 HTTP/1.0\r\n\r\n"), Request::Metrics { head_only: true });
        assert_eq!(parse_request("GET / HTTP/1.1\r\n\r\n"), Request::NotFound);
        assert_eq!(parse_request("POST /metrics HTTP/1.1\r\n\r\n"), Request::BadMethod);
        assert_eq!(parse_request("GET /metrics\r\n\r\n"), Request::Malformed);
        assert_eq!(parse_request("\u{0}\u{1}"), Request::Malformed);
    }
}
