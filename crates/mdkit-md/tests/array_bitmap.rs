//! The runtime with a write-intent bitmap: after an unclean shutdown only the chunks the bitmap
//! marks are resynced; a member re-added after writes it missed is rebuilt from the bitmap's
//! chunks only (md's bitmap-based re-add) and ends in sync with 0 mismatches; bits clear lazily
//! once the array is idle and whole, never while degraded.

use crate::array_util;

use std::time::Duration;

use array_util::*;
use mdkit_io::{BlockDevice, Rng};
use mdkit_md::array::{Array, AssembleOptions, assemble};
use mdkit_md::layout::Level;

/// Waits until the bitmap daemon cleared every bit (polling; the limit is a hang guard only:
/// on a busy machine the idle periods stretch).
async fn wait_bitmap_clean(a: &Array) {
    let t = std::time::Instant::now();
    loop {
        let dirty = a.get_attribute("bitmap/dirty_chunks").unwrap();
        if dirty == "0" {
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "idle bits never cleared: {dirty} dirty");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn member_requests(ms: &[SimMember]) -> u64 {
    ms.iter().map(|m| m.fault.as_ref().unwrap().stats().requests).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resync_after_a_crash_visits_only_dirty_chunks() {
    let mut rng = Rng::new(seed("resync_after_a_crash_visits_only_dirty_chunks", 6));
    let ms = faulty_members("bmrs-", 2, 32 * MIB);
    let a = create_array(&ms, opts(Level::Raid1, 2, None, None, true, true)).await;
    a.set_attribute("bitmap/time_base", "0.05").unwrap();
    let mut model = Model::new(a.size_bytes());
    fill(&a, &mut model, &mut rng).await;
    // Let the bitmap clear, then dirty two 1 MiB chunks and crash (no stop).
    a.flush().await.unwrap();
    wait_bitmap_clean(&a).await;
    for at in [3 * MIB + 4096, 20 * MIB] {
        let mut data = vec![0u8; 8192];
        rng.fill(&mut data);
        model.apply(at, &data);
        a.write(at, mdkit_io::SharedBuf::from_slice(&data), mdkit_io::WriteFlags::NONE).await.unwrap();
    }
    a.set_attribute("safe_mode_delay", "100").unwrap();
    drop(a);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let r = assemble(member_devs(&ms), AssembleOptions { start_frozen: true, ..Default::default() }).await.unwrap();
    let a = r.array;
    assert_eq!(a.get_attribute("resync_start").unwrap(), "0", "unclean");
    assert_eq!(a.get_attribute("bitmap/needed_chunks").unwrap(), "2");
    let before = member_requests(&ms);
    fast_sync(&a);
    a.request_sync("resync").unwrap();
    a.wait_sync_idle().await;
    let resync_requests = member_requests(&ms) - before;
    // A full resync of 32 MiB would be 32 reads + 32 writes of 1 MiB; two chunks are ~4.
    assert!(resync_requests < 24, "resync issued {resync_requests} member requests for 2 dirty chunks");
    assert_eq!(a.get_attribute("resync_start").unwrap(), "none");
    verify_all(&a, &model).await;
    assert_eq!(check(&a).await, 0);
    a.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn re_add_rebuilds_only_what_the_member_missed() {
    let mut rng = Rng::new(seed("re_add_rebuilds_only_what_the_member_missed", 7));
    let ms = faulty_members("bmra-", 2, 32 * MIB);
    let a = create_array(&ms, opts(Level::Raid1, 2, None, None, true, true)).await;
    a.set_attribute("bitmap/time_base", "0.05").unwrap();
    let mut model = Model::new(a.size_bytes());
    fill(&a, &mut model, &mut rng).await;
    // The fill's bits clear first, so only what is written degraded is needed afterwards.
    wait_bitmap_clean(&a).await;
    a.fail_member("bmra-1").await.unwrap();
    a.remove_member("bmra-1").await.unwrap();
    assert_eq!(a.get_attribute("bitmap/can_clear").unwrap(), "false", "no clearing while degraded");
    // Writes in three 1 MiB chunks while the member is away.
    for at in [MIB, 9 * MIB + 512 * 1024, 30 * MIB] {
        let mut data = vec![0u8; 4096 * 3];
        rng.fill(&mut data);
        model.apply(at, &data);
        a.write(at, mdkit_io::SharedBuf::from_slice(&data), mdkit_io::WriteFlags::NONE).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let needed: u64 = a.get_attribute("bitmap/needed_chunks").unwrap().parse().unwrap();
    assert!((3..=4).contains(&needed), "chunks written degraded are needed: {needed}");
    fast_sync(&a);
    let before = ms[1].fault.as_ref().unwrap().stats().requests;
    a.re_add_member(ms[1].member_dev()).await.unwrap();
    a.wait_sync_idle().await;
    let rebuild = ms[1].fault.as_ref().unwrap().stats().requests - before;
    assert!(rebuild < 20, "bitmap-guided recovery issued {rebuild} requests to the re-added member");
    assert_eq!(a.core().degraded(), 0);
    assert_eq!(check(&a).await, 0);
    verify_all(&a, &model).await;
    // Whole again: the bits clear.
    wait_bitmap_clean(&a).await;
    a.stop().await.unwrap();
    let b = assemble_array(&ms).await;
    verify_all(&b, &model).await;
    b.stop().await.unwrap();
}
