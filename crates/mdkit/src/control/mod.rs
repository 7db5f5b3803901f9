//! The control socket: a Unix socket speaking JSON lines, one request and one response per
//! line, one task per client connection.
//!
//! ```text
//!   → {"cmd": "status", "args": {}}
//!   ← {"ok": true, "result": {...}}
//!   ← {"ok": false, "error": "unknown command \"bogus\" (known: help, status)"}
//! ```
//!
//! Requests are at most [`REQUEST_MAX_BYTES`]; a longer line gets an error and the connection
//! is closed. Commands are looked up in a [`Registry`] built by [`registry()`].
//!
//! At most [`admission::CLIENTS_MAX`] clients are connected at once; one that sends no request
//! for [`admission::IDLE_TIMEOUT`] is closed, and when the socket is full a new client cuts the
//! one idle the longest (the rules are in [`admission`]). A client closed by these rules, or
//! refused, first gets an error line `{"ok": false, "error": "..."}` saying why.
//!
//! Adding a command (e.g. `attr.get`, `create`, `thin.create`): write a module with
//! `pub fn register(r: &mut Registry)` that calls `r.register("name", "help", handler)`, where
//! the handler is `fn(Arc<Service>, serde_json::Value) -> BoxFuture<'static, Result<Value>>`,
//! and call it from [`registry()`]. The CLI side sends `{"cmd": "name", "args": ...}` with
//! [`client::ControlClient::call`].

pub mod admission;
pub mod client;
pub mod md;
pub mod md_grow;
pub mod monitor;
pub mod status;
pub mod thin;
pub mod thin_activate;
pub mod thin_pool_activate;
pub mod thin_tools;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Notify;

use admission::{CLIENTS_MAX, Client, IDLE_TIMEOUT, State};

use crate::service::Service;
use crate::volumes::BoxFuture;
use crate::volumes::name_claim::NameClaim;

/// Longest request line accepted.
pub const REQUEST_MAX_BYTES: usize = 64 << 10;

/// A request line.
#[derive(Debug, Serialize, Deserialize)]
pub struct Request {
    pub cmd: String,
    #[serde(default)]
    pub args: Value,
}

/// A response line.
#[derive(Debug, Serialize, Deserialize)]
pub struct Response {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

pub type Handler = Box<dyn Fn(Arc<Service>, Value) -> BoxFuture<'static, Result<Value>> + Send + Sync>;

/// Command name → handler.
#[derive(Default)]
pub struct Registry {
    commands: BTreeMap<&'static str, (&'static str, Handler)>,
}

impl Registry {
    /// Registers `name`; panics on a duplicate name (a programming error caught by any test).
    pub fn register<F>(&mut self, name: &'static str, help: &'static str, handler: F)
    where
        F: Fn(Arc<Service>, Value) -> BoxFuture<'static, Result<Value>> + Send + Sync + 'static,
    {
        let prev = self.commands.insert(name, (help, Box::new(handler)));
        assert!(prev.is_none(), "control command {name:?} registered twice");
    }

    pub async fn call(&self, service: Arc<Service>, req: Request) -> Response {
        let Some((_, h)) = self.commands.get(req.cmd.as_str()) else {
            let known: Vec<&str> = self.commands.keys().copied().collect();
            return Response::err(format!("unknown command {:?} (known: {})", req.cmd, known.join(", ")));
        };
        // A panicking command answers with an error; the service and its volumes carry on.
        match crate::volumes::catch_panic(h(service, req.args)).await {
            Ok(Ok(v)) => Response { ok: true, result: Some(v), error: None },
            Ok(Err(e)) => Response::err(format!("{e:#}")),
            Err(panic) => {
                tracing::error!(cmd = %req.cmd, "control command panicked: {panic}");
                Response::err(format!("{}: internal error (panicked: {panic}); the service keeps running", req.cmd))
            }
        }
    }

    fn help(&self) -> Value {
        self.commands.iter().map(|(n, (h, _))| (n.to_string(), Value::String(h.to_string()))).collect()
    }
}

impl Response {
    pub fn err(msg: String) -> Response {
        Response { ok: false, result: None, error: Some(msg) }
    }
}

