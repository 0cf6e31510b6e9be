//! The demo backend of ratewall's quick start: answers every request with 200 and a line
//! of text, on 127.0.0.1:3000 (or the address given as the first argument). A `sleep=<ms>`
//! query parameter makes it take that long (to try concurrency limits).
//!
//!     cargo run -p demo-upstream [-- 0.0.0.0:3000]
//!
//! A crate of its own, with only what it needs: it builds in seconds, without the
//! gateway's dependencies or the tests'.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::io::Result<()> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("demo upstream listening on http://{addr}");
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, say: try again shortly rather than exit.
                eprintln!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        tokio::spawn(async move {
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service_fn(answer))
                .await;
        });
    }
}

async fn answer(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let sleep_ms = req
        .uri()
        .query()
        .into_iter()
        .flat_map(|q| q.split('&'))
        .find_map(|kv| kv.strip_prefix("sleep="))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0)
        .min(60_000);
    tokio::time::sleep(Duration::from_millis(sleep_ms)).await;
    let text = format!("hello from the upstream: {} {}\n", req.method(), req.uri());
    Ok(Response::new(Full::new(Bytes::from(text))))
}
