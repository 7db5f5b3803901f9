//! `mdkit`: the service (`mdkit serve`) and its command-line client.
//!
//! Layout: `cli/` one module per verb group; `config.rs` the TOML format; `volumes/` one file
//! per volume kind; `control/` the control socket and one module per command group;
//! `service.rs` start-up and shutdown.

mod cli;
mod config;
mod control;
mod service;
mod volumes;

use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    let default_level = if matches!(cli.command, cli::Command::Serve(_)) { "info" } else { "warn" };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).init();
    match cli::run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("mdkit: {e:#}");
            ExitCode::FAILURE
        }
    }
}
