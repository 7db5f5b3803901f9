//! Multi-member md assembly over damaged metadata: a valid array (2..6 in-memory members, with
//! an internal write-intent bitmap) is created once by mdkit; each input picks one of them,
//! which members take part and in what order, and a list of byte edits over the members'
//! metadata areas (superblock and bitmap, everything before the data offset), optionally
//! re-sealing the superblock checksum so the edit reaches the field checks. Assembly must
//! return an error or a running array (which then serves a read and a write and stops), never
//! panic, hang or allocate without bound.
#![no_main]

use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use mdkit_io::{BlockDevice, BlockDeviceExt, DeviceRef, MemDevice, WriteFlags};
use mdkit_md::array::{AssembleOptions, CreateOptions, MemberDev, PartialStart, assemble_with, create};
use mdkit_md::format::create::BitmapRequest;
use mdkit_md::format::superblock::{MAX_DEV_ROLES, off, sb_checksum};
use mdkit_md::layout::Level;

const MEMBER_BYTES: u64 = 4 << 20;
/// v1.2: the superblock's 4 KiB block starts 8 sectors into the member.
const SB_OFFSET_BYTES: usize = 4096;
/// Edits land in `[0, min(data offset, this))` of a member.
const EDIT_AREA_MAX_BYTES: usize = 64 << 10;

/// One created array: its members' contents and the size of their metadata area.
struct Template {
    members: Vec<Arc<MemDevice>>,
    edit_area_bytes: usize,
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a current-thread runtime builds")
}

fn make_template(level: Level, n: u32) -> Template {
    let members: Vec<Arc<MemDevice>> =
        (0..n).map(|i| Arc::new(MemDevice::new(format!("seed{i}"), MEMBER_BYTES))).collect();
    let devs: Vec<MemberDev> =
        members.iter().enumerate().map(|(i, m)| MemberDev::new(format!("seed{i}"), m.clone() as DeviceRef)).collect();
    let mut o = CreateOptions::new("fuzz", level, n);
    o.chunk_kib = if level.uses_chunks() { Some(64) } else { None };
    o.bitmap = BitmapRequest::Internal { chunk_bytes: Some(256 << 10) };
    o.assume_clean = true;
    o.uuid = Some([7; 16]);
    runtime().block_on(async {
        let a = create(devs, o).await.expect("the template array is created");
        a.array.write_slice(0, &[0x5a; 8192], WriteFlags::FUA).await.expect("template write");
        a.array.stop().await.expect("the template array stops");
    });
    let mut sb = [0u8; 4096];
    members[0].read_bytes(SB_OFFSET_BYTES as u64, &mut sb);
    let data_offset_sectors = u64::from_le_bytes(sb[off::DATA_OFFSET..off::DATA_OFFSET + 8].try_into().unwrap());
    let edit_area_bytes = usize::try_from(data_offset_sectors * 512).unwrap_or(usize::MAX).min(EDIT_AREA_MAX_BYTES);
    Template { members, edit_area_bytes }
}

fn templates() -> &'static Vec<Template> {
    static T: OnceLock<Vec<Template>> = OnceLock::new();
    T.get_or_init(|| {
        vec![
            make_template(Level::Raid1, 2),
            make_template(Level::Raid5, 3),
            make_template(Level::Raid6, 4),
            make_template(Level::Raid10, 5),
            make_template(Level::Raid6, 6),
            make_template(Level::Raid4, 3),
        ]
    })
}

/// Recomputes member `m`'s superblock checksum after its edits (max_dev clamped for the sum).
fn reseal(dev: &MemDevice) {
    let mut block = [0u8; 4096];
    dev.read_bytes(SB_OFFSET_BYTES as u64, &mut block);
    let max_dev = u32::from_le_bytes(block[off::MAX_DEV..off::MAX_DEV + 4].try_into().unwrap());
    let c = sb_checksum(&block, max_dev.min(MAX_DEV_ROLES));
    dev.write_bytes((SB_OFFSET_BYTES + off::SB_CSUM) as u64, &c.to_le_bytes());
}

fuzz_target!(|data: &[u8]| {
    let [pick, order, flags, edits @ ..] = data else { return };
    let t = &templates()[usize::from(*pick) % templates().len()];
    let n = t.members.len();
    let copies: Vec<Arc<MemDevice>> =
        t.members.iter().enumerate().map(|(i, m)| Arc::new(m.snapshot(format!("m{i}")))).collect();
    let mut resealed = vec![false; n];
    for e in edits.chunks_exact(5) {
        let m = usize::from(e[0]) % n;
        let at = usize::from(u16::from_le_bytes([e[1], e[2]])) % t.edit_area_bytes;
        copies[m].write_bytes(at as u64, &[e[3]]);
        resealed[m] |= e[4] & 1 == 1;
    }
    for (m, r) in resealed.iter().enumerate() {
        if *r {
            reseal(&copies[m]);
        }
    }
    // Which members take part (bit i of `order` leaves member i out) and a rotation of them.
    let mut devs: Vec<MemberDev> = (0..n)
        .filter(|i| order & (1 << i) == 0 || n <= 2)
        .map(|i| MemberDev::new(format!("m{i}"), copies[i].clone() as DeviceRef))
        .collect();
    if !devs.is_empty() {
        let by = usize::from(order >> 6) % devs.len();
        devs.rotate_left(by);
    }
    let opts = AssembleOptions { name: "fuzz".into(), force: flags & 1 == 1, uuid: None, start_frozen: true };
    let partial = if flags & 2 == 2 { PartialStart::Allowed } else { PartialStart::NeedsRun };
    runtime().block_on(async {
        let Ok(a) = assemble_with(devs, opts, partial).await else { return };
        let _ = a.array.read_vec(0, 8192).await;
        let _ = a.array.write_slice(4096, &[0xa5; 4096], WriteFlags::NONE).await;
        let _ = a.array.flush().await;
        let _ = a.array.stop().await;
    });
});
