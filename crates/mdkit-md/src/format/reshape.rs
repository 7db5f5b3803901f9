//! The reshape state of a v1.x superblock (RESHAPE_ACTIVE), decoded and checked against the
//! kernel's limits (md.c super_1_load / super_1_validate, raid5.c raid5_run, raid10.c
//! raid10_run; summarised in md-lifecycle.md section 1).
//!
//! ```text
//!  field             while RESHAPE_ACTIVE                         refused when
//!  level/new_level   equal (a level change is a takeover)         they differ; level not 4/5/6/10
//!  raid_disks        the NEW count                                old = raid_disks - delta_disks
//!  delta_disks       new - old (s32)                              old count below the level minimum
//!  layout/chunksize  the OLD values                                or beyond max_dev
//!  new_layout/chunk  the NEW values                               not a layout / chunk the level knows
//!  reshape_position  array sector; forward: below is new geometry  beyond the array, or not a multiple
//!                    backward: above is new geometry               of max(chunks) x new data disks
//!  new_offset        new_data_offset - data_offset (NEW_OFFSET)    growth with new_offset > 0, shrink
//!                                                                  with new_offset < 0, before sector 0
//!  RESHAPE_BACKWARDS direction when delta_disks == 0              -
//! ```
//! Stale reshape fields without RESHAPE_ACTIVE are ignored (the kernel does not clear them).

use super::superblock::{ROLE_MAX, ROLE_SPARE, Superblock, SuperblockError, feature};
use crate::layout::{Level, ParityGeometry, Raid10Geometry};

/// A decoded, validated reshape in progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReshapeState {
    pub level: Level,
    pub old_raid_disks: u32,
    pub new_raid_disks: u32,
    pub old_layout: u32,
    pub new_layout: u32,
    pub old_chunk_sectors: u32,
    pub new_chunk_sectors: u32,
    /// Array sector up to which (forward) or from which (backward) the new geometry holds.
    pub position_sectors: u64,
    /// `new_data_offset - data_offset` of this member (0 without NEW_OFFSET).
    pub new_offset_sectors: i64,
    /// The reshape runs from the end towards the start.
    pub backwards: bool,
}

/// md's reshape direction from a superblock's fields (super_1_validate): backwards with fewer
/// members, or over the same members when RESHAPE_BACKWARDS says so.
pub fn runs_backwards(sb: &Superblock) -> bool {
    sb.delta_disks < 0 || (sb.delta_disks == 0 && sb.feature_map & feature::RESHAPE_BACKWARDS != 0)
}

fn field(field: &'static str, value: impl std::fmt::Display, reason: impl Into<String>) -> SuperblockError {
    SuperblockError::Field { field, value: value.to_string(), reason: reason.into() }
}

impl ReshapeState {
    /// The reshape state of `sb`: `Ok(None)` when RESHAPE_ACTIVE is clear, an error naming the
    /// field when a value is outside what the kernel would run.
    pub fn from_superblock(sb: &Superblock) -> Result<Option<ReshapeState>, SuperblockError> {
        if sb.feature_map & feature::RESHAPE_ACTIVE == 0 {
            return Ok(None);
        }
        let level = match Level::from_md_level(sb.level) {
            Some(l @ (Level::Raid4 | Level::Raid5 | Level::Raid6 | Level::Raid10)) => l,
            _ => return Err(field("level", sb.level, "RESHAPE_ACTIVE on a level that cannot reshape")),
        };
        if sb.new_level != sb.level {
            let why = format!("differs from level {} (a level change is never persisted mid-reshape)", sb.level);
            return Err(field("new_level", sb.new_level, why));
        }
        let old = i64::from(sb.raid_disks) - i64::from(sb.delta_disks);
        let max = i64::from(sb.max_dev());
        if old < i64::from(level.min_raid_disks()) || old > max {
            let why = format!(
                "old member count {old} (raid_disks {} - delta_disks) must be {}..={max}",
                sb.raid_disks,
                level.min_raid_disks()
            );
            return Err(field("delta_disks", sb.delta_disks, why));
        }
        let state = ReshapeState {
            level,
            old_raid_disks: old as u32,
            new_raid_disks: sb.raid_disks,
            old_layout: sb.layout,
            new_layout: sb.new_layout,
            old_chunk_sectors: sb.chunk_sectors,
            new_chunk_sectors: sb.new_chunk_sectors,
            position_sectors: sb.reshape_position_sectors,
            new_offset_sectors: if sb.feature_map & feature::NEW_OFFSET != 0 {
                i64::from(sb.new_offset_sectors)
            } else {
                0
            },
            backwards: runs_backwards(sb),
        };
        state.check_geometries()?;
        state.check_position(sb.size_sectors)?;
        state.check_offset(sb)?;
        Ok(Some(state))
    }

