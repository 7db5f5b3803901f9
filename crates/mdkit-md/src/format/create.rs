//! Planning a new array exactly as `mdadm --create` (mdadm 4.2, Create.c + super1.c) does:
//! data offset, sizes, superblock, bitmap and bad-block log placement, roles and defaults.
//! The caller supplies the UUIDs and the creation time, so plans are deterministic; the result
//! is the superblock (and bitmap area) to write to each member — whole 4 KiB blocks.
//!
//! mdadm's rules, in the order it applies them:
//! 1. chunk: 512 KiB by default for raid0/4/5/6/10, none for raid1; layout: raid5/6
//!    left-symmetric (2), raid10 n2 (0x102), raid0 "original" (1), others 0.
//! 2. data offset (1.1/1.2), from the first member's size: `24 + bm_space + headroom` sectors
//!    rounded up to 1 MiB, where bm_space = choose_bm_space(device) and headroom starts at
//!    128 MiB and halves while `headroom * 1024 > device` and `headroom / 2 >= 2 * chunk`.
//!    1.0 puts data at 0 and the superblock at the end.
//! 3. per-member free space: `device - data_offset` (1.0: `(device & ~7) - 24 - bm_space`),
//!    rounded down to the chunk; `size` = the smallest (raid1: rounded down to 64 KiB;
//!    raid0: 0, the kernel uses each member's data_size).
//! 4. internal bitmap at +8 sectors (1.0: before the superblock), chunk from the room
//!    choose_bm_space(size) with the 64 MiB default; sync_size = size (raid10: array size).
//! 5. bad-block log (8 sectors) right after the bitmap space if it fits before the data,
//!    else just below the data; 1.0: at -8 sectors.
//! 6. raid0 members of different sizes get the RAID0_LAYOUT feature.
//! 7. events 0; resync_offset MaxSector when clean (raid0, --assume-clean, or raid4/5 built by
//!    recovering the last member), else 0.

use super::bitmap::{self, BitmapError, BitmapSuper};
use super::superblock::{
    self, MAX_DEV_ROLES, MAX_SECTOR, MetadataVersion, ROLE_SPARE, SB_FIXED_BYTES, Superblock, SuperblockError,
    compose_set_name, feature, md_time,
};
use super::{METADATA_BLOCK_BYTES, SECTOR_BYTES};
use crate::layout::names::{LayoutError, RAID0_ORIG_LAYOUT, RAID10_DEFAULT_LAYOUT, RAID56_DEFAULT_LAYOUT};
use crate::layout::{self, Level, ParityGeometry, Raid0Geometry, Raid0Layout, Raid10Geometry};

/// mdadm's default chunk (KiB).
pub const DEFAULT_CHUNK_KIB: u32 = 512;
/// Most devices an array may have (MAX_DEVS for 1.x metadata: the roles fill 4 KiB).
pub const MAX_DEVICES: u32 = MAX_DEV_ROLES;
/// mdadm's starting reshape headroom (128 MiB in sectors).
const MAX_HEADROOM_SECTORS: u64 = 128 * 1024 * 2;
/// 1 MiB in sectors: data offsets are rounded up to this.
const ONE_MIB_SECTORS: u64 = 2048;

/// Internal bitmap or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BitmapRequest {
    None,
    /// `--bitmap=internal`, optionally with `--bitmap-chunk` (bytes).
    Internal {
        chunk_bytes: Option<u32>,
    },
}

/// How the new array starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InitialSync {
    /// `--assume-clean`: the members are declared in sync (resync_offset = MaxSector).
    AssumeClean,
    /// Needs a full resync (resync_offset = 0).
    Resync,
    /// What mdadm does without `--assume-clean`: raid4/5 are created with the last member as a
    /// spare so the kernel rebuilds it (faster than a resync); other levels resync; raid0
    /// needs nothing.
    MdadmDefault,
}

