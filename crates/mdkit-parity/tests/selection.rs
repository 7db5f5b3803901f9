//! Run-time selection of the implementation: observable and overridable. Its own test binary
//! because the selection is process-wide.

use mdkit_parity::{Implementation, SelectError};

#[test]
fn selection_is_observable_and_overridable() {
    let best = Implementation::best().name();
    // Unless the environment overrides it, the first use picks the best implementation.
    match std::env::var(mdkit_parity::IMPLEMENTATION_ENV) {
        Ok(name) if !name.is_empty() => {
            eprintln!("note: {}={name}", mdkit_parity::IMPLEMENTATION_ENV)
        }
        _ => assert_eq!(mdkit_parity::implementation_name(), best),
    }
    if cfg!(target_arch = "x86_64") && std::is_x86_feature_detected!("avx2") {
        assert_eq!(best, "avx2");
    }

    mdkit_parity::set_implementation(Implementation::scalar());
    assert_eq!(mdkit_parity::implementation_name(), "scalar");
    let (a, b) = (vec![3u8; 100], vec![5u8; 100]);
    let mut p = vec![0u8; 100];
    mdkit_parity::xor_gen(&[&a, &b], &mut p);
    assert!(p.iter().all(|&x| x == 6));

    for imp in Implementation::available() {
        let chosen = mdkit_parity::set_implementation_by_name(imp.name()).expect("available");
        assert_eq!(chosen.name(), imp.name());
        assert_eq!(mdkit_parity::implementation_name(), imp.name());
    }

    assert!(matches!(mdkit_parity::set_implementation_by_name("sse9"), Err(SelectError::Unknown { .. })));
    assert!(!Implementation::available().is_empty());
}

/// `MDKIT_PARITY_IMPL` decides the first selection: the test re-runs itself as a child process
/// with the variable set (the selection is per process).
#[test]
fn environment_override_applies_at_first_use() {
    const CHILD_MARKER: &str = "MDKIT_PARITY_SELECTION_CHILD";
    if let Some(expected) = std::env::var_os(CHILD_MARKER) {
        assert_eq!(mdkit_parity::implementation_name(), expected.to_string_lossy());
        return;
    }
    let exe = std::env::current_exe().expect("test binary path");
    for (value, expected) in [("scalar", "scalar"), ("no-such-impl", Implementation::best().name())] {
        let out = std::process::Command::new(&exe)
            .args(["--exact", "selection::environment_override_applies_at_first_use", "--nocapture"])
            .env(mdkit_parity::IMPLEMENTATION_ENV, value)
            .env(CHILD_MARKER, expected)
            .output()
            .expect("re-run the test binary");
        assert!(
            out.status.success(),
            "{}={value}: child failed:\n{}\n{}",
            mdkit_parity::IMPLEMENTATION_ENV,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if value == "no-such-impl" {
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(stderr.contains("unknown parity implementation"), "warning expected: {stderr}");
        }
    }
}
