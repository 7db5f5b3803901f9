//! AVX2 kernels (x86_64, selected at run time).
//!
//! The syndrome kernel has the structure of the kernel's lib/raid6/avx2.c `avx2x4`: 128 bytes
//! per step held in four 32-byte registers for P and four for Q, Horner over the data blocks
//! from the highest index down, and "multiply by {02}" done per byte as
//! `q + q` (vpaddb) XOR (`0x1d` AND (0 > q signed)) (vpcmpgtb/vpand/vpxor). Stores are ordinary
//! (not non-temporal as in the kernel): our P/Q blocks are usually consumed from cache right
//! after (written by io_uring, checked, reused). Multiply-by-constant (recovery, read-modify-write)
//! uses two 16-entry pshufb tables per constant (lib/raid6/recov_avx2.c).
//!
//! Every kernel processes 128- or 64-byte steps, then 32-byte steps, and hands the last
//! `len % 32` bytes to the scalar kernel, so any length works.
//!
//! Safety model: the functions here are safe `#[target_feature(enable = "avx2")]` functions, so
//! a caller must prove AVX2 is present (the dispatcher in lib.rs only reaches them through an
//! `Implementation` that exists only after `is_x86_feature_detected!("avx2")`). Inside, every
//! raw-pointer access is preceded by a length check of all blocks involved.

use core::arch::x86_64::{
    __m256i, _mm_loadu_si128, _mm256_add_epi8, _mm256_and_si256, _mm256_broadcastsi128_si256, _mm256_cmpgt_epi8,
    _mm256_loadu_si256, _mm256_set1_epi8, _mm256_setzero_si256, _mm256_shuffle_epi8, _mm256_srli_epi16,
    _mm256_storeu_si256, _mm256_xor_si256,
};
use core::ptr;

use crate::blocks::{Blocks, assert_cover};
use crate::{gf, scalar};

//------------------------------------------------------------------------------------------------
// Helpers

const LANE_BYTES: usize = 32;

/// `v · {02}` per byte.
#[target_feature(enable = "avx2")]
#[inline]
fn mul2(v: __m256i, poly: __m256i) -> __m256i {
    let overflow = _mm256_and_si256(_mm256_cmpgt_epi8(_mm256_setzero_si256(), v), poly);
    _mm256_xor_si256(_mm256_add_epi8(v, v), overflow)
}

/// # Safety
/// `src` must be valid for reading 32 bytes.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn load(src: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 32 readable bytes; loadu has no alignment requirement.
    unsafe { _mm256_loadu_si256(src.cast()) }
}

/// # Safety
/// `dst` must be valid for writing 32 bytes.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn store(dst: *mut u8, v: __m256i) {
    // SAFETY: the caller guarantees 32 writable bytes; storeu has no alignment requirement.
    unsafe { _mm256_storeu_si256(dst.cast(), v) }
}

/// pshufb tables for multiplying by one constant.
#[derive(Clone, Copy)]
struct MulTable {
    low_nibble: __m256i,
    high_nibble: __m256i,
    nibble_mask: __m256i,
}

#[target_feature(enable = "avx2")]
#[inline]
fn mul_table(c: u8) -> MulTable {
    let row = &gf::NIBBLE_MUL[c as usize];
    // SAFETY: `row` is 32 bytes, so both 16-byte loads are in bounds; loadu needs no alignment.
    let (low, high) = unsafe { (_mm_loadu_si128(row.as_ptr().cast()), _mm_loadu_si128(row.as_ptr().add(16).cast())) };
    MulTable {
        low_nibble: _mm256_broadcastsi128_si256(low),
        high_nibble: _mm256_broadcastsi128_si256(high),
        nibble_mask: _mm256_set1_epi8(0x0f),
    }
}

/// `c · v` per byte: table[low nibble] XOR table[high nibble].
#[target_feature(enable = "avx2")]
#[inline]
fn mul_const(v: __m256i, t: MulTable) -> __m256i {
    let low = _mm256_and_si256(v, t.nibble_mask);
    let high = _mm256_and_si256(_mm256_srli_epi16::<4>(v), t.nibble_mask);
    _mm256_xor_si256(_mm256_shuffle_epi8(t.low_nibble, low), _mm256_shuffle_epi8(t.high_nibble, high))
}

//------------------------------------------------------------------------------------------------
// dst (^)= XOR of sources

/// See [`scalar::xor`].
#[target_feature(enable = "avx2")]
pub(crate) fn xor<B: Blocks + ?Sized>(dst: &mut [u8], srcs: &B, src_offset: usize, accumulate: bool) {
    let len = dst.len();
    assert_cover(srcs, src_offset, len);
    let dst_ptr = dst.as_mut_ptr();
    let mut off = 0;
    while off + 8 * LANE_BYTES <= len {
        // SAFETY: dst has len bytes and every present source covers src_offset + len (asserted),
        // and off + 256 <= len.
        unsafe { xor_lanes::<8, B>(dst_ptr.add(off), srcs, src_offset + off, accumulate) };
        off += 8 * LANE_BYTES;
    }
    while off + LANE_BYTES <= len {
        // SAFETY: as above with off + 32 <= len.
        unsafe { xor_lanes::<1, B>(dst_ptr.add(off), srcs, src_offset + off, accumulate) };
        off += LANE_BYTES;
    }
    if off < len {
        scalar::xor(&mut dst[off..], srcs, src_offset + off, accumulate);
    }
}

