//! Meta contexts: `NBD_OPT_LIST_META_CONTEXT` and `NBD_OPT_SET_META_CONTEXT` (proto.md
//! "Metadata querying"), which select what `NBD_CMD_BLOCK_STATUS` reports.
//!
//! | context                              | exports               | bits                               |
//! |--------------------------------------|-----------------------|------------------------------------|
//! | `base:allocation`                    | all                   | 1 = HOLE, 2 = ZERO                 |
//! | `x-mdkit:changed-since:<thin id>`    | thin volumes          | 1 = changed since snapshot `<id>`  |
//!
//! Option data is `u32 export_name_len, name, u32 n_queries, {u32 len, query}×n`; it is parsed
//! strictly (every length checked against what is left, nothing allocated from a length
//! before that check, no trailing bytes), at most [`META_QUERIES_MAX`] queries of at most
//! [`QUERY_MAX_BYTES`] each, on top of the handshake's cap on option data; a SET selects at
//! most [`SELECTED_CONTEXTS_MAX`] contexts. SET needs
//! structured replies first; SET replaces the selection even when it fails; BLOCK_STATUS is
//! allowed only when the last SET named the export the client then opened and selected at
//! least one context (checked by the handshake).
//!
//! `x-mdkit:changed-since:<id>` reports bit 0 (like `qemu:dirty-bitmap:`) for every range whose
//! blocks differ from thin device `<id>` (typically a snapshot taken at the last backup), by
//! thin_delta's rules: mapped to different data blocks, or mapped on one side only. 0 is "same
//! data block", the only claim it makes; a client copying the 1 ranges to its previous copy
//! gets the current contents.

use std::io;

use tokio::io::{AsyncWrite, AsyncWriteExt};

use crate::export::ExportState;
use crate::handshake::NAME_MAX_BYTES;
use crate::proto::*;
use crate::server::Shared;

/// Queries accepted in one LIST/SET option.
pub const META_QUERIES_MAX: usize = 64;
/// Contexts one SET may select (each costs a metadata walk per BLOCK_STATUS).
pub const SELECTED_CONTEXTS_MAX: usize = 8;
/// Longest query string (the protocol's string limit).
pub const QUERY_MAX_BYTES: usize = 4096;
/// The allocation context.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// Prefix of the changed-since contexts; the thin id follows in decimal.
pub const CHANGED_SINCE_PREFIX: &str = "x-mdkit:changed-since:";

/// A context a connection can select.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetaContext {
    /// `base:allocation`.
    Allocation,
    /// `x-mdkit:changed-since:<base>`.
    ChangedSince { base: u64 },
}

impl MetaContext {
    pub fn name(&self) -> String {
        match self {
            MetaContext::Allocation => BASE_ALLOCATION.to_string(),
            MetaContext::ChangedSince { base } => format!("{CHANGED_SINCE_PREFIX}{base}"),
        }
    }
}

/// What the last successful SET selected: the export it named (resolved) and the contexts, in
/// context-id order (id = index + 1).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selection {
    pub export_name: String,
    pub contexts: Vec<MetaContext>,
}

/// Parsed LIST/SET option data.
#[derive(Debug, PartialEq, Eq)]
pub struct MetaRequest {
    pub export_name: String,
    pub queries: Vec<String>,
}

/// Why option data was refused: the option reply type and a message.
#[derive(Debug, PartialEq, Eq)]
pub struct Refusal {
    pub reply: u32,
    pub message: String,
}

fn refuse(reply: u32, message: impl Into<String>) -> Refusal {
    Refusal { reply, message: message.into() }
}

/// A length-checked big-endian reader over option data.
struct Cursor<'a> {
    data: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn u32(&mut self, what: &str) -> Result<u32, Refusal> {
        let b = self.bytes(4, what)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn bytes(&mut self, n: usize, what: &str) -> Result<&'a [u8], Refusal> {
        if self.data.len() < n {
            return Err(refuse(
                REP_ERR_INVALID,
                format!("{what}: {n} bytes announced, {} left in the option", self.data.len()),
            ));
        }
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        Ok(head)
    }

    fn string(&mut self, max: usize, what: &str) -> Result<String, Refusal> {
        let len = self.u32(what)? as usize;
        if len > max {
            return Err(refuse(REP_ERR_TOO_BIG, format!("{what} of {len} bytes (limit {max})")));
        }
        let b = self.bytes(len, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| refuse(REP_ERR_INVALID, format!("{what} is not UTF-8")))
    }
}

/// Parses `u32 name_len, name, u32 n, {u32 len, query}×n` with the limits above.
pub fn parse_meta_request(data: &[u8]) -> Result<MetaRequest, Refusal> {
    let mut c = Cursor { data };
    let export_name = c.string(NAME_MAX_BYTES, "export name")?;
    let n = c.u32("query count")? as usize;
    if n > META_QUERIES_MAX {
        return Err(refuse(REP_ERR_TOO_BIG, format!("{n} meta context queries (limit {META_QUERIES_MAX})")));
    }
    // Each query takes at least its 4-byte length: a count the data cannot hold is a lie.
    if n * 4 > c.data.len() {
        return Err(refuse(REP_ERR_INVALID, format!("{n} queries announced in {} bytes", c.data.len())));
    }
    let mut queries = Vec::with_capacity(n);
    for i in 0..n {
        queries.push(c.string(QUERY_MAX_BYTES, &format!("query {i}"))?);
    }
    if !c.data.is_empty() {
        return Err(refuse(REP_ERR_INVALID, format!("{} bytes after the last query", c.data.len())));
    }
    Ok(MetaRequest { export_name, queries })
}

