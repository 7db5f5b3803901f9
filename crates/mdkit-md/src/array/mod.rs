//! The md array runtime (docs/design/md-runtime.md): a running array is an
//! [`mdkit_io::BlockDevice`] with 4 KiB logical blocks over its members.
//!
//! ```text
//!  Array::write ─ validate ─ write gate ─ bitmap ─ region barrier ─ personality ─ settle failures
//!                 (bounds)   (mark dirty) (bits    (no sync work    (raid0/1/10,   (member failures
//!                            durably)     durable)  in the range)    raid5 later)   durable first)
//! ```
//!
//! | module            | what                                                              |
//! |-------------------|-------------------------------------------------------------------|
//! | [`personality`]   | the [`Personality`] trait each level implements                   |
//! | [`core`]          | [`ArrayCore`]: members, failure, checkpoints, needs-check         |
//! | [`member`], [`slots`] | member state; the role table, swapped on membership changes   |
//! | [`errors`]        | typed errors ([`MdError`]), the read-error policy counters, the clock |
//! | [`io`]            | member I/O wrappers (data offset, in-flight, fail on error)       |
//! | [`sb`]            | the superblock writer (events, dev_roles, offsets, checksum)      |
//! | [`gate`]          | dirty/clean transitions with `safe_mode_delay`                    |
//! | [`barrier`]       | the bucketed region barrier (sync vs writes)                      |
//! | [`behind`]        | write-behind: raid1 writes outstanding to write-mostly members    |
//! | [`sync`]          | resync / recover / check / repair engine, speed limits, progress  |
//! | [`assemble`], [`create`] | starting arrays from members, creating new ones            |
//! | [`grow`]          | `--grow` without restriping: size, bitmap, raid1 mirrors          |
//! | [`pause`]         | holding requests while `grow` swaps the running array (one atomic) |
//! | [`attrs`]         | md's sysfs-named attributes                                       |
//! | [`raid0`], [`raid1`], [`raid10`], [`raid5`] | the personalities (`raid5`: dispatch point) |
//! | [`bitmap`], [`flush`] | the write-intent bitmap; flush batching                    |
//!
//! An array must be created or assembled inside a tokio runtime: it runs two background tasks
//! (the array daemon: safe-mode clean marking and failure recording; the sync engine). Stop it
//! with [`Array::stop`] (checkpoints, flushes, marks clean); dropping it without `stop` is a
//! crash as far as the members are concerned.

pub mod assemble;
pub mod attrs;
pub mod badblocks;
pub mod barrier;
mod bblog;
pub mod behind;
pub mod bitmap;
pub mod core;
pub mod create;
pub mod errors;
/// Flush batching lives in the member I/O layer (file volumes use it too).
pub use mdkit_io::flush;
pub mod gate;
pub mod grow;
pub mod grow_reshape;
pub mod io;
pub mod member;
pub mod mirror;
pub mod pause;
pub mod personality;
pub mod raid0;
pub mod raid1;
pub mod raid10;
pub mod raid5;
pub mod reshape;
pub mod sb;
pub mod slots;
pub mod sync;

use std::io as stdio;
use std::sync::Arc;
use std::time::Duration;

use mdkit_io::{BlockDevice, IoBuf, IoFuture, IoOp, ReadResult, SharedBuf, Topology, WriteFlags, ZeroFlags, check_io};
use parking_lot::Mutex;
use tokio::task::JoinHandle;

pub use self::assemble::{
    AssembleOptions, Assembled, MemberDev, PartialStart, Refusal, assemble, assemble_with, read_superblock,
};
pub use self::core::{ArrayCore, ArrayInfo};
pub use self::create::{CreateOptions, create, write_superblocks};
pub use self::errors::{Clock, ManualClock, MdError, MdErrorKind};
pub use self::grow::GrowReport;
pub use self::member::Member;
pub use self::personality::{Personality, SyncMode, SyncOutcome};
pub use self::slots::SlotTable;
pub use self::sync::SyncStatus;
pub use crate::format::grow::{BitmapChange, GrowChange, GrowSize};
pub use crate::format::takeover::LayoutChoice;

use self::member::flag;
use crate::format::superblock::{MAX_SECTOR, MetadataVersion, Superblock};

/// The array's logical block: md arrays are served with 4 KiB blocks (upstream lesson 1).
pub const ARRAY_BLOCK_BYTES: u32 = 4096;

