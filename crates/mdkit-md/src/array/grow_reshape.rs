//! Starting a raid4/5/6 restripe forwards: to more members (`grow --raid-devices N --add
//! DEV...`) or over the same members to a new chunk or layout (`grow --chunk` / `--layout`);
//! raid10 near layouts to more members (the data moves down one chunk; the bitmap, which
//! covers the array, grows with it: [`reshape_bitmap`]), as
//! mdadm ≥ 3.3 does on 1.x metadata without a backup file (Grow.c set_new_data_offset):
//! every member's data offset moves down by `min_offset_change` = LCM(old stripe, new stripe) /
//! old data members, so the new geometry's writes always trail the old geometry's reads; over
//! the same members by more where there is room, about half the free space before the data, as
//! mdadm picks it ([`move_into_room`]).
//! To fewer members (`grow --raid-devices N` below the count, no `--add`) the reshape runs
//! backwards and the data moves *up* by as much; the array must first be cut to the smaller
//! size (`grow --array-size`, as mdadm asks), and where the members have no room after the
//! used size, that size is lowered by whole chunks first (as mdadm lowers component_size).
//!
//! ```text
//!  refusals first (not clean, degraded, no room before the data, too few new devices)
//!  ─ stop at a checkpoint ─ new members: bitmap copy, superblock (placed like the old ones)
//!  ─ old members: RESHAPE_ACTIVE, NEW_OFFSET (new_offset = -min), delta_disks, raid_disks = N,
//!    reshape_position 0, events + 1 (FUA, flushed) ─ assemble again: the reshape personality
//!    and its engine take over (`reshape.rs`)
//! ```
//! A crash between these superblock writes leaves members disagreeing on the member count.
//! Nothing has moved at that point (reshape_position 0), so assembly takes an old member that
//! missed only this round into the reshape ([`adopt_unstarted_reshape`]) instead of letting the
//! geometry vote leave it out (which, with two such members, left no group able to run).

use std::io;
use std::sync::Arc;

use mdkit_io::{BlockDeviceExt, WriteFlags};

use super::assemble::{AssembleOptions, MemberDev, assemble, read_superblock};
use super::grow::{GrowReport, Settings, member_err, read_bitmap_area, refused};
use super::member::Member;
use super::{Array, ArrayInfo, SlotTable};
use crate::format::bitmap::BitmapSuper;
use crate::format::grow::{resize_bitmap, room_from};
use crate::format::superblock::{MetadataVersion, Superblock, feature};
use crate::layout::{Level, Raid10Geometry};

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// What a restripe moves the array to: its member count, layout and chunk afterwards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RestripeTarget {
    pub raid_disks: u32,
    pub layout: u32,
    pub chunk_sectors: u32,
}

/// mdadm's `min_offset_change` for a forward restripe (Grow.c compute_backup_blocks): the LCM
/// of the old and new stripes' data sectors / old data members (sectors; a multiple of both
/// chunks, so 4 KiB aligned and at least the larger chunk, as raid5_run needs for a restripe
/// over the same members).
pub fn min_offset_change_sectors(old_chunk: u64, new_chunk: u64, old_data: u64, new_data: u64) -> u64 {
    let (a, b) = (old_chunk * old_data, new_chunk * new_data);
    a / gcd(a, b) * b / old_data
}

/// The first sector the data may start at on a 1.1/1.2 member: past the superblock block, the
/// bitmap (`bitmap_bytes` long) and the bad-block log.
fn metadata_end_sectors(sb: &Superblock, bitmap_bytes: u64) -> u64 {
    let sb_end = sb.super_offset_sectors + 8;
    let bitmap_end = sb.bitmap_sector().map_or(0, |s| s + bitmap_bytes.div_ceil(512));
    let bblog_end = sb.bblog_sector().map_or(0, |s| s + u64::from(sb.bblog_size_sectors));
    sb_end.max(bitmap_end).max(bblog_end)
}

/// The free sectors before the data on a 1.1/1.2 member (see [`metadata_end_sectors`]).
fn room_before_data_sectors(sb: &Superblock, bitmap_bytes: u64) -> u64 {
    sb.data_offset_sectors.saturating_sub(metadata_end_sectors(sb, bitmap_bytes))
}

