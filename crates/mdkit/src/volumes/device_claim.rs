//! Devices reserved by requests that are opening them for a new volume: array members
//! (`md.create`, `md.assemble`, `md.manage --add`, `md.grow --add`) and a new pool's metadata
//! and data (`thin.pool-create`), from the in-use check until the volume that uses them is
//! registered.
//!
//! The in-use rule (`in_use.rs`) sees registered volumes only, and within this process the
//! device lock is shared: two creates naming one member both passed the check while neither was
//! registered yet (a remote member still connecting made the window seconds wide), both wrote
//! their superblocks to it, and the loser's cleanup could remove the winner's member file. A
//! request now claims its devices in the same step as the check; a second request naming one of
//! them, however spelt ([`DeviceKey::same`]), is refused until the claim is dropped.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::device_key::DeviceKey;

/// (claim id, device, what the claiming request opens it as).
type Claimed = Arc<Mutex<Vec<(u64, DeviceKey, &'static str)>>>;

/// The devices claimed at the moment.
#[derive(Default)]
pub struct DeviceClaims {
    claimed: Claimed,
    next_id: AtomicU64,
}

/// Claimed devices; dropping the claim releases them.
#[must_use = "the devices are released when the claim is dropped"]
pub struct DeviceClaim {
    id: u64,
    claimed: Claimed,
}

/// A device another request holds.
#[derive(Debug)]
pub struct DeviceBusy {
    pub spec: String,
    /// What the other request opens it as ("a member", "a pool device").
    pub what: &'static str,
}

impl fmt::Display for DeviceBusy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "device {:?} is being opened as {} by another request; nothing was done: wait for that request \
             or give another device",
            self.spec, self.what
        )
    }
}

impl std::error::Error for DeviceBusy {}

impl DeviceClaims {
    /// Claims every device of `keys` (to be opened as `what`: "a member", "a pool device"), or
    /// none when another claim holds one of them.
    pub fn claim(&self, keys: Vec<DeviceKey>, what: &'static str) -> Result<DeviceClaim, DeviceBusy> {
        let mut claimed = self.claimed.lock();
        for k in &keys {
            if let Some((_, _, other)) = claimed.iter().find(|(_, c, _)| c.same(k)) {
                return Err(DeviceBusy { spec: k.spec().to_string(), what: other });
            }
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        claimed.extend(keys.into_iter().map(|k| (id, k, what)));
        Ok(DeviceClaim { id, claimed: self.claimed.clone() })
    }
}

impl Drop for DeviceClaim {
    fn drop(&mut self) {
        self.claimed.lock().retain(|(id, _, _)| *id != self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claimed_device_is_refused_however_spelt_until_released() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let claims = DeviceClaims::default();
        let key = |s: &str| DeviceKey::new(s, d);
        let first = claims.claim(vec![key("a.img"), key("b.img")], "a member").unwrap();
        let e = claims.claim(vec![key("c.img"), key("./b.img")], "a pool device").map(drop).unwrap_err();
        assert_eq!((e.spec.as_str(), e.what), ("./b.img", "a member"));
        let other = claims.claim(vec![key("c.img")], "a member").expect("c.img was not taken by the refused claim");
        drop(first);
        let again = claims.claim(vec![key("b.img")], "a member").expect("released with the first claim");
        drop((other, again));
        assert!(claims.claimed.lock().is_empty());
    }
}
