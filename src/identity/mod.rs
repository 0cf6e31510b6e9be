//! Who a request is: the one place a rule's identity for a request is derived. Pure: no
//! I/O, so every case is tested without a network.
//!
//! A rule counts requests by a [`Key`]: an API key, a header's value, the client IP, or
//! everyone at once. [`Requester`] holds what a request says about who sent it (headers
//! and TCP peer), and [`Requester::identify`] turns it into the [`Identity`] a rule counts
//! it under, or a [`Refusal`]. The request path, `ratewall check` and the admin API all
//! call it, so they cannot drift; a new source of identity (a client certificate, a
//! verified token's claim) is one more arm of [`KeyKind`] and of `identify`.
//!
//! Identities are kept as [`IdentityDigest`]s: 128 bits of a domain-separated SHA-256,
//! so raw API keys never reach Redis key names, logs or metrics.

mod claim_path;
mod client_ip;
mod digest_cache;
pub mod directory;
pub mod failures;
pub mod jwt;
mod keys;
pub mod tag;
mod token_cache;

#[cfg(test)]
mod failure_tests;

use std::borrow::Cow;
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::OnceLock;

use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::StatusCode;
use ring::digest::{Context, SHA256};
use serde::Deserialize;

pub use client_ip::{client_ip, is_trusted, ClientIp, ForwardingHeader};
pub use directory::Directory;
pub use jwt::{ClaimPath, Failure, Known, TokenError, Verified, Verifier};
pub use keys::{
    api_key, sha256, KeyError, Keys, Listing, UnknownKeys,
    DEFAULT_FAILURES as DEFAULT_KEY_FAILURES, DEFAULT_KEY_HEADER, DEFAULT_RESYNC, MAX_KEY_LEN,
};

/// What a rule counts requests by (`key`), and what it does when the request does not
/// carry it (`missing_key`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key {
    pub kind: KeyKind,
    pub missing: MissingKey,
}

/// Who a rule counts requests for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyKind {
    /// The API key, from `[keys] header`.
    ApiKey,
    ClientIp,
    /// Everyone: one limit for all requests.
    Global,
    /// The value of this header.
    Header(HeaderName),
    /// The client certificate the TLS handshake verified (`[server.tls] client_ca`), by
    /// its SHA-256 fingerprint: an identity no header can forge.
    ClientCert,
    /// A claim of the request's bearer token, verified by `[jwt]` (`jwt:<claim.path>`).
    Jwt(ClaimPath),
    /// The combination of two or more of the others (`key = ["jwt:org_id",
    /// "header:x-project"]`): each combination is an identity of its own.
    Combined(Vec<KeyKind>),
    /// The host a call goes to (the egress gateway's target, issue 45): lower-cased,
    /// without its port.
    Target,
    /// A credential the call carries (`credential`: `Authorization`;
    /// `credential:<header>`): each value its own limit, known by its digest alone,
    /// never shown.
    Credential(HeaderName),
    /// Who calls: its client certificate where the connection presented one, else its
    /// address.
    Caller,
}

impl KeyKind {
    /// Whether it is `part`, or a combination with `part` among its parts.
    pub fn uses(&self, part: &KeyKind) -> bool {
        match self {
            KeyKind::Combined(parts) => parts.contains(part),
            kind => kind == part,
        }
    }

    /// Whether it counts by a token claim (alone, or as a part).
    pub fn uses_jwt(&self) -> bool {
        match self {
            KeyKind::Jwt(_) => true,
            KeyKind::Combined(parts) => parts.iter().any(KeyKind::uses_jwt),
            _ => false,
        }
    }
}

/// The SHA-256 fingerprint (of the DER) of the client certificate a request's connection
/// presented and the TLS handshake verified. Carried in the request's context
/// (`proxy::Context`, built from the handshake at the connection) to
/// [`Requester::with_client_cert`]: a client cannot put it there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientCert(pub [u8; 32]);

/// What a rule's `match` may ask a request to carry, or not: `api_key = "present"`,
/// `"header:x-user" = "absent"`. See [`Requester::carries`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Carried {
    /// The API key, from `[keys] header`.
    ApiKey,
    /// This header.
    Header(HeaderName),
}

impl fmt::Display for Carried {
    /// As the file writes it: `api_key`, `"header:<name>"`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Carried::ApiKey => f.write_str("api_key"),
            Carried::Header(h) => write!(f, "\"header:{h}\""),
        }
    }
}

/// A request without the key (or header) its rule counts by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MissingKey {
    /// 401.
    #[default]
    Reject,
    /// Counted by its client IP instead.
    ClientIp,
}

impl fmt::Display for KeyKind {
    /// As the file writes it: `api_key`, `client_ip`, `global`, `header:<name>`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyKind::ApiKey => f.write_str("api_key"),
            KeyKind::ClientIp => f.write_str("client_ip"),
            KeyKind::Global => f.write_str("global"),
            KeyKind::Header(h) => write!(f, "header:{h}"),
            KeyKind::ClientCert => f.write_str("client_cert"),
            KeyKind::Jwt(path) => write!(f, "jwt:{path}"),
            KeyKind::Target => f.write_str("target"),
            KeyKind::Credential(h) if h == http::header::AUTHORIZATION => f.write_str("credential"),
            KeyKind::Credential(h) => write!(f, "credential:{h}"),
            KeyKind::Caller => f.write_str("caller"),
            KeyKind::Combined(parts) => {
                let parts: Vec<String> = parts.iter().map(|p| format!("\"{p}\"")).collect();
                write!(f, "[{}]", parts.join(", "))
            }
        }
    }
}

/// Who a request is under one rule.
#[derive(Debug, Clone, Copy)]
pub struct Identity<'a> {
    pub digest: IdentityDigest,
    pub source: Source<'a>,
}

