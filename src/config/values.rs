//! Values that validate while they deserialise, so that their errors carry the line and
//! column of the offending value: durations, sizes, bounded counts, names, addresses.

use std::fmt;
use std::time::Duration;

use http::header::HeaderName;
use http::Method;
use ipnet::IpNet;
use serde::de::{self, Deserializer};
use serde::Deserialize;

use crate::identity::KeyKind;
use crate::limiter::Rate;
use crate::rules::{Glob, HostPattern};
use crate::upstream::MAX_RETRIES;

/// A humantime duration: `"50ms"`, `"2s"`, `"10m"`.
#[derive(Clone, Copy)]
pub(super) struct HumanDuration(pub(super) Duration);

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

pub(super) struct Cidr(pub(super) IpNet);

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

pub(super) struct Header(pub(super) HeaderName);

impl<'de> Deserialize<'de> for Header {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        HeaderName::from_bytes(s.trim().as_bytes())
            .map(Header)
            .map_err(|_| de::Error::custom(format!("invalid header name {s:?}")))
    }
}

/// `key = "api_key" | "client_ip" | "global" | "client_cert" | "header:<name>" |
/// "jwt:<claim.path>"`, or a list of two or more distinct ones (a combined key).
pub(super) struct KeySpec(pub(super) KeyKind);

/// What a key source may be, for errors.
const KEY_SOURCES: &str = "\"api_key\", \"client_ip\", \"global\", \"client_cert\", \"header:<name>\", \"jwt:<claim>\", \"target\", \"credential\", \"credential:<header>\" or \"caller\"";

/// A key source as a rule's `key` writes it (a pool's `balance = "hash:<key source>"`
/// takes the same words).
pub(super) fn key_kind(s: &str) -> Result<KeyKind, String> {
    Ok(match s {
        "api_key" => KeyKind::ApiKey,
        "client_ip" => KeyKind::ClientIp,
        "global" => KeyKind::Global,
        "client_cert" => KeyKind::ClientCert,
        "target" => KeyKind::Target,
        "caller" => KeyKind::Caller,
        "credential" => KeyKind::Credential(http::header::AUTHORIZATION),
        other if other.starts_with("credential:") => {
            let name = other["credential:".len()..].trim();
            HeaderName::from_bytes(name.as_bytes())
                .map(KeyKind::Credential)
                .map_err(|_| format!("invalid header name in key {s:?}"))?
        }
        other => match (other.strip_prefix("header:"), other.strip_prefix("jwt:")) {
            (Some(name), _) => HeaderName::from_bytes(name.trim().as_bytes())
                .map(KeyKind::Header)
                .map_err(|_| format!("invalid header name in key {s:?}"))?,
            (_, Some(path)) => KeyKind::Jwt(
                crate::identity::ClaimPath::parse(path)
                    .map_err(|e| format!("in key {s:?}: {e}"))?,
            ),
            _ => return Err(format!("invalid key {s:?}: expected {KEY_SOURCES}")),
        },
    })
}

/// `key = [...]`: two or more distinct key sources, none `global` (it adds nothing).
fn combined(parts: Vec<String>) -> Result<KeyKind, String> {
    if parts.len() < 2 {
        return Err(format!(
            "a combined key lists two or more key sources (got {}); for one, write it as a string",
            parts.len()
        ));
    }
    let mut kinds: Vec<KeyKind> = Vec::with_capacity(parts.len());
    for p in &parts {
        let kind = key_kind(p.trim())?;
        if kind == KeyKind::Global {
            return Err("\"global\" in a combined key adds nothing: leave it out".into());
        }
        if kinds.contains(&kind) {
            return Err(format!("{kind} is twice in the combined key"));
        }
        kinds.push(kind);
    }
    Ok(KeyKind::Combined(kinds))
}

impl<'de> Deserialize<'de> for KeySpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            One(String),
            Many(Vec<String>),
        }
        let written = Written::deserialize(d).map_err(|_| {
            de::Error::custom(format!(
                "invalid key: expected {KEY_SOURCES}, or a list of two or more of them"
            ))
        })?;
        match written {
            Written::One(s) => key_kind(&s),
            Written::Many(parts) => combined(parts),
        }
        .map(KeySpec)
        .map_err(de::Error::custom)
    }
}

