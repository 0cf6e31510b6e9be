//! WebSocket load for bench/run's ws table, where wrk cannot serve. CONNECTIONS sockets,
//! each opened with an RFC 6455 handshake (its `101` and `Sec-WebSocket-Accept` checked);
//! once all are open, each keeps IN_FLIGHT text messages of SIZE bytes (masked, a fresh
//! key each, §5.3) in flight for SECS seconds: every echoed message read is answered with
//! a new one, all those of one read in one write. Then each socket closes (1000) and waits
//! up to 2 s for the server's close. One thread: `taskset` it.
//!
//!     bench-ws-load 127.0.0.1:18586 64 4 10 [32] [/ws]
//!
//! Prints one line of `name value` pairs:
//! `messages N seconds S msgs_per_s R p50_us P p99_us P upgraded N refused N failed N
//! closed N stalled N unclean N min_per_conn N`, where `messages` are the echoes read
//! within the SECS seconds (a message is one round trip); `refused`: sockets answered other than
//! `101` (the first status is printed on stderr); `failed`: sockets that broke or ended
//! early (connect, read, write, a frame that is not one); `closed`: sockets the server
//! closed early with a close frame (its codes on stderr); `stalled`: open sockets that
//! had no echo in the last second; `unclean`: sockets whose close got no close back.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use ratewall_bench::frame::{self, Parse, Rng};
use ratewall_bench::histogram::Histogram;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[derive(Clone)]
struct Opts {
    addr: SocketAddr,
    in_flight: usize,
    secs: f64,
    size: usize,
    path: String,
}

