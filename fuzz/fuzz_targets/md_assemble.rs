//! Multi-member md assembly over damaged superblocks and bitmaps.
//! The harness (what the input means, what must hold) is `mdkit_md::fuzzing::assemble`;
//! the default suite replays the committed corpus through it (crates/*/tests/fuzz_corpus.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    mdkit_md::fuzzing::assemble(data);
});