/// A running md array. See the module documentation.
pub struct Array {
    array_name: String,
    /// The running array: `grow` replaces it (stop, rewrite the metadata, assemble again).
    live: parking_lot::RwLock<Live>,
    /// Every request and membership change holds this shared; `grow` holds it exclusively
    /// while it replaces the running array, so requests wait (they do not fail) meanwhile.
    pause: pause::Pause,
    name_for_device: String,
    /// Members assembly left out and why (until they are added or re-added).
    left_out: Mutex<Vec<Refusal>>,
    /// Its core and tasks moved into another handle (`grow`): dropping this one stops nothing.
    detached: std::sync::atomic::AtomicBool,
    /// md's `array_size` (`grow --array-size`): the size the array gives when below its
    /// personality's, in bytes (0: none). Not persisted, as in md; a grow keeps it.
    size_limit_bytes: std::sync::atomic::AtomicU64,
    /// The level to take the array to once its reshape finishes (a raid0 restripe runs as
    /// raid4 with the parity role empty, then goes back to raid0), as mdadm's `--grow` process
    /// does. In memory only, as in mdadm: after a restart `grow --level 0` finishes it.
    after_reshape: Mutex<Option<crate::layout::Level>>,
    /// True once the operator stopped the array ([`Array::stop`]). Whoever replaces the running
    /// core (grow, a reshape's start, the reassembly that ends a reshape) holds this lock from
    /// its stop to its take-over and refuses when it is set, so no array is assembled again
    /// after the operator's stop, and that stop waits for a replacement under way.
    closed: tokio::sync::Mutex<bool>,
}

/// What `grow` swaps: the core, the size it gives and its background tasks.
struct Live {
    core: Arc<ArrayCore>,
    topology: Topology,
    tasks: Vec<JoinHandle<()>>,
}

fn needs_check_error(core: &ArrayCore, reason: &str) -> stdio::Error {
    MdError::new(MdErrorKind::NeedsCheck, core.name(), "write", 0, format!("writes are refused: {reason}")).into()
}

impl Array {
    /// Starts the background tasks of an assembled core.
    pub(crate) fn start(core: ArrayCore, frozen: bool, bitmap_sink: Option<Arc<self::core::BitmapFailSink>>) -> Array {
        let core = Arc::new(core);
        core.set_arc();
        if let Some(sink) = bitmap_sink {
            sink.attach(&core);
        }
        if frozen {
            let _ = core.sync.request("frozen");
        }
        let topology = compute_topology(&core);
        let mut tasks = vec![tokio::spawn(daemon(core.clone())), tokio::spawn(sync::run(core.clone()))];
        if core.personality().reshape().is_some() {
            tasks.push(tokio::spawn(reshape::run(core.clone())));
        }
        let name_for_device = format!("{}:{}", core.info().level.name(), core.name());
        Array {
            array_name: core.name().to_string(),
            live: parking_lot::RwLock::new(Live { core, topology, tasks }),
            pause: pause::Pause::default(),
            name_for_device,
            left_out: Mutex::new(Vec::new()),
            detached: std::sync::atomic::AtomicBool::new(false),
            size_limit_bytes: std::sync::atomic::AtomicU64::new(0),
            after_reshape: Mutex::new(None),
            closed: tokio::sync::Mutex::new(false),
        }
    }

    /// The running array's core (`grow` replaces it: do not keep it across a grow).
    pub fn core(&self) -> Arc<ArrayCore> {
        self.live.read().core.clone()
    }

    pub fn name(&self) -> &str {
        &self.array_name
    }

    pub fn info(&self) -> ArrayInfo {
        self.core().info().clone()
    }

    /// Array size in bytes (the personality's size, rounded down to 4 KiB, or the smaller
    /// `array_size` set by [`Array::set_array_size`]).
    pub fn size_bytes(&self) -> u64 {
        self.topology().size_bytes
    }

    /// The personality's size in bytes, whatever `array_size` says (mdadm's "max").
    pub fn natural_size_bytes(&self) -> u64 {
        self.live.read().topology.size_bytes
    }

    /// md's `array_size` (`mdadm --grow --array-size`): the array gives only the first
    /// `bytes` (whole 4 KiB blocks, at most its natural size) until it is set back with
    /// `None` ("max"). Not written to the members: md keeps it in memory only. A reshape to
    /// fewer members needs it at or below the smaller size first, so nothing is cut off that
    /// the operator did not cut off before.
    pub fn set_array_size(&self, bytes: Option<u64>) -> stdio::Result<u64> {
        let natural = self.natural_size_bytes();
        let limit = match bytes {
            None => 0,
            Some(b) if b == 0 || !b.is_multiple_of(u64::from(ARRAY_BLOCK_BYTES)) => {
                let why = format!("{}: array size {b} bytes is not a non-zero multiple of 4 KiB", self.name());
                return Err(stdio::Error::new(stdio::ErrorKind::InvalidInput, why));
            }
            Some(b) if b > natural => {
                let why = format!("{}: array size {b} bytes is above what the members give ({natural})", self.name());
                return Err(stdio::Error::new(stdio::ErrorKind::InvalidInput, why));
            }
            Some(b) => b,
        };
        self.size_limit_bytes.store(limit, std::sync::atomic::Ordering::Release);
        tracing::info!(array = self.name(), size_bytes = self.size_bytes(), "array size set");
        Ok(self.size_bytes())
    }

