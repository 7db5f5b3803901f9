//! Helpers shared by the mdkit-md integration tests: a seeded RNG, member image files, host
//! tool checks and the kernel lab runner ([`lab`]).
#![allow(dead_code)] // each test binary uses a different subset

pub mod images;
pub mod lab;
pub mod verify;

/// SplitMix64: deterministic, seedable, owned here so seeds reproduce across versions.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, bound)`; `bound > 0`.
    pub fn below(&mut self, bound: u64) -> u64 {
        assert!(bound > 0);
        ((u128::from(self.next_u64()) * u128::from(bound)) >> 64) as u64
    }

    pub fn fill(&mut self, out: &mut [u8]) {
        for chunk in out.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// The seed for randomized tests: `MDKIT_TEST_SEED` or a fixed default, printed so a failure
/// can be replayed.
pub fn test_seed(test: &str) -> u64 {
    let seed = std::env::var("MDKIT_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x006d_646b_6974);
    eprintln!("{test}: seed {seed} (replay with MDKIT_TEST_SEED={seed})");
    seed
}

/// Fails the test with a message naming the tool and `scripts/test` when a host tool is
/// missing (DEVELOPING.md: host-tool tests fail, they do not skip).
pub fn require_tool(tool: &str) {
    let found = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    assert!(found, "host tool `{tool}` is missing: install it (scripts/test installs every tool the suite needs)");
}