/// How a reshape starts on disk: where it goes, how far the data moves (down forwards, up
/// backwards), where the engine starts and the used size per member it runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ReshapeStart {
    to: RestripeTarget,
    move_sectors: u64,
    backwards: bool,
    position_sectors: u64,
    size_sectors: u64,
}

impl ReshapeStart {
    fn new_offset_sectors(&self) -> i32 {
        let m = self.move_sectors as i32;
        if self.backwards { m } else { -m }
    }
}

/// The reshape's superblock fields on an old member (RESHAPE_BACKWARDS is written only when
/// the member count stays, as md's super_1_sync does: fewer members imply the direction).
fn mark_reshaping(sb: &mut Superblock, start: &ReshapeStart) {
    let to = start.to;
    sb.feature_map |= feature::RESHAPE_ACTIVE | feature::NEW_OFFSET;
    sb.feature_map &= !feature::RESHAPE_BACKWARDS;
    sb.delta_disks = to.raid_disks as i32 - sb.raid_disks as i32;
    if start.backwards && sb.delta_disks == 0 {
        sb.feature_map |= feature::RESHAPE_BACKWARDS;
    }
    sb.raid_disks = to.raid_disks;
    sb.new_level = sb.level;
    sb.new_layout = to.layout;
    sb.new_chunk_sectors = to.chunk_sectors;
    sb.new_offset_sectors = start.new_offset_sectors();
    sb.reshape_position_sectors = start.position_sectors;
    sb.size_sectors = start.size_sectors;
}

/// Where a reshape recorded in `sb` starts: 0 forwards, the smaller array's end backwards
/// (raid5_size with the fewer members).
fn start_position(sb: &Superblock, backwards: bool) -> Option<u64> {
    if !backwards {
        return Some(0);
    }
    let level = Level::from_md_level(sb.level)?;
    let disks = sb.raid_disks.min(u32::try_from(i64::from(sb.raid_disks) - i64::from(sb.delta_disks)).ok()?);
    let chunk = sb.chunk_sectors.max(sb.new_chunk_sectors);
    crate::layout::array_sectors(level, disks, sb.new_layout, chunk, sb.size_sectors)
}

/// Assembly's rule for a cut while a restripe starts: the freshest member records a forward
/// reshape at position 0 (nothing moved yet), and an old member is exactly one event behind with
/// the geometry before it (same level, layout, chunk, size and creation time; `raid_disks` less
/// `delta_disks`; its role active and unchanged). The start round is the only write it missed,
/// so its data is what the reshape's old geometry describes: it gets the reshape's fields in
/// memory, as if that write had landed. Returns the names of the members adopted.
pub(super) fn adopt_unstarted_reshape(found: &mut [(MemberDev, Superblock)]) -> Vec<String> {
    let backwards = crate::format::reshape::runs_backwards;
    let reshaping = |sb: &Superblock| {
        sb.feature_map & feature::RESHAPE_ACTIVE != 0
            && sb.feature_map & feature::NEW_OFFSET != 0
            && Some(sb.reshape_position_sectors) == start_position(sb, backwards(sb))
            && (sb.new_offset_sectors > 0) == backwards(sb)
            && sb.new_level == sb.level
            && (sb.delta_disks != 0 || (sb.new_layout, sb.new_chunk_sectors) != (sb.layout, sb.chunk_sectors))
    };
    let Some(r) = found.iter().map(|(_, sb)| sb).filter(|sb| reshaping(sb)).max_by_key(|sb| sb.events).cloned() else {
        return Vec::new();
    };
    let old_disks = i64::from(r.raid_disks) - i64::from(r.delta_disks);
    let start = ReshapeStart {
        to: RestripeTarget { raid_disks: r.raid_disks, layout: r.new_layout, chunk_sectors: r.new_chunk_sectors },
        move_sectors: u64::from(r.new_offset_sectors.unsigned_abs()),
        backwards: backwards(&r),
        position_sectors: r.reshape_position_sectors,
        size_sectors: r.size_sectors,
    };
    let mut adopted = Vec::new();
    for (md, sb) in found.iter_mut() {
        let role = r.dev_roles.get(sb.dev_number as usize).copied();
        // Backwards the start may also have lowered the used size (room after the data).
        let size_ok = sb.size_sectors == r.size_sectors || (start.backwards && sb.size_sectors > r.size_sectors);
        let room_ok = if start.backwards {
            sb.data_size_sectors >= r.size_sectors + start.move_sectors
        } else {
            sb.data_offset_sectors >= start.move_sectors
        };
        let missed_only_the_start = sb.feature_map & feature::RESHAPE_ACTIVE == 0
            && sb.events.checked_add(1) == Some(r.events)
            && i64::from(sb.raid_disks) == old_disks
            && (sb.level, sb.layout, sb.chunk_sectors, sb.ctime) == (r.level, r.layout, r.chunk_sectors, r.ctime)
            && size_ok
            && role == Some(sb.raw_role())
            && i64::from(sb.raw_role()) < old_disks
            && room_ok;
        if !missed_only_the_start {
            continue;
        }
        tracing::warn!(
            member = md.name.as_str(),
            events = sb.events,
            "member missed the superblock write that started the reshape (nothing has moved yet): it joins the reshape"
        );
        mark_reshaping(sb, &start);
        sb.dev_roles = r.dev_roles.clone();
        adopted.push(md.name.clone());
    }
    adopted
}

