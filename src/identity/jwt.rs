//! Bearer tokens (`[jwt]`): a signed JSON Web Token (RFC 7519) the gateway verifies
//! itself — signature, algorithm, expiry, issuer, audience — before a rule counts a
//! request by one of its claims (`key = "jwt:<claim>"`). Pure: the key set is given (read
//! from files at load, or fetched by `runtime::jwks`), the time is injected.
//!
//! One [`Verifier`] per configuration holds the validated [`Settings`], the current
//! [`KeySet`] (swapped whole when a JWKS is fetched again) and a bounded cache of the
//! tokens it verified, keyed by their SHA-256: a repeated token costs a hash and a map
//! lookup, not a signature check. The cache is emptied whenever the key set changes, so a
//! key rotated out stops its tokens at once.
//!
//! Never an unverified token: a token that cannot be checked (no key set yet) is
//! [`Failure::Unavailable`], never let through.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use base64::Engine;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, PublicKeyUse};
use jsonwebtoken::{DecodingKey, Validation};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use super::failures::{Allowance, Failures};
use super::token_cache::{Accepted, Refused, Rejected};

pub use super::claim_path::ClaimPath;

/// A token longer than this is refused unread.
pub const MAX_TOKEN_BYTES: usize = 8 * 1024;
/// `leeway` when not given: clocks of issuers and gateways disagree by this much.
pub const DEFAULT_LEEWAY: Duration = Duration::from_secs(30);
/// `jwks_refresh` when not given.
pub const DEFAULT_REFRESH: Duration = Duration::from_secs(300);
/// A token naming an unknown `kid` asks for a new JWKS at most this often.
pub const REFETCH_EVERY: Duration = Duration::from_secs(30);
/// The verified-token cache holds at most this many tokens.
pub const CACHE_ENTRIES: usize = 100_000;
/// The refused-token cache holds at most this many tokens…
pub const REFUSED_ENTRIES: usize = 10_000;
/// …each for at most this long (a token that is not valid yet is never remembered).
pub const REFUSED_FOR: Duration = Duration::from_secs(60);
/// `failures`' default: 20 tokens that fail at once per client address, then one more
/// every 6 s ("10/m").
pub const DEFAULT_FAILURES: Allowance = Allowance {
    burst: 20,
    every_ms: 6_000,
};

/// The algorithms `algorithms` may list (RFC 7518 §3.1, and EdDSA of RFC 8037). `none`
/// is never one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Alg {
    RS256,
    RS384,
    RS512,
    PS256,
    PS384,
    PS512,
    ES256,
    ES384,
    EdDSA,
    HS256,
    HS384,
    HS512,
}

impl Alg {
    pub const ALL: [Alg; 12] = [
        Alg::RS256,
        Alg::RS384,
        Alg::RS512,
        Alg::PS256,
        Alg::PS384,
        Alg::PS512,
        Alg::ES256,
        Alg::ES384,
        Alg::EdDSA,
        Alg::HS256,
        Alg::HS384,
        Alg::HS512,
    ];

    /// As a token's header and the file name it.
    pub fn name(self) -> &'static str {
        match self {
            Alg::RS256 => "RS256",
            Alg::RS384 => "RS384",
            Alg::RS512 => "RS512",
            Alg::PS256 => "PS256",
            Alg::PS384 => "PS384",
            Alg::PS512 => "PS512",
            Alg::ES256 => "ES256",
            Alg::ES384 => "ES384",
            Alg::EdDSA => "EdDSA",
            Alg::HS256 => "HS256",
            Alg::HS384 => "HS384",
            Alg::HS512 => "HS512",
        }
    }

    pub fn of_name(name: &str) -> Option<Alg> {
        Alg::ALL.into_iter().find(|a| a.name() == name)
    }

    /// A shared-secret (HMAC) algorithm: anyone who can verify can sign.
    pub fn is_symmetric(self) -> bool {
        matches!(self, Alg::HS256 | Alg::HS384 | Alg::HS512)
    }

    fn algorithm(self) -> jsonwebtoken::Algorithm {
        use jsonwebtoken::Algorithm as A;
        match self {
            Alg::RS256 => A::RS256,
            Alg::RS384 => A::RS384,
            Alg::RS512 => A::RS512,
            Alg::PS256 => A::PS256,
            Alg::PS384 => A::PS384,
            Alg::PS512 => A::PS512,
            Alg::ES256 => A::ES256,
            Alg::ES384 => A::ES384,
            Alg::EdDSA => A::EdDSA,
            Alg::HS256 => A::HS256,
            Alg::HS384 => A::HS384,
            Alg::HS512 => A::HS512,
        }
    }
}

