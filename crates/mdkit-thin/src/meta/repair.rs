//! thin_repair: salvage what is readable from damaged metadata and write new, consistent
//! metadata elsewhere. The input is only read.
//!
//! From the superblock's roots, every tree is walked *tolerantly*: a node that cannot be read,
//! fails its checksum or self-location, has an impossible header, or is reached twice within one
//! tree is skipped with the key range it covered, and the walk goes on with its siblings. Keys
//! outside the range their parent gives them, and mappings to data blocks beyond the data
//! device, are dropped. A device whose details were lost gets details that make every block
//! shared (creation and snapshot time after the newest mapping, as thin_repair does), so the
//! next write to any block copies it. A device whose mapping tree root was lost is dropped
//! (a missing volume fails loudly; an empty one would read zeroes). Space maps are never read:
//! both are rebuilt from the salvaged mappings by the restore path, so leaks, wrong counts and
//! damaged bitmaps disappear. The metadata snapshot (held root) is dropped, as thin_repair does.
//!
//! Unlike thin_repair, a damaged node costs only the mappings below it, not the whole device
//! tree (thin_repair falls back to an older intact root or gives up). The superblock must be
//! readable: without it there are no roots to start from (thin_repair scans every block then;
//! use it in that case).

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::meta::block::{BlockKind, BlockSet, get_u64, verify, zeroed_block};
use crate::meta::btree::{NodeView, validate_node};
use crate::meta::error::{MetaError, Result};
use crate::meta::io::MetaIo;
use crate::meta::superblock::{Superblock, THIN_MAGIC};
use crate::meta::thin::{DEVICE_DETAILS_BYTES, DeviceDetails, MAX_DEVICE_ID, OpenOptions, unpack_block_time};
use crate::meta::xml::{XmlDevice, XmlMapping, XmlMetadata, restore_xml};

/// Values that override (only upwards, like thin_repair) what the superblock says.
#[derive(Clone, Copy, Debug, Default)]
pub struct RepairOptions {
    pub transaction_id: Option<u64>,
    pub nr_data_blocks: Option<u64>,
}

/// A subtree that could not be read: its mappings (or devices) are lost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LostSubtree {
    /// "device details", "device list" or "device N".
    pub tree: String,
    pub block: u64,
    /// Keys `key_begin..key_end` (exclusive; u64::MAX = to the end) are gone.
    pub key_begin: u64,
    pub key_end: u64,
    pub reason: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SalvagedDevice {
    pub dev_id: u64,
    pub mapped_blocks: u64,
    /// The details tree had this device (else they were synthesized).
    pub details_found: bool,
    /// `mapped_blocks` the old details claimed, when found.
    pub old_mapped_blocks: Option<u64>,
}

/// What repair salvaged and what it could not.
#[derive(Clone, Debug, Default)]
pub struct RepairReport {
    pub devices: Vec<SalvagedDevice>,
    /// Devices whose mapping tree root is unreadable or missing: not written (a missing volume
    /// fails loudly; an empty one would read zeroes).
    pub devices_dropped: Vec<u64>,
    pub lost: Vec<LostSubtree>,
    /// Mappings to data blocks >= nr_data_blocks, or with keys outside their node's range.
    pub mappings_dropped: u64,
    pub held_root_dropped: Option<u64>,
    pub transaction_id: u64,
    pub time: u32,
    pub nr_data_blocks: u64,
}

impl RepairReport {
    pub fn mappings(&self) -> u64 {
        self.devices.iter().map(|d| d.mapped_blocks).sum()
    }

    /// Nothing was lost or changed beyond rebuilding the space maps.
    pub fn is_complete(&self) -> bool {
        self.lost.is_empty()
            && self.devices_dropped.is_empty()
            && self.mappings_dropped == 0
            && self.devices.iter().all(|d| d.details_found && d.old_mapped_blocks == Some(d.mapped_blocks))
    }
}

impl std::fmt::Display for RepairReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "salvaged {} devices, {} mappings (transaction {}, time {}, {} data blocks)",
            self.devices.len(),
            self.mappings(),
            self.transaction_id,
            self.time,
            self.nr_data_blocks
        )?;
        for d in &self.devices {
            write!(f, "  device {}: {} mappings", d.dev_id, d.mapped_blocks)?;
            match d.old_mapped_blocks {
                None => writeln!(f, " (details lost: synthesized, every block treated as shared)")?,
                Some(o) if o != d.mapped_blocks => writeln!(f, " (details said {o})")?,
                Some(_) => writeln!(f)?,
            }
        }
        for l in &self.lost {
            let end = if l.key_end == u64::MAX { "end".to_string() } else { l.key_end.to_string() };
            writeln!(f, "  lost: {} keys {}..{end} below block {}: {}", l.tree, l.key_begin, l.block, l.reason)?;
        }
        for d in &self.devices_dropped {
            writeln!(f, "  dropped device {d}: its mapping tree root is unreadable or missing")?;
        }
        if self.mappings_dropped > 0 {
            writeln!(f, "  dropped {} mappings with impossible keys or data blocks", self.mappings_dropped)?;
        }
        if let Some(h) = self.held_root_dropped {
            writeln!(f, "  dropped the metadata snapshot at block {h}")?;
        }
        Ok(())
    }
}

