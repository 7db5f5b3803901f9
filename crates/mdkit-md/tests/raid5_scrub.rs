//! Scrubbing raid5/raid6 on member *files* (io_uring FileDevice): one 4 KiB block of a member
//! file is corrupted behind the array's back; `check` counts it like md's `mismatch_cnt`
//! (sectors per stripe_size unit: 8 at 4 KiB, 128 at 64 KiB) and lists the mismatched range;
//! on RAID6 `mismatch_members` names the member and block (data i / P / Q) that is wrong;
//! `repair` rewrites the wrong block (RAID6: the named member, so corrupted *data* comes back;
//! RAID5: the parity, as md does); the next `check` finds 0.

use crate::array_util;

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;

use array_util::*;
use mdkit_io::{DeviceRef, FileDevice, FileOptions, Rng};
use mdkit_md::array::{Array, AssembleOptions, MemberDev, assemble};
use mdkit_md::layout::{Level, ParityGeometry};

fn file_members(dir: &std::path::Path, prefix: &str, n: usize, size: u64) -> Vec<(PathBuf, MemberDev)> {
    (0..n)
        .map(|i| {
            let p = dir.join(format!("{prefix}{i}.img"));
            FileDevice::create_sparse(&p, size).unwrap();
            let d: DeviceRef = Arc::new(FileDevice::open(&p, FileOptions::default()).unwrap());
            (p.clone(), MemberDev::new(p.to_string_lossy().into_owned(), d))
        })
        .collect()
}

async fn reopen(files: &[(PathBuf, MemberDev)]) -> Array {
    let devs: Vec<MemberDev> = files
        .iter()
        .map(|(p, _)| {
            let d: DeviceRef = Arc::new(FileDevice::open(p, FileOptions::default()).unwrap());
            MemberDev::new(p.to_string_lossy().into_owned(), d)
        })
        .collect();
    assemble(devs, AssembleOptions { name: "scrub".into(), ..Default::default() }).await.unwrap().array
}

/// Runs `action` (check or repair) to the end; returns mismatch_cnt and the details.
async fn scrub(a: &Array, action: &str) -> (u64, String, String) {
    a.wait_sync_idle().await;
    let before = a.sync_status().runs;
    a.request_sync(action).unwrap();
    loop {
        a.wait_sync_idle().await;
        let st = a.sync_status();
        if st.runs > before {
            assert_eq!(st.last_run.map(|(m, done)| (m.as_str(), done)), Some((action, true)), "{st:?}");
            return (
                st.mismatch_sectors,
                a.get_attribute("mismatch_ranges").unwrap(),
                a.get_attribute("mismatch_members").unwrap(),
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// Flips bytes of the 4 KiB block at member sector `sector` of member file `path`.
fn corrupt(path: &std::path::Path, data_offset_sectors: u64, sector: u64) {
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let at = (data_offset_sectors + sector) * 512;
    let mut b = vec![0u8; 4096];
    f.read_exact_at(&mut b, at).unwrap();
    for x in b.iter_mut().step_by(97) {
        *x ^= 0xa5;
    }
    f.write_all_at(&b, at).unwrap();
    f.sync_all().unwrap();
}

struct Case {
    level: Level,
    n: usize,
    /// What to corrupt in stripe 3: a data index or P/Q.
    what: &'static str,
    stripe_size: &'static str,
    /// mismatch_cnt expected.
    sectors: u64,
}

async fn run(c: Case, seed: u64) {
    let dir = tempfile::Builder::new().prefix("mdkit-scrub-").tempdir_in("/var/tmp").unwrap();
    let name = format!("scrub-{}-{}-{}", c.level.name(), c.what, c.stripe_size);
    let files = file_members(dir.path(), &format!("{name}-"), c.n, 8 * MIB);
    let devs: Vec<MemberDev> = files.iter().map(|(_, d)| d.clone()).collect();
    let mut o = opts(c.level, c.n as u32, Some(64), None, false, true);
    o.name = "scrub".into();
    let a = mdkit_md::array::create(devs, o).await.unwrap().array;
    let mut rng = Rng::new(seed);
    let mut model = Model::new(a.size_bytes());
    fill(&a, &mut model, &mut rng).await;
    let dof = a.core().slots().in_sync(0).unwrap().data_offset_sectors;
    a.stop().await.unwrap();
    drop(a);
    // Stripe 3, chunk sector 40 (a 4 KiB block).
    let g = ParityGeometry::new(c.level, c.n as u32, 2, 128).unwrap();
    let map = g.stripe_map(3);
    let (role, block) = match c.what {
        "P" => (map.p_member, "P".to_string()),
        "Q" => (map.q_member.unwrap(), "Q".to_string()),
        d => {
            let i: usize = d.parse().unwrap();
            (map.data_members[i], format!("data {i}"))
        }
    };
    let sector = 3 * 128 + 40;
    corrupt(&files[role].0, dof, sector);
    let a = reopen(&files).await;
    fast_sync(&a);
    a.set_attribute("stripe_size", c.stripe_size).unwrap();
    let (cnt, ranges, who) = scrub(&a, "check").await;
    let unit = c.sectors;
    let lo = sector / unit * unit;
    assert_eq!(cnt, c.sectors, "{name}: mismatch_cnt");
    assert_eq!(ranges, format!("{lo}-{}", lo + unit), "{name}: mismatch_ranges");
    let member = files[role].1.name.clone();
    if c.level == Level::Raid6 {
        assert!(
            who.contains(&format!("{member} (role {role}, {block})")),
            "{name}: mismatch_members {who:?} should name {member} {block}"
        );
    } else {
        assert!(who.contains("raid5 cannot tell"), "{name}: {who}");
    }
    // check changed nothing.
    assert_eq!(scrub(&a, "check").await.0, c.sectors, "{name}: check is read-only");
    let (rcnt, _, _) = scrub(&a, "repair").await;
    assert_eq!(rcnt, c.sectors, "{name}: repair counts what it fixes");
    assert_eq!(scrub(&a, "check").await, (0, "none".into(), "none".into()), "{name}: after repair");
    // RAID6 repairs the named block, so even corrupted data is back; RAID5 rewrites parity,
    // so only a corrupted parity block leaves the data as it was.
    if c.level == Level::Raid6 || c.what == "P" {
        verify_all(&a, &model).await;
    }
    a.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid6_check_names_the_wrong_member_and_repair_fixes_it() {
    let s = seed("raid6_check_names_the_wrong_member_and_repair_fixes_it", 81);
    run(Case { level: Level::Raid6, n: 6, what: "1", stripe_size: "4096", sectors: 8 }, s).await;
    run(Case { level: Level::Raid6, n: 6, what: "Q", stripe_size: "4096", sectors: 8 }, s + 1).await;
    run(Case { level: Level::Raid6, n: 5, what: "P", stripe_size: "65536", sectors: 128 }, s + 2).await;
    run(Case { level: Level::Raid6, n: 5, what: "2", stripe_size: "65536", sectors: 128 }, s + 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid5_check_counts_and_repair_rewrites_parity() {
    let s = seed("raid5_check_counts_and_repair_rewrites_parity", 83);
    run(Case { level: Level::Raid5, n: 4, what: "P", stripe_size: "4096", sectors: 8 }, s).await;
    run(Case { level: Level::Raid5, n: 4, what: "0", stripe_size: "65536", sectors: 128 }, s + 1).await;
    run(Case { level: Level::Raid4, n: 3, what: "1", stripe_size: "4096", sectors: 8 }, s + 2).await;
}