    pub fn events(&self) -> u64 {
        self.core().sb.events()
    }

    /// True once the running array was stopped (and not assembled again since).
    pub fn is_stopped(&self) -> bool {
        self.core().sb.is_stopped()
    }

    pub fn sync_status(&self) -> SyncStatus {
        sync::status(&self.core())
    }

    /// Waits until no sync work runs or is pending (or the engine is frozen).
    pub async fn wait_sync_idle(&self) {
        self.core().sync_wake.notify_one();
        self.core().sync.wait_idle().await;
    }

    /// md's `sync_action` write: idle, frozen, check, repair, resync, recover.
    pub fn request_sync(&self, action: &str) -> stdio::Result<()> {
        if self.core().personality().reshape().is_some() && !matches!(action, "idle" | "frozen") {
            return Err(stdio::Error::new(
                stdio::ErrorKind::ResourceBusy,
                format!("{}: sync_action {action} must wait until the reshape finishes", self.name()),
            ));
        }
        self.core().sync.request(action)?;
        self.core().sync_wake.notify_one();
        Ok(())
    }

    /// Stops the array like `mdadm --stop`: background sync stops at a checkpoint, members are
    /// flushed and the superblocks are written clean (with the resync/recovery checkpoints).
    /// The caller must have stopped issuing I/O. A grow or reshape reassembly under way
    /// finishes first and its array is the one stopped; none runs afterwards.
    pub async fn stop(&self) -> stdio::Result<()> {
        let mut closed = self.closed.lock().await;
        *closed = true;
        self.stop_core().await
    }

