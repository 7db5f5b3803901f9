//! The committed fuzz corpus of this crate's targets, replayed (fuzz/corpus_replay.rs).

use mdkit_thin::fuzzing;
use mdkit_thin::meta::{parse_xml, validate_node};

use crate::corpus_replay::replay;

#[test]
fn thin_node_corpus() {
    let seeds = replay("thin_node", fuzzing::node);
    assert!(seeds >= fuzzing::seed_nodes().len(), "the thin_node seeds are committed");
}

#[test]
fn thin_metadata_corpus() {
    let seeds = replay("thin_metadata", fuzzing::metadata);
    assert!(seeds >= fuzzing::seed_metadata_edits().len(), "the thin_metadata seeds are committed");
}

#[test]
fn thin_xml_corpus() {
    let seeds = replay("thin_xml", fuzzing::xml);
    assert!(seeds >= fuzzing::seed_xml().len(), "the thin_xml seeds are committed");
}

/// The seeds reach past the first checks: btree nodes validate, the XML dumps parse, and the
/// metadata edits run the engine.
#[test]
fn thin_seeds_reach_the_decoders() {
    let nodes = fuzzing::seed_nodes();
    assert!(nodes.iter().filter(|b| validate_node(b.as_slice().try_into().unwrap()).is_ok()).count() >= 2);
    for x in fuzzing::seed_xml() {
        assert!(parse_xml(std::str::from_utf8(&x).unwrap()).is_ok());
        fuzzing::xml(&x);
    }
    for e in fuzzing::seed_metadata_edits() {
        fuzzing::metadata(&e);
    }
}

/// Regenerates the committed seeds of thin_node, thin_metadata and thin_xml:
/// `cargo test --profile suite -p mdkit-thin --test suite write_thin_seed_corpus -- --ignored`.
#[test]
#[ignore = "writes fuzz/corpus; run by hand when the seeds change"]
fn write_thin_seed_corpus() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    let targets = [
        ("thin_node", fuzzing::seed_nodes()),
        ("thin_metadata", fuzzing::seed_metadata_edits()),
        ("thin_xml", fuzzing::seed_xml()),
    ];
    for (target, seeds) in targets {
        let dir = root.join(target);
        std::fs::create_dir_all(&dir).unwrap();
        for (i, seed) in seeds.iter().enumerate() {
            std::fs::write(dir.join(format!("seed-{i}")), seed).unwrap();
        }
    }
}
