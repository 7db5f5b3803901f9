//! The kernel data layouts: forward ∘ reverse = identity for every level, layout, device count
//! 2..=8 and several chunk sizes; every raid4/5/6 stripe is a permutation of the members; raid10
//! copies land on distinct members; hand-checked examples; the reverse map checked against an
//! independent port of the kernel's raid5_compute_blocknr index arithmetic.

use crate::common;

use common::{Rng, test_seed};
use mdkit_md::layout::names::algorithm as alg;
use mdkit_md::layout::parity::MemberBlock;
use mdkit_md::layout::{
    Level, MemberSector, ParityGeometry, Raid0Geometry, Raid0Layout, Raid1Geometry, Raid10Geometry,
};

const CHUNKS: [u32; 4] = [8, 16, 128, 1024];

fn parity_algorithms(level: Level) -> Vec<u32> {
    match level {
        Level::Raid4 => vec![0],
        Level::Raid5 => (0..=5).collect(),
        _ => vec![0, 1, 2, 3, 4, 5, 8, 9, 10, 16, 17, 18, 19, 20],
    }
}

/// raid5_compute_blocknr's index arithmetic, ported separately from the library's generic
/// inversion: member `i` of a stripe with parity `pd` -> logical data index.
fn kernel_blocknr_index(
    level: Level,
    algorithm: u32,
    n: usize,
    pd: usize,
    qd: Option<usize>,
    i: usize,
) -> Option<usize> {
    if i == pd || Some(i) == qd {
        return None;
    }
    let data_disks = n - level.max_degraded() as usize;
    let mut i = i as i64;
    let (n, pd) = (n as i64, pd as i64);
    match level {
        Level::Raid4 => {}
        Level::Raid5 => match algorithm {
            alg::LEFT_ASYMMETRIC | alg::RIGHT_ASYMMETRIC if i > pd => {
                i -= 1;
            }
            alg::LEFT_SYMMETRIC | alg::RIGHT_SYMMETRIC => {
                if i < pd {
                    i += n;
                }
                i -= pd + 1;
            }
            alg::PARITY_0 => i -= 1,
            _ => {}
        },
        _ => match algorithm {
            alg::LEFT_ASYMMETRIC | alg::RIGHT_ASYMMETRIC | alg::ROTATING_ZERO_RESTART | alg::ROTATING_N_RESTART => {
                if pd == n - 1 {
                    i -= 1;
                } else if i > pd {
                    i -= 2;
                }
            }
            alg::LEFT_SYMMETRIC | alg::RIGHT_SYMMETRIC => {
                if pd == n - 1 {
                    i -= 1;
                } else {
                    if i < pd {
                        i += n;
                    }
                    i -= pd + 2;
                }
            }
            alg::PARITY_0 => i -= 2,
            alg::PARITY_N => {}
            alg::ROTATING_N_CONTINUE => {
                if pd == 0 {
                    i -= 1;
                } else {
                    if i < pd {
                        i += n;
                    }
                    i -= pd + 1;
                }
            }
            alg::LEFT_ASYMMETRIC_6 | alg::RIGHT_ASYMMETRIC_6 => {
                if i > pd {
                    i -= 1;
                }
            }
            alg::LEFT_SYMMETRIC_6 | alg::RIGHT_SYMMETRIC_6 => {
                if i < pd {
                    i += data_disks as i64 + 1;
                }
                i -= pd + 1;
            }
            _ => i -= 1, // PARITY_0_6
        },
    }
    usize::try_from(i).ok()
}

#[test]
fn parity_layouts_are_bijections_and_permutations() {
    let mut rng = Rng::new(test_seed("parity_layouts"));
    let mut configs = 0;
    for level in [Level::Raid4, Level::Raid5, Level::Raid6] {
        for algorithm in parity_algorithms(level) {
            for n in level.min_raid_disks().max(2)..=8 {
                for chunk in CHUNKS {
                    let g = ParityGeometry::new(level, n, algorithm, chunk).unwrap();
                    check_parity(&g, &mut rng);
                    configs += 1;
                }
            }
        }
    }
    eprintln!("checked {configs} raid4/5/6 geometries");
}

