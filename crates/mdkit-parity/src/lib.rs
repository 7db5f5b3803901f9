//! XOR parity (RAID4/5 P) and RAID6 P+Q, bit-for-bit as the Linux kernel computes them
//! (lib/raid6, lib/xor), plus RAID6 scrub diagnosis and recovery of any two missing blocks.
//!
//! ```text
//!   data blocks D_0 .. D_{n-1} (Q order), equal lengths
//!   P = D_0 ^ D_1 ^ ... ^ D_{n-1}
//!   Q = g^0·D_0 ^ g^1·D_1 ^ ... ^ g^{n-1}·D_{n-1}      GF(2^8), poly 0x11d, g = {02}
//!     = (((D_{n-1})·g ^ D_{n-2})·g ^ ...)·g ^ D_0      (Horner, as lib/raid6 does)
//! ```
//!
//! "Q order" is the order of the syndrome, which is **not** always the logical chunk order of
//! the array: for md's non-DDF layouts D_i is the i-th data device met walking from the device
//! after Q (formats.md §3.3). Mapping stripes to Q order is the RAID layer's job.
//!
//! # Implementations
//! Kernels exist as a portable scalar version (64-bit words as eight GF lanes) and an AVX2
//! version (avx2x4 structure for P/Q, pshufb tables for multiply-by-constant). The best
//! available one is selected at first use; `MDKIT_PARITY_IMPL=scalar|avx2` in the environment
//! overrides that choice, and [`set_implementation`] changes it at run time (tests and
//! benchmarks). [`implementation_name`] reports what is in use. Each [`Implementation`] can
//! also be called directly, which is how tests compare them.
//!
//! # Lengths
//! All blocks of one call must have the same length; any length works (SIMD steps of 128 and
//! 32 bytes, the rest in scalar code). A length mismatch is a caller bug and panics with a
//! message naming the block. Nothing here allocates.
//!
//! # Entry points
//! - RAID4/5: [`xor_gen`], [`xor_into`] (read-modify-write `P ^= old ^ new`, and recovery of a
//!   single block).
//! - RAID6 generation: [`pq_gen`] ([`pq_gen_sparse`] with zero blocks); read-modify-write: [`pq_update`] (one block) or
//!   [`pq_xor_syndrome`] (a run of blocks, the kernel's `xor_syndrome`).
//! - RAID6 scrub: [`pq_check`] says whether P/Q match and, if not, which single member is wrong.
//! - RAID6 recovery: [`recover`] for any combination of up to two missing members, or the
//!   specific [`recover_data_from_p`], [`recover_2data`], [`recover_datap`],
//!   [`recover_dataq`]; P+Q are regenerated with [`pq_gen`].

#![deny(unsafe_op_in_unsafe_fn)]

use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};

#[cfg(target_arch = "x86_64")]
mod avx2;
mod blocks;
pub mod gf;
mod scalar;

use blocks::{Blocks, Filled};

//------------------------------------------------------------------------------------------------
// Limits

/// Most data blocks a RAID6 syndrome can cover: g has order 255, so g^0..g^254 are the only
/// distinct coefficients (and recovery divides by g^a ^ g^b, which must be non-zero).
pub const MAX_DATA_BLOCKS: usize = gf::GENERATOR_ORDER;

/// Bytes processed per pass by [`pq_check`] (on the stack, two buffers of this size).
const CHECK_SEGMENT_BYTES: usize = 4096;

//------------------------------------------------------------------------------------------------
// Implementations and selection

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    Scalar = 1,
    #[cfg(target_arch = "x86_64")]
    Avx2 = 2,
}

/// One set of kernels. Values exist only for implementations the running CPU supports, which
/// is what makes calling their SIMD code sound.
#[derive(PartialEq, Eq)]
pub struct Implementation {
    kind: Kind,
    name: &'static str,
}

impl fmt::Debug for Implementation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

static SCALAR: Implementation = Implementation { kind: Kind::Scalar, name: "scalar" };
#[cfg(target_arch = "x86_64")]
static AVX2: Implementation = Implementation { kind: Kind::Avx2, name: "avx2" };