/// What a key is, and so which algorithms it can verify: an RSA key RS* and PS*, an EC
/// key the ES algorithm of its curve, an Ed25519 key EdDSA, a secret HS*.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyType {
    Rsa,
    P256,
    P384,
    Ed25519,
    Secret,
}

impl KeyType {
    /// Whether a key of this type can verify `alg`.
    pub fn takes(self, alg: Alg) -> bool {
        use Alg::*;
        match self {
            KeyType::Rsa => matches!(alg, RS256 | RS384 | RS512 | PS256 | PS384 | PS512),
            KeyType::P256 => alg == ES256,
            KeyType::P384 => alg == ES384,
            KeyType::Ed25519 => alg == EdDSA,
            KeyType::Secret => alg.is_symmetric(),
        }
    }

    fn name(self) -> &'static str {
        match self {
            KeyType::Rsa => "RSA",
            KeyType::P256 => "EC P-256",
            KeyType::P384 => "EC P-384",
            KeyType::Ed25519 => "Ed25519",
            KeyType::Secret => "secret",
        }
    }
}

/// One key a token may be verified with.
pub struct VerifyKey {
    /// Its `kid`, where its JWKS names one.
    pub kid: Option<String>,
    pub kind: KeyType,
    /// The one algorithm its JWKS entry allows (`alg`), if it says.
    pub alg: Option<Alg>,
    key: DecodingKey,
}

impl VerifyKey {
    fn usable_for(&self, alg: Alg) -> bool {
        self.kind.takes(alg) && self.alg.is_none_or(|a| a == alg)
    }
}

/// The keys tokens are verified with, and a digest of what they were made from (a
/// fetch that brings the same set changes nothing, and keeps the cache).
pub struct KeySet {
    keys: Vec<VerifyKey>,
    material: [u8; 32],
    /// Which set this is, process-wide: a cached token is served only while the set it
    /// was verified with is the current one.
    generation: u64,
}

/// The next [`KeySet::generation`].
fn next_generation() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl fmt::Debug for KeySet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeySet")
            .field("keys", &self.keys.len())
            .finish_non_exhaustive()
    }
}

impl KeySet {
    /// A JWKS document (RFC 7517 §5): its signature keys this gateway can use. Keys for
    /// encryption (`use = "enc"`), of other types or curves are skipped; none left is an
    /// error.
    pub fn from_jwks(json: &[u8]) -> Result<KeySet, String> {
        let doc: Value =
            serde_json::from_slice(json).map_err(|e| format!("not a JWKS (JSON): {e}"))?;
        let entries = doc
            .get("keys")
            .and_then(Value::as_array)
            .ok_or("not a JWKS: no \"keys\" array")?;
        let mut keys = Vec::new();
        for entry in entries {
            let Ok(jwk) = serde_json::from_value::<Jwk>(entry.clone()) else {
                continue;
            };
            if let Some(k) = from_jwk(&jwk) {
                keys.push(k);
            }
        }
        if keys.is_empty() {
            return Err(format!(
                "no usable signature key among its {} key(s) (RSA, EC P-256/P-384, Ed25519 or oct)",
                entries.len()
            ));
        }
        Ok(KeySet {
            keys,
            material: Sha256::digest(json).into(),
            generation: next_generation(),
        })
    }

