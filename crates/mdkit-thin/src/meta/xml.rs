//! thin_dump / thin_restore XML interchange (thin-provisioning-tools format):
//!
//! ```text
//! <superblock uuid="" time="1" transaction="0" flags="0" version="2" data_block_size="128" nr_data_blocks="16384">
//!   <device dev_id="0" mapped_blocks="3" transaction="0" creation_time="0" snap_time="1">
//!     <range_mapping origin_begin="0" data_begin="0" length="2" time="0"/>
//!     <single_mapping origin_block="7" data_block="9" time="1"/>
//!   </device>
//! </superblock>
//! ```
//! The parser accepts exactly these elements (plus an `<?xml ...?>` prolog and comments) and
//! reports the line of any problem; it never panics on input.

use std::fmt::Write as _;
use std::io::Write;
use std::sync::Arc;

use std::collections::BTreeSet;

use crate::meta::block::zeroed_block;
use crate::meta::btree::calc_max_entries;
use crate::meta::dsm::MAX_DATA_BLOCKS;
use crate::meta::error::{MetaError, Result};
use crate::meta::io::MetaIo;
use crate::meta::sm_format::MAX_METADATA_BLOCKS;
use crate::meta::superblock::{SUPERBLOCK_LOCATION, check_data_block_size};
use crate::meta::thin::{
    BLOCK_TIME_BYTES, DeviceDetails, FormatOptions, MAX_DEVICE_ID, MIN_METADATA_BLOCKS, OpenOptions, ThinMetadata,
    check_data_fits_metadata, data_sm_metadata_blocks,
};

