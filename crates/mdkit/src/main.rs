//! `mdkit`: the service (`mdkit serve`) and its command-line client.
//!
//! Layout: `cli/` one module per verb group; `config.rs` the TOML format; `volumes/` one file
//! per volume kind; `control/` the control socket and one module per command group;
//! `service.rs` start-up and shutdown.

mod cli;
mod config;
mod control;
mod events;
mod metrics;
mod metrics_config;
mod metrics_http;
mod metrics_latency;
mod notify;
mod service;
mod volumes;

use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    // CLI output into a closed pipe (`mdkit examine M | head -1`) ends the process quietly, as
    // for any Unix filter, instead of a panic in println!. `mdkit serve` ignores SIGPIPE again
    // before it opens any socket; the control client sends with MSG_NOSIGNAL.
    default_sigpipe();
    let cli = cli::Cli::parse();
    let default_level = if matches!(cli.command, cli::Command::Serve(_)) { "info" } else { "warn" };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    // Colours only for a person at a terminal: not into files, pipes or journald
    // (systemd sets JOURNAL_STREAM when stderr is the journal).
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("JOURNAL_STREAM").is_none();
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).init();
    match cli::run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("mdkit: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// SIGPIPE terminates the process (the Rust runtime ignores it by default).
fn default_sigpipe() {
    // SAFETY: signal(2) with a valid signal number and SIG_DFL; called before any thread starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}

/// SIGPIPE is ignored: writes to a closed socket or pipe fail with EPIPE.
pub fn ignore_sigpipe() {
    // SAFETY: signal(2) with a valid signal number and SIG_IGN.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
}
