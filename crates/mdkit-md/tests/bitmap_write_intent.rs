//! The write-intent guarantee and its cost, on simulated members.
//!
//! - Every data write (a stand-in 4 KiB write per member, issued between `start_write` and
//!   `end_write` as a personality does) finds its chunk's bit durable on every member: checked
//!   by the oracle under concurrent writers, lazy clears, threshold clears and member flushes,
//!   on a paused current-thread runtime (deterministic) and on a multi-thread runtime.
//! - Group commit: N concurrent writers needing bits in one page cost one page write per member
//!   per round, and a write whose bit is already durable costs no I/O.
//! - Clearing: after a whole idle period, only after a member flush, never while degraded (and
//!   `events_cleared` does not move then), as soon as idle dirty chunks reach `flush_chunks`,
//!   never while `can_clear` is false or the chunk is being written.

use crate::bitmap_support;

use std::sync::Arc;
use std::time::Duration;

use bitmap_support::*;
use mdkit_io::{BlockDevice, BlockDeviceExt, DeviceRef, IoOp, MemDevice, Rng, Tracer};
use mdkit_md::array::bitmap::{BitmapCreate, WriteIntentBitmap};
use mdkit_md::format::bitmap::{BitmapGeometry, BitmapSuper};

const CHUNK_BYTES: u32 = 64 << 10;

fn geo(chunks: u64) -> BitmapGeometry {
    BitmapGeometry::new(CHUNK_BYTES, chunks * chunk_sectors(CHUNK_BYTES)).unwrap()
}

fn clean(chunk_bytes: u32) -> BitmapCreate {
    BitmapCreate { all_dirty: false, ..BitmapCreate::new(chunk_bytes) }
}

/// `n` oracle-wrapped RAM members for a bitmap of `chunks` chunks.
fn oracle_members(n: usize, chunks: u64) -> (Oracle, Vec<DeviceRef>) {
    let oracle = Oracle::new(geo(chunks));
    let devs = (0..n)
        .map(|i| {
            let mem: DeviceRef = Arc::new(MemDevice::new(format!("m{i}"), device_bytes(chunks)));
            Arc::new(oracle.wrap(mem)) as DeviceRef
        })
        .collect();
    (oracle, devs)
}

async fn create(devs: &[DeviceRef], chunks: u64, failures: &Failures) -> WriteIntentBitmap {
    let members = devs.iter().enumerate().map(|(i, d)| member(i as u32, d.clone(), 64 << 10)).collect();
    WriteIntentBitmap::create(members, array_info(chunks, CHUNK_BYTES), clean(CHUNK_BYTES), failures.callback())
        .await
        .expect("create")
}

/// Random writers: each picks chunks (mostly from a hot set), takes the bits, writes the data
/// stand-ins (sometimes FUA), ends the write, sometimes flushes every member, sometimes sleeps
/// so the daemon sweeps in between.
async fn writers(bm: Arc<WriteIntentBitmap>, devs: Vec<DeviceRef>, chunks: u64, tasks: usize, ops: usize, seed: u64) {
    let mut handles = Vec::new();
    for t in 0..tasks {
        let bm = bm.clone();
        let devs = devs.clone();
        handles.push(tokio::spawn(async move {
            let mut rng = Rng::new(seed ^ (t as u64 * 0x9e37));
            for _ in 0..ops {
                let c = if rng.chance(3, 4) { rng.below(24) * 37 % chunks } else { rng.below(chunks) };
                let span = if rng.chance(1, 8) { 2 } else { 1 };
                let last = (c + span).min(chunks);
                let range = c * chunk_sectors(CHUNK_BYTES)..last * chunk_sectors(CHUNK_BYTES);
                bm.start_write(range.clone()).await.expect("start_write");
                for cc in c..last {
                    data_write(&devs, cc, rng.chance(1, 10)).await.expect("data write");
                }
                bm.end_write(range, true);
                if rng.chance(1, 16) {
                    flush_all(&devs).await.expect("flush");
                }
                if rng.chance(1, 4) {
                    tokio::time::sleep(Duration::from_millis(rng.below(40))).await;
                }
            }
        }));
    }
    for h in handles {
        h.await.expect("writer task");
    }
}

