//! Md bitmap superblock decoder, bit geometry, examine-bitmap and the bad-block log codec.
//! The harness (what the input means, what must hold) is `mdkit_md::fuzzing::bitmap`;
//! the default suite replays the committed corpus through it (crates/*/tests/fuzz_corpus.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    mdkit_md::fuzzing::bitmap(data);
});
