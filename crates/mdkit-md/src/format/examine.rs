//! `mdadm --examine` and `mdadm --examine-bitmap` style rendering of a member's metadata, as
//! text (line for line what mdadm 4.2 prints, times in UTC) and as JSON.
//!
//! The caller prints the "DEVICE:" header line itself (mdadm prints `"%s:\n"` before the
//! superblock text). Times are rendered in UTC; run mdadm with `TZ=UTC` to compare.

use serde_json::{Value, json};

use super::bitmap::{self, BITMAP_MAGIC, BitmapGeometry, BitmapSuper};
use super::superblock::{
    LenientSuperblock, MAX_SECTOR, ROLE_FAULTY, ROLE_JOURNAL, ROLE_MAX, Superblock, SuperblockError, feature,
    md_time_seconds, sb_checksum, superblock_locations,
};
use super::{METADATA_BLOCK_BYTES, SECTOR_BYTES, format_uuid, validate};
use crate::layout::names::{level_name, parity_algorithm_name, raid0_layout_name, raid10_examine_text};
use crate::layout::{self, Level};

/// What to render for one member.
#[derive(Clone, Copy, Debug)]
pub struct Examine<'a> {
    pub superblock: &'a Superblock,
    /// The checksum the stored bytes should have (from
    /// [`Superblock::decode_lenient`](super::superblock::Superblock::decode_lenient)); `None`
    /// = recompute from the fields.
    pub computed_checksum: Option<u32>,
    /// The member's bitmap superblock, when BITMAP_OFFSET is set and it was read. Without it
    /// the "Unused Space" line ignores the bitmap's size.
    pub bitmap: Option<&'a BitmapSuper>,
    /// The member device's size in sectors.
    pub member_size_sectors: u64,
    /// mdadm's home host: adds "(local to host H)" after a matching name.
    pub homehost: Option<&'a str>,
}

impl<'a> Examine<'a> {
    pub fn new(superblock: &'a Superblock, bitmap: Option<&'a BitmapSuper>, member_size_sectors: u64) -> Examine<'a> {
        Examine { superblock, computed_checksum: None, bitmap, member_size_sectors, homehost: None }
    }

    fn expected_checksum(&self) -> u32 {
        self.computed_checksum.unwrap_or_else(|| {
            let sb = self.superblock;
            sb_checksum(&sb.encode_unchecked(), sb.max_dev().min(super::superblock::MAX_DEV_ROLES))
        })
    }
}

/// A member's metadata as `mdkit examine` reads it: the freshest superblock found at the 1.0,
/// 1.1 and 1.2 locations (also a damaged one, to show it), its bitmap superblock when one can
/// be parsed, and every problem found (each names the structure, the field and the reason).
#[derive(Clone, Debug)]
pub struct ExaminedMember {
    pub lenient: LenientSuperblock,
    pub bitmap: Option<BitmapSuper>,
    /// Byte offset the superblock was read from.
    pub sb_offset_bytes: u64,
    pub problems: Vec<String>,
    /// The bad-block log's entries (absolute member sectors) when BAD_BLOCKS is set and the
    /// log decodes; empty without BAD_BLOCKS.
    pub bad_blocks: Vec<super::badblocks::BadBlock>,
}

