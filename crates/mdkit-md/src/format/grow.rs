//! Planning `mdadm --grow` changes that move no data, on the superblocks as md writes them:
//! the used size per member (`--size`), the internal bitmap (`--bitmap internal|none`) and the
//! number of raid1 mirrors (`--raid-devices`). Pure: superblocks (and the bitmap area) in,
//! superblocks (and the bitmap area) out; the runtime writes them (`array/grow.rs`).
//!
//! Kernel rules followed (md.c update_size / super_1_rdev_size_change, raid1.c raid1_resize /
//! raid1_reshape, raid5.c raid5_resize, raid10.c raid10_resize, md-bitmap.c md_bitmap_resize):
//! - `--size max`: each member's `data_size` becomes its device size minus `data_offset`
//!   (1.1/1.2), `size` the smallest of them (rounded down to the chunk for raid4/5/6/10; to
//!   4 KiB for raid1, the array's block); an explicit size must fit every member.
//! - The grown part is resynced: `resync_offset` drops to the old end of the sync domain
//!   unless `--assume-clean`, and the bitmap marks the new chunks dirty.
//! - The bitmap keeps its chunk while `256 + ceil(chunks / 8)` bytes fit the space it may use
//!   (`sectors_reserved`, else its current size in sectors); otherwise the chunk doubles until
//!   they do, each new bit set when any old bit it covers was.
//! - raid1 fewer mirrors: at most N members may hold a role (md: EBUSY otherwise); the holders
//!   are renumbered 0.. in slot order (raid1_reshape). More mirrors: the new roles are empty
//!   until a spare is recovered into them.

use super::bitmap::{self, BitmapGeometry, BitmapSuper};
use super::superblock::{MAX_SECTOR, MetadataVersion, ROLE_MAX, Superblock, feature};
use super::takeover::{self, LayoutChoice};
use crate::layout::{self, Level};

/// `--size`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GrowSize {
    /// Everything the members offer.
    Max,
    /// This many sectors per member.
    Sectors(u64),
}

/// `--bitmap`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BitmapChange {
    Internal { chunk_bytes: Option<u32> },
    None,
}

/// One change (mdadm changes one thing per `--grow`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GrowChange {
    Size {
        size: GrowSize,
        assume_clean: bool,
    },
    Bitmap(BitmapChange),
    RaidDevices(u32),
    /// `--level` (with `--layout`): a takeover, see [`super::takeover`].
    Level {
        level: Level,
        layout: LayoutChoice,
    },
    /// `--chunk` and/or `--layout` alone on raid4/5/6: a restripe over the same members
    /// (`array/reshape.rs`); `None` keeps the current value.
    Restripe {
        layout: Option<u32>,
        chunk_sectors: Option<u32>,
    },
}

/// A member as the plan sees it: its superblock and device size.
#[derive(Clone, Debug)]
pub struct PlanMember {
    pub name: String,
    pub sb: Superblock,
    pub device_sectors: u64,
}

/// The metadata to write. `superblocks[i]` is for `members[i]` (events unchanged: the writer
/// sets them); `bitmap` is the new bitmap area (superblock + bits) written at each member's
/// bitmap offset before its superblock.
#[derive(Clone, Debug)]
pub struct GrowPlan {
    pub superblocks: Vec<Superblock>,
    pub bitmap: Option<Vec<u8>>,
    /// What changes, for the log and the caller ("size 261120 -> 523264 sectors per member").
    pub summary: String,
}

/// Why a grow is refused; the message names the array and the reason.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct GrowRefused(pub String);

fn refuse<T>(msg: String) -> Result<T, GrowRefused> {
    Err(GrowRefused(msg))
}

