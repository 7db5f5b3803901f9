//! NBD encoders and the error mapping of the server; the wire constants are mdkit-io's
//! [`mdkit_io::nbd_wire`] (one copy, shared with the member client), re-exported here.

use mdkit_io::{DeviceError, IoErrorKind};

pub use mdkit_io::nbd_wire::*;

/// Maps a device error onto the protocol's error set. The protocol says: ENOSPC for
/// EDQUOT/EFBIG/ENOSPC, EPERM for read-only media, EINVAL for bad arguments; never ENOTSUP
/// (reserved for FAST_ZERO) and preferably never ENOMEM. Classified by the io layer's typed
/// error ([`DeviceError::kind_of`]), which also covers plain errno and `io::ErrorKind` errors.
pub fn errno_from_io(e: &std::io::Error) -> u32 {
    match DeviceError::kind_of(e) {
        IoErrorKind::NoSpace => ENOSPC,
        IoErrorKind::ReadOnly => EPERM,
        IoErrorKind::InvalidRequest | IoErrorKind::Unsupported => EINVAL,
        _ => EIO,
    }
}

/// Human name of a command type, for logs and errors.
pub fn command_name(kind: u16) -> &'static str {
    match kind {
        CMD_READ => "READ",
        CMD_WRITE => "WRITE",
        CMD_DISC => "DISC",
        CMD_FLUSH => "FLUSH",
        CMD_TRIM => "TRIM",
        5 => "CACHE",
        CMD_WRITE_ZEROES => "WRITE_ZEROES",
        CMD_BLOCK_STATUS => "BLOCK_STATUS",
        _ => "unknown",
    }
}

//------------------------------------------------------------------------------------------------
// Encoders

/// Appends an option reply (magic, option, type, length, data).
pub fn put_option_reply(out: &mut Vec<u8>, option: u32, reply_type: u32, data: &[u8]) {
    out.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply_type.to_be_bytes());
    let len = u32::try_from(data.len()).expect("option reply data is built by us and small");
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(data);
}

/// A simple reply header (16 bytes).
pub fn simple_reply(error: u32, cookie: u64) -> [u8; SIMPLE_REPLY_BYTES] {
    let mut h = [0u8; SIMPLE_REPLY_BYTES];
    h[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    h[4..8].copy_from_slice(&error.to_be_bytes());
    h[8..16].copy_from_slice(&cookie.to_be_bytes());
    h
}

/// A structured reply chunk header (20 bytes).
pub fn structured_header(flags: u16, chunk_type: u16, cookie: u64, payload_len: u32) -> [u8; STRUCTURED_HEADER_BYTES] {
    let mut h = [0u8; STRUCTURED_HEADER_BYTES];
    h[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    h[4..6].copy_from_slice(&flags.to_be_bytes());
    h[6..8].copy_from_slice(&chunk_type.to_be_bytes());
    h[8..16].copy_from_slice(&cookie.to_be_bytes());
    h[16..20].copy_from_slice(&payload_len.to_be_bytes());
    h
}

/// A parsed request header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestHeader {
    pub magic: u32,
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub offset_bytes: u64,
    pub len_bytes: u32,
}

impl RequestHeader {
    pub fn parse(b: &[u8; REQUEST_HEADER_BYTES]) -> RequestHeader {
        let u16_at = |i: usize| u16::from_be_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| u64::from_be_bytes(b[i..i + 8].try_into().expect("8 bytes inside a 28-byte array"));
        RequestHeader {
            magic: u32_at(0),
            flags: u16_at(4),
            kind: u16_at(6),
            cookie: u64_at(8),
            offset_bytes: u64_at(16),
            len_bytes: u32_at(24),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mdkit_io::IoOp;

    #[test]
    fn request_header_parses_big_endian_fields() {
        let mut b = [0u8; REQUEST_HEADER_BYTES];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&CMD_FLAG_FUA.to_be_bytes());
        b[6..8].copy_from_slice(&CMD_WRITE.to_be_bytes());
        b[8..16].copy_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        b[16..24].copy_from_slice(&4096u64.to_be_bytes());
        b[24..28].copy_from_slice(&512u32.to_be_bytes());
        let h = RequestHeader::parse(&b);
        assert_eq!(h.magic, REQUEST_MAGIC);
        assert_eq!((h.flags, h.kind, h.cookie), (CMD_FLAG_FUA, CMD_WRITE, 0x0102_0304_0506_0708));
        assert_eq!((h.offset_bytes, h.len_bytes), (4096, 512));
    }

    #[test]
    fn reply_encoders_match_the_spec_layout() {
        let s = simple_reply(EINVAL, 7);
        assert_eq!(&s[0..4], &[0x67, 0x44, 0x66, 0x98]);
        assert_eq!(u32::from_be_bytes(s[4..8].try_into().unwrap()), 22);
        let h = structured_header(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, 9, 4104);
        assert_eq!(&h[0..4], &[0x66, 0x8e, 0x33, 0xef]);
        assert_eq!(u16::from_be_bytes([h[4], h[5]]), 1);
        assert_eq!(u32::from_be_bytes(h[16..20].try_into().unwrap()), 4104);
        let mut v = Vec::new();
        put_option_reply(&mut v, OPT_GO, REP_ACK, &[]);
        assert_eq!(v.len(), 20);
        assert_eq!(&v[0..8], &OPT_REPLY_MAGIC.to_be_bytes());
    }

    #[test]
    fn io_errors_map_to_protocol_errors() {
        use std::io::{Error, ErrorKind};
        assert_eq!(errno_from_io(&Error::from_raw_os_error(libc::EDQUOT)), ENOSPC);
        assert_eq!(errno_from_io(&Error::from_raw_os_error(libc::EROFS)), EPERM);
        assert_eq!(errno_from_io(&Error::from_raw_os_error(libc::ENOMEM)), EIO);
        assert_eq!(errno_from_io(&Error::new(ErrorKind::InvalidInput, "x")), EINVAL);
        assert_eq!(errno_from_io(&Error::new(ErrorKind::Unsupported, "x")), EINVAL);
        assert_eq!(errno_from_io(&Error::other("x")), EIO);
        // Typed device errors keep their errno through the message-carrying wrapper.
        let full: Error = DeviceError::errno("m0", IoOp::Write, 0, 4096, libc::ENOSPC).into();
        assert_eq!(errno_from_io(&full), ENOSPC);
        let short: Error = DeviceError::new(IoErrorKind::ShortRead, "m0", IoOp::Read, 0, 4096).into();
        assert_eq!(errno_from_io(&short), EIO);
    }
}
