//! `ratewall check`'s first half: the effective configuration, as the file and its
//! defaults make it (API keys never printed, only their labels).

use std::fmt::Write;

use crate::config::Config;
use crate::identity::{KeyKind, MissingKey};
use crate::limiter::store::Backend;
use crate::rules::{Plan, Rule};
use crate::upstream::{PoolSettings, DEFAULT_POOL};

/// The effective configuration, for `ratewall check`. API keys are not printed.
pub fn describe(cfg: &Config) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "listen        {}", cfg.server.listen);
    if let Some(a) = cfg.server.admin_listen {
        let _ = writeln!(out, "admin_listen  {a}");
    }
    for p in &cfg.upstreams {
        pool(&mut out, p);
    }
    let t = &cfg.server.timeouts;
    let _ = writeln!(
        out,
        "clients       header_timeout {}, idle_timeout {}, body_timeout {}, upgrade_idle_timeout {}, max_connections {}{}, max_header_bytes {}",
        humantime::format_duration(t.header),
        humantime::format_duration(t.idle),
        humantime::format_duration(t.body),
        humantime::format_duration(cfg.server.upgrade_idle_timeout),
        cfg.server.max_connections,
        if cfg.server.max_connections_set {
            ""
        } else {
            " (not set: 10000, or what the open-file limit holds)"
        },
        cfg.server.max_header_bytes
    );
    if let Some(tls) = &cfg.server.tls {
        out.push_str(&tls.describe());
    }
    store(&mut out, cfg);
    let _ = writeln!(
        out,
        "keys          header {}, {} listed with a plan{}",
        cfg.keys.header,
        cfg.keys.len(),
        match &cfg.keys.file {
            Some(f) => format!(" (with the keys file {})", f.display()),
            None => String::new(),
        }
    );
    // Keys by their labels (never by their characters).
    for (label, plan) in cfg.keys.labels() {
        let _ = writeln!(out, "  label       {label:?} (plan {plan})");
    }
    if let Some(j) = &cfg.jwt {
        out.push_str(&j.describe());
    }
    routes(cfg, &mut out);
    let _ = writeln!(out, "rules         {}", cfg.rules.len());
    for r in &cfg.rules {
        rule(&mut out, cfg, r);
    }
    out
}

/// A rule: its limit, per whom, when; what its store does; how it settles; its plans.
fn rule(out: &mut String, cfg: &Config, r: &Rule) {
    let when = cfg.applies_to(r);
    let key = match (&r.key.kind, r.key.missing) {
        (KeyKind::ApiKey, MissingKey::Reject) => "api_key (missing: 401)".to_string(),
        (KeyKind::ApiKey, MissingKey::ClientIp) => "api_key (missing: client_ip)".to_string(),
        (kind, _) => kind.to_string(),
    };
    let _ = writeln!(
        out,
        "  - {}: {} per {}; {}; when {}",
        r.name,
        r.quota,
        key,
        r.quota.algorithm.name(),
        when
    );
    let shared = !matches!(cfg.store.backend, Backend::Memory);
    let _ = writeln!(out, "      {}", r.behaviour(shared));
    if let Some(policy) = &r.settle {
        let _ = writeln!(out, "      settles: {}", policy.describe());
        if r.quota.max_debt > 0 {
            let _ = writeln!(
                out,
                "      borrows up to {} ahead of a cost reported later (max_debt)",
                r.quota.max_debt
            );
        }
    }
    if let Some(of) = &r.ceiling_of {
        let _ = writeln!(
            out,
            "      the attempts ceiling of {of}: counts every request {of} applies to, whatever the answer, never given back"
        );
    }
    let mut plans: Vec<_> = r.plans.iter().collect();
    plans.sort_by(|a, b| a.0.cmp(b.0));
    for (p, plan) in plans {
        let _ = match plan {
            Plan::Limit(q) => {
                writeln!(out, "      plan {p}: {q} ({})", q.algorithm.name())
            }
            Plan::Exempt => {
                writeln!(out, "      plan {p}: exempt, not limited by this rule")
            }
        };
    }
}

