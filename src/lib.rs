//! ratewall: a reverse-proxy gateway that enforces request rate limits at the perimeter.
//!
//! An operator runs it in front of an HTTP backend and describes limits in
//! `config/limits.toml`. Every request is either forwarded upstream with `RateLimit-*`
//! headers, or answered `429` with an honest `Retry-After`. One instance keeps its state
//! in memory; many instances share one limit through Redis.
//!
//! # Layout
//!
//! A request travels one way, and the modules follow it:
//!
//! - [`server`]: accept loop, graceful shutdown, SIGHUP reload.
//! - [`connection`]: one client connection: HTTP/1 or HTTP/2, the clocks on its silences
//!   (`header_timeout`, `idle_timeout`, stalled writes), `max_connections`.
//! - [`admin`]: the admin listener: metrics, health, the admin API, the status page.
//! - [`metrics`]: Prometheus metrics and the in-process stats the status page shows.
//! - [`gateway`]: one request: identify -> match rules -> limit -> answer or forward.
//! - [`identity`]: peer + trusted proxies + headers -> an identity digest (pure).
//! - [`rules`]: request parts -> the rules that apply (pure, through an index compiled at
//!   load: exact paths, a prefix trie, globs, methods, hosts).
//! - [`limiter`]: the algorithms as pure integer step functions (and the concurrency
//!   limit), and the stores that run them: [`limiter::memory`] (embedded) and
//!   [`limiter::redis`] (Lua twins in `lua/`); [`limiter::lease`] holds a request's
//!   concurrency slots until its response ends.
//! - [`headers`]: decisions -> `RateLimit-*`, `Retry-After`, problem+json.
//! - [`proxy`]: the pooled upstream client, hop-by-hop stripping, `X-Forwarded-*`.
//! - [`config`]: the TOML file -> validated, immutable [`config::Config`].
//! - [`worker`]: which worker thread runs the current request (per-thread pools).

pub mod admin;
pub mod config;
pub mod connection;
pub mod gateway;
pub mod headers;
pub mod identity;
pub mod limiter;
pub mod metrics;
pub mod proxy;
pub mod rules;
pub mod server;
pub mod worker;
