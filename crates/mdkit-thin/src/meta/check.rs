//! Offline metadata checker (the `thin_check` equivalent), independent of the engine's own
//! loading code: it walks every structure from the superblock, verifies each block's checksum
//! and location, every btree invariant (value size, max/min entries, key order within nodes,
//! key ranges against parents), detects cycles and blocks reached in two roles, counts every
//! reference to metadata and data blocks, and compares those counts with both space maps
//! (bitmaps, overflow trees, nr_allocated, index entries). It never writes.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use crate::meta::block::{BlockBuf, BlockKind, get_u32, get_u64, verify, zeroed_block};
use crate::meta::btree::{MAX_DEPTH, NodeView, validate_node};
use crate::meta::error::{BlockPath, Corruption, MetaError};
use crate::meta::io::MetaIo;
use crate::meta::sm_format::{
    ENTRIES_PER_BITMAP, INDEX_ENTRY_BYTES, IndexEntry, MAX_METADATA_BLOCKS, SmRoot, bitmap_decode, index_block_decode,
    nr_bitmaps,
};
use crate::meta::superblock::Superblock;
use crate::meta::thin::{DEVICE_DETAILS_BYTES, DeviceDetails, MAX_DEVICE_ID, ThinMetadata, unpack_block_time};

/// What to check.
#[derive(Clone, Copy, Debug)]
pub struct CheckOptions {
    /// Stop recording individual problems after this many (they are still counted).
    pub max_issues: usize,
}

impl Default for CheckOptions {
    fn default() -> CheckOptions {
        CheckOptions { max_issues: 1000 }
    }
}

/// One problem found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckIssue {
    pub block: Option<u64>,
    pub path: BlockPath,
    pub message: String,
}

impl fmt::Display for CheckIssue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.block {
            Some(b) => write!(f, "block {b}{}: {}", self.path, self.message),
            None => write!(f, "{}", self.message),
        }
    }
}

/// Result of a check.
#[derive(Clone, Debug, Default)]
pub struct CheckReport {
    pub device: String,
    pub errors: Vec<CheckIssue>,
    /// Not damage, but not what the kernel writes (e.g. index-entry hints).
    pub warnings: Vec<CheckIssue>,
    /// Errors beyond `max_issues` that were counted but not recorded.
    pub errors_not_recorded: u64,
    pub superblock: Option<Superblock>,
    pub nr_devices: u64,
    pub nr_mappings: u64,
    pub metadata_blocks_referenced: u64,
    pub data_blocks_referenced: u64,
    pub needs_check_flag: bool,
}

impl CheckReport {
    pub fn is_clean(&self) -> bool {
        self.errors.is_empty() && self.errors_not_recorded == 0
    }
}

impl fmt::Display for CheckReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{}: {} devices, {} mappings, {} metadata blocks and {} data blocks referenced{}",
            self.device,
            self.nr_devices,
            self.nr_mappings,
            self.metadata_blocks_referenced,
            self.data_blocks_referenced,
            if self.needs_check_flag { ", NEEDS_CHECK set" } else { "" }
        )?;
        for e in &self.errors {
            writeln!(f, "error: {e}")?;
        }
        if self.errors_not_recorded > 0 {
            writeln!(f, "... and {} more errors", self.errors_not_recorded)?;
        }
        for w in &self.warnings {
            writeln!(f, "warning: {w}")?;
        }
        if self.is_clean() {
            writeln!(f, "clean")?;
        }
        Ok(())
    }
}

/// What a metadata block was reached as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Superblock,
    SnapSuperblock,
    DetailsNode,
    MappingTopNode,
    MappingNode,
    DataIndexNode,
    DataRefCountNode,
    MetaRefCountNode,
    Bitmap,
    MetaIndex,
}

impl Role {
    /// Only btree nodes of the thin trees may be shared (snapshots, metadata snapshot).
    fn shareable(self) -> bool {
        matches!(self, Role::DetailsNode | Role::MappingTopNode | Role::MappingNode)
    }
}

/// Data block reference counts, allocated per bitmap-sized chunk that is actually used (no
/// longer than the pool). Ordered maps, not hashed ones: `inc` runs for every mapping and
/// there are few chunks, so SipHash on each call was a large part of the checker's cost.
struct DataRefs {
    nr_blocks: u64,
    chunks: BTreeMap<u64, Box<[u8]>>,
    /// Exact counts of the blocks whose chunk entry saturated at `u8::MAX`.
    big: BTreeMap<u64, u32>,
    distinct: u64,
}