/// What a restripe changes, for messages: "4 -> 5 members", "chunk 64 -> 128 KiB", ...
fn describe(info: &ArrayInfo, to: RestripeTarget) -> String {
    let mut parts = Vec::new();
    if to.raid_disks != info.raid_disks {
        parts.push(format!("{} -> {} members", info.raid_disks, to.raid_disks));
    }
    if to.chunk_sectors != info.chunk_sectors {
        parts.push(format!("chunk {} -> {} KiB", info.chunk_sectors / 2, to.chunk_sectors / 2));
    }
    if to.layout != info.layout {
        let name = |l: u32| crate::layout::names::format_layout(info.level, l);
        parts.push(format!("layout {} -> {}", name(info.layout), name(to.layout)));
    }
    if parts.is_empty() { "nothing to change".into() } else { parts.join(", ") }
}

/// How far every member's data moves down: mdadm's min_offset_change (raid10: the larger chunk
/// times the far copies, 1 for the near layouts mdkit reshapes).
fn move_sectors(info: &ArrayInfo, to: RestripeTarget) -> u64 {
    let (oc, nc) = (u64::from(info.chunk_sectors), u64::from(to.chunk_sectors));
    if info.level == Level::Raid10 {
        return oc.max(nc);
    }
    let parity = u64::from(info.level.max_degraded());
    let (od, nd) = (u64::from(info.raid_disks) - parity, u64::from(to.raid_disks) - parity);
    min_offset_change_sectors(oc, nc, od, nd)
}

/// A restripe over the same members moves the data down by more than min_offset_change where
/// the members have the room, as mdadm does (Grow.c set_new_data_offset with `delta_disks == 0`
/// picks a new offset near the middle of the free space before the data): the old geometry's
/// reads then lead the new geometry's writes by several stripes, so whoever continues the
/// reshape (the kernel too, after a stop) records a checkpoint before any write lands on an old
/// stripe not yet recorded as moved. With the bare minimum (one chunk for a layout change) the
/// kernel's reshape_request finds `readpos == writepos` and goes on without a checkpoint: not
/// crash safe, and its reads of one old stripe race its write of the next new one there.
/// `bitmap_bytes` is the bitmap the members hold now. Growth and shrinks keep the minimum.
fn same_members_move(start: ReshapeStart, info: &ArrayInfo, old: &[Arc<Member>], bitmap_bytes: u64) -> ReshapeStart {
    if start.backwards || start.to.raid_disks != info.raid_disks {
        return start;
    }
    let Some(data_offset) = old.first().map(|m| m.superblock().data_offset_sectors) else { return start };
    let room = old.iter().map(|m| room_before_data_sectors(&m.superblock(), bitmap_bytes)).min().unwrap_or(0);
    ReshapeStart { move_sectors: move_into_room(data_offset, room, start.move_sectors), ..start }
}