/// Environment variable that overrides the automatic choice at first use.
pub const IMPLEMENTATION_ENV: &str = "MDKIT_PARITY_IMPL";

const UNSELECTED: u8 = 0;
static SELECTED: AtomicU8 = AtomicU8::new(UNSELECTED);

/// Why [`set_implementation_by_name`] refused a name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SelectError {
    /// No implementation has this name.
    #[error("unknown parity implementation {name:?} (known: scalar, avx2)")]
    Unknown { name: String },
    /// The implementation exists but this CPU lacks the instructions it needs.
    #[error("parity implementation {name:?} is not supported by this CPU")]
    Unsupported { name: String },
}

impl Implementation {
    /// The portable implementation (always available).
    pub fn scalar() -> &'static Implementation {
        &SCALAR
    }

    /// The AVX2 implementation, if this CPU has AVX2.
    pub fn avx2() -> Option<&'static Implementation> {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            return Some(&AVX2);
        }
        None
    }

    /// Every implementation this CPU supports, fastest last.
    pub fn available() -> Vec<&'static Implementation> {
        let mut all = vec![Implementation::scalar()];
        all.extend(Implementation::avx2());
        all
    }

    /// The fastest implementation this CPU supports.
    pub fn best() -> &'static Implementation {
        Implementation::avx2().unwrap_or(&SCALAR)
    }

    /// Looks an implementation up by name.
    pub fn by_name(name: &str) -> Result<&'static Implementation, SelectError> {
        let found = match name {
            "scalar" => Some(Implementation::scalar()),
            "avx2" => Implementation::avx2(),
            _ => {
                return Err(SelectError::Unknown { name: name.to_string() });
            }
        };
        found.ok_or_else(|| SelectError::Unsupported { name: name.to_string() })
    }

    /// Short name: "scalar" or "avx2".
    pub fn name(&self) -> &'static str {
        self.name
    }

    fn from_kind(kind: u8) -> Option<&'static Implementation> {
        match kind {
            k if k == Kind::Scalar as u8 => Some(&SCALAR),
            #[cfg(target_arch = "x86_64")]
            k if k == Kind::Avx2 as u8 => Some(&AVX2),
            _ => None,
        }
    }
}

/// The implementation the free functions of this crate use.
pub fn implementation() -> &'static Implementation {
    if let Some(selected) = Implementation::from_kind(SELECTED.load(Ordering::Relaxed)) {
        return selected;
    }
    let initial = initial_implementation();
    // A concurrent set_implementation wins over the automatic choice.
    match SELECTED.compare_exchange(UNSELECTED, initial.kind as u8, Ordering::Relaxed, Ordering::Relaxed) {
        Ok(_) => initial,
        Err(current) => Implementation::from_kind(current).unwrap_or(initial),
    }
}

/// Name of the implementation in use ("scalar" or "avx2").
pub fn implementation_name() -> &'static str {
    implementation().name()
}

/// Makes `implementation` the one the free functions use (process-wide).
pub fn set_implementation(implementation: &'static Implementation) {
    SELECTED.store(implementation.kind as u8, Ordering::Relaxed);
}

/// [`set_implementation`] by name ("scalar", "avx2").
pub fn set_implementation_by_name(name: &str) -> Result<&'static Implementation, SelectError> {
    let found = Implementation::by_name(name)?;
    set_implementation(found);
    Ok(found)
}

fn initial_implementation() -> &'static Implementation {
    match std::env::var(IMPLEMENTATION_ENV) {
        Ok(name) if !name.is_empty() => Implementation::by_name(&name).unwrap_or_else(|e| {
            let best = Implementation::best();
            eprintln!("mdkit-parity: {IMPLEMENTATION_ENV}: {e}; using {}", best.name);
            best
        }),
        _ => Implementation::best(),
    }
}

//------------------------------------------------------------------------------------------------
// Results

