//! The thin-pool metadata engine: devices, mappings, snapshots, data block reference counts,
//! transactions. See the crate-level `meta` docs for the concurrency design.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::meta::block::{BLOCK_SECTORS, BlockKind, get_u32, get_u64, put_u32, put_u64, seal, verify, zeroed_block};
use crate::meta::btree::{self, NoRc, ReadMode, ValueRc};
use crate::meta::cache::{BlockCache, DEFAULT_CACHE_BLOCKS};
use crate::meta::dsm::{DataSm, MAX_DATA_BLOCKS};
use crate::meta::error::{Corruption, MetaError, Result};
use crate::meta::io::MetaIo;
use crate::meta::msm::MetadataSm;
use crate::meta::sm_format::{
    ENTRIES_PER_BITMAP, MAX_METADATA_BLOCKS, SmRoot, bitmap_decode, index_block_decode, nr_bitmaps,
};
use crate::meta::superblock::{
    FLAG_NEEDS_CHECK, SUPERBLOCK_LOCATION, Superblock, THIN_MAGIC, THIN_VERSION, check_data_block_size,
};
use crate::meta::tm::{DEFAULT_WRITEBACK_THRESHOLD_BLOCKS, Tm};

/// Thin device ids are 24-bit.
pub const MAX_DEVICE_ID: u64 = (1 << 24) - 1;
/// Packed size of device details.
pub const DEVICE_DETAILS_BYTES: usize = 24;
/// Mapping values: `(data_block << 24) | time`.
pub const BLOCK_TIME_BYTES: usize = 8;
/// Upper bound of the metadata reserve (kernel __set_metadata_reserve: 16 MiB).
pub const MAX_METADATA_RESERVE_BLOCKS: u64 = 4096;
/// Smallest metadata device accepted by `format` (kernel's sizing guide minimum is 2 MiB).
pub const MIN_METADATA_BLOCKS: u64 = 64;

/// Metadata blocks the data space map of `nr_data_blocks` takes at least: a bitmap per 16320
/// data blocks and the index btree leaves listing them (over 100 entries each).
pub fn data_sm_metadata_blocks(nr_data_blocks: u64) -> u64 {
    let bitmaps = nr_bitmaps(nr_data_blocks);
    bitmaps + bitmaps.div_ceil(100)
}

/// Blocks a new pool's metadata needs besides the data space map: the superblock, the
/// metadata space map (bitmaps, index, ref-count root), the empty trees, and slack for the
/// first commit's shadowing.
fn fixed_metadata_blocks(nr_meta: u64) -> u64 {
    nr_bitmaps(nr_meta) + 16
}

/// Refuses a data device whose space map does not fit a metadata device of `nr_meta` blocks
/// (with the reserve and room left for mappings), before anything is allocated or written:
/// an 8 PiB data device would need ~32 GiB of bitmaps, more than any dm-thin metadata device
/// (255 x 16320 blocks) holds.
pub fn check_data_fits_metadata(
    nr_data_blocks: u64,
    nr_meta: u64,
    data_block_size_sectors: u32,
) -> std::result::Result<(), String> {
    let needed = data_sm_metadata_blocks(nr_data_blocks);
    let reserve = (nr_meta / 10).min(MAX_METADATA_RESERVE_BLOCKS);
    let available = nr_meta.saturating_sub(fixed_metadata_blocks(nr_meta) + reserve);
    if needed <= available {
        return Ok(());
    }
    let block_bytes = u64::from(data_block_size_sectors) * 512;
    let most = MAX_METADATA_BLOCKS
        - fixed_metadata_blocks(MAX_METADATA_BLOCKS)
        - (MAX_METADATA_BLOCKS / 10).min(MAX_METADATA_RESERVE_BLOCKS);
    if needed > most {
        return Err(format!(
            "the data device ({nr_data_blocks} blocks of {block_bytes} bytes) is above what dm-thin metadata can map \
             at this block size: its space map alone needs {needed} metadata blocks, and the largest metadata device \
             ({MAX_METADATA_BLOCKS} blocks) leaves {most}; use a larger data block size or a smaller data device"
        ));
    }
    Err(format!(
        "the data device ({nr_data_blocks} blocks of {block_bytes} bytes) needs {needed} metadata blocks for its space \
         map; the metadata device holds {nr_meta} ({available} after the superblock, its own space map and the \
         reserve): use a larger metadata device"
    ))
}

/// Per-device details (kernel struct disk_device_details, 24 bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceDetails {
    pub mapped_blocks: u64,
    /// Pool transaction id when the device was created.
    pub transaction_id: u64,
    pub creation_time: u32,
    pub snapshotted_time: u32,
}

impl DeviceDetails {
    pub fn unpack(v: &[u8]) -> DeviceDetails {
        DeviceDetails {
            mapped_blocks: get_u64(v, 0),
            transaction_id: get_u64(v, 8),
            creation_time: get_u32(v, 16),
            snapshotted_time: get_u32(v, 20),
        }
    }

    pub fn pack(&self) -> [u8; DEVICE_DETAILS_BYTES] {
        let mut v = [0u8; DEVICE_DETAILS_BYTES];
        put_u64(&mut v, 0, self.mapped_blocks);
        put_u64(&mut v, 8, self.transaction_id);
        put_u32(&mut v, 16, self.creation_time);
        put_u32(&mut v, 20, self.snapshotted_time);
        v
    }
}

/// Packs a mapping value.
pub fn pack_block_time(data_block: u64, time: u32) -> u64 {
    (data_block << 24) | u64::from(time & 0x00ff_ffff)
}

/// Unpacks a mapping value into (data block, time).
pub fn unpack_block_time(v: u64) -> (u64, u32) {
    (v >> 24, (v & 0x00ff_ffff) as u32)
}

/// Result of a mapping lookup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub data_block: u64,
    /// Pool time when the block was mapped (24 bits).
    pub time: u32,
    /// The block may also be mapped by a snapshot: dm-thin's `snapshotted_time > time`.
    /// A write must break sharing (allocate, copy, remap).
    pub shared: bool,
}

/// Numbers as `dmsetup status` shows them for a thin-pool, and more.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolStatus {
    pub transaction_id: u64,
    /// dmsetup's used metadata: total minus free, where free excludes the reserve.
    pub used_metadata_blocks: u64,
    pub total_metadata_blocks: u64,
    /// Metadata blocks with a non-zero reference count.
    pub allocated_metadata_blocks: u64,
    pub metadata_reserve_blocks: u64,
    pub used_data_blocks: u64,
    pub total_data_blocks: u64,
    /// Block of the metadata snapshot, if one is held.
    pub held_root: Option<u64>,
    pub needs_check: bool,
    /// Kernel low-water threshold for metadata: min(1024 blocks, total / 4).
    pub metadata_low_water_blocks: u64,
}

