//! Names reserved for volumes being created at run time (`md.create`, `md.assemble`,
//! `thin.pool-create`, `thin.create`, `thin.snapshot`, `thin.activate`).
//!
//! Checking "no volume has this name" and registering the new volume are far apart: between
//! them a command opens members and writes superblocks or formats metadata. Two requests for
//! one name both passed the check, and the loser wrote its devices before the registry refused
//! it. So a command claims the name first, before it opens or writes anything, and holds the
//! [`NameClaim`] until its volume is registered or it failed (dropping the claim releases it):
//!
//! ```text
//!   claim(name) ─ refused while another request holds it
//!   check the registry for name ─ refused when a volume has it
//!   open / write devices, insert the volume
//!   drop the claim
//! ```
//! A second request either finds the claim or, after it was dropped, the registered volume.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;

use parking_lot::Mutex;

/// The names claimed at the moment.
#[derive(Default)]
pub struct NameClaims {
    claimed: Arc<Mutex<BTreeSet<String>>>,
}

/// A claimed name; dropping it releases the name.
#[must_use = "the name is released when the claim is dropped"]
pub struct NameClaim {
    name: String,
    claimed: Arc<Mutex<BTreeSet<String>>>,
}

/// A name another request holds.
#[derive(Debug)]
pub struct NameBusy {
    pub name: String,
    /// An export name (claimed by a request that creates a volume with that export), not a
    /// volume name.
    pub export: bool,
}

impl fmt::Display for NameBusy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.export {
            return write!(
                f,
                "export name {:?} is being taken by another request creating a volume; nothing was done: wait for \
                 that request (`mdkit status` lists the export once it is served) or choose another export name",
                self.name
            );
        }
        write!(
            f,
            "a volume named {:?} is being created by another request; nothing was done: wait for that request \
             (`mdkit status` lists the volume once it is made) or choose another name",
            self.name
        )
    }
}

impl std::error::Error for NameBusy {}

impl NameClaims {
    /// Claims the volume name `name`; refused while another claim holds it.
    pub fn claim(&self, name: &str) -> Result<NameClaim, NameBusy> {
        self.claim_as(name, false)
    }

    /// Claims the export name `name` (a set of claims of its own: the service's
    /// `export_claims`); refused while another claim holds it.
    pub fn claim_export(&self, name: &str) -> Result<NameClaim, NameBusy> {
        self.claim_as(name, true)
    }

    fn claim_as(&self, name: &str, export: bool) -> Result<NameClaim, NameBusy> {
        let mut claimed = self.claimed.lock();
        if !claimed.insert(name.to_string()) {
            return Err(NameBusy { name: name.to_string(), export });
        }
        Ok(NameClaim { name: name.to_string(), claimed: self.claimed.clone() })
    }
}

impl NameClaim {
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for NameClaim {
    fn drop(&mut self) {
        let removed = self.claimed.lock().remove(&self.name);
        debug_assert!(removed, "claim {:?} released twice", self.name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_claimed_once_until_its_claim_is_dropped() {
        let claims = NameClaims::default();
        let first = claims.claim("md0").unwrap();
        let other = claims.claim("md1").unwrap();
        let busy = claims.claim("md0").err().expect("md0 is claimed");
        assert!(busy.to_string().contains("\"md0\" is being created by another request"), "{busy}");
        drop(first);
        let again = claims.claim("md0").unwrap();
        assert_eq!((again.name(), other.name()), ("md0", "md1"));
    }
}