/// Verdict of a RAID6 consistency check on one set of blocks ([`pq_check`]).
///
/// Per byte position the discrepancies `Pd = P ^ P(data)` and `Qd = Q ^ Q(data)` name a
/// culprit: P alone (`Qd = 0`), Q alone (`Pd = 0`), or data block
/// `z = log(Qd) - log(Pd) mod 255` (a corrupted `D_z` gives `Pd = e`, `Qd = g^z·e`), as mdadm's
/// raid6check does. Positions without discrepancy are ignored; the block verdict is the common
/// culprit of all the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PqCheck {
    /// P and Q match the data.
    Consistent,
    /// Only P disagrees; data and Q agree with each other.
    WrongP,
    /// Only Q disagrees; data and P agree with each other.
    WrongQ,
    /// Exactly data block `index` (Q order) explains every discrepancy.
    WrongData { index: usize },
    /// No single member explains the discrepancies: more than one block is wrong (or a
    /// position points at a data index that does not exist).
    MultipleWrong,
}

/// One member of a RAID6 stripe, for error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Member {
    /// Data block, by Q-order index.
    Data(usize),
    /// The XOR parity.
    P,
    /// The Reed-Solomon syndrome.
    Q,
}

impl fmt::Display for Member {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Member::Data(index) => write!(f, "data {index}"),
            Member::P => f.write_str("P"),
            Member::Q => f.write_str("Q"),
        }
    }
}

/// Why [`recover`] could not rebuild a stripe.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RecoverError {
    /// More than two members are missing; RAID6 tolerates two.
    #[error("{} members missing ({}); RAID6 can rebuild at most 2", .missing.len(), members_list(.missing))]
    TooManyMissing { missing: Vec<Member> },
}

fn members_list(members: &[Member]) -> String {
    members.iter().map(Member::to_string).collect::<Vec<_>>().join(", ")
}

//------------------------------------------------------------------------------------------------
// Kernel dispatch

impl Implementation {
    fn k_xor<B: Blocks + ?Sized>(&self, dst: &mut [u8], srcs: &B, src_offset: usize, acc: bool) {
        match self.kind {
            Kind::Scalar => scalar::xor(dst, srcs, src_offset, acc),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: an Implementation of kind Avx2 is only handed out after AVX2 was detected.
            Kind::Avx2 => unsafe { avx2::xor(dst, srcs, src_offset, acc) },
        }
    }

    fn k_pq<B: Blocks + ?Sized>(
        &self,
        srcs: &B,
        first_index: usize,
        src_offset: usize,
        p: Option<&mut [u8]>,
        q: &mut [u8],
        acc: bool,
    ) {
        match self.kind {
            Kind::Scalar => scalar::pq(srcs, first_index, src_offset, p, q, acc),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: an Implementation of kind Avx2 is only handed out after AVX2 was detected.
            Kind::Avx2 => unsafe { avx2::pq(srcs, first_index, src_offset, p, q, acc) },
        }
    }

    fn k_mul_acc(&self, c: u8, old: &[u8], new: &[u8], p: &mut [u8], q: &mut [u8]) {
        match self.kind {
            Kind::Scalar => scalar::mul_acc(c, old, new, p, q),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: an Implementation of kind Avx2 is only handed out after AVX2 was detected.
            Kind::Avx2 => unsafe { avx2::mul_acc(c, old, new, p, q) },
        }
    }

    fn k_recov_2data(&self, p: &[u8], q: &[u8], dp: &mut [u8], dq: &mut [u8], pbmul: u8, qmul: u8) {
        match self.kind {
            Kind::Scalar => scalar::recov_2data(p, q, dp, dq, pbmul, qmul),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: an Implementation of kind Avx2 is only handed out after AVX2 was detected.
            Kind::Avx2 => unsafe { avx2::recov_2data(p, q, dp, dq, pbmul, qmul) },
        }
    }

    fn k_recov_datap(&self, q: &[u8], dq: &mut [u8], dp: &mut [u8], qmul: u8) {
        match self.kind {
            Kind::Scalar => scalar::recov_datap(q, dq, dp, qmul),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: an Implementation of kind Avx2 is only handed out after AVX2 was detected.
            Kind::Avx2 => unsafe { avx2::recov_datap(q, dq, dp, qmul) },
        }
    }
}

//------------------------------------------------------------------------------------------------
// Argument checks (caller bugs panic with a message naming the block)

fn assert_len(what: fmt::Arguments<'_>, actual_bytes: usize, expected_bytes: usize) {
    assert!(
        actual_bytes == expected_bytes,
        "{what} is {actual_bytes} bytes, expected {expected_bytes} (all blocks of a call must have equal length)"
    );
}