#[test]
fn every_data_write_finds_its_bit_durable_on_every_member() {
    let seed = 0x77_17e;
    eprintln!("seed {seed}");
    paused_runtime().block_on(async {
        let chunks = 70_000; // three pages, the last one partial
        let (oracle, devs) = oracle_members(3, chunks);
        let failures = Failures::default();
        let bm = Arc::new(create(&devs, chunks, &failures).await);
        bm.set_attribute("bitmap/time_base", "0.05").unwrap().unwrap();
        bm.set_attribute("bitmap/flush_chunks", "16").unwrap().unwrap();
        writers(bm.clone(), devs.clone(), chunks, 48, 120, seed).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let st = bm.stats();
        eprintln!("{st:?}; data writes checked by the oracle: {}", oracle.data_writes_checked());
        oracle.assert_clean();
        assert!(oracle.data_writes_checked() > 3 * 48 * 120, "the oracle saw the data writes");
        assert!(st.bits_cleared > 100, "clears interleaved with the writers: {st:?}");
        assert!(st.sweeps > 10, "{st:?}");
        assert_eq!(st.dirty_chunks, 0, "everything idle for 200 ms was cleared: {st:?}");
        assert!(failures.slots().is_empty());
    });
}

#[test]
fn write_intent_holds_on_a_multi_thread_runtime() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap();
    rt.block_on(async {
        let chunks = 5_000;
        let (oracle, devs) = oracle_members(2, chunks);
        let failures = Failures::default();
        let bm = Arc::new(create(&devs, chunks, &failures).await);
        bm.set_attribute("bitmap/time_base", "0.01").unwrap().unwrap();
        bm.set_attribute("bitmap/flush_chunks", "8").unwrap().unwrap();
        writers(bm.clone(), devs.clone(), chunks, 32, 200, 99).await;
        let st = bm.stats();
        eprintln!("{st:?}");
        oracle.assert_clean();
        assert!(st.bits_cleared > 0, "{st:?}");
    });
}

#[test]
fn concurrent_bit_setters_share_one_page_write_per_member() {
    paused_runtime().block_on(async {
        let chunks = 40_000; // two pages
        let tracer = Tracer::new(4096);
        let devs: Vec<DeviceRef> = (0..3)
            .map(|i| Arc::new(tracer.wrap(MemDevice::new(format!("m{i}"), device_bytes(chunks)))) as DeviceRef)
            .collect();
        let failures = Failures::default();
        let members = devs.iter().enumerate().map(|(i, d)| member(i as u32, d.clone(), 64 << 10)).collect();
        let bm = Arc::new(
            WriteIntentBitmap::create(
                members,
                array_info(chunks, CHUNK_BYTES),
                clean(CHUNK_BYTES),
                failures.callback(),
            )
            .await
            .unwrap(),
        );
        tracer.reset();
        let before = bm.stats();
        // 64 writers, 64 different chunks, all in page 0.
        let tasks: Vec<_> = (0..64u64)
            .map(|i| {
                let bm = bm.clone();
                tokio::spawn(async move { bm.start_write(chunk_range(i * 100, CHUNK_BYTES)).await })
            })
            .collect();
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        let st = bm.stats();
        let rounds = st.set_rounds - before.set_rounds;
        assert_eq!(st.page_writes - before.page_writes, 3);
        let snap = tracer.snapshot();
        let writes = snap.total().ops.write.requests;
        eprintln!("64 start_write: {rounds} round(s), {writes} member page writes");
        assert_eq!(rounds, 1, "every request joined the first round");
        assert_eq!(writes, 3, "one page write per member");
        for d in &snap.devices {
            assert_eq!(d.ops.write.requests, 1, "{}", d.name);
            assert_eq!(d.fua_writes, 1, "bits are set with FUA: {}", d.name);
        }
        // The same chunks again: bits already durable, no I/O at all.
        for i in 0..64u64 {
            bm.start_write(chunk_range(i * 100, CHUNK_BYTES)).await.unwrap();
        }
        assert_eq!(tracer.snapshot().total().ops.write.requests, 3);
        assert_eq!(bm.stats().fast_path_writes - st.fast_path_writes, 64);
        for i in 0..64u64 {
            bm.end_write(chunk_range(i * 100, CHUNK_BYTES), true);
            bm.end_write(chunk_range(i * 100, CHUNK_BYTES), true);
        }
        // Requests for two pages: still one round, one write of both pages per member.
        tracer.reset();
        let tasks: Vec<_> = (0..32u64)
            .map(|i| {
                let bm = bm.clone();
                let c = if i % 2 == 0 { i + 1 } else { 35_000 + i };
                tokio::spawn(async move { bm.start_write(chunk_range(c, CHUNK_BYTES)).await })
            })
            .collect();
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        let snap = tracer.snapshot();
        assert_eq!(snap.total().ops.write.requests, 3, "one write per member");
        assert_eq!(snap.total().ops.write.bytes, 3 * 8192, "each covering both pages");
    });
}

