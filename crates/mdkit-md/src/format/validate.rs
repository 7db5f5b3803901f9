//! Field limits checked before anything is sized or placed from a superblock: the kernel's own
//! limits (super_1_load, the personalities' run checks, md_bitmap_read_sb) and the placement
//! rules that keep the superblock, the bitmap, the bad-block log and the data area apart.
//!
//! ```text
//!  field             rule                                              kernel / mdadm source
//!  dev_number        < max_dev (its role must exist in dev_roles[])    super_1_validate
//!  level             -4, -1, 0, 1, 4, 5, 6 or 10                       md.c level lookup
//!  raid_disks        level minimum ..= max_dev (<= 1920)               *_run, super_1_sync
//!  chunksize         power of two >= 8 sectors (raid0/4/5/6/10)        raid0/raid5/raid10 run
//!  layout            an algorithm the level knows                      raid5/raid10 setup_conf
//!  size              <= data_size; the array holds at least a sector   md_run / *_size
//!  recovery_offset   <= data_size when RECOVERY_OFFSET is set          super_1_validate
//!  bitmap_offset     != 0, outside the superblock and the data area    md_bitmap_read_sb
//!  bblog_*           size <= 8 sectors, offset != 0, outside sb / data super_1_load
//!  reshape fields    see format/reshape.rs (RESHAPE_ACTIVE only)        super_1_load, raid5_run
//! ```
//! Every refusal names the field, its value and the reason ([`SuperblockError::Field`]).

use super::superblock::{MAX_DEV_ROLES, MetadataVersion, SB_BLOCK_BYTES, Superblock, SuperblockError, feature};
use crate::layout::{self, Level, Raid10Geometry};

/// Levels the kernel knows (linear -1 and multipath -4 included: they are valid superblocks
/// even though mdkit does not run them).
const KNOWN_LEVELS: [i32; 8] = [-4, -1, 0, 1, 4, 5, 6, 10];
/// Smallest chunk of a striped level (sectors): one 4 KiB page.
pub const MIN_CHUNK_SECTORS: u32 = 8;
/// Largest bad-block log the kernel reads (sectors): one 4 KiB page.
pub const MAX_BBLOG_SECTORS: u16 = 8;

fn field(field: &'static str, value: impl std::fmt::Display, reason: impl Into<String>) -> SuperblockError {
    SuperblockError::Field { field, value: value.to_string(), reason: reason.into() }
}

/// Every field-limit problem of `sb` that does not need the device size (see the module table).
pub fn field_problems(sb: &Superblock) -> Vec<SuperblockError> {
    let mut p = Vec::new();
    if sb.dev_number >= sb.max_dev() {
        p.push(field("dev_number", sb.dev_number, format!("not below max_dev {}", sb.max_dev())));
    }
    p.extend(geometry_problems(sb));
    p.extend(size_problems(sb));
    p.extend(bitmap_offset_problems(sb));
    p.extend(bblog_problems(sb));
    if p.is_empty()
        && let Err(e) = super::reshape::ReshapeState::from_superblock(sb)
    {
        p.push(e);
    }
    p
}

fn geometry_problems(sb: &Superblock) -> Vec<SuperblockError> {
    if !KNOWN_LEVELS.contains(&sb.level) {
        return vec![field("level", sb.level, "not an md level")];
    }
    let mut p = Vec::new();
    let max_disks = sb.max_dev().min(MAX_DEV_ROLES);
    let level = Level::from_md_level(sb.level);
    let min_disks = level.map_or(1, Level::min_raid_disks);
    if sb.raid_disks < min_disks || sb.raid_disks > max_disks {
        p.push(field("raid_disks", sb.raid_disks, format!("must be {min_disks}..={max_disks} for level {}", sb.level)));
        return p;
    }
    let Some(level) = level else { return p };
    if level.uses_chunks() && (sb.chunk_sectors < MIN_CHUNK_SECTORS || !sb.chunk_sectors.is_power_of_two()) {
        p.push(field("chunksize", sb.chunk_sectors, "sectors: must be a power of two of at least 4 KiB"));
        return p;
    }
    if let Some(reason) = layout_problem(sb, level) {
        p.push(field("layout", format!("{:#x}", sb.layout), reason));
    }
    p
}

fn layout_problem(sb: &Superblock, level: Level) -> Option<String> {
    match level {
        Level::Raid0 if sb.feature_map & feature::RAID0_LAYOUT != 0 => {
            layout::Raid0Layout::from_md(sb.layout).is_none().then(|| "not a raid0 layout (1 or 2)".to_string())
        }
        Level::Raid0 | Level::Raid1 => None,
        Level::Raid10 => {
            Raid10Geometry::new(sb.raid_disks, sb.layout, sb.chunk_sectors, 0).err().map(|e| e.to_string())
        }
        Level::Raid4 | Level::Raid5 | Level::Raid6 => {
            layout::ParityGeometry::new(level, sb.raid_disks, sb.layout, sb.chunk_sectors).err().map(|e| e.to_string())
        }
    }
}