/// What an identity was derived from.
#[derive(Debug, Clone, Copy)]
pub enum Source<'a> {
    Everyone,
    ClientIp(IpAddr),
    ApiKey(&'a [u8]),
    Header(&'a HeaderName, &'a [u8]),
    /// A verified client certificate, by its fingerprint.
    ClientCert(&'a [u8; 32]),
    /// A claim of a verified bearer token.
    Jwt(&'a ClaimPath),
    /// A combination of these parts (each named, none shown).
    Combined(&'a [KeyKind]),
    /// The host a call goes to.
    Target(&'a str),
    /// A credential, by the header it is in (its value never shown).
    Credential(&'a HeaderName),
}

impl Identity<'_> {
    /// What an operator may see of it: enough to recognise it, never a whole API key.
    /// Keys show their last 4 characters when they are long enough to keep the rest
    /// secret; addresses show their network (/24, /48).
    pub fn hint(&self) -> String {
        let (label, value) = match self.source {
            Source::Everyone => return "everyone".to_string(),
            Source::ClientIp(IpAddr::V4(v4)) => {
                let o = v4.octets();
                return format!("ip {}.{}.{}.x", o[0], o[1], o[2]);
            }
            Source::ClientIp(IpAddr::V6(v6)) => {
                let s = v6.segments();
                return format!("ip {:x}:{:x}:{:x}::/48", s[0], s[1], s[2]);
            }
            Source::ApiKey(v) => ("key", v),
            Source::Header(_, v) => ("header", v),
            // Not secret, but never shown raw: the identity's digest names it.
            Source::ClientCert(_) => return format!("client cert {}", self.digest.tag().as_str()),
            Source::Target(host) => return format!("target {host}"),
            Source::Credential(h) => {
                return format!("credential {h} {}", self.digest.tag().as_str())
            }
            Source::Jwt(path) => return format!("jwt {path} {}", self.digest.tag().as_str()),
            Source::Combined(parts) => {
                let parts: Vec<String> = parts.iter().map(ToString::to_string).collect();
                return format!("{} {}", parts.join(" + "), self.digest.tag().as_str());
            }
        };
        if value.len() >= 12 {
            let tail = String::from_utf8_lossy(&value[value.len() - 4..]);
            format!("{label} …{tail}")
        } else {
            format!("{label} ({} bytes)", value.len())
        }
    }
}

impl fmt::Display for Source<'_> {
    /// For `ratewall check`: what the request is counted per. Never a key's value.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Everyone => f.write_str("everyone, one shared limit"),
            Source::ClientIp(ip) => write!(f, "client IP {ip}"),
            Source::ApiKey(_) => f.write_str("API key"),
            Source::Header(h, _) => write!(f, "{h}"),
            Source::ClientCert(_) => f.write_str("client certificate"),
            Source::Jwt(path) => write!(f, "the token's {path} claim"),
            Source::Target(_) => f.write_str("the target host"),
            Source::Credential(h) => write!(f, "the credential in {h}"),
            Source::Combined(parts) => {
                let parts: Vec<String> = parts.iter().map(ToString::to_string).collect();
                write!(f, "the combination of {}", parts.join(" + "))
            }
        }
    }
}

/// Why a request is answered before any limit is consulted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No API key, and the rule needs one (`missing_key = "reject"`).
    MissingKey,
    /// The header the rule counts by is missing (`missing_key = "reject"`).
    MissingHeader,
    /// An unlisted API key with `unknown = "reject"`.
    UnknownKey,
    /// The key header is malformed (sent twice, too long).
    Malformed(KeyError),
    /// No verified client certificate, and the rule counts by one
    /// (`missing_key = "reject"`).
    MissingCert,
    /// No bearer token, and the rule counts by one of its claims (`missing_key =
    /// "reject"`).
    MissingToken,
    /// A verified token without the claim the rule counts by (`missing_key = "reject"`).
    MissingClaim,
    /// A token that did not verify: 401 with `WWW-Authenticate: Bearer
    /// error="invalid_token"`, never forwarded.
    InvalidToken(TokenError),
    /// No key set to verify tokens with yet (a `jwks_url` never fetched): 503, never
    /// forwarded unverified.
    KeysUnavailable,
    /// The client's address failed too many tokens (`[jwt] failures`) or sent too many
    /// unknown keys (`[keys] failures`): 429, its credential not even checked, for this
    /// many milliseconds.
    Throttled(u64),
}

impl Refusal {
    pub fn status(self) -> StatusCode {
        match self {
            Refusal::Malformed(_) => StatusCode::BAD_REQUEST,
            Refusal::KeysUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            Refusal::Throttled(_) => StatusCode::TOO_MANY_REQUESTS,
            _ => StatusCode::UNAUTHORIZED,
        }
    }

    /// The access log's `decision`.
    pub fn decision(self) -> &'static str {
        match self {
            Refusal::Malformed(_) => "bad_key",
            Refusal::InvalidToken(_) | Refusal::MissingClaim => "invalid_token",
            Refusal::KeysUnavailable => "keys_unavailable",
            Refusal::Throttled(_) => "throttled",
            _ => "unauthorized",
        }
    }

    /// Whether the refused request is charged to the rules that need no credential (see
    /// `decide/first.rs`): every refusal of the client's doing, not the gateway's own
    /// 503 for keys it has not fetched yet.
    pub fn is_charged(self) -> bool {
        self != Refusal::KeysUnavailable
    }

    /// Whether the request lacks what the rule counts by (and `missing_key` decides).
    pub fn is_missing(self) -> bool {
        matches!(
            self,
            Refusal::MissingKey
                | Refusal::MissingHeader
                | Refusal::MissingCert
                | Refusal::MissingToken
                | Refusal::MissingClaim
        )
    }

    /// The `WWW-Authenticate` challenge of a bearer token's refusal (RFC 6750 §3): bare
    /// where none was sent, with the reason where one did not verify.
    pub fn challenge(self) -> Option<HeaderValue> {
        let reason = match self {
            Refusal::MissingToken => return Some(HeaderValue::from_static("Bearer")),
            Refusal::InvalidToken(e) => e.reason(),
            Refusal::MissingClaim => "the token lacks the claim this rule counts by",
            _ => return None,
        };
        let escaped = reason.replace('\\', "\\\\").replace('"', "\\\"");
        HeaderValue::from_str(&format!(
            "Bearer error=\"invalid_token\", error_description=\"{escaped}\""
        ))
        .ok()
    }
}

impl fmt::Display for Refusal {
    /// The problem+json `detail`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::MissingKey => f.write_str("an API key is required"),
            Refusal::MissingHeader => f.write_str("a header this rule counts by is missing"),
            Refusal::UnknownKey => f.write_str("the API key is not known"),
            Refusal::Malformed(e) => write!(f, "{e}"),
            Refusal::MissingCert => f.write_str("a client certificate is required"),
            Refusal::MissingToken => f.write_str("a bearer token is required"),
            Refusal::MissingClaim => f.write_str("the token lacks the claim this rule counts by"),
            Refusal::InvalidToken(e) => write!(f, "invalid token: {e}"),
            Refusal::KeysUnavailable => {
                f.write_str("the keys to verify tokens with are not available yet")
            }
            Refusal::Throttled(_) => f.write_str(
                "too many requests from this address failed their credentials: none is checked until Retry-After",
            ),
        }
    }
}

/// What a request says about who sent it: its headers and its TCP peer, read with the
/// configured keys and trusted proxies. Each part (the client IP, the API key and its
/// digest and plan) is worked out once, however many rules ask.
pub struct Requester<'a> {
    headers: &'a HeaderMap,
    peer: IpAddr,
    keys: &'a Keys,
    trust: &'a ClientIp,
    client_ip: OnceLock<IpAddr>,
    /// The API key as sent, and its digest.
    api_key: OnceLock<SentKey<'a>>,
    /// The verified client certificate's fingerprint, over TLS.
    client_cert: Option<&'a [u8; 32]>,
    /// `[jwt]`'s verifier, where the config has one.
    jwt: Option<&'a Verifier>,
    /// The bearer token, verified once however many rules ask.
    token: OnceLock<SentToken>,
    /// The bearer token as sent, and its SHA-256 (what the caches know it by).
    sent_token: OnceLock<SentBearer<'a>>,
    /// Whether a failed credential is charged to the client's address, and refused
    /// unchecked past its allowance (`failures`): the request path's, not `check`'s or
    /// the admin API's.
    count_failures: bool,
    /// Why the API key is refused, if it is (unknown, or its address throttled): found
    /// once, so a request is charged one failure however many rules ask.
    key_refused: OnceLock<Option<Refusal>>,
    /// How the API key is listed ([`Keys::listing`]): looked up once, so that every rule
    /// of the request sees one answer however the directory changes meanwhile.
    listed: OnceLock<Option<Listing<'a>>>,
}

