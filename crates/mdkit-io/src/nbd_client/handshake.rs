//! The client side of the fixed-newstyle handshake: greeting, client flags,
//! `NBD_OPT_STRUCTURED_REPLY` (used when the server agrees), then `NBD_OPT_GO` asking for
//! `NBD_INFO_BLOCK_SIZE` (falling back to `NBD_OPT_EXPORT_NAME` on servers without GO). What
//! the server says is validated against the spec's limits before it shapes the device.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::error::{NbdClientError, NbdErrorKind};
use super::proto::*;

/// Option replies longer than this are refused (the spec's option data limit is 64 KiB for
/// requests; replies we ask for are tiny).
const OPTION_REPLY_MAX_BYTES: u32 = 64 << 10;

/// What the handshake learned about the export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExportInfo {
    pub size_bytes: u64,
    pub transmission_flags: u16,
    /// From `NBD_INFO_BLOCK_SIZE`, or (1, 4096, 32 MiB) when not given.
    pub min_block_bytes: u32,
    pub preferred_block_bytes: u32,
    pub max_block_bytes: u32,
    pub structured_replies: bool,
}

impl ExportInfo {
    pub fn has(&self, flag: u16) -> bool {
        self.transmission_flags & flag != 0
    }
}

struct Ctx<'a> {
    target: &'a str,
}

impl Ctx<'_> {
    fn err(&self, kind: NbdErrorKind, detail: impl Into<String>) -> NbdClientError {
        NbdClientError::new(kind, self.target, "handshake", detail)
    }
    fn io(&self, what: &str, e: std::io::Error) -> NbdClientError {
        self.err(NbdErrorKind::Handshake, format!("{what}: {e}"))
    }
}

/// Runs the handshake on a fresh connection and returns the export's description.
pub async fn handshake<S>(s: &mut S, target: &str, export: &str) -> Result<ExportInfo, NbdClientError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let c = Ctx { target };
    let magic = s.read_u64().await.map_err(|e| c.io("reading the greeting", e))?;
    if magic != NBDMAGIC {
        return Err(c.err(NbdErrorKind::Handshake, format!("not an NBD server (greeting {magic:#018x})")));
    }
    let style = s.read_u64().await.map_err(|e| c.io("reading the greeting", e))?;
    if style == OLDSTYLE_MAGIC {
        return Err(c.err(NbdErrorKind::Handshake, "oldstyle servers are not supported (use newstyle)"));
    }
    if style != IHAVEOPT {
        return Err(c.err(NbdErrorKind::Handshake, format!("unknown handshake style {style:#018x}")));
    }
    let hflags = s.read_u16().await.map_err(|e| c.io("reading handshake flags", e))?;
    if hflags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(c.err(NbdErrorKind::Handshake, "the server does not speak fixed newstyle"));
    }
    let no_zeroes = hflags & FLAG_NO_ZEROES != 0;
    let cflags = FLAG_C_FIXED_NEWSTYLE | if no_zeroes { FLAG_C_NO_ZEROES } else { 0 };
    s.write_u32(cflags).await.map_err(|e| c.io("sending client flags", e))?;
    let structured = negotiate_structured(s, &c).await?;
    let mut info = match go(s, &c, export).await? {
        Some(info) => info,
        None => export_name(s, &c, export, no_zeroes).await?,
    };
    info.structured_replies = structured;
    validate(&c, &info)?;
    Ok(info)
}

async fn send_option<S: AsyncWrite + Unpin>(
    s: &mut S,
    c: &Ctx<'_>,
    opt: u32,
    data: &[u8],
) -> Result<(), NbdClientError> {
    let mut m = Vec::with_capacity(16 + data.len());
    m.extend_from_slice(&IHAVEOPT.to_be_bytes());
    m.extend_from_slice(&opt.to_be_bytes());
    m.extend_from_slice(&(data.len() as u32).to_be_bytes());
    m.extend_from_slice(data);
    s.write_all(&m).await.map_err(|e| c.io("sending an option", e))?;
    s.flush().await.map_err(|e| c.io("sending an option", e))
}

/// One option reply: (reply type, data).
async fn option_reply<S: AsyncRead + Unpin>(
    s: &mut S,
    c: &Ctx<'_>,
    opt: u32,
) -> Result<(u32, Vec<u8>), NbdClientError> {
    let mut h = [0u8; 20];
    s.read_exact(&mut h).await.map_err(|e| c.io("reading an option reply", e))?;
    let magic = u64::from_be_bytes(h[0..8].try_into().expect("8 bytes"));
    let got_opt = u32::from_be_bytes(h[8..12].try_into().expect("4 bytes"));
    let rep = u32::from_be_bytes(h[12..16].try_into().expect("4 bytes"));
    let len = u32::from_be_bytes(h[16..20].try_into().expect("4 bytes"));
    if magic != OPT_REPLY_MAGIC || got_opt != opt {
        return Err(c.err(NbdErrorKind::Handshake, format!("bad option reply (magic {magic:#x}, option {got_opt})")));
    }
    if len > OPTION_REPLY_MAX_BYTES {
        return Err(c.err(NbdErrorKind::Handshake, format!("option reply of {len} bytes")));
    }
    let mut data = vec![0u8; len as usize];
    s.read_exact(&mut data).await.map_err(|e| c.io("reading option reply data", e))?;
    Ok((rep, data))
}

