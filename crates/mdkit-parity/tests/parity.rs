//! Parity generation, read-modify-write, scrub diagnosis and recovery, for every implementation
//! this CPU supports, against a naive reference written from the definitions
//! (tests/common/mod.rs) and against each other.

use crate::common;

use common::{Blocks, LENGTHS, TestRng, garbage_out, ref_mul, ref_pow2, ref_pq};
use mdkit_parity::{Implementation, Member, PqCheck, RecoverError, gf};

fn implementations() -> Vec<&'static Implementation> {
    let all = Implementation::available();
    if Implementation::avx2().is_none() {
        eprintln!("SKIP: this CPU has no AVX2; only the scalar implementation is tested");
    }
    all
}

fn as_refs(blocks: &[Vec<u8>]) -> Vec<&[u8]> {
    blocks.iter().map(|b| b.as_slice()).collect()
}

fn with_holes<'a>(blocks: &'a [Vec<u8>], missing: &[usize]) -> Vec<Option<&'a [u8]>> {
    blocks.iter().enumerate().map(|(i, b)| (!missing.contains(&i)).then_some(b.as_slice())).collect()
}

//------------------------------------------------------------------------------------------------
// Known answer, built by hand from the definitions

/// Three data blocks, four byte positions, worked out on paper:
///
/// ```text
///  pos  D0  D1  D2 | P = D0^D1^D2 | Q = D0 ^ 2·D1 ^ 4·D2
///   0   01  01  01 |      01      | 01 ^ 02 ^ 04            = 07
///   1   80  80  80 |      80      | 80 ^ 1d ^ 3a            = a7   (2·80 = 100^11d = 1d)
///   2   ff  02  00 |      fd      | ff ^ 04 ^ 00            = fb
///   3   00  53  c0 |      93      | 00 ^ a6 ^ 27            = 81   (2·c0 = 9d, 2·9d = 27)
/// ```
///
/// The pattern is repeated to lengths that reach every SIMD and tail path.
#[test]
fn known_answer_by_hand() {
    let d0 = [0x01u8, 0x80, 0xff, 0x00];
    let d1 = [0x01u8, 0x80, 0x02, 0x53];
    let d2 = [0x01u8, 0x80, 0x00, 0xc0];
    let p_expect = [0x01u8, 0x80, 0xfd, 0x93];
    let q_expect = [0x07u8, 0xa7, 0xfb, 0x81];
    for imp in implementations() {
        for len in [4usize, 36, 128, 132, 4096, 4100] {
            let repeat = |pattern: &[u8; 4]| -> Vec<u8> { (0..len).map(|i| pattern[i % 4]).collect() };
            let data = [repeat(&d0), repeat(&d1), repeat(&d2)];
            let mut p = vec![0xaa; len];
            let mut q = vec![0x55; len];
            imp.pq_gen(&as_refs(&data), &mut p, &mut q);
            assert_eq!(p, repeat(&p_expect), "{imp:?} P len {len}");
            assert_eq!(q, repeat(&q_expect), "{imp:?} Q len {len}");
            let mut p_xor = vec![0x12; len];
            imp.xor_gen(&as_refs(&data), &mut p_xor);
            assert_eq!(p_xor, repeat(&p_expect), "{imp:?} xor_gen len {len}");
            assert_eq!(imp.pq_check(&as_refs(&data), &p, &q), PqCheck::Consistent);
        }
    }
}

#[test]
fn reference_agrees_with_hand_values() {
    // Guards the reference itself: the same paper values as above.
    assert_eq!(ref_mul(0x80, 2), 0x1d);
    assert_eq!(ref_mul(0xc0, 4), 0x27);
    assert_eq!(ref_pow2(8), 0x1d);
    assert_eq!(ref_pow2(255), 1);
}

//------------------------------------------------------------------------------------------------
// Generation against the reference, every length and misalignment

