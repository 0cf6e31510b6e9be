//! `config/limits.toml`: raw serde structs (every table `deny_unknown_fields`), then
//! [`Config::parse`] validates them into immutable, typed values that cannot be wrong.
//!
//! Value-level checks (a rate, a CIDR, a duration) run inside deserialisation, so their
//! errors carry the line and column of the offending value; cross-field checks (burst
//! against cost, duplicate rule names) point at the rule's table.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroU64};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::header::HeaderName;
use http::Method;
use ipnet::IpNet;
use serde::de::{self, Deserializer};
use serde::Deserialize;

use crate::limiter::{Algorithm, Quota, QuotaError};
use crate::rules::{Glob, HostPattern, RuleIndex};
use toml::Spanned;

/// A configuration file that could not be loaded, with where and why.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: cannot read: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}:{line}:{column}: {key}: {message}")]
    Invalid {
        path: PathBuf,
        line: usize,
        column: usize,
        /// The dotted key path, e.g. `rules[0].rate`.
        key: String,
        message: String,
    },
}

/// The validated configuration. Built once per load and shared behind an `Arc`.
#[derive(Debug)]
pub struct Config {
    pub server: Server,
    pub admin: Admin,
    pub upstream: Upstream,
    pub store: Store,
    pub client_ip: ClientIp,
    pub keys: Keys,
    pub response: ResponseStyle,
    pub rules: Vec<Rule>,
    /// `rules`, precompiled for matching (see [`RuleIndex`]).
    pub index: RuleIndex,
}

#[derive(Debug)]
pub struct Server {
    pub listen: SocketAddr,
    pub admin_listen: Option<SocketAddr>,
    pub shutdown_grace: Duration,
    /// Threads serving clients, each with its own event loop and upstream connections.
    pub workers: usize,
    /// How long a client may take to send a request head (see [`Timeouts`]).
    pub timeouts: Timeouts,
    /// Open client connections at most (the gateway listener); past it, idle kept-alive
    /// connections are closed to make room and new ones wait in the listen backlog.
    pub max_connections: usize,
    /// The largest request head (request line and fields; HTTP/2: the header list size)
    /// a client may send; past it, 431.
    pub max_header_bytes: usize,
}

/// How long a client connection may keep the gateway waiting, each a bound on one kind of
/// silence (nginx: `client_header_timeout`, `keepalive_timeout`, `client_body_timeout`,
/// `send_timeout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// From accept to a complete request head (an HTTP/2 preface and SETTINGS); on a
    /// kept-alive connection, from the next request's first byte to its complete head.
    pub header: Duration,
    /// A kept-alive or HTTP/2 connection with nothing in flight is closed after this.
    pub idle: Duration,
    /// The longest gap between two reads of a request body (408), and between two writes
    /// of a response the client does not take (the connection is closed).
    pub body: Duration,
}

/// The admin API's protection.
pub struct Admin {
    /// Bearer token for mutating admin calls (reset). From `[admin].token`, or the
    /// `RATEWALL_ADMIN_TOKEN` environment variable, which wins. None: mutating calls are off.
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

#[derive(Debug, PartialEq)]
pub struct Upstream {
    /// Scheme and authority of the backend, e.g. `http://127.0.0.1:3000`.
    pub url: http::Uri,
    /// Path the request path is appended to, without a trailing `/` (empty for `/`).
    pub base_path: String,
    pub connect_timeout: Duration,
    pub timeout: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    Memory,
    Redis { url: String },
    RedisCluster { nodes: Vec<String> },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnError {
    /// Answer 503 while the store fails: no request escapes its limit.
    Deny,
    /// Forward without limiting while the store fails: availability over enforcement.
    Allow,
    /// Enforce the same rules in this process until the store answers again. With N
    /// instances behind a balancer, up to N times the limit passes meanwhile.
    Local,
}

impl OnError {
    pub fn name(self) -> &'static str {
        match self {
            OnError::Deny => "deny",
            OnError::Allow => "allow",
            OnError::Local => "local",
        }
    }
}

#[derive(Debug, PartialEq)]
pub struct Store {
    pub backend: Backend,
    pub prefix: String,
    pub timeout: Duration,
    pub on_error: OnError,
    /// Outages in a row that open the circuit breaker.
    pub breaker_failures: u32,
    /// How long an open breaker stops calls before a probe may close it.
    pub breaker_cooldown: Duration,
    /// The most keys the memory store (and the `local` fallback) tracks; see
    /// [`crate::limiter::memory`] for what is evicted when it is full.
    pub max_keys: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ForwardingHeader {
    XForwardedFor,
    Forwarded,
    XRealIp,
}

#[derive(Debug)]
pub struct ClientIp {
    pub trusted_proxies: Vec<IpNet>,
    pub header: ForwardingHeader,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnknownKeys {
    Allow,
    Reject,
}

#[derive(Debug)]
pub struct Keys {
    pub header: HeaderName,
    pub unknown: UnknownKeys,
    /// SHA-256 of an API key -> plan name, from `[keys.plans]` and the keys file. Keys
    /// are held as digests only, so the process never holds a listed key it has not seen
    /// in a request.
    plans: HashMap<[u8; 32], String>,
    /// The keys file, if any (re-read on every reload).
    pub file: Option<PathBuf>,
}

impl Keys {
    /// The plan `key` maps to, if it is listed.
    pub fn plan_of(&self, key: &[u8]) -> Option<&str> {
        if self.plans.is_empty() {
            return None;
        }
        self.plans.get(&sha256(key)).map(String::as_str)
    }

    /// How many keys are listed.
    pub fn len(&self) -> usize {
        self.plans.len()
    }

    pub fn is_empty(&self) -> bool {
        self.plans.is_empty()
    }
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).into()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResponseStyle {
    Draft,
    Legacy,
    Both,
    None,
}

/// Who a rule counts requests for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyKind {
    ApiKey,
    ClientIp,
    Global,
    Header(HeaderName),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MissingKey {
    Reject,
    ClientIp,
}

/// Which paths a rule's `match` takes.
#[derive(Debug, Clone, Default)]
pub enum PathMatch {
    #[default]
    Any,
    Prefix(String),
    Exact(String),
    Glob(Glob),
}

#[derive(Debug, Clone, Default)]
pub struct Match {
    pub path: PathMatch,
    /// Empty: every method.
    pub methods: Vec<Method>,
    /// Empty: every host.
    pub hosts: Vec<HostPattern>,
}

/// Whether a rule blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Denies what its limit does not allow (for `enforce_percent` of identities).
    #[default]
    Enforce,
    /// Decides, counts and logs, adds `RateLimit-Shadow`, never denies.
    Shadow,
}

#[derive(Debug, Clone)]
pub struct Rule {
    pub name: String,
    pub matcher: Match,
    pub key: KeyKind,
    pub missing_key: MissingKey,
    /// The quota for requests without a plan, then per plan name.
    pub quota: Quota,
    pub plans: HashMap<String, Quota>,
    pub mode: Mode,
    /// With `mode = "enforce"`: the share of identities (by hash) the rule enforces for,
    /// 0 to 100; the others are treated as in shadow mode.
    pub enforce_percent: u8,
    /// With `max_delay`: how many requests may wait on this rule at once in this process.
    pub max_waiting: u32,
    /// Up to this much random time is added to a denial's `Retry-After`, in µs.
    pub retry_jitter_us: u64,
}

impl Match {
    /// `GET|POST /api/* on api.example.com`, or `every request`.
    pub fn describe(&self) -> String {
        if matches!(self.path, PathMatch::Any) && self.methods.is_empty() && self.hosts.is_empty() {
            return "every request".to_string();
        }
        let mut s = String::new();
        if !self.methods.is_empty() {
            let m: Vec<&str> = self.methods.iter().map(|m| m.as_str()).collect();
            s.push_str(&m.join("|"));
            s.push(' ');
        }
        match &self.path {
            PathMatch::Prefix(p) => {
                s.push_str(p);
                s.push('*');
            }
            PathMatch::Exact(p) => s.push_str(p),
            PathMatch::Glob(g) => {
                s.push_str("glob ");
                s.push_str(g.pattern());
            }
            PathMatch::Any => s.push_str("any path"),
        }
        if !self.hosts.is_empty() {
            let h: Vec<String> = self.hosts.iter().map(ToString::to_string).collect();
            s.push_str(" on ");
            s.push_str(&h.join("|"));
        }
        s
    }
}

impl Rule {
    /// The quota that applies to a request whose API key maps to `plan`.
    pub fn quota_for(&self, plan: Option<&str>) -> &Quota {
        plan.and_then(|p| self.plans.get(p)).unwrap_or(&self.quota)
    }