    /// Public keys in PEM (SubjectPublicKeyInfo, or an RSA PUBLIC KEY), one a file,
    /// without a `kid`: `(name, text)`, the name for errors.
    pub fn from_pems(pems: &[(String, Vec<u8>)]) -> Result<KeySet, String> {
        let mut keys = Vec::new();
        let mut material = Sha256::new();
        for (name, text) in pems {
            material.update(text);
            let kind = pem_key_type(text).ok_or_else(|| {
                format!("{name}: not a public key in PEM (RSA, EC P-256/P-384 or Ed25519)")
            })?;
            let key = match kind {
                KeyType::Rsa => DecodingKey::from_rsa_pem(text),
                KeyType::P256 | KeyType::P384 => DecodingKey::from_ec_pem(text),
                KeyType::Ed25519 => DecodingKey::from_ed_pem(text),
                KeyType::Secret => unreachable_secret(),
            }
            .map_err(|e| format!("{name}: {e}"))?;
            keys.push(VerifyKey {
                kid: None,
                kind,
                alg: None,
                key,
            });
        }
        if keys.is_empty() {
            return Err("no key given".into());
        }
        Ok(KeySet {
            keys,
            material: material.finalize().into(),
            generation: next_generation(),
        })
    }

    /// A shared secret (HS algorithms).
    pub fn from_secret(secret: &[u8]) -> KeySet {
        KeySet {
            keys: vec![VerifyKey {
                kid: None,
                kind: KeyType::Secret,
                alg: None,
                key: DecodingKey::from_secret(secret),
            }],
            material: Sha256::digest(secret).into(),
            generation: next_generation(),
        }
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The key types in the set, for load checks: `(type, its algorithm if fixed)`.
    pub fn kinds(&self) -> impl Iterator<Item = (KeyType, Option<Alg>)> + '_ {
        self.keys.iter().map(|k| (k.kind, k.alg))
    }

    /// For `ratewall check`: how many keys, of which types, with which kids.
    pub fn describe(&self) -> String {
        let parts: Vec<String> = self
            .keys
            .iter()
            .map(|k| match &k.kid {
                Some(kid) => format!("{} (kid {kid})", k.kind.name()),
                None => k.kind.name().to_string(),
            })
            .collect();
        format!("{} key(s): {}", self.keys.len(), parts.join(", "))
    }

    /// The key for a token of `alg` naming `kid`: by its kid; with none, the one key that
    /// can verify `alg`.
    fn pick(&self, alg: Alg, kid: Option<&str>) -> Result<&VerifyKey, TokenError> {
        if let Some(kid) = kid {
            let key = self
                .keys
                .iter()
                .find(|k| k.kid.as_deref() == Some(kid))
                .ok_or(TokenError::UnknownKid)?;
            return match key.usable_for(alg) {
                true => Ok(key),
                false => Err(TokenError::KeyMismatch),
            };
        }
        let mut usable = self.keys.iter().filter(|k| k.usable_for(alg));
        match (usable.next(), usable.next()) {
            (Some(k), None) => Ok(k),
            (None, _) => Err(TokenError::KeyMismatch),
            (Some(_), Some(_)) => Err(TokenError::KidRequired),
        }
    }
}

/// Never: a PEM file is not a secret.
fn unreachable_secret() -> jsonwebtoken::errors::Result<DecodingKey> {
    Err(jsonwebtoken::errors::ErrorKind::InvalidKeyFormat.into())
}

/// A JWKS entry as a key, if this gateway can verify with it.
fn from_jwk(jwk: &Jwk) -> Option<VerifyKey> {
    if matches!(jwk.common.public_key_use, Some(PublicKeyUse::Encryption)) {
        return None;
    }
    let alg = match &jwk.common.key_algorithm {
        Some(a) => Some(Alg::of_name(serde_json::to_value(a).ok()?.as_str()?)?),
        None => None,
    };
    let kind = match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => KeyType::Rsa,
        AlgorithmParameters::EllipticCurve(p) => match p.curve {
            EllipticCurve::P256 => KeyType::P256,
            EllipticCurve::P384 => KeyType::P384,
            _ => return None,
        },
        AlgorithmParameters::OctetKeyPair(p) => match p.curve {
            EllipticCurve::Ed25519 => KeyType::Ed25519,
            _ => return None,
        },
        AlgorithmParameters::OctetKey(_) => KeyType::Secret,
    };
    if alg.is_some_and(|a| !kind.takes(a)) {
        return None;
    }
    Some(VerifyKey {
        kid: jwk.common.key_id.clone(),
        kind,
        alg,
        key: DecodingKey::from_jwk(jwk).ok()?,
    })
}

