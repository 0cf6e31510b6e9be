//! A decision as the decision API answers it (docs/service.md), and its JSON: written
//! straight into the body, as the proxy writes its RateLimit fields, since a call may
//! carry a hundred of them (a batch).

use http::StatusCode;

use super::Reply;
use crate::decide::{Decided, Rejection};
use crate::headers::{self, Applied};

/// A decision, as the caller reads it.
#[derive(Default, Debug)]
pub(super) struct Answer<'a> {
    pub allowed: bool,
    /// The status the proxy would have answered (200, 429, 401, 503...).
    pub status: u16,
    /// Seconds, as the proxy's `Retry-After`; null where it gives none.
    pub retry_after: Option<u64>,
    /// The `RateLimit` and `RateLimit-Policy` field values the proxy would send.
    pub ratelimit: Option<String>,
    pub ratelimit_policy: Option<String>,
    pub rules: Vec<RuleAnswer<'a>>,
    /// Where a rule settles: the name to settle it by (`POST /v1/settle`).
    pub reservation: Option<String>,
    /// Where a concurrency slot was taken (`POST /v1/leases`): its name, and seconds it
    /// lives unrenewed.
    pub lease: Option<String>,
    pub ttl: Option<u64>,
    /// Why it was refused before any limit (a missing key, no route), or why the store
    /// could not answer.
    pub detail: Option<String>,
    pub dry_run: bool,
}

#[derive(Debug)]
pub(super) struct RuleAnswer<'a> {
    pub rule: &'a str,
    pub allowed: bool,
    /// Watching, not enforcing (shadow mode, outside `enforce_percent`).
    pub shadow: bool,
    /// The quota it advertises (`q`), in requests of its cost.
    pub limit: u64,
    pub remaining: u64,
    /// Seconds until the full quota is back.
    pub reset: u64,
}

/// The fields of a decision's answer.
pub(super) fn view<'l>(d: &Decided<'l>, result: &Result<(), Rejection>) -> Answer<'l> {
    let (ratelimit, ratelimit_policy) = if d.applied.is_empty() {
        (None, None)
    } else {
        let (mut policy, mut state) = (Vec::with_capacity(64), Vec::with_capacity(64));
        headers::write_draft(&d.applied, &mut policy, &mut state);
        // Rule names and integers: UTF-8 always.
        (String::from_utf8(state).ok(), String::from_utf8(policy).ok())
    };
    let rules = (d.applied.iter().map(|a| rule_answer(a, false)))
        .chain(d.shadow.iter().map(|a| rule_answer(a, true)))
        .collect();
    let (allowed, status, retry_after, detail) = match result {
        Ok(()) => (true, 200, None, None),
        Err(r) => (
            false,
            r.problem.status.as_u16(),
            r.problem.retry_after,
            r.problem.detail.as_ref().map(|d| d.to_string()),
        ),
    };
    Answer {
        allowed,
        status,
        retry_after,
        ratelimit,
        ratelimit_policy,
        rules,
        detail,
        dry_run: d.dry_run,
        ..Answer::default()
    }
}

fn rule_answer<'l>(a: &Applied<'l>, shadow: bool) -> RuleAnswer<'l> {
    RuleAnswer {
        rule: a.rule,
        allowed: a.decision.allowed,
        shadow,
        limit: headers::advertised(&a.quota).0,
        remaining: headers::available(a),
        reset: headers::ceil_secs(a.decision.reset_us),
    }
}

/// One answer, as the body of a 200.
pub(super) fn one(a: &Answer<'_>) -> Reply {
    let mut out = Vec::with_capacity(256);
    write(&mut out, a);
    super::json_bytes(StatusCode::OK, out)
}

/// A batch's answers, in order, as the body of a 200.
pub(super) fn list(answers: &[Answer<'_>]) -> Reply {
    let mut out = Vec::with_capacity(2 + 256 * answers.len());
    write_list(&mut out, answers);
    super::json_bytes(StatusCode::OK, out)
}

fn write_list(out: &mut Vec<u8>, answers: &[Answer<'_>]) {
    out.push(b'[');
    for (i, a) in answers.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write(out, a);
    }
    out.push(b']');
}

/// `a` as a JSON object; its keys in the order docs/service.md lists them, the optional
/// ones left out where they are absent.
fn write(out: &mut Vec<u8>, a: &Answer<'_>) {
    out.extend_from_slice(b"{\"allowed\":");
    boolean(out, a.allowed);
    out.extend_from_slice(b",\"status\":");
    number(out, u64::from(a.status));
    out.extend_from_slice(b",\"retry_after\":");
    match a.retry_after {
        Some(n) => number(out, n),
        None => null(out),
    }
    out.extend_from_slice(b",\"ratelimit\":");
    nullable(out, a.ratelimit.as_deref());
    out.extend_from_slice(b",\"ratelimit_policy\":");
    nullable(out, a.ratelimit_policy.as_deref());
    out.extend_from_slice(b",\"rules\":[");
    for (i, r) in a.rules.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(b"{\"rule\":");
        string(out, r.rule);
        for (key, b) in [(&b",\"allowed\":"[..], r.allowed), (b",\"shadow\":", r.shadow)] {
            out.extend_from_slice(key);
            boolean(out, b);
        }
        for (key, n) in [
            (&b",\"limit\":"[..], r.limit),
            (b",\"remaining\":", r.remaining),
            (b",\"reset\":", r.reset),
        ] {
            out.extend_from_slice(key);
            number(out, n);
        }
        out.push(b'}');
    }
    out.push(b']');
    for (key, value) in [
        (&b",\"reservation\":"[..], &a.reservation),
        (b",\"lease\":", &a.lease),
    ] {
        if let Some(v) = value {
            out.extend_from_slice(key);
            string(out, v);
        }
    }
    if let Some(ttl) = a.ttl {
        out.extend_from_slice(b",\"ttl\":");
        number(out, ttl);
    }
    if let Some(detail) = &a.detail {
        out.extend_from_slice(b",\"detail\":");
        string(out, detail);
    }
    out.extend_from_slice(b",\"dry_run\":");
    boolean(out, a.dry_run);
    out.push(b'}');
}

