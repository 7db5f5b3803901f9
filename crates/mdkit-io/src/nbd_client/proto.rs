//! Client-side encoders over the shared wire constants ([`crate::nbd_wire`], re-exported here).

pub use crate::nbd_wire::*;

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