impl DataRefs {
    fn new(nr_blocks: u64) -> DataRefs {
        DataRefs { nr_blocks, chunks: BTreeMap::new(), big: BTreeMap::new(), distinct: 0 }
    }

    /// Counts one reference to data block `b` (below `nr_blocks`).
    fn inc(&mut self, b: u64) {
        let first = b - b % ENTRIES_PER_BITMAP;
        let len = (self.nr_blocks - first).min(ENTRIES_PER_BITMAP) as usize;
        let chunk = self.chunks.entry(b / ENTRIES_PER_BITMAP).or_insert_with(|| vec![0u8; len].into_boxed_slice());
        let c = &mut chunk[(b % ENTRIES_PER_BITMAP) as usize];
        if *c == 0 {
            self.distinct += 1;
        }
        if *c == u8::MAX {
            *self.big.entry(b).or_insert(u32::from(u8::MAX)) += 1;
        } else {
            *c += 1;
            if *c == u8::MAX {
                self.big.insert(b, u32::from(u8::MAX));
            }
        }
    }

    /// Fills `out` with the counts of blocks `first..first + out.len()`, which lie in one
    /// chunk (`first` is a multiple of [`ENTRIES_PER_BITMAP`], as a space-map bitmap's is).
    fn fill(&self, first: u64, out: &mut [u32]) {
        debug_assert!(first.is_multiple_of(ENTRIES_PER_BITMAP) && out.len() as u64 <= ENTRIES_PER_BITMAP);
        match self.chunks.get(&(first / ENTRIES_PER_BITMAP)) {
            Some(chunk) => out.iter_mut().zip(chunk.iter()).for_each(|(o, &c)| *o = u32::from(c)),
            None => out.fill(0),
        }
        // Exact counts of the saturated entries.
        for (&b, &v) in self.big.range(first..first + out.len() as u64) {
            out[(b - first) as usize] = v;
        }
    }
}

/// Called once per entry of each distinct leaf: (walker, leaf block, key, value, path).
type LeafFn<'f> = dyn FnMut(&mut Walker<'_>, u64, u64, &[u8], &[u64]) + 'f;

enum Visit {
    First,
    Again,
    Invalid,
}

struct Walker<'a> {
    io: &'a dyn MetaIo,
    opts: CheckOptions,
    nr_meta: u64,
    meta_refs: Vec<u32>,
    roles: HashMap<u64, Role>,
    on_path: Vec<u64>,
    entries_below: HashMap<u64, u64>,
    report: CheckReport,
}

