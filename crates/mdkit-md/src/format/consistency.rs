//! Which superblocks of one array agree, and which of them is the reference at assembly
//! (mdadm compare_super1 and load_devices, formats.md 1.5, md-lifecycle.md 7):
//!
//! - members agree when they share the array geometry: level, layout, chunk size, raid disks,
//!   per-member size (not for raid0) and creation time;
//! - the reference set is the largest group of agreeing members (ties: the group holding the
//!   freshest member; still tied: no reference, the caller refuses to guess);
//! - the reference member is the freshest member of that set with a role (highest `events`).
//!
//! A member whose geometry disagrees with that set is left out, so one damaged member can never
//! make the healthy majority look wrong.

use super::superblock::{Superblock, reference_member};

/// The fields every member of one array must share.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GeometryKey {
    pub level: i32,
    pub layout: u32,
    pub chunk_sectors: u32,
    pub raid_disks: u32,
    /// `size`; 0 for raid0 and linear, where it is not meaningful.
    pub size_sectors: u64,
    pub ctime: u64,
}

impl GeometryKey {
    pub fn of(sb: &Superblock) -> GeometryKey {
        GeometryKey {
            level: sb.level,
            layout: sb.layout,
            chunk_sectors: sb.chunk_sectors,
            raid_disks: sb.raid_disks,
            size_sectors: if sb.level <= 0 { 0 } else { sb.size_sectors },
            ctime: sb.ctime,
        }
    }

    /// Why `self` (a member's geometry) differs from `reference`, naming the first field.
    pub fn mismatch(&self, reference: &GeometryKey) -> Option<String> {
        let fields: [(&str, u64, u64); 6] = [
            ("level", self.level as u64, reference.level as u64),
            ("layout", u64::from(self.layout), u64::from(reference.layout)),
            ("chunksize", u64::from(self.chunk_sectors), u64::from(reference.chunk_sectors)),
            ("raid_disks", u64::from(self.raid_disks), u64::from(reference.raid_disks)),
            ("size", self.size_sectors, reference.size_sectors),
            ("ctime", self.ctime, reference.ctime),
        ];
        fields.iter().find(|(_, mine, theirs)| mine != theirs).map(|(field, mine, theirs)| {
            format!("its superblock says {field} {mine}, the other members agree on {theirs}")
        })
    }
}

/// The outcome of [`choose_reference`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReferenceChoice {
    /// Index of the reference superblock and the geometry its set shares.
    Chosen { index: usize, key: GeometryKey },
    /// Two groups of equal size and equal freshness disagree: the counts and freshest events.
    Ambiguous { members_each: usize, events: u64 },
    /// No superblock given.
    Empty,
}

/// Picks the reference superblock of `sbs` (all of one array, see the module documentation).
pub fn choose_reference(sbs: &[Superblock]) -> ReferenceChoice {
    let mut groups: Vec<(GeometryKey, Vec<usize>)> = Vec::new();
    for (i, sb) in sbs.iter().enumerate() {
        let key = GeometryKey::of(sb);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, members)) => members.push(i),
            None => groups.push((key, vec![i])),
        }
    }
    let freshest = |members: &[usize]| members.iter().map(|i| sbs[*i].events).max().unwrap_or(0);
    let rank = |members: &Vec<usize>| (members.len(), freshest(members));
    let Some((key, members)) = groups.iter().max_by_key(|(_, m)| rank(m)) else {
        return ReferenceChoice::Empty;
    };
    let best = rank(members);
    if groups.iter().filter(|(_, m)| rank(m) == best).count() > 1 {
        return ReferenceChoice::Ambiguous { members_each: best.0, events: best.1 };
    }
    let group: Vec<Superblock> = members.iter().map(|i| sbs[*i].clone()).collect();
    let within = reference_member(&group).unwrap_or(0);
    ReferenceChoice::Chosen { index: members[within], key: *key }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sb(chunk: u32, events: u64, dev_number: u32) -> Superblock {
        let mut s = Superblock::empty();
        s.level = 5;
        s.raid_disks = 4;
        s.chunk_sectors = chunk;
        s.size_sectors = 1000;
        s.events = events;
        s.dev_number = dev_number;
        s.dev_roles = vec![0, 1, 2, 3];
        s
    }

    #[test]
    fn majority_wins_over_a_fresher_or_first_outlier() {
        let sbs = [sb(64, 9, 0), sb(128, 5, 1), sb(128, 5, 2), sb(128, 4, 3)];
        let ReferenceChoice::Chosen { index, key } = choose_reference(&sbs) else { panic!() };
        assert_eq!((index, key.chunk_sectors), (1, 128));
        assert!(GeometryKey::of(&sbs[0]).mismatch(&key).unwrap().contains("chunksize 64"));
        assert_eq!(GeometryKey::of(&sbs[3]).mismatch(&key), None);
    }

    #[test]
    fn ties_go_to_the_fresher_group_or_are_ambiguous() {
        let sbs = [sb(64, 9, 0), sb(128, 5, 1)];
        assert!(matches!(choose_reference(&sbs), ReferenceChoice::Chosen { index: 0, .. }));
        let sbs = [sb(64, 5, 0), sb(128, 5, 1)];
        assert_eq!(choose_reference(&sbs), ReferenceChoice::Ambiguous { members_each: 1, events: 5 });
        assert_eq!(choose_reference(&[]), ReferenceChoice::Empty);
    }
}
