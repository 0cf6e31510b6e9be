//! Listeners, background upkeep, SIGHUP reload, and graceful shutdown on SIGTERM/SIGINT.
//! Every listener runs the one accept loop ([`crate::front_end::Listener`]) with its
//! shutdown: the proxy's cleartext and TLS ones in each worker (`Clients` serve their
//! connections), and each front-end's on a listener of its own ([`crate::FRONT_ENDS`]: the
//! admin one; started alike by `front_ends.rs`).
//!
//! Thread per core: `[server].workers` threads (one per CPU by default) each run their
//! own single-threaded event loop, accept on the one listening socket, and serve their
//! connections start to end with their own upstream pool — a request never hops threads,
//! so no cross-thread wake-ups on the hot path. The thread that calls [`run`] keeps the
//! rest: signals, reloads, the front-ends' listeners, upkeep, and the store's connections.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use http::Request;
use hyper::body::Incoming;
use hyper::service::service_fn;
use tokio::net::TcpListener;

use crate::config::Config;
use crate::connection::{self, InFlight, Registry, Tracked};
use crate::front_end::{Accepted, Handler, Listener, Shared};
use crate::proxy::{Context, Gateway, Live};
use crate::runtime::Current;
use crate::upstream::ClientPeer;

mod front_ends;
mod tags;

pub use tags::key_check_tags;

/// How often the memory store drops buckets that have refilled.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("store: {0}")]
    Store(#[from] crate::limiter::StoreError),
}

/// Run the gateway until SIGTERM or SIGINT, then drain and return. SIGHUP re-reads
/// `source` (the file, with the same overrides).
pub async fn run(config: Config, source: Option<crate::config::Source>) -> Result<(), StartError> {
    let started = std::time::Instant::now();
    let metrics = Arc::new(crate::proxy::Metrics::new());
    let live = Live::build(config, None, &metrics)?;
    live.limiter.warm().await;
    if let Some(at) =
        crate::limiter::redis::directory::Location::of(&live.config.store, live.config.keys.resync)
    {
        crate::limiter::redis::directory::RedisKeys::new(at)
            .first_read(
                live.config.keys.directory(),
                &metrics.limiter.key_directory_syncs,
                KEY_DIRECTORY_FIRST_READ,
            )
            .await;
    }
    let config = live.config.clone();
    let sockets = Sockets::bind(&config)?;
    let config_path = source.as_ref().map(|s| s.path.clone());
    // One current configuration, shared by the proxy and every front-end.
    let current = Arc::new(Current::new(live, source, metrics.clone()));
    let shared = Shared::new(current.clone(), metrics.clone());
    let gateway = Arc::new(Gateway::sharing(current, metrics.clone()));
    tags::key_tags(&shared, config_path.as_deref()).await;
    let registry = Registry::new(
        "gateway",
        config.server.max_connections,
        metrics.connection.listener("gateway"),
    );
    connection::raise_descriptor_limit(
        config.server.max_connections,
        config.server.max_connections_set,
    );
    // Before the gateway says it listens: until a handler is registered, a signal's default
    // action ends the process, so a SIGHUP sent on that word would kill it.
    let signals = Signals::register();
    say_listening(&config, &sockets.front_ends);
    let upkeep = tokio::spawn(upkeep(shared.clone()));
    let key_sync = tokio::spawn(follow_key_directory(shared.clone()));
    let reloads = tokio::spawn(reload_on_sighup(shared.clone(), signals.hangup));
    let front_ends: Vec<front_ends::Running> = (sockets.front_ends.into_iter())
        .map(|bound| front_ends::Running::start(bound, &config, &shared, &metrics))
        .collect();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let workers = start_workers(&config, &sockets.gateway, &gateway, &registry, &stopped)?;
    drop(sockets.gateway);
    signals.shutdown.await;
    tracing::info!(grace = ?config.server.shutdown_grace, "shutting down: draining in-flight requests");
    let _ = stop.send(true);
    let mut served = 0;
    for worker in workers {
        served += worker.join().await;
    }
    // The front-ends serve until the workers are done (the admin listener: their drain
    // can be watched).
    front_ends::stop(front_ends).await;
    upkeep.abort();
    key_sync.abort();
    reloads.abort();
    say_stopped(started, served);
    Ok(())
}

/// The listening sockets, bound at start (before the gateway says it listens).
struct Sockets {
    gateway: GatewaySockets,
    /// Each configured front-end's, registered with the calling runtime.
    front_ends: Vec<front_ends::Bound>,
}

