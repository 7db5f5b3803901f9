//! thin_delta: which virtual blocks differ between two thin devices of one pool.
//!
//! Both sides are flattened to runs of (virtual block → data block), **time ignored**, and
//! merged by virtual block (thin-provisioning-tools `src/thin/delta.rs`):
//!
//! | virtual block is                      | kind         |
//! |---------------------------------------|--------------|
//! | mapped on the left only               | `left_only`  |
//! | mapped on the right only              | `right_only` |
//! | mapped on both to the same data block | `same`       |
//! | mapped on both to different blocks    | `different`  |
//!
//! Unmapped on both sides is not reported. Units are pool blocks. The XML is byte-for-byte
//! what `thin_delta --snap1 L --snap2 R` prints (simple and `--verbose` forms).

use std::fmt::Write as _;

use crate::meta::error::Result;
use crate::meta::thin::ThinMetadata;

/// A run of consecutive virtual blocks mapped to consecutive data blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockRun {
    pub virt_begin: u64,
    pub data_begin: u64,
    pub length: u64,
}

impl BlockRun {
    fn virt_end(&self) -> u64 {
        self.virt_begin + self.length
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeltaKind {
    Same,
    Different,
    LeftOnly,
    RightOnly,
}

impl DeltaKind {
    pub fn as_str(self) -> &'static str {
        match self {
            DeltaKind::Same => "same",
            DeltaKind::Different => "different",
            DeltaKind::LeftOnly => "left_only",
            DeltaKind::RightOnly => "right_only",
        }
    }
}

/// One classified range: `length` virtual blocks from `begin`; the data blocks on each side
/// advance with the virtual block (a segment never spans a data-block discontinuity).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaSegment {
    pub kind: DeltaKind,
    pub begin: u64,
    pub length: u64,
    pub left_data: Option<u64>,
    pub right_data: Option<u64>,
}

/// Collects the mapping runs of `dev` from the live (committed or not) trees.
pub fn device_runs(md: &ThinMetadata, dev: u64) -> Result<Vec<BlockRun>> {
    let mut runs = Vec::new();
    md.for_each_mapping(dev, 0, u64::MAX, &mut |vb, m| {
        push_block(&mut runs, vb, m.data_block);
        true
    })?;
    Ok(runs)
}

/// Collects the mapping runs of `dev` as recorded in the held metadata snapshot.
pub fn snap_device_runs(md: &ThinMetadata, dev: u64) -> Result<Vec<BlockRun>> {
    let mut runs = Vec::new();
    md.for_each_snap_mapping(dev, &mut |vb, m| {
        push_block(&mut runs, vb, m.data_block);
        true
    })?;
    Ok(runs)
}

/// Appends one mapping (in ascending virtual order), extending the last run when contiguous.
pub fn push_block(runs: &mut Vec<BlockRun>, vblock: u64, data_block: u64) {
    if let Some(r) = runs.last_mut()
        && r.virt_end() == vblock
        && r.data_begin + r.length == data_block
    {
        r.length += 1;
        return;
    }
    runs.push(BlockRun { virt_begin: vblock, data_begin: data_block, length: 1 });
}

/// Merges two sorted, non-overlapping run lists into classified segments in virtual order.
pub fn compare(left: &[BlockRun], right: &[BlockRun]) -> Vec<DeltaSegment> {
    let mut out: Vec<DeltaSegment> = Vec::new();
    let (mut li, mut ri) = (0usize, 0usize);
    // Progress inside the current run of each side.
    let (mut lo, mut ro) = (0u64, 0u64);
    loop {
        let l = left.get(li).map(|r| (r.virt_begin + lo, r.data_begin + lo, r.length - lo));
        let r = right.get(ri).map(|r| (r.virt_begin + ro, r.data_begin + ro, r.length - ro));
        let (seg, lstep, rstep) = match (l, r) {
            (None, None) => break,
            (Some((lv, ld, ll)), None) => (segment(DeltaKind::LeftOnly, lv, ll, Some(ld), None), ll, 0),
            (None, Some((rv, rd, rl))) => (segment(DeltaKind::RightOnly, rv, rl, None, Some(rd)), 0, rl),
            (Some((lv, ld, ll)), Some((rv, rd, rl))) => {
                if lv < rv {
                    let n = ll.min(rv - lv);
                    (segment(DeltaKind::LeftOnly, lv, n, Some(ld), None), n, 0)
                } else if rv < lv {
                    let n = rl.min(lv - rv);
                    (segment(DeltaKind::RightOnly, rv, n, None, Some(rd)), 0, n)
                } else {
                    let n = ll.min(rl);
                    let kind = if ld == rd { DeltaKind::Same } else { DeltaKind::Different };
                    (segment(kind, lv, n, Some(ld), Some(rd)), n, n)
                }
            }
        };
        push_segment(&mut out, seg);
        advance(left, &mut li, &mut lo, lstep);
        advance(right, &mut ri, &mut ro, rstep);
    }
    out
}

