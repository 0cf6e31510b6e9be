//! `[jwt]`: where a request carries its bearer token, which algorithms and keys verify
//! it, which issuers and audiences are accepted, and what its claims give (a plan, headers
//! for the backend). Key files (`jwks_file`, `keys`) and the `secret_env` variable are read
//! with the config ([`super::Inputs`]), at every load, and their contents validated here; a
//! `jwks_url` is fetched by the running gateway (`runtime::jwks`), never by a load.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use http::header::HeaderName;
use serde::Deserialize;
use toml::Spanned;

use super::values::{Header, RawFailures};
use super::{Inputs, Invalid};
use crate::identity::jwt::{
    Alg, KeySet, KeyType, KeysFrom, Settings, TokenFrom, DEFAULT_FAILURES, DEFAULT_LEEWAY,
    DEFAULT_REFRESH,
};
use crate::identity::{ClaimPath, Verifier};
use crate::upstream::{Tls, TlsOptions};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawJwt {
    header: Option<Spanned<Header>>,
    cookie: Option<Spanned<String>>,
    algorithms: Spanned<Vec<Spanned<String>>>,
    jwks_file: Option<Spanned<String>>,
    jwks_url: Option<Spanned<String>>,
    jwks_ca: Option<Spanned<String>>,
    jwks_refresh: Option<Spanned<String>>,
    keys: Option<Spanned<Vec<String>>>,
    secret_env: Option<Spanned<String>>,
    issuer: Option<OneOrMany>,
    audience: Option<OneOrMany>,
    leeway: Option<Spanned<String>>,
    #[serde(default)]
    required_claims: Vec<Spanned<String>>,
    plan_claim: Option<Spanned<String>>,
    forward_claims: Option<Spanned<BTreeMap<String, String>>>,
    failures: Option<RawFailures>,
}

/// `issuer = "a"` or `issuer = ["a", "b"]`.
#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn list(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// `[jwt]`, validated: the verifier every request's token goes through, and where its
/// keys are fetched from, if they are.
#[derive(Debug)]
pub struct Jwt {
    pub verifier: Arc<Verifier>,
    pub fetch: Option<JwksFetch>,
}

/// A `jwks_url`: fetched over https at start, every `refresh`, and on an unknown kid.
#[derive(Debug)]
pub struct JwksFetch {
    pub url: http::Uri,
    /// Verified against `jwks_ca`, or the system's roots (the upstream client's TLS).
    pub tls: Arc<Tls>,
    pub refresh: Duration,
}

impl Jwt {
    /// Whether `other` verifies the same way with the same keys: a reload keeps the
    /// verifier, its fetched key set and its cache.
    pub fn same_as(&self, other: &Jwt) -> bool {
        let keys = |j: &Jwt| j.verifier.keys().map(|k| k.describe());
        self.verifier.settings == other.verifier.settings
            && match (&self.fetch, &other.fetch) {
                (Some(a), Some(b)) => *a.tls == *b.tls,
                (None, None) => keys(self) == keys(other),
                _ => false,
            }
    }

    /// `ratewall check`'s lines.
    pub fn describe(&self) -> String {
        let s = &self.verifier.settings;
        let algs: Vec<&str> = s.algorithms.iter().map(|a| a.name()).collect();
        let keys = match (&s.keys_from, self.verifier.keys()) {
            (KeysFrom::JwksUrl { url, refresh }, _) => format!(
                "jwks_url {url}, refreshed every {} and on an unknown kid (at most every 30s); not fetched by check",
                humantime::format_duration(*refresh)
            ),
            (KeysFrom::JwksFile(p), Some(k)) => format!("jwks_file {}: {}", p.display(), k.describe()),
            (KeysFrom::Pems(_), Some(k)) => format!("keys: {}", k.describe()),
            (KeysFrom::SecretEnv(v), _) => format!("secret from ${v}"),
            (_, None) => "no keys".to_string(),
        };
        let mut out = format!(
            "jwt           token from {}, algorithms {}, {keys}\n",
            s.from,
            algs.join(", ")
        );
        let any = |v: &[String]| match v.is_empty() {
            true => "any".to_string(),
            false => v.join(" | "),
        };
        out.push_str(&format!(
            "              issuer {}, audience {}, leeway {}s, exp required",
            any(&s.issuer),
            any(&s.audience),
            s.leeway
        ));
        if !s.required_claims.is_empty() {
            let c: Vec<&str> = s.required_claims.iter().map(|c| c.as_str()).collect();
            out.push_str(&format!(", required claims {}", c.join(", ")));
        }
        if let Some(p) = &s.plan_claim {
            out.push_str(&format!(", plan from claim {p}"));
        }
        for (claim, header) in &s.forward_claims {
            out.push_str(&format!(", claim {claim} forwarded as {header}"));
        }
        out.push('\n');
        out
    }
}

