//! Crash consistency at the metadata level, on the crash-recording device from mdkit-io: the
//! engine runs over `DeviceMetaIo` on a `CrashDevice`; afterwards, at every flush point (and at
//! sampled other points) and under every volatile-write policy (kept, lost, random subset,
//! torn sectors), the image must open, pass mdkit's check (and thin_check on a sample), and
//! hold exactly the last committed state (or the one being committed, if its superblock write
//! had been issued).

use crate::common;

use std::sync::Arc;

use common::*;
use mdkit_io::{CrashGroup, CrashPoint, CrashPolicy, DeviceRef, MemDevice, Rng};
use mdkit_thin::meta::{
    CheckOptions, DeviceMetaIo, FormatOptions, MemMetaIo, MetaIo, OpenOptions, ThinMetadata, check,
};

struct Commit {
    started: CrashPoint,
    finished: CrashPoint,
    model: Model,
}

#[test]
fn every_flush_point_holds_the_last_commit() {
    let seed = 0xc4a5_0001u64;
    eprintln!("seed {seed:#x}");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let group = CrashGroup::new();
    let meta_bytes = 2048 * 4096u64;
    let dev: DeviceRef = Arc::new(group.wrap("meta", MemDevice::new("meta", meta_bytes)));
    let io: Arc<dyn MetaIo> = Arc::new(DeviceMetaIo::new(dev, rt.handle().clone()));

    let started = group.now();
    // A small write-back threshold: transactions also write blocks out early, between
    // commits, which must not disturb the last commit either.
    let mut md = ThinMetadata::format_with(
        io.clone(),
        FormatOptions { data_block_size_sectors: 128, nr_data_blocks: 20_000, metadata_nr_blocks: None },
        OpenOptions { writeback_threshold_blocks: 32, ..Default::default() },
    )
    .unwrap();
    let mut commits = vec![Commit { started, finished: group.now(), model: Model::default() }];
    let mut model = Model::default();
    let mut rng = Rng::new(seed);
    for _ in 0..12 {
        for _ in 0..(100 + rng.below(300)) {
            random_op(&mut md, &mut model, &mut rng, 6, 1500);
        }
        let started = group.now();
        md.commit().unwrap();
        commits.push(Commit { started, finished: group.now(), model: model.clone() });
    }
    drop(md);

    let mut points = group.flush_points();
    // Plus a sample of arbitrary points (inside write bursts).
    let all = group.points();
    for i in (0..all.len()).step_by((all.len() / 40).max(1)) {
        points.push(all[i]);
    }
    points.sort();
    points.dedup();
    let mut checked = 0;
    let mut tool_checked = 0;
    for (pi, &p) in points.iter().enumerate() {
        if p < commits[0].finished {
            continue; // before the pool existed
        }
        let last_done = commits.iter().rposition(|c| c.finished <= p).expect("format finished before p");
        let mut acceptable = vec![&commits[last_done].model];
        if let Some(next) = commits.get(last_done + 1)
            && next.started < p
        {
            acceptable.push(&next.model);
        }
        for (ci, policy) in CrashPolicy::ALL.into_iter().enumerate() {
            let mut rng = Rng::new(seed ^ (pi as u64) << 8 ^ ci as u64);
            let images = group.image_at(p, &mut rng, policy).unwrap();
            let image = images[0].to_image();
            let mio: Arc<dyn MetaIo> = Arc::new(MemMetaIo::from_image(format!("crash@{}-{policy:?}", p.0), &image));
            let what = format!("{p} {policy:?} ({})", group.describe(p));
            let md = ThinMetadata::open(mio.clone()).unwrap_or_else(|e| panic!("{what}: open failed: {e}"));
            let got = model_of(&md);
            assert!(acceptable.iter().any(|m| **m == got), "{what}: state is not the last commit");
            let r = check(&*mio, &CheckOptions::default());
            assert!(r.is_clean(), "{what}:\n{r}");
            checked += 1;
            if pi % 9 == 0 && policy == CrashPolicy::RandomTear {
                let (path, _) = meta_file("crash-image.meta", 0);
                std::fs::write(&path, &image).unwrap();
                assert_thin_check_clean(&path, &what);
                tool_checked += 1;
            }
        }
    }
    eprintln!("{checked} crash images checked ({tool_checked} also with thin_check), {} commits", commits.len());
    assert!(checked > 100);
}