fn segment(kind: DeltaKind, begin: u64, length: u64, left_data: Option<u64>, right_data: Option<u64>) -> DeltaSegment {
    DeltaSegment { kind, begin, length, left_data, right_data }
}

fn advance(runs: &[BlockRun], idx: &mut usize, off: &mut u64, step: u64) {
    if step == 0 {
        return;
    }
    *off += step;
    if *off == runs[*idx].length {
        *idx += 1;
        *off = 0;
    }
}

/// Extends the last segment when `s` continues it in virtual and data blocks on both sides.
fn push_segment(out: &mut Vec<DeltaSegment>, s: DeltaSegment) {
    if let Some(p) = out.last_mut() {
        let follows = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (Some(a), Some(b)) => a + p.length == b,
            (None, None) => true,
            _ => false,
        };
        if p.kind == s.kind
            && p.begin + p.length == s.begin
            && follows(p.left_data, s.left_data)
            && follows(p.right_data, s.right_data)
        {
            p.length += s.length;
            return;
        }
    }
    out.push(s);
}

/// Adjacent segments of one kind joined by virtual contiguity only (thin_delta's simple form).
pub fn coalesce(segments: &[DeltaSegment]) -> Vec<(DeltaKind, u64, u64)> {
    let mut out: Vec<(DeltaKind, u64, u64)> = Vec::new();
    for s in segments {
        match out.last_mut() {
            Some((k, b, l)) if *k == s.kind && *b + *l == s.begin => *l += s.length,
            _ => out.push((s.kind, s.begin, s.length)),
        }
    }
    out
}

/// The superblock fields thin_delta prints.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeltaHeader {
    pub time: u32,
    pub transaction: u64,
    pub data_block_size: u32,
    pub nr_data_blocks: u64,
}

impl DeltaHeader {
    pub fn of(md: &ThinMetadata) -> DeltaHeader {
        DeltaHeader {
            time: md.time(),
            transaction: md.transaction_id(),
            data_block_size: md.data_block_size_sectors(),
            nr_data_blocks: md.nr_data_blocks(),
        }
    }
}

/// Renders thin_delta's XML: `verbose` groups consecutive ranges of one kind with their data
/// blocks, the simple form lists kind/begin/length only.
pub fn delta_xml(h: &DeltaHeader, left: u64, right: u64, segments: &[DeltaSegment], verbose: bool) -> String {
    let mut s = format!(
        "<superblock uuid=\"\" time=\"{}\" transaction=\"{}\" data_block_size=\"{}\" nr_data_blocks=\"{}\">\n  <diff left=\"{left}\" right=\"{right}\">\n",
        h.time, h.transaction, h.data_block_size, h.nr_data_blocks
    );
    if verbose {
        verbose_body(&mut s, segments);
    } else {
        for (kind, begin, length) in coalesce(segments) {
            let _ = writeln!(s, "    <{} begin=\"{begin}\" length=\"{length}\"/>", kind.as_str());
        }
    }
    s.push_str("  </diff>\n</superblock>\n");
    s
}

fn verbose_body(s: &mut String, segments: &[DeltaSegment]) {
    let mut open: Option<DeltaKind> = None;
    for seg in segments {
        if open != Some(seg.kind) {
            if let Some(k) = open {
                let _ = writeln!(s, "    </{}>", k.as_str());
            }
            let _ = writeln!(s, "    <{}>", seg.kind.as_str());
            open = Some(seg.kind);
        }
        let (b, n) = (seg.begin, seg.length);
        let _ = match (seg.kind, seg.left_data, seg.right_data) {
            (DeltaKind::Different, Some(l), Some(r)) => writeln!(
                s,
                "      <range begin=\"{b}\" left_data_begin=\"{l}\" right_data_begin=\"{r}\" length=\"{n}\"/>"
            ),
            (_, l, r) => {
                writeln!(s, "      <range begin=\"{b}\" data_begin=\"{}\" length=\"{n}\"/>", l.or(r).unwrap_or(0))
            }
        };
    }
    if let Some(k) = open {
        let _ = writeln!(s, "    </{}>", k.as_str());
    }
}

