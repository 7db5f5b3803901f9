//! The md bad-block log (md-lifecycle.md section 4) on RAM and fault-injecting members:
//! - entries already in a member's log (as the kernel leaves them) are honoured at assembly:
//!   the member's data there is garbage, yet every read returns the model's bytes (from the
//!   other copies or parity), and a level without redundancy returns EIO for exactly that range;
//!   check rewrites the range and clears the entry (repair too, for entries added through sysfs);
//! - a write error on a member with room in its log records a bad block instead of failing
//!   it, durably before the write returns; reads avoid it; `mdadm --examine-badblocks` lists it;
//!   a later successful write clears it, on disk too once the array stops;
//! - a full log fails the member as before; a log that does not decode leaves the member out.

use crate::array_util;

use array_util::*;
use mdkit_io::{BlockDevice, BlockDeviceExt, FaultRule, MemDevice, OpMask, Rng, SharedBuf, WriteFlags};
use mdkit_md::array::{Array, AssembleOptions, MdError, MdErrorKind, assemble};
use mdkit_md::format::badblocks::{self, BadBlock};
use mdkit_md::format::superblock::{Superblock, feature};
use mdkit_md::layout::Level;

const SB_BYTE: u64 = 4096; // 1.2 metadata

fn image(m: &SimMember) -> &MemDevice {
    m.mem.as_ref().expect("RAM member")
}

fn sb_of(m: &SimMember) -> Superblock {
    let mut b = vec![0u8; 4096];
    image(m).read_bytes(SB_BYTE, &mut b);
    Superblock::decode(&b, SB_BYTE / 512).unwrap()
}

/// The member's bad-block log as on disk (empty without BAD_BLOCKS).
fn disk_log(m: &SimMember) -> Vec<BadBlock> {
    let sb = sb_of(m);
    if sb.feature_map & feature::BAD_BLOCKS == 0 {
        return Vec::new();
    }
    let mut log = vec![0u8; usize::from(sb.bblog_size_sectors) * 512];
    image(m).read_bytes(sb.bblog_sector().unwrap() * 512, &mut log);
    badblocks::decode(&log, sb.bblog_shift).unwrap()
}

/// Writes `list` into the member's log and sets BAD_BLOCKS, as the kernel's super_1_sync does.
fn put_disk_log(m: &SimMember, list: &[BadBlock]) {
    let mut sb = sb_of(m);
    let page = badblocks::encode(list, sb.bblog_shift).unwrap();
    image(m).write_bytes(sb.bblog_sector().unwrap() * 512, &page[..usize::from(sb.bblog_size_sectors) * 512]);
    sb.feature_map |= feature::BAD_BLOCKS;
    image(m).write_bytes(SB_BYTE, &sb.encode().unwrap());
}

fn member_detail(a: &Array, name: &str) -> serde_json::Value {
    let d = a.detail();
    d["members"].as_array().unwrap().iter().find(|m| m["name"] == name).cloned().unwrap_or_else(|| panic!("{d}"))
}

fn level_opts(level: Level, n: usize) -> mdkit_md::array::CreateOptions {
    let layout = (level == Level::Raid10).then_some(0x102);
    opts(level, n as u32, Some(64), layout, false, true)
}

