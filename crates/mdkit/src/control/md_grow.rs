//! `md.grow` (mdadm --grow): name, size ("max" or bytes per member), raid_devices, bitmap
//! ("internal" | "none"), bitmap_chunk_bytes, write_behind (alone or with bitmap "internal"),
//! assume_clean, add (member specs), level (with layout: "preserve" or a layout name; the
//! takeovers md makes without moving data), and chunk_kib and/or layout alone (a raid4/5/6
//! restripe over the same members), array_size ("max" or bytes: md's array_size, in memory
//! only, which a reshape to fewer members needs first). One change per call, as mdadm does.

use std::sync::Arc;

use anyhow::{Result, anyhow, bail};
use mdkit_md::array::{BitmapChange, GrowChange, GrowSize, LayoutChoice};
use mdkit_md::layout::names::{parse_layout, parse_level};
use serde::Deserialize;
use serde_json::{Value, json};

use super::md::{as_md, md_volume, remember_members};
use crate::service::Service;
use crate::volumes::Volume;
use crate::volumes::in_use::users_of_volume;
use crate::volumes::md::{MemberOpen, open_members_in_service};
use crate::volumes::thin_origin::refresh_origins;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GrowArgs {
    name: String,
    size: Option<Value>,
    raid_devices: Option<u32>,
    bitmap: Option<String>,
    bitmap_chunk_bytes: Option<u64>,
    write_behind: Option<u32>,
    #[serde(default)]
    assume_clean: bool,
    #[serde(default)]
    add: Vec<String>,
    chunk_kib: Option<u32>,
    layout: Option<String>,
    level: Option<String>,
    array_size: Option<Value>,
}

/// `--array-size`: "max" (none) or a byte count.
fn array_size(a: &GrowArgs, v: &Value) -> Result<Option<u64>> {
    match v {
        Value::String(m) if m == "max" => Ok(None),
        Value::Number(n) => {
            Ok(Some(n.as_u64().ok_or_else(|| anyhow!("{}: array size {n}: not a byte count", a.name))?))
        }
        other => bail!("{}: array size {other}: use \"max\" or a byte count", a.name),
    }
}

/// `--chunk` and/or `--layout` alone: a restripe (the library refuses levels it cannot do).
fn restripe_change(a: &GrowArgs, level: &str) -> Result<GrowChange> {
    let chunk_sectors = a
        .chunk_kib
        .map(|k| k.checked_mul(2).ok_or_else(|| anyhow!("{}: --chunk {k} KiB is too large", a.name)))
        .transpose()?;
    let layout = match a.layout.as_deref() {
        None => None,
        Some(name) => {
            let l = parse_level(level).map_err(|e| anyhow!("{}: {e}", a.name))?;
            Some(parse_layout(l, name).map_err(|e| anyhow!("{}: --layout: {e}", a.name))?)
        }
    };
    Ok(GrowChange::Restripe { layout, chunk_sectors })
}

/// The one change asked for.
fn change(a: &GrowArgs, level: &str) -> Result<GrowChange> {
    let restripe = a.chunk_kib.is_some() || (a.layout.is_some() && a.level.is_none());
    let asked = [a.size.is_some(), a.raid_devices.is_some(), a.bitmap.is_some(), a.level.is_some(), restripe]
        .iter()
        .filter(|x| **x)
        .count();
    if asked != 1 {
        bail!(
            "{}: give one of --size, --raid-devices, --bitmap, --level, --chunk/--layout (mdadm changes one thing per --grow)",
            a.name
        );
    }
    if restripe {
        return restripe_change(a, level);
    }
    if let Some(l) = &a.level {
        let to = parse_level(l).map_err(|e| anyhow!("{}: --level: {e}", a.name))?;
        let layout = match a.layout.as_deref() {
            None => LayoutChoice::Default,
            Some("preserve") => LayoutChoice::Preserve,
            Some(name) => {
                LayoutChoice::Algorithm(parse_layout(to, name).map_err(|e| anyhow!("{}: --layout: {e}", a.name))?)
            }
        };
        return Ok(GrowChange::Level { level: to, layout });
    }
    if a.bitmap_chunk_bytes.is_some() && a.bitmap.as_deref() != Some("internal") {
        bail!("{}: --bitmap-chunk goes with --bitmap internal", a.name);
    }
    if a.assume_clean && a.size.is_none() {
        bail!("{}: --assume-clean goes with --size", a.name);
    }
    if let Some(s) = &a.size {
        let size = match s {
            Value::String(m) if m == "max" => GrowSize::Max,
            Value::Number(n) => {
                let b = n.as_u64().ok_or_else(|| anyhow!("size {n}: not a byte count"))?;
                if b == 0 || b % 1024 != 0 {
                    bail!("{}: --size {b} bytes is not a non-zero whole number of KiB", a.name);
                }
                GrowSize::Sectors(b / 512)
            }
            other => bail!("{}: size {other}: use \"max\" or a byte count", a.name),
        };
        return Ok(GrowChange::Size { size, assume_clean: a.assume_clean });
    }
    if let Some(n) = a.raid_devices {
        return Ok(GrowChange::RaidDevices(n));
    }
    match a.bitmap.as_deref() {
        Some("none") => Ok(GrowChange::Bitmap(BitmapChange::None)),
        Some("internal") => {
            let chunk_bytes = a
                .bitmap_chunk_bytes
                .map(|c| u32::try_from(c).map_err(|_| anyhow!("--bitmap-chunk {c} bytes is above 2 GiB")))
                .transpose()?;
            Ok(GrowChange::Bitmap(BitmapChange::Internal { chunk_bytes }))
        }
        Some(other) => bail!("{}: --bitmap {other:?}: use internal or none", a.name),
        None => bail!("{}: nothing to grow", a.name),
    }
}

