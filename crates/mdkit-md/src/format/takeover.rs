//! Level changes that move no data: md's takeovers (md.c level_store → the personality's
//! takeover; md-lifecycle.md section 3.1). Pure: superblocks in, superblocks out.
//!
//! ```text
//!  raid0, n members, 1 zone  -> raid4 / raid5 parity-last, n + 1 members
//!                                                                 (parity on the new last role,
//!                                                                  empty until a spare recovers it)
//!  raid0, n members, 1 zone  -> raid10 near-2, 2n members       (old role i becomes 2i; the odd
//!                                                                  roles empty until spares recover
//!                                                                  them)
//!  raid10 near-2, 2n members, one of each pair left -> raid0, n members (role 2i or 2i+1 -> i)
//!  raid4 / raid5 parity-last, n members, parity role empty -> raid0, n - 1 members
//!  raid1, 2 members          -> raid5 left-symmetric, 2 members  (a 2-member raid5 is a mirror)
//!  raid5, 2 members          -> raid1                            (any layout and chunk)
//!  raid4                     -> raid5 parity-last                (the same blocks)
//!  raid5 parity-last         -> raid4
//!  raid5 layout L, n members -> raid6 layout L-6, n + 1 members  (Q alone on the new last role,
//!                                                                  empty until a spare recovers it)
//!  raid6 layout L-6 or parity-last, n members -> raid5 layout L, n - 1 members
//!                                                                 (the Q member becomes a spare)
//! ```
//! Kernel rules kept: raid45_takeover_raid0's single zone (every member's data rounded down to
//! the chunk the same: the raid0 then holds exactly the data blocks of a parity-last raid4
//! whose parity member is missing) and size (that rounded size); raid0_takeover_raid45 and
//! raid0_takeover_raid10 the other way (raid0's data size per member becomes the used size); raid5_takeover_raid1's chunk
//! (64 KiB, halved until it divides the array, at least 4 KiB); raid6_takeover's 3..=253
//! members; the "-6" layout numbers (raid5 0..=4 → 16..=20, parity-last stays 5). Every
//! member's superblock gets the new level, layout, chunk, member count and roles; the events,
//! bitmap and data are untouched (the writer bumps events).
//!
//! A cut while the superblocks are written leaves some members one event behind at the old
//! level. Nothing moved, so assembly takes such a member into the new level
//! ([`is_takeover_of`]) instead of leaving it out as a geometry mismatch.

#[cfg(test)]
use super::superblock::ROLE_FAULTY;
use super::superblock::{ROLE_MAX, ROLE_SPARE, Superblock, feature};
use crate::layout::Level;
use crate::layout::names::RAID10_DEFAULT_LAYOUT;
use crate::layout::names::algorithm as alg;

/// The layout asked for with the level (`--layout`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayoutChoice {
    /// No `--layout`.
    Default,
    /// `--layout preserve`: raid5 -> raid6 keeps the raid5 layout with Q on the last member.
    Preserve,
    /// A layout number (parsed for the target level).
    Algorithm(u32),
}

/// How the roles move in a takeover.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoleMap {
    /// Roles stay; those past the new member count become spares.
    Keep,
    /// raid0 -> raid10 near-2: role i becomes 2i.
    Double,
    /// raid10 near-2 -> raid0: role 2i or 2i + 1 becomes i.
    Halve,
}

impl RoleMap {
    /// The new role of `role` (a role below `raid_disks` of the old geometry).
    fn map(self, role: u16, new_disks: u32) -> u16 {
        match self {
            RoleMap::Keep if u32::from(role) >= new_disks => ROLE_SPARE,
            RoleMap::Keep => role,
            RoleMap::Double => role * 2,
            RoleMap::Halve => role / 2,
        }
    }
}

/// md's raid10 near-2 layout (near_copies 2, far_copies 1): mdadm's default.
const RAID10_N2: u32 = RAID10_DEFAULT_LAYOUT;

/// What raid10 -> raid0 needs of the array's shape (raid0_takeover_raid10): near-2, an even
/// member count, and no bitmap (raid0 has none). The runtime checks it before it removes the
/// second copies, [`plan`] again on the superblocks.
pub fn raid10_to_raid0_shape(layout: u32, raid_disks: u32, has_bitmap: bool) -> Result<(), String> {
    if layout != RAID10_N2 || !raid_disks.is_multiple_of(2) {
        return Err(format!(
            "raid10 -> raid0 needs the near-2 layout (n2) on an even number of members, the array has layout {layout:#x} on {raid_disks}"
        ));
    }
    if has_bitmap {
        return Err("raid0 has no write-intent bitmap: remove it first (grow --bitmap none)".into());
    }
    Ok(())
}