fn assert_data_lens(data: &[&[u8]], len_bytes: usize) {
    for (index, block) in data.iter().enumerate() {
        assert_len(format_args!("data block {index}"), block.len(), len_bytes);
    }
}

fn assert_optional_data_lens(data: &[Option<&[u8]>], len_bytes: usize) {
    for (index, block) in data.iter().enumerate() {
        if let Some(block) = block {
            assert_len(format_args!("data block {index}"), block.len(), len_bytes);
        }
    }
}

fn assert_index_range(first_index: usize, count: usize) {
    let end = first_index.saturating_add(count);
    assert!(
        end <= MAX_DATA_BLOCKS,
        "data indices {first_index}..{end} exceed the RAID6 limit of {MAX_DATA_BLOCKS} data blocks"
    );
}

/// Indices of the absent data blocks; panics unless there are exactly `N` of them.
fn missing_data<const N: usize>(data: &[Option<&[u8]>], what: &str) -> [usize; N] {
    let mut found = [0usize; N];
    let mut count = 0;
    for (index, _) in data.iter().enumerate().filter(|(_, block)| block.is_none()) {
        if count < N {
            found[count] = index;
        }
        count += 1;
    }
    assert!(count == N, "{what} needs exactly {N} missing (None) data block(s), found {count}");
    found
}

//------------------------------------------------------------------------------------------------
// Operations

impl Implementation {
    /// RAID4/5 parity: `p = data[0] ^ data[1] ^ ...` (zeroes for empty `data`).
    pub fn xor_gen(&self, data: &[&[u8]], p: &mut [u8]) {
        assert_data_lens(data, p.len());
        self.k_xor(p, data, 0, false);
    }

    /// `dst ^= srcs[0] ^ srcs[1] ^ ...` — RAID5 read-modify-write (`xor_into(p, &[old, new])`)
    /// and single-block reconstruction (the kernel's xor_blocks).
    pub fn xor_into(&self, dst: &mut [u8], srcs: &[&[u8]]) {
        for (index, block) in srcs.iter().enumerate() {
            assert_len(format_args!("source block {index}"), block.len(), dst.len());
        }
        self.k_xor(dst, srcs, 0, true);
    }

    /// RAID6 P and Q of `data` (Q order), the kernel's gen_syndrome.
    pub fn pq_gen(&self, data: &[&[u8]], p: &mut [u8], q: &mut [u8]) {
        assert_len(format_args!("Q"), q.len(), p.len());
        assert_data_lens(data, p.len());
        assert_index_range(0, data.len());
        self.k_pq(data, 0, 0, Some(p), q, false);
    }

    /// [`pq_gen`](Implementation::pq_gen) where `None` blocks count as zeroes: the DDF layouts
    /// (formats.md 3.3) compute the syndrome over all device slots with the P and Q slots as
    /// zero blocks, and a short stripe can leave positions empty.
    pub fn pq_gen_sparse(&self, data: &[Option<&[u8]>], p: &mut [u8], q: &mut [u8]) {
        assert_len(format_args!("Q"), q.len(), p.len());
        assert_optional_data_lens(data, p.len());
        assert_index_range(0, data.len());
        self.k_pq(data, 0, 0, Some(p), q, false);
    }

    /// XORs the contribution of `blocks`, taken as data indices
    /// `first_index .. first_index + blocks.len()`, into P and Q:
    /// `P ^= ⊕ blocks[j]`, `Q ^= Σ g^(first_index + j)·blocks[j]` (the kernel's xor_syndrome
    /// with start = first_index, stop = first_index + blocks.len() - 1). Calling it once with
    /// the old contents and once with the new contents of those blocks is RAID6
    /// read-modify-write.
    pub fn pq_xor_syndrome(&self, first_index: usize, blocks: &[&[u8]], p: &mut [u8], q: &mut [u8]) {
        assert_len(format_args!("Q"), q.len(), p.len());
        assert_data_lens(blocks, p.len());
        assert_index_range(first_index, blocks.len());
        if blocks.is_empty() {
            return;
        }
        self.k_pq(blocks, first_index, 0, Some(p), q, true);
    }

