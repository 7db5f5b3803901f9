//! Volumes that failed to open, and the guard that turns a panicking open into one.
//!
//! A volume (a config `[[volume]]` of any kind, an md array remembered in `md-arrays.json`, or a
//! thin pool or volume remembered in `thin-pools.json`) whose open returns an error — or
//! panics — does not stop the service: it is kept as a [`FailedVolume`] next to the open ones,
//! logged, and listed by `mdkit status` with state `failed` and the error. Its exports are not served (NBD clients asking for them get "no such
//! export"); `status` lists them as failed with the reason. Other volumes and their exports are
//! untouched. `mdkit stop NAME` forgets a failed volume (and a remembered array's entry in
//! `md-arrays.json`); a config volume comes back (and is tried again) at the next start.
//!
//! The panic guard is a last resort at the task boundary, not a substitute for validating
//! what is read from disk: an open that panics leaves nothing half-registered, because a
//! volume is only inserted into the registry after its open returned.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::task::Poll;

use serde_json::{Value, json};

/// Where a volume's definition came from (what `mdkit stop` forgets, what the next start retries).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// A `[[volume]]` table of the config file: tried again at every start.
    Config,
    /// An md array created or assembled at run time, remembered in `md-arrays.json`.
    Remembered,
    /// A thin pool or thin volume created at run time, remembered in `thin-pools.json`.
    RememberedThin,
}

impl Origin {
    pub fn as_str(self) -> &'static str {
        match self {
            Origin::Config => "config",
            Origin::Remembered => "md-arrays.json",
            Origin::RememberedThin => "thin-pools.json",
        }
    }
}

/// A volume that could not be opened.
#[derive(Clone, Debug)]
pub struct FailedVolume {
    pub name: String,
    pub kind: String,
    pub origin: Origin,
    /// The whole error chain, for `status` and the log.
    pub error: String,
}

impl FailedVolume {
    /// The volume's entry in `status --json`.
    pub fn status_json(&self) -> Value {
        json!({
            "name": self.name,
            "kind": self.kind,
            "size_bytes": 0,
            "logical_block_bytes": 0,
            "state": "failed",
            "error": self.error,
            "origin": self.origin.as_str(),
        })
    }
}

/// Runs `fut`, turning a panic while polling it into `Err(message)`. The future is not
/// polled again after it panicked.
pub async fn catch_panic<T>(fut: impl Future<Output = T>) -> Result<T, String> {
    let mut fut = std::pin::pin!(fut);
    std::future::poll_fn(move |cx| match std::panic::catch_unwind(AssertUnwindSafe(|| fut.as_mut().poll(cx))) {
        Ok(Poll::Ready(v)) => Poll::Ready(Ok(v)),
        Ok(Poll::Pending) => Poll::Pending,
        Err(payload) => Poll::Ready(Err(panic_message(payload.as_ref()))),
    })
    .await
}

/// The message of a panic payload (`panic!("...")` carries a `&str` or a `String`).
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panicking_future_becomes_an_error() {
        let r: Result<u32, String> = catch_panic(async {
            tokio::task::yield_now().await;
            let v: Vec<u32> = Vec::new();
            v[3]
        })
        .await;
        let e = r.expect_err("the future panicked");
        assert!(e.contains("index out of bounds"), "{e}");
        assert_eq!(catch_panic(async { 7 }).await, Ok(7));
        assert_eq!(panic_message(&String::from("boom")), "boom");
    }

    #[test]
    fn failed_volumes_show_as_failed_with_their_error() {
        let f = FailedVolume {
            name: "md1".into(),
            kind: "md".into(),
            origin: Origin::Remembered,
            error: "no superblock".into(),
        };
        let v = f.status_json();
        assert_eq!((v["state"].as_str(), v["error"].as_str()), (Some("failed"), Some("no superblock")));
        assert_eq!(v["origin"], "md-arrays.json");
    }
}
