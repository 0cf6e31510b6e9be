//! One request: identify -> match rules -> limit -> answer or forward.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{Either, Full};
use hyper::body::Incoming;

use crate::config::{Config, KeyKind, MissingKey, OnError, Rule, UnknownKeys};
use crate::headers::{self, Applied, Problem};
use crate::identity::{self, KeyError};
use crate::limiter::{Check, IdentityDigest, Store};
use crate::proxy::{Proxy, ProxyError};
use crate::rules;

/// What a client receives: the upstream's streamed body, or one the gateway wrote.
pub type Body = Either<Incoming, Full<Bytes>>;

pub struct Gateway {
    config: Arc<Config>,
    store: Store,
    proxy: Proxy,
    /// Whether the last store call failed: store trouble is logged when it starts and
    /// when it ends, not once per request.
    store_failing: AtomicBool,
}

/// Why a request was answered before any limit was consulted.
enum Refusal {
    Missing(&'static str),
    Unknown,
    Malformed(KeyError),
}

impl Gateway {
    pub fn new(config: Arc<Config>, store: Store) -> Gateway {
        let proxy = Proxy::new(&config.upstream);
        Gateway {
            config,
            store,
            proxy,
            store_failing: AtomicBool::new(false),
        }
    }

    pub fn config(&self) -> &Arc<Config> {
        &self.config
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    pub async fn handle(&self, req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
        let cfg = &*self.config;
        let path = rules::normalize_path(req.uri().path());
        let applied_rules: Vec<&Rule> = cfg
            .rules
            .iter()
            .filter(|r| rules::applies(r, req.method(), &path))
            .collect();
        if applied_rules.is_empty() {
            return self.forward(req, peer.ip(), &[]).await;
        }

        let identities = match self.identify(&applied_rules, req.headers(), peer.ip()) {
            Ok(ids) => ids,
            Err(refusal) => return refuse(refusal, cfg),
        };
        let plan = self.plan(req.headers());
        let checks: Vec<Check<'_>> = applied_rules
            .iter()
            .zip(&identities)
            .map(|(rule, id)| Check {
                identity: id,
                rule: &rule.name,
                quota: rule.quota_for(plan),
            })
            .collect();

        let decisions = match self.store.decide(&checks).await {
            Ok(d) => {
                if self.store_failing.swap(false, Ordering::Relaxed) {
                    tracing::info!("store answers again; limiting resumed");
                }
                d
            }
            Err(e) => {
                if !self.store_failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(error = %e, on_error = ?cfg.store.on_error, "store failed; applying on_error until it answers");
                }
                return match cfg.store.on_error {
                    OnError::Deny => problem(
                        Problem::new(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "the rate-limit store is unavailable",
                        )
                        .with_retry_after(1),
                        cfg,
                        &[],
                    ),
                    OnError::Allow => self.forward(req, peer.ip(), &[]).await,
                };
            }
        };

        let applied: Vec<Applied<'_>> = checks
            .iter()
            .zip(decisions)
            .map(|(c, decision)| Applied {
                rule: c.rule,
                quota: c.quota,
                decision,
            })
            .collect();
        if applied.iter().any(|a| !a.decision.allowed) {
            tracing::debug!(path = %path, "denied");
            return problem(Problem::too_many_requests(&applied), cfg, &applied);
        }
        self.forward(req, peer.ip(), &applied).await
    }

    /// The identity digest of the request under each rule, in order.
    fn identify(
        &self,
        rules: &[&Rule],
        headers: &HeaderMap,
        peer: IpAddr,
    ) -> Result<Vec<IdentityDigest>, Refusal> {
        let cfg = &*self.config;
        let mut ip = None;
        let mut client_ip =
            || *ip.get_or_insert_with(|| identity::client_ip(peer, headers, &cfg.client_ip));
        rules
            .iter()
            .map(|rule| {
                let (name, value) = match &rule.key {
                    KeyKind::Global => return Ok(identity::digest_global()),
                    KeyKind::ClientIp => return Ok(identity::digest_ip(client_ip())),
                    KeyKind::ApiKey => (&cfg.keys.header, None),
                    KeyKind::Header(h) => (h, Some(h)),
                };
                match identity::api_key(headers, name).map_err(Refusal::Malformed)? {
                    Some(v) => match value {
                        Some(h) => Ok(identity::digest_header(h, v)),
                        None => {
                            if cfg.keys.unknown == UnknownKeys::Reject
                                && !cfg.keys.plans.contains_key(v)
                            {
                                return Err(Refusal::Unknown);
                            }
                            Ok(identity::digest_api_key(v))
                        }
                    },
                    None => match rule.missing_key {
                        MissingKey::ClientIp => Ok(identity::digest_ip(client_ip())),
                        MissingKey::Reject => Err(Refusal::Missing(if value.is_some() {
                            "a header this rule counts by is missing"
                        } else {
                            "an API key is required"
                        })),
                    },
                }
            })
            .collect()
    }

    /// The plan the request's API key maps to, if any.
    fn plan(&self, headers: &HeaderMap) -> Option<&str> {
        let keys = &self.config.keys;
        if keys.plans.is_empty() {
            return None;
        }
        let key = identity::api_key(headers, &keys.header).ok().flatten()?;
        keys.plans.get(key).map(String::as_str)
    }

    async fn forward(
        &self,
        req: Request<Incoming>,
        peer: IpAddr,
        applied: &[Applied<'_>],
    ) -> Response<Body> {
        match self.proxy.forward(req, peer).await {
            Ok(resp) => {
                let mut resp = resp.map(Either::Left);
                headers::add_ratelimit(resp.headers_mut(), self.config.response, applied);
                resp
            }
            Err(e) => {
                let status = match e {
                    ProxyError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
                    ProxyError::Unreachable(_) | ProxyError::Failed(_) => StatusCode::BAD_GATEWAY,
                };
                tracing::warn!(error = %e, status = status.as_u16(), "upstream failed");
                let detail = match status {
                    StatusCode::GATEWAY_TIMEOUT => "the upstream did not answer in time",
                    _ => "the upstream could not be reached",
                };
                problem(Problem::new(status, detail), &self.config, applied)
            }
        }
    }
}

fn refuse(refusal: Refusal, cfg: &Config) -> Response<Body> {
    let p = match refusal {
        Refusal::Missing(why) => Problem::new(StatusCode::UNAUTHORIZED, why),
        Refusal::Unknown => Problem::new(StatusCode::UNAUTHORIZED, "the API key is not known"),
        Refusal::Malformed(e) => Problem::new(StatusCode::BAD_REQUEST, &e.to_string()),
    };
    problem(p, cfg, &[])
}

/// A response the gateway writes itself.
pub fn problem(p: Problem, cfg: &Config, applied: &[Applied<'_>]) -> Response<Body> {
    let mut resp = Response::new(Either::Right(Full::new(p.body.clone())));
    *resp.status_mut() = p.status;
    p.headers(resp.headers_mut());
    headers::add_ratelimit(resp.headers_mut(), cfg.response, applied);
    resp
}