/// Reads and checks a member through `read_at(offset_bytes, buf)`: every superblock field
/// against the kernel's limits and the device size, and the bitmap superblock against the
/// member's superblock. `Err` when no md superblock is there (or it cannot be parsed at all).
pub fn examine_member(
    read_at: &mut dyn FnMut(u64, &mut [u8]) -> std::io::Result<()>,
    member_sectors: u64,
) -> Result<ExaminedMember, String> {
    let mut found: Vec<(u64, LenientSuperblock)> = Vec::new();
    for (_, off) in superblock_locations(member_sectors) {
        let mut b = vec![0u8; METADATA_BLOCK_BYTES];
        if read_at(off * SECTOR_BYTES, &mut b).is_err() {
            continue;
        }
        match Superblock::decode_lenient(&b) {
            Ok(l) => found.push((off, l)),
            Err(SuperblockError::BadMagic { .. }) => {}
            Err(e) => return Err(format!("superblock at byte {}: {e}", off * SECTOR_BYTES)),
        }
    }
    let (off, lenient) = found
        .into_iter()
        .max_by_key(|(_, l)| l.superblock.events)
        .ok_or_else(|| "No md superblock detected".to_string())?;
    let sb = &lenient.superblock;
    let at = off * SECTOR_BYTES;
    let mut problems: Vec<String> = Vec::new();
    if sb.super_offset_sectors != off {
        let e =
            SuperblockError::SuperOffsetMismatch { recorded_sectors: sb.super_offset_sectors, expected_sectors: off };
        problems.push(e.to_string());
    }
    problems.extend(lenient.problems.iter().map(ToString::to_string));
    problems.extend(validate::device_problems(sb, member_sectors).iter().map(ToString::to_string));
    let mut problems: Vec<String> = problems.into_iter().map(|p| format!("superblock at byte {at}: {p}")).collect();
    let bitmap = examine_bitmap(read_at, sb, member_sectors, &mut problems);
    let bad_blocks = examine_bad_blocks(read_at, sb, member_sectors, &mut problems);
    Ok(ExaminedMember { lenient, bitmap, sb_offset_bytes: at, problems, bad_blocks })
}

/// The member's bitmap superblock (when it parses) and its problems.
fn examine_bitmap(
    read_at: &mut dyn FnMut(u64, &mut [u8]) -> std::io::Result<()>,
    sb: &Superblock,
    member_sectors: u64,
    problems: &mut Vec<String>,
) -> Option<BitmapSuper> {
    let sector = sb.bitmap_sector()?;
    let space = validate::bitmap_space_bytes(sb, member_sectors)?;
    let at = sector * SECTOR_BYTES;
    let mut b = vec![0u8; METADATA_BLOCK_BYTES];
    if let Err(e) = read_at(at, &mut b) {
        problems.push(format!("bitmap superblock at byte {at}: read error: {e}"));
        return None;
    }
    let parsed = BitmapSuper::decode_lenient(&b);
    if let Err(e) = parsed.as_ref().map_err(Clone::clone).and_then(|h| {
        h.validate()?;
        h.check_for_member(sb, space)
    }) {
        problems.push(format!("bitmap superblock at byte {at}: {e}"));
    }
    parsed.ok()
}

/// The bad-block log's entries, when BAD_BLOCKS is set and the log lies on the device (its
/// offset and size problems are the superblock's): each must decode and lie on the device.
fn examine_bad_blocks(
    read_at: &mut dyn FnMut(u64, &mut [u8]) -> std::io::Result<()>,
    sb: &Superblock,
    member_sectors: u64,
    problems: &mut Vec<String>,
) -> Vec<super::badblocks::BadBlock> {
    let Some(sector) = sb.bblog_sector().filter(|_| sb.feature_map & feature::BAD_BLOCKS != 0) else {
        return Vec::new();
    };
    let len_sectors = u64::from(sb.bblog_size_sectors);
    if len_sectors > u64::from(validate::MAX_BBLOG_SECTORS) || sector.saturating_add(len_sectors) > member_sectors {
        return Vec::new();
    }
    let at = sector * SECTOR_BYTES;
    let mut log = vec![0u8; (len_sectors * SECTOR_BYTES) as usize];
    if let Err(e) = read_at(at, &mut log) {
        problems.push(format!("bad-block log at byte {at}: read error: {e}"));
        return Vec::new();
    }
    match super::badblocks::decode(&log, sb.bblog_shift) {
        Err(e) => {
            problems.push(format!("bad-block log at byte {at}: {e}"));
            Vec::new()
        }
        Ok(list) => {
            let beyond = list.iter().find(|b| b.start_sector.saturating_add(b.len_sectors) > member_sectors);
            if let Some(b) = beyond {
                problems.push(format!(
                    "bad-block log at byte {at}: entry at sector {} (+{}) lies beyond the {member_sectors}-sector device",
                    b.start_sector, b.len_sectors
                ));
            }
            list
        }
    }
}

