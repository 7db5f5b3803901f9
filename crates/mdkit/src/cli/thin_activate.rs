//! `mdkit thin activate | deactivate | pool-resize | pool-deactivate | pool-activate`: open an
//! existing thin device as a volume, close it again, grow a running pool, close a pool and open
//! it again while the service runs.
//!
//! ```text
//! mdkit thin activate POOL ID [--size S] [--name VOLUME] [--export NAME | --no-export]
//!                    [--external-origin PATH|volume:NAME]
//! mdkit thin deactivate POOL ID
//! mdkit thin pool-resize POOL [--data-size SIZE|max] [--metadata-size SIZE|max]
//! mdkit thin pool-deactivate POOL [--force]
//! mdkit thin pool-activate POOL
//! ```

use std::process::ExitCode;

use anyhow::Result;
use clap::Args;
use serde_json::{Value, json};

use super::ControlArgs;
use super::thin::{VolumeNaming, print_created};

#[derive(Args, Debug)]
pub struct ActivateArgs {
    pub pool: String,
    pub id: u64,
    /// Virtual size (default: the size recorded when mdkit created or last opened the device;
    /// a device made by the kernel or LVM has none, give it here).
    #[arg(long)]
    pub size: Option<String>,
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
pub struct DeactivateArgs {
    pub pool: String,
    pub id: u64,
    #[command(flatten)]
    pub control: ControlArgs,
}

#[derive(Args, Debug)]
pub struct PoolResizeArgs {
    pub pool: String,
    /// Data size: a size (a file data device is grown to it) or `max` (take the device's
    /// current size, e.g. after `truncate -s`). Default, when neither option is given: max.
    #[arg(long, value_name = "SIZE|max")]
    pub data_size: Option<String>,
    /// Metadata size: a size (a file is grown to it) or `max` (the device's current size,
    /// capped at dm-thin's 15.87 GiB). Default, when neither option is given: max.
    #[arg(long, value_name = "SIZE|max")]
    pub metadata_size: Option<String>,
    /// Print the raw JSON answer.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub control: ControlArgs,
}

#[derive(Args, Debug)]
pub struct PoolDeactivateArgs {
    pub pool: String,
    /// Close the pool's open thin volumes first (flushed, exports removed); pool-activate
    /// opens them again. Refused while NBD clients are connected to them.
    #[arg(long)]
    pub force: bool,
    #[command(flatten)]
    pub control: ControlArgs,
}

#[derive(Args, Debug)]
pub struct PoolActivateArgs {
    pub pool: String,
    #[command(flatten)]
    pub control: ControlArgs,
}

pub fn pool_deactivate(a: PoolDeactivateArgs) -> Result<ExitCode> {
    let v = a.control.client()?.call("thin.pool-deactivate", json!({ "pool": a.pool, "force": a.force }))?;
    for (what, key) in [("volume", "volumes_removed"), ("export", "exports_removed")] {
        for n in v[key].as_array().into_iter().flatten() {
            println!("closed {what} {}", n.as_str().unwrap_or("?"));
        }
    }
    match v["final_commit_error"].as_str() {
        Some(e) if v["was_failed"] == true => {
            println!("pool {}: failed, closed without its final commit ({e})", a.pool)
        }
        Some(e) => println!("pool {}: its final commit failed ({e}); check its metadata before activating it", a.pool),
        None => println!("pool {}: committed and closed", a.pool),
    }
    if v["devices_released"] == false {
        println!("pool {}: a device file is still held; offline tools are refused until it is released", a.pool);
    }
    println!("pool {} is inactive; `mdkit thin pool-activate {}` opens it again", a.pool, a.pool);
    Ok(ExitCode::SUCCESS)
}

pub fn pool_activate(a: PoolActivateArgs) -> Result<ExitCode> {
    let v = a.control.client()?.call("thin.pool-activate", json!({ "pool": a.pool }))?;
    println!("pool {} activated: {}", a.pool, v["status"].as_str().unwrap_or("?"));
    for n in v["volumes_opened"].as_array().into_iter().flatten() {
        println!("opened volume {}", n.as_str().unwrap_or("?"));
    }
    let errors = v["errors"].as_array().cloned().unwrap_or_default();
    for e in &errors {
        eprintln!("mdkit: {}", e["error"].as_str().unwrap_or("?"));
    }
    Ok(if errors.is_empty() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

pub fn activate(a: ActivateArgs) -> Result<ExitCode> {
    let (name, export) = a.volume.json();
    let origin = a.external_origin.as_deref().map(super::thin::device_spec).transpose()?;
    let args = json!({ "pool": a.pool, "id": a.id, "size": a.size, "name": name, "export": export, "external_origin": origin });
    print_created(&a.control.client()?.call("thin.activate", args)?)
}

pub fn deactivate(a: DeactivateArgs) -> Result<ExitCode> {
    let v = a.control.client()?.call("thin.deactivate", json!({ "pool": a.pool, "id": a.id }))?;
    println!("deactivated thin device {} of pool {}", a.id, a.pool);
    for (what, key) in [("volume", "volumes_removed"), ("export", "exports_removed")] {
        for n in v[key].as_array().into_iter().flatten() {
            println!("removed {what} {}", n.as_str().unwrap_or("?"));
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub fn pool_resize(a: PoolResizeArgs) -> Result<ExitCode> {
    let args = json!({ "pool": a.pool, "data_size": a.data_size, "metadata_size": a.metadata_size });
    let v = a.control.client()?.call("thin.pool-resize", args)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(ExitCode::SUCCESS);
    }
    print!("{}", resize_text(&v));
    Ok(ExitCode::SUCCESS)
}

fn resize_text(v: &Value) -> String {
    let mut out = String::new();
    for (what, key) in [("metadata", "metadata_blocks"), ("data", "data_blocks")] {
        let (old, new) = (&v[key]["old"], &v[key]["new"]);
        if old.is_null() {
            continue;
        }
        let verb = if old == new { "unchanged at" } else { "grown to" };
        out += &format!("{} {what}: {verb} {new} blocks (was {old})\n", v["pool"].as_str().unwrap_or("?"));
    }
    for o in v["external_origins"].as_array().into_iter().flatten() {
        let vol = o["volume"].as_str().unwrap_or("?");
        out += &match (o["error"].as_str(), o["old_bytes"].as_u64(), o["new_bytes"].as_u64()) {
            (Some(e), ..) => format!("{vol} external origin: size not read again: {e}\n"),
            (None, Some(old), Some(new)) if old != new => {
                format!("{vol} external origin: grown to {new} bytes (was {old})\n")
            }
            (None, _, new) => format!("{vol} external origin: unchanged at {} bytes\n", new.unwrap_or(0)),
        };
    }
    out += &format!("status: {}\n", v["status"].as_str().unwrap_or("?"));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resize_text_says_what_grew() {
        let v = json!({ "pool": "p", "metadata_blocks": {"old": 2048, "new": 2048},
            "data_blocks": {"old": 64, "new": 128}, "status": "0 20/2048 3/128 - rw" });
        let t = resize_text(&v);
        assert!(
            t.contains("p metadata: unchanged at 2048") && t.contains("p data: grown to 128 blocks (was 64)"),
            "{t}"
        );
        let v = json!({ "pool": "p", "status": "rw", "external_origins": [
            {"volume": "p.1", "old_bytes": 1024, "new_bytes": 4096},
            {"volume": "p.2", "old_bytes": 512, "new_bytes": 512},
            {"volume": "p.3", "error": "shrank"}] });
        let t = resize_text(&v);
        assert!(t.contains("p.1 external origin: grown to 4096 bytes (was 1024)"), "{t}");
        assert!(t.contains("p.2 external origin: unchanged at 512 bytes"), "{t}");
        assert!(t.contains("p.3 external origin: size not read again: shrank"), "{t}");
    }
}
