//! raid4/5/6 through the runtime on RAM members, every layout mdkit runs (raid4; raid5
//! algorithms 0–5; raid6 0–5, DDF 8–10 and the "-6" forms 16–20): created the mdadm way
//! (raid4/5 rebuild their last member, raid6 resyncs), random writes of odd shapes checked
//! against a byte model, `check` finds 0 mismatches, and every member's contents equal what the
//! kernel's layout and P/Q arithmetic say (each stripe recomputed independently from the
//! member images with `mdkit-parity`).

use crate::array_util;

use array_util::*;
use mdkit_io::{BlockDevice, Rng};
use mdkit_md::layout::{Level, ParityGeometry, StripeBlock};

/// Recomputes every stripe's parity from the member images (data offset from the superblock)
/// and compares; also checks the array's bytes against the layout map.
fn verify_members(ms: &[SimMember], level: Level, layout: u32, chunk_kib: u32, model: &Model, data_offset: u64) {
    let n = ms.len();
    let g = ParityGeometry::new(level, n as u32, layout, chunk_kib * 2).unwrap();
    let chunk = (chunk_kib * 1024) as usize;
    let imgs: Vec<Vec<u8>> = ms.iter().map(|m| m.mem.as_ref().unwrap().to_image()).collect();
    let stripes = model.data.len() / (chunk * g.data_disks());
    for s in 0..stripes as u64 {
        let map = g.stripe_map(s);
        let at = data_offset as usize + s as usize * chunk;
        let blk = |r: usize| &imgs[r][at..at + chunk];
        for (dd, r) in map.data_members.iter().enumerate() {
            let a = (s as usize * g.data_disks() + dd) * chunk;
            assert!(blk(*r) == &model.data[a..a + chunk], "{level:?}/{layout}: stripe {s} data {dd} on member {r}");
        }
        let data: Vec<&[u8]> = map.data_members.iter().map(|r| blk(*r)).collect();
        let mut p = vec![0u8; chunk];
        let mut q = vec![0u8; chunk];
        if let Some(qm) = map.q_member {
            let ordered: Vec<Option<&[u8]>> = map.syndrome_sources.iter().map(|x| x.map(blk)).collect();
            mdkit_parity::pq_gen_sparse(&ordered, &mut p, &mut q);
            assert!(blk(qm) == &q[..], "{level:?}/{layout}: stripe {s} Q on member {qm}");
        } else {
            mdkit_parity::xor_gen(&data, &mut p);
        }
        assert!(blk(map.p_member) == &p[..], "{level:?}/{layout}: stripe {s} P on member {}", map.p_member);
        assert_eq!(map.block_of(map.p_member), Some(StripeBlock::P));
    }
}

async fn roundtrip(level: Level, n: usize, layout: u32, seed: u64) {
    let name = format!("rt-{}-{layout}-", level.name());
    let ms = mem_members(&name, n, 6 * MIB);
    let a = create_array(&ms, opts(level, n as u32, Some(64), Some(layout), false, false)).await;
    fast_sync(&a);
    let mut rng = Rng::new(seed);
    let mut model = Model::new(a.size_bytes());
    // Writes race the initial sync (recovery of the last member for raid4/5, resync for raid6).
    for _ in 0..40 {
        random_write(&a, &mut model, &mut rng, 48).await;
    }
    a.wait_sync_idle().await;
    assert_eq!(a.core().degraded(), 0, "{name}: initial sync done");
    for i in 0..80 {
        if i % 4 == 3 {
            random_verify(&a, &model, &mut rng, 64).await;
        } else {
            random_write(&a, &mut model, &mut rng, 48).await;
        }
    }
    verify_all(&a, &model).await;
    assert_eq!(check(&a).await, 0, "{name}: mismatches");
    assert_eq!(a.get_attribute("mismatch_members").unwrap(), "none");
    let dof = a.core().slots().in_sync(0).unwrap().data_offset_sectors * 512;
    a.stop().await.unwrap();
    verify_members(&ms, level, layout, 64, &model, dof);
    // Re-assembled, it reads the same.
    let b = assemble_array(&ms).await;
    verify_all(&b, &model).await;
    b.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid4_and_raid5_every_algorithm() {
    let s = seed("raid4_and_raid5_every_algorithm", 41);
    roundtrip(Level::Raid4, 3, 0, s).await;
    for alg in 0..=5 {
        roundtrip(Level::Raid5, 4, alg, s + u64::from(alg)).await;
    }
    roundtrip(Level::Raid5, 3, 2, s + 9).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid6_every_algorithm() {
    let s = seed("raid6_every_algorithm", 43);
    for alg in [0, 1, 2, 3, 4, 5, 8, 9, 10, 16, 17, 18, 19, 20] {
        roundtrip(Level::Raid6, 5, alg, s + u64::from(alg)).await;
    }
    roundtrip(Level::Raid6, 4, 2, s + 99).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topology_and_attributes() {
    let ms = mem_members("topo-", 6, 4 * MIB);
    let a = create_array(&ms, opts(Level::Raid6, 6, Some(64), None, false, true)).await;
    assert_eq!(a.topology().optimal_io_bytes, 4 * 64 * 1024, "a full stripe");
    assert_eq!(a.get_attribute("stripe_size").unwrap(), "4096");
    assert_eq!(a.get_attribute("stripe_cache_size").unwrap(), "256");
    a.set_attribute("stripe_size", "16384").unwrap();
    assert!(a.set_attribute("stripe_size", "1000").is_err());
    assert!(a.set_attribute("stripe_cache_size", "5").is_err());
    a.set_attribute("stripe_cache_size", "1024").unwrap();
    assert_eq!(a.get_attribute("stripe_cache_size").unwrap(), "1024");
    assert_eq!(a.get_attribute("stripe_cache_active").unwrap(), "0");
    a.stop().await.unwrap();
}
