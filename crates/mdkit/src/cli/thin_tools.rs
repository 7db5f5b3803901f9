//! `mdkit thin dump | restore | repair | delta | reserve-metadata-snap | release-metadata-snap`:
//! metadata tools compatible with thin-provisioning-tools (the XML of thin_dump, thin_restore,
//! thin_delta). Offline on a metadata device, or online on a running pool through a metadata
//! snapshot.
//!
//! ```text
//! mdkit thin dump METADATA-DEV|POOL [-o FILE] [--metadata-snap]
//! mdkit thin restore -i XML -o METADATA-DEV [--force]
//! mdkit thin repair -i DAMAGED -o NEW [--force] [--transaction-id N] [--nr-data-blocks N] [--json]
//! mdkit thin delta POOL A B [--metadata-snap] [--verbose | --json]
//! mdkit thin delta --metadata METADATA-DEV A B [--metadata-snap] [--verbose | --json]
//! mdkit thin reserve-metadata-snap POOL
//! mdkit thin release-metadata-snap POOL
//! ```
//! `dump` reads a metadata device when its argument names an existing path (or contains a
//! `/`), else it asks the running service for the pool of that name.

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use mdkit_thin::meta::delta::{self, DeltaHeader, DeltaSegment};
use mdkit_thin::meta::repair::{RepairOptions, RepairReport, salvage};
use mdkit_thin::meta::{
    FileMetaIo, MetaIo, OpenOptions, ThinMetadata, parse_xml, restore_xml, snapshot_xml_metadata, to_xml_metadata,
};
use serde_json::{Value, json};

use super::ControlArgs;
use crate::control::thin_tools::{header_from_json, segments_from_json};

#[derive(Subcommand, Debug)]
pub enum ToolVerb {
    /// Print pool metadata as thin_dump XML (a metadata device offline, or a running pool).
    Dump(DumpArgs),
    /// Write new metadata from thin_dump XML (thin_restore); the device is formatted.
    Restore(RestoreArgs),
    /// Salvage damaged metadata into new metadata on another device (thin_repair).
    Repair(RepairArgs),
    /// Blocks that differ between two thin devices (thin_delta XML, or JSON).
    Delta(DeltaArgs),
    /// Hold a metadata snapshot of a running pool (dm-thin reserve_metadata_snap).
    ReserveMetadataSnap(SnapPoolArgs),
    /// Release the running pool's metadata snapshot (dm-thin release_metadata_snap).
    ReleaseMetadataSnap(SnapPoolArgs),
}

#[derive(Args, Debug)]
pub struct DumpArgs {
    /// A metadata device or file (offline), or the name of a running pool.
    pub target: String,
    /// Write the XML to FILE instead of standard output.
    #[arg(short = 'o', long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Dump the held metadata snapshot (thin_dump -m) instead of the current metadata.
    #[arg(short = 'm', long)]
    pub metadata_snap: bool,
    #[command(flatten)]
    pub control: ControlArgs,
}

#[derive(Args, Debug)]
pub struct RestoreArgs {
    /// thin_dump XML (thin-provisioning-tools 0.9 or 1.x).
    #[arg(short = 'i', long, value_name = "XML")]
    pub input: PathBuf,
    /// Metadata device or file to write (a file is created with --size when missing).
    #[arg(short = 'o', long, value_name = "DEV")]
    pub output: PathBuf,
    /// Size of the metadata file to create when it does not exist (e.g. 16M).
    #[arg(long, value_name = "SIZE")]
    pub size: Option<String>,
    /// Overwrite a device that holds dm-thin metadata already.
    #[arg(long)]
    pub force: bool,
}

