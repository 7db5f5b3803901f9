//! Who gets a control-socket slot.
//!
//! ```text
//!   clients        at most CLIENTS_MAX (64) connections at once
//!   idle timeout   a client that has not sent a whole request line within IDLE_TIMEOUT (60 s)
//!                  of connecting or of its last answer is told so and closed
//!   when full      a new client cuts the client idle the longest (connected, waiting for its
//!                  next request: no command running, not an event stream);
//!                  with none idle and every slot an event stream (`mdkit monitor`), the oldest
//!                  stream; otherwise (some slot is running a command) the new client gets an
//!                  error answer and is closed
//! ```
//!
//! So idle sockets can never lock the operator out: each new connection only ever cuts one of
//! them. Event streams are long-lived on purpose and are cut only when nothing else could make
//! room; a running command is never cut (that would abandon it half-way), so the one case that
//! refuses is 64 clients that are all running commands or streaming, and it passes as soon as
//! a command finishes.
//!
//! The values are documented in docs/CONFIG.md ("Control socket limits").
//!
//! The NBD server's admission (`mdkit_nbd::admission`) has the same shape for handshakes, but
//! keys on peer addresses and handshake state; the control socket needs idle/busy/stream
//! states instead, so this is a table of its own.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;

/// Control clients connected at once.
pub const CLIENTS_MAX: usize = 64;
/// How long a control client may take to send a whole request line, counted from connecting or
/// from its last answer.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// What a client is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// Waiting for its next request; can be cut to make room.
    Idle,
    /// Running a command; never cut.
    Busy,
    /// An event stream (`monitor.stream`); cut only when every slot is a stream.
    Stream,
}

/// Why a new client was refused: every slot is running a command or streaming, and not all
/// of them stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Full {
    pub clients: usize,
    pub busy: usize,
    pub streams: usize,
}

impl std::fmt::Display for Full {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the control socket has {} clients, the most it takes; {} are running commands and {} are \
             event streams (mdkit monitor), none idle: try again when a command has finished",
            self.clients, self.busy, self.streams
        )
    }
}

/// A client cut to make room for a new one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cut {
    pub id: u64,
    pub was: State,
}

struct Slot {
    state: State,
    /// The tick it became idle (key in `ClientTable::idle`), while idle.
    idle_tick: u64,
    /// Notified when the client is cut; its task answers with an error and closes.
    cut: Arc<Notify>,
}

/// What the table did since start (`status` "control", the `mdkit_control_*` metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ControlStats {
    /// Clients connected now.
    pub connected: usize,
    /// Idle clients cut to make room for a new one.
    pub cut_idle: u64,
    /// Event streams cut to make room for a new one.
    pub cut_streams: u64,
    /// New clients refused: every slot was running a command or streaming.
    pub refused: u64,
    /// Clients closed for sending no request within the idle timeout.
    pub idle_timeouts: u64,
}

/// The open control connections.
pub struct ClientTable {
    max: usize,
    stats: ControlStats,
    next_id: u64,
    next_tick: u64,
    slots: HashMap<u64, Slot>,
    /// Idle clients by the tick they became idle: the one idle the longest first.
    idle: BTreeMap<u64, u64>,
    /// Event streams, oldest connection first.
    streams: BTreeMap<u64, ()>,
}

/// Takes client `id` out of the index of its state (idle by tick, or streams).
fn unindex(idle: &mut BTreeMap<u64, u64>, streams: &mut BTreeMap<u64, ()>, id: u64, slot: &Slot) {
    match slot.state {
        State::Idle => {
            idle.remove(&slot.idle_tick);
        }
        State::Stream => {
            streams.remove(&id);
        }
        State::Busy => {}
    }
}

impl ClientTable {
    pub fn new(max: usize) -> ClientTable {
        assert!(max > 0, "a control socket takes at least one client");
        ClientTable {
            max,
            stats: ControlStats::default(),
            next_id: 0,
            next_tick: 0,
            slots: HashMap::new(),
            idle: BTreeMap::new(),
            streams: BTreeMap::new(),
        }
    }

    /// Takes a new client (idle), cutting one if the table is full (see the module docs). On
    /// `Ok` the new client's id and cut signal, and the client cut for it, if any (its signal
    /// has been notified and it is no longer in the table).
    pub fn admit(&mut self) -> Result<(u64, Arc<Notify>, Option<Cut>), Full> {
        let mut cut = None;
        if self.slots.len() >= self.max {
            let victim = match self.idle.iter().next() {
                Some((_, &id)) => Some(id),
                None if self.streams.len() == self.slots.len() => self.streams.keys().next().copied(),
                None => None,
            };
            let Some(id) = victim else {
                let streams = self.streams.len();
                self.stats.refused += 1;
                return Err(Full { clients: self.slots.len(), busy: self.slots.len() - streams, streams });
            };
            let was = self.slots[&id].state;
            match was {
                State::Stream => self.stats.cut_streams += 1,
                _ => self.stats.cut_idle += 1,
            }
            if let Some(slot) = self.remove(id) {
                slot.notify_one();
            }
            cut = Some(Cut { id, was });
        }
        let id = self.next_id;
        self.next_id += 1;
        let signal = Arc::new(Notify::new());
        self.slots.insert(id, Slot { state: State::Busy, idle_tick: 0, cut: signal.clone() });
        self.set(id, State::Idle);
        Ok((id, signal, cut))
    }

