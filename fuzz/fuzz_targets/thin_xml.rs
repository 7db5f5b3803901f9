//! thin_dump XML parser and thin_restore: arbitrary text must never panic; small documents
//! that parse are restored into a RAM metadata device (errors are fine).
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use mdkit_thin::meta::{MemMetaIo, MetaIo, OpenOptions, parse_xml, restore_xml};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(x) = parse_xml(text) else { return };
    let total: u64 = x.devices.iter().flat_map(|d| d.mappings.iter()).map(|m| m.length.min(1 << 20)).sum();
    if total > 10_000 || x.nr_data_blocks > 1 << 24 {
        return; // bounded work per input
    }
    let io: Arc<dyn MetaIo> = Arc::new(MemMetaIo::new("xml", 512));
    let _ = restore_xml(io, &x, OpenOptions::default());
});
