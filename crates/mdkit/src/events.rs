//! Events with `mdadm --monitor`'s names, for `mdkit monitor`.
//!
//! ```text
//!   watcher task (every POLL_INTERVAL) ── diff of volume state ──► EventBus (bounded broadcast)
//!                                                                   ├─► log (tracing)
//!                                                                   └─► monitor.stream clients
//! ```
//!
//! The watcher polls cheap state (md member flags, sync progress, thin pool status) and turns
//! changes into events, the way `mdadm --monitor` polls /proc/mdstat; nothing on the data path
//! waits for it. A subscriber that falls more than [`BUS_CAPACITY`] events behind loses the
//! oldest ones and is told how many it missed.
//!
//! Departures from mdadm, on purpose: `DegradedArray` is also raised when a running array
//! becomes degraded (mdadm only raises it at first sight and relies on `Fail`), and a thin pool
//! raises `LowWater`, `OutOfDataSpace`, `NeedsCheck` and `ReadOnly` (dm-thin's events).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;

use crate::service::Service;
use crate::volumes::Volume;
use crate::volumes::md::MdVolume;
use crate::volumes::thin::ThinPoolVolume;
use mdkit_thin::pool::PoolMode;

/// Events a subscriber may fall behind by before it loses the oldest.
pub const BUS_CAPACITY: usize = 256;
/// How often the watcher looks at the volumes.
pub const POLL_INTERVAL: Duration = Duration::from_millis(150);
/// `RebuildNN` steps, as mdadm's default `--increment 20`.
const REBUILD_STEP_PERCENT: u64 = 20;

/// Events mdadm mails (the others only go to the program and the log).
pub const MAILED: [&str; 5] = ["Fail", "FailSpare", "DegradedArray", "SparesMissing", "TestMessage"];

/// One event.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Event {
    /// Milliseconds since the Unix epoch.
    pub time_unix_ms: u64,
    /// mdadm's event name (`Fail`, `DegradedArray`, `Rebuild40`, ...).
    pub event: String,
    pub volume: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub member: Option<String>,
    #[serde(default)]
    pub detail: String,
    /// `"thin-pool"` for a pool's events (the message says "thin pool"); absent for md arrays.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_kind: Option<String>,
}

impl Event {
    pub fn new(event: &str, volume: &str, member: Option<&str>, detail: impl Into<String>) -> Event {
        let time_unix_ms = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
        Event {
            time_unix_ms,
            event: event.to_string(),
            volume: volume.to_string(),
            member: member.map(str::to_string),
            detail: detail.into(),
            device_kind: None,
        }
    }

    /// The same event, about a thin pool.
    pub fn on_thin_pool(self) -> Event {
        Event { device_kind: Some("thin-pool".to_string()), ..self }
    }

    /// mdadm's message: `EVENT event detected on md device MD[, component device X][: detail]`
    /// (`on thin pool POOL` for a pool).
    pub fn message(&self) -> String {
        let device = if self.device_kind.as_deref() == Some("thin-pool") { "thin pool" } else { "md device" };
        let mut s = format!("{} event detected on {device} {}", self.event, self.volume);
        if let Some(m) = &self.member {
            s.push_str(&format!(", component device {m}"));
        }
        if !self.detail.is_empty() {
            s.push_str(&format!(": {}", self.detail));
        }
        s
    }
}

/// The service's event bus: bounded broadcast, never blocks the sender.
pub struct EventBus {
    tx: broadcast::Sender<Event>,
}

impl Default for EventBus {
    fn default() -> Self {
        EventBus { tx: broadcast::channel(BUS_CAPACITY).0 }
    }
}

impl EventBus {
    /// Logs `ev` and hands it to every subscriber (none is fine).
    pub fn emit(&self, ev: Event) {
        log(&ev);
        let _ = self.tx.send(ev);
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.tx.subscribe()
    }
}

/// Writes `ev` to the log, at mdadm's syslog priority.
pub fn log(ev: &Event) {
    let msg = ev.message();
    match ev.event.as_str() {
        "Fail" | "FailSpare" | "DegradedArray" | "DeviceDisappeared" | "OutOfDataSpace" | "NeedsCheck" => {
            tracing::error!(event = %ev.event, volume = %ev.volume, "{msg}")
        }
        "NewArray" | "SpareActive" | "TestMessage" => tracing::info!(event = %ev.event, volume = %ev.volume, "{msg}"),
        _ => tracing::warn!(event = %ev.event, volume = %ev.volume, "{msg}"),
    }
}

