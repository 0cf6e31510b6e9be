//! A backend with a knee: `capacity` requests are served at once, each for `service` ±50%
//! (uniform over [0.5, 1.5] × `service`, from a fixed sequence: a real backend's requests
//! do not all take one time, and places of one fixed time would move in lockstep
//! batches); the rest wait for a place (a semaphore), so past the knee its latency grows
//! with its concurrency (at `c` in flight, about `service · c / capacity`). It counts the requests
//! in its handler, those waiting for a place included, and keeps the most it ever held,
//! so that a test can see the concurrency a gateway let reach it.
//!
//! It runs on a thread and runtime of its own: its clocks and its semaphore are not
//! delayed by the test's own clients on the test's runtime.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::sync::{oneshot, Semaphore};

struct Shared {
    places: Semaphore,
    service: Duration,
    /// Requests in the handler now, waiting or served.
    in_flight: AtomicUsize,
    /// The most there ever were.
    max_in_flight: AtomicUsize,
    /// Requests answered.
    served: AtomicUsize,
    /// Requests come so far: where each one's service time is drawn in the sequence.
    drawn: AtomicU64,
}

/// Counts one request in the handler for as long as it lives (a request whose
/// connection closes is dropped mid-wait: it leaves the count too).
struct InHandler<'a>(&'a Shared);

impl<'a> InHandler<'a> {
    fn enter(s: &'a Shared) -> InHandler<'a> {
        let now = s.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        s.max_in_flight.fetch_max(now, Ordering::SeqCst);
        InHandler(s)
    }
}

impl Drop for InHandler<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The knee backend; stopped on drop.
pub struct Knee {
    pub addr: SocketAddr,
    pub capacity: usize,
    pub service: Duration,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Knee {
    /// `capacity` places of `service` each: its throughput is `capacity / service`.
    pub fn start(capacity: usize, service: Duration) -> Knee {
        let shared = Arc::new(Shared {
            places: Semaphore::new(capacity),
            service,
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
            served: AtomicUsize::new(0),
            drawn: AtomicU64::new(0),
        });
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the knee");
        std_listener.set_nonblocking(true).expect("nonblocking");
        let addr = std_listener.local_addr().expect("the knee's address");
        let (stop, stopped) = oneshot::channel::<()>();
        let serving = shared.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("the knee's runtime");
            rt.block_on(async move {
                let listener =
                    tokio::net::TcpListener::from_std(std_listener).expect("the knee's listener");
                let accept = async {
                    loop {
                        let Ok((stream, _)) = listener.accept().await else {
                            continue;
                        };
                        let _ = stream.set_nodelay(true);
                        let shared = serving.clone();
                        tokio::spawn(async move {
                            let svc = service_fn(move |_req: Request<Incoming>| {
                                let shared = shared.clone();
                                async move { Ok::<_, Infallible>(answer(&shared).await) }
                            });
                            let _ =
                                hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                                    .serve_connection(TokioIo::new(stream), svc)
                                    .await;
                        });
                    }
                };
                tokio::select! {
                    _ = accept => {}
                    _ = stopped => {}
                }
            });
        });
        Knee {
            addr,
            capacity,
            service,
            shared,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Requests per second it serves at most.
    pub fn throughput(&self) -> f64 {
        self.capacity as f64 / self.service.as_secs_f64()
    }

    /// The most requests it held at once (waiting for a place included) since it started
    /// or since the last [`Knee::reset_max`].
    pub fn max_in_flight(&self) -> usize {
        self.shared.max_in_flight.load(Ordering::SeqCst)
    }

    /// Start counting the maximum afresh (from those in the handler now).
    pub fn reset_max(&self) {
        let now = self.shared.in_flight.load(Ordering::SeqCst);
        self.shared.max_in_flight.store(now, Ordering::SeqCst);
    }

    /// Requests answered so far.
    pub fn served(&self) -> usize {
        self.shared.served.load(Ordering::SeqCst)
    }
}

impl Drop for Knee {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn answer(shared: &Shared) -> Response<Full<Bytes>> {
    let _counted = InHandler::enter(shared);
    let place = shared.places.acquire().await;
    let n = shared.drawn.fetch_add(1, Ordering::SeqCst);
    tokio::time::sleep(shared.service.mul_f64(0.5 + unit(n))).await;
    drop(place);
    shared.served.fetch_add(1, Ordering::SeqCst);
    Response::new(Full::new(Bytes::from_static(b"ok\n")))
}

/// The `n`th number of a fixed sequence spread uniformly over [0, 1) (SplitMix64).
fn unit(n: u64) -> f64 {
    let mut z = n.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}
