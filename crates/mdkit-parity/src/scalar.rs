//! Portable kernels: 64-bit words treated as eight GF(2^8) lanes (the kernel's int.uc idea),
//! four words per step for instruction-level parallelism, then single words, then bytes.
//! All safe code; these are also the tail handlers of the SIMD kernels.

use crate::blocks::{Blocks, assert_cover};
use crate::gf;

//------------------------------------------------------------------------------------------------

const LOW7: u64 = 0x7f7f_7f7f_7f7f_7f7f;
const LSB: u64 = 0x0101_0101_0101_0101;

/// Eight bytes at once times {02}: shift each byte left, XOR 0x1d into the bytes that overflowed.
#[inline(always)]
fn mul2_word(v: u64) -> u64 {
    let overflow = (v >> 7) & LSB;
    ((v & LOW7) << 1) ^ overflow.wrapping_mul(u64::from(gf::POLY_LOW_BYTE))
}

#[inline(always)]
fn load(block: &[u8], at: usize) -> u64 {
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&block[at..at + 8]);
    u64::from_ne_bytes(bytes)
}

#[inline(always)]
fn store(block: &mut [u8], at: usize, v: u64) {
    block[at..at + 8].copy_from_slice(&v.to_ne_bytes());
}

//------------------------------------------------------------------------------------------------
// dst (^)= XOR of sources

/// `dst = ⊕ srcs[i][src_offset..]` (or `dst ^= ...` when `accumulate`). Absent sources count as
/// zeroes.
pub(crate) fn xor<B: Blocks + ?Sized>(dst: &mut [u8], srcs: &B, src_offset: usize, accumulate: bool) {
    let len = dst.len();
    assert_cover(srcs, src_offset, len);
    let mut off = 0;
    while off + 32 <= len {
        xor_words::<4, B>(dst, srcs, src_offset, off, accumulate);
        off += 32;
    }
    while off + 8 <= len {
        xor_words::<1, B>(dst, srcs, src_offset, off, accumulate);
        off += 8;
    }
    for i in off..len {
        let mut acc = if accumulate { dst[i] } else { 0 };
        for z in 0..srcs.count() {
            if let Some(b) = srcs.block(z) {
                acc ^= b[src_offset + i];
            }
        }
        dst[i] = acc;
    }
}

#[inline(always)]
fn xor_words<const W: usize, B: Blocks + ?Sized>(
    dst: &mut [u8],
    srcs: &B,
    src_offset: usize,
    off: usize,
    accumulate: bool,
) {
    let mut acc = [0u64; W];
    if accumulate {
        for (k, a) in acc.iter_mut().enumerate() {
            *a = load(dst, off + 8 * k);
        }
    }
    for z in 0..srcs.count() {
        if let Some(b) = srcs.block(z) {
            for (k, a) in acc.iter_mut().enumerate() {
                *a ^= load(b, src_offset + off + 8 * k);
            }
        }
    }
    for (k, a) in acc.iter().enumerate() {
        store(dst, off + 8 * k, *a);
    }
}

//------------------------------------------------------------------------------------------------
// P/Q syndrome

/// With `D_j = srcs[j][src_offset..]` and absent blocks as zeroes:
/// `P = ⊕ D_j`, `Q = Σ g^(first_index + j)·D_j` (Horner from the highest j), written to `p` and
/// `q` or XORed into them when `accumulate`. `p = None` computes Q only.
pub(crate) fn pq<B: Blocks + ?Sized>(
    srcs: &B,
    first_index: usize,
    src_offset: usize,
    mut p: Option<&mut [u8]>,
    q: &mut [u8],
    accumulate: bool,
) {
    let len = q.len();
    if let Some(p) = p.as_deref() {
        assert_eq!(p.len(), len, "P and Q lengths differ");
    }
    assert_cover(srcs, src_offset, len);
    let mut off = 0;
    while off + 32 <= len {
        pq_words::<4, B>(srcs, first_index, src_offset, off, p.as_deref_mut(), q, accumulate);
        off += 32;
    }
    while off + 8 <= len {
        pq_words::<1, B>(srcs, first_index, src_offset, off, p.as_deref_mut(), q, accumulate);
        off += 8;
    }
    for i in off..len {
        let (mut wp, mut wq) = (0u8, 0u8);
        for z in (0..srcs.count()).rev() {
            wq = gf::mul2(wq);
            if let Some(b) = srcs.block(z) {
                wp ^= b[src_offset + i];
                wq ^= b[src_offset + i];
            }
        }
        for _ in 0..first_index {
            wq = gf::mul2(wq);
        }
        if let Some(p) = p.as_deref_mut() {
            p[i] = if accumulate { p[i] ^ wp } else { wp };
        }
        q[i] = if accumulate { q[i] ^ wq } else { wq };
    }
}