/// `mdadm --examine-badblocks` text for a member named `dev` (examine_badblocks_super1).
pub fn render_bad_blocks(dev: &str, sb: &Superblock, bad_blocks: &[super::badblocks::BadBlock]) -> String {
    if sb.bblog_sector().is_none() {
        return format!("No bad-blocks list configured on {dev}\n");
    }
    if sb.feature_map & feature::BAD_BLOCKS == 0 {
        return format!("Bad-blocks list is empty in {dev}\n");
    }
    let mut out = format!("Bad-blocks on {dev}:\n");
    for b in bad_blocks {
        out.push_str(&format!("{:>20} for {} sectors\n", b.start_sector, b.len_sectors));
    }
    out
}

/// `mdadm --examine` text for a member (without the leading "DEVICE:" line).
pub fn render_text(sb: &Superblock, bitmap: Option<&BitmapSuper>, member_size_sectors: u64) -> String {
    render(&Examine::new(sb, bitmap, member_size_sectors))
}

/// JSON for a member: the same facts as the text, with units in the key names.
pub fn render_json(sb: &Superblock, bitmap: Option<&BitmapSuper>, member_size_sectors: u64) -> Value {
    render_json_with(&Examine::new(sb, bitmap, member_size_sectors))
}

/// mdadm's human_size: "" below 5000 KiB, else " (X.XX MiB Y.YY MB)" / GiB / TiB with its
/// rounding.
pub fn human_size(bytes: u64) -> String {
    let bytes = bytes as i128;
    let pair = |unit_bin: i128, unit_dec: i128, bin: &str, dec: &str| {
        let cb = (bytes * 200 / unit_bin + 1) / 2;
        let cd = (bytes / (unit_dec / 200) + 1) / 2;
        format!(" ({}.{:02} {bin} {}.{:02} {dec})", cb / 100, cb % 100, cd / 100, cd % 100)
    };
    if bytes < 5000 * 1024 {
        String::new()
    } else if bytes < 2 * (1 << 30) {
        pair(1 << 20, 1_000_000, "MiB", "MB")
    } else if bytes < 2 * (1 << 40) {
        pair(1 << 30, 1_000_000_000, "GiB", "GB")
    } else {
        pair(1 << 40, 1_000_000_000_000, "TiB", "TB")
    }
}

/// A Unix time as C's ctime() prints it (without the newline), in UTC:
/// "Sun Nov 22 05:11:20 2026".
pub fn ctime_utc(seconds: u64) -> String {
    let days = (seconds / 86_400) as i64;
    let rem = seconds % 86_400;
    let (y, m, d) = civil_from_days(days);
    const WD: [&str; 7] = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"];
    const MON: [&str; 12] = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
    format!(
        "{} {}{:>3} {:02}:{:02}:{:02} {}",
        WD[days.rem_euclid(7) as usize],
        MON[(m - 1) as usize],
        d,
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        y
    )
}

/// Days since 1970-01-01 to (year, month 1-12, day 1-31), proleptic Gregorian.
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// The "Layout :" value mdadm prints, if it prints one for this level.
fn layout_text(sb: &Superblock, layout: u32) -> Option<String> {
    match sb.level {
        0 if sb.feature_map & feature::RAID0_LAYOUT != 0 => {
            Some(raid0_layout_name(layout).unwrap_or("-unknown-").to_string())
        }
        5 => Some(parity_algorithm_name(Level::Raid5, layout).unwrap_or("-unknown-").to_string()),
        6 => Some(parity_algorithm_name(Level::Raid6, layout).unwrap_or("-unknown-").to_string()),
        10 => Some(raid10_examine_text(layout)),
        _ => None,
    }
}

/// Array size in bytes as mdadm --examine computes it (from `size`), for levels > 0.
fn examine_array_bytes(sb: &Superblock) -> Option<i128> {
    let (ddsks, denom): (i128, i128) = match sb.level {
        1 => (1, 1),
        4 | 5 => (i128::from(sb.raid_disks) - 1, 1),
        6 => (i128::from(sb.raid_disks) - 2, 1),
        10 => (i128::from(sb.raid_disks), i128::from(sb.layout & 255) * i128::from((sb.layout >> 8) & 255)),
        _ => (0, 1),
    };
    if ddsks == 0 || denom == 0 {
        return None;
    }
    Some((i128::from(sb.size_sectors) << 9) * ddsks / denom)
}

