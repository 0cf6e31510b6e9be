//! `[[upstreams]]` and `[upstream]`, validated: the pools requests go to, how a server is
//! picked among a pool's, when a server counts as down, and how often a request may go
//! again. Filled by `crate::config` (one pool named `default` for `[upstream] url`); run
//! by [`super::Pools`].

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;

use super::Tls;
use crate::identity::Key;

/// The longest name a pool or a route may have.
pub const MAX_NAME: usize = 64;
/// The pool `[upstream] url` makes, and where requests no route matches go.
pub const DEFAULT_POOL: &str = "default";

/// `[upstream] connect_timeout`'s default: 5 s, as Envoy's. Not 1 s: Linux sends a SYN
/// that went unanswered again after 1 s, then 3 s (RFC 6298's initial RTO, doubled), so
/// a backend whose listen queue was full for a moment answers the second or third SYN.
/// A 1 s bound cut exactly those connections: 502s, and a healthy server ejected.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// `[upstream] timeout`'s default.
pub const TIMEOUT: Duration = Duration::from_secs(30);
/// `max_fails`' default: failures within `fail_window` that eject a server.
pub const MAX_FAILS: u32 = 3;
/// `fail_window`'s default.
pub const FAIL_WINDOW: Duration = Duration::from_secs(10);
/// `fail_timeout`'s default: a first ejection's length (doubling per consecutive one).
pub const FAIL_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest an ejection lasts, however many came before it.
pub const MAX_EJECTION: Duration = Duration::from_secs(300);
/// `max_ejected_percent`'s default.
pub const MAX_EJECTED_PERCENT: u8 = 50;
/// `retries`' default: how many more servers a failed request may try.
pub const RETRIES: u32 = 1;
/// The most `retries` may be: a request tries at most `MAX_RETRIES + 1` servers (the
/// pools keep the servers it tried on the stack, no allocation per request).
pub const MAX_RETRIES: u32 = 10;
/// `resolve_every`'s default: how often a server's host name is resolved again.
pub const RESOLVE_EVERY: Duration = Duration::from_secs(30);

/// One pool, validated: `[[upstreams]]`, or `[upstream]` with a `url` (the pool `default`).
/// Compared whole on reload: an unchanged pool keeps its connections and its servers'
/// health.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolSettings {
    /// Unique, 1 to [`MAX_NAME`] characters: the metrics' `pool` label.
    pub name: String,
    /// Never empty.
    pub servers: Vec<ServerSettings>,
    pub balance: Balance,
    /// The longest opening a connection may take (resolving included).
    pub connect_timeout: Duration,
    /// Counted from the request sent in full, the longest the answer's head may take (then
    /// 504); also the longest the upstream may stay silent inside an answer's body, or
    /// take nothing of an upload.
    pub timeout: Duration,
    pub passive: Passive,
    /// `health = { … }`: active checks, if any.
    pub health: Option<HealthCheck>,
    /// How many other servers a failed request may try (`retries`), within the budget.
    pub retries: u32,
    /// How often a server's host name is resolved again.
    pub resolve_every: Duration,
    /// What its servers are spoken to in (`protocol`).
    pub protocol: Protocol,
    /// `overload = { … }`: its concurrency limit and the queue beyond it, if any.
    pub overload: Option<crate::overload::Settings>,
}

/// `protocol`: what a pool's servers are spoken to in. Upgrades (WebSocket) always go over
/// HTTP/1.1, on a connection of their own, whatever the pool speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Protocol {
    /// HTTP/1.1 on the gateway's own client, connections kept per worker.
    #[default]
    Http1,
    /// HTTP/2 over TLS (ALPN `h2`): `https://` servers only.
    H2,
    /// HTTP/2 over cleartext TCP, with prior knowledge: `http://` servers only.
    H2c,
    /// ALPN decides, per connection (`h2`, else HTTP/1.1): `https://` servers only.
    Auto,
}