/// Everything `mdadm --create` is told, with sizes in sectors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CreateRequest {
    pub metadata: MetadataVersion,
    pub level: Level,
    pub raid_devices: u32,
    /// Size of each member device (sectors), in slot order. Members beyond `raid_devices`
    /// become spares.
    pub member_sizes_sectors: Vec<u64>,
    /// `--chunk` (KiB); `None` = 512 KiB (raid1: no chunk).
    pub chunk_kib: Option<u32>,
    /// `--layout` (superblock value, see [`crate::layout::parse_layout`]); `None` = default.
    pub layout: Option<u32>,
    pub bitmap: BitmapRequest,
    /// `--size` (KiB per member); `None` = as large as the smallest member allows.
    pub size_kib: Option<u64>,
    /// `--data-offset` (sectors); `None` = mdadm's choice.
    pub data_offset_sectors: Option<u64>,
    /// Array name; combined with `homehost` as mdadm does ([`compose_set_name`]).
    pub name: String,
    pub homehost: Option<String>,
    pub array_uuid: [u8; 16],
    /// One per member; empty = derived deterministically from the array UUID.
    pub device_uuids: Vec<[u8; 16]>,
    /// Creation time (seconds since the epoch).
    pub ctime_seconds: u64,
    pub sync: InitialSync,
    /// `--delay` (bitmap daemon_sleep, seconds).
    pub bitmap_daemon_sleep_secs: u32,
    /// `--write-behind` (raid1 write-mostly members).
    pub bitmap_write_behind: u32,
}

impl CreateRequest {
    /// A request with mdadm's defaults: metadata 1.2, default chunk and layout, all members
    /// active, no bitmap, mdadm's default sync behaviour.
    pub fn new(
        level: Level,
        member_sizes_sectors: Vec<u64>,
        array_uuid: [u8; 16],
        ctime_seconds: u64,
    ) -> CreateRequest {
        CreateRequest {
            metadata: MetadataVersion::V1_2,
            level,
            raid_devices: member_sizes_sectors.len() as u32,
            member_sizes_sectors,
            chunk_kib: None,
            layout: None,
            bitmap: BitmapRequest::None,
            size_kib: None,
            data_offset_sectors: None,
            name: String::new(),
            homehost: None,
            array_uuid,
            device_uuids: Vec::new(),
            ctime_seconds,
            sync: InitialSync::MdadmDefault,
            bitmap_daemon_sleep_secs: bitmap::MDADM_DEFAULT_DAEMON_SLEEP_SECS,
            bitmap_write_behind: 0,
        }
    }
}

