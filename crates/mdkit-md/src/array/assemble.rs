//! Assembly: open the members' superblocks, pick the reference, validate every member against
//! it, place each in its role (or as spare/replacement), and start the array — the kernel's and
//! mdadm's rules (md-lifecycle.md section 7):
//!
//! - members must carry a v1.x superblock (1.0, 1.1 or 1.2) whose every field is within the
//!   kernel's limits ([`crate::format::validate`]) of the same array (set UUID; the one most
//!   members share unless one is asked for);
//! - the reference is the freshest member (highest `events` among members with a role) of the
//!   largest set that agrees on the geometry ([`crate::format::consistency`]); a member whose
//!   geometry disagrees with that set, or whose bitmap superblock does not fit it, is left out —
//!   one damaged member never makes the healthy majority look wrong;
//! - a cut while a restripe started (reshape_position 0, nothing moved) leaves old members one
//!   event behind without the reshape: they join it (`grow_reshape::adopt_unstarted_reshape`);
//! - a cut during a level change (a takeover: no data moves) leaves members one event behind at
//!   the old level: they take the new one (`format::takeover::adopt`);
//! - the reference's `dev_roles` decide each member's role; a member with a role whose events
//!   are more than one behind is *stale* and left out (it missed writes): `--force` takes stale
//!   members back when the array cannot run without them (and resyncs);
//! - a member with RECOVERY_OFFSET resumes its rebuild from `recovery_offset`; REPLACEMENT
//!   members resume replacing; roles 0xfffe (faulty) are refused;
//! - the array must be able to run (the personality decides); an explicit assembly
//!   ([`PartialStart::NeedsRun`]) with fewer members than were active at the last stop needs
//!   `--run` (or `--force`); a dirty *and* degraded raid4/5/6 is refused unless forced (md's
//!   start_dirty_degraded: its parity cannot be trusted);
//! - a member's bad-block log (BAD_BLOCKS) is loaded into its in-memory list (those ranges are
//!   never read from it); a log that cannot be read or decoded, or lists sectors beyond the
//!   device, leaves the member out.
//!
//! Every left-out member is named with the reason, returned in [`Assembled::refused`] and kept by
//! the array ([`Array::left_out`]); nothing is ever written to it (it is not in the slot
//! table), so it can be added or re-added later.

use crate::format::reshape::ReshapeState;
use std::collections::HashMap;
use std::io;
use std::sync::Arc;

use mdkit_io::{BlockDeviceExt, DeviceRef};

use super::Array;
use super::bitmap::{BitmapArrayInfo, WriteIntentBitmap};
use super::core::{ArrayCore, ArrayInfo, BitmapFailSink};
use super::member::{Member, flag};
use super::personality::Personality;
use super::slots::SlotTable;
use super::{raid0, raid1, raid5, raid10};
use crate::format::badblocks::BadBlock;
use crate::format::bitmap::BitmapSuper;
use crate::format::consistency::{GeometryKey, ReferenceChoice, choose_reference};
use crate::format::format_uuid;
use crate::format::superblock::{
    Freshness, MAX_SECTOR, MetadataVersion, ROLE_FAULTY, ROLE_JOURNAL, ROLE_MAX, ROLE_SPARE, SB_BLOCK_BYTES,
    Superblock, feature, member_freshness, superblock_locations,
};
use crate::layout::{ArrayGeometry, Level};

/// Runs a pure adoption rule (`adopt`: the indexes of the superblocks it rewrote) over the
/// members found, logs each member it took in (`what` it had missed), and returns their names.
fn adopt_with(
    found: &mut [(MemberDev, Superblock)],
    adopt: fn(&mut [Superblock]) -> Vec<usize>,
    what: &str,
) -> Vec<String> {
    let mut sbs: Vec<Superblock> = found.iter().map(|(_, sb)| sb.clone()).collect();
    let adopted = adopt(&mut sbs);
    for &i in &adopted {
        tracing::warn!(member = found[i].0.name.as_str(), events = found[i].1.events, "member missed {what}");
        found[i].1 = sbs[i].clone();
    }
    adopted.iter().map(|&i| found[i].0.name.clone()).collect()
}