impl Walker<'_> {
    fn error(&mut self, block: Option<u64>, path: &[u64], message: String) {
        if self.report.errors.len() < self.opts.max_issues {
            self.report.errors.push(CheckIssue { block, path: BlockPath(path.to_vec()), message });
        } else {
            self.report.errors_not_recorded += 1;
        }
    }

    fn warning(&mut self, block: Option<u64>, message: String) {
        if self.report.warnings.len() < self.opts.max_issues {
            self.report.warnings.push(CheckIssue { block, path: BlockPath::default(), message });
        }
    }

    fn corruption(&mut self, block: u64, path: &[u64], c: Corruption) {
        self.error(Some(block), path, c.to_string());
    }

    /// Counts one reference to `b` in `role`; says whether to descend.
    fn reference(&mut self, b: u64, role: Role, path: &[u64]) -> Visit {
        if b >= self.nr_meta {
            // Name the block holding the bad reference.
            let (at, up) = match path.split_last() {
                Some((p, rest)) => (*p, rest),
                None => (0, path),
            };
            self.corruption(at, up, Corruption::BeyondDevice { target: b, nr_blocks: self.nr_meta });
            return Visit::Invalid;
        }
        self.meta_refs[b as usize] += 1;
        match self.roles.get(&b).copied() {
            None => {
                self.roles.insert(b, role);
                Visit::First
            }
            Some(have) if have != role => {
                self.corruption(b, path, Corruption::ReferencedTwice(format!("reached as {have:?} and as {role:?}")));
                Visit::Invalid
            }
            Some(_) if self.on_path.contains(&b) => {
                self.corruption(b, path, Corruption::Cycle);
                Visit::Invalid
            }
            Some(_) if !role.shareable() => {
                self.corruption(b, path, Corruption::ReferencedTwice(format!("a {role:?} block cannot be shared")));
                Visit::Invalid
            }
            Some(_) => Visit::Again,
        }
    }

    fn read(&mut self, b: u64, kind: BlockKind, path: &[u64]) -> Option<Box<BlockBuf>> {
        let mut buf = zeroed_block();
        if let Err(e) = self.io.read_block(b, &mut buf) {
            self.error(Some(b), path, format!("read failed: {e}"));
            return None;
        }
        if let Err(c) = verify(&buf, kind, b) {
            self.corruption(b, path, c);
            return None;
        }
        Some(buf)
    }

    /// Walks one btree level from `b`; `f` sees each leaf entry once per distinct leaf.
    /// Returns the number of entries below `b` (memoised for shared subtrees).
    #[allow(clippy::too_many_arguments)]
    fn walk(
        &mut self,
        b: u64,
        role: Role,
        leaf_value_size: usize,
        lo: u64,
        hi: Option<u64>,
        is_root: bool,
        path: &mut Vec<u64>,
        f: &mut LeafFn<'_>,
    ) -> u64 {
        match self.reference(b, role, path) {
            Visit::Invalid => return 0,
            Visit::Again => return self.entries_below.get(&b).copied().unwrap_or(0),
            Visit::First => {}
        }
        if path.len() >= MAX_DEPTH {
            self.corruption(b, path, Corruption::TooDeep { depth: MAX_DEPTH });
            return 0;
        }
        let Some(blk) = self.read(b, BlockKind::Node, path) else { return 0 };
        if let Err(c) = validate_node(&blk) {
            self.corruption(b, path, c);
            return 0;
        }
        let n = NodeView::new(&blk);
        let nr = n.nr_entries() as usize;
        if n.is_leaf() && n.value_size() as usize != leaf_value_size {
            self.corruption(
                b,
                path,
                Corruption::ValueSizeMismatch { expected: leaf_value_size as u32, found: n.value_size() },
            );
            return 0;
        }
        if !is_root && (nr as u32) < n.max_entries() / 3 {
            self.corruption(
                b,
                path,
                Corruption::TooFewEntries { nr_entries: nr as u32, min_entries: n.max_entries() / 3 },
            );
        }
        if nr > 0 {
            if n.key(0) < lo {
                self.corruption(
                    b,
                    path,
                    Corruption::KeyRangeViolation(format!("first key {} is below the parent key {lo}", n.key(0))),
                );
            }
            if let Some(hi) = hi
                && n.key(nr - 1) >= hi
            {
                self.corruption(
                    b,
                    path,
                    Corruption::KeyRangeViolation(format!(
                        "last key {} is not below the next parent key {hi}",
                        n.key(nr - 1)
                    )),
                );
            }
        }
        path.push(b);
        self.on_path.push(b);
        let mut total = 0u64;
        if n.is_leaf() {
            for i in 0..nr {
                f(self, b, n.key(i), n.value(i), path);
            }
            total = nr as u64;
        } else {
            for i in 0..nr {
                let child_hi = if i + 1 < nr { Some(n.key(i + 1)) } else { hi };
                total += self.walk(n.value_u64(i), role, leaf_value_size, n.key(i), child_hi, false, path, f);
            }
        }
        path.pop();
        self.on_path.pop();
        self.entries_below.insert(b, total);
        total
    }

    /// Walks a whole single-level tree collecting its entries.
    fn collect(&mut self, root: u64, role: Role, value_size: usize) -> BTreeMap<u64, Vec<u8>> {
        let mut out = BTreeMap::new();
        let mut path = Vec::new();
        self.walk(root, role, value_size, 0, None, true, &mut path, &mut |_, _, k, v, _| {
            out.insert(k, v.to_vec());
        });
        out
    }
}