fn check_parity(g: &ParityGeometry, rng: &mut Rng) {
    let n = g.raid_disks();
    let d = g.data_disks();
    let what = format!("{:?} alg {} n {} chunk {}", g.level(), g.algorithm(), n, g.chunk_sectors());
    // Every stripe of a full rotation (and some far away) is a permutation of the members.
    let stripes: Vec<u64> = (0..2 * n as u64 + 3).chain((0..20).map(|_| rng.below(1 << 40))).collect();
    for s in stripes {
        let m = g.stripe_map(s);
        let mut seen = vec![0u32; n];
        seen[m.p_member] += 1;
        if let Some(q) = m.q_member {
            seen[q] += 1;
        }
        for x in &m.data_members {
            seen[*x] += 1;
        }
        assert!(seen.iter().all(|c| *c == 1), "{what} stripe {s}: not a permutation: {m:?}");
        assert_eq!(m.data_members.len(), d, "{what}");
        assert_eq!(m.q_member.is_some(), g.level() == Level::Raid6, "{what}");
        // The reverse index arithmetic of the kernel agrees with the forward map.
        for (member, want) in (0..n).map(|i| (i, m.block_of(i))) {
            let idx = kernel_blocknr_index(g.level(), g.algorithm(), n, m.p_member, m.q_member, member);
            match want.unwrap() {
                mdkit_md::layout::StripeBlock::Data(dd) => {
                    assert_eq!(idx, Some(dd), "{what} stripe {s} member {member}")
                }
                _ => assert_eq!(idx, None, "{what}"),
            }
        }
        if g.level() == Level::Raid6 {
            check_syndrome_order(g, &m, &what);
        }
    }
    // Random array sectors: forward then reverse.
    let array = g.array_sectors(1 << 36).unwrap();
    for _ in 0..300 {
        let s = rng.below(array);
        let mp = g.map(s);
        assert_eq!(mp.data.sector % g.chunk_sectors(), s % g.chunk_sectors(), "{what}");
        match g.unmap(mp.data.member, mp.data.sector) {
            Some(MemberBlock::Data { array_sector, data_index, .. }) => {
                assert_eq!(array_sector, s, "{what}");
                assert_eq!(data_index, mp.data_index, "{what}");
            }
            other => panic!("{what}: sector {s} -> {mp:?} -> {other:?}"),
        }
        let sm = g.stripe_map(mp.stripe);
        assert_eq!(
            (sm.p_member, sm.q_member, sm.data_members[mp.data_index]),
            (mp.p_member, mp.q_member, mp.data.member)
        );
    }
    // Random member sectors: reverse then forward.
    for _ in 0..300 {
        let member = rng.below(n as u64) as usize;
        let sector = rng.below(1 << 36);
        match g.unmap(member, sector).unwrap() {
            MemberBlock::Data { array_sector, .. } => {
                assert_eq!(g.map(array_sector).data, MemberSector { member, sector }, "{what}");
            }
            MemberBlock::P { stripe } => assert_eq!(g.stripe_map(stripe).p_member, member),
            MemberBlock::Q { stripe } => assert_eq!(g.stripe_map(stripe).q_member, Some(member)),
        }
    }
    assert_eq!(g.unmap(n, 0), None);
}

/// formats.md 3.3: md layouts walk from Q+1 (0 if Q is last) skipping P/Q; symmetric layouts
/// then equal logical order; DDF layouts list every slot with P/Q as zero blocks.
fn check_syndrome_order(g: &ParityGeometry, m: &mdkit_md::layout::StripeMap, what: &str) {
    let n = g.raid_disks();
    if m.ddf {
        assert_eq!(m.syndrome_sources.len(), n, "{what}");
        for (i, src) in m.syndrome_sources.iter().enumerate() {
            let is_pq = i == m.p_member || Some(i) == m.q_member;
            assert_eq!(*src, (!is_pq).then_some(i), "{what}");
        }
        return;
    }
    let srcs: Vec<usize> = m.syndrome_sources.iter().map(|s| s.expect("md layouts have no zero blocks")).collect();
    let mut sorted = srcs.clone();
    sorted.sort_unstable();
    let mut data = m.data_members.clone();
    data.sort_unstable();
    assert_eq!(sorted, data, "{what}: syndrome sources are the data members");
    if matches!(g.algorithm(), alg::LEFT_SYMMETRIC | alg::RIGHT_SYMMETRIC | alg::PARITY_0 | alg::PARITY_N) {
        assert_eq!(srcs, m.data_members, "{what}: symmetric layouts use logical order");
    } else {
        // A rotation of the logical order.
        let pos = srcs.iter().position(|x| *x == m.data_members[0]).unwrap();
        let rotated: Vec<usize> = srcs[pos..].iter().chain(&srcs[..pos]).copied().collect();
        assert_eq!(rotated, m.data_members, "{what}: asymmetric syndrome order is a rotation");
    }
}