/// What raid4/raid5 -> raid0 needs of the array's shape (raid0_takeover_raid45): parity on the
/// last member (raid4, or raid5 parity-last) and no bitmap (raid0 has none). The runtime checks
/// it before it fails and removes the parity member, [`plan`] again on the superblocks.
pub fn parity_last_to_raid0_shape(level: Level, layout: u32, has_bitmap: bool) -> Result<(), String> {
    if level == Level::Raid5 && layout != alg::PARITY_N {
        return Err(format!(
            "raid5 -> raid0 needs parity on the last member (layout parity-last), the array has layout {layout}; restripe with grow --layout parity-last first"
        ));
    }
    if has_bitmap {
        return Err("raid0 has no write-intent bitmap: remove it first (grow --bitmap none)".into());
    }
    Ok(())
}

/// The geometry after a takeover.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Takeover {
    pub level: Level,
    pub layout: u32,
    pub chunk_sectors: u32,
    pub raid_disks: u32,
    /// `size`: the used sectors per member.
    pub size_sectors: u64,
    pub roles: RoleMap,
}

/// raid5 algorithm -> its raid6 "-6" form (Q fixed on the last member), or None.
pub fn raid6_layout_of(raid5_layout: u32) -> Option<u32> {
    match raid5_layout {
        0..=4 => Some(raid5_layout + alg::LEFT_ASYMMETRIC_6),
        alg::PARITY_N => Some(alg::PARITY_N),
        _ => None,
    }
}

/// raid6 "-6" layout -> the raid5 algorithm it extends, or None (Q rotates: not a takeover).
pub fn raid5_layout_of(raid6_layout: u32) -> Option<u32> {
    match raid6_layout {
        alg::LEFT_ASYMMETRIC_6..=alg::PARITY_0_6 => Some(raid6_layout - alg::LEFT_ASYMMETRIC_6),
        alg::PARITY_N => Some(alg::PARITY_N),
        _ => None,
    }
}

/// raid5_takeover_raid1's chunk: 64 KiB, halved until it divides the array; None below 4 KiB.
fn mirror_chunk_sectors(array_sectors: u64) -> Option<u32> {
    let mut chunk = 128u32;
    while chunk >= 8 && !array_sectors.is_multiple_of(u64::from(chunk)) {
        chunk /= 2;
    }
    (chunk >= 8).then_some(chunk)
}

/// raid45_takeover_raid0 / raid10_takeover_raid0: one zone (the members' data, rounded down
/// to the chunk, all the same size), a chunk the new level accepts; the per-member size.
fn raid0_zone_sectors(chunk_sectors: u32, data_sizes: &[u64]) -> Result<u64, String> {
    if chunk_sectors < 8 || !chunk_sectors.is_power_of_two() {
        return Err(format!(
            "the new level needs a power-of-two chunk of at least 4 KiB, the raid0 has {} KiB",
            chunk_sectors / 2
        ));
    }
    let c = u64::from(chunk_sectors);
    let rounded: Vec<u64> = data_sizes.iter().map(|s| s / c * c).collect();
    match rounded.first() {
        None => Err("no member data sizes".into()),
        Some(first) if rounded.iter().any(|r| r != first) => Err(format!(
            "the raid0 has more than one zone (member data sizes {rounded:?} sectors after rounding to the chunk); md takes over single-zone raid0 only"
        )),
        Some(first) => Ok(*first),
    }
}