/// [`crate::format::takeover::adopt`] over the members found.
fn adopt_takeover(found: &mut [(MemberDev, Superblock)]) -> Vec<String> {
    let what = "the superblock write of a level change (nothing has moved yet): it takes the new level";
    adopt_with(found, crate::format::takeover::adopt, what)
}

/// [`crate::format::reshape::adopt_unfinished`] over the members found.
fn adopt_unfinished_reshape(found: &mut [(MemberDev, Superblock)]) -> Vec<String> {
    let what = "the superblock write that finished the reshape (everything had moved): it takes the new geometry";
    adopt_with(found, crate::format::reshape::adopt_unfinished, what)
}

/// A member device handed to assembly or creation: a name for messages (its path) and the device.
#[derive(Clone)]
pub struct MemberDev {
    pub name: String,
    pub dev: DeviceRef,
}

impl MemberDev {
    pub fn new(name: impl Into<String>, dev: DeviceRef) -> MemberDev {
        MemberDev { name: name.into(), dev }
    }
}

impl std::fmt::Debug for MemberDev {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MemberDev({})", self.name)
    }
}

/// How to assemble.
#[derive(Clone, Debug, Default)]
pub struct AssembleOptions {
    /// mdkit's name for the array ("md0").
    pub name: String,
    /// Take stale members back when needed, and start dirty degraded parity arrays.
    pub force: bool,
    /// Assemble this array (set UUID); members of other arrays are refused.
    pub uuid: Option<[u8; 16]>,
    /// Do not start background sync work (resync/recovery) until `sync_action` asks for it.
    pub start_frozen: bool,
}

/// A member assembly left out, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub member: String,
    pub reason: String,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.member, self.reason)
    }
}

/// A started array and what assembly had to say.
pub struct Assembled {
    pub array: Array,
    /// Members left out (the array runs without them).
    pub refused: Vec<Refusal>,
    /// Other notes: degraded start, resync or recovery pending.
    pub notes: Vec<String>,
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// Reads and validates the member's v1.x superblock, probing 1.0, 1.1 and 1.2 like mdadm.
/// The error names the reason (the member name is the caller's to add).
pub async fn read_superblock(dev: &DeviceRef) -> Result<Superblock, String> {
    let sectors = dev.topology().size_bytes / 512;
    let locations = superblock_locations(sectors);
    if locations.is_empty() {
        return Err(format!("device of {sectors} sectors is too small to hold md metadata"));
    }
    let mut valid: Vec<(MetadataVersion, Superblock)> = Vec::new();
    let mut problems: Vec<String> = Vec::new();
    let mut magic_seen = false;
    for (v, off) in locations {
        let bytes = match dev.read_metadata(off * 512, SB_BLOCK_BYTES).await {
            Ok(b) => b,
            Err(e) => {
                problems.push(format!("metadata {} at byte {}: read error: {e}", v.as_str(), off * 512));
                continue;
            }
        };
        match Superblock::decode(&bytes, off) {
            Ok(sb) => match sb.check_fits_device(sectors) {
                Ok(()) => valid.push((v, sb)),
                Err(e) => {
                    magic_seen = true;
                    problems.push(format!("metadata {} superblock at byte {}: {e}", v.as_str(), off * 512));
                }
            },
            Err(crate::format::superblock::SuperblockError::BadMagic { .. }) => {}
            Err(e) => {
                magic_seen = true;
                problems.push(format!("metadata {} superblock at byte {}: {e}", v.as_str(), off * 512));
            }
        }
    }
    match valid.len() {
        1 => Ok(valid.remove(0).1),
        0 if magic_seen || !problems.is_empty() => Err(format!("invalid md superblock: {}", problems.join("; "))),
        0 => Err("no md superblock found (checked metadata 1.0, 1.1 and 1.2 locations)".into()),
        _ => {
            // Two valid superblocks: a leftover of an earlier array. The one with more events is
            // the live one only if they belong to the same array; otherwise refuse.
            let uuids: Vec<[u8; 16]> = valid.iter().map(|(_, s)| s.set_uuid).collect();
            if uuids.windows(2).all(|w| w[0] == w[1]) {
                valid.sort_by_key(|(_, s)| std::cmp::Reverse(s.events));
                Ok(valid.remove(0).1)
            } else {
                let names: Vec<&str> = valid.iter().map(|(v, _)| v.as_str()).collect();
                Err(format!(
                    "several valid md superblocks of different arrays (metadata {}); wipe the stale one",
                    names.join(" and ")
                ))
            }
        }
    }
}

/// Array-wide features mdkit cannot run.
fn unsupported_features(sb: &Superblock) -> Option<&'static str> {
    let f = sb.feature_map;
    if f & feature::CLUSTERED != 0 {
        return Some("md-cluster arrays are not supported");
    }
    if f & feature::JOURNAL != 0 {
        return Some("raid5 write journal arrays are not supported");
    }
    if f & (feature::PPL | feature::MULTIPLE_PPLS) != 0 {
        return Some("partial parity log (PPL) arrays are not supported");
    }
    None
}

