//! mdadm's names for levels and layouts, both ways (mdadm maps.c r0layout / r5layout /
//! r6layout / pers, util.c parse_layout_10).

use super::Level;

/// raid5/6 algorithm numbers (raid5.h / mdadm.h).
pub mod algorithm {
    pub const LEFT_ASYMMETRIC: u32 = 0;
    pub const RIGHT_ASYMMETRIC: u32 = 1;
    pub const LEFT_SYMMETRIC: u32 = 2;
    pub const RIGHT_SYMMETRIC: u32 = 3;
    pub const PARITY_0: u32 = 4;
    pub const PARITY_N: u32 = 5;
    pub const ROTATING_ZERO_RESTART: u32 = 8;
    pub const ROTATING_N_RESTART: u32 = 9;
    pub const ROTATING_N_CONTINUE: u32 = 10;
    pub const LEFT_ASYMMETRIC_6: u32 = 16;
    pub const RIGHT_ASYMMETRIC_6: u32 = 17;
    pub const LEFT_SYMMETRIC_6: u32 = 18;
    pub const RIGHT_SYMMETRIC_6: u32 = 19;
    pub const PARITY_0_6: u32 = 20;
    pub const PARITY_N_6: u32 = PARITY_N;
}

/// raid0 layouts (RAID0_LAYOUT feature).
pub const RAID0_ORIG_LAYOUT: u32 = 1;
pub const RAID0_ALT_MULTIZONE_LAYOUT: u32 = 2;

/// mdadm's default raid10 layout, "n2".
pub const RAID10_DEFAULT_LAYOUT: u32 = 0x102;
/// mdadm's default raid5/6 layout, left-symmetric.
pub const RAID56_DEFAULT_LAYOUT: u32 = algorithm::LEFT_SYMMETRIC;

