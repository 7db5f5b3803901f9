//! Remote (NBD) members of an md volume: their link state, a start without the ones that are
//! unreachable, and their automatic return.
//!
//! ```text
//!   link watch (every LINK_WATCH_INTERVAL, one task per array with remote members)
//!     member faulty, link lost since it was last in sync, link up again ──► remove + re-add
//!     member unreachable at start, connect succeeds (backoff)          ──► re-add
//!     member left out stale at assembly, link up                       ──► re-add (once)
//! ```
//!
//! - Failfast is the client's: a lost link fails the member's requests (at once, or after
//!   `remote_timeout_ms` when the peer just goes silent), md fails the member and the array
//!   keeps serving; the write-intent bitmap records every write the member misses.
//! - The client reconnects in the background. Once the link is up again the watch re-adds the
//!   member the way `manage --remove` + `--re-add` would: the sync engine copies only the
//!   chunks the bitmap needs (`sync.copied_chunks` in `detail`), and the event watcher raises
//!   `RebuildStarted`/`RebuildFinished`/`SpareActive`. A member that failed for another reason
//!   (the server answered with an error, the link stayed up) is left failed.
//! - A member whose server cannot be reached when the array starts is left out (when the array
//!   can run without it): `detail` lists it under `missing` with the reason, the array starts
//!   degraded (`DegradedArray`), and the watch keeps connecting with backoff; a re-add the
//!   array refuses (no bitmap covers what the member missed) is reported in
//!   `last_readd_error` and not retried until the link changes.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use mdkit_io::nbd_client::NbdClientOptions;
use mdkit_io::{DeviceRef, NbdClientError, NbdDevice, NbdErrorKind};
use mdkit_md::array::{Array, MemberDev};
use parking_lot::Mutex;
use serde_json::{Value, json};

use super::md::MdVolume;

/// How often the watch looks at the links.
pub const LINK_WATCH_INTERVAL: Duration = Duration::from_millis(200);
/// Connection attempts to a member unreachable at start back off up to this.
const CONNECT_BACKOFF_MAX: Duration = Duration::from_secs(10);

/// One remote member of an array.
pub struct RemoteMember {
    /// The member URI (also its source).
    pub uri: String,
    /// The member's name in the array.
    pub name: String,
    dev: Option<Arc<NbdDevice>>,
    /// Why it is not in the array when it was unreachable at start.
    missing: Option<String>,
    /// The link's loss count when the member was last seen in sync with the link up.
    losses_in_sync: u64,
    /// The loss count at the last failed re-add attempt (not retried until it changes).
    readd_failed_at: Option<u64>,
    auto_readds: u64,
    last_readd_error: Option<String>,
    next_connect: Instant,
    connect_backoff: Duration,
}

impl RemoteMember {
    /// A member whose device is open.
    pub fn connected(uri: &str, name: &str, dev: Arc<NbdDevice>) -> RemoteMember {
        let losses = dev.link().losses;
        RemoteMember { losses_in_sync: losses, ..RemoteMember::base(uri, name, Some(dev), None) }
    }

    /// A member whose server could not be reached: `reason` says why.
    pub fn missing(uri: &str, name: &str, reason: String) -> RemoteMember {
        RemoteMember::base(uri, name, None, Some(reason))
    }

    fn base(uri: &str, name: &str, dev: Option<Arc<NbdDevice>>, missing: Option<String>) -> RemoteMember {
        RemoteMember {
            uri: uri.to_string(),
            name: name.to_string(),
            dev,
            missing,
            losses_in_sync: 0,
            readd_failed_at: None,
            auto_readds: 0,
            last_readd_error: None,
            next_connect: Instant::now(),
            connect_backoff: Duration::from_millis(200),
        }
    }

    pub fn device(&self) -> Option<Arc<NbdDevice>> {
        self.dev.clone()
    }

    pub fn missing_reason(&self) -> Option<&str> {
        self.missing.as_deref()
    }