/// One run of mappings: `length` consecutive virtual blocks to consecutive data blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct XmlMapping {
    pub origin_begin: u64,
    pub data_begin: u64,
    pub length: u64,
    pub time: u32,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct XmlDevice {
    pub dev_id: u64,
    pub mapped_blocks: u64,
    pub transaction: u64,
    pub creation_time: u32,
    pub snap_time: u32,
    pub mappings: Vec<XmlMapping>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct XmlMetadata {
    pub uuid: String,
    pub time: u32,
    pub transaction: u64,
    pub flags: u32,
    pub version: u32,
    pub data_block_size: u32,
    pub nr_data_blocks: u64,
    pub metadata_snap: Option<u64>,
    pub devices: Vec<XmlDevice>,
}

impl XmlMetadata {
    /// Every mapping as (dev, vblock) -> (data block, time), for comparisons.
    pub fn mapping_table(&self) -> std::collections::BTreeMap<(u64, u64), (u64, u32)> {
        let mut m = std::collections::BTreeMap::new();
        for d in &self.devices {
            for r in &d.mappings {
                for i in 0..r.length {
                    m.insert((d.dev_id, r.origin_begin + i), (r.data_begin + i, r.time));
                }
            }
        }
        m
    }

    /// Renders in thin_dump's layout.
    pub fn to_xml_string(&self) -> String {
        let mut s = String::new();
        let _ = write!(
            s,
            "<superblock uuid=\"{}\" time=\"{}\" transaction=\"{}\" flags=\"{}\" version=\"{}\" data_block_size=\"{}\" nr_data_blocks=\"{}\"",
            escape(&self.uuid),
            self.time,
            self.transaction,
            self.flags,
            self.version,
            self.data_block_size,
            self.nr_data_blocks
        );
        if let Some(m) = self.metadata_snap {
            let _ = write!(s, " metadata_snap=\"{m}\"");
        }
        s.push_str(">\n");
        for d in &self.devices {
            let _ = writeln!(
                s,
                "  <device dev_id=\"{}\" mapped_blocks=\"{}\" transaction=\"{}\" creation_time=\"{}\" snap_time=\"{}\">",
                d.dev_id, d.mapped_blocks, d.transaction, d.creation_time, d.snap_time
            );
            for r in &d.mappings {
                if r.length == 1 {
                    let _ = writeln!(
                        s,
                        "    <single_mapping origin_block=\"{}\" data_block=\"{}\" time=\"{}\"/>",
                        r.origin_begin, r.data_begin, r.time
                    );
                } else {
                    let _ = writeln!(
                        s,
                        "    <range_mapping origin_begin=\"{}\" data_begin=\"{}\" length=\"{}\" time=\"{}\"/>",
                        r.origin_begin, r.data_begin, r.length, r.time
                    );
                }
            }
            s.push_str("  </device>\n");
        }
        s.push_str("</superblock>\n");
        s
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('"', "&quot;").replace('<', "&lt;").replace('>', "&gt;")
}

/// The current state of `md` (committed or not) as XML data.
pub fn to_xml_metadata(md: &ThinMetadata) -> Result<XmlMetadata> {
    let mut x = XmlMetadata {
        uuid: String::new(),
        time: md.time(),
        transaction: md.transaction_id(),
        flags: u32::from(md.needs_check()),
        version: 2,
        data_block_size: md.data_block_size_sectors(),
        nr_data_blocks: md.nr_data_blocks(),
        metadata_snap: md.metadata_snap(),
        devices: Vec::new(),
    };
    for dev in md.devices() {
        let d = md.device_details(dev)?;
        let mut mappings: Vec<XmlMapping> = Vec::new();
        md.for_each_mapping(dev, 0, u64::MAX, &mut |vb, m| {
            push_run(&mut mappings, vb, m.data_block, m.time);
            true
        })?;
        x.devices.push(xml_device(dev, &d, mappings));
    }
    Ok(x)
}

/// The held metadata snapshot of `md` as XML data (what `thin_dump -m` reads). Unlike
/// `thin_dump -m`, which prints `nr_data_blocks="0"` (the snapshot has no space maps), the
/// pool's current data size is given, so the XML restores as it is.
pub fn snapshot_xml_metadata(md: &ThinMetadata) -> Result<XmlMetadata> {
    let h = md.metadata_snap().ok_or_else(|| MetaError::MetadataSnap("no metadata snapshot is held".into()))?;
    let sb = md.metadata_snap_superblock()?;
    let mut x = XmlMetadata {
        uuid: String::new(),
        time: sb.time,
        transaction: sb.trans_id,
        flags: 0,
        version: 2,
        data_block_size: sb.data_block_size_sectors,
        nr_data_blocks: md.nr_data_blocks(),
        metadata_snap: Some(h),
        devices: Vec::new(),
    };
    for (dev, d) in md.metadata_snap_devices()? {
        let mut mappings: Vec<XmlMapping> = Vec::new();
        md.for_each_snap_mapping(dev, &mut |vb, m| {
            push_run(&mut mappings, vb, m.data_block, m.time);
            true
        })?;
        x.devices.push(xml_device(dev, &d, mappings));
    }
    Ok(x)
}

fn xml_device(dev_id: u64, d: &DeviceDetails, mappings: Vec<XmlMapping>) -> XmlDevice {
    XmlDevice {
        dev_id,
        mapped_blocks: d.mapped_blocks,
        transaction: d.transaction_id,
        creation_time: d.creation_time,
        snap_time: d.snapshotted_time,
        mappings,
    }
}

/// Appends one mapping in ascending virtual order, extending the last run when it continues
/// it in virtual block, data block and time (thin_dump's run rule).
pub fn push_run(runs: &mut Vec<XmlMapping>, vblock: u64, data_block: u64, time: u32) {
    if let Some(r) = runs.last_mut()
        && r.origin_begin + r.length == vblock
        && r.data_begin + r.length == data_block
        && r.time == time
    {
        r.length += 1;
        return;
    }
    runs.push(XmlMapping { origin_begin: vblock, data_begin: data_block, length: 1, time });
}

/// Writes `md` as thin_dump XML.
pub fn dump_xml(md: &ThinMetadata, out: &mut dyn Write) -> Result<()> {
    let x = to_xml_metadata(md)?;
    out.write_all(x.to_xml_string().as_bytes())
        .map_err(|e| MetaError::InvalidArgument(format!("writing the XML dump failed: {e}")))
}

/// Checks everything `restore_xml` would refuse while writing, without writing: the header
/// (version, data block size, data blocks against the format and against a metadata device of
/// `metadata_nr_blocks`), unique 24-bit device ids, mapping runs (no overflow, data blocks
/// below `nr_data_blocks`, 24-bit times, no virtual block mapped twice) and each device's
/// `mapped_blocks`. Also refuses mappings that cannot fit: each 4 KiB leaf holds at most 252.
pub fn validate_xml(x: &XmlMetadata, metadata_nr_blocks: u64) -> Result<()> {
    let invalid = |m: String| Err(MetaError::InvalidArgument(m));
    if x.version != 1 && x.version != 2 {
        return invalid(format!("XML superblock version {} (supported: 1, 2)", x.version));
    }
    check_data_block_size(x.data_block_size).map_err(MetaError::InvalidArgument)?;
    if x.nr_data_blocks > MAX_DATA_BLOCKS {
        return invalid(format!("nr_data_blocks {} exceeds the 2^40 limit", x.nr_data_blocks));
    }
    let nr_meta = metadata_nr_blocks.min(MAX_METADATA_BLOCKS);
    if nr_meta < MIN_METADATA_BLOCKS {
        return invalid(format!(
            "metadata device of {nr_meta} blocks is smaller than the minimum {MIN_METADATA_BLOCKS}"
        ));
    }
    check_data_fits_metadata(x.nr_data_blocks, nr_meta, x.data_block_size).map_err(MetaError::InvalidArgument)?;
    let mut ids = BTreeSet::new();
    let mut total_mappings = 0u64;
    for d in &x.devices {
        if d.dev_id > MAX_DEVICE_ID {
            return invalid(format!("device id {} exceeds 24 bits", d.dev_id));
        }
        if !ids.insert(d.dev_id) {
            return invalid(format!("device {} is listed twice", d.dev_id));
        }
        let count = validate_runs(d, x.nr_data_blocks)?;
        if count != d.mapped_blocks {
            return invalid(format!(
                "device {}: mapped_blocks=\"{}\" but {count} mappings listed",
                d.dev_id, d.mapped_blocks
            ));
        }
        total_mappings = total_mappings.saturating_add(count);
    }
    let leaves = total_mappings.div_ceil(u64::from(calc_max_entries(BLOCK_TIME_BYTES)));
    let room = nr_meta.saturating_sub(data_sm_metadata_blocks(x.nr_data_blocks) + (nr_meta / 10).min(4096));
    if leaves > room {
        return invalid(format!(
            "{total_mappings} mappings need at least {leaves} metadata blocks; a metadata device of {nr_meta} blocks \
             has about {room} for them: use a larger one"
        ));
    }
    Ok(())
}

/// The mapping runs of one device; returns how many mappings they hold.
fn validate_runs(d: &XmlDevice, nr_data_blocks: u64) -> Result<u64> {
    let invalid = |m: String| Err(MetaError::InvalidArgument(format!("device {}: {m}", d.dev_id)));
    let mut spans = Vec::with_capacity(d.mappings.len());
    let mut count = 0u64;
    for r in &d.mappings {
        let last_vb = r.length.checked_sub(1).and_then(|n| r.origin_begin.checked_add(n));
        let last_db = r.length.checked_sub(1).and_then(|n| r.data_begin.checked_add(n));
        let (Some(last_vb), Some(last_db)) = (last_vb, last_db) else {
            return invalid(format!("mapping run at block {} of length {} overflows", r.origin_begin, r.length));
        };
        if last_db >= nr_data_blocks {
            // The first block of the run that is out of range.
            let skip = nr_data_blocks.saturating_sub(r.data_begin);
            return invalid(format!(
                "block {} maps data block {}, beyond the {nr_data_blocks} data blocks",
                r.origin_begin + skip,
                r.data_begin + skip
            ));
        }
        if r.time > 0x00ff_ffff {
            return invalid(format!("block {}: mapping time {} exceeds 24 bits", r.origin_begin, r.time));
        }
        spans.push((r.origin_begin, last_vb));
        count = count.saturating_add(r.length);
    }
    spans.sort_unstable();
    if let Some(w) = spans.windows(2).find(|w| w[1].0 <= w[0].1) {
        return invalid(format!("block {} is mapped twice", w[1].0));
    }
    Ok(count)
}

/// Formats `io` and fills it from `x` (thin_restore). Data block reference counts are the
/// number of mappings to each block. Commits before returning.
///
/// `validate_xml` runs first: XML the restore would refuse leaves the device byte-identical.
/// Past that, the superblock is cleared before anything else is written and a new one is
/// written only by the final commit, so a failure found while writing (metadata space, I/O)
/// or a crash leaves no pool at all, never an empty one ([`MetaError::RestoreIncomplete`]).
pub fn restore_xml(io: Arc<dyn MetaIo>, x: &XmlMetadata, opts: OpenOptions) -> Result<ThinMetadata> {
    validate_xml(x, io.nr_blocks())?;
    if opts.read_only {
        return Err(MetaError::ReadOnly("cannot restore read-only".into()));
    }
    let name = io.name().to_string();
    let clear = |source: MetaError| {
        let zero = zeroed_block();
        let cleared = io.write_blocks(&[(SUPERBLOCK_LOCATION, &zero)]).and_then(|()| io.flush());
        let note = match cleared {
            Ok(()) => "the superblock is cleared: the device holds no pool",
            Err(_) => "clearing the superblock failed too: do not use the device as a pool",
        };
        MetaError::RestoreIncomplete { device: name.clone(), note, source: Box::new(source) }
    };
    let zero = zeroed_block();
    io.write_blocks(&[(SUPERBLOCK_LOCATION, &zero)]).and_then(|()| io.flush()).map_err(|source| MetaError::Io {
        device: name.clone(),
        op: "write",
        block: SUPERBLOCK_LOCATION,
        source,
    })?;
    let fo = FormatOptions {
        data_block_size_sectors: x.data_block_size,
        nr_data_blocks: x.nr_data_blocks,
        metadata_nr_blocks: None,
    };
    let mut md = ThinMetadata::format_uncommitted(io.clone(), fo, opts).map_err(clear)?;
    fill(&mut md, x).and_then(|()| md.commit()).map_err(clear)?;
    Ok(md)
}

/// Adds `x`'s devices and mappings to freshly formatted metadata (`validate_xml` passed).
fn fill(md: &mut ThinMetadata, x: &XmlMetadata) -> Result<()> {
    md.restore_header(x.time, x.transaction, x.flags);
    for d in &x.devices {
        md.restore_device(
            d.dev_id,
            DeviceDetails {
                mapped_blocks: 0,
                transaction_id: d.transaction,
                creation_time: d.creation_time,
                snapshotted_time: d.snap_time,
            },
        )?;
        for r in &d.mappings {
            for i in 0..r.length {
                md.restore_mapping(d.dev_id, r.origin_begin + i, r.data_begin + i, r.time)?;
            }
        }
    }
    Ok(())
}

//------------------------------------------------------------------------------------------------
// Parser

struct Tag<'a> {
    name: &'a str,
    attrs: Vec<(&'a str, String)>,
    closing: bool,
    self_closing: bool,
    line: usize,
}

fn bad(line: usize, msg: impl std::fmt::Display) -> MetaError {
    MetaError::InvalidArgument(format!("XML line {line}: {msg}"))
}

fn unescape(v: &str, line: usize) -> Result<String> {
    let mut out = String::with_capacity(v.len());
    let mut rest = v;
    while let Some(p) = rest.find('&') {
        out.push_str(&rest[..p]);
        let after = &rest[p..];
        let end = after.find(';').ok_or_else(|| bad(line, "unterminated entity"))?;
        out.push(match &after[..=end] {
            "&amp;" => '&',
            "&lt;" => '<',
            "&gt;" => '>',
            "&quot;" => '"',
            "&apos;" => '\'',
            e => return Err(bad(line, format!("unknown entity {e}"))),
        });
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

fn tokenize(s: &str) -> Result<Vec<Tag<'_>>> {
    let mut tags = Vec::new();
    let mut pos = 0usize;
    let bytes = s.as_bytes();
    // Line numbers for messages, counted incrementally (linear in the input).
    let mut line = 1usize;
    let mut counted_to = 0usize;
    let mut line_of = |p: usize| {
        line += bytes[counted_to..p].iter().filter(|&&b| b == b'\n').count();
        counted_to = p;
        line
    };
    while pos < bytes.len() {
        let c = bytes[pos];
        if c.is_ascii_whitespace() {
            pos += 1;
            continue;
        }
        if c != b'<' {
            return Err(bad(line_of(pos), "text outside of tags"));
        }
        let line = line_of(pos);
        let rest = &s[pos..];
        if rest.starts_with("<!--") {
            let end = rest.find("-->").ok_or_else(|| bad(line, "unterminated comment"))?;
            pos += end + 3;
            continue;
        }
        if rest.starts_with("<?") {
            let end = rest.find("?>").ok_or_else(|| bad(line, "unterminated processing instruction"))?;
            pos += end + 2;
            continue;
        }
        let end = rest.find('>').ok_or_else(|| bad(line, "unterminated tag"))?;
        let mut inner = &rest[1..end];
        pos += end + 1;
        let closing = inner.starts_with('/');
        if closing {
            inner = &inner[1..];
        }
        let self_closing = inner.ends_with('/');
        if self_closing {
            inner = &inner[..inner.len() - 1];
        }
        let inner = inner.trim();
        let name_end = inner.find(|c: char| c.is_ascii_whitespace()).unwrap_or(inner.len());
        let name = &inner[..name_end];
        if name.is_empty() {
            return Err(bad(line, "tag without a name"));
        }
        let mut attrs = Vec::new();
        let mut a = inner[name_end..].trim_start();
        while !a.is_empty() {
            let eq = a.find('=').ok_or_else(|| bad(line, format!("attribute without value in <{name}>")))?;
            let key = a[..eq].trim();
            let v = a[eq + 1..].trim_start();
            let quote = v.chars().next().ok_or_else(|| bad(line, "missing attribute value"))?;
            if quote != '"' && quote != '\'' {
                return Err(bad(line, format!("unquoted value of {key}")));
            }
            let close = v[1..].find(quote).ok_or_else(|| bad(line, format!("unterminated value of {key}")))?;
            attrs.push((key, unescape(&v[1..1 + close], line)?));
            a = v[close + 2..].trim_start();
        }
        if closing && (self_closing || !attrs.is_empty()) {
            return Err(bad(line, format!("malformed closing tag </{name}>")));
        }
        tags.push(Tag { name, attrs, closing, self_closing, line });
    }
    Ok(tags)
}

struct Attrs<'a, 't> {
    tag: &'a Tag<'t>,
}

impl Attrs<'_, '_> {
    fn raw(&self, key: &str) -> Option<&str> {
        self.tag.attrs.iter().find(|(k, _)| *k == key).map(|(_, v)| v.as_str())
    }

    fn num<T: std::str::FromStr>(&self, key: &str) -> Result<T> {
        let v = self.raw(key).ok_or_else(|| bad(self.tag.line, format!("<{}> lacks {key}", self.tag.name)))?;
        v.parse::<T>().map_err(|_| bad(self.tag.line, format!("{key}=\"{v}\" is not a valid number")))
    }

    fn num_or<T: std::str::FromStr>(&self, key: &str, default: T) -> Result<T> {
        if self.raw(key).is_some() { self.num(key) } else { Ok(default) }
    }
}

/// A `<single_mapping/>` or `<range_mapping/>`; None for any other tag.
fn parse_mapping(m: &Tag<'_>) -> Result<Option<XmlMapping>> {
    let a = Attrs { tag: m };
    match (m.name, m.closing, m.self_closing) {
        ("single_mapping", false, true) => Ok(Some(XmlMapping {
            origin_begin: a.num("origin_block")?,
            data_begin: a.num("data_block")?,
            length: 1,
            time: a.num("time")?,
        })),
        ("range_mapping", false, true) => {
            let r = XmlMapping {
                origin_begin: a.num("origin_begin")?,
                data_begin: a.num("data_begin")?,
                length: a.num("length")?,
                time: a.num("time")?,
            };
            if r.length == 0 {
                return Err(bad(m.line, "range_mapping of length 0"));
            }
            Ok(Some(r))
        }
        _ => Ok(None),
    }
}

/// Parses thin_dump XML (thin-provisioning-tools 0.9 and 1.x, including `<def>`/`<ref>`).
pub fn parse_xml(s: &str) -> Result<XmlMetadata> {
    let tags = tokenize(s)?;
    let mut it = tags.iter().peekable();
    let sb = it.next().ok_or_else(|| bad(1, "empty document"))?;
    if sb.name != "superblock" || sb.closing || sb.self_closing {
        return Err(bad(sb.line, format!("expected <superblock>, found <{}>", sb.name)));
    }
    let a = Attrs { tag: sb };
    let mut x = XmlMetadata {
        uuid: a.raw("uuid").unwrap_or("").to_string(),
        time: a.num("time")?,
        transaction: a.num("transaction")?,
        flags: a.num_or("flags", 0)?,
        version: a.num_or("version", 1)?,
        data_block_size: a.num("data_block_size")?,
        nr_data_blocks: a.num("nr_data_blocks")?,
        metadata_snap: if a.raw("metadata_snap").is_some() { Some(a.num("metadata_snap")?) } else { None },
        devices: Vec::new(),
    };
    // thin_dump >= 1.0 writes leaf runs shared by several devices once, as <def>s, and splices
    // them into devices with <ref name=..>.
    let mut defs: std::collections::HashMap<String, Vec<XmlMapping>> = Default::default();
    loop {
        let t = it.next().ok_or_else(|| bad(sb.line, "missing </superblock>"))?;
        match (t.name, t.closing) {
            ("superblock", true) => break,
            ("def", false) if !t.self_closing => {
                let name = Attrs { tag: t }.raw("name").ok_or_else(|| bad(t.line, "<def> lacks name"))?.to_string();
                let mut mappings = Vec::new();
                loop {
                    let m = it.next().ok_or_else(|| bad(t.line, "missing </def>"))?;
                    if (m.name, m.closing) == ("def", true) {
                        break;
                    }
                    mappings.push(
                        parse_mapping(m)?.ok_or_else(|| bad(m.line, format!("unexpected <{}> in a def", m.name)))?,
                    );
                }
                defs.insert(name, mappings);
            }
            ("device", false) if !t.self_closing => {
                let a = Attrs { tag: t };
                let mut d = XmlDevice {
                    dev_id: a.num("dev_id")?,
                    mapped_blocks: a.num("mapped_blocks")?,
                    transaction: a.num("transaction")?,
                    creation_time: a.num("creation_time")?,
                    snap_time: a.num("snap_time")?,
                    mappings: Vec::new(),
                };
                loop {
                    let m = it.next().ok_or_else(|| bad(t.line, "missing </device>"))?;
                    match (m.name, m.closing) {
                        ("device", true) => break,
                        ("ref", false) if m.self_closing => {
                            let a = Attrs { tag: m };
                            let name = a.raw("name").ok_or_else(|| bad(m.line, "<ref> lacks name"))?;
                            let def = defs
                                .get(name)
                                .ok_or_else(|| bad(m.line, format!("<ref name=\"{name}\"> names no earlier <def>")))?;
                            d.mappings.extend_from_slice(def);
                        }
                        _ => match parse_mapping(m)? {
                            Some(r) => d.mappings.push(r),
                            None => {
                                return Err(bad(
                                    m.line,
                                    format!("unexpected <{}{}> in a device", if m.closing { "/" } else { "" }, m.name),
                                ));
                            }
                        },
                    }
                }
                x.devices.push(d);
            }
            _ => {
                return Err(bad(
                    t.line,
                    format!("unexpected <{}{}> in the superblock", if t.closing { "/" } else { "" }, t.name),
                ));
            }
        }
    }
    if let Some(t) = it.next() {
        return Err(bad(t.line, "content after </superblock>"));
    }
    Ok(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_render_roundtrip_and_errors() {
        let text = "<?xml version=\"1.0\"?>\n<!-- c -->\n<superblock uuid=\"\" time=\"1\" transaction=\"2\" flags=\"0\" version=\"2\" data_block_size=\"128\" nr_data_blocks=\"100\">\n  <device dev_id=\"0\" mapped_blocks=\"3\" transaction=\"0\" creation_time=\"0\" snap_time=\"1\">\n    <range_mapping origin_begin=\"0\" data_begin=\"10\" length=\"2\" time=\"0\"/>\n    <single_mapping origin_block=\"7\" data_block=\"9\" time=\"1\"/>\n  </device>\n</superblock>\n";
        let x = parse_xml(text).unwrap();
        assert_eq!(x.devices.len(), 1);
        assert_eq!(x.mapping_table().len(), 3);
        let again = parse_xml(&x.to_xml_string()).unwrap();
        assert_eq!(again, x);
        for bad_input in [
            "",
            "<superblock>",
            "<superblock time=\"x\" transaction=\"0\" data_block_size=\"128\" nr_data_blocks=\"1\"></superblock>",
            "<superblock time=\"0\" transaction=\"0\" data_block_size=\"128\" nr_data_blocks=\"1\"><foo/></superblock>",
            "<superblock time=\"0\" transaction=\"0\" data_block_size=\"128\" nr_data_blocks=\"1\">text</superblock>",
            "<superblock time=\"0 transaction=\"0\">",
            "<superblock uuid=\"&bogus;\" time=\"0\" transaction=\"0\" data_block_size=\"128\" nr_data_blocks=\"1\"></superblock>",
        ] {
            assert!(parse_xml(bad_input).is_err(), "{bad_input}");
        }
    }
}