/// How far to move data at `data_offset` down, given `room` free sectors before it on every
/// member and the least move `min`: to mdadm's choice of new offset (Grow.c choose_offset):
/// from the middle of the free space, rounded bit by bit (up to 1 MiB) to a coarser alignment,
/// each time the way that stays farther from the ends of the free space, never moving less than
/// `min` nor more than `room`; in whole 4 KiB. Less room than `min`: `min` (and the caller
/// refuses).
pub fn move_into_room(data_offset: u64, room: u64, min: u64) -> u64 {
    let room = room.min(data_offset);
    if room < min {
        return min;
    }
    let (lowest, highest) = (data_offset - room, data_offset - min);
    let mut offset = (lowest + data_offset) / 2;
    let mut bit = 1u64;
    while bit < 2048 {
        if offset & bit != 0 {
            let (up, down) = (offset + bit, offset - bit);
            match (up <= highest, down >= lowest) {
                (false, false) => break,
                (false, true) => offset = down,
                (true, false) => offset = up,
                (true, true) => offset = if data_offset - up > down - lowest { up } else { down },
            }
        }
        bit <<= 1;
    }
    let moved = data_offset - offset;
    (moved / 8 * 8).max(min)
}

/// Refuses a target the restripe cannot reach (before anything is written).
fn check_target(info: &ArrayInfo, to: RestripeTarget, added: usize) -> Result<(), String> {
    if to.raid_disks < info.raid_disks && (to.layout, to.chunk_sectors) != (info.layout, info.chunk_sectors) {
        return Err("change the member count or the chunk/layout, not both while dropping members".into());
    }
    if to == (RestripeTarget { raid_disks: info.raid_disks, layout: info.layout, chunk_sectors: info.chunk_sectors }) {
        return Err("the member count, chunk and layout are already these".into());
    }
    if info.level == Level::Raid4 && to.layout != info.layout {
        return Err("raid4 has one layout (parity on the last member)".into());
    }
    if info.level == Level::Raid10 {
        let g = crate::layout::Raid10Geometry::new(to.raid_disks, to.layout, to.chunk_sectors, 0)
            .map_err(|e| e.to_string())?;
        if g.far_copies() != 1 || (to.layout, to.chunk_sectors) != (info.layout, info.chunk_sectors) {
            return Err("raid10 restripes only to another member count, near layouts, same layout and chunk".into());
        }
    } else {
        crate::layout::ParityGeometry::new(info.level, to.raid_disks, to.layout, to.chunk_sectors)
            .map_err(|e| e.to_string())?;
    }
    let chunk = u64::from(to.chunk_sectors);
    if !info.member_size_sectors.is_multiple_of(chunk) {
        return Err(format!(
            "the used size per member ({} KiB) is not a multiple of the new chunk ({} KiB): grow --size to a multiple first",
            info.member_size_sectors / 2,
            chunk / 2
        ));
    }
    let k = to.raid_disks.saturating_sub(info.raid_disks) as usize;
    if added != k {
        return Err(format!("give exactly {k} new device(s) with --add, not {added}"));
    }
    Ok(())
}

/// The used size per member a reshape to fewer members runs with: the current one when every
/// member has `move_sectors` free after it (the data moves up by that much: md.c
/// new_offset_store refuses less), else the most that leaves that room, in whole (larger)
/// chunks, as mdadm lowers component_size after `--array-size`. The array (at most
/// `size_limit_bytes`) must fit the fewer members at that size.
fn shrink_size(
    info: &ArrayInfo,
    to: RestripeTarget,
    data_sizes: &[u64],
    move_sectors: u64,
    size_limit_bytes: u64,
) -> Result<u64, String> {
    let chunk = u64::from(info.chunk_sectors.max(to.chunk_sectors));
    let fits = data_sizes.iter().min().copied().unwrap_or(0).saturating_sub(move_sectors);
    let size = info.member_size_sectors.min(fits / chunk * chunk);
    let new_sectors = |size: u64| {
        crate::layout::array_sectors(info.level, to.raid_disks, to.layout, to.chunk_sectors, size).unwrap_or(0)
    };
    let most_bytes = new_sectors(size) * 512;
    if size == 0 || size_limit_bytes > most_bytes {
        return Err(format!(
            "{} members hold at most {} KiB here (the data moves up {move_sectors} sectors on each): the array gives {} KiB; cut it first with grow --array-size {}K (mdadm: --grow --array-size)",
            to.raid_disks,
            most_bytes / 1024,
            size_limit_bytes / 1024,
            most_bytes / 1024
        ));
    }
    Ok(size)
}