/// Checks the metadata on `io`. Never writes.
pub fn check(io: &dyn MetaIo, opts: &CheckOptions) -> CheckReport {
    let mut report = CheckReport { device: io.name().to_string(), ..Default::default() };
    let sb = match ThinMetadata::read_superblock(io) {
        Ok(sb) => sb,
        Err(e) => {
            let block = match &e {
                MetaError::Corrupt { block, .. } => Some(*block),
                _ => Some(0),
            };
            report.errors.push(CheckIssue { block, path: BlockPath::default(), message: e.to_string() });
            return report;
        }
    };
    report.needs_check_flag = sb.needs_check();
    report.superblock = Some(sb.clone());
    let nr_meta = sb.metadata_sm_root.nr_blocks;
    if nr_meta > io.nr_blocks() || !(2..=MAX_METADATA_BLOCKS).contains(&nr_meta) {
        report.errors.push(CheckIssue {
            block: Some(0),
            path: BlockPath::default(),
            message: format!(
                "metadata space map of {nr_meta} blocks does not fit the device ({} blocks, format maximum {MAX_METADATA_BLOCKS})",
                io.nr_blocks()
            ),
        });
        return report;
    }
    let mut w = Walker {
        io,
        opts: *opts,
        nr_meta,
        meta_refs: vec![0; nr_meta as usize],
        roles: HashMap::new(),
        on_path: Vec::new(),
        entries_below: HashMap::new(),
        report,
    };
    let nr_data = sb.data_sm_root.nr_blocks;
    let mut data = DataRefs::new(nr_data);

    w.reference(0, Role::Superblock, &[]);
    check_thin_trees(&mut w, &sb, &mut data, nr_data, true);
    if sb.held_root != 0
        && let Visit::First = w.reference(sb.held_root, Role::SnapSuperblock, &[0])
        && let Some(blk) = w.read(sb.held_root, BlockKind::Superblock, &[0])
    {
        let snap = Superblock::unpack(&blk);
        check_thin_trees(&mut w, &snap, &mut data, nr_data, false);
    }
    check_data_sm(&mut w, &sb.data_sm_root, &data);
    check_metadata_sm(&mut w, &sb.metadata_sm_root);
    w.report.data_blocks_referenced = data.distinct;
    w.report.metadata_blocks_referenced = w.meta_refs.iter().filter(|&&c| c > 0).count() as u64;
    w.report
}

/// Devices and mappings of one superblock (the live one or the metadata snapshot).
fn check_thin_trees(w: &mut Walker<'_>, sb: &Superblock, data: &mut DataRefs, nr_data: u64, live: bool) {
    let details: BTreeMap<u64, DeviceDetails> = w
        .collect(sb.device_details_root, Role::DetailsNode, DEVICE_DETAILS_BYTES)
        .into_iter()
        .map(|(k, v)| (k, DeviceDetails::unpack(&v)))
        .collect();
    let roots: BTreeMap<u64, u64> = w
        .collect(sb.data_mapping_root, Role::MappingTopNode, 8)
        .into_iter()
        .map(|(k, v)| (k, get_u64(&v, 0)))
        .collect();
    for k in details.keys().filter(|k| !roots.contains_key(k)) {
        w.error(Some(sb.data_mapping_root), &[], format!("device {k} has details but no mapping tree"));
    }
    for k in roots.keys().filter(|k| !details.contains_key(k)) {
        w.error(Some(sb.device_details_root), &[], format!("device {k} has a mapping tree but no details"));
    }
    for (&dev, &root) in &roots {
        if dev > MAX_DEVICE_ID {
            w.error(Some(sb.data_mapping_root), &[], format!("device id {dev} exceeds 24 bits"));
        }
        let mut path = vec![sb.data_mapping_root];
        let count = w.walk(root, Role::MappingNode, 8, 0, None, true, &mut path, &mut |w, leaf, _k, v, path| {
            let (b, _time) = unpack_block_time(get_u64(v, 0));
            if b >= nr_data {
                w.error(Some(leaf), path, format!("mapping to data block {b} beyond the {nr_data} data blocks"));
            } else {
                data.inc(b);
            }
        });
        if let Some(d) = details.get(&dev) {
            if d.mapped_blocks != count {
                w.error(
                    Some(root),
                    &[],
                    format!("device {dev}: details say {} mapped blocks, its tree has {count}", d.mapped_blocks),
                );
            }
            if d.snapshotted_time > sb.time || d.creation_time > sb.time {
                w.error(None, &[], format!("device {dev}: times {d:?} are after the pool time {}", sb.time));
            }
        }
        if live {
            w.report.nr_mappings += count;
        }
    }
    if live {
        w.report.nr_devices = roots.len() as u64;
    }
}

