//! check / repair: mismatches planted below the array are found (md's mismatch_cnt in sectors,
//! whole 64 KiB units, plus the list of ranges) by `check`, which changes nothing, and fixed by
//! `repair`; a resync after creation makes the copies equal; sync_action requests behave as md's
//! (check refused while a resync runs, frozen stops work, idle interrupts).

use crate::array_util;

use std::time::Duration;

use array_util::*;
use mdkit_io::{BlockDeviceExt, Rng};
use mdkit_md::array::{AssembleOptions, assemble};
use mdkit_md::layout::Level;

/// Writes `bytes` straight into member `i` at data-area sector `sector` (below the array).
fn plant(ms: &[SimMember], i: usize, data_offset_sectors: u64, sector: u64, bytes: &[u8]) {
    ms[i].mem.as_ref().unwrap().write_bytes((data_offset_sectors + sector) * 512, bytes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid1_check_counts_and_repair_fixes() {
    let mut rng = Rng::new(seed("raid1_check_counts_and_repair_fixes", 3));
    let ms = mem_members("chk1-", 2, 16 * MIB);
    let a = create_array(&ms, opts(Level::Raid1, 2, None, None, true, false)).await;
    fast_sync(&a);
    let mut m = Model::new(a.size_bytes());
    fill(&a, &mut m, &mut rng).await;
    a.wait_sync_idle().await;
    assert_eq!(check(&a).await, 0);
    let dof = a.core().slots().in_sync(1).unwrap().data_offset_sectors;
    // One byte in the unit at sector 1000 (unit 896..1024), and 8 KiB spanning two units at
    // sector 2040 (units 1920..2048 and 2048..2176).
    plant(&ms, 1, dof, 1000, &[0xAB]);
    plant(&ms, 1, dof, 2040, &[0xCD; 8192]);
    assert_eq!(check(&a).await, 3 * 128);
    let st = a.sync_status();
    assert_eq!(st.mismatch_ranges, vec![896..1024, 1920..2176]);
    assert_eq!(a.get_attribute("mismatch_ranges").unwrap(), "896-1024,1920-2176");
    assert_eq!(check(&a).await, 3 * 128, "check must not change anything");
    a.request_sync("repair").unwrap();
    a.wait_sync_idle().await;
    assert_eq!(a.get_attribute("mismatch_cnt").unwrap(), (3 * 128).to_string(), "repair reports what it fixed");
    assert_eq!(check(&a).await, 0, "repair fixed the copies");
    a.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid10_check_reports_array_ranges() {
    let mut rng = Rng::new(seed("raid10_check_reports_array_ranges", 4));
    let ms = mem_members("chk10-", 4, 16 * MIB);
    let a = create_array(&ms, opts(Level::Raid10, 4, Some(64), Some(0x102), false, false)).await;
    fast_sync(&a);
    let mut m = Model::new(a.size_bytes());
    fill(&a, &mut m, &mut rng).await;
    assert_eq!(check(&a).await, 0);
    let dof = a.core().slots().in_sync(3).unwrap().data_offset_sectors;
    // n2 on 4: member 3, member sector 0 holds array chunk 1 (sectors 128..256).
    plant(&ms, 3, dof, 5, &[1u8; 512]);
    assert_eq!(check(&a).await, 128);
    assert_eq!(a.sync_status().mismatch_ranges, vec![128..256]);
    a.request_sync("repair").unwrap();
    a.wait_sync_idle().await;
    assert_eq!(check(&a).await, 0);
    verify_all(&a, &m).await;
    a.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initial_resync_makes_copies_equal_and_requests_follow_md() {
    let ms = mem_members("rs-", 2, 16 * MIB);
    // Different garbage on each member's data area: only the resync makes them agree.
    for (i, m) in ms.iter().enumerate() {
        let mut junk = vec![0u8; (8 * MIB) as usize];
        Rng::new(i as u64 + 100).fill(&mut junk);
        m.mem.as_ref().unwrap().write_bytes(4 * MIB, &junk);
    }
    // Created (resync pending) and started frozen, so the resync can be slowed down first and is
    // still running when we poke at it.
    let o = opts(Level::Raid1, 2, None, None, false, false);
    mdkit_md::array::write_superblocks(&member_devs(&ms), &o).await.unwrap();
    let a =
        assemble(member_devs(&ms), AssembleOptions { start_frozen: true, ..Default::default() }).await.unwrap().array;
    assert_eq!(a.get_attribute("resync_start").unwrap(), "0");
    a.set_attribute("sync_speed_max", "2000").unwrap();
    a.set_attribute("sync_speed_min", "2000").unwrap();
    a.request_sync("resync").unwrap();
    // Until the engine runs it (the limit is a hang guard: a busy machine may take a while).
    let waiting = std::time::Instant::now();
    while a.sync_status().running.is_none() {
        assert!(waiting.elapsed() < Duration::from_secs(60), "the resync never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(a.get_attribute("sync_action").unwrap(), "resync");
    let e = a.request_sync("check").unwrap_err();
    assert!(e.to_string().contains("resync is running"), "{e}");
    assert!(a.request_sync("bogus").is_err());
    // Reads in the unsynced region must be stable (always the first copy).
    let x = a.read_vec(10 * MIB, 4096).await.unwrap();
    for _ in 0..10 {
        assert_eq!(a.read_vec(10 * MIB, 4096).await.unwrap(), x);
    }
    a.request_sync("frozen").unwrap();
    a.wait_sync_idle().await;
    assert_eq!(a.get_attribute("sync_action").unwrap(), "frozen");
    let cp: u64 = a.get_attribute("resync_start").unwrap().parse().unwrap();
    assert!(cp < a.size_bytes() / 512, "resync was interrupted at its checkpoint {cp}");
    fast_sync(&a);
    a.request_sync("resync").unwrap();
    a.wait_sync_idle().await;
    assert_eq!(a.get_attribute("resync_start").unwrap(), "none");
    assert_eq!(check(&a).await, 0);
    a.stop().await.unwrap();
}
