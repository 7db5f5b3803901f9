//! md's member error policy (md-lifecycle.md section 5) under a verifying concurrent workload,
//! on fault-injecting RAM members, for raid1, raid10, raid5 and raid6:
//! - read errors and short reads (a read answered "successfully" with half the bytes) are
//!   served from the other copies / parity, the range is rewritten and read back, and the
//!   member keeps its place while the policy allows: raid1/raid10 fail it at the fix attempt
//!   that takes md's decayed `read_errors` past `max_read_errors` (20; halved per full hour,
//!   moved by a manual clock), raid5/6 when more reads fail in a row than the stripe cache
//!   holds (a successful read resets the count);
//! - a member whose writes fail, and a member that disappears (every I/O fails), are failed,
//!   recorded in the survivors' superblocks and never sent I/O again;
//! - the client sees no error and no wrong data within the redundancy, and `check` afterwards
//!   finds 0 mismatches;
//! - beyond the redundancy raid1/raid10 keep the last copy, the request fails with a typed
//!   [`MdError`], and a failed write marks the array broken (writes refused), as md does
//!   (raid5/raid6 fail the member instead: raid5_faults.rs).
//!
//! Seeds are printed (`MDKIT_TEST_SEED` replays).

use crate::array_util;

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use array_util::*;
use mdkit_io::{
    BlockDevice, BlockDeviceExt, DeviceRef, FaultHandle, FaultRule, IoBuf, IoFuture, MemDevice, OpMask, ReadResult,
    Rng, SharedBuf, Topology, WriteFlags, ZeroFlags,
};
use mdkit_md::array::{Array, ManualClock, MdError, MdErrorKind, Member};
use mdkit_md::format::superblock::ROLE_FAULTY;
use mdkit_md::layout::{Level, ParityGeometry};

fn fault(m: &SimMember) -> &FaultHandle {
    m.fault.as_ref().expect("fault-injecting member")
}

fn member(a: &Array, m: &SimMember) -> Arc<Member> {
    a.core().slots().find(&m.name).expect("member of the array")
}

/// A workload round and a `check` at the same time; returns the check's mismatch count.
async fn workload_with_check(a: &'static Array, seed: u64, model: &mut Model) -> u64 {
    let (_, mismatches) = tokio::join!(verifying_workload(a, seed, 4, 45, 32, model), check(a));
    mismatches
}

#[derive(Clone, Copy, Debug)]
enum ReadFault {
    Eio,
    Short,
}

impl ReadFault {
    /// One failing read of the 4 KiB member block at byte `at`.
    fn once_at(self, at: u64) -> FaultRule {
        let range = Some(at..at + 4096);
        match self {
            ReadFault::Eio => FaultRule::error(OpMask::READ, range),
            ReadFault::Short => FaultRule::short_reads(range),
        }
        .times(1)
    }
}

/// Arms `count` one-shot read faults on `m`, one per `spacing` bytes of its data area (so no
/// read and no sync unit meets two), at a block inside each unit that varies per `round`.
fn arm(m: &SimMember, a: &Array, kind: ReadFault, count: u64, spacing: u64, round: u64) -> Vec<mdkit_io::RuleId> {
    let dof = member(a, m).data_offset_sectors * 512;
    (0..count).map(|k| fault(m).add(kind.once_at(dof + k * spacing + (round * 5 % 16) * 4096))).collect()
}

fn assert_all_fired(m: &SimMember, rules: &[mdkit_io::RuleId], what: &str) {
    for id in rules {
        assert_eq!(fault(m).fired(*id), Some(1), "{what}: every armed fault fired exactly once");
    }
}

//------------------------------------------------------------------------------------------------
// raid1 / raid10: max_read_errors with decay