/// Parameters of a new pool.
#[derive(Clone, Copy, Debug)]
pub struct FormatOptions {
    /// 128..=2097152, a multiple of 128 (64 KiB .. 1 GiB).
    pub data_block_size_sectors: u32,
    pub nr_data_blocks: u64,
    /// Metadata blocks to use; default (None) the whole device, capped at the format maximum
    /// (255 x 16320 blocks, about 15.9 GiB).
    pub metadata_nr_blocks: Option<u64>,
}

/// How to open.
#[derive(Clone, Copy, Debug)]
pub struct OpenOptions {
    pub read_only: bool,
    /// Clean-block cache size in 4 KiB blocks.
    pub cache_blocks: usize,
    /// Dirty blocks kept in memory before early write-back within a transaction.
    pub writeback_threshold_blocks: usize,
}

impl Default for OpenOptions {
    fn default() -> OpenOptions {
        OpenOptions {
            read_only: false,
            cache_blocks: DEFAULT_CACHE_BLOCKS,
            writeback_threshold_blocks: DEFAULT_WRITEBACK_THRESHOLD_BLOCKS,
        }
    }
}

struct Device {
    details: DeviceDetails,
    /// Root of the device's mapping tree (also the value in the top-level mapping tree).
    root: u64,
    details_dirty: bool,
    changed_this_txn: bool,
}

/// Data-block reference counting for mapping values.
struct BlockTimeRc<'a> {
    dsm: &'a mut DataSm,
}

impl ValueRc for BlockTimeRc<'_> {
    fn value_size(&self) -> Option<usize> {
        Some(BLOCK_TIME_BYTES)
    }
    fn inc(&mut self, tm: &mut Tm, v: &[u8]) -> Result<()> {
        self.dsm.inc(tm, unpack_block_time(get_u64(v, 0)).0)
    }
    fn dec(&mut self, tm: &mut Tm, v: &[u8]) -> Result<()> {
        self.dsm.dec(tm, unpack_block_time(get_u64(v, 0)).0).map(|_| ())
    }
}

/// Reference counting for top-level mapping-tree values (roots of device trees).
struct SubtreeRc<'a> {
    dsm: &'a mut DataSm,
}

impl ValueRc for SubtreeRc<'_> {
    fn value_size(&self) -> Option<usize> {
        Some(8)
    }
    fn inc(&mut self, tm: &mut Tm, v: &[u8]) -> Result<()> {
        tm.inc(get_u64(v, 0))
    }
    fn dec(&mut self, tm: &mut Tm, v: &[u8]) -> Result<()> {
        btree::del(tm, &mut BlockTimeRc { dsm: self.dsm }, get_u64(v, 0))
    }
}

/// The metadata engine of one thin pool.
pub struct ThinMetadata {
    io: Arc<dyn MetaIo>,
    opts: OpenOptions,
    tm: Tm,
    dsm: DataSm,
    /// The superblock of the last commit.
    committed: Superblock,
    time: u32,
    trans_id: u64,
    held_root: u64,
    flags: u32,
    mapping_root: u64,
    details_root: u64,
    data_block_size_sectors: u32,
    devices: BTreeMap<u64, Device>,
    read_only: Option<String>,
    poisoned: Option<String>,
}

impl std::fmt::Debug for ThinMetadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThinMetadata")
            .field("device", &self.io.name())
            .field("devices", &self.devices.len())
            .field("trans_id", &self.trans_id)
            .field("time", &self.time)
            .finish()
    }
}

// The pool runtime shares the engine between its metadata thread and the data path.
const _: fn() = || {
    fn shared<T: Send + Sync>() {}
    shared::<ThinMetadata>();
};

fn check_dev_id(dev: u64) -> Result<()> {
    if dev > MAX_DEVICE_ID {
        return Err(MetaError::InvalidArgument(format!(
            "thin device id {dev} exceeds the 24-bit limit {MAX_DEVICE_ID}"
        )));
    }
    Ok(())
}

impl ThinMetadata {
    //--------------------------------------------------------------------------------------------
    // Format / open / commit / abort

    /// Writes a new, empty pool (like the kernel on first activation, or thin_restore).
    pub fn format(io: Arc<dyn MetaIo>, fo: FormatOptions) -> Result<ThinMetadata> {
        Self::format_with(io, fo, OpenOptions::default())
    }

    pub fn format_with(io: Arc<dyn MetaIo>, fo: FormatOptions, opts: OpenOptions) -> Result<ThinMetadata> {
        let mut md = Self::format_uncommitted(io, fo, opts)?;
        md.commit()?;
        Ok(md)
    }

    /// `format_with` without the first commit: nothing reaches block 0 (the superblock) before
    /// the caller commits; new blocks may be written back early. Restore builds on this so a
    /// failure half-way never leaves a valid (empty) pool behind.
    pub(crate) fn format_uncommitted(
        io: Arc<dyn MetaIo>,
        fo: FormatOptions,
        opts: OpenOptions,
    ) -> Result<ThinMetadata> {
        check_data_block_size(fo.data_block_size_sectors).map_err(MetaError::InvalidArgument)?;
        if fo.nr_data_blocks > MAX_DATA_BLOCKS {
            return Err(MetaError::InvalidArgument(format!("{} data blocks exceed the 2^40 limit", fo.nr_data_blocks)));
        }
        let device_blocks = io.nr_blocks();
        let nr_meta = fo.metadata_nr_blocks.unwrap_or(device_blocks).min(MAX_METADATA_BLOCKS);
        if nr_meta > device_blocks {
            return Err(MetaError::InvalidArgument(format!(
                "{}: {nr_meta} metadata blocks requested but the device has {device_blocks}",
                io.name()
            )));
        }
        if nr_meta < MIN_METADATA_BLOCKS {
            return Err(MetaError::InvalidArgument(format!(
                "{}: metadata device of {nr_meta} blocks is smaller than the minimum {MIN_METADATA_BLOCKS}",
                io.name()
            )));
        }
        check_data_fits_metadata(fo.nr_data_blocks, nr_meta, fo.data_block_size_sectors)
            .map_err(|m| MetaError::InvalidArgument(format!("{}: {m}", io.name())))?;
        if opts.read_only {
            return Err(MetaError::ReadOnly("cannot format read-only".into()));
        }
        let mut msm = MetadataSm::new(nr_meta);
        msm.claim(SUPERBLOCK_LOCATION);
        let cache = Arc::new(BlockCache::new(opts.cache_blocks));
        let mut tm = Tm::new(io.clone(), cache, msm);
        tm.set_writeback_threshold(opts.writeback_threshold_blocks);
        tm.msm.ref_count_root = btree::empty(&mut tm, 4)?;
        let dsm = DataSm::create(&mut tm, fo.nr_data_blocks)?;
        let mapping_root = btree::empty(&mut tm, 8)?;
        let details_root = btree::empty(&mut tm, DEVICE_DETAILS_BYTES)?;
        let committed = Superblock {
            flags: 0,
            uuid: [0; 16],
            magic: THIN_MAGIC,
            version: THIN_VERSION,
            time: 0,
            trans_id: 0,
            held_root: 0,
            data_sm_root: SmRoot::default(),
            metadata_sm_root: SmRoot::default(),
            data_mapping_root: 0,
            device_details_root: 0,
            data_block_size_sectors: fo.data_block_size_sectors,
            metadata_block_size_sectors: BLOCK_SECTORS,
            metadata_nr_blocks: nr_meta,
            compat_flags: 0,
            compat_ro_flags: 0,
            incompat_flags: 0,
        };
        let md = ThinMetadata {
            io,
            opts,
            tm,
            dsm,
            committed,
            time: 0,
            trans_id: 0,
            held_root: 0,
            flags: 0,
            mapping_root,
            details_root,
            data_block_size_sectors: fo.data_block_size_sectors,
            devices: BTreeMap::new(),
            read_only: None,
            poisoned: None,
        };
        Ok(md)
    }