    fn check_geometries(&self) -> Result<(), SuperblockError> {
        if let Some(why) = self.geometry_problem(self.old_raid_disks, self.old_layout, self.old_chunk_sectors) {
            return Err(field("delta_disks", self.new_raid_disks as i64 - self.old_raid_disks as i64, why));
        }
        let new = self.geometry_problem(self.new_raid_disks, self.new_layout, self.new_chunk_sectors);
        if let Some(why) = new {
            let value = format!("{:#x}/{}", self.new_layout, self.new_chunk_sectors);
            return Err(field("new_layout/new_chunk", value, why));
        }
        Ok(())
    }

    fn geometry_problem(&self, disks: u32, layout: u32, chunk: u32) -> Option<String> {
        match self.level {
            Level::Raid10 => Raid10Geometry::new(disks, layout, chunk, 0).err().map(|e| e.to_string()),
            _ => ParityGeometry::new(self.level, disks, layout, chunk).err().map(|e| e.to_string()),
        }
    }

    /// Data members per stripe before and after.
    pub fn data_disks(&self) -> (u64, u64) {
        let parity = u64::from(self.level.max_degraded());
        match self.level {
            Level::Raid10 => (u64::from(self.old_raid_disks), u64::from(self.new_raid_disks)),
            _ => (u64::from(self.old_raid_disks) - parity, u64::from(self.new_raid_disks) - parity),
        }
    }

    /// Sectors per member of the new geometry that `array_sectors` from the start occupy
    /// (md's `sync_completed` units during a reshape; raid10 counts its copies).
    pub fn new_member_sectors(&self, array_sectors: u64) -> u64 {
        match self.level {
            Level::Raid10 => {
                let near = u128::from(self.new_layout & 0xff).max(1);
                let n = u128::from(self.new_raid_disks).max(1);
                (u128::from(array_sectors) * near / n) as u64
            }
            _ => array_sectors / self.data_disks().1,
        }
    }

    /// The reshape step (array sectors) positions are multiples of: max chunk x new data disks.
    pub fn step_sectors(&self) -> u64 {
        u64::from(self.old_chunk_sectors.max(self.new_chunk_sectors)) * self.data_disks().1
    }

    fn check_position(&self, size_sectors: u64) -> Result<(), SuperblockError> {
        let (old_d, new_d) = self.data_disks();
        let end = size_sectors.saturating_mul(old_d.max(new_d));
        let pos = self.position_sectors;
        if pos > end {
            return Err(field("reshape_position", pos, format!("beyond the array end at sector {end}")));
        }
        if self.level != Level::Raid10 && !pos.is_multiple_of(self.step_sectors()) {
            let why = format!("not on a stripe boundary (a multiple of {} sectors)", self.step_sectors());
            return Err(field("reshape_position", pos, why));
        }
        Ok(())
    }

    fn check_offset(&self, sb: &Superblock) -> Result<(), SuperblockError> {
        let off = self.new_offset_sectors;
        let grow = self.new_raid_disks > self.old_raid_disks;
        let shrink = self.new_raid_disks < self.old_raid_disks;
        if (grow && off > 0) || (shrink && off < 0) {
            let why = if grow { "growing moves data towards the start" } else { "shrinking moves data up" };
            return Err(field("new_offset", off, format!("wrong direction: {why}")));
        }
        if sb.data_offset_sectors.checked_add_signed(off).is_none() {
            return Err(field(
                "new_offset",
                off,
                format!("moves data_offset {} before sector 0", sb.data_offset_sectors),
            ));
        }
        Ok(())
    }

    /// The new data offset of a member whose superblock carried this state.
    pub fn new_data_offset(&self, data_offset_sectors: u64) -> u64 {
        data_offset_sectors.saturating_add_signed(self.new_offset_sectors)
    }
}

