//! The service configuration (TOML). Format reference: docs/CONFIG.md.
//!
//! ```toml
//! data_dir = "/var/lib/mdkit"        # relative paths below resolve inside it
//! control_socket = "mdkit.sock"      # default <data_dir>/mdkit.sock
//! [nbd]
//! listen = ["127.0.0.1:10809", "unix:nbd.sock"]
//! default_export = "default"
//! [[volume]]                          # opened in order; later volumes may use earlier ones
//! name = "vol0"
//! kind = "file"                       # + kind-specific keys, see volumes/<kind>.rs
//! path = "vol0.img"
//! size = "1GiB"
//! [[export]]
//! name = "default"
//! volume = "vol0"
//! read_only = false
//! ```
//!
//! Volume tables keep their kind-specific keys as a raw TOML table ([`VolumeSpec::params`]);
//! each volume kind parses its own keys (see `volumes::VolumeKind`), so a new kind needs no
//! change here.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use mdkit_nbd::server::{HANDSHAKE_TIMEOUT_DEFAULT, PAYLOAD_BUDGET_BYTES_DEFAULT, PAYLOAD_STALL_TIMEOUT_DEFAULT};
use mdkit_nbd::{ListenAddr, ServerOptions};
use serde::Deserialize;

/// The embedded default configuration (`mdkit serve` without `--config`).
pub const DEFAULT_CONFIG_TOML: &str = include_str!("default-config.toml");
/// Data directory when neither flag, environment nor config sets one.
pub const DEFAULT_DATA_DIR: &str = "./mdkit-data";
/// Environment variable overriding the data directory.
pub const DATA_DIR_ENV: &str = "MDKIT_DATA_DIR";
/// Control socket file name inside the data directory.
pub const CONTROL_SOCKET_NAME: &str = "mdkit.sock";
/// `nbd.idle_poll_us` default: covers a QD1 client's turn-around on the 2-vCPU dev VM (see
/// `mdkit_nbd::idle_poll` and docs/BENCHMARKS.md).
pub const IDLE_POLL_US_DEFAULT: u64 = 100;
/// `nbd.idle_poll_us` upper bound.
pub const IDLE_POLL_US_MAX: u64 = 10_000;

/// The file as written by the user.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    data_dir: Option<PathBuf>,
    control_socket: Option<PathBuf>,
    #[serde(default)]
    nbd: RawNbd,
    #[serde(default)]
    metrics: crate::metrics_config::RawMetrics,
    #[serde(default, rename = "volume")]
    volumes: Vec<toml::Table>,
    #[serde(default, rename = "export")]
    exports: Vec<ExportSpec>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNbd {
    listen: Option<Vec<String>>,
    default_export: Option<String>,
    max_in_flight_requests: Option<usize>,
    max_in_flight_bytes: Option<Size>,
    max_payload_bytes: Option<Size>,
    payload_budget_bytes: Option<Size>,
    max_connections: Option<usize>,
    max_connections_per_peer: Option<usize>,
    max_handshakes: Option<usize>,
    handshake_timeout_ms: Option<u64>,
    payload_stall_timeout_ms: Option<u64>,
    allow_remote: Option<bool>,
    shutdown_grace_ms: Option<u64>,
    idle_poll_us: Option<u64>,
}

/// A byte count: an integer, or a string with a binary suffix ("512", "4KiB", "1G", "2TiB").
/// A malformed value is refused with an error naming it (serde adds the key).
#[derive(Debug, Clone, Copy)]
pub enum Size {
    Bytes(u64),
    Text(u64),
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Size, D::Error> {
        d.deserialize_any(SizeVisitor)
    }
}

struct SizeVisitor;