/// What one query names, before asking the export: a context, a LIST wildcard, or nothing.
#[derive(Debug, PartialEq, Eq)]
enum Query {
    Context(MetaContext),
    /// `x-mdkit:` or `x-mdkit:changed-since:` in LIST: answered with the wildcard name.
    ChangedSinceWildcard,
    /// `base:` in LIST means every `base:` context.
    BaseWildcard,
    Unknown,
}

fn classify(q: &str) -> Query {
    if q == BASE_ALLOCATION {
        return Query::Context(MetaContext::Allocation);
    }
    if q == "base:" {
        return Query::BaseWildcard;
    }
    if q == "x-mdkit:" || q == CHANGED_SINCE_PREFIX {
        return Query::ChangedSinceWildcard;
    }
    match q.strip_prefix(CHANGED_SINCE_PREFIX) {
        // Plain decimal only: no sign, no leading zeroes, no spaces (one name per context).
        Some(id) if !id.is_empty() && id.len() <= 20 && id.bytes().all(|b| b.is_ascii_digit()) => {
            match id.parse::<u64>() {
                Ok(base) if base.to_string() == id => Query::Context(MetaContext::ChangedSince { base }),
                _ => Query::Unknown,
            }
        }
        _ => Query::Unknown,
    }
}

/// Whether `export` can answer `ctx` (a changed-since base must exist on a device that tracks
/// changes: asked with an empty range).
async fn supported(export: &ExportState, ctx: MetaContext) -> bool {
    match ctx {
        MetaContext::Allocation => true,
        MetaContext::ChangedSince { base } => export.export.device.changed_since(base, 0, 0, 1).await.is_ok(),
    }
}

/// Whether the export's device tracks changes at all (for LIST wildcards): only
/// `Unsupported` says no; an unknown base says yes.
async fn tracks_changes(export: &ExportState) -> bool {
    match export.export.device.changed_since(u64::MAX, 0, 0, 1).await {
        Ok(_) => true,
        Err(e) => e.kind() != io::ErrorKind::Unsupported,
    }
}

/// The names a LIST answers with (context ids in LIST replies are meaningless: 0).
async fn list_names(export: &ExportState, queries: &[String]) -> Vec<String> {
    fn add(names: &mut Vec<String>, n: String) {
        if !names.contains(&n) {
            names.push(n);
        }
    }
    let mut names: Vec<String> = Vec::new();
    if queries.is_empty() {
        add(&mut names, BASE_ALLOCATION.to_string());
        if tracks_changes(export).await {
            add(&mut names, CHANGED_SINCE_PREFIX.to_string());
        }
        return names;
    }
    for q in queries {
        let name = match classify(q) {
            Query::Context(ctx) => supported(export, ctx).await.then(|| ctx.name()),
            Query::BaseWildcard => Some(BASE_ALLOCATION.to_string()),
            Query::ChangedSinceWildcard => tracks_changes(export).await.then(|| CHANGED_SINCE_PREFIX.to_string()),
            Query::Unknown => None,
        };
        if let Some(n) = name {
            add(&mut names, n);
        }
    }
    names
}

/// The contexts a SET selects, in query order without duplicates.
async fn set_contexts(export: &ExportState, queries: &[String]) -> Vec<MetaContext> {
    let mut out: Vec<MetaContext> = Vec::new();
    for q in queries {
        if let Query::Context(ctx) = classify(q)
            && !out.contains(&ctx)
            && supported(export, ctx).await
        {
            out.push(ctx);
            if out.len() > SELECTED_CONTEXTS_MAX {
                break; // refused by the caller; no need to look further
            }
        }
    }
    out
}

/// Handles NBD_OPT_LIST_META_CONTEXT / NBD_OPT_SET_META_CONTEXT. For SET, returns the new
/// selection (`None` when it failed or selected nothing; the caller replaces its selection
/// with this whatever it is).
pub(crate) async fn list_or_set<S>(
    s: &mut S,
    shared: &Shared,
    option: u32,
    data: &[u8],
    structured: bool,
) -> io::Result<Option<Selection>>
where
    S: AsyncWrite + Unpin,
{
    let mut out = Vec::new();
    let reply = answer(shared, option, data, structured, &mut out).await;
    if let Err(r) = &reply {
        out.clear();
        put_option_reply(&mut out, option, r.reply, r.message.as_bytes());
    }
    s.write_all(&out).await?;
    Ok(reply.ok().flatten())
}

