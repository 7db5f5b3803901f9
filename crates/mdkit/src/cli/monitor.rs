//! `mdkit monitor [--json] [--oneshot] [--test] [--program PATH] [--mail ADDR]`: prints the
//! service's events (mdadm's names) as they happen, runs an alert program and mails, like
//! `mdadm --monitor`.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use serde_json::{Value, json};

use super::ControlArgs;
use crate::control::{Request, Response};
use crate::events::{Event, MAILED};

const SENDMAIL: &str = "/usr/sbin/sendmail";
/// Longest event line accepted from the service.
const LINE_MAX_BYTES: u64 = 1 << 20;

#[derive(Args, Debug)]
pub struct MonitorArgs {
    /// Print events as JSON lines.
    #[arg(long)]
    pub json: bool,
    /// Report the current state of every volume once (DegradedArray, NeedsCheck, ...) and exit.
    #[arg(long, short = '1')]
    pub oneshot: bool,
    /// Emit a TestMessage for every md array and thin pool (with --oneshot: then exit).
    #[arg(long, short = 't')]
    pub test: bool,
    /// Run PATH with EVENT VOLUME [MEMBER] for each event (no shell), like mdadm --program.
    #[arg(long, short = 'p', value_name = "PATH")]
    pub program: Option<PathBuf>,
    /// Mail Fail, FailSpare, DegradedArray, SparesMissing and TestMessage events to ADDR
    /// through /usr/sbin/sendmail.
    #[arg(long, short = 'm', value_name = "ADDR")]
    pub mail: Option<String>,
    #[command(flatten)]
    pub control: ControlArgs,
}

pub fn run(a: MonitorArgs) -> Result<ExitCode> {
    if a.mail.is_some() && !Path::new(SENDMAIL).exists() {
        bail!("--mail: {SENDMAIL} not found; install a mail transfer agent or use --program");
    }
    if let Some(p) = &a.program
        && !p.is_file()
    {
        bail!("--program {}: no such file", p.display());
    }
    if a.oneshot {
        let v = a.control.client()?.call("monitor.oneshot", json!({ "test": a.test }))?;
        let evs: Vec<Event> = serde_json::from_value(v["events"].clone()).context("monitor.oneshot answer")?;
        for ev in &evs {
            handle(&a, ev)?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    stream(&a)
}

fn stream(a: &MonitorArgs) -> Result<ExitCode> {
    let path = a.control.socket_path()?;
    let sock = UnixStream::connect(&path).with_context(|| {
        format!("connecting to the mdkit control socket {} (is `mdkit serve` running?)", path.display())
    })?;
    let mut req = serde_json::to_vec(&Request { cmd: "monitor.stream".into(), args: json!({ "test": a.test }) })?;
    req.push(b'\n');
    (&sock).write_all(&req).with_context(|| format!("sending monitor.stream to {}", path.display()))?;
    let mut reader = BufReader::new(sock);
    let first: Response = serde_json::from_slice(&read_line(&mut reader)?.ok_or_else(|| closed(&path))?)
        .context("malformed answer to monitor.stream")?;
    if !first.ok {
        bail!("{}", first.error.unwrap_or_default());
    }
    while let Some(line) = read_line(&mut reader)? {
        let v: Value = serde_json::from_slice(&line).context("malformed event line")?;
        if let Some(e) = v.get("error").and_then(Value::as_str) {
            bail!("{}: {e}", path.display());
        }
        if let Some(n) = v.get("missed") {
            eprintln!("mdkit monitor: fell behind, {n} event(s) missed");
            continue;
        }
        let ev: Event = serde_json::from_value(v["event"].clone()).context("malformed event line")?;
        handle(a, &ev)?;
    }
    eprintln!("mdkit monitor: the service closed the stream ({})", path.display());
    Ok(ExitCode::from(1))
}

fn closed(path: &Path) -> anyhow::Error {
    anyhow!("{}: connection closed without an answer to monitor.stream", path.display())
}

fn read_line(r: &mut BufReader<UnixStream>) -> Result<Option<Vec<u8>>> {
    let mut line = Vec::new();
    r.by_ref().take(LINE_MAX_BYTES).read_until(b'\n', &mut line)?;
    Ok((!line.is_empty()).then_some(line))
}

/// Prints `ev`, then runs the program and mails, in mdadm's order.
fn handle(a: &MonitorArgs, ev: &Event) -> Result<()> {
    let mut out = std::io::stdout().lock();
    if a.json {
        writeln!(out, "{}", serde_json::to_string(ev)?)?;
    } else {
        writeln!(out, "{}: {}", ev.time_unix_ms / 1000, ev.message())?;
    }
    out.flush()?;
    if let Some(p) = &a.program {
        run_program(p, ev);
    }
    if let Some(addr) = &a.mail
        && MAILED.contains(&ev.event.as_str())
    {
        send_mail(addr, ev)?;
    }
    Ok(())
}

/// Runs the alert program and waits for it (mdadm does too); its exit status is ignored.
fn run_program(p: &Path, ev: &Event) {
    let mut cmd = Command::new(p);
    cmd.arg(&ev.event).arg(&ev.volume);
    if let Some(m) = &ev.member {
        cmd.arg(m);
    } else if ev.event == "RebuildFinished" && ev.detail.contains("mismatches") {
        cmd.arg(&ev.detail);
    }
    if let Err(e) = cmd.stdin(Stdio::null()).status() {
        eprintln!("mdkit monitor: running {}: {e}", p.display());
    }
}

fn send_mail(addr: &str, ev: &Event) -> Result<()> {
    let host = crate::volumes::md::hostname().unwrap_or_else(|| "localhost".into());
    let mut child = Command::new(SENDMAIL)
        .arg("-t")
        .stdin(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {SENDMAIL}"))?;
    let body = format!(
        "From: mdkit monitoring\nTo: {addr}\nSubject: {} event on {}:{host}\n\nThis is an automatically generated mail message from mdkit.\n\n{}\n",
        ev.event,
        ev.volume,
        ev.message()
    );
    // Invariant: stdin was requested as piped above.
    child.stdin.take().expect("piped stdin").write_all(body.as_bytes()).context("writing to sendmail")?;
    let st = child.wait().context("waiting for sendmail")?;
    if !st.success() {
        eprintln!("mdkit monitor: {SENDMAIL} exited with {st}");
    }
    Ok(())
}