/// # Safety
/// `dst` writable (and readable) for `V * 32` bytes; every present source readable for
/// `V * 32` bytes from `at`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn xor_lanes<const V: usize, B: Blocks + ?Sized>(dst: *mut u8, srcs: &B, at: usize, accumulate: bool) {
    let mut acc = [_mm256_setzero_si256(); V];
    if accumulate {
        for (k, a) in acc.iter_mut().enumerate() {
            // SAFETY: dst covers V lanes (caller).
            *a = unsafe { load(dst.add(k * LANE_BYTES)) };
        }
    }
    for z in 0..srcs.count() {
        if let Some(block) = srcs.block(z) {
            let base = block.as_ptr().wrapping_add(at);
            for (k, a) in acc.iter_mut().enumerate() {
                // SAFETY: each present source covers V lanes from `at` (caller).
                *a = _mm256_xor_si256(*a, unsafe { load(base.add(k * LANE_BYTES)) });
            }
        }
    }
    for (k, a) in acc.iter().enumerate() {
        // SAFETY: dst covers V lanes (caller).
        unsafe { store(dst.add(k * LANE_BYTES), *a) };
    }
}

//------------------------------------------------------------------------------------------------
// P/Q syndrome (gen_syndrome and xor_syndrome in one)

/// See [`scalar::pq`].
#[target_feature(enable = "avx2")]
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
    let p_ptr = p.as_deref_mut().map_or(ptr::null_mut(), |p| p.as_mut_ptr());
    let q_ptr = q.as_mut_ptr();
    let mut off = 0;
    while off + 4 * LANE_BYTES <= len {
        // SAFETY: p (if any) and q have len bytes, every present source covers src_offset + len
        // (asserted above), and off + 128 <= len.
        unsafe { pq_lanes::<4, B>(srcs, first_index, src_offset + off, p_ptr, q_ptr, off, accumulate) };
        off += 4 * LANE_BYTES;
    }
    while off + LANE_BYTES <= len {
        // SAFETY: as above with off + 32 <= len.
        unsafe { pq_lanes::<1, B>(srcs, first_index, src_offset + off, p_ptr, q_ptr, off, accumulate) };
        off += LANE_BYTES;
    }
    if off < len {
        let p_tail = p.map(|p| &mut p[off..]);
        scalar::pq(srcs, first_index, src_offset + off, p_tail, &mut q[off..], accumulate);
    }
}

/// One step of `V` lanes: sources read at byte `at`, P/Q written at byte `out_at`.
///
/// # Safety
/// Every present source readable for `V * 32` bytes from `at`; `q` (and `p` unless null)
/// readable and writable for `V * 32` bytes from `out_at`.
#[target_feature(enable = "avx2")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn pq_lanes<const V: usize, B: Blocks + ?Sized>(
    srcs: &B,
    first_index: usize,
    at: usize,
    p: *mut u8,
    q: *mut u8,
    out_at: usize,
    accumulate: bool,
) {
    let poly = _mm256_set1_epi8(gf::POLY_LOW_BYTE as i8);
    let mut wp = [_mm256_setzero_si256(); V];
    let mut wq = [_mm256_setzero_si256(); V];
    let count = srcs.count();
    if count > 0 {
        let top = count - 1;
        // Horner starts from the highest block as-is (no multiply of zeroes first).
        if let Some(block) = srcs.block(top) {
            let base = block.as_ptr().wrapping_add(at);
            for k in 0..V {
                // SAFETY: present sources cover V lanes from `at` (caller).
                let d = unsafe { load(base.add(k * LANE_BYTES)) };
                wp[k] = d;
                wq[k] = d;
            }
        }
        for z in (0..top).rev() {
            for w in wq.iter_mut() {
                *w = mul2(*w, poly);
            }
            if let Some(block) = srcs.block(z) {
                let base = block.as_ptr().wrapping_add(at);
                for k in 0..V {
                    // SAFETY: present sources cover V lanes from `at` (caller).
                    let d = unsafe { load(base.add(k * LANE_BYTES)) };
                    wp[k] = _mm256_xor_si256(wp[k], d);
                    wq[k] = _mm256_xor_si256(wq[k], d);
                }
            }
        }
    }
    // The blocks below `first_index` contribute nothing but their Horner steps
    // (the kernel's xor_syndrome "left side").
    for _ in 0..first_index {
        for w in wq.iter_mut() {
            *w = mul2(*w, poly);
        }
    }
    let q_out = q.wrapping_add(out_at);
    let p_out = p.wrapping_add(out_at);
    if accumulate {
        // Load both outputs before storing either (4K aliasing, see mul_acc).
        for k in 0..V {
            // SAFETY: q covers V lanes from out_at (caller).
            wq[k] = _mm256_xor_si256(wq[k], unsafe { load(q_out.add(k * LANE_BYTES)) });
            if !p.is_null() {
                // SAFETY: p is non-null, so it covers V lanes from out_at (caller).
                wp[k] = _mm256_xor_si256(wp[k], unsafe { load(p_out.add(k * LANE_BYTES)) });
            }
        }
    }
    for (k, w) in wq.iter().enumerate() {
        // SAFETY: q covers V lanes from out_at (caller).
        unsafe { store(q_out.add(k * LANE_BYTES), *w) };
    }
    if !p.is_null() {
        for (k, w) in wp.iter().enumerate() {
            // SAFETY: p is non-null, so it covers V lanes from out_at (caller).
            unsafe { store(p_out.add(k * LANE_BYTES), *w) };
        }
    }
}