fn size_problems(sb: &Superblock) -> Vec<SuperblockError> {
    let mut p = Vec::new();
    let redundant = matches!(sb.level, 1 | 4 | 5 | 6 | 10);
    if redundant && sb.size_sectors > sb.data_size_sectors {
        p.push(field("size", sb.size_sectors, format!("sectors: larger than data_size {}", sb.data_size_sectors)));
    } else if let Some(level) = Level::from_md_level(sb.level).filter(|_| redundant) {
        let array = layout::array_sectors(level, sb.raid_disks, sb.layout, sb.chunk_sectors, sb.size_sectors);
        if array.unwrap_or(0) == 0 {
            p.push(field("size", sb.size_sectors, "sectors: the array would hold no data"));
        }
    }
    if sb.feature_map & feature::RECOVERY_OFFSET != 0
        && sb.recovery_offset_sectors > sb.data_size_sectors
        && sb.raw_role() != super::superblock::ROLE_JOURNAL
    {
        p.push(field(
            "recovery_offset",
            sb.recovery_offset_sectors,
            format!("sectors: beyond data_size {}", sb.data_size_sectors),
        ));
    }
    p
}

/// `[start, end)` in device sectors of the superblock (the whole 4 KiB block mdkit reads and
/// writes) and the data area.
fn reserved_ranges(sb: &Superblock) -> [(&'static str, u64, u64); 2] {
    let sb_end = sb.super_offset_sectors.saturating_add(SB_BLOCK_BYTES as u64 / 512);
    let data_end = sb.data_offset_sectors.saturating_add(sb.data_size_sectors);
    [("the superblock", sb.super_offset_sectors, sb_end), ("the data area", sb.data_offset_sectors, data_end)]
}

/// Why a structure of `len_sectors` at `offset_sectors` from the superblock cannot be there.
fn placement_problem(sb: &Superblock, offset_sectors: i64, len_sectors: u64) -> Option<String> {
    let Some(start) = sb.super_offset_sectors.checked_add_signed(offset_sectors) else {
        return Some("points before the start of the device".into());
    };
    let end = start.saturating_add(len_sectors.max(1));
    reserved_ranges(sb)
        .into_iter()
        .find(|(_, lo, hi)| start < *hi && *lo < end)
        .map(|(what, lo, hi)| format!("sectors {start}..{end} overlap {what} (sectors {lo}..{hi})"))
}

fn bitmap_offset_problems(sb: &Superblock) -> Vec<SuperblockError> {
    let Some(offset) = sb.bitmap_offset_sectors() else { return Vec::new() };
    if offset == 0 {
        return vec![field("bitmap_offset", offset, "BITMAP_OFFSET is set but the offset is 0")];
    }
    // The bitmap superblock itself (one sector); its bits are checked with the bitmap header.
    match placement_problem(sb, i64::from(offset), 1) {
        Some(why) => vec![field("bitmap_offset", offset, why)],
        None => Vec::new(),
    }
}

fn bblog_problems(sb: &Superblock) -> Vec<SuperblockError> {
    let mut p = Vec::new();
    let has_bad_blocks = sb.feature_map & feature::BAD_BLOCKS != 0;
    if has_bad_blocks && sb.bblog_size_sectors == 0 {
        p.push(field("bblog_size", 0, "BAD_BLOCKS is set but no log is reserved"));
    }
    if sb.bblog_size_sectors == 0 || sb.bblog_offset_sectors == 0 {
        return p; // no log: nothing is read or written there
    }
    if sb.bblog_size_sectors > MAX_BBLOG_SECTORS && !has_bad_blocks {
        // (with BAD_BLOCKS the kernel's own check already reports it)
        p.push(field("bblog_size", sb.bblog_size_sectors, "sectors: more than one 4 KiB page"));
    }
    let len = u64::from(sb.bblog_size_sectors);
    if let Some(why) = placement_problem(sb, i64::from(sb.bblog_offset_sectors), len) {
        p.push(field("bblog_offset", sb.bblog_offset_sectors, why));
    }
    p
}

/// Checks that need the member's size: the data area, the bitmap superblock and the bad-block
/// log all lie on the device (1.0: the data ends before the superblock).
pub fn device_problems(sb: &Superblock, device_sectors: u64) -> Vec<SuperblockError> {
    let mut p = Vec::new();
    let data_end = sb.data_offset_sectors.checked_add(sb.data_size_sectors);
    let limit = match sb.metadata_version() {
        MetadataVersion::V1_0 => sb.super_offset_sectors,
        _ => device_sectors,
    };
    if data_end.is_none_or(|end| end > limit) {
        p.push(SuperblockError::DataBeyondDevice {
            data_size_sectors: sb.data_size_sectors,
            available_sectors: limit.saturating_sub(sb.data_offset_sectors),
        });
    }
    let mut on_device = |name: &'static str, offset: i64, len: u64| {
        let start = sb.super_offset_sectors.checked_add_signed(offset);
        if start.and_then(|s| s.checked_add(len)).is_none_or(|end| end > device_sectors) {
            p.push(field(name, offset, format!("the area lies beyond the end of the {device_sectors}-sector device")));
        }
    };
    if let Some(offset) = sb.bitmap_offset_sectors().filter(|o| *o != 0) {
        on_device("bitmap_offset", i64::from(offset), 1);
    }
    if sb.bblog_size_sectors != 0 && sb.bblog_offset_sectors != 0 {
        on_device("bblog_offset", i64::from(sb.bblog_offset_sectors), u64::from(sb.bblog_size_sectors));
    }
    p
}