/// md_finish_reshape on one superblock: the new geometry (data offset, layout, chunk) becomes
/// the geometry, the reshape fields are cleared, `reshape_position` says `end_sectors`; a member
/// the reshape recovered (RECOVERY_OFFSET: it filled an empty role of the old geometry) is in
/// sync (end_reshape raises every such recovery_offset to the end).
pub fn finish_superblock(sb: &mut Superblock, end_sectors: u64) {
    sb.feature_map &= !feature::RECOVERY_OFFSET;
    sb.recovery_offset_sectors = 0;
    if let Some(new) = sb.new_data_offset_sectors() {
        let old = sb.data_offset_sectors;
        sb.data_size_sectors = (sb.data_size_sectors + old).saturating_sub(new);
        sb.data_offset_sectors = new;
    }
    sb.feature_map &= !(feature::RESHAPE_ACTIVE | feature::NEW_OFFSET | feature::RESHAPE_BACKWARDS);
    sb.layout = sb.new_layout;
    sb.chunk_sectors = sb.new_chunk_sectors;
    sb.delta_disks = 0;
    sb.new_offset_sectors = 0;
    sb.reshape_position_sectors = end_sectors;
}

/// raid5_finish_reshape / raid10_finish_reshape after a shrink: the members in roles the
/// array no longer has (at or beyond `raid_disks`) become spares.
pub fn drop_removed_roles(sb: &mut Superblock) {
    for role in sb.dev_roles.iter_mut() {
        if *role < ROLE_MAX && u32::from(*role) >= sb.raid_disks {
            *role = ROLE_SPARE;
        }
    }
}