/// Why an array cannot be created as requested.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CreateError {
    #[error("{level} needs at least {min} raid devices, {raid_devices} given")]
    TooFewDevices { level: &'static str, raid_devices: u32, min: u32 },
    #[error("{level} supports at most {max} raid devices, {raid_devices} given")]
    TooManyRaidDevices { level: &'static str, raid_devices: u32, max: u32 },
    #[error("{members} member devices given for {raid_devices} raid devices (need at least as many)")]
    NotEnoughMembers { members: usize, raid_devices: u32 },
    #[error("{count} devices exceed the {MAX_DEVICES} a 1.x superblock can describe")]
    TooManyDevices { count: usize },
    #[error("{level} does not support spare devices")]
    SparesNotSupported { level: &'static str },
    #[error("a chunk size is not meaningful for {level}")]
    ChunkNotAllowed { level: &'static str },
    #[error("chunk {chunk_kib} KiB is invalid: must be a power of 2 and at least 4 KiB")]
    BadChunk { chunk_kib: u32 },
    #[error("a write-intent bitmap is not meaningful for {level}")]
    BitmapNotAllowed { level: &'static str },
    #[error("write-behind is valid for raid1 only, not {level}")]
    WriteBehindNotRaid1 { level: &'static str },
    #[error("write-behind needs a write-intent bitmap")]
    WriteBehindWithoutBitmap,
    #[error("write-behind {write_behind} is out of range (0 - {max})", max = bitmap::COUNTER_MAX)]
    WriteBehindTooLarge { write_behind: u32 },
    #[error("--size is not supported for {level}")]
    SizeNotAllowed { level: &'static str },
    #[error("layout {layout:#x} requires at least {copies} devices, {raid_devices} given")]
    LayoutNeedsDevices { layout: u32, copies: u32, raid_devices: u32 },
    #[error("member {member}: {size_sectors} sectors is too small for the metadata (needs more than {needed_sectors})")]
    MemberTooSmall { member: usize, size_sectors: u64, needed_sectors: u64 },
    #[error("member {member}: only {available_kib} KiB available, smaller than the requested size {requested_kib} KiB")]
    MemberSmallerThanSize { member: usize, available_kib: u64, requested_kib: u64 },
    #[error("--size {size_kib} KiB is smaller than one chunk")]
    SizeBelowChunk { size_kib: u64 },
    #[error("{count} device uuids given for {members} members")]
    DeviceUuidCount { count: usize, members: usize },
    #[error("invalid geometry: {0}")]
    Layout(#[from] LayoutError),
    #[error("bitmap: {0}")]
    Bitmap(#[from] BitmapError),
    #[error("superblock for member {member}: {source}")]
    Superblock { member: usize, source: SuperblockError },
}

/// What to write to one member.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberPlan {
    pub superblock: Superblock,
    /// The encoded 4 KiB superblock block (checksum included, verified by decoding).
    pub superblock_block: Vec<u8>,
    /// Byte offset of the superblock block on the member.
    pub superblock_offset_bytes: u64,
    /// Byte offset of the bitmap area on the member (when there is a bitmap).
    pub bitmap_offset_bytes: Option<u64>,
}

/// A planned array.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CreatePlan {
    pub metadata: MetadataVersion,
    pub level: Level,
    pub raid_disks: u32,
    pub layout: u32,
    /// 0 for raid1.
    pub chunk_sectors: u32,
    /// The superblock `size` (per-member used sectors; 0 for raid0).
    pub member_size_sectors: u64,
    /// Common data offset (sectors).
    pub data_offset_sectors: u64,
    pub array_sectors: u64,
    pub bitmap: Option<BitmapSuper>,
    /// The bitmap area written to every member at `bitmap_offset_bytes`: superblock + all bits
    /// set, a whole number of 4 KiB blocks.
    pub bitmap_area: Option<Vec<u8>>,
    /// One per member, in slot order (spares last).
    pub members: Vec<MemberPlan>,
}

impl CreatePlan {
    /// The writes that initialise member `member`: `(byte offset, bytes)`, each 4 KiB aligned
    /// and a multiple of 4 KiB long.
    pub fn member_writes(&self, member: usize) -> Vec<(u64, &[u8])> {
        let Some(m) = self.members.get(member) else {
            return Vec::new();
        };
        let mut w = vec![(m.superblock_offset_bytes, m.superblock_block.as_slice())];
        if let (Some(off), Some(area)) = (m.bitmap_offset_bytes, self.bitmap_area.as_ref()) {
            w.push((off, area.as_slice()));
        }
        debug_assert!(
            w.iter().all(|(o, b)| o % METADATA_BLOCK_BYTES as u64 == 0 && b.len() % METADATA_BLOCK_BYTES == 0)
        );
        w
    }
}

/// mdadm's default data offset for 1.1/1.2 (validate_geometry1), from the first member's size
/// and the chunk in KiB (0 when the level has none).
pub fn mdadm_default_data_offset(device_sectors: u64, chunk_kib: u32) -> u64 {
    let bm_space = bitmap::choose_bm_space(device_sectors);
    let chunk_sectors = u64::from(chunk_kib) * 2;
    let mut headroom = MAX_HEADROOM_SECTORS;
    while (headroom << 10) > device_sectors && (chunk_kib == 0 || headroom / 2 >= chunk_sectors * 2) {
        headroom >>= 1;
    }
    (12 * 2 + bm_space + headroom).div_ceil(ONE_MIB_SECTORS) * ONE_MIB_SECTORS
}

fn default_layout(level: Level) -> u32 {
    match level {
        Level::Raid0 => RAID0_ORIG_LAYOUT,
        Level::Raid10 => RAID10_DEFAULT_LAYOUT,
        Level::Raid5 | Level::Raid6 => RAID56_DEFAULT_LAYOUT,
        Level::Raid1 | Level::Raid4 => 0,
    }
}

/// A deterministic per-member UUID when the caller gives none: the array UUID with the last
/// two bytes XORed with `member + 1` (the CLI passes random ones).
pub fn derived_device_uuid(array_uuid: &[u8; 16], member: usize) -> [u8; 16] {
    let mut u = *array_uuid;
    let tag = (member as u16).wrapping_add(1).to_be_bytes();
    u[14] ^= tag[0];
    u[15] ^= tag[1];
    u[0] ^= 0x5a;
    u
}

struct Shape {
    layout: u32,
    chunk_kib: u32,
}

fn check_shape(req: &CreateRequest) -> Result<Shape, CreateError> {
    let level = req.level;
    let lname = level.name();
    if req.raid_devices < level.min_raid_disks() {
        return Err(CreateError::TooFewDevices {
            level: lname,
            raid_devices: req.raid_devices,
            min: level.min_raid_disks(),
        });
    }
    if level == Level::Raid6 && req.raid_devices > 256 {
        return Err(CreateError::TooManyRaidDevices { level: lname, raid_devices: req.raid_devices, max: 256 });
    }
    let members = req.member_sizes_sectors.len();
    if members < req.raid_devices as usize {
        return Err(CreateError::NotEnoughMembers { members, raid_devices: req.raid_devices });
    }
    if members > MAX_DEVICES as usize {
        return Err(CreateError::TooManyDevices { count: members });
    }
    if level == Level::Raid0 && members > req.raid_devices as usize {
        return Err(CreateError::SparesNotSupported { level: lname });
    }
    if !req.device_uuids.is_empty() && req.device_uuids.len() != members {
        return Err(CreateError::DeviceUuidCount { count: req.device_uuids.len(), members });
    }
    if level == Level::Raid0 && req.bitmap != BitmapRequest::None {
        return Err(CreateError::BitmapNotAllowed { level: lname });
    }
    if req.bitmap_write_behind > 0 {
        if level != Level::Raid1 {
            return Err(CreateError::WriteBehindNotRaid1 { level: lname });
        }
        if req.bitmap == BitmapRequest::None {
            return Err(CreateError::WriteBehindWithoutBitmap);
        }
        if req.bitmap_write_behind > bitmap::COUNTER_MAX {
            return Err(CreateError::WriteBehindTooLarge { write_behind: req.bitmap_write_behind });
        }
    }
    if level == Level::Raid0 && req.size_kib.is_some() {
        return Err(CreateError::SizeNotAllowed { level: lname });
    }
    let chunk_kib = match (level.uses_chunks(), req.chunk_kib) {
        (false, Some(_)) => return Err(CreateError::ChunkNotAllowed { level: lname }),
        (false, None) => 0,
        (true, None) => DEFAULT_CHUNK_KIB,
        (true, Some(c)) if c < 4 || !c.is_power_of_two() => return Err(CreateError::BadChunk { chunk_kib: c }),
        (true, Some(c)) => c,
    };
    let layout = req.layout.unwrap_or_else(|| default_layout(level));
    let chunk_sectors = chunk_kib * 2;
    match level {
        Level::Raid10 => {
            let copies = (layout & 0xff) * ((layout >> 8) & 0xff);
            if copies > req.raid_devices {
                return Err(CreateError::LayoutNeedsDevices { layout, copies, raid_devices: req.raid_devices });
            }
            Raid10Geometry::new(req.raid_devices, layout, chunk_sectors, 0)?;
        }
        Level::Raid4 | Level::Raid5 | Level::Raid6 => {
            ParityGeometry::new(level, req.raid_devices, layout, chunk_sectors)?;
        }
        Level::Raid0 => {
            if layout != 0 && Raid0Layout::from_md(layout).is_none() {
                return Err(
                    LayoutError::Invalid { level: lname, reason: format!("unknown raid0 layout {layout}") }.into()
                );
            }
        }
        Level::Raid1 => {}
    }
    Ok(Shape { layout, chunk_kib })
}

/// Plans the array: every member's superblock and the shared bitmap area.
pub fn plan(req: &CreateRequest) -> Result<CreatePlan, CreateError> {
    let shape = check_shape(req)?;
    let level = req.level;
    let chunk_kib = shape.chunk_kib;
    let chunk_sectors = chunk_kib * 2;
    let v = req.metadata;

    // 2. data offset (first member decides, as mdadm's st->data_offset).
    let data_offset = match (v, req.data_offset_sectors) {
        (_, Some(o)) => o,
        (MetadataVersion::V1_0, None) => 0,
        (_, None) => mdadm_default_data_offset(req.member_sizes_sectors[0], chunk_kib),
    };

    // 3. free space per member (KiB, chunk-rounded) and the common size.
    let mut min_free_kib = u64::MAX;
    for (member, dev) in req.member_sizes_sectors.iter().copied().enumerate() {
        let free_sectors = match v {
            MetadataVersion::V1_0 => {
                let overhead = 8 * 2 + 8 + bitmap::choose_bm_space(dev);
                (dev & !7).checked_sub(overhead)
            }
            _ => dev.checked_sub(data_offset),
        };
        let too_small =
            || CreateError::MemberTooSmall { member, size_sectors: dev, needed_sectors: data_offset.max(24) };
        let mut free_kib = free_sectors.ok_or_else(too_small)? / 2;
        if chunk_kib > 0 {
            free_kib &= !(u64::from(chunk_kib) - 1);
        }
        if free_kib == 0 || dev < 24 {
            return Err(too_small());
        }
        if let Some(size) = req.size_kib
            && free_kib < size
        {
            return Err(CreateError::MemberSmallerThanSize { member, available_kib: free_kib, requested_kib: size });
        }
        min_free_kib = min_free_kib.min(free_kib);
    }
    let size_kib = match (level, req.size_kib) {
        (Level::Raid0, _) => 0,
        (_, Some(s)) => {
            let rounded = if chunk_kib > 0 { s & !(u64::from(chunk_kib) - 1) } else { s };
            if rounded == 0 {
                return Err(CreateError::SizeBelowChunk { size_kib: s });
            }
            rounded
        }
        (Level::Raid1, None) => min_free_kib & !63,
        (_, None) => min_free_kib,
    };
    let size_sectors = size_kib * 2;

    // Roles: mdadm's raid4/5 recovery trick moves the last active member to the end as a spare.
    let members = req.member_sizes_sectors.len();
    let recover_last = req.sync == InitialSync::MdadmDefault && matches!(level, Level::Raid4 | Level::Raid5);
    let clean = level == Level::Raid0 || req.sync == InitialSync::AssumeClean || recover_last;
    let active = if recover_last { req.raid_devices - 1 } else { req.raid_devices };
    let spares = members as u32 - active;
    // (member index in the request, dev_number, role)
    let mut assignment: Vec<(usize, u32, u16)> = Vec::with_capacity(members);
    for m in 0..members {
        let is_moved = recover_last && m == req.raid_devices as usize - 1;
        let dev_number = if is_moved { members as u32 } else { m as u32 };
        let role = if (m as u32) < req.raid_devices && !is_moved { m as u16 } else { ROLE_SPARE };
        assignment.push((m, dev_number, role));
    }
    let sb_bytes = (SB_FIXED_BYTES as u64 + 2 * u64::from(req.raid_devices + spares)).div_ceil(512) * 512;
    let mut max_dev = ((sb_bytes - SB_FIXED_BYTES as u64) / 2) as u32;
    for (_, dev_number, _) in &assignment {
        if *dev_number >= max_dev && max_dev < MAX_DEVICES {
            max_dev = dev_number + 1;
        }
    }
    let max_dev = max_dev.min(MAX_DEVICES);
    let mut dev_roles = vec![ROLE_SPARE; max_dev as usize];
    for (_, dev_number, role) in &assignment {
        if let Some(r) = dev_roles.get_mut(*dev_number as usize) {
            *r = *role;
        }
    }

    // 4. bitmap.
    let (bitmap_super, bitmap_offset) = match req.bitmap {
        BitmapRequest::None => (None, None),
        BitmapRequest::Internal { chunk_bytes } => {
            let sync_size =
                bitmap::mdadm_create_sync_size_sectors(level.md_level(), size_sectors, req.raid_devices, shape.layout);
            let room = bitmap::choose_bm_space(size_sectors);
            let chunk = bitmap::mdadm_chunk_bytes(room, sync_size, chunk_bytes)?;
            let offset: i32 = match v {
                MetadataVersion::V1_0 => {
                    let bits = u128::from(sync_size) * 512 / u128::from(chunk) + 1;
                    let bytes = bits.div_ceil(8) + 256;
                    let room = (bytes.div_ceil(4096) * 8) as i64;
                    (-room - 8) as i32
                }
                _ => 8,
            };
            let mut bms = BitmapSuper::new(req.array_uuid, chunk, sync_size);
            bms.daemon_sleep_secs = req.bitmap_daemon_sleep_secs;
            bms.write_behind = req.bitmap_write_behind;
            (Some(bms), Some(offset))
        }
    };
    let bitmap_area = bitmap_super.as_ref().map(BitmapSuper::initial_area).transpose()?;

    // 6. raid0 layout feature: mdadm compares whole-device chunk counts; we also apply the
    // kernel's zone test on data_size so an array mdkit plans is never refused as multi-zone
    // without a layout.
    let mut raid0_need_layout = false;
    if level == Level::Raid0 && shape.layout != 0 && chunk_sectors > 0 {
        let c = u64::from(chunk_sectors);
        let sub = req.data_offset_sectors.unwrap_or(0);
        let first = req.member_sizes_sectors[0].saturating_sub(sub) / c;
        raid0_need_layout = req.member_sizes_sectors.iter().any(|d| d.saturating_sub(sub) / c != first);
    }

    let mut base = Superblock::empty();
    base.set_uuid = req.array_uuid;
    base.set_name = compose_set_name(req.homehost.as_deref(), &req.name);
    base.ctime = md_time(req.ctime_seconds, 0);
    base.utime = base.ctime;
    base.level = level.md_level();
    base.layout = shape.layout;
    base.size_sectors = size_sectors;
    base.chunk_sectors = chunk_sectors;
    base.raid_disks = req.raid_devices;
    base.data_offset_sectors = data_offset;
    base.events = 0;
    base.resync_offset_sectors = if clean { MAX_SECTOR } else { 0 };
    base.dev_roles = dev_roles;
    if let Some(off) = bitmap_offset {
        base.feature_map |= feature::BITMAP_OFFSET;
        base.bitmap_offset_raw = off as u32;
    }

    let mut planned = Vec::with_capacity(members);
    for (member, dev_number, _) in &assignment {
        let dev = req.member_sizes_sectors[*member];
        let mut sb = base.clone();
        sb.dev_number = *dev_number;
        sb.device_uuid =
            req.device_uuids.get(*member).copied().unwrap_or_else(|| derived_device_uuid(&req.array_uuid, *member));
        place_member(&mut sb, v, dev, bitmap_super.as_ref(), bitmap_offset)?;
        planned.push(sb);
    }

    if level == Level::Raid0 {
        let data: Vec<u64> = planned.iter().map(|sb| sb.data_size_sectors).collect();
        let single_zone = Raid0Geometry::new(&data, chunk_sectors, None).is_ok();
        if raid0_need_layout || !single_zone {
            for sb in &mut planned {
                sb.feature_map |= feature::RAID0_LAYOUT;
            }
        }
    }

    let array_sectors = match level {
        Level::Raid0 => {
            let data: Vec<u64> = planned.iter().map(|sb| sb.data_size_sectors).collect();
            let lay = Raid0Layout::from_md(shape.layout);
            Raid0Geometry::new(&data, chunk_sectors, lay)?.array_sectors()
        }
        _ => layout::array_sectors(level, req.raid_devices, shape.layout, chunk_sectors, size_sectors).unwrap_or(0),
    };

    let mut out_members = Vec::with_capacity(members);
    for (i, mut sb) in planned.into_iter().enumerate() {
        let member = assignment[i].0;
        let block = sb.encode().map_err(|source| CreateError::Superblock { member, source })?;
        sb.sb_csum = super::le_u32(&block, superblock::off::SB_CSUM);
        sb.check_fits_device(req.member_sizes_sectors[member])
            .map_err(|source| CreateError::Superblock { member, source })?;
        let bitmap_offset_bytes = sb.bitmap_sector().map(|s| s * SECTOR_BYTES);
        out_members.push(MemberPlan {
            superblock_offset_bytes: sb.super_offset_sectors * SECTOR_BYTES,
            superblock_block: block.to_vec(),
            bitmap_offset_bytes,
            superblock: sb,
        });
    }

    Ok(CreatePlan {
        metadata: v,
        level,
        raid_disks: req.raid_devices,
        layout: shape.layout,
        chunk_sectors,
        member_size_sectors: size_sectors,
        data_offset_sectors: data_offset,
        array_sectors,
        bitmap: bitmap_super,
        bitmap_area,
        members: out_members,
    })
}

/// write_init_super1's per-member placement: superblock offset, data size, bad-block log.
fn place_member(
    sb: &mut Superblock,
    v: MetadataVersion,
    dev: u64,
    bms: Option<&BitmapSuper>,
    bitmap_offset: Option<i32>,
) -> Result<(), CreateError> {
    let (mut bm_space, bm_offset): (u64, i64) = match (bms, bitmap_offset) {
        (Some(b), Some(off)) => (b.geometry()?.area_sectors(), i64::from(off)),
        _ => (bitmap::choose_bm_space(sb.size_sectors), 8),
    };
    let sb_offset = v.sb_offset_sectors(dev).ok_or(CreateError::MemberTooSmall {
        member: sb.dev_number as usize,
        size_sectors: dev,
        needed_sectors: 24,
    })?;
    sb.super_offset_sectors = sb_offset;
    let data_offset = sb.data_offset_sectors;
    match v {
        MetadataVersion::V1_0 => {
            bm_space += 8;
            if sb_offset < sb.size_sectors + bm_space {
                bm_space = sb_offset.saturating_sub(sb.size_sectors);
            }
            sb.data_size_sectors = sb_offset - bm_space;
            if bm_space >= 8 {
                sb.bblog_size_sectors = 8;
                sb.bblog_offset_sectors = -8;
            }
        }
        MetadataVersion::V1_1 | MetadataVersion::V1_2 => {
            sb.data_size_sectors = dev - data_offset;
            let after_bitmap = i128::from(sb_offset) + i128::from(bm_offset) + i128::from(bm_space) + 8;
            if i128::from(data_offset) >= after_bitmap {
                sb.bblog_size_sectors = 8;
                sb.bblog_offset_sectors = (bm_offset + bm_space as i64) as i32;
            } else if data_offset >= sb_offset + 16 {
                sb.bblog_size_sectors = 8;
                sb.bblog_offset_sectors = (data_offset - 8 - sb_offset) as i32;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 2048;

    #[test]
    fn lab_raid1_matches_mdadm() {
        // mdadm 4.2 on 2 x 256 MiB: data offset 2048, avail 522240, size 522240, bitmap 64 MiB
        // chunk at +8, bblog 8 sectors at +16 (see /work/shared/lab md-raid.sh output).
        let mut req = CreateRequest::new(Level::Raid1, vec![256 * MIB; 2], [1; 16], 1_700_000_000);
        req.bitmap = BitmapRequest::Internal { chunk_bytes: None };
        req.sync = InitialSync::AssumeClean;
        let p = plan(&req).unwrap();
        let sb = &p.members[0].superblock;
        assert_eq!(sb.data_offset_sectors, 2048);
        assert_eq!(sb.data_size_sectors, 522_240);
        assert_eq!(sb.size_sectors, 522_240);
        assert_eq!(sb.chunk_sectors, 0);
        assert_eq!(sb.bitmap_offset_sectors(), Some(8));
        assert_eq!((sb.bblog_offset_sectors, sb.bblog_size_sectors), (16, 8));
        assert_eq!(sb.max_dev(), 128);
        assert_eq!(sb.resync_offset_sectors, MAX_SECTOR);
        let bms = p.bitmap.as_ref().unwrap();
        assert_eq!((bms.chunk_bytes, bms.sync_size_sectors), (64 << 20, 522_240));
        assert_eq!(p.array_sectors, 522_240);
        assert_eq!(p.member_writes(0).len(), 2);
        assert_eq!(p.member_writes(0)[1].0, 8192);
    }

    #[test]
    fn lab_raid5_matches_mdadm() {
        // mdadm 4.2 on 4 x 256 MiB raid5: data offset 4096, size 520192, array 780288 KiB.
        let mut req = CreateRequest::new(Level::Raid5, vec![256 * MIB; 4], [2; 16], 1_700_000_000);
        req.bitmap = BitmapRequest::Internal { chunk_bytes: None };
        req.sync = InitialSync::AssumeClean;
        let p = plan(&req).unwrap();
        let sb = &p.members[3].superblock;
        assert_eq!((sb.data_offset_sectors, sb.data_size_sectors, sb.size_sectors), (4096, 520_192, 520_192));
        assert_eq!((sb.layout, sb.chunk_sectors), (2, 1024));
        assert_eq!(p.array_sectors, 780_288 * 2);
        assert_eq!(sb.raw_role(), 3);
    }

    #[test]
    fn raid5_default_recovers_last_member() {
        let req = CreateRequest::new(Level::Raid5, vec![256 * MIB; 4], [2; 16], 1_700_000_000);
        let p = plan(&req).unwrap();
        let last = &p.members[3].superblock;
        assert_eq!(last.dev_number, 4);
        assert_eq!(last.raw_role(), ROLE_SPARE);
        assert_eq!(last.dev_roles[..5], [0, 1, 2, ROLE_SPARE, ROLE_SPARE]);
        assert!(last.is_clean());
        let req = CreateRequest::new(Level::Raid6, vec![256 * MIB; 4], [2; 16], 1_700_000_000);
        let p = plan(&req).unwrap();
        assert_eq!(p.members[0].superblock.resync_offset_sectors, 0);
    }

    #[test]
    fn headroom_rule() {
        // >= 200 GiB: 24 + 256 + 262144 rounded up to 1 MiB = 264192 (formats.md 1.6).
        assert_eq!(mdadm_default_data_offset(400 * 1024 * MIB, 512), 264_192);
        assert_eq!(mdadm_default_data_offset(256 * MIB, 0), 2048);
        assert_eq!(mdadm_default_data_offset(256 * MIB, 512), 4096);
    }

    #[test]
    fn raid0_multi_zone_gets_layout_feature() {
        let req = CreateRequest::new(Level::Raid0, vec![256 * MIB, 256 * MIB, 300 * MIB], [3; 16], 1);
        let p = plan(&req).unwrap();
        assert!(p.members.iter().all(|m| m.superblock.feature_map & feature::RAID0_LAYOUT != 0));
        assert_eq!(p.members[0].superblock.size_sectors, 0);
        let req = CreateRequest::new(Level::Raid0, vec![256 * MIB; 3], [3; 16], 1);
        let p = plan(&req).unwrap();
        assert!(p.members.iter().all(|m| m.superblock.feature_map & feature::RAID0_LAYOUT == 0));
        assert_eq!(p.members[0].superblock.layout, 1);
    }

    #[test]
    fn refusals() {
        let base = CreateRequest::new(Level::Raid6, vec![256 * MIB; 3], [1; 16], 1);
        assert!(matches!(plan(&base), Err(CreateError::TooFewDevices { .. })));
        let mut r = CreateRequest::new(Level::Raid5, vec![256 * MIB; 3], [1; 16], 1);
        r.chunk_kib = Some(12);
        assert!(matches!(plan(&r), Err(CreateError::BadChunk { .. })));
        r.chunk_kib = Some(2);
        assert!(matches!(plan(&r), Err(CreateError::BadChunk { .. })));
        let mut r = CreateRequest::new(Level::Raid1, vec![256 * MIB; 2], [1; 16], 1);
        r.chunk_kib = Some(64);
        assert!(matches!(plan(&r), Err(CreateError::ChunkNotAllowed { .. })));
        let mut r = CreateRequest::new(Level::Raid0, vec![256 * MIB; 2], [1; 16], 1);
        r.bitmap = BitmapRequest::Internal { chunk_bytes: None };
        assert!(matches!(plan(&r), Err(CreateError::BitmapNotAllowed { .. })));
        let r = CreateRequest::new(Level::Raid5, vec![256 * MIB, 256 * MIB, 1000], [1; 16], 1);
        assert!(matches!(plan(&r), Err(CreateError::MemberTooSmall { member: 2, .. })));
        let mut r = CreateRequest::new(Level::Raid10, vec![256 * MIB; 2], [1; 16], 1);
        r.layout = Some(0x103);
        assert!(matches!(plan(&r), Err(CreateError::LayoutNeedsDevices { .. })));
        let mut r = CreateRequest::new(Level::Raid5, vec![256 * MIB; 3], [1; 16], 1);
        r.layout = Some(9);
        assert!(matches!(plan(&r), Err(CreateError::Layout(_))));
        let mut r = CreateRequest::new(Level::Raid5, vec![256 * MIB; 3], [1; 16], 1);
        r.size_kib = Some(300 * 1024);
        assert!(matches!(plan(&r), Err(CreateError::MemberSmallerThanSize { .. })));
    }

    #[test]
    fn metadata_1_0_puts_everything_at_the_end() {
        let mut req = CreateRequest::new(Level::Raid1, vec![256 * MIB; 2], [5; 16], 1);
        req.metadata = MetadataVersion::V1_0;
        req.bitmap = BitmapRequest::Internal { chunk_bytes: None };
        let p = plan(&req).unwrap();
        let sb = &p.members[0].superblock;
        assert_eq!(sb.super_offset_sectors, 256 * MIB - 16);
        assert_eq!(sb.data_offset_sectors, 0);
        assert_eq!(sb.bitmap_offset_sectors(), Some(-16));
        assert_eq!((sb.bblog_offset_sectors, sb.bblog_size_sectors), (-8, 8));
        assert!(sb.data_size_sectors + 16 <= sb.super_offset_sectors);
        let bm = p.members[0].bitmap_offset_bytes.unwrap();
        assert_eq!(bm, (256 * MIB - 32) * 512);
    }
}
