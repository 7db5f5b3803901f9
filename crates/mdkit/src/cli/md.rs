//! The md verbs, with mdadm's names and flags:
//!
//! ```text
//! mdkit create NAME --level L --raid-devices N [--chunk K] [--layout X] [--bitmap internal|none]
//!              [--bitmap-chunk SIZE] [--write-behind[=N]] [--assume-clean] [--metadata 1.2] [--member-size SIZE]
//!              [--export E] [--force] MEMBER...
//! mdkit examine MEMBER... [--json]            (offline: reads the superblocks; files or NBD URIs)
//! mdkit assemble NAME MEMBER... [--uuid U] [--force] [--run] [--export E]
//! mdkit detail NAME [--json] | --scan
//! mdkit stop NAME
//! mdkit manage NAME --add|--fail|--remove|--re-add|--replace MEMBER [--with MEMBER] [--write-mostly]
//! mdkit attr NAME [KEY[=VALUE]]
//! ```
//! `create` goes through the running service when its control socket answers (the array starts
//! and can be exported); otherwise it writes the superblocks offline, like mdadm on stopped
//! devices, and `mdkit assemble` (or a `kind = "md"` volume) starts it later. Member paths are
//! made absolute from the current directory; `volume:NAME` names another volume of the service;
//! `nbd://HOST[:PORT]/EXPORT` and `nbd+unix:///EXPORT?socket=PATH` are members on NBD servers.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use serde_json::{Value, json};

use super::ControlArgs;
use crate::config::parse_size;
use crate::volumes::md::CreateParams;

#[derive(Args, Debug)]
pub struct CreateArgs {
    /// Array name (the volume name in the service).
    pub name: String,
    /// Member files or block devices, in role order (extra members become spares).
    #[arg(required = true, value_name = "MEMBER")]
    pub members: Vec<String>,
    /// raid0, raid1, raid4, raid5, raid6, raid10 (also 0, 1, 4, 5, 6, 10, stripe, mirror).
    #[arg(long, short = 'l')]
    pub level: String,
    /// Active members (default: all given).
    #[arg(long, short = 'n', value_name = "N")]
    pub raid_devices: Option<u32>,
    /// Chunk size: KiB, or with a unit (64K, 1M).
    #[arg(long, short = 'c', value_name = "SIZE")]
    pub chunk: Option<String>,
    /// Layout: raid10 n2/f2/o2, raid0 original/alternate, ...
    #[arg(long, short = 'p')]
    pub layout: Option<String>,
    /// internal or none (default: internal for redundant levels).
    #[arg(long, short = 'b')]
    pub bitmap: Option<String>,
    /// Write-intent bitmap chunk, as mdadm: KiB, or with a unit K, M, G, T (or s: 512-byte
    /// sectors); a power of two from 512 bytes to 2 GiB (default: mdadm's choice, 64 MiB or more).
    #[arg(long, value_name = "SIZE")]
    pub bitmap_chunk: Option<String>,
    /// raid1 with a bitmap: acknowledge writes once the members that are not write-mostly have
    /// them, with at most N (0..16383; 256 without a value, as mdadm) outstanding to the
    /// write-mostly ones.
    #[arg(long, value_name = "N", num_args = 0..=1, require_equals = true, default_missing_value = "256")]
    pub write_behind: Option<u32>,
    /// Do not resync the new array (the default when --member-size created every member file:
    /// fresh files are all zeroes).
    #[arg(long)]
    pub assume_clean: bool,
    /// Superblock format: 1.0, 1.1 or 1.2 (default).
    #[arg(long, short = 'e', value_name = "VERSION")]
    pub metadata: Option<String>,
    /// Create missing member files sparse with this size (512M, 1G, ...).
    #[arg(long, value_name = "SIZE")]
    pub member_size: Option<String>,
    /// Export the new array over NBD under this name (service mode only).
    #[arg(long, value_name = "EXPORT")]
    pub export: Option<String>,
    /// Overwrite members that already hold an md superblock.
    #[arg(long)]
    pub force: bool,
    #[command(flatten)]
    pub control: ControlArgs,
}