    /// How the rule acts on what its limit says, for `ratewall check`.
    pub fn behaviour(&self) -> String {
        let mut s = match (self.mode, self.enforce_percent) {
            (Mode::Shadow, _) => "shadow: decides and counts, never denies".to_string(),
            (Mode::Enforce, 100) => "enforced".to_string(),
            (Mode::Enforce, p) => {
                format!("enforced for {p}% of identities (by hash), shadow for the rest")
            }
        };
        if self.quota.max_delay_us > 0 {
            s.push_str(&format!(
                "; waits up to {} for tokens (at most {} waiting)",
                humantime::format_duration(Duration::from_micros(self.quota.max_delay_us)),
                self.max_waiting
            ));
        }
        if self.quota.algorithm == Algorithm::Concurrency {
            s.push_str(&format!(
                "; leases live {} in a shared store unless renewed",
                humantime::format_duration(Duration::from_micros(self.quota.lease_us))
            ));
        }
        if self.retry_jitter_us > 0 {
            s.push_str(&format!(
                "; Retry-After + up to {} jitter",
                humantime::format_duration(Duration::from_micros(self.retry_jitter_us))
            ));
        }
        s
    }

    /// Whether the rule denies for `identity`, or only watches (shadow mode, or an
    /// identity outside `enforce_percent`). Stable: by the identity's digest, so the same
    /// identities are enforced on every gateway and after restarts, and raising the
    /// percentage only adds identities.
    pub fn enforces(&self, identity: &crate::limiter::IdentityDigest) -> bool {
        match self.mode {
            Mode::Shadow => false,
            Mode::Enforce if self.enforce_percent >= 100 => true,
            Mode::Enforce => {
                let mut b = [0u8; 8];
                b.copy_from_slice(&identity.0[8..16]);
                u64::from_le_bytes(b) % 100 < u64::from(self.enforce_percent)
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Raw file shape. Every table rejects unknown keys.

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    server: RawServer,
    #[serde(default)]
    admin: RawAdmin,
    upstream: RawUpstream,
    store: Option<Spanned<RawStore>>,
    #[serde(default)]
    client_ip: RawClientIp,
    #[serde(default)]
    keys: RawKeys,
    #[serde(default)]
    response: RawResponse,
    #[serde(default)]
    rules: Vec<toml::Spanned<RawRule>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServer {
    listen: SocketAddr,
    admin_listen: Option<SocketAddr>,
    #[serde(default = "default_grace")]
    shutdown_grace: HumanDuration,
    workers: Option<Workers>,
    #[serde(default = "default_header_timeout")]
    header_timeout: HumanDuration,
    #[serde(default = "default_idle_timeout")]
    idle_timeout: HumanDuration,
    #[serde(default = "default_body_timeout")]
    body_timeout: HumanDuration,
    #[serde(default = "default_max_connections")]
    max_connections: MaxConnections,
    #[serde(default = "default_max_header_bytes")]
    max_header_bytes: HeaderBytes,
}

fn default_header_timeout() -> HumanDuration {
    HumanDuration(Duration::from_secs(10))
}
fn default_idle_timeout() -> HumanDuration {
    HumanDuration(Duration::from_secs(60))
}
fn default_body_timeout() -> HumanDuration {
    HumanDuration(Duration::from_secs(30))
}
fn default_max_connections() -> MaxConnections {
    MaxConnections(10_000)
}
fn default_max_header_bytes() -> HeaderBytes {
    HeaderBytes(32 * 1024)
}

/// 1 to 10,000,000 open client connections.
struct MaxConnections(usize);

impl<'de> Deserialize<'de> for MaxConnections {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = u64::deserialize(d)?;
        if !(1..=10_000_000).contains(&n) {
            return Err(de::Error::custom(format!(
                "max_connections = {n}: 1 to 10000000 (default 10000)"
            )));
        }
        Ok(MaxConnections(n as usize))
    }
}

/// A request head's size bound: 1 KiB to 1 MiB, as bytes or `"32KiB"`.
struct HeaderBytes(usize);

impl<'de> Deserialize<'de> for HeaderBytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = ByteSize::deserialize(d)?.0;
        if !(1024..=1024 * 1024).contains(&n) {
            return Err(de::Error::custom(format!(
                "max_header_bytes = {n} bytes: 1KiB to 1MiB (default 32KiB)"
            )));
        }
        Ok(HeaderBytes(n as usize))
    }
}

/// A size: a whole number of bytes, or a string with a binary unit: `"512B"`, `"32KiB"`,
/// `"1MiB"` (`k` and `m`, as nginx writes them, are the same units).
struct ByteSize(u64);

impl ByteSize {
    fn parse(s: &str) -> Result<u64, String> {
        let t = s.trim();
        let digits = t.bytes().take_while(u8::is_ascii_digit).count();
        let (n, unit) = t.split_at(digits);
        let n: u64 = n.parse().map_err(|_| {
            format!("invalid size {s:?}: expected e.g. 32768, \"32KiB\" or \"1MiB\"")
        })?;
        let scale: u64 = match unit.trim() {
            "" | "B" | "b" => 1,
            "KiB" | "k" | "K" => 1024,
            "MiB" | "m" | "M" => 1024 * 1024,
            "KB" | "kB" | "MB" => {
                return Err(format!(
                    "invalid size {s:?}: write KiB or MiB (1024-based), not {unit}"
                ))
            }
            other => return Err(format!("invalid size {s:?}: unknown unit {other:?}")),
        };
        n.checked_mul(scale)
            .ok_or_else(|| format!("invalid size {s:?}: too large"))
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number of bytes, or a size such as \"32KiB\"")
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<ByteSize, E> {
                u64::try_from(n)
                    .map(ByteSize)
                    .map_err(|_| E::custom(format!("invalid size {n}: below zero")))
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(n))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<ByteSize, E> {
                ByteSize::parse(s).map(ByteSize).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// One worker per CPU the process may use.
fn default_workers() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}

/// 1 to 1024 worker threads.
struct Workers(usize);

impl<'de> Deserialize<'de> for Workers {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = u64::deserialize(d)?;
        if !(1..=1024).contains(&n) {
            return Err(de::Error::custom(format!(
                "workers = {n}: 1 to 1024 (default: one per CPU)"
            )));
        }
        Ok(Workers(n as usize))
    }
}

fn default_grace() -> HumanDuration {
    HumanDuration(Duration::from_secs(10))
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawAdmin {
    token: Option<AdminToken>,
}

/// An admin token: long enough not to be guessed.
struct AdminToken(String);

impl<'de> Deserialize<'de> for AdminToken {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s.len() < 16 || s.bytes().any(|b| !b.is_ascii_graphic()) {
            return Err(de::Error::custom(
                "an admin token is at least 16 printable characters without spaces",
            ));
        }
        Ok(AdminToken(s))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawUpstream {
    url: UpstreamUrl,
    #[serde(default = "default_connect_timeout")]
    connect_timeout: HumanDuration,
    #[serde(default = "default_upstream_timeout")]
    timeout: HumanDuration,
}

fn default_connect_timeout() -> HumanDuration {
    HumanDuration(Duration::from_secs(1))
}
fn default_upstream_timeout() -> HumanDuration {
    HumanDuration(Duration::from_secs(30))
}

#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum RawBackend {
    Memory,
    Redis,
    RedisCluster,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStore {
    #[serde(default = "default_backend")]
    backend: RawBackend,
    url: Option<RedisUrl>,
    nodes: Option<Vec<RedisUrl>>,
    #[serde(default = "default_prefix")]
    prefix: Prefix,
    #[serde(default = "default_store_timeout")]
    timeout: HumanDuration,
    #[serde(default = "default_on_error")]
    on_error: OnError,
    #[serde(default = "default_breaker_failures")]
    breaker_failures: NonZeroU32,
    #[serde(default = "default_breaker_cooldown")]
    breaker_cooldown: HumanDuration,
    #[serde(default = "default_max_keys")]
    max_keys: MaxKeys,
}

fn default_max_keys() -> MaxKeys {
    MaxKeys(1_000_000)
}

/// 1 to 1,000,000,000 keys in the memory store.
struct MaxKeys(usize);

impl<'de> Deserialize<'de> for MaxKeys {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = u64::deserialize(d)?;
        if !(1..=1_000_000_000).contains(&n) {
            return Err(de::Error::custom(format!(
                "max_keys = {n}: 1 to 1000000000 (default 1000000)"
            )));
        }
        Ok(MaxKeys(n as usize))
    }
}

impl Default for RawStore {
    fn default() -> Self {
        RawStore {
            backend: default_backend(),
            url: None,
            nodes: None,
            prefix: default_prefix(),
            timeout: default_store_timeout(),
            on_error: default_on_error(),
            breaker_failures: default_breaker_failures(),
            breaker_cooldown: default_breaker_cooldown(),
            max_keys: default_max_keys(),
        }
    }
}

fn default_breaker_failures() -> NonZeroU32 {
    NonZeroU32::new(5).unwrap_or(NonZeroU32::MIN)
}
fn default_breaker_cooldown() -> HumanDuration {
    HumanDuration(Duration::from_secs(1))
}

fn default_backend() -> RawBackend {
    RawBackend::Memory
}
fn default_prefix() -> Prefix {
    Prefix("ratewall".into())
}
fn default_store_timeout() -> HumanDuration {
    HumanDuration(Duration::from_millis(50))
}
fn default_on_error() -> OnError {
    OnError::Deny
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClientIp {
    #[serde(default = "default_trusted")]
    trusted_proxies: Vec<Cidr>,
    #[serde(default = "default_forwarding_header")]
    header: ForwardingHeader,
}

impl Default for RawClientIp {
    fn default() -> Self {
        RawClientIp {
            trusted_proxies: default_trusted(),
            header: default_forwarding_header(),
        }
    }
}

fn default_trusted() -> Vec<Cidr> {
    Vec::new()
}
fn default_forwarding_header() -> ForwardingHeader {
    ForwardingHeader::XForwardedFor
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKeys {
    #[serde(default = "default_key_header")]
    header: Header,
    #[serde(default = "default_unknown")]
    unknown: UnknownKeys,
    #[serde(default)]
    plans: HashMap<String, Spanned<PlanName>>,
    file: Option<Spanned<String>>,
}

impl Default for RawKeys {
    fn default() -> Self {
        RawKeys {
            header: default_key_header(),
            unknown: default_unknown(),
            plans: HashMap::new(),
            file: None,
        }
    }
}

/// The keys file: `[plans]`, API key (or `sha256:<hex>` of one) -> plan name.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKeysFile {
    #[serde(default)]
    plans: HashMap<String, Spanned<PlanName>>,
}

/// An API key as listed: the key itself, or `sha256:<64 hex digits>` of it.
fn key_digest(listed: &str) -> Result<[u8; 32], String> {
    if let Some(hex) = listed.strip_prefix("sha256:") {
        let hex = hex.trim();
        let bytes = hex.as_bytes();
        if bytes.len() != 64 || !bytes.iter().all(u8::is_ascii_hexdigit) {
            return Err(format!(
                "{listed:?}: a sha256: key is 64 hex digits (`printf %s KEY | sha256sum`)"
            ));
        }
        let mut d = [0u8; 32];
        for (i, pair) in bytes.chunks_exact(2).enumerate() {
            let hi = (pair[0] as char).to_digit(16).unwrap_or(0);
            let lo = (pair[1] as char).to_digit(16).unwrap_or(0);
            d[i] = (hi * 16 + lo) as u8;
        }
        return Ok(d);
    }
    // A key no client can send (empty, control characters) would never match.
    if listed.is_empty() || http::HeaderValue::from_str(listed).is_err() {
        return Err("an API key is a non-empty header value without control characters".into());
    }
    Ok(sha256(listed.as_bytes()))
}

fn default_key_header() -> Header {
    Header(HeaderName::from_static("x-api-key"))
}
fn default_unknown() -> UnknownKeys {
    UnknownKeys::Allow
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawResponse {
    #[serde(default = "default_style")]
    headers: ResponseStyle,
}

impl Default for RawResponse {
    fn default() -> Self {
        RawResponse {
            headers: default_style(),
        }
    }
}

fn default_style() -> ResponseStyle {
    ResponseStyle::Draft
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMatch {
    path_prefix: Option<PathPrefix>,
    path: Option<PathPrefix>,
    glob: Option<GlobSpec>,
    #[serde(default)]
    methods: Vec<MethodName>,
    #[serde(default)]
    host: Hosts,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    name: Spanned<RuleName>,
    #[serde(rename = "match")]
    matcher: Option<Spanned<RawMatch>>,
    key: KeySpec,
    #[serde(default = "default_missing_key")]
    missing_key: MissingKey,
    algorithm: Option<Spanned<Algorithm>>,
    rate: Option<Spanned<Rate>>,
    burst: Option<Spanned<NonZeroU64>>,
    cost: Option<Spanned<NonZeroU64>>,
    mode: Option<Spanned<Mode>>,
    enforce_percent: Option<Spanned<u8>>,
    max_delay: Option<Spanned<HumanDuration>>,
    max_waiting: Option<Spanned<NonZeroU32>>,
    max_in_flight: Option<Spanned<NonZeroU64>>,
    lease_ttl: Option<Spanned<HumanDuration>>,
    retry_jitter: Option<HumanDuration>,
    #[serde(default)]
    plans: HashMap<String, Spanned<RawPlanOverride>>,
}

fn default_missing_key() -> MissingKey {
    MissingKey::Reject
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPlanOverride {
    rate: Option<Rate>,
    burst: Option<NonZeroU64>,
    algorithm: Option<Algorithm>,
    cost: Option<NonZeroU64>,
    max_in_flight: Option<NonZeroU64>,
}

/// Requests wait at most this many per rule, per gateway, unless `max_waiting` says.
const DEFAULT_MAX_WAITING: u32 = 1_000;
/// The longest a request may be made to wait for its tokens.
const MAX_DELAY: Duration = Duration::from_secs(300);
/// How long a concurrency lease lives in a shared store without renewal, by default.
const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------
// Value types that validate while they deserialise, so errors carry line and column.

/// A humantime duration: `"50ms"`, `"2s"`, `"10m"`.
#[derive(Clone, Copy)]
struct HumanDuration(Duration);

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let v = humantime::parse_duration(s.trim())
            .map_err(|e| de::Error::custom(format!("invalid duration {s:?}: {e}")))?;
        if v.is_zero() {
            return Err(de::Error::custom(format!(
                "duration {s:?} must be above zero"
            )));
        }
        Ok(HumanDuration(v))
    }
}

/// `"N/s"`, `"N/m"`, `"N/h"`, `"N/d"` or `"N/<duration>"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rate {
    pub count: u64,
    pub period: Duration,
}

impl Rate {
    pub fn parse(s: &str) -> Result<Rate, String> {
        let (n, per) = s
            .split_once('/')
            .ok_or_else(|| format!("invalid rate {s:?}: expected \"N/s\", \"N/m\", \"N/h\", \"N/d\" or \"N/<duration>\""))?;
        let count: u64 = n
            .trim()
            .parse()
            .map_err(|_| format!("invalid rate {s:?}: {n:?} is not a whole number"))?;
        if count == 0 {
            return Err(format!("invalid rate {s:?}: the count must be at least 1"));
        }
        let per = per.trim();
        let period = match per {
            "s" => Duration::from_secs(1),
            "m" => Duration::from_secs(60),
            "h" => Duration::from_secs(3600),
            "d" => Duration::from_secs(86_400),
            other => humantime::parse_duration(other)
                .map_err(|e| format!("invalid rate {s:?}: period {other:?}: {e}"))?,
        };
        if period.is_zero() || period.subsec_nanos() != 0 {
            return Err(format!(
                "invalid rate {s:?}: the period must be a whole number of seconds (RateLimit-Policy's w is in seconds)"
            ));
        }
        Ok(Rate { count, period })
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.period.as_secs() {
            1 => write!(f, "{}/s", self.count),
            60 => write!(f, "{}/m", self.count),
            3600 => write!(f, "{}/h", self.count),
            86_400 => write!(f, "{}/d", self.count),
            s => write!(f, "{}/{}s", self.count, s),
        }
    }
}

impl<'de> Deserialize<'de> for Rate {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Rate::parse(&s).map_err(de::Error::custom)
    }
}

struct Cidr(IpNet);

impl<'de> Deserialize<'de> for Cidr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let s = s.trim();
        // A bare address means that one host.
        let net = s
            .parse::<IpNet>()
            .or_else(|_| s.parse::<std::net::IpAddr>().map(IpNet::from))
            .map_err(|_| {
                de::Error::custom(format!(
                    "invalid CIDR {s:?}: expected e.g. \"10.0.0.0/8\" or \"::1/128\""
                ))
            })?;
        Ok(Cidr(net.trunc()))
    }
}

struct Header(HeaderName);

impl<'de> Deserialize<'de> for Header {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        HeaderName::from_bytes(s.trim().as_bytes())
            .map(Header)
            .map_err(|_| de::Error::custom(format!("invalid header name {s:?}")))
    }
}

enum KeySpec {
    ApiKey,
    ClientIp,
    Global,
    Header(HeaderName),
}

impl<'de> Deserialize<'de> for KeySpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        match s.as_str() {
            "api_key" => Ok(KeySpec::ApiKey),
            "client_ip" => Ok(KeySpec::ClientIp),
            "global" => Ok(KeySpec::Global),
            other => match other.strip_prefix("header:") {
                Some(name) => HeaderName::from_bytes(name.trim().as_bytes())
                    .map(KeySpec::Header)
                    .map_err(|_| de::Error::custom(format!("invalid header name in key {s:?}"))),
                None => Err(de::Error::custom(format!(
                    "invalid key {s:?}: expected \"api_key\", \"client_ip\", \"global\" or \"header:<name>\""
                ))),
            },
        }
    }
}

