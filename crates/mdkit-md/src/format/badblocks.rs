//! The md bad-block log: up to one 4 KiB page at `super_offset + bblog_offset`, holding
//! little-endian u64 entries `((sector >> shift) << 10) | (length >> shift)`: start and length in
//! units of `2^bblog_shift` sectors, length 1..=512 units in the low 10 bits. The first all-ones
//! entry ends the list (the kernel fills the unused part of the page with 0xff).
//!
//! Source: md.c super_1_load (reading) and super_1_sync (writing); formats.md 1.5.

use super::{METADATA_BLOCK_BYTES, le_u64, put_u64};

/// Entries in one 4 KiB log page.
pub const ENTRIES_PER_PAGE: usize = METADATA_BLOCK_BYTES / 8;
/// Largest length (in `2^shift`-sector units) one entry can hold.
pub const MAX_ENTRY_UNITS: u64 = 512;
const END_OF_LIST: u64 = u64::MAX;

/// One bad range in absolute member-device sectors (md adds `data_offset` before recording,
/// see rdev_set_badblocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct BadBlock {
    pub start_sector: u64,
    pub len_sectors: u64,
}

/// Why a log cannot be decoded or encoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BadBlockError {
    #[error("bad-block log buffer is {len_bytes} bytes, not a multiple of 8 or larger than one 4 KiB page")]
    BadLength { len_bytes: usize },
    #[error("bad-block entry {index} has length 0")]
    ZeroLength { index: usize },
    #[error(
        "bad block at sector {start_sector} (+{len_sectors}) is not aligned to 2^{shift} sectors or too long for one entry"
    )]
    Unrepresentable { start_sector: u64, len_sectors: u64, shift: u8 },
    #[error("{count} bad-block entries do not fit in one 4 KiB page ({ENTRIES_PER_PAGE} max)")]
    TooMany { count: usize },
    #[error("bad-block entry {index} does not fit 64-bit sectors with bblog_shift {shift}")]
    OutOfRange { index: usize, shift: u8 },
}

/// Decodes a log read from disk (`bblog_size` sectors, at most one page).
pub fn decode(log: &[u8], shift: u8) -> Result<Vec<BadBlock>, BadBlockError> {
    if !log.len().is_multiple_of(8) || log.len() > METADATA_BLOCK_BYTES {
        return Err(BadBlockError::BadLength { len_bytes: log.len() });
    }
    let mut out = Vec::new();
    for index in 0..log.len() / 8 {
        let raw = le_u64(log, index * 8);
        if raw == END_OF_LIST {
            break;
        }
        let units = raw & 0x3ff;
        if units == 0 {
            return Err(BadBlockError::ZeroLength { index });
        }
        // bblog_shift comes from disk: widen, then refuse what does not fit 64 bits.
        let wide = |v: u64| (u32::from(shift) < 64).then(|| u128::from(v) << shift).and_then(|w| u64::try_from(w).ok());
        let (Some(start_sector), Some(len_sectors)) = (wide(raw >> 10), wide(units)) else {
            return Err(BadBlockError::OutOfRange { index, shift });
        };
        out.push(BadBlock { start_sector, len_sectors });
    }
    Ok(out)
}

/// Encodes a list into a full 4 KiB page (unused entries all-ones).
pub fn encode(blocks: &[BadBlock], shift: u8) -> Result<[u8; METADATA_BLOCK_BYTES], BadBlockError> {
    if blocks.len() > ENTRIES_PER_PAGE {
        return Err(BadBlockError::TooMany { count: blocks.len() });
    }
    let mut page = [0xffu8; METADATA_BLOCK_BYTES];
    if shift >= 54 {
        // Entries hold 54 bits of start; larger shifts cannot describe any block.
        return match blocks.first() {
            None => Ok(page),
            Some(b) => {
                Err(BadBlockError::Unrepresentable { start_sector: b.start_sector, len_sectors: b.len_sectors, shift })
            }
        };
    }
    let unit_mask = (1u64 << shift) - 1;
    for (i, b) in blocks.iter().enumerate() {
        let units = b.len_sectors >> shift;
        let bad = b.start_sector & unit_mask != 0
            || b.len_sectors & unit_mask != 0
            || units == 0
            || units > MAX_ENTRY_UNITS
            || (b.start_sector >> shift) >= (1u64 << 54);
        if bad {
            return Err(BadBlockError::Unrepresentable {
                start_sector: b.start_sector,
                len_sectors: b.len_sectors,
                shift,
            });
        }
        // A length of 512 units is stored as 0x200, which still fits the 10-bit field.
        put_u64(&mut page, i * 8, ((b.start_sector >> shift) << 10) | units);
    }
    Ok(page)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_terminator() {
        let list =
            vec![BadBlock { start_sector: 0, len_sectors: 8 }, BadBlock { start_sector: 4096, len_sectors: 512 }];
        let page = encode(&list, 0).unwrap();
        assert_eq!(decode(&page, 0).unwrap(), list);
        assert_eq!(decode(&[0xff; 4096], 0).unwrap(), vec![]);
        let shifted = vec![BadBlock { start_sector: 64, len_sectors: 16 }];
        assert_eq!(decode(&encode(&shifted, 3).unwrap(), 3).unwrap(), shifted);
        assert!(encode(&[BadBlock { start_sector: 1, len_sectors: 8 }], 3).is_err());
        assert!(decode(&[0u8; 8], 0).is_err());
        assert!(decode(&[0u8; 7], 0).is_err());
        // Shifts from disk may be anything: no panic, a clear error.
        assert_eq!(encode(&[], 200).unwrap(), [0xff; 4096]);
        assert!(encode(&shifted, 64).is_err());
        let mut page = [0xffu8; 4096];
        page[..8].copy_from_slice(&((1u64 << 10) | 1).to_le_bytes());
        assert!(matches!(decode(&page, 64), Err(BadBlockError::OutOfRange { .. })));
    }
}