/// The gateway's sockets: each worker registers a handle of each in its own event loop.
struct GatewaySockets {
    cleartext: std::net::TcpListener,
    /// `[server.tls] listen`'s.
    tls: Option<std::net::TcpListener>,
}

impl Sockets {
    fn bind(config: &Config) -> Result<Sockets, StartError> {
        let server = &config.server;
        let backlog = backlog(server.backlog);
        let cleartext = bind_std(server.listen, backlog)?;
        let tls = match &server.tls {
            Some(tls) => Some(bind_std(tls.listen, backlog)?),
            None => None,
        };
        let front_ends = front_ends::bind(config, backlog)?;
        Ok(Sockets {
            gateway: GatewaySockets { cleartext, tls },
            front_ends,
        })
    }
}

impl GatewaySockets {
    /// Handles of the same sockets, for one worker.
    fn try_clone(&self, listen: SocketAddr) -> Result<GatewaySockets, StartError> {
        let cleartext = self
            .cleartext
            .try_clone()
            .map_err(|source| StartError::Bind {
                addr: listen,
                source,
            })?;
        let tls = match &self.tls {
            Some(l) => Some(l.try_clone().map_err(|source| StartError::Bind {
                addr: l.local_addr().unwrap_or(listen),
                source,
            })?),
            None => None,
        };
        Ok(GatewaySockets { cleartext, tls })
    }
}

/// The start line: what listens where, and on what.
fn say_listening(config: &Config, front_ends: &[front_ends::Bound]) {
    // Plain addresses: `none` where there is no admin listener (the admin front-end's
    // address, a field of its own since before front-ends were listed).
    let admin_listen = config
        .server
        .admin_listen
        .map_or_else(|| "none".to_string(), |a| a.to_string());
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        listen = %config.server.listen,
        tls_listen = %config.server.tls.as_ref().map_or_else(|| "none".to_string(), |t| t.listen.to_string()),
        admin = %admin_listen,
        front_ends = %front_ends::listed(front_ends),
        upstream = %upstream_of(config),
        pools = %pools_of(config),
        store = store_of(config),
        workers = config.server.workers.max(1),
        rules = config.rules.len(),
        "ratewall listening"
    );
    for warning in config.server.tls.iter().flat_map(|t| t.warnings()) {
        tracing::warn!("{warning}");
    }
}

/// The last line: how long the gateway ran, and how many requests it served.
fn say_stopped(started: std::time::Instant, served: u64) {
    let uptime = humantime::format_duration(Duration::from_secs(started.elapsed().as_secs()));
    tracing::info!(
        uptime = %uptime,
        uptime_s = started.elapsed().as_secs(),
        requests = served,
        "ratewall stopped"
    );
}

/// A worker thread, and the count of requests it served, sent when it is done.
struct Worker {
    thread: std::thread::JoinHandle<()>,
    finished: tokio::sync::oneshot::Receiver<u64>,
}

impl Worker {
    /// Wait for the worker to finish its drain: the requests it served.
    async fn join(self) -> u64 {
        // A worker that could not start has nothing to drain.
        let served = self.finished.await.unwrap_or(0);
        let thread = self.thread;
        let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        served
    }
}

/// Start `[server] workers` threads, each accepting on its own handles of the gateway's
/// sockets in its own event loop, until `stopped` turns true. Their connections share
/// `registry` (one `max_connections`).
fn start_workers(
    config: &Config,
    sockets: &GatewaySockets,
    gateway: &Arc<Gateway>,
    registry: &Arc<Registry>,
    stopped: &tokio::sync::watch::Receiver<bool>,
) -> Result<Vec<Worker>, StartError> {
    let listen = config.server.listen;
    (0..config.server.workers.max(1))
        .map(|n| {
            let sockets = sockets.try_clone(listen)?;
            let (gateway, registry, stopped) = (gateway.clone(), registry.clone(), stopped.clone());
            let grace = config.server.shutdown_grace;
            let (done, finished) = tokio::sync::oneshot::channel::<u64>();
            let thread = std::thread::Builder::new()
                .name(format!("ratewall-worker-{n}"))
                .spawn(move || {
                    let work = serve_worker(n, sockets, gateway, registry, grace, stopped);
                    let served = run_worker(n, work);
                    let _ = done.send(served);
                })
                .map_err(|source| StartError::Bind {
                    addr: listen,
                    source,
                })?;
            Ok(Worker { thread, finished })
        })
        .collect()
}