impl Array {
    /// A forward restripe on raid4/5/6 (`grow --raid-devices N`, `--chunk`, `--layout`): see
    /// the module documentation.
    pub(super) async fn start_reshape(&self, to: RestripeTarget, add: Vec<MemberDev>) -> io::Result<GrowReport> {
        let pause = self.pause.pause().await;
        let core = self.core();
        let info = core.info().clone();
        let name = self.name();
        let what = describe(&info, to);
        let refuse = |why: String| refused(format!("{name}: cannot reshape ({what}): {why}"));
        if core.personality().reshape().is_some() {
            return Err(refuse("a reshape is already running".into()));
        }
        if let Some(why) = core.needs_check() {
            return Err(refuse(format!("the array needs a check: {why}")));
        }
        let parity_missing = only_parity_missing(&info, &core.slots()) && to.raid_disks > info.raid_disks;
        if core.is_broken() || (core.degraded() > 0 && !parity_missing) || !core.slots().recovering().is_empty() {
            return Err(refuse("the array is degraded or rebuilding; let recovery finish first".into()));
        }
        if !super::is_in_sync(&core) {
            return Err(refuse("a resync is pending; let it finish first".into()));
        }
        if info.metadata == MetadataVersion::V1_0 {
            return Err(refuse("metadata 1.0 has no room before the data to move it (a backup file would be needed, which mdkit does not implement)".into()));
        }
        check_target(&info, to, add.len()).map_err(refuse)?;
        let slots = core.slots();
        let old: Vec<Arc<Member>> = (0..info.raid_disks as usize).filter_map(|r| slots.working(r).cloned()).collect();
        let start = self.plan_start(&info, to, &old).map_err(refuse)?;
        let move_sectors = start.move_sectors;
        let bitmap_area = match old.first() {
            Some(m) => read_bitmap_area(name, m, &m.superblock()).await?,
            None => None,
        };
        let start = same_members_move(start, &info, &old, bitmap_area.as_ref().map_or(0, |a| a.len() as u64));
        let bitmap_area = match bitmap_area {
            Some(area) => Some(reshape_bitmap(name, &info, &start, &old, area).map_err(refuse)?),
            None => None,
        };
        let bitmap_bytes = bitmap_area.as_ref().map_or(0, |a| a.len() as u64);
        for m in old.iter().filter(|_| !start.backwards) {
            let sb = m.superblock();
            let room = room_before_data_sectors(&sb, bitmap_bytes);
            if room < move_sectors {
                return Err(refuse(format!(
                    "member {} has {room} free sectors before its data (data_offset {}), the data must move down by {move_sectors}; mdkit does not implement mdadm's backup file",
                    m.name(),
                    sb.data_offset_sectors
                )));
            }
        }
        let roles = roles_for_added(&slots, to.raid_disks, add.len());
        let new_sbs = self.new_reshape_members(&slots, &add, &roles, info.raid_disks, &start)?;
        let before = self.size_bytes();
        let settings = Settings::of(&core);
        let replacing = self.replacing().await?;
        self.stop_core().await?;
        let written = self.write_reshape_start(&old, &add, new_sbs, &roles, bitmap_area, &start).await;
        let mut devs: Vec<MemberDev> =
            slots.working_members().iter().map(|m| MemberDev::new(m.name(), m.device().clone())).collect();
        devs.extend(add.iter().cloned());
        let opts = AssembleOptions {
            name: name.to_string(),
            uuid: Some(info.uuid),
            force: false,
            start_frozen: settings.frozen,
        };
        match assemble(devs, opts).await {
            Ok(a) => self.take_over(a, &settings, replacing),
            Err(e) => {
                let why = format!("reshape: assembling the array again failed: {e}");
                core.set_needs_check(why.clone());
                return Err(io::Error::other(format!("{name}: {why}")));
            }
        }
        drop(pause);
        written?;
        let way = if start.backwards { "up" } else { "down" };
        let summary = format!("reshape {what} started (data offset moves {way} {move_sectors} sectors)");
        tracing::info!(array = name, "{summary}");
        Ok(GrowReport { summary, size_bytes_before: before, size_bytes_after: self.size_bytes() })
    }

