//! The NBD client's typed error. It travels inside an `io::Error` (every `BlockDevice`
//! signature stays as it is) with an `io::ErrorKind` chosen so the md layer reacts correctly:
//! a lost link or a timeout is an ordinary I/O failure (the member is failed, failfast), a
//! request the server calls invalid or unsupported is not. Callers recover it with
//! [`NbdClientError::of`].

use std::fmt;
use std::io;

use super::proto;

/// What went wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NbdErrorKind {
    /// The member URI could not be parsed.
    InvalidUri,
    /// No connection could be made (refused, unreachable, connect timeout).
    Connect,
    /// The server broke the handshake rules or offers nothing usable.
    Handshake,
    /// The server refused the export (unknown name, policy, TLS required, read-only).
    ExportRefused,
    /// The connection was lost (or is being re-established): requests in flight at the loss
    /// and requests made while it is down fail with this.
    Disconnected,
    /// A request got no answer within the per-request timeout; the connection was dropped.
    Timeout,
    /// The server answered the request with an error (`errno` as on the wire).
    Server { errno: u32 },
    /// The server sent something the protocol does not allow; the connection was dropped.
    Protocol,
    /// The export does not offer the operation.
    Unsupported,
}

impl NbdErrorKind {
    fn describe(self) -> String {
        match self {
            NbdErrorKind::InvalidUri => "invalid NBD URI".into(),
            NbdErrorKind::Connect => "cannot connect".into(),
            NbdErrorKind::Handshake => "handshake failed".into(),
            NbdErrorKind::ExportRefused => "export refused".into(),
            NbdErrorKind::Disconnected => "link down".into(),
            NbdErrorKind::Timeout => "request timed out".into(),
            NbdErrorKind::Server { errno } => format!("server error {} ({errno})", errno_name(errno)),
            NbdErrorKind::Protocol => "protocol error".into(),
            NbdErrorKind::Unsupported => "not supported by the export".into(),
        }
    }

    /// The `io::ErrorKind` this error is presented with.
    pub fn io_kind(self) -> io::ErrorKind {
        match self {
            NbdErrorKind::InvalidUri => io::ErrorKind::InvalidInput,
            NbdErrorKind::Connect => io::ErrorKind::ConnectionRefused,
            NbdErrorKind::Handshake | NbdErrorKind::Protocol => io::ErrorKind::InvalidData,
            NbdErrorKind::ExportRefused => io::ErrorKind::NotFound,
            NbdErrorKind::Disconnected => io::ErrorKind::NotConnected,
            NbdErrorKind::Timeout => io::ErrorKind::TimedOut,
            NbdErrorKind::Unsupported => io::ErrorKind::Unsupported,
            NbdErrorKind::Server { errno } => match errno {
                proto::EPERM => io::ErrorKind::PermissionDenied,
                proto::EINVAL | proto::EOVERFLOW => io::ErrorKind::InvalidInput,
                proto::ENOSPC => io::ErrorKind::StorageFull,
                proto::ENOTSUP => io::ErrorKind::Unsupported,
                proto::ENOMEM => io::ErrorKind::OutOfMemory,
                _ => io::ErrorKind::Other,
            },
        }
    }
}

/// The wire name of an error value.
pub fn errno_name(errno: u32) -> &'static str {
    match errno {
        proto::EPERM => "EPERM",
        proto::EIO => "EIO",
        proto::ENOMEM => "ENOMEM",
        proto::EINVAL => "EINVAL",
        proto::ENOSPC => "ENOSPC",
        proto::EOVERFLOW => "EOVERFLOW",
        proto::ENOTSUP => "ENOTSUP",
        proto::ESHUTDOWN => "ESHUTDOWN",
        _ => "unknown",
    }
}

/// A failure of the NBD client, naming the target (URI), the operation and the byte offset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NbdClientError {
    pub kind: NbdErrorKind,
    /// The member URI (or the text that failed to parse).
    pub target: String,
    /// "connect", "handshake", "read", "write", "flush", "trim", "write_zeroes".
    pub op: &'static str,
    pub offset_bytes: Option<u64>,
    pub detail: String,
}

impl NbdClientError {
    pub fn new(kind: NbdErrorKind, target: &str, op: &'static str, detail: impl Into<String>) -> NbdClientError {
        NbdClientError { kind, target: target.to_string(), op, offset_bytes: None, detail: detail.into() }
    }

    pub fn at(mut self, offset_bytes: u64) -> NbdClientError {
        self.offset_bytes = Some(offset_bytes);
        self
    }

    /// The client error inside an `io::Error`, if it is one.
    pub fn of(e: &io::Error) -> Option<&NbdClientError> {
        e.get_ref()?.downcast_ref::<NbdClientError>()
    }
}

impl fmt::Display for NbdClientError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.target, self.op)?;
        if let Some(o) = self.offset_bytes {
            write!(f, " at byte {o}")?;
        }
        write!(f, ": {}", self.kind.describe())?;
        if !self.detail.is_empty() {
            write!(f, ": {}", self.detail)?;
        }
        Ok(())
    }
}

impl std::error::Error for NbdClientError {}

impl From<NbdClientError> for io::Error {
    fn from(e: NbdClientError) -> io::Error {
        io::Error::new(e.kind.io_kind(), e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_io_error_with_a_kind_md_acts_on() {
        let e = NbdClientError::new(NbdErrorKind::Disconnected, "nbd://h/x", "write", "connection reset").at(4096);
        let io: io::Error = e.clone().into();
        assert_eq!(io.kind(), io::ErrorKind::NotConnected);
        assert_eq!(NbdClientError::of(&io), Some(&e));
        assert_eq!(io.to_string(), "nbd://h/x: write at byte 4096: link down: connection reset");
        let s: io::Error = NbdClientError::new(NbdErrorKind::Server { errno: 5 }, "u", "read", "").into();
        assert_eq!((s.kind(), s.to_string().as_str()), (io::ErrorKind::Other, "u: read: server error EIO (5)"));
        assert!(NbdClientError::of(&io::Error::other("x")).is_none());
    }
}