/// Plans `change` for the members (every working member, spares included; the first one's
/// superblock gives the array fields). `bitmap_area` is the current bitmap area (superblock
/// and bits) when the array has one; `name` is for messages.
pub fn plan(
    name: &str,
    members: &[PlanMember],
    bitmap_area: Option<&[u8]>,
    change: GrowChange,
) -> Result<GrowPlan, GrowRefused> {
    let Some(refsb) = members.first().map(|m| &m.sb) else {
        return refuse(format!("{name}: no working member"));
    };
    let level = Level::from_md_level(refsb.level)
        .ok_or_else(|| GrowRefused(format!("{name}: level {} is not supported", refsb.level)))?;
    if refsb.feature_map & feature::RESHAPE_ACTIVE != 0 {
        return refuse(format!("{name}: a reshape is in progress; grow again once it has finished"));
    }
    match change {
        GrowChange::Size { size, assume_clean } => plan_size(name, level, members, bitmap_area, size, assume_clean),
        GrowChange::Bitmap(b) => plan_bitmap(name, level, members, b),
        GrowChange::RaidDevices(n) => plan_raid_devices(name, level, members, n),
        GrowChange::Level { level: to, layout } => plan_level(name, members, bitmap_area, to, layout),
        GrowChange::Restripe { .. } => {
            refuse(format!("{name}: --chunk / --layout restripe {} in the background, not here", level.name()))
        }
    }
}

fn plan_size(
    name: &str,
    level: Level,
    members: &[PlanMember],
    bitmap_area: Option<&[u8]>,
    size: GrowSize,
    assume_clean: bool,
) -> Result<GrowPlan, GrowRefused> {
    let refsb = &members[0].sb;
    match level {
        Level::Raid0 => return refuse(format!("{name}: grow --size on raid0 is not implemented yet")),
        Level::Raid10 if (refsb.layout >> 8) & 0xff > 1 && refsb.layout & (1 << 16) == 0 => {
            return refuse(format!("{name}: grow --size on a raid10 far layout is not possible (md refuses it too)"));
        }
        _ => {}
    }
    if refsb.metadata_version() == MetadataVersion::V1_0 {
        return refuse(format!(
            "{name}: grow --size on metadata 1.0 is not implemented yet (its superblock moves with the device end)"
        ));
    }
    let avail = |m: &PlanMember| m.device_sectors.saturating_sub(m.sb.data_offset_sectors);
    let round = |s: u64| match level {
        Level::Raid1 => s / 8 * 8,
        _ => s - s % u64::from(refsb.chunk_sectors.max(1)),
    };
    let old = refsb.size_sectors;
    let data_size = |m: &PlanMember| match size {
        GrowSize::Max => avail(m),
        GrowSize::Sectors(s) => s,
    };
    let new = match size {
        GrowSize::Max => round(members.iter().map(avail).min().unwrap_or(0)),
        GrowSize::Sectors(s) => {
            if let Some(m) = members.iter().find(|m| avail(m) < s) {
                return refuse(format!(
                    "{name}: member {} offers {} KiB of data space, --size asks for {} KiB",
                    m.name,
                    avail(m) / 2,
                    s / 2
                ));
            }
            round(s)
        }
    };
    if new < old {
        // Name what was asked for: the rounded value alone (3K -> 0 KiB) reads like a misparse.
        let asked = match size {
            GrowSize::Sectors(s) if round(s) != s => format!("{} KiB (rounded down to {} KiB)", s / 2, new / 2),
            _ => format!("{} KiB", new / 2),
        };
        return refuse(format!(
            "{name}: --size {asked} is below the {} KiB per member in use: shrinking would cut off data and is refused",
            old / 2
        ));
    }
    let sync_old = sync_domain(level, refsb, old);
    let sync_new = sync_domain(level, refsb, new);
    let mut sbs = Vec::with_capacity(members.len());
    for m in members {
        let mut sb = m.sb.clone();
        sb.size_sectors = new;
        sb.data_size_sectors = data_size(m).max(m.sb.data_size_sectors).min(avail(m));
        if !assume_clean && new > old {
            sb.resync_offset_sectors = sb.resync_offset_sectors.min(sync_old);
        }
        sbs.push(sb);
    }
    let bitmap = match (refsb.bitmap_offset_sectors(), bitmap_area) {
        (Some(_), Some(area)) => Some(resize_bitmap(name, area, sync_old, sync_new, !assume_clean)?),
        (Some(_), None) => return refuse(format!("{name}: the bitmap area was not read")),
        _ => None,
    };
    let summary = format!(
        "size {old} -> {new} sectors per member{}",
        if assume_clean || new == old { String::new() } else { format!(", resync from sector {sync_old}") }
    );
    Ok(GrowPlan { superblocks: sbs, bitmap, summary })
}