/// The most of a claim's value [`Requester::claims_of`] shows, in characters.
pub const MAX_CLAIM_SHOWN: usize = 64;

/// A bearer token as sent and its SHA-256 (`None`: none was sent), or why it cannot be
/// read.
type SentBearer<'a> = Result<Option<(&'a str, [u8; 32])>, TokenError>;

/// A bearer token as verified (`None`: none was sent), or why it cannot be used.
type SentToken = Result<Option<Arc<Verified>>, Refusal>;

/// An API key as sent (`None`: none was), and its digest; or why it cannot be used.
type SentKey<'a> = Result<Option<(&'a [u8], IdentityDigest)>, KeyError>;

impl<'a> Requester<'a> {
    pub fn new(headers: &'a HeaderMap, peer: IpAddr, keys: &'a Keys, trust: &'a ClientIp) -> Self {
        Requester {
            headers,
            peer,
            keys,
            trust,
            client_ip: OnceLock::new(),
            api_key: OnceLock::new(),
            client_cert: None,
            listed: OnceLock::new(),
            jwt: None,
            token: OnceLock::new(),
            sent_token: OnceLock::new(),
            count_failures: false,
            key_refused: OnceLock::new(),
        }
    }

    /// A failed credential (a token that does not verify, an unknown key) is charged to
    /// the client's address, and past its allowance the credentials it sends are
    /// refused with 429 unchecked (`[jwt] failures`, `[keys] failures`).
    pub fn counting_failures(mut self) -> Self {
        self.count_failures = true;
        self
    }

    /// Bearer tokens are verified with `jwt` (`[jwt]`).
    pub fn with_jwt(mut self, jwt: Option<&'a Verifier>) -> Self {
        self.jwt = jwt;
        self
    }

    /// The request's bearer token, verified (once); none where none was sent.
    pub fn token(&self) -> Result<Option<&Verified>, Refusal> {
        let sent = self.token.get_or_init(|| {
            let Some(v) = self.jwt else {
                return Err(Refusal::KeysUnavailable);
            };
            let (token, hash) = match self.sent_token(v) {
                Ok(Some(sent)) => sent,
                Ok(None) => return Ok(None),
                Err(e) => return Err(self.token_failed(v, e)),
            };
            match v.known(token, &hash) {
                Ok(Known::Accepted(verified)) => Ok(Some(verified)),
                Ok(Known::Refused(e)) => Err(self.token_failed(v, e)),
                Ok(Known::Unknown) => self.check_token(v, token, hash),
                Err(_) => Err(Refusal::KeysUnavailable),
            }
        });
        match sent {
            Ok(v) => Ok(v.as_deref()),
            Err(r) => Err(*r),
        }
    }

    /// Whether the request carries a bearer token that only a signature check can judge
    /// (neither cache knows it): the gateway then decides the rules that do not need it
    /// first, so that a forger pays them before any CPU is spent on its signature.
    pub fn token_pending(&self) -> bool {
        let Some(v) = self.jwt.filter(|_| self.token.get().is_none()) else {
            return false;
        };
        let Ok(Some((token, hash))) = self.sent_token(v) else {
            return false;
        };
        matches!(v.known(token, &hash), Ok(Known::Unknown))
    }