//------------------------------------------------------------------------------------------------
// Volume state snapshots

/// What the watcher remembers of one md member.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MemberState {
    InSync,
    Spare,
    Faulty,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct MdState {
    members: BTreeMap<String, MemberState>,
    degraded: u64,
    needs_check: bool,
    /// The running sync action and its progress in percent.
    sync: Option<(String, u64)>,
    mismatch_sectors: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct PoolState {
    mode: PoolMode,
    needs_check: bool,
    low_water: bool,
    out_of_data_space: bool,
    reason: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    Md(MdState),
    Pool(PoolState),
}

fn md_state(m: &MdVolume) -> MdState {
    let d = m.array.detail();
    let mut members = BTreeMap::new();
    for mem in d["members"].as_array().into_iter().flatten() {
        let Some(name) = mem["name"].as_str() else { continue };
        let words: Vec<&str> = mem["state"].as_array().into_iter().flatten().filter_map(|w| w.as_str()).collect();
        let st = if words.contains(&"faulty") {
            MemberState::Faulty
        } else if words.contains(&"in_sync") {
            MemberState::InSync
        } else {
            MemberState::Spare
        };
        members.insert(name.to_string(), st);
    }
    let st = m.array.sync_status();
    let sync = st.running.map(|mode| {
        let percent = (st.done_sectors.saturating_mul(100)).checked_div(st.total_sectors).unwrap_or(0);
        (format!("{mode:?}").to_lowercase(), percent.min(100))
    });
    let core = m.array.core();
    MdState {
        members,
        degraded: core.degraded() as u64,
        needs_check: core.needs_check().is_some(),
        sync,
        mismatch_sectors: st.mismatch_sectors,
    }
}

async fn pool_state(p: &ThinPoolVolume) -> Option<PoolState> {
    let st = p.pool().status().await.ok()?;
    Some(PoolState {
        mode: st.mode,
        needs_check: st.needs_check,
        low_water: st.low_water_reached,
        out_of_data_space: st.out_of_data_space,
        reason: st.mode_reason,
    })
}

async fn snapshot(v: &Arc<dyn Volume>) -> Option<State> {
    if let Some(m) = v.as_any().downcast_ref::<MdVolume>() {
        return Some(State::Md(md_state(m)));
    }
    let p = v.as_any().downcast_ref::<ThinPoolVolume>()?;
    pool_state(p).await.map(State::Pool)
}

/// The state of every md array and thin pool.
async fn snapshot_all(svc: &Service) -> BTreeMap<String, State> {
    let vols: Vec<Arc<dyn Volume>> = svc.volumes.read().await.iter().cloned().collect();
    let mut out = BTreeMap::new();
    for v in vols {
        if let Some(s) = snapshot(&v).await {
            out.insert(v.name().to_string(), s);
        }
    }
    out
}

//------------------------------------------------------------------------------------------------
// Diffs into events

/// Events for a volume seen for the first time (also what `--oneshot` reports, minus NewArray).
fn first_sight(name: &str, s: &State, new_array: bool) -> Vec<Event> {
    let mut ev = Vec::new();
    match s {
        State::Md(m) => {
            if new_array {
                ev.push(Event::new("NewArray", name, None, ""));
            }
            if m.degraded > 0 {
                ev.push(Event::new("DegradedArray", name, None, format!("{} member(s) missing", m.degraded)));
            }
            if m.needs_check {
                ev.push(Event::new("NeedsCheck", name, None, "the array needs a check"));
            }
        }
        State::Pool(p) => ev.extend(pool_events(name, None, p)),
    }
    ev
}

fn md_events(name: &str, old: &MdState, new: &MdState) -> Vec<Event> {
    let mut ev = Vec::new();
    for (member, st) in &new.members {
        let before = old.members.get(member).copied();
        match (before, st) {
            (Some(MemberState::InSync), MemberState::Faulty) => ev.push(Event::new("Fail", name, Some(member), "")),
            (Some(MemberState::Spare), MemberState::Faulty) => ev.push(Event::new("FailSpare", name, Some(member), "")),
            (Some(MemberState::Spare), MemberState::InSync) => {
                ev.push(Event::new("SpareActive", name, Some(member), ""))
            }
            // Re-added (a remote member whose link returned, or one missing at the start) and
            // caught up between two polls: the short way from failed or absent to in sync.
            (Some(MemberState::Faulty) | None, MemberState::InSync) => {
                ev.push(Event::new("SpareActive", name, Some(member), "re-added"))
            }
            _ => {}
        }
    }
    // A failed member md already dropped from the array between two polls.
    for (member, st) in &old.members {
        if *st == MemberState::InSync && !new.members.contains_key(member) && new.degraded > old.degraded {
            ev.push(Event::new("Fail", name, Some(member), "failed and removed"));
        }
    }
    if old.degraded == 0 && new.degraded > 0 {
        ev.push(Event::new("DegradedArray", name, None, format!("{} member(s) missing", new.degraded)));
    }
    if !old.needs_check && new.needs_check {
        ev.push(Event::new("NeedsCheck", name, None, "the array needs a check"));
    }
    ev.extend(rebuild_events(name, old, new));
    ev
}

fn rebuild_events(name: &str, old: &MdState, new: &MdState) -> Vec<Event> {
    let step = |p: u64| p / REBUILD_STEP_PERCENT * REBUILD_STEP_PERCENT;
    match (&old.sync, &new.sync) {
        (None, Some((action, _))) => vec![Event::new("RebuildStarted", name, None, action.as_str())],
        (Some((_, before)), Some((action, now))) if step(*now) > step(*before) && step(*now) < 100 => {
            vec![Event::new(&format!("Rebuild{}", step(*now)), name, None, action.as_str())]
        }
        (Some((action, _)), None) => {
            let mut detail = action.clone();
            if new.mismatch_sectors > 0 {
                detail = format!("{action}: mismatches found: {}", new.mismatch_sectors);
            }
            vec![Event::new("RebuildFinished", name, None, detail)]
        }
        _ => Vec::new(),
    }
}

/// Pool events for the conditions that are new in `new` (all of them when `old` is `None`).
fn pool_events(name: &str, old: Option<&PoolState>, new: &PoolState) -> Vec<Event> {
    let was = |f: fn(&PoolState) -> bool| old.is_some_and(f);
    let mut ev = Vec::new();
    if new.low_water && !was(|p| p.low_water) {
        ev.push(Event::new("LowWater", name, None, "free data blocks down to low_water_blocks"));
    }
    if new.out_of_data_space && !was(|p| p.out_of_data_space) {
        ev.push(Event::new("OutOfDataSpace", name, None, "no free data blocks"));
    }
    if new.needs_check && !was(|p| p.needs_check) {
        ev.push(Event::new("NeedsCheck", name, None, new.reason.clone()));
    }
    let changed = old.is_none_or(|p| p.mode != new.mode);
    match new.mode {
        PoolMode::ReadOnly if changed => ev.push(Event::new("ReadOnly", name, None, new.reason.clone())),
        PoolMode::Failed if changed => ev.push(Event::new("Fail", name, None, new.reason.clone())),
        _ => {}
    }
    ev.into_iter().map(Event::on_thin_pool).collect()
}

fn diff(name: &str, old: &State, new: &State) -> Vec<Event> {
    match (old, new) {
        (State::Md(o), State::Md(n)) => md_events(name, o, n),
        (State::Pool(o), State::Pool(n)) => pool_events(name, Some(o), n),
        // The name now belongs to another kind of volume.
        _ => first_sight(name, new, true),
    }
}

//------------------------------------------------------------------------------------------------

/// Starts the watcher; abort the handle at shutdown. Volumes present at start are first seen
/// here: an array that starts degraded raises `DegradedArray`.
pub fn spawn_watcher(svc: Arc<Service>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut known: BTreeMap<String, State> = BTreeMap::new();
        let mut tick = tokio::time::interval(POLL_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let now = snapshot_all(&svc).await;
            for (name, s) in &now {
                let events = match known.get(name) {
                    Some(old) => diff(name, old, s),
                    None => first_sight(name, s, true),
                };
                events.into_iter().for_each(|e| svc.events.emit(e));
            }
            for name in known.keys().filter(|n| !now.contains_key(*n)) {
                svc.events.emit(Event::new("DeviceDisappeared", name, None, "stopped or removed"));
            }
            known = now;
        }
    })
}