    /// Opens existing metadata.
    pub fn open(io: Arc<dyn MetaIo>) -> Result<ThinMetadata> {
        Self::open_with(io, OpenOptions::default())
    }

    pub fn open_with(io: Arc<dyn MetaIo>, opts: OpenOptions) -> Result<ThinMetadata> {
        let cache = Arc::new(BlockCache::new(opts.cache_blocks));
        Self::open_inner(io, cache, opts)
    }

    /// Reads and validates the superblock of `io` (also used by the checker).
    pub fn read_superblock(io: &dyn MetaIo) -> Result<Superblock> {
        let name = io.name().to_string();
        let corrupt = |reason| MetaError::Corrupt { device: name.clone(), block: 0, path: Default::default(), reason };
        if io.nr_blocks() == 0 {
            return Err(corrupt(Corruption::BadSuperblock("the metadata device is empty (no block 0)".into())));
        }
        let mut buf = zeroed_block();
        io.read_block(0, &mut buf).map_err(|source| MetaError::Io {
            device: name.clone(),
            op: "read",
            block: 0,
            source,
        })?;
        if buf.iter().all(|&b| b == 0) {
            return Err(corrupt(Corruption::BadSuperblock(
                "block 0 is all zeroes: the device was never formatted".into(),
            )));
        }
        let sb = Superblock::unpack(&buf);
        if sb.magic != THIN_MAGIC {
            return Err(corrupt(Corruption::BadSuperblock(format!("bad magic {}: not dm-thin metadata", sb.magic))));
        }
        verify(&buf, BlockKind::Superblock, 0).map_err(corrupt)?;
        sb.validate().map_err(corrupt)?;
        if sb.version != 1 && sb.version != 2 {
            return Err(MetaError::Unsupported {
                device: name,
                reason: format!("metadata version {} (supported: 1, 2)", sb.version),
            });
        }
        if sb.incompat_flags != 0 {
            return Err(MetaError::Unsupported {
                device: name,
                reason: format!("incompat feature flags {:#x} are set; refusing to open", sb.incompat_flags),
            });
        }
        Ok(sb)
    }

    fn open_inner(io: Arc<dyn MetaIo>, cache: Arc<BlockCache>, opts: OpenOptions) -> Result<ThinMetadata> {
        let sb = Self::read_superblock(&*io)?;
        let name = io.name().to_string();
        let mut read_only = opts.read_only.then(|| "opened read-only".to_string());
        if sb.compat_ro_flags != 0 {
            if !opts.read_only {
                return Err(MetaError::Unsupported {
                    device: name,
                    reason: format!(
                        "compat_ro feature flags {:#x} are set; only read-only access is possible",
                        sb.compat_ro_flags
                    ),
                });
            }
            read_only = Some(format!("compat_ro flags {:#x}", sb.compat_ro_flags));
        }
        let msm_root = sb.metadata_sm_root;
        if msm_root.nr_blocks > io.nr_blocks() {
            return Err(MetaError::Corrupt {
                device: name,
                block: 0,
                path: Default::default(),
                reason: Corruption::BadSuperblock(format!(
                    "metadata space map covers {} blocks but the device has only {}",
                    msm_root.nr_blocks,
                    io.nr_blocks()
                )),
            });
        }
        if msm_root.nr_blocks > MAX_METADATA_BLOCKS || msm_root.nr_blocks < 2 {
            return Err(MetaError::Corrupt {
                device: name,
                block: 0,
                path: Default::default(),
                reason: Corruption::BadSuperblock(format!("metadata space map of {} blocks", msm_root.nr_blocks)),
            });
        }
        let mut tm = Tm::new(io.clone(), cache, MetadataSm::new(msm_root.nr_blocks));
        tm.set_writeback_threshold(opts.writeback_threshold_blocks);
        let msm = load_metadata_sm(&tm, &msm_root)?;
        tm.msm = msm;
        let dsm = DataSm::open(&tm, &sb.data_sm_root)?;
        let devices = load_devices(&tm, sb.device_details_root, sb.data_mapping_root)?;
        Ok(ThinMetadata {
            io,
            opts,
            tm,
            dsm,
            time: sb.time,
            trans_id: sb.trans_id,
            held_root: sb.held_root,
            flags: sb.flags,
            mapping_root: sb.data_mapping_root,
            details_root: sb.device_details_root,
            data_block_size_sectors: sb.data_block_size_sectors,
            committed: sb,
            devices,
            read_only,
            poisoned: None,
        })
    }

    /// Makes the open transaction durable: details, data space map, metadata space map, then
    /// the superblock, with flushes in between (see `tm`).
    pub fn commit(&mut self) -> Result<()> {
        self.check_writable()?;
        self.guard(|s| {
            s.write_changed_details()?;
            let data_sm_root = s.dsm.flush(&mut s.tm)?;
            let metadata_sm_root = s.tm.flush_metadata_sm()?;
            let sb = Superblock {
                flags: s.flags,
                uuid: s.committed.uuid,
                magic: THIN_MAGIC,
                version: THIN_VERSION,
                time: s.time,
                trans_id: s.trans_id,
                held_root: s.held_root,
                data_sm_root,
                metadata_sm_root,
                data_mapping_root: s.mapping_root,
                device_details_root: s.details_root,
                data_block_size_sectors: s.data_block_size_sectors,
                metadata_block_size_sectors: BLOCK_SECTORS,
                metadata_nr_blocks: s.tm.msm.nr_blocks(),
                compat_flags: 0,
                compat_ro_flags: 0,
                incompat_flags: 0,
            };
            let mut buf = zeroed_block();
            sb.pack(&mut buf);
            s.tm.commit(&mut buf)?;
            s.dsm.end_transaction();
            for d in s.devices.values_mut() {
                d.changed_this_txn = false;
            }
            s.committed = sb;
            Ok(())
        })
    }