/// Builds the level's personality from the freshest superblock and each role's `data_size`.
/// A reshape in progress (RESHAPE_ACTIVE) gets the reshape personality (`reshape.rs`).
pub(crate) fn build_personality(name: &str, sb: &Superblock, data_sizes: &[u64]) -> io::Result<Arc<dyn Personality>> {
    let reshape = ReshapeState::from_superblock(sb).map_err(|e| invalid(format!("{name}: reshape state: {e}")))?;
    if let Some(st) = reshape {
        return super::reshape::build(name, sb, st);
    }
    let geo = ArrayGeometry::from_superblock(sb, data_sizes).map_err(|e| invalid(format!("{name}: {e}")))?;
    Ok(match geo {
        ArrayGeometry::Raid0(g) => Arc::new(raid0::Raid0::new(g, sb.chunk_sectors, sb.raid_disks)),
        ArrayGeometry::Raid1(_) => Arc::new(raid1::Raid1::new(sb.raid_disks, sb.size_sectors)),
        ArrayGeometry::Raid10(g) => Arc::new(raid10::Raid10::new(g, sb.raid_disks)),
        ArrayGeometry::Parity(g, _) => raid5::build(name, sb, g)?,
    })
}

/// Whether an explicit assembly may start with fewer members than were active at the last
/// stop (mdadm start_array: `--run`, `--force`, or assembly without an explicit device list).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PartialStart {
    /// Start degraded when the array can run (config volumes, arrays restored at start-up).
    #[default]
    Allowed,
    /// Refuse unless every member active at the last stop is present (`mdkit assemble`
    /// without `--run`).
    NeedsRun,
}

/// Reads every member's superblock; members without a usable one are refused by name.
async fn read_members(members: Vec<MemberDev>, refused: &mut Vec<Refusal>) -> Vec<(MemberDev, Superblock)> {
    let mut found = Vec::new();
    for md in members {
        match read_superblock(&md.dev).await {
            Ok(sb) => found.push((md, sb)),
            Err(reason) => refused.push(Refusal { member: md.name.clone(), reason }),
        }
    }
    found
}

/// A member one event behind takes its role from the freshest superblock (the kernel's
/// super_1_validate: a role it missed, such as faulty, must not be trusted from its own). When
/// that role is active but the member's own superblock holds another (a spare whose activation
/// it missed: the cut fell between the members' superblock writes, before its recovery
/// started), its data is not that role's: it is rebuilt from sector 0, never taken as in sync.
fn rebuild_if_role_changed(name: &str, mut sb: Superblock, role: u16) -> Superblock {
    if role >= ROLE_MAX || sb.raw_role() == role || sb.feature_map & feature::RECOVERY_OFFSET != 0 {
        return sb;
    }
    tracing::warn!(member = name, own = sb.raw_role(), role, "member missed its activation: rebuilt from sector 0");
    sb.feature_map |= feature::RECOVERY_OFFSET;
    sb.recovery_offset_sectors = 0;
    sb
}

/// The requested UUID, else the one most members carry (ties: more events).
fn pick_uuid(found: &[(MemberDev, Superblock)], requested: Option<[u8; 16]>) -> [u8; 16] {
    requested.unwrap_or_else(|| {
        let mut count: HashMap<[u8; 16], (usize, u64)> = HashMap::new();
        for (_, sb) in found {
            let e = count.entry(sb.set_uuid).or_default();
            e.0 += 1;
            e.1 = e.1.max(sb.events);
        }
        count.into_iter().max_by_key(|(_, v)| *v).map(|(u, _)| u).unwrap_or([0; 16])
    })
}

