//! `ratewall check --path … --method … --header …`: which rules apply to a sample request,
//! how each would count it, and why each other rule does not apply — told by the request
//! path's own functions (rule matching, [`Rule::applies`], [`Requester::identify`]), so the
//! explanation cannot drift from what requests get. Pure: no store is asked.

use std::fmt::Write;
use std::net::IpAddr;

use http::request::Parts;
use http::{HeaderMap, Method};

use crate::config::Config;
use crate::decide::{self, route, Destination, Subject};
use crate::identity::{Carried, KeyKind, Refusal, Requester, Source};
use crate::proxy::screen;
use crate::rules::{Applies, Condition, Match, Mode, PathMatch, Rule};

/// What `ratewall check` prints for a request of `method` to `raw_path` with `headers`
/// from `peer`: the request path's steps in its order, until one stops it.
pub fn explain(
    cfg: &Config,
    method: &Method,
    raw_path: &str,
    headers: &HeaderMap,
    peer: IpAddr,
) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "sample request: {method} {raw_path}");
    // The path part only: `--path` may carry a query.
    let raw = raw_path.split_once('?').map_or(raw_path, |(p, _)| p);
    let Some(parts) = screened(cfg, method, raw_path, raw, headers, &mut out) else {
        return out;
    };
    let requester = Requester::new(&parts.headers, peer, &cfg.keys, &cfg.client_ip)
        .with_jwt(cfg.jwt.as_ref().map(|j| &*j.verifier));
    let subject = Subject {
        method: &parts.method,
        uri: &parts.uri,
        headers: &parts.headers,
        peer,
        client_cert: None,
    };
    let Some(to) = routed(cfg, &subject, &requester, &mut out) else {
        return out;
    };
    if let Some(line) = token_line(cfg, &requester) {
        let _ = writeln!(out, "{line}");
    }
    let (applied, not) = sorted(cfg, &subject, raw, &to, &requester);
    if applied.is_empty() {
        let _ = writeln!(out, "no rule applies: forwarded without limits");
    } else {
        let _ = writeln!(
            out,
            "{} rule(s) apply; the request passes only if all allow it:",
            applied.len()
        );
        for line in applied {
            let _ = writeln!(out, "  - {line}");
        }
    }
    if !not.is_empty() {
        let _ = writeln!(out, "{} rule(s) do not apply:", not.len());
        for line in not {
            let _ = writeln!(out, "    {line}");
        }
    }
    out
}

/// The sample's head as the gateway would take it (`raw`: its path without the query):
/// None (and why, in `out`) where it is refused before any rule or is no request a client
/// could send; else with the header fields the gateway drops dropped.
fn screened(
    cfg: &Config,
    method: &Method,
    raw_path: &str,
    raw: &str,
    headers: &HeaderMap,
    out: &mut String,
) -> Option<Parts> {
    // What the gateway would answer before any rule: a path it refuses.
    if let Some(p) = screen::path_problem(raw).or_else(|| screen::parameter_problem(raw)) {
        let detail = p.detail.as_deref().unwrap_or_default();
        let _ = writeln!(
            out,
            "refused before any rule: {} ({detail})",
            p.status.as_u16()
        );
        return None;
    }
    let path = cfg.index.path_of(raw);
    if path != raw {
        let _ = writeln!(out, "  (rules see the path as {path})");
    }
    let request = http::Request::builder()
        .method(method.clone())
        .uri(raw_path)
        .body(());
    let mut parts = match request {
        Ok(r) => r.into_parts().0,
        Err(e) => {
            let _ = writeln!(out, "not a request path a client could send: {e}");
            return None;
        }
    };
    parts.headers = headers.clone();
    if !cfg.server.underscores_in_headers {
        let dropped = screen::drop_underscored(&mut parts.headers);
        if dropped > 0 {
            let _ = writeln!(
                out,
                "  ({dropped} header field(s) with '_' in the name dropped: underscores_in_headers = false)"
            );
        }
    }
    Some(parts)
}