    /// Drops every uncommitted change: the in-memory state becomes the last commit again (it
    /// is re-read from the device). Also clears a poisoned state.
    pub fn abort(&mut self) -> Result<()> {
        self.tm.forget_transaction();
        let cache = self.tm.cache().clone();
        let fresh = Self::open_inner(self.io.clone(), cache, self.opts)?;
        *self = fresh;
        Ok(())
    }

    fn write_changed_details(&mut self) -> Result<()> {
        for (&dev, d) in self.devices.iter_mut() {
            if d.details_dirty {
                self.details_root =
                    btree::insert(&mut self.tm, &mut NoRc, self.details_root, dev, &d.details.pack())?.0;
                d.details_dirty = false;
            }
        }
        Ok(())
    }

    fn check_writable(&self) -> Result<()> {
        if let Some(r) = &self.poisoned {
            return Err(MetaError::Poisoned { reason: r.clone() });
        }
        if let Some(r) = &self.read_only {
            return Err(MetaError::ReadOnly(r.clone()));
        }
        Ok(())
    }

    /// Runs a mutation; any error inside leaves partial in-memory changes, so it poisons the
    /// transaction (the device is untouched: nothing is referenced before commit).
    fn guard<R>(&mut self, f: impl FnOnce(&mut Self) -> Result<R>) -> Result<R> {
        let r = f(self).and_then(|v| {
            self.tm.writeback_if_needed()?;
            Ok(v)
        });
        if let Err(e) = &r
            && !matches!(e, MetaError::OutOfDataSpace { .. })
        {
            tracing::error!(device = self.io.name(), error = %e, "metadata transaction poisoned");
            self.poisoned = Some(e.to_string());
        }
        r
    }

    /// Metadata blocks kept back from normal operations (kernel: min(4096, total / 10)).
    pub fn metadata_reserve_blocks(&self) -> u64 {
        (self.tm.msm.nr_blocks() / 10).min(MAX_METADATA_RESERVE_BLOCKS)
    }

    /// Refuses to start an operation when free metadata is at the reserve. Operations that
    /// release space may dig into half of the reserve.
    fn ensure_metadata_space(&self, releases_space: bool) -> Result<()> {
        let reserve = self.metadata_reserve_blocks();
        let floor = if releases_space { reserve / 2 } else { reserve };
        let free = self.tm.msm.nr_free();
        if free <= floor.max(8) {
            return Err(MetaError::OutOfMetadataSpace {
                free_blocks: free,
                total_blocks: self.tm.msm.nr_blocks(),
                reserve_blocks: reserve,
            });
        }
        Ok(())
    }

    fn device(&self, dev: u64) -> Result<&Device> {
        self.devices.get(&dev).ok_or(MetaError::NoSuchDevice(dev))
    }

    //--------------------------------------------------------------------------------------------
    // Devices

    /// Creates an empty thin device.
    pub fn create_thin(&mut self, dev: u64) -> Result<()> {
        check_dev_id(dev)?;
        self.check_writable()?;
        if self.devices.contains_key(&dev) {
            return Err(MetaError::DeviceExists(dev));
        }
        self.ensure_metadata_space(false)?;
        self.guard(|s| {
            let root = btree::empty(&mut s.tm, BLOCK_TIME_BYTES)?;
            let (top, old) =
                btree::insert(&mut s.tm, &mut SubtreeRc { dsm: &mut s.dsm }, s.mapping_root, dev, &root.to_le_bytes())?;
            s.mapping_root = top;
            if old.is_some() {
                return Err(s.tm.corrupt(
                    top,
                    Corruption::BadDevice(format!("device {dev} in the mapping tree but not in the details tree")),
                ));
            }
            let details = DeviceDetails {
                mapped_blocks: 0,
                transaction_id: s.trans_id,
                creation_time: s.time,
                snapshotted_time: s.time,
            };
            s.devices.insert(dev, Device { details, root, details_dirty: true, changed_this_txn: true });
            Ok(())
        })
    }

    /// Creates `dev` as a snapshot of `origin` in O(1): the snapshot shares the origin's mapping
    /// tree (one more reference on its root); the pool time advances and both devices record
    /// it as their snapshotted time, which makes every existing mapping "shared".
    /// The origin must be quiesced (no in-flight writes) by the caller, as in dm-thin.
    pub fn create_snap(&mut self, dev: u64, origin: u64) -> Result<()> {
        check_dev_id(dev)?;
        self.check_writable()?;
        if self.devices.contains_key(&dev) {
            return Err(MetaError::DeviceExists(dev));
        }
        let origin_root = self.device(origin)?.root;
        self.ensure_metadata_space(false)?;
        self.guard(|s| {
            s.tm.inc(origin_root)?;
            let (top, old) = btree::insert(
                &mut s.tm,
                &mut SubtreeRc { dsm: &mut s.dsm },
                s.mapping_root,
                dev,
                &origin_root.to_le_bytes(),
            )?;
            s.mapping_root = top;
            if old.is_some() {
                return Err(s.tm.corrupt(
                    top,
                    Corruption::BadDevice(format!("device {dev} in the mapping tree but not in the details tree")),
                ));
            }
            s.time = s.time.wrapping_add(1);
            let time = s.time;
            let o = s.devices.get_mut(&origin).expect("origin checked above");
            o.details.snapshotted_time = time;
            o.details_dirty = true;
            o.changed_this_txn = true;
            let details = DeviceDetails {
                mapped_blocks: o.details.mapped_blocks,
                transaction_id: s.trans_id,
                creation_time: time,
                snapshotted_time: time,
            };
            s.devices.insert(dev, Device { details, root: origin_root, details_dirty: true, changed_this_txn: true });
            Ok(())
        })
    }

    /// Deletes a device; data blocks only it referenced become free at commit.
    pub fn delete(&mut self, dev: u64) -> Result<()> {
        self.check_writable()?;
        self.device(dev)?;
        self.ensure_metadata_space(true)?;
        self.guard(|s| {
            let (top, old) = btree::remove(&mut s.tm, &mut SubtreeRc { dsm: &mut s.dsm }, s.mapping_root, dev)?;
            s.mapping_root = top;
            if old.is_none() {
                return Err(s
                    .tm
                    .corrupt(top, Corruption::BadDevice(format!("device {dev} missing from the mapping tree"))));
            }
            s.details_root = btree::remove(&mut s.tm, &mut NoRc, s.details_root, dev)?.0;
            s.devices.remove(&dev);
            Ok(())
        })
    }

    /// Ids of all devices, ascending.
    pub fn devices(&self) -> Vec<u64> {
        self.devices.keys().copied().collect()
    }

    pub fn device_exists(&self, dev: u64) -> bool {
        self.devices.contains_key(&dev)
    }

    pub fn device_details(&self, dev: u64) -> Result<DeviceDetails> {
        Ok(self.device(dev)?.details)
    }

