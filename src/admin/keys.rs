//! `/admin/keys`: API keys added, re-planned, revoked and listed at runtime.
//!
//! | call | what |
//! | --- | --- |
//! | `PUT /admin/keys/<sha256-hex>` `{"plan":"pro","label":"Acme Corp"}` | list a key (by its digest) with a plan, and a label if given |
//! | `POST /admin/keys` `{"key":"<raw>","plan":"pro","label":"Acme Corp"}` | the same, by the raw key: hashed on arrival, never stored, logged or echoed |
//! | `DELETE /admin/keys/<sha256-hex>` | revoke a key: unlisted from the next request on |
//! | `GET /admin/keys?plan=pro&after=<hex>&limit=100` | digests, plans and labels, sorted by digest; `next` is the following page's `after` |
//!
//! Changes land in the runtime directory ([`crate::identity::directory`]): with the
//! memory store, the keys file, rewritten atomically (no file: 409, a change must survive a
//! restart); with Redis, the `<prefix>:keys` hash, which every gateway follows. A plan no
//! rule defines is 400; a key listed in `limits.toml` (inline, or in a shared store's keys
//! file) is the file's to change: 409. A label is optional, and checked as the config
//! checks one ([`directory::label`]): 400 otherwise. Each change is one audit line (target
//! `ratewall::audit`): action, digest, old and new plan, the label, the admin's address.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Method, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde::{Deserialize, Serialize};

use super::{error, json, parse_query, refused, BadCall, Reply};
use crate::config::Config;
use crate::identity::directory::{self, Change, Entries, Entry, KeyDigest};
use crate::identity::{sha256, MAX_KEY_LEN};
use crate::limiter::redis::directory::{Location, RedisKeys};
use crate::front_end::Shared;

/// The largest body a key call takes.
pub const MAX_BODY: usize = 16 * 1024;

/// How long a body may take to arrive.
const BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// A page's size: `limit=`'s default and bounds.
const DEFAULT_LIMIT: usize = 100;
const MAX_LIMIT: usize = 1000;

/// The path's calls: `/admin/keys` and `/admin/keys/<hex>`.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Call {
    List,
    Add,
    Set(KeyDigest),
    Delete(KeyDigest),
}

/// Which call `method` on `path` (under `/admin/keys`) is; or its refusal.
pub(super) fn route(method: &Method, path: &str) -> Result<Call, BadCall> {
    let rest = path.strip_prefix("/admin/keys").unwrap_or(path);
    match rest.strip_prefix('/').filter(|r| !r.is_empty()) {
        None => match *method {
            Method::GET => Ok(Call::List),
            Method::POST => Ok(Call::Add),
            _ => Err(not_allowed("GET or POST")),
        },
        Some(hex) => {
            let digest = directory::parse_hex(hex).ok_or_else(|| {
                bad("the key's digest is 64 hex digits: its SHA-256 (`printf %s KEY | sha256sum`)")
            })?;
            match *method {
                Method::PUT => Ok(Call::Set(digest)),
                Method::DELETE => Ok(Call::Delete(digest)),
                _ => Err(not_allowed("PUT or DELETE")),
            }
        }
    }
}

fn bad(message: impl Into<String>) -> BadCall {
    (StatusCode::BAD_REQUEST, message.into())
}