#[test]
fn pq_gen_and_xor_gen_match_reference() {
    let seed = 0x5eed_0001;
    let mut rng = TestRng::new(seed);
    for imp in implementations() {
        for data_count in [1usize, 2, 3, 4, 5, 6, 8, 14, 16] {
            for &len in LENGTHS {
                let offset = rng.below(32) as usize;
                let data = Blocks::random(&mut rng, data_count, len, offset);
                let (p_ref, q_ref) = ref_pq(&data.owned(), len);
                let mut p_buf = garbage_out(&mut rng, len, offset);
                let mut q_buf = garbage_out(&mut rng, len, offset + 3);
                let p = &mut p_buf[offset..offset + len];
                let q = &mut q_buf[offset + 3..offset + 3 + len];
                imp.pq_gen(&data.get(), p, q);
                let ctx = format!("{imp:?} seed {seed:#x} n {data_count} len {len} offset {offset}");
                assert_eq!(p, &p_ref[..], "P {ctx}");
                assert_eq!(q, &q_ref[..], "Q {ctx}");
                let mut px = garbage_out(&mut rng, len, 0);
                imp.xor_gen(&data.get(), &mut px);
                assert_eq!(px, p_ref, "xor_gen {ctx}");
            }
        }
    }
}

#[test]
fn pq_gen_sparse_treats_holes_as_zero_blocks() {
    let seed = 0x5eed_000a;
    let mut rng = TestRng::new(seed);
    for imp in implementations() {
        for &len in LENGTHS {
            let mut data = Blocks::random(&mut rng, 7, len, 0).owned();
            let holes = [1usize, 5, 6];
            for &h in &holes {
                data[h] = vec![0u8; len];
            }
            let (p_ref, q_ref) = ref_pq(&data, len);
            let (mut p, mut q) = (garbage_out(&mut rng, len, 0), garbage_out(&mut rng, len, 0));
            imp.pq_gen_sparse(&with_holes(&data, &holes), &mut p, &mut q);
            assert_eq!((&p, &q), (&p_ref, &q_ref), "{imp:?} seed {seed:#x} len {len}");
        }
    }
}

#[test]
fn empty_data_gives_zero_parity() {
    for imp in implementations() {
        let mut p = vec![7u8; 300];
        let mut q = vec![9u8; 300];
        imp.pq_gen(&[], &mut p, &mut q);
        assert!(p.iter().chain(&q).all(|&b| b == 0), "{imp:?}");
        let mut x = vec![3u8; 300];
        imp.xor_gen(&[], &mut x);
        assert!(x.iter().all(|&b| b == 0), "{imp:?}");
    }
}

#[test]
fn max_data_blocks_gen_and_recover() {
    // 255 data blocks: every distinct coefficient g^0..g^254 in use.
    let mut rng = TestRng::new(0x5eed_00ff);
    let len = 160;
    let data: Vec<Vec<u8>> = (0..mdkit_parity::MAX_DATA_BLOCKS).map(|_| rng.bytes(len)).collect();
    let (p_ref, q_ref) = ref_pq(&data, len);
    for imp in implementations() {
        let (mut p, mut q) = (vec![0; len], vec![0; len]);
        imp.pq_gen(&as_refs(&data), &mut p, &mut q);
        assert_eq!((&p, &q), (&p_ref, &q_ref), "{imp:?}");
        let (mut a, mut b) = (vec![0; len], vec![0; len]);
        imp.recover_2data(&with_holes(&data, &[0, 254]), &p, &q, &mut a, &mut b);
        assert_eq!((&a, &b), (&data[0], &data[254]), "{imp:?}");
    }
}

//------------------------------------------------------------------------------------------------
// Implementations agree bit for bit

#[test]
fn scalar_and_simd_agree_on_random_data() {
    let Some(avx2) = Implementation::avx2() else {
        eprintln!("SKIP: no AVX2 on this CPU, nothing to compare the scalar implementation with");
        return;
    };
    let scalar = Implementation::scalar();
    let seed = 0x5eed_0002;
    let mut rng = TestRng::new(seed);
    for round in 0..300 {
        let len = rng.below(3000) as usize;
        let data_count = 1 + rng.below(20) as usize;
        let offset = rng.below(64) as usize;
        let data = Blocks::random(&mut rng, data_count, len, offset);
        let ctx = format!("seed {seed:#x} round {round} n {data_count} len {len} offset {offset}");
        let run = |imp: &Implementation| {
            let (mut p, mut q) = (vec![0; len], vec![0; len]);
            imp.pq_gen(&data.get(), &mut p, &mut q);
            let mut x = vec![0; len];
            imp.xor_gen(&data.get(), &mut x);
            let (mut p2, mut q2) = (p.clone(), q.clone());
            let first = data_count / 3;
            imp.pq_xor_syndrome(first, &data.get()[first..], &mut p2, &mut q2);
            let (mut p3, mut q3) = (p.clone(), q.clone());
            let last = data_count - 1;
            imp.pq_update(last, data.get()[0], data.get()[last], &mut p3, &mut q3);
            (p, q, x, p2, q2, p3, q3)
        };
        assert!(run(scalar) == run(avx2), "implementations differ: {ctx}");
    }
}