/// The takeover of the array `sb` describes to `to`, or why md refuses it. `data_sizes`: the
/// data size of each member holding a role (read for raid0, whose superblocks have no size).
pub fn plan(sb: &Superblock, to: Level, layout: LayoutChoice, data_sizes: &[u64]) -> Result<Takeover, String> {
    let from = Level::from_md_level(sb.level).ok_or_else(|| format!("level {} is not supported", sb.level))?;
    let n = sb.raid_disks;
    let size = sb.size_sectors;
    let t = |level, layout, chunk_sectors, raid_disks| Takeover {
        level,
        layout,
        chunk_sectors,
        raid_disks,
        size_sectors: size,
        roles: RoleMap::Keep,
    };
    let fixed = |want: u32, name: &str| match layout {
        LayoutChoice::Default | LayoutChoice::Preserve => Ok(()),
        LayoutChoice::Algorithm(l) if l == want => Ok(()),
        LayoutChoice::Algorithm(l) => Err(format!(
            "{} -> {} takes layout {name} ({want}), not {l}; change the layout afterwards",
            from.name(),
            to.name()
        )),
    };
    match (from, to) {
        (a, b) if a == b => Err(format!("the array is already {}", a.name())),
        (Level::Raid0, Level::Raid4 | Level::Raid5) => {
            fixed(alg::PARITY_N, "parity-last")?;
            if n + 1 > crate::format::create::MAX_DEVICES {
                return Err(format!("{n} members leave no role for parity"));
            }
            let size_sectors = raid0_zone_sectors(sb.chunk_sectors, data_sizes)?;
            Ok(Takeover { size_sectors, ..t(to, alg::PARITY_N, sb.chunk_sectors, n + 1) })
        }
        (Level::Raid0, Level::Raid10) => {
            fixed(RAID10_N2, "n2")?;
            if 2 * n > crate::format::create::MAX_DEVICES {
                return Err(format!("{n} members are too many to mirror"));
            }
            let size_sectors = raid0_zone_sectors(sb.chunk_sectors, data_sizes)?;
            Ok(Takeover { size_sectors, roles: RoleMap::Double, ..t(to, RAID10_N2, sb.chunk_sectors, 2 * n) })
        }
        (Level::Raid10, Level::Raid0) => {
            raid10_to_raid0_shape(sb.layout, n, sb.feature_map & feature::BITMAP_OFFSET != 0)?;
            if !matches!(layout, LayoutChoice::Default) {
                return Err("raid10 -> raid0 takes no layout".into());
            }
            let mut per_pair = vec![0u32; n as usize / 2];
            for &r in sb.dev_roles.iter().filter(|r| **r < ROLE_MAX && u32::from(**r) < n) {
                per_pair[usize::from(r) / 2] += 1;
            }
            if let Some(k) = per_pair.iter().position(|c| *c != 1) {
                return Err(format!(
                    "every mirror pair must be down to one member (pair {k}, roles {} and {}, has {})",
                    2 * k,
                    2 * k + 1,
                    per_pair[k]
                ));
            }
            Ok(Takeover { roles: RoleMap::Halve, ..t(to, 0, sb.chunk_sectors, n / 2) })
        }
        (Level::Raid4 | Level::Raid5, Level::Raid0) => {
            parity_last_to_raid0_shape(from, sb.layout, sb.feature_map & feature::BITMAP_OFFSET != 0)?;
            if !matches!(layout, LayoutChoice::Default) {
                return Err(format!("{} -> raid0 takes no layout", from.name()));
            }
            let held = |r: u32| sb.dev_roles.iter().any(|x| u32::from(*x) == r);
            if let Some(r) = (0..n - 1).find(|r| !held(*r)) {
                return Err(format!("data role {r} has no member: raid0 needs every data member"));
            }
            if held(n - 1) {
                return Err(format!("the parity member (role {}) must be failed and removed first", n - 1));
            }
            Ok(t(Level::Raid0, 0, sb.chunk_sectors, n - 1))
        }
        (Level::Raid1, Level::Raid5) => {
            if n != 2 {
                return Err(format!("raid1 -> raid5 needs exactly 2 mirrors, the array has {n}"));
            }
            fixed(alg::LEFT_SYMMETRIC, "left-symmetric")?;
            let chunk = mirror_chunk_sectors(sb.size_sectors).ok_or_else(|| {
                format!(
                    "the array size ({} sectors) is not a multiple of 4 KiB, so no raid5 chunk fits",
                    sb.size_sectors
                )
            })?;
            Ok(t(Level::Raid5, alg::LEFT_SYMMETRIC, chunk, 2))
        }
        (Level::Raid5, Level::Raid1) => {
            if n != 2 {
                return Err(format!("raid5 -> raid1 needs a 2-member raid5, the array has {n} members"));
            }
            if !matches!(layout, LayoutChoice::Default) {
                return Err("raid1 has no layout".into());
            }
            Ok(t(Level::Raid1, 0, 0, 2))
        }
        (Level::Raid4, Level::Raid5) => {
            fixed(alg::PARITY_N, "parity-last")?;
            Ok(t(Level::Raid5, alg::PARITY_N, sb.chunk_sectors, n))
        }
        (Level::Raid5, Level::Raid4) => {
            if sb.layout != alg::PARITY_N {
                return Err(format!("raid5 -> raid4 needs layout parity-last (5), the array has {}", sb.layout));
            }
            fixed(0, "default")?;
            Ok(t(Level::Raid4, 0, sb.chunk_sectors, n))
        }
        (Level::Raid5, Level::Raid6) => {
            if !(3..=253).contains(&n) {
                return Err(format!("raid5 -> raid6 needs 3 to 253 members, the array has {n}"));
            }
            let l6 = raid6_layout_of(sb.layout)
                .ok_or_else(|| format!("raid5 layout {} has no raid6 form with Q on the last member", sb.layout))?;
            match layout {
                LayoutChoice::Preserve => {}
                LayoutChoice::Algorithm(l) if l == l6 => {}
                _ => {
                    return Err(format!(
                        "mdkit converts raid5 to raid6 by adding Q on a new last member and keeping the raid5 layout (layout {l6}, mdadm's --layout=preserve); the restripe to a rotating-Q layout is not implemented: pass --layout preserve"
                    ));
                }
            }
            Ok(t(Level::Raid6, l6, sb.chunk_sectors, n + 1))
        }
        (Level::Raid6, Level::Raid5) => {
            let l5 = raid5_layout_of(sb.layout).ok_or_else(|| {
                format!(
                    "raid6 layout {} rotates Q over every member; only a raid6 with Q on the last member (a -6 layout or parity-last) becomes raid5",
                    sb.layout
                )
            })?;
            if let LayoutChoice::Algorithm(l) = layout
                && l != l5
            {
                return Err(format!("raid6 -> raid5 keeps layout {l5}, not {l}; change the layout afterwards"));
            }
            Ok(t(Level::Raid5, l5, sb.chunk_sectors, n - 1))
        }
        (a, b) => Err(format!("{} -> {} is not implemented", a.name(), b.name())),
    }
}

