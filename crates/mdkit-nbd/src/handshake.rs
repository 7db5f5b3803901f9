//! Fixed newstyle handshake and option haggling.
//!
//! Every length the client sends is checked before anything is allocated from it: option data
//! is capped at [`OPTION_DATA_MAX_BYTES`]; larger options up to [`OPTION_DISCARD_MAX_BYTES`]
//! are read into a small scratch buffer and thrown away (reply `NBD_REP_ERR_TOO_BIG`), anything
//! larger ends the connection. The number of options per connection is capped as well, and the
//! whole handshake runs under a timeout set by the caller.

use std::io;
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::export::ExportState;
use crate::meta_context::{self, MetaContext, Selection};
use crate::proto::*;
use crate::server::Shared;

/// Largest option payload we parse (a 4096-byte name plus a list of info requests fits).
pub const OPTION_DATA_MAX_BYTES: u32 = 16 << 10;
/// Largest option payload we skip over instead of hanging up.
pub const OPTION_DISCARD_MAX_BYTES: u32 = 1 << 20;
/// Options accepted on one connection before we decide the client is looping.
pub const OPTIONS_MAX_PER_CONNECTION: u32 = 1024;
/// Longest export name accepted (the protocol's string limit).
pub const NAME_MAX_BYTES: usize = 4096;

/// What the handshake agreed on.
pub struct Negotiated {
    pub export: Arc<ExportState>,
    /// Structured replies were negotiated: reads must use them.
    pub structured: bool,
    /// The client asked for NBD_INFO_BLOCK_SIZE in NBD_OPT_GO, so it promised to honour the
    /// advertised minimum block size (misaligned requests then get EINVAL).
    pub block_size_committed: bool,
    pub flags: u16,
    /// Meta contexts BLOCK_STATUS answers, in context-id order (id = index + 1); empty when
    /// the last NBD_OPT_SET_META_CONTEXT did not name this export (BLOCK_STATUS then fails).
    pub contexts: Vec<MetaContext>,
}

/// The contexts of `selection` if it was made for `export`.
fn contexts_for(selection: &Option<Selection>, export: &ExportState) -> Vec<MetaContext> {
    match selection {
        Some(sel) if sel.export_name == export.export.name => sel.contexts.clone(),
        _ => Vec::new(),
    }
}

/// Runs the handshake of connection `conn_id`. `Ok(None)`: the client ended it (ABORT or EOF)
/// politely. `Err`: protocol violation or I/O error; the caller hard-disconnects. The
/// connection is marked negotiated ([`Shared::handshake_done`]) before the reply that ends the
/// handshake goes out, so a handshake flood cannot cut a client that already has it.
pub async fn negotiate<S>(s: &mut S, shared: &Shared, peer: &str, conn_id: u64) -> io::Result<Option<Negotiated>>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut hello = Vec::with_capacity(18);
    hello.extend_from_slice(&NBDMAGIC.to_be_bytes());
    hello.extend_from_slice(&IHAVEOPT.to_be_bytes());
    hello.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    s.write_all(&hello).await?;

    let client_flags = s.read_u32().await?;
    if client_flags & !CLIENT_FLAGS_KNOWN != 0 {
        return Err(violation(format!("unknown client flags {client_flags:#x}")));
    }
    let no_zeroes = client_flags & FLAG_C_NO_ZEROES != 0;
    let mut structured = false;
    let mut selection: Option<Selection> = None;
    let mut scratch = Vec::new();

    for _ in 0..OPTIONS_MAX_PER_CONNECTION {
        let magic = match s.read_u64().await {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        };
        if magic != IHAVEOPT {
            return Err(violation(format!("bad option magic {magic:#x}")));
        }
        let option = s.read_u32().await?;
        let len = s.read_u32().await?;
        if len > OPTION_DATA_MAX_BYTES {
            if len > OPTION_DISCARD_MAX_BYTES {
                return Err(violation(format!("option {option} with {len} data bytes")));
            }
            discard(s, u64::from(len)).await?;
            let msg = format!("option data of {len} bytes exceeds the {OPTION_DATA_MAX_BYTES}-byte limit");
            send(s, option, REP_ERR_TOO_BIG, msg.as_bytes()).await?;
            continue;
        }
        let mut data = vec![0u8; len as usize];
        s.read_exact(&mut data).await?;
        tracing::trace!(peer, option, len, "nbd option");

        if shared.is_shutting_down() && option != OPT_ABORT {
            send(s, option, REP_ERR_SHUTDOWN, b"server is shutting down").await?;
            continue;
        }
        match option {
            OPT_ABORT => {
                // The client may already have gone; a failed ACK is not an error.
                let _ = send(s, option, REP_ACK, &[]).await;
                return Ok(None);
            }
            OPT_LIST => {
                if !data.is_empty() {
                    send(s, option, REP_ERR_INVALID, b"NBD_OPT_LIST takes no data").await?;
                    continue;
                }
                let mut out = Vec::new();
                for e in shared.exports_snapshot() {
                    scratch.clear();
                    let name = e.export.name.as_bytes();
                    scratch.extend_from_slice(&(name.len() as u32).to_be_bytes());
                    scratch.extend_from_slice(name);
                    scratch.extend_from_slice(e.export.description.as_bytes());
                    put_option_reply(&mut out, option, REP_SERVER, &scratch);
                }
                put_option_reply(&mut out, option, REP_ACK, &[]);
                s.write_all(&out).await?;
            }
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    send(s, option, REP_ERR_INVALID, b"NBD_OPT_STRUCTURED_REPLY takes no data").await?;
                } else if structured {
                    send(s, option, REP_ERR_INVALID, b"structured replies already negotiated").await?;
                } else {
                    structured = true;
                    send(s, option, REP_ACK, &[]).await?;
                }
            }
            OPT_LIST_META_CONTEXT => {
                meta_context::list_or_set(s, shared, option, &data, structured).await?;
            }
            OPT_SET_META_CONTEXT => {
                // A SET replaces the selection, even when it fails.
                selection = meta_context::list_or_set(s, shared, option, &data, structured).await?;
            }
            OPT_INFO | OPT_GO => {
                if let Some(mut n) = info_or_go(s, shared, option, &data, structured, conn_id).await? {
                    n.contexts = contexts_for(&selection, &n.export);
                    return Ok(Some(n));
                }
            }
            OPT_EXPORT_NAME => {
                let name = String::from_utf8(data).map_err(|_| violation("export name is not UTF-8".into()))?;
                // No way to report an error here: the protocol says hang up.
                let export = shared
                    .find_export(&name)
                    .ok_or_else(|| violation(format!("NBD_OPT_EXPORT_NAME for unknown export {name:?}")))?;
                let flags = export.transmission_flags(structured);
                let mut out = Vec::with_capacity(10 + 124);
                out.extend_from_slice(&export.topology().size_bytes.to_be_bytes());
                out.extend_from_slice(&flags.to_be_bytes());
                if !no_zeroes {
                    out.resize(out.len() + 124, 0);
                }
                shared.handshake_done(conn_id);
                s.write_all(&out).await?;
                let contexts = contexts_for(&selection, &export);
                return Ok(Some(Negotiated { export, structured, block_size_committed: false, flags, contexts }));
            }
            OPT_STARTTLS => send(s, option, REP_ERR_UNSUP, b"TLS is not supported").await?,
            _ => {
                let msg = format!("option {option} is not supported");
                send(s, option, REP_ERR_UNSUP, msg.as_bytes()).await?;
            }
        }
    }
    Err(violation(format!("more than {OPTIONS_MAX_PER_CONNECTION} options")))
}