fn null(out: &mut Vec<u8>) {
    out.extend_from_slice(b"null");
}

fn nullable(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => string(out, s),
        None => null(out),
    }
}

fn boolean(out: &mut Vec<u8>, b: bool) {
    out.extend_from_slice(if b { b"true" } else { b"false" });
}

fn number(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

/// `s` as a JSON string: `"` and `\` escaped; a string with a control character (a
/// detail might quote one) is serde_json's to write.
fn string(out: &mut Vec<u8>, s: &str) {
    if s.bytes().any(|b| b < 0x20) {
        // Writing a str into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *out, s);
        return;
    }
    out.push(b'"');
    for &b in s.as_bytes() {
        if b == b'"' || b == b'\\' {
            out.push(b'\\');
        }
        out.push(b);
    }
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn written(a: &Answer<'_>) -> Value {
        let mut out = Vec::new();
        write(&mut out, a);
        serde_json::from_slice(&out).expect("valid JSON")
    }

    #[test]
    fn an_answer_is_the_json_the_docs_give() {
        let a = Answer {
            allowed: false,
            status: 429,
            retry_after: Some(3),
            ratelimit: Some("\"imports\";r=0;t=3".into()),
            ratelimit_policy: Some("\"imports\";q=10;w=60".into()),
            rules: vec![
                RuleAnswer { rule: "imports", allowed: false, shadow: false, limit: 10, remaining: 0, reset: 3 },
                RuleAnswer { rule: "new", allowed: true, shadow: true, limit: 5, remaining: 4, reset: 1 },
            ],
            reservation: Some("00ff".into()),
            detail: Some("a \\ \"quoted\" line\nand\u{1} é \u{2028}".into()),
            ..Answer::default()
        };
        assert_eq!(
            written(&a),
            json!({
                "allowed": false, "status": 429, "retry_after": 3,
                "ratelimit": "\"imports\";r=0;t=3", "ratelimit_policy": "\"imports\";q=10;w=60",
                "rules": [
                    {"rule": "imports", "allowed": false, "shadow": false, "limit": 10, "remaining": 0, "reset": 3},
                    {"rule": "new", "allowed": true, "shadow": true, "limit": 5, "remaining": 4, "reset": 1},
                ],
                "reservation": "00ff",
                "detail": "a \\ \"quoted\" line\nand\u{1} é \u{2028}",
                "dry_run": false,
            })
        );
        let lease = Answer { allowed: true, status: 200, lease: Some("ab".into()), ttl: Some(30), dry_run: true, ..Answer::default() };
        assert_eq!(
            written(&lease),
            json!({
                "allowed": true, "status": 200, "retry_after": null, "ratelimit": null,
                "ratelimit_policy": null, "rules": [], "lease": "ab", "ttl": 30, "dry_run": true,
            })
        );
    }

    #[test]
    fn a_list_is_its_answers_in_order() {
        let one = |status, remaining| Answer {
            status,
            allowed: status == 200,
            rules: vec![RuleAnswer { rule: "r", allowed: status == 200, shadow: false, limit: u64::MAX, remaining, reset: 0 }],
            ..Answer::default()
        };
        let mut out = Vec::new();
        write_list(&mut out, &[one(200, 7), one(429, 0)]);
        let v: Value = serde_json::from_slice(&out).expect("valid JSON");
        let got: Vec<(u64, bool, u64, u64)> = (v.as_array().expect("a list").iter())
            .map(|a| {
                let r = &a["rules"][0];
                (a["status"].as_u64().unwrap(), a["allowed"].as_bool().unwrap(), r["limit"].as_u64().unwrap(), r["remaining"].as_u64().unwrap())
            })
            .collect();
        assert_eq!(got, [(200, true, u64::MAX, 7), (429, false, u64::MAX, 0)]);
        out.clear();
        write_list(&mut out, &[]);
        assert_eq!(out, b"[]");
    }
}