/// mdadm getinfo_super1's space_before / space_after (None when mdadm would not print them).
fn unused_space(ex: &Examine<'_>) -> Option<(u64, u64)> {
    let sb = ex.superblock;
    if sb.feature_map & feature::NEW_OFFSET != 0 {
        return None;
    }
    let super_offset = sb.super_offset_sectors as i128;
    let data_offset = sb.data_offset_sectors as i128;
    let bitmap_offset = i128::from(sb.bitmap_offset_sectors().unwrap_or(0));
    let (ppl_offset, ppl_size) = if sb.bitmap_offset_sectors().is_none() {
        sb.ppl().map_or((0, 0), |(o, s)| (i128::from(o), i128::from(s)))
    } else {
        (0, 0)
    };
    let data_size = if sb.level <= 0 { sb.data_size_sectors } else { sb.size_sectors } as i128;
    let bblog = (sb.bblog_offset_sectors != 0 && sb.bblog_size_sectors != 0)
        .then(|| (i128::from(sb.bblog_offset_sectors), i128::from(sb.bblog_size_sectors)));
    let (before, after);
    if data_offset < super_offset {
        before = data_offset;
        let mut end = super_offset;
        if let Some((o, _)) = bblog {
            end = end.min(super_offset + o);
        }
        if super_offset + bitmap_offset + ppl_offset < end {
            end = super_offset + bitmap_offset + ppl_offset;
        }
        after = if data_offset + data_size < end { end - data_size - data_offset } else { 0 };
    } else {
        let mut earliest = super_offset + (32 + 4) * 2;
        if bitmap_offset > 0 {
            // mdadm compares the bitmap end *without* adding super_offset; kept as is.
            let bm_sectors = ex.bitmap.and_then(|b| b.geometry().ok()).map_or(0, |g| g.area_sectors()) as i128;
            earliest = earliest.max(bitmap_offset + bm_sectors);
        } else if ppl_offset > 0 {
            earliest = earliest.max(ppl_offset + ppl_size);
        }
        if let Some((o, s)) = bblog {
            earliest = earliest.max(super_offset + o + s);
        }
        before = (data_offset - earliest).max(0);
        after = ex.member_size_sectors as i128 - data_size - data_offset;
    }
    if before == 0 && after == 0 {
        return None; // mdadm stores 1 and then does not print the line.
    }
    if after == 1 {
        return None;
    }
    Some((before.max(0) as u64, after.max(0) as u64))
}

fn role_text(sb: &Superblock) -> String {
    let role = sb.raw_role();
    if role >= ROLE_FAULTY {
        "spare".into()
    } else if role == ROLE_JOURNAL {
        "Journal".into()
    } else if sb.feature_map & feature::REPLACEMENT != 0 {
        format!("Replacement device {role}")
    } else {
        format!("Active device {role}")
    }
}

fn delta_extra(sb: &Superblock) -> u32 {
    if sb.feature_map & feature::RESHAPE_ACTIVE != 0 && sb.delta_disks < 0 { sb.delta_disks.unsigned_abs() } else { 0 }
}

/// mdadm's "Array State" string ("AAA.", 'R' for a slot with a replacement, '?' when
/// inconsistent) and whether the roles are inconsistent.
pub fn array_state(sb: &Superblock) -> (String, bool) {
    let slots = sb.raid_disks.saturating_add(delta_extra(sb));
    let mut inconsistent = false;
    // One character per slot (mdadm prints raid_disks of them). A 1.x superblock holds at most
    // MAX_DEV_ROLES roles, so a larger raid_disks is corrupt: it is cut there (and called
    // inconsistent) instead of printing up to 65,280 characters.
    let shown = slots.min(super::superblock::MAX_DEV_ROLES) as usize;
    if slots > super::superblock::MAX_DEV_ROLES {
        inconsistent = true;
    }
    let mut counts = vec![0u32; shown];
    for r in &sb.dev_roles {
        if let Some(c) = counts.get_mut(*r as usize) {
            *c += 1;
        }
    }
    let mut s = String::with_capacity(shown);
    for cnt in counts {
        s.push(match cnt {
            2 if sb.level > 0 => 'R',
            1 => 'A',
            0 => '.',
            _ => {
                inconsistent = true;
                '?'
            }
        });
    }
    if sb.dev_roles.iter().any(|r| *r <= ROLE_MAX && u32::from(*r) > slots) {
        inconsistent = true;
    }
    (s, inconsistent)
}