impl serde::de::Visitor<'_> for SizeVisitor {
    type Value = Size;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a size: a whole number of bytes or a string such as \"64MiB\"")
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> std::result::Result<Size, E> {
        Ok(Size::Bytes(v))
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> std::result::Result<Size, E> {
        u64::try_from(v).map(Size::Bytes).map_err(|_| E::custom(format!("size {v}: must not be negative")))
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<Size, E> {
        parse_size(v).map(Size::Text).map_err(E::custom)
    }
}

impl Size {
    pub fn bytes(self) -> u64 {
        match self {
            Size::Bytes(b) | Size::Text(b) => b,
        }
    }
}

/// `key`'s size, when given, as a non-zero multiple of 512 bytes (what a member file, a mem
/// disk or a thin volume can be).
pub fn check_sector_multiple(key: &str, size: Option<Size>) -> Result<()> {
    match size.map(Size::bytes) {
        Some(b) if b == 0 || !b.is_multiple_of(512) => bail!("{key} = {b} bytes: must be a non-zero multiple of 512"),
        _ => Ok(()),
    }
}

/// `queue_depth`, when given, within what a member file's io_uring takes.
pub fn check_queue_depth(queue_depth: Option<u32>) -> Result<()> {
    match queue_depth {
        Some(qd) if qd == 0 || qd > mdkit_io::file::MAX_QUEUE_DEPTH => {
            bail!("queue_depth = {qd}: use 1..={}", mdkit_io::file::MAX_QUEUE_DEPTH)
        }
        _ => Ok(()),
    }
}

/// Parses "4096", "4K", "4KiB", "1.5GiB" is refused (whole numbers only). Suffixes are binary.
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("size {s:?}: expected a whole number with an optional unit (K, M, G, T, KiB, ...)"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        "t" | "tib" => 40,
        _ => return Err(format!("size {s:?}: unknown unit {unit:?} (use K, M, G, T or KiB, MiB, GiB, TiB)")),
    };
    n.checked_mul(1u64 << shift).ok_or_else(|| format!("size {s:?} overflows 64 bits"))
}

/// One `[[volume]]`: name, kind, and the kind's own keys.
#[derive(Debug, Clone)]
pub struct VolumeSpec {
    pub name: String,
    pub kind: String,
    /// Every key other than `name` and `kind`, for the kind to parse.
    pub params: toml::Table,
}

impl VolumeSpec {
    /// Parses the kind-specific keys into `T` (use `#[serde(deny_unknown_fields)]` on `T`).
    /// The error names the key and the value, not the volume: callers add that.
    pub fn parse_params<T: serde::de::DeserializeOwned>(&self) -> Result<T> {
        Ok(toml::Value::Table(self.params.clone()).try_into()?)
    }
}

/// One `[[export]]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportSpec {
    pub name: String,
    pub volume: String,
    #[serde(default)]
    pub read_only: bool,
    #[serde(default)]
    pub description: String,
}

/// NBD front-end settings, defaults filled in.
#[derive(Debug, Clone)]
pub struct NbdConfig {
    pub listen: Vec<ListenAddr>,
    pub default_export: Option<String>,
    pub server: ServerOptions,
    pub shutdown_grace: Duration,
    /// How long a data-path thread polls its sockets and member rings before it sleeps
    /// (`mdkit_nbd::idle_poll`); zero sleeps at once.
    pub idle_poll: Duration,
}

/// A loaded, validated configuration with every path made absolute.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where the configuration came from ("embedded default" or the file path).
    pub source: String,
    pub data_dir: PathBuf,
    pub control_socket: PathBuf,
    pub nbd: NbdConfig,
    /// `[metrics]`: the Prometheus endpoint (off unless `listen` is set).
    pub metrics: crate::metrics_config::MetricsConfig,
    pub volumes: Vec<VolumeSpec>,
    pub exports: Vec<ExportSpec>,
}

/// Command-line / environment overrides applied on top of the file.
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    /// `--data-dir`.
    pub data_dir: Option<PathBuf>,
    /// `MDKIT_DATA_DIR` (read by the CLI, passed in so parsing stays a pure function).
    pub env_data_dir: Option<PathBuf>,
    /// `--listen` (replaces `nbd.listen` when given).
    pub listen: Vec<String>,
}

impl Overrides {
    /// Overrides from the command line plus the environment.
    pub fn from_cli(data_dir: Option<PathBuf>, listen: Vec<String>) -> Overrides {
        let env_data_dir = std::env::var_os(DATA_DIR_ENV).filter(|v| !v.is_empty()).map(PathBuf::from);
        Overrides { data_dir, env_data_dir, listen }
    }
}

impl Config {
    /// Loads `--config FILE`, or the embedded default when `path` is `None`.
    pub fn load(path: Option<&Path>, overrides: &Overrides) -> Result<Config> {
        let cwd = std::env::current_dir().context("current directory")?;
        match path {
            Some(p) => {
                let text = std::fs::read_to_string(p).with_context(|| format!("reading config {}", p.display()))?;
                let base = p.parent().map(|d| cwd.join(d)).unwrap_or_else(|| cwd.clone());
                Config::parse(&text, &p.display().to_string(), &base, overrides)
            }
            None => Config::parse(DEFAULT_CONFIG_TOML, "embedded default", &cwd, overrides),
        }
    }

