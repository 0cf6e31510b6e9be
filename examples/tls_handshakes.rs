//! A TLS load client for `bench/run`'s TLS table, where wrk cannot serve: wrk keeps each
//! connection's OpenSSL session and resumes it on the next connection (a server that
//! takes it back does a resumed handshake, not a full one). This client resumes nothing
//! unless asked: `CONNECTIONS` tasks at once, each over and over for `SECS` seconds: TCP
//! connect, a TLS 1.3 handshake (rustls, ring, X25519; the server's signature is verified,
//! its certificate chain is not, as wrk does not: `insecure_skip_verify`'s verifier), one
//! `GET /` with `Connection: close` and a fresh `x-api-key`, the whole answer read, closed.
//! One thread: `taskset` it.
//!
//!     cargo run --release --example tls_handshakes -- 127.0.0.1:18386 64 10 [--resume]
//!
//! Prints one line: `requests N ok N failed N seconds S p50_ms P p99_ms P resumed N`
//! (a request is one connection and one handshake; latency from connect to the answer's
//! end; `resumed`: the handshakes that resumed a session).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ratewall::upstream::NoVerification;
use rustls::client::{
    ClientSessionStore, Resumption, Tls12ClientSessionValue, Tls13ClientSessionValue,
};
use rustls::pki_types::ServerName;
use rustls::{HandshakeKind, NamedGroup};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

type Error = Box<dyn std::error::Error + Send + Sync>;

fn main() -> Result<(), Error> {
    let usage = "usage: tls_handshakes ADDR CONNECTIONS SECS [--resume]";
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (addr, conns, secs) = match &args[..] {
        [a, c, s] | [a, c, s, _] => (
            a.parse::<SocketAddr>()?,
            c.parse::<usize>()?,
            s.parse::<u64>()?,
        ),
        _ => return Err(usage.into()),
    };
    let resume = match args.get(3).map(String::as_str) {
        None => false,
        Some("--resume") => true,
        Some(_) => return Err(usage.into()),
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(NoVerification(provider)))
        .with_no_client_auth();
    config.resumption = if resume {
        Resumption::store(Arc::new(Tickets::default()))
    } else {
        Resumption::disabled()
    };
    let connector = TlsConnector::from(Arc::new(config));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let start = Instant::now();
        let end = start + Duration::from_secs(secs);
        let tasks: Vec<_> = (0..conns)
            .map(|i| tokio::spawn(client(addr, connector.clone(), i, end)))
            .collect();
        let mut all = Tally::default();
        for t in tasks {
            let t = t.await?;
            all.failed += t.failed;
            all.resumed += t.resumed;
            all.latencies.extend(t.latencies);
        }
        let seconds = start.elapsed().as_secs_f64();
        all.latencies.sort_unstable();
        let at = |q: f64| -> f64 {
            let l = &all.latencies;
            if l.is_empty() {
                return 0.0;
            }
            l[((l.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e3
        };
        let ok = all.latencies.len();
        println!(
            "requests {} ok {ok} failed {} seconds {seconds:.3} p50_ms {:.3} p99_ms {:.3} resumed {}",
            ok + all.failed,
            all.failed,
            at(0.5),
            at(0.99),
            all.resumed,
        );
        Ok::<_, Error>(())
    })
}

#[derive(Default)]
struct Tally {
    /// Each answered request's time, connect to the answer's end.
    latencies: Vec<Duration>,
    failed: usize,
    resumed: usize,
}

/// One connection slot: connect, handshake, one request, until `end`.
async fn client(addr: SocketAddr, connector: TlsConnector, slot: usize, end: Instant) -> Tally {
    let mut tally = Tally::default();
    let mut n = 0usize;
    while Instant::now() < end {
        n += 1;
        let started = Instant::now();
        match exchange(addr, &connector, (slot * 1_000_003 + n) % 100_000).await {
            Ok(resumed) => {
                tally.latencies.push(started.elapsed());
                tally.resumed += usize::from(resumed);
            }
            Err(_) => tally.failed += 1,
        }
    }
    tally
}

/// One connection: a handshake and one request whose answer is a 200. Whether the
/// handshake resumed a session.
async fn exchange(addr: SocketAddr, connector: &TlsConnector, key: usize) -> Result<bool, Error> {
    let tcp = TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let name = ServerName::try_from("localhost")?;
    let mut tls = connector.connect(name, tcp).await?;
    let resumed = tls.get_ref().1.handshake_kind() == Some(HandshakeKind::Resumed);
    let request = format!(
        "GET / HTTP/1.1\r\nHost: localhost\r\nx-api-key: key-{key}\r\nConnection: close\r\n\r\n"
    );
    tls.write_all(request.as_bytes()).await?;
    let mut answer = Vec::with_capacity(512);
    // A server that closes without close_notify ends the read with an error: the answer
    // read so far is judged all the same.
    let _ = tls.read_to_end(&mut answer).await;
    if !answer.starts_with(b"HTTP/1.1 200 ") {
        return Err("not a 200".into());
    }
    Ok(resumed)
}

/// The TLS 1.3 tickets the server gave, newest taken first, up to 1,024 (rustls' own cache
/// keeps 8 a server: with tens of connections starting at once, most would find none).
/// One server, so names are not told apart.
#[derive(Debug, Default)]
struct Tickets(Mutex<VecDeque<Tls13ClientSessionValue>>);

impl ClientSessionStore for Tickets {
    fn set_kx_hint(&self, _: ServerName<'static>, _: NamedGroup) {}

    fn kx_hint(&self, _: &ServerName<'_>) -> Option<NamedGroup> {
        None
    }

    fn set_tls12_session(&self, _: ServerName<'static>, _: Tls12ClientSessionValue) {}

    fn tls12_session(&self, _: &ServerName<'_>) -> Option<Tls12ClientSessionValue> {
        None
    }

    fn remove_tls12_session(&self, _: &ServerName<'static>) {}

    fn insert_tls13_ticket(&self, _: ServerName<'static>, value: Tls13ClientSessionValue) {
        let mut tickets = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if tickets.len() == 1024 {
            tickets.pop_front();
        }
        tickets.push_back(value);
    }

    fn take_tls13_ticket(&self, _: &ServerName<'_>) -> Option<Tls13ClientSessionValue> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).pop_back()
    }
}