/// Renders the full `mdadm --examine` text.
pub fn render(ex: &Examine<'_>) -> String {
    let sb = ex.superblock;
    let mut o = String::new();
    let mut line = |s: String| {
        o.push_str(&s);
        o.push('\n');
    };
    line(format!("          Magic : {:08x}", super::superblock::MD_SB_MAGIC));
    line(format!("        Version : {}", sb.metadata_version().as_str()));
    line(format!("    Feature Map : {:#x}", sb.feature_map));
    line(format!("     Array UUID : {}", format_uuid(&sb.set_uuid)));
    let name = sb.name();
    let mut name_line = format!("           Name : {name}");
    if let Some(h) = ex.homehost
        && !h.is_empty()
        && h.len() < 32
        && name.len() > h.len()
        && name.starts_with(h)
        && name.as_bytes()[h.len()] == b':'
    {
        name_line.push_str(&format!("  (local to host {h})"));
    }
    line(name_line);
    line(format!("  Creation Time : {}", ctime_utc(md_time_seconds(sb.ctime))));
    line(format!("     Raid Level : {}", level_name(sb.level).unwrap_or("-unknown-")));
    line(format!("   Raid Devices : {}", sb.raid_disks as i32));
    line(String::new());
    line(format!(" Avail Dev Size : {} sectors{}", sb.data_size_sectors, human_size(sb.data_size_sectors << 9)));
    if sb.level > 0 {
        if let Some(asize) = examine_array_bytes(sb) {
            line(format!("     Array Size : {} KiB{}", asize >> 10, human_size(asize.max(0) as u64)));
        }
        if sb.size_sectors != sb.data_size_sectors {
            line(format!("  Used Dev Size : {} sectors{}", sb.size_sectors, human_size(sb.size_sectors << 9)));
        }
    }
    if sb.data_offset_sectors != 0 {
        line(format!("    Data Offset : {} sectors", sb.data_offset_sectors));
    }
    if sb.new_offset_sectors != 0 && sb.feature_map & feature::NEW_OFFSET != 0 {
        let off = sb.data_offset_sectors.wrapping_add_signed(i64::from(sb.new_offset_sectors));
        line(format!("     New Offset : {off} sectors"));
    }
    line(format!("   Super Offset : {} sectors", sb.super_offset_sectors));
    if sb.feature_map & feature::RECOVERY_OFFSET != 0 {
        line(format!("Recovery Offset : {} sectors", sb.recovery_offset_sectors));
    }
    if let Some((before, after)) = unused_space(ex) {
        line(format!("   Unused Space : before={before} sectors, after={after} sectors"));
    }
    line(format!("          State : {}", if sb.resync_offset_sectors == MAX_SECTOR { "clean" } else { "active" }));
    line(format!("    Device UUID : {}", format_uuid(&sb.device_uuid)));
    line(String::new());
    if let Some(off) = sb.bitmap_offset_sectors() {
        line(format!("Internal Bitmap : {off} sectors from superblock"));
    } else if let Some((off, size)) = sb.ppl() {
        line(format!("            PPL : {size} sectors at offset {off} sectors from superblock"));
    }
    render_reshape(sb, &mut line);
    if sb.devflags != 0 {
        let mut f = String::from("          Flags :");
        if sb.devflags & super::superblock::DEVFLAG_WRITE_MOSTLY != 0 {
            f.push_str(" write-mostly");
        }
        if sb.devflags & super::superblock::DEVFLAG_FAILFAST != 0 {
            f.push_str(" failfast");
        }
        line(f);
    }
    line(format!("    Update Time : {}", ctime_utc(md_time_seconds(sb.utime))));
    if sb.bblog_size_sectors != 0 && sb.bblog_offset_sectors != 0 {
        let mut b = format!(
            "  Bad Block Log : {} entries available at offset {} sectors",
            u32::from(sb.bblog_size_sectors) * 512 / 8,
            sb.bblog_offset_sectors
        );
        if sb.feature_map & feature::BAD_BLOCKS != 0 {
            b.push_str(" - bad blocks present.");
        }
        line(b);
    }
    let expected = ex.expected_checksum();
    if expected == sb.sb_csum {
        line(format!("       Checksum : {:x} - correct", sb.sb_csum));
    } else {
        line(format!("       Checksum : {:x} - expected {:x}", sb.sb_csum, expected));
    }
    line(format!("         Events : {}", sb.events));
    line(String::new());
    if let Some(l) = layout_text(sb, sb.layout) {
        line(format!("         Layout :{}{l}", if sb.level == 10 { "" } else { " " }));
    }
    match sb.level {
        0 | 4 | 5 | 6 | 10 => line(format!("     Chunk Size : {}K", sb.chunk_sectors / 2)),
        -1 => line(format!("       Rounding : {}K", sb.chunk_sectors / 2)),
        _ => {}
    }
    line(String::new());
    line(format!("   Device Role : {}", role_text(sb)));
    let (state, inconsistent) = array_state(sb);
    line(format!("   Array State : {state} ('A' == active, '.' == missing, 'R' == replacing)"));
    if inconsistent {
        line("WARNING Array state is inconsistent - each number should appear only once".into());
        let mut w = String::new();
        for (d, r) in sb.dev_roles.iter().enumerate() {
            if *r >= ROLE_FAULTY {
                w.push_str(&format!(" {d}:-"));
            } else {
                w.push_str(&format!(" {d}:{r}"));
            }
        }
        line(w);
    }
    o
}