    /// Read-modify-write of one data block at Q-order `index`, in one pass:
    /// `P ^= old ^ new`, `Q ^= g^index·(old ^ new)`.
    pub fn pq_update(&self, index: usize, old: &[u8], new: &[u8], p: &mut [u8], q: &mut [u8]) {
        assert_index_range(index, 1);
        assert_len(format_args!("new data block"), new.len(), old.len());
        assert_len(format_args!("P"), p.len(), old.len());
        assert_len(format_args!("Q"), q.len(), old.len());
        self.k_mul_acc(gf::EXP[index], old, new, p, q);
    }

    /// Checks P and Q against `data` and names the single wrong member if there is one
    /// (see [`PqCheck`]). Works in 4 KiB passes with stack buffers; allocates nothing.
    pub fn pq_check(&self, data: &[&[u8]], p: &[u8], q: &[u8]) -> PqCheck {
        let len = p.len();
        assert_len(format_args!("Q"), q.len(), len);
        assert_data_lens(data, len);
        assert_index_range(0, data.len());
        let mut p_calc = [0u8; CHECK_SEGMENT_BYTES];
        let mut q_calc = [0u8; CHECK_SEGMENT_BYTES];
        let mut culprit: Option<PqCheck> = None;
        let mut offset = 0;
        while offset < len {
            let seg = CHECK_SEGMENT_BYTES.min(len - offset);
            let (pc, qc) = (&mut p_calc[..seg], &mut q_calc[..seg]);
            let (p_seg, q_seg) = (&p[offset..offset + seg], &q[offset..offset + seg]);
            self.k_pq(data, 0, offset, Some(&mut *pc), &mut *qc, false);
            // The common case, a consistent stripe, costs one gen plus two memcmp.
            if pc != p_seg || qc != q_seg {
                for ((&pc_byte, &qc_byte), (&p_byte, &q_byte)) in pc.iter().zip(qc.iter()).zip(p_seg.iter().zip(q_seg))
                {
                    let Some(verdict) = byte_culprit(pc_byte ^ p_byte, qc_byte ^ q_byte, data.len()) else {
                        continue;
                    };
                    match culprit {
                        None => culprit = Some(verdict),
                        Some(previous) if previous == verdict => {}
                        Some(_) => return PqCheck::MultipleWrong,
                    }
                    if verdict == PqCheck::MultipleWrong {
                        return verdict;
                    }
                }
            }
            offset += seg;
        }
        culprit.unwrap_or(PqCheck::Consistent)
    }

    /// Rebuilds the one missing (`None`) data block from P and the others (RAID5 degraded read,
    /// RAID6 with one failure): `out = P ^ ⊕ others`.
    pub fn recover_data_from_p(&self, data: &[Option<&[u8]>], p: &[u8], out: &mut [u8]) {
        let [missing] = missing_data::<1>(data, "recover_data_from_p");
        assert_len(format_args!("P"), p.len(), out.len());
        assert_optional_data_lens(data, out.len());
        let with_p = Filled { base: data, index: missing, block: p };
        self.k_xor(out, &with_p, 0, false);
    }

    /// Rebuilds two missing data blocks a < b (the two `None`s) from P and Q, the kernel's
    /// raid6_2data_recov: `out_a` receives D_a and `out_b` D_b.
    pub fn recover_2data(&self, data: &[Option<&[u8]>], p: &[u8], q: &[u8], out_a: &mut [u8], out_b: &mut [u8]) {
        let [a, b] = missing_data::<2>(data, "recover_2data");
        let len = p.len();
        assert_len(format_args!("Q"), q.len(), len);
        assert_len(format_args!("output block a"), out_a.len(), len);
        assert_len(format_args!("output block b"), out_b.len(), len);
        assert_optional_data_lens(data, len);
        assert_index_range(0, data.len());
        // Syndromes of the survivors, kept in the outputs (as the kernel keeps them in the
        // dead pages): P ^ P' = D_a ^ D_b and Q ^ Q' = g^a·D_a ^ g^b·D_b.
        self.k_pq(data, 0, 0, Some(&mut *out_a), &mut *out_b, false);
        // D_b = (g^a·(P^P') ^ (Q^Q')) / (g^a ^ g^b)
        //     = EXI[b-a]·(P^P') ^ INV[g^a ^ g^b]·(Q^Q');  D_a = (P^P') ^ D_b.
        let pbmul = gf::EXI[b - a];
        let qmul = gf::INV[(gf::EXP[a] ^ gf::EXP[b]) as usize];
        self.k_recov_2data(p, q, out_a, out_b, pbmul, qmul);
    }