/// What `mdkit monitor --oneshot` reports: the problems of every volume as they stand, and a
/// `TestMessage` per md array and thin pool when `test` is set.
pub async fn current(svc: &Service, test: bool) -> Vec<Event> {
    let mut out = Vec::new();
    for (name, s) in snapshot_all(svc).await {
        if test {
            out.push(Event::new("TestMessage", &name, None, "generated by mdkit monitor --test"));
        }
        out.extend(first_sight(&name, &s, false));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn md(members: &[(&str, MemberState)], degraded: u64, sync: Option<u64>) -> MdState {
        MdState {
            members: members.iter().map(|(n, s)| (n.to_string(), *s)).collect(),
            degraded,
            needs_check: false,
            sync: sync.map(|p| ("recover".to_string(), p)),
            mismatch_sectors: 0,
        }
    }

    fn names(ev: &[Event]) -> Vec<&str> {
        ev.iter().map(|e| e.event.as_str()).collect()
    }

    #[test]
    fn failure_raises_fail_and_degraded() {
        use MemberState::*;
        let old = md(&[("a", InSync), ("b", InSync)], 0, None);
        let new = md(&[("a", InSync), ("b", Faulty)], 1, None);
        let ev = md_events("md0", &old, &new);
        assert_eq!(names(&ev), ["Fail", "DegradedArray"]);
        assert_eq!(ev[0].member.as_deref(), Some("b"));
    }

    #[test]
    fn member_back_in_sync_between_two_polls_raises_spare_active() {
        use MemberState::*;
        let failed = md(&[("a", InSync), ("b", Faulty)], 1, None);
        let missing = md(&[("a", InSync)], 1, None);
        let whole = md(&[("a", InSync), ("b", InSync)], 0, None);
        for old in [&failed, &missing] {
            let ev = md_events("md0", old, &whole);
            assert_eq!(names(&ev), ["SpareActive"]);
            assert_eq!(ev[0].member.as_deref(), Some("b"));
        }
        assert!(md_events("md0", &whole, &whole).is_empty());
    }

    #[test]
    fn rebuild_progress_crosses_steps_once() {
        use MemberState::*;
        let m = [("a", InSync), ("b", Spare)];
        assert_eq!(names(&md_events("md0", &md(&m, 1, None), &md(&m, 1, Some(0)))), ["RebuildStarted"]);
        assert_eq!(names(&md_events("md0", &md(&m, 1, Some(10)), &md(&m, 1, Some(45)))), ["Rebuild40"]);
        assert!(md_events("md0", &md(&m, 1, Some(41)), &md(&m, 1, Some(59))).is_empty());
        let done = [("a", InSync), ("b", InSync)];
        assert_eq!(
            names(&md_events("md0", &md(&m, 1, Some(90)), &md(&done, 0, None))),
            ["SpareActive", "RebuildFinished"]
        );
    }

    #[test]
    fn pool_conditions_fire_once() {
        let ok = PoolState {
            mode: PoolMode::ReadWrite,
            needs_check: false,
            low_water: false,
            out_of_data_space: false,
            reason: String::new(),
        };
        let full = PoolState { low_water: true, out_of_data_space: true, ..ok.clone() };
        assert_eq!(names(&pool_events("p", Some(&ok), &full)), ["LowWater", "OutOfDataSpace"]);
        assert!(pool_events("p", Some(&full), &full).is_empty());
        assert!(pool_events("p", None, &ok).is_empty());
    }

    #[test]
    fn array_first_seen_degraded_raises_degraded_array() {
        use MemberState::*;
        let s = State::Md(md(&[("a", InSync)], 1, None));
        assert_eq!(names(&first_sight("md0", &s, true)), ["NewArray", "DegradedArray"]);
        let healthy = State::Md(md(&[("a", InSync), ("b", InSync)], 0, None));
        assert_eq!(names(&first_sight("md0", &healthy, false)), Vec::<&str>::new());
    }

    #[test]
    fn slow_subscriber_is_told_how_many_it_missed() {
        let bus = EventBus::default();
        let mut rx = bus.subscribe();
        for _ in 0..BUS_CAPACITY + 5 {
            bus.emit(Event::new("TestMessage", "md0", None, ""));
        }
        let missed = rx.try_recv().unwrap_err();
        assert_eq!(missed, broadcast::error::TryRecvError::Lagged(5));
        assert_eq!(rx.try_recv().unwrap().event, "TestMessage");
    }

    #[test]
    fn message_reads_like_mdadm() {
        let e = Event::new("Fail", "md0", Some("b.img"), "");
        assert_eq!(e.message(), "Fail event detected on md device md0, component device b.img");
        let e = Event::new("LowWater", "pool0", None, "low").on_thin_pool();
        assert_eq!(e.message(), "LowWater event detected on thin pool pool0: low");
    }
}
