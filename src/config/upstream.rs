//! `[upstream]` and `[[upstreams]]`: the pools requests are forwarded to. `[upstream]`
//! with a `url` is the pool named `default`; without one, it holds the settings every
//! `[[upstreams]]` pool inherits (each pool key but `name` and `servers`). Validated into
//! [`PoolSettings`], the pool `default` first.

use std::collections::HashSet;
use std::num::NonZeroU32;
use std::ops::Range;
use std::path::Path;
use std::time::Duration;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use toml::Spanned;

use super::overload::RawOverload;
use super::values::{
    BalanceSpec, Expect, FailStatus, HealthPath, HumanDuration, Percent, PoolName, ProtocolSpec,
    Retries, UpstreamUrl, Weight,
};
use super::Invalid;
use crate::identity::KeyKind;
use crate::upstream::{
    tls_for, Balance, HealthCheck, Passive, PoolSettings, Protocol, ServerSettings, TlsError,
    TlsOptions, CONNECT_TIMEOUT, DEFAULT_POOL, FAIL_TIMEOUT, FAIL_WINDOW, MAX_EJECTED_PERCENT,
    MAX_FAILS, RESOLVE_EVERY, RETRIES, TIMEOUT,
};

/// `[[upstreams]]`' pool table, and from its keys `[upstream]`'s and the view of either
/// that validation reads, so that the pool keys are written once. (serde's `flatten`
/// would share them too, but a flattened table loses its values' spans and the list of
/// keys an unknown one's error gives.) The keys after `name` and `servers` are the pool's
/// settings; the macro makes:
/// - `$upstream`: `[upstream]`, the same settings with `url` for `name` and `servers`;
/// - [`Keys`]: one table's settings by reference, with the table's key path, and each
///   table's `keys(table)`; `empty_keys()`, a table that gives none.
macro_rules! pool_tables {
    (@keys $table:ident: $($key:ident),*) => {
        impl $table {
            fn keys(&self, table: String) -> Keys<'_> {
                Keys {
                    table,
                    $($key: self.$key.as_ref(),)*
                }
            }
        }
    };
    (
        upstream: $upstream:ident,
        $(#[$meta:meta])*
        $vis:vis struct $pool:ident {
            name: $name:ty,
            servers: $servers:ty,
            $($key:ident: Option<$ty:ty>,)*
        }
    ) => {
        $(#[$meta])*
        $vis struct $pool {
            name: $name,
            servers: $servers,
            $($key: Option<$ty>,)*
        }

        /// `[upstream]`: a pool's settings (see [`RawPool`]), and `url`.
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        $vis struct $upstream {
            /// Given: this table is the pool `default`, of this one server.
            url: Option<Spanned<UpstreamUrl>>,
            $($key: Option<$ty>,)*
        }

        /// The pool keys of one table, and the table's key path (`upstream`,
        /// `upstreams[2]`), so that an error names the table the value came from.
        #[derive(Clone)]
        struct Keys<'a> {
            table: String,
            $($key: Option<&'a $ty>,)*
        }

        pool_tables!(@keys $pool: $($key),*);
        pool_tables!(@keys $upstream: $($key),*);

        /// `[upstream]` without a key.
        fn empty_keys<'a>() -> Keys<'a> {
            Keys {
                table: "upstream".to_string(),
                $($key: None,)*
            }
        }
    };
}

pool_tables! {
    upstream: RawUpstream,
    /// One `[[upstreams]]` pool: a name, servers, and the pool's settings (each also a
    /// key of `[upstream]`).
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct RawPool {
        name: Spanned<PoolName>,
        servers: Spanned<Vec<Spanned<ServerEntry>>>,
        connect_timeout: Option<Spanned<HumanDuration>>,
        timeout: Option<Spanned<HumanDuration>>,
        // https:// only: see `crate::upstream::TlsOptions`.
        ca: Option<Spanned<String>>,
        sni: Option<Spanned<String>>,
        cert: Option<Spanned<String>>,
        key: Option<Spanned<String>>,
        insecure_skip_verify: Option<Spanned<bool>>,
        balance: Option<Spanned<BalanceSpec>>,
        max_fails: Option<Spanned<u32>>,
        fail_window: Option<Spanned<HumanDuration>>,
        fail_timeout: Option<Spanned<HumanDuration>>,
        max_ejected_percent: Option<Spanned<Percent>>,
        fail_on_status: Option<Spanned<Vec<FailStatus>>>,
        health: Option<Spanned<RawHealth>>,
        retries: Option<Spanned<Retries>>,
        resolve_every: Option<Spanned<HumanDuration>>,
        protocol: Option<Spanned<ProtocolSpec>>,
        overload: Option<Spanned<RawOverload>>,
    }
}

/// One of `servers` written as a table: `{ url = "https://b:8443", weight = 2 }`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPoolServer {
    url: UpstreamUrl,
    weight: Option<Weight>,
}