/// `[jwt] leeway` and `jwks_refresh`: a humantime duration (`leeway` may be zero).
fn duration(s: &Spanned<String>, key: &str, zero: bool) -> Result<Duration, Invalid> {
    let d = humantime::parse_duration(s.get_ref().trim())
        .map_err(|e| no(s, key, format!("invalid duration {:?}: {e}", s.get_ref())))?;
    if d.is_zero() && !zero {
        return Err(no(s, key, "must be above zero"));
    }
    Ok(d)
}

fn no<T>(at: &Spanned<T>, key: &str, message: impl Into<String>) -> Invalid {
    Invalid::new(Some(at.span()), format!("jwt.{key}"), message)
}

/// Headers a claim may not be forwarded as: they frame or route the request.
const RESERVED: &[&str] = &[
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "upgrade",
    "te",
    "trailer",
    "keep-alive",
    "proxy-connection",
];

impl RawJwt {
    /// The key files (`jwks_file`, `keys`), relative to `dir` (the config's folder).
    pub(super) fn files(&self, dir: &Path) -> Vec<std::path::PathBuf> {
        let listed = self.keys.iter().flat_map(|k| k.get_ref().iter());
        self.jwks_file
            .iter()
            .map(|f| f.get_ref())
            .chain(listed)
            .map(|p| dir.join(p.trim()))
            .collect()
    }

    /// The environment variable holding the HS secret (`secret_env`).
    pub(super) fn secret_env(&self) -> Option<&str> {
        self.secret_env.as_ref().map(|s| s.get_ref().trim())
    }

    /// `[jwt]`, validated, with its key files' contents and its secret from `inputs`
    /// (paths relative to `dir`, the config's folder).
    pub(super) fn validate(
        self,
        span: std::ops::Range<usize>,
        dir: &Path,
        inputs: &Inputs,
    ) -> Result<Jwt, Invalid> {
        let from = self.token_from()?;
        let algorithms = self.algorithms()?;
        self.one_key_source(span)?;
        self.no_key_confusion(&algorithms)?;
        self.url_keys_with_url()?;
        let (keys_from, keys, fetch) = self.keys(dir, inputs)?;
        if let Some(keys) = &keys {
            self.every_algorithm_verifiable(&algorithms, keys)?;
        }
        let forward_claims = self.forward_claims(&from)?;
        let claim = |s: &Spanned<String>, key: &str| {
            ClaimPath::parse(s.get_ref()).map_err(|m| no(s, key, m))
        };
        let settings = Settings {
            from,
            algorithms,
            keys_from,
            issuer: self.issuer.map(OneOrMany::list).unwrap_or_default(),
            audience: self.audience.map(OneOrMany::list).unwrap_or_default(),
            leeway: match &self.leeway {
                Some(l) => duration(l, "leeway", true)?.as_secs(),
                None => DEFAULT_LEEWAY.as_secs(),
            },
            required_claims: self
                .required_claims
                .iter()
                .map(|c| claim(c, "required_claims"))
                .collect::<Result<_, _>>()?,
            plan_claim: self
                .plan_claim
                .as_ref()
                .map(|c| claim(c, "plan_claim"))
                .transpose()?,
            forward_claims,
            failures: match &self.failures {
                Some(f) => f.allowance("jwt")?,
                None => DEFAULT_FAILURES,
            },
        };
        Ok(Jwt {
            verifier: Arc::new(Verifier::new(settings, keys)),
            fetch,
        })
    }

    /// `header` or `cookie` (not both): where a request carries its token.
    fn token_from(&self) -> Result<TokenFrom, Invalid> {
        Ok(match (&self.header, &self.cookie) {
            (Some(_), Some(c)) => {
                return Err(no(c, "cookie", "give header or cookie, not both"));
            }
            (_, Some(c)) if c.get_ref().trim().is_empty() => {
                return Err(no(c, "cookie", "the cookie's name is empty"));
            }
            (_, Some(c)) => TokenFrom::Cookie(c.get_ref().trim().to_string()),
            (Some(h), None) => TokenFrom::Bearer(h.get_ref().0.clone()),
            (None, None) => TokenFrom::Bearer(http::header::AUTHORIZATION),
        })
    }

