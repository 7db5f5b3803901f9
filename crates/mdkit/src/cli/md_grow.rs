//! `mdkit grow NAME` (mdadm --grow) on a running array, one change at a time:
//!
//! ```text
//! mdkit grow NAME --size max|SIZE [--assume-clean]     used size per member, after the members grew
//! mdkit grow NAME --bitmap internal|none [--bitmap-chunk SIZE]
//! mdkit grow NAME --raid-devices N [--add MEMBER]...   raid1 mirrors; raid4/5/6, raid10 near restripe
//! mdkit grow NAME --write-behind N                     raid1 with a bitmap (also with --bitmap internal)
//! mdkit grow NAME --level L [--layout preserve|NAME] [--add MEMBER]
//!                                                      the level changes md makes without moving data
//! mdkit grow NAME [--chunk K] [--layout NAME]          raid4/5/6: restripe over the same members
//! mdkit grow NAME --array-size max|SIZE                the size the array gives (md's array_size)
//! ```
//! A plain `--size` number is KiB, as in mdadm. raid4/5/6 `--raid-devices N` restripes onto the
//! added members in the background (`array/reshape.rs`). `--level`: raid1 (2 mirrors) <-> raid5,
//! single-zone raid0 <-> raid4/raid5 parity-last (`--add` the parity member; back, it is failed
//! and removed first), raid0 <-> raid10 near-2 (`--add` the second copies; back, the second
//! copies are failed and removed first),
//! raid4 <-> raid5 parity-last, raid5 -> raid6 with Q on a new last member (`--layout preserve`;
//! `--add` the device that recovers Q), raid6 with Q last -> raid5 (`format/takeover.rs`).
//! `--chunk` and/or `--layout` without `--level` restripe raid4/5/6 in the background over the
//! same members, moving the data offset down by the larger chunk; raid10 near layouts restripe
//! onto more members. Other restripes (raid0, raid10 far/offset) are refused as not implemented
//! yet. `--raid-devices` below the current count (raid4/5/6, raid10 near)
//! reshapes backwards onto fewer members, moving the data up; the array must first be cut to
//! the smaller size with `--array-size` (in memory only, as md's), and the members left over
//! become spares.

use std::process::ExitCode;

use anyhow::{Result, anyhow};
use clap::Args;
use serde_json::json;

use super::ControlArgs;
use super::md::{absolute_members, detail_text, parse_chunk_kib};
use crate::config::parse_size;

#[derive(Args, Debug)]
pub struct GrowArgs {
    /// Array name.
    pub name: String,
    /// Used size per member: `max` (everything the members offer) or a size (plain number: KiB).
    #[arg(long, short = 'z')]
    pub size: Option<String>,
    /// raid1: the number of mirrors; raid4/5/6 and raid10 (near): restripe onto this many members
    /// (with --add).
    #[arg(long, short = 'n')]
    pub raid_devices: Option<u32>,
    /// Add (`internal`) or remove (`none`) the write-intent bitmap.
    #[arg(long, short = 'b')]
    pub bitmap: Option<String>,
    /// With --bitmap internal: the bitmap chunk (default: mdadm's choice).
    #[arg(long, value_name = "SIZE")]
    pub bitmap_chunk: Option<String>,
    /// raid1 with a bitmap: the most writes outstanding to write-mostly members (0 = off,
    /// up to 16383); alone, or with --bitmap internal.
    #[arg(long, value_name = "N")]
    pub write_behind: Option<u32>,
    /// With --size: do not resync the grown part.
    #[arg(long)]
    pub assume_clean: bool,
    /// With --raid-devices: devices to add; raid1 recovers them into the new mirrors, raid4/5/6
    /// restripes onto them. With --level: the devices that recover Q (raid6), parity or the second
    /// copies (from raid0).
    #[arg(long, short = 'a', value_name = "MEMBER")]
    pub add: Vec<String>,
    /// raid4/5/6: restripe to this chunk (plain number: KiB), alone or with --layout.
    #[arg(long, short = 'c')]
    pub chunk: Option<String>,
    /// With --level: `preserve` (raid5 -> raid6 keeps the raid5 layout, Q on the new last
    /// member) or the new level's layout name. Without --level: raid5/6 restripe to this layout.
    #[arg(long, short = 'p')]
    pub layout: Option<String>,
    /// The new level, where md changes it without moving data: raid1 (2 mirrors) <-> raid5,
    /// raid0 <-> raid4/raid5 (parity-last, --add the parity member; back: it is removed),
    /// raid0 <-> raid10 (near-2, --add the second copies; back: they are removed), raid4 <->
    /// raid5 (parity-last),
    /// raid5 -> raid6 (--layout preserve, --add the Q member), raid6 with Q on the last
    /// member -> raid5.
    #[arg(long, short = 'l')]
    pub level: Option<String>,
    /// The size the array gives: `max` or a size (plain number: KiB), at most what the members
    /// give; kept in memory only, as md's array_size. Needed before `--raid-devices` drops
    /// members.
    #[arg(long, value_name = "SIZE")]
    pub array_size: Option<String>,
    #[command(flatten)]
    pub control: ControlArgs,
}

/// mdadm's `--size` and `--array-size`: `max`, a plain number of KiB, or a size with a unit.
fn size_arg(flag: &str, s: &str) -> Result<serde_json::Value> {
    if s == "max" {
        return Ok(json!("max"));
    }
    let bytes = if s.chars().all(|c| c.is_ascii_digit()) {
        s.parse::<u64>()
            .ok()
            .and_then(|k| k.checked_mul(1024))
            .ok_or_else(|| anyhow!("{flag} {s:?}: not a number of KiB below 16 EiB"))?
    } else {
        parse_size(s).map_err(|e| anyhow!("{flag}: {e}"))?
    };
    Ok(json!(bytes))
}

pub fn grow(a: GrowArgs) -> Result<ExitCode> {
    let size = a.size.as_deref().map(|s| size_arg("--size", s)).transpose()?;
    let array_size = a.array_size.as_deref().map(|s| size_arg("--array-size", s)).transpose()?;
    let bitmap_chunk =
        a.bitmap_chunk.as_deref().map(parse_size).transpose().map_err(|e| anyhow!("--bitmap-chunk: {e}"))?;
    let add = absolute_members(&a.add)?;
    let chunk_kib = a.chunk.as_deref().map(parse_chunk_kib).transpose()?;
    let d = a.control.client()?.call(
        "md.grow",
        json!({ "name": a.name, "size": size, "raid_devices": a.raid_devices, "bitmap": a.bitmap,
                "bitmap_chunk_bytes": bitmap_chunk, "write_behind": a.write_behind, "assume_clean": a.assume_clean, "add": add,
                "chunk_kib": chunk_kib, "layout": a.layout, "level": a.level, "array_size": array_size }),
    )?;
    println!("mdkit: grow {}: {}", a.name, d["grow"].as_str().unwrap_or("done"));
    for o in d["external_origins"].as_array().into_iter().flatten() {
        let vol = o["volume"].as_str().unwrap_or("?");
        match o["error"].as_str() {
            Some(e) => println!("mdkit: thin volume {vol}: its external origin's size was not read again: {e}"),
            None => println!("mdkit: thin volume {vol} reads its external origin up to byte {}", o["new_bytes"]),
        }
    }
    print!("{}", detail_text(&d["detail"], false));
    Ok(ExitCode::SUCCESS)
}