/// Where the request goes, as the request path chooses (`decide::route::choose`), said in
/// `out`; None where it goes nowhere (a 404, or a refusal while choosing).
fn routed(
    cfg: &Config,
    subject: &Subject<'_>,
    requester: &Requester<'_>,
    out: &mut String,
) -> Option<Destination> {
    let to = match route::choose(cfg, subject, requester) {
        Ok(Some(to)) => to,
        Ok(None) => {
            let _ = writeln!(
                out,
                "route: none matches, and there is no pool default: answered 404, no rule consulted"
            );
            return None;
        }
        Err(refusal) => {
            let _ = writeln!(
                out,
                "refused while choosing a route: {} (read for a route's match)",
                refused(&refusal, &cfg.keys.header)
            );
            return None;
        }
    };
    // With one pool and no route, every request goes to the pool default: nothing to say.
    if cfg.routes.list.is_empty() && cfg.upstreams.len() == 1 {
        return Some(to);
    }
    let pool = to.pool_name(cfg).unwrap_or_default();
    let _ = match to.route_name(cfg) {
        Some(route) => writeln!(out, "route: {route} -> pool {pool}"),
        None => writeln!(out, "route: none matches -> pool {pool}"),
    };
    if let Some(target) = to.target(cfg, subject.uri) {
        let _ = writeln!(out, "  (forwarded as {target})");
    }
    Some(to)
}

/// The rules that apply to the request (how each counts it) and those that do not (why),
/// each as a line, in the file's order. `raw`: the request's path without its query.
fn sorted<'a>(
    cfg: &'a Config,
    subject: &Subject<'_>,
    raw: &str,
    to: &Destination,
    requester: &Requester<'a>,
) -> (Vec<String>, Vec<String>) {
    let path = cfg.index.path_of(raw);
    let plan = requester.plan();
    let fitting = decide::matching(cfg, subject, Some(to));
    let mut applied = Vec::new();
    let mut not = Vec::new();
    for (i, r) in cfg.rules.iter().enumerate() {
        if !fitting.contains(&i) {
            let host = decide::forwarded_host(cfg, subject, Some(to));
            not.push(format!(
                "{}: {}",
                r.name,
                misfit(&r.matcher, subject.method, &path, host)
            ));
            continue;
        }
        match applies(cfg, r, requester, plan) {
            Ok(line) => applied.push(line),
            Err(line) => not.push(line),
        }
    }
    (applied, not)
}

/// How a rule that fits the request's path, method and host takes it: the line for the
/// rules that apply, or (Err) the line for those that do not. `plan`: the request's.
fn applies<'a>(
    cfg: &'a Config,
    r: &'a Rule,
    requester: &Requester<'a>,
    plan: Option<&str>,
) -> Result<String, String> {
    match r.applies(requester) {
        Ok(Applies::Limits(quota)) => {
            let plan_note = match plan {
                Some(p) if r.plans.contains_key(p) => format!(" (plan {p})"),
                _ => String::new(),
            };
            Ok(format!(
                "{}: {quota}{plan_note}, {}; {}",
                r.name,
                quota.algorithm.name(),
                counted(cfg, r, requester)
            ))
        }
        Ok(Applies::Unmet(c)) => Err(format!("{}: {}", r.name, unmet(cfg, c))),
        Ok(Applies::Exempt) => Err(format!(
            "{}: plan {} is exempt from it",
            r.name,
            plan.unwrap_or_default()
        )),
        // Only an API key condition refuses: the key is read as an api_key rule would.
        Err(refusal) => Ok(format!(
            "{}: {} (read for its match on api_key)",
            r.name,
            refused(&refusal, &cfg.keys.header),
        )),
    }
}

