//! `mdkit thin ...`: thin pools and volumes. Every verb talks to the running service except
//! `check`, which reads a metadata device offline (like thin_check), and the metadata tools
//! of `thin_tools.rs` (dump, restore, repair, delta, metadata snapshots).
//!
//! ```text
//! mdkit thin pool-create NAME --metadata DEV --data DEV [--block-size 64K] [--no-zeroing]
//!                        [--error-if-no-space] [--metadata-size S] [--data-size S] [--force]
//!                        [--autoextend-threshold-percent P [--autoextend-step S|N%]
//!                         [--autoextend-max-size S]]
//! mdkit thin status POOL [--json]
//! mdkit thin check METADATA-DEV [--clear-needs-check] [--json]
//! mdkit thin create POOL ID --size S [--name VOLUME] [--export NAME | --no-export]
//!                   [--external-origin PATH|volume:NAME]
//! mdkit thin snapshot POOL NEW-ID ORIGIN-ID [--name VOLUME] [--export NAME | --no-export]
//! mdkit thin delete POOL ID
//! mdkit thin list POOL [--json]
//! mdkit thin activate | deactivate | pool-resize | pool-deactivate | pool-activate ...
//!                                                       (thin_activate.rs)
//! ```
//! DEV is a path (a file or block device) or `volume:NAME` (a volume of the service, e.g. an
//! md array).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use mdkit_thin::meta::{CheckOptions, FileMetaIo, check, clear_needs_check};
use serde_json::{Value, json};

use super::ControlArgs;

#[derive(Args, Debug)]
pub struct ThinArgs {
    #[command(subcommand)]
    pub verb: Verb,
}

#[derive(Subcommand, Debug)]
pub enum Verb {
    /// Format a new pool on a metadata and a data device and open it in the service.
    PoolCreate(PoolCreateArgs),
    /// Pool status (the `dmsetup status` line, usage, mode) and every thin device's.
    Status(PoolJsonArgs),
    /// Check pool metadata offline (thin_check equivalent); exit status 1 when damaged.
    Check(CheckArgs),
    /// Create a thin device of SIZE, open it as a volume and export it over NBD.
    Create(CreateArgs),
    /// Snapshot a thin device (O(1)), open the snapshot as a volume and export it.
    Snapshot(SnapshotArgs),
    /// Delete a thin device (its run-time volume and export are removed first).
    Delete(DeleteArgs),
    /// Mapped, exclusive and shared blocks of every thin device.
    List(PoolJsonArgs),
    #[command(flatten)]
    Tools(super::thin_tools::ToolVerb),
    /// Open an existing thin device (made by the kernel, LVM or earlier) as a volume and export it.
    Activate(super::thin_activate::ActivateArgs),
    /// Flush a thin device's run-time volume, remove it and its export (the device stays).
    Deactivate(super::thin_activate::DeactivateArgs),
    /// Grow a running pool: pick up a grown data device, grow the metadata (never shrinks).
    PoolResize(super::thin_activate::PoolResizeArgs),
    /// Close a pool (commit, release its devices) while the service runs; --force closes its
    /// thin volumes first. Offline tools may then write its metadata.
    PoolDeactivate(super::thin_activate::PoolDeactivateArgs),
    /// Open a deactivated pool again, with the thin volumes and exports it had.
    PoolActivate(super::thin_activate::PoolActivateArgs),
}

#[derive(Args, Debug)]
pub struct PoolCreateArgs {
    pub name: String,
    /// Metadata device: a path or volume:NAME.
    #[arg(long, value_name = "DEV")]
    pub metadata: String,
    /// Data device: a path or volume:NAME.
    #[arg(long, value_name = "DEV")]
    pub data: String,
    /// Data block size: 64K..1G, a multiple of 64K.
    #[arg(long, default_value = "64K")]
    pub block_size: String,
    /// Do not zero newly provisioned blocks (dm-thin skip_block_zeroing).
    #[arg(long)]
    pub no_zeroing: bool,
    /// Fail writes at once when out of data space (else they queue up to the timeout).
    #[arg(long)]
    pub error_if_no_space: bool,
    /// Seconds writes queue for data space before failing (default 60).
    #[arg(long, value_name = "S")]
    pub no_space_timeout_s: Option<u64>,
    /// Warn when free data blocks fall below this.
    #[arg(long, value_name = "BLOCKS")]
    pub low_water_blocks: Option<u64>,
    /// Create the metadata file with this size if it does not exist.
    #[arg(long, value_name = "SIZE")]
    pub metadata_size: Option<String>,
    /// Create the data file with this size if it does not exist.
    #[arg(long, value_name = "SIZE")]
    pub data_size: Option<String>,
    /// Format the metadata device even when it is not blank: DESTROYS any pool on it.
    #[arg(long)]
    pub force: bool,
    /// File data device: grow it when more than P% (1..=99) of the data blocks are used.
    #[arg(long, value_name = "P")]
    pub autoextend_threshold_percent: Option<u64>,
    /// Each autoextend growth: N% of the data file's size or a size (default 20%).
    #[arg(long, value_name = "SIZE|N%", requires = "autoextend_threshold_percent")]
    pub autoextend_step: Option<String>,
    /// Never autoextend the data file beyond this size.
    #[arg(long, value_name = "SIZE", requires = "autoextend_threshold_percent")]
    pub autoextend_max_size: Option<String>,
    #[command(flatten)]
    pub control: ControlArgs,
}