async fn negotiate_structured<S>(s: &mut S, c: &Ctx<'_>) -> Result<bool, NbdClientError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    send_option(s, c, OPT_STRUCTURED_REPLY, &[]).await?;
    let (rep, _) = option_reply(s, c, OPT_STRUCTURED_REPLY).await?;
    match rep {
        REP_ACK => Ok(true),
        r if r & REP_ERR_BIT != 0 => Ok(false),
        r => Err(c.err(NbdErrorKind::Handshake, format!("unexpected reply {r} to NBD_OPT_STRUCTURED_REPLY"))),
    }
}

/// `NBD_OPT_GO`; `None` when the server does not know the option (use EXPORT_NAME).
async fn go<S>(s: &mut S, c: &Ctx<'_>, export: &str) -> Result<Option<ExportInfo>, NbdClientError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut data = Vec::with_capacity(8 + export.len());
    data.extend_from_slice(&(export.len() as u32).to_be_bytes());
    data.extend_from_slice(export.as_bytes());
    data.extend_from_slice(&1u16.to_be_bytes());
    data.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    send_option(s, c, OPT_GO, &data).await?;
    let mut export_info: Option<(u64, u16)> = None;
    let mut sizes: Option<(u32, u32, u32)> = None;
    // Bounded: a server may send a few INFO replies, never an endless stream.
    for _ in 0..64 {
        let (rep, d) = option_reply(s, c, OPT_GO).await?;
        match rep {
            REP_INFO if d.len() >= 2 => {
                let kind = u16::from_be_bytes([d[0], d[1]]);
                match (kind, d.len()) {
                    (INFO_EXPORT, 12) => {
                        let size = u64::from_be_bytes(d[2..10].try_into().expect("8 bytes"));
                        export_info = Some((size, u16::from_be_bytes([d[10], d[11]])));
                    }
                    (INFO_BLOCK_SIZE, 14) => {
                        let u = |i: usize| u32::from_be_bytes(d[i..i + 4].try_into().expect("4 bytes"));
                        sizes = Some((u(2), u(6), u(10)));
                    }
                    (INFO_EXPORT | INFO_BLOCK_SIZE, n) => {
                        return Err(c.err(NbdErrorKind::Handshake, format!("NBD_INFO {kind} of {n} bytes")));
                    }
                    _ => {}
                }
            }
            REP_ACK => {
                let (size_bytes, transmission_flags) = export_info
                    .ok_or_else(|| c.err(NbdErrorKind::Handshake, "NBD_OPT_GO finished without NBD_INFO_EXPORT"))?;
                let (min, pref, max) = sizes.unwrap_or((1, 4096, DEFAULT_MAX_PAYLOAD_BYTES));
                return Ok(Some(ExportInfo {
                    size_bytes,
                    transmission_flags,
                    min_block_bytes: min,
                    preferred_block_bytes: pref,
                    max_block_bytes: max,
                    structured_replies: false,
                }));
            }
            REP_ERR_UNSUP if export_info.is_none() => return Ok(None),
            r if r & REP_ERR_BIT != 0 => {
                let msg = String::from_utf8_lossy(&d).into_owned();
                let kind = if r == REP_ERR_TLS_REQD || r == REP_ERR_UNKNOWN || r == REP_ERR_POLICY {
                    NbdErrorKind::ExportRefused
                } else {
                    NbdErrorKind::Handshake
                };
                return Err(c.err(kind, format!("export {export:?}: {}: {msg}", rep_error_name(r))));
            }
            r => return Err(c.err(NbdErrorKind::Handshake, format!("unexpected reply {r} to NBD_OPT_GO"))),
        }
    }
    Err(c.err(NbdErrorKind::Handshake, "NBD_OPT_GO: too many replies"))
}

/// The old way into transmission, for servers without NBD_OPT_GO.
async fn export_name<S>(s: &mut S, c: &Ctx<'_>, export: &str, no_zeroes: bool) -> Result<ExportInfo, NbdClientError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    send_option(s, c, OPT_EXPORT_NAME, export.as_bytes()).await?;
    let size_bytes = s.read_u64().await.map_err(|e| c.io(&format!("export {export:?} (NBD_OPT_EXPORT_NAME)"), e))?;
    let transmission_flags = s.read_u16().await.map_err(|e| c.io("reading transmission flags", e))?;
    if !no_zeroes {
        let mut z = [0u8; 124];
        s.read_exact(&mut z).await.map_err(|e| c.io("reading the zero padding", e))?;
    }
    Ok(ExportInfo {
        size_bytes,
        transmission_flags,
        min_block_bytes: 1,
        preferred_block_bytes: 4096,
        max_block_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
        structured_replies: false,
    })
}

/// The spec's block-size rules, plus what an md member needs.
fn validate(c: &Ctx<'_>, i: &ExportInfo) -> Result<(), NbdClientError> {
    let (min, pref, max) = (i.min_block_bytes, i.preferred_block_bytes, i.max_block_bytes);
    let ok = min.is_power_of_two()
        && min <= 65536
        && pref.is_power_of_two()
        && pref >= min.max(512)
        && max >= min
        && (max == u32::MAX || max.is_multiple_of(min));
    if !ok {
        return Err(c.err(
            NbdErrorKind::Handshake,
            format!("invalid block sizes: minimum {min}, preferred {pref}, maximum {max}"),
        ));
    }
    if min > 4096 {
        return Err(c.err(NbdErrorKind::Handshake, format!("minimum block size {min} bytes is above 4096")));
    }
    if i.transmission_flags & FLAG_HAS_FLAGS == 0 {
        return Err(c.err(NbdErrorKind::Handshake, "transmission flags without NBD_FLAG_HAS_FLAGS"));
    }
    if i.transmission_flags & FLAG_READ_ONLY != 0 {
        return Err(c.err(NbdErrorKind::ExportRefused, "the export is read-only; a member must be writable"));
    }
    Ok(())
}