/// Rule names appear in Redis keys, headers and metrics: keep them to a safe alphabet.
struct RuleName(String);

impl<'de> Deserialize<'de> for RuleName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let ok = !s.is_empty()
            && s.len() <= 64
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b));
        if !ok {
            return Err(de::Error::custom(format!(
                "invalid rule name {s:?}: 1 to 64 characters of A-Z a-z 0-9 _ - ."
            )));
        }
        Ok(RuleName(s))
    }
}

struct PlanName(String);

impl<'de> Deserialize<'de> for PlanName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s.is_empty() || s.len() > 64 {
            return Err(de::Error::custom("a plan name is 1 to 64 characters"));
        }
        Ok(PlanName(s))
    }
}

/// The prefix of every Redis key; `{`, `}` and spaces would break the hash tag.
struct Prefix(String);

impl<'de> Deserialize<'de> for Prefix {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let ok = !s.is_empty()
            && s.len() <= 64
            && s.bytes()
                .all(|b| b.is_ascii_graphic() && b != b'{' && b != b'}');
        if !ok {
            return Err(de::Error::custom(format!(
                "invalid prefix {s:?}: 1 to 64 printable characters without braces or spaces"
            )));
        }
        Ok(Prefix(s))
    }
}

struct PathPrefix(String);