    /// The bearer token as sent, and its SHA-256; none where none was sent.
    fn sent_token(&self, v: &Verifier) -> SentBearer<'a> {
        *self
            .sent_token
            .get_or_init(|| Ok(v.token_of(self.headers)?.map(|t| (t, jwt::digest(t)))))
    }

    /// A token no cache knows, checked in full: charged to the client's address first
    /// where failures count (and refused unchecked past its allowance), its charge given
    /// back if it verified.
    fn check_token(&self, v: &Verifier, token: &str, hash: [u8; 32]) -> SentToken {
        let f = &v.failures;
        let now = f.now_ms();
        let charged = match self.count_failures {
            true => Some(
                f.charge(self.client_ip(), now)
                    .map_err(Refusal::Throttled)?,
            ),
            false => None,
        };
        let verified = v.check_unknown(token, hash);
        if let (Some(key), Ok(_) | Err(Failure::Unavailable)) = (charged, &verified) {
            f.refund(key, now);
        }
        match verified {
            Ok(verified) => Ok(Some(verified)),
            Err(Failure::Invalid(e)) => Err(Refusal::InvalidToken(e)),
            Err(Failure::Unavailable) => Err(Refusal::KeysUnavailable),
        }
    }

    /// A token refused without a signature check (malformed, too long, refused a moment
    /// ago): one failure of the client's address where failures count, and 429 once its
    /// allowance is spent.
    fn token_failed(&self, v: &Verifier, e: TokenError) -> Refusal {
        if !self.count_failures {
            return Refusal::InvalidToken(e);
        }
        let f = &v.failures;
        match f.charge(self.client_ip(), f.now_ms()) {
            Ok(_) => Refusal::InvalidToken(e),
            Err(ms) => Refusal::Throttled(ms),
        }
    }

    /// The headers the backend gets from the request's verified token
    /// (`forward_claims`): none without `[jwt] forward_claims`, without a token, or with
    /// one that did not verify.
    pub fn forwarded_claims(&self) -> Vec<(HeaderName, HeaderValue)> {
        let Some(v) = self.jwt.filter(|v| !v.settings.forward_claims.is_empty()) else {
            return Vec::new();
        };
        match self.token() {
            Ok(Some(verified)) => v.forwarded(verified),
            _ => Vec::new(),
        }
    }

    /// The request came with this verified client certificate (see [`ClientCert`]).
    pub fn with_client_cert(mut self, cert: Option<&'a ClientCert>) -> Self {
        self.client_cert = cert.map(|c| &c.0);
        self
    }

    /// The client's address (see [`client_ip`]).
    pub fn client_ip(&self) -> IpAddr {
        *self
            .client_ip
            .get_or_init(|| client_ip(self.peer, self.headers, self.trust))
    }

    fn api_key(&self) -> SentKey<'a> {
        *self.api_key.get_or_init(|| {
            let key = api_key(self.headers, &self.keys.header)?;
            Ok(key.map(|v| (v, digest_cache::digest(v, digest_api_key))))
        })
    }

    /// The request's plan: its verified token's `plan_claim` where it carries one, else
    /// the plan its API key is listed with, if any. A malformed key has none (the rules
    /// counting by it refuse the request), nor has a token that did not verify.
    pub fn plan(&self) -> Option<&str> {
        if let Some(plan) = self.token_plan() {
            return Some(plan);
        }
        self.listing()?.plan
    }

    /// The label of the request's API key, where it is listed with one (for operators:
    /// the access line, the status page's most limited identities).
    /// Looked up only where some key has a label: a request with a key no rule counts
    /// by hashes it for nothing otherwise.
    pub fn label(&self) -> Option<&Arc<str>> {
        if !self.keys.labelled() {
            return None;
        }
        self.listing()?.label.as_ref()
    }

    /// The label an identity is shown with: its API key's, where it is counted by one
    /// (alone, or as a part of a combination); none for an address, a header, a claim.
    pub fn label_of(&self, source: &Source<'_>) -> Option<&Arc<str>> {
        let by_key = match source {
            Source::ApiKey(_) => true,
            Source::Combined(parts) => parts.contains(&KeyKind::ApiKey),
            _ => false,
        };
        by_key.then(|| self.label()).flatten()
    }

    /// The claim values an identity counted by a token's claims is made of, as `sub=alice`
    /// (`, `-separated for a combination), each value cut at [`MAX_CLAIM_SHOWN`]
    /// characters. Who the user is, so for admin views only (the admin token required):
    /// never the public page, `/status.json`, logs or metrics.
    pub fn claims_of(&self, source: &Source<'_>) -> Option<String> {
        let paths: Vec<&ClaimPath> = match source {
            Source::Jwt(path) => vec![*path],
            Source::Combined(parts) => parts
                .iter()
                .filter_map(|p| match p {
                    KeyKind::Jwt(path) => Some(path),
                    _ => None,
                })
                .collect(),
            _ => return None,
        };
        let verified = self.token().ok().flatten()?;
        let shown: Vec<String> = paths
            .iter()
            .filter_map(|path| {
                let value = path.text(&verified.claims)?;
                let mut cut: String = value.chars().take(MAX_CLAIM_SHOWN).collect();
                if cut.len() < value.len() {
                    cut.push('…');
                }
                Some(format!("{path}={cut}"))
            })
            .collect();
        (!shown.is_empty()).then(|| shown.join(", "))
    }

    /// The `plan_claim` of the request's verified token (a string claim).
    fn token_plan(&self) -> Option<&str> {
        let claim = self.jwt?.settings.plan_claim.as_ref()?;
        let verified = self.token().ok().flatten()?;
        claim.lookup(&verified.claims)?.as_str()
    }

    /// How the request's API key is listed (see [`Keys::listing`]), once per request.
    fn listing(&self) -> Option<&Listing<'a>> {
        self.listed
            .get_or_init(|| {
                let (key, _) = self.api_key().ok().flatten()?;
                self.keys.listing(key)
            })
            .as_ref()
    }

    /// Who the request is under a rule counting by `key`.
    pub fn identify(&self, key: &'a Key) -> Result<Identity<'a>, Refusal> {
        match self.identify_kind(&key.kind) {
            Err(missing) if missing.is_missing() && key.missing == MissingKey::ClientIp => {
                Ok(self.ip_identity())
            }
            other => other,
        }
    }

    /// Whether the request lacks `part` (of a rule's key): what `missing_key` decides
    /// for, named by `ratewall check`.
    pub fn lacks(&self, part: &'a KeyKind) -> bool {
        matches!(self.identify_kind(part), Err(r) if r.is_missing())
    }

    /// Who the request is by `kind`; a missing part is its `Missing*` refusal (for
    /// [`Requester::identify`]'s `missing_key` to decide).
    fn identify_kind(&self, kind: &'a KeyKind) -> Result<Identity<'a>, Refusal> {
        match kind {
            KeyKind::Global => Ok(Identity {
                digest: digest_global(),
                source: Source::Everyone,
            }),
            KeyKind::ClientIp => Ok(self.ip_identity()),
            KeyKind::ApiKey => match self.api_key().map_err(Refusal::Malformed)? {
                Some((v, digest)) => {
                    if let Some(refused) = self.key_refusal() {
                        return Err(refused);
                    }
                    Ok(Identity {
                        digest,
                        source: Source::ApiKey(v),
                    })
                }
                None => Err(Refusal::MissingKey),
            },
            KeyKind::Header(h) => match api_key(self.headers, h).map_err(Refusal::Malformed)? {
                Some(v) => Ok(Identity {
                    digest: digest_header(h, v),
                    source: Source::Header(h, v),
                }),
                None => Err(Refusal::MissingHeader),
            },
            KeyKind::ClientCert => match self.client_cert {
                Some(fingerprint) => Ok(Identity {
                    digest: digest_client_cert(fingerprint),
                    source: Source::ClientCert(fingerprint),
                }),
                None => Err(Refusal::MissingCert),
            },
            KeyKind::Jwt(path) => {
                let verified = self.token()?.ok_or(Refusal::MissingToken)?;
                let value = path.text(&verified.claims).ok_or(Refusal::MissingClaim)?;
                Ok(Identity {
                    digest: digest_claim(path, value.as_bytes()),
                    source: Source::Jwt(path),
                })
            }
            KeyKind::Target => {
                let host = target_host(self.headers).ok_or(Refusal::MissingHeader)?;
                Ok(Identity {
                    digest: digest_target(host),
                    source: Source::Target(host),
                })
            }
            KeyKind::Credential(h) => {
                match credential(self.headers, h).map_err(Refusal::Malformed)? {
                    Some(v) => Ok(Identity {
                        digest: digest_credential(h, &v),
                        source: Source::Credential(h),
                    }),
                    None => Err(Refusal::MissingHeader),
                }
            }
            KeyKind::Caller => match self.client_cert {
                Some(fingerprint) => Ok(Identity {
                    digest: digest_client_cert(fingerprint),
                    source: Source::ClientCert(fingerprint),
                }),
                None => Ok(self.ip_identity()),
            },
            KeyKind::Combined(parts) => {
                let mut combined = Combined::new();
                for part in parts {
                    combined.add(self.identify_kind(part)?.digest);
                }
                Ok(Identity {
                    digest: combined.finish(),
                    source: Source::Combined(parts),
                })
            }
        }
    }

    /// Whether the request carries `what`, read exactly as a rule counting by it reads it,
    /// so that `"absent"` and `"present"` split requests the way that rule would see them
    /// and none falls between:
    ///
    /// - The API key is absent when the header is not sent, or sent empty: where an
    ///   `api_key` rule would see it missing. It is present when it is a key an `api_key`
    ///   rule would count the request by. A key such a rule would refuse is refused here
    ///   too, with the same answer: a malformed one (sent twice, over 1 KiB) with 400, and
    ///   under `unknown = "reject"` an unlisted one with 401. So a bad key neither passes
    ///   as absent (and dodges a per-key rule) nor as present (and dodges a per-IP one).
    /// - A header is absent where a `header:<name>` rule would see it missing (not sent,
    ///   or one empty value), and present otherwise: a value sent twice or over 1 KiB is
    ///   present, and the rule counting by it refuses it. Never refused here: a header
    ///   condition only asks whether it is there (an `authorization` header may be long).
    pub fn carries(&self, what: &Carried) -> Result<bool, Refusal> {
        match what {
            Carried::ApiKey => match self.api_key().map_err(Refusal::Malformed)? {
                None => Ok(false),
                Some(_) => match self.key_refusal() {
                    Some(refused) => Err(refused),
                    None => Ok(true),
                },
            },
            Carried::Header(h) => Ok(!matches!(api_key(self.headers, h), Ok(None))),
        }
    }

    /// Why the request's key, well formed and sent, is refused, if it is: unknown with
    /// `unknown = "reject"`; or, where failures count, sent from an address whose
    /// allowance of unknown keys is spent — then refused with 429 without being looked
    /// up, whatever it is (a known key let through would tell a guesser it guessed
    /// right). An unknown key is one failure of its address. Found once per request.
    fn key_refusal(&self) -> Option<Refusal> {
        *self.key_refused.get_or_init(|| {
            if self.keys.unknown != UnknownKeys::Reject {
                return None;
            }
            let f = &self.keys.failures;
            if !self.count_failures {
                return self.listing().is_none().then_some(Refusal::UnknownKey);
            }
            if !f.quiet() {
                if let Some(ms) = f.throttled(self.client_ip(), f.now_ms()) {
                    return Some(Refusal::Throttled(ms));
                }
            }
            if self.listing().is_some() {
                return None;
            }
            Some(match f.charge(self.client_ip(), f.now_ms()) {
                Ok(_) => Refusal::UnknownKey,
                Err(ms) => Refusal::Throttled(ms),
            })
        })
    }

    fn ip_identity(&self) -> Identity<'a> {
        let ip = self.client_ip();
        Identity {
            digest: digest_ip(ip),
            source: Source::ClientIp(ip),
        }
    }
}