/// A level or layout that cannot be parsed or is not valid.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    #[error("unknown RAID level {0:?} (use raid0, raid1, raid4, raid5, raid6 or raid10)")]
    UnknownLevel(String),
    #[error("layout {name:?} not understood for {level}")]
    UnknownLayout { level: &'static str, name: String },
    #[error("layout is not meaningful for {level}")]
    NotMeaningful { level: &'static str },
    #[error("invalid {level} geometry: {reason}")]
    Invalid { level: &'static str, reason: String },
}

const R5_NAMES: &[(&str, u32)] = &[
    ("left-asymmetric", 0),
    ("right-asymmetric", 1),
    ("left-symmetric", 2),
    ("right-symmetric", 3),
    ("default", 2),
    ("la", 0),
    ("ra", 1),
    ("ls", 2),
    ("rs", 3),
    ("parity-first", 4),
    ("parity-last", 5),
    ("ddf-zero-restart", 1),
    ("ddf-N-restart", 0),
    ("ddf-N-continue", 2),
];

const R6_NAMES: &[(&str, u32)] = &[
    ("left-asymmetric", 0),
    ("right-asymmetric", 1),
    ("left-symmetric", 2),
    ("right-symmetric", 3),
    ("default", 2),
    ("la", 0),
    ("ra", 1),
    ("ls", 2),
    ("rs", 3),
    ("parity-first", 4),
    ("parity-last", 5),
    ("ddf-zero-restart", 8),
    ("ddf-N-restart", 9),
    ("ddf-N-continue", 10),
    ("left-asymmetric-6", 16),
    ("right-asymmetric-6", 17),
    ("left-symmetric-6", 18),
    ("right-symmetric-6", 19),
    ("parity-first-6", 20),
];

const R0_NAMES: &[(&str, u32)] = &[("original", 1), ("alternate", 2), ("1", 1), ("2", 2), ("dangerous", 0)];

fn lookup(table: &[(&str, u32)], name: &str) -> Option<u32> {
    table.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
}

fn reverse(table: &[(&'static str, u32)], value: u32) -> Option<&'static str> {
    // The tables are 'static; the first entry for a value is its canonical name (mdadm map_num).
    table.iter().find(|(_, v)| *v == value).map(|(n, _)| *n)
}

/// Parses a level the way mdadm does: "raid5", "5", "stripe", "mirror", ...
pub fn parse_level(name: &str) -> Result<Level, LayoutError> {
    Ok(match name {
        "raid0" | "0" | "stripe" => Level::Raid0,
        "raid1" | "1" | "mirror" => Level::Raid1,
        "raid4" | "4" => Level::Raid4,
        "raid5" | "5" => Level::Raid5,
        "raid6" | "6" => Level::Raid6,
        "raid10" | "10" => Level::Raid10,
        _ => return Err(LayoutError::UnknownLevel(name.to_string())),
    })
}

/// The name mdadm prints for a superblock `level` ("raid5", "linear", ...), if any.
pub fn level_name(md_level: i32) -> Option<&'static str> {
    match md_level {
        -1 => Some("linear"),
        -4 => Some("multipath"),
        -5 => Some("faulty"),
        0 => Some("raid0"),
        1 => Some("raid1"),
        4 => Some("raid4"),
        5 => Some("raid5"),
        6 => Some("raid6"),
        10 => Some("raid10"),
        _ => None,
    }
}

/// Parses a raid10 layout "nN", "fN", "oN" (N = copies, 1..=200) as mdadm's parse_layout_10.
pub fn parse_raid10_layout(name: &str) -> Option<u32> {
    let (kind, digits) = name.split_at_checked(1)?;
    if digits.is_empty() || !digits.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let copies: u32 = digits.parse().ok()?;
    if !(1..=200).contains(&copies) {
        return None;
    }
    match kind {
        "n" => Some(0x100 + copies),
        "o" => Some(0x10000 | (copies << 8) | 1),
        "f" => Some((copies << 8) | 1),
        _ => None,
    }
}

/// The short raid10 name for a layout ("n2", "f3", "o2"), or `None` when both near and far
/// copies exceed 1 or far-set variant bits are set (no mdadm spelling exists).
pub fn raid10_short_name(layout: u32) -> Option<String> {
    let near = layout & 0xff;
    let far = (layout >> 8) & 0xff;
    let offset = layout & 0x10000 != 0;
    if layout >> 17 != 0 {
        return None;
    }
    match (near, far, offset) {
        (n, 1, false) if n >= 1 => Some(format!("n{n}")),
        (1, f, true) if f >= 1 => Some(format!("o{f}")),
        (1, f, false) if f > 1 => Some(format!("f{f}")),
        _ => None,
    }
}

fn parse_number(name: &str) -> Option<u32> {
    if let Some(hex) = name.strip_prefix("0x") { u32::from_str_radix(hex, 16).ok() } else { name.parse().ok() }
}

/// Parses a layout name for `level` (mdadm's spellings; a plain number or 0x-hex is accepted
/// too and returned as is).
pub fn parse_layout(level: Level, name: &str) -> Result<u32, LayoutError> {
    let unknown = || LayoutError::UnknownLayout { level: level.name(), name: name.to_string() };
    let parsed = match level {
        Level::Raid0 => lookup(R0_NAMES, name),
        Level::Raid5 => lookup(R5_NAMES, name),
        Level::Raid6 => lookup(R6_NAMES, name),
        Level::Raid10 => parse_raid10_layout(name),
        Level::Raid4 => match name {
            "default" => Some(0),
            "parity-last" => Some(algorithm::PARITY_N),
            _ => None,
        },
        Level::Raid1 => return Err(LayoutError::NotMeaningful { level: level.name() }),
    };
    parsed.or_else(|| parse_number(name)).ok_or_else(unknown)
}

/// The canonical name of a layout (what mdadm --examine prints for raid0/5/6, the short form
/// for raid10); a number when there is no name.
pub fn format_layout(level: Level, layout: u32) -> String {
    let named = match level {
        Level::Raid0 => reverse(R0_NAMES, layout).map(str::to_string),
        Level::Raid5 => reverse(R5_NAMES, layout).map(str::to_string),
        Level::Raid6 => reverse(R6_NAMES, layout).map(str::to_string),
        Level::Raid10 => raid10_short_name(layout),
        Level::Raid4 => (layout == algorithm::PARITY_N).then(|| "parity-last".to_string()),
        Level::Raid1 => None,
    };
    named.unwrap_or_else(|| if layout > 9 { format!("{layout:#x}") } else { layout.to_string() })
}

/// mdadm's examine text for a raid10 layout (print_r10_layout): " near=2", " far=2",
/// " offset=2", " near=2, far=2", or "NO REDUNDANCY".
pub fn raid10_examine_text(layout: u32) -> String {
    let near = layout & 255;
    let far = (layout >> 8) & 255;
    let offset = layout & 0x10000 != 0;
    let mut s = String::new();
    let mut sep = "";
    if near != 1 {
        s.push_str(&format!("{sep} near={near}"));
        sep = ",";
    }
    if far != 1 {
        s.push_str(&format!("{sep} {}={far}", if offset { "offset" } else { "far" }));
    }
    if near * far == 1 {
        s.push_str("NO REDUNDANCY");
    }
    s
}

/// Canonical mdadm name of a raid5 or raid6 algorithm, if it has one.
pub fn parity_algorithm_name(level: Level, layout: u32) -> Option<&'static str> {
    match level {
        Level::Raid5 => reverse(R5_NAMES, layout),
        Level::Raid6 => reverse(R6_NAMES, layout),
        _ => None,
    }
}

/// Canonical mdadm name of a raid0 layout, if it has one.
pub fn raid0_layout_name(layout: u32) -> Option<&'static str> {
    reverse(R0_NAMES, layout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_ways() {
        assert_eq!(parse_layout(Level::Raid5, "ls"), Ok(2));
        assert_eq!(parse_layout(Level::Raid5, "left-symmetric"), Ok(2));
        assert_eq!(parse_layout(Level::Raid5, "parity-last"), Ok(5));
        assert_eq!(parse_layout(Level::Raid5, "ddf-zero-restart"), Ok(1));
        assert_eq!(parse_layout(Level::Raid6, "ddf-zero-restart"), Ok(8));
        assert_eq!(parse_layout(Level::Raid6, "ddf-N-continue"), Ok(10));
        assert_eq!(parse_layout(Level::Raid6, "right-symmetric-6"), Ok(19));
        assert_eq!(parse_layout(Level::Raid10, "n2"), Ok(0x102));
        assert_eq!(parse_layout(Level::Raid10, "f2"), Ok(0x201));
        assert_eq!(parse_layout(Level::Raid10, "o2"), Ok(0x10201));
        assert_eq!(parse_layout(Level::Raid10, "n3"), Ok(0x103));
        assert_eq!(parse_layout(Level::Raid0, "alternate"), Ok(2));
        assert_eq!(parse_layout(Level::Raid0, "dangerous"), Ok(0));
        assert!(parse_layout(Level::Raid10, "x2").is_err());
        assert!(parse_layout(Level::Raid10, "n0").is_err());
        assert!(parse_layout(Level::Raid10, "n201").is_err());
        assert!(parse_layout(Level::Raid5, "sideways").is_err());
        assert!(parse_layout(Level::Raid1, "n2").is_err());
        for (level, n) in [(Level::Raid5, 6u32), (Level::Raid6, 21)] {
            for l in 0..n {
                let name = format_layout(level, l);
                if parity_algorithm_name(level, l).is_some() {
                    assert_eq!(parse_layout(level, &name), Ok(l), "{name}");
                }
            }
        }
        for l in [0x102, 0x103, 0x201, 0x301, 0x10201] {
            assert_eq!(parse_layout(Level::Raid10, &format_layout(Level::Raid10, l)), Ok(l));
        }
        assert_eq!(format_layout(Level::Raid10, 0x202), "0x202");
        assert_eq!(raid10_examine_text(0x102), " near=2");
        assert_eq!(raid10_examine_text(0x201), " far=2");
        assert_eq!(raid10_examine_text(0x10201), " offset=2");
        assert_eq!(raid10_examine_text(0x202), " near=2, far=2");
        assert_eq!(raid10_examine_text(0x101), "NO REDUNDANCY");
        assert_eq!(parse_level("mirror"), Ok(Level::Raid1));
        assert!(parse_level("raid7").is_err());
    }
}