impl<'de> Deserialize<'de> for PathPrefix {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if !s.starts_with('/') {
            return Err(de::Error::custom(format!("{s:?} must start with \"/\"")));
        }
        if s.contains('*') {
            return Err(de::Error::custom(format!(
                "{s:?}: * is literal here; for a pattern use glob = {s:?}"
            )));
        }
        if s.contains(['?', '#']) {
            return Err(de::Error::custom(format!(
                "{s:?}: rules match the path only, without ? or #"
            )));
        }
        // Requests are matched by their normalised path: a path written otherwise would
        // never match.
        let normal = crate::rules::normalize_path(&s);
        if normal != s.as_str() {
            return Err(de::Error::custom(format!(
                "{s:?} is matched against normalised paths; write it as {normal:?}"
            )));
        }
        Ok(PathPrefix(s))
    }
}

/// A path glob: `*` within one segment, `**` for any number of segments.
struct GlobSpec(Glob);

impl<'de> Deserialize<'de> for GlobSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Glob::new(&s).map(GlobSpec).map_err(de::Error::custom)
    }
}

/// `host = "api.example.com"`, or a list; `*.example.com` for every subdomain.
#[derive(Default)]
struct Hosts(Vec<HostPattern>);

impl<'de> Deserialize<'de> for Hosts {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = Hosts;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a host name, or a list of them")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Hosts, E> {
                HostPattern::new(s)
                    .map(|h| Hosts(vec![h]))
                    .map_err(E::custom)
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Hosts, A::Error> {
                let mut out = Vec::new();
                while let Some(s) = seq.next_element::<String>()? {
                    out.push(HostPattern::new(&s).map_err(de::Error::custom)?);
                }
                Ok(Hosts(out))
            }
        }
        d.deserialize_any(V)
    }
}

struct MethodName(Method);

impl<'de> Deserialize<'de> for MethodName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let upper = s.to_ascii_uppercase();
        Method::from_bytes(upper.as_bytes())
            .map(MethodName)
            .map_err(|_| de::Error::custom(format!("invalid method {s:?}")))
    }
}

struct UpstreamUrl {
    uri: http::Uri,
    base_path: String,
}

impl<'de> Deserialize<'de> for UpstreamUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let uri: http::Uri = s
            .parse()
            .map_err(|e| de::Error::custom(format!("invalid upstream url {s:?}: {e}")))?;
        if uri.scheme_str() != Some("http") {
            return Err(de::Error::custom(format!(
                "invalid upstream url {s:?}: only http:// upstreams are supported"
            )));
        }
        let Some(authority) = uri.authority().cloned() else {
            return Err(de::Error::custom(format!(
                "invalid upstream url {s:?}: no host"
            )));
        };
        if uri.query().is_some() {
            return Err(de::Error::custom(format!(
                "invalid upstream url {s:?}: no query allowed"
            )));
        }
        let base_path = uri.path().trim_end_matches('/').to_string();
        let uri = http::Uri::builder()
            .scheme("http")
            .authority(authority)
            .path_and_query("/")
            .build()
            .map_err(|e| de::Error::custom(format!("invalid upstream url {s:?}: {e}")))?;
        Ok(UpstreamUrl { uri, base_path })
    }
}

struct RedisUrl(String);

impl<'de> Deserialize<'de> for RedisUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        redis::Client::open(s.as_str())
            .map_err(|e| de::Error::custom(format!("invalid redis url: {e}")))?;
        Ok(RedisUrl(s))
    }
}

// ---------------------------------------------------------------------------------------