impl Protocol {
    /// Every protocol, in the order the docs list them.
    pub const ALL: [Protocol; 4] = [Protocol::Http1, Protocol::H2, Protocol::H2c, Protocol::Auto];
    /// Their names, as the file writes them.
    pub const NAMES: [&'static str; 4] = ["http1", "h2", "h2c", "auto"];

    /// Whether requests go over HTTP/2 (`auto`: where ALPN picks it).
    pub fn is_http2(self) -> bool {
        self != Protocol::Http1
    }

    /// As the file writes it.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Http1 => "http1",
            Protocol::H2 => "h2",
            Protocol::H2c => "h2c",
            Protocol::Auto => "auto",
        }
    }
}

/// One of a pool's `servers`.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerSettings {
    /// Scheme and authority, as the file gives them: the metrics' `server` label (without
    /// a trailing `/`) and, for a host name, what is resolved.
    pub url: http::Uri,
    /// Path the request path is appended to, without a trailing `/` (empty for `/`).
    pub base_path: String,
    /// Its share of requests against the pool's other servers (1 if not given), 1 to 1000.
    pub weight: u32,
    /// TLS to it: set exactly when `url` is `https://`.
    pub tls: Option<Arc<Tls>>,
}

impl ServerSettings {
    /// `http://10.0.0.1:8080`: the label the metrics, logs and status page use.
    pub fn label(&self) -> String {
        self.url.to_string().trim_end_matches('/').to_string()
    }
}

/// How a pool picks a server for a request.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum Balance {
    /// Weighted round robin (smooth: a server of weight 2 is not picked twice in a row
    /// when others wait).
    #[default]
    RoundRobin,
    /// The server with the fewest requests in flight for its weight.
    LeastRequests,
    /// Two servers at random, the one with fewer requests in flight for its weight.
    RandomTwo,
    /// Consistent hashing by the identity this key source gives (`hash:api_key`): a
    /// request without one is balanced round robin.
    Hash(Key),
}

impl Balance {
    /// As the file writes it: `round_robin`, `hash:api_key`.
    pub fn name(&self) -> String {
        match self {
            Balance::RoundRobin => "round_robin".into(),
            Balance::LeastRequests => "least_requests".into(),
            Balance::RandomTwo => "random_two".into(),
            Balance::Hash(key) => format!("hash:{}", key.kind),
        }
    }
}

/// Passive health: what ejects a server, and for how long.
#[derive(Debug, Clone, PartialEq)]
pub struct Passive {
    /// `max_fails` failures within `fail_window` eject a server (0: never ejected).
    pub max_fails: u32,
    pub fail_window: Duration,
    /// A first ejection's length; each consecutive one doubles it, up to [`MAX_EJECTION`].
    pub fail_timeout: Duration,
    /// At most this share of a pool's servers is ejected at once (0 to 100).
    pub max_ejected_percent: u8,
    /// Statuses from a server that count as its failure (502, 503, 504 only); empty: none.
    pub fail_on_status: Vec<StatusCode>,
}

impl Default for Passive {
    fn default() -> Passive {
        Passive {
            max_fails: MAX_FAILS,
            fail_window: FAIL_WINDOW,
            fail_timeout: FAIL_TIMEOUT,
            max_ejected_percent: MAX_EJECTED_PERCENT,
            fail_on_status: Vec::new(),
        }
    }
}

/// `health = { path, interval, timeout, healthy, unhealthy, expect }`: a `GET path` to each
/// server every `interval`, from one task per pool, never on the request path.
#[derive(Debug, Clone, PartialEq)]
pub struct HealthCheck {
    /// Starts with `/`.
    pub path: String,
    pub interval: Duration,
    pub timeout: Duration,
    /// Consecutive passes that bring a failing server back.
    pub healthy: u32,
    /// Consecutive failures that take a server out.
    pub unhealthy: u32,
    /// The statuses that pass, e.g. `2xx` (200..=299) or `204` (204..=204).
    pub expect: std::ops::RangeInclusive<u16>,
}

/// `health`'s defaults, for the keys a table leaves out.
impl Default for HealthCheck {
    fn default() -> HealthCheck {
        HealthCheck {
            path: "/healthz".into(),
            interval: Duration::from_secs(2),
            timeout: Duration::from_secs(1),
            healthy: 2,
            unhealthy: 3,
            expect: 200..=299,
        }
    }
}
