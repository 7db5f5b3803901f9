//! md control commands (`mdkit create`, `assemble`, `detail`, `stop`, `manage`, `attr`) and the
//! record of arrays created or assembled at run time.
//!
//! | command       | args                                                                  |
//! |---------------|-----------------------------------------------------------------------|
//! | `md.create`   | name, members, level, raid_devices, chunk_kib, layout, bitmap,        |
//! |               | assume_clean, metadata, member_size_bytes, export, force              |
//! | `md.assemble` | name, members, uuid, force, run, export                               |
//! | `md.detail`   | name                                                                  |
//! | `md.stop`     | name                                                                  |
//! | `md.manage`   | name, action (add, fail, remove, re-add, replace), member, with,      |
//! |               | write_mostly (add, re-add)                                            |
//! | `md.grow`     | see `md_grow.rs` (size, raid_devices, bitmap, add, ...)               |
//! | `md.attr`     | name, key (optional), value (optional: set)                           |
//! | `md.list`     | —                                                                     |
//!
//! Members are paths (relative to the data directory), `volume:NAME` or NBD URIs. Arrays created or
//! assembled through these commands are remembered in `<data_dir>/md-arrays.json` (like
//! mdadm.conf: name, uuid, members, export) and assembled again when the service starts;
//! `md.stop` forgets them. One that fails to assemble at start is listed as failed (not
//! retried in a loop, not fatal to the service) until `md.stop` forgets it; one whose assembly
//! killed the process is not tried again (`volumes/open_guard.rs`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, anyhow, bail};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::Registry;
use crate::config::ExportSpec;
use crate::service::Service;
use crate::volumes::device_key::DeviceKey;
use crate::volumes::md::{
    CreateParams, MdVolume, MemberOpen, OpenedMembers, open_members_in_service, start_array, with_missing,
};
use crate::volumes::open_guard::OpenGuard;
use crate::volumes::{FailedVolume, Volume};
use mdkit_md::array::{AssembleOptions, PartialStart, assemble_with};

/// File (in the data directory) recording run-time arrays.
pub const STATE_FILE: &str = "md-arrays.json";

/// One remembered array.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Remembered {
    pub name: String,
    pub uuid: String,
    pub members: Vec<String>,
    #[serde(default)]
    pub export: Option<String>,
    /// The level to take the array to once its reshape finishes (a raid0 restripe runs as
    /// raid4: "raid0"), kept here so a restart mid-reshape still goes back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub then_level: Option<String>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct StateFile {
    arrays: Vec<Remembered>,
}

fn state_path(data_dir: &Path) -> PathBuf {
    data_dir.join(STATE_FILE)
}

fn load_state(data_dir: &Path) -> Result<StateFile> {
    let p = state_path(data_dir);
    match std::fs::read(&p) {
        Ok(b) => serde_json::from_slice(&b).with_context(|| format!("parsing {}", p.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(StateFile::default()),
        Err(e) => Err(e).with_context(|| format!("reading {}", p.display())),
    }
}

fn save_state(data_dir: &Path, st: &StateFile) -> Result<()> {
    let p = state_path(data_dir);
    let tmp = p.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(st)?).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &p).with_context(|| format!("renaming to {}", p.display()))?;
    Ok(())
}

fn remember(svc: &Service, r: Remembered) -> Result<()> {
    let mut st = load_state(&svc.config.data_dir)?;
    st.arrays.retain(|a| a.name != r.name);
    st.arrays.push(r);
    save_state(&svc.config.data_dir, &st)
}

fn forget(svc: &Service, name: &str) -> Result<()> {
    let mut st = load_state(&svc.config.data_dir)?;
    let before = st.arrays.len();
    st.arrays.retain(|a| a.name != name);
    if st.arrays.len() != before { save_state(&svc.config.data_dir, &st) } else { Ok(()) }
}

/// Updates the remembered members of `name`, if it is remembered.
pub(crate) fn remember_members(svc: &Service, vol: &MdVolume) -> Result<()> {
    let mut st = load_state(&svc.config.data_dir)?;
    if let Some(a) = st.arrays.iter_mut().find(|a| a.name == vol.name) {
        a.members = vol.member_sources();
        save_state(&svc.config.data_dir, &st)?;
    }
    Ok(())
}