/// Bytes the internal bitmap of `sb` may occupy: from its start to the nearest of the data
/// area, the bad-block log, the superblock and the end of the device that lies after it
/// (`None` when there is no bitmap or it starts outside the device).
pub fn bitmap_space_bytes(sb: &Superblock, device_sectors: u64) -> Option<u64> {
    let start = sb.bitmap_sector().filter(|s| *s < device_sectors)?;
    let after = |s: u64| (s > start).then_some(s);
    let limit = [Some(sb.data_offset_sectors), Some(sb.super_offset_sectors), sb.bblog_sector()]
        .into_iter()
        .flatten()
        .filter_map(after)
        .fold(device_sectors, u64::min);
    Some((limit - start) * 512)
}

/// The bitmap's sync domain for this superblock's geometry (kernel `resync_max_sectors`): the
/// per-member size for raid1/4/5/6, the array size for raid10; `None` for levels without one.
pub fn bitmap_sync_domain_sectors(sb: &Superblock) -> Option<u64> {
    bitmap_sync_domain_for_size(sb, sb.size_sectors)
}

/// The sync domain `sb`'s array would have with `size_sectors` used per member.
pub fn bitmap_sync_domain_for_size(sb: &Superblock, size_sectors: u64) -> Option<u64> {
    match Level::from_md_level(sb.level)? {
        Level::Raid0 => None,
        Level::Raid10 => layout::array_sectors(Level::Raid10, sb.raid_disks, sb.layout, sb.chunk_sectors, size_sectors),
        _ => Some(size_sectors),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::create::{BitmapRequest, CreateRequest, InitialSync, plan};

    fn raid5() -> Superblock {
        let mut req = CreateRequest::new(Level::Raid5, vec![64 * 2048; 4], [0x42; 16], 1_790_000_000);
        req.bitmap = BitmapRequest::Internal { chunk_bytes: None };
        req.sync = InitialSync::AssumeClean;
        plan(&req).unwrap().members[1].superblock.clone()
    }

    fn problem(sb: &Superblock) -> String {
        let p = field_problems(sb);
        assert!(!p.is_empty(), "no problem found in {sb:?}");
        p[0].to_string()
    }

    #[test]
    fn valid_superblock_has_no_problem() {
        let sb = raid5();
        assert_eq!(field_problems(&sb), vec![]);
        assert_eq!(device_problems(&sb, 64 * 2048), vec![]);
    }

    #[test]
    fn each_limit_names_its_field() {
        type Edit = fn(&mut Superblock);
        let cases: Vec<(&str, Edit)> = vec![
            ("dev_number", |s| s.dev_number = 5000),
            ("dev_number", |s| s.dev_number = u32::MAX),
            ("raid_disks", |s| s.raid_disks = 0x7fff_ffff),
            ("raid_disks", |s| s.raid_disks = 1),
            ("level", |s| s.level = 7),
            ("chunksize", |s| s.chunk_sectors = 3),
            ("chunksize", |s| s.chunk_sectors = 0),
            ("layout", |s| s.layout = 77),
            ("size", |s| s.size_sectors = u64::MAX),
            ("size", |s| s.size_sectors = 0),
            ("bitmap_offset", |s| s.bitmap_offset_raw = 0),
            ("bitmap_offset", |s| s.bitmap_offset_raw = 1),
            ("bitmap_offset", |s| s.bitmap_offset_raw = (-100i32) as u32),
            ("bblog_offset", |s| s.bblog_offset_sectors = -4),
            ("bblog_size", |s| s.bblog_size_sectors = 9),
        ];
        for (name, edit) in cases {
            let mut sb = raid5();
            edit(&mut sb);
            let text = problem(&sb);
            assert!(text.contains(name), "{name}: {text}");
        }
        let mut sb = raid5();
        sb.bblog_offset_sectors = 0x1000_0000;
        assert!(device_problems(&sb, 64 * 2048).iter().any(|e| e.to_string().contains("bblog_offset")));
        let mut sb = raid5();
        sb.data_size_sectors = u64::MAX - 5;
        assert!(matches!(device_problems(&sb, 64 * 2048)[0], SuperblockError::DataBeyondDevice { .. }));
    }
}