    /// Moves client `id` to `state`; false if it is gone (it was cut: it must not start a
    /// command or a stream, only close).
    pub fn set(&mut self, id: u64, state: State) -> bool {
        let tick = self.next_tick;
        let Some(slot) = self.slots.get_mut(&id) else {
            return false;
        };
        unindex(&mut self.idle, &mut self.streams, id, slot);
        slot.state = state;
        match state {
            State::Idle => {
                slot.idle_tick = tick;
                self.next_tick += 1;
                self.idle.insert(tick, id);
            }
            State::Stream => {
                self.streams.insert(id, ());
            }
            State::Busy => {}
        }
        true
    }

    /// Forgets client `id`; returns its cut signal if it was still there (removing twice,
    /// after a cut, is harmless).
    pub fn remove(&mut self, id: u64) -> Option<Arc<Notify>> {
        let slot = self.slots.remove(&id)?;
        unindex(&mut self.idle, &mut self.streams, id, &slot);
        Some(slot.cut)
    }

    /// Counts a client closed by the idle timeout.
    pub fn timed_out(&mut self) {
        self.stats.idle_timeouts += 1;
    }

    /// What the table did since start, and how many clients are connected now.
    pub fn stats(&self) -> ControlStats {
        ControlStats { connected: self.slots.len(), ..self.stats }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.slots.len()
    }
}

/// One admitted client: its id in the shared table; leaves the table when dropped.
pub struct Client {
    table: Arc<Mutex<ClientTable>>,
    pub id: u64,
    /// Notified when this client is cut to make room for a new one.
    pub cut: Arc<Notify>,
}

impl Client {
    pub fn new(table: Arc<Mutex<ClientTable>>, id: u64, cut: Arc<Notify>) -> Client {
        Client { table, id, cut }
    }

    /// See [`ClientTable::set`].
    pub fn set(&self, state: State) -> bool {
        self.table.lock().set(self.id, state)
    }

    /// See [`ClientTable::timed_out`].
    pub fn timed_out(&self) {
        self.table.lock().timed_out();
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.table.lock().remove(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admit(t: &mut ClientTable) -> (u64, Option<Cut>) {
        let (id, _, cut) = t.admit().unwrap();
        (id, cut)
    }

    #[test]
    fn a_full_table_cuts_the_client_idle_the_longest_never_a_running_command() {
        let mut t = ClientTable::new(4);
        let ids: Vec<u64> = (0..4).map(|_| admit(&mut t).0).collect();
        assert!(ids.iter().all(|&id| t.slots.contains_key(&id)));
        // 0 runs a command, 1 streams; 2 and 3 are idle, 3 since longer (2 ran a command since).
        assert!(t.set(ids[0], State::Busy));
        assert!(t.set(ids[1], State::Stream));
        assert!(t.set(ids[2], State::Busy));
        assert!(t.set(ids[2], State::Idle));
        let (a, cut) = admit(&mut t);
        assert_eq!(cut, Some(Cut { id: ids[3], was: State::Idle }));
        assert!(!t.set(ids[3], State::Busy), "a cut client cannot start a command");
        let (b, cut) = admit(&mut t);
        assert_eq!(cut, Some(Cut { id: ids[2], was: State::Idle }));
        // The new ones are idle in arrival order.
        assert_eq!(admit(&mut t).1, Some(Cut { id: a, was: State::Idle }));
        assert_eq!(admit(&mut t).1, Some(Cut { id: b, was: State::Idle }));
        assert_eq!(t.len(), 4);
        assert_eq!(t.stats(), ControlStats { connected: 4, cut_idle: 4, ..ControlStats::default() });
        // The running command and the stream are still there.
        assert_eq!(t.slots[&ids[0]].state, State::Busy);
        assert_eq!(t.slots[&ids[1]].state, State::Stream);
    }

    #[test]
    fn with_none_idle_streams_are_cut_only_when_every_slot_streams() {
        let mut t = ClientTable::new(3);
        let ids: Vec<u64> = (0..3).map(|_| admit(&mut t).0).collect();
        assert!(t.set(ids[0], State::Stream));
        assert!(t.set(ids[1], State::Stream));
        assert!(t.set(ids[2], State::Busy));
        let full = t.admit().unwrap_err();
        assert_eq!(full, Full { clients: 3, busy: 1, streams: 2 });
        assert!(full.to_string().starts_with("the control socket has 3 clients, the most it takes;"), "{full}");
        assert_eq!(t.len(), 3);
        // The command ends: its client is idle and is the one cut.
        assert!(t.set(ids[2], State::Idle));
        let (new, cut) = admit(&mut t);
        assert_eq!(cut, Some(Cut { id: ids[2], was: State::Idle }));
        // Every slot streams: the oldest stream makes room.
        assert!(t.set(new, State::Stream));
        assert_eq!(admit(&mut t).1, Some(Cut { id: ids[0], was: State::Stream }));
        assert!(!t.streams.contains_key(&ids[0]));
        assert_eq!(t.len(), 3);
        t.timed_out();
        let counted = ControlStats { connected: 3, cut_idle: 1, cut_streams: 1, refused: 1, idle_timeouts: 1 };
        assert_eq!(t.stats(), counted);
    }

    #[test]
    fn a_cut_client_is_signalled_and_removing_it_again_is_harmless() {
        let mut t = ClientTable::new(1);
        let (first, signal, _) = t.admit().unwrap();
        let (_, _, cut) = t.admit().unwrap();
        assert_eq!(cut.map(|c| c.id), Some(first));
        // The permit is stored: the task sees it on its next wait, at once.
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let notified = std::pin::pin!(signal.notified());
        assert!(std::future::Future::poll(notified, &mut cx).is_ready(), "cut signal stored");
        assert!(t.remove(first).is_none());
        assert_eq!(t.len(), 1);
        assert!(t.idle.len() == 1 && t.streams.is_empty());
    }
}