/// Assembly's rule for a cut in the superblock round that finishes a reshape: every moved
/// stripe was flushed before that round's first write, so a member still recording the
/// reshape, exactly one event behind a finished member whose geometry is this reshape's new
/// one (level, member count, layout, chunk, size, creation time; the same role, or a spare now
/// where the member held a role the array dropped), holds the new geometry on disk. It gets the
/// finished fields in memory, as if the write had landed; otherwise its old chunk or layout
/// would leave it out of the array, or (data moving up, to fewer members) its old data offset
/// would be read. (Data moving down, the old offset plus the move is where the member's data
/// starts anyway.) Returns the indexes adopted.
pub fn adopt_unfinished(sbs: &mut [Superblock]) -> Vec<usize> {
    let finished = |sb: &Superblock| sb.feature_map & feature::RESHAPE_ACTIVE == 0;
    let Some(f) = sbs.iter().filter(|sb| finished(sb)).max_by_key(|sb| sb.events).cloned() else {
        return Vec::new();
    };
    let mut adopted = Vec::new();
    for (i, sb) in sbs.iter_mut().enumerate() {
        let role_now = f.dev_roles.get(sb.dev_number as usize).copied();
        let role_kept = role_now == Some(sb.raw_role())
            || (role_now == Some(ROLE_SPARE) && sb.raw_role() < ROLE_MAX && u32::from(sb.raw_role()) >= f.raid_disks);
        let missed_only_the_finish = sb.feature_map & feature::RESHAPE_ACTIVE != 0
            && sb.events.checked_add(1) == Some(f.events)
            && (sb.level, sb.new_level, sb.raid_disks, sb.size_sectors, sb.ctime)
                == (f.level, f.level, f.raid_disks, f.size_sectors, f.ctime)
            && (sb.new_layout, sb.new_chunk_sectors) == (f.layout, f.chunk_sectors)
            && (sb.delta_disks != 0 || (sb.layout, sb.chunk_sectors) != (f.layout, f.chunk_sectors))
            && role_kept
            && ReshapeState::from_superblock(sb).is_ok_and(|st| st.is_some());
        if missed_only_the_finish {
            finish_superblock(sb, f.reshape_position_sectors);
            sb.dev_roles.clone_from(&f.dev_roles);
            adopted.push(i);
        }
    }
    adopted
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::create::{CreateRequest, InitialSync, plan};

    fn reshaping() -> Superblock {
        let mut req = CreateRequest::new(Level::Raid5, vec![64 * 2048; 5], [0x42; 16], 1_790_000_000);
        req.sync = InitialSync::AssumeClean;
        let mut sb = plan(&req).unwrap().members[1].superblock.clone();
        sb.feature_map |= feature::RESHAPE_ACTIVE | feature::NEW_OFFSET;
        sb.new_level = 5;
        sb.new_layout = sb.layout;
        sb.new_chunk_sectors = sb.chunk_sectors;
        sb.delta_disks = 1;
        sb.new_offset_sectors = -512;
        sb.reshape_position_sectors = u64::from(sb.chunk_sectors) * 4 * 3;
        sb
    }

    #[test]
    fn valid_state_decodes() {
        let sb = reshaping();
        let st = ReshapeState::from_superblock(&sb).unwrap().unwrap();
        assert_eq!((st.old_raid_disks, st.new_raid_disks), (4, 5));
        assert!(!st.backwards);
        assert_eq!(st.step_sectors(), u64::from(sb.chunk_sectors) * 4);
        let bytes = sb.encode().unwrap();
        assert_eq!(Superblock::decode(&bytes, sb.super_offset_sectors).unwrap().reshape_position_sectors, 12 * 1024);
    }

    #[test]
    fn crafted_states_are_refused_by_field() {
        type Edit = fn(&mut Superblock);
        let cases: Vec<(&str, Edit)> = vec![
            ("new_level", |s| s.new_level = 6),
            ("level", |s| s.level = 1),
            ("delta_disks", |s| s.delta_disks = 4),
            ("delta_disks", |s| s.delta_disks = i32::MIN),
            ("delta_disks", |s| s.delta_disks = -5000),
            ("new_layout", |s| s.new_layout = 99),
            ("new_chunk", |s| s.new_chunk_sectors = 3),
            ("reshape_position", |s| s.reshape_position_sectors = u64::MAX),
            ("reshape_position", |s| s.reshape_position_sectors = 8),
            ("new_offset", |s| s.new_offset_sectors = 64),
            ("new_offset", |s| s.new_offset_sectors = i32::MIN),
        ];
        for (name, edit) in cases {
            let mut sb = reshaping();
            edit(&mut sb);
            let err = ReshapeState::from_superblock(&sb).unwrap_err().to_string();
            assert!(err.contains(name), "{name}: {err}");
            // The strict decoder refuses the same bytes with the same field named.
            let bytes = sb.encode_unchecked();
            let err = Superblock::decode(&bytes, sb.super_offset_sectors).unwrap_err().to_string();
            assert!(err.contains(name) || err.contains("overlaps") || err.contains("level"), "{name}: {err}");
        }
    }

    /// A chunk restripe over the same 5 members, and the same superblock once finished.
    fn restriping_and_finished() -> (Superblock, Superblock) {
        let mut sb = reshaping();
        sb.delta_disks = 0;
        sb.new_chunk_sectors = sb.chunk_sectors * 2;
        sb.new_offset_sectors = -(sb.new_chunk_sectors as i32);
        sb.reshape_position_sectors = 0;
        sb.events = 10;
        let mut done = sb.clone();
        finish_superblock(&mut done, 4096);
        done.events += 1;
        (sb, done)
    }

    #[test]
    fn a_member_that_missed_the_finish_takes_the_new_geometry() {
        let (sb, done) = restriping_and_finished();
        assert_eq!((done.chunk_sectors, done.feature_map & feature::RESHAPE_ACTIVE), (sb.new_chunk_sectors, 0));
        assert_eq!(done.data_offset_sectors, sb.data_offset_sectors - u64::from(sb.new_chunk_sectors));
        let mut sbs = vec![done.clone(), sb.clone()];
        assert_eq!(adopt_unfinished(&mut sbs), vec![1]);
        let mut want = done.clone();
        want.events = sb.events;
        assert_eq!(sbs[1], want, "as if the finishing write had landed");
        // Two events behind, another chunk, another array's creation time: left as they are.
        type Edit = fn(&mut Superblock);
        let edits: [Edit; 3] = [|s| s.events -= 1, |s| s.new_chunk_sectors *= 2, |s| s.ctime += 1];
        for edit in edits {
            let mut other = sb.clone();
            edit(&mut other);
            let mut sbs = vec![done.clone(), other.clone()];
            assert!(adopt_unfinished(&mut sbs).is_empty());
            assert_eq!(sbs[1], other);
        }
    }

    #[test]
    fn inactive_fields_are_ignored() {
        let mut sb = reshaping();
        sb.feature_map &= !(feature::RESHAPE_ACTIVE | feature::NEW_OFFSET);
        sb.new_level = 77;
        assert_eq!(ReshapeState::from_superblock(&sb).unwrap(), None);
    }
}