/// One of `servers`: a URL, or a [`RawPoolServer`] table.
struct ServerEntry(RawPoolServer);

impl<'de> Deserialize<'de> for ServerEntry {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ServerEntry;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a server's URL, or a table { url, weight }")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<ServerEntry, E> {
                let url = UpstreamUrl::deserialize(de::value::StrDeserializer::<E>::new(s))?;
                Ok(ServerEntry(RawPoolServer { url, weight: None }))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<ServerEntry, A::Error> {
                RawPoolServer::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(ServerEntry)
            }
        }
        d.deserialize_any(V)
    }
}

/// `health = { … }`: active checks; a key left out takes [`HealthCheck`]'s default.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHealth {
    path: Option<HealthPath>,
    interval: Option<Spanned<HumanDuration>>,
    timeout: Option<Spanned<HumanDuration>>,
    healthy: Option<NonZeroU32>,
    unhealthy: Option<NonZeroU32>,
    expect: Option<Expect>,
}

/// A pool's own keys, then what it inherits (`[upstream]` without a url), if anything.
struct Layered<'a> {
    own: Keys<'a>,
    inherited: Option<Keys<'a>>,
}

impl<'a> Layered<'a> {
    /// The value `get` reads, from the pool's own table or else the inherited one, with
    /// that table's key path.
    fn pick<T: ?Sized>(&self, get: impl Fn(&Keys<'a>) -> Option<&'a T>) -> Option<(&str, &'a T)> {
        get(&self.own)
            .map(|v| (self.own.table.as_str(), v))
            .or_else(|| {
                let i = self.inherited.as_ref()?;
                get(i).map(|v| (i.table.as_str(), v))
            })
    }

    fn duration(
        &self,
        get: impl Fn(&Keys<'a>) -> Option<&'a Spanned<HumanDuration>>,
        default: Duration,
    ) -> Duration {
        self.pick(get).map_or(default, |(_, d)| d.get_ref().0)
    }
}

/// Every pool of the file, the pool `default` first; and the settings a pool made from
/// nothing but a URL takes (`[upstream]` without url, or the defaults), for `--upstream`.
/// `upstream` is `[upstream]` (with the span of its table), `pools` the `[[upstreams]]`;
/// files are read relative to `dir`. `client_certs`: whether clients may present
/// certificates (`hash:client_cert` needs them).
pub(super) fn validate(
    upstream: Option<&Spanned<RawUpstream>>,
    pools: &[Spanned<RawPool>],
    dir: &Path,
    client_certs: bool,
) -> Result<(Vec<PoolSettings>, PoolDefaults), Invalid> {
    let mut out = Vec::with_capacity(pools.len() + 1);
    let url = upstream.and_then(|u| u.get_ref().url.as_ref());
    // `[upstream]` with url: the pool `default`; without: what the pools inherit.
    let mut inherited = None;
    if let Some(u) = upstream.map(Spanned::get_ref) {
        let own = u.keys("upstream".to_string());
        match &u.url {
            Some(url) => {
                let server = (url.span(), url.get_ref(), None::<u32>);
                let layered = Layered {
                    own,
                    inherited: None,
                };
                out.push(pool(DEFAULT_POOL, &[server], &layered, dir, client_certs)?);
            }
            None => inherited = Some(own),
        }
    }
    let defaults = PoolDefaults::of(inherited.as_ref(), dir, client_certs)?;
    let mut names = HashSet::new();
    for (i, p) in pools.iter().enumerate() {
        let raw = p.get_ref();
        let name = raw.name.get_ref().0.as_str();
        let at = format!("upstreams[{i}]");
        if name == DEFAULT_POOL && url.is_some() {
            return Err(Invalid::new(
                Some(raw.name.span()),
                format!("{at}.name"),
                "the pool \"default\" is [upstream] url: name this pool otherwise, or drop url from [upstream] and keep this one",
            ));
        }
        if !names.insert(name) {
            return Err(Invalid::new(
                Some(raw.name.span()),
                format!("{at}.name"),
                format!("duplicate pool name {name:?}"),
            ));
        }
        if raw.servers.get_ref().is_empty() {
            return Err(Invalid::new(
                Some(raw.servers.span()),
                format!("{at}.servers"),
                "a pool needs at least one server: servers = [\"http://10.0.0.1:8080\"]",
            ));
        }
        let servers: Vec<_> = raw
            .servers
            .get_ref()
            .iter()
            .map(|s| {
                (
                    s.span(),
                    &s.get_ref().0.url,
                    s.get_ref().0.weight.as_ref().map(|w| w.0),
                )
            })
            .collect();
        let layered = Layered {
            own: raw.keys(at),
            inherited: inherited.clone(),
        };
        let settings = pool(name, &servers, &layered, dir, client_certs)?;
        // The pool `default` goes first: requests no route fits go to it.
        if name == DEFAULT_POOL {
            out.insert(0, settings);
        } else {
            out.push(settings);
        }
    }
    if out.is_empty() {
        return Err(match upstream {
            Some(u) => Invalid::new(
                Some(u.span()),
                "upstream.url",
                "no pool to forward to: give [upstream] a url, or add [[upstreams]] pools (an [upstream] without url only holds the settings they inherit)",
            ),
            None => Invalid::new(
                None,
                "(top level)",
                "no upstream: give [upstream] url = \"http://…\", or [[upstreams]] pools",
            ),
        });
    }
    Ok((out, defaults))
}

/// What a pool made by `--upstream` (where the file has no pool `default`) takes: the
/// inherited `[upstream]` settings, and its TLS keys for an `https://` URL.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolDefaults {
    /// With no servers: every other setting a new pool gets.
    pub pool: PoolSettings,
    pub tls: TlsOptions,
}

impl PoolDefaults {
    fn of(
        inherited: Option<&Keys<'_>>,
        dir: &Path,
        client_certs: bool,
    ) -> Result<PoolDefaults, Invalid> {
        let layered = Layered {
            own: inherited.cloned().unwrap_or_else(empty_keys),
            inherited: None,
        };
        Ok(PoolDefaults {
            pool: settings_without_servers(&layered, client_certs)?,
            tls: tls_options(&layered, dir),
        })
    }
}

/// Every setting of a pool but its name, servers and TLS.
fn settings_without_servers(k: &Layered<'_>, client_certs: bool) -> Result<PoolSettings, Invalid> {
    let balance = match k.pick(|k| k.balance) {
        Some((table, b)) => {
            let balance = b.get_ref().0.clone();
            if let Balance::Hash(key) = &balance {
                if key.kind == KeyKind::ClientCert && !client_certs {
                    return Err(Invalid::new(
                        Some(b.span()),
                        format!("{table}.balance"),
                        "hash:client_cert needs client certificates: [server.tls] with client_ca",
                    ));
                }
            }
            balance
        }
        None => Balance::default(),
    };
    let passive = Passive {
        max_fails: k
            .pick(|k| k.max_fails)
            .map_or(MAX_FAILS, |(_, n)| *n.get_ref()),
        fail_window: k.duration(|k| k.fail_window, FAIL_WINDOW),
        fail_timeout: k.duration(|k| k.fail_timeout, FAIL_TIMEOUT),
        max_ejected_percent: k
            .pick(|k| k.max_ejected_percent)
            .map_or(MAX_EJECTED_PERCENT, |(_, p)| p.get_ref().0),
        fail_on_status: k
            .pick(|k| k.fail_on_status)
            .map_or_else(Vec::new, |(_, s)| {
                let mut statuses: Vec<_> = s.get_ref().iter().map(|s| s.0).collect();
                statuses.sort_unstable();
                statuses.dedup();
                statuses
            }),
    };
    let health = match k.pick(|k| k.health) {
        Some((table, h)) => Some(health(table, h)?),
        None => None,
    };
    let overload = match k.pick(|k| k.overload) {
        Some((table, o)) => Some(super::overload::validate(table, o)?),
        None => None,
    };
    Ok(PoolSettings {
        name: String::new(),
        servers: Vec::new(),
        balance,
        connect_timeout: k.duration(|k| k.connect_timeout, CONNECT_TIMEOUT),
        timeout: k.duration(|k| k.timeout, TIMEOUT),
        passive,
        health,
        retries: k
            .pick(|k| k.retries)
            .map_or(RETRIES, |(_, r)| r.get_ref().0),
        resolve_every: k.duration(|k| k.resolve_every, RESOLVE_EVERY),
        protocol: k
            .pick(|k| k.protocol)
            .map_or_else(Protocol::default, |(_, p)| p.get_ref().0),
        overload,
    })
}

/// `health = { … }` of the table `table`, its defaults filled in.
fn health(table: &str, h: &Spanned<RawHealth>) -> Result<HealthCheck, Invalid> {
    let raw = h.get_ref();
    let d = HealthCheck::default();
    let interval = raw.interval.as_ref().map_or(d.interval, |i| i.get_ref().0);
    let timeout = raw.timeout.as_ref().map_or(d.timeout, |t| t.get_ref().0);
    if timeout >= interval {
        // Blame the value the file gives: the timeout, or else the interval.
        let (key, span) = match (&raw.timeout, &raw.interval) {
            (Some(t), _) => ("timeout", t.span()),
            (None, Some(i)) => ("interval", i.span()),
            (None, None) => ("timeout", h.span()),
        };
        return Err(Invalid::new(
            Some(span),
            format!("{table}.health.{key}"),
            format!(
                "health timeout {} must be shorter than its interval {}: one check ends before the next begins",
                humantime::format_duration(timeout),
                humantime::format_duration(interval)
            ),
        ));
    }
    Ok(HealthCheck {
        path: raw.path.as_ref().map_or(d.path, |p| p.0.clone()),
        interval,
        timeout,
        healthy: raw.healthy.map_or(d.healthy, NonZeroU32::get),
        unhealthy: raw.unhealthy.map_or(d.unhealthy, NonZeroU32::get),
        expect: raw.expect.as_ref().map_or(d.expect, |e| e.0.clone()),
    })
}

/// One pool named `name` of `servers` (each: where the file has it, its URL, its
/// weight), with the settings `k` gives.
fn pool(
    name: &str,
    servers: &[(Range<usize>, &UpstreamUrl, Option<u32>)],
    k: &Layered<'_>,
    dir: &Path,
    client_certs: bool,
) -> Result<PoolSettings, Invalid> {
    let mut settings = settings_without_servers(k, client_certs)?;
    settings.name = name.to_string();
    let options = tls_options(k, dir);
    let any_https = servers
        .iter()
        .any(|(_, url, _)| url.uri.scheme_str() == Some("https"));
    // TLS keys in the pool's own table mean nothing without an https:// server; inherited
    // ones are for the pools that have one.
    let own_tls = [k.own.ca, k.own.sni, k.own.cert, k.own.key]
        .iter()
        .any(Option::is_some)
        || k.own.insecure_skip_verify.is_some_and(|b| *b.get_ref());
    let is_upstream = k.own.table == "upstream";
    if own_tls && !any_https {
        let (key, message) = if is_upstream {
            (
                "url",
                "TLS keys (ca, sni, cert, key, insecure_skip_verify) need an https:// url",
            )
        } else {
            (
                "servers",
                "TLS keys (ca, sni, cert, key, insecure_skip_verify) need an https:// server",
            )
        };
        return Err(Invalid::new(
            Some(servers[0].0.clone()),
            format!("{}.{key}", k.own.table),
            message,
        ));
    }
    let mut seen = HashSet::new();
    for (i, (span, url, weight)) in servers.iter().enumerate() {
        let at = if is_upstream {
            "upstream.url".to_string()
        } else {
            format!("{}.servers[{i}]", k.own.table)
        };
        let tls = if url.uri.scheme_str() == Some("https") {
            tls_for(&url.uri, options.clone()).map_err(|e| tls_error(e, k, dir, span))?
        } else {
            None
        };
        let server = ServerSettings {
            url: url.uri.clone(),
            base_path: url.base_path.clone(),
            weight: weight.unwrap_or(1),
            tls,
        };
        // By its URL alone: two servers that differ only in base path would share a ring
        // place, a metrics series and a status-page row.
        if !seen.insert(server.label()) {
            return Err(Invalid::new(
                Some(span.clone()),
                at,
                format!(
                    "server {:?} is listed twice in pool {name:?}: give it a weight instead",
                    server.label()
                ),
            ));
        }
        settings.servers.push(server);
    }
    check_protocol(&settings, servers, k)?;
    Ok(settings)
}

/// A pool's `protocol` against its servers' schemes: `h2` and `auto` are TLS (ALPN), so
/// every server is `https://`; `h2c` is cleartext, so every one is `http://`. Blamed on
/// the `protocol` key where the file gives it (the pool's own table, or `[upstream]`'s).
fn check_protocol(
    settings: &PoolSettings,
    servers: &[(Range<usize>, &UpstreamUrl, Option<u32>)],
    k: &Layered<'_>,
) -> Result<(), Invalid> {
    let Some((table, given)) = k.pick(|k| k.protocol) else {
        return Ok(());
    };
    let (https, what, hint) = match settings.protocol {
        Protocol::Http1 => return Ok(()),
        Protocol::H2 => (
            true,
            "is HTTP/2 over TLS",
            " (for cleartext HTTP/2, use \"h2c\")",
        ),
        Protocol::Auto => (true, "lets TLS' ALPN choose h2 or HTTP/1.1", ""),
        Protocol::H2c => (
            false,
            "is HTTP/2 over cleartext TCP",
            " (for HTTP/2 over TLS, use \"h2\")",
        ),
    };
    let scheme = if https { "https://" } else { "http://" };
    let wrong = servers
        .iter()
        .zip(&settings.servers)
        .find(|(_, s)| s.tls.is_some() != https);
    match wrong {
        None => Ok(()),
        Some(((_, url, _), _)) => Err(Invalid::new(
            Some(given.span()),
            format!("{table}.protocol"),
            format!(
                "protocol {:?} {what} and needs {scheme} servers: {:?} is not one{hint}",
                settings.protocol.name(),
                url.uri.to_string().trim_end_matches('/')
            ),
        )),
    }
}

/// The TLS keys `k` gives, their files relative to `dir`.
fn tls_options(k: &Layered<'_>, dir: &Path) -> TlsOptions {
    let path = |p: Option<(&str, &Spanned<String>)>| p.map(|(_, p)| dir.join(p.get_ref().trim()));
    TlsOptions {
        ca: path(k.pick(|k| k.ca)),
        sni: k.pick(|k| k.sni).map(|(_, s)| s.get_ref().clone()),
        cert: path(k.pick(|k| k.cert)),
        key: path(k.pick(|k| k.key)),
        insecure_skip_verify: k
            .pick(|k| k.insecure_skip_verify)
            .is_some_and(|(_, b)| *b.get_ref()),
    }
}

/// A TLS key that cannot be used, blamed on the key where the file gives it (the pool's
/// own table, or `[upstream]`'s), in the file's own words.
fn tls_error(e: TlsError, k: &Layered<'_>, dir: &Path, server: &Range<usize>) -> Invalid {
    let given = match e.key {
        "ca" => k.pick(|k| k.ca),
        "sni" => k.pick(|k| k.sni),
        "cert" => k.pick(|k| k.cert),
        "key" => k.pick(|k| k.key),
        _ => None,
    };
    // The file's own words, not the path resolved here (which depends on where the file
    // lies).
    let message = match given {
        Some((_, g)) if e.key != "sni" => {
            let resolved = dir.join(g.get_ref().trim()).display().to_string();
            let named = format!("{:?} (relative to this file's folder)", g.get_ref());
            e.message.replace(&resolved, &named)
        }
        _ => e.message,
    };
    let table = given.map_or(k.own.table.as_str(), |(t, _)| t);
    Invalid::new(
        Some(given.map_or(server.clone(), |(_, g)| g.span())),
        format!("{table}.{}", e.key),
        message,
    )
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::time::Duration;

    use http::StatusCode;

    use crate::config::Config;
    use crate::identity::KeyKind;
    use crate::upstream::{Balance, HealthCheck, Passive, CONNECT_TIMEOUT, RETRIES};

    fn parse(body: &str) -> Config {
        Config::parse(
            &format!("[server]\nlisten = \"127.0.0.1:1\"\n{body}"),
            Path::new("t.toml"),
        )
        .unwrap_or_else(|e| panic!("{e}"))
    }

    fn names(cfg: &Config) -> Vec<&str> {
        cfg.upstreams.iter().map(|p| p.name.as_str()).collect()
    }

    #[test]
    fn upstream_url_is_the_pool_default_and_comes_first() {
        let cfg = parse(
            "[[upstreams]]\nname = \"api\"\nservers = [\"http://10.0.0.1:8080\"]\n[upstream]\nurl = \"http://127.0.0.1:3000/base/\"\ntimeout = \"3s\"\nretries = 2\n",
        );
        assert_eq!(names(&cfg), ["default", "api"]);
        let d = &cfg.upstreams[0];
        assert_eq!(d.servers.len(), 1);
        assert_eq!(d.servers[0].label(), "http://127.0.0.1:3000");
        assert_eq!(d.servers[0].base_path, "/base");
        assert_eq!((d.timeout, d.retries), (Duration::from_secs(3), 2));
        // With a url, [upstream] is a pool of its own: the others do not inherit from it.
        let api = &cfg.upstreams[1];
        assert_eq!(
            (api.timeout, api.retries),
            (crate::upstream::TIMEOUT, RETRIES)
        );
        assert_eq!(cfg.routes.default_pool, Some(0));
        assert_eq!(cfg.upstream().url, d.servers[0].url);
        assert_eq!(cfg.upstream().timeout, Duration::from_secs(3));
    }

    #[test]
    fn upstream_without_url_holds_what_every_pool_inherits() {
        let cfg = parse(
            "[upstream]\nconnect_timeout = \"2s\"\nmax_fails = 5\nbalance = \"least_requests\"\nhealth = { path = \"/up\" }\n\
             [[upstreams]]\nname = \"a\"\nservers = [\"http://10.0.0.1:8080\", { url = \"http://10.0.0.2:8080/v2\", weight = 3 }]\nmax_fails = 1\n\
             [[upstreams]]\nname = \"default\"\nservers = [\"http://10.0.0.3\"]\nbalance = \"hash:header:X-Tenant\"\nhealth = { interval = \"5s\", expect = \"204\" }\n",
        );
        assert_eq!(names(&cfg), ["default", "a"], "the pool default first");
        let (d, a) = (&cfg.upstreams[0], &cfg.upstreams[1]);
        assert_eq!(a.connect_timeout, Duration::from_secs(2));
        assert_eq!((a.passive.max_fails, d.passive.max_fails), (1, 5));
        assert_eq!(a.balance, Balance::LeastRequests);
        match &d.balance {
            Balance::Hash(k) => assert_eq!(k.kind, KeyKind::Header("x-tenant".parse().unwrap())),
            other => panic!("{other:?}"),
        }
        assert_eq!(d.balance.name(), "hash:header:x-tenant");
        assert_eq!(
            a.health,
            Some(HealthCheck {
                path: "/up".into(),
                ..HealthCheck::default()
            })
        );
        // A pool's own health table replaces the inherited one whole.
        let h = d.health.as_ref().unwrap();
        assert_eq!(
            (h.path.as_str(), h.interval),
            ("/healthz", Duration::from_secs(5))
        );
        assert_eq!(h.expect, 204..=204);
        assert_eq!(
            a.servers.iter().map(|s| s.weight).collect::<Vec<_>>(),
            [1, 3]
        );
        assert_eq!(a.servers[1].base_path, "/v2");
        assert_eq!(
            cfg.upstream().url,
            d.servers[0].url,
            "the default's first server"
        );
        assert_eq!(
            cfg.pool_defaults.pool.connect_timeout,
            Duration::from_secs(2)
        );
    }

    #[test]
    fn a_pool_without_settings_takes_the_defaults() {
        let cfg = parse("[[upstreams]]\nname = \"a\"\nservers = [\"http://10.0.0.1\"]\n");
        let a = &cfg.upstreams[0];
        assert_eq!(a.passive, Passive::default());
        assert_eq!(a.connect_timeout, CONNECT_TIMEOUT);
        assert_eq!(a.health, None);
        assert_eq!(a.balance, Balance::RoundRobin);
        assert_eq!(cfg.routes.default_pool, None);
        assert_eq!(
            cfg.upstream().url,
            a.servers[0].url,
            "the first pool's first server"
        );
    }

    #[test]
    fn passive_health_keys_are_read() {
        let cfg = parse(
            "[[upstreams]]\nname = \"a\"\nservers = [\"http://10.0.0.1\"]\nfail_on_status = [504, 502, 504]\nmax_ejected_percent = 0\nfail_window = \"30s\"\nfail_timeout = \"1m\"\nmax_fails = 0\nresolve_every = \"5m\"\nretries = 0\n",
        );
        let a = &cfg.upstreams[0];
        assert_eq!(
            a.passive,
            Passive {
                max_fails: 0,
                fail_window: Duration::from_secs(30),
                fail_timeout: Duration::from_secs(60),
                max_ejected_percent: 0,
                fail_on_status: vec![StatusCode::BAD_GATEWAY, StatusCode::GATEWAY_TIMEOUT],
            }
        );
        assert_eq!((a.retries, a.resolve_every), (0, Duration::from_secs(300)));
    }

    #[test]
    fn each_https_server_gets_tls_and_http_ones_none() {
        let cfg = parse(
            "[[upstreams]]\nname = \"a\"\nservers = [\"http://10.0.0.1\", \"https://b.internal:8443\"]\nsni = \"api.internal\"\ninsecure_skip_verify = true\n",
        );
        let s = &cfg.upstreams[0].servers;
        assert!(s[0].tls.is_none());
        let tls = s[1].tls.as_ref().expect("TLS for https://");
        assert!(
            tls.describe().contains("name api.internal"),
            "{}",
            tls.describe()
        );
    }

    /// The error `body` gives: (line, column, key, message).
    fn err(body: &str) -> (usize, usize, String, String) {
        match Config::parse(
            &format!("[server]\nlisten = \"127.0.0.1:1\"\n{body}"),
            Path::new("t.toml"),
        ) {
            Err(crate::config::ConfigError::Invalid {
                line,
                column,
                key,
                message,
                ..
            }) => (line, column, key, message),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("accepted: {body}"),
        }
    }

    #[test]
    fn what_a_pool_may_not_say() {
        for (body, key, message) in [
            (
                "[[upstreams]]\nname = \"a\"\nservers = [\"http://10.0.0.1\"]\nca = \"ca.pem\"\n",
                "upstreams[0].servers",
                "TLS keys (ca, sni, cert, key, insecure_skip_verify) need an https:// server",
            ),
            (
                "[[upstreams]]\nname = \"a\"\nservers = [\"http://10.0.0.1\", \"http://10.0.0.1/\"]\n",
                "upstreams[0].servers[1]",
                "server \"http://10.0.0.1\" is listed twice in pool \"a\": give it a weight instead",
            ),
            (
                "[[upstreams]]\nname = \"a b\"\nservers = [\"http://10.0.0.1\"]\n",
                "upstreams[0].name",
                "invalid pool name \"a b\": 1 to 64 characters of A-Z a-z 0-9 _ - .",
            ),
            (
                "[[upstreams]]\nname = \"a\"\nservers = [\"http://10.0.0.1\"]\nbalance = \"hash:global\"\n",
                "upstreams[0].balance",
                "\"hash:global\" would send every request to one server: hash by api_key, client_ip, client_cert or header:<name>",
            ),
            (
                "[[upstreams]]\nname = \"a\"\nservers = [\"http://10.0.0.1\"]\nbalance = \"hash:client_cert\"\n",
                "upstreams[0].balance",
                "hash:client_cert needs client certificates: [server.tls] with client_ca",
            ),
            (
                "[[upstreams]]\nname = \"a\"\nservers = [\"http://10.0.0.1\"]\nretries = 11\n",
                "upstreams[0].retries",
                "retries = 11: 0 to 10 (default 1)",
            ),
            (
                "[[upstreams]]\nname = \"a\"\nservers = [{ url = \"http://10.0.0.1\", weigth = 2 }]\n",
                "upstreams[0].servers[0].weigth",
                "unknown field `weigth`, expected `url` or `weight`",
            ),
            (
                "[upstream]\nhealth = { interval = \"500ms\" }\n[[upstreams]]\nname = \"a\"\nservers = [\"http://10.0.0.1\"]\n",
                "upstream.health.interval",
                "health timeout 1s must be shorter than its interval 500ms: one check ends before the next begins",
            ),
            (
                "[[upstreams]]\nname = \"a\"\nservers = [\"http://10.0.0.1\"]\nhealth = { path = \"healthz\" }\n",
                "upstreams[0].health.path",
                "invalid health path \"healthz\": a path starting with \"/\" (a query may follow)",
            ),
            (
                "[upstream]\nurl = \"http://10.0.0.1\"\nservers = [\"http://10.0.0.2\"]\n",
                "upstream.servers",
                "unknown field `servers`, expected one of `url`, `connect_timeout`, `timeout`, `ca`, `sni`, `cert`, `key`, `insecure_skip_verify`, `balance`, `max_fails`, `fail_window`, `fail_timeout`, `max_ejected_percent`, `fail_on_status`, `health`, `retries`, `resolve_every`, `protocol`, `overload`",
            ),
        ] {
            let (_, _, k, m) = err(body);
            assert_eq!((k.as_str(), m.as_str()), (key, message), "{body}");
        }
    }

    #[test]
    fn expect_takes_a_class_or_one_status() {
        for (text, range) in [("2xx", 200..=299), ("3XX", 300..=399), ("204", 204..=204)] {
            let cfg = parse(&format!(
                "[[upstreams]]\nname = \"a\"\nservers = [\"http://10.0.0.1\"]\nhealth = {{ expect = \"{text}\" }}\n"
            ));
            assert_eq!(
                cfg.upstreams[0].health.as_ref().unwrap().expect,
                range,
                "{text}"
            );
        }
        for bad in ["6xx", "20", "2000", "099", "x"] {
            let (_, _, key, _) = err(&format!(
                "[[upstreams]]\nname = \"a\"\nservers = [\"http://10.0.0.1\"]\nhealth = {{ expect = \"{bad}\" }}\n"
            ));
            assert_eq!(key, "upstreams[0].health.expect", "{bad}");
        }
    }
}
