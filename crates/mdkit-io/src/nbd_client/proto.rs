//! NBD wire constants the client needs (NetworkBlockDevice/nbd `doc/proto.md`; integers are
//! big-endian). Names follow the specification so they can be grepped against it. The server
//! side has its own copy in mdkit-nbd: this crate sits below it and cannot depend on it.

/// "NBDMAGIC", the first 8 bytes a server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// "IHAVEOPT": newstyle magic, also the prefix of every client option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Oldstyle servers send this instead of IHAVEOPT.
pub const OLDSTYLE_MAGIC: u64 = 0x0000_4202_8186_1253;
/// Prefix of every option reply.
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;

/// Handshake flags (server → client, u16).
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flags (client → server, u32).
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Option types.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;

/// Option reply types; errors have bit 31 set.
pub const REP_ACK: u32 = 1;
pub const REP_INFO: u32 = 3;
pub const REP_ERR_BIT: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_ERR_BIT + 1;
pub const REP_ERR_POLICY: u32 = REP_ERR_BIT + 2;
pub const REP_ERR_INVALID: u32 = REP_ERR_BIT + 3;
pub const REP_ERR_PLATFORM: u32 = REP_ERR_BIT + 4;
pub const REP_ERR_TLS_REQD: u32 = REP_ERR_BIT + 5;
pub const REP_ERR_UNKNOWN: u32 = REP_ERR_BIT + 6;
pub const REP_ERR_SHUTDOWN: u32 = REP_ERR_BIT + 7;
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = REP_ERR_BIT + 8;
pub const REP_ERR_TOO_BIG: u32 = REP_ERR_BIT + 9;

/// Information types in `NBD_REP_INFO`.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flags (u16, sent with the export size).
pub const FLAG_HAS_FLAGS: u16 = 1 << 0;
pub const FLAG_READ_ONLY: u16 = 1 << 1;
pub const FLAG_SEND_FLUSH: u16 = 1 << 2;
pub const FLAG_SEND_FUA: u16 = 1 << 3;
pub const FLAG_ROTATIONAL: u16 = 1 << 4;
pub const FLAG_SEND_TRIM: u16 = 1 << 5;
pub const FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;

pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
pub const REQUEST_HEADER_BYTES: usize = 28;

/// Command types.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_WRITE_ZEROES: u16 = 6;

/// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;

/// Structured reply chunk flags and types.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_ERROR_BIT: u16 = 1 << 15;
pub const REPLY_TYPE_ERROR_OFFSET: u16 = REPLY_TYPE_ERROR_BIT + 1;

/// Error values carried in replies (the wire's own numbering, the Linux errno values).
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const ENOMEM: u32 = 12;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;
pub const ESHUTDOWN: u32 = 108;

/// The spec's default maximum payload when the server names none (32 MiB).
pub const DEFAULT_MAX_PAYLOAD_BYTES: u32 = 32 << 20;

/// A request header.
pub fn request_header(
    flags: u16,
    cmd: u16,
    cookie: u64,
    offset_bytes: u64,
    len_bytes: u32,
) -> [u8; REQUEST_HEADER_BYTES] {
    let mut h = [0u8; REQUEST_HEADER_BYTES];
    h[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    h[4..6].copy_from_slice(&flags.to_be_bytes());
    h[6..8].copy_from_slice(&cmd.to_be_bytes());
    h[8..16].copy_from_slice(&cookie.to_be_bytes());
    h[16..24].copy_from_slice(&offset_bytes.to_be_bytes());
    h[24..28].copy_from_slice(&len_bytes.to_be_bytes());
    h
}

/// The name of an option-reply error, for messages.
pub fn rep_error_name(rep: u32) -> &'static str {
    match rep {
        REP_ERR_UNSUP => "NBD_REP_ERR_UNSUP",
        REP_ERR_POLICY => "NBD_REP_ERR_POLICY",
        REP_ERR_INVALID => "NBD_REP_ERR_INVALID",
        REP_ERR_PLATFORM => "NBD_REP_ERR_PLATFORM",
        REP_ERR_TLS_REQD => "NBD_REP_ERR_TLS_REQD (the server requires TLS, which mdkit does not speak)",
        REP_ERR_UNKNOWN => "NBD_REP_ERR_UNKNOWN (no such export)",
        REP_ERR_SHUTDOWN => "NBD_REP_ERR_SHUTDOWN",
        REP_ERR_BLOCK_SIZE_REQD => "NBD_REP_ERR_BLOCK_SIZE_REQD",
        REP_ERR_TOO_BIG => "NBD_REP_ERR_TOO_BIG",
        _ => "unknown option error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_header_layout() {
        let h = request_header(CMD_FLAG_FUA, CMD_WRITE, 0x0102_0304_0506_0708, 4096, 512);
        assert_eq!(&h[0..4], &[0x25, 0x60, 0x95, 0x13]);
        assert_eq!(&h[4..8], &[0, 1, 0, 1]);
        assert_eq!(&h[8..16], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(u64::from_be_bytes(h[16..24].try_into().unwrap()), 4096);
        assert_eq!(u32::from_be_bytes(h[24..28].try_into().unwrap()), 512);
    }
}
