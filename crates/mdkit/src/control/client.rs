//! Client side of the control socket, used by the CLI verbs (blocking; one request at a time).

use std::io::{BufRead, BufReader, Read};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use serde_json::Value;

use super::{Request, Response};

/// Longest response accepted (status of many volumes stays far below this).
const RESPONSE_MAX_BYTES: u64 = 64 << 20;

pub struct ControlClient {
    path: PathBuf,
    /// How long one read or write may wait (`--timeout-s`).
    timeout: Duration,
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl ControlClient {
    pub fn connect(path: &Path, timeout: Duration) -> Result<ControlClient> {
        let s = UnixStream::connect(path).with_context(|| {
            format!("connecting to the mdkit control socket {} (is `mdkit serve` running?)", path.display())
        })?;
        s.set_read_timeout(Some(timeout))?;
        s.set_write_timeout(Some(timeout))?;
        let writer = s.try_clone()?;
        Ok(ControlClient { path: path.to_path_buf(), timeout, reader: BufReader::new(s), writer })
    }

    /// Sends one command and returns its result, or the server's error as an `Err`.
    pub fn call(&mut self, cmd: &str, args: Value) -> Result<Value> {
        let mut line = serde_json::to_vec(&Request { cmd: cmd.to_string(), args })?;
        line.push(b'\n');
        if let Err(e) = send_all(&self.writer, &line) {
            // A service that refused or closed this connection said why before closing; that
            // answer is still in the socket.
            if let Some(refusal) = self.leftover_error() {
                return Err(anyhow!("{}: {refusal}", self.path.display()));
            }
            return Err(anyhow::Error::new(e).context(format!("sending {cmd:?} to {}", self.path.display())));
        }
        let mut resp = Vec::new();
        (&mut self.reader)
            .take(RESPONSE_MAX_BYTES)
            .read_until(b'\n', &mut resp)
            .map_err(|e| self.read_error(cmd, e))?;
        if resp.is_empty() {
            return Err(anyhow!("{}: connection closed without a response to {cmd:?}", self.path.display()));
        }
        let resp: Response = serde_json::from_slice(&resp).context("malformed response from the control socket")?;
        if resp.ok {
            Ok(resp.result.unwrap_or(Value::Null))
        } else {
            Err(anyhow!("{}", resp.error.unwrap_or_else(|| "unknown error".into())))
        }
    }

    /// The error line the service left before closing the connection, if any.
    fn leftover_error(&mut self) -> Option<String> {
        let mut resp = Vec::new();
        (&mut self.reader).take(RESPONSE_MAX_BYTES).read_until(b'\n', &mut resp).ok()?;
        let resp: Response = serde_json::from_slice(&resp).ok()?;
        if resp.ok { None } else { resp.error }
    }

    /// A failed read of the answer to `cmd`. The socket's read timeout surfaces as EAGAIN
    /// ("Resource temporarily unavailable"), which says nothing about waiting: name the
    /// timeout and the flag that sets it instead.
    fn read_error(&self, cmd: &str, e: std::io::Error) -> anyhow::Error {
        if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
            return anyhow!(
                "{}: timed out: no answer to {cmd:?} within {} s (--timeout-s sets the limit)",
                self.path.display(),
                self.timeout.as_secs()
            );
        }
        anyhow::Error::new(e).context(format!("reading the answer to {cmd:?} from {}", self.path.display()))
    }
}

/// Writes all of `buf` with MSG_NOSIGNAL: a service that closed the socket is an EPIPE error,
/// not a SIGPIPE (the CLI keeps SIGPIPE's default action for its stdout).
fn send_all(sock: &UnixStream, mut buf: &[u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        // SAFETY: the fd is open for the life of `sock`; ptr/len describe the live slice `buf`.
        let n = unsafe { libc::send(sock.as_raw_fd(), buf.as_ptr().cast(), buf.len(), libc::MSG_NOSIGNAL) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        // n >= 0 and at most buf.len() (send(2)).
        buf = &buf[n as usize..];
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A service that refuses the connection (socket full) writes why and closes before the
    /// request arrives: the CLI reports that, not "Broken pipe".
    #[test]
    fn a_refusal_before_the_request_is_reported_not_a_broken_pipe() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mdkit.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let mut client = ControlClient::connect(&path, Duration::from_secs(60)).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        let refusal = "the control socket has 64 clients, the most it takes; 64 are running commands";
        server.write_all(format!("{{\"ok\":false,\"error\":\"{refusal}\"}}\n").as_bytes()).unwrap();
        drop(server);
        let e = format!("{:#}", client.call("status", Value::Null).unwrap_err());
        assert!(e.contains(refusal), "{e}");
    }
}
