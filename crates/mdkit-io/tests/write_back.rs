//! `WriteBackDevice`: plain writes are answered while they still run on the device, and the
//! contract holds anyway — reads see every acknowledged write, overlapping writes land in order,
//! the window is bounded, a flush makes everything acknowledged before it durable (checked on
//! crash images at every flush), and a write lost after its acknowledgement fails every later
//! flush.

use std::sync::{Arc, Mutex};

use mdkit_io::{
    BlockDevice, BlockDeviceExt, CrashGroup, CrashPolicy, FaultRule, FaultyDevice, FlashDevice, FlashModel, MemDevice,
    OpMask, Rng, SharedBuf, WriteBackDevice, WriteBackOptions, WriteFlags,
};

const MIB: u64 = 1 << 20;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// A device whose writes take `write_us` (real waiting time).
fn slow_mem(write_us: u32) -> FlashDevice<MemDevice> {
    let model = FlashModel { write_latency_us: write_us, ..FlashModel::counting_only() };
    FlashDevice::new(MemDevice::new("mem", 4 * MIB), model)
}

fn block(v: u8) -> Vec<u8> {
    vec![v; 4096]
}

#[test]
fn plain_writes_are_answered_while_running_and_reads_see_them() {
    runtime().block_on(async {
        let wb = WriteBackDevice::new(slow_mem(30_000), WriteBackOptions::default());
        wb.write_slice(8192, &block(7), WriteFlags::NONE).await.unwrap();
        // On a current-thread runtime nothing else ran since: the write is still on the device.
        let s = wb.stats();
        assert_eq!((s.acknowledged_early, s.pending_writes), (1, 1), "{s:?}");
        assert!(wb.topology().volatile_cache);
        // The read waits for the pending write and returns its data.
        assert_eq!(wb.read_vec(8192, 4096).await.unwrap(), block(7));
        assert_eq!(wb.stats().pending_writes, 0);
        // A neighbouring block never waited.
        assert_eq!(wb.read_vec(0, 4096).await.unwrap(), block(0));
        // FUA writes go through: done when they return.
        wb.write_slice(0, &block(3), WriteFlags::FUA).await.unwrap();
        let s = wb.stats();
        assert_eq!((s.written_through, s.pending_writes), (1, 0), "{s:?}");
        wb.flush().await.unwrap();
    });
}

#[test]
fn overlapping_writes_land_in_order_and_the_window_is_bounded() {
    runtime().block_on(async {
        let wb = Arc::new(WriteBackDevice::new(slow_mem(200_000), WriteBackOptions { max_writes: 2, max_bytes: MIB }));
        // Older write of two blocks, then a newer one over its second block: the newer waits.
        wb.write_slice(0, &[block(1), block(1)].concat(), WriteFlags::NONE).await.unwrap();
        wb.write_slice(4096, &block(2), WriteFlags::NONE).await.unwrap();
        assert!(wb.stats().waits >= 1);
        assert_eq!(wb.read_vec(0, 8192).await.unwrap(), [block(1), block(2)].concat());

        // Two pending writes fill the window; a third waits for room (200 ms writes: a stalled
        // room appears during the few yields below only if the thread stalls that long).
        wb.write_slice(MIB, &block(4), WriteFlags::NONE).await.unwrap();
        wb.write_slice(2 * MIB, &block(5), WriteFlags::NONE).await.unwrap();
        assert_eq!(wb.stats().pending_writes, 2);
        let third = {
            let wb = wb.clone();
            tokio::spawn(async move { wb.write_slice(3 * MIB, &block(6), WriteFlags::NONE).await })
        };
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(!third.is_finished(), "the third write must wait for room");
        assert!(wb.stats().pending_writes <= 2);
        third.await.unwrap().unwrap();
        // A write larger than the byte window is written through.
        wb.write_slice(0, &vec![9u8; 2 * MIB as usize], WriteFlags::NONE).await.unwrap();
        assert_eq!(wb.read_vec(MIB, 4096).await.unwrap(), vec![9u8; 4096]);
        wb.flush().await.unwrap();
        assert_eq!(wb.read_vec(3 * MIB, 4096).await.unwrap(), block(6));
    });
}

#[test]
fn errors_before_queueing_come_back_and_a_lost_write_fails_every_later_flush() {
    runtime().block_on(async {
        // Refused at once (bounds; a fault on the first poll): the write itself reports it.
        let faulty = FaultyDevice::new(MemDevice::new("mem", 4 * MIB));
        let faults = faulty.handle();
        let wb = WriteBackDevice::new(faulty, WriteBackOptions::default());
        let e = wb.write_slice(4 * MIB, &block(1), WriteFlags::NONE).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
        faults.add(FaultRule::error(OpMask::of(mdkit_io::IoOp::Write), Some(0..4096)));
        assert!(wb.write_slice(0, &block(1), WriteFlags::NONE).await.is_err());
        wb.flush().await.unwrap();
        assert_eq!(wb.stats().lost_writes, 0);

        // Fails after it was answered (the fault sits below a slow device): lost.
        let faulty = FaultyDevice::new(MemDevice::new("mem", 4 * MIB));
        faulty.handle().add(FaultRule::error(OpMask::of(mdkit_io::IoOp::Write), Some(8192..12288)));
        let model = FlashModel { write_latency_us: 5_000, ..FlashModel::counting_only() };
        let wb = WriteBackDevice::new(FlashDevice::new(faulty, model), WriteBackOptions::default());
        wb.write_slice(0, &block(1), WriteFlags::NONE).await.unwrap();
        wb.write_slice(8192, &block(2), WriteFlags::NONE).await.unwrap();
        assert_eq!(wb.stats().acknowledged_early, 2);
        for _ in 0..2 {
            let e = wb.flush().await.unwrap_err();
            assert!(e.to_string().contains("lost write of 4096 bytes at offset 8192"), "{e}");
        }
        assert_eq!(wb.stats().lost_writes, 1);
        assert!(wb.handle().lost_write().is_some());
        // The write that succeeded is there.
        assert_eq!(wb.read_vec(0, 4096).await.unwrap(), block(1));
    });
}

