//! Devices reserved by requests that are opening them for a new array member (`md.create`,
//! `md.assemble`, `md.manage --add`, `md.grow --add`), from the in-use check until the array
//! that uses them is registered.
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

type Claimed = Arc<Mutex<Vec<(u64, DeviceKey)>>>;

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
}

impl fmt::Display for DeviceBusy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "device {:?} is being opened as a member by another request; nothing was done: wait for that request \
             or give another device",
            self.spec
        )
    }
}

impl std::error::Error for DeviceBusy {}

impl DeviceClaims {
    /// Claims every device of `keys`, or none when another claim holds one of them.
    pub fn claim(&self, keys: Vec<DeviceKey>) -> Result<DeviceClaim, DeviceBusy> {
        let mut claimed = self.claimed.lock();
        if let Some(k) = keys.iter().find(|k| claimed.iter().any(|(_, c)| c.same(k))) {
            return Err(DeviceBusy { spec: k.spec().to_string() });
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        claimed.extend(keys.into_iter().map(|k| (id, k)));
        Ok(DeviceClaim { id, claimed: self.claimed.clone() })
    }
}

impl Drop for DeviceClaim {
    fn drop(&mut self) {
        self.claimed.lock().retain(|(id, _)| *id != self.id);
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
        let first = claims.claim(vec![key("a.img"), key("b.img")]).unwrap();
        let e = claims.claim(vec![key("c.img"), key("./b.img")]).map(drop).unwrap_err();
        assert_eq!(e.spec, "./b.img");
        let other = claims.claim(vec![key("c.img")]).expect("c.img was not taken by the refused claim");
        drop(first);
        let again = claims.claim(vec![key("b.img")]).expect("released with the first claim");
        drop((other, again));
        assert!(claims.claimed.lock().is_empty());
    }
}
