//! Correctness under concurrency: many tasks write overlapping ranges in the same few stripes
//! at once (healthy arrays, raid5 with one member missing, raid6 with two missing), in phases.
//! After each phase every 4 KiB block must hold exactly one of the blocks written to it during
//! the phase (overlapping concurrent writes may resolve either way, but never mix or tear), or
//! its contents from before the phase if nobody wrote it. Every block a write produces is
//! self-describing (write id + block index + seeded bytes), so the check is exact. A helper
//! task keeps changing `stripe_size` (4/8/12/64 KiB) and `rmw_level` in the middle of the
//! workload: nothing is lost. At the end (after rebuilding the missing members) `check` finds
//! 0 mismatches.

use crate::array_util;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use array_util::*;
use mdkit_io::{BlockDevice, BlockDeviceExt, DeviceRef, FlashDevice, IoBuf, MemDevice, Rng, WriteFlags};
use mdkit_md::array::Array;
use mdkit_md::layout::Level;

const BLOCK: usize = 4096;

/// RAM members with flash-like latencies (tens of µs, many channels), so member I/O really
/// overlaps and writes to a stripe meet in its cache entry.
fn slow_members(prefix: &str, n: usize, size: u64) -> Vec<SimMember> {
    let model = flash_like_model();
    (0..n)
        .map(|i| {
            let name = format!("{prefix}{i}");
            let mem = Arc::new(MemDevice::new(name.clone(), size));
            let dev: DeviceRef = Arc::new(FlashDevice::new(mem.clone() as DeviceRef, model));
            SimMember { name, dev, mem: Some(mem), fault: None }
        })
        .collect()
}

/// The contents write `id` puts in array block `block`.
fn block_contents(id: u64, block: u64, out: &mut [u8]) {
    out[..8].copy_from_slice(&id.to_le_bytes());
    out[8..16].copy_from_slice(&block.to_le_bytes());
    let mut r = Rng::new(id.wrapping_mul(0x1_0000_0001) ^ block);
    r.fill(&mut out[16..]);
}

/// One phase: `tasks` writers, each `ops` writes of 1..=max_blocks blocks inside `window`
/// blocks. Returns, per block, the ids written to it.
async fn phase(
    a: &Array,
    seed: u64,
    tasks: u64,
    ops: u64,
    window: u64,
    max_blocks: u64,
    next_id: u64,
) -> HashMap<u64, Vec<u64>> {
    let futs = (0..tasks).map(|t| async move {
        let mut rng = Rng::new(seed ^ (t << 32));
        let mut issued: Vec<(u64, u64, u64)> = Vec::new();
        for i in 0..ops {
            let len = 1 + rng.below(max_blocks);
            let start = rng.below(window - len + 1);
            let id = next_id + t * 1_000_000 + i;
            let mut buf = IoBuf::zeroed(len as usize * BLOCK);
            for (k, chunk) in buf.as_mut_slice().chunks_mut(BLOCK).enumerate() {
                block_contents(id, start + k as u64, chunk);
            }
            let flags = if rng.below(10) == 0 { WriteFlags::FUA } else { WriteFlags::NONE };
            a.write(start * BLOCK as u64, buf.freeze(), flags)
                .await
                .unwrap_or_else(|e| panic!("write {start}+{len} blocks: {e}"));
            issued.push((id, start, len));
            if rng.below(4) == 0 {
                tokio::task::yield_now().await;
            }
        }
        issued
    });
    let mut written: HashMap<u64, Vec<u64>> = HashMap::new();
    for issued in mdkit_md::array::io::join_all(futs).await {
        for (id, start, len) in issued {
            for b in start..start + len {
                written.entry(b).or_default().push(id);
            }
        }
    }
    written
}

