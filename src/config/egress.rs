//! `[egress]`: the egress gateway (issue 45), an HTTP forward proxy for the calls a
//! company's services make to APIs it does not own, that is never open: every target is
//! listed (`[[egress.targets]]`, a host exact or `*.suffix`); anything else is refused.
//! Its rules are those with `match = { egress = true }`, keyed by `target`,
//! `credential` or `caller` (docs/egress.md).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

use super::values::HumanDuration;
use super::Invalid;

/// The validated `[egress]` table.
#[derive(Debug, Clone)]
pub struct Egress {
    pub listen: SocketAddr,
    /// The targets calls may go to, in the file's order.
    pub targets: Vec<Target>,
    /// How long a call may take to connect to its target and have its answer's head
    /// (`timeout`, default 30 s); past it, 504.
    pub timeout: Duration,
    /// How long a tunnel may stay without a byte either way (`tunnel_idle_timeout`,
    /// default 5 min).
    pub tunnel_idle: Duration,
}

/// One `[[egress.targets]]`.
#[derive(Clone)]
pub struct Target {
    /// As the file gives it, lower-cased: `api.example.com` or `*.example.com`.
    pub host: String,
    /// `tls = true`: an absolute-form `http://` call goes to the target over TLS
    /// (verified against the system's roots, or `ca`).
    pub tls: bool,
    /// `connect = true`: `CONNECT host:port` tunnels are allowed.
    pub connect: bool,
    /// The ports a call may name (default 80 and 443).
    pub ports: Vec<u16>,
    /// `allow_private = true`: the target may resolve to a private, loopback or
    /// link-local address (otherwise refused: no way into the network through DNS).
    pub allow_private: bool,
    /// The TLS client for `tls = true`: the roots it verifies with.
    pub tls_client: Option<Arc<rustls::ClientConfig>>,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("host", &self.host)
            .field("tls", &self.tls)
            .field("connect", &self.connect)
            .field("ports", &self.ports)
            .field("allow_private", &self.allow_private)
            .finish_non_exhaustive()
    }
}

impl Target {
    /// Whether `host` (lower-cased, no port) is this target's.
    pub fn fits(&self, host: &str) -> bool {
        match self.host.strip_prefix('*') {
            // `*.example.com`: a name below example.com, never example.com itself.
            Some(suffix) => host.len() > suffix.len() && host.ends_with(suffix),
            None => self.host == host,
        }
    }
}

impl Egress {
    /// The target `host` (lower-cased, no port) is, and its position: an exact host
    /// first, else the longest `*.suffix` that fits.
    pub fn target(&self, host: &str) -> Option<(usize, &Target)> {
        let exact = self.targets.iter().position(|t| t.host == host);
        let found = exact.or_else(|| {
            (self.targets.iter().enumerate())
                .filter(|(_, t)| t.host.starts_with('*') && t.fits(host))
                .max_by_key(|(_, t)| t.host.len())
                .map(|(i, _)| i)
        })?;
        Some((found, &self.targets[found]))
    }
}