fn render_reshape(sb: &Superblock, line: &mut impl FnMut(String)) {
    if sb.feature_map & feature::RESHAPE_ACTIVE == 0 {
        return;
    }
    line(format!(
        "  Reshape pos'n : {}{}",
        sb.reshape_position_sectors / 2,
        human_size(sb.reshape_position_sectors.wrapping_shl(9))
    ));
    if sb.delta_disks != 0 {
        line(format!(
            "  Delta Devices : {} ({}->{})",
            sb.delta_disks,
            sb.raid_disks as i64 - i64::from(sb.delta_disks),
            sb.raid_disks
        ));
    }
    if sb.new_level != sb.level {
        line(format!("      New Level : {}", level_name(sb.new_level).unwrap_or("-unknown-")));
    }
    if sb.new_layout != sb.layout {
        match sb.level {
            5 | 6 => line(format!("     New Layout : {}", layout_text(sb, sb.new_layout).unwrap_or_default())),
            10 => line(format!("     New Layout :{}", raid10_examine_text(sb.new_layout))),
            _ => {}
        }
    }
    if sb.new_chunk_sectors != sb.chunk_sectors {
        line(format!("  New Chunksize : {}K", sb.new_chunk_sectors / 2));
    }
    line(String::new());
}

/// JSON with the facts of [`render`].
pub fn render_json_with(ex: &Examine<'_>) -> Value {
    let sb = ex.superblock;
    let expected = ex.expected_checksum();
    let (state, inconsistent) = array_state(sb);
    let array_size_kib = if sb.level > 0 { examine_array_bytes(sb).map(|b| (b >> 10) as u64) } else { None };
    let array_sectors = match Level::from_md_level(sb.level) {
        Some(Level::Raid0) | None => None,
        Some(l) => layout::array_sectors(l, sb.raid_disks, sb.layout, sb.chunk_sectors, sb.size_sectors),
    };
    let unused = unused_space(ex).map(|(b, a)| json!({ "before_sectors": b, "after_sectors": a }));
    let bblog = (sb.bblog_size_sectors != 0 && sb.bblog_offset_sectors != 0).then(|| {
        json!({
            "entries": u32::from(sb.bblog_size_sectors) * 512 / 8,
            "offset_sectors": sb.bblog_offset_sectors,
            "size_sectors": sb.bblog_size_sectors,
            "shift": sb.bblog_shift,
            "bad_blocks_present": sb.feature_map & feature::BAD_BLOCKS != 0,
        })
    });
    let mut m = serde_json::Map::new();
    m.insert("magic".into(), json!(format!("{:08x}", super::superblock::MD_SB_MAGIC)));
    m.insert("version".into(), json!(sb.metadata_version().as_str()));
    m.insert("feature_map".into(), json!(sb.feature_map));
    m.insert("features".into(), json!(feature::names(sb.feature_map)));
    m.insert("array_uuid".into(), json!(format_uuid(&sb.set_uuid)));
    m.insert("name".into(), json!(sb.name()));
    m.insert("creation_time_unix".into(), json!(md_time_seconds(sb.ctime)));
    m.insert("creation_time".into(), json!(ctime_utc(md_time_seconds(sb.ctime))));
    m.insert("level".into(), json!(level_name(sb.level)));
    m.insert("level_number".into(), json!(sb.level));
    m.insert("raid_devices".into(), json!(sb.raid_disks));
    m.insert("avail_dev_size_sectors".into(), json!(sb.data_size_sectors));
    m.insert("array_size_kib".into(), json!(array_size_kib));
    m.insert("array_size_sectors".into(), json!(array_sectors));
    m.insert("used_dev_size_sectors".into(), json!(sb.size_sectors));
    m.insert("data_offset_sectors".into(), json!(sb.data_offset_sectors));
    m.insert("super_offset_sectors".into(), json!(sb.super_offset_sectors));
    m.insert(
        "recovery_offset_sectors".into(),
        json!((sb.feature_map & feature::RECOVERY_OFFSET != 0).then_some(sb.recovery_offset_sectors)),
    );
    m.insert("unused_space".into(), json!(unused));
    m.insert("state".into(), json!(if sb.resync_offset_sectors == MAX_SECTOR { "clean" } else { "active" }));
    m.insert("resync_offset_sectors".into(), json!(sb.resync_offset_sectors));
    m.insert("device_uuid".into(), json!(format_uuid(&sb.device_uuid)));
    m.insert("internal_bitmap_offset_sectors".into(), json!(sb.bitmap_offset_sectors()));
    m.insert("ppl".into(), json!(sb.ppl().map(|(o, s)| json!({ "offset_sectors": o, "size_sectors": s }))));
    m.insert("write_mostly".into(), json!(sb.devflags & super::superblock::DEVFLAG_WRITE_MOSTLY != 0));
    m.insert("failfast".into(), json!(sb.devflags & super::superblock::DEVFLAG_FAILFAST != 0));
    m.insert("update_time_unix".into(), json!(md_time_seconds(sb.utime)));
    m.insert("update_time".into(), json!(ctime_utc(md_time_seconds(sb.utime))));
    m.insert("bad_block_log".into(), json!(bblog));
    m.insert("checksum".into(), json!(format!("{:08x}", sb.sb_csum)));
    m.insert("checksum_correct".into(), json!(expected == sb.sb_csum));
    m.insert("checksum_expected".into(), json!(format!("{expected:08x}")));
    m.insert("events".into(), json!(sb.events));
    m.insert("layout".into(), json!(layout_text(sb, sb.layout).map(|s| s.trim().to_string())));
    m.insert("layout_number".into(), json!(sb.layout));
    m.insert("chunk_size_kib".into(), json!(sb.chunk_sectors / 2));
    m.insert("device_role".into(), json!(role_text(sb)));
    m.insert("role".into(), json!(sb.raw_role()));
    m.insert("dev_number".into(), json!(sb.dev_number));
    m.insert("max_dev".into(), json!(sb.max_dev()));
    m.insert("array_state".into(), json!(state));
    m.insert("array_state_inconsistent".into(), json!(inconsistent));
    m.insert("member_size_sectors".into(), json!(ex.member_size_sectors));
    m.insert("bitmap".into(), json!(ex.bitmap.map(|b| bitmap_json(b, None))));
    Value::Object(m)
}

