//! sd_notify(3) for `Type=notify` units: `READY=1` once the service serves, `STOPPING=1` when
//! it begins shutting down, `STATUS=` lines for `systemctl status`.
//!
//! The protocol is one datagram per message to the unix socket named by `$NOTIFY_SOCKET`
//! (a path, or `@name` for the abstract namespace). Without the variable every call is a no-op,
//! so `mdkit serve` behaves the same outside systemd. Send errors are logged, never fatal: a
//! missed notification makes systemd time the unit out, which says more than a crash would.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// Environment variable systemd sets for `Type=notify` services.
pub const NOTIFY_SOCKET_ENV: &str = "NOTIFY_SOCKET";

/// Sends `state` (newline-separated `KEY=VALUE` lines) to `$NOTIFY_SOCKET`, if set.
pub fn notify(state: &str) {
    let Some(path) = std::env::var_os(NOTIFY_SOCKET_ENV).filter(|p| !p.is_empty()) else { return };
    if let Err(e) = send(&path.to_string_lossy(), state) {
        tracing::warn!(socket = %path.to_string_lossy(), "sd_notify {state:?} failed: {e}");
    }
}

fn send(path: &str, state: &str) -> std::io::Result<()> {
    let addr = match path.strip_prefix('@') {
        Some(name) => SocketAddr::from_abstract_name(name.as_bytes())?,
        None => SocketAddr::from_pathname(path)?,
    };
    let sock = UnixDatagram::unbound()?;
    let sent_bytes = sock.send_to_addr(state.as_bytes(), &addr)?;
    if sent_bytes != state.len() {
        return Err(std::io::Error::other(format!("short datagram: {sent_bytes} of {} bytes", state.len())));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_one_datagram_to_a_path_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let rx = UnixDatagram::bind(&path).unwrap();
        send(path.to_str().unwrap(), "READY=1\nSTATUS=serving").unwrap();
        let mut buf = [0u8; 64];
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1\nSTATUS=serving");
    }

    #[test]
    fn sends_to_an_abstract_socket() {
        let name = format!("mdkit-notify-test-{}", std::process::id());
        let rx = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
        send(&format!("@{name}"), "STOPPING=1").unwrap();
        let mut buf = [0u8; 64];
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STOPPING=1");
    }
}