/// Reads the bitmap area of a member as it is now.
async fn area(dev: &DeviceRef, chunks: u64) -> Vec<u8> {
    dev.read_vec(BITMAP_OFFSET, (geo(chunks).pages() * 4096) as usize).await.unwrap()
}

#[test]
fn bits_clear_after_a_whole_idle_period_and_only_after_a_flush() {
    paused_runtime().block_on(async {
        let chunks = 1000;
        let tracer = Tracer::new(1 << 16);
        let devs: Vec<DeviceRef> = (0..2)
            .map(|i| Arc::new(tracer.wrap(MemDevice::new(format!("m{i}"), device_bytes(chunks)))) as DeviceRef)
            .collect();
        let failures = Failures::default();
        let members = devs.iter().enumerate().map(|(i, d)| member(i as u32, d.clone(), 64 << 10)).collect();
        let bm = WriteIntentBitmap::create(
            members,
            array_info(chunks, CHUNK_BYTES),
            clean(CHUNK_BYTES),
            failures.callback(),
        )
        .await
        .unwrap();
        bm.set_attribute("time_base", "1").unwrap().unwrap();
        let g = geo(chunks);
        bm.start_write(chunk_range(7, CHUNK_BYTES)).await.unwrap();
        data_write(&devs, 7, false).await.unwrap();
        bm.end_write(chunk_range(7, CHUNK_BYTES), true);
        for d in &devs {
            assert!(bit_on(&area(d, chunks).await, &g, 7), "set on {}", d.name());
        }
        // Sweeps at 1 s (age 1) and 2 s (age 2 -> cleared): still set at 1.5 s.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(bm.dirty_chunks(), vec![7]);
        for d in &devs {
            assert!(bit_on(&area(d, chunks).await, &g, 7));
        }
        tokio::time::sleep(Duration::from_millis(1000)).await;
        assert_eq!(bm.dirty_chunks(), Vec::<u64>::new());
        for d in &devs {
            assert!(!bit_on(&area(d, chunks).await, &g, 7), "cleared on {}", d.name());
        }
        // The trace: both members' flushes completed before any clearing page write started.
        let events = tracer.snapshot().events;
        let clear_writes: Vec<_> = events
            .iter()
            .filter(|e| e.op == IoOp::Write && e.offset_bytes >= BITMAP_OFFSET && e.offset_bytes < DATA_BASE && !e.fua)
            .collect();
        assert!(!clear_writes.is_empty(), "clears are plain writes");
        for w in &clear_writes {
            for d in &devs {
                let flushed_before = events.iter().any(|f| {
                    f.op == IoOp::Flush && &*f.device == d.name() && f.start + f.latency <= w.start && f.seq < w.seq
                });
                assert!(
                    flushed_before,
                    "clear write on {} at {:?} not preceded by a flush of {}",
                    w.device,
                    w.start,
                    d.name()
                );
            }
        }
        assert_eq!(bm.stats().member_flushes, 2);
    });
}

