//! The whole dm-thin metadata engine and checker over a damaged pool.
//! The harness (what the input means, what must hold) is `mdkit_thin::fuzzing::metadata`;
//! the default suite replays the committed corpus through it (crates/*/tests/fuzz_corpus.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    mdkit_thin::fuzzing::metadata(data);
});
