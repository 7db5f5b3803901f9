//! `mdadm --grow` for the changes that move no data (`format/grow.rs` plans them): the used
//! size per member, the internal bitmap, the number of raid1 mirrors, the level changes md
//! makes without moving data (takeovers, `format/takeover.rs`) — on a running array.
//!
//! ```text
//!  pause requests ─ refresh member sizes ─ plan (refusals change nothing) ─ stop at a
//!  checkpoint (clean superblocks) ─ re-read superblocks and bitmap, plan again ─ write bitmap
//!  areas, then superblocks with events + 1 (FUA) ─ assemble again from the same devices ─
//!  replace the running array ─ resume requests ─ add members (--add)
//! ```
//!
//! Requests issued meanwhile wait on the pause (none fails); the new array resyncs the grown
//! part, recovers spares into new mirrors, and serves the new size to new NBD connections.
//! A crash between the superblock writes leaves members with different event counts: the
//! freshest ones assemble and the others are stale (recovered like any stale member).

use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use mdkit_io::{BlockDeviceExt, WriteFlags};

use super::assemble::{AssembleOptions, Assembled, MemberDev, assemble, read_superblock};
use super::core::ArrayCore;
use super::grow_reshape::RestripeTarget;
use super::member::Member;
use super::{Array, Live, SlotTable};
use crate::format::METADATA_BLOCK_BYTES;
use crate::format::bitmap::BitmapSuper;
use crate::format::grow::{GrowChange, GrowPlan, PlanMember, plan};
use crate::format::superblock::Superblock;
use crate::format::takeover::LayoutChoice;
use crate::layout::Level;

/// What a grow did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrowReport {
    /// "size 261120 -> 523264 sectors per member, resync from sector 261120", ...
    pub summary: String,
    pub size_bytes_before: u64,
    pub size_bytes_after: u64,
}

/// Settings of the running array that assembly does not read from the superblocks.
pub(super) struct Settings {
    speed_min_kib: u64,
    speed_max_kib: u64,
    max_read_errors: u64,
    safe_mode_delay: std::time::Duration,
    clock: Arc<dyn super::Clock>,
    pub(super) frozen: bool,
}

impl Settings {
    pub(super) fn of(core: &ArrayCore) -> Settings {
        Settings {
            speed_min_kib: core.sync.speed_min_kib(),
            speed_max_kib: core.sync.speed_max_kib(),
            max_read_errors: core.max_read_errors(),
            safe_mode_delay: core.gate.safe_mode_delay(),
            clock: core.clock(),
            frozen: core.sync.is_frozen(),
        }
    }

    fn apply(&self, core: &ArrayCore) {
        core.sync.set_speed_min_kib(self.speed_min_kib);
        core.sync.set_speed_max_kib(self.speed_max_kib);
        core.set_max_read_errors(self.max_read_errors);
        core.gate.set_safe_mode_delay(self.safe_mode_delay);
        core.set_clock(self.clock.clone());
    }
}

pub(super) fn refused(e: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, e.to_string())
}

pub(super) fn member_err(array: &str, m: &str, what: &str, e: impl std::fmt::Display) -> io::Error {
    io::Error::other(format!("{array}: member {m}: {what}: {e}"))
}

/// The bitmap area (superblock and bits) of `sb`'s member, when it has a bitmap.
pub(super) async fn read_bitmap_area(array: &str, m: &Member, sb: &Superblock) -> io::Result<Option<Vec<u8>>> {
    let Some(sector) = sb.bitmap_sector() else { return Ok(None) };
    let dev = m.device();
    let head = dev
        .read_vec(sector * 512, METADATA_BLOCK_BYTES)
        .await
        .map_err(|e| member_err(array, m.name(), &format!("reading the bitmap at sector {sector}"), e))?;
    let bms = BitmapSuper::decode(&head).map_err(|e| member_err(array, m.name(), "bitmap superblock", e))?;
    // Sized from the array, as the kernel does (sync_size may be ahead after a cut grow).
    let domain = crate::format::validate::bitmap_sync_domain_sectors(sb).unwrap_or(0);
    let geo = crate::format::bitmap::BitmapGeometry::new(bms.chunk_bytes, domain)
        .map_err(|e| member_err(array, m.name(), "bitmap superblock", e))?;
    let area = dev
        .read_vec(sector * 512, geo.area_bytes() as usize)
        .await
        .map_err(|e| member_err(array, m.name(), &format!("reading the bitmap at sector {sector}"), e))?;
    Ok(Some(area))
}