/// Whether `s` is 1 to 64 characters of A-Z a-z 0-9 _ - . (a name that metrics, logs and
/// Redis keys carry as it is).
fn safe_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= crate::upstream::MAX_NAME
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b))
}

/// A pool's `name`: the metrics' `pool` label, and what a route's `upstream` names.
pub(super) struct PoolName(pub(super) String);

impl<'de> Deserialize<'de> for PoolName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if !safe_name(&s) {
            return Err(de::Error::custom(format!(
                "invalid pool name {s:?}: 1 to 64 characters of A-Z a-z 0-9 _ - ."
            )));
        }
        Ok(PoolName(s))
    }
}

/// A route's `name`: the logs' and metrics' `route`, and what a rule's `route` names.
pub(super) struct RouteName(pub(super) String);

impl<'de> Deserialize<'de> for RouteName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if !safe_name(&s) {
            return Err(de::Error::custom(format!(
                "invalid route name {s:?}: 1 to 64 characters of A-Z a-z 0-9 _ - ."
            )));
        }
        Ok(RouteName(s))
    }
}

/// `balance = "round_robin" | "least_requests" | "random_two" | "hash:<key source>"`.
pub(super) struct BalanceSpec(pub(super) crate::upstream::Balance);

/// What `balance` takes, as serde's "unknown variant" lists it (so that a misspelling
/// gets a "did you mean").
const BALANCES: &[&str] = &[
    "round_robin",
    "least_requests",
    "random_two",
    "hash:<key source>",
];

impl<'de> Deserialize<'de> for BalanceSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use crate::upstream::Balance;
        let s = String::deserialize(d)?;
        let balance = match s.as_str() {
            "round_robin" => Balance::RoundRobin,
            "least_requests" => Balance::LeastRequests,
            "random_two" => Balance::RandomTwo,
            other => {
                let Some(source) = other.strip_prefix("hash:") else {
                    return Err(de::Error::unknown_variant(other, BALANCES));
                };
                let hash_by = "hash by api_key, client_ip, client_cert or header:<name>";
                let kind = key_kind(source.trim()).map_err(|_| {
                    de::Error::custom(format!(
                        "invalid key source {source:?} in {s:?}: {hash_by}, as a rule's key names them"
                    ))
                })?;
                if let KeyKind::Jwt(_) = kind {
                    return Err(de::Error::custom(format!(
                        "{s:?}: a pool does not hash by a token claim: {hash_by}"
                    )));
                }
                if kind == KeyKind::Global {
                    return Err(de::Error::custom(format!(
                        "{s:?} would send every request to one server: {hash_by}"
                    )));
                }
                Balance::Hash(crate::identity::Key {
                    kind,
                    missing: crate::identity::MissingKey::default(),
                })
            }
        };
        Ok(BalanceSpec(balance))
    }
}

/// `protocol = "http1" | "h2" | "h2c" | "auto"`: what a pool's servers are spoken to in.
pub(super) struct ProtocolSpec(pub(super) crate::upstream::Protocol);

impl<'de> Deserialize<'de> for ProtocolSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use crate::upstream::Protocol;
        let s = String::deserialize(d)?;
        Protocol::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .map(ProtocolSpec)
            .ok_or_else(|| de::Error::unknown_variant(&s, &Protocol::NAMES))
    }
}

/// A server's `weight`: 1 to 1000.
pub(super) struct Weight(pub(super) u32);

impl<'de> Deserialize<'de> for Weight {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = i64::deserialize(d)?;
        match u32::try_from(n) {
            Ok(n @ 1..=1000) => Ok(Weight(n)),
            _ => Err(de::Error::custom(format!(
                "weight = {n}: 1 to 1000 (default 1)"
            ))),
        }
    }
}

/// A plan's `priority`: a whole number from 0 to `u32::MAX` (a string, a float or a
/// negative number is refused in those words, not serde's `expected u32`).
pub(super) struct Priority(pub(super) u32);

impl Priority {
    const EXPECTED: &'static str = "a whole number from 0 to 4294967295 (default 0)";
}