/// Why the member's write-intent bitmap cannot be used, checked before anything is sized from
/// it: location on the device, the kernel's field checks, uuid, sync_size and space.
async fn bitmap_problem(md: &MemberDev, sb: &Superblock) -> Option<String> {
    let sector = sb.bitmap_sector()?;
    let device_sectors = md.dev.topology().size_bytes / 512;
    let Some(space_bytes) = crate::format::validate::bitmap_space_bytes(sb, device_sectors) else {
        return Some(format!("its bitmap at sector {sector} lies outside the {device_sectors}-sector device"));
    };
    let at = sector * 512;
    let bytes = match md.dev.read_metadata(at, SB_BLOCK_BYTES).await {
        Ok(b) => b,
        Err(e) => return Some(format!("reading its bitmap superblock at byte {at}: {e}")),
    };
    match BitmapSuper::decode(&bytes).and_then(|b| b.check_for_member(sb, space_bytes)) {
        Ok(()) => None,
        Err(e) => Some(format!("bitmap superblock at byte {at}: {e}")),
    }
}

/// The member's bad-block log entries (super_1_load): none without BAD_BLOCKS; with it the log
/// must be reserved (offset and size non-zero, at most one 4 KiB page), readable, decode, and
/// every entry must lie on the device.
async fn read_bad_blocks(md: &MemberDev, sb: &Superblock) -> Result<Vec<BadBlock>, String> {
    if sb.feature_map & feature::BAD_BLOCKS == 0 {
        return Ok(Vec::new());
    }
    let Some(sector) = sb.bblog_sector() else {
        return Err("BAD_BLOCKS is set but no bad-block log is reserved (bblog_offset or bblog_size is 0)".into());
    };
    let len_sectors = u64::from(sb.bblog_size_sectors);
    if len_sectors > u64::from(crate::format::validate::MAX_BBLOG_SECTORS) {
        return Err(format!("bad-block log of {len_sectors} sectors is larger than one 4 KiB page"));
    }
    let device_sectors = md.dev.topology().size_bytes / 512;
    let at = sector * 512;
    // Read whole 4 KiB blocks around the log (members may refuse smaller direct reads).
    let lo = at & !4095;
    let hi = (at + len_sectors * 512).div_ceil(4096) * 4096;
    if hi > device_sectors * 512 {
        return Err(format!("its bad-block log at sector {sector} lies outside the {device_sectors}-sector device"));
    }
    let block = md
        .dev
        .read_metadata(lo, (hi - lo) as usize)
        .await
        .map_err(|e| format!("reading its bad-block log at byte {at}: {e}"))?;
    let log = &block[(at - lo) as usize..(at - lo + len_sectors * 512) as usize];
    let list = crate::format::badblocks::decode(log, sb.bblog_shift)
        .map_err(|e| format!("bad-block log at byte {at}: {e}"))?;
    if let Some(b) = list.iter().find(|b| b.start_sector.saturating_add(b.len_sectors) > device_sectors) {
        return Err(format!(
            "bad-block log at byte {at}: entry at sector {} (+{}) lies beyond the {device_sectors}-sector device",
            b.start_sector, b.len_sectors
        ));
    }
    Ok(list)
}

/// Why a member of the array cannot take part, judged against the reference (geometry,
/// features, bitmap, bad-block log, data area).
async fn member_problem(md: &MemberDev, sb: &Superblock, refsb: &Superblock, key: &GeometryKey) -> Option<String> {
    if let Some(why) = GeometryKey::of(sb).mismatch(key) {
        return Some(why);
    }
    if let Some(why) = unsupported_features(sb) {
        return Some(why.into());
    }
    let mirrored = matches!(Level::from_md_level(refsb.level), Some(Level::Raid1 | Level::Raid10));
    if mirrored && sb.data_size_sectors < refsb.size_sectors {
        return Some(format!(
            "data area of {} sectors is smaller than the array's per-member size {}",
            sb.data_size_sectors, refsb.size_sectors
        ));
    }
    if refsb.feature_map & feature::BITMAP_OFFSET != 0 && refsb.level > 0 {
        return bitmap_problem(md, sb).await;
    }
    None
}