#[derive(Args, Debug)]
pub struct ExamineArgs {
    /// Member files or block devices, or members on NBD servers (`nbd://HOST[:PORT]/EXPORT`,
    /// `nbd+unix:///EXPORT?socket=PATH`).
    #[arg(required = true, value_name = "MEMBER")]
    pub members: Vec<PathBuf>,
    #[arg(long)]
    pub json: bool,
    /// List each member's bad-block log entries instead (like `mdadm --examine-badblocks`).
    #[arg(long)]
    pub badblocks: bool,
}

#[derive(Args, Debug)]
pub struct AssembleArgs {
    pub name: String,
    #[arg(required = true, value_name = "MEMBER")]
    pub members: Vec<String>,
    /// Assemble only the array with this UUID.
    #[arg(long)]
    pub uuid: Option<String>,
    /// Take stale members back when the array cannot run without them; start a dirty
    /// degraded array.
    #[arg(long, short = 'f')]
    pub force: bool,
    /// Start the array even with fewer members than were active when it last stopped.
    #[arg(long, short = 'R')]
    pub run: bool,
    #[arg(long, value_name = "EXPORT")]
    pub export: Option<String>,
    #[command(flatten)]
    pub control: ControlArgs,
}

#[derive(Args, Debug)]
pub struct NameArgs {
    pub name: String,
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub control: ControlArgs,
}

#[derive(Args, Debug)]
pub struct DetailArgs {
    #[arg(required_unless_present = "scan")]
    pub name: Option<String>,
    /// Every running array as an mdadm.conf ARRAY line (mdadm --detail --scan).
    #[arg(long, conflicts_with_all = ["name", "json"])]
    pub scan: bool,
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub control: ControlArgs,
}

#[derive(Args, Debug)]
pub struct ManageArgs {
    pub name: String,
    #[arg(long, short = 'a', value_name = "MEMBER", group = "action")]
    pub add: Option<String>,
    #[arg(long, short = 'f', value_name = "MEMBER", group = "action")]
    pub fail: Option<String>,
    #[arg(long, short = 'r', value_name = "MEMBER", group = "action")]
    pub remove: Option<String>,
    #[arg(long = "re-add", value_name = "MEMBER", group = "action")]
    pub re_add: Option<String>,
    #[arg(long, value_name = "MEMBER", group = "action")]
    pub replace: Option<String>,
    /// With --replace: the device to rebuild as the replacement (added as a spare first).
    #[arg(long, value_name = "MEMBER", requires = "replace")]
    pub with: Option<String>,
    /// With --add: create the member file sparse with this size if missing.
    #[arg(long, value_name = "SIZE")]
    pub member_size: Option<String>,
    /// With --add / --re-add: reads avoid the member while another copy is in sync (a slow or
    /// remote mirror); recorded in its superblock like mdadm's --write-mostly.
    #[arg(long)]
    pub write_mostly: bool,
    #[command(flatten)]
    pub control: ControlArgs,
}

#[derive(Args, Debug)]
pub struct AttrArgs {
    pub name: String,
    /// KEY to read, KEY=VALUE to set; nothing lists every attribute.
    pub attr: Option<String>,
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub control: ControlArgs,
}

/// Member specs as the service should see them: absolute paths (from the current directory),
/// `volume:NAME` or NBD URIs (`nbd://HOST[:PORT]/EXPORT`, `nbd+unix:///EXPORT?socket=PATH`).
pub(crate) fn absolute_members(members: &[String]) -> Result<Vec<String>> {
    let cwd = std::env::current_dir().context("current directory")?;
    Ok(members
        .iter()
        .map(|m| {
            if m.starts_with("volume:") || mdkit_io::is_nbd_uri(m) || Path::new(m).is_absolute() {
                m.clone()
            } else {
                cwd.join(m).display().to_string()
            }
        })
        .collect())
}

