//! Listeners: the gateway's accept loop, the admin listener, background upkeep, and
//! graceful shutdown on SIGTERM/SIGINT.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

use crate::config::{Config, OnError};
use crate::gateway::{Gateway, Live};
use crate::limiter::guard::Health;

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
    let live = Live::build(config, None)?;
    let config = live.config.clone();
    let listener = bind(config.server.listen).await?;
    let admin = match config.server.admin_listen {
        Some(addr) => Some(bind(addr).await?),
        None => None,
    };
    let gateway = Arc::new(Gateway::new(live, config_path));
    tracing::info!(
        listen = %config.server.listen,
        admin = ?config.server.admin_listen,
        upstream = %config.upstream.url,
        rules = config.rules.len(),
        "ratewall listening"
    );

    let upkeep = tokio::spawn(upkeep(gateway.clone()));
    let reloads = tokio::spawn(reload_on_sighup(gateway.clone()));
    let admin_task = admin.map(|l| tokio::spawn(serve_admin(l, gateway.clone())));

    serve(
        listener,
        gateway,
        config.server.shutdown_grace,
        shutdown_signal(),
    )
    .await;
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
                let service = service_fn(move |req: Request<Incoming>| {
                    let gw = gw.clone();
                    async move { Ok::<_, Infallible>(gw.handle(req, peer).await) }
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
    tracing::info!(grace = ?grace, "shutting down: draining in-flight requests");
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

/// Background work that keeps the store bounded.
async fn upkeep(gateway: Arc<Gateway>) {
    let mut tick = tokio::time::interval(SWEEP_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        gateway.live().limiter.sweep();
    }
}

/// The admin listener: `/healthz`, `/readyz`.
///
/// `/readyz` is 200 while traffic is served as configured: the store answers, or it fails
/// and `on_error` (allow, local) lets traffic through; 503 while `on_error = "deny"` turns
/// requests away. The body says which, and the breaker's state.
pub async fn serve_admin(listener: TcpListener, gateway: Arc<Gateway>) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "admin accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let gw = gateway.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req: Request<Incoming>| {
                let gw = gw.clone();
                async move { Ok::<_, Infallible>(admin(&gw, &req).await) }
            });
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn admin(gw: &Gateway, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let text = |status: StatusCode, body: &str| {
        let mut r = Response::new(Full::new(Bytes::from(body.to_string())));
        *r.status_mut() = status;
        r.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        r
    };
    match req.uri().path() {
        "/healthz" => text(StatusCode::OK, "ok\n"),
        "/readyz" => {
            let live = gw.live();
            let limiter = &live.limiter;
            let on_error = limiter.on_error();
            let breaker = match limiter.health() {
                Health::Open => "open",
                Health::Healthy | Health::Failing => "closed",
            };
            match limiter.ping().await {
                Ok(()) => text(StatusCode::OK, "ready: store answers; breaker closed\n"),
                Err(e) => {
                    let serving = on_error != OnError::Deny;
                    let (status, verdict) = if serving {
                        (StatusCode::OK, "ready")
                    } else {
                        (StatusCode::SERVICE_UNAVAILABLE, "not ready")
                    };
                    let body = format!(
                        "{verdict}: store failing ({e}); breaker {breaker}; on_error = {}\n",
                        on_error.name()
                    );
                    text(status, &body)
                }
            }
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}