async fn answer(
    shared: &Shared,
    option: u32,
    data: &[u8],
    structured: bool,
    out: &mut Vec<u8>,
) -> Result<Option<Selection>, Refusal> {
    let set = option == OPT_SET_META_CONTEXT;
    if set && !structured {
        return Err(refuse(REP_ERR_INVALID, "NBD_OPT_SET_META_CONTEXT needs structured replies first"));
    }
    let req = parse_meta_request(data)?;
    let export = shared
        .find_export(&req.export_name)
        .ok_or_else(|| refuse(REP_ERR_UNKNOWN, format!("no export named {:?}", req.export_name)))?;
    let mut payload = Vec::new();
    if !set {
        for name in list_names(&export, &req.queries).await {
            payload.clear();
            payload.extend_from_slice(&0u32.to_be_bytes());
            payload.extend_from_slice(name.as_bytes());
            put_option_reply(out, option, REP_META_CONTEXT, &payload);
        }
        put_option_reply(out, option, REP_ACK, &[]);
        return Ok(None);
    }
    let contexts = set_contexts(&export, &req.queries).await;
    if contexts.len() > SELECTED_CONTEXTS_MAX {
        return Err(refuse(
            REP_ERR_TOO_BIG,
            format!("{} meta contexts selected (limit {SELECTED_CONTEXTS_MAX})", contexts.len()),
        ));
    }
    for (i, ctx) in contexts.iter().enumerate() {
        payload.clear();
        payload.extend_from_slice(&(i as u32 + 1).to_be_bytes());
        payload.extend_from_slice(ctx.name().as_bytes());
        put_option_reply(out, option, REP_META_CONTEXT, &payload);
    }
    put_option_reply(out, option, REP_ACK, &[]);
    if contexts.is_empty() {
        return Ok(None);
    }
    Ok(Some(Selection { export_name: export.export.name.clone(), contexts }))
}

/// Encodes option data for LIST/SET (tests, fuzz seeds).
pub fn encode_meta_request(export_name: &str, queries: &[&str]) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&(export_name.len() as u32).to_be_bytes());
    v.extend_from_slice(export_name.as_bytes());
    v.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        v.extend_from_slice(&(q.len() as u32).to_be_bytes());
        v.extend_from_slice(q.as_bytes());
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse_strictly() {
        let ok = encode_meta_request("e", &["base:allocation", "x"]);
        let r = parse_meta_request(&ok).unwrap();
        assert_eq!((r.export_name.as_str(), r.queries.len()), ("e", 2));
        assert_eq!(parse_meta_request(&encode_meta_request("", &[])).unwrap().queries, Vec::<String>::new());
        // Trailing byte, truncated query, a count the data cannot hold, too many queries.
        let mut trailing = ok.clone();
        trailing.push(0);
        assert_eq!(parse_meta_request(&trailing).unwrap_err().reply, REP_ERR_INVALID);
        assert_eq!(parse_meta_request(&ok[..ok.len() - 1]).unwrap_err().reply, REP_ERR_INVALID);
        let mut lying = encode_meta_request("e", &[]);
        let at = lying.len() - 4;
        lying[at..].copy_from_slice(&40u32.to_be_bytes());
        assert_eq!(parse_meta_request(&lying).unwrap_err().reply, REP_ERR_INVALID);
        lying[at..].copy_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(parse_meta_request(&lying).unwrap_err().reply, REP_ERR_TOO_BIG);
        let many: Vec<&str> = vec!["q"; META_QUERIES_MAX + 1];
        assert_eq!(parse_meta_request(&encode_meta_request("e", &many)).unwrap_err().reply, REP_ERR_TOO_BIG);
        // Lengths beyond the string limits, and bad UTF-8.
        let mut long_name = encode_meta_request("e", &[]);
        long_name[0..4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(parse_meta_request(&long_name).unwrap_err().reply, REP_ERR_TOO_BIG);
        let mut bad_utf8 = encode_meta_request("e", &["ab"]);
        let n = bad_utf8.len();
        bad_utf8[n - 2] = 0xff;
        assert_eq!(parse_meta_request(&bad_utf8).unwrap_err().reply, REP_ERR_INVALID);
        assert_eq!(parse_meta_request(&[]).unwrap_err().reply, REP_ERR_INVALID);
    }

    #[test]
    fn queries_name_contexts_exactly() {
        assert_eq!(classify("base:allocation"), Query::Context(MetaContext::Allocation));
        assert_eq!(classify("base:"), Query::BaseWildcard);
        assert_eq!(classify("x-mdkit:changed-since:7"), Query::Context(MetaContext::ChangedSince { base: 7 }));
        assert_eq!(classify("x-mdkit:changed-since:"), Query::ChangedSinceWildcard);
        for bad in
            ["base:allocatio", "x-mdkit:changed-since:07", "x-mdkit:changed-since:+7", "x-mdkit:changed-since: 7"]
        {
            assert_eq!(classify(bad), Query::Unknown, "{bad}");
        }
        assert_eq!(classify("x-mdkit:changed-since:99999999999999999999"), Query::Unknown);
        assert_eq!(MetaContext::ChangedSince { base: 3 }.name(), "x-mdkit:changed-since:3");
    }
}
