//! md's sysfs-named attributes (`/sys/block/mdX/md/*`), read and written by name, and the
//! `mdadm --detail` view as JSON.
//!
//! Readable: `array_state level raid_disks chunk_size layout component_size array_size degraded
//! sync_action last_sync_action sync_completed sync_speed sync_speed_min sync_speed_max mismatch_cnt
//! resync_start safe_mode_delay metadata_version uuid events consistency_policy
//! max_read_errors`, per member `dev-NAME/{state,slot,errors,recovery_start,offset,size,bad_blocks}`
//! (`errors`: sectors corrected after read errors, as md), `bitmap/*`, the personality's
//! (`stripe_cache_size`, ...), and beyond md: `mismatch_ranges` (sectors of the sync domain),
//! `needs_check`, `last_sync_error`.
//!
//! `sync_action` reads as md's: `frozen` first, then the running or pending action (a requested
//! check/repair, a resync or recovery the array state calls for, before the engine starts it),
//! else `idle`; `last_sync_action` is the last action started (`idle` before any).
//!
//! Writable: `array_size` (KiB or `default`: the size the array gives, in memory only, as md's),
//! `sync_action` (idle frozen check repair resync recover; levels without redundancy
//! refuse every value with EINVAL, as md), `sync_speed_min`,
//! `sync_speed_max` (KiB/s, or `system` for md's defaults), `safe_mode_delay` (seconds),
//! `max_read_errors` (raid1/raid10 read-error fix attempts before a member is failed),
//! `dev-NAME/bad_blocks` ("SECTOR LENGTH" adds a bad block, as md), `dev-NAME/state` (`faulty`, `remove`, `want_replacement`, `-want_replacement`,
//! `writemostly`, `-writemostly`), `bitmap/*` (time_base, backlog, max_backlog_used (resets), can_clear, flush_chunks, idle_region_bytes),
//! `flush_batching`, and the personality's writable attributes.

use std::io;
use std::time::Duration;

use serde_json::{Value, json};

use super::Array;
use super::core::ArrayCore;
use super::member::flag;
use super::sync::{self, DEFAULT_SPEED_MAX_KIB, DEFAULT_SPEED_MIN_KIB};
use crate::format::format_uuid;
use crate::format::superblock::MAX_SECTOR;
use crate::layout::{Level, format_layout};

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

fn array_state(core: &ArrayCore) -> &'static str {
    if core.is_broken() {
        "broken"
    } else if core.needs_check().is_some() {
        "readonly"
    } else if core.gate.is_active() {
        "active"
    } else {
        "clean"
    }
}

fn consistency_policy(core: &ArrayCore) -> &'static str {
    if !core.personality().has_redundancy() {
        "none"
    } else if core.bitmap.is_some() {
        "bitmap"
    } else {
        "resync"
    }
}

fn ranges_text(ranges: &[std::ops::Range<u64>], truncated: bool) -> String {
    if ranges.is_empty() {
        return "none".into();
    }
    let mut s: Vec<String> = ranges.iter().map(|r| format!("{}-{}", r.start, r.end)).collect();
    if truncated {
        s.push("...".into());
    }
    s.join(",")
}