    /// Holds off [`Array::stop`] while the caller replaces the running core; refused once the
    /// array was stopped.
    pub(super) async fn replacing(&self) -> stdio::Result<tokio::sync::MutexGuard<'_, bool>> {
        let closed = self.closed.lock().await;
        if *closed {
            let why = format!("{}: the array was stopped", self.name());
            return Err(stdio::Error::new(stdio::ErrorKind::NotConnected, why));
        }
        Ok(closed)
    }

    /// Stops the running core (the operator's stop, or a replacement's first step).
    pub(super) async fn stop_core(&self) -> stdio::Result<()> {
        let core = &self.core();
        if core.sb.is_stopped() {
            return Ok(()); // stopped already (e.g. by the reassembly that ends a reshape)
        }
        core.begin_shutdown();
        let tasks: Vec<JoinHandle<()>> = std::mem::take(&mut self.live.write().tasks);
        for t in tasks {
            let _ = t.await;
        }
        // Writes still in flight (a caller that did not wait) get a bounded grace.
        for _ in 0..500 {
            if core.gate.writes_in_flight() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        core.personality().stop(core).await?;
        let flushed = core.flush_members().await;
        // Clear idle bits (after a flush) and write the bitmap superblock before the final
        // superblocks, as md does on stop.
        let bitmap_done = match &core.bitmap {
            Some(bm) => bm.shutdown().await,
            None => Ok(()),
        };
        let flushed = flushed.and(bitmap_done);
        if core.needs_check().is_some() {
            return flushed;
        }
        let _t = core.gate.transition.lock().await;
        if core.gate.writes_in_flight() == 0 {
            core.gate.want_active.store(false, std::sync::atomic::Ordering::Release);
        }
        let written = core.last_superblocks("array stopped").await;
        flushed.and(written)?;
        tracing::info!(array = core.name(), events = core.sb.events(), "array stopped");
        Ok(())
    }

    //--------------------------------------------------------------------------------------------
    // Management (mdadm --manage)

    fn find(&self, member: &str) -> stdio::Result<Arc<Member>> {
        self.core().slots().find(member).ok_or_else(|| {
            stdio::Error::new(stdio::ErrorKind::NotFound, format!("{}: no member named {member:?}", self.name()))
        })
    }

    /// `--fail`: marks the member faulty (refused for the last member the array needs).
    pub async fn fail_member(&self, member: &str) -> stdio::Result<()> {
        let _p = self.pause.enter().await;
        let m = self.find(member)?;
        if !self.core().fail_member(&m, "failed by request") {
            return Err(stdio::Error::new(
                stdio::ErrorKind::ResourceBusy,
                format!("{}: member {member} cannot be failed: the array cannot run without it", self.name()),
            ));
        }
        self.core().settle_failures().await
    }

    /// `--remove`: takes a faulty member or a spare out of the array.
    pub async fn remove_member(&self, member: &str) -> stdio::Result<()> {
        let _p = self.pause.enter().await;
        let core = self.core();
        let _g = core.membership.lock().await;
        let m = match self.find(member) {
            Ok(m) => m,
            Err(_) if self.left_out.lock().iter().any(|r| r.member == member) => {
                // Not in the array (left out at assembly or by a grow): removing forgets it.
                self.forget_left_out(member);
                tracing::info!(array = self.name(), member, "left-out member removed");
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        let slots = self.core().slots();
        if !m.is_faulty() && slots.role_of(&m).is_some() {
            return Err(stdio::Error::new(
                stdio::ErrorKind::ResourceBusy,
                format!("{}: member {member} is active in the array; fail it first", self.name()),
            ));
        }
        let mut t = (*slots).clone();
        t.remove(&m);
        self.core().set_slots(t);
        self.core().update_superblocks("member removed").await?;
        tracing::info!(array = self.name(), member, "member removed");
        Ok(())
    }

    /// `--add`: writes a new superblock (and bitmap) to the device and adds it as a spare; the
    /// sync engine puts it into an empty role and rebuilds it.
    pub async fn add_member(&self, dev: MemberDev) -> stdio::Result<()> {
        let _p = self.pause.enter().await;
        let core = self.core();
        let _g = core.membership.lock().await;
        let slots = self.core().slots();
        if slots.all_members().iter().any(|m| m.name() == dev.name) {
            return Err(stdio::Error::new(
                stdio::ErrorKind::AlreadyExists,
                format!("{}: {} is already a member", self.name(), dev.name),
            ));
        }
        if !self.core().personality().has_redundancy() {
            return Err(stdio::Error::new(
                stdio::ErrorKind::Unsupported,
                format!("{}: {} arrays take no spares", self.name(), self.info().level.name()),
            ));
        }
        let sb = self.new_member_superblock(&dev, &slots)?;
        let block = sb.encode().map_err(|e| stdio::Error::other(format!("{}: {}: {e}", self.name(), dev.name)))?;
        let m = Arc::new(Member::new(dev.name.clone(), dev.dev.clone(), sb.clone()));
        let core = self.core();
        // No round may reset the bitmap's members while the new member's copy is written (a
        // cut then left it with a superblock pointing at a zeroed bitmap).
        let hold = core.hold_rounds().await;
        if let Some(bm) = &core.bitmap {
            // The new member's bitmap copy is complete before its superblock points at it.
            let mut t = (*slots).clone();
            t.add_spare(m.clone());
            bm.set_members(core.bitmap_members(&t));
            bm.sync_all_pages().await?;
        }
        core.member_write_meta(&m, sb.super_offset_sectors * 512, SharedBuf::from_slice(&block)).await?;
        let mut t = (*slots).clone();
        t.add_spare(m);
        core.set_slots(t);
        drop(hold);
        core.update_superblocks("member added").await?;
        drop(_g);
        self.kick_sync();
        self.forget_left_out(&dev.name);
        tracing::info!(array = self.name(), member = %dev.name, "spare added");
        Ok(())
    }

    /// A superblock for a device joining the array: the array fields of a current member, the
    /// device's own placement, a fresh device UUID and the lowest free dev_number.
    fn new_member_superblock(&self, dev: &MemberDev, slots: &SlotTable) -> stdio::Result<Superblock> {
        let members = slots.all_members();
        let tmpl = members
            .iter()
            .find(|m| !m.is_faulty())
            .ok_or_else(|| {
                stdio::Error::other(format!("{}: no working member to copy the superblock from", self.name()))
            })?
            .superblock();
        let dev_sectors = dev.dev.topology().size_bytes / 512;
        let v = tmpl.metadata_version();
        let sb_offset = v.sb_offset_sectors(dev_sectors).ok_or_else(|| {
            stdio::Error::new(stdio::ErrorKind::InvalidInput, format!("{}: {} is too small", self.name(), dev.name))
        })?;
        let mut sb = tmpl.clone();
        sb.super_offset_sectors = sb_offset;
        match v {
            MetadataVersion::V1_0 => {
                let reserved = tmpl.super_offset_sectors.saturating_sub(tmpl.data_size_sectors);
                sb.data_size_sectors = sb_offset.saturating_sub(reserved);
            }
            _ => sb.data_size_sectors = dev_sectors.saturating_sub(tmpl.data_offset_sectors),
        }
        if sb.data_size_sectors < self.info().member_size_sectors {
            return Err(stdio::Error::new(
                stdio::ErrorKind::InvalidInput,
                format!(
                    "{}: {} offers {} data sectors, the array needs {} per member",
                    self.name(),
                    dev.name,
                    sb.data_size_sectors,
                    self.info().member_size_sectors
                ),
            ));
        }
        let used: Vec<u32> = members.iter().map(|m| m.dev_number).collect();
        sb.dev_number = (0..).find(|n| !used.contains(n)).unwrap_or(0);
        sb.device_uuid = create::random_uuid()?;
        sb.recovery_offset_sectors = 0;
        sb.cnt_corrected_read = 0;
        sb.devflags = 0;
        sb.events = self.core().sb.events();
        sb.feature_map &=
            !(crate::format::superblock::feature::RECOVERY_OFFSET | crate::format::superblock::feature::REPLACEMENT);
        let need = sb.dev_number as usize + 1;
        if sb.dev_roles.len() < need {
            sb.dev_roles.resize(need, crate::format::superblock::ROLE_SPARE);
        }
        sb.dev_roles[sb.dev_number as usize] = crate::format::superblock::ROLE_SPARE;
        Ok(sb)
    }

    /// `--re-add`: a former member returns to its role. With the same event count it is in sync
    /// at once; with a write-intent bitmap that covers what it missed (its events are at least
    /// the bitmap's `events_cleared`) it is rebuilt bitmap-guided; otherwise re-add is refused
    /// (use `--add` for a full rebuild).
    pub async fn re_add_member(&self, dev: MemberDev) -> stdio::Result<()> {
        let _p = self.pause.enter().await;
        let core = self.core();
        let _g = core.membership.lock().await;
        let sb = assemble::read_superblock(&dev.dev).await.map_err(|e| {
            stdio::Error::new(stdio::ErrorKind::InvalidData, format!("{}: {}: {e}", self.name(), dev.name))
        })?;
        let info = self.info();
        let refuse = |why: String| {
            stdio::Error::new(
                stdio::ErrorKind::InvalidInput,
                format!("{}: cannot re-add {}: {why}", self.name(), dev.name),
            )
        };
        if sb.set_uuid != info.uuid {
            return Err(refuse("it belongs to a different array".into()));
        }
        let role = sb.raw_role() as usize;
        if role >= info.raid_disks as usize {
            return Err(refuse("it was not an active member (add it as a spare instead)".into()));
        }
        let slots = self.core().slots();
        if slots.working(role).is_some() {
            return Err(refuse(format!("role {role} is held by another member")));
        }
        if let Some(why) = self.missed_a_layout_change(&sb, &slots) {
            return Err(refuse(format!("{why}; use --add for a full rebuild")));
        }
        if slots.all_members().iter().any(|m| m.dev_number == sb.dev_number && !m.is_faulty()) {
            return Err(refuse(format!("dev_number {} is in use", sb.dev_number)));
        }
        let events = self.core().sb.events();
        let in_sync = sb.events == events && sb.feature_map & crate::format::superblock::feature::RECOVERY_OFFSET == 0;
        if !in_sync {
            let covered = match &self.core().bitmap {
                Some(bm) => bm.can_readd(sb.events) && sb.events <= events,
                None => false,
            };
            if !covered {
                return Err(refuse(format!(
                    "its events {} differ from the array's {events} and no write-intent bitmap covers what it missed; use --add for a full rebuild",
                    sb.events
                )));
            }
        }
        let m = Arc::new(Member::new(dev.name.clone(), dev.dev.clone(), sb));
        if in_sync {
            m.set(flag::IN_SYNC);
        } else {
            // Recovered from the bitmap: only the chunks written while it was away.
            m.set_recovery_offset(0);
            m.set(flag::BITMAP_RECOVERY);
        }
        let mut t = (*slots).clone();
        if let Some(old) = t.slot(role).and_then(|s| s.member.clone()) {
            t.remove(&old);
            t.add_faulty(old);
        }
        t.set_holder(role, Some(m));
        self.core().set_slots(t);
        self.core().update_superblocks("member re-added").await?;
        drop(_g);
        self.kick_sync();
        self.forget_left_out(&dev.name);
        tracing::info!(array = self.name(), member = %dev.name, role, in_sync, "member re-added");
        Ok(())
    }

    /// Why a former member's data cannot be brought back from the bitmap: the array's layout
    /// moved on since it left (a reshape ran or runs, a level or size change). A reshape moves
    /// data without the bitmap, so only a member that left at the array's present layout may
    /// return to its role.
    fn missed_a_layout_change(&self, sb: &Superblock, slots: &SlotTable) -> Option<String> {
        use crate::format::consistency::GeometryKey;
        use crate::format::superblock::feature::RESHAPE_ACTIVE;
        if self.core().personality().reshape().is_some() {
            return Some("the array is reshaping (re-add once the reshape has finished)".into());
        }
        if sb.feature_map & RESHAPE_ACTIVE != 0 {
            let at = sb.reshape_position_sectors;
            return Some(format!("it left during a reshape (its superblock records reshape position {at})"));
        }
        let current = slots.working_members().first()?.superblock();
        GeometryKey::of(sb).mismatch(&GeometryKey::of(&current)).map(|m| {
            let m = m.replace("the other members agree on", "the array now has");
            format!("it missed a change of the array's layout ({m})")
        })
    }

    /// Sets or clears a member's write-mostly flag (mdadm `--write-mostly`, sysfs
    /// `writemostly`): reads avoid a write-mostly member while another in-sync copy exists. The
    /// flag is written to the member's superblock (devflags WriteMostly1) before this returns.
    pub async fn set_write_mostly(&self, member: &str, on: bool) -> stdio::Result<()> {
        let _p = self.pause.enter().await;
        let m = self.find(member)?;
        if on {
            m.set(flag::WRITE_MOSTLY);
        } else {
            m.clear(flag::WRITE_MOSTLY);
        }
        self.core().update_superblocks(if on { "member write-mostly" } else { "member not write-mostly" }).await
    }

    /// mdadm `--write-behind=N` on a running array (md's `bitmap/backlog`, persisted): raid1
    /// with a write-intent bitmap only; `n` is 0 (off) to 16383 (the bitmap's COUNTER_MAX).
    /// Lowering it does not wait for the behind writes already outstanding beyond the new limit.
    pub async fn set_write_behind(&self, n: u32) -> stdio::Result<()> {
        let _p = self.pause.enter().await;
        let core = self.core();
        let refuse = |why: String| stdio::Error::new(stdio::ErrorKind::InvalidInput, format!("{}: {why}", self.name()));
        if core.info().level != crate::layout::Level::Raid1 {
            return Err(refuse(format!("write-behind is for raid1, not {}", core.info().level.name())));
        }
        let Some(bm) = &core.bitmap else {
            return Err(refuse("write-behind needs a write-intent bitmap (grow --bitmap internal first)".into()));
        };
        if n > crate::format::bitmap::COUNTER_MAX {
            return Err(refuse(format!("write-behind {n} is above {}", crate::format::bitmap::COUNTER_MAX)));
        }
        bm.set_attribute("backlog", &n.to_string()).unwrap_or(Ok(()))?;
        core.update_superblocks("write-behind").await
    }

    /// `--replace`: rebuild a spare as the member's replacement, then fail the member.
    /// With `with`, that device is added and becomes the replacement (not another spare).
    pub async fn replace_member(&self, member: &str, with: Option<MemberDev>) -> stdio::Result<()> {
        let m = self.find(member)?;
        let refuse =
            |why: &str| stdio::Error::new(stdio::ErrorKind::InvalidInput, format!("{}: {member} {why}", self.name()));
        let slots = self.core().slots();
        let role = slots.role_of(&m).filter(|_| !m.is_faulty()).ok_or_else(|| refuse("is not an active member"))?;
        if slots.slot(role).is_some_and(|s| s.replacement.as_ref().is_some_and(|r| !r.is_faulty())) {
            return Err(refuse("is already being replaced"));
        }
        drop(slots);
        if let Some(w) = with {
            let name = w.name.clone();
            self.add_member(w).await?;
            self.take_as_replacement(role, &name).await?;
        }
        m.set(flag::WANT_REPLACEMENT);
        self.kick_sync();
        Ok(())
    }

    /// mdadm `--with` writes the spare's `slot` (md slot_store): that device becomes the
    /// replacement of `role`. Left to the recovery task, the first spare would be taken, which
    /// is an older spare when the array already had one. A spare the recovery task already
    /// put into an empty role stays there.
    async fn take_as_replacement(&self, role: usize, spare: &str) -> stdio::Result<()> {
        let _p = self.pause.enter().await;
        let core = self.core();
        let _g = core.membership.lock().await;
        let slots = core.slots();
        let Some(s) = slots.spares().iter().find(|s| s.name() == spare).cloned() else {
            tracing::warn!(array = self.name(), member = spare, "no longer a spare: not made the replacement");
            return Ok(());
        };
        let mut t = (*slots).clone();
        sync::make_replacement(&mut t, role, &s);
        core.set_slots(t);
        core.update_superblocks("replacement chosen").await?;
        tracing::info!(array = self.name(), member = spare, role, "spare becomes replacement (--with)");
        Ok(())
    }

    fn kick_sync(&self) {
        self.core().sync.not_idle();
        self.core().sync_wake.notify_one();
    }

    //--------------------------------------------------------------------------------------------
    // Attributes and details

    /// Every attribute with its value (md sysfs names).
    pub fn attributes(&self) -> Vec<(String, String)> {
        attrs::all(&self.core(), self.size_bytes())
    }

    pub fn get_attribute(&self, name: &str) -> stdio::Result<String> {
        attrs::get(&self.core(), self.size_bytes(), name)
    }

    pub fn set_attribute(&self, name: &str, value: &str) -> stdio::Result<()> {
        attrs::set(self, name, value)
    }

    /// What `mdadm --detail` shows, as JSON, plus the members assembly left out
    /// (`left_out`: member and reason).
    pub fn detail(&self) -> serde_json::Value {
        let mut d = attrs::detail(&self.core(), self.size_bytes());
        let left_out: Vec<serde_json::Value> =
            self.left_out().iter().map(|r| serde_json::json!({ "member": r.member, "reason": r.reason })).collect();
        d["left_out"] = serde_json::Value::Array(left_out);
        d
    }

    /// Members assembly left out (never written to), with the reason; a member leaves this
    /// list when it is added or re-added.
    pub fn left_out(&self) -> Vec<Refusal> {
        self.left_out.lock().clone()
    }

    pub(crate) fn set_left_out(&self, refused: Vec<Refusal>) {
        *self.left_out.lock() = refused;
    }

    fn forget_left_out(&self, member: &str) {
        self.left_out.lock().retain(|r| r.member != member);
    }
}

impl Drop for Array {
    fn drop(&mut self) {
        if self.detached.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        let live = self.live.get_mut();
        live.core.begin_shutdown();
        for t in live.tasks.drain(..) {
            t.abort();
        }
    }
}

fn compute_topology(core: &ArrayCore) -> Topology {
    let pers = core.personality();
    let members = core.slots().working_members();
    let tops: Vec<Topology> = members.iter().map(|m| m.device().topology()).collect();
    let size_bytes = pers.array_sectors() * 512 / u64::from(ARRAY_BLOCK_BYTES) * u64::from(ARRAY_BLOCK_BYTES);
    let mirrors = matches!(pers.level(), crate::layout::Level::Raid1 | crate::layout::Level::Raid10);
    let max_io = tops.iter().map(|t| t.max_io_bytes).min().unwrap_or(32 << 20).clamp(ARRAY_BLOCK_BYTES, 32 << 20);
    Topology {
        size_bytes,
        logical_block_bytes: ARRAY_BLOCK_BYTES,
        physical_block_bytes: ARRAY_BLOCK_BYTES,
        optimal_io_bytes: pers.optimal_io_bytes().max(ARRAY_BLOCK_BYTES),
        max_io_bytes: max_io / ARRAY_BLOCK_BYTES * ARRAY_BLOCK_BYTES,
        supports_fua: true,
        volatile_cache: tops.iter().any(|t| t.volatile_cache),
        supports_discard: if mirrors {
            tops.iter().all(|t| t.supports_write_zeroes)
        } else {
            tops.iter().all(|t| t.supports_discard)
        },
        supports_write_zeroes: tops.iter().all(|t| t.supports_write_zeroes),
        discard_granularity_bytes: ARRAY_BLOCK_BYTES,
        rotational: tops.iter().any(|t| t.rotational),
    }
}

/// The array daemon: records member failures nobody is waiting for, and marks the array clean
/// after `safe_mode_delay` without writes.
async fn daemon(core: Arc<ArrayCore>) {
    loop {
        if core.is_shutting_down() {
            break;
        }
        let wake = core.wake.notified();
        tokio::pin!(wake);
        wake.as_mut().enable();
        if core.failures_pending()
            && core.needs_check().is_none()
            && let Err(e) = core.update_superblocks("member failure").await
        {
            tracing::error!(array = core.name(), "recording a member failure: {e}");
        }
        let mut sleep_for = Duration::from_secs(1);
        if core.gate.is_active() && core.gate.writes_in_flight() == 0 && core.needs_check().is_none() {
            let idle = core.gate.idle_for();
            let delay = core.gate.safe_mode_delay();
            if idle >= delay {
                if let Err(e) = core.try_mark_clean().await {
                    tracing::error!(array = core.name(), "marking the array clean: {e}");
                }
            } else {
                sleep_for = delay - idle;
            }
        }
        tokio::select! {
            _ = wake => {}
            _ = tokio::time::sleep(sleep_for) => {}
        }
    }
}

/// Counts a user write in the gate until dropped.
struct GateGuard<'a>(&'a ArrayCore);

impl Drop for GateGuard<'_> {
    fn drop(&mut self) {
        self.0.exit_write_gate();
    }
}

