//! `config/limits.toml`: raw serde structs (every table `deny_unknown_fields`), then
//! [`Config::parse`] validates them into immutable, typed values that cannot be wrong.
//! The types live with their meaning (a rule in [`crate::rules`], a quota in
//! [`crate::limiter`], an API key's settings in [`crate::identity`], the upstream's in
//! [`crate::upstream`]); this module only parses, validates into them, and reports errors.
//! One file per table; each setting's default is written once, with the type it
//! configures.
//!
//! [`Config::load`] reads the file, the environment variables and the files it names (the
//! keys file, `[server.tls]`'s certificates, `[jwt]`'s keys) into [`Inputs`], and
//! [`Config::parse_with`] validates the text with them; [`Config::parse`], with none.
//! Still read while validating, outside this module: an https:// upstream's or
//! `jwks_url`'s `ca`, `cert` and `key` (or the system's roots), by
//! [`crate::upstream::tls_for`]; and the process's open-file limit and CPU count, which
//! `max_connections`' and `workers`' defaults follow.
//!
//! Value-level checks (a rate, a CIDR, a duration) run inside deserialisation
//! (`values.rs`), so their errors carry the line and column of the offending value;
//! cross-field checks (burst against cost, duplicate rule names) point at the rule's table.

pub mod decide;
mod descriptors; // issue 44 (rls): [[descriptors]] and the tree they make
mod diff;
pub mod egress;
pub mod envoy_yaml; // issue 44 (rls): [decide] envoy_config, envoyproxy/ratelimit's YAML
mod inputs;
mod jwt;
mod keys;
mod matching;
mod overload;
mod overrides;
mod routes;
mod rules;
mod server;
mod store;
mod suggest;
mod tls;
mod upstream;
mod values;
mod wording;

use std::collections::{BTreeSet, HashSet};
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Deserialize;
use toml::Spanned;

use crate::headers::ResponseStyle;
use crate::identity::{ClientIp, KeyKind, Keys};
use crate::limiter::store as store_settings;
use crate::rules::{Routes, Rule, RuleIndex};

pub use descriptors::{
    Descriptors, Leaf, Level, Limit, Node, Pattern, Unit, Wildcard, REMOTE_ADDRESS,
};
pub use diff::{Changes, Listed, Named};
pub use inputs::Inputs;
pub use jwt::{JwksFetch, Jwt};
pub use keys::{reread_keys_file, write_keys_file};
pub use overrides::{Given, OverrideError, Overrides, Source};
pub use rules::{DEFAULT_LEASE_TTL, DEFAULT_MAX_WAITING, MAX_DELAY};
pub use server::{
    derive_max_connections, open_files_limit, Admin, Log, Server, BACKLOG, MAX_CONNECTIONS,
    MAX_HEADER_BYTES, RESERVED_DESCRIPTORS, SHUTDOWN_GRACE,
};
pub use upstream::PoolDefaults;
pub use values::TagSecret;

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
    /// A setting the environment gives that is not valid (its value is not repeated: it
    /// may be a secret).
    #[error("{variable}: {message}")]
    Environment {
        variable: &'static str,
        message: String,
    },
}

/// The validated configuration. Built once per load and shared behind an `Arc`.
#[derive(Debug)]
pub struct Config {
    pub server: Server,
    pub admin: Admin,
    /// Every pool (`[upstream] url` and `[[upstreams]]`), the pool `default` first if there
    /// is one, then in the file's order. Never empty.
    pub upstreams: Vec<crate::upstream::PoolSettings>,
    /// What a pool `--upstream` makes (where the file has no pool `default`) takes.
    pub pool_defaults: PoolDefaults,
    /// `[[routes]]`, compiled: each names a pool by its position in `upstreams`.
    pub routes: Routes,
    pub store: store_settings::Settings,
    pub client_ip: ClientIp,
    pub keys: Keys,
    /// `[jwt]`: how bearer tokens are verified, where a rule counts by a claim.
    pub jwt: Option<Jwt>,
    pub response: ResponseStyle,
    /// `[log]`: what the access log says.
    pub log: Log,
    pub rules: Vec<Rule>,
    /// `rules`, precompiled for matching (see [`RuleIndex`]).
    pub index: RuleIndex,
    /// issue 44 (rls): what Envoy's rate limit service calls map to (`[[descriptors]]`,
    /// `[decide] envoy_config`), per domain.
    pub descriptors: Descriptors,
    /// `[decide]`: the decision service's listener; none where the file has no such table.
    pub decide: Option<decide::Decide>,
    /// `[egress]`: the egress gateway's listener and targets (issue 45); none where the
    /// file has no such table.
    pub egress: Option<egress::Egress>,
    /// The SHA-256 (hex) of the file's text, as `sha256sum` prints it: which file is
    /// serving, on the status page. (The keys file it names is not included.)
    pub sha256: Option<String>,
}

/// `bytes`' SHA-256 in lower-case hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    crate::identity::directory::hex(&crate::identity::sha256(bytes))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    server: server::RawServer,
    #[serde(default)]
    admin: server::RawAdmin,
    upstream: Option<Spanned<upstream::RawUpstream>>,
    #[serde(default)]
    upstreams: Vec<Spanned<upstream::RawPool>>,
    #[serde(default)]
    routes: Vec<Spanned<routes::RawRoute>>,
    store: Option<Spanned<store::RawStore>>,
    #[serde(default)]
    client_ip: keys::RawClientIp,
    #[serde(default)]
    keys: keys::RawKeys,
    jwt: Option<Spanned<jwt::RawJwt>>,
    #[serde(default)]
    response: server::RawResponse,
    #[serde(default)]
    log: server::RawLog,
    #[serde(default)]
    rules: Vec<Spanned<rules::RawRule>>,
    /// issue 44 (rls): `[[descriptors]]`, Envoy RLS descriptors -> rules.
    #[serde(default)]
    descriptors: Vec<Spanned<descriptors::RawDescriptors>>,
    decide: Option<Spanned<decide::RawDecide>>,
    egress: Option<Spanned<egress::RawEgress>>,
}

