//! NBD wire constants and encoders (NetworkBlockDevice/nbd `doc/proto.md`; all integers are
//! big-endian). Names follow the specification so they can be grepped against it.

use mdkit_io::{DeviceError, IoErrorKind};

//------------------------------------------------------------------------------------------------
// Handshake

/// "NBDMAGIC", first 8 bytes the server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// "IHAVEOPT": newstyle magic, also the prefix of every client option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Prefix of every option reply.
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;

/// Handshake flags (server → client, u16).
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;

/// Client flags (client → server, u32). Any other bit makes the server drop the connection.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;
pub const CLIENT_FLAGS_KNOWN: u32 = FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES;

/// Option types.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

/// Option reply types; errors have bit 31 set.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
pub const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
pub const REP_ERR_INVALID: u32 = (1 << 31) + 3;
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
pub const REP_ERR_SHUTDOWN: u32 = (1 << 31) + 7;
pub const REP_ERR_TOO_BIG: u32 = (1 << 31) + 9;

/// Information types in `NBD_REP_INFO` (requests of `NBD_OPT_INFO` / `NBD_OPT_GO`).
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

//------------------------------------------------------------------------------------------------
// Transmission flags (u16, sent with the export size)

pub const FLAG_HAS_FLAGS: u16 = 1 << 0;
pub const FLAG_READ_ONLY: u16 = 1 << 1;
pub const FLAG_SEND_FLUSH: u16 = 1 << 2;
pub const FLAG_SEND_FUA: u16 = 1 << 3;
pub const FLAG_ROTATIONAL: u16 = 1 << 4;
pub const FLAG_SEND_TRIM: u16 = 1 << 5;
pub const FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const FLAG_SEND_DF: u16 = 1 << 7;
pub const FLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const FLAG_SEND_FAST_ZERO: u16 = 1 << 11;

//------------------------------------------------------------------------------------------------
// Requests and replies

pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Size of a (compact) request header: magic, flags, type, cookie, offset, length.
pub const REQUEST_HEADER_BYTES: usize = 28;
pub const SIMPLE_REPLY_BYTES: usize = 16;
pub const STRUCTURED_HEADER_BYTES: usize = 20;

/// Command types.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

/// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
/// BLOCK_STATUS: exactly one extent per context, not longer than the request.
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

/// Structured reply flags and chunk types.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;

/// `base:allocation` state bits.
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;

/// Error values carried in replies (the protocol's fixed set, not the host's errno).
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;
pub const ESHUTDOWN: u32 = 108;

/// Default maximum payload (2^25), what clients may always send.
pub const MAX_PAYLOAD_BYTES_DEFAULT: u32 = 32 << 20;

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