/// The geometry fields a takeover writes (`new_*` equal to them: no reshape follows).
fn set_geometry(sb: &mut Superblock, level: i32, layout: u32, chunk_sectors: u32, raid_disks: u32, size_sectors: u64) {
    (sb.level, sb.layout, sb.chunk_sectors, sb.raid_disks, sb.size_sectors) =
        (level, layout, chunk_sectors, raid_disks, size_sectors);
    (sb.new_level, sb.new_layout, sb.new_chunk_sectors, sb.delta_disks) = (level, layout, chunk_sectors, 0);
}

/// `sb` after the takeover: the new geometry, and its roles moved by the takeover's map.
pub fn apply(sb: &mut Superblock, t: &Takeover) {
    let old_disks = sb.raid_disks;
    for r in &mut sb.dev_roles {
        if *r < ROLE_MAX && u32::from(*r) < old_disks {
            *r = t.roles.map(*r, t.raid_disks);
        }
    }
    set_geometry(sb, t.level.md_level(), t.layout, t.chunk_sectors, t.raid_disks, t.size_sectors);
    if t.level == Level::Raid0 {
        // raid0 stripes over each member's data size: the kernel's takeovers set it to the
        // used size (rdev->sectors = dev_sectors), so the zone holds exactly the old data.
        sb.data_size_sectors = t.size_sectors;
    }
}

