//! Listeners: the gateway's accept loops, background upkeep, SIGHUP reload, and graceful
//! shutdown on SIGTERM/SIGINT. The admin listener is [`crate::admin`].
//!
//! Thread per core: `[server].workers` threads (one per CPU by default) each run their
//! own single-threaded event loop, accept on the one listening socket, and serve their
//! connections start to end with their own upstream pool — a request never hops threads,
//! so no cross-thread wake-ups on the hot path. The thread that calls [`run`] keeps the
//! rest: signals, reloads, the admin listener, upkeep, and the store's connections.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::Request;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

use crate::config::Config;
use crate::gateway::{Gateway, Live};
use crate::proxy::Peer;

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
/// `config_path`.
pub async fn run(
    config: Config,
    config_path: Option<std::path::PathBuf>,
) -> Result<(), StartError> {
    let metrics = Arc::new(crate::metrics::Metrics::new());
    let live = Live::build(config, None, &metrics)?;
    live.limiter.warm().await;
    let config = live.config.clone();
    let listener = bind_std(config.server.listen)?;
    let admin = match config.server.admin_listen {
        Some(addr) => Some(bind(addr).await?),
        None => None,
    };
    let gateway = Arc::new(Gateway::new(live, config_path, metrics));
    tracing::info!(
        listen = %config.server.listen,
        admin = ?config.server.admin_listen,
        upstream = %config.upstream.url,
        rules = config.rules.len(),
        "ratewall listening"
    );

    let upkeep = tokio::spawn(upkeep(gateway.clone()));
    let reloads = tokio::spawn(reload_on_sighup(gateway.clone()));
    let admin_task = admin.map(|l| tokio::spawn(crate::admin::serve(l, gateway.clone())));

    // Each worker accepts on its own handle of the one socket, in its own event loop.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut workers = Vec::new();
    for n in 0..config.server.workers.max(1) {
        let listener = listener.try_clone().map_err(|source| StartError::Bind {
            addr: config.server.listen,
            source,
        })?;
        let (gateway, grace, mut stopped) = (
            gateway.clone(),
            config.server.shutdown_grace,
            stopped.clone(),
        );
        let (done, finished) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("ratewall-worker-{n}"))
            .spawn(move || {
                crate::worker::set(n);
                let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(rt) => rt,
                    Err(e) => {
                        tracing::error!(error = %e, worker = n, "cannot start a worker's event loop");
                        return;
                    }
                };
                rt.block_on(async move {
                    let listener = match TcpListener::from_std(listener) {
                        Ok(l) => l,
                        Err(e) => {
                            tracing::error!(error = %e, worker = n, "cannot register the listener");
                            return;
                        }
                    };
                    let stop = async move {
                        let _ = stopped.wait_for(|s| *s).await;
                    };
                    serve(listener, gateway, grace, stop).await;
                });
                let _ = done.send(());
            })
            .map_err(|source| StartError::Bind {
                addr: config.server.listen,
                source,
            })?;
        workers.push((thread, finished));
    }
    drop(listener);
    shutdown_signal().await;
    tracing::info!(grace = ?config.server.shutdown_grace, "shutting down: draining in-flight requests");
    let _ = stop.send(true);
    for (thread, finished) in workers {
        // A worker that could not start has nothing to drain.
        let _ = finished.await;
        let _ = tokio::task::spawn_blocking(move || thread.join()).await;
    }
    upkeep.abort();
    reloads.abort();
    if let Some(t) = admin_task {
        t.abort();
    }
    Ok(())
}

/// SIGHUP: re-read the config. A bad file is logged and changes nothing.
async fn reload_on_sighup(gateway: Arc<Gateway>) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut hup = match signal(SignalKind::hangup()) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGHUP; reloads are off");
                return;
            }
        };
        while hup.recv().await.is_some() {
            match gateway.reload() {
                Ok(()) => {
                    tracing::info!(rules = gateway.live().config.rules.len(), "config reloaded")
                }
                Err(e) => {
                    tracing::error!(error = %e, "config reload rejected; the old config keeps serving")
                }
            }
        }
    }
    #[cfg(not(unix))]
    let _ = gateway;
}

/// The gateway's listening socket, shared by the workers (each registers a handle of it
/// in its own event loop).
fn bind_std(addr: SocketAddr) -> Result<std::net::TcpListener, StartError> {
    let bound = std::net::TcpListener::bind(addr).and_then(|l| {
        l.set_nonblocking(true)?;
        Ok(l)
    });
    bound.map_err(|source| StartError::Bind { addr, source })
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Bind { addr, source })
}

/// Accept connections until `shutdown` resolves; then stop accepting and give in-flight
/// requests up to `grace` to finish.
pub async fn serve(
    listener: TcpListener,
    gateway: Arc<Gateway>,
    grace: Duration,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(30));
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of file descriptors and the like: wait, never stop serving.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let gw = gateway.clone();
                // Rendered once for all the connection's requests.
                let client = Peer::new(peer);
                let service = service_fn(move |req: Request<Incoming>| {
                    let (gw, client) = (gw.clone(), client.clone());
                    async move { Ok::<_, Infallible>(gw.handle(req, &client).await) }
                });
                let conn = builder.serve_connection(TokioIo::new(stream), service).into_owned();
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!(error = %e, %peer, "connection ended with an error");
                    }
                });
            }
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("shutdown grace ran out; closing the remaining connections");
    }
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Background work that keeps the store bounded, and closes upstream connections that
/// expired or that the upstream closed while idle.
async fn upkeep(gateway: Arc<Gateway>) {
    let mut tick = tokio::time::interval(SWEEP_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let live = gateway.live();
        live.limiter.sweep();
        for proxy in live.proxies.iter() {
            proxy.sweep();
        }
    }
}