#[derive(Args, Debug)]
pub struct RepairArgs {
    /// The damaged metadata device (only read).
    #[arg(short = 'i', long, value_name = "DEV")]
    pub input: PathBuf,
    /// Where the new metadata goes (a file is created with the input's size when missing).
    #[arg(short = 'o', long, value_name = "DEV")]
    pub output: PathBuf,
    /// Overwrite an output that holds dm-thin metadata already.
    #[arg(long)]
    pub force: bool,
    /// Use at least this transaction id.
    #[arg(long, value_name = "N")]
    pub transaction_id: Option<u64>,
    /// Use at least this many data blocks.
    #[arg(long, value_name = "N")]
    pub nr_data_blocks: Option<u64>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct DeltaArgs {
    /// POOL A B, or A B with --metadata.
    #[arg(num_args = 2..=3, required = true, value_name = "POOL A B")]
    pub args: Vec<String>,
    /// Read this metadata device offline instead of a running pool.
    #[arg(long, value_name = "DEV")]
    pub metadata: Option<PathBuf>,
    /// Compare the devices as the held metadata snapshot records them (thin_delta -m).
    #[arg(short = 'm', long)]
    pub metadata_snap: bool,
    /// thin_delta --verbose XML (data blocks of every range).
    #[arg(long, conflicts_with = "json")]
    pub verbose: bool,
    /// JSON instead of XML.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub control: ControlArgs,
}

#[derive(Args, Debug)]
pub struct SnapPoolArgs {
    pub pool: String,
    #[command(flatten)]
    pub control: ControlArgs,
}

pub fn run(v: ToolVerb) -> Result<ExitCode> {
    match v {
        ToolVerb::Dump(a) => dump(a),
        ToolVerb::Restore(a) => restore(a),
        ToolVerb::Repair(a) => repair(a),
        ToolVerb::Delta(a) => delta_verb(a),
        ToolVerb::ReserveMetadataSnap(a) => {
            let v = a.control.client()?.call("thin.reserve-metadata-snap", json!({ "pool": a.pool }))?;
            println!("pool {}: metadata snapshot held at block {}", a.pool, v["held_root"]);
            Ok(ExitCode::SUCCESS)
        }
        ToolVerb::ReleaseMetadataSnap(a) => {
            a.control.client()?.call("thin.release-metadata-snap", json!({ "pool": a.pool }))?;
            println!("pool {}: metadata snapshot released", a.pool);
            Ok(ExitCode::SUCCESS)
        }
    }
}

//------------------------------------------------------------------------------------------------
// dump

fn is_device_path(target: &str) -> bool {
    target.contains('/') || Path::new(target).exists()
}

fn open_read_only(path: &Path) -> Result<ThinMetadata> {
    let io = FileMetaIo::open(path, false).with_context(|| format!("opening {}", path.display()))?;
    let opts = OpenOptions { read_only: true, ..OpenOptions::default() };
    ThinMetadata::open_with(Arc::new(io), opts).with_context(|| format!("reading the metadata on {}", path.display()))
}

fn dump(a: DumpArgs) -> Result<ExitCode> {
    let xml = if is_device_path(&a.target) {
        let md = open_read_only(Path::new(&a.target))?;
        let mut x = if a.metadata_snap { snapshot_xml_metadata(&md)? } else { to_xml_metadata(&md)? };
        // thin_dump never prints the attribute (restore drops the snapshot anyway).
        x.metadata_snap = None;
        x.to_xml_string()
    } else {
        let v = a.control.client()?.call("thin.dump", json!({ "pool": a.target, "metadata_snap": a.metadata_snap }))?;
        v["xml"].as_str().context("the service's thin.dump answer has no xml")?.to_string()
    };
    write_output(a.output.as_deref(), xml.as_bytes())?;
    Ok(ExitCode::SUCCESS)
}

fn write_output(path: Option<&Path>, bytes: &[u8]) -> Result<()> {
    match path {
        Some(p) => std::fs::write(p, bytes).with_context(|| format!("writing {}", p.display())),
        None => {
            let mut out = std::io::stdout().lock();
            out.write_all(bytes).and_then(|()| out.flush()).context("writing to standard output")
        }
    }
}

//------------------------------------------------------------------------------------------------
// restore / repair

/// Opens (or creates with `create_bytes`) the output metadata device for writing, refusing one
/// that holds dm-thin metadata unless `force`.
fn open_output(path: &Path, create_bytes: Option<u64>, force: bool) -> Result<FileMetaIo> {
    if !path.exists() {
        let Some(bytes) = create_bytes else {
            bail!("{} does not exist (give --size to create a metadata file)", path.display());
        };
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .with_context(|| format!("creating {}", path.display()))?;
        f.set_len(bytes).with_context(|| format!("sizing {}", path.display()))?;
    }
    let io = FileMetaIo::open(path, true)
        .with_context(|| format!("opening {} for writing", path.display()))
        .map_err(super::offline_writer_error)?;
    if !force && ThinMetadata::read_superblock(&io).is_ok() {
        bail!(
            "{} holds dm-thin metadata already; give --force to overwrite it (make sure no pool uses it)",
            path.display()
        );
    }
    Ok(io)
}

fn restore(a: RestoreArgs) -> Result<ExitCode> {
    let text = std::fs::read_to_string(&a.input).with_context(|| format!("reading {}", a.input.display()))?;
    let x = parse_xml(&text).with_context(|| format!("{}", a.input.display()))?;
    let size = a.size.as_deref().map(crate::config::parse_size).transpose().map_err(anyhow::Error::msg)?;
    let created = !a.output.exists();
    let io = open_output(&a.output, size, a.force)?;
    // A refused restore leaves an existing output as it was (the engine validates before
    // writing); a file made for it goes again.
    let md = restore_xml(Arc::new(io), &x, OpenOptions::default()).map_err(|e| {
        if created {
            let _ = std::fs::remove_file(&a.output);
        }
        anyhow::Error::new(e).context(format!("restoring {} to {}", a.input.display(), a.output.display()))
    })?;
    let st = md.status();
    println!(
        "restored {} devices, {} mappings to {} (transaction {}, {}/{} metadata blocks used)",
        x.devices.len(),
        x.mapping_table().len(),
        a.output.display(),
        st.transaction_id,
        st.used_metadata_blocks,
        st.total_metadata_blocks
    );
    Ok(ExitCode::SUCCESS)
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => (x.dev(), x.ino(), x.rdev()) == (y.dev(), y.ino(), y.rdev()),
        _ => false,
    }
}