/// Whether `fresh` is `old` after one takeover round (one event later, nothing else changed):
/// the rule assembly uses to take a member that missed only that write into the new level.
pub fn is_takeover_of(old: &Superblock, fresh: &Superblock) -> bool {
    let quiet = |sb: &Superblock| sb.feature_map & feature::RESHAPE_ACTIVE == 0;
    if !quiet(old) || !quiet(fresh) || old.events.checked_add(1) != Some(fresh.events) {
        return false;
    }
    // raid0 superblocks carry no size: the takeover gave the zone's (checked below).
    let sized = |sb: &Superblock| if sb.level == 0 { fresh.size_sectors } else { sb.size_sectors };
    if (old.set_uuid, old.ctime, sized(old)) != (fresh.set_uuid, fresh.ctime, fresh.size_sectors) {
        return false;
    }
    let Some(to) = Level::from_md_level(fresh.level) else { return false };
    // raid1 has no layout, and raid10 -> raid0 takes none.
    let choice = match to {
        Level::Raid1 | Level::Raid0 => LayoutChoice::Default,
        _ => LayoutChoice::Algorithm(fresh.layout),
    };
    let Ok(mut t) = plan(old, to, choice, &[old.data_size_sectors]) else { return false };
    if old.level == 0 {
        // One member's data cannot show the zone; it must hold the size the takeover gave.
        if t.size_sectors < fresh.size_sectors {
            return false;
        }
        t.size_sectors = fresh.size_sectors;
    }
    let mut expect = old.clone();
    apply(&mut expect, &t);
    // Its own role where the takeover's map puts it.
    let role_kept = fresh.dev_roles.get(old.dev_number as usize) == expect.dev_roles.get(old.dev_number as usize);
    (expect.level, expect.layout, expect.chunk_sectors, expect.raid_disks, expect.size_sectors)
        == (fresh.level, fresh.layout, fresh.chunk_sectors, fresh.raid_disks, fresh.size_sectors)
        && role_kept
}

