//! raid4/5/6: the dispatch point for the parity personality (issue 6: stripe cache, RMW /
//! reconstruct-write, P+Q via mdkit-parity). Assembly and creation call [`build`] for levels 4,
//! 5 and 6; until the personality lands it refuses with a clear message, and nothing is written
//! to the members.

use std::io;
use std::sync::Arc;

use super::personality::Personality;
use crate::format::superblock::Superblock;
use crate::layout::{Level, ParityGeometry};

/// Builds the raid4/5/6 personality for an array described by its (freshest) superblock.
pub fn build(name: &str, sb: &Superblock, geo: ParityGeometry) -> io::Result<Arc<dyn Personality>> {
    let _ = (sb, geo);
    let level: Level = Level::from_md_level(sb.level).unwrap_or(Level::Raid5);
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        format!(
            "{name}: {} arrays are not yet supported by the mdkit runtime (parity personality pending); the members were not changed",
            level.name()
        ),
    ))
}