/// The bitmap's (and resync's) domain: per member for raid1/4/5/6, the array for raid10.
fn sync_domain(level: Level, sb: &Superblock, size_sectors: u64) -> u64 {
    let array = layout::array_sectors(level, sb.raid_disks, sb.layout, sb.chunk_sectors, size_sectors).unwrap_or(0);
    bitmap::kernel_sync_size_sectors(level.md_level(), size_sectors, array)
}

/// md_bitmap_resize with chunksize 0: the chunk doubles until the bits fit the bitmap's space;
/// bits carry over (OR of the old bits a new one covers), new chunks are dirty when `dirty_new`.
pub(crate) fn resize_bitmap(
    name: &str,
    area: &[u8],
    sync_old: u64,
    sync_new: u64,
    dirty_new: bool,
) -> Result<Vec<u8>, GrowRefused> {
    let bad = |e: bitmap::BitmapError| GrowRefused(format!("{name}: bitmap: {e}"));
    let mut bms = BitmapSuper::decode(area).map_err(bad)?;
    let old_geo = bms.geometry().map_err(bad)?;
    let space_bytes = if bms.sectors_reserved != 0 {
        u64::from(bms.sectors_reserved) * 512
    } else {
        old_geo.storage_bytes().div_ceil(512) * 512
    };
    let mut chunk = bms.chunk_bytes;
    let fits = |c: u32| BitmapGeometry { chunk_bytes: c, sync_size_sectors: sync_new }.storage_bytes() <= space_bytes;
    while !fits(chunk) {
        chunk = chunk.checked_mul(2).ok_or_else(|| GrowRefused(format!("{name}: bitmap: no chunk size fits")))?;
    }
    let new_geo = BitmapGeometry::new(chunk, sync_new).map_err(bad)?;
    let mut out = vec![0u8; new_geo.area_bytes().max(old_geo.area_bytes()) as usize];
    let ratio = u64::from(chunk / old_geo.chunk_bytes);
    for c in 0..old_geo.chunks() {
        if bitmap::test_bit(area, &old_geo, c).unwrap_or(true) {
            bitmap::set_bit(&mut out, &new_geo, c / ratio, true);
        }
    }
    if dirty_new && sync_new > sync_old {
        for c in new_geo.chunk_of_sector(sync_old)..new_geo.chunks() {
            bitmap::set_bit(&mut out, &new_geo, c, true);
        }
    }
    bms.chunk_bytes = chunk;
    bms.sync_size_sectors = sync_new;
    bms.sectors_reserved = (space_bytes / 512) as u32;
    bms.write_header(&mut out).map_err(bad)?;
    out.truncate(new_geo.area_bytes() as usize);
    Ok(out)
}

/// The bitmap area's first sector relative to the superblock and the sectors it may use.
fn bitmap_room(sb: &Superblock) -> Option<(i64, u64)> {
    let sb_at = sb.super_offset_sectors;
    match sb.metadata_version() {
        MetadataVersion::V1_0 => {
            let data_end = sb.data_offset_sectors + sb.data_size_sectors;
            let end = sb.bblog_sector().filter(|b| *b > data_end && *b < sb_at).unwrap_or(sb_at);
            let room = end.checked_sub(data_end)?;
            Some((-(i64::try_from(room).ok()?), room))
        }
        _ => Some((8, room_from(sb, sb_at + 8)?)),
    }
}

/// On 1.1/1.2 metadata: the sectors from `start` to whatever comes next, the data (at the
/// superblock's data offset) or the bad-block log.
pub(crate) fn room_from(sb: &Superblock, start: u64) -> Option<u64> {
    let end = [Some(sb.data_offset_sectors), sb.bblog_sector()].into_iter().flatten().filter(|s| *s >= start).min()?;
    Some(end - start)
}

