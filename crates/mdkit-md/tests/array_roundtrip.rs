//! Data round trips through the runtime for every level and layout mdkit runs (raid0 single-
//! and multi-zone ORIG/ALT, raid1 2- and 3-way, raid10 near/far/offset on even and odd member
//! counts): random writes and reads of odd shapes against a byte model, a stop and
//! re-assembly, then `check` (0 mismatches), plus out-of-range and misaligned requests that must
//! fail and change nothing.

use crate::array_util;

use array_util::*;
use mdkit_io::{BlockDevice, BlockDeviceExt, IoBuf, Rng, SharedBuf, WriteFlags, ZeroFlags};
use mdkit_md::array::Array;
use mdkit_md::layout::Level;

struct Case {
    name: &'static str,
    level: Level,
    sizes_mib: Vec<u64>,
    chunk_kib: Option<u32>,
    layout: Option<u32>,
    bitmap: bool,
}

fn cases() -> Vec<Case> {
    let c = |name, level, sizes_mib: Vec<u64>, chunk_kib, layout, bitmap| Case {
        name,
        level,
        sizes_mib,
        chunk_kib,
        layout,
        bitmap,
    };
    vec![
        c("raid0-single", Level::Raid0, vec![12; 3], Some(64), None, false),
        c("raid0-multizone-orig", Level::Raid0, vec![8, 12, 12, 16], Some(64), Some(1), false),
        c("raid0-multizone-alt", Level::Raid0, vec![8, 12, 12, 16], Some(64), Some(2), false),
        c("raid1-2way-bitmap", Level::Raid1, vec![12; 2], None, None, true),
        c("raid1-3way", Level::Raid1, vec![12; 3], None, None, false),
        c("raid10-n2x4", Level::Raid10, vec![12; 4], Some(64), Some(0x102), true),
        c("raid10-n2x3", Level::Raid10, vec![12; 3], Some(64), Some(0x102), false),
        c("raid10-f2x2", Level::Raid10, vec![12; 2], Some(64), Some(0x201), false),
        c("raid10-f2x3", Level::Raid10, vec![12; 3], Some(64), Some(0x201), false),
        c("raid10-o2x3", Level::Raid10, vec![12; 3], Some(64), Some(0x10201), false),
        c("raid10-o2x4", Level::Raid10, vec![12; 4], Some(64), Some(0x10201), false),
        c("raid10-n3x3", Level::Raid10, vec![12; 3], Some(64), Some(0x103), false),
    ]
}

async fn members_for(case: &Case) -> Vec<SimMember> {
    case.sizes_mib
        .iter()
        .enumerate()
        .map(|(i, s)| mem_members(&format!("{}-m{i}-", case.name), 1, s * MIB).remove(0))
        .collect()
}

async fn workload(a: &Array, m: &mut Model, rng: &mut Rng, ops: usize) {
    for _ in 0..ops {
        match rng.below(10) {
            0..=5 => {
                random_write(a, m, rng, 96).await;
            }
            6 => {
                let (off, len) = random_extent(rng, m.data.len() as u64, 40);
                a.write_zeroes(off, len, ZeroFlags::default()).await.unwrap();
                m.zero(off, len);
            }
            7 => a.flush().await.unwrap(),
            _ => random_verify(a, m, rng, 96).await,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_level_and_layout_round_trips() {
    let s = seed("every_level_and_layout_round_trips", 11);
    for case in cases() {
        eprintln!("case {}", case.name);
        let mut rng = Rng::new(s ^ case.name.len() as u64);
        let ms = members_for(&case).await;
        let a =
            create_array(&ms, opts(case.level, ms.len() as u32, case.chunk_kib, case.layout, case.bitmap, false)).await;
        fast_sync(&a);
        let size = a.size_bytes();
        assert!(size > 0 && size % 4096 == 0, "{}: size {size}", case.name);
        let mut m = Model::new(size);
        // Concurrent writers on disjoint quarters, while the initial resync runs.
        let quarter = size / 4 / 4096 * 4096;
        let mut futs = Vec::new();
        for q in 0..4u64 {
            let mut rng = Rng::new(s + q);
            let a = &a;
            futs.push(async move {
                let mut writes = Vec::new();
                for _ in 0..20 {
                    let len = (1 + rng.below(40)) * 4096;
                    let off = q * quarter + rng.below((quarter - len) / 4096 + 1) * 4096;
                    let mut buf = IoBuf::zeroed(len as usize);
                    rng.fill(buf.as_mut_slice());
                    writes.push((off, buf.as_slice().to_vec()));
                    a.write(off, buf.freeze(), WriteFlags::NONE).await.unwrap();
                }
                writes
            });
        }
        for f in futs {
            for (off, data) in f.await {
                m.apply(off, &data);
            }
        }
        workload(&a, &mut m, &mut rng, 300).await;
        verify_all(&a, &m).await;
        a.wait_sync_idle().await;
        if case.level != Level::Raid0 {
            assert_eq!(check(&a).await, 0, "{}: mismatches after the workload", case.name);
        }
        a.stop().await.unwrap();
        drop(a);
        let a = assemble_array(&ms).await;
        assert_eq!(a.size_bytes(), size);
        assert_eq!(a.get_attribute("array_state").unwrap(), "clean", "{}", case.name);
        assert_eq!(a.get_attribute("resync_start").unwrap(), "none", "{}: stopped clean", case.name);
        verify_all(&a, &m).await;
        workload(&a, &mut m, &mut rng, 100).await;
        verify_all(&a, &m).await;
        if case.level != Level::Raid0 {
            assert_eq!(check(&a).await, 0, "{}: mismatches after re-assembly", case.name);
        }
        a.stop().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_fail_and_change_nothing() {
    let ms = mem_members("bad-", 2, 8 * MIB);
    let a = create_array(&ms, opts(Level::Raid1, 2, None, None, false, true)).await;
    let size = a.size_bytes();
    let before: Vec<Vec<u8>> = ms.iter().map(|m| m.mem.as_ref().unwrap().to_image()).collect();
    let cases: Vec<(u64, usize)> =
        vec![(size, 4096), (size - 4096, 8192), (512, 4096), (0, 512), (u64::MAX - 4095, 4096)];
    for (off, len) in &cases {
        let e = a.write(*off, SharedBuf::zeroed(*len), WriteFlags::NONE).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "write {off}+{len}: {e}");
        let (_, r) = a.read(*off, IoBuf::zeroed(*len)).await;
        assert_eq!(r.unwrap_err().kind(), std::io::ErrorKind::InvalidInput);
        assert!(a.discard(*off, *len as u64).await.is_err());
        assert!(a.write_zeroes(*off, *len as u64, ZeroFlags::default()).await.is_err());
    }
    let e = a.write(0, SharedBuf::zeroed(64 << 20), WriteFlags::NONE).await.unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    assert!(e.to_string().contains("raid1:md-test"), "error names the array: {e}");
    // Nothing reached the members: not even the superblocks (the array never became active).
    let after: Vec<Vec<u8>> = ms.iter().map(|m| m.mem.as_ref().unwrap().to_image()).collect();
    assert!(before == after, "a refused request changed a member");
    assert_eq!(a.read_vec(0, 4096).await.unwrap(), vec![0u8; 4096]);
    a.stop().await.unwrap();
}
