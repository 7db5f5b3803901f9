//! The slot table: which member holds which role (slot) of the array, which members replace
//! others, which are spares and which have failed. Immutable once built; the core swaps in a new
//! table (an `Arc`) whenever membership changes, so I/O paths take one snapshot and use it
//! without locks. Member *state* (faulty, in sync, recovery progress) lives in the members and
//! changes in place.

use std::sync::Arc;

use super::member::{Member, flag};

/// One role of the array.
#[derive(Clone, Debug, Default)]
pub struct Slot {
    /// The member holding the role (possibly faulty or still recovering).
    pub member: Option<Arc<Member>>,
    /// A member rebuilding to take the role over (md replacement).
    pub replacement: Option<Arc<Member>>,
}

/// A snapshot of the array's membership.
#[derive(Clone, Debug)]
pub struct SlotTable {
    slots: Vec<Slot>,
    /// Working members without a role.
    spares: Vec<Arc<Member>>,
    /// Failed members not yet removed (md keeps them until `remove`).
    faulty: Vec<Arc<Member>>,
}

impl SlotTable {
    /// An empty table for `raid_disks` roles.
    pub fn new(raid_disks: usize) -> SlotTable {
        SlotTable { slots: vec![Slot::default(); raid_disks], spares: Vec::new(), faulty: Vec::new() }
    }

    pub fn raid_disks(&self) -> usize {
        self.slots.len()
    }

    pub fn slot(&self, role: usize) -> Option<&Slot> {
        self.slots.get(role)
    }

    /// The member holding `role` if it has not failed (in sync or recovering).
    pub fn working(&self, role: usize) -> Option<&Arc<Member>> {
        self.slots.get(role)?.member.as_ref().filter(|m| !m.is_faulty())
    }

    /// The member holding `role` if it is working and in sync.
    pub fn in_sync(&self, role: usize) -> Option<&Arc<Member>> {
        self.slots.get(role)?.member.as_ref().filter(|m| m.is_in_sync())
    }

    /// A member that holds valid data for member sectors `[.., end_sector)` of `role`: the
    /// holder, else a replacement rebuilt that far.
    pub fn readable(&self, role: usize, end_sector: u64) -> Option<&Arc<Member>> {
        let s = self.slots.get(role)?;
        if let Some(m) = s.member.as_ref().filter(|m| m.readable_to(end_sector)) {
            return Some(m);
        }
        s.replacement.as_ref().filter(|m| m.readable_to(end_sector))
    }

    /// Every working member that must receive writes for `role` (holder and replacement).
    pub fn write_targets(&self, role: usize) -> impl Iterator<Item = &Arc<Member>> {
        self.slots
            .get(role)
            .into_iter()
            .flat_map(|s| s.member.iter().chain(s.replacement.iter()))
            .filter(|m| !m.is_faulty())
    }

    /// Working members in a role that are not in sync (recovering holders and replacements),
    /// with their role.
    pub fn recovering(&self) -> Vec<(usize, Arc<Member>)> {
        let mut v = Vec::new();
        for (r, s) in self.slots.iter().enumerate() {
            for m in s.member.iter().chain(s.replacement.iter()) {
                if !m.is_faulty() && !m.has(flag::IN_SYNC) {
                    v.push((r, m.clone()));
                }
            }
        }
        v
    }

    pub fn spares(&self) -> &[Arc<Member>] {
        &self.spares
    }

    pub fn faulty_members(&self) -> &[Arc<Member>] {
        &self.faulty
    }

    /// Roles without a working in-sync holder.
    pub fn missing_in_sync(&self) -> u32 {
        (0..self.slots.len()).filter(|r| self.in_sync(*r).is_none()).count() as u32
    }

    /// Roles without any working holder (not even a recovering one).
    pub fn empty_roles(&self) -> Vec<usize> {
        (0..self.slots.len()).filter(|r| self.working(*r).is_none()).collect()
    }