/// Why a rule's path, method or host does not fit the request (the first that does not).
fn misfit(m: &Match, method: &Method, path: &str, host: Option<&str>) -> String {
    if !m.fits_path(path) {
        return match &m.path {
            PathMatch::Prefix(p) => format!("the path does not start with {p}"),
            PathMatch::Exact(p) => format!("the path is not {p}"),
            PathMatch::Glob(g) => format!("the path does not fit glob {}", g.pattern()),
            PathMatch::Any => "the path does not fit".to_string(),
        };
    }
    if !m.fits_method(method) {
        let methods: Vec<&str> = m.methods.iter().map(Method::as_str).collect();
        return format!("the method is not {}", methods.join("|"));
    }
    let hosts: Vec<String> = m.hosts.iter().map(ToString::to_string).collect();
    match host {
        Some(h) => format!("the host {h} is not {}", hosts.join("|")),
        None => format!("no host, and it applies on {} only", hosts.join("|")),
    }
}

/// Why a condition of a rule's `match` on what the request carries does not hold.
fn unmet(cfg: &Config, c: &Condition) -> String {
    let what = match (&c.carried, c.present) {
        (Carried::ApiKey, true) => format!("no API key ({})", cfg.keys.header),
        (Carried::ApiKey, false) => format!("an API key ({})", cfg.keys.header),
        (Carried::Header(h), true) => format!("no {h} header"),
        (Carried::Header(h), false) => format!("a {h} header"),
    };
    format!("match {c}, and the request carries {what}")
}

/// A refusal, as `check` tells it; `name`: the header the rule reads.
fn refused(refusal: &Refusal, name: &http::HeaderName) -> String {
    match refusal {
        Refusal::Malformed(e) => format!("refused with 400: {e}"),
        Refusal::UnknownKey => {
            "refused with 401: the API key is not known (unknown = \"reject\")".into()
        }
        Refusal::MissingKey | Refusal::MissingHeader => {
            format!("refused with 401: no {name} header")
        }
        // `check`'s sample request comes over no TLS connection.
        Refusal::MissingCert => {
            "refused with 401: no client certificate (over TLS, with [server.tls] client_ca)".into()
        }
        Refusal::MissingToken => "refused with 401: no bearer token".into(),
        Refusal::MissingClaim | Refusal::InvalidToken(_) => {
            format!("refused with 401: {refusal}")
        }
        Refusal::KeysUnavailable => {
            "refused with 503: no JWKS fetched (check does not fetch jwks_url; the gateway does at start)".into()
        }
        // `check` counts no failures: never here.
        Refusal::Throttled(_) => format!("refused with 429: {refusal}"),
    }
}

/// What the sample request's bearer token is, where `[jwt]` is configured: verified (its
/// claims' names), none, or why it is refused.
fn token_line(cfg: &Config, requester: &Requester<'_>) -> Option<String> {
    let jwt = cfg.jwt.as_ref()?;
    Some(match requester.token() {
        Ok(None) => format!("bearer token: none ({})", jwt.verifier.settings.from),
        Ok(Some(v)) => {
            let names: Vec<&str> = v.claims.keys().map(String::as_str).collect();
            format!("bearer token: verified (claims {})", names.join(", "))
        }
        Err(Refusal::KeysUnavailable) => {
            "bearer token: not verified: check does not fetch jwks_url (the gateway does at start)"
                .to_string()
        }
        Err(r) => format!("bearer token: refused with 401: {r}"),
    })
}

/// The part of `kind` the request lacks first, for `check` to name.
fn lacking<'a>(kind: &'a KeyKind, requester: &Requester<'a>) -> Option<&'a KeyKind> {
    match kind {
        KeyKind::Combined(parts) => parts.iter().find(|p| requester.lacks(p)),
        kind => requester.lacks(kind).then_some(kind),
    }
}