/// Every control command. Add new command groups here.
pub fn registry() -> Registry {
    let mut r = Registry::default();
    status::register(&mut r);
    md::register(&mut r);
    thin::register(&mut r);
    thin_tools::register(&mut r);
    thin_activate::register(&mut r);
    thin_pool_activate::register(&mut r);
    monitor::register(&mut r);
    r
}

/// Refuses `name` for a new volume, array or pool unless the config would take it.
pub(crate) fn check_name(what: &str, name: &str) -> Result<()> {
    if !crate::config::valid_name(name) {
        return Err(anyhow!("{what} {name:?}: use letters, digits, '-', '_' and '.' (1..=64 characters, not . or ..)"));
    }
    Ok(())
}

/// Refuses a new export name the NBD server would not take or another export has, before
/// anything is created for it, and claims it: the caller holds the claim until its export is
/// added (two requests creating volumes with one export name both passed the check before, and
/// the second's volume ended up without the export it asked for, yet remembered with it).
pub(crate) async fn check_new_export(svc: &Service, name: &str) -> Result<NameClaim> {
    if name.is_empty() || name.len() > mdkit_nbd::handshake::NAME_MAX_BYTES || name.contains('\0') {
        return Err(anyhow!(
            "export name {:.80?}: must be 1..={} bytes without NUL",
            name,
            mdkit_nbd::handshake::NAME_MAX_BYTES
        ));
    }
    let claim = svc.export_claims.claim_export(name)?;
    if let Some(e) = svc.exports.read().await.iter().find(|e| e.name == name) {
        return Err(anyhow!("export name {name:?} is taken (volume {:?})", e.volume));
    }
    if let Some(e) = svc.failed_exports.read().await.iter().find(|e| e.spec.name == name) {
        return Err(anyhow!("export name {name:?} is taken (failed volume {:?})", e.spec.volume));
    }
    if let Some((pool, volume)) = crate::volumes::thin_inactive::export_of_inactive(&*svc.volumes.read().await, name) {
        return Err(anyhow!(
            "export name {name:?} is taken (thin volume {volume:?} of the deactivated pool {pool:?}, served again on pool-activate)"
        ));
    }
    Ok(claim)
}

/// Refuses arguments to a command that takes none (`null` and `{}` are none).
pub(crate) fn no_args(cmd: &str, args: &Value) -> Result<()> {
    match args {
        Value::Null => Ok(()),
        Value::Object(m) if m.is_empty() => Ok(()),
        other => Err(anyhow!("{cmd} takes no arguments, got {:.200}", other.to_string())),
    }
}

/// The JSON type of `v`, for messages.
fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

//------------------------------------------------------------------------------------------------

/// The running control socket; [`ControlServer::stop`] removes it.
pub struct ControlServer {
    path: PathBuf,
    task: tokio::task::JoinHandle<()>,
}