    /// Exactly one of `jwks_file`, `jwks_url`, `keys`, `secret_env`; else the error is
    /// the table's (`span`).
    fn one_key_source(&self, span: std::ops::Range<usize>) -> Result<(), Invalid> {
        let sources = [
            ("jwks_file", self.jwks_file.is_some()),
            ("jwks_url", self.jwks_url.is_some()),
            ("keys", self.keys.is_some()),
            ("secret_env", self.secret_env.is_some()),
        ];
        let given: Vec<&str> = sources.iter().filter(|s| s.1).map(|s| s.0).collect();
        if given.len() == 1 {
            return Ok(());
        }
        Err(Invalid::new(
            Some(span),
            "jwt",
            format!(
                "give exactly one of jwks_file, jwks_url, keys or secret_env (the keys tokens are verified with); {}",
                match given.len() {
                    0 => "none is given".to_string(),
                    _ => format!("{} are given", given.join(", ")),
                }
            ),
        ))
    }

    /// HS algorithms alone and with a secret, or none of them and no secret: a shared
    /// secret beside public keys lets the holder of a public key sign tokens.
    fn no_key_confusion(&self, algorithms: &[Alg]) -> Result<(), Invalid> {
        let symmetric = algorithms.iter().filter(|a| a.is_symmetric()).count();
        if symmetric > 0 && (symmetric < algorithms.len() || self.keys.is_some()) {
            return Err(no(
                &self.algorithms,
                "algorithms",
                "an HS algorithm (a shared secret) beside public keys or asymmetric algorithms lets anyone holding the public key sign tokens (key confusion): list HS algorithms alone, with secret_env",
            ));
        }
        if let (Some(s), 0) = (&self.secret_env, symmetric) {
            return Err(no(
                s,
                "secret_env",
                "a secret verifies HS256, HS384 or HS512 only: list those in algorithms, or give public keys (jwks_url, jwks_file, keys)",
            ));
        }
        Ok(())
    }

    /// `jwks_ca` and `jwks_refresh` only beside a `jwks_url`.
    fn url_keys_with_url(&self) -> Result<(), Invalid> {
        for (key, set) in [
            ("jwks_ca", self.jwks_ca.as_ref().map(Spanned::span)),
            (
                "jwks_refresh",
                self.jwks_refresh.as_ref().map(Spanned::span),
            ),
        ] {
            if let (Some(span), None) = (set, &self.jwks_url) {
                return Err(Invalid::new(
                    Some(span),
                    format!("jwt.{key}"),
                    format!("{key} applies to jwks_url only"),
                ));
            }
        }
        Ok(())
    }