fn check_data_sm(w: &mut Walker<'_>, root: &SmRoot, data: &DataRefs) {
    let nb = nr_bitmaps(root.nr_blocks);
    let index = w.collect(root.bitmap_root, Role::DataIndexNode, INDEX_ENTRY_BYTES);
    // The index is bounded by the metadata device, so a bogus nr_blocks is caught here before
    // anything is sized by it.
    if index.len() as u64 != nb {
        w.error(
            Some(root.bitmap_root),
            &[],
            format!("data space-map index has {} entries, expected {nb}", index.len()),
        );
        return;
    }
    let mut entries = Vec::with_capacity(index.len());
    for (i, (k, v)) in index.iter().enumerate() {
        if *k != i as u64 {
            w.error(Some(root.bitmap_root), &[], format!("data space-map index key {k} at position {i}"));
            return;
        }
        entries.push(IndexEntry::unpack(v));
    }
    let overflow: HashMap<u64, u32> = w
        .collect(root.ref_count_root, Role::DataRefCountNode, 4)
        .into_iter()
        .map(|(k, v)| (k, get_u32(&v, 0)))
        .collect();
    compare_space_map(w, "data", root, &entries, &overflow, |first, out| data.fill(first, out));
}

fn check_metadata_sm(w: &mut Walker<'_>, root: &SmRoot) {
    let nb = nr_bitmaps(root.nr_blocks) as usize;
    if root.nr_blocks != w.nr_meta {
        w.error(Some(0), &[], "metadata space-map size changed during the check".into());
        return;
    }
    let Visit::First = w.reference(root.bitmap_root, Role::MetaIndex, &[0]) else { return };
    let Some(blk) = w.read(root.bitmap_root, BlockKind::Index, &[0]) else { return };
    let entries = index_block_decode(&blk, nb);
    let overflow: HashMap<u64, u32> = w
        .collect(root.ref_count_root, Role::MetaRefCountNode, 4)
        .into_iter()
        .map(|(k, v)| (k, get_u32(&v, 0)))
        .collect();
    // Count the bitmaps' own references before comparing anything.
    let mut ok = true;
    for ie in &entries {
        if !matches!(w.reference(ie.blocknr, Role::Bitmap, &[root.bitmap_root]), Visit::First) {
            ok = false;
        }
    }
    if !ok {
        return;
    }
    let counted = std::mem::take(&mut w.meta_refs);
    compare_space_map_counted(w, "metadata", root, &entries, &overflow, |first, out| {
        out.copy_from_slice(&counted[first as usize..][..out.len()]);
    });
    w.meta_refs = counted;
}

/// Data space map: bitmaps are referenced (counted as metadata) as they are read.
fn compare_space_map(
    w: &mut Walker<'_>,
    what: &str,
    root: &SmRoot,
    entries: &[IndexEntry],
    overflow: &HashMap<u64, u32>,
    expected: impl Fn(u64, &mut [u32]),
) {
    for ie in entries {
        if !matches!(w.reference(ie.blocknr, Role::Bitmap, &[root.bitmap_root]), Visit::First) {
            return;
        }
    }
    compare_space_map_counted(w, what, root, entries, overflow, expected);
}

