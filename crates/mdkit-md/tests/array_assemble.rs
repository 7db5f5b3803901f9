//! Assembly rules and bad input: members in any order find their roles; corrupt, foreign
//! (other array uuid), stale and geometry-mismatched members are refused with a message naming
//! the member and the reason while the array starts without them (or assembly fails naming
//! every refusal when it cannot run); --force takes a stale member back; re-add follows md's
//! events rule; unsupported levels are refused without touching the members; a dirty degraded
//! parity array needs --force; a dirty array resyncs after assembly.

use crate::array_util;

use array_util::*;
use mdkit_io::{BlockDevice, Rng};
use mdkit_md::array::{AssembleOptions, assemble};
use mdkit_md::layout::Level;

fn names(refused: &[mdkit_md::array::Refusal]) -> Vec<String> {
    refused.iter().map(|r| r.to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_in_any_order_and_bad_members_refused_by_name() {
    let mut rng = Rng::new(seed("members_in_any_order", 1));
    let ms = mem_members("asm-", 4, 16 * MIB);
    let other = mem_members("other-", 2, 16 * MIB);
    let a = create_array(&ms[..3], opts(Level::Raid1, 3, None, None, true, true)).await;
    let mut model = Model::new(a.size_bytes());
    fill(&a, &mut model, &mut rng).await;
    a.stop().await.unwrap();
    let b = create_array(&other, opts(Level::Raid1, 2, None, None, false, true)).await;
    b.stop().await.unwrap();
    drop((a, b));

    // Corrupt one member's superblock (checksum no longer matches).
    ms[1].mem.as_ref().unwrap().write_bytes(4096 + 100, &[0x55]);
    let shuffled = vec![ms[2].clone(), other[0].clone(), ms[3].clone(), ms[1].clone(), ms[0].clone()];
    let r =
        assemble(member_devs(&shuffled), AssembleOptions { name: "md0".into(), ..Default::default() }).await.unwrap();
    let refused = names(&r.refused);
    assert!(refused.iter().any(|s| s.starts_with("asm-1: ") && s.contains("bad checksum")), "{refused:?}");
    assert!(
        refused.iter().any(|s| s.starts_with("other-0: ") && s.contains("belongs to a different array")),
        "{refused:?}"
    );
    assert!(refused.iter().any(|s| s.starts_with("asm-3: ") && s.contains("no md superblock")), "{refused:?}");
    let a = r.array;
    assert_eq!(a.core().degraded(), 1);
    assert_eq!(a.get_attribute("dev-asm-2/slot").unwrap(), "2");
    assert_eq!(a.get_attribute("dev-asm-0/slot").unwrap(), "0");
    verify_all(&a, &model).await;
    a.stop().await.unwrap();

    // Nothing usable: the error names every member and why.
    let e = assemble(member_devs(&[ms[3].clone(), ms[1].clone()]), AssembleOptions::default())
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("asm-3") && e.contains("asm-1") && e.contains("bad checksum"), "{e}");
    // An explicit uuid refuses members of the right shape but the wrong array.
    let wrong = [9u8; 16];
    let e = assemble(member_devs(&ms[..1]), AssembleOptions { uuid: Some(wrong), ..Default::default() })
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("asm-0") && e.contains("different array"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_members_are_refused_forced_or_re_added() {
    let mut rng = Rng::new(seed("stale_members", 2));
    let ms = mem_members("st-", 2, 16 * MIB);
    let a = create_array(&ms, opts(Level::Raid1, 2, None, None, false, true)).await;
    let mut model = Model::new(a.size_bytes());
    fill(&a, &mut model, &mut rng).await;
    a.stop().await.unwrap();
    drop(a);
    // Run the array on member 0 alone and write: member 1 falls behind.
    let a = assemble_array(&ms[..1]).await;
    for _ in 0..10 {
        random_write(&a, &mut model, &mut rng, 16).await;
        a.flush().await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    a.set_attribute("safe_mode_delay", "0.001").unwrap();
    a.stop().await.unwrap();
    drop(a);
    let r = assemble(member_devs(&ms), AssembleOptions::default()).await.unwrap();
    let refused = names(&r.refused);
    assert!(refused.iter().any(|s| s.starts_with("st-1: stale: events")), "{refused:?}");
    let a = r.array;
    assert_eq!(a.core().degraded(), 1);
    // Re-add without a bitmap and with different events: refused (would need a full rebuild).
    let e = a.re_add_member(ms[1].member_dev()).await.unwrap_err().to_string();
    assert!(e.contains("st-1") && e.contains("--add"), "{e}");
    // --add works: full rebuild.
    fast_sync(&a);
    a.add_member(ms[1].member_dev()).await.unwrap();
    a.wait_sync_idle().await;
    assert_eq!(a.core().degraded(), 0);
    assert_eq!(check(&a).await, 0);
    verify_all(&a, &model).await;
    a.stop().await.unwrap();
    drop(a);

    // A member that left when nothing was written since can be re-added in sync.
    let a = assemble_array(&ms).await;
    a.fail_member("st-1").await.unwrap();
    a.remove_member("st-1").await.unwrap();
    let e = a.re_add_member(ms[1].member_dev()).await.unwrap_err().to_string();
    assert!(e.contains("events"), "failing it bumped the events: {e}");
    a.stop().await.unwrap();
    drop(a);

    // Presented together again, the member that was failed and removed is stale.
    let r = assemble(member_devs(&ms), AssembleOptions::default()).await.unwrap();
    assert!(names(&r.refused).iter().any(|s| s.starts_with("st-1: stale")), "{:?}", r.refused);
    r.array.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn re_add_with_a_bitmap_recovers_the_member() {
    let mut rng = Rng::new(seed("re_add_with_a_bitmap", 3));
    let ms = mem_members("ra-", 2, 16 * MIB);
    let a = create_array(&ms, opts(Level::Raid1, 2, None, None, true, true)).await;
    fast_sync(&a);
    let mut model = Model::new(a.size_bytes());
    fill(&a, &mut model, &mut rng).await;
    a.fail_member("ra-1").await.unwrap();
    a.remove_member("ra-1").await.unwrap();
    for _ in 0..20 {
        random_write(&a, &mut model, &mut rng, 16).await;
    }
    a.re_add_member(ms[1].member_dev()).await.unwrap();
    a.wait_sync_idle().await;
    assert_eq!(a.core().degraded(), 0);
    assert_eq!(check(&a).await, 0);
    verify_all(&a, &model).await;
    a.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_assembles_with_a_stale_member() {
    let mut rng = Rng::new(seed("force_assembles", 4));
    let ms = mem_members("fo-", 4, 16 * MIB);
    let a = create_array(&ms, opts(Level::Raid10, 4, Some(64), Some(0x102), false, true)).await;
    let mut model = Model::new(a.size_bytes());
    fill(&a, &mut model, &mut rng).await;
    a.stop().await.unwrap();
    drop(a);
    // The array runs without member 1 (its mirror partner is member 0): member 1 goes stale.
    let degraded = [ms[0].clone(), ms[2].clone(), ms[3].clone()];
    let a = assemble_array(&degraded).await;
    assert_eq!(a.core().degraded(), 1);
    random_write(&a, &mut model, &mut rng, 4).await;
    a.stop().await.unwrap();
    drop(a);
    // Now member 0 is lost: without the stale member 1, roles 0/1 have no copy.
    let rest = [ms[1].clone(), ms[2].clone(), ms[3].clone()];
    let e = assemble(member_devs(&rest), AssembleOptions::default()).await.err().unwrap().to_string();
    assert!(e.contains("fo-1") && e.contains("stale") && e.contains("cannot start"), "{e}");
    let r = assemble(member_devs(&rest), AssembleOptions { force: true, ..Default::default() }).await.unwrap();
    assert!(r.notes.iter().any(|n| n.contains("resync from sector 0")), "a forced member is resynced: {:?}", r.notes);
    let a = r.array;
    assert_eq!(a.core().degraded(), 1, "forced in: only member 0's role is missing");
    fast_sync(&a);
    a.wait_sync_idle().await;
    assert_eq!(check(&a).await, 0);
    a.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_levels_are_refused_and_change_nothing() {
    use mdkit_md::format::superblock::Superblock;
    let ms = mem_members("lin-", 2, 16 * MIB);
    let a = create_array(&ms, opts(Level::Raid1, 2, None, None, false, true)).await;
    a.stop().await.unwrap();
    drop(a);
    // Rewrite both superblocks as md "linear" (level -1), checksum correct.
    for m in &ms {
        let mem = m.mem.as_ref().unwrap();
        let mut b = vec![0u8; 4096];
        mem.read_bytes(4096, &mut b);
        let mut sb = Superblock::decode(&b, 8).unwrap();
        sb.level = -1;
        mem.write_bytes(4096, &sb.encode_unchecked());
    }
    let before: Vec<Vec<u8>> = ms.iter().map(|m| m.mem.as_ref().unwrap().to_image()).collect();
    let e = assemble(member_devs(&ms), AssembleOptions::default()).await.err().unwrap().to_string();
    assert!(e.contains("level -1 is not supported"), "{e}");
    let after: Vec<Vec<u8>> = ms.iter().map(|m| m.mem.as_ref().unwrap().to_image()).collect();
    assert!(before == after, "nothing written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dirty_degraded_parity_array_needs_force() {
    let mut rng = Rng::new(seed("dirty_degraded_parity_array_needs_force", 9));
    let ms = mem_members("dd5-", 3, 16 * MIB);
    let a = create_array(&ms, opts(Level::Raid5, 3, Some(64), None, false, true)).await;
    a.set_attribute("safe_mode_delay", "100").unwrap();
    let mut model = Model::new(a.size_bytes());
    random_write(&a, &mut model, &mut rng, 16).await;
    drop(a); // crash: the superblocks say active
    let e = assemble(member_devs(&ms[..2]), AssembleOptions::default()).await.err().unwrap().to_string();
    assert!(e.contains("dirty degraded raid5") && e.contains("--force"), "{e}");
    let r = assemble(member_devs(&ms[..2]), AssembleOptions { force: true, ..Default::default() }).await.unwrap();
    assert_eq!(r.array.core().degraded(), 1);
    // As mdadm's --force ("force-array"): marked clean, no resync of a degraded array, and the
    // next assembly (a restart, or the one that ends a reshape) needs no --force again (QA: a
    // forced start left the array dirty; the reassembly at the end of its reshape was refused
    // and the array went read-only).
    assert!(r.notes.iter().any(|n| n.contains("marked clean as mdadm does")), "{:?}", r.notes);
    assert_eq!(r.array.get_attribute("resync_start").unwrap(), "none");
    verify_all(&r.array, &model).await;
    r.array.stop().await.unwrap();
    let again = assemble(member_devs(&ms[..2]), AssembleOptions::default()).await.expect("no --force needed again");
    verify_all(&again.array, &model).await;
    again.array.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dirty_array_resyncs_after_assembly() {
    let mut rng = Rng::new(5);
    let ms = mem_members("dirty-", 2, 16 * MIB);
    let a = create_array(&ms, opts(Level::Raid1, 2, None, None, false, true)).await;
    a.set_attribute("safe_mode_delay", "100").unwrap();
    let mut model = Model::new(a.size_bytes());
    random_write(&a, &mut model, &mut rng, 16).await;
    assert_eq!(a.get_attribute("array_state").unwrap(), "active");
    drop(a); // no stop: the superblocks still say active
    let r = assemble(member_devs(&ms), AssembleOptions { start_frozen: true, ..Default::default() }).await.unwrap();
    assert!(r.notes.iter().any(|n| n.contains("unclean shutdown: resync from sector 0")), "{:?}", r.notes);
    let a = r.array;
    assert_eq!(a.get_attribute("resync_start").unwrap(), "0");
    fast_sync(&a);
    a.request_sync("resync").unwrap();
    a.wait_sync_idle().await;
    assert_eq!(a.get_attribute("resync_start").unwrap(), "none");
    verify_all(&a, &model).await;
    let _ = a.size_bytes();
    a.stop().await.unwrap();
}