/// What a PEM public key is, from its SubjectPublicKeyInfo's algorithm (and curve).
fn pem_key_type(text: &[u8]) -> Option<KeyType> {
    let text = std::str::from_utf8(text).ok()?;
    if text.contains("-----BEGIN RSA PUBLIC KEY-----") {
        return Some(KeyType::Rsa);
    }
    let body: String = text
        .lines()
        .skip_while(|l| !l.starts_with("-----BEGIN PUBLIC KEY-----"))
        .skip(1)
        .take_while(|l| !l.starts_with("-----END"))
        .collect();
    let der = base64::engine::general_purpose::STANDARD
        .decode(body.trim())
        .ok()?;
    let has = |oid: &[u8]| der.windows(oid.len()).any(|w| w == oid);
    // The OIDs, DER-encoded: rsaEncryption, prime256v1, secp384r1, Ed25519.
    if has(&[6, 9, 0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 1, 1, 1]) {
        Some(KeyType::Rsa)
    } else if has(&[6, 8, 0x2a, 0x86, 0x48, 0xce, 0x3d, 3, 1, 7]) {
        Some(KeyType::P256)
    } else if has(&[6, 5, 0x2b, 0x81, 0x04, 0x00, 0x22]) {
        Some(KeyType::P384)
    } else if has(&[6, 3, 0x2b, 0x65, 0x70]) {
        Some(KeyType::Ed25519)
    } else {
        None
    }
}

/// Where a request carries its token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenFrom {
    /// `<header>: Bearer <token>` (RFC 6750 §2.1; the scheme in any case).
    Bearer(HeaderName),
    /// The cookie of this name.
    Cookie(String),
}

impl fmt::Display for TokenFrom {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenFrom::Bearer(h) => write!(f, "{h}: Bearer <token>"),
            TokenFrom::Cookie(c) => write!(f, "cookie {c}"),
        }
    }
}

/// Where the keys come from, as the file says (for `ratewall check` and reloads).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeysFrom {
    JwksFile(std::path::PathBuf),
    JwksUrl {
        url: String,
        refresh: Duration,
    },
    Pems(Vec<std::path::PathBuf>),
    /// The variable's name: its value is never kept here, nor shown.
    SecretEnv(String),
}

/// `[jwt]`, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub from: TokenFrom,
    pub algorithms: Vec<Alg>,
    pub keys_from: KeysFrom,
    /// Accepted `iss` values; empty: any.
    pub issuer: Vec<String>,
    /// Accepted `aud` values (one is enough); empty: any.
    pub audience: Vec<String>,
    /// Seconds of clock skew allowed on `exp` and `nbf`.
    pub leeway: u64,
    /// Claims every token must carry.
    pub required_claims: Vec<ClaimPath>,
    /// The claim whose value is the request's plan.
    pub plan_claim: Option<ClaimPath>,
    /// Claims sent to the backend as headers, after verification.
    pub forward_claims: Vec<(ClaimPath, HeaderName)>,
    /// Tokens a client address may fail before its tokens are refused unchecked
    /// (`failures`).
    pub failures: Allowance,
}

/// A token the verifier accepted: its claims, and until when (Unix seconds, leeway
/// included) it stays accepted.
#[derive(Debug)]
pub struct Verified {
    pub claims: Map<String, Value>,
    pub until: u64,
}

/// Why a token is refused: the `error_description` of its 401 (RFC 6750 §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenError {
    TooLong,
    Malformed,
    AlgorithmNotAllowed,
    KeyMismatch,
    UnknownKid,
    KidRequired,
    BadSignature,
    NoExpiry,
    Expired,
    NotYetValid,
    WrongIssuer,
    WrongAudience,
    MissingClaim,
    /// The header's `crit` names extensions the recipient must understand to accept the
    /// token (RFC 7515 §4.1.11), and ratewall understands none.
    Critical,
    /// A `crit` that is not a non-empty list of extension names: empty, not a list, or
    /// naming a header parameter RFC 7515 §4.1 defines (§4.1.11 forbids each).
    BadCritical,
    /// `b64: false` (RFC 7797): the payload is not base64url-encoded, and its signature
    /// covers other bytes than a JWS's. Not supported.
    UnencodedPayload,
    /// The token's header field, or its cookie, is sent more than once: a backend that
    /// reads another copy than the gateway would trust a token never verified.
    Repeated,
}