/// raid10 near-2 -> raid0: the in-sync member in the odd role of each pair whose even role is
/// in sync too; refused when a pair has no in-sync member.
fn second_copies(slots: &SlotTable, raid_disks: usize) -> Result<Vec<String>, String> {
    let pairs = raid_disks / 2;
    if let Some(k) = (0..pairs).find(|k| slots.in_sync(2 * k).is_none() && slots.in_sync(2 * k + 1).is_none()) {
        return Err(format!("mirror pair {k} has no in-sync member"));
    }
    Ok((0..pairs)
        .filter(|k| slots.in_sync(2 * k).is_some())
        .filter_map(|k| slots.in_sync(2 * k + 1).map(|m| m.name().to_string()))
        .collect())
}

/// raid4 / parity-last raid5 -> raid0: the member in the parity (last) role, if any; refused
/// when a data role has no in-sync member.
fn parity_member(slots: &SlotTable, raid_disks: usize) -> Result<Vec<String>, String> {
    let parity = raid_disks - 1;
    if let Some(r) = (0..parity).find(|r| slots.in_sync(*r).is_none()) {
        return Err(format!("data role {r} has no in-sync member"));
    }
    Ok(slots.slot(parity).and_then(|s| s.member.as_ref()).map(|m| m.name().to_string()).into_iter().collect())
}

/// md refuses a takeover while a sync runs (reshape, recovery or a pending resync).
fn no_sync_running(core: &ArrayCore) -> Result<(), String> {
    if core.personality().reshape().is_some() {
        return Err("a reshape is running".into());
    }
    if !core.slots().recovering().is_empty() {
        return Err("a recovery is running; let it finish first".into());
    }
    if !super::is_in_sync(core) {
        return Err("a resync is pending; let it finish first".into());
    }
    Ok(())
}

/// [`no_sync_running`], and every role in sync, except a raid6 whose only missing role is Q's
/// (the one raid5 drops), a raid4/5 whose only missing role is parity and a raid10 down to one
/// copy of each pair (both raid0; [`Array::drop_members_for_raid0`] refuses spares before it
/// removes anything).
fn takeover_state(core: &ArrayCore, to: Level) -> Result<(), String> {
    no_sync_running(core)?;
    let slots = core.slots();
    let info = core.info();
    let n = info.raid_disks as usize;
    let missing: Vec<usize> = (0..n).filter(|r| slots.in_sync(*r).is_none()).collect();
    let q_only = info.level == Level::Raid6 && to == Level::Raid5 && missing == [n - 1];
    let halves = info.level == Level::Raid10
        && to == Level::Raid0
        && (0..n / 2).all(|k| slots.in_sync(2 * k).is_some() != slots.in_sync(2 * k + 1).is_some());
    let parity_only = matches!(info.level, Level::Raid4 | Level::Raid5) && to == Level::Raid0 && missing == [n - 1];
    if !missing.is_empty() && !q_only && !parity_only && !halves {
        return Err(format!("the array is degraded (roles {missing:?} missing); let recovery finish first"));
    }
    Ok(())
}

