//! `[server]`, `[admin]`, `[response]` and `[log]`: where the gateway listens, how it
//! treats client connections, the admin token, which rate-limit headers answers carry,
//! what the access log says.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;

use super::values::{
    AdminToken, Backlog, HeaderBytes, HeaderFields, HumanDuration, MaxConnections, TagSecret,
    Workers,
};
use crate::connection::{self, Timeouts};
use crate::headers::ResponseStyle;
use crate::rules::PathCase;

/// `[server]`, validated.
#[derive(Debug)]
pub struct Server {
    pub listen: SocketAddr,
    pub admin_listen: Option<SocketAddr>,
    pub shutdown_grace: Duration,
    /// Threads serving clients, each with its own event loop and upstream connections.
    pub workers: usize,
    /// How long a client may keep a connection silent (see [`Timeouts`]).
    pub timeouts: Timeouts,
    /// An upgraded connection (a WebSocket) with no byte either way for this long is
    /// closed (`upgrade_idle_timeout`).
    pub upgrade_idle_timeout: Duration,
    /// Open client connections at most (the gateway listener); past it, idle kept-alive
    /// connections are closed to make room and new ones wait in the listen backlog.
    pub max_connections: usize,
    /// Whether the file set `max_connections`; if not, it was derived from the open-file
    /// limit ([`derive_max_connections`]) to fit the hard limit.
    pub max_connections_set: bool,
    /// The listen backlog of the gateway's listeners (cleartext, TLS) and the admin one:
    /// connections the kernel completes and queues before they are accepted, as asked
    /// (the kernel cuts it to `net.core.somaxconn`; the start-up log says so).
    pub backlog: u32,
    /// The largest request head (request line and fields; HTTP/2: the header list size)
    /// a client may send; past it, 431.
    pub max_header_bytes: usize,
    /// The most fields an HTTP/1 request head may have (`max_header_fields`); past it, 431.
    pub max_header_fields: usize,
    /// How the backend compares paths, and so the rules (`path_case`).
    pub path_case: PathCase,
    /// Whether header fields with `_` in their name are forwarded (`true`) or dropped
    /// before anything reads them (`false`, the default, as nginx).
    pub underscores_in_headers: bool,
    /// `[server.tls]`: the TLS listener beside the cleartext one, its certificates loaded.
    pub tls: Option<crate::tls::Settings>,
    /// The secret identity tags are keyed by (`RATEWALL_TAG_SECRET`, which wins, or
    /// `tag_secret`); none: the shared store's, or one kept beside the keys file
    /// ([`crate::identity::tag`]).
    pub tag_secret: Option<TagSecret>,
}

/// The defaults of `[server]` not set by a type of their own.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// `upgrade_idle_timeout`'s default.
pub const UPGRADE_IDLE_TIMEOUT: Duration = Duration::from_secs(3600);
/// `max_connections` when the file does not set it and the open-file limit allows it.
pub const MAX_CONNECTIONS: usize = 10_000;
pub use connection::RESERVED_DESCRIPTORS;

/// `max_connections` from the open-file limit the process may raise itself to (its hard
/// limit), as HAProxy derives `maxconn` from `ulimit -n`: each client connection may hold
/// one to the upstream too, and [`RESERVED_DESCRIPTORS`] stay for the rest; at most
/// [`MAX_CONNECTIONS`], at least 1. `None` (the limit cannot be read): the default.
pub fn derive_max_connections(open_files: Option<u64>) -> usize {
    let Some(limit) = open_files else {
        return MAX_CONNECTIONS;
    };
    let fits = limit.saturating_sub(RESERVED_DESCRIPTORS) / 2;
    usize::try_from(fits).map_or(MAX_CONNECTIONS, |n| n.clamp(1, MAX_CONNECTIONS))
}