#[derive(Args, Debug)]
pub struct PoolJsonArgs {
    pub pool: String,
    /// Print the raw JSON answer.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub control: ControlArgs,
}

#[derive(Args, Debug)]
pub struct CheckArgs {
    pub metadata: PathBuf,
    /// When the metadata is clean, clear NEEDS_CHECK so the pool opens read-write again.
    #[arg(long)]
    pub clear_needs_check: bool,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct CreateArgs {
    pub pool: String,
    pub id: u64,
    /// Virtual size (e.g. 10G).
    #[arg(long)]
    pub size: String,
    /// A read-only volume that unmapped blocks read from (dm-thin's external origin; the
    /// golden-image case): a file or block device path, or volume:NAME. Never written.
    #[arg(long, value_name = "PATH|volume:NAME")]
    pub external_origin: Option<String>,
    #[command(flatten)]
    pub volume: VolumeNaming,
    #[command(flatten)]
    pub control: ControlArgs,
}

#[derive(Args, Debug)]
pub struct SnapshotArgs {
    pub pool: String,
    pub new_id: u64,
    pub origin_id: u64,
    /// Virtual size (default: the origin's).
    #[arg(long)]
    pub size: Option<String>,
    #[command(flatten)]
    pub volume: VolumeNaming,
    #[command(flatten)]
    pub control: ControlArgs,
}

#[derive(Args, Debug)]
pub struct VolumeNaming {
    /// Volume name in the service (default POOL.ID).
    #[arg(long)]
    pub name: Option<String>,
    /// NBD export name (default: the volume name).
    #[arg(long, conflicts_with = "no_export")]
    pub export: Option<String>,
    /// Do not export the volume.
    #[arg(long)]
    pub no_export: bool,
}

impl VolumeNaming {
    pub fn json(&self) -> (Value, Value) {
        let export = if self.no_export { json!("") } else { json!(self.export) };
        (json!(self.name), export)
    }
}

#[derive(Args, Debug)]
pub struct DeleteArgs {
    pub pool: String,
    pub id: u64,
    #[command(flatten)]
    pub control: ControlArgs,
}

pub fn run(a: ThinArgs) -> Result<ExitCode> {
    match a.verb {
        Verb::PoolCreate(a) => pool_create(a),
        Verb::Status(a) => status(a),
        Verb::Check(a) => check_offline(a),
        Verb::Create(a) => {
            let (name, export) = a.volume.json();
            let origin = a.external_origin.as_deref().map(device_spec).transpose()?;
            let args = json!({ "pool": a.pool, "id": a.id, "size": a.size, "name": name, "export": export, "external_origin": origin });
            print_created(&a.control.client()?.call("thin.create", args)?)
        }
        Verb::Snapshot(a) => {
            let (name, export) = a.volume.json();
            let args = json!({ "pool": a.pool, "id": a.new_id, "origin": a.origin_id, "size": a.size, "name": name, "export": export });
            print_created(&a.control.client()?.call("thin.snapshot", args)?)
        }
        Verb::Delete(a) => {
            let v = a.control.client()?.call("thin.delete", json!({ "pool": a.pool, "id": a.id }))?;
            println!("deleted thin device {} of pool {}", a.id, a.pool);
            for n in v["volumes_removed"].as_array().into_iter().flatten() {
                println!("removed volume {}", n.as_str().unwrap_or("?"));
            }
            Ok(ExitCode::SUCCESS)
        }
        Verb::List(a) => list(a),
        Verb::Tools(v) => super::thin_tools::run(v),
        Verb::Activate(a) => super::thin_activate::activate(a),
        Verb::Deactivate(a) => super::thin_activate::deactivate(a),
        Verb::PoolResize(a) => super::thin_activate::pool_resize(a),
        Verb::PoolDeactivate(a) => super::thin_activate::pool_deactivate(a),
        Verb::PoolActivate(a) => super::thin_activate::pool_activate(a),
    }
}

/// Paths become absolute (the service resolves relative paths against its data directory).
pub fn device_spec(s: &str) -> Result<String> {
    if s.starts_with("volume:") {
        return Ok(s.to_string());
    }
    let p = PathBuf::from(s);
    let abs = if p.is_absolute() { p } else { std::env::current_dir().context("current directory")?.join(p) };
    Ok(abs.display().to_string())
}

fn pool_create(a: PoolCreateArgs) -> Result<ExitCode> {
    let mut options = Vec::new();
    if a.no_zeroing {
        options.push("skip_block_zeroing");
    }
    if a.error_if_no_space {
        options.push("error_if_no_space");
    }
    let mut args = json!({
        "name": a.name,
        "metadata": device_spec(&a.metadata)?,
        "data": device_spec(&a.data)?,
        "block_size": a.block_size,
        "options": options,
    });
    if a.force {
        args["force"] = Value::Bool(true);
    }
    for (k, v) in [
        ("metadata_size", a.metadata_size.map(Value::from)),
        ("data_size", a.data_size.map(Value::from)),
        ("no_space_timeout_s", a.no_space_timeout_s.map(Value::from)),
        ("low_water_blocks", a.low_water_blocks.map(Value::from)),
        ("autoextend_threshold_percent", a.autoextend_threshold_percent.map(Value::from)),
        ("autoextend_step", a.autoextend_step.map(Value::from)),
        ("autoextend_max_size", a.autoextend_max_size.map(Value::from)),
    ] {
        if let Some(v) = v {
            args[k] = v;
        }
    }
    let v = a.control.client()?.call("thin.pool-create", args.clone())?;
    println!(
        "created thin pool {} ({} KiB blocks): {}",
        a.name,
        v["data_block_bytes"].as_u64().unwrap_or(0) >> 10,
        v["status"].as_str().unwrap_or("?")
    );
    println!("It is open now and reopened when the service restarts. Equivalent config:");
    println!(
        "[[volume]]\nname = {:?}\nkind = \"thin-pool\"\nmetadata = {}\ndata = {}\nblock_size = {}\noptions = {}",
        a.name, args["metadata"], args["data"], args["block_size"], args["options"]
    );
    // Every remembered key but the create-only sizes: a config without the no-space timeout and
    // the low-water mark would open a different pool (60 s queueing, no low-water warnings).
    for k in [
        "no_space_timeout_s",
        "low_water_blocks",
        "autoextend_threshold_percent",
        "autoextend_step",
        "autoextend_max_size",
    ] {
        if !args[k].is_null() {
            println!("{k} = {}", args[k]);
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub fn print_created(v: &Value) -> Result<ExitCode> {
    print!(
        "thin device {} of pool {} is volume {}",
        v["id"],
        v["pool"].as_str().unwrap_or("?"),
        v["volume"].as_str().unwrap_or("?")
    );
    match v["export"].as_str() {
        Some(e) => print!(", exported as {e:?}"),
        None => print!(" (not exported)"),
    }
    match v["external_origin"].as_str() {
        Some(o) => println!(", over external origin {o}"),
        None => println!(),
    }
    Ok(ExitCode::SUCCESS)
}

fn status(a: PoolJsonArgs) -> Result<ExitCode> {
    let v = a.control.client()?.call("thin.status", json!({ "pool": a.pool }))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(ExitCode::SUCCESS);
    }
    print!("{}", status_text(&v));
    Ok(ExitCode::SUCCESS)
}

fn status_text(v: &Value) -> String {
    let s = |x: &Value| x.as_str().map(str::to_string).unwrap_or_else(|| x.to_string());
    let u = |x: &Value| x.as_u64().unwrap_or(0);
    let mut out = format!("{}: {}\n", s(&v["pool"]), s(&v["status"]));
    if v["inactive"].as_bool() == Some(true) {
        out += &format!("  metadata {}, data {}\n", s(&v["metadata_device"]), s(&v["data_device"]));
        for t in v["thins"].as_array().into_iter().flatten() {
            out += &format!("  thin {} (volume {}) opens again with the pool\n", t["id"], s(&t["volume"]));
        }
        out += &format!("  `mdkit thin pool-activate {}` opens it again\n", s(&v["pool"]));
        return out;
    }
    out += &format!(
        "  mode {}{}, data {}/{} blocks of {} KiB, metadata {}/{} blocks, transaction {}\n",
        s(&v["mode"]),
        match v["mode_reason"].as_str() {
            Some(r) if !r.is_empty() => format!(" ({r})"),
            _ => String::new(),
        },
        u(&v["used_data_blocks"]),
        u(&v["total_data_blocks"]),
        u(&v["data_block_bytes"]) >> 10,
        u(&v["used_metadata_blocks"]),
        u(&v["total_metadata_blocks"]),
        u(&v["transaction_id"]),
    );
    if v["needs_check"].as_bool() == Some(true) {
        out += &format!(
            "  NEEDS_CHECK is set: `mdkit thin pool-deactivate {p} --force`, then \
             `mdkit thin check METADATA-DEV --clear-needs-check`, then `mdkit thin pool-activate {p}`\n",
            p = s(&v["pool"])
        );
    }
    if v["low_water_reached"].as_bool() == Some(true) {
        out += &format!("  free data blocks are down to the low-water mark ({})\n", u(&v["low_water_blocks"]));
    }
    out += &format!(
        "  {:<8} {:>14} {:>20} {:>14}  {}\n",
        "THIN", "MAPPED-SECTORS", "HIGHEST-MAPPED-SECTOR", "SIZE", "OPEN"
    );
    for t in v["thins"].as_array().into_iter().flatten() {
        out += &format!(
            "  {:<8} {:>14} {:>20} {:>14}  {}\n",
            u(&t["id"]),
            u(&t["mapped_sectors"]),
            t["highest_mapped_sector"].as_u64().map_or("-".to_string(), |h| h.to_string()),
            t["size_bytes"].as_u64().map_or("?".to_string(), |b| b.to_string()),
            if t["open"].as_bool() == Some(true) { "yes" } else { "no" },
        );
    }
    out
}

fn list(a: PoolJsonArgs) -> Result<ExitCode> {
    let v = a.control.client()?.call("thin.list", json!({ "pool": a.pool }))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<8} {:>12} {:>12} {:>12} {:>16} {:>16}  VOLUMES",
        "THIN", "MAPPED", "EXCLUSIVE", "SHARED", "MAPPED-BYTES", "SIZE"
    );
    for t in v["thins"].as_array().into_iter().flatten() {
        let vols: Vec<String> =
            t["volumes"].as_array().into_iter().flatten().filter_map(|x| x.as_str().map(str::to_string)).collect();
        println!(
            "{:<8} {:>12} {:>12} {:>12} {:>16} {:>16}  {}",
            // Value's Display ignores width and alignment; its string form does not.
            t["id"].to_string(),
            t["mapped_blocks"].to_string(),
            t["exclusive_blocks"].to_string(),
            t["shared_blocks"].to_string(),
            t["mapped_bytes"].to_string(),
            t["size_bytes"].as_u64().map_or("?".to_string(), |b| b.to_string()),
            if vols.is_empty() { "-".to_string() } else { vols.join(",") },
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn check_offline(a: CheckArgs) -> Result<ExitCode> {
    // --clear-needs-check writes: refused on the device of a running pool (`offline_writer_error`).
    let io = FileMetaIo::open(&a.metadata, a.clear_needs_check)
        .with_context(|| format!("opening {}", a.metadata.display()))
        .map_err(super::offline_writer_error)?;
    let opts = CheckOptions::default();
    let report = if a.clear_needs_check { clear_needs_check(&io, &opts)? } else { check(&io, &opts) };
    if a.json {
        let issues = |v: &[mdkit_thin::meta::CheckIssue]| -> Vec<Value> {
            v.iter().map(|i| json!({ "block": i.block, "message": i.message })).collect()
        };
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "device": report.device,
                "clean": report.is_clean(),
                "errors": issues(&report.errors),
                "errors_not_recorded": report.errors_not_recorded,
                "warnings": issues(&report.warnings),
                "devices": report.nr_devices,
                "mappings": report.nr_mappings,
                "metadata_blocks_referenced": report.metadata_blocks_referenced,
                "data_blocks_referenced": report.data_blocks_referenced,
                "needs_check": report.needs_check_flag,
                "transaction_id": report.superblock.as_ref().map(|s| s.trans_id),
            }))?
        );
    } else {
        print!("{report}");
        if a.clear_needs_check && report.is_clean() {
            println!("NEEDS_CHECK is clear");
        }
    }
    if !report.is_clean() {
        if !a.json {
            bail!(
                "{}: metadata is damaged; salvage it with `mdkit thin repair -i DAMAGED -o NEW` (or thin_repair)",
                a.metadata.display()
            );
        }
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_text_shows_the_dmsetup_line_and_every_thin() {
        let v = json!({
            "pool": "p", "status": "3 20/1024 5/100 - rw discard_passdown queue_if_no_space - 256", "mode": "rw",
            "used_data_blocks": 5, "total_data_blocks": 100, "data_block_bytes": 65536, "used_metadata_blocks": 20,
            "total_metadata_blocks": 1024, "transaction_id": 3, "needs_check": false,
            "thins": [{"id": 0, "mapped_sectors": 640, "highest_mapped_sector": 1279, "size_bytes": 1048576, "open": true}]
        });
        let t = status_text(&v);
        assert!(t.contains("3 20/1024 5/100 - rw") && t.contains("1279") && t.contains("yes"), "{t}");
    }
}