impl<'de> Deserialize<'de> for Priority {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = Priority;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(Priority::EXPECTED)
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<Priority, E> {
                u32::try_from(n)
                    .map(Priority)
                    .map_err(|_| E::custom(format!("priority = {n}: {}", Priority::EXPECTED)))
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<Priority, E> {
                u32::try_from(n)
                    .map(Priority)
                    .map_err(|_| E::custom(format!("priority = {n}: {}", Priority::EXPECTED)))
            }
        }
        d.deserialize_any(V)
    }
}

/// `max_ejected_percent`: 0 to 100.
pub(super) struct Percent(pub(super) u8);

impl<'de> Deserialize<'de> for Percent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = i64::deserialize(d)?;
        match u8::try_from(n) {
            Ok(n @ 0..=100) => Ok(Percent(n)),
            _ => Err(de::Error::custom(format!(
                "max_ejected_percent = {n}: 0 to 100 (default {})",
                crate::upstream::MAX_EJECTED_PERCENT
            ))),
        }
    }
}

/// `retries`: 0 to [`MAX_RETRIES`].
pub(super) struct Retries(pub(super) u32);

impl<'de> Deserialize<'de> for Retries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = i64::deserialize(d)?;
        match u32::try_from(n) {
            Ok(n) if n <= MAX_RETRIES => Ok(Retries(n)),
            _ => Err(de::Error::custom(format!(
                "retries = {n}: 0 to {MAX_RETRIES} (default {})",
                crate::upstream::RETRIES
            ))),
        }
    }
}

/// One of `fail_on_status`: 502, 503 or 504.
pub(super) struct FailStatus(pub(super) http::StatusCode);

impl<'de> Deserialize<'de> for FailStatus {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = i64::deserialize(d)?;
        match n {
            502..=504 => http::StatusCode::from_u16(n as u16)
                .map(FailStatus)
                .map_err(de::Error::custom),
            _ => Err(de::Error::custom(format!(
                "fail_on_status takes 502, 503 and 504 only (a server that cannot serve), not {n}: other statuses are the backend's answers"
            ))),
        }
    }
}

/// `health.expect`: a class (`"2xx"`, 200 to 299) or one status (`"204"`).
pub(super) struct Expect(pub(super) std::ops::RangeInclusive<u16>);

impl<'de> Deserialize<'de> for Expect {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let t = s.trim();
        let bad = || {
            de::Error::custom(format!(
                "invalid expect {s:?}: a class of statuses (\"2xx\", \"3xx\", \"4xx\", \"5xx\") or one status (\"204\")"
            ))
        };
        let range = match t.as_bytes() {
            [c @ b'1'..=b'5', b'x' | b'X', b'x' | b'X'] => {
                let base = u16::from(c - b'0') * 100;
                base..=base + 99
            }
            _ => match t.parse::<u16>() {
                Ok(n @ 100..=599) if t.len() == 3 => n..=n,
                _ => return Err(bad()),
            },
        };
        Ok(Expect(range))
    }
}

/// `health.path`: what is asked of each server, starting with `/` (a query may follow).
pub(super) struct HealthPath(pub(super) String);

impl<'de> Deserialize<'de> for HealthPath {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let ok = s.starts_with('/') && s.parse::<http::uri::PathAndQuery>().is_ok();
        if !ok || s.contains('#') {
            return Err(de::Error::custom(format!(
                "invalid health path {s:?}: a path starting with \"/\" (a query may follow)"
            )));
        }
        Ok(HealthPath(s))
    }
}

/// A route's `strip_prefix` or `add_prefix`: a path starting with `/`, without query.
pub(super) struct RoutePrefix(pub(super) String);

impl<'de> Deserialize<'de> for RoutePrefix {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let ok = s.starts_with('/')
            && !s.contains(['?', '#'])
            && s.parse::<http::uri::PathAndQuery>().is_ok();
        if !ok {
            return Err(de::Error::custom(format!(
                "invalid prefix {s:?}: a path starting with \"/\", without ? or #"
            )));
        }
        Ok(RoutePrefix(s))
    }
}