/// `--chunk`: a plain number is KiB (mdadm), or a size with a unit.
pub(super) fn parse_chunk_kib(s: &str) -> Result<u32> {
    let bytes = if s.chars().all(|c| c.is_ascii_digit()) {
        s.parse::<u64>().map_err(|_| anyhow!("--chunk {s:?}"))? * 1024
    } else {
        parse_size(s).map_err(|e| anyhow!("--chunk: {e}"))?
    };
    if bytes == 0 || bytes % 1024 != 0 {
        bail!("--chunk {s:?}: must be a whole number of KiB");
    }
    u32::try_from(bytes / 1024).map_err(|_| anyhow!("--chunk {s:?} is too large"))
}

/// Largest bitmap chunk: the bitmap superblock's `chunksize` is 32 bits and a power of two.
const BITMAP_CHUNK_MAX_BYTES: u64 = 1 << 31;

/// `--bitmap-chunk` with mdadm's parse_size rules: a positive whole number, then nothing or K
/// (KiB), M, G, T, or s (512-byte sectors); a power of two of at least one sector (md refuses
/// less than 512 bytes), at most 2 GiB (the superblock field is 32 bits).
fn parse_bitmap_chunk_bytes(s: &str) -> Result<u32> {
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().ok().filter(|n| *n > 0).ok_or_else(|| anyhow!("invalid bitmap chunksize: {s:?}"))?;
    let sectors_per_unit: u64 = match unit {
        "" | "K" => 2,
        "M" => 2 << 10,
        "G" => 2 << 20,
        "T" => 2 << 30,
        "s" => 1,
        _ => bail!("invalid bitmap chunksize: {s:?} (a number of KiB, or with K, M, G, T or s)"),
    };
    let sectors = n.checked_mul(sectors_per_unit).ok_or_else(|| anyhow!("invalid bitmap chunksize: {s:?}"))?;
    if !sectors.is_power_of_two() {
        bail!("invalid bitmap chunksize: {s:?} is not a power of two");
    }
    let bytes = sectors.saturating_mul(512);
    if bytes > BITMAP_CHUNK_MAX_BYTES {
        bail!("invalid bitmap chunksize: {s:?} is above the 2 GiB the bitmap superblock holds");
    }
    Ok(u32::try_from(bytes).expect("at most 2^31, checked above"))
}

/// `--chunk` where the level has no chunks (raid1): ignored with a warning, not an error.
fn chunk_for_level(level: &str, chunk_kib: Option<u32>) -> Option<u32> {
    match mdkit_md::layout::parse_level(level) {
        Ok(l) if chunk_kib.is_some() && !l.uses_chunks() => {
            eprintln!("mdkit: --chunk not meaningful with {} level: ignored", l.name());
            None
        }
        _ => chunk_kib,
    }
}

pub fn create(a: CreateArgs) -> Result<ExitCode> {
    let members = absolute_members(&a.members)?;
    let params = CreateParams {
        level: a.level.clone(),
        raid_devices: a.raid_devices,
        chunk_kib: chunk_for_level(&a.level, a.chunk.as_deref().map(parse_chunk_kib).transpose()?),
        layout: a.layout.clone(),
        bitmap: a.bitmap.clone(),
        bitmap_chunk_bytes: a.bitmap_chunk.as_deref().map(parse_bitmap_chunk_bytes).transpose()?,
        write_behind: a.write_behind,
        // Without the flag: resync, except on member files created just now (all zeroes).
        assume_clean: a.assume_clean.then_some(true),
        metadata: a.metadata.clone(),
    };
    let member_size =
        a.member_size.as_deref().map(parse_size).transpose().map_err(|e| anyhow!("--member-size: {e}"))?;
    match a.control.client() {
        Ok(mut c) => {
            let mut args = serde_json::to_value(&params)?;
            args["name"] = json!(a.name);
            args["members"] = json!(members);
            args["member_size_bytes"] = json!(member_size);
            args["export"] = json!(a.export);
            args["force"] = json!(a.force);
            let d = c.call("md.create", args)?;
            println!(
                "mdkit: array {} started ({}, {} members)",
                a.name,
                d["level"].as_str().unwrap_or("?"),
                d["raid_disks"]
            );
            print!("{}", detail_text(&d, false));
            Ok(ExitCode::SUCCESS)
        }
        Err(why) => {
            if a.export.is_some() {
                bail!("--export needs the running service ({why:#})");
            }
            create_offline(&a.name, &members, &params, member_size, a.force)
        }
    }
}