impl Config {
    /// Read and validate the file at `path`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Config::parse(&text, path)
    }

    /// Validate `text`; `path` only names the file in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let invalid = |span: Option<Range<usize>>, key: String, message: String| {
            let (line, column) = line_col(text, span.map(|s| s.start).unwrap_or(0));
            ConfigError::Invalid {
                path: path.to_owned(),
                line,
                column,
                key,
                message,
            }
        };
        let de = toml::Deserializer::parse(text).map_err(|e| {
            invalid(
                e.span(),
                "(document)".into(),
                e.message().trim().to_string(),
            )
        })?;
        let raw: RawConfig = serde_path_to_error::deserialize(de).map_err(|e| {
            let key = match e
                .path()
                .to_string()
                .replace(".$__serde_spanned_private_value", "")
            {
                k if k == "." => "(top level)".to_string(),
                k => redact_key(k, "keys.plans."),
            };
            let inner = e.into_inner();
            invalid(inner.span(), key, inner.message().trim().to_string())
        })?;
        let keys_file = match &raw.keys.file {
            Some(f) => {
                let file = path
                    .parent()
                    .unwrap_or(Path::new(""))
                    .join(f.get_ref().trim());
                let listed = load_keys_file(&file).map_err(|e| match e {
                    // A missing keys file is the config's error: point at `file =`.
                    ConfigError::Read { source, .. } => invalid(
                        Some(f.span()),
                        "keys.file".into(),
                        format!(
                            "cannot read the keys file {:?} (relative to this file's folder): {source}",
                            f.get_ref()
                        ),
                    ),
                    e => e,
                })?;
                Some((file, listed))
            }
            None => None,
        };
        Config::validate(raw, keys_file).map_err(|(span, key, message)| invalid(span, key, message))
    }

    fn validate(
        raw: RawConfig,
        keys_file: Option<(PathBuf, HashMap<[u8; 32], String>)>,
    ) -> Result<Config, (Option<Range<usize>>, String, String)> {
        let (store_span, store) = match raw.store {
            Some(s) => (Some(s.span()), s.into_inner()),
            None => (None, RawStore::default()),
        };
        let backend = match (store.backend, store.url, store.nodes) {
            (RawBackend::Memory, _, _) => Backend::Memory,
            (RawBackend::Redis, Some(url), _) => Backend::Redis { url: url.0 },
            (RawBackend::Redis, None, _) => {
                return Err((
                    store_span,
                    "store.url".into(),
                    "backend = \"redis\" needs url = \"redis://host:port\"".into(),
                ))
            }
            (RawBackend::RedisCluster, _, Some(nodes)) if !nodes.is_empty() => Backend::RedisCluster {
                nodes: nodes.into_iter().map(|n| n.0).collect(),
            },
            (RawBackend::RedisCluster, _, _) => {
                return Err((
                    store_span,
                    "store.nodes".into(),
                    "backend = \"redis_cluster\" needs nodes = [\"redis://host:port\", ...] (one or more seed nodes)".into(),
                ))
            }
        };
        // Every listed key, as a digest: inline ones, then the keys file's.
        let mut listed: HashMap<[u8; 32], String> = HashMap::new();
        let mut inline: Vec<(&String, &Spanned<PlanName>)> = raw.keys.plans.iter().collect();
        inline.sort_by(|a, b| a.0.cmp(b.0));
        for (k, spanned) in inline {
            let plan = spanned.get_ref();
            let d =
                key_digest(k).map_err(|m| (Some(spanned.span()), "keys.plans".to_string(), m))?;
            if listed.get(&d).is_some_and(|p| *p != plan.0) {
                return Err((
                    Some(spanned.span()),
                    "keys.plans".into(),
                    "one API key is listed twice with different plans (as itself and as its sha256:)"
                        .into(),
                ));
            }
            listed.insert(d, plan.0.clone());
        }
        let (keys_path, file_keys) = match keys_file {
            Some((p, k)) => (Some(p), k),
            None => (None, HashMap::new()),
        };
        for (d, plan) in file_keys {
            if listed.get(&d).is_some_and(|p| *p != plan) {
                return Err((
                    raw.keys.file.as_ref().map(Spanned::span),
                    "keys.file".into(),
                    format!("an API key in the keys file has plan {plan:?} there and {:?} in [keys.plans]", listed[&d]),
                ));
            }
            listed.insert(d, plan);
        }
        let plan_names: HashSet<&str> = listed.values().map(String::as_str).collect();

        let mut names = HashSet::new();
        let mut rules = Vec::with_capacity(raw.rules.len());
        for (i, spanned) in raw.rules.iter().enumerate() {
            let r = spanned.get_ref();
            let at = |key: &str| format!("rules[{i}].{key}");
            let name = r.name.get_ref().0.as_str();
            if !names.insert(name) {
                return Err((
                    Some(r.name.span()),
                    at("name"),
                    format!("duplicate rule name {name:?}"),
                ));
            }
            rules.push(validate_rule(r, spanned.span(), &at, &plan_names)?);
        }
        let index = RuleIndex::new(&rules);

        let token = std::env::var("RATEWALL_ADMIN_TOKEN")
            .ok()
            .filter(|t| !t.is_empty())
            .or(raw.admin.token.map(|t| t.0));
        Ok(Config {
            admin: Admin { token },
            server: Server {
                listen: raw.server.listen,
                admin_listen: raw.server.admin_listen,
                shutdown_grace: raw.server.shutdown_grace.0,
                workers: raw.server.workers.map_or_else(default_workers, |w| w.0),
                timeouts: Timeouts {
                    header: raw.server.header_timeout.0,
                    idle: raw.server.idle_timeout.0,
                    body: raw.server.body_timeout.0,
                },
                max_connections: raw.server.max_connections.0,
                max_header_bytes: raw.server.max_header_bytes.0,
            },
            upstream: Upstream {
                url: raw.upstream.url.uri,
                base_path: raw.upstream.url.base_path,
                connect_timeout: raw.upstream.connect_timeout.0,
                timeout: raw.upstream.timeout.0,
            },
            store: Store {
                backend,
                prefix: store.prefix.0,
                timeout: store.timeout.0,
                on_error: store.on_error,
                breaker_failures: store.breaker_failures.get(),
                breaker_cooldown: store.breaker_cooldown.0,
                max_keys: store.max_keys.0,
            },
            client_ip: ClientIp {
                trusted_proxies: raw
                    .client_ip
                    .trusted_proxies
                    .into_iter()
                    .map(|c| c.0)
                    .collect(),
                header: raw.client_ip.header,
            },
            keys: Keys {
                header: raw.keys.header.0,
                unknown: raw.keys.unknown,
                plans: listed,
                file: keys_path,
            },
            response: raw.response.headers,
            rules,
            index,
        })
    }

    /// The effective configuration, for `ratewall check`. API keys are not printed.
    pub fn describe(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let _ = writeln!(out, "listen        {}", self.server.listen);
        if let Some(a) = self.server.admin_listen {
            let _ = writeln!(out, "admin_listen  {a}");
        }
        let _ = writeln!(
            out,
            "upstream      {}{}",
            self.upstream.url.to_string().trim_end_matches('/'),
            self.upstream.base_path
        );
        let t = &self.server.timeouts;
        let _ = writeln!(
            out,
            "clients       header_timeout {}, idle_timeout {}, body_timeout {}, max_connections {}, max_header_bytes {}",
            humantime::format_duration(t.header),
            humantime::format_duration(t.idle),
            humantime::format_duration(t.body),
            self.server.max_connections,
            self.server.max_header_bytes
        );
        let backend = match &self.store.backend {
            Backend::Memory => format!(
                "memory (embedded, one instance; max_keys {})",
                self.store.max_keys
            ),
            Backend::Redis { .. } => "redis".to_string(),
            Backend::RedisCluster { nodes } => {
                format!("redis_cluster ({} seed nodes)", nodes.len())
            }
        };
        let _ = writeln!(
            out,
            "store         {backend}, timeout {}, on_error {}",
            humantime::format_duration(self.store.timeout),
            self.store.on_error.name()
        );
        let _ = writeln!(
            out,
            "keys          header {}, {} listed with a plan{}",
            self.keys.header,
            self.keys.plans.len(),
            match &self.keys.file {
                Some(f) => format!(" (with the keys file {})", f.display()),
                None => String::new(),
            }
        );
        let _ = writeln!(out, "rules         {}", self.rules.len());
        for r in &self.rules {
            let when = r.matcher.describe();
            let key = match &r.key {
                KeyKind::ApiKey => match r.missing_key {
                    MissingKey::Reject => "api_key (missing: 401)".to_string(),
                    MissingKey::ClientIp => "api_key (missing: client_ip)".to_string(),
                },
                KeyKind::ClientIp => "client_ip".to_string(),
                KeyKind::Global => "global".to_string(),
                KeyKind::Header(h) => format!("header:{h}"),
            };
            let _ = writeln!(
                out,
                "  - {}: {} per {}; {}; when {}",
                r.name,
                r.quota,
                key,
                r.quota.algorithm.name(),
                when
            );
            let _ = writeln!(out, "      {}", r.behaviour());
            let mut plans: Vec<_> = r.plans.iter().collect();
            plans.sort_by(|a, b| a.0.cmp(b.0));
            for (p, q) in plans {
                let _ = writeln!(out, "      plan {p}: {q} ({})", q.algorithm.name());
            }
        }
        out
    }
}