/// Every attribute and its value.
pub fn all(core: &ArrayCore, size_bytes: u64) -> Vec<(String, String)> {
    let info = core.info();
    let st = sync::status(core);
    let mut v: Vec<(String, String)> = vec![
        ("array_state".into(), array_state(core).into()),
        ("level".into(), info.level.name().into()),
        ("raid_disks".into(), info.raid_disks.to_string()),
        ("chunk_size".into(), (u64::from(info.chunk_sectors) * 512).to_string()),
        ("layout".into(), info.layout.to_string()),
        ("component_size".into(), (info.member_size_sectors / 2).to_string()),
        ("array_size".into(), (size_bytes / 1024).to_string()),
        ("degraded".into(), core.degraded().to_string()),
        ("sync_action".into(), st.action.into()),
        ("last_sync_action".into(), st.last_action.map_or("idle", |m| m.as_str()).into()),
        (
            "sync_completed".into(),
            if st.running.is_some() || st.action == "reshape" {
                format!("{} / {}", st.done_sectors, st.total_sectors)
            } else {
                "none".into()
            },
        ),
        (
            "sync_speed".into(),
            if st.running.is_some() || st.action == "reshape" { st.speed_kib.to_string() } else { "none".into() },
        ),
        ("sync_speed_min".into(), core.sync.speed_min_kib().to_string()),
        ("sync_speed_max".into(), core.sync.speed_max_kib().to_string()),
        ("mismatch_cnt".into(), st.mismatch_sectors.to_string()),
        ("mismatch_ranges".into(), ranges_text(&st.mismatch_ranges, st.mismatch_ranges_truncated)),
        (
            "resync_start".into(),
            match core.resync_checkpoint() {
                MAX_SECTOR => "none".into(),
                s => s.to_string(),
            },
        ),
        ("safe_mode_delay".into(), format!("{:.3}", core.gate.safe_mode_delay().as_secs_f64())),
        ("metadata_version".into(), info.metadata.as_str().into()),
        ("uuid".into(), format_uuid(&info.uuid)),
        ("events".into(), core.sb.events().to_string()),
        ("consistency_policy".into(), consistency_policy(core).into()),
        ("needs_check".into(), core.needs_check().unwrap_or_else(|| "no".into())),
        ("last_sync_error".into(), st.last_error.unwrap_or_else(|| "none".into())),
        ("max_read_errors".into(), core.max_read_errors().to_string()),
    ];
    let slots = core.slots();
    for m in slots.all_members() {
        let role = slots.role_of(&m);
        let p = format!("dev-{}", m.name());
        v.push((format!("{p}/state"), m.state_words(role.is_some()).join(",")));
        v.push((format!("{p}/slot"), role.map_or("none".into(), |r| r.to_string())));
        v.push((format!("{p}/errors"), m.corrected_reads().to_string()));
        let rs = if m.is_in_sync() || role.is_none() || m.is_faulty() {
            "none".into()
        } else {
            m.recovery_offset().to_string()
        };
        v.push((format!("{p}/recovery_start"), rs));
        v.push((format!("{p}/offset"), m.data_offset_sectors.to_string()));
        v.push((format!("{p}/size"), (m.data_size_sectors / 2).to_string()));
        v.push((format!("{p}/bad_blocks"), bad_block_lines(&m)));
    }
    if let Some(bm) = &core.bitmap {
        let b = core.behind.stats();
        v.extend(bm.attributes().into_iter().map(|(k, val)| match k {
            "bitmap/max_backlog_used" => (k.to_string(), b.peak_writes.to_string()),
            _ => (k.to_string(), val),
        }));
        v.push(("bitmap/behind_writes".into(), b.outstanding_writes.to_string()));
        v.push(("bitmap/behind_bytes".into(), b.outstanding_bytes.to_string()));
    }
    v.extend(core.flusher.attributes().into_iter().map(|(k, val)| (k.to_string(), val)));
    v.extend(core.personality().attributes().into_iter().map(|(k, val)| (k.to_string(), val)));
    v
}

/// md's `dev-*/bad_blocks`: one "sector length" line per log entry (absolute member sectors).
fn bad_block_lines(m: &super::Member) -> String {
    let (entries, _) = m.bad_blocks().snapshot();
    entries.iter().map(|b| format!("{} {}\n", b.start_sector, b.len_sectors)).collect()
}

