//! Cuts a connection whose WRITE payload stops arriving.
//!
//! A WRITE holds its share of the payload budget from the moment its buffer is allocated
//! until its reply is sent, so a client that stops sending in the middle of a payload would
//! hold that share for as long as it keeps the socket open. The watch ends such a connection
//! once no payload byte has arrived for a whole timeout (detected between one and two
//! timeouts after the last byte), which returns the budget.
//!
//! Cost: nothing while payloads arrive with their headers. One timer per connection, created
//! the first time a payload has to wait for the socket and reused after that; it is re-armed
//! at most once per timeout, never per request.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

pub struct StallWatch {
    timeout: Duration,
    timer: Option<Pin<Box<Sleep>>>,
    /// Payloads started on this connection; with the bytes filled, identifies progress.
    payloads: u64,
    /// (payload, bytes filled) when the timer was last armed.
    mark: (u64, usize),
}

impl StallWatch {
    pub fn new(timeout: Duration) -> StallWatch {
        StallWatch { timeout, timer: None, payloads: 0, mark: (0, 0) }
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A new payload starts being read.
    pub fn payload_started(&mut self) {
        self.payloads += 1;
    }

    /// The current payload waits for the socket with `filled` bytes read. True when it made
    /// no progress during a whole timeout; otherwise the task is woken to check again.
    pub fn poll_stalled(&mut self, cx: &mut Context<'_>, filled: usize) -> bool {
        let now_mark = (self.payloads, filled);
        let timer = self.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep(self.timeout)));
        loop {
            if timer.as_mut().poll(cx) == Poll::Pending {
                return false;
            }
            // The timer ran out: stalled if nothing moved since it was armed. A timer left
            // over from an earlier payload never matches (the payload count differs).
            if self.mark == now_mark {
                return true;
            }
            self.mark = now_mark;
            timer.as_mut().reset(Instant::now() + self.timeout);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::poll_fn;

    async fn poll(w: &mut StallWatch, filled: usize) -> bool {
        poll_fn(|cx| Poll::Ready(w.poll_stalled(cx, filled))).await
    }

    #[tokio::test(start_paused = true)]
    async fn only_a_payload_without_progress_for_a_whole_timeout_is_stalled() {
        let mut w = StallWatch::new(Duration::from_secs(10));
        w.payload_started();
        assert!(!poll(&mut w, 0).await);
        // Progress every 6 s: never stalled, however long it takes.
        for step in 1..10 {
            tokio::time::advance(Duration::from_secs(6)).await;
            assert!(!poll(&mut w, step * 100).await, "step {step}");
        }
        // No progress from here: the timer that runs out first was armed before the last
        // progress, so it re-arms; the next one finds nothing moved.
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(!poll(&mut w, 900).await);
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(poll(&mut w, 900).await);
        // A new payload starts afresh even though the old timer ran out.
        w.payload_started();
        assert!(!poll(&mut w, 0).await);
    }
}