type Invalid = (Option<Range<usize>>, String, String);

/// One rule, validated: its limit (a rate or a concurrency cap), its plans, its match, its
/// mode. `span` is the rule's table; `at` names a key of it.
fn validate_rule(
    r: &RawRule,
    span: Range<usize>,
    at: &dyn Fn(&str) -> String,
    plan_names: &HashSet<&str>,
) -> Result<Rule, Invalid> {
    let name = r.name.get_ref().0.as_str();
    let no = |span: Option<Range<usize>>, key: &str, message: String| -> Invalid {
        (span, at(key), message)
    };
    // A rule limits a rate or a concurrency, never both.
    let concurrency = match (&r.rate, &r.max_in_flight) {
        (Some(_), Some(m)) => {
            return Err(no(
                Some(m.span()),
                "max_in_flight",
                "a rule has either rate (a rate limit) or max_in_flight (a concurrency limit), not both; make two rules".into(),
            ))
        }
        (None, None) => {
            return Err(no(
                Some(span),
                "rate",
                "missing rate (e.g. \"10/s\"), or max_in_flight for a concurrency limit".into(),
            ))
        }
        (None, Some(m)) => Some(*m.get_ref()),
        (Some(_), None) => None,
    };
    let only_rates: [(&str, Option<Range<usize>>); 5] = [
        ("algorithm", r.algorithm.as_ref().map(Spanned::span)),
        ("burst", r.burst.as_ref().map(Spanned::span)),
        ("cost", r.cost.as_ref().map(Spanned::span)),
        ("max_delay", r.max_delay.as_ref().map(Spanned::span)),
        ("max_waiting", r.max_waiting.as_ref().map(Spanned::span)),
    ];
    if concurrency.is_some() {
        if let Some((key, span)) = only_rates.into_iter().find(|(_, s)| s.is_some()) {
            return Err(no(
                span,
                key,
                format!("{key} does not apply to a max_in_flight rule (a concurrency limit)"),
            ));
        }
    } else if let Some(l) = &r.lease_ttl {
        return Err(no(
            Some(l.span()),
            "lease_ttl",
            "lease_ttl applies to max_in_flight rules only".into(),
        ));
    }
    if let (None, Some(w)) = (&r.max_delay, &r.max_waiting) {
        return Err(no(
            Some(w.span()),
            "max_waiting",
            "max_waiting bounds requests waiting under max_delay; set max_delay too".into(),
        ));
    }
    let lease = match &r.lease_ttl {
        Some(l) if l.get_ref().0 < Duration::from_secs(1) => {
            return Err(no(
                Some(l.span()),
                "lease_ttl",
                "lease_ttl is at least 1s (leases are renewed every third of it)".into(),
            ))
        }
        Some(l) => l.get_ref().0,
        None => DEFAULT_LEASE_TTL,
    };

    let algorithm = r
        .algorithm
        .as_ref()
        .map_or(Algorithm::default(), |a| *a.get_ref());
    let burst = r.burst.as_ref().map(|b| *b.get_ref());
    let cost = r.cost.as_ref().map_or(NonZeroU64::MIN, |c| *c.get_ref());
    let max_delay = r.max_delay.as_ref().map(|d| d.get_ref().0);
    if let Some(d) = r.max_delay.as_ref().filter(|d| d.get_ref().0 > MAX_DELAY) {
        return Err(no(
            Some(d.span()),
            "max_delay",
            format!(
                "max_delay is at most {}: a request held longer has usually been given up on",
                humantime::format_duration(MAX_DELAY)
            ),
        ));
    }
    // A rate limit's quota; a plan may change any of its numbers.
    let rate_quota = |algorithm: Algorithm, rate: Rate, burst, cost| {
        let q = Quota::new(algorithm, rate, burst, cost)?;
        match max_delay {
            Some(d) => q.with_max_delay(d),
            None => Ok(q),
        }
    };
    // Blame the setting the quota names, where the file has it.
    let blame = |e: QuotaError| {
        let named = match e.field {
            crate::limiter::QuotaField::Burst => r.burst.as_ref().map(Spanned::span),
            crate::limiter::QuotaField::Cost => r.cost.as_ref().map(Spanned::span),
            crate::limiter::QuotaField::MaxDelay => r.max_delay.as_ref().map(Spanned::span),
            crate::limiter::QuotaField::Rate => None,
        };
        let fallback = r.rate.as_ref().map_or(span.clone(), Spanned::span);
        (named.or(Some(fallback)), at(e.field.name()), e.message)
    };
    let quota = match (concurrency, &r.rate) {
        (Some(max), _) => Quota::concurrency(max, lease),
        (None, Some(rate)) => rate_quota(algorithm, *rate.get_ref(), burst, cost).map_err(blame)?,
        (None, None) => return Err(no(Some(span), "rate", "missing rate".into())),
    };

    let mut plans = HashMap::new();
    for (plan, o) in &r.plans {
        let key = at(&format!("plans.{plan}"));
        if !plan_names.contains(plan.as_str()) {
            return Err((
                Some(o.span()),
                key,
                format!("plan {plan:?} is not given to any key in [keys.plans] or the keys file"),
            ));
        }
        let over = o.get_ref();
        let q = match concurrency {
            Some(max) => {
                let extra = [
                    ("rate", over.rate.is_some()),
                    ("burst", over.burst.is_some()),
                    ("algorithm", over.algorithm.is_some()),
                    ("cost", over.cost.is_some()),
                ];
                if let Some((k, _)) = extra.iter().find(|(_, set)| *set) {
                    return Err((
                        Some(o.span()),
                        format!("{key}.{k}"),
                        format!("{k} does not apply to a max_in_flight rule; a plan may set max_in_flight"),
                    ));
                }
                Quota::concurrency(over.max_in_flight.unwrap_or(max), lease)
            }
            None => {
                if over.max_in_flight.is_some() {
                    return Err((
                        Some(o.span()),
                        format!("{key}.max_in_flight"),
                        "max_in_flight applies to concurrency rules only".into(),
                    ));
                }
                let alg = over.algorithm.unwrap_or(algorithm);
                // The rule's burst carries over only to an algorithm that has one.
                let burst = over.burst.or(burst.filter(|_| alg.has_burst()));
                let rate = over
                    .rate
                    .or(r.rate.as_ref().map(|r| *r.get_ref()))
                    .unwrap_or(quota.rate);
                rate_quota(alg, rate, burst, over.cost.unwrap_or(cost)).map_err(|e| {
                    (
                        Some(o.span()),
                        format!("{key}.{}", e.field.name()),
                        e.message,
                    )
                })?
            }
        };
        plans.insert(plan.clone(), q);
    }

    let mode = r.mode.as_ref().map_or(Mode::Enforce, |m| *m.get_ref());
    let enforce_percent = match &r.enforce_percent {
        Some(p) if *p.get_ref() > 100 => {
            return Err(no(
                Some(p.span()),
                "enforce_percent",
                format!("enforce_percent is 0 to 100, not {}", p.get_ref()),
            ))
        }
        Some(p) if mode == Mode::Shadow => {
            return Err(no(
                Some(p.span()),
                "enforce_percent",
                "enforce_percent rolls out an enforcing rule; with mode = \"shadow\" nothing is enforced".into(),
            ))
        }
        Some(p) if matches!(r.key, KeySpec::Global) && *p.get_ref() < 100 => {
            return Err(no(
                Some(p.span()),
                "enforce_percent",
                "key = \"global\" is one identity: enforce_percent would enforce for everyone or no one; use mode = \"shadow\" or count by api_key or client_ip".into(),
            ))
        }
        Some(p) => *p.get_ref(),
        None => 100,
    };

    let matcher = match &r.matcher {
        None => Match::default(),
        Some(m) => {
            let m_span = m.span();
            let m = m.get_ref();
            let path = match (&m.path_prefix, &m.path, &m.glob) {
                (None, None, None) => PathMatch::Any,
                (Some(p), None, None) => PathMatch::Prefix(p.0.clone()),
                (None, Some(p), None) => PathMatch::Exact(p.0.clone()),
                (None, None, Some(g)) => PathMatch::Glob(g.0.clone()),
                _ => {
                    return Err(no(
                        Some(m_span),
                        "match",
                        "give one of path_prefix, path and glob".into(),
                    ))
                }
            };
            Match {
                path,
                methods: m.methods.iter().map(|m| m.0.clone()).collect(),
                hosts: m.host.0.clone(),
            }
        }
    };
    let key = match &r.key {
        KeySpec::ApiKey => KeyKind::ApiKey,
        KeySpec::ClientIp => KeyKind::ClientIp,
        KeySpec::Global => KeyKind::Global,
        KeySpec::Header(h) => KeyKind::Header(h.clone()),
    };
    Ok(Rule {
        name: name.to_string(),
        matcher,
        key,
        missing_key: r.missing_key,
        quota,
        plans,
        mode,
        enforce_percent,
        max_waiting: r
            .max_waiting
            .as_ref()
            .map_or(DEFAULT_MAX_WAITING, |w| w.get_ref().get()),
        retry_jitter_us: r
            .retry_jitter
            .as_ref()
            .map_or(0, |j| u64::try_from(j.0.as_micros()).unwrap_or(u64::MAX)),
    })
}

