//! Who gets a connection slot.
//!
//! ```text
//!   per peer address   at most max_connections_per_peer (handshaking + established);
//!                      more from that address are closed at accept (Unix sockets are exempt)
//!   handshakes         at most max_handshakes connections still negotiating; a new one
//!                      cuts the oldest (it has had the longest to finish)
//!   total              at most max_connections; when full, a new one cuts the oldest
//!                      handshake, or is closed when every slot is an established connection
//! ```
//!
//! So connections that never finish the handshake hold at most `max_handshakes` slots, for at
//! most the handshake timeout, and can never take the slots of established connections; one
//! address cannot take more than its share; and a client that negotiates promptly gets in
//! while a flood of idle sockets is going on (the flood only ever cuts older handshakes).

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::task::AbortHandle;

/// The limits, from [`crate::ServerOptions`].
#[derive(Clone, Copy, Debug)]
pub struct AdmissionLimits {
    pub max_connections: usize,
    pub max_connections_per_peer: usize,
    pub max_handshakes: usize,
}

/// Why a new connection was closed at accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Every slot holds an established connection.
    Total,
    /// The peer address already holds its share.
    PerPeer,
}

/// Counters of admission decisions (monotonic).
#[derive(Debug, Default)]
pub struct AdmissionCounters {
    pub refused_total: AtomicU64,
    pub refused_per_peer: AtomicU64,
    pub handshakes_evicted: AtomicU64,
    pub handshakes_timed_out: AtomicU64,
}

/// A copy of [`AdmissionCounters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AdmissionSnapshot {
    pub refused_total: u64,
    pub refused_per_peer: u64,
    pub handshakes_evicted: u64,
    pub handshakes_timed_out: u64,
}

impl AdmissionCounters {
    pub fn snapshot(&self) -> AdmissionSnapshot {
        AdmissionSnapshot {
            refused_total: self.refused_total.load(Ordering::Relaxed),
            refused_per_peer: self.refused_per_peer.load(Ordering::Relaxed),
            handshakes_evicted: self.handshakes_evicted.load(Ordering::Relaxed),
            handshakes_timed_out: self.handshakes_timed_out.load(Ordering::Relaxed),
        }
    }
}

struct Slot {
    abort: AbortHandle,
    peer_ip: Option<IpAddr>,
}

/// The open connections. Touched at accept, at the end of a handshake and when a connection
/// ends — never per request.
#[derive(Default)]
pub struct ConnTable {
    all: HashMap<u64, Slot>,
    per_peer: HashMap<IpAddr, usize>,
    /// Connections still negotiating, oldest (lowest id) first.
    handshaking: BTreeMap<u64, ()>,
}

impl ConnTable {
    /// Decides on a new connection from `peer_ip` (`None`: a Unix socket). On `Ok`, the caller
    /// must abort the returned handle (a handshake cut to make room), if any, and then
    /// [`insert`](Self::insert) the new connection.
    pub fn admit(
        &mut self,
        limits: &AdmissionLimits,
        peer_ip: Option<IpAddr>,
        counters: &AdmissionCounters,
    ) -> Result<Option<AbortHandle>, Refusal> {
        if let Some(ip) = peer_ip
            && self.per_peer.get(&ip).copied().unwrap_or(0) >= limits.max_connections_per_peer
        {
            counters.refused_per_peer.fetch_add(1, Ordering::Relaxed);
            return Err(Refusal::PerPeer);
        }
        let full = self.all.len() >= limits.max_connections || self.handshaking.len() >= limits.max_handshakes;
        if !full {
            return Ok(None);
        }
        let Some((&oldest, _)) = self.handshaking.iter().next() else {
            counters.refused_total.fetch_add(1, Ordering::Relaxed);
            return Err(Refusal::Total);
        };
        counters.handshakes_evicted.fetch_add(1, Ordering::Relaxed);
        Ok(self.remove(oldest))
    }

    pub fn insert(&mut self, id: u64, abort: AbortHandle, peer_ip: Option<IpAddr>) {
        if let Some(ip) = peer_ip {
            *self.per_peer.entry(ip).or_insert(0) += 1;
        }
        self.handshaking.insert(id, ());
        self.all.insert(id, Slot { abort, peer_ip });
    }

    /// Whether connection `id` is still negotiating (a newer one could cut it).
    pub fn is_handshaking(&self, id: u64) -> bool {
        self.handshaking.contains_key(&id)
    }

    /// The connection finished its handshake: it can no longer be cut to make room.
    pub fn handshake_done(&mut self, id: u64) {
        self.handshaking.remove(&id);
    }

    /// Forgets a connection; returns its abort handle if it was still there (removing twice,
    /// after an eviction, is harmless).
    pub fn remove(&mut self, id: u64) -> Option<AbortHandle> {
        let slot = self.all.remove(&id)?;
        self.handshaking.remove(&id);
        if let Some(ip) = slot.peer_ip
            && let Some(n) = self.per_peer.get_mut(&ip)
        {
            *n -= 1;
            if *n == 0 {
                self.per_peer.remove(&ip);
            }
        }
        Some(slot.abort)
    }

    pub fn len(&self) -> usize {
        self.all.len()
    }

    pub fn is_empty(&self) -> bool {
        self.all.is_empty()
    }

    pub fn abort_handles(&self) -> Vec<AbortHandle> {
        self.all.values().map(|s| s.abort.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle(rt: &tokio::runtime::Runtime) -> AbortHandle {
        rt.spawn(std::future::pending::<()>()).abort_handle()
    }

    #[test]
    fn idle_handshakes_never_take_established_slots_nor_lock_out_new_peers() {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let limits = AdmissionLimits { max_connections: 6, max_connections_per_peer: 3, max_handshakes: 2 };
        let c = AdmissionCounters::default();
        let mut t = ConnTable::default();
        let ip = |n: u8| Some(IpAddr::from([127, 0, 0, n]));
        // Four established connections from two peers.
        for id in 0..4u64 {
            assert!(t.admit(&limits, ip(1 + (id % 2) as u8), &c).unwrap().is_none());
            t.insert(id, handle(&rt), ip(1 + (id % 2) as u8));
            t.handshake_done(id);
        }
        // A flood of idle handshakes from many addresses only ever cuts older handshakes.
        for id in 4..40u64 {
            let evicted = t.admit(&limits, ip(10 + id as u8), &c).unwrap();
            assert_eq!(evicted.is_some(), id >= 6, "connection {id}");
            t.insert(id, handle(&rt), ip(10 + id as u8));
            assert!(t.len() <= 6);
        }
        assert_eq!(c.snapshot().handshakes_evicted, 34);
        // The established four are all still there.
        for id in 0..4 {
            assert!(t.all.contains_key(&id));
        }
        // One address cannot exceed its share.
        t.insert(100, handle(&rt), ip(1));
        assert_eq!(t.admit(&limits, ip(1), &c).unwrap_err(), Refusal::PerPeer);
        // Removing an evicted connection again is harmless; counts drop to zero and vanish.
        assert!(t.remove(4).is_none());
        t.remove(100);
        t.remove(0);
        t.remove(2);
        assert!(!t.per_peer.contains_key(&IpAddr::from([127, 0, 0, 1])));
        // Every slot established: refused.
        let mut full = ConnTable::default();
        let one = AdmissionLimits { max_connections: 1, max_connections_per_peer: 9, max_handshakes: 1 };
        full.insert(1, handle(&rt), None);
        full.handshake_done(1);
        assert_eq!(full.admit(&one, None, &c).unwrap_err(), Refusal::Total);
    }
}