/// `store         memory (…), timeout 50ms, on_error allow`
fn store(out: &mut String, cfg: &Config) {
    let backend = match &cfg.store.backend {
        Backend::Memory => format!(
            "memory (embedded, one instance; max_keys {})",
            cfg.store.max_keys
        ),
        Backend::Redis { .. } => "redis".to_string(),
        Backend::RedisCluster { nodes } => {
            format!("redis_cluster ({} seed nodes)", nodes.len())
        }
        Backend::RedisSentinel(at) => format!(
            "redis_sentinel (master {:?}, {} sentinels)",
            at.master_name,
            at.urls.len()
        ),
    };
    let _ = writeln!(
        out,
        "store         {backend}, timeout {}, on_error {}",
        humantime::format_duration(cfg.store.timeout),
        cfg.store.on_error.name()
    );
}

/// `routes        2, first match wins; otherwise pool default`, then each route.
fn routes(cfg: &Config, out: &mut String) {
    let otherwise = match cfg.routes.default_pool {
        Some(i) => format!("pool {}", cfg.upstreams[i].name),
        None => "404".to_string(),
    };
    if cfg.routes.list.is_empty() {
        let _ = writeln!(out, "routes        none: every request goes to {otherwise}");
        return;
    }
    let _ = writeln!(
        out,
        "routes        {}, first match wins; no match: {otherwise}",
        cfg.routes.list.len()
    );
    for r in &cfg.routes.list {
        let mut paths = String::new();
        if let Some(s) = &r.strip_prefix {
            paths.push_str(&format!(", strip_prefix {s}"));
        }
        if let Some(a) = &r.add_prefix {
            paths.push_str(&format!(", add_prefix {a}"));
        }
        let _ = writeln!(
            out,
            "  - {}: {} -> pool {}{paths}",
            r.name,
            r.matcher.describe(),
            cfg.upstreams[r.pool].name
        );
    }
}

/// `upstream      http://a, http://b (weight 2)` (`pool <name>` for another than the pool
/// `default`), the TLS of its https:// servers, then how it balances, retries and ejects.
fn pool(out: &mut String, p: &PoolSettings) {
    let fmt = |d: std::time::Duration| humantime::format_duration(d).to_string();
    let label = if p.name == DEFAULT_POOL {
        "upstream".to_string()
    } else {
        format!("pool {}", p.name)
    };
    let servers: Vec<String> = p
        .servers
        .iter()
        .map(|s| match s.weight {
            1 => format!("{}{}", s.label(), s.base_path),
            w => format!("{}{} (weight {w})", s.label(), s.base_path),
        })
        .collect();
    let _ = writeln!(out, "{label:<13} {}", servers.join(", "));
    let mut tls: Vec<String> = p
        .servers
        .iter()
        .filter_map(|s| s.tls.as_ref().map(|t| t.describe()))
        .collect();
    tls.dedup();
    for t in tls {
        let _ = writeln!(out, "              {t}");
    }
    let passive = &p.passive;
    let ejects = if passive.max_fails == 0 {
        "never ejects a server".to_string()
    } else {
        let statuses: Vec<&str> = passive.fail_on_status.iter().map(|s| s.as_str()).collect();
        format!(
            "ejects a server after {} failures{} in {} for {} (doubling), at most {}% of the pool",
            passive.max_fails,
            if statuses.is_empty() {
                String::new()
            } else {
                format!(" (with {})", statuses.join("/"))
            },
            fmt(passive.fail_window),
            fmt(passive.fail_timeout),
            passive.max_ejected_percent
        )
    };
    let health = match &p.health {
        Some(h) => format!(
            "health GET {} every {} (timeout {}, {} up, {} down, expect {}-{})",
            h.path,
            fmt(h.interval),
            fmt(h.timeout),
            h.healthy,
            h.unhealthy,
            h.expect.start(),
            h.expect.end()
        ),
        None => "no active health checks".to_string(),
    };
    let _ = writeln!(
        out,
        "              protocol {}, {}, connect_timeout {}, timeout {}, retries {}, resolved every {}; {ejects}; {health}",
        p.protocol.name(),
        p.balance.name(),
        fmt(p.connect_timeout),
        fmt(p.timeout),
        p.retries,
        fmt(p.resolve_every)
    );
}
