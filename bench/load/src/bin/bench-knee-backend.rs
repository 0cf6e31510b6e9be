//! The backend of bench/overload: one whose latency grows with its concurrency past a knee.
//! PERMITS requests (default 16) are served at once, each by a sleep of SLEEP_MS (default
//! 20 ms); the rest wait their turn for a permit, first come first served. Its capacity is
//! PERMITS / SLEEP: 800 requests/s by default; past PERMITS in flight, a request's latency
//! is SLEEP · in_flight / PERMITS.
//!
//!     bench-knee-backend 127.0.0.1:18702 [PERMITS] [SLEEP_MS]
//!
//! - `GET /max`: `in_flight N max M served S`, at once and without a permit: the requests
//!   inside the backend now (waiting for a permit or holding one), the most there were at
//!   once since the last `GET /max` (it is reset to `in_flight` by this call), and those
//!   served since start. bench/overload samples it every 100 ms.
//! - Anything else: `200`, `ok\n`, after its permit and its sleep.
//!
//! One thread: the sleeps cost nothing, and 800 requests/s are far below what one core serves.

use std::cell::Cell;
use std::convert::Infallible;
use std::rc::Rc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::sync::Semaphore;

/// What `GET /max` reports.
#[derive(Default)]
struct Counts {
    in_flight: Cell<u64>,
    max: Cell<u64>,
    served: Cell<u64>,
}

/// One request inside the backend, counted out on drop (also when its client leaves).
struct Inside(Rc<Counts>);

impl Inside {
    fn new(counts: &Rc<Counts>) -> Inside {
        let n = counts.in_flight.get() + 1;
        counts.in_flight.set(n);
        counts.max.set(counts.max.get().max(n));
        Inside(counts.clone())
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        self.0.in_flight.set(self.0.in_flight.get() - 1);
    }
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let addr = args
        .first()
        .cloned()
        .unwrap_or_else(|| "127.0.0.1:18702".into());
    let permits: usize = args.get(1).map_or(Ok(16), |s| s.parse()).map_err(invalid)?;
    let sleep_ms: u64 = args.get(2).map_or(Ok(20), |s| s.parse()).map_err(invalid)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // A LocalSet: the counts are Rc<Cell>s, on this one thread.
    tokio::task::LocalSet::new().block_on(&rt, serve(addr, permits, sleep_ms))
}

fn invalid(e: std::num::ParseIntError) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, e)
}

async fn serve(addr: String, permits: usize, sleep_ms: u64) -> std::io::Result<()> {
    let listener = ratewall_bench::listen(&addr)?;
    let semaphore = Rc::new(Semaphore::new(permits));
    let counts = Rc::new(Counts::default());
    let sleep = Duration::from_millis(sleep_ms);
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                eprintln!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let (semaphore, counts) = (semaphore.clone(), counts.clone());
        tokio::task::spawn_local(async move {
            let service = service_fn(move |req: Request<Incoming>| {
                let (semaphore, counts) = (semaphore.clone(), counts.clone());
                async move { Ok::<_, Infallible>(answer(req, &semaphore, &counts, sleep).await) }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn answer(
    req: Request<Incoming>,
    semaphore: &Semaphore,
    counts: &Rc<Counts>,
    sleep: Duration,
) -> Response<Full<Bytes>> {
    if req.uri().path() == "/max" {
        let line = format!(
            "in_flight {} max {} served {}\n",
            counts.in_flight.get(),
            counts.max.get(),
            counts.served.get()
        );
        counts.max.set(counts.in_flight.get());
        return Response::new(Full::new(Bytes::from(line)));
    }
    let _inside = Inside::new(counts);
    // Never closed: acquire fails only on a closed semaphore.
    let Ok(_permit) = semaphore.acquire().await else {
        return Response::new(Full::new(Bytes::from_static(b"closed\n")));
    };
    tokio::time::sleep(sleep).await;
    counts.served.set(counts.served.get() + 1);
    Response::new(Full::new(Bytes::from_static(b"ok\n")))
}
