//! NBD fixed-newstyle handshake and option parser: arbitrary client bytes (from the client
//! flags on) must never panic or hang; the server answers or hangs up.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let outcome = mdkit_nbd::fuzzing::handshake(data);
    // The server always greets first (18 bytes) and replies only to what it was sent.
    assert!(outcome.reply_bytes >= 18);
});