//------------------------------------------------------------------------------------------------
// Multiply-by-constant kernels

/// See [`scalar::mul_acc`]. All loads of a step come before its stores: P and Q are usually
/// 4 KiB-aligned buffers, and a load right after a store to the same address bits 0..11 is
/// held back by the CPU's 4K-aliasing check.
#[target_feature(enable = "avx2")]
pub(crate) fn mul_acc(c: u8, old: &[u8], new: &[u8], p: &mut [u8], q: &mut [u8]) {
    let len = old.len();
    assert!(new.len() == len && p.len() == len && q.len() == len, "block lengths differ");
    let table = mul_table(c);
    let (old_ptr, new_ptr) = (old.as_ptr(), new.as_ptr());
    let (p_ptr, q_ptr) = (p.as_mut_ptr(), q.as_mut_ptr());
    let mut off = 0;
    while off + LANE_BYTES <= len {
        // SAFETY: all four slices have len bytes and off + 32 <= len.
        unsafe {
            let d = _mm256_xor_si256(load(old_ptr.add(off)), load(new_ptr.add(off)));
            let pv = load(p_ptr.add(off));
            let qv = load(q_ptr.add(off));
            store(p_ptr.add(off), _mm256_xor_si256(pv, d));
            store(q_ptr.add(off), _mm256_xor_si256(qv, mul_const(d, table)));
        }
        off += LANE_BYTES;
    }
    scalar::mul_acc(c, &old[off..], &new[off..], &mut p[off..], &mut q[off..]);
}

/// See [`scalar::recov_2data`].
#[target_feature(enable = "avx2")]
pub(crate) fn recov_2data(p: &[u8], q: &[u8], dp: &mut [u8], dq: &mut [u8], pbmul: u8, qmul: u8) {
    let len = p.len();
    assert!(q.len() == len && dp.len() == len && dq.len() == len, "block lengths differ");
    let pb_table = mul_table(pbmul);
    let q_table = mul_table(qmul);
    let mut off = 0;
    while off + LANE_BYTES <= len {
        // SAFETY: all four slices have len bytes and off + 32 <= len.
        unsafe {
            let dp_at = dp.as_mut_ptr().add(off);
            let dq_at = dq.as_mut_ptr().add(off);
            let px = _mm256_xor_si256(load(p.as_ptr().add(off)), load(dp_at));
            let qx = _mm256_xor_si256(load(q.as_ptr().add(off)), load(dq_at));
            let b = _mm256_xor_si256(mul_const(px, pb_table), mul_const(qx, q_table));
            store(dq_at, b);
            store(dp_at, _mm256_xor_si256(b, px));
        }
        off += LANE_BYTES;
    }
    scalar::recov_2data(&p[off..], &q[off..], &mut dp[off..], &mut dq[off..], pbmul, qmul);
}

/// See [`scalar::recov_datap`].
#[target_feature(enable = "avx2")]
pub(crate) fn recov_datap(q: &[u8], dq: &mut [u8], dp: &mut [u8], qmul: u8) {
    let len = q.len();
    assert!(dq.len() == len && dp.len() == len, "block lengths differ");
    let q_table = mul_table(qmul);
    let mut off = 0;
    while off + LANE_BYTES <= len {
        // SAFETY: all three slices have len bytes and off + 32 <= len.
        unsafe {
            let dq_at = dq.as_mut_ptr().add(off);
            let dp_at = dp.as_mut_ptr().add(off);
            let d = mul_const(_mm256_xor_si256(load(q.as_ptr().add(off)), load(dq_at)), q_table);
            store(dq_at, d);
            store(dp_at, _mm256_xor_si256(load(dp_at), d));
        }
        off += LANE_BYTES;
    }
    scalar::recov_datap(&q[off..], &mut dq[off..], &mut dp[off..], qmul);
}
