//! Flush batching (the idea of md commit 2bc13b83, "md: batch flush requests"): one member-flush
//! round satisfies every flush request that arrived before the round started.
//!
//! ```text
//!  request arrives: need = started + 1        (any round that starts from now on covers it)
//!    no round running  -> lead round `need` now (run the caller's `round`)
//!    a round running   -> wait; when it ends, one waiter leads the next round for all of them
//!  request returns when a round >= need completed: Ok if such a round succeeded
//! ```
//! A request never waits for more than the round in progress plus its own; the rounds run
//! back to back while requests keep arriving, so N concurrent requests cost about two rounds
//! instead of N. A leader whose future is dropped mid-round gives the lead to a waiter, which
//! runs a new round (the abandoned one is never counted as done).
//!
//! With batching switched off (`flush_batching = false`) every request runs its own round, for
//! comparison.
//!
//! Used by md arrays (a round flushes every member) and by a [`FileDevice`](crate::FileDevice)
//! opened with `flush_batching` (a round is one `fdatasync` of the file: the volumes of
//! `mdkit serve` that sit directly on a file, plain and thin-pool devices alike).

use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::Mutex;
use tokio::sync::watch;

#[derive(Default)]
struct State {
    /// Rounds started (the newest round's number).
    started: u64,
    /// Newest round completed.
    completed: u64,
    running: bool,
    /// Newest round that succeeded.
    last_ok: u64,
    /// Why the newest failed round failed.
    last_error: Option<(io::ErrorKind, String)>,
}

/// Counters of a [`FlushBatcher`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlushStats {
    /// `flush` calls.
    pub requests: u64,
    /// Member-flush rounds run.
    pub rounds: u64,
    /// Rounds that returned an error.
    pub failed_rounds: u64,
}

/// See the module documentation.
pub struct FlushBatcher {
    state: Mutex<State>,
    /// Bumped after every state change waiters care about (a round ended or was abandoned).
    changed: watch::Sender<u64>,
    batching: AtomicBool,
    requests: AtomicU64,
    rounds: AtomicU64,
    failed_rounds: AtomicU64,
}

impl Default for FlushBatcher {
    fn default() -> FlushBatcher {
        FlushBatcher::new()
    }
}

impl std::fmt::Debug for FlushBatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FlushBatcher({:?}, batching {})", self.stats(), self.batching())
    }
}

impl FlushBatcher {
    /// A batcher with batching on.
    pub fn new() -> FlushBatcher {
        FlushBatcher {
            state: Mutex::new(State::default()),
            changed: watch::channel(0).0,
            batching: AtomicBool::new(true),
            requests: AtomicU64::new(0),
            rounds: AtomicU64::new(0),
            failed_rounds: AtomicU64::new(0),
        }
    }

    /// Completes once a round of member flushes that started after this call did completes.
    /// `round` flushes every member (it runs only if this caller leads a round); its error is
    /// the error of every request the round serves.
    pub async fn flush<F, Fut>(&self, round: F) -> io::Result<()>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = io::Result<()>>,
    {
        self.requests.fetch_add(1, Ordering::Relaxed);
        if !self.batching() {
            return self.run(round).await;
        }
        let mut rx = self.changed.subscribe();
        let need = {
            let s = self.state.lock();
            s.started + 1
        };
        let mut round = Some(round);
        loop {
            let lead = {
                let mut s = self.state.lock();
                if s.completed >= need {
                    return result_for(&s, need);
                }
                if s.running {
                    None
                } else {
                    s.running = true;
                    s.started += 1;
                    Some(s.started)
                }
            };
            let Some(number) = lead else {
                // A changed() error means the sender is gone, impossible while `self` lives.
                let _ = rx.changed().await;
                continue;
            };
            debug_assert!(number >= need, "a round this request leads started after it arrived");
            let round = round.take().expect("a request leads at most one round: it is served by it");
            let mut leader = Leader { batcher: self, number, done: false };
            let r = self.run(round).await;
            leader.finish(&r);
            return r;
        }
    }