/// Checks the window against the phase's writes and the previous contents; returns the new
/// contents.
async fn verify_phase(a: &Array, ctx: &str, window: u64, before: &[u8], written: &HashMap<u64, Vec<u64>>) -> Vec<u8> {
    let now = a.read_vec(0, window as usize * BLOCK).await.unwrap();
    let mut expect = vec![0u8; BLOCK];
    for b in 0..window {
        let got = &now[b as usize * BLOCK..(b as usize + 1) * BLOCK];
        match written.get(&b) {
            None => assert!(
                got == &before[b as usize * BLOCK..(b as usize + 1) * BLOCK],
                "{ctx}: unwritten block {b} changed"
            ),
            Some(ids) => {
                let id = u64::from_le_bytes(got[..8].try_into().unwrap());
                assert!(ids.contains(&id), "{ctx}: block {b} holds id {id}, not one of the {} writes to it", ids.len());
                block_contents(id, b, &mut expect);
                assert!(got == &expect[..], "{ctx}: block {b} is torn or mixed (header says write {id})");
            }
        }
    }
    now
}

async fn run(level: Level, n: usize, fail: &[usize], seed: u64) {
    let name = format!("conc-{}-{}m", level.name(), fail.len());
    let ms = slow_members(&format!("{name}-"), n + fail.len(), 4 * MIB);
    let a = create_array(&ms[..n], opts(level, n as u32, Some(32), None, true, true)).await;
    fast_sync(&a);
    for &f in fail {
        a.fail_member(&ms[f].name).await.unwrap();
        a.remove_member(&ms[f].name).await.unwrap();
    }
    assert_eq!(a.core().degraded() as usize, fail.len());
    // Three stripes (32 KiB chunks) plus a bit: heavy contention on the same rows.
    let data_disks = (n - level.max_degraded() as usize) as u64;
    let window = 3 * data_disks * 8 + 5;
    let a = Arc::new(a);
    let stop = Arc::new(AtomicBool::new(false));
    let knob = {
        let (a, stop) = (a.clone(), stop.clone());
        tokio::spawn(async move {
            let sizes = ["4096", "8192", "12288", "65536"];
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                a.set_attribute("stripe_size", sizes[i % sizes.len()]).unwrap();
                a.set_attribute("rmw_level", ["1", "2", "0"][i % 3]).unwrap();
                i += 1;
                tokio::time::sleep(Duration::from_micros(700)).await;
            }
            i
        })
    };
    let mut before = a.read_vec(0, window as usize * BLOCK).await.unwrap();
    for p in 0..6u64 {
        let written = phase(&a, seed + p, 12, 25, window, 12, (p + 1) << 40).await;
        before = verify_phase(&a, &format!("{name} phase {p} (seed {seed})"), window, &before, &written).await;
    }
    stop.store(true, Ordering::Relaxed);
    let changes = knob.await.unwrap();
    assert!(changes > 3, "stripe_size changed {changes} times during the workload");
    let batched = a.get_attribute("stripe_batched_writes").unwrap().parse::<u64>().unwrap();
    let batches = a.get_attribute("stripe_batches").unwrap().parse::<u64>().unwrap();
    eprintln!(
        "{name}: {batched} pieces in {batches} batches; attrs {:?}",
        a.attributes().iter().filter(|(k, _)| k.ends_with("_writes")).collect::<Vec<_>>()
    );
    assert!(batched > batches, "{name}: concurrent writes to a stripe share batches");
    // Rebuild what is missing, then every parity unit matches.
    for (i, _) in fail.iter().enumerate() {
        a.add_member(ms[n + i].member_dev()).await.unwrap();
    }
    a.wait_sync_idle().await;
    assert_eq!(a.core().degraded(), 0, "{name}: rebuilt");
    let again = a.read_vec(0, window as usize * BLOCK).await.unwrap();
    assert!(again == before, "{name}: contents changed by the rebuild");
    assert_eq!(check(&a).await, 0, "{name}: mismatches");
    a.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid5_healthy_and_one_missing() {
    let s = seed("raid5_healthy_and_one_missing", 61);
    run(Level::Raid5, 4, &[], s).await;
    run(Level::Raid5, 4, &[1], s + 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid6_healthy_one_and_two_missing() {
    let s = seed("raid6_healthy_one_and_two_missing", 67);
    run(Level::Raid6, 6, &[], s).await;
    run(Level::Raid6, 6, &[4], s + 10).await;
    run(Level::Raid6, 6, &[0, 3], s + 20).await;
}