fn create_offline(
    name: &str,
    members: &[String],
    params: &CreateParams,
    member_size: Option<u64>,
    force: bool,
) -> Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting a runtime")?;
    // Refuse bad parameters before any member file is created.
    params.to_options(name, members.len(), false)?;
    rt.block_on(async {
        let vols = crate::volumes::Volumes::default();
        let how = crate::volumes::md::MemberOpen { create_size_bytes: member_size, ..Default::default() };
        let opened = crate::volumes::md::open_members(members, Path::new("/"), &vols, how)
            .await
            .map_err(super::offline_writer_error)?;
        if !force {
            for m in &opened.devs {
                if let Ok(sb) = mdkit_md::array::read_superblock(&m.dev).await {
                    bail!("{} already holds an md superblock (array {}); use --force to overwrite it", m.name, mdkit_md::format::format_uuid(&sb.set_uuid));
                }
                if let Some(what) = crate::volumes::signatures::probe(&*m.dev).await {
                    bail!("{} holds {what}; use --force to overwrite it", m.name);
                }
            }
        }
        let opts = params.to_options(name, opened.devs.len(), opened.all_created)?;
        let plan = mdkit_md::array::write_superblocks(&opened.devs, &opts).await?;
        println!(
            "mdkit: no service running: wrote {} superblocks (array {}, uuid {}); start it with `mdkit assemble {name} MEMBER...` or a kind = \"md\" volume",
            plan.members.len(),
            name,
            mdkit_md::format::format_uuid(&plan.members[0].superblock.set_uuid)
        );
        Ok(ExitCode::SUCCESS)
    })
}

//------------------------------------------------------------------------------------------------
// examine (offline)

/// One member's superblock as `mdadm --examine` prints it (or JSON), and the problems found
/// in its metadata (each naming the field); `Err` when there is no superblock.
fn examine_one(path: &Path, as_json: bool, badblocks: bool) -> Result<(String, Vec<String>)> {
    use mdkit_md::format::examine::{Examine, examine_member, render, render_bad_blocks, render_json_with};
    let member = super::member_reader::MemberReader::open(path)?;
    let sectors = member.sectors(path)?;
    let mut read_at = |offset: u64, buf: &mut [u8]| member.read_at(offset, buf);
    let m = examine_member(&mut read_at, sectors).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let sb = &m.lenient.superblock;
    let bad_blocks: Vec<Value> =
        m.bad_blocks.iter().map(|b| json!({ "sector": b.start_sector, "sectors": b.len_sectors })).collect();
    if badblocks && !as_json {
        let text = render_bad_blocks(&path.display().to_string(), sb, &m.bad_blocks);
        return Ok((text.trim_end().to_string(), m.problems));
    }
    let mut ex = Examine::new(sb, m.bitmap.as_ref(), sectors);
    ex.computed_checksum = Some(m.lenient.computed_checksum);
    if as_json {
        let mut v = render_json_with(&ex);
        v["device"] = json!(path.display().to_string());
        v["bad_blocks"] = json!(bad_blocks);
        if !m.problems.is_empty() {
            v["problems"] = json!(m.problems);
        }
        Ok((serde_json::to_string_pretty(&v)?, m.problems))
    } else {
        Ok((format!("{}:\n{}", path.display(), render(&ex)), m.problems))
    }
}

/// Prints each member's metadata; problems go to stderr (naming member, structure and field)
/// and make the exit status 1, like a member without a superblock.
pub fn examine(a: ExamineArgs) -> Result<ExitCode> {
    let mut code = ExitCode::SUCCESS;
    for m in &a.members {
        match examine_one(m, a.json, a.badblocks) {
            Ok((text, problems)) => {
                println!("{text}");
                for p in &problems {
                    eprintln!("mdkit: {}: {p}", m.display());
                }
                if !problems.is_empty() {
                    code = ExitCode::FAILURE;
                }
            }
            Err(e) => {
                eprintln!("mdkit: {e:#}");
                code = ExitCode::FAILURE;
            }
        }
    }
    Ok(code)
}