    /// How the reshape to `to` starts: forwards (more members, or the same) the data moves
    /// down by mdadm's min_offset_change (over the same members [`same_members_move`] widens
    /// it once the bitmap is known); backwards (fewer members) it moves up by as much,
    /// from the end of the smaller array, once the array was cut to that size (`--array-size`).
    fn plan_start(&self, info: &ArrayInfo, to: RestripeTarget, old: &[Arc<Member>]) -> Result<ReshapeStart, String> {
        let move_sectors = move_sectors(info, to);
        let backwards = to.raid_disks < info.raid_disks;
        let mut start =
            ReshapeStart { to, move_sectors, backwards, position_sectors: 0, size_sectors: info.member_size_sectors };
        if backwards {
            if info.metadata == MetadataVersion::V1_0 {
                return Err(
                    "metadata 1.0 keeps its superblock right after the data: fewer members are not implemented for it"
                        .into(),
                );
            }
            let data_sizes: Vec<u64> = old.iter().map(|m| m.superblock().data_size_sectors).collect();
            start.size_sectors = shrink_size(info, to, &data_sizes, move_sectors, self.size_bytes())?;
            start.position_sectors = crate::layout::array_sectors(
                info.level,
                to.raid_disks,
                to.layout,
                to.chunk_sectors,
                start.size_sectors,
            )
            .unwrap_or(0);
        }
        Ok(start)
    }

    /// Superblocks for the devices joining the new geometry (in `roles`): placed like the old
    /// members, with the same NEW_OFFSET, as mdadm sets every member's new offset (the
    /// kernel's raid5_run takes the least move over all members in a role). One filling a role
    /// of the old geometry (below `old_disks`) is recovered by the reshape: RECOVERY_OFFSET 0.
    fn new_reshape_members(
        &self,
        slots: &SlotTable,
        add: &[MemberDev],
        roles: &[u32],
        old_disks: u32,
        start: &ReshapeStart,
    ) -> io::Result<Vec<Superblock>> {
        let move_sectors = start.move_sectors;
        let first_number = slots.all_members().iter().map(|m| m.dev_number + 1).max().unwrap_or(0);
        let mut out = Vec::new();
        for ((dev_number, dev), role) in (first_number..).zip(add).zip(roles) {
            // Refuses a device whose data area is smaller than the array's per-member size.
            let mut sb = self.new_member_superblock(dev, slots)?;
            if sb.data_offset_sectors < move_sectors {
                return Err(refused(format!("{}: {}: no room to move the data offset down", self.name(), dev.name)));
            }
            sb.dev_number = dev_number;
            mark_reshaping(&mut sb, start);
            if *role < old_disks {
                sb.feature_map |= feature::RECOVERY_OFFSET;
                sb.recovery_offset_sectors = 0;
            }
            out.push(sb);
        }
        Ok(out)
    }

    /// With the array stopped: bitmap copies and superblocks of the new members, then the old
    /// members' superblocks with the reshape state, all with one more event (FUA, flushed).
    async fn write_reshape_start(
        &self,
        old: &[Arc<Member>],
        add: &[MemberDev],
        mut new_sbs: Vec<Superblock>,
        new_roles: &[u32],
        bitmap_area: Option<Vec<u8>>,
        start: &ReshapeStart,
    ) -> io::Result<()> {
        let name = self.name();
        let mut old_sbs = Vec::new();
        for m in old {
            old_sbs.push(read_superblock(m.device()).await.map_err(|e| member_err(name, m.name(), "superblock", e))?);
        }
        let events = old_sbs.iter().map(|s| s.events).max().unwrap_or(0) + 1;
        let mut roles = old_sbs.first().map(|s| s.dev_roles.clone()).unwrap_or_default();
        for (sb, role) in new_sbs.iter().zip(new_roles) {
            let n = sb.dev_number as usize;
            if roles.len() <= n {
                roles.resize(n + 1, crate::format::superblock::ROLE_SPARE);
            }
            roles[n] = *role as u16;
        }
        let mut area = bitmap_area;
        if let Some(a) = &mut area {
            let mut bms = crate::format::bitmap::BitmapSuper::decode(a).map_err(refused)?;
            bms.events = events;
            bms.write_header(a).map_err(refused)?;
        }
        let mut writes: Vec<(MemberDev, Superblock)> = Vec::new();
        for (dev, sb) in add.iter().zip(new_sbs.iter_mut()) {
            writes.push((dev.clone(), sb.clone()));
        }
        for (m, mut sb) in old.iter().zip(old_sbs) {
            mark_reshaping(&mut sb, start);
            writes.push((MemberDev::new(m.name(), m.device().clone()), sb));
        }
        for (dev, mut sb) in writes {
            sb.events = events;
            sb.utime = super::sb::now_md_time();
            sb.dev_roles = roles.clone();
            if let (Some(a), Some(sector)) = (&area, sb.bitmap_sector()) {
                dev.dev
                    .write_slice(sector * 512, a, WriteFlags::FUA)
                    .await
                    .map_err(|e| member_err(name, &dev.name, &format!("writing the bitmap at sector {sector}"), e))?;
            }
            let block = sb.encode().map_err(|e| member_err(name, &dev.name, "superblock", e))?;
            dev.dev
                .write_slice(sb.super_offset_sectors * 512, &block, WriteFlags::FUA)
                .await
                .map_err(|e| member_err(name, &dev.name, "writing the superblock", e))?;
            dev.dev.flush().await.map_err(|e| member_err(name, &dev.name, "flush", e))?;
        }
        Ok(())
    }

