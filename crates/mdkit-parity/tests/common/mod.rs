//! Shared test helpers: a seeded PRNG and a deliberately naive reference of the RAID6 math,
//! written from the definitions (carry-less multiply reduced by 0x11d), sharing no code or
//! tables with the crate.

#![allow(dead_code)]

/// SplitMix64; the seed is printed by the tests that use it.
pub struct TestRng(u64);

impl TestRng {
    pub fn new(seed: u64) -> TestRng {
        TestRng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, bound: u64) -> u64 {
        self.next_u64() % bound
    }
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next_u64() as u8).collect()
    }
}

/// a·b in GF(2^8) with x^8+x^4+x^3+x^2+1: carry-less product, then polynomial reduction.
pub fn ref_mul(a: u8, b: u8) -> u8 {
    let mut wide: u16 = 0;
    for bit in 0..8 {
        if (b >> bit) & 1 == 1 {
            wide ^= (a as u16) << bit;
        }
    }
    for bit in (8..16).rev() {
        if (wide >> bit) & 1 == 1 {
            wide ^= 0x11d << (bit - 8);
        }
    }
    wide as u8
}

/// g^i with g = {02}, by repeated multiplication.
pub fn ref_pow2(i: usize) -> u8 {
    let mut v = 1u8;
    for _ in 0..i {
        v = ref_mul(v, 2);
    }
    v
}

/// P = ⊕ D_i, Q = Σ g^i·D_i, byte by byte, straight from the definition (no Horner).
pub fn ref_pq(data: &[Vec<u8>], len: usize) -> (Vec<u8>, Vec<u8>) {
    let mut p = vec![0u8; len];
    let mut q = vec![0u8; len];
    for (i, block) in data.iter().enumerate() {
        let coefficient = ref_pow2(i);
        for x in 0..len {
            p[x] ^= block[x];
            q[x] ^= ref_mul(coefficient, block[x]);
        }
    }
    (p, q)
}

/// Random blocks inside a larger allocation at a chosen misalignment, so that SIMD code sees
/// unaligned pointers.
pub struct Blocks {
    storage: Vec<Vec<u8>>,
    pub offset: usize,
    pub len: usize,
}

impl Blocks {
    pub fn random(rng: &mut TestRng, count: usize, len: usize, offset: usize) -> Blocks {
        let storage = (0..count).map(|_| rng.bytes(len + offset)).collect();
        Blocks { storage, offset, len }
    }
    pub fn get(&self) -> Vec<&[u8]> {
        self.storage.iter().map(|b| &b[self.offset..self.offset + self.len]).collect()
    }
    pub fn owned(&self) -> Vec<Vec<u8>> {
        self.get().iter().map(|b| b.to_vec()).collect()
    }
}

/// An output buffer of `len` bytes starting `offset` bytes into its allocation, prefilled with
/// garbage so that "ignored on entry" is actually tested.
pub fn garbage_out(rng: &mut TestRng, len: usize, offset: usize) -> Vec<u8> {
    rng.bytes(len + offset)
}

/// Lengths that cover every code path: empty, bytes-only tails, one 32-byte lane, 128-byte
/// steps with and without remainders, pages.
pub const LENGTHS: &[usize] =
    &[0, 1, 7, 8, 31, 32, 33, 63, 64, 65, 127, 128, 129, 160, 255, 256, 257, 511, 4096, 4097, 8191];