/// md's bb_store: "SECTOR LENGTH" (absolute member sectors) adds an entry, persisted by the
/// next superblock round. Only for members with a bad-block log.
fn add_bad_block(core: &ArrayCore, member: &str, value: &str) -> io::Result<()> {
    let m = core
        .slots()
        .find(member)
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("{}: no member {member:?}", core.name())))?;
    let usage = || invalid(format!("dev-{member}/bad_blocks: {value:?}: write \"SECTOR LENGTH\" (member sectors)"));
    let mut it = value.split_whitespace();
    let (Some(s), Some(n), None) = (it.next(), it.next(), it.next()) else { return Err(usage()) };
    let (Ok(sector), Ok(len)) = (s.parse::<u64>(), n.parse::<u64>()) else { return Err(usage()) };
    if len == 0 || sector.checked_add(len).is_none_or(|end| end * 512 > m.device().topology().size_bytes) {
        return Err(usage());
    }
    if !m.bad_blocks().set(sector, len) {
        return Err(io::Error::new(
            io::ErrorKind::StorageFull,
            format!("{}: {member}: no bad-block log, or the log is full", core.name()),
        ));
    }
    core.wake.notify_one();
    Ok(())
}

/// One attribute.
pub fn get(core: &ArrayCore, size_bytes: u64, name: &str) -> io::Result<String> {
    all(core, size_bytes)
        .into_iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v)
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("{}: no attribute {name:?}", core.name())))
}

fn parse_speed(name: &str, value: &str, system: u64) -> io::Result<u64> {
    let v = value.trim();
    if v == "system" {
        return Ok(system);
    }
    v.parse::<u64>().map_err(|_| invalid(format!("{name}: {value:?} is not a number of KiB/s (or \"system\")")))
}

/// Sets one attribute.
pub fn set(array: &Array, name: &str, value: &str) -> io::Result<()> {
    let core = &array.core();
    let value = value.trim();
    match name {
        "array_size" => {
            // md's array_size_store: "default" or KiB.
            let bytes = match value {
                "default" => None,
                v => Some(
                    v.parse::<u64>()
                        .ok()
                        .and_then(|k| k.checked_mul(1024))
                        .ok_or_else(|| invalid(format!("{}: array_size {v:?}: use default or KiB", core.name())))?,
                ),
            };
            array.set_array_size(bytes).map(|_| ())
        }
        "sync_action" => {
            // md's action_store: a personality without sync_request (raid0) refuses every
            // value with EINVAL.
            if !core.personality().has_redundancy() {
                return Err(invalid(format!(
                    "{}: sync_action {value:?}: {} has no redundancy to resync, recover or check",
                    core.name(),
                    core.info().level.name()
                )));
            }
            array.request_sync(value)
        }
        "sync_speed_min" => {
            core.sync.set_speed_min_kib(parse_speed(name, value, DEFAULT_SPEED_MIN_KIB)?);
            Ok(())
        }
        "sync_speed_max" => {
            let v = parse_speed(name, value, DEFAULT_SPEED_MAX_KIB)?;
            if v == 0 {
                return Err(invalid("sync_speed_max must be at least 1 KiB/s".into()));
            }
            core.sync.set_speed_max_kib(v);
            Ok(())
        }
        "max_read_errors" => {
            let n: u64 = value.parse().map_err(|_| invalid(format!("max_read_errors: {value:?} is not a number")))?;
            if n == 0 {
                return Err(invalid("max_read_errors must be at least 1".into()));
            }
            core.set_max_read_errors(n);
            Ok(())
        }
        "safe_mode_delay" => {
            let secs: f64 =
                value.parse().map_err(|_| invalid(format!("safe_mode_delay: {value:?} is not a number of seconds")))?;
            if !(0.0..=3600.0).contains(&secs) {
                return Err(invalid(format!("safe_mode_delay {secs} s is outside 0..3600")));
            }
            core.gate.set_safe_mode_delay(Duration::from_secs_f64(secs.max(0.001)));
            core.wake.notify_one();
            Ok(())
        }
        _ if name.starts_with("dev-") && name.ends_with("/bad_blocks") => {
            add_bad_block(core, &name[4..name.len() - 11], value)
        }
        _ if name.starts_with("dev-") && name.ends_with("/state") => {
            let member = &name[4..name.len() - 6];
            let m = core.slots().find(member).ok_or_else(|| {
                io::Error::new(io::ErrorKind::NotFound, format!("{}: no member {member:?}", core.name()))
            })?;
            match value {
                "faulty" => {
                    if !core.fail_member(&m, "failed by request") {
                        return Err(io::Error::new(
                            io::ErrorKind::ResourceBusy,
                            format!("{}: {member}: the array cannot run without it", core.name()),
                        ));
                    }
                    core.wake.notify_one();
                    Ok(())
                }
                "want_replacement" => {
                    m.set(flag::WANT_REPLACEMENT);
                    core.sync.not_idle();
                    core.sync_wake.notify_one();
                    Ok(())
                }
                "-want_replacement" => {
                    m.clear(flag::WANT_REPLACEMENT);
                    Ok(())
                }
                "writemostly" => {
                    m.set(flag::WRITE_MOSTLY);
                    Ok(())
                }
                "-writemostly" => {
                    m.clear(flag::WRITE_MOSTLY);
                    Ok(())
                }
                "remove" => Err(invalid(format!(
                    "{}: use `mdkit manage {} --remove {member}` (it writes the superblocks)",
                    core.name(),
                    core.name()
                ))),
                other => Err(invalid(format!(
                    "{name}: {other:?}: use faulty, want_replacement, -want_replacement, writemostly, -writemostly"
                ))),
            }
        }
        "bitmap/max_backlog_used" if core.bitmap.is_some() => {
            // md's behind_writes_used_reset: any write starts the peak over.
            core.behind.reset_peak();
            Ok(())
        }
        _ => {
            if let Some(r) = core.personality().set_attribute(name, value) {
                return r;
            }
            if let Some(r) = core.flusher.set_attribute(name, value) {
                return r;
            }
            if name.starts_with("bitmap/")
                && let Some(bm) = &core.bitmap
                && let Some(r) = bm.set_attribute(name, value)
            {
                return r;
            }
            if all(core, array.size_bytes()).iter().any(|(k, _)| k == name) {
                Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!("{}: attribute {name} is read-only", core.name()),
                ))
            } else {
                Err(io::Error::new(io::ErrorKind::NotFound, format!("{}: no attribute {name:?}", core.name())))
            }
        }
    }
}