/// mdadm's human_chunksize: "64 MB", "4 KB", "512 B".
pub fn human_chunk(bytes: u32) -> String {
    const SUFFIX: [&str; 5] = ["B", "KB", "MB", "GB", "TB"];
    let mut b = bytes;
    let mut i = 0;
    while b >> 10 != 0 {
        b >>= 10;
        i += 1;
    }
    format!("{b} {}", SUFFIX[i])
}

/// Bits the area buffer holds, and how many are set (mdadm counts only what it could read).
fn bit_counts(bms: &BitmapSuper, area: &[u8]) -> Option<(u64, u64)> {
    let geo = BitmapGeometry::new(bms.chunk_bytes, bms.sync_size_sectors).ok()?;
    let available = (area.len().saturating_sub(bitmap::BITMAP_SUPER_BYTES) as u64) * 8;
    let total = geo.chunks().min(available);
    let dirty = (0..total).filter(|c| bitmap::test_bit(area, &geo, *c).unwrap_or(false)).count() as u64;
    Some((total, dirty))
}

/// `mdadm --examine-bitmap` text. `area` is the bitmap area starting at its superblock (as
/// much as was read); without it the "Bitmap :" line is left out.
pub fn render_bitmap_text(bms: &BitmapSuper, filename: &str, area: Option<&[u8]>) -> String {
    let mut o = String::new();
    let mut line = |s: String| {
        o.push_str(&s);
        o.push('\n');
    };
    line(format!("        Filename : {filename}"));
    line(format!("           Magic : {BITMAP_MAGIC:08x}"));
    line(format!("         Version : {}", bms.version));
    line(format!("            UUID : {}", format_uuid(&bms.uuid)));
    line(format!("          Events : {}", bms.events));
    line(format!("  Events Cleared : {}", bms.events_cleared));
    let state = match bms.state {
        0 => "OK",
        2 => "Out of date",
        _ => "Unknown",
    };
    line(format!("           State : {state}"));
    line(format!("       Chunksize : {}", human_chunk(bms.chunk_bytes)));
    line(format!("          Daemon : {}s flush period", bms.daemon_sleep_secs));
    let mode =
        if bms.write_behind != 0 { format!("Allow write behind, max {}", bms.write_behind) } else { "Normal".into() };
    line(format!("      Write Mode : {mode}"));
    line(format!(
        "       Sync Size : {}{}",
        bms.sync_size_sectors / 2,
        human_size(bms.sync_size_sectors.wrapping_mul(SECTOR_BYTES))
    ));
    if let Some((total, dirty)) = area.and_then(|a| bit_counts(bms, a)) {
        let pct = 100.0 * dirty as f64 / (if total == 0 { 1 } else { total }) as f64;
        line(format!("          Bitmap : {total} bits (chunks), {dirty} dirty ({pct:2.1}%)"));
    }
    o
}