/// Compares every entry of the space map (bitmap by bitmap) with the counted references;
/// `expected(first, out)` fills `out` with the counted references of blocks
/// `first..first + out.len()` (one bitmap's worth at a time: per-block lookups dominated the
/// checker's cost).
fn compare_space_map_counted(
    w: &mut Walker<'_>,
    what: &str,
    root: &SmRoot,
    entries: &[IndexEntry],
    overflow: &HashMap<u64, u32>,
    expected: impl Fn(u64, &mut [u32]),
) {
    let mut allocated = 0u64;
    // One bitmap's worth, or less for a small space map.
    let bitmap_len = root.nr_blocks.min(ENTRIES_PER_BITMAP) as usize;
    let mut codes = vec![0u8; bitmap_len];
    let mut counted = vec![0u32; bitmap_len];
    let mut overflow_matched: std::collections::HashSet<u64> = std::collections::HashSet::new();
    for (bm, ie) in entries.iter().enumerate() {
        let Some(blk) = w.read(ie.blocknr, BlockKind::Bitmap, &[root.bitmap_root]) else { continue };
        let base = bm as u64 * ENTRIES_PER_BITMAP;
        let len = (root.nr_blocks - base).min(ENTRIES_PER_BITMAP) as usize;
        bitmap_decode(&blk, &mut codes[..len]);
        expected(base, &mut counted[..len]);
        let mut used = 0u32;
        for (i, &code) in codes[..len].iter().enumerate() {
            let b = base + i as u64;
            let on_disk = if code == 3 {
                match overflow.get(&b) {
                    Some(&v) => {
                        overflow_matched.insert(b);
                        v
                    }
                    None => {
                        w.error(
                            Some(root.ref_count_root),
                            &[],
                            format!("{what} block {b} marked >= 3 but missing from the ref-count tree"),
                        );
                        continue;
                    }
                }
            } else {
                u32::from(code)
            };
            if on_disk != 0 {
                allocated += 1;
                used += 1;
            }
            let want = counted[i];
            if on_disk != want {
                let kind = if on_disk > want { "leaked" } else { "under-counted" };
                // Named by the bitmap block that holds the entry.
                w.error(
                    Some(ie.blocknr),
                    &[],
                    format!("{what} block {b}: reference count {on_disk} in the space map, {want} counted ({kind})"),
                );
            }
        }
        let want_free = ENTRIES_PER_BITMAP as u32 - used;
        if ie.nr_free > ENTRIES_PER_BITMAP as u32 || ie.none_free_before > ENTRIES_PER_BITMAP as u32 {
            w.error(
                Some(ie.blocknr),
                &[],
                format!(
                    "{what} bitmap {bm}: impossible index entry (nr_free {}, none_free_before {}; a bitmap holds {ENTRIES_PER_BITMAP})",
                    ie.nr_free, ie.none_free_before
                ),
            );
        } else if ie.nr_free != want_free {
            w.warning(
                Some(ie.blocknr),
                format!("{what} bitmap {bm}: index entry says {} free, bitmap has {want_free}", ie.nr_free),
            );
        }
        if let Some(first_free) = codes[..len].iter().position(|&c| c == 0)
            && ie.none_free_before as usize > first_free
        {
            // A hint only (thin_restore 0.9.0 writes such hints); space is lost, not damaged.
            w.warning(
                Some(ie.blocknr),
                format!("{what} bitmap {bm}: none_free_before {} skips free entry {first_free}", ie.none_free_before),
            );
        }
    }
    for (&b, &v) in overflow {
        if !overflow_matched.contains(&b) {
            w.error(
                Some(root.ref_count_root),
                &[],
                format!("{what} ref-count tree holds block {b} (count {v}) whose bitmap entry is not 3"),
            );
        } else if v < 3 {
            w.error(Some(root.ref_count_root), &[], format!("{what} ref-count tree holds count {v} < 3 for block {b}"));
        }
    }
    if allocated != root.nr_allocated {
        // thin_restore 0.9.0 writes an off-by-one metadata nr_allocated; thin_check accepts it.
        w.warning(
            Some(0),
            format!("{what} space map says {} blocks allocated, bitmaps hold {allocated}", root.nr_allocated),
        );
    }
}

/// `thin_check --clear-needs-check-flag`: checks, and only if the metadata is clean clears
/// NEEDS_CHECK in the superblock (nothing else changes). Returns the report; `Ok` with a
/// report that is not clean means nothing was written.
pub fn clear_needs_check(io: &dyn MetaIo, opts: &CheckOptions) -> Result<CheckReport, MetaError> {
    let report = check(io, opts);
    let Some(sb) = report.superblock.clone() else { return Ok(report) };
    if !report.is_clean() || !sb.needs_check() {
        return Ok(report);
    }
    let mut s = sb;
    s.flags &= !crate::meta::superblock::FLAG_NEEDS_CHECK;
    let mut buf = zeroed_block();
    s.pack(&mut buf);
    crate::meta::block::seal(&mut buf, BlockKind::Superblock, 0);
    let io_err = |op, source| MetaError::Io { device: io.name().to_string(), op, block: 0, source };
    io.write_blocks(&[(0, &buf)]).map_err(|e| io_err("write", e))?;
    io.flush().map_err(|e| io_err("flush", e))?;
    Ok(CheckReport { needs_check_flag: false, superblock: Some(s), ..report })
}