/// The request parts that name an identity directly, as the admin API takes them
/// (`key=`, `header=`, `ip=`): a key header holding `value`, and `ip` as the peer.
pub fn headers_naming(key: &KeyKind, keys: &Keys, value: &[u8]) -> Option<HeaderMap> {
    let name = match key {
        KeyKind::ApiKey => &keys.header,
        KeyKind::Header(h) | KeyKind::Credential(h) => h,
        KeyKind::Target => &http::header::HOST,
        KeyKind::Caller
        | KeyKind::ClientIp
        | KeyKind::Global
        | KeyKind::ClientCert
        | KeyKind::Jwt(_)
        | KeyKind::Combined(_) => return Some(HeaderMap::new()),
    };
    let mut h = HeaderMap::new();
    h.insert(name.clone(), HeaderValue::from_bytes(value).ok()?);
    Some(h)
}

/// The digest of one part of a key (or a whole single key) as the admin API names it:
/// `value` is the API key, the header's value, the address, the certificate's SHA-256
/// fingerprint (hex, colons allowed) or the claim's text. None for a value that is not
/// one, and for a combination (give each part).
pub fn digest_part(kind: &KeyKind, value: &[u8]) -> Option<IdentityDigest> {
    Some(match kind {
        KeyKind::Global => digest_global(),
        KeyKind::ApiKey => digest_api_key(value),
        KeyKind::Header(h) => digest_header(h, value),
        KeyKind::Jwt(path) => digest_claim(path, value),
        KeyKind::ClientIp => {
            let ip: IpAddr = std::str::from_utf8(value).ok()?.trim().parse().ok()?;
            digest_ip(ip.to_canonical())
        }
        KeyKind::ClientCert => digest_client_cert(&parse_fingerprint(value)?),
        KeyKind::Target => digest_target(std::str::from_utf8(value).ok()?.trim()),
        KeyKind::Credential(h) => digest_credential(h, value),
        // A certificate or an address: give it as client_cert or client_ip.
        KeyKind::Caller | KeyKind::Combined(_) => return None,
    })
}

/// A SHA-256 fingerprint as an operator writes one: 64 hex digits, colons allowed
/// (`openssl x509 -fingerprint -sha256` prints them with).
pub fn parse_fingerprint(text: &[u8]) -> Option<[u8; 32]> {
    let digits: Vec<u8> = text.iter().copied().filter(|b| *b != b':').collect();
    directory::parse_hex(std::str::from_utf8(&digits).ok()?)
}

/// A 128-bit digest of an identity. Rendered as hex in Redis key names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IdentityDigest(pub [u8; 16]);

impl IdentityDigest {
    /// The first 8 hex digits, as logs and the status page show an identity; no allocation.
    pub fn short_hex(&self) -> ShortHex {
        let mut s = [0u8; 8];
        for (i, b) in self.0[..4].iter().enumerate() {
            s[2 * i] = b"0123456789abcdef"[usize::from(b >> 4)];
            s[2 * i + 1] = b"0123456789abcdef"[usize::from(b & 0xf)];
        }
        ShortHex(s)
    }

    pub fn hex(&self) -> String {
        let mut s = String::with_capacity(32);
        self.push_hex(&mut s);
        s
    }

    /// Append the 32 lowercase hex digits to `out`.
    pub fn push_hex(&self, out: &mut String) {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        for b in self.0 {
            out.push(char::from(DIGITS[usize::from(b >> 4)]));
            out.push(char::from(DIGITS[usize::from(b & 0xf)]));
        }
    }
}

/// 8 lowercase hex digits of an identity digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShortHex([u8; 8]);

impl ShortHex {
    pub fn as_str(&self) -> &str {
        // Hex digits are ASCII.
        std::str::from_utf8(&self.0).unwrap_or("????????")
    }
}

/// Digests, domain-separated so an API key can never collide with an IP or a header value.
pub fn digest_api_key(key: &[u8]) -> IdentityDigest {
    digest(&[b"ratewall/key\0", key])
}

/// A client certificate by its SHA-256 fingerprint.
pub fn digest_client_cert(fingerprint: &[u8; 32]) -> IdentityDigest {
    digest(&[b"ratewall/cert\0", fingerprint])
}

pub fn digest_ip(ip: IpAddr) -> IdentityDigest {
    match ip {
        IpAddr::V4(v4) => digest(&[b"ratewall/ip4\0", &v4.octets()]),
        IpAddr::V6(v6) => digest(&[b"ratewall/ip6\0", &v6.octets()]),
    }
}

pub fn digest_global() -> IdentityDigest {
    // One value, hashed once (every request of a global rule asks).
    static GLOBAL: OnceLock<IdentityDigest> = OnceLock::new();
    *GLOBAL.get_or_init(|| digest(&[b"ratewall/global"]))
}

/// The host a request names in its `Host` (the egress gateway sets it from the call's
/// target): without its port or a trailing dot.
fn target_host(headers: &HeaderMap) -> Option<&str> {
    let raw = headers.get(http::header::HOST)?.to_str().ok()?;
    let host = match raw.strip_prefix('[') {
        Some(v6) => v6.split_once(']').map_or(raw, |(h, _)| h),
        None => raw.split_once(':').map_or(raw, |(h, _)| h),
    };
    let host = host.strip_suffix('.').unwrap_or(host);
    (!host.is_empty()).then_some(host)
}

/// A call's target host, lower-cased (DNS names are case-insensitive).
pub fn digest_target(host: &str) -> IdentityDigest {
    let lower = host.to_ascii_lowercase();
    digest(&[b"ratewall/target\0", lower.as_bytes()])
}

/// A credential's value under the header it is in.
pub fn digest_credential(name: &HeaderName, value: &[u8]) -> IdentityDigest {
    digest(&[
        b"ratewall/credential\0",
        name.as_str().as_bytes(),
        b"\0",
        value,
    ])
}

/// The longest credential a `credential` key reads (a bearer token may be long).
pub const MAX_CREDENTIAL_LEN: usize = 16 * 1024;