/// Member 0 of a filled array gets a 32 KiB bad range 1 MiB into its data area, with garbage
/// under it; the array re-assembles and reads the model back.
async fn kernel_entries_are_read_around(level: Level, n: usize) {
    let name = format!("bbread-{}-", level.name());
    let mut rng = Rng::new(seed(&name, 3));
    let ms = mem_members(&name, n, 16 * MIB);
    let a = create_array(&ms, level_opts(level, n)).await;
    let mut model = Model::new(a.size_bytes());
    fill(&a, &mut model, &mut rng).await;
    a.stop().await.unwrap();
    drop(a);
    let dof = sb_of(&ms[0]).data_offset_sectors;
    let bad = BadBlock { start_sector: dof + 2048, len_sectors: 64 };
    image(&ms[0]).write_bytes(bad.start_sector * 512, &vec![0xa5; 64 * 512]);
    put_disk_log(&ms[0], &[bad]);

    let a = assemble_array(&ms).await;
    let m0 = ms[0].name.as_str();
    assert_eq!(member_detail(&a, m0)["bad_blocks"], 1, "{level:?}");
    assert_eq!(a.get_attribute(&format!("dev-{m0}/bad_blocks")).unwrap(), format!("{} 64\n", dof + 2048));
    assert!(a.get_attribute(&format!("dev-{m0}/state")).unwrap().contains("in_sync"), "{level:?}");
    if level == Level::Raid0 {
        // No redundancy: exactly the 64 KiB chunk holding the bad range fails, the rest reads.
        let mut failed = Vec::new();
        for off in (0..a.size_bytes()).step_by(64 << 10) {
            match a.read_vec(off, 64 << 10).await {
                Ok(got) => assert_eq!(got, model.slice(off, 64 << 10), "raid0 at {off}"),
                Err(e) => {
                    let md = MdError::of(&e).unwrap_or_else(|| panic!("untyped {e}"));
                    assert_eq!((md.kind, md.member.as_deref()), (MdErrorKind::KnownBadBlock, Some(m0)), "{e}");
                    failed.push(off);
                }
            }
        }
        assert_eq!(failed.len(), 1, "raid0: one chunk unreadable: {failed:?}");
        assert_eq!(a.get_attribute("array_state").unwrap(), "clean", "a known bad block breaks nothing");
        a.stop().await.unwrap();
        assert_eq!(disk_log(&ms[0]), vec![bad], "raid0 keeps the entry");
        return;
    }
    verify_all(&a, &model).await;
    if matches!(level, Level::Raid1 | Level::Raid10) {
        // Reads go to the good copy (md's read_balance): the entry stays until sync work
        // rewrites it.
        assert_eq!(a.get_attribute(&format!("dev-{m0}/bad_blocks")).unwrap(), format!("{} 64\n", dof + 2048));
    }
    fast_sync(&a);
    assert_eq!(check(&a).await, 0, "{level:?}: check after reading around the bad range");
    // check rewrote the range from the other copies or parity (the member had no write error).
    assert_eq!(a.get_attribute(&format!("dev-{m0}/bad_blocks")).unwrap(), "", "{level:?}: healed");
    verify_all(&a, &model).await;
    a.stop().await.unwrap();
    drop(a);
    assert_eq!(disk_log(&ms[0]), vec![], "{level:?}: the cleared log is written at stop");
    assert_eq!(sb_of(&ms[0]).feature_map & feature::BAD_BLOCKS, 0);
    let b = assemble_array(&ms).await;
    verify_all(&b, &model).await;
    b.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid1_reads_around_kernel_bad_blocks() {
    kernel_entries_are_read_around(Level::Raid1, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid10_reads_around_kernel_bad_blocks() {
    kernel_entries_are_read_around(Level::Raid10, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid5_reads_around_kernel_bad_blocks() {
    kernel_entries_are_read_around(Level::Raid5, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid0_returns_eio_for_a_bad_range() {
    kernel_entries_are_read_around(Level::Raid0, 2).await;
}

/// Host `mdadm --examine-badblocks` on a copy of the member's image, if mdadm is installed.
fn mdadm_badblocks(m: &SimMember) -> Option<String> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(&m.name);
    std::fs::write(&path, image(m).to_image()).unwrap();
    let out = std::process::Command::new("mdadm").arg("--examine-badblocks").arg(&path).output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout).replace(&path.display().to_string(), "DEV");
    assert!(out.status.success(), "mdadm --examine-badblocks: {text}{}", String::from_utf8_lossy(&out.stderr));
    Some(text)
}

async fn write_error_records_a_bad_block(level: Level, n: usize) {
    let name = format!("bbw-{}-", level.name());
    let mut rng = Rng::new(seed(&name, 5));
    let ms = faulty_members(&name, n, 16 * MIB);
    let a = create_array(&ms, level_opts(level, n)).await;
    let mut model = Model::new(a.size_bytes());
    fill(&a, &mut model, &mut rng).await;
    let dof = sb_of(&ms[1]).data_offset_sectors;
    let at = (dof + 2048) * 512;
    let rule = ms[1].fault.as_ref().unwrap().add(FaultRule::error(OpMask::WRITE, Some(at..at + 4096)));
    let events = a.events();
    // Every write succeeds: the failing 4 KiB become a bad block, the member stays.
    fill(&a, &mut model, &mut rng).await;
    assert!(ms[1].fault.as_ref().unwrap().fired(rule).unwrap() > 0, "{level:?}: the fault fired");
    let m1 = ms[1].name.as_str();
    let state = a.get_attribute(&format!("dev-{m1}/state")).unwrap();
    assert_eq!(state, "in_sync,write_error", "{level:?}");
    assert_eq!(a.get_attribute(&format!("dev-{m1}/bad_blocks")).unwrap(), format!("{} 8\n", dof + 2048));
    assert_eq!(a.core().degraded(), 0);
    // Durable before the writes returned: the log and BAD_BLOCKS are on the member already.
    let want = vec![BadBlock { start_sector: dof + 2048, len_sectors: 8 }];
    assert_eq!(disk_log(&ms[1]), want, "{level:?}: recorded on disk");
    assert!(a.events() > events);
    verify_all(&a, &model).await;
    if let Some(text) = mdadm_badblocks(&ms[1]) {
        assert_eq!(text, format!("Bad-blocks on DEV:\n{:>20} for 8 sectors\n", dof + 2048), "{level:?}");
    } else {
        eprintln!("SKIP: mdadm is not installed: --examine-badblocks not compared");
    }
    let rendered = mdkit_md::format::examine::render_bad_blocks("DEV", &sb_of(&ms[1]), &disk_log(&ms[1]));
    assert_eq!(rendered, format!("Bad-blocks on DEV:\n{:>20} for 8 sectors\n", dof + 2048));
    // The sector heals: a successful write over it clears the entry, on disk at stop.
    ms[1].fault.as_ref().unwrap().remove(rule);
    fill(&a, &mut model, &mut rng).await;
    assert_eq!(a.get_attribute(&format!("dev-{m1}/bad_blocks")).unwrap(), "", "{level:?}: cleared");
    verify_all(&a, &model).await;
    a.stop().await.unwrap();
    drop(a);
    assert_eq!(disk_log(&ms[1]), vec![], "{level:?}");
    let b = assemble_array(&ms).await;
    verify_all(&b, &model).await;
    assert_eq!(check(&b).await, 0, "{level:?}");
    b.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid1_write_error_records_a_bad_block() {
    write_error_records_a_bad_block(Level::Raid1, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid5_write_error_records_a_bad_block() {
    write_error_records_a_bad_block(Level::Raid5, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid10_write_error_records_a_bad_block() {
    write_error_records_a_bad_block(Level::Raid10, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_log_fails_the_member() {
    let mut rng = Rng::new(seed("a_full_log_fails_the_member", 7));
    let ms = faulty_members("bbfull-", 2, 16 * MIB);
    let a = create_array(&ms, level_opts(Level::Raid1, 2)).await;
    let mut model = Model::new(a.size_bytes());
    fill(&a, &mut model, &mut rng).await;
    let dof = sb_of(&ms[1]).data_offset_sectors;
    // 512 one-sector entries, md's limit for one 4 KiB page, through md's sysfs interface.
    let tail = dof + 16 * MIB / 512 - 8 * 2048;
    for i in 0..512 {
        a.set_attribute("dev-bbfull-1/bad_blocks", &format!("{} 1", tail + 2 * i)).unwrap();
    }
    let e = a.set_attribute("dev-bbfull-1/bad_blocks", &format!("{} 1", tail + 2000)).unwrap_err();
    assert!(e.to_string().contains("full"), "{e}");
    assert_eq!(member_detail(&a, "bbfull-1")["bad_blocks"], 512);
    let at = (dof + 2048) * 512;
    ms[1].fault.as_ref().unwrap().add(FaultRule::error(OpMask::WRITE, Some(at..at + 4096)));
    let mut buf = vec![0u8; 64 << 10];
    rng.fill(&mut buf);
    a.write(MIB, SharedBuf::from_slice(&buf), WriteFlags::NONE).await.unwrap();
    model.apply(MIB, &buf);
    assert_eq!(a.get_attribute("dev-bbfull-1/state").unwrap(), "faulty");
    let why = member_detail(&a, "bbfull-1")["fail_reason"].as_str().unwrap_or_default().to_string();
    assert!(why.contains("bad-block log is full"), "{why}");
    verify_all(&a, &model).await;
    a.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_log_leaves_the_member_out() {
    let ms = mem_members("bbcorrupt-", 2, 8 * MIB);
    let a = create_array(&ms, level_opts(Level::Raid1, 2)).await;
    a.stop().await.unwrap();
    drop(a);
    let sb = sb_of(&ms[1]);
    put_disk_log(&ms[1], &[BadBlock { start_sector: sb.data_offset_sectors, len_sectors: 8 }]);
    // Entry 0 with length 0.
    image(&ms[1]).write_bytes(sb.bblog_sector().unwrap() * 512, &(sb.data_offset_sectors << 10).to_le_bytes());
    let r = assemble(member_devs(&ms), AssembleOptions { name: "md-test".into(), ..AssembleOptions::default() })
        .await
        .unwrap();
    assert_eq!(r.refused.len(), 1, "{:?}", r.refused);
    assert_eq!(r.refused[0].member, "bbcorrupt-1");
    assert!(
        r.refused[0].reason.contains("bad-block log at byte") && r.refused[0].reason.contains("length 0"),
        "{}",
        r.refused[0].reason
    );
    assert_eq!(r.array.core().degraded(), 1);
    r.array.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repair_rewrites_and_clears_bad_blocks() {
    let mut rng = Rng::new(seed("repair_rewrites_and_clears_bad_blocks", 11));
    let ms = mem_members("bbrepair-", 2, 16 * MIB);
    let a = create_array(&ms, level_opts(Level::Raid1, 2)).await;
    fast_sync(&a);
    let mut model = Model::new(a.size_bytes());
    fill(&a, &mut model, &mut rng).await;
    let dof = sb_of(&ms[1]).data_offset_sectors;
    a.set_attribute("dev-bbrepair-1/bad_blocks", &format!("{} 128", dof + 4096)).unwrap();
    a.request_sync("repair").unwrap();
    a.wait_sync_idle().await;
    assert_eq!(a.get_attribute("dev-bbrepair-1/bad_blocks").unwrap(), "", "repair rewrote the range");
    assert_eq!(a.get_attribute("dev-bbrepair-1/state").unwrap(), "in_sync");
    verify_all(&a, &model).await;
    a.stop().await.unwrap();
    assert_eq!(disk_log(&ms[1]), vec![]);
}
