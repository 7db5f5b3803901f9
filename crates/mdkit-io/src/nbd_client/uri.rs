//! Member URIs, the NBD URI specification's forms (NetworkBlockDevice/nbd `doc/uri.md`) that
//! mdkit speaks:
//!
//! ```text
//! nbd://HOST[:PORT]/EXPORT            TCP (nbd+tcp:// too); PORT defaults to 10809;
//!                                     HOST may be [IPv6]
//! nbd+unix:///EXPORT?socket=PATH      Unix-domain socket
//! ```
//! The export name is the path without its leading `/`, percent-decoded (empty = the
//! server's default export). TLS (`nbds…`), vsock, user names, fragments and unknown query
//! keys are refused with a message saying so.

use std::fmt;
use std::path::PathBuf;

use super::error::{NbdClientError, NbdErrorKind};

/// The IANA port for NBD.
pub const DEFAULT_PORT: u16 = 10809;

/// Where the server listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NbdAddress {
    Tcp { host: String, port: u16 },
    Unix { socket: PathBuf },
}

/// A parsed member URI.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NbdUri {
    pub address: NbdAddress,
    pub export: String,
    text: String,
}

impl fmt::Display for NbdUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// Whether `s` is meant as an NBD URI (a member spec starting with an `nbd` scheme).
pub fn is_nbd_uri(s: &str) -> bool {
    s.split_once("://")
        .is_some_and(|(scheme, _)| scheme == "nbd" || scheme.starts_with("nbd+") || scheme.starts_with("nbds"))
}

impl NbdUri {
    pub fn parse(text: &str) -> Result<NbdUri, NbdClientError> {
        let bad = |why: String| NbdClientError::new(NbdErrorKind::InvalidUri, text, "parse", why);
        let (scheme, rest) = text.split_once("://").ok_or_else(|| bad("no scheme (nbd:// or nbd+unix://)".into()))?;
        let unix = match scheme {
            "nbd" | "nbd+tcp" => false,
            "nbd+unix" => true,
            s if s.starts_with("nbds") => {
                return Err(bad(format!("{s}: TLS is not supported; use nbd:// or nbd+unix://")));
            }
            s => {
                return Err(bad(format!(
                    "scheme {s:?}: use nbd://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=PATH"
                )));
            }
        };
        if rest.contains('#') {
            return Err(bad("fragments (#...) are not allowed".into()));
        }
        let (before_query, query) = match rest.split_once('?') {
            Some((b, q)) => (b, Some(q)),
            None => (rest, None),
        };
        let (authority, path) = match before_query.find('/') {
            Some(i) => (&before_query[..i], &before_query[i + 1..]),
            None => (before_query, ""),
        };
        let export = percent_decode(path).map_err(|e| bad(format!("export name: {e}")))?;
        let mut socket = None;
        for pair in query.into_iter().flat_map(|q| q.split('&')).filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            match k {
                "socket" if unix => socket = Some(percent_decode(v).map_err(|e| bad(format!("socket: {e}")))?),
                "socket" => return Err(bad("socket= is only for nbd+unix:// URIs".into())),
                other => return Err(bad(format!("query key {other:?} is not supported (only socket= for nbd+unix)"))),
            }
        }
        let address = if unix {
            if !authority.is_empty() {
                return Err(bad(format!("nbd+unix:// takes no host ({authority:?}): nbd+unix:///EXPORT?socket=PATH")));
            }
            let socket =
                socket.filter(|s| !s.is_empty()).ok_or_else(|| bad("nbd+unix:// needs ?socket=PATH".into()))?;
            NbdAddress::Unix { socket: PathBuf::from(socket) }
        } else {
            let (host, port) = parse_authority(authority).map_err(bad)?;
            NbdAddress::Tcp { host, port }
        };
        Ok(NbdUri { address, export, text: text.to_string() })
    }
}