    /// Every algorithm listed has a key given that can verify it.
    fn every_algorithm_verifiable(&self, algorithms: &[Alg], keys: &KeySet) -> Result<(), Invalid> {
        for alg in algorithms {
            let usable = |(kind, fixed): (KeyType, Option<Alg>)| {
                kind.takes(*alg) && fixed.is_none_or(|f| f == *alg)
            };
            if !keys.kinds().any(usable) {
                return Err(no(
                    &self.algorithms,
                    "algorithms",
                    format!(
                        "no key given can verify {}: {}",
                        alg.name(),
                        keys.describe()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// `forward_claims`: each claim's path and the header it goes as, never one that
    /// frames the request or carries the token (`from`).
    fn forward_claims(&self, from: &TokenFrom) -> Result<Vec<(ClaimPath, HeaderName)>, Invalid> {
        let mut forward_claims = Vec::new();
        let Some(f) = &self.forward_claims else {
            return Ok(forward_claims);
        };
        for (c, h) in f.get_ref() {
            let path = ClaimPath::parse(c).map_err(|m| no(f, "forward_claims", m))?;
            let header = HeaderName::from_bytes(h.trim().as_bytes()).map_err(|_| {
                no(
                    f,
                    "forward_claims",
                    format!("invalid header name {h:?} for claim {c:?}"),
                )
            })?;
            let token_header = matches!(from, TokenFrom::Bearer(t) if *t == header);
            if RESERVED.contains(&header.as_str()) || token_header {
                return Err(no(
                    f,
                    "forward_claims",
                    format!("claim {c:?} cannot be forwarded as {header:?}: that header frames the request or carries the token"),
                ));
            }
            forward_claims.push((path, header));
        }
        Ok(forward_claims)
    }

    /// `algorithms`: a non-empty list of known names; never `none`.
    fn algorithms(&self) -> Result<Vec<Alg>, Invalid> {
        let names: Vec<&str> = Alg::ALL.iter().map(|a| a.name()).collect();
        let mut out = Vec::new();
        for a in self.algorithms.get_ref() {
            let name = a.get_ref().trim();
            let alg = Alg::of_name(name).ok_or_else(|| {
                let why = match name.eq_ignore_ascii_case("none") {
                    true => "\"none\" (an unsigned token) is never accepted".to_string(),
                    false => format!("unknown algorithm {name:?}"),
                };
                no(
                    a,
                    "algorithms",
                    format!("{why}: expected some of {}", names.join(", ")),
                )
            })?;
            if !out.contains(&alg) {
                out.push(alg);
            }
        }
        if out.is_empty() {
            return Err(no(
                &self.algorithms,
                "algorithms",
                format!(
                    "list the algorithms tokens are signed with: some of {}",
                    names.join(", ")
                ),
            ));
        }
        Ok(out)
    }

    /// Where the keys come from; the keys read now (none for a URL); the URL's fetch.
    fn keys(
        &self,
        dir: &Path,
        inputs: &Inputs,
    ) -> Result<(KeysFrom, Option<KeySet>, Option<JwksFetch>), Invalid> {
        let read = |span: std::ops::Range<usize>, key: &str, path: &str| {
            let file = dir.join(path.trim());
            inputs.contents(&file).map(|b| (file, b)).map_err(|e| {
                Invalid::new(
                    Some(span),
                    format!("jwt.{key}"),
                    format!("cannot read {path:?} (relative to this file's folder): {e}"),
                )
            })
        };
        if let Some(f) = &self.jwks_file {
            let (file, bytes) = read(f.span(), "jwks_file", f.get_ref())?;
            let keys = KeySet::from_jwks(&bytes)
                .map_err(|m| no(f, "jwks_file", format!("{}: {m}", f.get_ref())))?;
            return Ok((KeysFrom::JwksFile(file), Some(keys), None));
        }
        if let Some(k) = &self.keys {
            let mut pems = Vec::new();
            let mut paths = Vec::new();
            for path in k.get_ref() {
                let (file, bytes) = read(k.span(), "keys", path)?;
                paths.push(file);
                pems.push((path.clone(), bytes));
            }
            let keys = KeySet::from_pems(&pems).map_err(|m| no(k, "keys", m))?;
            return Ok((KeysFrom::Pems(paths), Some(keys), None));
        }
        if let Some(s) = &self.secret_env {
            let var = s.get_ref().trim();
            let secret = inputs.var(var).unwrap_or_default();
            if secret.is_empty() {
                return Err(no(
                    s,
                    "secret_env",
                    format!("the environment variable {var} is not set, or empty: it holds the HS secret"),
                ));
            }
            let keys = KeySet::from_secret(secret.as_bytes());
            return Ok((KeysFrom::SecretEnv(var.to_string()), Some(keys), None));
        }
        let Some(u) = &self.jwks_url else {
            return Err(Invalid::new(None, "jwt", "no key source"));
        };
        let url: http::Uri = u
            .get_ref()
            .trim()
            .parse()
            .map_err(|e| no(u, "jwks_url", format!("invalid URL {:?}: {e}", u.get_ref())))?;
        if url.scheme_str() != Some("https") || url.host().is_none() {
            return Err(no(
                u,
                "jwks_url",
                "jwks_url must be an https:// URL: keys fetched in cleartext could be anyone's",
            ));
        }
        let options = TlsOptions {
            ca: self.jwks_ca.as_ref().map(|c| dir.join(c.get_ref().trim())),
            ..TlsOptions::default()
        };
        let tls = crate::upstream::tls_for(&url, options)
            .map_err(|e| {
                let at = match e.key {
                    "ca" => self.jwks_ca.as_ref().unwrap_or(u),
                    _ => u,
                };
                no(
                    at,
                    if e.key == "ca" { "jwks_ca" } else { "jwks_url" },
                    e.message,
                )
            })?
            .ok_or_else(|| no(u, "jwks_url", "jwks_url must be https://"))?;
        let refresh = match &self.jwks_refresh {
            Some(r) => duration(r, "jwks_refresh", false)?,
            None => DEFAULT_REFRESH,
        };
        let keys_from = KeysFrom::JwksUrl {
            url: u.get_ref().trim().to_string(),
            refresh,
        };
        Ok((keys_from, None, Some(JwksFetch { url, tls, refresh })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(jwt: &str) -> Result<crate::config::Config, String> {
        let text = format!(
            "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\nurl = \"http://127.0.0.1:2\"\n[jwt]\n{jwt}\n\
             [[rules]]\nname = \"u\"\nkey = \"jwt:sub\"\nrate = \"1/s\"\n"
        );
        let inputs = Inputs::default().env("RATEWALL_TEST_JWT_SECRET", "s3cret");
        crate::config::Config::parse_with(&text, Path::new("t.toml"), &inputs)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn jwt_settings_are_validated_at_load() {
        let err = |jwt: &str, says: &str| {
            let e = parse(jwt)
                .err()
                .unwrap_or_else(|| panic!("{jwt}: accepted"));
            assert!(e.contains(says), "{jwt}: {e}");
        };
        let ok = "algorithms = [\"HS256\"]\nsecret_env = \"RATEWALL_TEST_JWT_SECRET\"";
        let cfg = parse(ok).expect("a valid [jwt]");
        let jwt = cfg.jwt.as_ref().expect("[jwt]");
        assert_eq!(jwt.verifier.settings.leeway, 30);
        assert_eq!(
            jwt.verifier.settings.from,
            TokenFrom::Bearer(http::header::AUTHORIZATION)
        );
        err(
            "algorithms = [\"none\"]\nsecret_env = \"X\"",
            "never accepted",
        );
        err(
            "algorithms = [\"RS257\"]\njwks_url = \"https://a.test/k\"",
            "unknown algorithm \"RS257\": expected some of RS256",
        );
        err(
            "algorithms = []\njwks_url = \"https://a.test/k\"",
            "list the algorithms",
        );
        err(
            "algorithms = [\"HS256\", \"RS256\"]\njwks_url = \"https://a.test/k\"",
            "key confusion",
        );
        err(
            "algorithms = [\"RS256\"]\nsecret_env = \"RATEWALL_TEST_JWT_SECRET\"",
            "a secret verifies HS256",
        );
        err(
            "algorithms = [\"HS256\"]\nsecret_env = \"RATEWALL_TEST_UNSET_VARIABLE\"",
            "is not set, or empty",
        );
        err(
            "algorithms = [\"RS256\"]\njwks_url = \"http://a.test/k\"",
            "must be an https:// URL",
        );
        err("algorithms = [\"RS256\"]", "give exactly one of");
        err(
            "algorithms = [\"RS256\"]\njwks_url = \"https://a.test/k\"\njwks_file = \"k.json\"",
            "jwks_file, jwks_url are given",
        );
        err(
            "algorithms = [\"RS256\"]\njwks_file = \"nowhere.json\"",
            "cannot read \"nowhere.json\"",
        );
        err(
            &format!("{ok}\njwks_ca = \"ca.pem\""),
            "jwks_ca applies to jwks_url only",
        );
        err(
            &format!("{ok}\nforward_claims = {{ sub = \"host\" }}"),
            "cannot be forwarded",
        );
        err(
            &format!("{ok}\nforward_claims = {{ sub = \"bad header\" }}"),
            "invalid header name",
        );
        err(
            &format!("{ok}\nplan_claim = \"a..b\""),
            "invalid claim path",
        );
        err(
            &format!("{ok}\nheader = \"x-token\"\ncookie = \"t\""),
            "not both",
        );
        err(
            &format!("{ok}\nalgorithm = \"HS256\""),
            "unknown field `algorithm`",
        );
    }

    #[test]
    fn a_jwt_rule_needs_the_jwt_table_and_a_combined_key_two_distinct_parts() {
        let rules = |key: &str| {
            crate::config::Config::parse(
                &format!(
                    "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\nurl = \"http://127.0.0.1:2\"\n\
                     [[rules]]\nname = \"u\"\nkey = {key}\nrate = \"1/s\"\n"
                ),
                Path::new("t.toml"),
            )
            .map(|c| c.rules[0].key.kind.clone())
            .map_err(|e| e.to_string())
        };
        assert!(rules("\"jwt:sub\"")
            .unwrap_err()
            .contains("needs a [jwt] table"));
        assert!(rules("[\"header:x-a\"]")
            .unwrap_err()
            .contains("two or more"));
        assert!(rules("[\"header:x-a\", \"header:X-A\"]")
            .unwrap_err()
            .contains("twice"));
        assert!(rules("[\"api_key\", [\"client_ip\"]]").is_err());
        let kind = rules("[\"api_key\", \"header:x-project\"]").unwrap();
        assert_eq!(kind.to_string(), "[\"api_key\", \"header:x-project\"]");
    }
}