    /// Waits until the running reshape (if any) is finished, then assembles the array again
    /// so it serves its new size. Returns at once when no reshape runs, and with an error when
    /// the array stops (or its reshape engine fails) first.
    pub async fn wait_reshape(&self) -> io::Result<()> {
        let core = self.core();
        let Some(r) = core.personality().reshape() else { return Ok(()) };
        loop {
            tokio::select! {
                _ = r.wait_done() => break,
                _ = tokio::time::sleep(std::time::Duration::from_millis(200)) => {}
            }
            let failed = core.sync_status_error();
            if core.is_shutting_down() || failed.is_some() {
                let why = failed.unwrap_or_else(|| "the array stopped".into());
                return Err(io::Error::other(format!("{}: the reshape did not finish: {why}", self.name())));
            }
        }
        let pause = self.pause.pause().await;
        if !Arc::ptr_eq(&self.core(), &core) {
            return Ok(()); // another waiter already assembled the array again
        }
        let settings = Settings::of(&core);
        let devs: Vec<MemberDev> =
            core.slots().all_members().iter().map(|m| MemberDev::new(m.name(), m.device().clone())).collect();
        let replacing = self.replacing().await?;
        self.stop_core().await?;
        let opts = AssembleOptions {
            name: self.name().to_string(),
            uuid: Some(core.info().uuid),
            force: false,
            start_frozen: settings.frozen,
        };
        let a = assemble(devs, opts).await.map_err(|e| {
            let why = format!("reshape finished, assembling the array again failed: {e}");
            core.set_needs_check(why.clone());
            io::Error::other(format!("{}: {why}", self.name()))
        })?;
        self.take_over(a, &settings, replacing);
        drop(pause);
        self.change_level_after_reshape().await
    }
}

/// The write-intent bitmap the reshape starts with. Its `sectors_reserved` is capped to the
/// room left before the moved data on every member (so no later resize claims sectors that
/// now hold data). A raid10 bitmap covers the array, so it is resized to the new array as the
/// kernel's raid10_start_reshape does: same chunk if the bits fit the room, else the chunk
/// doubles until they do (a bit of the doubled chunk is set where either half was). The new
/// space starts dirty, as md_bitmap_resize marks it: the reshape moves the old array only,
/// so the copies of the array's new tail hold whatever the members held there until the
/// bitmap-guided resync after the reshape writes them (raid10_finish_reshape's resync).
fn reshape_bitmap(
    name: &str,
    info: &ArrayInfo,
    start: &ReshapeStart,
    old: &[Arc<Member>],
    mut area: Vec<u8>,
) -> Result<Vec<u8>, String> {
    let to = start.to;
    let move_down = if start.backwards { 0 } else { start.move_sectors };
    // Every member's room from its bitmap to the moved data (or its bad-block log).
    let rooms = old.iter().map(|m| {
        let mut sb = m.superblock();
        sb.data_offset_sectors = sb.data_offset_sectors.saturating_sub(move_down);
        sb.bitmap_sector().and_then(|start| room_from(&sb, start)).unwrap_or(0)
    });
    let room = rooms.min().unwrap_or(0).min(u64::from(u32::MAX)) as u32;
    if room == 0 {
        return Err("a member has no room for its bitmap before the moved data".into());
    }
    let mut bms = BitmapSuper::decode(&area).map_err(|e| format!("bitmap: {e}"))?;
    if bms.sectors_reserved == 0 || bms.sectors_reserved > room {
        bms.sectors_reserved = room;
    }
    bms.write_header(&mut area).map_err(|e| format!("bitmap: {e}"))?;
    if info.level != Level::Raid10 {
        // The bitmap covers the used size per member, which a shrink may have lowered.
        if start.size_sectors == info.member_size_sectors {
            return Ok(area);
        }
        return resize_bitmap(name, &area, info.member_size_sectors, start.size_sectors, false).map_err(|e| e.0);
    }
    let sectors = |disks: u32, layout: u32, chunk: u32, size: u64| {
        Raid10Geometry::new(disks, layout, chunk, size).map(|g| g.array_sectors())
    };
    let old_sync = sectors(info.raid_disks, info.layout, info.chunk_sectors, info.member_size_sectors)
        .map_err(|e| e.to_string())?;
    let new_sync =
        sectors(to.raid_disks, to.layout, to.chunk_sectors, start.size_sectors).map_err(|e| e.to_string())?;
    resize_bitmap(name, &area, old_sync, new_sync, true).map_err(|e| e.0)
}