/// `mdadm --detail` as JSON.
pub fn detail(core: &ArrayCore, size_bytes: u64) -> Value {
    let info = core.info();
    let st = sync::status(core);
    let slots = core.slots();
    let degraded = core.degraded();
    let mut state = vec![array_state(core).to_string()];
    if degraded > 0 {
        state.push("degraded".into());
    }
    match st.running {
        Some(super::SyncMode::Resync) => state.push("resyncing".into()),
        Some(super::SyncMode::Recover) => state.push("recovering".into()),
        Some(super::SyncMode::Check) => state.push("checking".into()),
        Some(super::SyncMode::Repair) => state.push("repairing".into()),
        None if core.personality().reshape().is_some_and(|r| !r.is_done()) => state.push("reshaping".into()),
        None if core.resync_checkpoint() != MAX_SECTOR => state.push("resync pending".into()),
        None => {}
    }
    if st.action == "frozen" {
        state.push("frozen".into());
    }
    let members: Vec<Value> = slots
        .all_members()
        .iter()
        .map(|m| {
            let role = slots.role_of(m);
            let replacement = m.has(flag::REPLACEMENT);
            json!({
                "name": m.name(),
                "dev_number": m.dev_number,
                "role": role,
                "state": m.state_words(role.is_some()),
                "rebuilding": role.is_some() && !m.is_in_sync() && !m.is_faulty(),
                "replacement": replacement,
                "recovery_offset_sectors": if m.is_in_sync() || role.is_none() { Value::Null } else { json!(m.recovery_offset()) },
                "read_errors": m.read_errors(),
                "read_errors_decayed": m.fix_attempts(),
                "read_errors_in_a_row": m.consecutive_read_errors(),
                "corrected_reads": m.corrected_reads(),
                "bad_blocks": m.bad_blocks().entries(),
                "bad_sectors": m.bad_blocks().sectors(),
                "bad_block_log": m.bad_blocks().has_log(),
                "fail_reason": m.fail_reason(),
                "data_offset_sectors": m.data_offset_sectors,
                "data_size_sectors": m.data_size_sectors,
                "in_flight": m.in_flight(),
            })
        })
        .collect();
    let count = |f: &dyn Fn(&super::Member) -> bool| slots.all_members().iter().filter(|m| f(m)).count();
    let percent = if st.total_sectors > 0 { st.done_sectors as f64 * 100.0 / st.total_sectors as f64 } else { 0.0 };
    json!({
        "name": core.name(),
        "uuid": format_uuid(&info.uuid),
        "set_name": info.set_name,
        "metadata": info.metadata.as_str(),
        "level": info.level.name(),
        "raid_disks": info.raid_disks,
        "layout": info.layout,
        "layout_name": if matches!(info.level, Level::Raid1) { String::new() } else { format_layout(info.level, info.layout) },
        "chunk_kib": info.chunk_sectors / 2,
        "size_bytes": size_bytes,
        "component_size_kib": info.member_size_sectors / 2,
        "ctime": crate::format::superblock::md_time_seconds(info.ctime),
        "events": core.sb.events(),
        "state": state.join(", "),
        "array_state": array_state(core),
        "consistency_policy": consistency_policy(core),
        "degraded": degraded,
        "total_devices": slots.all_members().len(),
        "active_devices": (0..slots.raid_disks()).filter(|r| slots.in_sync(*r).is_some()).count(),
        "working_devices": count(&|m| !m.is_faulty()),
        "failed_devices": count(&|m| m.is_faulty()),
        "spare_devices": count(&|m| !m.is_faulty() && !m.is_in_sync()),
        "needs_check": core.needs_check(),
        "broken": core.broken_reason(),
        "unrecoverable_reads": core.unrecoverable_reads(),
        "reshape": core.personality().reshape().map(|r| json!({
            "position_sectors": r.position_sectors(),
            "raid_disks_before": r.state().old_raid_disks,
            "raid_disks_after": r.state().new_raid_disks,
            "size_bytes_after": r.new_array_sectors() * 512,
        })),
        "sync": {
            "action": st.action,
            "done_sectors": st.done_sectors,
            "total_sectors": st.total_sectors,
            "percent": if st.running.is_some() || st.action == "reshape" { json!(percent) } else { Value::Null },
            "speed_kib": st.speed_kib,
            "eta_s": st.eta.map(|d| d.as_secs()),
            "mismatch_cnt": st.mismatch_sectors,
            "copied_chunks": st.copied_chunks,
            "copied_bytes": st.copied_sectors * 512,
            "mismatch_ranges": st.mismatch_ranges.iter().map(|r| json!([r.start, r.end])).collect::<Vec<_>>(),
            "last_error": st.last_error,
            "resync_start": if core.resync_checkpoint() == MAX_SECTOR { Value::Null } else { json!(core.resync_checkpoint()) },
            "speed_min_kib": core.sync.speed_min_kib(),
            "speed_max_kib": core.sync.speed_max_kib(),
        },
        "write_behind": core.bitmap.as_ref().map(|b| {
            let wb = core.behind.stats();
            json!({
                "limit": b.write_behind(),
                "outstanding_writes": wb.outstanding_writes,
                "outstanding_bytes": wb.outstanding_bytes,
                "peak_writes": wb.peak_writes,
                "completed_writes": wb.completed_writes,
                "failed_writes": wb.failed_writes,
                "slot_waits": wb.slot_waits,
            })
        }),
        "bitmap": core.bitmap.as_ref().map(|b| {
            let h = b.header();
            let st = b.stats();
            json!({
                "chunk_bytes": h.chunk_bytes,
                "chunks": b.geometry().chunks(),
                "dirty_chunks": st.dirty_chunks,
                "needed_chunks": st.needed_chunks,
                "events": h.events,
                "events_cleared": h.events_cleared,
            })
        }),
        "members": members,
    })
}