#[test]
fn raid5_left_symmetric_worked_example() {
    // formats.md 3.2, n = 4 with 512 KiB chunks.
    let g = ParityGeometry::new(Level::Raid5, 4, alg::LEFT_SYMMETRIC, 1024).unwrap();
    let rows: [(usize, [usize; 3]); 4] = [(3, [0, 1, 2]), (2, [3, 0, 1]), (1, [2, 3, 0]), (0, [1, 2, 3])];
    for (s, (p, data)) in rows.iter().enumerate() {
        let m = g.stripe_map(s as u64);
        assert_eq!((m.p_member, m.data_members.as_slice()), (*p, data.as_slice()), "stripe {s}");
    }
    // Array chunk 7 -> stripe 2, index 1 -> member 3 at member chunk 2.
    assert_eq!(g.map(7 * 1024 + 100).data, MemberSector { member: 3, sector: 2 * 1024 + 100 });
}

#[test]
fn raid6_examples() {
    // left-symmetric n=4: stripe 0 has P = n-1-0 = 3, Q = 0, data on 1,2.
    let g = ParityGeometry::new(Level::Raid6, 4, alg::LEFT_SYMMETRIC, 8).unwrap();
    let m = g.stripe_map(0);
    assert_eq!((m.p_member, m.q_member, m.data_members.clone()), (3, Some(0), vec![1, 2]));
    let m = g.stripe_map(1);
    assert_eq!((m.p_member, m.q_member, m.data_members.clone()), (2, Some(3), vec![0, 1]));
    // ddf-N-continue n=5 stripe 0: P=4, Q=3, data 0,1,2.
    let g = ParityGeometry::new(Level::Raid6, 5, alg::ROTATING_N_CONTINUE, 8).unwrap();
    let m = g.stripe_map(0);
    assert_eq!((m.p_member, m.q_member, m.data_members.clone()), (4, Some(3), vec![0, 1, 2]));
    // ddf-N-restart n=5 stripe 0: like left-asymmetric shifted by one: P=3, Q=4, data 0,1,2.
    let g = ParityGeometry::new(Level::Raid6, 5, alg::ROTATING_N_RESTART, 8).unwrap();
    let m = g.stripe_map(0);
    assert_eq!((m.p_member, m.q_member, m.data_members.clone()), (3, Some(4), vec![0, 1, 2]));
}

fn raid10_layouts(n: u32) -> Vec<u32> {
    let mut v = Vec::new();
    for copies in 2..=n.min(4) {
        v.push(0x100 | copies); // nX
        v.push((copies << 8) | 1); // fX
        v.push(0x10000 | (copies << 8) | 1); // oX
    }
    if n >= 4 {
        v.push(0x202); // n2 + f2
        v.push(0x201 | (2 << 17)); // f2, far sets of fc*nc
        v.push(0x10201 | (2 << 17));
        v.push(0x201 | (1 << 17)); // f2, far sets of n/fc (old "improved" layout)
    }
    v
}

#[test]
fn raid10_copies_are_distinct_and_invertible() {
    let mut rng = Rng::new(test_seed("raid10"));
    let mut configs = 0;
    for n in 2..=8u32 {
        for layout in raid10_layouts(n) {
            for chunk in CHUNKS {
                let member_size = u64::from(chunk) * (40 + rng.below(60)) + rng.below(u64::from(chunk));
                let g = Raid10Geometry::new(n, layout, chunk, member_size).unwrap();
                check_raid10(&g, n, layout, &mut rng);
                configs += 1;
            }
        }
    }
    eprintln!("checked {configs} raid10 geometries");
}