/// Whether every role without an in-sync member holds only parity (a raid0 taken over to
/// raid4, its parity role empty; a raid5 grown to raid6 with `--layout preserve` whose Q member
/// was still rebuilding): nothing is rebuilt from parity, so an unclean shutdown leaves no
/// parity to distrust and the array starts without --force.
fn missing_hold_only_parity(pers: &dyn Personality, table: &SlotTable, sb: &Superblock) -> bool {
    if let Some(r) = pers.reshape() {
        return r.missing_hold_only_parity(table);
    }
    let Some(level) = Level::from_md_level(sb.level) else { return false };
    let parity = |r: u32| crate::layout::holds_only_parity(level, sb.layout, sb.raid_disks, r);
    (0..sb.raid_disks).all(|r| table.in_sync(r as usize).is_some() || parity(r))
}

/// Roles the array has: `raid_disks`, or during a reshape to fewer members the old count
/// (`raid_disks - delta_disks`), whose last roles the old geometry still reads.
fn role_count(sb: &Superblock) -> usize {
    // An invalid reshape state is refused when the personality is built.
    let reshape = ReshapeState::from_superblock(sb).ok().flatten();
    reshape.map_or(sb.raid_disks, |st| st.old_raid_disks.max(st.new_raid_disks)) as usize
}

/// Roles the reference superblock records as held (mdadm's working disks at the last
/// superblock update).
fn recorded_active_roles(refsb: &Superblock) -> usize {
    let raid_disks = role_count(refsb);
    (0..raid_disks).filter(|r| refsb.dev_roles.iter().any(|role| usize::from(*role) == *r)).count()
}

/// Assembles and starts an array from `members` (see the module documentation); a degraded
/// start is allowed whenever the array can run.
pub async fn assemble(members: Vec<MemberDev>, opts: AssembleOptions) -> io::Result<Assembled> {
    assemble_with(members, opts, PartialStart::Allowed).await
}