    /// Rebuilds the one missing data block and P from Q and the other data blocks, the
    /// kernel's raid6_datap_recov.
    pub fn recover_datap(&self, data: &[Option<&[u8]>], q: &[u8], out_data: &mut [u8], out_p: &mut [u8]) {
        let [missing] = missing_data::<1>(data, "recover_datap");
        let len = q.len();
        assert_len(format_args!("output data block"), out_data.len(), len);
        assert_len(format_args!("output P"), out_p.len(), len);
        assert_optional_data_lens(data, len);
        assert_index_range(0, data.len());
        // out_p = P' of the survivors, out_data = Q' of the survivors;
        // then D_x = g^-x·(Q ^ Q') and P = P' ^ D_x.
        self.k_pq(data, 0, 0, Some(&mut *out_p), &mut *out_data, false);
        let qmul = gf::INV[gf::EXP[missing] as usize];
        self.k_recov_datap(q, out_data, out_p, qmul);
    }

    /// Rebuilds the one missing data block (from P) and then Q.
    pub fn recover_dataq(&self, data: &[Option<&[u8]>], p: &[u8], out_data: &mut [u8], out_q: &mut [u8]) {
        let [missing] = missing_data::<1>(data, "recover_dataq");
        let len = p.len();
        assert_len(format_args!("output data block"), out_data.len(), len);
        assert_len(format_args!("output Q"), out_q.len(), len);
        assert_optional_data_lens(data, len);
        assert_index_range(0, data.len());
        let with_p = Filled { base: data, index: missing, block: p };
        self.k_xor(out_data, &with_p, 0, false);
        let complete = Filled { base: data, index: missing, block: out_data };
        self.k_pq(&complete, 0, 0, None, out_q, false);
    }

    /// Rebuilds whatever is missing of one RAID6 stripe, if at most two members are.
    ///
    /// `data` holds the data blocks in Q order with `None` for the missing ones; `p`/`q` are
    /// `None` when missing. `out` holds one buffer per missing member, in the order: missing data
    /// blocks by ascending index, then P, then Q. Contents of `out` on entry are ignored.
    pub fn recover(
        &self,
        data: &[Option<&[u8]>],
        p: Option<&[u8]>,
        q: Option<&[u8]>,
        out: &mut [&mut [u8]],
    ) -> Result<(), RecoverError> {
        let mut missing: Vec<Member> = Vec::new();
        let missing_count =
            data.iter().filter(|b| b.is_none()).count() + usize::from(p.is_none()) + usize::from(q.is_none());
        if missing_count > 2 {
            missing.extend(data.iter().enumerate().filter(|(_, b)| b.is_none()).map(|(i, _)| Member::Data(i)));
            missing.extend(p.is_none().then_some(Member::P));
            missing.extend(q.is_none().then_some(Member::Q));
            return Err(RecoverError::TooManyMissing { missing });
        }
        assert!(
            out.len() == missing_count,
            "recover: {} output buffers for {missing_count} missing members",
            out.len()
        );
        let data_missing = missing_count - usize::from(p.is_none()) - usize::from(q.is_none());
        match (data_missing, p, q, out) {
            (_, _, _, []) => {}
            (0, None, Some(_), [out_p]) => self.k_xor(out_p, data, 0, false),
            (0, Some(_), None, [out_q]) => self.k_pq(data, 0, 0, None, out_q, false),
            (0, None, None, [out_p, out_q]) => self.k_pq(data, 0, 0, Some(&mut **out_p), out_q, false),
            (1, Some(p), Some(_), [out_d]) => self.recover_data_from_p(data, p, out_d),
            (1, None, Some(q), [out_d, out_p]) => self.recover_datap(data, q, out_d, out_p),
            (1, Some(p), None, [out_d, out_q]) => self.recover_dataq(data, p, out_d, out_q),
            (2, Some(p), Some(q), [out_a, out_b]) => self.recover_2data(data, p, q, out_a, out_b),
            _ => unreachable!("missing-member cases are exhaustive for at most two missing"),
        }
        Ok(())
    }
}

