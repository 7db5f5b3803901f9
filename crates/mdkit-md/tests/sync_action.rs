//! md's `sync_action` / `last_sync_action` semantics (md_sync_action, action_store):
//! - work the array state decides reads as that action at once, before the engine starts it:
//!   a requested check, a pending resync (raid1) or recovery (raid5) after creation, a recovery
//!   after a spare is added;
//! - `last_sync_action` names the last action started (`idle` before any);
//! - levels without redundancy (raid0) refuse every `sync_action` write with EINVAL.
//!
//! The runtimes are single-threaded on purpose: the sync engine is a task of the same thread,
//! so it cannot start between a change and the read that follows it without an `.await`.

use crate::array_util;

use std::io;

use array_util::*;
use mdkit_md::array::Array;
use mdkit_md::layout::Level;

fn attr(a: &Array, name: &str) -> String {
    a.get_attribute(name).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[tokio::test]
async fn a_requested_check_reads_check_before_it_starts_and_is_remembered() {
    let ms = mem_members("sa-chk-", 2, 16 * MIB);
    let a = create_array(&ms, opts(Level::Raid1, 2, None, None, true, true)).await;
    fast_sync(&a);
    a.wait_sync_idle().await;
    assert_eq!((attr(&a, "sync_action"), attr(&a, "last_sync_action")), ("idle".into(), "idle".into()));
    a.set_attribute("sync_action", "check").unwrap();
    // No await since the request: the engine has not run, the attribute reads the new value.
    assert_eq!(attr(&a, "sync_action"), "check");
    assert_eq!(a.sync_status().running, None);
    a.wait_sync_idle().await;
    assert_eq!((attr(&a, "sync_action"), attr(&a, "last_sync_action")), ("idle".into(), "check".into()));
    assert_eq!(a.sync_status().last_run.map(|(m, done)| (m.as_str(), done)), Some(("check", true)));
    a.stop().await.unwrap();
}

#[tokio::test]
async fn a_new_unclean_array_reads_resync_until_the_resync_is_done() {
    let ms = mem_members("sa-rs-", 2, 16 * MIB);
    let a = create_array(&ms, opts(Level::Raid1, 2, None, None, false, false)).await;
    assert_eq!(attr(&a, "resync_start"), "0");
    assert_eq!(attr(&a, "sync_action"), "resync");
    fast_sync(&a);
    a.wait_sync_idle().await;
    assert_eq!(attr(&a, "resync_start"), "none");
    assert_eq!((attr(&a, "sync_action"), attr(&a, "last_sync_action")), ("idle".into(), "resync".into()));
    a.stop().await.unwrap();
}

#[tokio::test]
async fn a_new_raid5_reads_recover_like_mdadm_creates_it() {
    // mdadm creates raid5 with its last member as a spare that is recovered.
    let ms = mem_members("sa-r5-", 3, 16 * MIB);
    let a = create_array(&ms, opts(Level::Raid5, 3, Some(64), None, false, false)).await;
    assert_eq!(attr(&a, "sync_action"), "recover");
    fast_sync(&a);
    a.wait_sync_idle().await;
    assert_eq!((attr(&a, "sync_action"), attr(&a, "last_sync_action")), ("idle".into(), "recover".into()));
    assert_eq!(attr(&a, "degraded"), "0");
    a.stop().await.unwrap();
}

#[tokio::test]
async fn an_added_spare_reads_recover_from_the_moment_it_is_added() {
    let ms = mem_members("sa-rec-", 3, 16 * MIB);
    let a = create_array(&ms[..2], opts(Level::Raid1, 2, None, None, true, true)).await;
    fast_sync(&a);
    a.fail_member("sa-rec-1").await.unwrap();
    a.remove_member("sa-rec-1").await.unwrap();
    a.wait_sync_idle().await;
    assert_eq!((attr(&a, "sync_action"), attr(&a, "degraded")), ("idle".into(), "1".into()), "nothing to rebuild onto");
    a.add_member(ms[2].member_dev()).await.unwrap();
    assert_eq!(a.sync_status().running, None, "the engine has not run since the add");
    assert_eq!(attr(&a, "sync_action"), "recover");
    let d = a.detail();
    assert_eq!(d["sync"]["action"], "recover", "{d:#}");
    a.wait_sync_idle().await;
    assert_eq!((attr(&a, "sync_action"), attr(&a, "degraded")), ("idle".into(), "0".into()));
    assert_eq!(attr(&a, "last_sync_action"), "recover");
    a.stop().await.unwrap();
}

#[tokio::test]
async fn frozen_reads_frozen_even_with_work_pending() {
    let ms = mem_members("sa-frz-", 2, 16 * MIB);
    let a = create_array(&ms, opts(Level::Raid1, 2, None, None, true, false)).await;
    a.set_attribute("sync_action", "frozen").unwrap();
    a.wait_sync_idle().await;
    assert_ne!(attr(&a, "resync_start"), "none", "the resync is still pending");
    assert_eq!(attr(&a, "sync_action"), "frozen");
    fast_sync(&a);
    a.set_attribute("sync_action", "resync").unwrap();
    assert_eq!(attr(&a, "sync_action"), "resync");
    a.wait_sync_idle().await;
    assert_eq!(attr(&a, "sync_action"), "idle");
    a.stop().await.unwrap();
}

#[tokio::test]
async fn raid0_refuses_sync_action_writes_with_einval() {
    let ms = mem_members("sa-r0-", 2, 16 * MIB);
    let a = create_array(&ms, opts(Level::Raid0, 2, Some(64), None, false, true)).await;
    for action in ["check", "repair", "resync", "recover", "idle", "frozen"] {
        let e = a.set_attribute("sync_action", action).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{action}: {e}");
        assert!(e.to_string().contains("raid0 has no redundancy"), "{action}: {e}");
    }
    assert_eq!((attr(&a, "sync_action"), attr(&a, "last_sync_action")), ("idle".into(), "idle".into()));
    a.stop().await.unwrap();
}
