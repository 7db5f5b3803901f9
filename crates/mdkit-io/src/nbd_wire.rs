//! NBD wire constants shared by the server (mdkit-nbd) and the member client
//! ([`crate::nbd_client`]): NetworkBlockDevice/nbd `doc/proto.md`, all integers big-endian.
//! Names follow the specification so they can be grepped against it. One copy, here, because
//! this crate sits below the server.

//------------------------------------------------------------------------------------------------
// Handshake

/// "NBDMAGIC", first 8 bytes the server sends.
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
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
/// Error chunk types have bit 15 set.
pub const REPLY_TYPE_ERROR_BIT: u16 = 1 << 15;
pub const REPLY_TYPE_ERROR: u16 = REPLY_TYPE_ERROR_BIT + 1;
pub const REPLY_TYPE_ERROR_OFFSET: u16 = REPLY_TYPE_ERROR_BIT + 2;

/// `base:allocation` state bits.
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;

/// Error values carried in replies (the protocol's fixed set, not the host's errno).
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const ENOMEM: u32 = 12;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;
pub const ESHUTDOWN: u32 = 108;

/// Default maximum payload (2^25): what a client may always send, and what a client assumes
/// when the server names no block size.
pub const DEFAULT_MAX_PAYLOAD_BYTES: u32 = 32 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    /// Values straight from the specification's tables (a wrong error-chunk number once made
    /// the client read an ERROR chunk as ERROR_OFFSET).
    #[test]
    fn values_match_the_specification() {
        assert_eq!((REPLY_TYPE_ERROR, REPLY_TYPE_ERROR_OFFSET), (32769, 32770));
        assert_eq!((REP_ERR_UNSUP, REP_ERR_TOO_BIG), (0x8000_0001, 0x8000_0009));
        assert_eq!((CMD_BLOCK_STATUS, REPLY_TYPE_BLOCK_STATUS, REPLY_TYPE_OFFSET_HOLE), (7, 5, 2));
        assert_eq!(&NBDMAGIC.to_be_bytes(), b"NBDMAGIC");
        assert_eq!(&IHAVEOPT.to_be_bytes(), b"IHAVEOPT");
    }
}