impl Array {
    fn check(&self, op: IoOp, offset_bytes: u64, len_bytes: u64) -> stdio::Result<()> {
        check_io(&self.name_for_device, &self.topology(), op, offset_bytes, len_bytes)
    }

    /// The common path of every modifying request.
    async fn modify<F>(&self, op: IoOp, offset_bytes: u64, len_bytes: u64, f: F) -> stdio::Result<()>
    where
        F: for<'a> FnOnce(&'a ArrayCore, &'a dyn Personality, u64, u64) -> IoFuture<'a, stdio::Result<()>>,
    {
        self.check(op, offset_bytes, len_bytes)?;
        if len_bytes == 0 {
            return Ok(());
        }
        let _p = self.pause.enter().await;
        let core_ref = self.core();
        let core = &*core_ref;
        if let Some(reason) = core.needs_check() {
            return Err(needs_check_error(core, &reason));
        }
        if core.is_broken() {
            // md refuses writes to a broken array (md_submit_bio).
            let why = core.broken_reason().unwrap_or_else(|| "a member the array cannot run without failed".into());
            let detail = format!("writes are refused: {why}");
            return Err(MdError::new(MdErrorKind::Broken, core.name(), op.as_str(), offset_bytes / 512, detail).into());
        }
        core.note_user_request();
        core.enter_write_gate().await?;
        let _gate = GateGuard(core);
        let (off, len) = (offset_bytes / 512, len_bytes / 512);
        let pers = core.personality().clone();
        let range = pers.sync_range_of(off, len);
        if let Some(bm) = &core.bitmap {
            bm.start_write(range.clone()).await?;
        }
        let slots = core.slots();
        let all_roles = (0..slots.raid_disks()).all(|r| slots.working(r).is_some());
        let failures_before = core.failures_noted();
        let r = {
            let _w = core.barrier.enter_write(range.clone()).await;
            f(core, &*pers, off, len).await
        };
        if let Some(bm) = &core.bitmap {
            // "Reached every role": nothing was missing and no member failed meanwhile;
            // otherwise the chunks stay needed for the member that missed the write.
            let complete = r.is_ok() && all_roles && core.failures_noted() == failures_before;
            bm.end_write(range, complete);
        }
        // Acknowledge only once every member failure seen so far is durable.
        let settled = core.settle_failures().await;
        r.and(settled)
    }
}