//------------------------------------------------------------------------------------------------
// Read-modify-write equals full recompute

#[test]
fn pq_update_equals_recompute() {
    let seed = 0x5eed_0003;
    let mut rng = TestRng::new(seed);
    for imp in implementations() {
        for data_count in [2usize, 3, 4, 6, 14] {
            for &len in LENGTHS {
                let mut data = Blocks::random(&mut rng, data_count, len, 0).owned();
                let (mut p, mut q) = ref_pq(&data, len);
                // A sequence of single-block rewrites, each applied incrementally.
                for _ in 0..3 {
                    let index = rng.below(data_count as u64) as usize;
                    let new = rng.bytes(len);
                    imp.pq_update(index, &data[index], &new, &mut p, &mut q);
                    data[index] = new;
                }
                let (p_ref, q_ref) = ref_pq(&data, len);
                let ctx = format!("{imp:?} seed {seed:#x} n {data_count} len {len}");
                assert_eq!(p, p_ref, "P {ctx}");
                assert_eq!(q, q_ref, "Q {ctx}");
            }
        }
    }
}

#[test]
fn pq_xor_syndrome_old_then_new_equals_recompute() {
    let seed = 0x5eed_0004;
    let mut rng = TestRng::new(seed);
    for imp in implementations() {
        for data_count in [2usize, 4, 6, 9] {
            for &len in &[0usize, 5, 64, 200, 4096, 4133] {
                for start in 0..data_count {
                    for stop in start..data_count {
                        let old = Blocks::random(&mut rng, data_count, len, 0).owned();
                        let (mut p, mut q) = ref_pq(&old, len);
                        let mut new = old.clone();
                        for block in &mut new[start..=stop] {
                            *block = rng.bytes(len);
                        }
                        // The kernel's RMW: subtract the old run, add the new run.
                        imp.pq_xor_syndrome(start, &as_refs(&old[start..=stop]), &mut p, &mut q);
                        imp.pq_xor_syndrome(start, &as_refs(&new[start..=stop]), &mut p, &mut q);
                        let (p_ref, q_ref) = ref_pq(&new, len);
                        let ctx = format!("{imp:?} seed {seed:#x} n {data_count} len {len} {start}..={stop}");
                        assert_eq!(p, p_ref, "P {ctx}");
                        assert_eq!(q, q_ref, "Q {ctx}");
                    }
                }
            }
        }
    }
}

#[test]
fn xor_into_read_modify_write_and_single_recovery() {
    let seed = 0x5eed_0005;
    let mut rng = TestRng::new(seed);
    for imp in implementations() {
        for data_count in [1usize, 2, 3, 4, 8] {
            for &len in LENGTHS {
                let mut data = Blocks::random(&mut rng, data_count, len, 0).owned();
                let mut p = vec![0; len];
                imp.xor_gen(&as_refs(&data), &mut p);
                let index = rng.below(data_count as u64) as usize;
                let new = rng.bytes(len);
                imp.xor_into(&mut p, &[&data[index], &new]);
                data[index] = new;
                let (p_ref, _) = ref_pq(&data, len);
                let ctx = format!("{imp:?} seed {seed:#x} n {data_count} len {len}");
                assert_eq!(p, p_ref, "RMW P {ctx}");
                let mut out = garbage_out(&mut rng, len, 0);
                imp.recover_data_from_p(&with_holes(&data, &[index]), &p, &mut out);
                assert_eq!(out, data[index], "recover {index} {ctx}");
            }
        }
    }
}

//------------------------------------------------------------------------------------------------
// Recovery of every pair of missing members, n = 4..8 devices