/// The hard open-file limit: what the process may raise its own to (and does, at start).
pub fn open_files_limit() -> Option<u64> {
    rlimit::Resource::NOFILE.get().ok().map(|(_, hard)| hard)
}
pub const MAX_HEADER_BYTES: usize = 32 * 1024;
/// nginx's `listen ... backlog` on Linux is 511; HAProxy's is `maxconn`. 1024 holds a burst
/// of new connections (a thousand TLS clients at once) without SYN retransmits.
pub const BACKLOG: u32 = 1024;

impl Server {
    /// How client connections are served under this config.
    pub fn connections(&self) -> connection::Settings {
        connection::Settings {
            timeouts: self.timeouts,
            max_header_bytes: self.max_header_bytes,
            max_header_fields: self.max_header_fields,
        }
    }
}

/// One worker per CPU the process may use.
fn default_workers() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}

/// The admin API's protection.
pub struct Admin {
    /// Bearer token every `/admin/*` call needs. From `[admin].token`, or the
    /// `RATEWALL_ADMIN_TOKEN` environment variable, which wins. None: the admin API is off.
    pub token: Option<String>,
}

impl fmt::Debug for Admin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the token.
        f.debug_struct("Admin")
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .finish()
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    listen: SocketAddr,
    admin_listen: Option<SocketAddr>,
    shutdown_grace: Option<HumanDuration>,
    workers: Option<Workers>,
    header_timeout: Option<HumanDuration>,
    idle_timeout: Option<HumanDuration>,
    body_timeout: Option<HumanDuration>,
    upgrade_idle_timeout: Option<HumanDuration>,
    max_connections: Option<MaxConnections>,
    backlog: Option<Backlog>,
    max_header_bytes: Option<HeaderBytes>,
    max_header_fields: Option<HeaderFields>,
    path_case: Option<PathCase>,
    underscores_in_headers: Option<bool>,
    tag_secret: Option<TagSecret>,
    pub(super) tls: Option<super::tls::RawTls>,
}

impl RawServer {
    /// `path_case`, which the routes are compiled with before the rest is validated.
    pub(super) fn path_case(&self) -> PathCase {
        self.path_case.unwrap_or_default()
    }

