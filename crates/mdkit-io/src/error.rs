//! [`DeviceError`]: the typed error of the member I/O layer.
//!
//! Every backend and decorator reports a failed request as a `DeviceError` inside an
//! `io::Error` (the `BlockDevice` signatures stay `io::Result`): what kind of failure it was
//! ([`IoErrorKind`]), which device, operation, offset and length, the errno when there is one,
//! and whether a fault injector made it up. Layers above classify with [`DeviceError::kind_of`]
//! instead of matching message text; it also maps errors that carry no `DeviceError` (plain
//! errno errors, `io::ErrorKind`s) onto the same kinds.

use std::fmt;
use std::io;

use crate::device::IoOp;

/// What went wrong with a device request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IoErrorKind {
    /// The device reported an I/O error (EIO and the other media/transport errnos).
    Eio,
    /// A read returned fewer bytes than asked for (end of file, truncated backend).
    ShortRead,
    /// A write moved nothing (no progress).
    ShortWrite,
    /// ENOSPC / EDQUOT / EFBIG.
    NoSpace,
    /// EROFS / EPERM / EACCES, or a device opened read-only.
    ReadOnly,
    /// The request itself was invalid (range, alignment): a caller bug, not a device fault.
    InvalidRequest,
    /// The device does not support the operation.
    Unsupported,
    /// The request timed out (ETIMEDOUT).
    Timeout,
    /// The device or the runtime behind it is gone (ESHUTDOWN, ENXIO, ENODEV, a reaper gone).
    Closed,
    /// Anything else.
    Other,
}

impl IoErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            IoErrorKind::Eio => "I/O error",
            IoErrorKind::ShortRead => "short read",
            IoErrorKind::ShortWrite => "short write",
            IoErrorKind::NoSpace => "no space",
            IoErrorKind::ReadOnly => "read-only",
            IoErrorKind::InvalidRequest => "invalid request",
            IoErrorKind::Unsupported => "unsupported",
            IoErrorKind::Timeout => "timeout",
            IoErrorKind::Closed => "device closed",
            IoErrorKind::Other => "error",
        }
    }

    /// The kind an errno stands for.
    pub fn from_errno(errno: i32) -> IoErrorKind {
        match errno {
            libc::ENOSPC | libc::EDQUOT | libc::EFBIG => IoErrorKind::NoSpace,
            libc::EROFS | libc::EPERM | libc::EACCES => IoErrorKind::ReadOnly,
            libc::EINVAL => IoErrorKind::InvalidRequest,
            libc::EOPNOTSUPP => IoErrorKind::Unsupported,
            libc::ETIMEDOUT => IoErrorKind::Timeout,
            libc::ESHUTDOWN | libc::ENXIO | libc::ENODEV => IoErrorKind::Closed,
            _ => IoErrorKind::Eio,
        }
    }

    /// The `io::ErrorKind` an `io::Error` carrying this kind presents.
    pub fn io_kind(self) -> io::ErrorKind {
        match self {
            IoErrorKind::Eio | IoErrorKind::Other => io::ErrorKind::Other,
            IoErrorKind::ShortRead => io::ErrorKind::UnexpectedEof,
            IoErrorKind::ShortWrite => io::ErrorKind::WriteZero,
            IoErrorKind::NoSpace => io::ErrorKind::StorageFull,
            IoErrorKind::ReadOnly => io::ErrorKind::PermissionDenied,
            IoErrorKind::InvalidRequest => io::ErrorKind::InvalidInput,
            IoErrorKind::Unsupported => io::ErrorKind::Unsupported,
            IoErrorKind::Timeout => io::ErrorKind::TimedOut,
            IoErrorKind::Closed => io::ErrorKind::BrokenPipe,
        }
    }

    fn from_io_kind(k: io::ErrorKind) -> IoErrorKind {
        match k {
            io::ErrorKind::UnexpectedEof => IoErrorKind::ShortRead,
            io::ErrorKind::WriteZero => IoErrorKind::ShortWrite,
            io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded | io::ErrorKind::FileTooLarge => {
                IoErrorKind::NoSpace
            }
            io::ErrorKind::ReadOnlyFilesystem | io::ErrorKind::PermissionDenied => IoErrorKind::ReadOnly,
            io::ErrorKind::InvalidInput => IoErrorKind::InvalidRequest,
            io::ErrorKind::Unsupported => IoErrorKind::Unsupported,
            io::ErrorKind::TimedOut => IoErrorKind::Timeout,
            io::ErrorKind::BrokenPipe | io::ErrorKind::NotConnected => IoErrorKind::Closed,
            _ => IoErrorKind::Eio,
        }
    }
}

/// A failed device request. See the module documentation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceError {
    pub kind: IoErrorKind,
    pub device: String,
    pub op: IoOp,
    pub offset_bytes: u64,
    pub len_bytes: u64,
    /// The errno, when the failure has one.
    pub errno: Option<i32>,
    /// Made up by a fault injector ([`crate::FaultyDevice`]).
    pub injected: bool,
    /// Further detail ("end of file after 4096 bytes", "pulled disk", ...).
    pub detail: String,
}

