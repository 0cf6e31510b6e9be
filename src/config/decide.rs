//! `[decide]`: the decision service's listener (issue 44): the decision API for
//! applications, Envoy's rate limit service and forward-auth, on a listener of its own,
//! never the proxy's. Loopback by default; every call needs the bearer token
//! (`token`, or `RATEWALL_DECIDE_TOKEN`, which wins) or, with `tls = true` and
//! `[server.tls] client_ca`, a verified client certificate.

use std::net::SocketAddr;

use http::StatusCode;
use serde::Deserialize;
use toml::Spanned;

use super::values::{AdminToken, ByteSize};
use super::Invalid;

/// The validated `[decide]` table.
#[derive(Clone)]
pub struct Decide {
    pub listen: SocketAddr,
    /// The bearer token a call needs (none: only a verified client certificate is
    /// believed; without `tls` and a client CA, every call is refused with 403).
    pub token: Option<String>,
    /// The token's SHA-256, what a call's token is compared with (its digest, byte by
    /// byte: a compare that tells neither where they differ nor how long it is), made once.
    pub token_sha256: Option<[u8; 32]>,
    /// Serve TLS with `[server.tls]`'s certificates and client CA.
    pub tls: bool,
    /// The largest request body read (`max_body`, default 1 MiB): past it, 413.
    pub max_body: u64,
    /// The most decisions in one batch (`max_batch`, default 100).
    pub max_batch: usize,
    /// The status forward-auth denies with (`forward_auth = { deny_status = 403 }`;
    /// default 429). nginx's `auth_request` takes only 2xx, 401 and 403.
    pub forward_auth_deny: StatusCode,
    /// envoyproxy/ratelimit's YAML, read as rules (`envoy_config`), relative to the
    /// config file's folder.
    pub envoy_config: Option<String>,
}

impl std::fmt::Debug for Decide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the token.
        f.debug_struct("Decide")
            .field("listen", &self.listen)
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .field("tls", &self.tls)
            .field("max_body", &self.max_body)
            .field("max_batch", &self.max_batch)
            .field("forward_auth_deny", &self.forward_auth_deny)
            .field("envoy_config", &self.envoy_config)
            .finish()
    }
}

/// `listen`'s default: loopback only.
pub const LISTEN: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 8081);
pub const MAX_BODY: u64 = 1024 * 1024;
pub const MAX_BATCH: usize = 100;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDecide {
    listen: Option<SocketAddr>,
    token: Option<AdminToken>,
    tls: Option<Spanned<bool>>,
    max_body: Option<ByteSize>,
    max_batch: Option<Spanned<usize>>,
    forward_auth: Option<RawForwardAuth>,
    pub(super) envoy_config: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawForwardAuth {
    deny_status: Spanned<u16>,
}

impl RawDecide {
    /// `env_token`: `RATEWALL_DECIDE_TOKEN`, which wins. `server_tls`: whether `[server.tls]`
    /// is there to lend its certificates.
    pub(super) fn validate(
        self,
        env_token: Option<AdminToken>,
        server_tls: bool,
    ) -> Result<Decide, Invalid> {
        let tls = self.tls.as_ref().is_some_and(|t| *t.get_ref());
        if let (true, false, Some(t)) = (tls, server_tls, &self.tls) {
            return Err(Invalid::new(
                Some(t.span()),
                "decide.tls",
                "tls = true serves [server.tls]'s certificates (and client CA): add [server.tls]",
            ));
        }
        let max_batch = match self.max_batch {
            Some(b) if !(1..=10_000).contains(b.get_ref()) => {
                return Err(Invalid::new(
                    Some(b.span()),
                    "decide.max_batch",
                    "max_batch is 1 to 10000",
                ))
            }
            Some(b) => b.into_inner(),
            None => MAX_BATCH,
        };
        let forward_auth_deny = match self.forward_auth {
            None => StatusCode::TOO_MANY_REQUESTS,
            Some(f) => match StatusCode::from_u16(*f.deny_status.get_ref()) {
                Ok(s) if s.is_client_error() => s,
                _ => {
                    return Err(Invalid::new(
                        Some(f.deny_status.span()),
                        "decide.forward_auth.deny_status",
                        "deny_status is a 4xx status (429, or 403 for nginx's auth_request)",
                    ))
                }
            },
        };
        let token = env_token.or(self.token).map(|t| t.0);
        Ok(Decide {
            listen: self.listen.unwrap_or(LISTEN),
            token_sha256: token
                .as_ref()
                .map(|t| crate::identity::sha256(t.as_bytes())),
            token,
            tls,
            max_body: self.max_body.map_or(MAX_BODY, |b| b.0),
            max_batch,
            forward_auth_deny,
            envoy_config: self.envoy_config,
        })
    }
}