/// Total blocks of each kind, for summaries.
pub fn totals(segments: &[DeltaSegment]) -> [(DeltaKind, u64); 4] {
    let mut t = [(DeltaKind::Same, 0), (DeltaKind::Different, 0), (DeltaKind::LeftOnly, 0), (DeltaKind::RightOnly, 0)];
    for s in segments {
        let i = s.kind as usize;
        t[i].1 += s.length;
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs(blocks: &[(u64, u64)]) -> Vec<BlockRun> {
        let mut r = Vec::new();
        for &(v, d) in blocks {
            push_block(&mut r, v, d);
        }
        r
    }

    /// thin-lifecycle.md §3.3: `thin_delta --thin1 2 --thin2 1` on the §1.7 image.
    #[test]
    fn reference_example() {
        let dev2: Vec<(u64, u64)> = (0..8).map(|i| (i, i)).chain([(20, 9)]).collect();
        let dev1: Vec<(u64, u64)> = (0..8).map(|i| (i, if i == 3 { 8 } else { i })).collect();
        let segs = compare(&runs(&dev2), &runs(&dev1));
        let h = DeltaHeader { time: 1, transaction: 2, data_block_size: 128, nr_data_blocks: 1024 };
        assert_eq!(
            delta_xml(&h, 2, 1, &segs, false),
            "<superblock uuid=\"\" time=\"1\" transaction=\"2\" data_block_size=\"128\" nr_data_blocks=\"1024\">\n  <diff left=\"2\" right=\"1\">\n    <same begin=\"0\" length=\"3\"/>\n    <different begin=\"3\" length=\"1\"/>\n    <same begin=\"4\" length=\"4\"/>\n    <left_only begin=\"20\" length=\"1\"/>\n  </diff>\n</superblock>\n"
        );
        let v = delta_xml(&h, 2, 1, &segs, true);
        assert!(v.contains("<range begin=\"3\" left_data_begin=\"3\" right_data_begin=\"8\" length=\"1\"/>"), "{v}");
        assert!(v.contains("<left_only>\n      <range begin=\"20\" data_begin=\"9\" length=\"1\"/>"), "{v}");
    }

    /// Every virtual block is classified exactly as a block-by-block comparison would.
    #[test]
    fn matches_block_by_block_classification() {
        let mut rng = mdkit_io::Rng::new(3);
        for _ in 0..200 {
            let mut l = std::collections::BTreeMap::new();
            let mut r = std::collections::BTreeMap::new();
            for v in 0..200u64 {
                if rng.chance(2, 3) {
                    l.insert(v, rng.below(20) + v);
                }
                if rng.chance(2, 3) {
                    r.insert(v, if rng.chance(1, 2) { l.get(&v).copied().unwrap_or(v) } else { rng.below(400) });
                }
            }
            let lr = runs(&l.iter().map(|(a, b)| (*a, *b)).collect::<Vec<_>>());
            let rr = runs(&r.iter().map(|(a, b)| (*a, *b)).collect::<Vec<_>>());
            let segs = compare(&lr, &rr);
            let mut seen = std::collections::BTreeMap::new();
            for s in &segs {
                for i in 0..s.length {
                    assert!(seen.insert(s.begin + i, s.kind).is_none());
                    assert_eq!(s.left_data.map(|d| d + i), l.get(&(s.begin + i)).copied());
                    assert_eq!(s.right_data.map(|d| d + i), r.get(&(s.begin + i)).copied());
                }
            }
            for v in 0..200u64 {
                let want = match (l.get(&v), r.get(&v)) {
                    (None, None) => None,
                    (Some(_), None) => Some(DeltaKind::LeftOnly),
                    (None, Some(_)) => Some(DeltaKind::RightOnly),
                    (Some(a), Some(b)) => Some(if a == b { DeltaKind::Same } else { DeltaKind::Different }),
                };
                assert_eq!(seen.get(&v).copied(), want, "block {v}");
            }
        }
    }
}