    fn json(&self, array: &Array) -> Value {
        let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let mut v = json!({
            "name": self.name,
            "uri": self.uri,
            "auto_readds": self.auto_readds,
            "last_readd_error": self.last_readd_error,
            "missing_reason": self.missing,
            "in_array": array.core().slots().find(&self.name).is_some(),
        });
        match &self.dev {
            Some(d) => {
                let l = d.link();
                v["link"] = json!(if l.up { "up" } else { "down" });
                v["last_contact_unix_ms"] = json!(l.last_contact_unix_ms);
                v["last_contact_age_ms"] = json!(now_ms.saturating_sub(l.last_contact_unix_ms));
                v["outstanding_requests"] = json!(l.outstanding_requests);
                v["outstanding_bytes"] = json!(l.outstanding_bytes);
                v["losses"] = json!(l.losses);
                v["reconnects"] = json!(l.reconnects);
                v["last_loss"] = json!(l.last_loss);
            }
            None => {
                v["link"] = json!("missing");
                v["outstanding_requests"] = json!(0);
                v["outstanding_bytes"] = json!(0);
            }
        }
        v
    }
}

/// The remote members of one array, and the settings to reconnect the missing ones.
pub struct RemoteLinks {
    opts: NbdClientOptions,
    members: Mutex<Vec<RemoteMember>>,
    stopped: AtomicBool,
}

/// What the watch does for one member this round.
enum Step {
    ReAdd { name: String, dev: Arc<NbdDevice>, losses: u64 },
    Connect { uri: String, name: String },
}

impl RemoteLinks {
    pub fn new(opts: NbdClientOptions, members: Vec<RemoteMember>) -> RemoteLinks {
        RemoteLinks { opts, members: Mutex::new(members), stopped: AtomicBool::new(false) }
    }

    pub fn is_empty(&self) -> bool {
        self.members.lock().is_empty()
    }

    /// The URI of the remote member `name`.
    pub fn uri_of(&self, name: &str) -> Option<String> {
        self.members.lock().iter().find(|m| m.name == name).map(|m| m.uri.clone())
    }

    /// A remote member opened by `manage --add`/`--re-add` (replaces an entry of the same URI).
    pub fn register(&self, uri: &str, name: &str, dev: Arc<NbdDevice>) {
        let mut g = self.members.lock();
        g.retain(|m| m.uri != uri);
        g.push(RemoteMember::connected(uri, name, dev));
    }

    /// A member removed from the array (`manage --remove`): no longer watched or listed, and
    /// its connection closes with the last reference to its device.
    pub fn forget(&self, name: &str) {
        self.members.lock().retain(|m| m.name != name);
    }

    /// The array stopped: the watch ends.
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
    }

    /// `remote_members` and `missing` for `detail`.
    pub fn json(&self, array: &Array) -> (Value, Value) {
        let g = self.members.lock();
        let links: Vec<Value> = g.iter().map(|m| m.json(array)).collect();
        let missing: Vec<Value> =
            g.iter().filter_map(|m| Some(json!({ "member": m.name, "reason": m.missing.as_deref()? }))).collect();
        (Value::Array(links), Value::Array(missing))
    }

    /// This round's work: decided under the lock, done without it.
    fn plan(&self, array: &Array) -> Vec<Step> {
        let slots = array.core().slots();
        let left_out: Vec<String> = array.left_out().into_iter().map(|r| r.member).collect();
        let mut steps = Vec::new();
        let now = Instant::now();
        for m in self.members.lock().iter_mut() {
            let Some(dev) = &m.dev else {
                if now >= m.next_connect {
                    m.next_connect = now + m.connect_backoff;
                    m.connect_backoff = (m.connect_backoff * 2).min(CONNECT_BACKOFF_MAX);
                    steps.push(Step::Connect { uri: m.uri.clone(), name: m.name.clone() });
                }
                continue;
            };
            let link = dev.link();
            let member = slots.find(&m.name);
            let in_sync = member.as_ref().is_some_and(|x| !x.is_faulty());
            if in_sync {
                if link.up {
                    m.losses_in_sync = link.losses;
                }
                continue;
            }
            let lost_since = link.losses > m.losses_in_sync;
            let failed_by_link = member.as_ref().is_some_and(|x| x.is_faulty()) && lost_since;
            let stale_at_start = member.is_none() && left_out.contains(&m.name);
            if link.up && (failed_by_link || stale_at_start) && m.readd_failed_at != Some(link.losses) {
                steps.push(Step::ReAdd { name: m.name.clone(), dev: dev.clone(), losses: link.losses });
            }
        }
        steps
    }

    fn readd_done(&self, name: &str, dev: Option<Arc<NbdDevice>>, result: Result<(), String>, losses: u64) {
        let mut g = self.members.lock();
        let Some(m) = g.iter_mut().find(|m| m.name == name) else { return };
        match result {
            Ok(()) => {
                m.auto_readds += 1;
                m.last_readd_error = None;
                m.readd_failed_at = None;
                m.missing = None;
                if let Some(d) = dev {
                    m.losses_in_sync = d.link().losses;
                    m.dev = Some(d);
                }
            }
            Err(e) => {
                m.last_readd_error = Some(e);
                m.readd_failed_at = Some(losses);
            }
        }
    }

    fn connect_failed(&self, name: &str, reason: String) {
        if let Some(m) = self.members.lock().iter_mut().find(|m| m.name == name) {
            m.missing = Some(reason);
        }
    }
}