fn repair(a: RepairArgs) -> Result<ExitCode> {
    if same_file(&a.input, &a.output) {
        bail!("input and output are the same device ({}); repair writes elsewhere", a.input.display());
    }
    let input = FileMetaIo::open(&a.input, false).with_context(|| format!("opening {}", a.input.display()))?;
    let opts = RepairOptions { transaction_id: a.transaction_id, nr_data_blocks: a.nr_data_blocks };
    let (x, report) = salvage(&input, opts).with_context(|| format!("salvaging {}", a.input.display()))?;
    let input_bytes = input.nr_blocks() * 4096;
    let io = open_output(&a.output, Some(input_bytes), a.force)?;
    restore_xml(Arc::new(io), &x, OpenOptions::default())
        .with_context(|| format!("writing the repaired metadata to {}", a.output.display()))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report_json(&report, &a.output))?);
    } else {
        print!("{report}");
        println!("wrote {}", a.output.display());
    }
    Ok(ExitCode::SUCCESS)
}

fn report_json(r: &RepairReport, output: &Path) -> Value {
    json!({
        "output": output.display().to_string(),
        "complete": r.is_complete(),
        "transaction_id": r.transaction_id,
        "time": r.time,
        "nr_data_blocks": r.nr_data_blocks,
        "mappings": r.mappings(),
        "devices": r.devices.iter().map(|d| json!({
            "dev_id": d.dev_id, "mapped_blocks": d.mapped_blocks, "details_found": d.details_found,
            "old_mapped_blocks": d.old_mapped_blocks,
        })).collect::<Vec<_>>(),
        "devices_dropped": r.devices_dropped,
        "lost": r.lost.iter().map(|l| json!({
            "tree": l.tree, "block": l.block, "key_begin": l.key_begin,
            "key_end": (l.key_end != u64::MAX).then_some(l.key_end), "reason": l.reason,
        })).collect::<Vec<_>>(),
        "mappings_dropped": r.mappings_dropped,
        "held_root_dropped": r.held_root_dropped,
    })
}