/// JSON for a bitmap superblock (and its bits when `area` is given).
pub fn bitmap_json(bms: &BitmapSuper, area: Option<&[u8]>) -> Value {
    let geo = bms.geometry().ok();
    let counts = area.and_then(|a| bit_counts(bms, a));
    json!({
        "version": bms.version,
        "uuid": format_uuid(&bms.uuid),
        "events": bms.events,
        "events_cleared": bms.events_cleared,
        "state": bms.state,
        "stale": bms.state & bitmap::state::STALE != 0,
        "chunk_bytes": bms.chunk_bytes,
        "daemon_sleep_secs": bms.daemon_sleep_secs,
        "write_behind": bms.write_behind,
        "sync_size_sectors": bms.sync_size_sectors,
        "chunks": geo.map(|g| g.chunks()),
        "area_bytes": geo.map(|g| g.area_bytes()),
        "dirty_chunks": counts.map(|c| c.1),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_sizes_like_mdadm() {
        assert_eq!(human_size(522_240 * 512), " (255.00 MiB 267.39 MB)");
        assert_eq!(human_size(780_288 * 1024), " (762.00 MiB 799.01 MB)");
        assert_eq!(human_size(4000 * 1024), "");
        assert_eq!(human_size(3 << 30), " (3.00 GiB 3.22 GB)");
        assert_eq!(human_chunk(64 << 20), "64 MB");
        assert_eq!(human_chunk(512), "512 B");
    }

    #[test]
    fn ctime_format() {
        assert_eq!(ctime_utc(0), "Thu Jan  1 00:00:00 1970");
        // 2026-11-22 05:11:20 UTC, as printed by mdadm in the lab.
        assert_eq!(ctime_utc(1_795_324_280), "Sun Nov 22 05:11:20 2026");
        assert_eq!(ctime_utc(951_782_400), "Tue Feb 29 00:00:00 2000");
    }
}
