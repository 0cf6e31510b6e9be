//! A bare hyper reverse proxy, for `bench/run` to measure beside ratewall: hyper's HTTP/1
//! server and hyper-util's pooled client, one current-thread runtime per core accepting on
//! one socket (as ratewall runs), and nothing else — no limits, no headers, no metrics.
//! What the stack ratewall started from costs on this machine, before any limiting.
//!
//!     cargo run --release --example hyper_proxy -- 127.0.0.1:18088 http://127.0.0.1:18080

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use http::{Request, Response, StatusCode, Uri};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};

type Body = BoxBody<Bytes, hyper::Error>;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let listen: SocketAddr = args
        .next()
        .ok_or("usage: hyper_proxy LISTEN UPSTREAM")?
        .parse()?;
    let upstream: Uri = args
        .next()
        .ok_or("usage: hyper_proxy LISTEN UPSTREAM")?
        .parse()?;
    let listener = std::net::TcpListener::bind(listen)?;
    listener.set_nonblocking(true)?;
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads: Vec<_> = (0..workers)
        .map(|_| {
            let (listener, upstream) = (listener.try_clone(), upstream.clone());
            std::thread::spawn(move || -> Result<(), String> {
                let listener = listener.map_err(|e| e.to_string())?;
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| e.to_string())?;
                rt.block_on(serve(listener, upstream))
            })
        })
        .collect();
    for t in threads {
        if let Ok(Err(e)) = t.join() {
            eprintln!("worker failed: {e}");
        }
    }
    Ok(())
}

async fn serve(listener: std::net::TcpListener, upstream: Uri) -> Result<(), String> {
    let listener = tokio::net::TcpListener::from_std(listener).map_err(|e| e.to_string())?;
    let client = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(256)
        .build_http::<Incoming>();
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (client, upstream) = (client.clone(), upstream.clone());
        tokio::spawn(async move {
            let service = service_fn(move |req: Request<Incoming>| {
                let (client, upstream) = (client.clone(), upstream.clone());
                async move { Ok::<_, Infallible>(forward(&client, &upstream, req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn forward(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Incoming>,
    upstream: &Uri,
    mut req: Request<Incoming>,
) -> Response<Body> {
    let pq = req.uri().path_and_query().map_or("/", |p| p.as_str());
    let uri = format!("{}{}", upstream.to_string().trim_end_matches('/'), pq).parse();
    let answer = match uri {
        Ok(uri) => {
            *req.uri_mut() = uri;
            client.request(req).await.ok()
        }
        Err(_) => None,
    };
    match answer {
        Some(resp) => resp.map(|b| b.boxed()),
        None => {
            let mut resp = Response::new(Full::new(Bytes::new()).map_err(|e| match e {}).boxed());
            *resp.status_mut() = StatusCode::BAD_GATEWAY;
            resp
        }
    }
}
