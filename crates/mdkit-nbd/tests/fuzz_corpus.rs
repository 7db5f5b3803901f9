//! The committed fuzz corpus of this crate's targets, replayed (fuzz/corpus_replay.rs).

use mdkit_nbd::fuzzing;

use crate::corpus_replay::replay;

#[test]
fn nbd_handshake_corpus() {
    let seeds = replay("nbd_handshake", |d| {
        // The server always greets first (18 bytes), whatever the client sent.
        assert!(fuzzing::handshake(d).reply_bytes >= 18);
    });
    assert!(seeds >= fuzzing::seed_handshakes().len(), "the nbd_handshake seeds are committed");
}

#[test]
fn nbd_requests_corpus() {
    let seeds = replay("nbd_requests", |d| {
        let _ = fuzzing::requests(d);
    });
    assert!(seeds >= fuzzing::seed_requests().len(), "the nbd_requests seeds are committed");
}