impl TokenError {
    pub fn reason(self) -> &'static str {
        match self {
            TokenError::TooLong => "the token is over 8 KiB",
            TokenError::Malformed => "the token is malformed",
            TokenError::AlgorithmNotAllowed => "the token's algorithm is not allowed",
            TokenError::KeyMismatch => "no key for the token's algorithm",
            TokenError::UnknownKid => "the token's key id (kid) is not known",
            TokenError::KidRequired => "the token names no key id (kid), and several keys fit",
            TokenError::BadSignature => "the token's signature is invalid",
            TokenError::NoExpiry => "the token has no exp claim",
            TokenError::Expired => "the token has expired",
            TokenError::NotYetValid => "the token is not valid yet (nbf)",
            TokenError::WrongIssuer => "the token's issuer is not accepted",
            TokenError::WrongAudience => "the token's audience is not accepted",
            TokenError::MissingClaim => "the token lacks a required claim",
            TokenError::Critical => {
                "the token marks extensions critical (crit) that this gateway does not understand"
            }
            TokenError::BadCritical => {
                "the token's crit header parameter is not a list of extension names"
            }
            TokenError::UnencodedPayload => {
                "the token's payload is unencoded (b64 false), which is not supported"
            }
            TokenError::Repeated => "the token's header or cookie is sent more than once",
        }
    }
}

impl fmt::Display for TokenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.reason())
    }
}

/// A token the verifier did not accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    Invalid(TokenError),
    /// No key set yet (a `jwks_url` never fetched): nothing can be verified.
    Unavailable,
}

/// A token's SHA-256: what the caches know it by.
pub fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// Unix seconds now, by the system's clock.
fn system_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// What the caches know of a token, by its SHA-256.
#[derive(Debug, Clone)]
pub enum Known {
    Accepted(Arc<Verified>),
    /// Refused a moment ago (or too long to read).
    Refused(TokenError),
    /// Never seen, or forgotten: only a signature check tells.
    Unknown,
}

/// Verifies tokens with [`Settings`] against the current [`KeySet`], and remembers the
/// ones it accepted and, for a while, the ones it refused.
pub struct Verifier {
    pub settings: Settings,
    keys: ArcSwapOption<KeySet>,
    cache: Accepted,
    refused: Rejected,
    /// The failures of each client address (`failures`): the request path charges it
    /// before a signature is checked.
    pub failures: Failures,
    /// Counts each signature check: accepted, refused (the gateway's metrics).
    checks: std::sync::OnceLock<[prometheus_client::metrics::counter::Counter; 2]>,
    /// Unix seconds now: injected in tests.
    now: fn() -> u64,
    /// When (Unix seconds) an unknown kid last asked for a new key set.
    refetch_asked: AtomicU64,
    /// Woken when an unknown kid asks for a new key set (`runtime::jwks` waits on it,
    /// holding only this, so that the verifier ends with its configuration).
    pub refetch: Arc<tokio::sync::Notify>,
}

impl fmt::Debug for Verifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Verifier")
            .field("settings", &self.settings)
            .field("keys", &self.keys.load())
            .finish_non_exhaustive()
    }
}

impl Verifier {
    /// A verifier with `keys` (none until a JWKS is fetched).
    pub fn new(settings: Settings, keys: Option<KeySet>) -> Verifier {
        Verifier::with_clock(settings, keys, system_now, CACHE_ENTRIES)
    }

    /// [`Verifier::new`] with the time and the cache's bound given.
    pub fn with_clock(
        settings: Settings,
        keys: Option<KeySet>,
        now: fn() -> u64,
        cache_entries: usize,
    ) -> Verifier {
        let failures = settings.failures;
        Verifier {
            settings,
            keys: ArcSwapOption::new(keys.map(Arc::new)),
            cache: Accepted::new(cache_entries),
            refused: Rejected::new(REFUSED_ENTRIES),
            failures: Failures::new(failures),
            checks: std::sync::OnceLock::new(),
            now,
            refetch_asked: AtomicU64::new(0),
            refetch: Arc::new(tokio::sync::Notify::new()),
        }
    }

