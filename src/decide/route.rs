//! Where a request goes: the first route whose match fits it and that route's pool, or
//! the pool `default` for a request no route fits (else it is answered 404). Chosen
//! before the rules, which may follow a route (`match = { route = "billing" }`), and
//! before the identity a `hash:` pool balances by is read.

use super::Subject;
use crate::config::Config;
use crate::identity::{Refusal, Requester};
use crate::rules;
use crate::upstream::Balance;

/// A request's way upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Destination {
    /// The route it matched (a position in `config.routes.list`); `None`: no route, the
    /// pool `default`.
    pub route: Option<usize>,
    /// Its pool: a position in `config.upstreams`.
    pub pool: usize,
    /// For a pool balanced by `hash:<key source>`, the hash of the request's identity
    /// under that key source ([`Destination::hashed`]).
    pub hash: Option<u64>,
}

impl Destination {
    /// The route's name, as logs show it.
    pub fn route_name<'c>(&self, cfg: &'c Config) -> Option<&'c str> {
        self.route
            .and_then(|r| cfg.routes.list.get(r))
            .map(|r| r.name.as_str())
    }

    /// The pool's name.
    pub fn pool_name<'c>(&self, cfg: &'c Config) -> Option<&'c str> {
        cfg.upstreams.get(self.pool).map(|p| p.name.as_str())
    }

    /// The path and query the request is forwarded with, where its route rewrites them
    /// (`strip_prefix`, `add_prefix`): the path the route matched, normalised, never
    /// outside `add_prefix` ([`crate::rules::Routes::forwarded_path`]).
    pub fn target(&self, cfg: &Config, uri: &http::Uri) -> Option<String> {
        let route = cfg.routes.list.get(self.route?)?;
        if route.strip_prefix.is_none() && route.add_prefix.is_none() {
            return None;
        }
        let pq = uri.path_and_query().map_or("/", |pq| pq.as_str());
        Some(cfg.routes.forwarded_path(self.route?, pq).into_owned())
    }

    /// With the hash a `hash:<key source>` pool balances the request by: its identity's
    /// under that key source (a request without one is balanced round robin).
    pub fn hashed<'a>(mut self, cfg: &'a Config, requester: &Requester<'a>) -> Destination {
        if let Some(Balance::Hash(key)) = cfg.upstreams.get(self.pool).map(|p| &p.balance) {
            self.hash = requester
                .identify(key)
                .ok()
                .map(|id| crate::upstream::key_hash(&id.digest.0));
        }
        self
    }
}

/// The request's destination; `Ok(None)` when no route fits and there is no pool
/// `default` (a 404). A key a route's condition reads and refuses refuses the request.
pub fn choose(
    cfg: &Config,
    subject: &Subject<'_>,
    requester: &Requester<'_>,
) -> Result<Option<Destination>, Refusal> {
    let routes = &cfg.routes;
    let route = if routes.list.is_empty() {
        None
    } else {
        let path = cfg.index.path_of(subject.uri.path());
        let host = if routes.uses_host() {
            rules::request_host(subject.uri, subject.headers)
        } else {
            None
        };
        routes.choose(subject.method, &path, host, requester)?
    };
    let pool = match route {
        Some(r) => routes.list.get(r).map(|r| r.pool),
        None => routes.default_pool,
    };
    Ok(pool.map(|pool| Destination {
        route,
        pool,
        hash: None,
    }))
}