/// Read a keys file: `[plans]`, each API key (or `sha256:<hex>`) -> plan name. Errors
/// name the keys file, its line and column.
fn load_keys_file(path: &Path) -> Result<HashMap<[u8; 32], String>, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    let invalid = |span: Option<Range<usize>>, key: String, message: String| {
        let (line, column) = line_col(&text, span.map(|s| s.start).unwrap_or(0));
        ConfigError::Invalid {
            path: path.to_owned(),
            line,
            column,
            key,
            message,
        }
    };
    let de = toml::Deserializer::parse(&text).map_err(|e| {
        invalid(
            e.span(),
            "(document)".into(),
            e.message().trim().to_string(),
        )
    })?;
    let raw: RawKeysFile = serde_path_to_error::deserialize(de).map_err(|e| {
        let key = redact_key(
            e.path()
                .to_string()
                .replace(".$__serde_spanned_private_value", ""),
            "plans.",
        );
        let inner = e.into_inner();
        invalid(inner.span(), key, inner.message().trim().to_string())
    })?;
    let mut out = HashMap::with_capacity(raw.plans.len());
    for (listed, spanned) in raw.plans {
        let span = spanned.span();
        let plan = spanned.into_inner();
        let d = key_digest(&listed).map_err(|m| invalid(Some(span.clone()), "plans".into(), m))?;
        if out.get(&d).is_some_and(|p: &String| *p != plan.0) {
            return Err(invalid(
                Some(span),
                "plans".into(),
                "one API key is listed twice with different plans (as itself and as its sha256:)"
                    .into(),
            ));
        }
        out.insert(d, plan.0);
    }
    Ok(out)
}

/// An error's key path with the API key in it replaced: `keys.plans.<key>` (the line and
/// column still point at it). API keys never reach messages or logs.
fn redact_key(path: String, plans: &str) -> String {
    match path.strip_prefix(plans) {
        Some(rest) if !rest.is_empty() => format!("{plans}<key>"),
        _ => path,
    }
}

