//! `[metrics]`: where the Prometheus endpoint listens (docs/CONFIG.md).
//!
//! Off by default. Like `[nbd] allow_remote`, an address that is not loopback needs an
//! explicit `allow_remote = true`: the endpoint has no authentication and tells a network
//! observer the names and health of every volume.

use std::net::SocketAddr;

use anyhow::{Result, bail};
use serde::Deserialize;

/// The `[metrics]` table as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMetrics {
    listen: Option<String>,
    allow_remote: Option<bool>,
}

/// The validated `[metrics]` table.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MetricsConfig {
    /// `None`: no endpoint.
    pub listen: Option<SocketAddr>,
}

impl MetricsConfig {
    pub fn from_raw(raw: RawMetrics) -> Result<MetricsConfig> {
        let allow_remote = raw.allow_remote.unwrap_or(false);
        let Some(text) = raw.listen else {
            if allow_remote {
                bail!("metrics.allow_remote is set but metrics.listen is not");
            }
            return Ok(MetricsConfig::default());
        };
        let addr: SocketAddr = text
            .parse()
            .map_err(|_| anyhow::anyhow!("metrics.listen {text:?}: expected IP:PORT (e.g. \"127.0.0.1:9108\")"))?;
        if !addr.ip().is_loopback() && !allow_remote {
            bail!(
                "metrics.listen {addr}: not a loopback address; the endpoint has no authentication, \
                 set metrics.allow_remote = true to serve it there anyway"
            );
        }
        Ok(MetricsConfig { listen: Some(addr) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<MetricsConfig> {
        MetricsConfig::from_raw(toml::from_str(text)?)
    }

    #[test]
    fn off_by_default_and_loopback_accepted() {
        assert_eq!(parse("").unwrap().listen, None);
        assert_eq!(parse("listen = \"127.0.0.1:9108\"").unwrap().listen, Some("127.0.0.1:9108".parse().unwrap()));
        assert_eq!(parse("listen = \"[::1]:9108\"").unwrap().listen, Some("[::1]:9108".parse().unwrap()));
    }

    #[test]
    fn remote_needs_the_opt_in() {
        let e = parse("listen = \"0.0.0.0:9108\"").unwrap_err().to_string();
        assert!(e.contains("not a loopback address") && e.contains("allow_remote"), "{e}");
        let c = parse("listen = \"0.0.0.0:9108\"\nallow_remote = true").unwrap();
        assert_eq!(c.listen, Some("0.0.0.0:9108".parse().unwrap()));
    }

    #[test]
    fn bad_tables_get_clear_errors() {
        for (text, want) in [
            ("listen = \"localhost\"", "expected IP:PORT"),
            ("allow_remote = true", "metrics.listen is not"),
            ("bogus = 1", "unknown field"),
        ] {
            let e = format!("{:#}", parse(text).unwrap_err());
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }
}