    /// dm-thin's `dm_thin_changed_this_transaction`: a flush/FUA to this device must wait for a
    /// commit when true.
    pub fn changed_this_transaction(&self, dev: u64) -> bool {
        self.devices.get(&dev).is_some_and(|d| d.changed_this_txn)
    }

    /// Any uncommitted change at all.
    pub fn has_uncommitted_changes(&self) -> bool {
        self.tm.nr_new() > 0
            || self.devices.values().any(|d| d.details_dirty)
            || self.trans_id != self.committed.trans_id
    }

    /// Highest mapped virtual block of `dev` (thin status' highest mapped sector / block size).
    pub fn highest_mapped(&self, dev: u64) -> Result<Option<u64>> {
        btree::last_key(&self.tm, self.device(dev)?.root)
    }

    //--------------------------------------------------------------------------------------------
    // Mappings

    fn mapping_from(&self, d: &Device, v: u64) -> Mapping {
        let (data_block, time) = unpack_block_time(v);
        Mapping { data_block, time, shared: d.details.snapshotted_time > time }
    }

    /// Looks up a mapping, reading metadata from the device as needed.
    pub fn lookup(&self, dev: u64, vblock: u64) -> Result<Option<Mapping>> {
        let d = self.device(dev)?;
        let v = btree::lookup(&self.tm, d.root, vblock, BLOCK_TIME_BYTES, ReadMode::MayRead)?;
        Ok(v.map(|v| self.mapping_from(d, v.as_u64())))
    }

    /// Looks up a mapping using only memory: `Err(WouldBlock)` when a node is not cached
    /// (dm-thin's non-blocking `dm_thin_find_block(.., can_issue_io = false)`).
    pub fn lookup_cached(&self, dev: u64, vblock: u64) -> Result<Option<Mapping>> {
        let d = self.device(dev)?;
        let v = btree::lookup(&self.tm, d.root, vblock, BLOCK_TIME_BYTES, ReadMode::CacheOnly)?;
        Ok(v.map(|v| self.mapping_from(d, v.as_u64())))
    }

    /// Visits mappings of `dev` with `begin <= vblock < end` in order; `f` returns false to stop.
    pub fn for_each_mapping(
        &self,
        dev: u64,
        begin: u64,
        end: u64,
        f: &mut dyn FnMut(u64, Mapping) -> bool,
    ) -> Result<()> {
        let d = self.device(dev)?;
        btree::walk_range(&self.tm, d.root, BLOCK_TIME_BYTES, begin, end, &mut |k, v| {
            Ok(f(k, self.mapping_from(d, get_u64(v, 0))))
        })
    }

    /// Runs `f` on the device's mapping tree after making the top-level path to it private,
    /// and stores the new root.
    fn update_device_tree<R>(
        &mut self,
        dev: u64,
        f: impl FnOnce(&mut Tm, &mut DataSm, u64) -> Result<(u64, R)>,
    ) -> Result<R> {
        let (top, leaf, idx) =
            btree::shadow_path(&mut self.tm, &mut SubtreeRc { dsm: &mut self.dsm }, self.mapping_root, dev)?
                .ok_or_else(|| {
                    self.tm.corrupt(
                        self.mapping_root,
                        Corruption::BadDevice(format!("device {dev} missing from the mapping tree")),
                    )
                })?;
        self.mapping_root = top;
        let root = btree::leaf_value(&self.tm, leaf, idx)?.as_u64();
        let (new_root, r) = f(&mut self.tm, &mut self.dsm, root)?;
        btree::set_leaf_value(&mut self.tm, leaf, idx, &new_root.to_le_bytes())?;
        let d = self.devices.get_mut(&dev).expect("caller checked the device");
        d.root = new_root;
        d.changed_this_txn = true;
        Ok(r)
    }

    /// Maps `vblock` of `dev` to `data_block` at the current time. Takes over one reference to
    /// `data_block` from the caller (from `alloc_data_block` or `inc_data_block`); a previous
    /// mapping's reference is released. Returns true if the block was not mapped before.
    pub fn insert(&mut self, dev: u64, vblock: u64, data_block: u64) -> Result<bool> {
        self.check_writable()?;
        self.device(dev)?;
        if data_block >= self.dsm.nr_blocks() {
            return Err(MetaError::InvalidArgument(format!(
                "data block {data_block} is beyond the {} data blocks",
                self.dsm.nr_blocks()
            )));
        }
        self.ensure_metadata_space(false)?;
        self.insert_unchecked(dev, vblock, data_block)
    }

    /// `insert` after its checks (the caller ran them, and `ensure_metadata_space`).
    fn insert_unchecked(&mut self, dev: u64, vblock: u64, data_block: u64) -> Result<bool> {
        let value = pack_block_time(data_block, self.time).to_le_bytes();
        self.guard(|s| {
            let inserted = s.update_device_tree(dev, |tm, dsm, root| {
                let (new_root, old) = btree::insert(tm, &mut BlockTimeRc { dsm }, root, vblock, &value)?;
                if let Some(o) = old {
                    dsm.dec(tm, unpack_block_time(o.as_u64()).0)?;
                }
                Ok((new_root, old.is_none()))
            })?;
            let d = s.devices.get_mut(&dev).expect("checked");
            if inserted {
                d.details.mapped_blocks += 1;
            }
            d.details_dirty = true;
            Ok(inserted)
        })
    }

    /// Allocates a data block and maps `vblock` to it (provisioning, or breaking sharing: the
    /// old block's reference is released). The caller copies/zeroes data as needed.
    pub fn provision(&mut self, dev: u64, vblock: u64) -> Result<Mapping> {
        self.check_writable()?;
        self.device(dev)?;
        self.ensure_metadata_space(false)?;
        let b = self.alloc_data_block()?;
        // One space check covers both steps (the reserve is far above what one mapping
        // needs): checking again here could refuse the insert after the allocation changed
        // the data space map, leaking the block.
        self.insert_unchecked(dev, vblock, b)?;
        Ok(Mapping { data_block: b, time: self.time & 0x00ff_ffff, shared: false })
    }

    /// Unmaps one block; returns the old mapping.
    pub fn remove(&mut self, dev: u64, vblock: u64) -> Result<Option<Mapping>> {
        self.check_writable()?;
        let Some(m) = self.lookup(dev, vblock)? else { return Ok(None) };
        self.ensure_metadata_space(true)?;
        self.guard(|s| {
            let old =
                s.update_device_tree(dev, |tm, dsm, root| btree::remove(tm, &mut BlockTimeRc { dsm }, root, vblock))?;
            if old.is_none() {
                return Err(MetaError::Poisoned { reason: format!("mapping {dev}:{vblock} vanished during remove") });
            }
            let d = s.devices.get_mut(&dev).expect("checked");
            d.details.mapped_blocks = d.details.mapped_blocks.saturating_sub(1);
            d.details_dirty = true;
            Ok(Some(m))
        })
    }

