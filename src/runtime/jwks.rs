//! `[jwt] jwks_url`: the key set fetched over https (verified like a backend: against
//! `jwks_ca` or the system's roots, by the upstream client's TLS), at start, every
//! `jwks_refresh`, and when a token names an unknown `kid` (the verifier asks at most once
//! per 30 s; the request that saw it gets its 401, the next ones the new keys). A failed
//! fetch keeps the last good set; until a first one succeeds the JWT rules answer 503.
//!
//! One task per verifier, holding it weakly: a reload that keeps the `[jwt]` settings
//! keeps the verifier (and its task); one that changes them starts a new task, and the old
//! one ends with its verifier.

use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::rt::TokioIo;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::config::JwksFetch;
use crate::identity::jwt::KeySet;
use crate::identity::Verifier;

/// A JWKS document is at most this long.
pub const MAX_JWKS_BYTES: usize = 1024 * 1024;
/// One fetch, connection to last byte, takes at most this long.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(10);
/// Until a first fetch succeeds, the next is tried this soon (or at `jwks_refresh`, if
/// sooner).
const FIRST_RETRY: Duration = Duration::from_secs(2);

crate::telemetry::label_enum! {
    /// How a JWKS fetch ended.
    pub enum FetchResult {
        /// A key set was fetched (the same as before, or a new one).
        Ok,
        /// Refused, unreachable, not 200, too long, not a JWKS with a usable key: the last
        /// good set keeps serving.
        Failed,
    }
}

crate::telemetry::label_sets! {
    pub struct FetchLabels {
        pub result: FetchResult,
    }
}

crate::telemetry::label_enum! {
    /// What a bearer token's signature check found.
    pub enum CheckResult {
        Accepted,
        Refused,
    }
}

crate::telemetry::label_sets! {
    pub struct CheckLabels {
        pub result: CheckResult,
    }
}

crate::telemetry::metrics! {
    /// `ratewall_jwks_fetches_total{result}`, `ratewall_token_checks_total{result}`.
    pub struct JwksMetrics {
        pub fetches: Family<FetchLabels, Counter> = ("jwks_fetches", "Fetches of [jwt] jwks_url by result: ok, failed (the last good key set keeps serving)",
            zero = FetchResult::ALL.map(|result| FetchLabels { result }),
        ),
        pub token_checks: Family<CheckLabels, Counter> = ("token_checks", "Bearer tokens checked in full (a signature verified), by result: accepted, refused. A token either cache knows is not checked again, nor is one whose address failed too many ([jwt] failures)",
            zero = CheckResult::ALL.map(|result| CheckLabels { result }),
        ),
    }
}

impl JwksMetrics {
    /// The counters a verifier counts its signature checks with: accepted, refused.
    pub fn checks(&self) -> [Counter; 2] {
        [CheckResult::Accepted, CheckResult::Refused].map(|result| {
            self.token_checks
                .get_or_create(&CheckLabels { result })
                .clone()
        })
    }

    fn count(&self, result: FetchResult) {
        self.fetches.get_or_create(&FetchLabels { result }).inc();
    }
}

/// Keep `verifier`'s key set fetched from `fetch`, for as long as the verifier lives.
pub fn start(
    verifier: &Arc<Verifier>,
    fetch: &JwksFetch,
    metrics: Arc<super::Metrics>,
) -> tokio::task::JoinHandle<()> {
    let weak: Weak<Verifier> = Arc::downgrade(verifier);
    let (url, tls, refresh) = (fetch.url.clone(), fetch.tls.clone(), fetch.refresh);
    tokio::spawn(async move {
        loop {
            let Some(verifier) = weak.upgrade() else {
                return;
            };
            match fetch_once(&url, &tls).await {
                Ok(keys) => {
                    metrics.jwks.count(FetchResult::Ok);
                    let n = keys.len();
                    if verifier.set_keys(keys) {
                        tracing::info!(url = %url, keys = n, "jwks: new key set");
                    }
                }
                Err(e) => {
                    metrics.jwks.count(FetchResult::Failed);
                    let kept = match verifier.keys() {
                        Some(_) => "the last good key set keeps serving",
                        None => "no key set yet: JWT rules answer 503",
                    };
                    tracing::warn!(url = %url, error = %e, "jwks fetch failed; {kept}");
                }
            }
            let wait = match verifier.keys() {
                Some(_) => refresh,
                None => refresh.min(FIRST_RETRY),
            };
            // Only the waker is held while waiting: a verifier its configuration dropped
            // ends here, and the task with it.
            let wake = verifier.refetch.clone();
            drop(verifier);
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = wake.notified() => {}
            }
        }
    })
}

/// One GET of `url` over TLS: its body, as a key set.
async fn fetch_once(url: &http::Uri, tls: &crate::upstream::Tls) -> Result<KeySet, String> {
    let body = tokio::time::timeout(FETCH_TIMEOUT, get(url, tls))
        .await
        .map_err(|_| format!("no answer within {FETCH_TIMEOUT:?}"))??;
    KeySet::from_jwks(&body)
}

async fn get(url: &http::Uri, tls: &crate::upstream::Tls) -> Result<Bytes, String> {
    let host = url.host().ok_or("no host")?;
    let port = url.port_u16().unwrap_or(443);
    let tcp = tokio::net::TcpStream::connect((host.trim_matches(['[', ']']), port))
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let stream = tls.connect(tcp).await.map_err(|e| format!("TLS: {e}"))?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("HTTP: {e}"))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let authority = url.authority().map_or(host, |a| a.as_str());
    let req = http::Request::get(url.path_and_query().map_or("/", |p| p.as_str()))
        .header(http::header::HOST, authority)
        .header(http::header::ACCEPT, "application/json")
        .body(Empty::<Bytes>::new())
        .map_err(|e| format!("request: {e}"))?;
    let resp = send
        .send_request(req)
        .await
        .map_err(|e| format!("HTTP: {e}"))?;
    if resp.status() != http::StatusCode::OK {
        return Err(format!("status {}", resp.status().as_u16()));
    }
    let body = Limited::new(resp.into_body(), MAX_JWKS_BYTES)
        .collect()
        .await
        .map_err(|e| format!("body (at most {MAX_JWKS_BYTES} bytes): {e}"))?;
    Ok(body.to_bytes())
}
