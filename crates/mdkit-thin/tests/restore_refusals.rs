//! A refused restore leaves the output device as it was. The restore used to format the device
//! first and find a bad mapping while writing, leaving a valid pool with no devices where the
//! old metadata had been (thin_check passed, the pool would open empty). Now every check the
//! restore makes while writing runs before it writes anything; a failure only writing can find
//! (an I/O error, here) leaves the superblock cleared, never a valid pool.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use common::*;
use mdkit_thin::meta::{
    CheckOptions, MemMetaIo, MetaError, MetaIo, OpenOptions, ThinMetadata, XmlDevice, XmlMapping, XmlMetadata, check,
    restore_xml,
};

const META_BLOCKS: u64 = 1024;

fn good_xml() -> XmlMetadata {
    let run = |origin_begin, data_begin, length| XmlMapping { origin_begin, data_begin, length, time: 0 };
    let dev = |dev_id, mappings: Vec<XmlMapping>| XmlDevice {
        dev_id,
        mapped_blocks: mappings.iter().map(|m| m.length).sum(),
        transaction: 0,
        creation_time: 0,
        snap_time: 0,
        mappings,
    };
    XmlMetadata {
        uuid: String::new(),
        time: 1,
        transaction: 7,
        flags: 0,
        version: 2,
        data_block_size: 128,
        nr_data_blocks: 100,
        metadata_snap: None,
        devices: vec![dev(0, vec![run(0, 0, 10), run(20, 50, 5)]), dev(3, vec![run(0, 0, 10)])],
    }
}

/// Each semantic error the restore knows, as a change to the good XML.
fn bad_cases() -> Vec<(&'static str, XmlMetadata)> {
    let mut cases = Vec::new();
    let mut case = |name, f: &dyn Fn(&mut XmlMetadata)| {
        let mut x = good_xml();
        f(&mut x);
        cases.push((name, x));
    };
    case("unsupported version", &|x| x.version = 3);
    case("data block size not a multiple of 64 KiB", &|x| x.data_block_size = 100);
    case("data blocks beyond 2^40", &|x| x.nr_data_blocks = (1 << 40) + 1);
    case("data device too big for the metadata device", &|x| x.nr_data_blocks = 1 << 30);
    case("device id beyond 24 bits", &|x| x.devices[1].dev_id = 1 << 24);
    case("device listed twice", &|x| x.devices[1].dev_id = 0);
    case("mapping beyond the data blocks", &|x| x.devices[1].mappings[0].data_begin = 95);
    case("data run overflows", &|x| x.devices[1].mappings[0].data_begin = u64::MAX - 2);
    case("virtual run overflows", &|x| x.devices[1].mappings[0].origin_begin = u64::MAX - 2);
    case("mapping time beyond 24 bits", &|x| x.devices[0].mappings[1].time = 1 << 24);
    case("block mapped twice", &|x| x.devices[0].mappings[1].origin_begin = 9);
    case("mapped_blocks disagrees", &|x| x.devices[0].mapped_blocks = 14);
    case("more mappings than the metadata can hold", &|x| {
        x.nr_data_blocks = 1 << 22;
        x.devices[0].mappings[1].length = (1 << 22) - 50;
        x.devices[0].mapped_blocks = 10 + (1 << 22) - 50;
    });
    cases
}

#[test]
fn a_refused_restore_leaves_the_device_byte_identical() {
    let mem = Arc::new(MemMetaIo::new("restore.meta", META_BLOCKS));
    let io: Arc<dyn MetaIo> = mem.clone();
    drop(restore_xml(io.clone(), &good_xml(), OpenOptions::default()).unwrap());
    let before = mem.to_image();
    for (name, x) in bad_cases() {
        let e = match restore_xml(io.clone(), &x, OpenOptions::default()) {
            Ok(_) => panic!("{name}: restored"),
            Err(e) => e,
        };
        eprintln!("{name}: {e}");
        assert!(matches!(e, MetaError::InvalidArgument(_)), "{name}: {e}");
        assert!(mem.to_image() == before, "{name}: the refused restore changed the device");
    }
    let md = ThinMetadata::open(io.clone()).unwrap();
    assert_eq!(md.devices(), vec![0, 3], "the old metadata is still there");
    assert_eq!(md.transaction_id(), 7);
}

#[test]
fn a_restore_failing_while_writing_leaves_no_pool() {
    let mem = Arc::new(MemMetaIo::new("restore-io.meta", META_BLOCKS));
    let io: Arc<dyn MetaIo> = mem.clone();
    drop(restore_xml(io.clone(), &good_xml(), OpenOptions::default()).unwrap());
    // Fail the second write: the first one clears the superblock.
    let calls = Arc::new(AtomicU64::new(0));
    let c = calls.clone();
    mem.set_hook(Some(Box::new(move |w| {
        if w.is_some() && c.fetch_add(1, Ordering::SeqCst) == 1 {
            return Err(std::io::Error::other("injected write error"));
        }
        Ok(())
    })));
    let e = match restore_xml(io.clone(), &good_xml(), OpenOptions::default()) {
        Ok(_) => panic!("restored through a failing write"),
        Err(e) => e,
    };
    mem.set_hook(None);
    eprintln!("{e}");
    assert!(matches!(e, MetaError::RestoreIncomplete { .. }), "{e}");
    assert!(e.to_string().contains("superblock is cleared"), "{e}");
    assert!(ThinMetadata::open(io.clone()).is_err(), "no pool opens from a failed restore");
    let r = check(&*io, &CheckOptions::default());
    assert!(!r.is_clean(), "check must not pass a failed restore:\n{r}");
}

#[test]
fn a_refused_restore_to_a_file_passes_thin_check_as_before() {
    let (path, io) = meta_file("restore-refused.meta", META_BLOCKS * 4096);
    drop(restore_xml(io.clone(), &good_xml(), OpenOptions::default()).unwrap());
    let before = std::fs::read(&path).unwrap();
    let mut x = good_xml();
    x.devices[1].mappings[0].data_begin = 95;
    assert!(restore_xml(io.clone(), &x, OpenOptions::default()).is_err());
    assert!(std::fs::read(&path).unwrap() == before, "the refused restore changed the file");
    assert_thin_check_clean(&path, "metadata kept by a refused restore");
}
