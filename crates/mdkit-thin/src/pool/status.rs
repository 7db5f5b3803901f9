//! Block status of thin volumes, from the mapping btree: a mapped block is allocated data, an
//! unmapped block is a hole that reads as zeroes (reads of unmapped blocks return zeroes
//! whatever the zeroing option says). Blocks shared with a snapshot are reported as data, not
//! holes, although a write to them allocates: reporting them as holes would make clients skip
//! them (thin-lifecycle.md §7.2).
//!
//! The lookup runs on the metadata worker, like every other metadata read that may do I/O, and
//! walks only the mappings inside the requested range, stopping as soon as the answer is full.
//! A provisioning write still in flight may be reported as a hole; the client asked while
//! writing, and either answer is a state the range was in.

use std::io;

use mdkit_io::{Extent, ExtentFlags, ExtentList, check_status_range};

use super::ThinDev;
use crate::meta::MetaError;

/// Extents of `[offset_bytes, offset_bytes + len_bytes)` given the mapped virtual blocks in
/// that range, ascending (`block_bytes` per block). Mapped blocks are data, the rest holes.
pub(crate) fn extents_from_mapped(
    offset_bytes: u64,
    len_bytes: u64,
    block_bytes: u64,
    max_extents: usize,
    mapped: impl IntoIterator<Item = u64>,
) -> Vec<Extent> {
    let shape = Shape { offset_bytes, len_bytes, block_bytes, max_extents };
    shape.runs(mapped, ExtentFlags::DATA, ExtentFlags::HOLE_ZERO)
}

/// A range cut into blocks, and the most extents an answer may have.
struct Shape {
    offset_bytes: u64,
    len_bytes: u64,
    block_bytes: u64,
    max_extents: usize,
}

impl Shape {
    /// Extents where the `marked` blocks (ascending) have `on` and the others `off`.
    fn runs<F: Copy + PartialEq>(&self, marked: impl IntoIterator<Item = u64>, on: F, off: F) -> Vec<Extent<F>> {
        let mut list = ExtentList::new(self.len_bytes, self.max_extents);
        let end = self.offset_bytes + self.len_bytes;
        let mut pos = self.offset_bytes;
        for vb in marked {
            let start = vb.saturating_mul(self.block_bytes);
            if start >= end {
                break;
            }
            if start > pos && !list.push(start - pos, off) {
                return list.finish();
            }
            let stop = start.saturating_add(self.block_bytes).min(end);
            if stop > pos && !list.push(stop - pos.max(start), on) {
                return list.finish();
            }
            pos = pos.max(stop);
        }
        if pos < end {
            list.push(end - pos, off);
        }
        list.finish()
    }
}

/// Virtual blocks whose mapping differs between two ascending mapping lists (thin_delta's
/// rules: different data block, or mapped on one side only), ascending.
pub(crate) fn changed_blocks(current: &[(u64, u64)], base: &[(u64, u64)]) -> Vec<u64> {
    let (mut i, mut j) = (0, 0);
    let mut out = Vec::new();
    while i < current.len() || j < base.len() {
        match (current.get(i), base.get(j)) {
            (Some(&(a, da)), Some(&(b, db))) if a == b => {
                if da != db {
                    out.push(a);
                }
                i += 1;
                j += 1;
            }
            (Some(&(a, _)), Some(&(b, _))) if a < b => {
                out.push(a);
                i += 1;
            }
            (Some(_), Some(&(b, _))) => {
                out.push(b);
                j += 1;
            }
            (Some(&(a, _)), None) => {
                out.push(a);
                i += 1;
            }
            (None, Some(&(b, _))) => {
                out.push(b);
                j += 1;
            }
            (None, None) => break,
        }
    }
    out
}

/// Blocks compared per changed-since request: the answer covers at most this many (the client
/// asks again from where it stopped), so the worker's time and the memory stay bounded.
const CHANGED_WINDOW_BLOCKS: u64 = 1 << 16;

impl ThinDev {
    /// The thin volume's block status (see the module docs).
    pub(crate) async fn block_status(
        &self,
        name: &str,
        size_bytes: u64,
        offset_bytes: u64,
        len_bytes: u64,
        max_extents: usize,
    ) -> io::Result<Vec<Extent>> {
        check_status_range(name, size_bytes, offset_bytes, len_bytes)?;
        self.pool.state.check_open()?;
        if len_bytes == 0 {
            return Ok(vec![]);
        }
        let bs = self.pool.state.block_bytes;
        let begin = offset_bytes / bs;
        let end = (offset_bytes + len_bytes).div_ceil(bs);
        // A run of distinct extents alternates data and hole, so `max_extents` data runs are
        // enough mappings; collecting no more bounds the worker's time and the memory.
        let cap = max_extents.max(1).saturating_mul(2);
        let id = self.id;
        let name_owned = name.to_string();
        let (mapped, truncated) = self
            .pool
            .call_io(move |w| {
                let md = w.md.read();
                let mut v: Vec<u64> = Vec::new();
                let mut runs = 0usize;
                md.for_each_mapping(id, begin, end, &mut |vb, _| {
                    if v.last().is_none_or(|&last| last + 1 != vb) {
                        runs += 1;
                    }
                    v.push(vb);
                    runs <= cap
                })
                .map(|()| (v, runs > cap))
                .map_err(|e| io::Error::other(format!("{name_owned}: block status of blocks {begin}..{end}: {e}")))
            })
            .await??;
        // Past the last mapping collected nothing is known: the answer stops there.
        let known_len = match mapped.last() {
            Some(&last) if truncated => ((last + 1) * bs - offset_bytes).min(len_bytes),
            _ => len_bytes,
        };
        Ok(extents_from_mapped(offset_bytes, known_len, bs, max_extents, mapped))
    }