    /// Unmaps every block in `[begin, end)`; returns how many were mapped.
    pub fn remove_range(&mut self, dev: u64, begin: u64, end: u64) -> Result<u64> {
        self.remove_range_with(dev, begin, end, &mut |_, _| {})
    }

    /// Like `remove_range`, and returns what was unmapped (vblock, old mapping) in order.
    /// For discard passdown the way dm-thin does it: unmap, hold the blocks whose count went
    /// to 0 with `inc_data_block`, commit, discard them on the data device, then
    /// `dec_data_block` (so no block is reused, or discarded, while the last commit maps it).
    pub fn remove_range_mappings(&mut self, dev: u64, begin: u64, end: u64) -> Result<Vec<(u64, Mapping)>> {
        let snapshotted_time = self.device(dev)?.details.snapshotted_time;
        let mut out = Vec::new();
        self.remove_range_with(dev, begin, end, &mut |vb, v| {
            let (data_block, time) = unpack_block_time(v.as_u64());
            out.push((vb, Mapping { data_block, time, shared: snapshotted_time > time }));
        })?;
        Ok(out)
    }

    fn remove_range_with(
        &mut self,
        dev: u64,
        begin: u64,
        end: u64,
        sink: &mut dyn FnMut(u64, btree::Value),
    ) -> Result<u64> {
        self.check_writable()?;
        self.device(dev)?;
        if begin >= end {
            return Ok(0);
        }
        self.ensure_metadata_space(true)?;
        self.guard(|s| {
            let n = s.update_device_tree(dev, |tm, dsm, root| {
                btree::remove_range(tm, &mut BlockTimeRc { dsm }, root, BLOCK_TIME_BYTES, begin, end, sink)
            })?;
            let d = s.devices.get_mut(&dev).expect("checked");
            d.details.mapped_blocks = d.details.mapped_blocks.saturating_sub(n);
            d.details_dirty = true;
            Ok(n)
        })
    }

    //--------------------------------------------------------------------------------------------
    // Data blocks

    /// Allocates a free data block with count 1. Blocks freed in this transaction are not
    /// reused before commit. `OutOfDataSpace` changes nothing.
    pub fn alloc_data_block(&mut self) -> Result<u64> {
        self.check_writable()?;
        if !self.dsm.may_have_free() {
            return Err(MetaError::OutOfDataSpace { nr_blocks: self.dsm.nr_blocks() });
        }
        self.ensure_metadata_space(false)?;
        self.guard(|s| s.dsm.alloc(&mut s.tm))
    }

    /// Adds a reference to a data block. A free block becomes allocated (count 1): that is how
    /// blocks are held across a discard passdown (kernel `dm_pool_inc_data_range`).
    pub fn inc_data_block(&mut self, b: u64) -> Result<()> {
        self.check_writable()?;
        self.check_data_block(b)?;
        self.ensure_metadata_space(false)?;
        self.guard(|s| s.dsm.inc_any(&mut s.tm, b))
    }

    /// Drops a reference; returns the new count (0 = free after commit).
    pub fn dec_data_block(&mut self, b: u64) -> Result<u32> {
        self.check_writable()?;
        self.check_data_block(b)?;
        self.ensure_metadata_space(true)?;
        self.guard(|s| s.dsm.dec(&mut s.tm, b))
    }

    pub fn data_block_ref_count(&self, b: u64) -> Result<u32> {
        self.check_data_block(b)?;
        self.dsm.get(&self.tm, b)
    }

    fn check_data_block(&self, b: u64) -> Result<()> {
        if b >= self.dsm.nr_blocks() {
            return Err(MetaError::InvalidArgument(format!(
                "data block {b} is beyond the {} data blocks",
                self.dsm.nr_blocks()
            )));
        }
        Ok(())
    }

    /// Grows the data device (shrinking is refused, as by the kernel).
    pub fn resize_data(&mut self, nr_data_blocks: u64) -> Result<()> {
        self.check_writable()?;
        if nr_data_blocks < self.dsm.nr_blocks() {
            return Err(MetaError::InvalidArgument(format!(
                "data device cannot shrink from {} to {nr_data_blocks} blocks",
                self.dsm.nr_blocks()
            )));
        }
        self.check_data_growth(nr_data_blocks)?;
        self.guard(|s| s.dsm.extend(&mut s.tm, nr_data_blocks))
    }

    /// Refuses a data growth the metadata cannot map, before anything changes: past the format's
    /// limit, or needing more metadata blocks for the data space map (new bitmap blocks and the
    /// index nodes listing them) than are free beyond the reserve. Tried anyway, the growth
    /// would run out of metadata space half-way, which poisons the transaction and fails the
    /// pool (dm-thin sets needs_check there).
    pub fn check_data_growth(&self, nr_data_blocks: u64) -> Result<()> {
        if nr_data_blocks > MAX_DATA_BLOCKS {
            return Err(MetaError::InvalidArgument(format!("{nr_data_blocks} data blocks exceed the 2^40 limit")));
        }
        let new_bitmaps = nr_bitmaps(nr_data_blocks).saturating_sub(nr_bitmaps(self.dsm.nr_blocks()));
        if new_bitmaps == 0 {
            return Ok(());
        }
        // An index leaf holds over 100 entries; the rest shadows the path and the superblock.
        let needed = new_bitmaps + new_bitmaps.div_ceil(100) + 16;
        let free = self.free_metadata_blocks();
        if needed > free {
            return Err(MetaError::InvalidArgument(format!(
                "mapping {nr_data_blocks} data blocks needs about {needed} more metadata blocks for the data space map, \
                 and {free} are free: grow the metadata first"
            )));
        }
        Ok(())
    }

    /// The most metadata blocks the space map may grow to: the device's current size, capped at
    /// the format maximum (dm-thin's DM_SM_METADATA_MAX_BLOCKS).
    pub fn usable_metadata_blocks(&self) -> u64 {
        self.io.nr_blocks().min(MAX_METADATA_BLOCKS)
    }

    /// Grows the metadata space map to `nr_blocks` (capped at the device size and the format
    /// maximum). Takes effect at the next commit.
    pub fn resize_metadata(&mut self, nr_blocks: u64) -> Result<()> {
        self.check_writable()?;
        let cap = self.usable_metadata_blocks();
        if nr_blocks < self.tm.msm.nr_blocks() {
            return Err(MetaError::InvalidArgument(format!(
                "metadata cannot shrink from {} to {nr_blocks} blocks",
                self.tm.msm.nr_blocks()
            )));
        }
        if nr_blocks > cap {
            return Err(MetaError::InvalidArgument(format!("{nr_blocks} metadata blocks exceed the usable {cap}")));
        }
        self.tm.msm.extend(nr_blocks);
        Ok(())
    }