    async fn run<F, Fut>(&self, round: F) -> io::Result<()>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = io::Result<()>>,
    {
        self.rounds.fetch_add(1, Ordering::Relaxed);
        let r = round().await;
        if r.is_err() {
            self.failed_rounds.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    pub fn batching(&self) -> bool {
        self.batching.load(Ordering::Relaxed)
    }

    /// Switches batching on or off (requests already waiting finish as they started).
    pub fn set_batching(&self, on: bool) {
        self.batching.store(on, Ordering::Relaxed);
    }

    pub fn stats(&self) -> FlushStats {
        FlushStats {
            requests: self.requests.load(Ordering::Relaxed),
            rounds: self.rounds.load(Ordering::Relaxed),
            failed_rounds: self.failed_rounds.load(Ordering::Relaxed),
        }
    }

    /// `flush_batching` (1/0) and mdkit's counters `flush_requests`, `flush_rounds`.
    pub fn attributes(&self) -> Vec<(&'static str, String)> {
        let s = self.stats();
        vec![
            ("flush_batching", u8::from(self.batching()).to_string()),
            ("flush_requests", s.requests.to_string()),
            ("flush_rounds", s.rounds.to_string()),
        ]
    }

    /// Sets `flush_batching` (1/0/true/false); `None` for other names.
    pub fn set_attribute(&self, name: &str, value: &str) -> Option<io::Result<()>> {
        match name {
            "flush_batching" => Some(match value.trim() {
                "1" | "true" | "on" => {
                    self.set_batching(true);
                    Ok(())
                }
                "0" | "false" | "off" => {
                    self.set_batching(false);
                    Ok(())
                }
                v => Err(io::Error::new(io::ErrorKind::InvalidInput, format!("flush_batching: '{v}' is not 0 or 1"))),
            }),
            "flush_requests" | "flush_rounds" => {
                Some(Err(io::Error::new(io::ErrorKind::PermissionDenied, format!("{name} is read-only"))))
            }
            _ => None,
        }
    }
}

fn result_for(s: &State, need: u64) -> io::Result<()> {
    if s.last_ok >= need {
        return Ok(());
    }
    let (kind, why) = s.last_error.clone().unwrap_or((io::ErrorKind::Other, "flush failed".into()));
    Err(io::Error::new(kind, why))
}

/// Records the end of a led round, or gives the lead away if the leader is dropped mid-round.
struct Leader<'a> {
    batcher: &'a FlushBatcher,
    number: u64,
    done: bool,
}

impl Leader<'_> {
    fn finish(&mut self, r: &io::Result<()>) {
        {
            let mut s = self.batcher.state.lock();
            s.completed = s.completed.max(self.number);
            match r {
                Ok(()) => s.last_ok = s.last_ok.max(self.number),
                Err(e) => s.last_error = Some((e.kind(), e.to_string())),
            }
            s.running = false;
        }
        self.done = true;
        self.batcher.changed.send_modify(|v| *v += 1);
    }
}

impl Drop for Leader<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.batcher.state.lock().running = false;
            self.batcher.changed.send_modify(|v| *v += 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
    }

    #[test]
    fn a_lone_request_runs_its_round_at_once() {
        rt().block_on(async {
            let b = FlushBatcher::new();
            b.flush(|| async { Ok(()) }).await.unwrap();
            b.flush(|| async { Ok(()) }).await.unwrap();
            assert_eq!(b.stats(), FlushStats { requests: 2, rounds: 2, failed_rounds: 0 });
        });
    }

    #[test]
    fn errors_reach_every_request_of_the_round() {
        rt().block_on(async {
            let b = std::sync::Arc::new(FlushBatcher::new());
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            let first = {
                let b = b.clone();
                tokio::spawn(async move {
                    b.flush(|| async move {
                        rx.await.ok();
                        Ok(())
                    })
                    .await
                })
            };
            tokio::task::yield_now().await;
            // These arrive while round 1 runs: they share round 2, which fails.
            let waiters: Vec<_> = (0..4)
                .map(|_| {
                    let b = b.clone();
                    tokio::spawn(async move { b.flush(|| async { Err(io::Error::other("member gone")) }).await })
                })
                .collect();
            tokio::task::yield_now().await;
            tx.send(()).unwrap();
            first.await.unwrap().unwrap();
            for w in waiters {
                let e = w.await.unwrap().unwrap_err();
                assert!(e.to_string().contains("member gone"), "{e}");
            }
            assert_eq!(b.stats().rounds, 2);
            assert_eq!(b.stats().failed_rounds, 1);
        });
    }

    #[test]
    fn a_dropped_leader_hands_over() {
        rt().block_on(async {
            let b = std::sync::Arc::new(FlushBatcher::new());
            let leader = {
                let b = b.clone();
                tokio::spawn(async move { b.flush(std::future::pending::<io::Result<()>>).await })
            };
            tokio::task::yield_now().await;
            let waiter = {
                let b = b.clone();
                tokio::spawn(async move { b.flush(|| async { Ok(()) }).await })
            };
            tokio::task::yield_now().await;
            leader.abort();
            waiter.await.unwrap().unwrap();
            assert_eq!(b.stats().rounds, 2);
        });
    }

    #[test]
    fn attributes_switch_batching() {
        let b = FlushBatcher::new();
        assert!(b.set_attribute("flush_batching", "0").unwrap().is_ok());
        assert!(!b.batching());
        assert!(b.set_attribute("flush_batching", "x").unwrap().is_err());
        assert!(b.set_attribute("flush_rounds", "1").unwrap().is_err());
        assert!(b.set_attribute("stripe_size", "1").is_none());
        assert_eq!(b.attributes()[0], ("flush_batching", "0".to_string()));
    }
}
