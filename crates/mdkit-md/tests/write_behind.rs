//! Write-behind (md's `--write-behind=N`) on raid1: a local RAM member and a write-mostly
//! member whose data writes the test holds ([`HeldWrites`]), so "the remote lags" is a state
//! the test sets, not a timing. Each test states one rule of md's write-behind:
//! acknowledged without the write-mostly member, at most N outstanding, FLUSH and FUA wait for
//! every member, reads avoid a lagging copy, overlapping behind writes keep their order, the
//! bitmap keeps the chunk dirty until the behind write is done, a failed behind write fails
//! the member and leaves the chunk for a bitmap-guided re-add.

use std::sync::Arc;

use mdkit_io::{BlockDevice, BlockDeviceExt, DeviceRef, FaultyDevice, MemDevice, OpMask, SharedBuf, WriteFlags};
use mdkit_md::array::{Array, MemberDev, create};
use mdkit_md::layout::Level;

use crate::array_util::held::HeldWrites;
use crate::array_util::{MIB, opts};

const MEMBER_BYTES: u64 = 16 * MIB;

struct Rig {
    a: Arc<Array>,
    local: Arc<MemDevice>,
    remote: Arc<MemDevice>,
    held: Arc<HeldWrites>,
    /// Data offset of both members, bytes.
    data_offset: u64,
    fault: mdkit_io::FaultHandle,
    local_fault: mdkit_io::FaultHandle,
}

/// raid1 of `local` and a write-mostly `remote` (behind a fault injector and a write holder),
/// bitmap with 1 MiB chunks, write-behind `n`.
async fn rig(n: u32) -> Rig {
    let local = Arc::new(MemDevice::new("local", MEMBER_BYTES));
    let local_faulty = FaultyDevice::new(local.clone() as DeviceRef);
    let local_fault = local_faulty.handle();
    let remote = Arc::new(MemDevice::new("remote", MEMBER_BYTES));
    let faulty = FaultyDevice::new(remote.clone() as DeviceRef);
    let fault = faulty.handle();
    let held = HeldWrites::new(Arc::new(faulty));
    let mut o = opts(Level::Raid1, 2, None, None, true, true);
    o.write_behind = n;
    let members = vec![
        MemberDev::new("local", Arc::new(local_faulty) as DeviceRef),
        MemberDev::new("remote", held.clone() as DeviceRef),
    ];
    let a = Arc::new(create(members, o).await.unwrap_or_else(|e| panic!("create: {e}")).array);
    a.set_write_mostly("remote", true).await.unwrap();
    let data_offset = a.detail()["members"][1]["data_offset_sectors"].as_u64().unwrap() * 512;
    held.hold_from(data_offset);
    Rig { a, local, remote, held, data_offset, fault, local_fault }
}

fn block(tag: u8) -> Vec<u8> {
    vec![tag; 4096]
}

fn on(dev: &MemDevice, at: u64) -> Vec<u8> {
    let mut b = vec![0u8; 4096];
    dev.read_bytes(at, &mut b);
    b
}

/// Lets every other task run until nothing moves (a current-thread runtime).
async fn settle() {
    for _ in 0..200 {
        tokio::task::yield_now().await;
    }
}

fn behind(a: &Array) -> (u64, u64) {
    let w = &a.detail()["write_behind"];
    (w["outstanding_writes"].as_u64().unwrap(), w["outstanding_bytes"].as_u64().unwrap())
}

#[tokio::test]
async fn acknowledged_before_the_write_mostly_member_and_flush_waits_for_it() {
    let r = rig(4).await;
    r.a.write(0, SharedBuf::from_slice(&block(1)), WriteFlags::NONE).await.unwrap();
    // Acknowledged although the member holds every data write: it lags.
    r.held.wait_for(1).await;
    assert!(on(&r.local, r.data_offset) == block(1));
    assert!(on(&r.remote, r.data_offset) == block(0), "the write-mostly member lags");
    assert_eq!(behind(&r.a), (1, 4096));
    assert!(r.a.read_vec(0, 4096).await.unwrap() == block(1), "reads see the acknowledged data");
    let a = r.a.clone();
    let flush = tokio::spawn(async move { a.flush().await });
    settle().await;
    assert!(!flush.is_finished(), "a FLUSH waits for the behind write");
    r.held.open();
    flush.await.unwrap().unwrap();
    assert!(on(&r.remote, r.data_offset) == block(1));
    assert_eq!(behind(&r.a), (0, 0));
    assert_eq!(r.a.get_attribute("bitmap/max_backlog_used").unwrap(), "1");
}