/// The credential in the header `name`, as the API it is for reads it: the secret alone,
/// so that one token is one identity however it is sent — `Bearer T`, `bearer  T`,
/// `token T` are `T`; `Basic` is the password of its `user:password` (the user where the
/// password is empty, as Stripe sends its key); another scheme, or another header, is the
/// value trimmed. None where it is missing or empty; refused (400) where it is sent twice
/// or is longer than [`MAX_CREDENTIAL_LEN`]: never counted as missing.
fn credential<'h>(
    headers: &'h HeaderMap,
    name: &HeaderName,
) -> Result<Option<Cow<'h, [u8]>>, KeyError> {
    let mut values = headers.get_all(name).iter();
    let Some(v) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    let v = v.as_bytes().trim_ascii();
    if v.len() > MAX_CREDENTIAL_LEN {
        return Err(KeyError::CredentialTooLong);
    }
    if v.is_empty() {
        return Ok(None);
    }
    if *name != http::header::AUTHORIZATION {
        return Ok(Some(Cow::Borrowed(v)));
    }
    let (scheme, rest) = match v.iter().position(|b| b.is_ascii_whitespace()) {
        Some(at) => (&v[..at], v[at..].trim_ascii()),
        None => return Ok(Some(Cow::Borrowed(v))),
    };
    if scheme.eq_ignore_ascii_case(b"basic") {
        use base64::Engine;
        if let Ok(pair) = base64::engine::general_purpose::STANDARD.decode(rest) {
            let (user, password) = match pair.iter().position(|&b| b == b':') {
                Some(at) => (&pair[..at], &pair[at + 1..]),
                None => (&pair[..], &[][..]),
            };
            let secret = if password.is_empty() { user } else { password };
            return Ok(Some(Cow::Owned(secret.to_vec())));
        }
    }
    if scheme.eq_ignore_ascii_case(b"bearer") || scheme.eq_ignore_ascii_case(b"token") {
        return Ok(Some(Cow::Borrowed(rest)));
    }
    Ok(Some(Cow::Borrowed(v)))
}

pub fn digest_header(name: &HeaderName, value: &[u8]) -> IdentityDigest {
    digest(&[b"ratewall/header\0", name.as_str().as_bytes(), b"\0", value])
}

/// A verified token's claim at `path`, by its text (a number or a boolean as its JSON).
pub fn digest_claim(path: &ClaimPath, value: &[u8]) -> IdentityDigest {
    digest(&[b"ratewall/jwt\0", path.as_str().as_bytes(), b"\0", value])
}

/// A combination, by its parts' digests in the key's order.
pub fn digest_combined(parts: &[IdentityDigest]) -> IdentityDigest {
    let mut combined = Combined::new();
    for p in parts {
        combined.add(*p);
    }
    combined.finish()
}

/// [`digest_combined`], a part at a time (the request path's, without a list).
struct Combined(Context);

impl Combined {
    fn new() -> Combined {
        let mut h = Context::new(&SHA256);
        h.update(b"ratewall/combined\0");
        Combined(h)
    }

    fn add(&mut self, part: IdentityDigest) {
        self.0.update(&part.0);
    }

    fn finish(self) -> IdentityDigest {
        truncated(self.0)
    }
}

/// SHA-256 of `parts` in order, truncated. ring's SHA-256 (already here for TLS): the same
/// hash as the `sha2` crate's, in fewer instructions on a CPU without SHA extensions.
fn digest(parts: &[&[u8]]) -> IdentityDigest {
    let mut h = Context::new(&SHA256);
    for p in parts {
        h.update(p);
    }
    truncated(h)
}

