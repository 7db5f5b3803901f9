//! The `mdkit` command line: one module per verb group.
//!
//! Adding a verb group (e.g. the md verbs `create`, `assemble`, `examine`, `detail`, `stop`, or
//! `mdkit thin ...`): write `cli/<group>.rs` with a clap `Args`/`Subcommand` type and a
//! `run(args) -> Result<ExitCode>`, add a variant to [`Command`] and a line to [`run`]. Verbs
//! that talk to a running service take [`ControlArgs`] (flattened) and call
//! `args.control.client()?.call("cmd", json!({...}))`; the service side is a control command
//! (see `control/mod.rs`).

pub mod md;
pub mod md_grow;
pub mod member_reader;
pub mod monitor;
pub mod serve;
pub mod status;
pub mod thin;
pub mod thin_activate;
pub mod thin_tools;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};

use crate::config::{Config, Overrides};
use crate::control::client::ControlClient;

#[derive(Parser)]
#[command(name = "mdkit", version, about = "Software RAID (md) and thin provisioning in user space, served over NBD")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Run the service: open volumes, serve NBD exports and the control socket.
    Serve(serve::ServeArgs),
    /// Show volumes, exports, listeners and counters of a running service.
    Status(status::StatusArgs),
    /// Create an md array (through the service when it runs, else superblocks only).
    Create(md::CreateArgs),
    /// Show the md superblock of member devices or NBD exports (offline, like mdadm --examine).
    Examine(md::ExamineArgs),
    /// Assemble an md array from its members and start it in the service.
    Assemble(md::AssembleArgs),
    /// Show an md array's state, members and progress (like mdadm --detail); `--scan`: one
    /// mdadm.conf ARRAY line per running array (mdadm --detail --scan).
    Detail(md::DetailArgs),
    /// Stop an md array (flush, mark clean) and forget it.
    Stop(md::NameArgs),
    /// Add, fail, remove, re-add or replace an md array member.
    Manage(md::ManageArgs),
    /// Grow an md array: size after the members grew, bitmap, write-behind, raid1 mirrors,
    /// raid4/5/6 restripe onto more members, level changes that move no data (like mdadm --grow).
    Grow(md_grow::GrowArgs),
    /// Read or set md attributes (sysfs names: sync_action, sync_speed_max, mismatch_cnt, ...).
    Attr(md::AttrArgs),
    /// Thin pools and volumes: pool-create, status, check, create, snapshot, delete, list,
    /// activate, deactivate, pool-resize, dump, restore, repair, delta,
    /// reserve-/release-metadata-snap.
    Thin(thin::ThinArgs),
    /// Print events (mdadm's names: Fail, DegradedArray, ...), run an alert program, mail.
    Monitor(monitor::MonitorArgs),
}

pub fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Serve(a) => serve::run(a),
        Command::Status(a) => status::run(a),
        Command::Create(a) => md::create(a),
        Command::Examine(a) => md::examine(a),
        Command::Thin(a) => thin::run(a),
        Command::Assemble(a) => md::assemble(a),
        Command::Detail(a) => md::detail(a),
        Command::Stop(a) => md::stop(a),
        Command::Manage(a) => md::manage(a),
        Command::Attr(a) => md::attr(a),
        Command::Grow(a) => md_grow::grow(a),
        Command::Monitor(a) => monitor::run(a),
    }
}

/// How a client verb finds the running service's control socket.
#[derive(Args, Debug, Clone)]
pub struct ControlArgs {
    /// Control socket path (default: from --config, else <data dir>/mdkit.sock).
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// The config file the service was started with (to find its control socket).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Data directory of the service (default: $MDKIT_DATA_DIR, else ./mdkit-data).
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Seconds to wait for an answer.
    #[arg(long, default_value_t = 30)]
    pub timeout_s: u64,
}

impl ControlArgs {
    pub fn socket_path(&self) -> Result<PathBuf> {
        if let Some(s) = &self.socket {
            return Ok(s.clone());
        }
        let cfg = Config::load(self.config.as_deref(), &Overrides::from_cli(self.data_dir.clone(), Vec::new()))?;
        Ok(cfg.control_socket)
    }

    pub fn client(&self) -> Result<ControlClient> {
        ControlClient::connect(&self.socket_path()?, Duration::from_secs(self.timeout_s))
    }
}

/// The refusal of an offline writer on a device a running service holds
/// (`mdkit_io::lock`), with what to do about it; any other error as it is.
pub(crate) fn offline_writer_error(e: anyhow::Error) -> anyhow::Error {
    let busy = e.chain().any(|c| c.downcast_ref::<std::io::Error>().is_some_and(mdkit_io::lock::is_busy));
    if !busy {
        return e;
    }
    anyhow::anyhow!(
        "{e:#}; nothing was written. Close it in the service first (`mdkit thin pool-deactivate POOL` for a \
         thin pool's metadata or data device, `mdkit stop NAME` for an md array's member) or stop the \
         service; read-only tools (`mdkit thin check` without --clear-needs-check, `thin dump`, `examine`) \
         work on it as it is"
    )
}
