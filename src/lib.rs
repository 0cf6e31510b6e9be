//! ratewall: a reverse-proxy gateway that enforces request rate limits at the perimeter.
//!
//! An operator runs it in front of an HTTP backend and describes limits in
//! `config/limits.toml`. Every request is either forwarded upstream with `RateLimit-*`
//! headers, or answered `429` with an honest `Retry-After`. One instance keeps its state
//! in memory; many instances share one limit through Redis.
//!
//! # Layout
//!
//! A request travels one way: server -> connection -> proxy -> decide (rules, identity,
//! limiter) -> headers -> upstream, and this list follows it, with what serves the path
//! (runtime, admin, config, telemetry, worker) where it is first needed. The modules sit in
//! tiers (docs/architecture.md: bottom, parts, runtime, decision, front-ends, top) and
//! import only from their own tier or below: `tests/it/layering.rs` fails on an import up a
//! tier, on an import cycle, and on a module that uses more than ten others, and
//! `cargo test --test it layering:: -- --nocapture` prints the layers the imports make.
//!
//! - [`server`]: the workers, each running the proxy's cleartext and TLS listeners in its
//!   own event loop; every front-end of [`FRONT_ENDS`] the config configures, started
//!   alike (`server/front_ends.rs`); SIGHUP reload, graceful shutdown. Each listener runs
//!   the one accept loop, [`front_end::Listener`], and hands each connection to
//! - [`connection`]: one client connection (cleartext, or TLS after its handshake), HTTP/1
//!   or HTTP/2, the clocks on its silences
//!   (`header_timeout`, `idle_timeout`, stalled bodies), `max_connections`: a folder, one
//!   concern a file (`registry`, `track`, `tls`, `serve`, `protocol`, `clocks`, `head`,
//!   `descriptors`, and `metrics`: the connections' and the TLS listener's); each request
//!   to
//! - [`proxy`]: the reverse proxy, one request top to bottom in `proxy/mod.rs`, each in
//!   its [`proxy::RequestCtx`] (`ctx.rs`), its connection's [`proxy::Context`] (peer, TLS
//!   session, client certificate, worker) beside it: screen its head (`screen.rs`), read
//!   what its body asks a model for (`tokens.rs`), decide it ([`decide`]), wait, ask its
//!   pool's overload protection (`overload.rs`), forward it, respond (settle what the
//!   answer says, `settle.rs`; tunnel an upgrade, `switched.rs`; the body holding its
//!   leases, `body.rs`) and finish: the one place that counts it and writes its access
//!   line (`access.rs`). Every answer it writes goes through one function (`answer.rs`),
//!   HTTP or, to a gRPC call, a Trailers-Only gRPC answer ([`proxy::grpc`]).
//! - [`decide`]: the decision core: a [`decide::Subject`] (method, URI, headers, peer,
//!   client certificate) in, a [`decide::Decided`] out, or a [`decide::Rejection`] for the
//!   front-end to write: the route and pool (`route.rs`; a 404 where none fits), the rules
//!   that fit and who the request is under each (`limits.rs`), the rules that need no
//!   credential first where a token must be verified (`first.rs`), the store asked and one
//!   pure verdict (`ask.rs`, `verdict.rs`), the settlement held (`settling.rs`). No hyper
//!   type in it.
//! - [`runtime`]: what every request runs on, whichever front-end took it: the current
//!   [`runtime::Live`] (config, limiter, pools, per-rule counters; swapped whole on reload
//!   by [`runtime::Current`]), the JWKS fetcher (`jwks.rs`), and [`runtime::Metrics`], the
//!   registry root holding every module's metrics, with the request metrics
//!   (`requests.rs`, recorded from one [`runtime::Ended`]) and the dashboards'
//!   (`dashboards.rs`: denials by plan, retry waits, near-limit requests, the good-client
//!   SLO judged by the bounded demand meter, `demand.rs`).
//! - [`admin`]: the admin listener, a front-end (listed in `front_ends!` below): metrics,
//!   health, the admin API, the status page, the guard that slows a peer guessing the
//!   admin token (`admin/guard.rs`), and the runtime key calls, `/admin/keys`
//!   (`admin/keys.rs`).
//! - [`service`]: the decision service on `[decide] listen`, a front-end: the decision
//!   API (`service/api.rs`: decide, settle, leases, with the reservations and leases it
//!   holds in `service/grants.rs`), forward-auth (`service/forward_auth.rs`) and Envoy's
//!   rate limit service (`service/rls/`), each deciding with the decision core.
//! - [`egress`]: the egress gateway on `[egress] listen`, a front-end (issue 45): an HTTP
//!   forward proxy to listed targets only (absolute-form calls, TLS originated where the
//!   target says so, and `CONNECT` tunnels), its calls decided by the rules of `match = {
//!   egress = true }`; what an API's answer says of its limit (`egress/learn.rs`).
//! - [`front_end`]: what a front-end on a listener of its own is ([`front_end::FrontEnd`]:
//!   its name, where it listens, its bounds, its handler) and what it shares with the
//!   proxy ([`front_end::Shared`]: the current configuration, the metrics); the accept
//!   loop every listener runs (`front_end/listener.rs`). A new front-end is its folder and
//!   one line in `front_ends!` (docs/architecture.md, "How to add a front-end").
//! - [`cli`]: `ratewall check`, whole: the loaded file described (`cli/describe.rs`) and
//!   a sample request's way through the request path's own functions (`cli/explain.rs`).
//! - [`config`]: the TOML file -> validated, immutable [`config::Config`], one file per
//!   table; the types it fills live with their meaning, below. [`config::Config::load`]
//!   reads the file and what it names (the environment, the keys file, certificates, JWT
//!   keys: [`config::Inputs`]); [`config::Config::parse`] reads nothing.
//! - [`rules`]: request parts -> the route (`[[routes]]`, first match wins) and the rules
//!   that apply (pure, through an index compiled at load: exact paths, a prefix trie,
//!   globs, methods, hosts).
//! - [`identity`]: the one place a rule's identity for a request is derived: peer +
//!   trusted proxies + headers -> an identity digest, or a refusal (pure). Bearer tokens
//!   are verified there (`identity/jwt.rs`, with the verified-token cache,
//!   `token_cache.rs`), and API keys looked up in the runtime key directory
//!   (`identity/directory.rs`; kept in step with Redis by `limiter/redis/directory.rs`;
//!   a `jwks_url` fetched by `runtime/jwks.rs`).
//! - [`limiter`]: the algorithms as pure integer step functions (and the concurrency
//!   limit; the calendar periods of `"N/month"` rates, `limiter/calendar.rs`); one [`limiter::Store`] boundary with two kinds behind it, [`limiter::memory`]
//!   (embedded) and [`limiter::redis`] (one Redis or a cluster; Lua twins in `lua/`); the
//!   [`limiter::breaker::Limiter`] around it (breaker, deny cache, `on_error`), and the
//!   gateways' heartbeat that `local_share = "auto"` counts by (`limiter/heartbeat.rs`).
//! - [`headers`]: decisions -> `RateLimit-*`, `Retry-After`, problem+json.
//! - [`upstream`]: the pools and the clients to their servers (HTTP/1.1, HTTP/2): `settings` (the
//!   validated `[[upstreams]]`), `pools` (each pool's servers, re-resolved, with one
//!   client per worker and its kept connections; forwarding with retries), `balance`,
//!   `health` (passive and active), `budget` (retries), `metrics` (per pool and server);
//!   then the client, in the order a request goes through it: `forward` (the hop-by-hop
//!   fields stripped, `X-Forwarded-*`), `head` (the request head written, the answer's
//!   parsed), `kept`, `stream` (TCP, or TLS over it) and `tls` (an `https://` backend's
//!   handshake: verified against the system's roots or `ca`, SNI, a client certificate,
//!   sessions resumed, ALPN), `body` (bodies framed both ways), `h2` (HTTP/2 pools: a
//!   server's connections shared by the workers, streams under the server's limit read
//!   by `peer_settings`, bodies and trailers both ways), and `error`: a typed
//!   [`upstream::Error`] that says the client's status (502, 504, 400, 408) and whether
//!   the request may go again.
//! - [`overload`]: a pool's overload protection (`overload = { … }`): its concurrency
//!   limit, adaptive (`limit.rs`, a gradient controller on an injected clock) or fixed,
//!   and the queue beyond it by priority (`queue.rs`); a [`overload::Permit`] held from
//!   send to the answer's head, asked of the pool (`upstream::Pool::admit`) by
//!   `proxy/overload.rs` after the rate limits.
//! - [`settle`]: settling reservations, all but the algorithms' pure step (`limiter/settle.rs`):
//!   `reservation` (the charges a request holds), `policy`, `settling`, `max_tokens`, and
//!   the settlement property tests (`properties.rs`); `usage`, the tokens an OpenAI-compatible backend
//!   reports, read from its answer's body (JSON or server-sent events) as it streams past;
//!   `decode`, a compressed answer (gzip, deflate, br, zstd) decoded for it, within a budget.
//! - [`websocket`]: RFC 6455 as a gateway passing frames through needs it: `frame` (an
//!   exact, bounded, streaming §5 frame scanner; the close frames the gateway writes) and
//!   `meter` (a rule's `messages` limit: one bucket per identity across its sockets,
//!   charged to the store in batches).
//! - [`telemetry`]: the bottom layer of the metrics: `metrics!` (a module's metrics declared
//!   once, one field a metric with its name and help; it writes the struct and its
//!   `register`), `label_sets!` (the families' label sets), `label_enum!` (a vocabulary
//!   enum written once with its label values), `Gauged`, and [`telemetry::stats`], what the status page shows (outcomes, latencies,
//!   the loads of the config; counted with atomics on the request path, sampled into a
//!   bounded ring); [`telemetry::Disposition`], how a request ended, from which the
//!   access log's `decision`, the metrics' labels and the status page's outcome are read;
//!   the gRPC status vocabulary (`grpc.rs`). Each module declares the metrics it owns
//!   (`connection/metrics.rs`, `runtime/requests.rs`, `limiter/metrics.rs`,
//!   `upstream/tls.rs`, `upstream/metrics.rs`, …; the admin listener's in
//!   `telemetry/admin.rs`), held with the one registry by [`runtime::Metrics`]; every series
//!   a config implies is created at zero.
//! - [`tls`]: `[server.tls]`: the certificates (chosen by SNI), client certificates, the
//!   rustls server config the TLS listener's handshakes run on.
//! - [`worker`]: which worker thread the current code runs on, for per-thread resources
//!   found without a request's context (Redis connections);
//!   a request carries its worker in its connection's [`proxy::Context`].

pub mod cli;
pub mod config;
pub mod connection;
pub mod decide;
pub mod front_end;
pub mod headers;
pub mod identity;
pub mod limiter;
pub mod overload;
pub mod proxy;
pub mod random;
pub mod rules;
pub mod runtime;
pub mod server;
pub mod settle;
pub mod telemetry;
pub mod tls;
pub mod tunnel;
pub mod upstream;
pub mod websocket;
pub mod worker;

// The front-ends on listeners of their own, each one line: its module, started by the
// server where it is configured (`front_end::FrontEnd`), in this order.
front_end::front_ends! {
    admin,
    service,
    egress,
}

/// The property runs the unit tests share with the integration tests (`proptest_seeds!`:
/// the saved regressions, a fixed seed, and on CI a fresh one, each seed printed with the
/// `RATEWALL_TEST_SEED` that replays it): one file, `tests/it/common/seed.rs`.
#[cfg(test)]
#[path = "../tests/it/common/seed.rs"]
pub(crate) mod seed;