/// Worker `n`'s thread: its single-threaded event loop, running `work` (its listeners, as
/// [`serve_worker`] serves them) to its end. Returns how many requests it served.
fn run_worker(n: usize, work: impl Future<Output = u64>) -> u64 {
    crate::worker::set(n);
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, worker = n, "cannot start a worker's event loop");
            return 0;
        }
    };
    rt.block_on(work)
}

/// Serve worker `n`'s listeners (cleartext, and TLS where configured) in this event loop
/// until `stopped` turns true, then drain them. Returns how many requests they served.
async fn serve_worker(
    n: usize,
    sockets: GatewaySockets,
    gateway: Arc<Gateway>,
    registry: Arc<Registry>,
    grace: Duration,
    stopped: tokio::sync::watch::Receiver<bool>,
) -> u64 {
    let cleartext = match TcpListener::from_std(sockets.cleartext) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, worker = n, "cannot register the listener");
            return 0;
        }
    };
    let tls = match sockets.tls.map(TcpListener::from_std) {
        Some(Ok(l)) => Some(l),
        Some(Err(e)) => {
            tracing::error!(error = %e, worker = n, "cannot register the TLS listener");
            return 0;
        }
        None => None,
    };
    let stop = || {
        let mut stopped = stopped.clone();
        async move {
            let _ = stopped.wait_for(|s| *s).await;
        }
    };
    // This worker's alone (its connections run on its thread): no other core touches it.
    let served = Arc::new(AtomicU64::new(0));
    let clients = |tls| Clients {
        gateway: gateway.clone(),
        tls,
        worker: n,
        served: served.clone(),
    };
    let pacer = tokio::spawn(pace());
    let listener = Listener::new(cleartext, registry.clone(), clients(false), grace);
    match tls {
        Some(tls) => {
            let tls = Listener::new(tls, registry, clients(true), grace);
            tokio::join!(listener.run(stop()), tls.run(stop()));
        }
        None => listener.run(stop()).await,
    }
    pacer.abort();
    served.load(Relaxed)
}

/// The servers of the first pool (the pool `default` where there is one), each as the
/// file names it with its base path: `http://a:3000, http://b:3000/base`.
fn upstream_of(config: &Config) -> String {
    config
        .upstreams
        .first()
        .map_or_else(String::new, servers_of)
}

/// The other pools and their servers: `billing: http://a, http://b; search: http://c`,
/// or `-`.
fn pools_of(config: &Config) -> String {
    let others: Vec<String> = config
        .upstreams
        .iter()
        .skip(1)
        .map(|p| format!("{}: {}", p.name, servers_of(p)))
        .collect();
    if others.is_empty() {
        "-".to_string()
    } else {
        others.join("; ")
    }
}

fn servers_of(pool: &crate::upstream::PoolSettings) -> String {
    let urls: Vec<String> = pool
        .servers
        .iter()
        .map(|s| format!("{}{}", s.url.to_string().trim_end_matches('/'), s.base_path))
        .collect();
    urls.join(", ")
}

fn store_of(config: &Config) -> &'static str {
    match config.store.backend {
        crate::limiter::store::Backend::Memory => "memory",
        crate::limiter::store::Backend::Redis { .. } => "redis",
        crate::limiter::store::Backend::RedisCluster { .. } => "redis_cluster",
        crate::limiter::store::Backend::RedisSentinel(_) => "redis_sentinel",
    }
}

/// How often each worker's timer wakes, whatever else it has to do (see [`pace`]).
const PACE: Duration = Duration::from_millis(250);

/// Keep a timer due within [`PACE`] in the worker's event loop. Tokio's timer driver
/// wakes its own thread (an eventfd write, and an extra turn of the loop) whenever a timer
/// is set to fire before the earliest one it planned for when it last slept. With only far
/// timers pending (connections' idle clocks, a minute out), every request's upstream
/// timeout would be such a timer; with this one due soon, none is. Four wake-ups a second
/// instead of one per request (docs/performance.md, "The perimeter's cost", has what it
/// was measured to save).
async fn pace() {
    let mut tick = tokio::time::interval(PACE);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
    }
}

/// The signals the gateway answers, registered at once (see [`Signals::register`]).
struct Signals {
    /// SIGHUP, or `None` where it cannot be listened for (reloads are then off).
    hangup: Option<Hangups>,
    /// Resolves on SIGTERM or SIGINT.
    shutdown: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
}