/// Rule names appear in Redis keys, headers and metrics: keep them to a safe alphabet.
pub(super) struct RuleName(pub(super) String);

impl<'de> Deserialize<'de> for RuleName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if !safe_name(&s) {
            return Err(de::Error::custom(format!(
                "invalid rule name {s:?}: 1 to 64 characters of A-Z a-z 0-9 _ - ."
            )));
        }
        Ok(RuleName(s))
    }
}

pub(super) struct PlanName(pub(super) String);

impl<'de> Deserialize<'de> for PlanName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s.is_empty() || s.len() > 64 {
            return Err(de::Error::custom("a plan name is 1 to 64 characters"));
        }
        Ok(PlanName(s))
    }
}

/// A listed API key's value in `[keys.plans]` (and a keys file's `[plans]`): its plan,
/// `"pro"`, or its plan and the label operators know it by, `{ plan = "pro", label =
/// "Acme Corp" }`. The label is checked where the listing's span is known (see
/// [`crate::identity::directory::label`] for what a label may hold).
pub(super) struct KeyListing {
    pub(super) plan: String,
    pub(super) label: Option<String>,
}

impl<'de> Deserialize<'de> for KeyListing {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Table {
            plan: PlanName,
            label: Option<String>,
        }
        struct Listing;
        impl<'de> de::Visitor<'de> for Listing {
            type Value = KeyListing;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a plan name (\"pro\") or { plan = \"pro\", label = \"Acme Corp\" }")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<KeyListing, E> {
                let plan = PlanName::deserialize(de::value::StrDeserializer::<E>::new(v))?;
                Ok(KeyListing {
                    plan: plan.0,
                    label: None,
                })
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<KeyListing, A::Error> {
                let t = Table::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(KeyListing {
                    plan: t.plan.0,
                    label: t.label,
                })
            }
        }
        d.deserialize_any(Listing)
    }
}

/// The prefix of every Redis key; `{`, `}` and spaces would break the hash tag.
pub(super) struct Prefix(pub(super) String);

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

pub(super) struct PathPrefix(pub(super) String);

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
pub(super) struct GlobSpec(pub(super) Glob);

impl<'de> Deserialize<'de> for GlobSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Glob::new(&s).map(GlobSpec).map_err(de::Error::custom)
    }
}

/// `host = "api.example.com"`, or a list; `*.example.com` for every subdomain.
#[derive(Default)]
pub(super) struct Hosts(pub(super) Vec<HostPattern>);

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

pub(super) struct MethodName(pub(super) Method);

impl<'de> Deserialize<'de> for MethodName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let upper = s.to_ascii_uppercase();
        Method::from_bytes(upper.as_bytes())
            .map(MethodName)
            .map_err(|_| de::Error::custom(format!("invalid method {s:?}")))
    }
}

pub(super) struct UpstreamUrl {
    pub(super) uri: http::Uri,
    pub(super) base_path: String,
}

impl<'de> Deserialize<'de> for UpstreamUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let uri: http::Uri = s
            .parse()
            .map_err(|e| de::Error::custom(format!("invalid upstream url {s:?}: {e}")))?;
        let scheme = match uri.scheme_str() {
            Some("http") => "http",
            Some("https") => "https",
            _ => {
                return Err(de::Error::custom(format!(
                    "invalid upstream url {s:?}: only http:// and https:// upstreams are supported"
                )))
            }
        };
        let Some(authority) = uri.authority().cloned() else {
            return Err(de::Error::custom(format!(
                "invalid upstream url {s:?}: no host"
            )));
        };
        // Never echoed: user info is a password. It would also show in metrics labels, the
        // status page and the logs, and nothing sends it upstream.
        if authority.as_str().contains('@') {
            return Err(de::Error::custom(
                "invalid upstream url: user info (user:password@) is not supported, and is not sent to the backend: give the backend's address only",
            ));
        }
        if uri.query().is_some() {
            return Err(de::Error::custom(format!(
                "invalid upstream url {s:?}: no query allowed"
            )));
        }
        let base_path = uri.path().trim_end_matches('/').to_string();
        let uri = http::Uri::builder()
            .scheme(scheme)
            .authority(authority)
            .path_and_query("/")
            .build()
            .map_err(|e| de::Error::custom(format!("invalid upstream url {s:?}: {e}")))?;
        Ok(UpstreamUrl { uri, base_path })
    }
}