/// Refuses to make array `name` smaller while another volume is built on it: a thin pool's
/// data or metadata past the new end would be gone (QA: `--array-size` then `--raid-devices 3`
/// under a live pool left it failed for good, "data device holds 2012 blocks but the metadata
/// maps 3024"), and pools never shrink.
async fn refuse_shrink_under_users(svc: &Service, name: &str, what: &str) -> Result<()> {
    let users = users_of_volume(&*svc.volumes.read().await, name, &svc.config.data_dir);
    if users.is_empty() {
        return Ok(());
    }
    bail!(
        "{name}: {what} would make the array smaller, but {} {} built on it and would lose what lies past \
         the new end (thin pools never shrink); nothing was changed",
        users.join(", "),
        if users.len() == 1 { "is" } else { "are" }
    )
}

pub async fn grow(svc: Arc<Service>, args: Value) -> Result<Value> {
    let a: GrowArgs = super::parse_args("md.grow", args)?;
    let v = md_volume(&svc, &json!({ "name": a.name })).await?;
    let vol = as_md(&v);
    let level = vol.array.info().level.name();
    if let Some(v) = &a.array_size {
        let others = a.size.is_some()
            || a.raid_devices.is_some()
            || a.bitmap.is_some()
            || a.level.is_some()
            || a.chunk_kib.is_some()
            || a.layout.is_some()
            || a.write_behind.is_some()
            || !a.add.is_empty();
        if others {
            bail!("{}: --array-size goes alone (mdadm changes one thing per --grow)", a.name);
        }
        let before = vol.array.size_bytes();
        let asked = array_size(&a, v)?;
        if asked.is_some_and(|b| b < before) {
            refuse_shrink_under_users(&svc, &a.name, "--array-size").await?;
        }
        let after = vol.array.set_array_size(asked)?;
        let summary = format!("array size {} KiB -> {} KiB", before / 1024, after / 1024);
        return Ok(
            json!({ "grow": summary, "size_bytes_before": before, "size_bytes_after": after, "detail": vol.details() }),
        );
    }
    if let Some(n) = a.write_behind {
        if a.bitmap.as_deref() == Some("none") {
            bail!("{}: --write-behind needs a write-intent bitmap, not --bitmap none", a.name);
        }
        if a.bitmap.is_none() {
            // Alone: only the bitmap's write_behind changes (md's bitmap/backlog, persisted).
            vol.array.set_write_behind(n).await?;
            return Ok(json!({ "grow": format!("write-behind {n}"), "detail": vol.details() }));
        }
    }
    let c = change(&a, level)?;
    if let GrowChange::Size { size: GrowSize::Sectors(s), .. } = c
        && s < vol.array.info().member_size_sectors
    {
        refuse_shrink_under_users(&svc, &a.name, "--size").await?;
    }
    if !a.add.is_empty() && !matches!(c, GrowChange::RaidDevices(_) | GrowChange::Level { .. }) {
        bail!("{}: --add goes with --raid-devices or --level", a.name);
    }
    let opened = if a.add.is_empty() {
        None
    } else {
        Some(open_members_in_service(&a.add, &svc.config.data_dir, &svc.volumes, MemberOpen::default()).await?)
    };
    let devs = opened.as_ref().map(|o| o.devs.clone()).unwrap_or_default();
    let report = vol.array.grow(c, devs).await?;
    if let Some(n) = a.write_behind {
        vol.array.set_write_behind(n).await?;
    }
    if let Some(level) = vol.array.level_after_reshape() {
        super::md::remember_then_level(&svc, &a.name, Some(level))?;
        super::md::forget_then_level_when_done(&svc, vol);
    }
    vol.finish_reshape_in_background();
    if let Some(o) = opened {
        vol.sources.lock().extend(o.devs.iter().map(|d| d.name.clone()).zip(o.sources));
        remember_members(&svc, vol)?;
    }
    // Thin volumes reading this array as their external origin take its new size.
    let spec = format!("volume:{}", a.name);
    let origins = refresh_origins(&*svc.volumes.read().await, |t| t.origin_spec() == Some(spec.as_str()));
    Ok(json!({
        "external_origins": origins,
        "grow": report.summary,
        "size_bytes_before": report.size_bytes_before,
        "size_bytes_after": report.size_bytes_after,
        "detail": vol.details(),
    }))
}