/// Assembly's rule for a cut during a takeover's superblock round: every member exactly one
/// takeover behind the freshest superblock gets the new geometry and roles in memory, as if
/// that write had landed (nothing moved, so its data is what the new level describes).
/// Returns the indices of the members adopted.
pub fn adopt(sbs: &mut [Superblock]) -> Vec<usize> {
    let Some(fresh) = sbs.iter().max_by_key(|sb| sb.events).cloned() else { return Vec::new() };
    let mut adopted = Vec::new();
    for (i, sb) in sbs.iter_mut().enumerate() {
        if !is_takeover_of(sb, &fresh) {
            continue;
        }
        set_geometry(sb, fresh.level, fresh.layout, fresh.chunk_sectors, fresh.raid_disks, fresh.size_sectors);
        if fresh.level == 0 {
            // As `apply`: raid0 stripes over the data size, which the takeover set to the used
            // size (a member whose data area grew, e.g. by a reshape, would split the zone).
            sb.data_size_sectors = fresh.size_sectors;
        }
        sb.dev_roles = fresh.dev_roles.clone();
        adopted.push(i);
    }
    adopted
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::create::{CreateRequest, InitialSync, plan as create_plan};

    fn sbs(level: Level, n: usize) -> Vec<Superblock> {
        let mut req = CreateRequest::new(level, vec![64 * 2048; n], [7; 16], 1_790_000_000);
        req.sync = InitialSync::AssumeClean;
        create_plan(&req).unwrap().members.into_iter().map(|m| m.superblock).collect()
    }

    #[test]
    fn mirror_becomes_a_two_member_raid5_and_back() {
        let m = sbs(Level::Raid1, 2);
        let t = plan(&m[0], Level::Raid5, LayoutChoice::Default, &[]).unwrap();
        assert_eq!((t.level, t.layout, t.raid_disks), (Level::Raid5, alg::LEFT_SYMMETRIC, 2));
        assert_eq!(m[0].size_sectors % u64::from(t.chunk_sectors), 0);
        assert!(t.chunk_sectors <= 128 && t.chunk_sectors >= 8);
        let mut r5 = m[0].clone();
        apply(&mut r5, &t);
        let back = plan(&r5, Level::Raid1, LayoutChoice::Default, &[]).unwrap();
        assert_eq!((back.level, back.layout, back.chunk_sectors, back.raid_disks), (Level::Raid1, 0, 0, 2));
        assert!(
            plan(&sbs(Level::Raid1, 3)[0], Level::Raid5, LayoutChoice::Default, &[]).unwrap_err().contains("exactly 2")
        );
    }

    #[test]
    fn chunk_halves_until_it_divides_the_array() {
        assert_eq!(mirror_chunk_sectors(128 * 1000), Some(128));
        assert_eq!(mirror_chunk_sectors(128 * 1000 + 32), Some(32));
        assert_eq!(mirror_chunk_sectors(128 * 1000 + 8), Some(8));
        assert_eq!(mirror_chunk_sectors(128 * 1000 + 4), None);
    }

    #[test]
    fn raid5_gains_q_on_a_new_last_member_and_loses_it_again() {
        let m = sbs(Level::Raid5, 3);
        let e = plan(&m[0], Level::Raid6, LayoutChoice::Default, &[]).unwrap_err();
        assert!(e.contains("--layout preserve"), "{e}");
        let t = plan(&m[0], Level::Raid6, LayoutChoice::Preserve, &[]).unwrap();
        assert_eq!((t.level, t.layout, t.raid_disks), (Level::Raid6, alg::LEFT_SYMMETRIC_6, 4));
        let mut r6 = m[2].clone();
        apply(&mut r6, &t);
        r6.events += 1;
        assert!(is_takeover_of(&m[0], &r6));
        // Back: the member in role 3 (Q) becomes a spare.
        r6.dev_roles[3] = 3;
        let back = plan(&r6, Level::Raid5, LayoutChoice::Default, &[]).unwrap();
        assert_eq!((back.layout, back.raid_disks), (alg::LEFT_SYMMETRIC, 3));
        let mut r5 = r6.clone();
        apply(&mut r5, &back);
        assert_eq!(r5.dev_roles[3], ROLE_SPARE);
        assert_eq!(&r5.dev_roles[..3], &[0, 1, 2]);
        // A rotating-Q raid6 is not a takeover.
        let e = plan(&sbs(Level::Raid6, 4)[0], Level::Raid5, LayoutChoice::Default, &[]).unwrap_err();
        assert!(e.contains("rotates Q"), "{e}");
    }

    #[test]
    fn raid4_and_parity_last_raid5_are_the_same_blocks() {
        let m = sbs(Level::Raid4, 3);
        let t = plan(&m[0], Level::Raid5, LayoutChoice::Default, &[]).unwrap();
        assert_eq!((t.layout, t.chunk_sectors), (alg::PARITY_N, m[0].chunk_sectors));
        let mut r5 = m[0].clone();
        apply(&mut r5, &t);
        assert_eq!(plan(&r5, Level::Raid4, LayoutChoice::Default, &[]).unwrap().layout, 0);
        let e = plan(&sbs(Level::Raid5, 3)[0], Level::Raid4, LayoutChoice::Default, &[]).unwrap_err();
        assert!(e.contains("parity-last"), "{e}");
    }

    #[test]
    fn parity_last_raid_without_its_parity_member_becomes_raid0() {
        let mut m = sbs(Level::Raid5, 4);
        let e = plan(&m[0], Level::Raid0, LayoutChoice::Default, &[]).unwrap_err();
        assert!(e.contains("parity-last"), "{e}");
        for sb in &mut m {
            sb.layout = alg::PARITY_N;
            sb.feature_map &= !feature::BITMAP_OFFSET;
        }
        let e = plan(&m[0], Level::Raid0, LayoutChoice::Default, &[]).unwrap_err();
        assert!(e.contains("parity member (role 3) must be failed and removed first"), "{e}");
        let parity = m[0].dev_roles.iter().position(|r| *r == 3).unwrap();
        m[0].dev_roles[parity] = ROLE_FAULTY;
        let t = plan(&m[0], Level::Raid0, LayoutChoice::Default, &[]).unwrap();
        assert_eq!((t.level, t.raid_disks, t.chunk_sectors), (Level::Raid0, 3, m[0].chunk_sectors));
        let mut r0 = m[0].clone();
        apply(&mut r0, &t);
        assert_eq!(r0.data_size_sectors, m[0].size_sectors, "raid0 stripes over exactly the used size");
        let mut with_bitmap = m[0].clone();
        with_bitmap.feature_map |= feature::BITMAP_OFFSET;
        let e = plan(&with_bitmap, Level::Raid0, LayoutChoice::Default, &[]).unwrap_err();
        assert!(e.contains("bitmap"), "{e}");
    }

    #[test]
    fn single_zone_raid0_gains_a_parity_member() {
        let m = sbs(Level::Raid0, 3);
        assert_eq!(m[0].size_sectors, 0);
        let data: Vec<u64> = m.iter().map(|sb| sb.data_size_sectors).collect();
        let t = plan(&m[0], Level::Raid5, LayoutChoice::Default, &data).unwrap();
        let c = u64::from(m[0].chunk_sectors);
        assert_eq!(
            (t.level, t.layout, t.raid_disks, t.size_sectors),
            (Level::Raid5, alg::PARITY_N, 4, data[0] / c * c)
        );
        let t4 = plan(&m[0], Level::Raid4, LayoutChoice::Default, &data).unwrap();
        assert_eq!((t4.layout, t4.raid_disks), (alg::PARITY_N, 4));
        let e = plan(&m[0], Level::Raid5, LayoutChoice::Default, &[data[0], data[1], data[2] + c]).unwrap_err();
        assert!(e.contains("more than one zone"), "{e}");
        let mut fresh = m[1].clone();
        apply(&mut fresh, &t);
        fresh.events += 1;
        assert!(is_takeover_of(&m[0], &fresh));
        let mut all = vec![m[0].clone(), fresh.clone()];
        assert_eq!(adopt(&mut all), vec![0]);
        assert_eq!((all[0].level, all[0].size_sectors, all[0].raid_disks), (5, t.size_sectors, 4));
    }

    #[test]
    fn raid0_mirrors_into_raid10_near2_and_back() {
        let m = sbs(Level::Raid0, 2);
        let data: Vec<u64> = m.iter().map(|sb| sb.data_size_sectors).collect();
        let t = plan(&m[1], Level::Raid10, LayoutChoice::Default, &data).unwrap();
        assert_eq!((t.layout, t.raid_disks, t.roles), (RAID10_N2, 4, RoleMap::Double));
        let mut r10 = m[1].clone();
        apply(&mut r10, &t);
        assert_eq!(&r10.dev_roles[..2], &[0, 2], "old role i becomes 2i");
        r10.events += 1;
        assert!(is_takeover_of(&m[0], &r10));
        // Back: both copies of pair 0 present is refused; one of each pair left maps 2i+1 -> i.
        let mut both = r10.clone();
        both.dev_roles.extend([1, 3]);
        let e = plan(&both, Level::Raid0, LayoutChoice::Default, &[]).unwrap_err();
        assert!(e.contains("pair 0"), "{e}");
        let mut halves = r10.clone();
        halves.dev_roles = vec![ROLE_FAULTY, 2, 1, ROLE_FAULTY];
        let back = plan(&halves, Level::Raid0, LayoutChoice::Default, &[]).unwrap();
        assert_eq!((back.raid_disks, back.roles), (2, RoleMap::Halve));
        let mut r0 = halves.clone();
        apply(&mut r0, &back);
        assert_eq!(r0.dev_roles, vec![ROLE_FAULTY, 1, 0, ROLE_FAULTY]);
        r0.events += 1;
        let mut old = halves.clone();
        old.dev_number = 1;
        assert!(is_takeover_of(&old, &r0), "a raid10 member one round behind joins the raid0");
        let mut with_bitmap = halves.clone();
        with_bitmap.feature_map |= feature::BITMAP_OFFSET;
        let e = plan(&with_bitmap, Level::Raid0, LayoutChoice::Default, &[]).unwrap_err();
        assert!(e.contains("raid0 has no write-intent bitmap"), "{e}");
    }

    #[test]
    fn only_one_round_apart_counts_as_a_takeover() {
        let m = sbs(Level::Raid1, 2);
        let t = plan(&m[0], Level::Raid5, LayoutChoice::Default, &[]).unwrap();
        let mut fresh = m[1].clone();
        apply(&mut fresh, &t);
        assert!(!is_takeover_of(&m[0], &fresh), "same events");
        fresh.events += 1;
        assert!(is_takeover_of(&m[0], &fresh));
        fresh.events += 1;
        assert!(!is_takeover_of(&m[0], &fresh), "two rounds apart");
        fresh.events -= 1;
        // And back: a raid5 member one round behind the raid1 one.
        let mut r1 = m[0].clone();
        r1.events = fresh.events + 1;
        assert!(is_takeover_of(&fresh, &r1));
        let mut all = vec![m[0].clone(), fresh.clone()];
        assert_eq!(adopt(&mut all), vec![0]);
        assert_eq!((all[0].level, all[0].layout, all[0].chunk_sectors), (5, fresh.layout, fresh.chunk_sectors));
        fresh.size_sectors -= 8;
        assert!(!is_takeover_of(&m[0], &fresh), "size changed");
    }
}