impl ControlServer {
    pub async fn start(path: &Path, service: Arc<Service>, registry: Registry) -> Result<ControlServer> {
        if path.exists() {
            if UnixStream::connect(path).await.is_ok() {
                return Err(anyhow!(
                    "{}: another mdkit is already running (its control socket answers)",
                    path.display()
                ));
            }
            std::fs::remove_file(path).with_context(|| format!("removing stale control socket {}", path.display()))?;
        }
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let listener =
            UnixListener::bind(path).with_context(|| format!("binding control socket {}", path.display()))?;
        // Only the owner may control the service.
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .with_context(|| format!("chmod {}", path.display()))?;
        let mut registry = registry;
        let help = registry.help();
        registry.register("help", "list the control commands", move |_, args| {
            let help = help.clone();
            Box::pin(async move { no_args("help", &args).map(|()| help) })
        });
        let registry = Arc::new(registry);
        let clients = service.control_clients.clone();
        let task = tokio::spawn(async move {
            loop {
                let (stream, _) = match listener.accept().await {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!("control socket accept: {e}");
                        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let admitted = clients.lock().admit();
                let (id, cut_signal, cut) = match admitted {
                    Ok(a) => a,
                    Err(full) => {
                        tracing::warn!("refused a control client: {full}");
                        last_words(&stream, &Response::err(full.to_string()));
                        continue;
                    }
                };
                if let Some(cut) = cut {
                    tracing::info!(
                        "control socket full ({CLIENTS_MAX} clients): closed client {} ({:?}) to admit a new one",
                        cut.id,
                        cut.was
                    );
                }
                let client = Client::new(clients.clone(), id, cut_signal);
                let (service, registry) = (service.clone(), registry.clone());
                tokio::spawn(async move {
                    if let Err(e) = serve_client(stream, client, IDLE_TIMEOUT, service, registry).await {
                        tracing::debug!("control client: {e:#}");
                    }
                });
            }
        });
        tracing::info!(path = %path.display(), "control socket listening");
        Ok(ControlServer { path: path.to_path_buf(), task })
    }

    pub fn stop(self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The error line a client cut to make room gets.
fn cut_message(was: State) -> String {
    if was == State::Stream {
        format!(
            "closed to make room: the control socket had {CLIENTS_MAX} clients, the most it takes, all event \
             streams, and this stream was the oldest"
        )
    } else {
        format!(
            "closed to make room: the control socket had {CLIENTS_MAX} clients, the most it takes, and this one \
             was idle the longest"
        )
    }
}

/// What the wait for a client's next request line ended with.
#[derive(Debug, PartialEq, Eq)]
enum Wait {
    /// A line (or the last bytes before EOF) is in the buffer.
    Line,
    Eof,
    /// The client was cut to make room for a new one.
    Cut,
    /// No whole request line within the idle timeout.
    IdleTimeout,
}

/// Waits for the next request line of a client, at most `idle_timeout`, and for no longer than
/// the client's `cut` signal.
async fn next_request(
    r: &mut (impl AsyncBufRead + Unpin),
    line: &mut Vec<u8>,
    cut: &Notify,
    idle_timeout: Duration,
) -> std::io::Result<Wait> {
    let mut limited = r.take(REQUEST_MAX_BYTES as u64 + 1);
    tokio::select! {
        biased;
        () = cut.notified() => Ok(Wait::Cut),
        () = tokio::time::sleep(idle_timeout) => Ok(Wait::IdleTimeout),
        n = limited.read_until(b'\n', line) => {
            Ok(if n? == 0 { Wait::Eof } else { Wait::Line })
        }
    }
}

async fn serve_client(
    stream: UnixStream,
    client: Client,
    idle_timeout: Duration,
    service: Arc<Service>,
    registry: Arc<Registry>,
) -> Result<()> {
    let (r, mut w) = stream.into_split();
    let mut r = BufReader::new(r);
    let mut line = Vec::new();
    loop {
        line.clear();
        match next_request(&mut r, &mut line, &client.cut, idle_timeout).await? {
            Wait::Line => {}
            Wait::Eof => return Ok(()),
            Wait::Cut => {
                last_words(&w, &Response::err(cut_message(State::Idle)));
                return Ok(());
            }
            Wait::IdleTimeout => {
                client.timed_out();
                let msg =
                    format!("closed: no request within {} s (idle control clients are closed)", idle_timeout.as_secs());
                last_words(&w, &Response::err(msg));
                return Ok(());
            }
        }
        // Cut between reading the line and here: it must not start the command.
        if !client.set(State::Busy) {
            last_words(&w, &Response::err(cut_message(State::Idle)));
            return Ok(());
        }
        if line.len() > REQUEST_MAX_BYTES {
            let resp = Response::err(format!("request longer than {REQUEST_MAX_BYTES} bytes"));
            send(&mut w, &resp).await?;
            return Ok(());
        }
        let resp = match serde_json::from_slice::<Request>(&line) {
            // Every command takes named arguments; serde would read an array as positional ones.
            Ok(req) if !(req.args.is_null() || req.args.is_object()) => Response::err(format!(
                "{:.100}: arguments must be a JSON object, not {}",
                req.cmd,
                json_type(&req.args)
            )),
            Ok(req) if req.cmd == monitor::STREAM_CMD => {
                // Not cut between the two states: the table is only changed under its lock.
                client.set(State::Stream);
                return monitor::stream(r, w, service, req.args, &client.cut).await;
            }
            Ok(req) => registry.call(service.clone(), req).await,
            Err(e) => Response::err(format!("malformed request: {e}")),
        };
        send(&mut w, &resp).await?;
        // A busy client is never cut, so it is still in the table.
        client.set(State::Idle);
    }
}

/// A verb's arguments as `T`; a wrong value names the argument it was given for
/// (`md.create: bad arguments: `chunk_kib`: invalid type: string "x", expected u32`).
pub(crate) fn parse_args<T: serde::de::DeserializeOwned>(cmd: &str, args: Value) -> Result<T> {
    serde_path_to_error::deserialize(args).map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            anyhow!("{cmd}: bad arguments: {}", e.inner())
        } else {
            anyhow!("{cmd}: bad arguments: `{path}`: {}", e.inner())
        }
    })
}