/// 1-based line and column of byte offset `at` in `text`.
fn line_col(text: &str, at: usize) -> (usize, usize) {
    let at = at.min(text.len());
    let before = &text.as_bytes()[..at];
    let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
    let line_start = before
        .iter()
        .rposition(|&b| b == b'\n')
        .map(|p| p + 1)
        .unwrap_or(0);
    let column = String::from_utf8_lossy(&before[line_start..])
        .chars()
        .count()
        + 1;
    (line, column)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
[server]
listen = "127.0.0.1:8080"
[upstream]
url = "http://127.0.0.1:3000"
"#;

    fn parse(extra: &str) -> Result<Config, ConfigError> {
        Config::parse(&format!("{MINIMAL}{extra}"), Path::new("limits.toml"))
    }

    fn err(extra: &str) -> (usize, usize, String, String) {
        match parse(extra) {
            Err(ConfigError::Invalid {
                line,
                column,
                key,
                message,
                ..
            }) => (line, column, key, message),
            Err(e) => panic!("unexpected error {e}"),
            Ok(_) => panic!("config was accepted"),
        }
    }

    #[test]
    fn shipped_config_is_valid() {
        let cfg = Config::load(Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/config/limits.toml"
        )))
        .expect("the shipped config/limits.toml must be valid");
        assert_eq!(cfg.store.backend, Backend::Memory);
        assert!(!cfg.rules.is_empty());
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let cfg = parse("").unwrap();
        assert_eq!(cfg.store.backend, Backend::Memory);
        assert_eq!(cfg.store.timeout, Duration::from_millis(50));
        assert_eq!(cfg.store.on_error, OnError::Deny);
        assert_eq!(cfg.keys.header.as_str(), "x-api-key");
        assert_eq!(cfg.response, ResponseStyle::Draft);
        assert_eq!(cfg.upstream.timeout, Duration::from_secs(30));
        let t = cfg.server.timeouts;
        assert_eq!(
            (t.header, t.idle, t.body),
            (
                Duration::from_secs(10),
                Duration::from_secs(60),
                Duration::from_secs(30)
            )
        );
        assert_eq!(cfg.server.max_connections, 10_000);
        assert_eq!(cfg.server.max_header_bytes, 32 * 1024);
        assert_eq!(cfg.store.max_keys, 1_000_000);
    }

    #[test]
    fn sizes_are_bytes_or_binary_units() {
        for (text, bytes) in [
            ("4096", 4096),
            ("\"4096B\"", 4096),
            ("\"32KiB\"", 32 * 1024),
            ("\"8k\"", 8 * 1024),
            ("\" 1MiB \"", 1024 * 1024),
        ] {
            let cfg = Config::parse(
                &format!("[server]\nlisten = \"127.0.0.1:1\"\nmax_header_bytes = {text}\n[upstream]\nurl = \"http://127.0.0.1:2\"\n"),
                Path::new("t.toml"),
            )
            .unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(cfg.server.max_header_bytes, bytes, "{text}");
        }
        for bad in [
            "\"32KB\"",
            "\"x\"",
            "\"2GiB\"",
            "-1",
            "\"1.5KiB\"",
            "\"2MiB\"",
        ] {
            assert!(
                Config::parse(
                    &format!("[server]\nlisten = \"127.0.0.1:1\"\nmax_header_bytes = {bad}\n[upstream]\nurl = \"http://127.0.0.1:2\"\n"),
                    Path::new("t.toml"),
                )
                .is_err(),
                "{bad} was accepted"
            );
        }
    }

    #[test]
    fn unknown_key_is_rejected_with_line_column_and_key() {
        let (line, column, key, message) =
            err("[store]\nbackend = \"memory\"\nbakend = \"redis\"\n");
        assert_eq!((line, column), (8, 1));
        assert_eq!(key, "store.bakend");
        assert!(message.contains("unknown field `bakend`"), "{message}");
    }

    #[test]
    fn bad_rate_points_at_the_value() {
        let (line, column, key, message) =
            err("[[rules]]\nname = \"a\"\nkey = \"global\"\nrate = \"ten/s\"\n");
        assert_eq!((line, column), (9, 8));
        assert_eq!(key, "rules[0].rate");
        assert!(message.contains("not a whole number"), "{message}");
    }

    #[test]
    fn bad_cidr_is_rejected() {
        let (line, _, key, message) =
            err("[client_ip]\ntrusted_proxies = [\"10.0.0.0/8\", \"10.0.0.0/33\"]\n");
        assert_eq!(line, 7);
        assert_eq!(key, "client_ip.trusted_proxies[1]");
        assert!(message.contains("invalid CIDR"), "{message}");
    }

    #[test]
    fn rates_parse() {
        assert_eq!(
            Rate::parse("10/s").unwrap(),
            Rate {
                count: 10,
                period: Duration::from_secs(1)
            }
        );
        assert_eq!(
            Rate::parse("5/10s").unwrap(),
            Rate {
                count: 5,
                period: Duration::from_secs(10)
            }
        );
        assert_eq!(
            Rate::parse("100/d").unwrap().period,
            Duration::from_secs(86_400)
        );
        assert_eq!(
            Rate::parse("3/2m").unwrap().period,
            Duration::from_secs(120)
        );
        for bad in ["0/s", "10", "10/", "10/500ms", "-1/s", "1.5/s", "10/x"] {
            assert!(Rate::parse(bad).is_err(), "{bad} was accepted");
        }
    }

    #[test]
    fn burst_below_cost_is_rejected() {
        let (_, _, key, message) = err(
            "[[rules]]\nname = \"a\"\nkey = \"global\"\nrate = \"10/s\"\nburst = 2\ncost = 3\n",
        );
        assert_eq!(key, "rules[0].cost");
        assert!(message.contains("cost 3 is more than burst 2"), "{message}");
    }

    #[test]
    fn duplicate_rule_names_are_rejected() {
        let (line, _, key, _) = err(
            "[[rules]]\nname = \"a\"\nkey = \"global\"\nrate = \"1/s\"\n[[rules]]\nname = \"a\"\nkey = \"global\"\nrate = \"1/s\"\n",
        );
        assert_eq!(key, "rules[1].name");
        assert_eq!(line, 11, "the second rule's name");
    }

    #[test]
    fn redis_backend_needs_a_url() {
        let (_, _, key, _) = err("[store]\nbackend = \"redis\"\n");
        assert_eq!(key, "store.url");
    }

    #[test]
    fn bad_key_spec_and_header_are_rejected() {
        let (_, _, key, _) = err("[[rules]]\nname = \"a\"\nkey = \"cookie\"\nrate = \"1/s\"\n");
        assert_eq!(key, "rules[0].key");
        let (_, _, key, _) =
            err("[[rules]]\nname = \"a\"\nkey = \"header:bad header\"\nrate = \"1/s\"\n");
        assert_eq!(key, "rules[0].key");
    }

    #[test]
    fn plan_overrides_must_name_a_known_plan() {
        let (_, _, key, message) = err(
            "[keys.plans]\n\"k1\" = \"pro\"\n[[rules]]\nname = \"a\"\nkey = \"api_key\"\nrate = \"1/s\"\n[rules.plans.gold]\nrate = \"5/s\"\n",
        );
        assert_eq!(key, "rules[0].plans.gold");
        assert!(message.contains("gold"), "{message}");
        let cfg = parse(
            "[keys.plans]\n\"k1\" = \"pro\"\n[[rules]]\nname = \"a\"\nkey = \"api_key\"\nrate = \"1/s\"\n[rules.plans.pro]\nrate = \"5/s\"\nburst = 9\n",
        )
        .unwrap();
        let r = &cfg.rules[0];
        assert_eq!(r.quota_for(Some("pro")).burst, 9);
        assert_eq!(r.quota_for(None).burst, 1);
    }

    #[test]
    fn keys_come_from_the_file_as_digests_and_inline() {
        let dir = tempfile::tempdir().unwrap();
        let digest = |k: &str| {
            use sha2::Digest;
            sha2::Sha256::digest(k.as_bytes())
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        };
        std::fs::write(
            dir.path().join("keys.toml"),
            format!(
                "[plans]\n\"sha256:{}\" = \"pro\"\n\"raw-key-2\" = \"team\"\n",
                digest("secret-1").to_uppercase()
            ),
        )
        .unwrap();
        let text = format!(
            "{MINIMAL}[keys]\nfile = \"keys.toml\"\nunknown = \"reject\"\n[keys.plans]\n\"inline-3\" = \"pro\"\n[[rules]]\nname = \"a\"\nkey = \"api_key\"\nrate = \"1/s\"\n[rules.plans.team]\nalgorithm = \"sliding_window\"\nrate = \"5/m\"\ncost = 2\n"
        );
        let path = dir.path().join("limits.toml");
        std::fs::write(&path, &text).unwrap();
        let cfg = Config::load(&path).unwrap();
        assert_eq!(cfg.keys.plan_of(b"secret-1"), Some("pro"));
        assert_eq!(cfg.keys.plan_of(b"raw-key-2"), Some("team"));
        assert_eq!(cfg.keys.plan_of(b"inline-3"), Some("pro"));
        assert_eq!(cfg.keys.plan_of(b"sha256:x"), None);
        assert_eq!(cfg.keys.len(), 3);
        let team = cfg.rules[0].quota_for(Some("team"));
        assert_eq!(team.algorithm, Algorithm::SlidingWindow);
        assert_eq!((team.rate.count, team.cost), (5, 2));
        // The same key twice with different plans is an error, wherever it is listed.
        std::fs::write(
            dir.path().join("keys.toml"),
            format!("[plans]\n\"sha256:{}\" = \"team\"\n", digest("inline-3")),
        )
        .unwrap();
        let e = Config::load(&path).unwrap_err().to_string();
        assert!(e.contains("keys.file") && e.contains("\"team\""), "{e}");
        // An error inside the keys file names the keys file.
        std::fs::write(dir.path().join("keys.toml"), "[plans]\n\"k\" = \"\"\n").unwrap();
        let e = Config::load(&path).unwrap_err().to_string();
        assert!(e.contains("keys.toml:2:7: plans.<key>:"), "{e}");
        // Nor is a key shown in the config's own errors.
        let e = parse("[keys.plans]\n\"sk-live-SECRET\" = 5\n")
            .unwrap_err()
            .to_string();
        assert!(
            !e.contains("SECRET") && e.contains("keys.plans.<key>"),
            "{e}"
        );
    }

    #[test]
    fn enforce_percent_picks_a_stable_growing_share_of_identities() {
        let at = |p: u8| {
            let cfg = parse(&format!(
                "[[rules]]\nname = \"a\"\nkey = \"api_key\"\nrate = \"1/s\"\nenforce_percent = {p}\n"
            ))
            .unwrap();
            (0..10_000u32)
                .filter(|i| {
                    let id = crate::identity::digest_api_key(format!("key-{i}").as_bytes());
                    cfg.rules[0].enforces(&id)
                })
                .collect::<HashSet<u32>>()
        };
        let (ten, fifty, all, none) = (at(10), at(50), at(100), at(0));
        assert!((900..=1_100).contains(&ten.len()), "{}", ten.len());
        assert!((4_800..=5_200).contains(&fifty.len()), "{}", fifty.len());
        assert_eq!((all.len(), none.len()), (10_000, 0));
        assert!(
            ten.is_subset(&fifty),
            "raising the share only adds identities"
        );
        assert_eq!(ten, at(10), "the same identities every time");
    }

    #[test]
    fn matches_take_exact_paths_globs_and_hosts() {
        let cfg = parse(
            "[[rules]]\nname = \"a\"\nkey = \"global\"\nrate = \"1/s\"\nmatch = { glob = \"/v1/*/export\", host = [\"API.example.com\", \"*.example.org\"], methods = [\"get\"] }\n[[rules]]\nname = \"b\"\nkey = \"global\"\nmax_in_flight = 3\nmatch = { path = \"/upload\", host = \"x.test\" }\n",
        )
        .unwrap();
        assert_eq!(
            cfg.rules[0].matcher.describe(),
            "GET glob /v1/*/export on api.example.com|*.example.org"
        );
        assert_eq!(cfg.rules[1].matcher.describe(), "/upload on x.test");
        assert_eq!(cfg.rules[1].quota.algorithm, Algorithm::Concurrency);
        assert_eq!(cfg.rules[1].quota.lease_us, 10_000_000);
    }

    #[test]
    fn upstream_url_keeps_base_path() {
        let cfg = Config::parse(
            "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\nurl = \"http://127.0.0.1:3000/base/\"\n",
            Path::new("x"),
        )
        .unwrap();
        assert_eq!(cfg.upstream.base_path, "/base");
        assert_eq!(
            cfg.upstream.url.authority().unwrap().as_str(),
            "127.0.0.1:3000"
        );
        assert!(Config::parse(
            "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\nurl = \"https://x\"\n",
            Path::new("x")
        )
        .is_err());
    }

    #[test]
    fn line_col_counts_from_one() {
        assert_eq!(line_col("ab\ncd", 0), (1, 1));
        assert_eq!(line_col("ab\ncd", 4), (2, 2));
    }
}