impl Array {
    /// `mdadm --grow` with one change (see the module documentation); `add` devices join
    /// as spares afterwards (`--grow --raid-devices N --add DEV`: the spare is recovered into
    /// the new mirror). Refusals (a level or change not implemented, shrinking, no room)
    /// change nothing.
    pub async fn grow(&self, change: GrowChange, add: Vec<MemberDev>) -> io::Result<GrowReport> {
        if !add.is_empty() && !matches!(change, GrowChange::RaidDevices(_) | GrowChange::Level { .. }) {
            return Err(refused(format!("{}: --add goes with --raid-devices or --level only", self.name())));
        }
        if self.is_stopped() {
            return Err(refused(format!("{}: cannot grow: the array was stopped", self.name())));
        }
        let info = self.info();
        if let GrowChange::RaidDevices(n) = change
            && super::grow_reshape::is_restripe(info.level, info.raid_disks, n)
        {
            let to = RestripeTarget { raid_disks: n, layout: info.layout, chunk_sectors: info.chunk_sectors };
            return self.start_reshape(to, add).await;
        }
        if let GrowChange::RaidDevices(n) = change
            && info.level == Level::Raid0
        {
            return self.restripe_raid0(n, add).await;
        }
        if let GrowChange::Restripe { layout, chunk_sectors } = change {
            if !matches!(info.level, Level::Raid4 | Level::Raid5 | Level::Raid6) {
                let why = "--chunk / --layout restripe raid4/5/6 only (raid0 and raid10 are not implemented yet)";
                return Err(refused(format!("{}: {why}, not {}", self.name(), info.level.name())));
            }
            let to = RestripeTarget {
                raid_disks: info.raid_disks,
                layout: layout.unwrap_or(info.layout),
                chunk_sectors: chunk_sectors.unwrap_or(info.chunk_sectors),
            };
            return self.start_reshape(to, add).await;
        }
        if let GrowChange::Level { level: Level::Raid0, .. } = change
            && matches!(info.level, Level::Raid10 | Level::Raid4 | Level::Raid5)
        {
            self.drop_members_for_raid0().await?;
        }
        let pause = self.pause.pause().await;
        let core = self.core();
        if let Some(why) = core.needs_check() {
            return Err(refused(format!("{}: cannot grow: the array needs a check: {why}", self.name())));
        }
        if core.is_broken() {
            return Err(refused(format!("{}: cannot grow a broken array", self.name())));
        }
        if let GrowChange::Level { level, .. } = change {
            takeover_state(&core, level)
                .map_err(|why| refused(format!("{}: cannot change the level: {why}", self.name())))?;
        }
        let working = core.slots().working_members();
        if matches!(change, GrowChange::Size { .. }) {
            for m in &working {
                m.device().refresh_size().map_err(|e| member_err(self.name(), m.name(), "re-reading its size", e))?;
            }
        }
        // Everything that can refuse runs before the array stops.
        self.plan_from(&working, working.iter().map(|m| m.superblock()).collect(), change).await?;
        let before = self.size_bytes();
        let settings = Settings::of(&core);
        let replacing = self.replacing().await?;
        let stopped = self.stop_core().await;
        let written = match stopped {
            Ok(()) => self.rewrite(&working, change).await,
            Err(e) => Err(e),
        };
        let devs: Vec<MemberDev> = working.iter().map(|m| MemberDev::new(m.name(), m.device().clone())).collect();
        let opts = AssembleOptions {
            name: self.name().to_string(),
            uuid: Some(core.info().uuid),
            force: false,
            start_frozen: settings.frozen,
        };
        match assemble(devs, opts).await {
            Ok(a) => self.take_over(a, &settings, replacing),
            Err(e) => {
                let why = format!("grow: assembling the array again failed: {e}");
                core.set_needs_check(why.clone());
                return Err(io::Error::other(format!("{}: {why}", self.name())));
            }
        }
        drop(pause);
        let summary = written?;
        for d in add {
            self.add_member(d).await?;
        }
        tracing::info!(array = self.name(), "grown: {summary}");
        Ok(GrowReport { summary, size_bytes_before: before, size_bytes_after: self.size_bytes() })
    }