/// Handles NBD_OPT_INFO / NBD_OPT_GO. Returns the negotiated state for a successful GO.
async fn info_or_go<S>(
    s: &mut S,
    shared: &Shared,
    option: u32,
    data: &[u8],
    structured: bool,
    conn_id: u64,
) -> io::Result<Option<Negotiated>>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let Some((name, requests)) = parse_info_request(data) else {
        send(s, option, REP_ERR_INVALID, b"malformed NBD_OPT_INFO/GO data").await?;
        return Ok(None);
    };
    let Some(export) = shared.find_export(&name) else {
        let msg = format!("no export named {name:?}");
        send(s, option, REP_ERR_UNKNOWN, msg.as_bytes()).await?;
        return Ok(None);
    };
    let flags = export.transmission_flags(structured);
    let mut out = Vec::with_capacity(256);
    let mut info = Vec::with_capacity(64);

    info.extend_from_slice(&INFO_EXPORT.to_be_bytes());
    info.extend_from_slice(&export.topology().size_bytes.to_be_bytes());
    info.extend_from_slice(&flags.to_be_bytes());
    put_option_reply(&mut out, option, REP_INFO, &info);

    if requests.contains(&INFO_NAME) {
        info.clear();
        info.extend_from_slice(&INFO_NAME.to_be_bytes());
        info.extend_from_slice(export.export.name.as_bytes());
        put_option_reply(&mut out, option, REP_INFO, &info);
    }
    if requests.contains(&INFO_DESCRIPTION) && !export.export.description.is_empty() {
        info.clear();
        info.extend_from_slice(&INFO_DESCRIPTION.to_be_bytes());
        info.extend_from_slice(export.export.description.as_bytes());
        put_option_reply(&mut out, option, REP_INFO, &info);
    }
    // Sent whether or not it was asked for (allowed: clients ignore what they did not ask
    // for); only a GO that asked for it commits the client to the minimum block size.
    let bs = export.block_sizes(shared.options.max_payload_bytes);
    info.clear();
    info.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    info.extend_from_slice(&bs.min_bytes.to_be_bytes());
    info.extend_from_slice(&bs.preferred_bytes.to_be_bytes());
    info.extend_from_slice(&bs.max_payload_bytes.to_be_bytes());
    put_option_reply(&mut out, option, REP_INFO, &info);

    put_option_reply(&mut out, option, REP_ACK, &[]);
    if option == OPT_GO {
        shared.handshake_done(conn_id);
    }
    s.write_all(&out).await?;
    if option == OPT_GO {
        let block_size_committed = requests.contains(&INFO_BLOCK_SIZE);
        return Ok(Some(Negotiated { export, structured, block_size_committed, flags, contexts: Vec::new() }));
    }
    Ok(None)
}