    /// The current key set; none before the first fetch.
    pub fn keys(&self) -> Option<Arc<KeySet>> {
        self.keys.load_full()
    }

    /// Whether the keys come from a URL (fetched, refreshed).
    pub fn fetched(&self) -> bool {
        matches!(self.settings.keys_from, KeysFrom::JwksUrl { .. })
    }

    /// Serve `keys` from now on. A set other than the current one empties the cache:
    /// a token verified with a key no longer in the set is refused from now on.
    /// Whether the set changed.
    pub fn set_keys(&self, keys: KeySet) -> bool {
        if self
            .keys
            .load()
            .as_ref()
            .is_some_and(|k| k.material == keys.material)
        {
            return false;
        }
        self.keys.store(Some(Arc::new(keys)));
        self.cache.clear();
        self.refused.clear();
        true
    }

    /// How many verified tokens are remembered now.
    pub fn cached(&self) -> usize {
        self.cache.len()
    }

    /// The token `headers` carry where [`Settings::from`] says: none when absent (or,
    /// in the header, under another scheme than Bearer). The header sent twice, or the
    /// cookie named twice (in one `Cookie` field or across several), is
    /// [`TokenError::Repeated`] whatever the copies hold: the gateway would verify one and
    /// a backend might read another.
    pub fn token_of<'h>(&self, headers: &'h HeaderMap) -> Result<Option<&'h str>, TokenError> {
        match &self.settings.from {
            TokenFrom::Bearer(name) => {
                let mut values = headers.get_all(name).iter();
                let Some(v) = values.next() else {
                    return Ok(None);
                };
                if values.next().is_some() {
                    return Err(TokenError::Repeated);
                }
                let v = v.to_str().map_err(|_| TokenError::Malformed)?.trim();
                let Some((scheme, token)) = v.split_once(' ') else {
                    return Ok(None);
                };
                if !scheme.eq_ignore_ascii_case("bearer") {
                    return Ok(None);
                }
                match token.trim() {
                    "" => Ok(None),
                    t => Ok(Some(t)),
                }
            }
            TokenFrom::Cookie(name) => cookie(headers, name),
        }
    }

    /// `token`, verified: from the caches where it was judged a moment ago (accepted and
    /// still within its `exp`, or refused), else checked in full.
    pub fn verify(&self, token: &str) -> Result<Arc<Verified>, Failure> {
        let hash = digest(token);
        match self.known(token, &hash)? {
            Known::Accepted(v) => Ok(v),
            Known::Refused(e) => Err(Failure::Invalid(e)),
            Known::Unknown => self.check_unknown(token, hash),
        }
    }

    /// What the caches know of `token` (of SHA-256 `hash`, [`digest`]): no signature is
    /// checked.
    pub fn known(&self, token: &str, hash: &[u8; 32]) -> Result<Known, Failure> {
        if token.len() > MAX_TOKEN_BYTES {
            return Ok(Known::Refused(TokenError::TooLong));
        }
        let now = (self.now)();
        let keys = self.keys.load_full().ok_or(Failure::Unavailable)?;
        if let Some(v) = self.cache.get(hash, now, keys.generation) {
            return Ok(Known::Accepted(v));
        }
        if let Some(r) = self.refused.get(hash, now, keys.generation) {
            return Ok(Known::Refused(r.error));
        }
        Ok(Known::Unknown)
    }

    /// `token` (of SHA-256 `hash`), checked in full, and its verdict remembered: an
    /// acceptance until its `exp`, a refusal for [`REFUSED_FOR`] (one that is not valid
    /// yet, never: it may become so).
    pub fn check_unknown(&self, token: &str, hash: [u8; 32]) -> Result<Arc<Verified>, Failure> {
        let now = (self.now)();
        let keys = self.keys.load_full().ok_or(Failure::Unavailable)?;
        let checked = self.check(&keys, token, now);
        if let Some(c) = self.checks.get() {
            c[usize::from(checked.is_err())].inc();
        }
        let verified = match checked {
            Ok(v) => v,
            Err(e) => {
                if e == TokenError::UnknownKid {
                    self.ask_refetch(now);
                }
                if e != TokenError::NotYetValid {
                    let until = now.saturating_add(REFUSED_FOR.as_secs());
                    let refused = Refused { error: e, until };
                    self.refused.insert(hash, refused, now, keys.generation);
                }
                return Err(Failure::Invalid(e));
            }
        };
        let verified = Arc::new(verified);
        // Served from the cache only while `keys` is the current set.
        self.cache
            .insert(hash, verified.clone(), now, keys.generation);
        Ok(verified)
    }

    /// Count each signature check with `counters` (accepted, refused) from now on; a
    /// verifier kept across a reload keeps the ones it had.
    pub fn count_checks(&self, counters: [prometheus_client::metrics::counter::Counter; 2]) {
        let _ = self.checks.set(counters);
    }

    /// How many refused tokens are remembered now.
    pub fn refused(&self) -> usize {
        self.refused.len()
    }

    /// An unknown kid may mean the issuer rotated its keys: ask for a new set, at most
    /// once per [`REFETCH_EVERY`].
    fn ask_refetch(&self, now: u64) {
        if !self.fetched() {
            return;
        }
        let last = self.refetch_asked.load(Ordering::Relaxed);
        if last != 0 && now < last + REFETCH_EVERY.as_secs() {
            return;
        }
        if self
            .refetch_asked
            .compare_exchange(last, now.max(1), Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            self.refetch.notify_one();
        }
    }

    /// The whole check: shape, algorithm, key, signature, then the claims at `now`.
    fn check(&self, keys: &KeySet, token: &str, now: u64) -> Result<Verified, TokenError> {
        let (alg, kid) = header(token)?;
        let alg = Alg::of_name(&alg)
            .filter(|a| self.settings.algorithms.contains(a))
            .ok_or(TokenError::AlgorithmNotAllowed)?;
        let key = keys.pick(alg, kid.as_deref())?;
        // Times, issuer and audience are checked below, against the injected clock.
        let mut v = Validation::new(alg.algorithm());
        v.validate_exp = false;
        v.validate_nbf = false;
        v.validate_aud = false;
        v.required_spec_claims.clear();
        let data =
            jsonwebtoken::decode::<Map<String, Value>>(token, &key.key, &v).map_err(|e| match e
                .kind()
            {
                jsonwebtoken::errors::ErrorKind::InvalidSignature => TokenError::BadSignature,
                jsonwebtoken::errors::ErrorKind::InvalidAlgorithm => TokenError::KeyMismatch,
                _ => TokenError::Malformed,
            })?;
        let claims = data.claims;
        let s = &self.settings;
        let time = |name: &str| match claims.get(name) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|t| t.is_finite())
                .map(|t| Some(t.max(0.0) as u64))
                .ok_or(TokenError::Malformed),
        };
        let exp = time("exp")?.ok_or(TokenError::NoExpiry)?;
        let until = exp.saturating_add(s.leeway);
        if now >= until {
            return Err(TokenError::Expired);
        }
        if time("nbf")?.is_some_and(|nbf| now.saturating_add(s.leeway) < nbf) {
            return Err(TokenError::NotYetValid);
        }
        if !s.issuer.is_empty() {
            let iss = claims.get("iss").and_then(Value::as_str);
            if !iss.is_some_and(|i| s.issuer.iter().any(|x| x == i)) {
                return Err(TokenError::WrongIssuer);
            }
        }
        if !s.audience.is_empty() {
            let accepted = |a: &Value| {
                a.as_str()
                    .is_some_and(|a| s.audience.iter().any(|x| x == a))
            };
            let ok = match claims.get("aud") {
                Some(Value::Array(list)) => list.iter().any(accepted),
                Some(a) => accepted(a),
                None => false,
            };
            if !ok {
                return Err(TokenError::WrongAudience);
            }
        }
        if s.required_claims
            .iter()
            .any(|c| c.lookup(&claims).is_none_or(Value::is_null))
        {
            return Err(TokenError::MissingClaim);
        }
        Ok(Verified { claims, until })
    }

    /// The headers a verified token's claims give the backend (`forward_claims`): each
    /// claim with a value, as its text, where it makes a valid header value.
    pub fn forwarded(&self, verified: &Verified) -> Vec<(HeaderName, HeaderValue)> {
        self.settings
            .forward_claims
            .iter()
            .filter_map(|(claim, header)| {
                let text = claim.text(&verified.claims)?;
                Some((header.clone(), HeaderValue::from_str(&text).ok()?))
            })
            .collect()
    }
}