    /// Every member in the table: holders, replacements, spares, failed.
    pub fn all_members(&self) -> Vec<Arc<Member>> {
        let mut v: Vec<Arc<Member>> = Vec::new();
        for s in &self.slots {
            v.extend(s.member.iter().cloned());
            v.extend(s.replacement.iter().cloned());
        }
        v.extend(self.spares.iter().cloned());
        v.extend(self.faulty.iter().cloned());
        v
    }

    /// Members that are not faulty (those that get superblock writes and flushes).
    pub fn working_members(&self) -> Vec<Arc<Member>> {
        self.all_members().into_iter().filter(|m| !m.is_faulty()).collect()
    }

    /// The role a member holds (as holder or replacement), if any.
    pub fn role_of(&self, m: &Member) -> Option<usize> {
        self.slots.iter().position(|s| {
            s.member.as_ref().is_some_and(|x| std::ptr::eq(&**x, m))
                || s.replacement.as_ref().is_some_and(|x| std::ptr::eq(&**x, m))
        })
    }

    pub fn find(&self, name: &str) -> Option<Arc<Member>> {
        self.all_members().into_iter().find(|m| m.name() == name)
    }

    //--------------------------------------------------------------------------------------------
    // Building new tables (membership changes).

    pub fn set_holder(&mut self, role: usize, m: Option<Arc<Member>>) {
        if let Some(s) = self.slots.get_mut(role) {
            s.member = m;
        }
    }

    pub fn set_replacement(&mut self, role: usize, m: Option<Arc<Member>>) {
        if let Some(s) = self.slots.get_mut(role) {
            s.replacement = m;
        }
    }

    pub fn add_spare(&mut self, m: Arc<Member>) {
        self.spares.push(m);
    }

    pub fn add_faulty(&mut self, m: Arc<Member>) {
        self.faulty.push(m);
    }

    /// Removes `m` from wherever it is; returns whether it was present.
    pub fn remove(&mut self, m: &Member) -> bool {
        let same = |x: &Arc<Member>| std::ptr::eq(&**x, m);
        let mut found = false;
        for s in &mut self.slots {
            if s.member.as_ref().is_some_and(same) {
                s.member = None;
                found = true;
            }
            if s.replacement.as_ref().is_some_and(same) {
                s.replacement = None;
                found = true;
            }
        }
        let before = self.spares.len() + self.faulty.len();
        self.spares.retain(|x| !same(x));
        self.faulty.retain(|x| !same(x));
        found || before != self.spares.len() + self.faulty.len()
    }

    /// The same table with `m` treated as gone (to ask "could the array run without it?").
    pub fn without(&self, m: &Member) -> SlotTable {
        let mut t = self.clone();
        t.remove(m);
        t
    }
}

#[cfg(test)]
mod tests {
    use mdkit_io::MemDevice;

    use super::*;
    use crate::format::superblock::Superblock;

    fn member(name: &str) -> Arc<Member> {
        let mut sb = Superblock::empty();
        sb.data_size_sectors = 100;
        Arc::new(Member::new(name, Arc::new(MemDevice::new(name, 1 << 20)), sb))
    }

    #[test]
    fn roles_spares_and_failures() {
        let mut t = SlotTable::new(2);
        let a = member("a");
        let b = member("b");
        let s = member("s");
        a.set(flag::IN_SYNC);
        t.set_holder(0, Some(a.clone()));
        t.set_holder(1, Some(b.clone()));
        t.add_spare(s.clone());
        assert_eq!(t.missing_in_sync(), 1);
        assert_eq!(t.recovering().len(), 1);
        assert!(t.readable(1, 1).is_none());
        b.set_recovery_offset(50);
        assert!(t.readable(1, 50).is_some());
        assert_eq!(t.write_targets(1).count(), 1);
        a.set(flag::FAULTY);
        assert!(t.working(0).is_none());
        assert_eq!(t.missing_in_sync(), 2);
        assert_eq!(t.working_members().len(), 2);
        let w = t.without(&s);
        assert_eq!(w.spares().len(), 0);
        assert_eq!(t.role_of(&b), Some(1));
        assert_eq!(t.role_of(&s), None);
        assert!(t.find("s").is_some());
    }
}