fn plan_bitmap(name: &str, level: Level, members: &[PlanMember], b: BitmapChange) -> Result<GrowPlan, GrowRefused> {
    let refsb = &members[0].sb;
    let has = refsb.feature_map & feature::BITMAP_OFFSET != 0;
    let chunk_bytes = match b {
        BitmapChange::None if !has => return refuse(format!("{name}: there is no bitmap to remove")),
        BitmapChange::None => {
            let sbs = members
                .iter()
                .map(|m| {
                    let mut sb = m.sb.clone();
                    sb.feature_map &= !feature::BITMAP_OFFSET;
                    sb
                })
                .collect();
            return Ok(GrowPlan { superblocks: sbs, bitmap: None, summary: "internal bitmap removed".into() });
        }
        BitmapChange::Internal { .. } if has => {
            return refuse(format!(
                "{name}: already has an internal bitmap; remove it first with --bitmap none to change it"
            ));
        }
        BitmapChange::Internal { chunk_bytes } => chunk_bytes,
    };
    if level == Level::Raid0 {
        return refuse(format!("{name}: a write-intent bitmap is not meaningful for raid0 (no redundancy)"));
    }
    if refsb.feature_map & (feature::PPL | feature::MULTIPLE_PPLS) != 0 {
        return refuse(format!("{name}: the array has a partial parity log, which excludes a bitmap"));
    }
    let sync = sync_domain(level, refsb, refsb.size_sectors);
    let mut rooms = Vec::with_capacity(members.len());
    for m in members {
        match bitmap_room(&m.sb) {
            Some((off, room)) if room > 1 => rooms.push((off, room)),
            _ => return refuse(format!("{name}: member {} has no room for an internal bitmap", m.name)),
        }
    }
    let room = rooms.iter().map(|r| r.1).min().unwrap_or(0);
    let chunk = bitmap::mdadm_chunk_bytes(room, sync, chunk_bytes).map_err(|e| GrowRefused(format!("{name}: {e}")))?;
    let mut bms = BitmapSuper::new(refsb.set_uuid, chunk, sync);
    bms.events = refsb.events;
    bms.events_cleared = refsb.events;
    bms.sectors_reserved = room.min(u64::from(u32::MAX)) as u32;
    let area = bms.initial_area().map_err(|e| GrowRefused(format!("{name}: bitmap: {e}")))?;
    let area_sectors = area.len() as u64 / 512;
    let mut sbs = Vec::with_capacity(members.len());
    for (m, (off, room)) in members.iter().zip(rooms) {
        if area_sectors > room {
            return refuse(format!(
                "{name}: member {} has {room} sectors for a bitmap, {area_sectors} are needed",
                m.name
            ));
        }
        let mut sb = m.sb.clone();
        // 1.0: the bitmap ends where its room ends (before the bad-block log / superblock).
        let off = if off < 0 { off + (room - area_sectors) as i64 } else { off };
        sb.feature_map |= feature::BITMAP_OFFSET;
        sb.bitmap_offset_raw = off as i32 as u32;
        sbs.push(sb);
    }
    let summary = format!(
        "internal bitmap added: chunk {} KiB, {} chunks",
        chunk / 1024,
        bms.geometry().map_or(0, |g| g.chunks())
    );
    Ok(GrowPlan { superblocks: sbs, bitmap: Some(area), summary })
}

fn plan_raid_devices(name: &str, level: Level, members: &[PlanMember], n: u32) -> Result<GrowPlan, GrowRefused> {
    let refsb = &members[0].sb;
    if n == refsb.raid_disks {
        return refuse(format!("{name}: --raid-devices {n}: no change requested (mdadm's words)"));
    }
    if level != Level::Raid1 {
        return refuse(format!("{name}: grow --raid-devices on {} is not implemented yet", level.name()));
    }
    let old = refsb.raid_disks;
    if n == 0 || n > crate::format::create::MAX_DEVICES {
        return refuse(format!("{name}: --raid-devices {n} is out of range"));
    }
    if members.iter().any(|m| m.sb.feature_map & feature::REPLACEMENT != 0) {
        return refuse(format!("{name}: a replacement is in progress; grow once it has finished"));
    }
    let roles = &refsb.dev_roles;
    let holders: Vec<u16> = {
        let mut r: Vec<u16> = roles.iter().copied().filter(|r| *r < ROLE_MAX && u32::from(*r) < old).collect();
        r.sort_unstable();
        r
    };
    if n < old && holders.len() > n as usize {
        return refuse(format!(
            "{name}: cannot reduce raid-devices from {old} to {n}: {} members are active; fail and remove {} of them first (md refuses: Device or resource busy)",
            holders.len(),
            holders.len() - n as usize
        ));
    }
    // raid1_reshape: holders are renumbered 0.. in slot order.
    let remap = |r: u16| -> u16 {
        if r < ROLE_MAX && u32::from(r) < old && n < old {
            holders.iter().position(|h| *h == r).map_or(r, |i| i as u16)
        } else {
            r
        }
    };
    let new_roles: Vec<u16> = roles.iter().map(|r| remap(*r)).collect();
    let sbs = members
        .iter()
        .map(|m| {
            let mut sb = m.sb.clone();
            sb.raid_disks = n;
            sb.dev_roles = new_roles.clone();
            sb
        })
        .collect();
    Ok(GrowPlan { superblocks: sbs, bitmap: None, summary: format!("raid-devices {old} -> {n}") })
}