#[tokio::test]
async fn at_most_n_behind_writes_then_a_write_waits_for_a_slot() {
    let r = rig(2).await;
    for i in 0..2u64 {
        r.a.write(i * 4096, SharedBuf::from_slice(&block(7)), WriteFlags::NONE).await.unwrap();
    }
    let a = r.a.clone();
    let third =
        tokio::spawn(async move { a.write(2 * 4096, SharedBuf::from_slice(&block(7)), WriteFlags::NONE).await });
    settle().await;
    assert!(!third.is_finished(), "N = 2 behind writes outstanding: the third waits");
    assert_eq!(r.held.waiting(), 2);
    r.held.release_last();
    third.await.unwrap().unwrap();
    assert_eq!(r.a.detail()["write_behind"]["slot_waits"], 1);
    r.held.open();
    r.a.flush().await.unwrap();
}

#[tokio::test]
async fn fua_reaches_every_member_before_it_completes() {
    let r = rig(8).await;
    let a = r.a.clone();
    let fua = tokio::spawn(async move { a.write(0, SharedBuf::from_slice(&block(3)), WriteFlags::FUA).await });
    r.held.wait_for(1).await;
    settle().await;
    assert!(!fua.is_finished(), "FUA is not done behind");
    r.held.open();
    fua.await.unwrap().unwrap();
    assert!(on(&r.remote, r.data_offset) == block(3));
}

#[tokio::test]
async fn overlapping_behind_writes_reach_the_member_in_order() {
    let r = rig(8).await;
    r.a.write(0, SharedBuf::from_slice(&block(1)), WriteFlags::NONE).await.unwrap();
    r.a.write(0, SharedBuf::from_slice(&block(2)), WriteFlags::NONE).await.unwrap();
    settle().await;
    // The member would let the newest write go first; the second must not have been issued.
    assert_eq!(r.held.waiting(), 1, "the second behind write waits for the first");
    r.held.release_last();
    r.held.wait_for(1).await;
    r.held.open();
    r.a.flush().await.unwrap();
    assert!(on(&r.remote, r.data_offset) == block(2), "the member ends with the newer data");
}

#[tokio::test]
async fn a_read_never_goes_to_a_lagging_member_while_its_behind_write_is_outstanding() {
    let r = rig(8).await;
    r.a.write(0, SharedBuf::from_slice(&block(5)), WriteFlags::NONE).await.unwrap();
    r.held.wait_for(1).await;
    // No longer write-mostly, but its behind write is outstanding: it still lags. The local
    // copy cannot be read: the read must wait for the behind write, not read the old data
    // (and then "repair" the local copy with it).
    r.a.set_write_mostly("remote", false).await.unwrap();
    r.local_fault.fail_range(OpMask::READ, r.data_offset, 4096);
    let a = r.a.clone();
    let read = tokio::spawn(async move { a.read_vec(0, 4096).await });
    settle().await;
    assert!(!read.is_finished(), "the read waits for the behind write");
    r.held.open();
    assert!(read.await.unwrap().unwrap() == block(5), "the read returned the old data");
    r.a.flush().await.unwrap();
}

#[tokio::test]
async fn the_bitmap_chunk_stays_dirty_until_the_behind_write_is_done() {
    let r = rig(8).await;
    let bm = || r.a.core().bitmap.as_ref().unwrap().stats();
    r.a.write(0, SharedBuf::from_slice(&block(9)), WriteFlags::NONE).await.unwrap();
    r.a.core().bitmap.as_ref().unwrap().sweep_now().await.unwrap();
    assert_eq!(bm().dirty_chunks, 1, "a sweep must not clear a chunk with a behind write outstanding");
    r.held.open();
    r.a.flush().await.unwrap();
    r.a.core().bitmap.as_ref().unwrap().sweep_now().await.unwrap();
    assert_eq!(bm().dirty_chunks, 0, "cleared once the behind write is done");
}

