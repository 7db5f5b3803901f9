//! GF(2^8) arithmetic exactly as the Linux RAID6 code uses it.
//!
//! The field is GF(2)[x] / (x^8 + x^4 + x^3 + x^2 + 1), i.e. reduction polynomial **0x11d**, and
//! the generator is g = {02}. Multiplying by {02} is "shift left one bit, XOR 0x1d if a bit fell
//! out". Addition is XOR. (Source: lib/raid6/mktables.c; formats.md §3.3.)
//!
//! Every table here is computed by `const fn` at compile time from those two definitions; none is
//! copied. Names follow the kernel's tables so the recovery code reads like lib/raid6/recov.c:
//!
//! ```text
//!   MUL[a][b]   a·b                         (64 KiB, the kernel's raid6_gfmul)
//!   EXP[i]      g^i for i in 0..255         (EXP[255] = g^255 = 1)
//!   LOG[a]      i with g^i = a, for a != 0  (LOG[0] is meaningless and set to 0)
//!   INV[a]      a^-1 = a^254                (INV[0] = 0)
//!   EXI[i]      (g^i + 1)^-1, for i in 1..255 (EXI[0] = INV[0] = 0)
//!   NIBBLE_MUL[c] = [c·0x0, c·0x1, ..., c·0xf, c·0x00, c·0x10, ..., c·0xf0]
//!                 (the kernel's raid6_vgfmul: pshufb tables for multiply-by-constant)
//! ```

//------------------------------------------------------------------------------------------------

/// The low byte of the reduction polynomial x^8 + x^4 + x^3 + x^2 + 1 (0x11d).
pub const POLY_LOW_BYTE: u8 = 0x1d;

/// The multiplicative order of g = {02}: g^255 = 1, so at most 255 distinct data coefficients.
pub const GENERATOR_ORDER: usize = 255;

/// a·{02}.
#[inline(always)]
pub const fn mul2(a: u8) -> u8 {
    let carry = if a & 0x80 != 0 { POLY_LOW_BYTE } else { 0 };
    (a << 1) ^ carry
}

/// a·b by shift-and-add ("Russian peasant"), the definition the tables are built from.
pub const fn mul(a: u8, b: u8) -> u8 {
    let mut product = 0u8;
    let mut a_shifted = a;
    let mut b_rest = b;
    while b_rest != 0 {
        if b_rest & 1 != 0 {
            product ^= a_shifted;
        }
        a_shifted = mul2(a_shifted);
        b_rest >>= 1;
    }
    product
}

/// g^exponent for any exponent (reduced modulo the generator order).
pub const fn pow_g(exponent: usize) -> u8 {
    EXP[exponent % GENERATOR_ORDER]
}

/// a^-1 (0 for a = 0, which has no inverse).
#[inline]
pub const fn inv(a: u8) -> u8 {
    INV[a as usize]
}

//------------------------------------------------------------------------------------------------

const fn build_exp() -> [u8; 256] {
    let mut table = [0u8; 256];
    let mut value = 1u8;
    let mut i = 0;
    while i < 256 {
        table[i] = value;
        value = mul2(value);
        i += 1;
    }
    table
}

const fn build_log() -> [u8; 256] {
    let mut table = [0u8; 256];
    let mut value = 1u8;
    let mut i = 0;
    while i < GENERATOR_ORDER {
        table[value as usize] = i as u8;
        value = mul2(value);
        i += 1;
    }
    table
}

const fn build_mul() -> [[u8; 256]; 256] {
    let mut table = [[0u8; 256]; 256];
    let mut a = 0;
    while a < 256 {
        // Row a by linearity: a·b = a·(b>>1)·2 ^ (b&1 ? a : 0), one step per entry.
        let mut b = 1;
        while b < 256 {
            let half = table[a][b >> 1];
            let odd = if b & 1 != 0 { a as u8 } else { 0 };
            table[a][b] = mul2(half) ^ odd;
            b += 1;
        }
        a += 1;
    }
    table
}

const fn build_inv() -> [u8; 256] {
    let mut table = [0u8; 256];
    let mut a = 1;
    while a < 256 {
        // a^254 = a^-1 because a^255 = 1 for every non-zero a.
        let a_log = LOG[a] as usize;
        table[a] = EXP[(a_log * 254) % GENERATOR_ORDER];
        a += 1;
    }
    table
}