    //--------------------------------------------------------------------------------------------
    // Pool state

    pub fn transaction_id(&self) -> u64 {
        self.trans_id
    }

    /// dm-thin's `set_transaction_id <current> <new>`: compare-and-swap, effective at commit.
    pub fn set_transaction_id(&mut self, current: u64, new: u64) -> Result<()> {
        self.check_writable()?;
        if self.trans_id != current {
            return Err(MetaError::TransactionIdMismatch { expected: current, actual: self.trans_id });
        }
        self.trans_id = new;
        Ok(())
    }

    /// Current snapshot time.
    pub fn time(&self) -> u32 {
        self.time
    }

    pub fn data_block_size_sectors(&self) -> u32 {
        self.data_block_size_sectors
    }

    pub fn nr_data_blocks(&self) -> u64 {
        self.dsm.nr_blocks()
    }

    pub fn needs_check(&self) -> bool {
        self.flags & FLAG_NEEDS_CHECK != 0
    }

    /// Sets NEEDS_CHECK and writes it into the last committed superblock right away (kernel
    /// `dm_pool_metadata_set_needs_check`). Works on a poisoned transaction; the open
    /// transaction is not committed.
    pub fn set_needs_check(&mut self) -> Result<()> {
        if let Some(r) = &self.read_only {
            return Err(MetaError::ReadOnly(r.clone()));
        }
        self.flags |= FLAG_NEEDS_CHECK;
        let mut sb = self.committed.clone();
        sb.flags |= FLAG_NEEDS_CHECK;
        let mut buf = zeroed_block();
        sb.pack(&mut buf);
        seal(&mut buf, BlockKind::Superblock, 0);
        let io_err = |op, source| MetaError::Io { device: self.io.name().to_string(), op, block: 0, source };
        self.io.write_blocks(&[(0, &buf)]).map_err(|e| io_err("write", e))?;
        self.io.flush().map_err(|e| io_err("flush", e))?;
        self.tm.cache().remove(0);
        self.committed = sb;
        Ok(())
    }

    pub fn is_poisoned(&self) -> Option<&str> {
        self.poisoned.as_deref()
    }

    pub fn is_read_only(&self) -> bool {
        self.read_only.is_some()
    }

    /// Block of the held metadata snapshot, if any.
    pub fn metadata_snap(&self) -> Option<u64> {
        (self.held_root != 0).then_some(self.held_root)
    }

    /// `dmsetup status`-style numbers.
    pub fn status(&self) -> PoolStatus {
        let total = self.tm.msm.nr_blocks();
        let reserve = self.metadata_reserve_blocks();
        let free = self.tm.msm.nr_free().saturating_sub(reserve);
        PoolStatus {
            transaction_id: self.trans_id,
            used_metadata_blocks: total - free,
            total_metadata_blocks: total,
            allocated_metadata_blocks: self.tm.msm.nr_allocated(),
            metadata_reserve_blocks: reserve,
            used_data_blocks: self.dsm.nr_allocated(),
            total_data_blocks: self.dsm.nr_blocks(),
            held_root: self.metadata_snap(),
            needs_check: self.needs_check(),
            metadata_low_water_blocks: (total / 4).min(1024),
        }
    }

    /// Free metadata blocks beyond the reserve (dm-thin's free metadata count).
    pub fn free_metadata_blocks(&self) -> u64 {
        self.tm.msm.nr_free().saturating_sub(self.metadata_reserve_blocks())
    }

    /// Metadata blocks freed by the open transaction: not allocatable before it commits (a
    /// block the last commit references is never overwritten), free after. When an operation
    /// is refused for lack of metadata space and this is non-zero, a commit may make room
    /// (the kernel commits "before we use up the metadata reserve").
    pub fn metadata_blocks_freed_uncommitted(&self) -> u64 {
        self.tm.msm.nr_freed_this_txn()
    }

    pub fn free_data_blocks(&self) -> u64 {
        self.dsm.nr_free()
    }

    pub fn device_name(&self) -> &str {
        self.io.name()
    }

    /// Blocks in the clean cache / dirty set (diagnostics).
    pub fn cache_stats(&self) -> (usize, usize) {
        (self.tm.cache().len(), self.tm.nr_dirty())
    }

    //--------------------------------------------------------------------------------------------
    // Metadata snapshot (held root)

    /// `reserve_metadata_snap`: commits, then keeps a copy of the superblock whose trees stay
    /// referenced (and so unchanged) until released; userspace tools read it with `-m`.
    pub fn reserve_metadata_snap(&mut self) -> Result<u64> {
        self.check_writable()?;
        if self.held_root != 0 {
            return Err(MetaError::MetadataSnap(format!(
                "a metadata snapshot already exists at block {}; release it first",
                self.held_root
            )));
        }
        self.ensure_metadata_space(false)?;
        self.commit()?;
        self.guard(|s| {
            let h = s.tm.new_block(BlockKind::Superblock)?;
            let mut copy = s.committed.clone();
            copy.data_sm_root = SmRoot::default();
            copy.metadata_sm_root = SmRoot::default();
            copy.held_root = 0;
            copy.pack(s.tm.get_mut(h)?);
            s.tm.inc(s.mapping_root)?;
            s.tm.inc(s.details_root)?;
            s.held_root = h;
            Ok(h)
        })
    }

    /// `release_metadata_snap`: drops the snapshot's references.
    pub fn release_metadata_snap(&mut self) -> Result<()> {
        self.check_writable()?;
        let h = self.held_root;
        if h == 0 {
            return Err(MetaError::MetadataSnap("no metadata snapshot is held".into()));
        }
        self.guard(|s| {
            let snap = Superblock::unpack(&*s.tm.read(h, BlockKind::Superblock)?);
            btree::del(&mut s.tm, &mut SubtreeRc { dsm: &mut s.dsm }, snap.data_mapping_root)?;
            btree::del(&mut s.tm, &mut NoRc, snap.device_details_root)?;
            s.tm.dec(h)?;
            s.held_root = 0;
            Ok(())
        })
    }

    /// The superblock copy the metadata snapshot holds (its space-map roots are zero).
    pub fn metadata_snap_superblock(&self) -> Result<Superblock> {
        let h = self.metadata_snap().ok_or_else(|| MetaError::MetadataSnap("no metadata snapshot is held".into()))?;
        Ok(Superblock::unpack(&*self.tm.read(h, BlockKind::Superblock)?))
    }

    /// The devices and their mapping roots as recorded in the metadata snapshot.
    pub fn metadata_snap_devices(&self) -> Result<Vec<(u64, DeviceDetails)>> {
        let h = self.metadata_snap().ok_or_else(|| MetaError::MetadataSnap("no metadata snapshot is held".into()))?;
        let snap = Superblock::unpack(&*self.tm.read(h, BlockKind::Superblock)?);
        let devs = load_devices(&self.tm, snap.device_details_root, snap.data_mapping_root)?;
        Ok(devs.into_iter().map(|(k, d)| (k, d.details)).collect())
    }