/// How `rule` counts the request: per whom, and whether it enforces; or why it refuses.
fn counted<'a>(cfg: &'a Config, rule: &'a Rule, requester: &Requester<'a>) -> String {
    let lacks = lacking(&rule.key.kind, requester);
    let name = match lacks.unwrap_or(&rule.key.kind) {
        KeyKind::Header(h) => h,
        _ => &cfg.keys.header,
    };
    let identity = match requester.identify(&rule.key) {
        Ok(identity) => identity,
        Err(refusal) => {
            return match (refusal, lacks) {
                (r, Some(part)) if r.is_missing() && part != &rule.key.kind => {
                    format!("{} (the part {part} is missing)", refused(&r, name))
                }
                (r, _) => refused(&r, name),
            }
        }
    };
    let by_key = matches!(rule.key.kind, KeyKind::ApiKey | KeyKind::Header(_));
    let who = match identity.source {
        Source::ApiKey(_) | Source::Header(..) => {
            format!("{name} (identity {})", identity.digest.tag().as_str())
        }
        Source::ClientIp(_) if rule.key.kind == KeyKind::ClientCert => {
            format!("no client certificate: {}", identity.source)
        }
        Source::ClientIp(_) if matches!(rule.key.kind, KeyKind::Jwt(_) | KeyKind::Combined(_)) => {
            let part = lacks.map_or_else(String::new, ToString::to_string);
            format!("no {part}: {}", identity.source)
        }
        Source::Jwt(_) | Source::Combined(_) => format!(
            "{} (identity {})",
            identity.source,
            identity.digest.tag().as_str()
        ),
        Source::ClientIp(_) if by_key => format!("no {name}: {}", identity.source),
        source => source.to_string(),
    };
    let mode = match (rule.mode, rule.enforce_percent) {
        (Mode::Shadow, _) => ", shadow: never denies",
        (_, 100) => "",
        _ if rule.enforces(&identity.digest) => ", enforced for this identity (enforce_percent)",
        _ => ", shadow for this identity (outside enforce_percent)",
    };
    // The key's label, where it is listed with one: whose key this is.
    let label = match requester.label_of(&identity.source) {
        Some(l) => format!(", key labelled {l:?}"),
        None => String::new(),
    };
    format!("counted per {who}{label}{mode}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn check_says_why_each_rule_does_or_does_not_apply() {
        let cfg = Config::parse(
            concat!(
                "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\nurl = \"http://127.0.0.1:2\"\n",
                "[keys]\nunknown = \"reject\"\n[keys.plans]\n\"pro-key\" = \"pro\"\n",
                "[[rules]]\nname = \"anon\"\nkey = \"client_ip\"\nrate = \"300/m\"\nmatch = { api_key = \"absent\" }\n",
                "[[rules]]\nname = \"keyed\"\nkey = \"api_key\"\nrate = \"10/s\"\nmatch = { api_key = \"present\", methods = [\"POST\"] }\n[rules.plans.pro]\n",
                "[[rules]]\nname = \"users\"\nkey = \"header:x-user\"\nrate = \"1/s\"\nmatch = { \"header:x-user\" = \"present\", host = \"app.test\" }\n",
            ),
            std::path::Path::new("t.toml"),
        )
        .unwrap();
        let ask = |method: Method, sent: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in sent {
                h.insert(*k, HeaderValue::from_static(v));
            }
            let out = explain(&cfg, &method, "/x", &h, IpAddr::from([192, 0, 2, 1]));
            out.lines().skip(1).map(str::to_string).collect::<Vec<_>>()
        };
        assert_eq!(
            ask(Method::GET, &[("host", "app.test")]),
            [
                "1 rule(s) apply; the request passes only if all allow it:",
                "  - anon: 300/m burst 300, token_bucket; counted per client IP 192.0.2.1",
                "2 rule(s) do not apply:",
                "    keyed: the method is not POST",
                "    users: match \"header:x-user\" = \"present\", and the request carries no x-user header",
            ]
        );
        // The identity by its tag, keyed by the process's secret (this test is the only one
        // of the library's to set it).
        let key = crate::identity::tag::TagKey::from_secret(b"explain's own secret");
        crate::identity::tag::process().set(key.clone());
        let digest = crate::identity::digest_api_key(b"pro-key");
        let tag = key.tag(&digest);
        assert_ne!(tag, digest.short_hex());
        let keyed = format!(
            "  - keyed: 10/s burst 10 (plan pro), token_bucket; counted per x-api-key (identity {})",
            tag.as_str()
        );
        assert_eq!(
            ask(Method::POST, &[("x-api-key", "pro-key"), ("x-user", "u")]),
            [
                "1 rule(s) apply; the request passes only if all allow it:",
                keyed.as_str(),
                "2 rule(s) do not apply:",
                "    anon: match api_key = \"absent\", and the request carries an API key (x-api-key)",
                "    users: the host 127.0.0.1 is not app.test",
            ]
        );
        assert_eq!(
            ask(Method::GET, &[("x-api-key", "stranger")])[..2],
            [
                "1 rule(s) apply; the request passes only if all allow it:",
                "  - anon: refused with 401: the API key is not known (unknown = \"reject\") (read for its match on api_key)",
            ]
        );
    }

    /// A JWT rule and a combined key: check verifies the sample's token with the file's
    /// keys, and names each part of a combination (and the part a request lacks).
    #[test]
    fn check_verifies_a_sample_token_and_names_each_part_of_a_combined_key() {
        let inputs =
            crate::config::Inputs::default().env("RATEWALL_EXPLAIN_TEST_SECRET", "explain-secret");
        let cfg = Config::parse_with(
            concat!(
                "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\nurl = \"http://127.0.0.1:2\"\n",
                "[jwt]\nalgorithms = [\"HS256\"]\nsecret_env = \"RATEWALL_EXPLAIN_TEST_SECRET\"\n",
                "[[rules]]\nname = \"users\"\nkey = \"jwt:sub\"\nrate = \"10/s\"\n",
                "[[rules]]\nname = \"projects\"\nkey = [\"jwt:org.id\", \"header:x-project\"]\nrate = \"5/s\"\n",
            ),
            std::path::Path::new("t.toml"),
            &inputs,
        )
        .unwrap();
        let token = jsonwebtoken::encode(
            &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
            &serde_json::json!({"sub": "alice", "org": {"id": "acme"}, "exp": 4_000_000_000u64}),
            &jsonwebtoken::EncodingKey::from_secret(b"explain-secret"),
        )
        .unwrap();
        let ask = |sent: &[(&'static str, String)]| {
            let mut h = HeaderMap::new();
            for (k, v) in sent {
                h.insert(*k, HeaderValue::from_str(v).unwrap());
            }
            let out = explain(&cfg, &Method::GET, "/x", &h, IpAddr::from([192, 0, 2, 1]));
            out.lines().skip(1).map(str::to_string).collect::<Vec<_>>()
        };
        let bearer = format!("Bearer {token}");
        let both = ask(&[
            ("authorization", bearer.clone()),
            ("x-project", "p1".into()),
        ]);
        assert_eq!(both[0], "bearer token: verified (claims exp, org, sub)");
        assert!(both[2].starts_with("  - users: 10/s burst 10, token_bucket; counted per the token's sub claim (identity "), "{both:?}");
        assert!(both[3].starts_with("  - projects: 5/s burst 5, token_bucket; counted per the combination of jwt:org.id + header:x-project (identity "), "{both:?}");
        let no_project = ask(&[("authorization", bearer)]);
        assert_eq!(no_project[3], "  - projects: 5/s burst 5, token_bucket; refused with 401: no x-project header (the part header:x-project is missing)");
        let bad = ask(&[("authorization", "Bearer not.a.token".into())]);
        assert_eq!(
            bad[0],
            "bearer token: refused with 401: invalid token: the token is malformed"
        );
        assert_eq!(bad[2], "  - users: 10/s burst 10, token_bucket; refused with 401: invalid token: the token is malformed");
    }
}