/// A block written by `task` as its `seq`-th step: every 512-byte sector names both, so a torn
/// block (legal for a write still volatile at the cut) is checked sector by sector.
fn content(task: u64, seq: u64) -> Vec<u8> {
    let mut v = vec![0u8; 4096];
    for (i, s) in v.chunks_mut(512).enumerate() {
        s[..8].copy_from_slice(&task.to_le_bytes());
        s[8..16].copy_from_slice(&seq.to_le_bytes());
        s[16..].fill((task * 31 + seq * 7 + i as u64) as u8);
    }
    v
}

/// Each task owns 64 blocks and writes them randomly (FUA now and then), flushing now and
/// then. At the point each flush returned, every crash image must hold, for each block of that
/// task, what the task last wrote there before the flush began, or something the task wrote
/// after that; and what a FUA write put there, from the point it returned.
#[test]
fn every_flush_point_holds_what_was_acknowledged_before_it() {
    for seed in 0..6u64 {
        runtime().block_on(async move {
            const TASKS: u64 = 4;
            const BLOCKS: u64 = 64;
            let group = CrashGroup::new();
            let crash = group.wrap("m0", MemDevice::new("m0", TASKS * BLOCKS * 4096));
            let wb = Arc::new(WriteBackDevice::new(crash, WriteBackOptions { max_writes: 8, max_bytes: MIB }));
            // (task, point the flush returned, per block: minimum acceptable seq)
            let checks = Arc::new(Mutex::new(Vec::<(u64, u64, Vec<u64>)>::new()));
            let mut joins = Vec::new();
            for task in 0..TASKS {
                let (wb, group, checks) = (wb.clone(), group.clone(), checks.clone());
                joins.push(tokio::spawn(async move {
                    let mut rng = Rng::new(seed * 1000 + task);
                    let mut last = vec![0u64; BLOCKS as usize]; // seq acknowledged last (0 = never)
                    let mut durable = vec![0u64; BLOCKS as usize]; // seq known durable
                    for seq in 1..=120u64 {
                        if rng.chance(1, 8) {
                            let before = last.clone();
                            wb.flush().await.unwrap();
                            let point = group.now().0;
                            for (d, b) in durable.iter_mut().zip(&before) {
                                *d = (*d).max(*b);
                            }
                            checks.lock().unwrap().push((task, point, durable.clone()));
                            continue;
                        }
                        let b = rng.below(BLOCKS);
                        let fua = rng.chance(1, 6);
                        let off = (task * BLOCKS + b) * 4096;
                        let flags = if fua { WriteFlags::FUA } else { WriteFlags::NONE };
                        wb.write(off, SharedBuf::from_slice(&content(task, seq)), flags).await.unwrap();
                        last[b as usize] = seq;
                        if fua {
                            durable[b as usize] = seq;
                            checks.lock().unwrap().push((task, group.now().0, durable.clone()));
                        }
                    }
                }));
            }
            for j in joins {
                j.await.unwrap();
            }
            wb.flush().await.unwrap();
            assert!(wb.stats().acknowledged_early > 0, "the crash device yields inside I/O: writes must pend");
            let checks = checks.lock().unwrap().clone();
            assert!(checks.len() > 20);
            let mut rng = Rng::new(seed);
            for (task, point, min_seq) in checks {
                for policy in CrashPolicy::ALL {
                    let img = group.image_at(mdkit_io::CrashPoint(point), &mut rng, policy).unwrap();
                    let img = img[0].read_vec(0, (TASKS * BLOCKS * 4096) as usize).await.unwrap();
                    for b in 0..BLOCKS {
                        let at = ((task * BLOCKS + b) * 4096) as usize;
                        let want = min_seq[b as usize];
                        for (i, got) in img[at..at + 4096].chunks(512).enumerate() {
                            let ctx = format!("seed {seed} task {task} block {b} sector {i} point {point} {policy:?}");
                            if got.iter().all(|&x| x == 0) {
                                assert_eq!(want, 0, "{ctx}: acknowledged-and-flushed seq {want} is lost");
                                continue;
                            }
                            let seq = u64::from_le_bytes(got[8..16].try_into().unwrap());
                            assert_eq!(got, &content(task, seq)[i * 512..(i + 1) * 512], "{ctx}: not a whole sector");
                            assert!(seq >= want, "{ctx}: holds seq {seq}, acknowledged-and-flushed seq {want} is lost");
                        }
                    }
                }
            }
        });
    }
}

/// A plain `#[test]` thread has no tokio runtime: the write is polled to completion in place.
#[test]
fn without_a_runtime_to_finish_in_writes_go_through() {
    let wb = WriteBackDevice::new(MemDevice::new("mem", MIB), WriteBackOptions::default());
    let mut write = wb.write_slice(0, &block(1), WriteFlags::NONE);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    // MemDevice completes inline, so the first poll finishes the write.
    let std::task::Poll::Ready(r) = write.as_mut().poll(&mut cx) else { panic!("a RAM disk write pends") };
    r.unwrap();
    assert_eq!(wb.stats().acknowledged_early, 0);
    assert_eq!(wb.stats().written_through, 1);
}