/// `HOST[:PORT]` or `[V6]:PORT`.
fn parse_authority(a: &str) -> Result<(String, u16), String> {
    if a.is_empty() {
        return Err("no host: nbd://HOST[:PORT]/EXPORT".into());
    }
    if a.contains('@') {
        return Err("user names in NBD URIs are not supported".into());
    }
    let (host, port) = if let Some(r) = a.strip_prefix('[') {
        let (h, tail) = r.split_once(']').ok_or("unclosed '[' in the host")?;
        match tail {
            "" => (h, None),
            t => (h, Some(t.strip_prefix(':').ok_or_else(|| format!("unexpected {t:?} after the IPv6 address"))?)),
        }
    } else {
        match a.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (a, None),
        }
    };
    if host.is_empty() {
        return Err("empty host".into());
    }
    let port = match port {
        None => DEFAULT_PORT,
        Some(p) => p.parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(|| format!("port {p:?} is not 1..=65535"))?,
    };
    Ok((host.to_string(), port))
}

fn percent_decode(s: &str) -> Result<String, String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = s.get(i + 1..i + 3).ok_or_else(|| format!("truncated %-escape in {s:?}"))?;
            out.push(u8::from_str_radix(hex, 16).map_err(|_| format!("bad %-escape %{hex} in {s:?}"))?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("{s:?} decodes to invalid UTF-8"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(h: &str, p: u16) -> NbdAddress {
        NbdAddress::Tcp { host: h.into(), port: p }
    }

    #[test]
    fn parses_the_supported_forms() {
        let u = NbdUri::parse("nbd://example.com/disk").unwrap();
        assert_eq!((u.address, u.export.as_str()), (tcp("example.com", 10809), "disk"));
        let u = NbdUri::parse("nbd+tcp://127.0.0.1:1234/a%20b/c").unwrap();
        assert_eq!((u.address, u.export.as_str()), (tcp("127.0.0.1", 1234), "a b/c"));
        let u = NbdUri::parse("nbd://[::1]:99").unwrap();
        assert_eq!((u.address, u.export.as_str()), (tcp("::1", 99), ""));
        let u = NbdUri::parse("nbd+unix:///x?socket=/run/n%62d.sock").unwrap();
        assert_eq!(u.address, NbdAddress::Unix { socket: "/run/nbd.sock".into() });
        assert_eq!(u.export, "x");
        assert_eq!(u.to_string(), "nbd+unix:///x?socket=/run/n%62d.sock");
        assert!(is_nbd_uri("nbd://h/x") && is_nbd_uri("nbds://h") && is_nbd_uri("nbd+unix:///?socket=s"));
        assert!(!is_nbd_uri("/var/lib/a.img") && !is_nbd_uri("volume:x") && !is_nbd_uri("nbdfile.img"));
    }

    #[test]
    fn refuses_what_it_does_not_speak_with_a_reason() {
        for (uri, why) in [
            ("nbds://h/x", "TLS"),
            ("nbd+vsock://1/x", "scheme"),
            ("nbd:///x", "no host"),
            ("nbd://h:0/x", "port"),
            ("nbd://h:70000/x", "port"),
            ("nbd://u@h/x", "user"),
            ("nbd://h/x#f", "fragment"),
            ("nbd://h/x?socket=/s", "only for nbd+unix"),
            ("nbd+unix:///x", "socket=PATH"),
            ("nbd+unix://h/x?socket=/s", "no host"),
            ("nbd+unix:///x?socket=/s&tls=on", "query key"),
            ("nbd://h/%zz", "%-escape"),
            ("nbd://[::1/x", "unclosed"),
        ] {
            let e = NbdUri::parse(uri).unwrap_err();
            assert_eq!(e.kind, NbdErrorKind::InvalidUri);
            assert!(e.to_string().contains(why), "{uri}: {e}");
            assert!(e.to_string().starts_with(uri), "{uri}: {e}");
        }
    }
}
