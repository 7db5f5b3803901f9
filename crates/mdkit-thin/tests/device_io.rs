//! The metadata engine over a real member backend: `DeviceMetaIo` on mdkit-io's io_uring
//! `FileDevice` (O_DIRECT), driven from a plain thread while the runtime serves the I/O, as
//! the pool runtime's metadata worker will. thin_check must accept the result.

use crate::common;

use std::sync::Arc;

use common::*;
use mdkit_io::{DeviceRef, FileDevice, FileOptions, Rng};
use mdkit_thin::meta::{DeviceMetaIo, FormatOptions, MetaIo, ThinMetadata};

#[test]
fn engine_over_io_uring_file_device_passes_thin_check() {
    let path = tool_dir().join("device-io.meta");
    let _ = std::fs::remove_file(&path);
    FileDevice::create_sparse(&path, 8 << 20).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let dev: DeviceRef = Arc::new(rt.block_on(async { FileDevice::open(&path, FileOptions::default()) }).unwrap());
    let io: Arc<dyn MetaIo> = Arc::new(DeviceMetaIo::new(dev, rt.handle().clone()));
    let mut md = ThinMetadata::format(
        io.clone(),
        FormatOptions { data_block_size_sectors: 128, nr_data_blocks: 50_000, metadata_nr_blocks: None },
    )
    .unwrap();
    let mut model = Model::default();
    let mut rng = Rng::new(21);
    for _ in 0..3 {
        for _ in 0..2000 {
            random_op(&mut md, &mut model, &mut rng, 5, 8000);
        }
        md.commit().unwrap();
    }
    drop(md);
    let md = ThinMetadata::open(io).unwrap();
    assert_matches(&md, &model, "reopened over FileDevice");
    drop(md);
    assert_thin_check_clean(&path, "written through FileDevice");
    assert_dump_matches(&path, &model, "written through FileDevice");
}