pub(super) struct RedisUrl(pub(super) String);

impl<'de> Deserialize<'de> for RedisUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        redis::Client::open(s.as_str())
            .map_err(|e| de::Error::custom(format!("invalid redis url: {e}")))?;
        Ok(RedisUrl(s))
    }
}

/// 1 to 10,000,000 open client connections.
pub(super) struct MaxConnections(pub(super) usize);

impl<'de> Deserialize<'de> for MaxConnections {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = u64::deserialize(d)?;
        if !(1..=10_000_000).contains(&n) {
            return Err(de::Error::custom(format!(
                "max_connections = {n}: 1 to 10000000 (default {})",
                super::MAX_CONNECTIONS
            )));
        }
        Ok(MaxConnections(n as usize))
    }
}

/// A listen backlog: 1 to 65,535 connections (the kernel may cut it: `net.core.somaxconn`).
pub(super) struct Backlog(pub(super) u32);

impl<'de> Deserialize<'de> for Backlog {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = u64::deserialize(d)?;
        match u32::try_from(n) {
            Ok(n @ 1..=65_535) => Ok(Backlog(n)),
            _ => Err(de::Error::custom(format!(
                "backlog = {n}: 1 to 65535 (default {})",
                super::BACKLOG
            ))),
        }
    }
}

/// A request head's size bound: 1 KiB to 1 MiB, as bytes or `"32KiB"`.
pub(super) struct HeaderBytes(pub(super) usize);

impl<'de> Deserialize<'de> for HeaderBytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = ByteSize::deserialize(d)?.0;
        if !(1024..=1024 * 1024).contains(&n) {
            return Err(de::Error::custom(format!(
                "max_header_bytes = {n} bytes: 1KiB to 1MiB (default {}KiB)",
                super::MAX_HEADER_BYTES / 1024
            )));
        }
        Ok(HeaderBytes(n as usize))
    }
}

/// How many fields an HTTP/1 request head may have: 100 to 65,536.
pub(super) struct HeaderFields(pub(super) usize);

impl<'de> Deserialize<'de> for HeaderFields {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = u64::deserialize(d)?;
        if !(100..=65_536).contains(&n) {
            return Err(de::Error::custom(format!(
                "max_header_fields = {n}: 100 to 65536 (default: one per 32 bytes of max_header_bytes, 1024 at 32KiB)"
            )));
        }
        Ok(HeaderFields(n as usize))
    }
}

/// A size: a whole number of bytes, or a string with a binary unit: `"512B"`, `"32KiB"`,
/// `"1MiB"` (`k` and `m`, as nginx writes them, are the same units).
pub(super) struct ByteSize(pub(super) u64);

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

/// A rate of bytes: a size per period, `"1MiB/s"`, `"512KiB/m"`, `"10MiB/10s"` (the size
/// as [`ByteSize`] reads it, the period as a rate's, not a calendar's): a [`Rate`] whose
/// count is bytes.
pub(super) struct ByteRate(pub(super) Rate);

impl ByteRate {
    fn parse(s: &str) -> Result<Rate, String> {
        let forms = "expected a size per period, e.g. \"1MiB/s\", \"512KiB/m\" or \"10MiB/10s\"";
        let (size, per) = s
            .split_once('/')
            .ok_or_else(|| format!("invalid byte rate {s:?}: {forms}"))?;
        let bytes = ByteSize::parse(size).map_err(|e| format!("invalid byte rate {s:?}: {e}"))?;
        if bytes == 0 {
            return Err(format!(
                "invalid byte rate {s:?}: at least 1 byte per period"
            ));
        }
        // The period as a rate's (s, m, h, d or a whole number of seconds).
        let period = Rate::parse(&format!("1/{}", per.trim()))
            .ok()
            .filter(|r| r.calendar.is_none())
            .ok_or_else(|| {
                format!(
                    "invalid byte rate {s:?}: the period {per:?} is not one of s, m, h, d or a whole number of seconds (\"10s\"); {forms}"
                )
            })?;
        Ok(Rate::every(bytes, period.period))
    }
}