/// [`assemble`] with mdadm's rule for explicit assembly: `partial` says whether fewer members
/// than were active at the last stop may start the array (`--run`; `--force` implies it).
pub async fn assemble_with(
    members: Vec<MemberDev>,
    opts: AssembleOptions,
    partial: PartialStart,
) -> io::Result<Assembled> {
    let name = if opts.name.is_empty() { "md".to_string() } else { opts.name.clone() };
    if members.is_empty() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{name}: no member devices given")));
    }
    let mut refused: Vec<Refusal> = Vec::new();
    let found = read_members(members, &mut refused).await;
    let fail = |what: String, refused: &[Refusal]| -> io::Error {
        let list: Vec<String> = refused.iter().map(|r| r.to_string()).collect();
        if list.is_empty() {
            invalid(format!("{name}: {what}"))
        } else {
            invalid(format!("{name}: {what}; refused: {}", list.join("; ")))
        }
    };
    if found.is_empty() {
        return Err(fail("no member has a usable md superblock".into(), &refused));
    }
    let uuid = pick_uuid(&found, opts.uuid);
    let (mut mine, others): (Vec<_>, Vec<_>) = found.into_iter().partition(|(_, sb)| sb.set_uuid == uuid);
    // A cut while a restripe started: old members that missed only that round join it.
    let adopted = super::grow_reshape::adopt_unstarted_reshape(&mut mine);
    // A cut during a level change (takeover): members that missed only that round take the new level.
    let took_over = adopt_takeover(&mut mine);
    // A cut while a restripe over the same members finished: members that missed only that round finish it.
    let finished = adopt_unfinished_reshape(&mut mine);
    for (md, sb) in others {
        refused.push(Refusal {
            member: md.name.clone(),
            reason: format!(
                "belongs to a different array (uuid {}, assembling {})",
                format_uuid(&sb.set_uuid),
                format_uuid(&uuid)
            ),
        });
    }
    if mine.is_empty() {
        return Err(fail(format!("no member belongs to array uuid {}", format_uuid(&uuid)), &refused));
    }
    // The reference: the freshest member of the largest set that agrees on the geometry.
    let sbs: Vec<Superblock> = mine.iter().map(|(_, sb)| sb.clone()).collect();
    let (ref_idx, key) = match choose_reference(&sbs) {
        ReferenceChoice::Chosen { index, key } => (index, key),
        ReferenceChoice::Ambiguous { members_each, events } => {
            let list: Vec<&str> = mine.iter().map(|(md, _)| md.name.as_str()).collect();
            return Err(fail(
                format!(
                    "members {} disagree on the array geometry in groups of {members_each} (events {events}) and none is a majority; assemble the consistent members only",
                    list.join(", ")
                ),
                &refused,
            ));
        }
        ReferenceChoice::Empty => return Err(fail("no member belongs to the array".into(), &refused)),
    };
    let refsb = sbs[ref_idx].clone();
    if let Some(why) = unsupported_features(&refsb) {
        return Err(fail(format!("member {}: {why}", mine[ref_idx].0.name), &refused));
    }
    let level = Level::from_md_level(refsb.level)
        .ok_or_else(|| fail(format!("md level {} is not supported", refsb.level), &refused))?;
    let raid_disks = role_count(&refsb);

    // Classify each member.
    struct Accepted {
        md: MemberDev,
        sb: Superblock,
        role: u16,
        stale: bool,
        bad_blocks: Vec<BadBlock>,
    }
    let mut accepted: Vec<Accepted> = Vec::new();
    let mut stale: Vec<Accepted> = Vec::new();
    for (md, sb) in mine {
        let refuse = |reason: String| Refusal { member: md.name.clone(), reason };
        if let Some(why) = member_problem(&md, &sb, &refsb, &key).await {
            refused.push(refuse(why));
            continue;
        }
        let bad_blocks = match read_bad_blocks(&md, &sb).await {
            Ok(list) => list,
            Err(why) => {
                refused.push(refuse(why));
                continue;
            }
        };
        let role = refsb.dev_roles.get(sb.dev_number as usize).copied().unwrap_or(ROLE_SPARE);
        if member_freshness(sb.events, refsb.events, sb.raw_role()) == Freshness::Stale {
            let reason = format!(
                "stale: events {} but the array is at {} (it missed updates: failed or removed earlier); re-add it to recover it",
                sb.events, refsb.events
            );
            stale.push(Accepted { md: md.clone(), sb: sb.clone(), role: sb.raw_role(), stale: true, bad_blocks });
            refused.push(Refusal { member: md.name.clone(), reason });
            continue;
        }
        if role == ROLE_FAULTY {
            refused.push(refuse(format!("recorded as faulty in the array's superblocks (events {})", refsb.events)));
            continue;
        }
        if role == ROLE_JOURNAL {
            refused.push(refuse("journal devices are not supported".into()));
            continue;
        }
        let sb = rebuild_if_role_changed(&md.name, sb, role);
        accepted.push(Accepted { md, sb, role, stale: false, bad_blocks });
    }
    // dev_number must be unique.
    let mut seen: HashMap<u32, String> = HashMap::new();
    accepted.retain(|a| match seen.get(&a.sb.dev_number) {
        Some(other) => {
            refused.push(Refusal {
                member: a.md.name.clone(),
                reason: format!("same dev_number {} as {other} (a copy of the same member?)", a.sb.dev_number),
            });
            false
        }
        None => {
            seen.insert(a.sb.dev_number, a.md.name.clone());
            true
        }
    });

    let place = |accepted: &[Accepted], refused: &mut Vec<Refusal>| -> (SlotTable, Vec<Arc<Member>>) {
        let mut t = SlotTable::new(raid_disks);
        let mut all = Vec::new();
        // Holders with more events first, so a duplicate role keeps the fresher member.
        let mut order: Vec<&Accepted> = accepted.iter().collect();
        order.sort_by_key(|a| std::cmp::Reverse(a.sb.events));
        for a in order {
            let m = Arc::new(Member::new(a.md.name.clone(), a.md.dev.clone(), a.sb.clone()));
            m.bad_blocks().load(&a.bad_blocks);
            let role = a.role;
            if role < ROLE_MAX && (role as usize) < raid_disks {
                let r = role as usize;
                let recovering = a.sb.feature_map & feature::RECOVERY_OFFSET != 0 && !a.stale;
                if recovering {
                    m.set_recovery_offset(a.sb.recovery_offset_sectors);
                } else {
                    m.set(flag::IN_SYNC);
                }
                if a.sb.feature_map & feature::REPLACEMENT != 0 && !a.stale {
                    m.set(flag::REPLACEMENT);
                    if !recovering {
                        m.set_recovery_offset(0);
                        m.clear(flag::IN_SYNC);
                    }
                    if t.slot(r).is_some_and(|s| s.replacement.is_some()) {
                        refused.push(Refusal {
                            member: a.md.name.clone(),
                            reason: format!("a second replacement for role {r}"),
                        });
                        continue;
                    }
                    t.set_replacement(r, Some(m.clone()));
                } else if t.slot(r).is_some_and(|s| s.member.is_some()) {
                    refused.push(Refusal {
                        member: a.md.name.clone(),
                        reason: format!("role {r} is already held by a fresher member"),
                    });
                    continue;
                } else {
                    t.set_holder(r, Some(m.clone()));
                }
            } else {
                t.add_spare(m.clone());
            }
            all.push(m);
        }
        (t, all)
    };

    let mut refused_place = Vec::new();
    let (mut table, _) = place(&accepted, &mut refused_place);
    let data_sizes = |t: &SlotTable| -> Vec<u64> {
        (0..raid_disks).map(|r| t.slot(r).and_then(|s| s.member.as_ref()).map_or(0, |m| m.data_size_sectors)).collect()
    };
    // raid0 zones depend on every role's size; a missing role borrows the reference's (the
    // array cannot run then anyway).
    let sizes_for = |t: &SlotTable| -> Vec<u64> {
        if level != Level::Raid0 {
            return Vec::new();
        }
        data_sizes(t).into_iter().map(|s| if s == 0 { refsb.data_size_sectors } else { s }).collect()
    };
    let pers = build_personality(&name, &refsb, &sizes_for(&table));
    let pers = pers.map_err(|e| fail(e.to_string(), &refused))?;
    let mut forced = false;
    if !pers.can_run(&table) && opts.force && !stale.is_empty() {
        // mdadm --force: bring stale members back (freshest first) until the array can run.
        stale.sort_by_key(|a| std::cmp::Reverse(a.sb.events));
        for s in stale.drain(..) {
            if pers.can_run(&table) {
                break;
            }
            tracing::warn!(array = %name, member = %s.md.name, events = s.sb.events, to = refsb.events, "forcing stale member back into the array");
            refused.retain(|r| r.member != s.md.name);
            accepted.push(Accepted { stale: true, ..s });
            forced = true;
            refused_place.clear();
            table = place(&accepted, &mut refused_place).0;
        }
    }
    refused.extend(refused_place);
    // raid0 needs every role's real size for its zones.
    let pers =
        if level == Level::Raid0 && forced { build_personality(&name, &refsb, &sizes_for(&table))? } else { pers };
    if !pers.can_run(&table) {
        let have = raid_disks as u32 - table.missing_in_sync();
        return Err(fail(
            format!(
                "cannot start {}: {have} of {raid_disks} roles have an in-sync member, not enough to run",
                level.name()
            ),
            &refused,
        ));
    }
    let recorded = recorded_active_roles(&refsb);
    let present = (0..raid_disks).filter(|r| table.working(*r).is_some()).count();
    if present < recorded && partial == PartialStart::NeedsRun && !opts.force {
        return Err(fail(
            format!(
                "not started: {present} of the {recorded} members active at the last stop are usable; use --run to start it degraded"
            ),
            &refused,
        ));
    }
    let degraded = pers.degraded(&table);
    let mut resync_cp = if pers.has_redundancy() { refsb.resync_offset_sectors } else { MAX_SECTOR };
    let parity_roles_empty = degraded > 0 && missing_hold_only_parity(&*pers, &table, &refsb);
    if parity_roles_empty && degraded >= level.max_degraded() && resync_cp != MAX_SECTOR {
        // No parity to make consistent (raid5_sync_request skips a resync this degraded).
        tracing::info!(array = name.as_str(), "unclean shutdown with the parity role(s) empty: nothing to resync");
        resync_cp = MAX_SECTOR;
    }
    let dirty_degraded = matches!(level, Level::Raid4 | Level::Raid5 | Level::Raid6)
        && resync_cp != MAX_SECTOR
        && degraded > 0
        && !parity_roles_empty;
    if dirty_degraded && !opts.force {
        return Err(fail(
            format!(
                "cannot start a dirty degraded {} ({degraded} member(s) missing, unclean shutdown): its parity cannot be trusted; use --force to start it anyway",
                level.name()
            ),
            &refused,
        ));
    }
    let forced_clean = dirty_degraded && !forced;
    if forced_clean {
        // mdadm --assemble --force marks such an array clean ("force-array": resync_offset =
        // MaxSector): a degraded array has nothing to resync from, and a start that stays
        // dirty is refused again at the next assembly (the one that ends a reshape too).
        resync_cp = MAX_SECTOR;
    }
    if forced && pers.has_redundancy() {
        resync_cp = 0;
    }

    // The write-intent bitmap, from every working member (md_bitmap_load).
    let sink = Arc::new(BitmapFailSink::default());
    let bitmap = if refsb.feature_map & feature::BITMAP_OFFSET != 0 && pers.has_redundancy() {
        let members: Vec<super::bitmap::BitmapMember> = table
            .working_members()
            .iter()
            .filter_map(|m| {
                super::bitmap::BitmapMember::from_superblock(m.dev_number, m.device().clone(), &m.superblock()).ok()
            })
            .collect();
        let info = BitmapArrayInfo {
            name: name.clone(),
            set_uuid: uuid,
            events: refsb.events,
            resync_offset_sectors: resync_cp,
            sync_size_sectors: pers.sync_domain_sectors(),
            degraded: table.missing_in_sync() > 0,
        };
        Some(WriteIntentBitmap::load(members, info, sink.fail_fn()).await.map_err(|e| fail(e.to_string(), &refused))?)
    } else {
        None
    };

    let mut notes = Vec::new();
    if !adopted.is_empty() {
        notes.push(format!(
            "member(s) {} missed the superblock write that started the reshape (nothing had moved): taken into it",
            adopted.join(", ")
        ));
    }
    if !finished.is_empty() {
        notes.push(format!(
            "member(s) {} missed the superblock write that finished the reshape (everything had moved): taken into the new geometry",
            finished.join(", ")
        ));
    }
    if !took_over.is_empty() {
        notes.push(format!(
            "member(s) {} missed the superblock write of the level change (nothing had moved): taken into the new level",
            took_over.join(", ")
        ));
    }
    if degraded > 0 {
        notes.push(format!("started degraded: {degraded} of {raid_disks} roles without an in-sync member"));
    }
    if forced {
        notes.push("stale member(s) forced in: resync from sector 0".to_string());
    } else if forced_clean {
        notes.push(format!(
            "dirty and degraded, started with --force: marked clean as mdadm does (stripes written at the \
             unclean shutdown may hold stale parity for the {degraded} missing member(s))"
        ));
    } else if resync_cp != MAX_SECTOR {
        notes.push(format!("unclean shutdown: resync from sector {resync_cp}"));
    }
    for (member, claimed, capped) in pers.reshape().map(|r| r.cap_recovered(&table)).unwrap_or_default() {
        tracing::warn!(array = name.as_str(), member, claimed, capped, "recovery_offset beyond the reshape position");
        notes.push(format!(
            "member {member}: recovery_offset {claimed} lies beyond what the reshape wrote on it; not trusted past sector {capped}"
        ));
    }
    for (r, m) in table.recovering() {
        notes.push(format!("member {} resumes rebuilding role {r} from sector {}", m.name(), m.recovery_offset()));
    }
    let info = ArrayInfo {
        name: name.clone(),
        level,
        raid_disks: refsb.raid_disks,
        layout: refsb.layout,
        chunk_sectors: refsb.chunk_sectors,
        member_size_sectors: refsb.size_sectors,
        uuid,
        set_name: refsb.name(),
        ctime: refsb.ctime,
        metadata: refsb.metadata_version(),
    };
    let core = ArrayCore::new(info, pers, table, refsb.events, resync_cp, bitmap);
    let array = Array::start(core, opts.start_frozen, Some(sink));
    array.set_left_out(refused.clone());
    tracing::info!(array = %name, level = level.name(), uuid = %format_uuid(&uuid), degraded, refused = refused.len(), "array assembled");
    Ok(Assembled { array, refused, notes })
}
