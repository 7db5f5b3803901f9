//! `mdkit serve`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Args;

use crate::config::{Config, DEFAULT_CONFIG_TOML, Overrides};

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// TOML config file (docs/CONFIG.md); without it the embedded default is used.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Data directory (overrides $MDKIT_DATA_DIR and the config's data_dir).
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// NBD listen address, repeatable (replaces nbd.listen): HOST:PORT or unix:PATH.
    #[arg(long, value_name = "ADDR")]
    pub listen: Vec<String>,
    /// Print the embedded default config and exit.
    #[arg(long)]
    pub print_default_config: bool,
    /// Parse and check the config, print the result and exit (opens nothing).
    #[arg(long)]
    pub check_config: bool,
    /// Data-path threads: each runs a current-thread runtime serving NBD connections, with an
    /// io_uring per member of its own (default: one per CPU; 1..=1024).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub threads: Option<u16>,
}

pub fn run(args: ServeArgs) -> Result<ExitCode> {
    if args.print_default_config {
        print!("{DEFAULT_CONFIG_TOML}");
        return Ok(ExitCode::SUCCESS);
    }
    let config = Config::load(args.config.as_deref(), &Overrides::from_cli(args.data_dir, args.listen))?;
    if args.check_config {
        println!("config: {}", config.source);
        println!("data_dir: {}", config.data_dir.display());
        println!("control_socket: {}", config.control_socket.display());
        for l in &config.nbd.listen {
            println!("listen: {l}");
        }
        if let Some(addr) = config.metrics.listen {
            println!("metrics: http://{addr}/metrics");
        }
        crate::volumes::check_specs(&config.volumes)?;
        crate::volumes::in_use::check_config(&config)?;
        crate::volumes::thin::check_config_exports(&config)?;
        for v in &config.volumes {
            println!("volume: {} (kind {})", v.name, v.kind);
        }
        for e in &config.exports {
            println!("export: {} -> volume {}{}", e.name, e.volume, if e.read_only { " (read-only)" } else { "" });
        }
        return Ok(ExitCode::SUCCESS);
    }
    // The service writes to sockets whose peers may vanish: EPIPE, not a signal.
    crate::ignore_sigpipe();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Control plane (control socket, accept, volume management, md daemons): a small
    // multi-thread runtime. Data path: one current-thread runtime per core, where connections
    // run with their requests and member I/O on one thread (mdkit_nbd::threads).
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("mdkit-worker")
        .worker_threads(cpus.min(2))
        .build()
        .context("starting the tokio runtime")?;
    let data_path =
        mdkit_nbd::ConnectionThreads::start_with(args.threads.map_or(cpus, usize::from).max(1), config.nbd.idle_poll)
            .context("starting the data-path threads")?;
    rt.block_on(crate::service::run(config, data_path.handles()))?;
    // Member devices drain their rings when dropped; give background tasks no chance to linger.
    rt.shutdown_timeout(std::time::Duration::from_secs(5));
    drop(data_path);
    Ok(ExitCode::SUCCESS)
}