/// The member one byte position blames, or None when the position is consistent.
fn byte_culprit(p_delta: u8, q_delta: u8, data_count: usize) -> Option<PqCheck> {
    match (p_delta, q_delta) {
        (0, 0) => None,
        (_, 0) => Some(PqCheck::WrongP),
        (0, _) => Some(PqCheck::WrongQ),
        (pd, qd) => {
            let log_p = usize::from(gf::LOG[pd as usize]);
            let log_q = usize::from(gf::LOG[qd as usize]);
            let index = (log_q + gf::GENERATOR_ORDER - log_p) % gf::GENERATOR_ORDER;
            Some(if index < data_count { PqCheck::WrongData { index } } else { PqCheck::MultipleWrong })
        }
    }
}

//------------------------------------------------------------------------------------------------
// Free functions: the selected implementation

/// [`Implementation::xor_gen`] with the selected implementation.
pub fn xor_gen(data: &[&[u8]], p: &mut [u8]) {
    implementation().xor_gen(data, p)
}

/// [`Implementation::xor_into`] with the selected implementation.
pub fn xor_into(dst: &mut [u8], srcs: &[&[u8]]) {
    implementation().xor_into(dst, srcs)
}

/// [`Implementation::pq_gen`] with the selected implementation.
pub fn pq_gen(data: &[&[u8]], p: &mut [u8], q: &mut [u8]) {
    implementation().pq_gen(data, p, q)
}

/// [`Implementation::pq_gen_sparse`] with the selected implementation.
pub fn pq_gen_sparse(data: &[Option<&[u8]>], p: &mut [u8], q: &mut [u8]) {
    implementation().pq_gen_sparse(data, p, q)
}

/// [`Implementation::pq_xor_syndrome`] with the selected implementation.
pub fn pq_xor_syndrome(first_index: usize, blocks: &[&[u8]], p: &mut [u8], q: &mut [u8]) {
    implementation().pq_xor_syndrome(first_index, blocks, p, q)
}

/// [`Implementation::pq_update`] with the selected implementation.
pub fn pq_update(index: usize, old: &[u8], new: &[u8], p: &mut [u8], q: &mut [u8]) {
    implementation().pq_update(index, old, new, p, q)
}

/// [`Implementation::pq_check`] with the selected implementation.
pub fn pq_check(data: &[&[u8]], p: &[u8], q: &[u8]) -> PqCheck {
    implementation().pq_check(data, p, q)
}

/// [`Implementation::recover_data_from_p`] with the selected implementation.
pub fn recover_data_from_p(data: &[Option<&[u8]>], p: &[u8], out: &mut [u8]) {
    implementation().recover_data_from_p(data, p, out)
}

/// [`Implementation::recover_2data`] with the selected implementation.
pub fn recover_2data(data: &[Option<&[u8]>], p: &[u8], q: &[u8], out_a: &mut [u8], out_b: &mut [u8]) {
    implementation().recover_2data(data, p, q, out_a, out_b)
}

/// [`Implementation::recover_datap`] with the selected implementation.
pub fn recover_datap(data: &[Option<&[u8]>], q: &[u8], out_data: &mut [u8], out_p: &mut [u8]) {
    implementation().recover_datap(data, q, out_data, out_p)
}

/// [`Implementation::recover_dataq`] with the selected implementation.
pub fn recover_dataq(data: &[Option<&[u8]>], p: &[u8], out_data: &mut [u8], out_q: &mut [u8]) {
    implementation().recover_dataq(data, p, out_data, out_q)
}

/// [`Implementation::recover`] with the selected implementation.
pub fn recover(
    data: &[Option<&[u8]>],
    p: Option<&[u8]>,
    q: Option<&[u8]>,
    out: &mut [&mut [u8]],
) -> Result<(), RecoverError> {
    implementation().recover(data, p, q, out)
}