/// Writes `v` as the last line to a client about to be closed, without waiting: a client that
/// does not read loses it, and nothing here blocks on it.
pub(crate) fn last_words<W: LastWords>(w: &W, v: &impl Serialize) {
    let Ok(mut out) = serde_json::to_vec(v) else { return };
    out.push(b'\n');
    let _ = w.try_write_line(&out);
}

/// A socket [`last_words`] can write to.
pub(crate) trait LastWords {
    fn try_write_line(&self, buf: &[u8]) -> std::io::Result<usize>;
}

impl LastWords for UnixStream {
    fn try_write_line(&self, buf: &[u8]) -> std::io::Result<usize> {
        self.try_write(buf)
    }
}

impl LastWords for OwnedWriteHalf {
    fn try_write_line(&self, buf: &[u8]) -> std::io::Result<usize> {
        self.try_write(buf)
    }
}

async fn send(w: &mut OwnedWriteHalf, resp: &Response) -> Result<()> {
    let mut out = serde_json::to_vec(resp)?;
    out.push(b'\n');
    w.write_all(&out).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client that sends nothing is closed after exactly the idle timeout (paused clock), a
    /// request that arrives just before it is read, and the wait starts over for each request.
    #[tokio::test(start_paused = true)]
    async fn a_client_that_sends_nothing_is_closed_after_the_idle_timeout() {
        let (server, mut peer) = UnixStream::pair().unwrap();
        let mut r = BufReader::new(server);
        let cut = Notify::new();
        let mut line = Vec::new();
        let start = tokio::time::Instant::now();
        let writer = tokio::spawn(async move {
            tokio::time::sleep(IDLE_TIMEOUT - Duration::from_millis(1)).await;
            peer.write_all(b"{\"cmd\": \"status\"}\n").await.unwrap();
            peer
        });
        assert_eq!(next_request(&mut r, &mut line, &cut, IDLE_TIMEOUT).await.unwrap(), Wait::Line);
        assert_eq!(line, b"{\"cmd\": \"status\"}\n");
        let _peer = writer.await.unwrap();
        let answered = tokio::time::Instant::now();
        assert_eq!(answered - start, IDLE_TIMEOUT - Duration::from_millis(1));
        line.clear();
        assert_eq!(next_request(&mut r, &mut line, &cut, IDLE_TIMEOUT).await.unwrap(), Wait::IdleTimeout);
        assert_eq!(tokio::time::Instant::now() - answered, IDLE_TIMEOUT);
        assert!(line.is_empty());
    }

    /// A client cut to make room stops waiting at once, before the idle timeout.
    #[tokio::test(start_paused = true)]
    async fn a_cut_client_stops_waiting_at_once() {
        let (server, _peer) = UnixStream::pair().unwrap();
        let mut r = BufReader::new(server);
        let cut = Notify::new();
        cut.notify_one();
        let start = tokio::time::Instant::now();
        assert_eq!(next_request(&mut r, &mut Vec::new(), &cut, IDLE_TIMEOUT).await.unwrap(), Wait::Cut);
        assert_eq!(tokio::time::Instant::now(), start);
    }

    #[test]
    fn the_limits_have_their_documented_values() {
        // docs/CONFIG.md, "Control socket limits".
        assert_eq!(CLIENTS_MAX, 64);
        assert_eq!(IDLE_TIMEOUT, Duration::from_secs(60));
    }
}