//------------------------------------------------------------------------------------------------
// delta

fn parse_id(s: &str) -> Result<u64> {
    s.parse().with_context(|| format!("thin device id {s:?} is not a number"))
}

fn delta_verb(a: DeltaArgs) -> Result<ExitCode> {
    let (header, left, right, segments) = match (&a.metadata, a.args.as_slice()) {
        (Some(path), [l, r]) => {
            let (left, right) = (parse_id(l)?, parse_id(r)?);
            let md = open_read_only(path)?;
            let (h, segs) = offline_delta(&md, left, right, a.metadata_snap)
                .with_context(|| format!("comparing devices {left} and {right} on {}", path.display()))?;
            (h, left, right, segs)
        }
        (None, [pool, l, r]) => {
            let (left, right) = (parse_id(l)?, parse_id(r)?);
            let v = a.control.client()?.call(
                "thin.delta",
                json!({ "pool": pool, "left": left, "right": right, "metadata_snap": a.metadata_snap }),
            )?;
            (header_from_json(&v["header"]), left, right, segments_from_json(&v["segments"])?)
        }
        (Some(_), _) => bail!("with --metadata give two thin device ids: A B"),
        (None, _) => bail!("give POOL A B (or --metadata DEV A B)"),
    };
    let text = if a.json {
        serde_json::to_string_pretty(&delta_json(&header, left, right, &segments))? + "\n"
    } else {
        delta::delta_xml(&header, left, right, &segments, a.verbose)
    };
    write_output(None, text.as_bytes())?;
    Ok(ExitCode::SUCCESS)
}

fn offline_delta(md: &ThinMetadata, left: u64, right: u64, snap: bool) -> Result<(DeltaHeader, Vec<DeltaSegment>)> {
    if snap {
        let sb = md.metadata_snap_superblock()?;
        let h = DeltaHeader {
            time: sb.time,
            transaction: sb.trans_id,
            data_block_size: sb.data_block_size_sectors,
            nr_data_blocks: md.nr_data_blocks(),
        };
        let (l, r) = (delta::snap_device_runs(md, left)?, delta::snap_device_runs(md, right)?);
        return Ok((h, delta::compare(&l, &r)));
    }
    let (l, r) = (delta::device_runs(md, left)?, delta::device_runs(md, right)?);
    Ok((DeltaHeader::of(md), delta::compare(&l, &r)))
}

/// JSON form: the coalesced ranges (as thin_delta's simple XML) with byte offsets, and totals.
fn delta_json(h: &DeltaHeader, left: u64, right: u64, segments: &[DeltaSegment]) -> Value {
    let block_bytes = u64::from(h.data_block_size) * 512;
    let ranges: Vec<Value> = delta::coalesce(segments)
        .into_iter()
        .map(|(kind, begin, length)| {
            json!({
                "kind": kind.as_str(), "begin_block": begin, "length_blocks": length,
                "offset_bytes": begin * block_bytes, "length_bytes": length * block_bytes,
            })
        })
        .collect();
    let totals: serde_json::Map<String, Value> =
        delta::totals(segments).iter().map(|(k, n)| (k.as_str().to_string(), json!(n))).collect();
    json!({
        "left": left,
        "right": right,
        "time": h.time,
        "transaction": h.transaction,
        "data_block_size_sectors": h.data_block_size,
        "data_block_bytes": block_bytes,
        "nr_data_blocks": h.nr_data_blocks,
        "totals_blocks": totals,
        "ranges": ranges,
    })
}
