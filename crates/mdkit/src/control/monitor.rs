//! Monitor control commands (`mdkit monitor`).
//!
//! | command           | args                | answer                                          |
//! |-------------------|---------------------|-------------------------------------------------|
//! | `monitor.oneshot` | test (bool)         | `{"events": [...]}`: the problems as they stand |
//! | `monitor.stream`  | test (bool)         | streaming, see below                            |
//!
//! `monitor.stream` answers `{"ok": true, "result": {"streaming": true}}`, then one line per
//! event `{"event": {...}}` (first a `TestMessage` per md array and thin pool when `test` is set), and
//! `{"missed": N}` when the client fell behind the bus and lost N events. The stream ends when
//! the client closes the connection or the service stops, or with a last line
//! `{"ok": false, "error": "..."}` when the control socket is full of event streams and a new
//! client needs this one's slot (see `control/admission.rs`).

use std::sync::Arc;

use anyhow::Result;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::OwnedWriteHalf;
use tokio::sync::Notify;
use tokio::sync::broadcast::error::RecvError;

use super::{Registry, Response};
use crate::events;
use crate::service::Service;

/// The streaming command; `serve_client` hands the connection over to [`stream`].
pub const STREAM_CMD: &str = "monitor.stream";

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct MonitorArgs {
    #[serde(default)]
    test: bool,
}

fn parse(args: Value) -> Result<MonitorArgs> {
    if args.is_null() {
        return Ok(MonitorArgs::default());
    }
    super::parse_args("monitor", args)
}

pub fn register(r: &mut Registry) {
    r.register(
        "monitor.oneshot",
        "events for the current state of every volume (mdadm --monitor --oneshot)",
        |svc, args| {
            Box::pin(async move {
                let a = parse(args)?;
                let evs = events::current(&svc, a.test).await;
                evs.iter().for_each(events::log);
                Ok(json!({ "events": evs }))
            })
        },
    );
    r.register(
        STREAM_CMD,
        "stream events as they happen (mdadm --monitor); streaming, see control/monitor.rs",
        |_, _| {
            Box::pin(async move { Err(anyhow::anyhow!("{STREAM_CMD} streams: it is served by the connection loop")) })
        },
    );
}

async fn send_line(w: &mut OwnedWriteHalf, v: &impl serde::Serialize) -> Result<()> {
    let mut out = serde_json::to_vec(v)?;
    out.push(b'\n');
    w.write_all(&out).await?;
    Ok(())
}

/// Serves a `monitor.stream` request until the client goes away.
pub async fn stream(
    mut r: impl AsyncReadExt + Unpin,
    mut w: OwnedWriteHalf,
    svc: Arc<Service>,
    args: Value,
    cut: &Notify,
) -> Result<()> {
    let a = match parse(args) {
        Ok(a) => a,
        Err(e) => return send_line(&mut w, &Response::err(format!("{e:#}"))).await,
    };
    // Subscribe before answering: nothing raised after the answer is lost.
    let mut rx = svc.events.subscribe();
    send_line(&mut w, &Response { ok: true, result: Some(json!({"streaming": true})), error: None }).await?;
    if a.test {
        for ev in events::current(&svc, true).await.into_iter().filter(|e| e.event == "TestMessage") {
            events::log(&ev);
            send_line(&mut w, &json!({ "event": ev })).await?;
        }
    }
    let mut scratch = [0u8; 256];
    loop {
        tokio::select! {
            () = cut.notified() => {
                super::last_words(&w, &Response::err(super::cut_message(super::admission::State::Stream)));
                return Ok(());
            }
            got = rx.recv() => match got {
                Ok(ev) => send_line(&mut w, &json!({ "event": ev })).await?,
                Err(RecvError::Lagged(n)) => send_line(&mut w, &json!({ "missed": n })).await?,
                Err(RecvError::Closed) => return Ok(()),
            },
            n = r.read(&mut scratch) => {
                // The client sends nothing more; EOF (or an error) means it left.
                if n.unwrap_or(0) == 0 {
                    return Ok(());
                }
            }
        }
    }
}