#[inline(always)]
fn pq_words<const W: usize, B: Blocks + ?Sized>(
    srcs: &B,
    first_index: usize,
    src_offset: usize,
    off: usize,
    p: Option<&mut [u8]>,
    q: &mut [u8],
    accumulate: bool,
) {
    let mut wp = [0u64; W];
    let mut wq = [0u64; W];
    for z in (0..srcs.count()).rev() {
        for w in wq.iter_mut() {
            *w = mul2_word(*w);
        }
        if let Some(b) = srcs.block(z) {
            for k in 0..W {
                let d = load(b, src_offset + off + 8 * k);
                wp[k] ^= d;
                wq[k] ^= d;
            }
        }
    }
    for _ in 0..first_index {
        for w in wq.iter_mut() {
            *w = mul2_word(*w);
        }
    }
    if let Some(p) = p {
        for (k, w) in wp.iter().enumerate() {
            let old = if accumulate { load(p, off + 8 * k) } else { 0 };
            store(p, off + 8 * k, old ^ *w);
        }
    }
    for (k, w) in wq.iter().enumerate() {
        let old = if accumulate { load(q, off + 8 * k) } else { 0 };
        store(q, off + 8 * k, old ^ *w);
    }
}

//------------------------------------------------------------------------------------------------
// Multiply-by-constant kernels (table lookups; recovery and read-modify-write)

/// `d = old ^ new; p ^= d; q ^= c·d` — the RAID6 read-modify-write update of one data block.
pub(crate) fn mul_acc(c: u8, old: &[u8], new: &[u8], p: &mut [u8], q: &mut [u8]) {
    let row = &gf::MUL[c as usize];
    for (((o, n), p), q) in old.iter().zip(new).zip(p.iter_mut()).zip(q.iter_mut()) {
        let d = o ^ n;
        *p ^= d;
        *q ^= row[d as usize];
    }
}

/// Two-data recovery, final step (lib/raid6/recov.c raid6_2data_recov_intx1): on entry `dp` and
/// `dq` hold the syndromes of the surviving data; on exit they hold the failed blocks A and B.
pub(crate) fn recov_2data(p: &[u8], q: &[u8], dp: &mut [u8], dq: &mut [u8], pbmul: u8, qmul: u8) {
    let pb_row = &gf::MUL[pbmul as usize];
    let q_row = &gf::MUL[qmul as usize];
    for (((p, q), dp), dq) in p.iter().zip(q).zip(dp.iter_mut()).zip(dq.iter_mut()) {
        let px = p ^ *dp;
        let qx = q_row[(q ^ *dq) as usize];
        let b = pb_row[px as usize] ^ qx;
        *dq = b;
        *dp = b ^ px;
    }
}

/// Data+P recovery, final step (raid6_datap_recov): on entry `dq` holds Q of the surviving data
/// and `dp` P of the surviving data; on exit `dq` is the failed data block and `dp` the full P.
pub(crate) fn recov_datap(q: &[u8], dq: &mut [u8], dp: &mut [u8], qmul: u8) {
    let q_row = &gf::MUL[qmul as usize];
    for ((q, dq), dp) in q.iter().zip(dq.iter_mut()).zip(dp.iter_mut()) {
        let d = q_row[(q ^ *dq) as usize];
        *dq = d;
        *dp ^= d;
    }
}

//------------------------------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mul2_word_matches_bytewise() {
        let mut x: u64 = 0x0123_4567_89ab_cdef;
        for _ in 0..1000 {
            let bytes = x.to_ne_bytes();
            let expect: Vec<u8> = bytes.iter().map(|&b| gf::mul2(b)).collect();
            assert_eq!(mul2_word(x).to_ne_bytes().to_vec(), expect);
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        }
        assert_eq!(mul2_word(0x8080_8080_8080_8080), 0x1d1d_1d1d_1d1d_1d1d);
    }
}