/// Periodic sweeps judge idleness per `idle_region_bytes` region: a chunk written once stays
/// dirty while a neighbour in its region keeps being written, and clears a whole idle period
/// after the region went quiet; a chunk in another region clears on its own schedule, and with
/// `idle_region_bytes` 0 every chunk is judged alone (md's rule). `flush_chunks` sweeps ignore
/// regions.
#[test]
fn a_region_clears_only_when_all_of_it_went_idle() {
    paused_runtime().block_on(async {
        let chunks = 1000;
        let (_oracle, devs) = oracle_members(2, chunks);
        let failures = Failures::default();
        let bm = create(&devs, chunks, &failures).await;
        bm.set_attribute("time_base", "1").unwrap().unwrap();
        // Regions of 100 chunks.
        bm.set_attribute("idle_region_bytes", &(100 * u64::from(CHUNK_BYTES)).to_string()).unwrap().unwrap();
        let attr = |name: &str| bm.attributes().into_iter().find(|(k, _)| *k == name).map(|(_, v)| v);
        assert_eq!(attr("bitmap/idle_region_bytes").as_deref(), Some("6553600"));
        let write = |c: u64| {
            let bm = &bm;
            let devs = &devs;
            async move {
                bm.start_write(chunk_range(c, CHUNK_BYTES)).await.unwrap();
                data_write(devs, c, false).await.unwrap();
                bm.end_write(chunk_range(c, CHUNK_BYTES), true);
            }
        };
        // Chunk 7 once; chunk 250 (another region) once; chunk 8 (7's region) every 300 ms.
        write(7).await;
        write(250).await;
        for _ in 0..10 {
            write(8).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        // 3 s: 250 was cleared after its region idled a whole period; 7 is kept by 8.
        assert_eq!(bm.dirty_chunks(), vec![7, 8]);
        // The region goes quiet: both clear within two periods.
        tokio::time::sleep(Duration::from_millis(2100)).await;
        assert_eq!(bm.dirty_chunks(), Vec::<u64>::new());

        // Per chunk (md's rule): 7 clears while 8 is still being written.
        bm.set_attribute("idle_region_bytes", "0").unwrap().unwrap();
        write(7).await;
        for _ in 0..10 {
            write(8).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        assert_eq!(bm.dirty_chunks(), vec![8]);

        // A threshold sweep clears idle chunks whatever their region.
        bm.set_attribute("idle_region_bytes", &(1000 * u64::from(CHUNK_BYTES)).to_string()).unwrap().unwrap();
        bm.set_attribute("time_base", "3600").unwrap().unwrap();
        for c in [20, 21, 22] {
            write(c).await;
        }
        bm.set_attribute("flush_chunks", "3").unwrap().unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(bm.dirty_chunks().iter().all(|c| ![20, 21, 22].contains(c)), "{:?}", bm.dirty_chunks());
        assert!(bm.set_attribute("idle_region_bytes", "lots").unwrap().is_err());
        assert!(failures.0.lock().is_empty());
    });
}

/// A clean bitmap (md events 10) of `chunks` chunks on two in-memory members.
async fn two_member_bitmap(chunks: u64) -> (Vec<DeviceRef>, Failures, WriteIntentBitmap) {
    let devs: Vec<DeviceRef> =
        (0..2).map(|i| Arc::new(MemDevice::new(format!("m{i}"), device_bytes(chunks))) as DeviceRef).collect();
    let failures = Failures::default();
    let members = devs.iter().enumerate().map(|(i, d)| member(i as u32, d.clone(), 64 << 10)).collect();
    let bm =
        WriteIntentBitmap::create(members, array_info(chunks, CHUNK_BYTES), clean(CHUNK_BYTES), failures.callback())
            .await
            .unwrap();
    (devs, failures, bm)
}

/// A member that fails during a superblock round keeps the previous event count; a sweep that
/// runs while the round is in flight (the bitmap header already has the new count) must not
/// move `events_cleared` past it, or the member can only be rebuilt in full. Seen as "events 7
/// differ from the array's 12 and no write-intent bitmap covers what it missed" when a remote
/// member's link went down while a round was writing to it.
#[test]
fn a_sweep_during_a_superblock_round_keeps_the_failing_member_re_addable() {
    paused_runtime().block_on(async {
        let chunks = 1000;
        let (devs, failures, bm) = two_member_bitmap(chunks).await;
        assert_eq!(bm.events_cleared(), 10);
        bm.start_write(chunk_range(3, CHUNK_BYTES)).await.unwrap();
        bm.end_write(chunk_range(3, CHUNK_BYTES), true);
        // Round 11 starts: the bitmap header first; member 1's md superblock never gets 11.
        bm.update_superblock(11).await.unwrap();
        assert_eq!(bm.sweep_now().await.unwrap(), 1, "idle chunk 3 clears");
        assert_eq!(bm.events_cleared(), 10, "not past the events every member's superblock holds");
        // Member 1 fails in that round; round 12 records the failure on member 0 alone.
        bm.set_degraded(true);
        bm.set_members(vec![member(0, devs[0].clone(), 64 << 10)]);
        bm.update_superblock(12).await.unwrap();
        bm.superblocks_recorded(12);
        bm.start_write(chunk_range(7, CHUNK_BYTES)).await.unwrap();
        bm.end_write(chunk_range(7, CHUNK_BYTES), false);
        assert_eq!(bm.sweep_now().await.unwrap(), 0);
        assert_eq!(bm.events_cleared(), 10);
        assert!(bm.can_readd(10), "member 1 (events 10) is re-added from the bitmap");
        assert_eq!(bm.needed_chunks(), vec![7], "only what it missed");
        // Whole again: the sweep advances to the recorded events.
        bm.set_members(vec![member(0, devs[0].clone(), 64 << 10), member(1, devs[1].clone(), 64 << 10)]);
        bm.sync_all_pages().await.unwrap();
        bm.end_sync(chunk_range(7, CHUNK_BYTES));
        bm.set_degraded(false);
        bm.update_superblock(13).await.unwrap();
        assert_eq!(bm.sweep_now().await.unwrap(), 1);
        assert_eq!(bm.events_cleared(), 12, "round 13 is still in flight");
        bm.superblocks_recorded(13);
        bm.start_write(chunk_range(9, CHUNK_BYTES)).await.unwrap();
        bm.end_write(chunk_range(9, CHUNK_BYTES), true);
        assert_eq!(bm.sweep_now().await.unwrap(), 1);
        assert_eq!(bm.events_cleared(), 13);
        assert!(failures.0.lock().is_empty());
    });
}

#[test]
fn nothing_clears_while_degraded_and_events_cleared_stands_still() {
    paused_runtime().block_on(async {
        let chunks = 1000;
        let (devs, _, bm) = two_member_bitmap(chunks).await;
        bm.set_attribute("time_base", "0.1").unwrap().unwrap();
        bm.set_attribute("flush_chunks", "1").unwrap().unwrap();
        assert_eq!(bm.events_cleared(), 10);
        // Member 1 leaves: md writes events 11 (bitmap first), then the array runs degraded.
        bm.set_degraded(true);
        bm.set_members(vec![member(0, devs[0].clone(), 64 << 10)]);
        bm.update_superblock(11).await.unwrap();
        for c in [3u64, 500, 999] {
            bm.start_write(chunk_range(c, CHUNK_BYTES)).await.unwrap();
            bm.end_write(chunk_range(c, CHUNK_BYTES), false);
        }
        bm.update_superblock(12).await.unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(bm.dirty_chunks(), vec![3, 500, 999]);
        assert_eq!(bm.needed_chunks(), vec![3, 500, 999]);
        assert_eq!(bm.events_cleared(), 10);
        assert_eq!(bm.sweep_now().await.unwrap(), 0);
        assert!(bm.set_attribute("can_clear", "true").unwrap().is_err(), "md refuses can_clear=true while degraded");
        let on_disk = BitmapSuper::decode(&area(&devs[0], chunks).await).unwrap();
        assert_eq!((on_disk.events, on_disk.events_cleared), (12, 10));
        // Member 1 (events 10 >= events_cleared 10) is re-added: only the chunks written meanwhile.
        assert!(bm.can_readd(10));
        bm.set_members(vec![member(0, devs[0].clone(), 64 << 10), member(1, devs[1].clone(), 64 << 10)]);
        bm.sync_all_pages().await.unwrap();
        let needs: Vec<u64> = (0..chunks).filter(|&c| bm.chunk_needs_sync(c * chunk_sectors(CHUNK_BYTES))).collect();
        assert_eq!(needs, vec![3, 500, 999]);
        for c in needs {
            bm.end_sync(chunk_range(c, CHUNK_BYTES));
        }
        bm.set_degraded(false);
        bm.update_superblock(13).await.unwrap();
        // The array's md superblocks with events 13 are on both members now.
        bm.superblocks_recorded(13);
        tokio::time::sleep(Duration::from_millis(350)).await;
        assert_eq!(bm.dirty_chunks(), Vec::<u64>::new(), "cleared once whole again");
        assert_eq!(bm.events_cleared(), 13, "advanced to the md events by the clearing sweep");
        for d in &devs {
            let a = area(d, chunks).await;
            assert_eq!(BitmapSuper::decode(&a).unwrap().events_cleared, 13, "{}", d.name());
            assert_eq!(mdkit_md::format::bitmap::count_dirty(&a, &geo(chunks)), 0);
        }
        assert!(!bm.can_readd(12), "a member that left before the clear needs a full recovery");
    });
}

#[test]
fn threshold_clears_without_waiting_for_the_period() {
    paused_runtime().block_on(async {
        let chunks = 1000;
        let (devs, _, bm) = two_member_bitmap(chunks).await;
        bm.set_attribute("time_base", "3600").unwrap().unwrap();
        bm.set_attribute("flush_chunks", "20").unwrap().unwrap();
        let start = tokio::time::Instant::now();
        for c in 0..19u64 {
            bm.start_write(chunk_range(c * 3, CHUNK_BYTES)).await.unwrap();
            bm.end_write(chunk_range(c * 3, CHUNK_BYTES), true);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(bm.stats().idle_dirty_chunks, 19, "below the threshold: nothing happens");
        assert_eq!(bm.stats().bits_cleared, 0);
        // A hot chunk stays busy across the threshold sweep: it must not be cleared.
        bm.start_write(chunk_range(999, CHUNK_BYTES)).await.unwrap();
        bm.start_write(chunk_range(60, CHUNK_BYTES)).await.unwrap();
        bm.end_write(chunk_range(60, CHUNK_BYTES), true); // 20th idle dirty chunk
        tokio::time::sleep(Duration::from_millis(10)).await;
        let st = bm.stats();
        assert_eq!(st.bits_cleared, 20, "{st:?}");
        assert_eq!(bm.dirty_chunks(), vec![999]);
        assert!(start.elapsed() < Duration::from_secs(1), "long before the 1 h period");
        for d in &devs {
            let a = area(d, chunks).await;
            assert_eq!(mdkit_md::format::bitmap::count_dirty(&a, &geo(chunks)), 1, "{}", d.name());
        }
        bm.end_write(chunk_range(999, CHUNK_BYTES), true);
        // can_clear=false keeps every bit.
        bm.set_attribute("can_clear", "false").unwrap().unwrap();
        for c in 100..130u64 {
            bm.start_write(chunk_range(c, CHUNK_BYTES)).await.unwrap();
            bm.end_write(chunk_range(c, CHUNK_BYTES), true);
        }
        assert_eq!(bm.sweep_now().await.unwrap(), 0);
        assert_eq!(bm.dirty_chunks().len(), 31);
        let attrs: std::collections::HashMap<_, _> = bm.attributes().into_iter().collect();
        assert_eq!(attrs["bitmap/can_clear"], "false");
        assert_eq!(attrs["bitmap/chunksize"], CHUNK_BYTES.to_string());
        assert_eq!(attrs["bitmap/time_base"], "3600");
        assert_eq!(attrs["bitmap/flush_chunks"], "20");
        bm.set_attribute("can_clear", "true").unwrap().unwrap();
        assert_eq!(bm.sweep_now().await.unwrap(), 31);
    });
}

#[test]
fn attributes_are_validated() {
    paused_runtime().block_on(async {
        let chunks = 100;
        let dev: DeviceRef = Arc::new(MemDevice::new("m0", device_bytes(chunks)));
        let bm = WriteIntentBitmap::create(
            vec![member(0, dev.clone(), 64 << 10)],
            array_info(chunks, CHUNK_BYTES),
            clean(CHUNK_BYTES),
            Failures::default().callback(),
        )
        .await
        .unwrap();
        for (name, value) in [("time_base", "0"), ("time_base", "abc"), ("backlog", "16384"), ("can_clear", "maybe")] {
            let e = bm.set_attribute(name, value).unwrap().unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{name}={value}: {e}");
        }
        assert_eq!(
            bm.set_attribute("chunksize", "4096").unwrap().unwrap_err().kind(),
            std::io::ErrorKind::PermissionDenied
        );
        assert!(bm.set_attribute("stripe_cache_size", "256").is_none());
        bm.set_attribute("backlog", "256").unwrap().unwrap();
        bm.set_attribute("time_base", "0.5").unwrap().unwrap();
        bm.update_superblock(11).await.unwrap();
        let h = BitmapSuper::decode(&dev.read_vec(BITMAP_OFFSET, 4096).await.unwrap()).unwrap();
        assert_eq!(
            (h.write_behind, h.daemon_sleep_secs, h.events),
            (256, 1, 11),
            "sub-second time_base is 1 s on disk"
        );
        // Out-of-range writes are refused, not silently uncovered.
        let e = bm.start_write(0..(chunks + 1) * chunk_sectors(CHUNK_BYTES)).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
        assert!(e.to_string().contains("beyond"), "{e}");
        bm.shutdown().await.unwrap();
        assert!(bm.start_write(0..8).await.is_err());
    });
}

#[test]
fn a_cancelled_start_write_releases_its_chunk() {
    paused_runtime().block_on(async {
        let chunks = 100;
        let dev: DeviceRef = Arc::new(MemDevice::new("m0", device_bytes(chunks)));
        let bm = WriteIntentBitmap::create(
            vec![member(0, dev.clone(), 64 << 10)],
            array_info(chunks, CHUNK_BYTES),
            clean(CHUNK_BYTES),
            Failures::default().callback(),
        )
        .await
        .unwrap();
        {
            // Polled once (the bit is set and a round requested), then dropped: no data write
            // was issued and nothing stays pending.
            let mut fut = std::pin::pin!(bm.start_write(chunk_range(5, CHUNK_BYTES)));
            tokio::select! {
                biased;
                _ = &mut fut => panic!("the bit cannot be durable without a round"),
                _ = std::future::ready(()) => {}
            }
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(bm.dirty_chunks(), vec![5]);
        assert_eq!(bm.sweep_now().await.unwrap(), 1, "an abandoned bit is cleared like an idle one");
        assert_eq!(bm.dirty_chunks(), Vec::<u64>::new());
        bm.start_write(chunk_range(5, CHUNK_BYTES)).await.unwrap();
        bm.end_write(chunk_range(5, CHUNK_BYTES), true);
        assert_eq!(bm.stats().idle_dirty_chunks, 1);
    });
}