/// Records (or clears) the level `name` goes to after its reshape, if it is remembered.
pub(crate) fn remember_then_level(svc: &Service, name: &str, level: Option<mdkit_md::layout::Level>) -> Result<()> {
    let mut st = load_state(&svc.config.data_dir)?;
    let want = level.map(|l| l.name().to_string());
    if let Some(a) = st.arrays.iter_mut().find(|a| a.name == name && a.then_level != want) {
        a.then_level = want;
        save_state(&svc.config.data_dir, &st)?;
    }
    Ok(())
}

/// Once `vol`'s reshape and the level change after it are done, the state file forgets the
/// level to go to.
pub(crate) fn forget_then_level_when_done(svc: &Arc<Service>, vol: &MdVolume) {
    let svc = svc.clone();
    let name = vol.name.clone();
    vol.on_reshape_done(Box::new(move || {
        if let Err(e) = remember_then_level(&svc, &name, None) {
            tracing::error!(array = %name, "{STATE_FILE}: {e:#}");
        }
    }));
}

pub fn register(r: &mut Registry) {
    r.register("md.create", "create an md array on members and start it (mdadm --create)", |svc, args| {
        Box::pin(async move { create(svc, args).await })
    });
    r.register("md.assemble", "assemble an md array from members and start it (mdadm --assemble)", |svc, args| {
        Box::pin(async move { assemble(svc, args).await })
    });
    r.register("md.detail", "an md array's state, members and progress (mdadm --detail)", |svc, args| {
        Box::pin(async move { Ok(md_volume(&svc, &args).await?.details()) })
    });
    r.register("md.stop", "stop an md array: flush, mark clean, forget it (mdadm --stop)", |svc, args| {
        Box::pin(async move { stop(svc, args).await })
    });
    r.register("md.manage", "add / fail / remove / re-add / replace a member (mdadm --manage)", |svc, args| {
        Box::pin(async move { manage(svc, args).await })
    });
    r.register("md.grow", "grow an md array: size, bitmap, raid1 mirrors (mdadm --grow)", |svc, args| {
        Box::pin(async move { super::md_grow::grow(svc, args).await })
    });
    r.register("md.attr", "get all, get one or set an md attribute (sysfs names: sync_action, ...)", |svc, args| {
        Box::pin(async move { attr(svc, args).await })
    });
    r.register("md.list", "the running md arrays", |svc, args| {
        Box::pin(async move {
            super::no_args("md.list", &args)?;
            let vols = svc.volumes.read().await;
            let arrays: Vec<Value> = vols
                .iter()
                .filter_map(|v| v.as_any().downcast_ref::<MdVolume>())
                .map(|m| json!({"name": m.name, "level": m.array.info().level.name(), "state": v_state(m)}))
                .collect();
            Ok(json!({ "arrays": arrays }))
        })
    });
}