/// A takeover: every superblock gets the new level, layout, chunk, member count and roles. The
/// bitmap keeps its bits (its domain, the per-member size, does not change); it is written again
/// so that its events follow the superblocks'.
fn plan_level(
    name: &str,
    members: &[PlanMember],
    bitmap_area: Option<&[u8]>,
    to: Level,
    layout: LayoutChoice,
) -> Result<GrowPlan, GrowRefused> {
    let refsb = &members[0].sb;
    let holders: Vec<u64> = members
        .iter()
        .filter(|m| m.sb.raw_role() < ROLE_MAX && u32::from(m.sb.raw_role()) < refsb.raid_disks)
        .map(|m| m.sb.data_size_sectors)
        .collect();
    let t = takeover::plan(refsb, to, layout, &holders)
        .map_err(|e| GrowRefused(format!("{name}: cannot change the level: {e}")))?;
    let bitmap = match (refsb.bitmap_offset_sectors(), bitmap_area) {
        (Some(_), Some(area)) => Some(area.to_vec()),
        (Some(_), None) => return refuse(format!("{name}: the bitmap area was not read")),
        _ => None,
    };
    let sbs = members
        .iter()
        .map(|m| {
            let mut sb = m.sb.clone();
            takeover::apply(&mut sb, &t);
            sb
        })
        .collect();
    let from = layout::names::level_name(refsb.level).unwrap_or("?");
    let mut summary = format!("level {from} -> {}", t.level.name());
    if t.level != Level::Raid1 {
        summary += &format!(", layout {}", layout::names::format_layout(t.level, t.layout));
        summary += &format!(", chunk {} KiB", t.chunk_sectors / 2);
    }
    if t.raid_disks != refsb.raid_disks {
        summary += &format!(", raid-devices {} -> {}", refsb.raid_disks, t.raid_disks);
    }
    Ok(GrowPlan { superblocks: sbs, bitmap, summary })
}