/// `listen`'s default: loopback only, the port proxies are usually found on.
pub const LISTEN: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 3128);
pub const TIMEOUT: Duration = Duration::from_secs(30);
pub const TUNNEL_IDLE: Duration = Duration::from_secs(300);
pub const PORTS: [u16; 2] = [80, 443];

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEgress {
    listen: Option<SocketAddr>,
    timeout: Option<HumanDuration>,
    tunnel_idle_timeout: Option<HumanDuration>,
    #[serde(default)]
    targets: Vec<Spanned<RawTarget>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTarget {
    host: Spanned<String>,
    #[serde(default)]
    tls: bool,
    #[serde(default)]
    connect: bool,
    ports: Option<Spanned<Vec<u16>>>,
    #[serde(default)]
    allow_private: bool,
    ca: Option<Spanned<String>>,
}

impl RawEgress {
    /// `dir`: the config file's folder, which a target's `ca` is relative to.
    pub(super) fn validate(self, dir: &Path) -> Result<Egress, Invalid> {
        let mut targets: Vec<Target> = Vec::with_capacity(self.targets.len());
        for (i, raw) in self.targets.into_iter().enumerate() {
            let span = raw.span();
            let raw = raw.into_inner();
            let key = |k: &str| format!("egress.targets[{i}].{k}");
            let host = raw.host.get_ref().trim().to_ascii_lowercase();
            let name = host.strip_prefix("*.").unwrap_or(&host);
            let plain = !name.is_empty()
                && (name.bytes())
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'));
            if !plain {
                return Err(Invalid::new(
                    Some(raw.host.span()),
                    key("host"),
                    "a host name (api.example.com) or *. and a suffix (*.example.com): no port, scheme or path",
                ));
            }
            if targets.iter().any(|t| t.host == host) {
                return Err(Invalid::new(
                    Some(raw.host.span()),
                    key("host"),
                    format!("{host} is listed twice"),
                ));
            }
            let ports = match raw.ports {
                None => PORTS.to_vec(),
                Some(p) if p.get_ref().is_empty() || p.get_ref().contains(&0) => {
                    return Err(Invalid::new(
                        Some(p.span()),
                        key("ports"),
                        "ports: one or more of 1 to 65535",
                    ));
                }
                Some(p) => p.into_inner(),
            };
            if raw.ca.is_some() && !raw.tls {
                return Err(Invalid::new(
                    raw.ca.as_ref().map(Spanned::span),
                    key("ca"),
                    "ca verifies the TLS that tls = true originates: add tls = true (a CONNECT tunnel's TLS is the client's own)",
                ));
            }
            let tls_client = match raw.tls {
                false => None,
                true => {
                    let ca = raw.ca.as_ref().map(|c| dir.join(c.get_ref().trim()));
                    let client = crate::upstream::client_config(ca.as_deref()).map_err(|e| {
                        Invalid::new(
                            raw.ca
                                .as_ref()
                                .map_or(Some(span.clone()), |c| Some(c.span())),
                            key("ca"),
                            e.message,
                        )
                    })?;
                    Some(client)
                }
            };
            targets.push(Target {
                host,
                tls: raw.tls,
                connect: raw.connect,
                ports,
                allow_private: raw.allow_private,
                tls_client,
            });
        }
        // At most a day each: a tunnel's clock never overflows, and nothing waits longer.
        let day = Duration::from_secs(86_400);
        Ok(Egress {
            listen: self.listen.unwrap_or(LISTEN),
            targets,
            timeout: self.timeout.map_or(TIMEOUT, |t| t.0).min(day),
            tunnel_idle: self
                .tunnel_idle_timeout
                .map_or(TUNNEL_IDLE, |t| t.0)
                .min(day),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn egress(hosts: &[&str]) -> Egress {
        let targets = hosts
            .iter()
            .map(|h| Target {
                host: h.to_string(),
                tls: false,
                connect: false,
                ports: PORTS.to_vec(),
                allow_private: false,
                tls_client: None,
            })
            .collect();
        Egress {
            listen: LISTEN,
            targets,
            timeout: TIMEOUT,
            tunnel_idle: TUNNEL_IDLE,
        }
    }

    #[test]
    fn an_exact_host_wins_then_the_longest_suffix_never_the_apex() {
        let e = egress(&[
            "*.example.com",
            "api.example.com",
            "*.eu.example.com",
            "other.test",
        ]);
        let found = |h: &str| e.target(h).map(|(i, _)| i);
        assert_eq!(found("api.example.com"), Some(1));
        assert_eq!(found("x.eu.example.com"), Some(2));
        assert_eq!(found("eu.example.com"), Some(0));
        assert_eq!(found("www.example.com"), Some(0));
        assert_eq!(
            found("example.com"),
            None,
            "*.example.com is not example.com itself"
        );
        assert_eq!(found("badexample.com"), None);
        assert_eq!(found("other.test"), Some(3));
        assert_eq!(found("x.other.test"), None);
    }
}
