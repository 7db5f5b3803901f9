//! `NBD_CMD_BLOCK_STATUS`: one `NBD_REPLY_TYPE_BLOCK_STATUS` chunk per selected meta context,
//! the last one flagged DONE (proto.md "Structured reply chunk message types").
//!
//! ```text
//!   chunk: magic 668e33ef | flags u16 (DONE on the last) | type 5 | cookie u64 | length u32
//!   payload: context id u32 | n × { length u32 ≠ 0, status flags u32 }     (length = 4 + 8n)
//! ```
//!
//! The extents come from the export's device ([`mdkit_io::BlockDevice::block_status`] and
//! [`mdkit_io::BlockDevice::changed_since`]), asked for at most [`DESCRIPTORS_MAX`] extents
//! (one with `NBD_CMD_FLAG_REQ_ONE`). They never run past the request, so every length fits
//! the 32-bit field; they may stop short of its end, and the client asks again from there
//! (the protocol allows any non-empty prefix). The answer is checked before it is sent: a
//! device breaking the contract gets the request an EIO naming the device, never a malformed
//! reply. The chunks of one request hold at most 8192 descriptors together, so a request
//! holds at most 64 KiB however large the range is and however many contexts are selected.

use mdkit_io::Extent;

use crate::export::ExportState;
use crate::meta_context::MetaContext;
use crate::proto::*;

/// Extents per context in one reply (the protocol's SHOULD-limit is 2^20; smaller keeps the
/// memory of a request small, and clients continue from where a reply stopped).
pub const DESCRIPTORS_MAX: usize = 8192;

/// The range and flags of one BLOCK_STATUS request.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StatusRequest {
    pub cookie: u64,
    pub offset_bytes: u64,
    pub len_bytes: u64,
    pub flags: u16,
}

/// Builds the reply chunks, or the error to reply with.
pub(crate) async fn block_status(
    export: &ExportState,
    contexts: &[MetaContext],
    req: StatusRequest,
) -> Result<Vec<u8>, (u32, String)> {
    // The descriptor budget is per request, shared by its contexts.
    let max = if req.flags & CMD_FLAG_REQ_ONE != 0 { 1 } else { (DESCRIPTORS_MAX / contexts.len().max(1)).max(1) };
    let dev = &export.export.device;
    let mut out = Vec::new();
    for (i, ctx) in contexts.iter().enumerate() {
        let (off, len) = (req.offset_bytes, req.len_bytes);
        let runs: Vec<(u64, u32)> = match *ctx {
            MetaContext::Allocation => dev.block_status(off, len, max).await.map(|v| bits(v, |f| f.nbd_bits())),
            MetaContext::ChangedSince { base } => {
                dev.changed_since(base, off, len, max).await.map(|v| bits(v, u32::from))
            }
        }
        .map_err(|e| (errno_from_io(&e), e.to_string()))?;
        check_answer(dev.name(), ctx, &runs, len, max)?;
        let last = i + 1 == contexts.len();
        put_chunk(&mut out, req.cookie, i as u32 + 1, &runs, last);
    }
    Ok(out)
}

fn bits<F: Copy>(v: Vec<Extent<F>>, f: impl Fn(F) -> u32) -> Vec<(u64, u32)> {
    v.into_iter().map(|e| (e.len_bytes, f(e.flags))).collect()
}

/// The device's answer must be 1..=max non-empty extents inside the request.
fn check_answer(
    device: &str,
    ctx: &MetaContext,
    runs: &[(u64, u32)],
    len: u64,
    max: usize,
) -> Result<(), (u32, String)> {
    let total = runs.iter().try_fold(0u64, |acc, &(n, _)| if n == 0 { None } else { acc.checked_add(n) });
    let ok = !runs.is_empty() && runs.len() <= max && total.is_some_and(|t| t <= len);
    if ok {
        return Ok(());
    }
    Err((
        EIO,
        format!(
            "{device}: block status for {} answered {} extents covering {total:?} bytes of a {len}-byte request \
             (at most {max} non-empty extents inside the request expected)",
            ctx.name(),
            runs.len()
        ),
    ))
}

fn put_chunk(out: &mut Vec<u8>, cookie: u64, context_id: u32, runs: &[(u64, u32)], last: bool) {
    let payload_len = 4 + 8 * runs.len();
    let flags = if last { REPLY_FLAG_DONE } else { 0 };
    let len = u32::try_from(payload_len).expect("at most DESCRIPTORS_MAX descriptors");
    out.reserve(STRUCTURED_HEADER_BYTES + payload_len);
    out.extend_from_slice(&structured_header(flags, REPLY_TYPE_BLOCK_STATUS, cookie, len));
    out.extend_from_slice(&context_id.to_be_bytes());
    for &(n, status) in runs {
        let n = u32::try_from(n).expect("checked: extents lie inside a request of at most u32::MAX bytes");
        out.extend_from_slice(&n.to_be_bytes());
        out.extend_from_slice(&status.to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_matches_the_reference_example() {
        // thin-lifecycle.md §7.3: cookie 7, context 1, 64 KiB data then 128 KiB hole|zero.
        let mut v = Vec::new();
        put_chunk(&mut v, 7, 1, &[(65536, 0), (131072, 3)], true);
        let expect: [u8; 40] = [
            0x66, 0x8e, 0x33, 0xef, 0x00, 0x01, 0x00, 0x05, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0x14, //
            0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 3,
        ];
        assert_eq!(v, expect);
        let mut v = Vec::new();
        put_chunk(&mut v, 7, 2, &[(512, 1)], false);
        assert_eq!(u16::from_be_bytes([v[4], v[5]]), 0, "not DONE");
    }

    #[test]
    fn broken_device_answers_are_refused() {
        let c = MetaContext::Allocation;
        assert!(check_answer("d", &c, &[(10, 0), (5, 3)], 20, 8).is_ok());
        for (runs, len, max) in [
            (vec![], 20, 8),
            (vec![(0, 0)], 20, 8),
            (vec![(21, 0)], 20, 8),
            (vec![(1, 0), (1, 3)], 20, 1),
            (vec![(u64::MAX, 0), (2, 0)], u64::MAX, 8),
        ] {
            let (errno, msg) = check_answer("dev9", &c, &runs, len, max).unwrap_err();
            assert_eq!(errno, EIO);
            assert!(msg.contains("dev9") && msg.contains("base:allocation"), "{msg}");
        }
    }
}