    /// The thin volume's blocks that differ from thin device `base` (see the NBD
    /// `x-mdkit:changed-since:` context). A zero-length range checks that `base` exists.
    pub(crate) async fn changed_since(
        &self,
        name: &str,
        size_bytes: u64,
        base: u64,
        offset_bytes: u64,
        len_bytes: u64,
        max_extents: usize,
    ) -> io::Result<Vec<Extent<bool>>> {
        check_status_range(name, size_bytes, offset_bytes, len_bytes)?;
        self.pool.state.check_open()?;
        let bs = self.pool.state.block_bytes;
        let begin = offset_bytes / bs;
        let end = (offset_bytes + len_bytes).div_ceil(bs).min(begin + CHANGED_WINDOW_BLOCKS);
        let len = len_bytes.min(end * bs - offset_bytes);
        let (id, who) = (self.id, name.to_string());
        let (current, older) = self
            .pool
            .call_io(move |w| {
                let md = w.md.read();
                let fail = |e: MetaError| io::Error::other(format!("{who}: changed since thin {base}: {e}"));
                if md.device_details(base).is_err() {
                    return Err(io::Error::new(
                        io::ErrorKind::NotFound,
                        format!("{who}: changed since thin {base}: no thin device {base} in the pool"),
                    ));
                }
                let mut lists = [Vec::new(), Vec::new()];
                for (dev, list) in [id, base].into_iter().zip(lists.iter_mut()) {
                    md.for_each_mapping(dev, begin, end, &mut |vb, m| {
                        list.push((vb, m.data_block));
                        true
                    })
                    .map_err(fail)?;
                }
                let [a, b] = lists;
                Ok((a, b))
            })
            .await??;
        if len_bytes == 0 {
            return Ok(vec![]);
        }
        let shape = Shape { offset_bytes, len_bytes: len, block_bytes: bs, max_extents };
        Ok(shape.runs(changed_blocks(&current, &older), true, false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: ExtentFlags = ExtentFlags::DATA;
    const H: ExtentFlags = ExtentFlags::HOLE_ZERO;

    fn e(len_bytes: u64, flags: ExtentFlags) -> Extent {
        Extent { len_bytes, flags }
    }

    #[test]
    fn mapped_blocks_become_data_and_the_rest_holes() {
        // 64-byte blocks for readability; blocks 1, 2 and 5 mapped in [0, 512).
        let v = extents_from_mapped(0, 512, 64, 16, [1, 2, 5]);
        assert_eq!(v, vec![e(64, H), e(128, D), e(128, H), e(64, D), e(128, H)]);
        // Unaligned start inside a mapped block, end inside a hole.
        let v = extents_from_mapped(100, 250, 64, 16, [1, 2, 5]);
        assert_eq!(v, vec![e(92, D), e(128, H), e(30, D)]);
        // Nothing mapped: one hole; everything mapped: one data run.
        assert_eq!(extents_from_mapped(0, 1 << 40, 1 << 16, 4, []), vec![e(1 << 40, H)]);
        assert_eq!(extents_from_mapped(64, 128, 64, 4, [1, 2]), vec![e(128, D)]);
    }

    #[test]
    fn the_answer_stops_at_the_extent_count() {
        let v = extents_from_mapped(0, 1024, 64, 3, [1, 3, 5, 7]);
        assert_eq!(v, vec![e(64, H), e(64, D), e(64, H)]);
        let v = extents_from_mapped(0, 1024, 64, 1, [0, 1, 3]);
        assert_eq!(v, vec![e(128, D)]);
    }

    #[test]
    fn changed_blocks_follow_thin_delta_rules() {
        // Same block: unchanged; different block: changed; one side only: changed.
        let current = [(0, 10), (1, 11), (3, 13), (6, 16)];
        let base = [(0, 10), (1, 99), (2, 12), (6, 16), (7, 17)];
        assert_eq!(changed_blocks(&current, &base), vec![1, 2, 3, 7]);
        assert_eq!(changed_blocks(&[], &[]), Vec::<u64>::new());
        let shape = Shape { offset_bytes: 0, len_bytes: 512, block_bytes: 64, max_extents: 8 };
        let runs = shape.runs(changed_blocks(&current, &base), true, false);
        let lens: Vec<(u64, bool)> = runs.iter().map(|r| (r.len_bytes, r.flags)).collect();
        assert_eq!(lens, vec![(64, false), (192, true), (192, false), (64, true)]);
    }
}