//------------------------------------------------------------------------------------------------
// service verbs

pub fn assemble(a: AssembleArgs) -> Result<ExitCode> {
    let members = absolute_members(&a.members)?;
    let d = a.control.client()?.call(
        "md.assemble",
        json!({ "name": a.name, "members": members, "uuid": a.uuid, "force": a.force, "run": a.run, "export": a.export }),
    )?;
    println!("mdkit: array {} assembled", a.name);
    for (member, reason) in left_out(&d) {
        eprintln!("mdkit: {}: member {member} left out: {reason}", a.name);
    }
    print!("{}", detail_text(&d, false));
    Ok(ExitCode::SUCCESS)
}

pub fn detail(a: DetailArgs) -> Result<ExitCode> {
    let Some(name) = &a.name else { return scan(&a.control) };
    let d = a.control.client()?.call("md.detail", json!({ "name": name }))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&d)?);
    } else {
        print!("{}", detail_text(&d, std::io::stdout().is_terminal()));
    }
    Ok(ExitCode::SUCCESS)
}

/// `detail --scan`: mdadm's ARRAY line for every running array (an array stopped between the
/// list and its detail is skipped).
fn scan(control: &ControlArgs) -> Result<ExitCode> {
    let mut client = control.client()?;
    let list = client.call("md.list", Value::Null)?;
    for a in list["arrays"].as_array().into_iter().flatten() {
        let Some(name) = a["name"].as_str() else { continue };
        let Ok(d) = client.call("md.detail", json!({ "name": name })) else { continue };
        println!("{}", array_line(name, &d));
    }
    Ok(ExitCode::SUCCESS)
}

/// `ARRAY NAME metadata=V name=SET_NAME UUID=U`, as mdadm --detail --scan prints it (the array
/// is named by its service name where mdadm gives the device path).
fn array_line(name: &str, d: &Value) -> String {
    let s = |k: &str| d[k].as_str().unwrap_or("").to_string();
    let mut line = format!("ARRAY {name} metadata={}", s("metadata"));
    if !s("set_name").is_empty() {
        line += &format!(" name={}", s("set_name"));
    }
    line + &format!(" UUID={}", s("uuid"))
}

pub fn stop(a: NameArgs) -> Result<ExitCode> {
    a.control.client()?.call("md.stop", json!({ "name": a.name }))?;
    println!("mdkit: stopped {}", a.name);
    Ok(ExitCode::SUCCESS)
}

pub fn manage(a: ManageArgs) -> Result<ExitCode> {
    let (action, member) = match (&a.add, &a.fail, &a.remove, &a.re_add, &a.replace) {
        (Some(m), ..) => ("add", m),
        (_, Some(m), ..) => ("fail", m),
        (_, _, Some(m), ..) => ("remove", m),
        (_, _, _, Some(m), _) => ("re-add", m),
        (.., Some(m)) => ("replace", m),
        _ => bail!("give one of --add, --fail, --remove, --re-add, --replace"),
    };
    if a.write_mostly && !matches!(action, "add" | "re-add") {
        bail!("--write-mostly goes with --add or --re-add");
    }
    // New devices are paths from here; members already in the array may be names.
    let member = if matches!(action, "add" | "re-add") {
        absolute_members(std::slice::from_ref(member))?.remove(0)
    } else {
        member.clone()
    };
    let with = a.with.as_ref().map(|w| absolute_members(std::slice::from_ref(w))).transpose()?.map(|mut v| v.remove(0));
    let member_size =
        a.member_size.as_deref().map(parse_size).transpose().map_err(|e| anyhow!("--member-size: {e}"))?;
    let d = a.control.client()?.call(
        "md.manage",
        json!({ "name": a.name, "action": action, "member": member, "with": with, "member_size_bytes": member_size,
                "write_mostly": a.write_mostly }),
    )?;
    println!("mdkit: {action} {member}: done");
    print!("{}", detail_text(&d, false));
    Ok(ExitCode::SUCCESS)
}