#[test]
fn recover_every_pair_of_missing_members() {
    let seed = 0x5eed_0006;
    let mut rng = TestRng::new(seed);
    for imp in implementations() {
        for devices in 4..=8usize {
            let data_count = devices - 2;
            for &len in &[0usize, 1, 33, 128, 160, 4096, 4097] {
                let data = Blocks::random(&mut rng, data_count, len, 0).owned();
                let (p, q) = ref_pq(&data, len);
                // Members 0..data_count are data, then P, then Q.
                let member = |i: usize| match i {
                    i if i < data_count => Member::Data(i),
                    i if i == data_count => Member::P,
                    _ => Member::Q,
                };
                let mut failure_sets: Vec<Vec<usize>> = vec![vec![]];
                for a in 0..devices {
                    failure_sets.push(vec![a]);
                    for b in a + 1..devices {
                        failure_sets.push(vec![a, b]);
                    }
                }
                for failed in failure_sets {
                    let members: Vec<Member> = failed.iter().map(|&i| member(i)).collect();
                    let missing_data: Vec<usize> = failed.iter().copied().filter(|&i| i < data_count).collect();
                    let holes = with_holes(&data, &missing_data);
                    let p_in = (!members.contains(&Member::P)).then_some(p.as_slice());
                    let q_in = (!members.contains(&Member::Q)).then_some(q.as_slice());
                    let mut outs: Vec<Vec<u8>> = failed.iter().map(|_| garbage_out(&mut rng, len, 0)).collect();
                    let mut out_refs: Vec<&mut [u8]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
                    let ctx = format!("{imp:?} seed {seed:#x} devices {devices} len {len} lost {members:?}");
                    imp.recover(&holes, p_in, q_in, &mut out_refs).unwrap_or_else(|e| panic!("{ctx}: {e}"));
                    for (out, m) in outs.iter().zip(&members) {
                        let expect = match m {
                            Member::Data(i) => &data[*i],
                            Member::P => &p,
                            Member::Q => &q,
                        };
                        assert_eq!(out, expect, "{m} {ctx}");
                    }
                }
            }
        }
    }
}

#[test]
fn specific_recovery_functions() {
    let seed = 0x5eed_0007;
    let mut rng = TestRng::new(seed);
    for imp in implementations() {
        let (data_count, len) = (6, 4096 + 77);
        let data = Blocks::random(&mut rng, data_count, len, 0).owned();
        let (p, q) = ref_pq(&data, len);
        for x in 0..data_count {
            let holes = with_holes(&data, &[x]);
            let (mut d, mut out_p) = (garbage_out(&mut rng, len, 0), garbage_out(&mut rng, len, 0));
            imp.recover_datap(&holes, &q, &mut d, &mut out_p);
            assert_eq!((&d, &out_p), (&data[x], &p), "{imp:?} datap {x}");
            let (mut d, mut out_q) = (garbage_out(&mut rng, len, 0), garbage_out(&mut rng, len, 0));
            imp.recover_dataq(&holes, &p, &mut d, &mut out_q);
            assert_eq!((&d, &out_q), (&data[x], &q), "{imp:?} dataq {x}");
            for y in x + 1..data_count {
                let holes = with_holes(&data, &[x, y]);
                let (mut a, mut b) = (garbage_out(&mut rng, len, 0), garbage_out(&mut rng, len, 0));
                imp.recover_2data(&holes, &p, &q, &mut a, &mut b);
                assert_eq!((&a, &b), (&data[x], &data[y]), "{imp:?} 2data {x} {y}");
            }
        }
    }
}

#[test]
fn recover_refuses_three_missing() {
    let data = [vec![1u8; 64], vec![2u8; 64], vec![3u8; 64]];
    let holes = with_holes(&data, &[0, 2]);
    let q = vec![0u8; 64];
    let mut outs = [vec![0u8; 64], vec![0u8; 64], vec![0u8; 64]];
    let mut out_refs: Vec<&mut [u8]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
    let err = mdkit_parity::recover(&holes, None, Some(&q), &mut out_refs).unwrap_err();
    assert_eq!(err, RecoverError::TooManyMissing { missing: vec![Member::Data(0), Member::Data(2), Member::P] });
    assert_eq!(err.to_string(), "3 members missing (data 0, data 2, P); RAID6 can rebuild at most 2");
}

//------------------------------------------------------------------------------------------------
// Scrub: which member is wrong