/// The resync checkpoint a plan leaves ([`MAX_SECTOR`]: none).
pub fn resync_offset(p: &GrowPlan) -> u64 {
    p.superblocks.iter().map(|s| s.resync_offset_sectors).min().unwrap_or(MAX_SECTOR)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::create::{BitmapRequest, CreateRequest, InitialSync, plan as create_plan};

    fn members(level: Level, n: usize, sectors: u64, bitmap: bool) -> (Vec<PlanMember>, Option<Vec<u8>>) {
        let mut req = CreateRequest::new(level, vec![sectors; n], [7; 16], 1_790_000_000);
        if bitmap {
            req.bitmap = BitmapRequest::Internal { chunk_bytes: None };
        }
        req.sync = InitialSync::AssumeClean;
        let p = create_plan(&req).unwrap();
        let ms = p
            .members
            .iter()
            .enumerate()
            .map(|(i, m)| PlanMember { name: format!("m{i}"), sb: m.superblock.clone(), device_sectors: sectors })
            .collect();
        (ms, p.bitmap_area.clone())
    }

    #[test]
    fn size_max_grows_and_marks_new_chunks() {
        let (mut ms, area) = members(Level::Raid1, 2, 64 * 2048, true);
        let old = ms[0].sb.size_sectors;
        for m in &mut ms {
            m.device_sectors = 128 * 2048;
        }
        let p =
            plan("md0", &ms, area.as_deref(), GrowChange::Size { size: GrowSize::Max, assume_clean: false }).unwrap();
        let sb = &p.superblocks[0];
        assert_eq!(sb.size_sectors, 128 * 2048 - sb.data_offset_sectors);
        assert_eq!(sb.data_size_sectors, sb.size_sectors);
        assert_eq!(sb.resync_offset_sectors, old);
        let bms = BitmapSuper::decode(p.bitmap.as_ref().unwrap()).unwrap();
        assert_eq!(bms.sync_size_sectors, sb.size_sectors);
        let geo = bms.geometry().unwrap();
        assert!(bitmap::test_bit(p.bitmap.as_ref().unwrap(), &geo, geo.chunks() - 1).unwrap());
    }

    #[test]
    fn bitmap_chunk_doubles_when_the_bits_do_not_fit() {
        let (ms, _) = members(Level::Raid1, 2, 64 * 2048, false);
        let sync = ms[0].sb.size_sectors;
        // 8 sectors reserved: 4096 - 256 bytes of bits.
        let mut bms = BitmapSuper::new([7; 16], 4096, sync);
        bms.sectors_reserved = 8;
        let area = bms.initial_area().unwrap();
        let grown = resize_bitmap("md0", &area, sync, sync * 4, true).unwrap();
        let new = BitmapSuper::decode(&grown).unwrap();
        assert!(new.chunk_bytes > 4096, "{}", new.chunk_bytes);
        assert!(new.geometry().unwrap().storage_bytes() <= 4096);
        assert!(
            BitmapGeometry { chunk_bytes: new.chunk_bytes / 2, sync_size_sectors: sync * 4 }.storage_bytes() > 4096
        );
    }

    #[test]
    fn refusals_name_the_reason() {
        let (ms, area) = members(Level::Raid5, 3, 64 * 2048, true);
        let e = plan("md0", &ms, area.as_deref(), GrowChange::RaidDevices(4)).unwrap_err().to_string();
        assert_eq!(e, "md0: grow --raid-devices on raid5 is not implemented yet");
        let e = plan("md0", &ms, area.as_deref(), GrowChange::RaidDevices(3)).unwrap_err().to_string();
        assert_eq!(e, "md0: --raid-devices 3: no change requested (mdadm's words)");
        let e = plan("md0", &ms, area.as_deref(), GrowChange::Size { size: GrowSize::Sectors(8), assume_clean: false })
            .unwrap_err()
            .to_string();
        assert!(e.contains("shrinking would cut off data"), "{e}");
        // 4 KiB rounds down to no chunk at all: the message says what was asked.
        assert!(e.contains("--size 4 KiB (rounded down to 0 KiB)"), "{e}");
        let e = plan(
            "md0",
            &ms,
            area.as_deref(),
            GrowChange::Size { size: GrowSize::Sectors(1 << 30), assume_clean: false },
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("member m0 offers"), "{e}");
        let e = plan("md0", &ms, None, GrowChange::Bitmap(BitmapChange::Internal { chunk_bytes: None }))
            .unwrap_err()
            .to_string();
        assert!(e.contains("already has an internal bitmap"), "{e}");
    }

    #[test]
    fn raid1_fewer_mirrors_needs_members_removed_and_renumbers() {
        let (mut ms, _) = members(Level::Raid1, 3, 64 * 2048, false);
        let e = plan("md0", &ms, None, GrowChange::RaidDevices(2)).unwrap_err().to_string();
        assert!(e.contains("3 members are active; fail and remove 1"), "{e}");
        // Role 0 removed: roles 1, 2 become 0, 1.
        ms.remove(0);
        for m in &mut ms {
            m.sb.dev_roles[0] = super::super::superblock::ROLE_SPARE;
        }
        let p = plan("md0", &ms, None, GrowChange::RaidDevices(2)).unwrap();
        assert_eq!(p.superblocks[0].raid_disks, 2);
        assert_eq!(&p.superblocks[0].dev_roles[..3], &[0xffff, 0, 1]);
    }

    #[test]
    fn bitmap_add_fits_the_room_before_the_bad_block_log() {
        let (ms, _) = members(Level::Raid1, 2, 64 * 2048, false);
        let p = plan("md0", &ms, None, GrowChange::Bitmap(BitmapChange::Internal { chunk_bytes: None })).unwrap();
        let sb = &p.superblocks[0];
        assert_eq!(sb.bitmap_offset_sectors(), Some(8));
        let area = p.bitmap.unwrap();
        let bms = BitmapSuper::decode(&area).unwrap();
        let space = super::super::validate::bitmap_space_bytes(sb, 64 * 2048).unwrap();
        bms.check_for_member(sb, space).unwrap();
    }
}