//------------------------------------------------------------------------------------------------
// Tolerant btree walk

struct Walker<'a> {
    io: &'a dyn MetaIo,
    lost: Vec<LostSubtree>,
    dropped: u64,
}

/// Deepest tree accepted: 2^64 keys need at most 11 levels at 84 entries per node.
const MAX_DEPTH: usize = 16;

impl Walker<'_> {
    fn read_node(&self, b: u64) -> std::result::Result<Box<crate::meta::block::BlockBuf>, String> {
        if b >= self.io.nr_blocks() {
            return Err(format!("block {b} is beyond the device ({} blocks)", self.io.nr_blocks()));
        }
        let mut buf = zeroed_block();
        self.io.read_block(b, &mut buf).map_err(|e| format!("read error: {e}"))?;
        verify(&buf, BlockKind::Node, b).map_err(|c| c.to_string())?;
        validate_node(&buf).map_err(|c| c.to_string())?;
        Ok(buf)
    }

    /// Visits the leaf entries of the tree at `root` with keys in `lo..hi`, skipping what cannot
    /// be read. `f` gets (key, value).
    fn walk(&mut self, tree: &str, root: u64, value_size: usize, f: &mut dyn FnMut(u64, &[u8])) {
        let mut visited = BlockSet::default();
        self.walk_node(tree, root, value_size, 0, u64::MAX, 0, &mut visited, f);
    }

    #[allow(clippy::too_many_arguments)]
    fn walk_node(
        &mut self,
        tree: &str,
        b: u64,
        value_size: usize,
        lo: u64,
        hi: u64,
        depth: usize,
        visited: &mut BlockSet,
        f: &mut dyn FnMut(u64, &[u8]),
    ) {
        let lose = |s: &mut Self, reason: String| {
            s.lost.push(LostSubtree { tree: tree.to_string(), block: b, key_begin: lo, key_end: hi, reason });
        };
        if depth > MAX_DEPTH {
            return lose(self, format!("tree deeper than {MAX_DEPTH} levels"));
        }
        if !visited.insert(b) {
            return lose(self, "block reached twice in one tree (a cycle or a shared child)".into());
        }
        let buf = match self.read_node(b) {
            Ok(buf) => buf,
            Err(e) => return lose(self, e),
        };
        let n = NodeView::new(&buf);
        if n.is_leaf() && n.value_size() as usize != value_size {
            return lose(
                self,
                format!("leaf with {}-byte values in a tree of {value_size}-byte values", n.value_size()),
            );
        }
        let nr = n.nr_entries() as usize;
        for i in 0..nr {
            let key = n.key(i);
            let next = if i + 1 < nr { n.key(i + 1) } else { hi };
            if n.is_leaf() {
                if key < lo || key >= hi {
                    self.dropped += 1;
                    continue;
                }
                f(key, n.value(i));
            } else {
                // The child covers its key up to the next one, clipped to this node's range.
                // (The first child starts at this node's lower bound, whatever its key says.)
                let clo = if i == 0 { lo } else { key.max(lo) };
                let chi = next.min(hi);
                if clo >= chi {
                    continue;
                }
                self.walk_node(tree, n.value_u64(i), value_size, clo, chi, depth + 1, visited, f);
            }
        }
    }
}

//------------------------------------------------------------------------------------------------
// Salvage

fn read_superblock(io: &dyn MetaIo) -> Result<Superblock> {
    let name = io.name().to_string();
    let bad = |why: String| {
        MetaError::InvalidArgument(format!(
            "{name}: the superblock is unusable ({why}); mdkit thin repair starts from its roots, so it cannot \
         salvage this metadata (thin_repair scans every block and may)"
        ))
    };
    if io.nr_blocks() == 0 {
        return Err(bad("the device is empty".into()));
    }
    let mut buf = zeroed_block();
    io.read_block(0, &mut buf).map_err(|e| bad(format!("read error: {e}")))?;
    let sb = Superblock::unpack(&buf);
    if sb.magic != THIN_MAGIC {
        return Err(bad(format!("bad magic {}", sb.magic)));
    }
    verify(&buf, BlockKind::Superblock, 0).map_err(|c| bad(c.to_string()))?;
    sb.validate().map_err(|c| bad(c.to_string()))?;
    Ok(sb)
}