/// Whether the array's only missing role is its parity role, on a parity-last raid4/5 (a
/// raid0 taken over to raid4, md's raid45_takeover_raid0): it may grow, its parity role filled
/// by the first new device and recovered by the reshape (mdadm's raid0 --raid-devices path).
fn only_parity_missing(info: &ArrayInfo, slots: &SlotTable) -> bool {
    let n = info.raid_disks;
    let missing: Vec<u32> = (0..n).filter(|r| slots.in_sync(*r as usize).is_none()).collect();
    matches!(info.level, Level::Raid4 | Level::Raid5)
        && (info.level == Level::Raid4 || info.layout == crate::layout::names::algorithm::PARITY_N)
        && missing == [n - 1]
        && slots.working(n as usize - 1).is_none()
}

/// The roles `count` new devices take in a restripe to `raid_disks`: the empty ones in order,
/// as raid5_add_disk fills the first free slot (a missing old role first, then the new ones).
fn roles_for_added(slots: &SlotTable, raid_disks: u32, count: usize) -> Vec<u32> {
    (0..raid_disks).filter(|r| slots.working(*r as usize).is_none()).take(count).collect()
}

/// Whether `grow --raid-devices n` restripes (raid4/5/6 and raid10 to another member count).
pub fn is_restripe(level: Level, raid_disks: u32, n: u32) -> bool {
    matches!(level, Level::Raid4 | Level::Raid5 | Level::Raid6 | Level::Raid10) && n != raid_disks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offset_change_matches_mdadm() {
        // 4 -> 5 raid5, 64 KiB chunk: LCM(3, 4) chunks = 12 chunks / 3 = 4 chunks.
        assert_eq!(min_offset_change_sectors(128, 128, 3, 4), 512);
        // 3 -> 5 raid5: LCM(2, 4) = 4 chunks / 2 = 2 chunks.
        assert_eq!(min_offset_change_sectors(128, 128, 2, 4), 256);
        // 4 -> 5 raid6 (2 -> 3 data members): LCM(2, 3) = 6 chunks / 2 = 3 chunks.
        assert_eq!(min_offset_change_sectors(128, 128, 2, 3), 384);
        // Same members, 64 -> 128 KiB chunk (and back): one larger chunk, what raid5_run needs.
        assert_eq!(min_offset_change_sectors(128, 256, 3, 3), 256);
        assert_eq!(min_offset_change_sectors(256, 128, 3, 3), 256);
        // Same members and chunk, another layout: one chunk.
        assert_eq!(min_offset_change_sectors(128, 128, 4, 4), 128);
    }

    #[test]
    fn a_restripe_over_the_same_members_moves_the_data_as_far_as_mdadm_would() {
        // 1 MiB data offset, 16 sectors of metadata before it: mdadm's new offset is 1024.
        assert_eq!(move_into_room(2048, 2032, 128), 1024);
        // 128 MiB data offset (mdadm's default on large members), bitmap in the way.
        assert_eq!(move_into_room(262144, 262144 - 24, 256), 131072);
        // Barely more room than the minimum: no more than the room, whole 4 KiB, at least min.
        assert_eq!(move_into_room(2048, 132, 128), 128);
        // Less room than the minimum: the minimum (refused by the caller).
        assert_eq!(move_into_room(2048, 100, 128), 128);
        for room in 128..2040 {
            let m = move_into_room(2048, room, 128);
            assert!(m >= 128 && m <= room && m.is_multiple_of(8), "room {room}: {m}");
        }
    }
}