async fn mirror_read_faults(level: Level, n: usize, layout: Option<u32>, member_mib: u64, kind: ReadFault) {
    let test = format!("{}-{kind:?}-reads", level.name());
    let s = seed(&test, 31);
    let ms = faulty_members(&format!("{test}-"), n, member_mib * MIB);
    let a = create_array(&ms, opts(level, n as u32, Some(64), layout, true, true)).await;
    fast_sync(&a);
    let clock = ManualClock::new();
    a.core().set_clock(clock.clone());
    let a: &'static Array = Box::leak(Box::new(a));
    let mut model = Model::new(a.size_bytes());
    verifying_workload(a, s, 4, 45, 32, &mut model).await;
    let x = &ms[1];
    let mx = member(a, x);
    // 20 fix attempts: at md's limit, not past it. The workload's reads and the check meet
    // each fault once (whichever comes first), and each is one fix attempt.
    let rules = arm(x, a, kind, 20, MIB, 0);
    assert_eq!(workload_with_check(a, s + 1, &mut model).await, 0, "{test}: check");
    assert_all_fired(x, &rules, &test);
    assert_eq!(mx.fix_attempts(), 20, "{test}");
    assert_eq!(mx.read_errors(), 20, "{test}: one failed read per fault");
    assert!(mx.is_in_sync(), "{test}: 20 read errors do not exceed max_read_errors");
    let corrected = u64::from(mx.corrected_reads());
    assert!(corrected >= 20 * 8 && corrected % 8 == 0, "{test}: corrected {corrected} sectors");
    assert_eq!(a.get_attribute(&format!("dev-{}/errors", x.name)).unwrap(), corrected.to_string());
    // An hour without errors halves the count: 10 more attempts end at 10 + 10 = 20.
    clock.advance(Duration::from_secs(3600));
    let rules = arm(x, a, kind, 10, MIB, 1);
    assert_eq!(workload_with_check(a, s + 2, &mut model).await, 0, "{test}: check");
    assert_all_fired(x, &rules, &test);
    assert_eq!(mx.fix_attempts(), 20, "{test}: decayed to 10, then 10 more");
    assert!(mx.is_in_sync(), "{test}");
    // The next one is the 21st: the member is failed instead of repaired.
    let rules = arm(x, a, kind, 1, MIB, 2);
    assert_eq!(workload_with_check(a, s + 3, &mut model).await, 0, "{test}: check");
    assert_all_fired(x, &rules, &test);
    assert_eq!(mx.fix_attempts(), 21, "{test}");
    assert_eq!(mx.read_errors(), 31, "{test}");
    assert!(mx.is_faulty(), "{test}: failed past max_read_errors");
    let why = mx.fail_reason().unwrap_or_default();
    assert!(why.contains("21 read errors exceed max_read_errors 20"), "{test}: {why}");
    assert_eq!(a.get_attribute(&format!("dev-{}/state", x.name)).unwrap(), "faulty");
    assert_eq!(a.core().degraded(), 1, "{test}");
    settle_and_check_survivors(a, &ms, 1, &mut model, s + 4).await;
}