impl DeviceError {
    pub fn new(kind: IoErrorKind, device: &str, op: IoOp, offset_bytes: u64, len_bytes: u64) -> DeviceError {
        DeviceError {
            kind,
            device: device.to_string(),
            op,
            offset_bytes,
            len_bytes,
            errno: None,
            injected: false,
            detail: String::new(),
        }
    }

    /// A failure with `errno`; the kind follows from it.
    pub fn errno(device: &str, op: IoOp, offset_bytes: u64, len_bytes: u64, errno: i32) -> DeviceError {
        DeviceError {
            errno: Some(errno),
            ..DeviceError::new(IoErrorKind::from_errno(errno), device, op, offset_bytes, len_bytes)
        }
    }

    pub fn detail(mut self, d: impl Into<String>) -> DeviceError {
        self.detail = d.into();
        self
    }

    pub fn injected(mut self) -> DeviceError {
        self.injected = true;
        self
    }

    /// The `DeviceError` inside an `io::Error`, if it carries one (at any depth of wrapping
    /// that keeps the source: `io::Error::new(kind, DeviceError)` or an error whose
    /// `source()` chain reaches one).
    pub fn of(e: &io::Error) -> Option<&DeviceError> {
        let mut cur: Option<&(dyn std::error::Error + 'static)> = e.get_ref().map(|r| r as _);
        while let Some(err) = cur {
            if let Some(d) = err.downcast_ref::<DeviceError>() {
                return Some(d);
            }
            cur = err.source();
        }
        None
    }

    /// The kind of any `io::Error`: the carried `DeviceError`'s, else from its errno, else from
    /// its `io::ErrorKind`.
    pub fn kind_of(e: &io::Error) -> IoErrorKind {
        if let Some(d) = DeviceError::of(e) {
            return d.kind;
        }
        match e.raw_os_error() {
            Some(errno) => IoErrorKind::from_errno(errno),
            None => IoErrorKind::from_io_kind(e.kind()),
        }
    }

    /// The errno of any `io::Error`, when it has one.
    pub fn errno_of(e: &io::Error) -> Option<i32> {
        e.raw_os_error().or_else(|| DeviceError::of(e).and_then(|d| d.errno))
    }
}

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} of {} bytes at offset {}: ",
            self.device,
            self.op.as_str(),
            self.len_bytes,
            self.offset_bytes
        )?;
        if self.injected {
            f.write_str("injected fault: ")?;
        }
        match self.errno {
            Some(errno) => write!(f, "{}", io::Error::from_raw_os_error(errno))?,
            None => f.write_str(self.kind.as_str())?,
        }
        if !self.detail.is_empty() {
            write!(f, " ({})", self.detail)?;
        }
        Ok(())
    }
}

impl std::error::Error for DeviceError {}

impl From<DeviceError> for io::Error {
    fn from(e: DeviceError) -> io::Error {
        let kind = match e.errno {
            Some(errno) => io::Error::from_raw_os_error(errno).kind(),
            None => e.kind.io_kind(),
        };
        io::Error::new(kind, e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_survive_the_io_error_and_plain_errors_classify_too() {
        let e: io::Error = DeviceError::errno("m0", IoOp::Write, 4096, 512, libc::ENOSPC).into();
        assert_eq!(DeviceError::kind_of(&e), IoErrorKind::NoSpace);
        assert_eq!(DeviceError::errno_of(&e), Some(libc::ENOSPC));
        assert_eq!(e.kind(), io::ErrorKind::StorageFull);
        assert_eq!(
            e.to_string(),
            format!("m0: write of 512 bytes at offset 4096: {}", io::Error::from_raw_os_error(libc::ENOSPC))
        );
        let d = DeviceError::of(&e).expect("typed");
        assert_eq!((d.op, d.offset_bytes, d.injected), (IoOp::Write, 4096, false));

        let short: io::Error =
            DeviceError::new(IoErrorKind::ShortRead, "m1", IoOp::Read, 0, 8192).detail("4096 bytes").into();
        assert_eq!(DeviceError::kind_of(&short), IoErrorKind::ShortRead);
        assert_eq!(short.kind(), io::ErrorKind::UnexpectedEof);

        assert_eq!(DeviceError::kind_of(&io::Error::from_raw_os_error(libc::EIO)), IoErrorKind::Eio);
        assert_eq!(DeviceError::kind_of(&io::Error::from_raw_os_error(libc::ETIMEDOUT)), IoErrorKind::Timeout);
        assert_eq!(DeviceError::kind_of(&io::Error::new(io::ErrorKind::UnexpectedEof, "x")), IoErrorKind::ShortRead);
        assert_eq!(DeviceError::kind_of(&io::Error::other("x")), IoErrorKind::Eio);
        assert!(DeviceError::of(&io::Error::other("x")).is_none());
    }

    #[test]
    fn found_through_a_wrapping_error_source() {
        #[derive(Debug)]
        struct Wrap(DeviceError);
        impl fmt::Display for Wrap {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "wrapped: {}", self.0)
            }
        }
        impl std::error::Error for Wrap {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let e = io::Error::other(Wrap(DeviceError::errno("m0", IoOp::Read, 0, 512, libc::EIO).injected()));
        assert_eq!(DeviceError::of(&e).map(|d| d.injected), Some(true));
        assert_eq!(DeviceError::kind_of(&e), IoErrorKind::Eio);
    }
}
