//! NBD transmission phase: an arbitrary request stream (first byte: structured replies, block
//! sizes committed, read-only) against a 1 MiB RAM export must never panic or hang, and
//! whatever the headers announce, no payload beyond the server's limits is allocated.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = mdkit_nbd::fuzzing::requests(data);
});