    /// Visits the metadata snapshot's mappings of `dev` (shared flag computed against the
    /// snapshot's own details).
    pub fn for_each_snap_mapping(&self, dev: u64, f: &mut dyn FnMut(u64, Mapping) -> bool) -> Result<()> {
        let h = self.metadata_snap().ok_or_else(|| MetaError::MetadataSnap("no metadata snapshot is held".into()))?;
        let snap = Superblock::unpack(&*self.tm.read(h, BlockKind::Superblock)?);
        let devs = load_devices(&self.tm, snap.device_details_root, snap.data_mapping_root)?;
        let d = devs.get(&dev).ok_or(MetaError::NoSuchDevice(dev))?;
        btree::walk_range(&self.tm, d.root, BLOCK_TIME_BYTES, 0, u64::MAX, &mut |k, v| {
            Ok(f(k, self.mapping_from(d, get_u64(v, 0))))
        })
    }

    //--------------------------------------------------------------------------------------------
    // Restore support (thin_restore semantics: fields come from the XML)

    pub(crate) fn restore_header(&mut self, time: u32, trans_id: u64, flags: u32) {
        self.time = time;
        self.trans_id = trans_id;
        self.flags = flags;
    }

    /// Creates `dev` with the given details; mappings follow through `restore_mapping`.
    pub(crate) fn restore_device(&mut self, dev: u64, details: DeviceDetails) -> Result<()> {
        self.create_thin(dev)?;
        let d = self.devices.get_mut(&dev).expect("just created");
        d.details = DeviceDetails { mapped_blocks: 0, ..details };
        Ok(())
    }

    /// Maps `vblock` to `data_block` with an explicit time, adding a reference to the data
    /// block whatever its count. Refuses a block that is already mapped.
    pub(crate) fn restore_mapping(&mut self, dev: u64, vblock: u64, data_block: u64, time: u32) -> Result<()> {
        self.check_writable()?;
        self.device(dev)?;
        self.check_data_block(data_block)?;
        if time > 0x00ff_ffff {
            return Err(MetaError::InvalidArgument(format!("mapping time {time} exceeds 24 bits")));
        }
        self.ensure_metadata_space(false)?;
        let value = pack_block_time(data_block, time).to_le_bytes();
        self.guard(|s| {
            s.dsm.inc_any(&mut s.tm, data_block)?;
            let inserted = s.update_device_tree(dev, |tm, dsm, root| {
                let (new_root, old) = btree::insert(tm, &mut BlockTimeRc { dsm }, root, vblock, &value)?;
                Ok((new_root, old.is_none()))
            })?;
            if !inserted {
                return Err(MetaError::InvalidArgument(format!("device {dev}: block {vblock} is mapped twice")));
            }
            let d = s.devices.get_mut(&dev).expect("checked");
            d.details.mapped_blocks += 1;
            d.details_dirty = true;
            Ok(())
        })
    }
}

//------------------------------------------------------------------------------------------------
// Loading

fn load_metadata_sm(tm: &Tm, root: &SmRoot) -> Result<MetadataSm> {
    let nr_blocks = root.nr_blocks;
    let nb = nr_bitmaps(nr_blocks) as usize;
    let index = {
        let blk = tm.read(root.bitmap_root, BlockKind::Index)?;
        index_block_decode(&blk, nb)
    };
    let mut codes = vec![0u8; nr_blocks as usize];
    let mut bitmap_blocks = Vec::with_capacity(nb);
    for (bm, ie) in index.iter().enumerate() {
        if ie.blocknr == 0 || ie.blocknr >= nr_blocks {
            return Err(tm.corrupt(
                root.bitmap_root,
                Corruption::BadSpaceMap(format!("metadata bitmap {bm} at impossible block {}", ie.blocknr)),
            ));
        }
        if let Some(why) = ie.impossible() {
            return Err(tm.corrupt(root.bitmap_root, Corruption::BadSpaceMap(format!("metadata bitmap {bm}: {why}"))));
        }
        let blk = tm.read(ie.blocknr, BlockKind::Bitmap)?;
        let start = bm * ENTRIES_PER_BITMAP as usize;
        let end = (start + ENTRIES_PER_BITMAP as usize).min(nr_blocks as usize);
        bitmap_decode(&blk, &mut codes[start..end]);
        bitmap_blocks.push(ie.blocknr);
    }
    // The superblock and the space map's own blocks must be counted in use: a space map
    // that calls one of them free would hand it out as a new block (for the bitmap or index
    // itself, a commit would allocate the block as its own new home and free it as the old
    // one, forever).
    let own = [(0, "the superblock"), (root.bitmap_root, "the metadata space-map index")]
        .into_iter()
        .chain(bitmap_blocks.iter().map(|&b| (b, "a metadata space-map bitmap")));
    for (b, what) in own {
        if codes.get(b as usize).is_none_or(|&c| c == 0) {
            return Err(tm.corrupt(
                b,
                Corruption::BadSpaceMap(format!("{what} is in use but the metadata space map marks it free")),
            ));
        }
    }
    let mut overflow = std::collections::HashMap::new();
    btree::walk_range(tm, root.ref_count_root, 4, 0, u64::MAX, &mut |k, v| {
        overflow.insert(k, get_u32(v, 0));
        Ok(true)
    })?;
    MetadataSm::from_disk(codes, overflow, root.bitmap_root, bitmap_blocks, root.ref_count_root)
        .map_err(|m| tm.corrupt(root.bitmap_root, Corruption::BadSpaceMap(m)))
}

fn load_devices(tm: &Tm, details_root: u64, mapping_root: u64) -> Result<BTreeMap<u64, Device>> {
    let mut details = BTreeMap::new();
    btree::walk_range(tm, details_root, DEVICE_DETAILS_BYTES, 0, u64::MAX, &mut |k, v| {
        details.insert(k, DeviceDetails::unpack(v));
        Ok(true)
    })?;
    let mut roots = BTreeMap::new();
    btree::walk_range(tm, mapping_root, 8, 0, u64::MAX, &mut |k, v| {
        roots.insert(k, get_u64(v, 0));
        Ok(true)
    })?;
    if let Some(k) = details.keys().find(|k| !roots.contains_key(k)) {
        return Err(
            tm.corrupt(mapping_root, Corruption::BadDevice(format!("device {k} has details but no mapping tree")))
        );
    }
    if let Some(k) = roots.keys().find(|k| !details.contains_key(k)) {
        return Err(
            tm.corrupt(details_root, Corruption::BadDevice(format!("device {k} has a mapping tree but no details")))
        );
    }
    Ok(details
        .into_iter()
        .map(|(k, d)| (k, Device { details: d, root: roots[&k], details_dirty: false, changed_this_txn: false }))
        .collect())
}
