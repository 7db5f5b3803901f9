//! Flush batching: one member-flush round serves every flush request that arrived before it
//! started.
//! - 128 concurrent clients writing 4 KiB then flushing, in a loop: rounds <= requests / 8,
//!   and no request completes before a round that started after it arrived has completed
//!   (checked against a log of arrivals, round starts/ends and completions);
//! - the same on crash-recording members: when a client's flush returns, every write it
//!   completed before asking is durable (the image of a power cut right then has it);
//! - batching off: one round per request; the rule also holds on a multi-thread runtime.

use crate::bitmap_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bitmap_support::paused_runtime;
use mdkit_io::{BlockDevice, CrashGroup, CrashPolicy, DeviceRef, MemDevice, Rng, SharedBuf, WriteFlags};
use mdkit_md::array::flush::FlushBatcher;
use parking_lot::Mutex;

#[derive(Default)]
struct Log {
    clock: AtomicU64,
    /// (start, end) of every round.
    rounds: Mutex<Vec<(u64, u64)>>,
    /// (arrival, completion) of every request.
    requests: Mutex<Vec<(u64, u64)>>,
}

impl Log {
    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::SeqCst)
    }

    /// Every request is covered by a round that started after it arrived and ended before it
    /// completed.
    fn check(&self) {
        let rounds = self.rounds.lock();
        let requests = self.requests.lock();
        for &(arrival, done) in requests.iter() {
            assert!(
                rounds.iter().any(|&(s, e)| s > arrival && e < done),
                "request (arrived {arrival}, completed {done}) was not served by a round that started after it"
            );
        }
    }
}

async fn member_flush_round(log: Arc<Log>, devs: Arc<Vec<DeviceRef>>) -> std::io::Result<()> {
    let start = log.tick();
    for d in devs.iter() {
        d.flush().await?;
    }
    tokio::time::sleep(Duration::from_micros(500)).await; // a flush takes time on real disks
    log.rounds.lock().push((start, log.tick()));
    Ok(())
}

async fn clients(batcher: Arc<FlushBatcher>, log: Arc<Log>, devs: Arc<Vec<DeviceRef>>, n: u64, loops: u64) {
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let (batcher, log, devs) = (batcher.clone(), log.clone(), devs.clone());
            tokio::spawn(async move {
                let mut rng = Rng::new(i);
                for k in 0..loops {
                    let off = (i * loops + k) * 4096;
                    for d in devs.iter() {
                        d.write(off, SharedBuf::from_slice(&[i as u8; 4096]), WriteFlags::NONE).await.unwrap();
                    }
                    if rng.chance(1, 3) {
                        tokio::task::yield_now().await;
                    }
                    let arrival = log.tick();
                    let round = {
                        let (log, devs) = (log.clone(), devs.clone());
                        move || member_flush_round(log, devs)
                    };
                    batcher.flush(round).await.unwrap();
                    log.requests.lock().push((arrival, log.tick()));
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

fn mem_members(n: usize) -> Arc<Vec<DeviceRef>> {
    Arc::new((0..n).map(|i| Arc::new(MemDevice::new(format!("m{i}"), 64 << 20)) as DeviceRef).collect())
}

#[test]
fn one_round_serves_every_request_that_arrived_before_it() {
    paused_runtime().block_on(async {
        for n in [32u64, 128] {
            let batcher = Arc::new(FlushBatcher::new());
            let log = Arc::new(Log::default());
            clients(batcher.clone(), log.clone(), mem_members(3), n, 20).await;
            let st = batcher.stats();
            eprintln!("{n} clients: {} requests, {} rounds", st.requests, st.rounds);
            assert_eq!(st.requests, n * 20);
            assert!(st.rounds * 8 <= st.requests, "{n} clients: {st:?}");
            assert_eq!(log.rounds.lock().len() as u64, st.rounds);
            log.check();
        }
    });
}

#[test]
fn without_batching_every_request_runs_a_round() {
    paused_runtime().block_on(async {
        let batcher = Arc::new(FlushBatcher::new());
        batcher.set_attribute("flush_batching", "0").unwrap().unwrap();
        let log = Arc::new(Log::default());
        clients(batcher.clone(), log.clone(), mem_members(2), 32, 5).await;
        let st = batcher.stats();
        assert_eq!((st.requests, st.rounds), (160, 160));
        log.check();
    });
}

#[test]
fn batching_holds_on_a_multi_thread_runtime() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap();
    rt.block_on(async {
        let batcher = Arc::new(FlushBatcher::new());
        let log = Arc::new(Log::default());
        clients(batcher.clone(), log.clone(), mem_members(2), 128, 10).await;
        let st = batcher.stats();
        eprintln!("multi-thread: {st:?}");
        assert!(st.rounds * 8 <= st.requests, "{st:?}");
        log.check();
    });
}

#[test]
fn a_returned_flush_made_the_clients_writes_durable() {
    paused_runtime().block_on(async {
        let group = CrashGroup::new();
        let devs: Arc<Vec<DeviceRef>> = Arc::new(
            (0..2)
                .map(|i| Arc::new(group.wrap(format!("m{i}"), MemDevice::new(format!("m{i}"), 16 << 20))) as DeviceRef)
                .collect(),
        );
        let batcher = Arc::new(FlushBatcher::new());
        // (client, block, crash point right after its flush returned)
        let checks = Arc::new(Mutex::new(Vec::new()));
        let tasks: Vec<_> = (0..64u64)
            .map(|i| {
                let (batcher, devs, group, checks) = (batcher.clone(), devs.clone(), group.clone(), checks.clone());
                tokio::spawn(async move {
                    for k in 0..4u64 {
                        let block = i * 4 + k;
                        for d in devs.iter() {
                            d.write(block * 4096, SharedBuf::from_slice(&[i as u8 + 1; 4096]), WriteFlags::NONE)
                                .await
                                .unwrap();
                        }
                        let round = {
                            let devs = devs.clone();
                            move || async move {
                                for d in devs.iter() {
                                    d.flush().await?;
                                }
                                Ok(())
                            }
                        };
                        batcher.flush(round).await.unwrap();
                        checks.lock().push((i, block, group.now()));
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        assert!(batcher.stats().rounds * 8 <= batcher.stats().requests, "{:?}", batcher.stats());
        let mut rng = Rng::new(5);
        for (i, block, point) in checks.lock().iter().copied() {
            let images = group.image_at(point, &mut rng, CrashPolicy::LoseAll).unwrap();
            for img in &images {
                let mut b = [0u8; 4096];
                img.read_bytes(block * 4096, &mut b);
                assert!(b.iter().all(|&x| x == i as u8 + 1), "client {i} block {block} not durable at {point}");
            }
        }
    });
}
