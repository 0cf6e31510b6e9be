//! A demo backend for trying ratewall: answers every request with 200 and a short text,
//! on 127.0.0.1:3000 (or the address given as the first argument). A `sleep=<ms>` query
//! parameter makes it take that long (to try concurrency limits).
//!
//!     cargo run --example upstream [-- 127.0.0.1:3000]

use std::convert::Infallible;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("demo upstream listening on http://{addr}");
    loop {
        let (stream, _) = listener.accept().await?;
        tokio::spawn(async move {
            let svc = service_fn(|req: Request<Incoming>| async move {
                let sleep_ms = req
                    .uri()
                    .query()
                    .into_iter()
                    .flat_map(|q| q.split('&'))
                    .find_map(|kv| kv.strip_prefix("sleep="))
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0)
                    .min(60_000);
                tokio::time::sleep(std::time::Duration::from_millis(sleep_ms)).await;
                let text = format!("hello from the upstream: {} {}\n", req.method(), req.uri());
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(text))))
            });
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}