/// The plans some rule has a `[rules.plans.<plan>]` table for: the only plans a key may
/// be given.
fn defined_plans(rules: &[Spanned<rules::RawRule>]) -> BTreeSet<&str> {
    rules
        .iter()
        .flat_map(|r| r.get_ref().plan_names())
        .collect()
}

/// A value the file has wrong: where (a byte span of the file), under which key, and why.
struct Invalid {
    span: Option<Range<usize>>,
    key: String,
    message: String,
}

impl Invalid {
    fn new(span: Option<Range<usize>>, key: impl Into<String>, message: impl Into<String>) -> Self {
        Invalid {
            span,
            key: key.into(),
            message: message.into(),
        }
    }

    /// The error, with the line and column of the span in `text` (the file at `path`).
    fn locate(self, text: &str, path: &Path) -> ConfigError {
        let (line, column) = line_col(text, self.span.map_or(0, |s| s.start));
        ConfigError::Invalid {
            path: path.to_owned(),
            line,
            column,
            key: self.key,
            message: self.message,
        }
    }
}

/// The folder of the file at `path`, which the files it names are relative to.
fn folder(path: &Path) -> &Path {
    path.parent().unwrap_or(Path::new(""))
}

fn read(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })
}

/// `text` (the file at `path`) as a `T`, or the first error, located. `plans`: the key path
/// under which table keys are API keys, to be kept out of the message.
fn from_toml<T: DeserializeOwned>(text: &str, path: &Path, plans: &str) -> Result<T, ConfigError> {
    let de = toml::Deserializer::parse(text)
        .map_err(|e| Invalid::new(e.span(), "(document)", e.message().trim()).locate(text, path))?;
    serde_path_to_error::deserialize(de).map_err(|e| {
        let key = match e
            .path()
            .to_string()
            .replace(".$__serde_spanned_private_value", "")
        {
            k if k == "." => "(top level)".to_string(),
            k => redact_key(k, plans),
        };
        let inner = e.into_inner();
        let said = inner.message().trim();
        let message =
            wording::in_own_words(&key, said).unwrap_or_else(|| suggest::with_suggestion(said));
        Invalid::new(inner.span(), key, message).locate(text, path)
    })
}

/// With `underscores_in_headers = false`, fields whose name has `_` are dropped before
/// anything reads them: a key header or a rule's `header:<name>` with one would never be
/// seen, and every request would look as if it did not carry it. Refused at load.
fn underscored_names<'a>(
    key_header: &http::HeaderName,
    rules: &'a [Rule],
    raw: &[toml::Spanned<rules::RawRule>],
) -> Result<(), Invalid> {
    let why = |name: &http::HeaderName| {
        format!(
            "the header {name:?} has an underscore, and such fields are dropped (underscores_in_headers = false): no request would carry it; rename it, or set [server] underscores_in_headers = true"
        )
    };
    if key_header.as_str().contains('_') {
        return Err(Invalid::new(None, "keys.header", why(key_header)));
    }
    for (i, (rule, spanned)) in rules.iter().zip(raw).enumerate() {
        let underscored = |k: &'a KeyKind| match k {
            KeyKind::Header(h) if h.as_str().contains('_') => Some((h, "key")),
            _ => None,
        };
        let by_key = match &rule.key.kind {
            KeyKind::Combined(parts) => parts.iter().find_map(underscored),
            kind => underscored(kind),
        };
        let by_match = rule.matcher.carrying.iter().find_map(|c| match &c.carried {
            crate::identity::Carried::Header(h) => Some((h, "match")),
            crate::identity::Carried::ApiKey => None,
        });
        if let Some((h, what)) = by_key
            .or(by_match)
            .filter(|(h, _)| h.as_str().contains('_'))
        {
            return Err(Invalid::new(
                Some(spanned.span()),
                format!("rules[{i}].{what}"),
                why(h),
            ));
        }
    }
    Ok(())
}

impl Config {
    /// The backend as the start line and `ratewall check` name it: the first pool's
    /// (the pool `default`, where there is one, is first) first server, with its pool's
    /// clocks.
    pub fn upstream(&self) -> crate::upstream::Settings {
        let pool = &self.upstreams[0];
        let server = &pool.servers[0];
        crate::upstream::Settings {
            url: server.url.clone(),
            tls: server.tls.clone(),
            base_path: server.base_path.clone(),
            connect_timeout: pool.connect_timeout,
            timeout: pool.timeout,
        }
    }