    /// Every setting the file leaves out takes its default.
    pub(super) fn validate(self, tls: Option<crate::tls::Settings>) -> Server {
        let max_header_bytes = self.max_header_bytes.map_or(MAX_HEADER_BYTES, |m| m.0);
        let d = Timeouts::default();
        let or = |v: Option<HumanDuration>, default| v.map_or(default, |v| v.0);
        Server {
            listen: self.listen,
            admin_listen: self.admin_listen,
            shutdown_grace: or(self.shutdown_grace, SHUTDOWN_GRACE),
            workers: self.workers.map_or_else(default_workers, |w| w.0),
            timeouts: Timeouts {
                header: or(self.header_timeout, d.header),
                idle: or(self.idle_timeout, d.idle),
                body: or(self.body_timeout, d.body),
            },
            upgrade_idle_timeout: or(self.upgrade_idle_timeout, UPGRADE_IDLE_TIMEOUT),
            max_connections: self
                .max_connections
                .as_ref()
                .map_or_else(|| derive_max_connections(open_files_limit()), |m| m.0),
            max_connections_set: self.max_connections.is_some(),
            backlog: self.backlog.map_or(BACKLOG, |b| b.0),
            max_header_bytes,
            max_header_fields: self
                .max_header_fields
                .map_or_else(|| connection::default_max_fields(max_header_bytes), |m| m.0),
            path_case: self.path_case.unwrap_or_default(),
            underscores_in_headers: self.underscores_in_headers.unwrap_or(false),
            tls,
            tag_secret: self.tag_secret,
        }
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAdmin {
    token: Option<AdminToken>,
}

impl RawAdmin {
    /// `env_token`: `RATEWALL_ADMIN_TOKEN`, validated ([`env_admin_token`]), which wins over
    /// the file's.
    pub(super) fn validate(self, env_token: Option<AdminToken>) -> Admin {
        Admin {
            token: env_token.or(self.token).map(|t| t.0),
        }
    }
}

/// `RATEWALL_ADMIN_TOKEN`'s value held to the file's rule (at least 16 printable
/// characters, no spaces): a short one is guessed in a few tries. Set but empty: unset, as
/// before. The error never repeats the value.
pub(super) fn env_admin_token(
    value: Option<String>,
) -> Result<Option<AdminToken>, super::ConfigError> {
    env_secret("RATEWALL_ADMIN_TOKEN", value, AdminToken::new)
}

/// `RATEWALL_DECIDE_TOKEN`'s value held to the admin token's rule.
pub(super) fn env_decide_token(
    value: Option<String>,
) -> Result<Option<AdminToken>, super::ConfigError> {
    env_secret("RATEWALL_DECIDE_TOKEN", value, AdminToken::new)
}

/// `RATEWALL_TAG_SECRET`'s value held to the file's rule, as the admin token's.
pub(super) fn env_tag_secret(
    value: Option<String>,
) -> Result<Option<TagSecret>, super::ConfigError> {
    env_secret("RATEWALL_TAG_SECRET", value, TagSecret::new)
}

/// A secret from the environment variable `variable`, made by `new`; set but empty:
/// unset. The error names the variable, never the value.
fn env_secret<T>(
    variable: &'static str,
    value: Option<String>,
    new: fn(String) -> Result<T, &'static str>,
) -> Result<Option<T>, super::ConfigError> {
    let Some(value) = value.filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    new(value)
        .map(Some)
        .map_err(|message| super::ConfigError::Environment {
            variable,
            message: message.to_string(),
        })
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawResponse {
    #[serde(default)]
    pub(super) headers: ResponseStyle,
}

/// `[log]`, validated: what the access log says (`crate::proxy`'s access line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Log {
    /// Whether the access log names the client's address (as the gateway resolved it,
    /// through `[client_ip]`'s trusted proxies). Off where addresses are personal data
    /// the logs must not keep.
    pub client_ip: bool,
}

impl Default for Log {
    fn default() -> Self {
        Log { client_ip: true }
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLog {
    client_ip: Option<bool>,
}

impl RawLog {
    pub(super) fn validate(self) -> Log {
        Log {
            client_ip: self.client_ip.unwrap_or(Log::default().client_ip),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unset_max_connections_fits_the_open_file_limit() {
        // 20,000 descriptors: room for 9,968 clients with an upstream connection each.
        let n = derive_max_connections(Some(20_000));
        assert_eq!(n, 9_968);
        assert!(n as u64 * 2 + RESERVED_DESCRIPTORS <= 20_000);
        // A generous limit: the default bound, not a million connections.
        assert_eq!(derive_max_connections(Some(1 << 20)), MAX_CONNECTIONS);
        assert_eq!(derive_max_connections(Some(20_128)), MAX_CONNECTIONS);
        // A tiny one still serves one client; an unreadable one takes the default.
        assert_eq!(derive_max_connections(Some(10)), 1);
        assert_eq!(derive_max_connections(None), MAX_CONNECTIONS);
    }

    #[test]
    fn a_tag_secret_from_the_environment_is_held_to_the_files_rule() {
        assert!(env_tag_secret(None).unwrap().is_none());
        assert!(env_tag_secret(Some(String::new())).unwrap().is_none());
        let secret = env_tag_secret(Some("sixteen-chars-ok".into())).unwrap();
        assert_eq!(secret.map(|s| s.as_bytes().len()), Some(16));
        let e = env_tag_secret(Some("too short".into()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("RATEWALL_TAG_SECRET"), "{e}");
        assert!(!e.contains("too short"), "the value is never repeated: {e}");
        let file = TagSecret::new("spaces are not allowed here".into());
        assert!(file.is_err());
        assert_eq!(
            format!("{:?}", TagSecret::new("sixteen-chars-ok".into()).unwrap()),
            "TagSecret(<set>)"
        );
    }
}