/// The value of cookie `name` among every `Cookie` field of `headers` (RFC 6265 §4.2.1:
/// `name=value` pairs split by `;`; HTTP/2 may send them in several fields, RFC 9113
/// §8.2.3), its quotes taken off; none where it is absent or empty. A pair's name is
/// compared with the spaces around it trimmed, and a pair without `=` counts as a name
/// (backends differ on both), the bytes as sent (a field that is not UTF-8 is read too):
/// the name found twice is [`TokenError::Repeated`].
fn cookie<'h>(headers: &'h HeaderMap, name: &str) -> Result<Option<&'h str>, TokenError> {
    let mut found: Option<&'h [u8]> = None;
    for field in headers.get_all(http::header::COOKIE) {
        for pair in field.as_bytes().split(|&b| b == b';') {
            let (k, value) = match pair.iter().position(|&b| b == b'=') {
                Some(eq) => (&pair[..eq], &pair[eq + 1..]),
                None => (pair, &[][..]),
            };
            if k.trim_ascii() != name.as_bytes() {
                continue;
            }
            if found.is_some() {
                return Err(TokenError::Repeated);
            }
            found = Some(value.trim_ascii());
        }
    }
    match found {
        None | Some([]) => Ok(None),
        Some(v) => {
            let v = std::str::from_utf8(v).map_err(|_| TokenError::Malformed)?;
            Ok(Some(v.trim_matches('"')).filter(|v| !v.is_empty()))
        }
    }
}