/// The first 128 bits of the hash.
fn truncated(h: Context) -> IdentityDigest {
    let full = h.finish();
    let mut out = [0u8; 16];
    out.copy_from_slice(&full.as_ref()[..16]);
    IdentityDigest(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/observability.md names every kind the public page shows of a hint (its first
    /// word; issue 42, item 9: `jwt` was missing).
    #[test]
    fn the_public_hint_kinds_are_the_documents() {
        let doc = include_str!("../../docs/observability.md");
        let listed = doc
            .split_once("`hint`: its kind — ")
            .and_then(|(_, rest)| rest.split_once(" — "))
            .map(|(kinds, _)| kinds)
            .expect("the kinds in docs/observability.md");
        let header = HeaderName::from_static("x-tenant");
        let claim = ClaimPath::parse("sub").expect("a claim path");
        let parts = [KeyKind::ApiKey, KeyKind::ClientIp];
        let d = digest_global();
        let sources = [
            Source::Everyone,
            Source::ClientIp(ip("192.0.2.1")),
            Source::ClientIp(ip("2001:db8::1")),
            Source::ApiKey(b"sk_live_0123456789"),
            Source::Header(&header, b"acme"),
            Source::ClientCert(&[7; 32]),
            Source::Jwt(&claim),
            Source::Combined(&parts),
        ];
        for source in sources {
            let hint = Identity { digest: d, source }.hint();
            let kind = hint.split(' ').next().unwrap_or_default();
            assert!(
                listed.contains(&format!("`{kind}`")),
                "{kind} ({hint}) not in: {listed}"
            );
        }
    }

    /// A verifier of HS256 bearer tokens signed with the secret `s`, reading the plan from
    /// `plan_claim`.
    fn hs256_verifier(plan_claim: Option<ClaimPath>) -> Verifier {
        Verifier::new(
            hs256_settings(plan_claim),
            Some(jwt::KeySet::from_secret(b"s")),
        )
    }

    /// The settings of [`hs256_verifier`]: bearer tokens, HS256 only, 30 s of leeway,
    /// the default allowance of failures.
    pub(super) fn hs256_settings(plan_claim: Option<ClaimPath>) -> jwt::Settings {
        use jwt::{Alg, KeysFrom, Settings, TokenFrom};
        Settings {
            from: TokenFrom::Bearer(http::header::AUTHORIZATION),
            algorithms: vec![Alg::HS256],
            keys_from: KeysFrom::SecretEnv("X".into()),
            issuer: Vec::new(),
            audience: Vec::new(),
            leeway: 30,
            required_claims: Vec::new(),
            plan_claim,
            forward_claims: Vec::new(),
            failures: jwt::DEFAULT_FAILURES,
        }
    }

    /// Headers with `name` sent once with each of `values`.
    pub(super) fn headers(name: &str, values: &[&[u8]]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_bytes(v).unwrap(),
            );
        }
        h
    }

    /// Keys that take any key and list none.
    fn any_keys() -> Keys {
        Keys::new(
            DEFAULT_KEY_HEADER,
            UnknownKeys::Allow,
            Default::default(),
            None,
        )
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn digests_are_separated_by_kind() {
        assert_ne!(digest_api_key(b"1.2.3.4"), digest_ip(ip("1.2.3.4")));
        assert_ne!(digest_api_key(b"a"), digest_api_key(b"b"));
        assert_eq!(
            digest_ip(ip("::ffff:1.2.3.4").to_canonical()),
            digest_ip(ip("1.2.3.4"))
        );
        let d = digest_api_key(b"secret-key").hex();
        assert!(!d.contains("secret"));
    }

    /// `client_cert`: the verified certificate's fingerprint, in a domain of its own (the
    /// same 32 bytes as an API key are another identity); none: `missing_key`.
    #[test]
    fn a_client_certificate_is_an_identity_of_its_own() {
        let keys = any_keys();
        let trust = ClientIp::default();
        let h = HeaderMap::new();
        let fp = ClientCert([7u8; 32]);
        let by_cert = |missing| Key {
            kind: KeyKind::ClientCert,
            missing,
        };
        let (reject, by_ip) = (by_cert(MissingKey::Reject), by_cert(MissingKey::ClientIp));
        let with = Requester::new(&h, ip("192.0.2.1"), &keys, &trust).with_client_cert(Some(&fp));
        let id = with.identify(&reject).expect("identified");
        assert_eq!(id.digest, digest_client_cert(&fp.0));
        assert_ne!(id.digest, digest_api_key(&fp.0));
        assert!(id.hint().starts_with("client cert "), "{}", id.hint());
        assert!(!id.hint().contains("0707"), "{}", id.hint());
        let without = Requester::new(&h, ip("192.0.2.1"), &keys, &trust);
        assert_eq!(without.identify(&reject).unwrap_err(), Refusal::MissingCert);
        assert_eq!(without.identify(&reject).unwrap_err().status(), 401);
        assert_eq!(
            without.identify(&by_ip).expect("by ip").digest,
            digest_ip(ip("192.0.2.1"))
        );
    }

    /// `api_key = "absent" | "present"` splits requests exactly as an `api_key` rule sees
    /// them: absent where it would see no key, present where it would count one, and a key
    /// it would refuse refused alike, never passed as either.
    #[test]
    fn what_a_request_carries_is_read_as_the_rule_counting_by_it_reads_it() {
        let listed = std::collections::HashMap::from([(sha256(b"pro-key"), "pro".to_string())]);
        let keys = |unknown| Keys::new(DEFAULT_KEY_HEADER, unknown, listed.clone(), None);
        let (allow, reject) = (keys(UnknownKeys::Allow), keys(UnknownKeys::Reject));
        let trust = ClientIp::default();
        let user = HeaderName::from_static("x-user");
        // Headers sent; then carries(ApiKey) with unknown = allow, with unknown = reject;
        // carries(x-user).
        type Sent<'s> = &'s [(&'s str, &'s [u8])];
        let cases: [(Sent, _, _, _); 8] = [
            (&[], Ok(false), Ok(false), Ok(false)),
            (&[("x-api-key", b"  ")], Ok(false), Ok(false), Ok(false)),
            (&[("x-api-key", b"pro-key")], Ok(true), Ok(true), Ok(false)),
            (
                &[("x-api-key", b"made-up"), ("x-user", b"u")],
                Ok(true),
                Err(Refusal::UnknownKey),
                Ok(true),
            ),
            (
                &[("x-api-key", b"a"), ("x-api-key", b"b")],
                Err(Refusal::Malformed(KeyError::Repeated)),
                Err(Refusal::Malformed(KeyError::Repeated)),
                Ok(false),
            ),
            (
                &[("x-api-key", &[b'k'; MAX_KEY_LEN + 1])],
                Err(Refusal::Malformed(KeyError::TooLong)),
                Err(Refusal::Malformed(KeyError::TooLong)),
                Ok(false),
            ),
            // A header condition only asks whether it is there: twice, or long, it is.
            (
                &[("x-user", b"a"), ("x-user", b"b")],
                Ok(false),
                Ok(false),
                Ok(true),
            ),
            (&[("x-user", &[b'u'; 4096])], Ok(false), Ok(false), Ok(true)),
        ];
        for (sent, with_allow, with_reject, has_user) in cases {
            let mut h = HeaderMap::new();
            for (name, value) in sent {
                h.append(
                    HeaderName::from_bytes(name.as_bytes()).unwrap(),
                    HeaderValue::from_bytes(value).unwrap(),
                );
            }
            let at = |keys| Requester::new(&h, ip("192.0.2.1"), keys, &trust);
            let names: Vec<&str> = sent.iter().map(|(n, _)| *n).collect();
            assert_eq!(
                at(&allow).carries(&Carried::ApiKey),
                with_allow,
                "{names:?}"
            );
            assert_eq!(
                at(&reject).carries(&Carried::ApiKey),
                with_reject,
                "{names:?}"
            );
            assert_eq!(
                at(&allow).carries(&Carried::Header(user.clone())),
                has_user,
                "{names:?}"
            );
            // The api_key rule agrees: missing where absent, counted where present,
            // refused alike.
            let rule = Key {
                kind: KeyKind::ApiKey,
                missing: MissingKey::Reject,
            };
            for keys in [&allow, &reject] {
                let r = at(keys);
                match (r.carries(&Carried::ApiKey), r.identify(&rule)) {
                    (Ok(false), Err(Refusal::MissingKey)) | (Ok(true), Ok(_)) => {}
                    (Err(a), Err(b)) => assert_eq!(a, b, "{names:?}"),
                    (c, i) => panic!("{names:?}: carries {c:?}, identify {:?}", i.map(|_| ())),
                }
            }
        }
    }

    /// Who an identity is, for operators: a labelled key's label where it is counted by
    /// the key (alone or as a part), never for an address; a token's claim values
    /// (`sub=alice`, each part of a combination) where it is counted by them, cut when
    /// long; nothing looked up while no key has a label.
    #[test]
    fn labels_and_claims_name_the_identities_they_belong_to() {
        let verifier = hs256_verifier(None);
        let plans = std::collections::HashMap::from([
            (sha256(b"acme-key"), "pro".to_string()),
            (sha256(b"plain-key"), "pro".to_string()),
        ]);
        let labels =
            std::collections::HashMap::from([(sha256(b"acme-key"), Arc::from("Acme Corp"))]);
        let keys = Keys::new(DEFAULT_KEY_HEADER, UnknownKeys::Allow, plans.clone(), None)
            .with_labels(labels);
        let unlabelled = Keys::new(DEFAULT_KEY_HEADER, UnknownKeys::Allow, plans, None);
        assert!(keys.labelled() && !unlabelled.labelled());
        let trust = ClientIp::default();
        let sub = ClaimPath::parse("sub").unwrap();
        let org = ClaimPath::parse("org.id").unwrap();
        let per_key = Key {
            kind: KeyKind::ApiKey,
            missing: MissingKey::Reject,
        };
        let per_ip = Key {
            kind: KeyKind::ClientIp,
            missing: MissingKey::Reject,
        };
        let key_and_ip = Key {
            kind: KeyKind::Combined(vec![KeyKind::ApiKey, KeyKind::ClientIp]),
            missing: MissingKey::Reject,
        };
        let per_sub = Key {
            kind: KeyKind::Jwt(sub.clone()),
            missing: MissingKey::Reject,
        };
        let sub_and_org = Key {
            kind: KeyKind::Combined(vec![KeyKind::Jwt(sub), KeyKind::Jwt(org)]),
            missing: MissingKey::Reject,
        };
        let with_key = |key: &'static str| {
            let mut h = HeaderMap::new();
            h.insert("x-api-key", HeaderValue::from_static(key));
            h
        };
        let label = |keys: &Keys, h: &HeaderMap, rule: &Key| {
            let r = Requester::new(h, ip("192.0.2.9"), keys, &trust);
            let id = r.identify(rule).unwrap();
            r.label_of(&id.source).map(ToString::to_string)
        };
        let acme = with_key("acme-key");
        assert_eq!(label(&keys, &acme, &per_key).as_deref(), Some("Acme Corp"));
        assert_eq!(
            label(&keys, &acme, &key_and_ip).as_deref(),
            Some("Acme Corp")
        );
        assert_eq!(
            label(&keys, &acme, &per_ip),
            None,
            "an address is not the key"
        );
        assert_eq!(label(&keys, &with_key("plain-key"), &per_key), None);
        assert_eq!(label(&keys, &with_key("unlisted"), &per_key), None);
        let r = Requester::new(&acme, ip("192.0.2.9"), &unlabelled, &trust);
        assert_eq!(r.label(), None);
        assert!(r.listed.get().is_none(), "not looked up for a label");

        let long = "x".repeat(MAX_CLAIM_SHOWN + 10);
        let token = jsonwebtoken::encode(
            &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
            &serde_json::json!({"sub": "alice", "org": {"id": long}, "exp": 4_000_000_000u64}),
            &jsonwebtoken::EncodingKey::from_secret(b"s"),
        )
        .unwrap();
        let mut h = HeaderMap::new();
        h.insert(
            http::header::AUTHORIZATION,
            HeaderValue::from_str(&format!("Bearer {token}")).unwrap(),
        );
        let claims = |rule: &Key| {
            let r = Requester::new(&h, ip("192.0.2.9"), &keys, &trust).with_jwt(Some(&verifier));
            r.claims_of(&r.identify(rule).unwrap().source)
        };
        assert_eq!(claims(&per_sub).as_deref(), Some("sub=alice"));
        assert_eq!(
            claims(&sub_and_org),
            Some(format!(
                "sub=alice, org.id={}…",
                "x".repeat(MAX_CLAIM_SHOWN)
            ))
        );
        assert_eq!(claims(&per_ip), None);
    }

    /// `jwt:<claim>` and combined keys: a claim in a domain of its own, a missing claim
    /// or token following `missing_key`, an invalid token always refused, and each
    /// combination (by its parts' values and order) an identity apart.
    #[test]
    fn claims_and_combinations_are_identities_of_their_own() {
        let verifier = hs256_verifier(Some(ClaimPath::parse("tier").unwrap()));
        let token = |claims: serde_json::Value| {
            let t = jsonwebtoken::encode(
                &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
                &claims,
                &jsonwebtoken::EncodingKey::from_secret(b"s"),
            )
            .unwrap();
            HeaderValue::from_str(&format!("Bearer {t}")).unwrap()
        };
        let keys = any_keys();
        let trust = ClientIp::default();
        let sub = ClaimPath::parse("sub").unwrap();
        let by = |kind: KeyKind, missing| Key { kind, missing };
        let per_sub = by(KeyKind::Jwt(sub.clone()), MissingKey::Reject);
        let per_sub_or_ip = by(KeyKind::Jwt(sub.clone()), MissingKey::ClientIp);
        let project = KeyKind::Header(HeaderName::from_static("x-project"));
        let combined = |parts: Vec<KeyKind>| by(KeyKind::Combined(parts), MissingKey::Reject);
        let both = combined(vec![KeyKind::Jwt(sub.clone()), project.clone()]);
        let flipped = combined(vec![project.clone(), KeyKind::Jwt(sub.clone())]);
        let exp = 4_000_000_000u64;
        let identify = |auth: Option<HeaderValue>, project: Option<&'static str>, key: &Key| {
            let mut h = HeaderMap::new();
            if let Some(a) = auth {
                h.insert(http::header::AUTHORIZATION, a);
            }
            if let Some(p) = project {
                h.insert("x-project", HeaderValue::from_static(p));
            }
            let r = Requester::new(&h, ip("192.0.2.9"), &keys, &trust).with_jwt(Some(&verifier));
            let plan = r.plan().map(str::to_string);
            (r.identify(key).map(|i| i.digest), plan)
        };
        let alice = || {
            Some(token(
                serde_json::json!({"sub": "alice", "tier": "pro", "exp": exp}),
            ))
        };
        let (id, plan) = identify(alice(), None, &per_sub);
        assert_eq!(id.unwrap(), digest_claim(&sub, b"alice"));
        assert_eq!(plan.as_deref(), Some("pro"), "the plan claim");
        assert_ne!(digest_claim(&sub, b"alice"), digest_api_key(b"alice"));
        let numeric = Some(token(serde_json::json!({"sub": 7, "exp": exp})));
        assert_eq!(
            identify(numeric, None, &per_sub).0.unwrap(),
            digest_claim(&sub, b"7")
        );
        // No sub (a sub that is not a string is a malformed token: RFC 7519 §4.1.2).
        let no_sub = || Some(token(serde_json::json!({"tier": "pro", "exp": exp})));
        assert_eq!(
            identify(no_sub(), None, &per_sub).0,
            Err(Refusal::MissingClaim)
        );
        assert_eq!(
            identify(no_sub(), None, &per_sub_or_ip).0.unwrap(),
            digest_ip(ip("192.0.2.9"))
        );
        assert_eq!(identify(None, None, &per_sub).0, Err(Refusal::MissingToken));
        assert_eq!(
            identify(None, None, &per_sub_or_ip).0.unwrap(),
            digest_ip(ip("192.0.2.9"))
        );
        let forged = Some(HeaderValue::from_static("Bearer e30.e30.sig"));
        assert!(matches!(
            identify(forged, None, &per_sub_or_ip).0,
            Err(Refusal::InvalidToken(_))
        ));
        let a = identify(alice(), Some("p1"), &both).0.unwrap();
        assert_eq!(
            a,
            digest_combined(&[
                digest_claim(&sub, b"alice"),
                digest_header(&HeaderName::from_static("x-project"), b"p1")
            ])
        );
        assert_ne!(a, identify(alice(), Some("p2"), &both).0.unwrap());
        assert_ne!(a, identify(alice(), Some("p1"), &flipped).0.unwrap());
        assert_eq!(
            identify(alice(), None, &both).0,
            Err(Refusal::MissingHeader)
        );
    }

    #[test]
    fn digest_hex_is_32_lowercase_chars() {
        let d = IdentityDigest([0xab; 16]);
        assert_eq!(d.hex(), "ab".repeat(16));
        let mut b = [0u8; 16];
        b[..4].copy_from_slice(&[0x01, 0x9f, 0xe0, 0x7c]);
        let d = IdentityDigest(b);
        assert_eq!(d.short_hex().as_str(), &d.hex()[..8]);
        assert_eq!(d.short_hex().as_str(), "019fe07c");
    }

    #[test]
    fn one_credential_is_one_identity_however_it_is_sent() {
        use base64::Engine;
        let auth = http::header::AUTHORIZATION;
        let read = |values: &[&str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(&auth, HeaderValue::from_str(v).expect("a value"));
            }
            credential(&h, &auth).map(|c| c.map(Cow::into_owned))
        };
        let basic = |pair: &str| {
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(pair)
            )
        };
        for sent in [
            "Bearer T0k3n",
            "bearer  T0k3n",
            "BEARER T0k3n ",
            "token T0k3n",
            &basic("x:T0k3n"),
            &basic("T0k3n:"),
        ] {
            assert_eq!(read(&[sent]), Ok(Some(b"T0k3n".to_vec())), "{sent}");
        }
        assert_eq!(read(&["Digest abc"]), Ok(Some(b"Digest abc".to_vec())));
        assert_eq!(read(&[]), Ok(None));
        assert_eq!(read(&["  "]), Ok(None));
        assert_eq!(
            read(&["Bearer a", "Bearer b"]),
            Err(KeyError::Repeated),
            "two credentials: refused, never missing"
        );
        let long = format!("Bearer {}", "x".repeat(MAX_CREDENTIAL_LEN));
        assert_eq!(read(&[&long]), Err(KeyError::CredentialTooLong));
        // Another header: its value, trimmed.
        let mut h = HeaderMap::new();
        h.insert("x-api-key", HeaderValue::from_static(" k1 "));
        assert_eq!(
            credential(&h, &HeaderName::from_static("x-api-key")).map(|c| c.map(Cow::into_owned)),
            Ok(Some(b"k1".to_vec()))
        );
    }
}