#[cfg(unix)]
type Hangups = tokio::signal::unix::Signal;
#[cfg(not(unix))]
type Hangups = std::convert::Infallible;

impl Signals {
    /// Register SIGHUP, SIGTERM and SIGINT now: a signal that arrives between here and
    /// the first poll of its stream is kept for it, not met by the default action.
    #[cfg(unix)]
    fn register() -> Signals {
        use tokio::signal::unix::{signal, SignalKind};
        let hangup = signal(SignalKind::hangup())
            .map_err(|e| tracing::warn!(error = %e, "cannot listen for SIGHUP; reloads are off"))
            .ok();
        let terminate = signal(SignalKind::terminate());
        let interrupt = signal(SignalKind::interrupt());
        let shutdown = Box::pin(async move {
            match (terminate, interrupt) {
                (Ok(mut term), Ok(mut int)) => {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = int.recv() => {}
                    }
                }
                (Ok(mut term), Err(_)) => {
                    term.recv().await;
                }
                (Err(_), _) => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        });
        Signals { hangup, shutdown }
    }

    #[cfg(not(unix))]
    fn register() -> Signals {
        let shutdown = Box::pin(async {
            let _ = tokio::signal::ctrl_c().await;
        });
        Signals {
            hangup: None,
            shutdown,
        }
    }
}

/// SIGHUP: re-read the config. A bad file is logged and changes nothing.
async fn reload_on_sighup(shared: Shared, hangups: Option<Hangups>) {
    let Some(mut hangups) = hangups else { return };
    #[cfg(unix)]
    while hangups.recv().await.is_some() {
        let before = shared.live();
        match shared.current().reload() {
            Ok(()) => {
                let after = shared.live();
                for warning in after.config.server.tls.iter().flat_map(|t| t.warnings()) {
                    tracing::warn!("{warning}");
                }
                let c = crate::config::Changes::between(&before.config, &after.config);
                use crate::config::Listed;
                tracing::info!(
                    rules = after.config.rules.len(),
                    added = %Listed(&c.added),
                    removed = %Listed(&c.removed),
                    changed = %Listed(&c.changed),
                    pools = %c.pools,
                    routes = %c.routes,
                    settings = %Listed(&c.settings),
                    "config reloaded{}",
                    if c.is_empty() { ": nothing changed" } else { "" }
                )
            }
            Err(e) => {
                tracing::error!(error = %e, "config reload rejected; the old config keeps serving")
            }
        }
    }
    #[cfg(not(unix))]
    let _ = (shared, &mut hangups);
}

/// Where the kernel's bound on listen backlogs is read (Linux).
const SOMAXCONN: &str = "/proc/sys/net/core/somaxconn";

/// The backlog the listeners get: `[server] backlog`, cut to `net.core.somaxconn` where
/// the kernel would cut it anyway — said once at start, so that an operator who asked for
/// more knows where the rest went.
fn backlog(asked: u32) -> u32 {
    let cap = std::fs::read_to_string(SOMAXCONN)
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok());
    match cap {
        Some(cap) if cap < asked => {
            tracing::warn!(
                backlog = asked,
                somaxconn = cap,
                "[server] backlog {asked} is cut to net.core.somaxconn = {cap}: the listen queue holds {cap}; raise it with sysctl -w net.core.somaxconn={asked}"
            );
            cap
        }
        _ => asked,
    }
}

/// A listening socket with `backlog` (std's `TcpListener::bind` takes 128: a burst of new
/// connections beyond it waits for SYN retransmits, a second or more), non-blocking; as
/// std's, with `SO_REUSEADDR` (a restart binds while old connections are in TIME_WAIT).
/// The gateway's is shared by the workers (each registers a handle of it in its own event
/// loop).
fn bind_std(addr: SocketAddr, backlog: u32) -> Result<std::net::TcpListener, StartError> {
    use socket2::{Domain, Protocol, Socket, Type};
    let bound = (|| {
        let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
        #[cfg(unix)]
        socket.set_reuse_address(true)?;
        socket.bind(&addr.into())?;
        socket.listen(i32::try_from(backlog).unwrap_or(i32::MAX))?;
        socket.set_nonblocking(true)?;
        Ok(std::net::TcpListener::from(socket))
    })();
    bound.map_err(|source| StartError::Bind { addr, source })
}