/// Parses `u32 name_len, name, u16 n, u16[n]`; `None` when lengths are inconsistent.
pub fn parse_info_request(data: &[u8]) -> Option<(String, Vec<u16>)> {
    let name_len = u32::from_be_bytes(data.get(0..4)?.try_into().ok()?) as usize;
    if name_len > NAME_MAX_BYTES {
        return None;
    }
    let name = data.get(4..4 + name_len)?;
    let n_at = 4 + name_len;
    let n = u16::from_be_bytes(data.get(n_at..n_at + 2)?.try_into().ok()?) as usize;
    let list = data.get(n_at + 2..)?;
    if list.len() != 2 * n {
        return None;
    }
    let requests = list.chunks_exact(2).map(|c| u16::from_be_bytes([c[0], c[1]])).collect();
    Some((String::from_utf8(name.to_vec()).ok()?, requests))
}

async fn send<S: AsyncWrite + Unpin>(s: &mut S, option: u32, reply: u32, data: &[u8]) -> io::Result<()> {
    let mut out = Vec::with_capacity(20 + data.len());
    put_option_reply(&mut out, option, reply, data);
    s.write_all(&out).await
}

async fn discard<S: AsyncRead + Unpin>(s: &mut S, mut len: u64) -> io::Result<()> {
    let mut sink = [0u8; 4096];
    while len > 0 {
        let n = len.min(sink.len() as u64) as usize;
        s.read_exact(&mut sink[..n]).await?;
        len -= n as u64;
    }
    Ok(())
}

fn violation(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(name: &[u8], reqs: &[u16]) -> Vec<u8> {
        let mut v = (name.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(name);
        v.extend_from_slice(&(reqs.len() as u16).to_be_bytes());
        for r in reqs {
            v.extend_from_slice(&r.to_be_bytes());
        }
        v
    }

    /// A client's socket: reads a scripted byte string; for each reply the server writes, notes
    /// whether the connection was still negotiating when the client could first see it.
    struct Observed {
        client: std::io::Cursor<Vec<u8>>,
        shared: Arc<Shared>,
        still_handshaking: Vec<bool>,
    }

    impl tokio::io::AsyncRead for Observed {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<io::Result<()>> {
            std::pin::Pin::new(&mut self.client).poll_read(cx, buf)
        }
    }

    impl AsyncWrite for Observed {
        fn poll_write(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<io::Result<usize>> {
            let now = self.shared.is_handshaking(7);
            self.still_handshaking.push(now);
            std::task::Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
        fn poll_shutdown(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
    }

    /// Once a client can read the reply that ends its handshake (GO's ACK, or EXPORT_NAME's
    /// export data), its connection no longer counts as a handshake: a flood of new connections
    /// arriving right then cannot cut it (it was marked after the write, and a test with a
    /// real flood caught a client cut in that gap).
    #[test]
    fn a_client_holding_the_final_reply_is_no_longer_a_handshake() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        for client in crate::fuzzing::seed_handshakes().into_iter().take(2) {
            let server = crate::NbdServer::new(crate::ServerOptions { max_handshakes: 1, ..Default::default() });
            let device = Arc::new(mdkit_io::MemDevice::new("d", 1 << 20));
            server
                .add_export(crate::Export { name: "d".into(), description: String::new(), device, read_only: false })
                .unwrap();
            server.set_default_export(Some("d".into()));
            let shared = server.shared().clone();
            let idle = rt.spawn(std::future::pending::<()>());
            shared.insert_connection(7, idle.abort_handle());
            let mut s = Observed {
                client: std::io::Cursor::new(client),
                shared: shared.clone(),
                still_handshaking: Vec::new(),
            };
            let done = rt.block_on(negotiate(&mut s, &shared, "test", 7)).unwrap();
            assert!(done.is_some(), "the seed handshake negotiates");
            let seen = &s.still_handshaking;
            assert!(seen.len() >= 2 && seen[0], "earlier replies go out while it negotiates: {seen:?}");
            assert_eq!(seen.last(), Some(&false), "the final reply goes out after it stopped counting: {seen:?}");
            idle.abort();
        }
    }

    #[test]
    fn info_request_parser_accepts_wellformed_and_rejects_inconsistent() {
        assert_eq!(parse_info_request(&info(b"abc", &[3, 1])), Some(("abc".into(), vec![3, 1])));
        assert_eq!(parse_info_request(&info(b"", &[])), Some((String::new(), vec![])));
        let mut bad = info(b"abc", &[3]);
        bad.push(0);
        assert_eq!(parse_info_request(&bad), None);
        let mut long_name = info(b"abc", &[]);
        long_name[0..4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(parse_info_request(&long_name), None);
        assert_eq!(parse_info_request(&[0, 0]), None);
        assert_eq!(parse_info_request(&info(&[0xff, 0xfe], &[])), None);
    }
}