#[test]
fn check_names_the_single_wrong_member() {
    let seed = 0x5eed_0008;
    let mut rng = TestRng::new(seed);
    for imp in implementations() {
        for data_count in [2usize, 3, 6, 14] {
            for &len in &[1usize, 31, 128, 4096, 4096 * 3 + 5] {
                let data = Blocks::random(&mut rng, data_count, len, 0).owned();
                let (p, q) = ref_pq(&data, len);
                let ctx = format!("{imp:?} seed {seed:#x} n {data_count} len {len}");
                assert_eq!(imp.pq_check(&as_refs(&data), &p, &q), PqCheck::Consistent, "{ctx}");
                for target in 0..data_count + 2 {
                    // Corrupt 1..4 byte positions of one member with non-zero errors.
                    let (mut d2, mut p2, mut q2) = (data.clone(), p.clone(), q.clone());
                    let block = match target {
                        t if t < data_count => &mut d2[t],
                        t if t == data_count => &mut p2,
                        _ => &mut q2,
                    };
                    for _ in 0..1 + rng.below(4) {
                        let at = rng.below(len as u64) as usize;
                        block[at] ^= 1 + rng.below(255) as u8;
                    }
                    let expect = match target {
                        t if t < data_count => PqCheck::WrongData { index: t },
                        t if t == data_count => PqCheck::WrongP,
                        _ => PqCheck::WrongQ,
                    };
                    assert_eq!(imp.pq_check(&as_refs(&d2), &p2, &q2), expect, "target {target} {ctx}");
                }
            }
        }
    }
}

#[test]
fn check_reports_more_than_one_wrong() {
    let seed = 0x5eed_0009;
    let mut rng = TestRng::new(seed);
    for imp in implementations() {
        let (data_count, len) = (5usize, 8192 + 9);
        let data = Blocks::random(&mut rng, data_count, len, 0).owned();
        let (p, q) = ref_pq(&data, len);
        // Two members wrong at different byte positions (also across the 4 KiB pass boundary):
        // the positions blame different members.
        for (a, b) in [(0usize, 1usize), (0, 5), (2, 6), (5, 6), (4, 3)] {
            let (mut d2, mut p2, mut q2) = (data.clone(), p.clone(), q.clone());
            for (member, at) in [(a, 10usize), (b, 4096 + 10)] {
                let block = match member {
                    m if m < data_count => &mut d2[m],
                    m if m == data_count => &mut p2,
                    _ => &mut q2,
                };
                block[at] ^= 0x5a;
            }
            assert_eq!(imp.pq_check(&as_refs(&d2), &p2, &q2), PqCheck::MultipleWrong, "{imp:?} {a} {b}");
        }
        // P and Q both off at one position in a way that points at data index 7, which does not
        // exist with 5 data blocks: Pd = e, Qd = g^7·e.
        let (mut p2, mut q2) = (p.clone(), q.clone());
        p2[100] ^= 0x33;
        q2[100] ^= gf::mul(gf::EXP[7], 0x33);
        assert_eq!(imp.pq_check(&as_refs(&data), &p2, &q2), PqCheck::MultipleWrong, "{imp:?} index 7");
        // Same construction pointing at index 3, which exists: indistinguishable from D_3 wrong.
        let (mut p3, mut q3) = (p.clone(), q.clone());
        p3[100] ^= 0x33;
        q3[100] ^= gf::mul(gf::EXP[3], 0x33);
        assert_eq!(imp.pq_check(&as_refs(&data), &p3, &q3), PqCheck::WrongData { index: 3 }, "{imp:?}");
    }
}

//------------------------------------------------------------------------------------------------
// Caller bugs are loud

#[test]
#[should_panic(expected = "data block 1 is 63 bytes, expected 64")]
fn length_mismatch_panics_with_the_block_named() {
    let (a, b) = (vec![0u8; 64], vec![0u8; 63]);
    let (mut p, mut q) = (vec![0u8; 64], vec![0u8; 64]);
    mdkit_parity::pq_gen(&[&a, &b], &mut p, &mut q);
}

#[test]
#[should_panic(expected = "needs exactly 2 missing (None) data block(s), found 1")]
fn recover_2data_requires_two_holes() {
    let data = [vec![1u8; 32], vec![2u8; 32]];
    let holes = with_holes(&data, &[1]);
    let (p, q) = (vec![0u8; 32], vec![0u8; 32]);
    let (mut a, mut b) = (vec![0u8; 32], vec![0u8; 32]);
    mdkit_parity::recover_2data(&holes, &p, &q, &mut a, &mut b);
}
