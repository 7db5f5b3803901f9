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
//! Adding a command (e.g. `attr.get`, `create`, `thin.create`): write a module with
//! `pub fn register(r: &mut Registry)` that calls `r.register("name", "help", handler)`, where
//! the handler is `fn(Arc<Service>, serde_json::Value) -> BoxFuture<'static, Result<Value>>`,
//! and call it from [`registry()`]. The CLI side sends `{"cmd": "name", "args": ...}` with
//! [`client::ControlClient::call`].

pub mod client;
pub mod md;
pub mod md_grow;
pub mod monitor;
pub mod status;
pub mod thin;
pub mod thin_activate;
pub mod thin_tools;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, anyhow};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;

use crate::service::Service;
use crate::volumes::BoxFuture;

/// Longest request line accepted.
pub const REQUEST_MAX_BYTES: usize = 64 << 10;
/// Control clients served at once.
const CLIENTS_MAX: usize = 64;

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
/// anything is created for it.
pub(crate) async fn check_new_export(svc: &Service, name: &str) -> Result<()> {
    if name.is_empty() || name.len() > mdkit_nbd::handshake::NAME_MAX_BYTES || name.contains('\0') {
        return Err(anyhow!(
            "export name {:.80?}: must be 1..={} bytes without NUL",
            name,
            mdkit_nbd::handshake::NAME_MAX_BYTES
        ));
    }
    if let Some(e) = svc.exports.read().await.iter().find(|e| e.name == name) {
        return Err(anyhow!("export name {name:?} is taken (volume {:?})", e.volume));
    }
    if let Some(e) = svc.failed_exports.read().await.iter().find(|e| e.spec.name == name) {
        return Err(anyhow!("export name {name:?} is taken (failed volume {:?})", e.spec.volume));
    }
    Ok(())
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
        let clients = Arc::new(Semaphore::new(CLIENTS_MAX));
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
                let Ok(permit) = clients.clone().try_acquire_owned() else {
                    tracing::warn!("too many control clients; closing one");
                    continue;
                };
                let (service, registry) = (service.clone(), registry.clone());
                tokio::spawn(async move {
                    let _permit = permit;
                    if let Err(e) = serve_client(stream, service, registry).await {
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

async fn serve_client(stream: UnixStream, service: Arc<Service>, registry: Arc<Registry>) -> Result<()> {
    let (r, mut w) = stream.into_split();
    let mut r = BufReader::new(r);
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = (&mut r).take(REQUEST_MAX_BYTES as u64 + 1).read_until(b'\n', &mut line).await?;
        if n == 0 {
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
            Ok(req) if req.cmd == monitor::STREAM_CMD => return monitor::stream(r, w, service, req.args).await,
            Ok(req) => registry.call(service.clone(), req).await,
            Err(e) => Response::err(format!("malformed request: {e}")),
        };
        send(&mut w, &resp).await?;
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

async fn send(w: &mut tokio::net::unix::OwnedWriteHalf, resp: &Response) -> Result<()> {
    let mut out = serde_json::to_vec(resp)?;
    out.push(b'\n');
    w.write_all(&out).await?;
    Ok(())
}