/// After a failure: the survivors' superblocks record it, the failed member gets no more I/O,
/// the workload still sees no error, check finds nothing and every byte is right.
async fn settle_and_check_survivors(a: &'static Array, ms: &[SimMember], x: usize, model: &mut Model, s: u64) {
    a.core().settle_failures().await.unwrap();
    let survivor = ms.iter().enumerate().find(|(i, _)| *i != x).unwrap().1;
    assert_eq!(sb_of(survivor).dev_roles[x], ROLE_FAULTY, "{}: the failure is recorded", survivor.name);
    let before = fault(&ms[x]).stats().requests;
    assert_eq!(workload_with_check(a, s, model).await, 0, "check after the failure");
    verify_all(a, model).await;
    assert_eq!(fault(&ms[x]).stats().requests, before, "{}: no I/O reaches a failed member", ms[x].name);
    a.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid1_read_errors_fail_the_member_past_max_read_errors() {
    mirror_read_faults(Level::Raid1, 2, None, 24, ReadFault::Eio).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid1_short_reads_count_as_read_errors() {
    mirror_read_faults(Level::Raid1, 2, None, 24, ReadFault::Short).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid10_read_errors_fail_the_member_past_max_read_errors() {
    mirror_read_faults(Level::Raid10, 4, Some(0x102), 24, ReadFault::Eio).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid10_short_reads_count_as_read_errors() {
    mirror_read_faults(Level::Raid10, 4, Some(0x102), 24, ReadFault::Short).await;
}

//------------------------------------------------------------------------------------------------
// raid5 / raid6: corrected read errors reset the count

async fn parity_read_faults(level: Level, n: usize, kind: ReadFault) {
    let test = format!("{}-{kind:?}-reads", level.name());
    let s = seed(&test, 41);
    let ms = faulty_members(&format!("{test}-"), n, 12 * MIB);
    let a = create_array(&ms, opts(level, n as u32, Some(64), None, true, true)).await;
    fast_sync(&a);
    // The smallest stripe cache: 40 read errors would exceed it were they not reset.
    a.set_attribute("stripe_cache_size", "17").unwrap();
    let a: &'static Array = Box::leak(Box::new(a));
    let mut model = Model::new(a.size_bytes());
    verifying_workload(a, s, 4, 45, 32, &mut model).await;
    let x = &ms[2];
    let mx = member(a, x);
    let rules = arm(x, a, kind, 40, 192 * 1024, 0);
    assert_eq!(workload_with_check(a, s + 1, &mut model).await, 0, "{test}: check");
    assert_all_fired(x, &rules, &test);
    assert_eq!(mx.read_errors(), 40, "{test}: one failed read per fault");
    assert_eq!(mx.consecutive_read_errors(), 0, "{test}: the read-back after each rewrite reset the count");
    assert!(mx.is_in_sync(), "{test}: corrected read errors keep the member");
    let corrected = u64::from(mx.corrected_reads());
    assert!(corrected >= 40 * 8 && corrected % 8 == 0, "{test}: corrected {corrected} sectors");
    assert_eq!(check(a).await, 0, "{test}: second check");
    verify_all(a, &model).await;
    a.stop().await.unwrap();
    assert_eq!(u64::from(sb_of(x).cnt_corrected_read), corrected, "{test}: stored at the next superblock write");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid5_read_errors_are_corrected_and_reset_the_count() {
    parity_read_faults(Level::Raid5, 4, ReadFault::Eio).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid5_short_reads_are_corrected() {
    parity_read_faults(Level::Raid5, 4, ReadFault::Short).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid6_read_errors_are_corrected_and_reset_the_count() {
    parity_read_faults(Level::Raid6, 5, ReadFault::Eio).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid6_short_reads_are_corrected() {
    parity_read_faults(Level::Raid6, 5, ReadFault::Short).await;
}

//------------------------------------------------------------------------------------------------
// Write errors and vanished members, every level

#[derive(Clone, Copy, Debug)]
enum Death {
    WriteErrors,
    Pulled,
}

async fn member_dies(level: Level, n: usize, layout: Option<u32>, x: usize, how: Death) {
    let test = format!("{}-{how:?}", level.name());
    let s = seed(&test, 51);
    let ms = faulty_members(&format!("{test}-"), n, 12 * MIB);
    let a = create_array(&ms, opts(level, n as u32, Some(64), layout, true, true)).await;
    fast_sync(&a);
    let a: &'static Array = Box::leak(Box::new(a));
    let mut model = Model::new(a.size_bytes());
    verifying_workload(a, s, 4, 45, 32, &mut model).await;
    match how {
        Death::WriteErrors => {
            fault(&ms[x]).add(FaultRule::error(OpMask::WRITE, None));
        }
        Death::Pulled => fault(&ms[x]).pull(),
    }
    verifying_workload(a, s + 1, 4, 60, 32, &mut model).await;
    let mx = member(a, &ms[x]);
    assert!(mx.is_faulty(), "{test}: failed");
    assert_eq!(a.get_attribute(&format!("dev-{}/state", ms[x].name)).unwrap(), "faulty", "{test}");
    assert_eq!(a.core().degraded(), 1, "{test}");
    assert_ne!(a.get_attribute("array_state").unwrap(), "broken", "{test}");
    let why = mx.fail_reason().unwrap_or_default();
    match how {
        // Every write fails, the bad-block log and superblock too: the member is failed.
        Death::WriteErrors => {
            let data_or_bitmap = why.contains("write at member sector") || why.contains("write-intent bitmap");
            assert!(data_or_bitmap || why.contains("superblock write failed"), "{test}: {why}");
            assert_eq!(mx.read_errors(), 0, "{test}: reads still worked");
        }
        // The first I/O to fail may be a read (its repair write then fails), a data write or
        // flush, or a write-intent bitmap write.
        Death::Pulled => {
            assert!(
                why.contains("member sector") || why.contains("write-intent bitmap") || why.contains("superblock"),
                "{test}: {why}"
            )
        }
    }
    settle_and_check_survivors(a, &ms, x, &mut model, s + 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_errors_fail_the_member_on_every_level() {
    member_dies(Level::Raid1, 2, None, 0, Death::WriteErrors).await;
    member_dies(Level::Raid10, 4, Some(0x102), 3, Death::WriteErrors).await;
    member_dies(Level::Raid5, 4, None, 1, Death::WriteErrors).await;
    member_dies(Level::Raid6, 5, None, 4, Death::WriteErrors).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_member_is_failed_on_every_level() {
    member_dies(Level::Raid1, 2, None, 1, Death::Pulled).await;
    member_dies(Level::Raid10, 4, Some(0x102), 0, Death::Pulled).await;
    member_dies(Level::Raid5, 4, None, 3, Death::Pulled).await;
    member_dies(Level::Raid6, 5, None, 2, Death::Pulled).await;
}

//------------------------------------------------------------------------------------------------
// raid5: more failed reads in a row than the stripe cache holds

/// Reads of the inner device; when armed, the next `n` reads wait until all `n` have arrived
/// and then fail together (a member returning a burst of errors for reads in flight). Every
/// other read yields once first, so a burst's failures are all seen before a later read of the
/// same member completes.
struct BurstDevice {
    inner: DeviceRef,
    armed: AtomicUsize,
    burst: parking_lot::Mutex<Option<Arc<tokio::sync::Barrier>>>,
    failed: AtomicUsize,
}

impl BurstDevice {
    fn arm(&self, n: usize) {
        *self.burst.lock() = Some(Arc::new(tokio::sync::Barrier::new(n)));
        self.armed.store(n, Ordering::SeqCst);
    }
}

impl BlockDevice for BurstDevice {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn topology(&self) -> Topology {
        self.inner.topology()
    }
    fn read(&self, off: u64, buf: IoBuf) -> IoFuture<'_, ReadResult> {
        let held = self.armed.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok();
        let burst = if held { self.burst.lock().clone() } else { None };
        Box::pin(async move {
            match burst {
                Some(b) => {
                    b.wait().await;
                    self.failed.fetch_add(1, Ordering::SeqCst);
                    (buf, Err(io::Error::other(format!("{}: read at {off}: burst error", self.inner.name()))))
                }
                None => {
                    tokio::task::yield_now().await;
                    self.inner.read(off, buf).await
                }
            }
        })
    }
    fn write(&self, off: u64, buf: SharedBuf, f: WriteFlags) -> IoFuture<'_, io::Result<()>> {
        self.inner.write(off, buf, f)
    }
    fn flush(&self) -> IoFuture<'_, io::Result<()>> {
        self.inner.flush()
    }
    fn discard(&self, off: u64, len: u64) -> IoFuture<'_, io::Result<()>> {
        self.inner.discard(off, len)
    }
    fn write_zeroes(&self, off: u64, len: u64, f: ZeroFlags) -> IoFuture<'_, io::Result<()>> {
        self.inner.write_zeroes(off, len, f)
    }
}

/// `count` concurrent 4 KiB client reads, each of a different stripe's chunk on member `x`.
async fn reads_on_member(a: &Array, g: &ParityGeometry, x: usize, first_stripe: u64, count: u64, model: &Model) {
    let chunk_bytes = g.chunk_sectors() * 512;
    let data_disks = g.data_disks() as u64;
    let offsets: Vec<u64> = (first_stripe..)
        .filter_map(|s| {
            let dd = g.stripe_map(s).data_members.iter().position(|&m| m == x)? as u64;
            Some((s * data_disks + dd) * chunk_bytes)
        })
        .take(count as usize)
        .collect();
    let reads = offsets.iter().map(|&off| async move {
        let got = a.read_vec(off, 4096).await.unwrap_or_else(|e| panic!("read {off}: {e}"));
        assert!(got == model.slice(off, 4096), "wrong data at {off}");
    });
    // A hang guard only: a burst that never fills would wait forever.
    tokio::time::timeout(Duration::from_secs(120), mdkit_md::array::io::join_all(reads))
        .await
        .expect("the burst's reads completed");
}

#[tokio::test]
async fn raid5_member_failing_more_reads_in_a_row_than_the_stripe_cache_is_failed() {
    let mut rng = Rng::new(seed("raid5_member_failing_more_reads_in_a_row_than_the_stripe_cache_is_failed", 61));
    let n = 4;
    let mems: Vec<Arc<MemDevice>> = (0..n).map(|i| Arc::new(MemDevice::new(format!("burst-{i}"), 12 * MIB))).collect();
    let x = 1;
    let burst = Arc::new(BurstDevice {
        inner: mems[x].clone(),
        armed: AtomicUsize::new(0),
        burst: parking_lot::Mutex::new(None),
        failed: AtomicUsize::new(0),
    });
    let ms: Vec<SimMember> = mems
        .iter()
        .enumerate()
        .map(|(i, m)| SimMember {
            name: format!("burst-{i}"),
            dev: if i == x { burst.clone() } else { m.clone() },
            mem: Some(m.clone()),
            fault: None,
        })
        .collect();
    let a = create_array(&ms, opts(Level::Raid5, n as u32, Some(64), None, false, true)).await;
    a.set_attribute("stripe_cache_size", "17").unwrap();
    let mut model = Model::new(a.size_bytes());
    fill(&a, &mut model, &mut rng).await;
    let g = ParityGeometry::new(Level::Raid5, n as u32, 2, 128).unwrap();
    let mx = member(&a, &ms[x]);
    // 17 failures in a row: not more than the cache; the read-backs reset the count.
    burst.arm(17);
    reads_on_member(&a, &g, x, 0, 17, &model).await;
    assert_eq!(burst.failed.load(Ordering::SeqCst), 17);
    assert!(mx.is_in_sync(), "17 failed reads in a row do not exceed stripe_cache_size 17");
    assert_eq!(mx.consecutive_read_errors(), 0, "reset by the successful read-backs");
    assert_eq!(u64::from(mx.corrected_reads()), 17 * 8, "each rewritten 4 KiB block read back");
    // 18 in a row: failed at the 18th, the clients still get their data.
    burst.arm(18);
    reads_on_member(&a, &g, x, 40, 18, &model).await;
    assert_eq!(burst.failed.load(Ordering::SeqCst), 35);
    assert!(mx.is_faulty(), "18 failed reads in a row exceed stripe_cache_size 17");
    let why = mx.fail_reason().unwrap_or_default();
    assert!(why.contains("18 failed reads in a row exceed 17"), "{why}");
    assert_eq!(a.core().degraded(), 1);
    a.core().settle_failures().await.unwrap();
    assert_eq!(sb_of(&ms[0]).dev_roles[x], ROLE_FAULTY);
    verify_all(&a, &model).await;
    assert_eq!(check(&a).await, 0);
    a.stop().await.unwrap();
}

//------------------------------------------------------------------------------------------------
// Beyond the redundancy

/// Beyond the redundancy: `fault_bytes` of unreadable member data from the start of the data
/// area, a read at `read_at` that needs it, a write at `write_at` (`write_len`) that needs the
/// last member.
struct LastCopy {
    level: Level,
    n: usize,
    layout: Option<u32>,
    fault_bytes: u64,
    read_at: u64,
    write_at: u64,
    write_len: u64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_copy_is_kept_and_errors_are_typed() {
    let mut rng = Rng::new(seed("the_last_copy_is_kept_and_errors_are_typed", 71));
    let cases = [
        LastCopy {
            level: Level::Raid1,
            n: 2,
            layout: None,
            fault_bytes: 2 * MIB,
            read_at: MIB,
            write_at: 3 * MIB,
            write_len: 4096,
        },
        LastCopy {
            level: Level::Raid10,
            n: 2,
            layout: Some(0x102),
            fault_bytes: 2 * MIB,
            read_at: MIB,
            write_at: 3 * MIB,
            write_len: 4096,
        },
    ];
    for c in cases {
        let level = c.level;
        let ms = faulty_members(&format!("last-{}-", level.name()), c.n, 8 * MIB);
        let a = create_array(&ms, opts(level, c.n as u32, Some(64), c.layout, false, true)).await;
        let mut model = Model::new(a.size_bytes());
        fill(&a, &mut model, &mut rng).await;
        a.fail_member(&ms[0].name).await.unwrap();
        let last = &ms[1];
        let dof = member(&a, last).data_offset_sectors * 512;
        // A read error the level cannot cover: the request fails with a typed error, the member
        // stays.
        fault(last).add(FaultRule::error(OpMask::READ, Some(dof..dof + c.fault_bytes)));
        let e = a.read_vec(c.read_at, 8192).await.unwrap_err();
        let md = MdError::of(&e).unwrap_or_else(|| panic!("{level:?}: untyped error {e}"));
        assert_eq!((md.kind, md.op, md.array.as_str()), (MdErrorKind::Unrecoverable, "read", "md-test"), "{e}");
        assert!(e.to_string().contains(&last.name), "{level:?}: the error names the member: {e}");
        assert!(member(&a, last).is_in_sync(), "{level:?}: the last copy is never failed");
        assert_ne!(a.get_attribute("array_state").unwrap(), "broken", "{level:?}: a read error does not break it");
        // A write error on its data while its bad-block log has room: the range is recorded as
        // bad, the member stays, the write fails (no copy took it), the array is not broken.
        let data_rule = fault(last).add(FaultRule::error(OpMask::WRITE, Some(dof..dof + 8 * MIB)));
        let e = a.write(c.write_at, SharedBuf::zeroed(c.write_len as usize), WriteFlags::NONE).await.unwrap_err();
        let md = MdError::of(&e).unwrap_or_else(|| panic!("{level:?}: untyped error {e}"));
        assert_eq!((md.kind, md.member.as_deref()), (MdErrorKind::BadBlockRecorded, Some(last.name.as_str())), "{e}");
        assert!(member(&a, last).is_in_sync(), "{level:?}");
        assert!(!member(&a, last).bad_blocks().is_empty(), "{level:?}");
        assert_ne!(a.get_attribute("array_state").unwrap(), "broken", "{level:?}");
        // A write error where not even the log can be written: kept, the array is broken and
        // refuses writes.
        fault(last).remove(data_rule);
        fault(last).add(FaultRule::error(OpMask::WRITE, None));
        let e = a.write(c.write_at, SharedBuf::zeroed(c.write_len as usize), WriteFlags::NONE).await.unwrap_err();
        let md = MdError::of(&e).unwrap_or_else(|| panic!("{level:?}: untyped error {e}"));
        assert_eq!((md.kind, md.member.as_deref()), (MdErrorKind::MemberWrite, Some(last.name.as_str())), "{e}");
        assert!(member(&a, last).is_in_sync(), "{level:?}");
        assert_eq!(a.get_attribute("array_state").unwrap(), "broken", "{level:?}");
        let e = a.write(c.write_at, SharedBuf::zeroed(4096), WriteFlags::NONE).await.unwrap_err();
        let kind = MdError::of(&e).map(|m| m.kind);
        assert!(matches!(kind, Some(MdErrorKind::Broken | MdErrorKind::NeedsCheck)), "{e}");
        // What the members still hold is served.
        verify_range(&a, &model, c.write_at + c.write_len, MIB).await;
        let detail = a.detail();
        let shown = detail["members"].as_array().unwrap().iter().find(|m| m["name"] == ms[0].name.as_str()).cloned();
        assert_eq!(shown.unwrap()["fail_reason"], "failed by request", "{detail}");
    }
}