    /// raid0 to more members as mdadm does it (the kernel has no raid0 reshape): a takeover
    /// to raid4 with the parity role empty, a forward restripe to `n` data members where the
    /// first new device fills the old geometry's parity role (recovered by the reshape) and the
    /// new parity role stays empty, then, once the reshape finishes, a takeover back to raid0
    /// ([`Array::wait_reshape`]). A refusal of the restripe takes the array back to raid0.
    async fn restripe_raid0(&self, n: u32, add: Vec<MemberDev>) -> io::Result<GrowReport> {
        let info = self.info();
        let refuse = |why: String| refused(format!("{}: cannot grow raid0 to {n} members: {why}", self.name()));
        if n < info.raid_disks {
            return Err(refuse("md cannot take members out of raid0 (move the data to a smaller array)".into()));
        }
        if add.len() != (n - info.raid_disks) as usize {
            return Err(refuse(format!("give exactly {} new device(s) with --add", n - info.raid_disks)));
        }
        let before = self.size_bytes();
        let to_raid4 = GrowChange::Level { level: Level::Raid4, layout: LayoutChoice::Default };
        Box::pin(self.grow(to_raid4, Vec::new())).await.map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("{}: cannot grow raid0 to {n} members: the step to raid4: {e}", self.name()),
            )
        })?;
        let to = RestripeTarget { raid_disks: n + 1, layout: self.info().layout, chunk_sectors: info.chunk_sectors };
        *self.after_reshape.lock() = Some(Level::Raid0);
        match self.start_reshape(to, add).await {
            Ok(r) => {
                let summary =
                    format!("raid0 -> raid4 (parity role empty), {}; raid0 again when it finishes", r.summary);
                Ok(GrowReport { summary, size_bytes_before: before, size_bytes_after: self.size_bytes() })
            }
            Err(e) => {
                self.after_reshape.lock().take();
                let back = GrowChange::Level { level: Level::Raid0, layout: LayoutChoice::Default };
                if let Err(b) = Box::pin(self.grow(back, Vec::new())).await {
                    tracing::error!(
                        array = self.name(),
                        "the restripe was refused, and going back to raid0 failed: {b}"
                    );
                }
                Err(e)
            }
        }
    }

    /// The level the array goes to once its reshape finishes (a raid0 restripe: raid0).
    pub fn level_after_reshape(&self) -> Option<Level> {
        *self.after_reshape.lock()
    }

    /// Sets [`Array::level_after_reshape`] again after a restart (the service keeps it beside
    /// the array); only while a reshape runs.
    pub fn set_level_after_reshape(&self, level: Level) -> io::Result<()> {
        if self.core().personality().reshape().is_none() {
            return Err(refused(format!("{}: no reshape runs to change the level after", self.name())));
        }
        *self.after_reshape.lock() = Some(level);
        Ok(())
    }

    /// After a finished reshape: the level change the grow that started it asked for.
    pub(super) async fn change_level_after_reshape(&self) -> io::Result<()> {
        let Some(level) = self.after_reshape.lock().take() else { return Ok(()) };
        let r = self.grow(GrowChange::Level { level, layout: LayoutChoice::Default }, Vec::new()).await?;
        tracing::info!(array = self.name(), "after the reshape: {}", r.summary);
        Ok(())
    }

    /// What a takeover to raid0 needs first, as mdadm prepares it (remove_disks_for_takeover):
    /// a raid10 near-2 keeps one copy of each mirror pair (where both are in sync, the one in
    /// the odd role is failed and removed), a raid4 / parity-last raid5 loses its parity
    /// member. Checks first (the shape, nothing running, no spares, every data block kept), so
    /// a refusal changes nothing.
    async fn drop_members_for_raid0(&self) -> io::Result<()> {
        let core = self.core();
        let info = core.info().clone();
        let why = |w: String| refused(format!("{}: cannot change the level: {w}", self.name()));
        let has_bitmap = core.bitmap.is_some();
        match info.level {
            Level::Raid10 => crate::format::takeover::raid10_to_raid0_shape(info.layout, info.raid_disks, has_bitmap),
            _ => crate::format::takeover::parity_last_to_raid0_shape(info.level, info.layout, has_bitmap),
        }
        .map_err(why)?;
        no_sync_running(&core).map_err(why)?;
        let slots = core.slots();
        if !slots.spares().is_empty() {
            return Err(why("raid0 has no spares; remove the spares first".into()));
        }
        let n = info.raid_disks as usize;
        let drop = match info.level {
            Level::Raid10 => second_copies(&slots, n),
            _ => parity_member(&slots, n),
        }
        .map_err(why)?;
        for m in drop {
            tracing::info!(array = self.name(), member = m.as_str(), "removing it before the takeover to raid0");
            self.fail_member(&m).await?;
            self.remove_member(&m).await?;
        }
        Ok(())
    }

    async fn plan_from(
        &self,
        working: &[Arc<Member>],
        sbs: Vec<Superblock>,
        change: GrowChange,
    ) -> io::Result<GrowPlan> {
        let members: Vec<PlanMember> = working
            .iter()
            .zip(sbs)
            .map(|(m, sb)| PlanMember {
                name: m.name().to_string(),
                sb,
                device_sectors: m.device().topology().size_bytes / 512,
            })
            .collect();
        let area = match (working.first(), members.first()) {
            (Some(m), Some(pm)) => read_bitmap_area(self.name(), m, &pm.sb).await?,
            _ => None,
        };
        plan(self.name(), &members, area.as_deref(), change).map_err(refused)
    }

    /// With the array stopped: plans on the superblocks as written at the stop and writes the
    /// new metadata (bitmap areas, then superblocks with one more event, FUA, flushed).
    async fn rewrite(&self, working: &[Arc<Member>], change: GrowChange) -> io::Result<String> {
        let mut sbs = Vec::with_capacity(working.len());
        for m in working {
            let sb =
                read_superblock(m.device()).await.map_err(|e| member_err(self.name(), m.name(), "superblock", e))?;
            sbs.push(sb);
        }
        let events = sbs.iter().map(|s| s.events).max().unwrap_or(0).saturating_add(1);
        let p = self.plan_from(working, sbs, change).await?;
        if let Some(area) = &p.bitmap {
            let mut area = area.clone();
            let mut bms = BitmapSuper::decode(&area).map_err(refused)?;
            bms.events = events;
            bms.write_header(&mut area).map_err(refused)?;
            for (m, sb) in working.iter().zip(&p.superblocks) {
                let Some(sector) = sb.bitmap_sector() else { continue };
                m.device().write_slice(sector * 512, &area, WriteFlags::FUA).await.map_err(|e| {
                    member_err(self.name(), m.name(), &format!("writing the bitmap at sector {sector}"), e)
                })?;
            }
        }
        for (m, sb) in working.iter().zip(&p.superblocks) {
            let mut sb = sb.clone();
            sb.events = events;
            sb.utime = super::sb::now_md_time();
            let block = sb.encode().map_err(|e| member_err(self.name(), m.name(), "superblock", e))?;
            m.device()
                .write_slice(sb.super_offset_sectors * 512, &block, WriteFlags::FUA)
                .await
                .map_err(|e| member_err(self.name(), m.name(), "writing the superblock", e))?;
            m.device().flush().await.map_err(|e| member_err(self.name(), m.name(), "flush", e))?;
        }
        Ok(p.summary)
    }

    /// Moves the newly assembled array's core and tasks into this handle.
    /// `replacing` (from [`Array::replacing`]) is released once the new core is in place.
    pub(super) fn take_over(&self, a: Assembled, settings: &Settings, replacing: tokio::sync::MutexGuard<'_, bool>) {
        let new = a.array;
        new.detached.store(true, Ordering::Release);
        let live = {
            let mut l = new.live.write();
            Live { core: l.core.clone(), topology: l.topology, tasks: std::mem::take(&mut l.tasks) }
        };
        settings.apply(&live.core);
        {
            let mut left = self.left_out.lock();
            for r in a.refused.into_iter().chain(dropped_faulty(&self.core(), &live.core)) {
                left.retain(|x| x.member != r.member);
                left.push(r);
            }
        }
        drop(new);
        *self.live.write() = live;
        drop(replacing);
        self.kick_sync();
    }
}

/// The faulty members of `old` the reassembly (grow, a reshape's start or end) left behind (it
/// assembles the working members only): listed as left out, so the operator can remove or add
/// them again.
fn dropped_faulty(old: &ArrayCore, new: &ArrayCore) -> Vec<super::Refusal> {
    let kept: Vec<String> = new.slots().all_members().iter().map(|m| m.name().to_string()).collect();
    old.slots()
        .all_members()
        .iter()
        .filter(|m| m.is_faulty() && !kept.iter().any(|k| k == m.name()))
        .map(|m| super::Refusal {
            member: m.name().to_string(),
            reason: "faulty before the array was assembled again (by a grow or at the end of a reshape); --add it \
                     (--re-add only takes it back when its bitmap covers what it missed)"
                .into(),
        })
        .collect()
}
