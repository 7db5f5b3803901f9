//! Btree operations against a BTreeMap model, with every invariant checked after each step.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use mdkit_io::Rng;

use super::*;
use crate::meta::cache::BlockCache;
use crate::meta::io::MemMetaIo;
use crate::meta::msm::MetadataSm;

fn new_tm(nr_blocks: u64) -> Tm {
    let io = Arc::new(MemMetaIo::new("mem", nr_blocks));
    let mut msm = MetadataSm::new(nr_blocks);
    msm.claim(0);
    Tm::new(io, Arc::new(BlockCache::new(1024)), msm)
}

/// Counts references below `root` and checks node invariants; returns entries.
fn check_tree(tm: &Tm, root: u64, vs: usize, refs: &mut HashMap<u64, u32>) -> BTreeMap<u64, Vec<u8>> {
    #[allow(clippy::too_many_arguments)]
    fn rec(
        tm: &Tm,
        b: u64,
        vs: usize,
        lo: u64,
        hi: Option<u64>,
        is_root: bool,
        refs: &mut HashMap<u64, u32>,
        out: &mut BTreeMap<u64, Vec<u8>>,
    ) {
        let first = {
            let c = refs.entry(b).or_insert(0);
            *c += 1;
            *c == 1
        };
        if !first {
            return;
        }
        let blk = tm.read(b, BlockKind::Node).unwrap();
        validate_node(&blk).unwrap();
        let n = NodeView::new(&blk);
        let nr = n.nr_entries() as usize;
        if !is_root {
            assert!(nr as u32 >= n.max_entries() / 3, "node {b} has {nr} entries");
        }
        if nr > 0 {
            assert!(n.key(0) >= lo, "node {b} first key {} below {lo}", n.key(0));
            if let Some(hi) = hi {
                assert!(n.key(nr - 1) < hi);
            }
        }
        if n.is_leaf() {
            assert_eq!(n.value_size() as usize, vs);
            for i in 0..nr {
                out.insert(n.key(i), n.value(i).to_vec());
            }
        } else {
            for i in 0..nr {
                let h = if i + 1 < nr { Some(n.key(i + 1)) } else { hi };
                rec(tm, n.value_u64(i), vs, n.key(i), h, false, refs, out);
            }
        }
    }
    let mut out = BTreeMap::new();
    rec(tm, root, vs, 0, None, true, refs, &mut out);
    out
}

fn assert_counts(tm: &Tm, refs: &HashMap<u64, u32>) {
    for (&b, &c) in refs {
        assert_eq!(tm.ref_count(b), c, "block {b}");
    }
    let allocated: u64 = tm.msm.allocated_blocks().filter(|(b, _)| *b != 0).count() as u64;
    assert_eq!(allocated, refs.len() as u64, "leaked or missing blocks");
}

#[test]
fn random_insert_remove_matches_model_and_keeps_invariants() {
    let mut tm = new_tm(20_000);
    let mut rng = Rng::new(7);
    let mut root = empty(&mut tm, 8).unwrap();
    let mut model = BTreeMap::new();
    for step in 0..30_000u64 {
        let key = rng.below(5000) * 3;
        if rng.chance(3, 5) {
            let v = step.to_le_bytes();
            let (r, old) = insert(&mut tm, &mut NoRc, root, key, &v).unwrap();
            root = r;
            assert_eq!(old.map(|o| o.as_u64()), model.insert(key, step));
        } else {
            let (r, old) = remove(&mut tm, &mut NoRc, root, key).unwrap();
            root = r;
            assert_eq!(old.map(|o| o.as_u64()), model.remove(&key));
        }
        if step % 5000 == 4999 {
            let mut refs = HashMap::new();
            let got = check_tree(&tm, root, 8, &mut refs);
            assert_eq!(got.len(), model.len());
            for (k, v) in &model {
                assert_eq!(get_u64(&got[k], 0), *v);
                assert_eq!(lookup(&tm, root, *k, 8, ReadMode::MayRead).unwrap().unwrap().as_u64(), *v);
            }
            assert_counts(&tm, &refs);
        }
    }
    // Remove everything in ranges.
    let (r, n) = remove_range(&mut tm, &mut NoRc, root, 8, 0, 7000, &mut |_, _| {}).unwrap();
    root = r;
    let expect = model.range(0..7000).count() as u64;
    assert_eq!(n, expect);
    model.retain(|k, _| *k >= 7000);
    let mut refs = HashMap::new();
    let got = check_tree(&tm, root, 8, &mut refs);
    assert_eq!(got.keys().copied().collect::<Vec<_>>(), model.keys().copied().collect::<Vec<_>>());
    assert_counts(&tm, &refs);
    let (r, _) = remove_range(&mut tm, &mut NoRc, root, 8, 0, u64::MAX, &mut |_, _| {}).unwrap();
    let mut refs = HashMap::new();
    assert!(check_tree(&tm, r, 8, &mut refs).is_empty());
    assert_counts(&tm, &refs);
}

#[test]
fn sequential_and_reverse_inserts_split_cleanly() {
    let mut tm = new_tm(5000);
    for keys in [(0..20_000u64).collect::<Vec<_>>(), (0..20_000u64).rev().collect()] {
        let mut root = empty(&mut tm, 24).unwrap();
        for &k in &keys {
            root = insert(&mut tm, &mut NoRc, root, k, &[k as u8; 24]).unwrap().0;
        }
        let mut refs = HashMap::new();
        assert_eq!(check_tree(&tm, root, 24, &mut refs).len(), 20_000);
        assert_eq!(lookup_ge(&tm, root, 19_999, 24).unwrap().unwrap().0, 19_999);
        assert_eq!(lookup_ge(&tm, root, 20_000, 24).unwrap(), None);
        assert_eq!(last_key(&tm, root).unwrap(), Some(19_999));
        del(&mut tm, &mut NoRc, root).unwrap();
        assert_counts(&tm, &HashMap::new());
    }
}

#[test]
fn shared_subtrees_copy_on_write_with_refcounts() {
    let mut tm = new_tm(5000);
    let mut a = empty(&mut tm, 8).unwrap();
    for k in 0..3000u64 {
        a = insert(&mut tm, &mut NoRc, a, k, &k.to_le_bytes()).unwrap().0;
    }
    tm.commit(&mut [0u8; 4096]).unwrap();
    // Snapshot: share the whole tree.
    tm.inc(a).unwrap();
    let mut b = a;
    for k in (0..3000u64).step_by(7) {
        b = insert(&mut tm, &mut NoRc, b, k, &(k + 1_000_000).to_le_bytes()).unwrap().0;
    }
    for k in (1..3000u64).step_by(11) {
        b = remove(&mut tm, &mut NoRc, b, k).unwrap().0;
    }
    let mut refs = HashMap::new();
    let ta = check_tree(&tm, a, 8, &mut refs);
    let tb = check_tree(&tm, b, 8, &mut refs);
    assert_eq!(ta.len(), 3000);
    assert!(ta.iter().all(|(k, v)| get_u64(v, 0) == *k), "origin unchanged");
    assert_eq!(get_u64(&tb[&7], 0), 1_000_007);
    assert!(!tb.contains_key(&12));
    assert_counts(&tm, &refs);
    del(&mut tm, &mut NoRc, a).unwrap();
    let mut refs = HashMap::new();
    check_tree(&tm, b, 8, &mut refs);
    assert_counts(&tm, &refs);
}