impl BlockDevice for Array {
    fn name(&self) -> &str {
        &self.name_for_device
    }

    fn topology(&self) -> Topology {
        let mut t = self.live.read().topology;
        let limit = self.size_limit_bytes.load(std::sync::atomic::Ordering::Acquire);
        if limit > 0 {
            t.size_bytes = t.size_bytes.min(limit);
        }
        t
    }

    fn read(&self, offset_bytes: u64, buf: IoBuf) -> IoFuture<'_, ReadResult> {
        Box::pin(async move {
            if let Err(e) = self.check(IoOp::Read, offset_bytes, buf.len() as u64) {
                return (buf, Err(e));
            }
            if buf.is_empty() {
                return (buf, Ok(()));
            }
            let _p = self.pause.enter().await;
            let core = self.core();
            core.note_user_request();
            core.personality().read(&core, offset_bytes / 512, buf).await
        })
    }

    fn write(&self, offset_bytes: u64, buf: SharedBuf, flags: WriteFlags) -> IoFuture<'_, stdio::Result<()>> {
        Box::pin(async move {
            let len = buf.len() as u64;
            self.modify(IoOp::Write, offset_bytes, len, move |core, pers, off, _| pers.write(core, off, buf, flags))
                .await
        })
    }

    fn flush(&self) -> IoFuture<'_, stdio::Result<()>> {
        Box::pin(async move {
            let _p = self.pause.enter().await;
            self.core().flush_members().await
        })
    }

    fn discard(&self, offset_bytes: u64, len_bytes: u64) -> IoFuture<'_, stdio::Result<()>> {
        Box::pin(async move {
            self.modify(IoOp::Discard, offset_bytes, len_bytes, |core, pers, off, len| pers.discard(core, off, len))
                .await
        })
    }

    fn write_zeroes(&self, offset_bytes: u64, len_bytes: u64, flags: ZeroFlags) -> IoFuture<'_, stdio::Result<()>> {
        Box::pin(async move {
            self.modify(IoOp::WriteZeroes, offset_bytes, len_bytes, move |core, pers, off, len| {
                pers.write_zeroes(core, off, len, flags)
            })
            .await
        })
    }
}

/// Whether the sync domain is fully in sync (no resync pending).
pub fn is_in_sync(core: &ArrayCore) -> bool {
    core.resync_checkpoint() == MAX_SECTOR
}