fn check_raid10(g: &Raid10Geometry, n: u32, layout: u32, rng: &mut Rng) {
    let what = format!("raid10 n {n} layout {layout:#x} chunk {}", g.chunk_sectors());
    assert!(g.dev_sectors() * u64::from(n) >= g.array_sectors() * g.copies() as u64, "{what}: capacity");
    let array = g.array_sectors();
    assert!(array > 0, "{what}");
    let mut samples: Vec<u64> = (0..400).map(|_| rng.below(array)).collect();
    samples.extend([0, array - 1]);
    for s in samples {
        let copies = g.map(s).unwrap();
        assert_eq!(copies.len(), g.copies(), "{what}");
        let mut members: Vec<usize> = copies.iter().map(|c| c.member).collect();
        members.sort_unstable();
        members.dedup();
        assert_eq!(members.len(), copies.len(), "{what}: sector {s} has two copies on one member: {copies:?}");
        for c in copies {
            assert!(c.member < n as usize && c.sector < g.dev_sectors(), "{what}: {c:?} outside the member");
            assert_eq!(g.unmap(c.member, c.sector), Some(s), "{what}: copy {c:?} of sector {s}");
        }
    }
    assert!(g.map(array).is_none());
    for _ in 0..400 {
        let member = rng.below(u64::from(n)) as usize;
        let sector = rng.below(g.dev_sectors());
        if let Some(a) = g.unmap(member, sector) {
            assert!(g.map(a).unwrap().contains(&MemberSector { member, sector }), "{what}: {member}/{sector} -> {a}");
        }
    }
    // Exhaustive per chunk for small geometries: every member chunk is used at most once.
    if g.dev_sectors() / g.chunk_sectors() <= 200 {
        let c = g.chunk_sectors();
        let mut used = std::collections::HashSet::new();
        for chunk in 0..array / c {
            for copy in g.map(chunk * c).unwrap() {
                assert!(used.insert((copy.member, copy.sector / c)), "{what}: member chunk used twice");
            }
        }
        assert_eq!(used.len() as u64, array / c * g.copies() as u64);
    }
}

#[test]
fn raid0_zones_are_bijections() {
    let mut rng = Rng::new(test_seed("raid0"));
    for n in 1..=8usize {
        for chunk in CHUNKS {
            for distinct in 1..=3 {
                let c = u64::from(chunk);
                let sizes_pool: Vec<u64> = (0..distinct).map(|_| c * (1 + rng.below(20)) + rng.below(c)).collect();
                let sizes: Vec<u64> = (0..n).map(|_| sizes_pool[rng.below(distinct) as usize]).collect();
                for layout in [Raid0Layout::Original, Raid0Layout::Alternate] {
                    let g = Raid0Geometry::new(&sizes, chunk, Some(layout)).unwrap();
                    let what = format!("raid0 sizes {sizes:?} chunk {chunk} {layout:?}");
                    let total: u64 = sizes.iter().map(|s| s - s % c).sum();
                    assert_eq!(g.array_sectors(), total, "{what}");
                    // Exhaustive over chunk starts plus random offsets.
                    let mut hit = std::collections::HashSet::new();
                    for k in 0..total / c {
                        let s = k * c + rng.below(c);
                        let m = g.map(s).unwrap();
                        assert!(m.sector < sizes[m.member] - sizes[m.member] % c, "{what}");
                        assert_eq!(g.unmap(m.member, m.sector), Some(s), "{what}: {s} -> {m:?}");
                        assert!(hit.insert((m.member, m.sector / c)), "{what}: member chunk used twice");
                    }
                    assert_eq!(g.map(total), None);
                    for (member, size) in sizes.iter().enumerate() {
                        assert_eq!(g.unmap(member, size - size % c), None, "{what}");
                    }
                }
            }
        }
    }
}

#[test]
fn raid0_orig_and_alt_differ_only_in_later_zones() {
    let sizes = [1024u64, 3072, 3072, 3072];
    let orig = Raid0Geometry::new(&sizes, 8, Some(Raid0Layout::Original)).unwrap();
    let alt = Raid0Geometry::new(&sizes, 8, Some(Raid0Layout::Alternate)).unwrap();
    let zone1 = orig.zones()[1].start_sector;
    for s in (0..zone1).step_by(7) {
        assert_eq!(orig.map(s), alt.map(s));
    }
    // Zone 1 starts at array chunk 512, 512 % 3 = 2: ORIG begins on the zone's third member.
    assert_eq!(orig.map(zone1).unwrap().member, 3);
    assert_eq!(alt.map(zone1).unwrap().member, 1);
}

#[test]
fn raid1_is_trivial() {
    let g = Raid1Geometry { raid_disks: 3, member_size_sectors: 100 };
    assert_eq!(g.map(99).unwrap(), (0..3).map(|member| MemberSector { member, sector: 99 }).collect::<Vec<_>>());
    assert_eq!(g.map(100), None);
    assert_eq!(g.unmap(2, 5), Some(5));
    assert_eq!(g.unmap(3, 5), None);
}