/// Header parameters RFC 7515 §4.1 defines: a `crit` may not name them (§4.1.11).
const REGISTERED_PARAMETERS: [&str; 11] = [
    "alg", "jku", "jwk", "kid", "x5u", "x5c", "x5t", "x5t#S256", "typ", "cty", "crit",
];

/// A token's header: its `alg` and `kid`, or why it is refused: [`TokenError::Malformed`]
/// when it is not three base64url parts with a JSON header; [`TokenError::Critical`] (or
/// [`TokenError::BadCritical`]) when it has a `crit`, since RFC 7515 §4.1.11 has a
/// recipient refuse a token naming critical extensions it does not understand, and this
/// gateway understands none; [`TokenError::UnencodedPayload`] for RFC 7797's `b64: false`.
fn header(token: &str) -> Result<(String, Option<String>), TokenError> {
    #[derive(serde::Deserialize)]
    struct Header {
        alg: String,
        kid: Option<String>,
        /// Present (`null` included) or not.
        #[serde(default, deserialize_with = "present")]
        crit: Option<Value>,
        #[serde(default, deserialize_with = "present")]
        b64: Option<Value>,
    }
    fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
        <Value as serde::Deserialize>::deserialize(d).map(Some)
    }
    let mut parts = token.split('.');
    let (Some(head), Some(_), Some(_), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(TokenError::Malformed);
    };
    let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(head)
        .map_err(|_| TokenError::Malformed)?;
    let h: Header = serde_json::from_slice(&json).map_err(|_| TokenError::Malformed)?;
    match h.b64 {
        // `true` is the default, said aloud.
        None | Some(Value::Bool(true)) => {}
        Some(Value::Bool(false)) => return Err(TokenError::UnencodedPayload),
        Some(_) => return Err(TokenError::Malformed),
    }
    if let Some(crit) = h.crit {
        let names = crit.as_array().filter(|names| !names.is_empty());
        let well_formed = names.is_some_and(|names| {
            names.iter().all(|n| {
                n.as_str()
                    .is_some_and(|n| !REGISTERED_PARAMETERS.contains(&n))
            })
        });
        return Err(match well_formed {
            true => TokenError::Critical,
            false => TokenError::BadCritical,
        });
    }
    Ok((h.alg, h.kid))
}

#[cfg(test)]
#[path = "jwt_tests.rs"]
mod tests;