#[tokio::test]
async fn a_failed_behind_write_fails_the_member_and_keeps_the_chunk_for_re_add() {
    let r = rig(8).await;
    r.a.write(0, SharedBuf::from_slice(&block(4)), WriteFlags::NONE).await.unwrap();
    r.held.wait_for(1).await;
    // The link goes while the behind write is on its way: every request fails (a single bad
    // range would be recorded as a bad block instead, md's narrow_write_error).
    r.fault.pull();
    r.held.open();
    r.a.flush().await.unwrap();
    let d = r.a.detail();
    assert_eq!(d["members"][1]["state"][0], "faulty", "{d}");
    assert_eq!(d["write_behind"]["failed_writes"], 1);
    let st = r.a.core().bitmap.as_ref().unwrap().stats();
    assert!(st.needed_chunks >= 1, "the chunk is kept for a bitmap-guided re-add: {st:?}");
    assert!(r.a.read_vec(0, 4096).await.unwrap() == block(4));
}

#[tokio::test]
async fn write_behind_is_refused_without_a_bitmap_or_beyond_raid1() {
    let ms: Vec<MemberDev> = (0..2)
        .map(|i| MemberDev::new(format!("m{i}"), Arc::new(MemDevice::new(format!("m{i}"), MEMBER_BYTES)) as DeviceRef))
        .collect();
    let mut o = opts(Level::Raid1, 2, None, None, false, true);
    o.write_behind = 256;
    let e = create(ms.clone(), o).await.err().expect("no bitmap").to_string();
    assert!(e.contains("write-behind needs a write-intent bitmap"), "{e}");
    let mut o = opts(Level::Raid10, 2, Some(64), None, true, true);
    o.write_behind = 256;
    let e = create(ms.clone(), o).await.err().expect("raid10").to_string();
    assert!(e.contains("raid1 only"), "{e}");
    let mut o = opts(Level::Raid1, 2, None, None, true, true);
    o.write_behind = 16384;
    let e = create(ms, o).await.err().expect("too large").to_string();
    assert!(e.contains("out of range"), "{e}");
}

/// `mdadm --examine-bitmap` (through a read-only loop device, as `bitmap_mdadm`) reads the
/// write-behind value mdkit wrote at create, and the one a running change persisted.
#[tokio::test]
async fn mdadm_examine_bitmap_shows_the_write_behind_value() {
    crate::common::require_tool("mdadm");
    crate::common::require_tool("losetup");
    let dir = tempfile::tempdir().unwrap();
    let ms = crate::array_util::mem_members("wb", 2, MEMBER_BYTES);
    let mut o = opts(Level::Raid1, 2, None, None, true, true);
    o.write_behind = 256;
    let a = crate::array_util::create_array(&ms, o).await;
    let examine = |tag: &str| {
        let path = dir.path().join(format!("wb0-{tag}.img"));
        std::fs::write(&path, ms[0].mem.as_ref().unwrap().to_image()).unwrap();
        let out = std::process::Command::new("losetup").args(["--read-only", "--find", "--show"]).arg(&path).output();
        let out = out.unwrap();
        assert!(out.status.success(), "losetup: {}", String::from_utf8_lossy(&out.stderr));
        let dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let x = std::process::Command::new("mdadm").arg("--examine-bitmap").arg(&dev).output().unwrap();
        let _ = std::process::Command::new("losetup").arg("-d").arg(&dev).status();
        let text = String::from_utf8_lossy(&x.stdout).into_owned();
        assert!(x.status.success(), "mdadm -X: {text}{}", String::from_utf8_lossy(&x.stderr));
        crate::array_util::examine_field(&text, "Write Mode").unwrap_or("").to_string()
    };
    assert_eq!(examine("create"), "Allow write behind, max 256");
    a.set_write_behind(64).await.unwrap();
    assert_eq!(examine("set"), "Allow write behind, max 64");
    let e = a.set_write_behind(16384).await.unwrap_err().to_string();
    assert!(e.contains("above 16383"), "{e}");
    a.stop().await.unwrap();
    assert_eq!(examine("stopped"), "Allow write behind, max 64");
}