fn v_state(m: &MdVolume) -> String {
    crate::volumes::md::state_word(&m.array)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NameArg {
    name: String,
}

pub(crate) async fn md_volume(svc: &Service, args: &Value) -> Result<Arc<dyn Volume>> {
    let a: NameArg = super::parse_args("md.detail", args.clone())?;
    let vols = svc.volumes.read().await;
    let v = vols.get(&a.name).ok_or_else(|| match vols.get_failed(&a.name) {
        Some(f) => anyhow!("volume {:?} failed to open: {} (`mdkit stop {}` forgets it)", a.name, f.error, a.name),
        None => anyhow!("no volume named {:?}", a.name),
    })?;
    if v.as_any().downcast_ref::<MdVolume>().is_none() {
        bail!("volume {:?} is a {} volume, not an md array", a.name, v.kind());
    }
    Ok(v.clone())
}

pub(crate) fn as_md(v: &Arc<dyn Volume>) -> &MdVolume {
    // Invariant: md_volume() only returns volumes that downcast to MdVolume.
    v.as_any().downcast_ref::<MdVolume>().expect("md_volume checked the kind")
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateArgs {
    name: String,
    members: Vec<String>,
    #[serde(flatten)]
    params: CreateParams,
    member_size_bytes: Option<u64>,
    export: Option<String>,
    #[serde(default)]
    force: bool,
}

impl CreateArgs {
    /// `md.create`'s arguments. serde's `flatten` hides which key a wrong value was given for;
    /// then the [`CreateParams`] keys alone are parsed again to name it.
    fn parse(args: Value) -> Result<CreateArgs> {
        super::parse_args("md.create", args.clone()).map_err(|e| {
            let mut params = args.as_object().cloned().unwrap_or_default();
            for k in ["name", "members", "member_size_bytes", "export", "force"] {
                params.remove(k);
            }
            match super::parse_args::<CreateParams>("md.create", Value::Object(params)) {
                Err(named) if named.to_string().contains("bad arguments: `") => named,
                _ => e,
            }
        })
    }
}

async fn create(svc: Arc<Service>, args: Value) -> Result<Value> {
    let a = CreateArgs::parse(args)?;
    super::check_name("array name", &a.name)?;
    // Held until the array is registered: a second request for the name is refused before it
    // opens a member (it used to write its superblocks first).
    let _claim = svc.volumes.read().await.claim(&a.name)?;
    if svc.volumes.read().await.contains(&a.name) {
        bail!("a volume named {:?} already exists", a.name);
    }
    let _export_claim = match &a.export {
        Some(e) => Some(super::check_new_export(&svc, e).await?),
        None => None,
    };
    // Refuse bad parameters before any member file is created.
    a.params.to_options(&a.name, a.members.len(), false)?;
    let how = MemberOpen { create_size_bytes: a.member_size_bytes, ..MemberOpen::default() };
    let mut opened = open_members_in_service(&a.members, &svc.config.data_dir, &svc.volumes, how).await?;
    // Held until the array is registered: no other request opens these members meanwhile.
    let _members = opened.take_claim();
    let assembled = match create_on(&a, &opened).await {
        Ok(assembled) => assembled,
        Err(e) => {
            // Refused after opening: the member files made for it go again.
            opened.discard();
            return Err(e);
        }
    };
    let vol = MdVolume::new(&a.name, assembled.array, opened);
    install(&svc, vol, a.export).await
}

/// Writes the new array onto the opened members, unless a member is in use or (without
/// --force) holds an md superblock, a file system or another known signature already.
async fn create_on(a: &CreateArgs, opened: &OpenedMembers) -> Result<mdkit_md::array::Assembled> {
    if !a.force {
        for m in &opened.devs {
            if let Ok(sb) = mdkit_md::array::read_superblock(&m.dev).await {
                bail!(
                    "member {} already holds an md superblock (array {}, {}); use --force to overwrite it",
                    m.name,
                    mdkit_md::format::format_uuid(&sb.set_uuid),
                    sb.name()
                );
            }
            if let Some(what) = crate::volumes::signatures::probe(&*m.dev).await {
                bail!("member {} holds {what}; use --force to overwrite it", m.name);
            }
        }
    }
    let opts = a.params.to_options(&a.name, opened.devs.len(), opened.all_created)?;
    Ok(mdkit_md::array::create(opened.devs.clone(), opts).await?)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AssembleArgs {
    name: String,
    members: Vec<String>,
    uuid: Option<String>,
    #[serde(default)]
    force: bool,
    /// Start with fewer members than were active at the last stop (mdadm --run).
    #[serde(default)]
    run: bool,
    export: Option<String>,
}

async fn assemble(svc: Arc<Service>, args: Value) -> Result<Value> {
    let a: AssembleArgs = super::parse_args("md.assemble", args)?;
    super::check_name("array name", &a.name)?;
    // Assembly writes the members' superblocks: claimed first, as for create.
    let _claim = svc.volumes.read().await.claim(&a.name)?;
    if svc.volumes.read().await.contains(&a.name) {
        bail!("a volume named {:?} already exists", a.name);
    }
    let _export_claim = match &a.export {
        Some(e) => Some(super::check_new_export(&svc, e).await?),
        None => None,
    };
    let uuid = match &a.uuid {
        Some(u) => Some(mdkit_md::format::parse_uuid(u).ok_or_else(|| anyhow!("uuid {u:?} is not 32 hex digits"))?),
        None => None,
    };
    let how = MemberOpen { allow_unreachable: true, ..MemberOpen::default() };
    let mut opened = open_members_in_service(&a.members, &svc.config.data_dir, &svc.volumes, how).await?;
    // Held until the array is registered: no other request opens these members meanwhile.
    let _members = opened.take_claim();
    let opts = AssembleOptions { name: a.name.clone(), force: a.force, uuid, ..AssembleOptions::default() };
    let partial = if a.run { PartialStart::Allowed } else { PartialStart::NeedsRun };
    let missing: Vec<String> = opened.remote.iter().filter_map(|m| m.missing_reason().map(str::to_string)).collect();
    let assembled =
        assemble_with(opened.devs.clone(), opts, partial).await.map_err(|e| with_missing(e.into(), &missing))?;
    for r in &assembled.refused {
        tracing::warn!(array = %a.name, "member left out: {r}");
    }
    for n in &assembled.notes {
        tracing::info!(array = %a.name, "{n}");
    }
    let vol = MdVolume::new(&a.name, assembled.array, opened);
    drop_left_out_sources(&vol);
    install(&svc, vol, a.export).await
}

/// Forgets where the members assembly left out came from: they are not part of the array, so
/// they may be re-added or used elsewhere, and the state file does not list them.
fn drop_left_out_sources(vol: &MdVolume) {
    let left_out = vol.left_out_names();
    vol.sources.lock().retain(|(n, _)| !left_out.contains(n));
}

/// Registers a started array as a volume, exports it when asked, remembers it.
async fn install(svc: &Arc<Service>, vol: Arc<MdVolume>, export: Option<String>) -> Result<Value> {
    let name = vol.name.clone();
    let uuid = mdkit_md::format::format_uuid(&vol.array.info().uuid);
    let members = vol.member_sources();
    svc.volumes.write().await.insert(vol.clone())?;
    if let Some(e) = &export {
        let spec = ExportSpec {
            name: e.clone(),
            volume: name.clone(),
            read_only: false,
            description: format!("md array {name}"),
        };
        if let Err(err) = svc.add_export(spec).await {
            tracing::warn!(array = %name, "export {e:?} not added: {err:#}");
        }
    }
    remember(svc, Remembered { name: name.clone(), uuid, members, export, then_level: None })?;
    Ok(vol.details())
}

/// Assembles the arrays remembered in the state file (service start-up). An array that fails
/// to start (error or panic) stays remembered and is listed as failed, with its export; the
/// service starts without it and `md.stop` forgets it.
pub async fn restore(svc: &Arc<Service>) {
    let st = match load_state(&svc.config.data_dir) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("md arrays not restored: {e:#}");
            return;
        }
    };
    let mut guard = OpenGuard::load_or_empty(&svc.config.data_dir);
    for r in st.arrays {
        if svc.volumes.read().await.contains(&r.name) {
            tracing::warn!(array = %r.name, "remembered md array has the name of a configured volume; skipped");
            continue;
        }
        let started = if guard.crashed(&r.name) {
            Err(OpenGuard::crashed_error())
        } else {
            let start = crate::volumes::catch_panic(start_remembered(svc, &r));
            guard
                .guarded(&svc.config.data_dir, &r.name, start)
                .await
                .unwrap_or_else(|panic| Err(anyhow!("assembling panicked: {panic}")))
        };
        match started {
            Ok(()) => tracing::info!(array = %r.name, "remembered md array assembled"),
            Err(e) => {
                let error = format!("remembered md array not assembled: {e:#}");
                let origin = crate::volumes::Origin::Remembered;
                svc.volume_failed(FailedVolume { name: r.name.clone(), kind: "md".into(), origin, error }).await;
            }
        }
        if let Some(e) = &r.export {
            let spec = ExportSpec {
                name: e.clone(),
                volume: r.name.clone(),
                read_only: false,
                description: format!("md array {}", r.name),
            };
            if let Err(err) = svc.add_export(spec).await {
                tracing::error!(array = %r.name, "export {e:?} not added: {err:#}");
            }
        }
    }
}

/// Assembles one remembered array and registers it.
async fn start_remembered(svc: &Arc<Service>, r: &Remembered) -> Result<()> {
    let uuid = mdkit_md::format::parse_uuid(&r.uuid).ok_or_else(|| anyhow!("bad uuid {:?} in {STATE_FILE}", r.uuid))?;
    let how = MemberOpen { allow_unreachable: true, ..MemberOpen::default() };
    let mut opened = open_members_in_service(&r.members, &svc.config.data_dir, &svc.volumes, how).await?;
    let _members = opened.take_claim();
    let vol = start_array(&r.name, opened, None, Some(uuid), false).await?;
    if let Some(l) = &r.then_level {
        resume_then_level(svc, &vol, l);
    }
    svc.volumes.write().await.insert(vol)
}

/// A raid0 restripe stopped mid-way goes back to raid0 when its reshape finishes. Anything
/// else in `then_level` (mdkit writes only "raid0"), or no reshape running, is logged and
/// forgotten: the array serves as it is and `grow --level` changes it.
fn resume_then_level(svc: &Arc<Service>, vol: &MdVolume, l: &str) {
    let set = match mdkit_md::layout::parse_level(l) {
        Ok(level @ mdkit_md::layout::Level::Raid0) => {
            vol.array.set_level_after_reshape(level).map_err(|e| e.to_string())
        }
        Ok(other) => Err(format!("{STATE_FILE}: then_level {:?} is not a level mdkit goes back to", other.name())),
        Err(e) => Err(format!("{STATE_FILE}: then_level: {e}")),
    };
    match set {
        Ok(()) => forget_then_level_when_done(svc, vol),
        Err(e) => {
            tracing::warn!(array = %vol.name, "{e}; not going to {l} by itself (grow --level does)");
            if let Err(e) = remember_then_level(svc, &vol.name, None) {
                tracing::error!(array = %vol.name, "{STATE_FILE}: {e:#}");
            }
        }
    }
}

async fn stop(svc: Arc<Service>, args: Value) -> Result<Value> {
    let a: NameArg = super::parse_args("md.stop", args.clone())?;
    if let Some(exports) = svc.forget_failed(&a.name).await {
        forget(&svc, &a.name)?;
        OpenGuard::clear_crashed(&svc.config.data_dir, &a.name)?;
        return Ok(json!({ "stopped": a.name, "was_failed": true, "exports_removed": exports }));
    }
    let v = md_volume(&svc, &args).await?;
    let name = v.name().to_string();
    {
        let vols = svc.volumes.read().await;
        for other in vols.iter() {
            if let Some(m) = other.as_any().downcast_ref::<MdVolume>()
                && m.member_sources().iter().any(|s| s == &format!("volume:{name}"))
            {
                bail!("md array {:?} is a member of {:?}; stop that first", name, m.name);
            }
        }
    }
    let exports: Vec<String> =
        svc.exports.read().await.iter().filter(|e| e.volume == name).map(|e| e.name.clone()).collect();
    let stats = svc.nbd.export_stats();
    for e in &exports {
        if stats.iter().any(|(n, s)| n == e && s.connections > 0) {
            bail!("export {e:?} of {name:?} has clients connected; disconnect them first");
        }
    }
    for e in &exports {
        svc.nbd.remove_export(e);
    }
    svc.exports.write().await.retain(|e| e.volume != name);
    let vol = svc.volumes.write().await.remove(&name).ok_or_else(|| anyhow!("volume {name:?} vanished"))?;
    vol.close().await?;
    forget(&svc, &name)?;
    Ok(json!({ "stopped": name, "exports_removed": exports }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ManageArgs {
    name: String,
    action: String,
    member: String,
    with: Option<String>,
    member_size_bytes: Option<u64>,
    /// With add / re-add: the member is write-mostly (reads avoid it).
    #[serde(default)]
    write_mostly: bool,
}

/// The member name for `spec`: a member name, or the device it was opened from however spelt
/// (`./m3` and `m3` relative to the data directory, an absolute path, a link, a loop device).
fn resolve_member(vol: &MdVolume, spec: &str, data_dir: &Path) -> Option<String> {
    let src = vol.sources.lock();
    if let Some((n, _)) = src.iter().find(|(n, _)| n == spec) {
        return Some(n.clone());
    }
    let key = DeviceKey::new(spec, data_dir);
    src.iter().find(|(_, s)| key.same(&DeviceKey::new(s, data_dir))).map(|(n, _)| n.clone())
}

async fn manage(svc: Arc<Service>, args: Value) -> Result<Value> {
    let a: ManageArgs = super::parse_args("md.manage", args)?;
    let v = md_volume(&svc, &json!({ "name": a.name })).await?;
    let vol = as_md(&v);
    drop_left_out_sources(vol);
    let open_new = async |spec: &str| -> Result<_> {
        let how = MemberOpen { create_size_bytes: a.member_size_bytes, ..MemberOpen::default() };
        let mut o = open_members_in_service(&[spec.to_string()], &svc.config.data_dir, &svc.volumes, how).await?;
        // Keep member names unique within the array.
        let existing: Vec<String> = vol.sources.lock().iter().map(|(n, _)| n.clone()).collect();
        if existing.contains(&o.devs[0].name) {
            o.devs[0].name = o.sources[0].clone();
        }
        Ok(o)
    };
    match a.action.as_str() {
        "add" | "re-add" => {
            if let Some(m) = resolve_member(vol, &a.member, &svc.config.data_dir)
                && vol.array.core().slots().find(&m).is_some_and(|x| x.is_faulty())
            {
                bail!("{}: member {m} is still in the array (faulty); --remove it first, then --{}", a.name, a.action);
            }
            let o = open_new(&a.member).await?;
            let dev = o.devs[0].clone();
            if a.action == "add" {
                vol.array.add_member(dev.clone()).await?;
            } else {
                vol.array.re_add_member(dev.clone()).await?;
            }
            vol.sources.lock().push((dev.name.clone(), o.sources[0].clone()));
            for m in o.remote {
                if let Some(d) = m.device() {
                    vol.remote.register(&m.uri, &dev.name, d);
                }
            }
            if a.write_mostly {
                vol.array.set_write_mostly(&dev.name, true).await?;
            }
        }
        "fail" | "remove" => {
            let left_out = || vol.array.left_out().into_iter().map(|r| r.member).find(|n| *n == a.member);
            let m = resolve_member(vol, &a.member, &svc.config.data_dir)
                .or_else(|| (a.action == "remove").then(left_out).flatten())
                .ok_or_else(|| anyhow!("{}: no member {:?}", a.name, a.member))?;
            if a.action == "fail" {
                vol.array.fail_member(&m).await?;
            } else {
                vol.array.remove_member(&m).await?;
                vol.sources.lock().retain(|(n, _)| n != &m);
                vol.remote.forget(&m);
            }
        }
        "replace" => {
            let m = resolve_member(vol, &a.member, &svc.config.data_dir)
                .ok_or_else(|| anyhow!("{}: no member {:?}", a.name, a.member))?;
            let with = match &a.with {
                Some(w) => {
                    let o = open_new(w).await?;
                    Some((o.devs[0].clone(), o.sources[0].clone()))
                }
                None => None,
            };
            let replaced = vol.array.replace_member(&m, with.as_ref().map(|(dev, _)| dev.clone())).await;
            // Recorded only if the array holds the device: a refused replace (the member is a
            // spare, the device too small) must not leave it listed as in use by this array.
            if let Some((dev, source)) = with
                && vol.array.core().slots().all_members().iter().any(|x| x.name() == dev.name)
            {
                vol.sources.lock().push((dev.name, source));
            }
            replaced?;
        }
        other => bail!("action {other:?}: use add, fail, remove, re-add or replace"),
    }
    remember_members(&svc, vol)?;
    Ok(vol.details())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AttrArgs {
    name: String,
    key: Option<String>,
    value: Option<String>,
}

async fn attr(svc: Arc<Service>, args: Value) -> Result<Value> {
    let a: AttrArgs = super::parse_args("md.attr", args)?;
    let v = md_volume(&svc, &json!({ "name": a.name })).await?;
    let vol = as_md(&v);
    match (a.key, a.value) {
        (None, _) => {
            let m: serde_json::Map<String, Value> =
                vol.array.attributes().into_iter().map(|(k, v)| (k, Value::String(v))).collect();
            Ok(Value::Object(m))
        }
        (Some(k), None) => Ok(json!({ k.clone(): vol.array.get_attribute(&k)? })),
        (Some(k), Some(val)) => {
            vol.array.set_attribute(&k, &val)?;
            if k.ends_with("/bad_blocks") {
                // As md's bad_blocks store: recorded in the member's log before the answer.
                vol.array.core().update_superblocks("bad block recorded").await?;
            }
            Ok(json!({ k.clone(): vol.array.get_attribute(&k).unwrap_or(val) }))
        }
    }
}
