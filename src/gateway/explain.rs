//! `ratewall check --path … --method … --header …`: which rules apply to a sample request
//! and how each would count it, told by the request path's own functions (rule matching,
//! [`Requester::identify`]), so the explanation cannot drift from what requests get.
//! Pure: no store is asked.

use std::fmt::Write;
use std::net::IpAddr;

use http::{HeaderMap, Method};

use super::limits::matching;
use crate::config::Config;
use crate::identity::{KeyKind, Refusal, Requester, Source};
use crate::rules::{normalize_path, Mode, Rule};

/// What `ratewall check` prints for a request of `method` to `raw_path` with `headers`
/// from `peer`.
pub fn explain(
    cfg: &Config,
    method: &Method,
    raw_path: &str,
    headers: &HeaderMap,
    peer: IpAddr,
) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "sample request: {method} {raw_path}");
    let path = normalize_path(raw_path);
    if path != raw_path {
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
            return out;
        }
    };
    parts.headers = headers.clone();
    let applied = matching(cfg, &parts);
    if applied.is_empty() {
        let _ = writeln!(out, "no rule applies: forwarded without limits");
        return out;
    }
    let requester = Requester::new(&parts.headers, peer, &cfg.keys, &cfg.client_ip);
    let plan = requester.plan();
    let _ = writeln!(
        out,
        "{} rule(s) apply; the request passes only if all allow it:",
        applied.len()
    );
    for r in applied.into_iter().map(|i| &cfg.rules[i]) {
        let plan_note = match plan {
            Some(p) if r.plans.contains_key(p) => format!(" (plan {p})"),
            _ => String::new(),
        };
        let _ = writeln!(
            out,
            "  - {}: {}{plan_note}, {}; {}",
            r.name,
            r.quota_for(plan),
            r.quota_for(plan).algorithm.name(),
            counted(cfg, r, &requester)
        );
    }
    out
}

/// How `rule` counts the request: per whom, and whether it enforces; or why it refuses.
fn counted<'a>(cfg: &'a Config, rule: &'a Rule, requester: &Requester<'a>) -> String {
    let name = match &rule.key.kind {
        KeyKind::Header(h) => h,
        _ => &cfg.keys.header,
    };
    let identity = match requester.identify(&rule.key) {
        Ok(identity) => identity,
        Err(Refusal::Malformed(e)) => return format!("refused with 400: {e}"),
        Err(Refusal::UnknownKey) => {
            return "refused with 401: the API key is not known (unknown = \"reject\")".into()
        }
        Err(Refusal::MissingKey | Refusal::MissingHeader) => {
            return format!("refused with 401: no {name} header")
        }
    };
    let by_key = matches!(rule.key.kind, KeyKind::ApiKey | KeyKind::Header(_));
    let who = match identity.source {
        Source::ApiKey(_) | Source::Header(..) => {
            format!("{name} (identity {})", identity.digest.short_hex().as_str())
        }
        Source::ClientIp(_) if by_key => format!("no {name}: {}", identity.source),
        source => source.to_string(),
    };
    let mode = match (rule.mode, rule.enforce_percent) {
        (Mode::Shadow, _) => ", shadow: never denies",
        (_, 100) => "",
        _ if rule.enforces(&identity.digest) => ", enforced for this identity (enforce_percent)",
        _ => ", shadow for this identity (outside enforce_percent)",
    };
    format!("counted per {who}{mode}")
}
