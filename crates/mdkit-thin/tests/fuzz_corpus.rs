//! The committed fuzz corpus of this crate's targets, replayed (fuzz/corpus_replay.rs).

use mdkit_thin::fuzzing;

use crate::corpus_replay::replay;

#[test]
fn thin_node_corpus() {
    replay("thin_node", fuzzing::node);
}

#[test]
fn thin_metadata_corpus() {
    replay("thin_metadata", fuzzing::metadata);
}

#[test]
fn thin_xml_corpus() {
    replay("thin_xml", fuzzing::xml);
}