    /// Read and validate the file at `path`, with the environment's settings and the
    /// files it names (see [`Inputs`]).
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Config::load_text(&read(path)?, path)
    }

    /// Validate `text` as [`Config::load`] does the file at `path`: with the environment
    /// variables and the files it names, read now.
    pub fn load_text(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let raw: RawConfig = from_toml(text, path, "keys.plans.")?;
        let inputs = Inputs::read(&raw, folder(path));
        Config::parse_with(text, path, &inputs)
    }

    /// Validate `text` alone: no environment, and no file it names (a keys file, a
    /// certificate) can be read. `path` only names the file in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        Config::parse_with(text, path, &Inputs::default())
    }

    /// Validate `text` with `inputs`: the environment's settings and the contents of the
    /// files it names, relative to `path`'s folder. Reads nothing itself.
    pub fn parse_with(text: &str, path: &Path, inputs: &Inputs) -> Result<Config, ConfigError> {
        let mut raw: RawConfig = from_toml(text, path, "keys.plans.")?;
        let raw_decide = raw.decide.take();
        let raw_egress = raw.egress.take();
        let env_token = server::env_admin_token(inputs.var("RATEWALL_ADMIN_TOKEN"))?;
        let env_tag_secret = server::env_tag_secret(inputs.var("RATEWALL_TAG_SECRET"))?;
        let env_decide_token = server::env_decide_token(inputs.var("RATEWALL_DECIDE_TOKEN"))?;
        let defined = defined_plans(&raw.rules);
        let dir = folder(path);
        let keys_file = match &raw.keys.file {
            Some(f) => {
                let file = dir.join(f.get_ref().trim());
                let listed = inputs
                    .text(&file)
                    .map_err(|source| ConfigError::Read {
                        path: file.clone(),
                        source,
                    })
                    .and_then(|text| keys::keys_file_entries(&text, &file, &defined))
                    .map_err(|e| match e {
                        // A missing keys file is the config's error: point at `file =`.
                        ConfigError::Read { source, .. } => Invalid::new(
                            Some(f.span()),
                            "keys.file",
                            format!(
                                "cannot read the keys file {:?} (relative to this file's folder): {source}",
                                f.get_ref()
                            ),
                        )
                        .locate(text, path),
                        e => e,
                    })?;
                Some((file, listed))
            }
            None => None,
        };
        let tls = match &raw.server.tls {
            Some(t) => Some(t.build(dir, inputs).map_err(|e| e.locate(text, path))?),
            None => None,
        };
        // issue 44 (rls): `[decide] envoy_config`, envoyproxy/ratelimit's YAML, read as rules.
        let envoy =
            envoy_yaml::read(raw_decide.as_ref(), dir, inputs).map_err(|e| e.locate(text, path))?;
        let mut config = Config::validate(raw, keys_file, tls, env_token, dir, inputs, envoy)
            .map_err(|e| e.locate(text, path))?;
        if let Some(d) = raw_decide {
            let span = d.span();
            let decide = d
                .into_inner()
                .validate(env_decide_token, config.server.tls.is_some())
                .map_err(|e| e.locate(text, path))?;
            let whose = "the decision service listens on its own, never the proxy's or the admin's";
            config
                .own_listener(decide.listen, span, "decide.listen", whose)
                .map_err(|e| e.locate(text, path))?;
            config.decide = Some(decide);
        }
        if let Some(e) = raw_egress {
            let span = e.span();
            let egress = e
                .into_inner()
                .validate(dir)
                .map_err(|e| e.locate(text, path))?;
            let whose = "the egress gateway listens on its own";
            config
                .own_listener(egress.listen, span, "egress.listen", whose)
                .map_err(|e| e.locate(text, path))?;
            config.egress = Some(egress);
        }
        config.sha256 = Some(sha256_hex(text.as_bytes()));
        // `RATEWALL_TAG_SECRET` wins over the file's.
        if env_tag_secret.is_some() {
            config.server.tag_secret = env_tag_secret;
        }
        Ok(config)
    }

    /// `addr` refused where another listener of the file (the proxy's, its TLS one, the
    /// admin's, the decision service's) has it already: a listener of its own is one.
    fn own_listener(
        &self,
        addr: std::net::SocketAddr,
        span: Range<usize>,
        key: &str,
        whose: &str,
    ) -> Result<(), Invalid> {
        let taken = [
            Some(self.server.listen),
            self.server.admin_listen,
            self.server.tls.as_ref().map(|t| t.listen),
            self.decide.as_ref().map(|d| d.listen),
        ];
        if taken.contains(&Some(addr)) {
            let why = format!("{addr} is another listener's: {whose}");
            return Err(Invalid::new(Some(span), key, why));
        }
        Ok(())
    }

    fn validate(
        raw: RawConfig,
        keys_file: Option<(
            PathBuf,
            std::collections::HashMap<[u8; 32], crate::identity::directory::Entry>,
        )>,
        tls: Option<crate::tls::Settings>,
        env_token: Option<values::AdminToken>,
        dir: &Path,
        inputs: &Inputs,
        // issue 44 (rls): `[decide] envoy_config`'s file, read.
        envoy: Option<envoy_yaml::Domains>,
    ) -> Result<Config, Invalid> {
        let store = match raw.store {
            Some(s) => {
                let span = s.span();
                s.into_inner().validate(Some(span))?
            }
            None => store::RawStore::default().validate(None)?,
        };
        let defined = defined_plans(&raw.rules);
        let shared = !matches!(store.backend, crate::limiter::store::Backend::Memory);
        let keys = raw.keys.validate(keys_file, &defined, shared)?;
        let jwt = match raw.jwt {
            Some(j) => {
                let span = j.span();
                Some(j.into_inner().validate(span, dir, inputs)?)
            }
            None => None,
        };
        drop(defined);
        let client_certs = tls.as_ref().is_some_and(|t| t.client_auth.is_some());
        let (upstreams, pool_defaults) =
            upstream::validate(raw.upstream.as_ref(), &raw.upstreams, dir, client_certs)?;
        let path_case = raw.server.path_case();
        let routes = routes::validate(&raw.routes, &upstreams, &keys.header, path_case)?;
        let route_names = routes::written_names(&raw.routes);
        let mut names = HashSet::new();
        let mut rules = Vec::with_capacity(raw.rules.len());
        // The attempts ceilings of rules that refund by status: after the file's rules, so
        // that a rule's position is its place in the file.
        let mut ceilings: Vec<(usize, Rule)> = Vec::new();
        for (i, spanned) in raw.rules.iter().enumerate() {
            let r = spanned.get_ref();
            let name = r.name.get_ref().0.as_str();
            if !names.insert(name) {
                return Err(Invalid::new(
                    Some(r.name.span()),
                    format!("rules[{i}].name"),
                    format!("duplicate rule name {name:?}"),
                ));
            }
            let (rule, ceiling) = r.validate(i, spanned.span(), &keys.header, &route_names)?;
            rules.push(rule);
            ceilings.extend(ceiling.map(|c| (i, c)));
            if rules[i].key.kind.uses_jwt() && jwt.is_none() {
                return Err(Invalid::new(
                    Some(spanned.span()),
                    format!("rules[{i}].key"),
                    format!(
                        "key = {} counts by a token claim: it needs a [jwt] table (its algorithms and keys)",
                        match &rules[i].key.kind {
                            KeyKind::Jwt(p) => format!("\"jwt:{p}\""),
                            kind => kind.to_string(),
                        }
                    ),
                ));
            }
            if rules[i].key.kind.uses(&KeyKind::ClientCert)
                && tls.as_ref().is_none_or(|t| t.client_auth.is_none())
            {
                return Err(Invalid::new(
                    Some(spanned.span()),
                    format!("rules[{i}].key"),
                    "key = \"client_cert\" needs client certificates: [server.tls] with client_ca",
                ));
            }
        }
        for (i, ceiling) in ceilings {
            if names.contains(ceiling.name.as_str()) {
                let r = raw.rules[i].get_ref();
                return Err(Invalid::new(
                    Some(r.name.span()),
                    format!("rules[{i}].charge.attempts"),
                    format!(
                        "the attempts ceiling of rule {:?} is the rule {:?}, and the file has a rule of that name already: rename one",
                        r.name.get_ref().0,
                        ceiling.name
                    ),
                ));
            }
            rules.push(ceiling);
        }
        let server = raw.server.validate(tls);
        if !server.underscores_in_headers {
            underscored_names(&keys.header, &rules, &raw.rules)?;
        }
        // issue 44 (rls): the YAML's limits are rules of their own, appended.
        let descriptors = descriptors::validate(&raw.descriptors, envoy, &mut rules, &keys.header)?;
        let index = RuleIndex::new(rules.iter().map(|r| &r.matcher), server.path_case);
        Ok(Config {
            admin: raw.admin.validate(env_token),
            server,
            upstreams,
            pool_defaults,
            routes,
            store,
            client_ip: raw.client_ip.validate(),
            keys,
            jwt,
            response: raw.response.headers,
            log: raw.log.validate(),
            rules,
            index,
            descriptors,
            decide: None,
            egress: None,
            sha256: None,
        })
    }

    /// What requests `rule` applies to, as `ratewall check` and the status page say it:
    /// its match, then the route it is limited to (`every request, route billing`).
    pub fn applies_to(&self, rule: &Rule) -> String {
        let mut when = rule.matcher.describe();
        if let Some(route) = rule.matcher.route.and_then(|i| self.routes.list.get(i)) {
            when.push_str(", route ");
            when.push_str(&route.name);
        }
        when
    }
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
    use crate::limiter::store::Backend;
    use crate::limiter::{Algorithm, OnError};
    use std::time::Duration;

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
    fn a_rule_may_limit_the_messages_of_the_sockets_it_admits() {
        use crate::rules::Messages;
        let cfg = parse(
            "[[rules]]\nname = \"chat\"\nkey = \"client_ip\"\nrate = \"5/s\"\n\
             messages = { rate = \"50/s\", burst = 100 }\n\
             [[rules]]\nname = \"sockets\"\nkey = \"client_ip\"\nmax_in_flight = 2\n\
             messages = { rate = \"10/m\" }\n\
             [[rules]]\nname = \"plain\"\nkey = \"global\"\nrate = \"5/s\"\n",
        )
        .unwrap();
        let m = |i: usize| cfg.rules[i].messages;
        assert_eq!(
            m(0),
            Some(Messages {
                rate: crate::limiter::Rate::parse("50/s").unwrap(),
                burst: 100,
                max_bytes: None,
            })
        );
        assert_eq!(m(1).map(|m| m.burst), Some(10), "burst: the rate's N");
        assert_eq!(m(2), None);
        let shown = crate::cli::describe(&cfg);
        assert!(
            shown
                .contains("WebSocket data frames 50/s, burst 100, per identity across its sockets"),
            "{shown}"
        );
        assert!(
            shown.contains("WebSocket data frames 10/m, burst 10,"),
            "{shown}"
        );
    }

    #[test]
    fn a_bad_messages_limit_names_its_key() {
        let rule = |m: &str| {
            format!(
                "[[rules]]\nname = \"chat\"\nkey = \"client_ip\"\nrate = \"5/s\"\nmessages = {m}\n"
            )
        };
        for (messages, key, says) in [
            (
                "{ rate = \"fast\" }",
                "rules[0].messages.rate",
                "invalid rate",
            ),
            ("{ rate = \"0/s\" }", "rules[0].messages.rate", "at least 1"),
            (
                "{ rate = \"5/s\", burst = 0 }",
                "rules[0].messages.burst",
                "",
            ),
            ("{ burst = 5 }", "rules[0].messages", "missing field `rate`"),
            (
                "{ rate = \"5/s\", brust = 5 }",
                "rules[0].messages.brust",
                "unknown field",
            ),
            (
                "{ rate = \"1/d\", burst = 4503599627370496 }",
                "rules[0].messages.burst",
                "precision",
            ),
            ("\"50/s\"", "rules[0].messages", ""),
        ] {
            let (_, _, k, message) = err(&rule(messages));
            assert_eq!(k, key, "{messages}: {message}");
            assert!(message.contains(says), "{messages}: {message}");
        }
    }

    #[test]
    fn a_rule_may_bound_its_sockets_message_size_and_payload_bytes() {
        use crate::limiter::Rate;
        use crate::rules::Bytes;
        let cfg = parse(
            "[[rules]]\nname = \"chat\"\nkey = \"client_ip\"\nrate = \"5/s\"\n\
             messages = { rate = \"50/s\", max_bytes = \"1MiB\" }\n\
             bytes = { rate = \"1MiB/s\", burst = \"4MiB\" }\n\
             [[rules]]\nname = \"sockets\"\nkey = \"client_ip\"\nmax_in_flight = 2\n\
             bytes = { rate = \"512KiB/10s\" }\n\
             [[rules]]\nname = \"plain\"\nkey = \"global\"\nrate = \"5/s\"\n\
             messages = { rate = \"5/s\", max_bytes = 4096 }\n",
        )
        .unwrap();
        let r = &cfg.rules;
        assert_eq!(r[0].messages.and_then(|m| m.max_bytes), Some(1 << 20));
        assert_eq!(
            r[0].bytes,
            Some(Bytes {
                rate: Rate::every(1 << 20, Duration::from_secs(1)),
                burst: 4 << 20,
            })
        );
        assert_eq!(
            r[1].bytes,
            Some(Bytes {
                rate: Rate::every(512 << 10, Duration::from_secs(10)),
                burst: 512 << 10,
            }),
            "burst: the rate's bytes"
        );
        assert_eq!(r[1].messages, None);
        assert_eq!(r[2].messages.and_then(|m| m.max_bytes), Some(4096));
        assert_eq!(r[2].bytes, None);
        let shown = crate::cli::describe(&cfg);
        for says in [
            "WebSocket messages at most 1048576 bytes",
            "WebSocket payload bytes 1048576/s, burst 4194304, per identity across its sockets (as sent)",
            "WebSocket payload bytes 524288/10s, burst 524288,",
        ] {
            assert!(shown.contains(says), "{says}: {shown}");
        }
    }

    #[test]
    fn a_bad_size_or_byte_limit_names_its_key() {
        // The line, the key blamed (under rules[0]), what the message says.
        let cases = r#"
            messages = { rate = "5/s", max_bytes = 0 }        | messages.max_bytes | at least 1 byte
            messages = { rate = "5/s", max_bytes = "1MB" }    | messages.max_bytes | write KiB or MiB
            messages = { rate = "5/s", max_bytes = -1 }       | messages.max_bytes | below zero
            bytes = { rate = "fast" }                         | bytes.rate  | expected a size per period
            bytes = { rate = "1MB/s" }                        | bytes.rate  | write KiB or MiB
            bytes = { rate = "0/s" }                          | bytes.rate  | at least 1 byte per period
            bytes = { rate = "1MiB/month" }                   | bytes.rate  | is not one of s, m, h, d
            bytes = { rate = "1MiB/sec" }                     | bytes.rate  | is not one of s, m, h, d
            bytes = { rate = "1MiB/s", burst = 0 }            | bytes.burst | at least 1 byte
            bytes = { rate = "1MiB/s", brust = 5 }            | bytes.brust | unknown field
            bytes = { burst = 5 }                             | bytes       | missing field `rate`
            bytes = { rate = "1/d", burst = "4294967296MiB" } | bytes.burst | precision
            bytes = "1MiB/s"                                  | bytes       |
        "#;
        for case in cases.lines().filter(|l| !l.trim().is_empty()) {
            let [line, key, says]: [&str; 3] = case
                .split('|')
                .map(str::trim)
                .collect::<Vec<_>>()
                .try_into()
                .unwrap();
            let rule = format!(
                "[[rules]]\nname = \"chat\"\nkey = \"client_ip\"\nrate = \"5/s\"\n{line}\n"
            );
            let (_, _, k, message) = err(&rule);
            assert_eq!(k, format!("rules[0].{key}"), "{line}: {message}");
            assert!(message.contains(says), "{line}: {message}");
        }
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let cfg = parse("").unwrap();
        assert_eq!(cfg.store.backend, Backend::Memory);
        assert_eq!(cfg.store.timeout, Duration::from_millis(50));
        assert_eq!(cfg.store.on_error, OnError::Deny);
        assert_eq!(cfg.keys.header.as_str(), "x-api-key");
        assert_eq!(cfg.response, ResponseStyle::Draft);
        assert_eq!(cfg.upstream().timeout, Duration::from_secs(30));
        let t = cfg.server.timeouts;
        assert_eq!(
            (t.header, t.idle, t.body),
            (
                Duration::from_secs(10),
                Duration::from_secs(60),
                Duration::from_secs(30)
            )
        );
        assert!(!cfg.server.max_connections_set);
        assert_eq!(
            cfg.server.max_connections,
            server::derive_max_connections(server::open_files_limit())
        );
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

    /// A plan table no key in the files names is no error: the runtime directory (the
    /// admin API) may give it to a key. It is among the plans keys may be given.
    #[test]
    fn a_plan_no_listed_key_has_is_one_keys_may_be_given_at_runtime() {
        let cfg = parse(
            "[keys.plans]\n\"k1\" = \"pro\"\n[[rules]]\nname = \"a\"\nkey = \"api_key\"\nrate = \"1/s\"\n[rules.plans.pro]\n[rules.plans.gold]\nrate = \"5/s\"\n",
        )
        .unwrap();
        assert!(cfg.keys.defines("gold") && cfg.keys.defines("pro"));
        assert!(!cfg.keys.defines("silver"));
        assert_eq!(cfg.keys.resync, crate::identity::DEFAULT_RESYNC);
        assert_eq!(
            cfg.rules[0].quota_for(Some("gold")).map(|q| q.rate.count),
            Some(5)
        );
        let cfg = parse(
            "[keys.plans]\n\"k1\" = \"pro\"\n[[rules]]\nname = \"a\"\nkey = \"api_key\"\nrate = \"1/s\"\n[rules.plans.pro]\nrate = \"5/s\"\nburst = 9\n",
        )
        .unwrap();
        let r = &cfg.rules[0];
        assert_eq!(r.quota_for(Some("pro")).map(|q| q.burst), Some(9));
        assert_eq!(r.quota_for(None).map(|q| q.burst), Some(1));
    }

    /// The rules define `pro` and `partner`: a key given any other plan is a typo that
    /// would give its customer no plan at all.
    const PLANNED: &str = "[[rules]]\nname = \"a\"\nkey = \"api_key\"\nrate = \"1/s\"\n[rules.plans.pro]\nrate = \"5/s\"\n[rules.plans.partner]\nexempt = true\n";

    #[test]
    fn a_key_given_a_plan_no_rule_defines_is_an_error() {
        let (line, column, key, message) =
            err(&format!("[keys.plans]\n\"pro-key-0001\" = \"pro\"\n\"partner-key\" = \"partner\"\n\"pro-key-0002\" = \"Pro\"\n{PLANNED}"));
        assert_eq!((line, column, key.as_str()), (9, 18, "keys.plans.<key>"));
        assert_eq!(
            message,
            "plan \"Pro\" is not defined by any rule: the rules define \"partner\", \"pro\" (did you mean \"pro\"?); a key with the rules' default limits needs no plan, or an empty [rules.plans.<plan>] table"
        );
        assert!(!message.contains("pro-key"), "no key in the message");
        let (_, _, _, message) = err("[keys.plans]\n\"k\" = \"gold\"\n");
        assert_eq!(
            message,
            "plan \"gold\" is not defined by any rule: no rule has a [rules.plans.<plan>] table; a key with the rules' default limits needs no plan, or an empty [rules.plans.<plan>] table"
        );
        // An empty table defines a plan with the rule's own limit.
        let cfg = parse(&format!(
            "[keys.plans]\n\"k\" = \"free\"\n\"j\" = \"pro\"\n\"l\" = \"partner\"\n{PLANNED}[rules.plans.free]\n"
        ))
        .unwrap();
        assert_eq!(
            cfg.rules[0].quota_for(Some("free")),
            Some(&cfg.rules[0].quota)
        );
    }

    /// A key is listed with its plan alone (`"pro"`) or with a label (`{ plan = "pro",
    /// label = "Acme Corp" }`); a label that is too long or could break a log line is an
    /// error at its line, in the config's words, and never names the key.
    #[test]
    fn a_key_may_carry_a_label_and_a_bad_one_is_an_error() {
        let cfg = parse(&format!(
            "[keys.plans]\n\"plain-key\" = \"pro\"\n\"acme-key\" = {{ plan = \"pro\", label = \"Acme Corp\" }}\n{PLANNED}"
        ))
        .unwrap();
        let acme = cfg.keys.listing(b"acme-key").unwrap();
        assert_eq!(
            (acme.plan, acme.label.as_deref()),
            (Some("pro"), Some("Acme Corp"))
        );
        let plain = cfg.keys.listing(b"plain-key").unwrap();
        assert_eq!((plain.plan, plain.label), (Some("pro"), None));
        assert_eq!(
            cfg.keys.labels(),
            vec![("Acme Corp".to_string(), "pro".to_string())]
        );
        let long = "x".repeat(65);
        for (value, key, want) in [
            (
                format!("{{ plan = \"pro\", label = \"{long}\" }}"),
                "keys.plans.<key>",
                "a label is 1 to 64 characters (this one has 65), like \"Acme Corp\"",
            ),
            (
                "{ plan = \"pro\", label = \"Acme\\nINFO forged\" }".to_string(),
                "keys.plans.<key>",
                "a label is shown in logs and on pages: no control or invisible characters (it has \\u{a})",
            ),
            (
                "{ plan = \"pro\", label = \"Acme\", note = \"x\" }".to_string(),
                "keys.plans.<key>",
                "unknown field `note`, expected `plan` or `label`",
            ),
            (
                "{ label = \"Acme\" }".to_string(),
                "keys.plans.<key>",
                "missing field `plan`",
            ),
        ] {
            let (line, _, k, message) =
                err(&format!("[keys.plans]\n\"secret-key-9\" = {value}\n{PLANNED}"));
            assert_eq!((line, k.as_str()), (7, key), "{value}");
            assert!(message.contains(want), "{value}: {message}");
            assert!(!message.contains("secret-key-9"), "{message}");
        }
    }

    /// With the memory store the keys file's keys are the runtime directory's (the admin
    /// API changes them); with Redis they are static config, like inline ones.
    #[test]
    fn the_keys_file_is_the_directory_with_the_memory_store_and_static_with_redis() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("keys.toml"),
            "[plans]\n\"file-key\" = \"pro\"\n",
        )
        .unwrap();
        let rules = "[keys]\nfile = \"keys.toml\"\nresync = \"2s\"\n[keys.plans]\n\"inline-key\" = \"pro\"\n[[rules]]\nname = \"a\"\nkey = \"api_key\"\nrate = \"1/s\"\n[rules.plans.pro]\n";
        let load = |store: &str| {
            let path = dir.path().join("limits.toml");
            std::fs::write(&path, format!("{MINIMAL}{store}{rules}")).unwrap();
            Config::load(&path).unwrap()
        };
        let memory = load("");
        let sha256 = crate::identity::sha256;
        let (file, inline) = (sha256(b"file-key"), sha256(b"inline-key"));
        assert!(memory.keys.directory_in_file());
        assert_eq!(memory.keys.directory().get(&file), Some("pro".into()));
        assert_eq!(memory.keys.static_plan(&file), None);
        assert_eq!(memory.keys.static_plan(&inline), Some("pro"));
        assert_eq!(memory.keys.resync, std::time::Duration::from_secs(2));
        let redis = load("[store]\nbackend = \"redis\"\nurl = \"redis://127.0.0.1:1\"\n");
        assert!(!redis.keys.directory_in_file());
        assert!(redis.keys.directory().is_empty());
        assert_eq!(redis.keys.static_plan(&file), Some("pro"));
        for keys in [&memory.keys, &redis.keys] {
            assert_eq!(keys.plan_of(b"file-key"), Some("pro"));
            assert_eq!(keys.plan_of(b"inline-key"), Some("pro"));
        }
    }

    #[test]
    fn a_keys_file_plan_no_rule_defines_is_an_error_in_the_keys_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("keys.toml"),
            "[plans]\n\"pro-key-0001\" = \"pro\"\n\"pro-key-0002\" = \"Pro\"\n",
        )
        .unwrap();
        let path = dir.path().join("limits.toml");
        std::fs::write(
            &path,
            format!("{MINIMAL}[keys]\nfile = \"keys.toml\"\n{PLANNED}"),
        )
        .unwrap();
        let e = Config::load(&path).unwrap_err().to_string();
        let keys = dir.path().join("keys.toml");
        assert_eq!(
            e,
            format!("{}:3:18: plans.<key>: plan \"Pro\" is not defined by any rule: the rules define \"partner\", \"pro\" (did you mean \"pro\"?); a key with the rules' default limits needs no plan, or an empty [rules.plans.<plan>] table", keys.display())
        );
    }

    #[test]
    fn an_exempt_plan_takes_no_limit_of_its_own() {
        let cfg = parse(&format!(
            "[keys.plans]\n\"k\" = \"partner\"\n\"j\" = \"pro\"\n{PLANNED}"
        ))
        .unwrap();
        let r = &cfg.rules[0];
        assert_eq!(r.quota_for(Some("partner")), None);
        assert!(
            crate::cli::describe(&cfg).contains("plan partner: exempt"),
            "{}",
            crate::cli::describe(&cfg)
        );
        let (line, column, key, message) = err(
            "[keys.plans]\n\"k\" = \"pro\"\n[[rules]]\nname = \"ip\"\nkey = \"client_ip\"\nrate = \"1/s\"\n[rules.plans.pro]\nexempt = true\nrate = \"5/s\"\n",
        );
        assert_eq!(
            (line, column, key.as_str()),
            (13, 10, "rules[0].plans.pro.exempt")
        );
        assert_eq!(
            message,
            "exempt = true: plan \"pro\" is not limited by this rule, so a rate for it means nothing; drop one or the other"
        );
    }

    #[test]
    fn match_takes_conditions_on_what_a_request_carries() {
        let cfg = parse(
            "[[rules]]\nname = \"ip\"\nkey = \"client_ip\"\nrate = \"1/s\"\nmatch = { path_prefix = \"/api/\", api_key = \"absent\", \"header:X-User\" = \"present\" }\n",
        )
        .unwrap();
        assert_eq!(
            cfg.rules[0].matcher.describe(),
            "path_prefix /api/, api_key = \"absent\", \"header:x-user\" = \"present\""
        );
        for (text, at, key, message) in [
            (
                "match = { api_key = \"sometimes\" }",
                (10, 21),
                "rules[0].match.api_key",
                "unknown variant `sometimes`, expected `present` or `absent`",
            ),
            (
                "match = { apikey = \"absent\" }",
                (10, 11),
                "rules[0].match.apikey",
                "unknown field `apikey`, expected one of `path_prefix`, `path`, `glob`, `methods`, `host`, `api_key`, `header:<name>`, `route`, `proxied`, `egress` (did you mean `api_key`?)",
            ),
            (
                "match = { \"header:bad name\" = \"absent\" }",
                (10, 11),
                "rules[0].match.header:bad name",
                "invalid header name in \"header:bad name\"",
            ),
            (
                "match = { \"header:X-API-Key\" = \"absent\" }",
                (10, 32),
                "rules[0].match.header:x-api-key",
                "x-api-key is the API key header ([keys] header): write api_key = \"absent\", which reads it as a key",
            ),
        ] {
            let (line, column, k, m) = err(&format!(
                "[[rules]]\nname = \"ip\"\nkey = \"client_ip\"\nrate = \"1/s\"\n{text}\n"
            ));
            assert_eq!(((line, column), k.as_str(), m.as_str()), (at, key, message), "{text}");
        }
        let (line, column, key, message) = err(
            "[[rules]]\nname = \"k\"\nkey = \"api_key\"\nrate = \"1/s\"\nmatch = { api_key = \"absent\" }\n",
        );
        assert_eq!(
            (line, column, key.as_str()),
            (10, 21, "rules[0].match.api_key")
        );
        assert_eq!(
            message,
            "a rule counting by api_key that applies only when it is absent counts nobody by it; count those requests with key = \"client_ip\""
        );
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
            "{MINIMAL}[keys]\nfile = \"keys.toml\"\nunknown = \"reject\"\n[keys.plans]\n\"inline-3\" = \"pro\"\n[[rules]]\nname = \"a\"\nkey = \"api_key\"\nrate = \"1/s\"\n[rules.plans.team]\nalgorithm = \"sliding_window\"\nrate = \"5/m\"\ncost = 2\n[rules.plans.pro]\n"
        );
        let path = dir.path().join("limits.toml");
        std::fs::write(&path, &text).unwrap();
        let cfg = Config::load(&path).unwrap();
        assert_eq!(cfg.keys.plan_of(b"secret-1"), Some("pro"));
        assert_eq!(cfg.keys.plan_of(b"raw-key-2"), Some("team"));
        assert_eq!(cfg.keys.plan_of(b"inline-3"), Some("pro"));
        assert_eq!(cfg.keys.plan_of(b"sha256:x"), None);
        assert_eq!(cfg.keys.len(), 3);
        let team = cfg.rules[0].quota_for(Some("team")).unwrap();
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
    fn a_concurrency_rule_says_what_its_store_does_with_a_slot() {
        let rule = "[[rules]]\nname = \"c\"\nkey = \"global\"\nmax_in_flight = 3\n";
        let memory = parse(rule).unwrap();
        assert!(
            crate::cli::describe(&memory)
                .contains("enforced; a slot is held until its request ends"),
            "{}",
            crate::cli::describe(&memory)
        );
        let redis = parse(&format!(
            "[store]\nbackend = \"redis\"\nurl = \"redis://127.0.0.1:6379\"\n{rule}"
        ))
        .unwrap();
        assert!(
            crate::cli::describe(&redis)
                .contains("enforced; leases live 10s in the store unless renewed"),
            "{}",
            crate::cli::describe(&redis)
        );
    }

    /// `ratewall check` says how a rule settles: `charge`, `cost_header`, `cost_from` with
    /// `reserve`, `max_debt` (issue 42, item 9), and a rule limited to a route says so.
    #[test]
    fn check_says_how_a_rule_settles_and_for_which_route() {
        let cfg = Config::parse(
            "[server]\nlisten = \"127.0.0.1:1\"\n\
             [[upstreams]]\nname = \"default\"\nservers = [\"http://127.0.0.1:2\"]\n\
             [[upstreams]]\nname = \"llm\"\nservers = [\"http://127.0.0.1:3\"]\n\
             [[routes]]\nname = \"chat\"\nmatch = { path_prefix = \"/v1/\" }\nupstream = \"llm\"\n\
             [[rules]]\nname = \"ok-only\"\nkey = \"client_ip\"\nrate = \"10/m\"\n\
             charge = { statuses = [\"2xx\"], attempts = { rate = \"100/m\", burst = 100 } }\n\
             [[rules]]\nname = \"reported\"\nkey = \"client_ip\"\nrate = \"1000/m\"\n\
             cost_header = \"x-ratelimit-cost\"\nmax_debt = 50\n\
             [[rules]]\nname = \"tokens\"\nkey = \"client_ip\"\nrate = \"10000/m\"\nburst = 4000\n\
             cost_from = \"openai_usage\"\nreserve = \"max_tokens\"\ndefault_reserve = 256\n\
             match = { route = \"chat\" }\n",
            Path::new("x"),
        )
        .unwrap();
        let said = crate::cli::describe(&cfg);
        for want in [
            "charges answers 2xx only",
            "the cost the answer reports in x-ratelimit-cost",
            "borrows up to 50 ahead of a cost reported later (max_debt)",
            "the total_tokens an OpenAI-style answer reports",
            "reserves the request's max_tokens",
            "256 for a body that says none",
        ] {
            assert!(said.contains(want), "{want:?} missing:\n{said}");
        }
        assert_eq!(cfg.applies_to(&cfg.rules[2]), "every request, route chat");
        assert_eq!(cfg.applies_to(&cfg.rules[0]), "every request");
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
        assert_eq!(cfg.rules[1].matcher.describe(), "path /upload on x.test");
        assert_eq!(cfg.rules[1].quota.algorithm, Algorithm::Concurrency);
        assert_eq!(cfg.rules[1].quota.lease_us, 10_000_000);
    }

    #[test]
    fn an_https_upstream_gets_tls_and_only_it_takes_tls_keys() {
        let cfg = Config::parse(
            "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\nurl = \"https://10.0.0.1:8443\"\nsni = \"b.internal\"\ninsecure_skip_verify = true\n",
            Path::new("x"),
        )
        .unwrap();
        let upstream = cfg.upstream();
        let tls = upstream.tls.as_ref().expect("TLS for https://");
        assert_eq!(
            tls.describe(),
            "tls: name b.internal, verified against nothing (insecure_skip_verify) -- INSECURE: the backend's certificate is NOT verified"
        );
        assert!(crate::cli::describe(&cfg).contains(&tls.describe()));
        let plain = Config::parse(
            "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\nurl = \"http://10.0.0.1\"\n",
            Path::new("x"),
        )
        .unwrap();
        assert!(plain.upstream().tls.is_none());
        let e = Config::parse(
            "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\nurl = \"https://b\"\ninsecure_skip_verify = true\nsni = \"not a name\"\n",
            Path::new("x"),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("x:6:7: upstream.sni: \"not a name\" is not a valid server name"),
            "{e}"
        );
    }

    #[test]
    fn upstream_url_keeps_base_path() {
        let cfg = Config::parse(
            "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\nurl = \"http://127.0.0.1:3000/base/\"\n",
            Path::new("x"),
        )
        .unwrap();
        assert_eq!(cfg.upstream().base_path, "/base");
        assert_eq!(
            cfg.upstream().url.authority().unwrap().as_str(),
            "127.0.0.1:3000"
        );
        assert!(Config::parse(
            "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\nurl = \"ftp://x\"\n",
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