impl<'de> Deserialize<'de> for ByteRate {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        ByteRate::parse(&s).map(ByteRate).map_err(de::Error::custom)
    }
}

/// 1 to 1024 worker threads.
pub(super) struct Workers(pub(super) usize);

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

/// An admin token: long enough not to be guessed.
pub(super) struct AdminToken(pub(super) String);

impl AdminToken {
    /// At least 16 printable ASCII characters, no spaces: the file's rule and the
    /// environment's.
    pub(super) fn new(s: String) -> Result<AdminToken, &'static str> {
        if s.len() < 16 || s.bytes().any(|b| !b.is_ascii_graphic()) {
            return Err("an admin token is at least 16 printable characters without spaces");
        }
        Ok(AdminToken(s))
    }
}

impl<'de> Deserialize<'de> for AdminToken {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        AdminToken::new(String::deserialize(d)?).map_err(de::Error::custom)
    }
}

/// A deployment's tag secret (`[server] tag_secret`, `RATEWALL_TAG_SECRET`): as long as
/// an admin token, never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct TagSecret(pub(crate) String);

impl TagSecret {
    pub(super) fn new(s: String) -> Result<TagSecret, &'static str> {
        if s.len() < 16 || s.bytes().any(|b| !b.is_ascii_graphic()) {
            return Err("a tag secret is at least 16 printable characters without spaces");
        }
        Ok(TagSecret(s))
    }

    pub fn as_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

impl fmt::Debug for TagSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TagSecret(<set>)")
    }
}

impl<'de> Deserialize<'de> for TagSecret {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        TagSecret::new(String::deserialize(d)?).map_err(de::Error::custom)
    }
}

/// 1 to 1,000,000,000 keys in the memory store.
pub(super) struct MaxKeys(pub(super) usize);

impl<'de> Deserialize<'de> for MaxKeys {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = u64::deserialize(d)?;
        if !(1..=1_000_000_000).contains(&n) {
            return Err(de::Error::custom(format!(
                "max_keys = {n}: 1 to 1000000000 (default {})",
                crate::limiter::store::Settings::default().max_keys
            )));
        }
        Ok(MaxKeys(n as usize))
    }
}

impl<'de> Deserialize<'de> for Rate {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Rate::parse(&s).map_err(de::Error::custom)
    }
}

/// `failures = { rate = "10/m", burst = 20 }` (`[jwt]`, `[keys]`): how many failed checks
/// a client address may make before its checks are answered 429 unmade.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawFailures {
    rate: toml::Spanned<Rate>,
    burst: Option<toml::Spanned<u64>>,
}

impl RawFailures {
    /// The allowance, or why not (`table`: `jwt` or `keys`). A rate of at most 1000/s, not
    /// a calendar's; a burst of 1 to 1,000,000 (default: the rate's count).
    pub(super) fn allowance(
        &self,
        table: &str,
    ) -> Result<crate::identity::failures::Allowance, super::Invalid> {
        let no = |span, m: String| super::Invalid::new(Some(span), format!("{table}.failures"), m);
        let rate = self.rate.get_ref();
        let every_ms = rate.period.as_millis() / u128::from(rate.count.max(1));
        if rate.calendar.is_some() || rate.count == 0 || every_ms == 0 {
            return Err(no(
                self.rate.span(),
                format!(
                    "failures' rate is a steady rate of 1 or more, at most 1000/s (e.g. \"10/m\"), not {}/{:?}",
                    rate.count, rate.period
                ),
            ));
        }
        let burst = match &self.burst {
            Some(b) if !(1..=1_000_000).contains(b.get_ref()) => {
                return Err(no(
                    b.span(),
                    format!(
                        "failures' burst is 1 to 1000000 (the failures an address may make at once), not {}",
                        b.get_ref()
                    ),
                ));
            }
            Some(b) => *b.get_ref(),
            None => rate.count,
        };
        Ok(crate::identity::failures::Allowance {
            burst,
            every_ms: u64::try_from(every_ms).unwrap_or(u64::MAX),
        })
    }
}