/// A front-end's socket, registered with this runtime.
fn bind(addr: SocketAddr, backlog: u32) -> Result<TcpListener, StartError> {
    TcpListener::from_std(bind_std(addr, backlog)?)
        .map_err(|source| StartError::Bind { addr, source })
}

/// The gateway's clients, on a worker's cleartext or (`tls`) TLS listener: each
/// connection's requests go to the gateway, each in its [`Context`].
#[derive(Clone)]
struct Clients {
    gateway: Arc<Gateway>,
    tls: bool,
    /// The worker whose event loop runs the listener (and its connections).
    worker: usize,
    /// The requests served, counted by the worker's listeners together.
    served: Arc<AtomicU64>,
}

impl Handler for Clients {
    /// Serve a connection as the config live when it was accepted says: its clocks and
    /// bounds, the redirect to HTTPS on the cleartext listener (`redirect_https`), the
    /// TLS listener's certificates.
    fn serve(&self, conn: Accepted<'_>) -> Option<impl Future<Output = ()> + Send + 'static> {
        let live = self.gateway.live();
        let settings = live.config.server.connections();
        // Where the client should have gone: the TLS listener's port, for a 308.
        let redirect = match &live.config.server.tls {
            Some(t) if t.redirect_https && !self.tls => Some(t.listen.port()),
            _ => None,
        };
        let tls_config = match (&live.config.server.tls, self.tls) {
            (Some(t), true) => Some(t.server_config.clone()),
            // `[server.tls]` taken out by a reload: its listener, bound at start, takes
            // no more connections than it can serve (none) until a restart.
            (None, true) => return None,
            (_, false) => None,
        };
        drop(live);
        let clients = self.clone();
        let metrics = self.gateway.metrics().clone();
        let (stream, peer, registry, permit) =
            (conn.stream, conn.peer, conn.registry.clone(), conn.permit);
        Some(async move {
            match tls_config {
                None => {
                    // Rendered once for all the connection's requests.
                    let client = ClientPeer::new(peer);
                    connection::serve(stream, &registry, permit, settings, |track| {
                        clients.service(redirect, client, track)
                    })
                    .await
                }
                Some(config) => {
                    connection::serve_tls(
                        stream,
                        config,
                        &registry,
                        permit,
                        settings,
                        |outcome, session| metrics.connection.tls_handshake(outcome, session),
                        |track, session| {
                            let client = ClientPeer::with_tls(peer, Some(session));
                            clients.service(redirect, client, track)
                        },
                    )
                    .await
                }
            }
        })
    }
}

impl Clients {
    /// The service of one connection from `client`: its requests, each in a context made
    /// from the connection's, each tracked as in flight until its answer's body is done.
    /// `redirect`: the TLS port every request is sent to instead (`redirect_https`).
    fn service(
        self,
        redirect: Option<u16>,
        client: ClientPeer,
        track: Arc<connection::Track>,
    ) -> impl connection::Service<Tracked<crate::proxy::Body>> {
        let Clients {
            gateway: gw,
            served,
            worker,
            ..
        } = self;
        let ctx = Context::new(client, worker).on(track.clone());
        service_fn(move |req: Request<Incoming>| {
            served.fetch_add(1, Relaxed);
            let request = InFlight::new(&track);
            let http2 = req.version() == http::Version::HTTP_2;
            let (gw, ctx) = (gw.clone(), ctx.clone());
            async move {
                let resp = match redirect {
                    Some(port) => gw.redirect(&req, &ctx, |req| to_https(req, port)),
                    None => gw.handle(req, &ctx).await,
                };
                Ok::<_, Infallible>(resp.map(|body| Tracked::new(body, request, http2)))
            }
        })
    }
}

/// The cleartext listener's answer where `redirect_https` is on: 308 to the same URL on
/// the TLS listener's `port` (RFC 9110 §15.4.9: the method and body are kept).
fn to_https<B>(req: &Request<B>, port: u16) -> http::Response<crate::proxy::Body> {
    // A host the gateway would refuse (userinfo, a path, two that disagree) never becomes
    // a Location: `Host: evil.example/x` is a 400, not a redirect elsewhere.
    let sound = crate::proxy::host_is_sound(req.version(), req.uri(), req.headers());
    let host = sound
        .then(|| req.uri().host().map(str::to_string))
        .flatten()
        .or_else(|| {
            if !sound {
                return None;
            }
            let h = req.headers().get(http::header::HOST)?.to_str().ok()?;
            // The host without its port (an IPv6 literal keeps its brackets).
            let end = match h.rfind(']') {
                Some(b) => b + 1,
                None => h.find(':').unwrap_or(h.len()),
            };
            Some(h[..end].to_string())
        });
    let path = req.uri().path_and_query().map_or("/", |p| p.as_str());
    let location = match (host, port) {
        (Some(h), 443) => Some(format!("https://{h}{path}")),
        (Some(h), p) => Some(format!("https://{h}:{p}{path}")),
        (None, _) => None,
    };
    let mut resp = http::Response::new(crate::proxy::Body::Right(Default::default()));
    match location.and_then(|l| http::HeaderValue::try_from(l).ok()) {
        Some(l) => {
            *resp.status_mut() = http::StatusCode::PERMANENT_REDIRECT;
            resp.headers_mut().insert(http::header::LOCATION, l);
        }
        None => *resp.status_mut() = http::StatusCode::BAD_REQUEST,
    }
    resp
}

/// Background work that keeps the store bounded, and closes upstream connections that
/// expired or that the upstream closed while idle.
async fn upkeep(shared: Shared) {
    let mut tick = tokio::time::interval(SWEEP_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let live = shared.live();
        live.limiter.sweep();
        let keys = live.config.keys.directory().len();
        shared
            .metrics()
            .limiter
            .key_directory_keys
            .set(i64::try_from(keys).unwrap_or(i64::MAX));
        shared
            .metrics()
            .connection
            .tls_settings(live.config.server.tls.as_ref());
        live.pools.sweep();
    }
}

/// How long start-up waits for a shared store's key directory before serving without it.
const KEY_DIRECTORY_FIRST_READ: Duration = Duration::from_secs(2);

/// How often the key directory's follower looks for a reload that moved the directory
/// (another Redis, prefix or `resync`).
const KEY_SYNC_RECHECK: Duration = Duration::from_secs(1);

/// With a shared store, keep the key directory in step with its Redis hash (see
/// [`crate::limiter::redis::directory`]); started again on the new settings when a reload
/// changes where the directory lives. The memory store's directory is the keys file's:
/// nothing to follow.
async fn follow_key_directory(shared: Shared) {
    use crate::limiter::redis::directory::{Location, RedisKeys};
    loop {
        let live = shared.live();
        let keys = &live.config.keys;
        let at = Location::of(&live.config.store, keys.resync);
        let follower = at.clone().map(|at| {
            let syncs = shared.metrics().limiter.key_directory_syncs.clone();
            AbortOnDrop(tokio::spawn(
                RedisKeys::new(at).follow(keys.directory().clone(), syncs),
            ))
        });
        drop(live);
        loop {
            tokio::time::sleep(KEY_SYNC_RECHECK).await;
            let live = shared.live();
            if Location::of(&live.config.store, live.config.keys.resync) != at {
                break;
            }
        }
        drop(follower);
    }
}

/// A task aborted when its handle is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn location(uri: &str, host: Option<&str>, port: u16) -> (u16, Option<String>) {
        let mut req = Request::get(uri);
        match host {
            Some(h) => req = req.header("host", h),
            // An authority and no Host: an HTTP/2 request (`:authority`).
            None => req = req.version(http::Version::HTTP_2),
        }
        let resp = to_https(&req.body(()).unwrap(), port);
        let at = resp
            .headers()
            .get(http::header::LOCATION)
            .map(|l| l.to_str().unwrap().to_string());
        (resp.status().as_u16(), at)
    }

    #[test]
    fn the_redirect_keeps_host_path_and_query_and_names_the_tls_port() {
        let cases = [
            (
                "/a?b=1",
                Some("app.test:8080"),
                8443,
                "https://app.test:8443/a?b=1",
            ),
            ("/", Some("app.test"), 443, "https://app.test/"),
            ("/x", Some("[::1]:8080"), 8443, "https://[::1]:8443/x"),
            ("http://h2.test:80/y", None, 443, "https://h2.test/y"),
        ];
        for (uri, host, port, want) in cases {
            assert_eq!(
                location(uri, host, port),
                (308, Some(want.to_string())),
                "{uri}"
            );
        }
        assert_eq!(
            location("/", None, 8443),
            (400, None),
            "no host to send it to"
        );
        // A host the gateway would refuse is no Location.
        for (uri, host) in [("/x", "evil.example/x"), ("/x", "a@evil.example")] {
            assert_eq!(location(uri, Some(host), 443), (400, None), "{host}");
        }
    }
}