/// What one socket saw.
#[derive(Default)]
struct Tally {
    messages: u64,
    latency: Histogram,
    upgraded: bool,
    refused: Option<String>,
    failed: Option<String>,
    closed: Option<u16>,
    stalled: bool,
    unclean: bool,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Error> {
    let usage = "usage: bench-ws-load ADDR CONNECTIONS IN_FLIGHT SECS [SIZE] [PATH]";
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !(4..=6).contains(&args.len()) {
        return Err(usage.into());
    }
    let conns: usize = args[1].parse()?;
    let opts = Opts {
        addr: args[0].parse()?,
        in_flight: args[2].parse::<usize>()?.max(1),
        secs: args[3].parse()?,
        size: args.get(4).map_or(Ok(32), |s| s.parse())?,
        path: args.get(5).cloned().unwrap_or_else(|| "/ws".into()),
    };

    // Every socket says when its handshake is done (or failed); the clock starts when all
    // have, so that the count is of open sockets only.
    let (ready_tx, mut ready_rx) = mpsc::unbounded_channel::<()>();
    let (go_tx, go_rx) = watch::channel::<Option<Instant>>(None);
    let tasks: Vec<_> = (0..conns)
        .map(|i| {
            let (opts, ready, go) = (opts.clone(), ready_tx.clone(), go_rx.clone());
            tokio::spawn(socket(i as u64, opts, ready, go))
        })
        .collect();
    drop(ready_tx);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    for _ in 0..conns {
        match tokio::time::timeout_at(deadline, ready_rx.recv()).await {
            Ok(Some(())) => {}
            _ => break,
        }
    }
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(opts.secs);
    go_tx.send(Some(end))?;

    let mut total = Tally::default();
    let (mut upgraded, mut refused, mut failed, mut closed, mut stalled, mut unclean) =
        (0, 0, 0, 0, 0, 0);
    let mut min_per_conn = u64::MAX;
    for task in tasks {
        let t = task.await?;
        total.messages += t.messages;
        total.latency.merge(&t.latency);
        upgraded += u32::from(t.upgraded);
        if t.upgraded {
            min_per_conn = min_per_conn.min(t.messages);
        }
        if let Some(status) = t.refused {
            if refused == 0 {
                eprintln!("refused: {status}");
            }
            refused += 1;
        }
        if let Some(why) = t.failed {
            if failed < 3 {
                eprintln!("failed: {why}");
            }
            failed += 1;
        }
        if let Some(code) = t.closed {
            if closed < 3 {
                eprintln!("closed by the server: {code}");
            }
            closed += 1;
        }
        stalled += u32::from(t.stalled);
        unclean += u32::from(t.unclean);
    }
    let secs = end.duration_since(start).as_secs_f64();
    println!(
        "messages {} seconds {secs:.3} msgs_per_s {:.0} p50_us {} p99_us {} upgraded {upgraded} \
         refused {refused} failed {failed} closed {closed} stalled {stalled} unclean {unclean} \
         min_per_conn {}",
        total.messages,
        total.messages as f64 / secs,
        total.latency.quantile(0.5),
        total.latency.quantile(0.99),
        if upgraded == 0 { 0 } else { min_per_conn },
    );
    Ok(())
}

/// One socket: handshake, report ready, wait for the start, run until the end, close.
async fn socket(
    n: u64,
    opts: Opts,
    ready: mpsc::UnboundedSender<()>,
    mut go: watch::Receiver<Option<Instant>>,
) -> Tally {
    let mut tally = Tally::default();
    let mut rng = Rng::new((u64::from(std::process::id()) << 32) | (n + 1));
    let mut buf = BytesMut::with_capacity(64 * 1024);
    let stream = tokio::time::timeout(Duration::from_secs(10), open(&opts, &mut rng, &mut buf));
    let mut stream = match stream.await {
        Ok(Ok(Ok(stream))) => stream,
        Ok(Ok(Err(status))) => {
            tally.refused = Some(status);
            let _ = ready.send(());
            return tally;
        }
        Ok(Err(e)) => {
            tally.failed = Some(format!("handshake: {e}"));
            let _ = ready.send(());
            return tally;
        }
        Err(_) => {
            tally.failed = Some("handshake: no answer in 10 s".into());
            let _ = ready.send(());
            return tally;
        }
    };
    tally.upgraded = true;
    let _ = ready.send(());
    let Ok(end) = go.wait_for(Option::is_some).await.map(|end| end.unwrap()) else {
        return tally;
    };

    let payload: Vec<u8> = (0..opts.size).map(|i| b'a' + (i % 26) as u8).collect();
    let mut out = Vec::with_capacity(opts.in_flight * (opts.size + 14));
    // When each batch of messages in flight was sent, oldest first (echoes come in order).
    let mut sent: VecDeque<(Instant, usize)> = VecDeque::new();
    let mut last_echo = Instant::now();
    for _ in 0..opts.in_flight {
        frame::write(&mut out, frame::TEXT, &payload, Some(rng.mask()));
    }
    sent.push_back((Instant::now(), opts.in_flight));
    if let Err(e) = stream.write_all(&out).await {
        tally.failed = Some(format!("write: {e}"));
        return tally;
    }
    let stop = tokio::time::sleep_until(tokio::time::Instant::from_std(end));
    tokio::pin!(stop);
    loop {
        let read = tokio::select! {
            read = stream.read_buf(&mut buf) => read,
            _ = &mut stop => break,
        };
        match read {
            Ok(0) => {
                tally.failed = Some("the server closed the connection".into());
                return tally;
            }
            Ok(_) => {}
            Err(e) => {
                tally.failed = Some(format!("read: {e}"));
                return tally;
            }
        }
        let now = Instant::now();
        let mut echoes = 0;
        out.clear();
        loop {
            let f = match frame::parse(&buf, 1 << 20) {
                Parse::Frame(f) => f,
                Parse::Incomplete => break,
                Parse::Invalid(why) => {
                    tally.failed = Some(format!("from the server: {why}"));
                    return tally;
                }
            };
            if f.mask.is_some() {
                tally.failed = Some("from the server: a masked frame".into());
                return tally;
            }
            match f.opcode {
                frame::CLOSE => {
                    tally.closed = Some(frame::close_code(f.payload(&buf)));
                    return tally;
                }
                frame::PING => {
                    let pong = f.payload(&buf).to_vec();
                    frame::write(&mut out, frame::PONG, &pong, Some(rng.mask()));
                }
                frame::PONG => {}
                _ if f.fin => echoes += 1,
                _ => {}
            }
            buf.advance(f.len);
        }
        if now >= end {
            break;
        }
        if echoes > 0 {
            last_echo = now;
            tally.messages += echoes as u64;
            let mut left = echoes;
            while left > 0 {
                let Some((at, n)) = sent.front_mut() else {
                    break;
                };
                let take = left.min(*n);
                let us = now.duration_since(*at).as_micros() as u64;
                tally.latency.record(us, take as u64);
                *n -= take;
                left -= take;
                if *n == 0 {
                    sent.pop_front();
                }
            }
            for _ in 0..echoes {
                frame::write(&mut out, frame::TEXT, &payload, Some(rng.mask()));
            }
            sent.push_back((now, echoes));
        }
        if !out.is_empty() {
            if let Err(e) = stream.write_all(&out).await {
                tally.failed = Some(format!("write: {e}"));
                return tally;
            }
        }
        if buf.capacity() - buf.len() < 4096 {
            buf.reserve(64 * 1024);
        }
    }
    tally.stalled = end.saturating_duration_since(last_echo) > Duration::from_secs(1);

    // The closing handshake (§7.1.2): a close, then whatever is still in flight, then the
    // server's close.
    out.clear();
    frame::write(
        &mut out,
        frame::CLOSE,
        &frame::close_payload(1000, ""),
        Some(rng.mask()),
    );
    let closed = async {
        stream.write_all(&out).await.ok()?;
        loop {
            loop {
                match frame::parse(&buf, 1 << 20) {
                    Parse::Frame(f) if f.opcode == frame::CLOSE => return Some(()),
                    Parse::Frame(f) => buf.advance(f.len),
                    Parse::Incomplete => break,
                    Parse::Invalid(_) => return None,
                }
            }
            if buf.capacity() - buf.len() < 4096 {
                buf.reserve(64 * 1024);
            }
            if stream.read_buf(&mut buf).await.ok()? == 0 {
                return None;
            }
        }
    };
    tally.unclean = !matches!(
        tokio::time::timeout(Duration::from_secs(2), closed).await,
        Ok(Some(()))
    );
    tally
}

/// Connects and upgrades: the stream, or the status line of an answer other than `101`
/// with the right `Sec-WebSocket-Accept`. Bytes after the head stay in `buf`.
async fn open(
    opts: &Opts,
    rng: &mut Rng,
    buf: &mut BytesMut,
) -> std::io::Result<Result<TcpStream, String>> {
    let mut stream = TcpStream::connect(opts.addr).await?;
    stream.set_nodelay(true)?;
    let key = frame::key(rng);
    let request = format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n",
        opts.path, opts.addr
    );
    stream.write_all(request.as_bytes()).await?;
    let end = loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break end + 4;
        }
        if buf.len() > 64 * 1024 || stream.read_buf(buf).await? == 0 {
            let got = String::from_utf8_lossy(&buf[..buf.len().min(80)]).into_owned();
            return Ok(Err(format!("no complete answer: {got:?}")));
        }
    };
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    buf.advance(end);
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap_or("").to_string();
    if !status.starts_with("HTTP/1.1 101") {
        return Ok(Err(status));
    }
    let want = frame::accept(&key);
    let accepted = lines.any(|line| {
        line.split_once(':').is_some_and(|(name, value)| {
            name.trim().eq_ignore_ascii_case("sec-websocket-accept") && value.trim() == want
        })
    });
    if !accepted {
        return Ok(Err(format!(
            "{status}, without the right Sec-WebSocket-Accept"
        )));
    }
    Ok(Ok(stream))
}