const fn build_exi() -> [u8; 256] {
    let mut table = [0u8; 256];
    let mut i = 0;
    while i < 256 {
        table[i] = INV[(EXP[i] ^ 1) as usize];
        i += 1;
    }
    table
}

const fn build_nibble_mul() -> [[u8; 32]; 256] {
    let mut table = [[0u8; 32]; 256];
    let mut c = 0;
    while c < 256 {
        let mut nibble = 0;
        while nibble < 16 {
            table[c][nibble] = mul(c as u8, nibble as u8);
            table[c][16 + nibble] = mul(c as u8, (nibble << 4) as u8);
            nibble += 1;
        }
        c += 1;
    }
    table
}

/// EXP[i] = g^i.
pub static EXP: [u8; 256] = build_exp();
/// LOG[a] = log_g(a) for a != 0.
pub static LOG: [u8; 256] = build_log();
/// MUL[a][b] = a·b.
pub static MUL: [[u8; 256]; 256] = build_mul();
/// INV[a] = a^-1.
pub static INV: [u8; 256] = build_inv();
/// EXI[i] = (g^i + 1)^-1: the coefficient of the lower failed block in 2-data recovery.
pub static EXI: [u8; 256] = build_exi();
/// NIBBLE_MUL[c]: low-nibble products in [0..16], high-nibble products in [16..32].
pub static NIBBLE_MUL: [[u8; 32]; 256] = build_nibble_mul();

//------------------------------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;

    /// Carry-less product reduced by 0x11d, written differently from `mul` on purpose.
    fn mul_reference(a: u8, b: u8) -> u8 {
        let mut wide: u16 = 0;
        for bit in 0..8 {
            if b & (1 << bit) != 0 {
                wide ^= u16::from(a) << bit;
            }
        }
        for bit in (8..16).rev() {
            if wide & (1 << bit) != 0 {
                wide ^= 0x11d << (bit - 8);
            }
        }
        wide as u8
    }

    #[test]
    fn mul_table_matches_polynomial_definition() {
        for a in 0..=255u8 {
            for b in 0..=255u8 {
                assert_eq!(MUL[a as usize][b as usize], mul_reference(a, b), "{a}·{b}");
                assert_eq!(mul(a, b), mul_reference(a, b), "{a}·{b}");
            }
        }
    }

    #[test]
    fn known_products() {
        // 0x80·2 overflows: 0x100 ^ 0x11d = 0x1d.
        assert_eq!(mul2(0x80), 0x1d);
        assert_eq!(mul2(0x01), 0x02);
        assert_eq!(mul2(0xff), 0xe3); // 0x1fe ^ 0x11d
        assert_eq!(EXP[8], 0x1d);
        assert_eq!(EXP[255], 1);
        assert_eq!(LOG[0x1d], 8);
    }

    #[test]
    fn generator_has_full_order_and_log_inverts_exp() {
        let mut seen = [false; 256];
        for (i, &v) in EXP.iter().enumerate().take(GENERATOR_ORDER) {
            assert_ne!(v, 0);
            assert!(!seen[v as usize], "g^{i} repeats");
            seen[v as usize] = true;
            assert_eq!(LOG[v as usize] as usize, i);
        }
        assert_eq!(pow_g(255), 1);
        assert_eq!(pow_g(256), 2);
    }

    #[test]
    fn inverse_and_exi() {
        assert_eq!(INV[0], 0);
        for a in 1..=255u8 {
            assert_eq!(mul(a, INV[a as usize]), 1, "{a}");
        }
        for i in 1..255usize {
            assert_eq!(mul(EXI[i], EXP[i] ^ 1), 1, "exi {i}");
        }
    }

    #[test]
    fn nibble_tables_compose_to_mul() {
        for c in 0..256usize {
            for x in 0..256usize {
                let lo = NIBBLE_MUL[c][x & 15];
                let hi = NIBBLE_MUL[c][16 + (x >> 4)];
                assert_eq!(lo ^ hi, MUL[c][x]);
            }
        }
    }
}