/// The missing-member reason for a connection error: `URI unreachable: why`.
pub fn unreachable_reason(e: &NbdClientError) -> Option<String> {
    (e.kind == NbdErrorKind::Connect).then(|| format!("{} unreachable: {}", e.target, e.detail))
}

/// Starts the link watch of `vol` (nothing to do without remote members).
pub fn spawn_watch(vol: &Arc<MdVolume>) {
    if vol.remote.is_empty() {
        return;
    }
    let weak = Arc::downgrade(vol);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(LINK_WATCH_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(vol) = weak.upgrade() else { return };
            if vol.remote.stopped.load(Ordering::Acquire) {
                return;
            }
            for step in vol.remote.plan(&vol.array) {
                run_step(&vol, step).await;
            }
        }
    });
}

async fn run_step(vol: &MdVolume, step: Step) {
    let links = &vol.remote;
    match step {
        Step::ReAdd { name, dev, losses } => {
            let r = re_add(vol, &name, dev.clone()).await;
            links.readd_done(&name, Some(dev), r, losses);
        }
        Step::Connect { uri, name } => match NbdDevice::connect(&uri, links.opts).await {
            Ok(dev) => {
                let dev = Arc::new(dev);
                tracing::info!(array = %vol.name, member = %uri, "unreachable remote member answers: re-adding it");
                let r = re_add(vol, &name, dev.clone()).await;
                let losses = dev.link().losses;
                links.readd_done(&name, r.is_ok().then_some(dev), r, losses);
            }
            Err(e) => {
                let why = unreachable_reason(&e).unwrap_or_else(|| e.to_string());
                tracing::debug!(array = %vol.name, member = %uri, "still unreachable: {why}");
                links.connect_failed(&name, why);
            }
        },
    }
}

/// Takes the failed member out (if it is still in the array) and re-adds it: bitmap-guided
/// when the bitmap covers what it missed.
async fn re_add(vol: &MdVolume, name: &str, dev: Arc<NbdDevice>) -> Result<(), String> {
    let array = &vol.array;
    if array.core().slots().find(name).is_some() {
        array.remove_member(name).await.map_err(|e| format!("removing the failed member: {e}"))?;
    }
    let dev: DeviceRef = dev;
    match array.re_add_member(MemberDev::new(name, dev)).await {
        Ok(()) => {
            vol.note_member_source(name);
            tracing::info!(array = %vol.name, member = name, "remote member re-added after its link returned");
            Ok(())
        }
        Err(e) => {
            tracing::warn!(array = %vol.name, member = name, "automatic re-add refused: {e}");
            Err(e.to_string())
        }
    }
}