fn not_allowed(which: &str) -> BadCall {
    (
        StatusCode::METHOD_NOT_ALLOWED,
        format!("method not allowed: {which}"),
    )
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PlanBody {
    plan: String,
    label: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyBody {
    key: String,
    plan: String,
    label: Option<String>,
}

/// A plan as a body names it, and the label given with it, if any.
pub(super) type Planned = (String, Option<String>);

/// `PUT`'s body: `{"plan": "<plan>"}` or `{"plan": "<plan>", "label": "<label>"}`,
/// nothing else.
pub(super) fn plan_body(body: &[u8]) -> Result<Planned, BadCall> {
    serde_json::from_slice::<PlanBody>(body)
        .map(|b| (b.plan, b.label))
        .map_err(|e| {
            bad(format!(
                "the body is {{\"plan\": \"<plan>\"}}, with \"label\": \"<label>\" if you like: {e}"
            ))
        })
}

/// `POST`'s body: `{"key": "<raw key>", "plan": "<plan>"}`, and `"label"` if given,
/// nothing else; the key's digest. An error never repeats the body (it holds a key): it
/// says only what is wrong.
pub(super) fn key_body(body: &[u8]) -> Result<(KeyDigest, Planned), BadCall> {
    let b = serde_json::from_slice::<KeyBody>(body).map_err(|e| {
        let what = match e.classify() {
            serde_json::error::Category::Data => "a field is missing, unknown or not a string",
            _ => "not JSON",
        };
        bad(format!(
            "the body is {{\"key\": \"<API key>\", \"plan\": \"<plan>\"}}: {what} (line {}, column {})",
            e.line(),
            e.column()
        ))
    })?;
    let k = b.key.as_bytes();
    let trimmed = k.trim_ascii();
    if k.is_empty() || k.len() > MAX_KEY_LEN {
        return Err(bad(format!("the key is 1 to {MAX_KEY_LEN} bytes")));
    }
    // What a client can send and the gateway would read as this key.
    if trimmed.len() != k.len() || http::HeaderValue::from_bytes(k).is_err() {
        return Err(bad(
            "the key is a header value: no control characters, no spaces around it",
        ));
    }
    Ok((sha256(k), (b.plan, b.label)))
}

/// The entry a body asks for: its plan must be one a rule defines, its label one the
/// config would take.
fn entry(cfg: &Config, (plan, label): Planned) -> Result<Entry, BadCall> {
    let label = match label {
        Some(l) => Some(directory::label(&l).map_err(bad)?),
        None => None,
    };
    Ok(Entry {
        plan: defined(cfg, &plan)?,
        label,
    })
}

/// The plan must be one a rule defines.
fn defined(cfg: &Config, plan: &str) -> Result<Arc<str>, BadCall> {
    if cfg.keys.defines(plan) {
        if let Some(p) = directory::plan_name(plan) {
            return Ok(p);
        }
    }
    let names: Vec<String> = cfg.keys.defined().map(|p| format!("{p:?}")).collect();
    Err(bad(if names.is_empty() {
        format!("plan {plan:?} is not defined: no rule has a [rules.plans.<plan>] table")
    } else {
        format!(
            "plan {plan:?} is not defined: the rules define {}",
            names.join(", ")
        )
    }))
}

#[derive(Serialize)]
struct Changed<'a> {
    digest: String,
    /// The plan before (`null`: the key was not listed).
    old_plan: Option<&'a str>,
    /// The plan now (`null`: deleted).
    plan: Option<&'a str>,
    /// The label now, where it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    label: Option<&'a str>,
}

#[derive(Serialize)]
struct Listed {
    digest: String,
    plan: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    label: Option<String>,
    /// `runtime` (the directory: this API's) or `config` (`limits.toml` or its keys file).
    source: &'static str,
}

/// Serve one `/admin/keys` call (its token already checked).
pub(super) async fn call(shared: &Shared, peer: IpAddr, req: http::Request<Incoming>) -> Reply {
    let call = match route(req.method(), req.uri().path()) {
        Ok(c) => c,
        Err(r) => return refused(r),
    };
    let live = shared.live();
    let cfg = &*live.config;
    let change = match call {
        Call::List => {
            let query = parse_query(req.uri().query().unwrap_or(""));
            return match list(cfg, &query) {
                Ok(r) => r,
                Err(r) => refused(r),
            };
        }
        Call::Delete(d) => Change::Delete(d),
        Call::Set(d) => match read_body(req).await.and_then(|b| plan_body(&b)) {
            Ok(planned) => match entry(cfg, planned) {
                Ok(e) => Change::Set(d, e),
                Err(r) => return refused(r),
            },
            Err(r) => return refused(r),
        },
        Call::Add => match read_body(req).await.and_then(|b| key_body(&b)) {
            Ok((d, planned)) => match entry(cfg, planned) {
                Ok(e) => Change::Set(d, e),
                Err(r) => return refused(r),
            },
            Err(r) => return refused(r),
        },
    };
    match apply(cfg, &change).await {
        Ok(old) => {
            let (new, label) = match &change {
                Change::Set(_, e) => (Some(&*e.plan), e.label.as_deref()),
                Change::Delete(_) => (None, None),
            };
            let digest = directory::hex(change.digest());
            if matches!(change, Change::Delete(_)) && old.is_none() {
                return error(StatusCode::NOT_FOUND, "this key is not listed");
            }
            tracing::info!(
                target: "ratewall::audit",
                action = if new.is_some() { "set" } else { "delete" },
                digest = %digest,
                old_plan = old.as_deref().unwrap_or("-"),
                new_plan = new.unwrap_or("-"),
                label = label.unwrap_or("-"),
                admin = %peer,
                "key directory changed"
            );
            let status = if old.is_none() {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            };
            json(
                status,
                &Changed {
                    digest,
                    old_plan: old.as_deref(),
                    plan: new,
                    label,
                },
            )
        }
        Err(r) => refused(r),
    }
}

/// The body, at most [`MAX_BODY`] bytes, within [`BODY_TIMEOUT`].
async fn read_body(req: http::Request<Incoming>) -> Result<bytes::Bytes, BadCall> {
    let limited = Limited::new(req.into_body(), MAX_BODY);
    match tokio::time::timeout(BODY_TIMEOUT, limited.collect()).await {
        Ok(Ok(b)) => Ok(b.to_bytes()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            Err(bad(format!("the body is over {} KiB", MAX_BODY / 1024)))
        }
        Ok(Err(_)) => Err(bad("the body could not be read")),
        Err(_) => Err((
            StatusCode::REQUEST_TIMEOUT,
            "the body took too long".to_string(),
        )),
    }
}

/// Make the change where the directory lives; the plan the key had before.
async fn apply(cfg: &Config, change: &Change) -> Result<Option<String>, BadCall> {
    let keys = &cfg.keys;
    if keys.static_plan(change.digest()).is_some() {
        return Err((
            StatusCode::CONFLICT,
            "this key is listed in the config ([keys.plans] in limits.toml, or the keys file with a shared store): change it there and reload".into(),
        ));
    }
    let directory = keys.directory().clone();
    if let Some(at) = Location::of(&cfg.store, keys.resync) {
        let old = RedisKeys::new(at)
            .change(change)
            .await
            .map_err(|e| (StatusCode::SERVICE_UNAVAILABLE, format!("store: {e}")))?;
        // This gateway knows at once; the others within milliseconds (its message).
        directory.apply(change);
        // The hash holds the plan, then the label: the plan is its first word.
        return Ok(old.map(|o| Entry::parse(&o).map_or(o, |e| e.plan.to_string())));
    }
    let Some(path) = keys.file.clone().filter(|_| keys.directory_in_file()) else {
        return Err((
            StatusCode::CONFLICT,
            "the memory store keeps runtime keys in the keys file, and none is set: set [keys] file in limits.toml (a change must survive a restart)".into(),
        ));
    };
    let change = change.clone();
    let written = tokio::task::spawn_blocking(move || {
        let _writing = directory.writer();
        let mut next = Entries::clone(&directory.snapshot());
        let old = match &change {
            Change::Set(d, p) => next.insert(*d, p.clone()),
            Change::Delete(d) => next.remove(d),
        };
        // Nothing to write for a key that was not there.
        if old.is_some() || matches!(change, Change::Set(..)) {
            crate::config::write_keys_file(&path, &next)
                .map_err(|e| format!("cannot write the keys file {}: {e}", path.display()))?;
            directory.replace(next);
        }
        Ok::<_, String>(old.map(|e| e.plan.to_string()))
    })
    .await;
    match written {
        Ok(Ok(old)) => Ok(old),
        Ok(Err(m)) => Err((StatusCode::INTERNAL_SERVER_ERROR, m)),
        Err(e) => Err((StatusCode::INTERNAL_SERVER_ERROR, format!("{e}"))),
    }
}

/// `GET /admin/keys`: every key listed, runtime and config, by digest.
fn list(cfg: &Config, query: &[(String, Vec<u8>)]) -> Result<Reply, BadCall> {
    let mut plan = None;
    let mut after = None;
    let mut limit = DEFAULT_LIMIT;
    for (name, value) in query {
        let text = std::str::from_utf8(value).map_err(|_| bad(format!("{name}= is not UTF-8")))?;
        match name.as_str() {
            "plan" => plan = Some(text),
            "after" => {
                after =
                    Some(directory::parse_hex(text).ok_or_else(|| {
                        bad("after= is a digest: 64 hex digits (a page's `next`)")
                    })?)
            }
            "limit" => {
                limit = text
                    .parse()
                    .ok()
                    .filter(|n| (1..=MAX_LIMIT).contains(n))
                    .ok_or_else(|| bad(format!("limit= is 1 to {MAX_LIMIT}")))?
            }
            other => {
                return Err(bad(format!(
                    "unknown parameter {other:?}: plan=, after=, limit="
                )))
            }
        }
    }
    let keys = &cfg.keys;
    let runtime = keys.directory().snapshot();
    let mut all: Entries = keys
        .static_entries()
        .filter(|(d, _)| !runtime.contains_key(*d))
        .map(|(d, e)| (*d, e.clone()))
        .collect();
    all.extend(runtime.iter().map(|(d, e)| (*d, e.clone())));
    let (page, next) = directory::page(&all, plan, after.as_ref(), limit);
    let listed: Vec<Listed> = page
        .into_iter()
        .map(|(d, e)| Listed {
            source: if runtime.contains_key(&d) {
                "runtime"
            } else {
                "config"
            },
            digest: directory::hex(&d),
            plan: e.plan.to_string(),
            label: e.label.map(|l| l.to_string()),
        })
        .collect();
    Ok(json(
        StatusCode::OK,
        &serde_json::json!({
            "keys": listed,
            "next": next.as_ref().map(directory::hex),
        }),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_take_a_digest_or_nothing() {
        let h = "ab".repeat(32);
        let at = |m: Method, p: &str| route(&m, p);
        assert_eq!(at(Method::GET, "/admin/keys"), Ok(Call::List));
        assert_eq!(at(Method::GET, "/admin/keys/"), Ok(Call::List));
        assert_eq!(at(Method::POST, "/admin/keys"), Ok(Call::Add));
        let d = directory::parse_hex(&h).unwrap();
        assert_eq!(
            at(Method::PUT, &format!("/admin/keys/{h}")),
            Ok(Call::Set(d))
        );
        assert_eq!(
            at(Method::DELETE, &format!("/admin/keys/{}", h.to_uppercase())),
            Ok(Call::Delete(d))
        );
        for (m, p) in [
            (Method::PUT, "/admin/keys"),
            (Method::DELETE, "/admin/keys"),
            (Method::GET, &format!("/admin/keys/{h}")),
            (Method::POST, &format!("/admin/keys/{h}")),
        ] {
            assert_eq!(
                at(m, p).unwrap_err().0,
                StatusCode::METHOD_NOT_ALLOWED,
                "{p}"
            );
        }
        for p in [
            format!("/admin/keys/{}", &h[..63]),
            format!("/admin/keys/{h}0"),
            format!("/admin/keys/{}zz", &h[..62]),
            format!("/admin/keys/{h}/x"),
            "/admin/keys/sha256:00".to_string(),
        ] {
            let (status, message) = at(Method::PUT, &p).unwrap_err();
            assert_eq!(status, StatusCode::BAD_REQUEST, "{p}");
            assert!(message.contains("64 hex digits"), "{message}");
        }
    }

    #[test]
    fn bodies_are_parsed_strictly() {
        assert_eq!(
            plan_body(br#"{"plan":"pro"}"#),
            Ok(("pro".to_string(), None))
        );
        assert_eq!(
            plan_body(br#"{"plan":"pro","label":"Acme Corp"}"#),
            Ok(("pro".to_string(), Some("Acme Corp".to_string())))
        );
        for b in [
            &br#"{"plan":"pro","x":1}"#[..],
            br#"{"plan":7}"#,
            br#"{"plan":"pro","label":7}"#,
            br#"{}"#,
            br#"{"plan":"pro"} trailing"#,
            b"\xff\xfe",
            b"",
        ] {
            assert_eq!(plan_body(b).unwrap_err().0, StatusCode::BAD_REQUEST);
        }
        let (d, (plan, label)) = key_body(br#"{"key":"secret-key-1","plan":"pro"}"#).unwrap();
        assert_eq!(
            (d, plan.as_str(), label),
            (sha256(b"secret-key-1"), "pro", None)
        );
        let (_, (_, label)) =
            key_body(br#"{"key":"secret-key-1","plan":"pro","label":"Acme Corp"}"#).unwrap();
        assert_eq!(label.as_deref(), Some("Acme Corp"));
        let long = format!(
            r#"{{"key":"{}","plan":"pro"}}"#,
            "k".repeat(MAX_KEY_LEN + 1)
        );
        for b in [
            br#"{"key":"secret-key-1","plan":"pro","note":"secret-key-1"}"#.to_vec(),
            br#"{"key":"","plan":"pro"}"#.to_vec(),
            br#"{"key":" secret-key-1","plan":"pro"}"#.to_vec(),
            br#"{"key":"a\u0001b","plan":"pro"}"#.to_vec(),
            br#"{"plan":"pro"}"#.to_vec(),
            br#"{"key":"secret-key-1"}"#.to_vec(),
            long.into_bytes(),
            b"secret-key-1".to_vec(),
        ] {
            let (status, message) = key_body(&b).unwrap_err();
            assert_eq!(status, StatusCode::BAD_REQUEST);
            // The key never comes back in an error.
            assert!(!message.contains("secret-key-1"), "{message}");
        }
    }
}