/// Reads what is readable from `input` and returns it as XML data plus the report. Nothing is
/// written anywhere.
pub fn salvage(input: &dyn MetaIo, opts: RepairOptions) -> Result<(XmlMetadata, RepairReport)> {
    let sb = read_superblock(input)?;
    let nr_data_blocks = sb.data_sm_root.nr_blocks.max(opts.nr_data_blocks.unwrap_or(0));
    let mut w = Walker { io: input, lost: Vec::new(), dropped: 0 };
    let mut details: BTreeMap<u64, DeviceDetails> = BTreeMap::new();
    w.walk("device details", sb.device_details_root, DEVICE_DETAILS_BYTES, &mut |k, v| {
        details.insert(k, DeviceDetails::unpack(v));
    });
    let mut roots: BTreeMap<u64, u64> = BTreeMap::new();
    w.walk("device list", sb.data_mapping_root, 8, &mut |k, v| {
        roots.insert(k, get_u64(v, 0));
    });
    let mut report =
        RepairReport { held_root_dropped: (sb.held_root != 0).then_some(sb.held_root), ..Default::default() };
    let mut devices = Vec::new();
    let mut newest_time = sb.time;
    for (&dev, &root) in &roots {
        if dev > MAX_DEVICE_ID {
            w.dropped += 1;
            continue;
        }
        let mut mappings: Vec<XmlMapping> = Vec::new();
        let mut count = 0u64;
        let mut out_of_range = 0u64;
        w.walk(&format!("device {dev}"), root, 8, &mut |vb, v| {
            let (data_block, time) = unpack_block_time(get_u64(v, 0));
            if data_block >= nr_data_blocks {
                out_of_range += 1;
                return;
            }
            newest_time = newest_time.max(time);
            count += 1;
            match mappings.last_mut() {
                Some(r)
                    if r.origin_begin + r.length == vb && r.data_begin + r.length == data_block && r.time == time =>
                {
                    r.length += 1
                }
                _ => mappings.push(XmlMapping { origin_begin: vb, data_begin: data_block, length: 1, time }),
            }
        });
        w.dropped += out_of_range;
        if w.lost.iter().any(|l| l.block == root && l.tree == format!("device {dev}")) {
            report.devices_dropped.push(dev);
            continue;
        }
        let old = details.get(&dev).copied();
        let d = old.unwrap_or_default();
        devices.push(XmlDevice {
            dev_id: dev,
            mapped_blocks: count,
            transaction: d.transaction_id,
            creation_time: d.creation_time,
            snap_time: d.snapshotted_time,
            mappings,
        });
        report.devices.push(SalvagedDevice {
            dev_id: dev,
            mapped_blocks: count,
            details_found: old.is_some(),
            old_mapped_blocks: old.map(|d| d.mapped_blocks),
        });
    }
    // Devices whose details are lost: every mapping older than their snapshot time (shared).
    let synth_time = newest_time.saturating_add(1).min(0x00ff_ffff);
    let time = sb.time.max(if report.devices.iter().any(|d| !d.details_found) { synth_time } else { newest_time });
    for (d, s) in devices.iter_mut().zip(&report.devices) {
        if !s.details_found {
            d.transaction = sb.trans_id.saturating_sub(1);
            d.creation_time = synth_time;
            d.snap_time = synth_time;
        }
    }
    report.devices_dropped.extend(details.keys().filter(|k| !roots.contains_key(k)));
    report.devices_dropped.sort_unstable();
    report.lost = w.lost;
    report.mappings_dropped = w.dropped;
    report.transaction_id = sb.trans_id.max(opts.transaction_id.unwrap_or(0));
    report.time = time;
    report.nr_data_blocks = nr_data_blocks;
    let x = XmlMetadata {
        uuid: String::new(),
        time,
        transaction: report.transaction_id,
        flags: 0,
        version: 2,
        data_block_size: sb.data_block_size_sectors,
        nr_data_blocks,
        metadata_snap: None,
        devices,
    };
    Ok((x, report))
}

/// Salvages `input` and writes new metadata to `output` (formatted; both space maps rebuilt
/// from the mappings). `input` is never written.
pub fn repair(input: &dyn MetaIo, output: Arc<dyn MetaIo>, opts: RepairOptions) -> Result<RepairReport> {
    let (x, report) = salvage(input, opts)?;
    restore_xml(output, &x, OpenOptions::default())?;
    Ok(report)
}