    /// Parses and validates; relative `data_dir` resolves against `base_dir` (the config
    /// file's directory; the current directory for the embedded default).
    pub fn parse(text: &str, source: &str, base_dir: &Path, overrides: &Overrides) -> Result<Config> {
        let raw: RawConfig = toml::from_str(text).with_context(|| format!("parsing config ({source})"))?;
        // Precedence: --data-dir, then MDKIT_DATA_DIR, then the file, then ./mdkit-data.
        let (data_dir, data_base) = if let Some(d) = &overrides.data_dir {
            (d.clone(), std::env::current_dir()?)
        } else if let Some(d) = overrides.env_data_dir.clone() {
            (d, std::env::current_dir()?)
        } else if let Some(d) = raw.data_dir {
            (d, base_dir.to_path_buf())
        } else {
            (PathBuf::from(DEFAULT_DATA_DIR), std::env::current_dir()?)
        };
        let data_dir = normalize(&data_base.join(data_dir));
        let control_socket = match raw.control_socket {
            Some(p) => normalize(&data_dir.join(p)),
            None => data_dir.join(CONTROL_SOCKET_NAME),
        };
        let nbd = nbd_config(raw.nbd, &overrides.listen, &data_dir)?;
        let metrics = crate::metrics_config::MetricsConfig::from_raw(raw.metrics)?;
        let volumes =
            raw.volumes.into_iter().enumerate().map(|(i, t)| volume_spec(i, t)).collect::<Result<Vec<_>>>()?;
        let cfg = Config {
            source: source.to_string(),
            data_dir,
            control_socket,
            nbd,
            metrics,
            volumes,
            exports: raw.exports,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// A path from the config: absolute stays, relative goes inside the data directory.
    #[allow(dead_code, reason = "for commands that take paths relative to the data directory")]
    pub fn resolve(&self, p: &Path) -> PathBuf {
        normalize(&self.data_dir.join(p))
    }

    fn validate(&self) -> Result<()> {
        let mut names = BTreeSet::new();
        for v in &self.volumes {
            if !valid_name(&v.name) {
                bail!(
                    "volume name {:?}: use letters, digits, '-', '_' and '.' (1..=64 characters, not . or ..)",
                    v.name
                );
            }
            if !names.insert(v.name.as_str()) {
                bail!("volume {:?} is defined twice", v.name);
            }
        }
        let mut exports = BTreeSet::new();
        for e in &self.exports {
            if e.name.is_empty() || e.name.len() > 4096 || e.name.contains('\0') {
                bail!("export name {:?} is empty, too long or contains NUL", e.name);
            }
            if !exports.insert(e.name.as_str()) {
                bail!("export {:?} is defined twice", e.name);
            }
            if !names.contains(e.volume.as_str()) {
                bail!("export {:?} refers to volume {:?}, which is not defined", e.name, e.volume);
            }
        }
        if let Some(d) = &self.nbd.default_export
            && !exports.contains(d.as_str())
        {
            bail!("nbd.default_export {d:?} is not an export");
        }
        Ok(())
    }
}

fn volume_spec(index: usize, mut t: toml::Table) -> Result<VolumeSpec> {
    let take_str = |t: &mut toml::Table, key: &str| -> Result<String> {
        match t.remove(key) {
            Some(toml::Value::String(s)) => Ok(s),
            Some(other) => bail!("volume #{}: `{key}` must be a string, not {}", index + 1, other.type_str()),
            None => bail!("volume #{}: `{key}` is required", index + 1),
        }
    };
    let name = take_str(&mut t, "name")?;
    let kind = take_str(&mut t, "kind").with_context(|| format!("volume {name:?}"))?;
    Ok(VolumeSpec { name, kind, params: t })
}

fn nbd_config(raw: RawNbd, listen_override: &[String], data_dir: &Path) -> Result<NbdConfig> {
    let defaults = ServerOptions::default();
    let listen_strs: Vec<String> = if !listen_override.is_empty() {
        listen_override.to_vec()
    } else {
        raw.listen.unwrap_or_else(|| vec!["127.0.0.1:10809".to_string()])
    };
    let mut listen = Vec::new();
    for s in &listen_strs {
        let a: ListenAddr = s.parse().map_err(|e: String| anyhow::anyhow!("nbd.listen: {e}"))?;
        listen.push(match a {
            ListenAddr::Unix(p) => ListenAddr::Unix(normalize(&data_dir.join(p))),
            tcp => tcp,
        });
    }
    let max_payload_bytes = match raw.max_payload_bytes {
        None => defaults.max_payload_bytes,
        Some(s) => {
            let b = s.bytes();
            if !(1 << 20..=1 << 30).contains(&b) {
                bail!("nbd.max_payload_bytes {b}: must be between 1 MiB and 1 GiB");
            }
            b as u32
        }
    };
    let idle_poll_us = raw.idle_poll_us.unwrap_or(IDLE_POLL_US_DEFAULT);
    if idle_poll_us > IDLE_POLL_US_MAX {
        bail!("nbd.idle_poll_us {idle_poll_us}: at most {IDLE_POLL_US_MAX} (a longer spin only burns CPU)");
    }
    let server = ServerOptions {
        max_in_flight_requests: positive(
            raw.max_in_flight_requests,
            defaults.max_in_flight_requests,
            "nbd.max_in_flight_requests",
        )?,
        max_in_flight_bytes: raw
            .max_in_flight_bytes
            .map(|s| s.bytes() as usize)
            .unwrap_or(defaults.max_in_flight_bytes),
        max_payload_bytes,
        payload_budget_bytes: payload_budget(raw.payload_budget_bytes, max_payload_bytes)?,
        max_connections: positive(raw.max_connections, defaults.max_connections, "nbd.max_connections")?,
        max_connections_per_peer: positive(
            raw.max_connections_per_peer,
            defaults.max_connections_per_peer,
            "nbd.max_connections_per_peer",
        )?,
        max_handshakes: positive(raw.max_handshakes, defaults.max_handshakes, "nbd.max_handshakes")?,
        handshake_timeout: timeout_ms(raw.handshake_timeout_ms, HANDSHAKE_TIMEOUT_DEFAULT, "nbd.handshake_timeout_ms")?,
        payload_stall_timeout: timeout_ms(
            raw.payload_stall_timeout_ms,
            PAYLOAD_STALL_TIMEOUT_DEFAULT,
            "nbd.payload_stall_timeout_ms",
        )?,
        allow_remote: raw.allow_remote.unwrap_or(false),
    };
    Ok(NbdConfig {
        listen,
        default_export: raw.default_export,
        server,
        shutdown_grace: Duration::from_millis(raw.shutdown_grace_ms.unwrap_or(10_000)),
        idle_poll: Duration::from_micros(idle_poll_us),
    })
}

/// `nbd.payload_budget_bytes`: at least 4/3 of the largest payload (one of those must fit
/// beside the quarter kept for small requests, see `mdkit_nbd::budget`).
fn payload_budget(raw: Option<Size>, max_payload_bytes: u32) -> Result<u64> {
    let min_bytes = u64::from(max_payload_bytes) * 4 / 3 + 4096;
    let Some(s) = raw else { return Ok(PAYLOAD_BUDGET_BYTES_DEFAULT.max(min_bytes)) };
    if s.bytes() < min_bytes {
        bail!(
            "nbd.payload_budget_bytes {}: must be at least {min_bytes} (4/3 of nbd.max_payload_bytes {max_payload_bytes})",
            s.bytes()
        );
    }
    Ok(s.bytes())
}

/// A timeout in milliseconds: 1 ms to 10 minutes.
fn timeout_ms(raw: Option<u64>, default: Duration, what: &str) -> Result<Duration> {
    match raw {
        None => Ok(default),
        Some(ms) if (1..=600_000).contains(&ms) => Ok(Duration::from_millis(ms)),
        Some(ms) => bail!("{what} {ms}: must be between 1 and 600000"),
    }
}

fn positive(v: Option<usize>, default: usize, what: &str) -> Result<usize> {
    match v {
        None => Ok(default),
        Some(0) => bail!("{what} must be at least 1"),
        Some(n) => Ok(n),
    }
}

/// A volume name: 1..=64 letters, digits, '-', '_' and '.', and not "." or "..".
pub(crate) fn valid_name(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && s != "."
        && s != ".."
}

/// Removes `.` and `..` components lexically (no symlink resolution; the path may not exist).
pub fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            std::path::Component::CurDir => {}
            std::path::Component::ParentDir => {
                out.pop();
            }
            other => out.push(other.as_os_str()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config> {
        Config::parse(text, "test", Path::new("/etc/mdkit"), &Overrides::default())
    }

    #[test]
    fn embedded_default_parses() {
        let c = Config::parse(
            DEFAULT_CONFIG_TOML,
            "embedded",
            Path::new("/x"),
            &Overrides { data_dir: Some("/d".into()), ..Overrides::default() },
        )
        .unwrap();
        assert_eq!(c.data_dir, PathBuf::from("/d"));
        assert_eq!(c.control_socket, PathBuf::from("/d/mdkit.sock"));
        assert_eq!(c.volumes.len(), 1);
        assert_eq!(c.volumes[0].kind, "md");
        assert_eq!(c.exports[0].name, "default");
        assert_eq!(c.nbd.default_export.as_deref(), Some("default"));
        assert_eq!(c.nbd.listen, vec![ListenAddr::Tcp("127.0.0.1:10809".into())]);
    }

    #[test]
    fn paths_resolve_inside_the_data_dir() {
        let c = parse(
            r#"
            data_dir = "data"
            control_socket = "ctl/s.sock"
            [nbd]
            listen = ["unix:nbd.sock", "127.0.0.1:0"]
            "#,
        )
        .unwrap();
        assert_eq!(c.data_dir, PathBuf::from("/etc/mdkit/data"));
        assert_eq!(c.control_socket, PathBuf::from("/etc/mdkit/data/ctl/s.sock"));
        assert_eq!(c.nbd.listen[0], ListenAddr::Unix("/etc/mdkit/data/nbd.sock".into()));
        assert_eq!(c.resolve(Path::new("/abs/f.img")), PathBuf::from("/abs/f.img"));
        assert_eq!(c.resolve(Path::new("../f.img")), PathBuf::from("/etc/mdkit/f.img"));
    }

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("2 TiB"), Ok(2 << 40));
        assert!(parse_size("1.5G").is_err());
        assert!(parse_size("1X").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn bad_configs_get_clear_errors() {
        let cases = [
            ("bogus = 1", "unknown field"),
            ("[[volume]]\nkind = \"file\"", "`name` is required"),
            ("[[volume]]\nname = \"a b\"\nkind = \"file\"", "volume name"),
            ("[[volume]]\nname = \"a\"\nkind = \"file\"\n[[volume]]\nname = \"a\"\nkind = \"mem\"", "defined twice"),
            ("[[export]]\nname = \"e\"\nvolume = \"nope\"", "not defined"),
            ("[nbd]\nlisten = [\"nonsense\"]", "HOST:PORT"),
            ("[nbd]\ndefault_export = \"x\"", "not an export"),
            ("[nbd]\nmax_in_flight_requests = 0", "at least 1"),
            ("[nbd]\nidle_poll_us = 20000", "idle_poll_us 20000: at most 10000"),
            ("[nbd]\npayload_budget_bytes = \"16MiB\"", "payload_budget_bytes 16777216: must be at least"),
            ("[nbd]\nhandshake_timeout_ms = 0", "handshake_timeout_ms 0: must be between 1 and 600000"),
            ("[nbd]\npayload_stall_timeout_ms = 700000", "payload_stall_timeout_ms 700000: must be between"),
            ("[nbd]\nmax_connections_per_peer = 0", "at least 1"),
            ("[nbd]\nallow_remote = \"yes\"", "allow_remote"),
        ];
        for (text, want) in cases {
            let e = format!("{:#}", parse(text).unwrap_err());
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }

    #[test]
    fn nbd_abuse_limits_have_defaults_and_can_be_set() {
        let d = parse("").unwrap().nbd.server;
        assert!(!d.allow_remote);
        assert_eq!(d.handshake_timeout, HANDSHAKE_TIMEOUT_DEFAULT);
        assert_eq!(d.payload_budget_bytes, PAYLOAD_BUDGET_BYTES_DEFAULT);
        assert_eq!(d.payload_stall_timeout, PAYLOAD_STALL_TIMEOUT_DEFAULT);
        let c = parse(
            "[nbd]\nallow_remote = true\nhandshake_timeout_ms = 250\npayload_stall_timeout_ms = 900\npayload_budget_bytes = \"256MiB\"\n\
             max_connections = 10\nmax_connections_per_peer = 3\nmax_handshakes = 2",
        )
        .unwrap()
        .nbd
        .server;
        assert!(c.allow_remote);
        assert_eq!(c.handshake_timeout, Duration::from_millis(250));
        assert_eq!(c.payload_stall_timeout, Duration::from_millis(900));
        assert_eq!(c.payload_budget_bytes, 256 << 20);
        assert_eq!((c.max_connections, c.max_connections_per_peer, c.max_handshakes), (10, 3, 2));
    }

    #[test]
    fn volume_params_keep_kind_specific_keys() {
        let c = parse("[[volume]]\nname = \"v\"\nkind = \"file\"\npath = \"v.img\"\nsize = \"1M\"").unwrap();
        let v = &c.volumes[0];
        assert!(v.params.contains_key("path") && v.params.contains_key("size"));
        assert!(!v.params.contains_key("name"));
    }
}