pub fn attr(a: AttrArgs) -> Result<ExitCode> {
    let args = match a.attr.as_deref() {
        None => json!({ "name": a.name }),
        // The last '=': member names may contain one (`dev-nbd+unix:///?socket=/s/state=faulty`);
        // attribute values never do.
        Some(kv) => match kv.rsplit_once('=') {
            Some((k, v)) => json!({ "name": a.name, "key": k, "value": v }),
            None => json!({ "name": a.name, "key": kv }),
        },
    };
    let v = a.control.client()?.call("md.attr", args)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(m) = v.as_object() {
        if m.len() == 1 && a.attr.is_some() {
            println!("{}", m.values().next().and_then(Value::as_str).unwrap_or(""));
        } else {
            let w = m.keys().map(String::len).max().unwrap_or(0);
            for (k, val) in m {
                println!("{k:<w$}  {}", val.as_str().unwrap_or(""));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

//------------------------------------------------------------------------------------------------
// detail rendering

fn human_bytes(b: u64) -> String {
    let mib = b as f64 / (1u64 << 20) as f64;
    let mb = b as f64 / 1e6;
    if b >= 1 << 30 {
        format!("{:.2} GiB {:.2} GB", mib / 1024.0, mb / 1000.0)
    } else {
        format!("{mib:.2} MiB {mb:.2} MB")
    }
}

/// A `/proc/mdstat` style progress line: `[====>......]  recovery = 42.1% (x/y) finish=1.2min speed=...K/sec`.
pub fn progress_line(sync: &Value, bar: bool) -> Option<String> {
    let action = sync["action"].as_str()?;
    if matches!(action, "idle" | "frozen") {
        return None;
    }
    let word = if action == "recover" { "recovery" } else { action };
    if sync.get("percent") == Some(&Value::Null) {
        // Decided but not started yet (md's sync_action already names it).
        return Some(format!("{word}=PENDING"));
    }
    let done = sync["done_sectors"].as_u64().unwrap_or(0);
    let total = sync["total_sectors"].as_u64().unwrap_or(0).max(1);
    let pct = done as f64 * 100.0 / total as f64;
    let eta = sync["eta_s"].as_u64().map_or("?".to_string(), |s| format!("{:.1}min", s as f64 / 60.0));
    let speed = sync["speed_kib"].as_u64().unwrap_or(0);
    let mut s = String::new();
    if bar {
        const WIDTH: usize = 20;
        let filled = ((pct / 100.0) * WIDTH as f64) as usize;
        s.push('[');
        s.push_str(&"=".repeat(filled.min(WIDTH)));
        if filled < WIDTH {
            s.push('>');
            s.push_str(&".".repeat(WIDTH - filled - 1));
        }
        s.push_str("]  ");
    }
    s.push_str(&format!("{word} = {pct:.1}% ({}/{}) finish={eta} speed={speed}K/sec", done / 2, total / 2));
    Some(s)
}

/// The members assembly left out, from `md.detail` JSON: (member, reason).
fn left_out(d: &Value) -> Vec<(String, String)> {
    let text = |v: &Value| v.as_str().unwrap_or("?").to_string();
    d["left_out"].as_array().into_iter().flatten().map(|r| (text(&r["member"]), text(&r["reason"]))).collect()
}

/// `mdadm --detail` style text from `md.detail` JSON.
pub fn detail_text(d: &Value, bar: bool) -> String {
    let s = |k: &str| d[k].as_str().unwrap_or("").to_string();
    let u = |k: &str| d[k].as_u64().unwrap_or(0);
    let mut o = String::new();
    let mut line = |k: &str, v: String| o.push_str(&format!("{k:>18} : {v}\n"));
    line("Version", s("metadata"));
    line("Raid Level", s("level"));
    line("Array Size", format!("{} KiB ({})", u("size_bytes") / 1024, human_bytes(u("size_bytes"))));
    if u("component_size_kib") > 0 {
        line(
            "Used Dev Size",
            format!("{} KiB ({})", u("component_size_kib"), human_bytes(u("component_size_kib") * 1024)),
        );
    }
    line("Raid Devices", u("raid_disks").to_string());
    line("Total Devices", u("total_devices").to_string());
    if !d["bitmap"].is_null() {
        line("Intent Bitmap", "Internal".into());
    }
    if let Some(w) = write_behind_text(&d["write_behind"]) {
        line("Write Behind", w);
    }
    line("State", s("state"));
    line("Active Devices", u("active_devices").to_string());
    line("Working Devices", u("working_devices").to_string());
    line("Failed Devices", u("failed_devices").to_string());
    line("Spare Devices", u("spare_devices").to_string());
    if !s("layout_name").is_empty() {
        line("Layout", s("layout_name"));
    }
    if u("chunk_kib") > 0 {
        line("Chunk Size", format!("{}K", u("chunk_kib")));
    }
    line("Consistency Policy", s("consistency_policy"));
    if let Some(p) = progress_line(&d["sync"], bar) {
        line("Sync Status", p);
    }
    if let Some(n) = d["sync"]["mismatch_cnt"].as_u64().filter(|n| *n > 0) {
        line("Mismatch Count", format!("{n} sectors"));
    }
    if let Some(b) = d["sync"]["copied_bytes"].as_u64().filter(|b| *b > 0) {
        let chunks = d["sync"]["copied_chunks"].as_u64().unwrap_or(0);
        line("Sync Copied", format!("{} ({chunks} bitmap chunks) by the last resync/recovery", human_bytes(b)));
    }
    if let Some(e) = d["sync"]["last_error"].as_str() {
        line("Last Sync Error", e.to_string());
    }
    if let Some(r) = d["needs_check"].as_str() {
        line("Needs Check", r.to_string());
    }
    line("Name", format!("{} ({})", s("name"), s("set_name")));
    line("UUID", s("uuid"));
    line("Events", u("events").to_string());
    o.push_str(&format!("\n{:>10} {:>10}   {:<28} {}\n", "Number", "RaidDevice", "State", "Member"));
    for m in d["members"].as_array().into_iter().flatten() {
        let role = m["role"].as_u64().map_or("-".to_string(), |r| r.to_string());
        let mut state: Vec<String> =
            m["state"].as_array().into_iter().flatten().filter_map(|x| x.as_str().map(str::to_string)).collect();
        if m["rebuilding"].as_bool().unwrap_or(false) {
            state.push(format!("rebuilding@{}", m["recovery_offset_sectors"].as_u64().unwrap_or(0)));
        }
        if let Some(n) = m["bad_blocks"].as_u64().filter(|n| *n > 0) {
            state.push(format!("bad_blocks={n}"));
        }
        o.push_str(&format!(
            "{:>10} {:>10}   {:<28} {}\n",
            m["dev_number"].as_u64().unwrap_or(0),
            role,
            state.join(","),
            m["name"].as_str().unwrap_or("")
        ));
    }
    for (member, reason) in left_out(d) {
        o.push_str(&format!("{:>10} {:>10}   {:<28} {member}: {reason}\n", "-", "-", "left out"));
    }
    for m in d["missing"].as_array().into_iter().flatten() {
        let (member, reason) = (m["member"].as_str().unwrap_or("?"), m["reason"].as_str().unwrap_or("?"));
        o.push_str(&format!("{:>10} {:>10}   {:<28} {member}: {reason}\n", "-", "-", "missing"));
    }
    o.push_str(&remote_links_text(d));
    o
}

/// `max N, W writes / B bytes outstanding (peak P)` when write-behind is on or writes are
/// still behind; `None` otherwise.
pub fn write_behind_text(w: &Value) -> Option<String> {
    let n = |k: &str| w[k].as_u64().unwrap_or(0);
    if w.is_null() || (n("limit") == 0 && n("outstanding_writes") == 0) {
        return None;
    }
    Some(format!(
        "max {}, {} writes / {} bytes outstanding (peak {}, {} failed)",
        n("limit"),
        n("outstanding_writes"),
        n("outstanding_bytes"),
        n("peak_writes"),
        n("failed_writes")
    ))
}

/// The `Remote links` section: one line per remote member.
fn remote_links_text(d: &Value) -> String {
    let links = d["remote_members"].as_array().into_iter().flatten();
    let mut o = String::new();
    for l in links {
        if o.is_empty() {
            o.push_str("\nRemote links\n");
        }
        let n = |k: &str| l[k].as_u64().unwrap_or(0);
        let mut line = format!("  {}  link {}", l["uri"].as_str().unwrap_or("?"), l["link"].as_str().unwrap_or("?"));
        if l["link"] != "missing" {
            line.push_str(&format!(
                ", last contact {} ms ago, outstanding {} requests / {} bytes, {} losses, {} reconnects",
                n("last_contact_age_ms"),
                n("outstanding_requests"),
                n("outstanding_bytes"),
                n("losses"),
                n("reconnects")
            ));
        }
        line.push_str(&format!(", {} automatic re-adds", n("auto_readds")));
        if let Some(e) = l["last_readd_error"].as_str() {
            line.push_str(&format!(", last re-add refused: {e}"));
        }
        o.push_str(&line);
        o.push('\n');
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_spellings() {
        assert_eq!(parse_chunk_kib("64").unwrap(), 64);
        assert_eq!(parse_chunk_kib("64K").unwrap(), 64);
        assert_eq!(parse_chunk_kib("1M").unwrap(), 1024);
        assert!(parse_chunk_kib("0").is_err());
        assert!(parse_chunk_kib("1.5M").is_err());
    }

    #[test]
    fn bitmap_chunk_spellings_follow_mdadm() {
        assert_eq!(parse_bitmap_chunk_bytes("64").unwrap(), 64 << 10, "no unit: KiB");
        assert_eq!(parse_bitmap_chunk_bytes("64K").unwrap(), 64 << 10);
        assert_eq!(parse_bitmap_chunk_bytes("4M").unwrap(), 4 << 20);
        assert_eq!(parse_bitmap_chunk_bytes("1G").unwrap(), 1 << 30);
        assert_eq!(parse_bitmap_chunk_bytes("2G").unwrap(), 1 << 31);
        assert_eq!(parse_bitmap_chunk_bytes("1s").unwrap(), 512);
        for bad in ["0", "", "-64", "48K", "3s", "1.5M", "64KiB", "4T", "1k", "M"] {
            let e = parse_bitmap_chunk_bytes(bad).unwrap_err().to_string();
            assert!(e.contains("invalid bitmap chunksize"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn chunk_is_dropped_only_where_the_level_has_none() {
        assert_eq!(chunk_for_level("raid1", Some(64)), None);
        assert_eq!(chunk_for_level("mirror", Some(64)), None);
        assert_eq!(chunk_for_level("raid5", Some(64)), Some(64));
        assert_eq!(chunk_for_level("raid10", Some(64)), Some(64));
        assert_eq!(chunk_for_level("raid1", None), None);
        assert_eq!(chunk_for_level("raid7", Some(64)), Some(64), "a bad level is reported by create");
    }

    #[test]
    fn progress_bar_and_detail_text() {
        let sync =
            json!({"action": "recover", "done_sectors": 500, "total_sectors": 1000, "speed_kib": 2000, "eta_s": 60});
        let p = progress_line(&sync, true).unwrap();
        assert!(
            p.starts_with("[==========>.........]  recovery = 50.0% (250/500) finish=1.0min speed=2000K/sec"),
            "{p}"
        );
        assert!(progress_line(&json!({"action": "idle"}), true).is_none());
        let pending = json!({"action": "resync", "done_sectors": 7, "total_sectors": 9, "percent": null});
        assert_eq!(progress_line(&pending, true).unwrap(), "resync=PENDING");
        let d = json!({"metadata": "1.2", "level": "raid1", "size_bytes": 1u64 << 30, "raid_disks": 2, "state": "clean, degraded, recovering",
            "sync": sync, "members": [{"dev_number": 0, "role": 0, "state": ["in_sync"], "name": "a.img"},
                                       {"dev_number": 2, "role": 1, "state": ["spare"], "rebuilding": true, "recovery_offset_sectors": 500, "name": "c.img"}]});
        let t = detail_text(&d, false);
        assert!(
            t.contains("Raid Level : raid1") && t.contains("recovery = 50.0%") && t.contains("rebuilding@500"),
            "{t}"
        );
    }
}
