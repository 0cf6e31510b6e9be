//! An upgraded connection's life after its `101` (or, over HTTP/2, its extended CONNECT's
//! `200`): the bytes copied both ways between the client and the backend until either
//! side is done, and, for a WebSocket, its frames read on the way (never changed, never
//! buffered whole: `crate::websocket`'s scanner), so that
//!
//! - the data frames a client sends, and their payload bytes, count against the limits of
//!   the rules that admitted the socket (`messages = { rate, burst }`, `bytes = { rate,
//!   burst }`, [`Meter`]): past one, the client is not read from (back-pressure) for up to
//!   the rule's `max_delay`, and then the socket is closed with 1008 and a reason, to both
//!   ends;
//! - a message larger than `messages.max_bytes` closes the socket with 1009 before the
//!   frame that makes it so goes on;
//! - data frames after a side's close frame are dropped (RFC 6455 §5.5.1), not passed;
//! - a shutdown whose grace ran out, a stream that breaks RFC 6455, or a store that failed
//!   under `on_error = "deny"` close the socket with a close frame to both ends (1001,
//!   1002, 1011) where each side's stream is between frames.
//!
//! The tunnel ends when either side closes: the other then has a second to say its last
//! (the answering close frame of a WebSocket's closing handshake, a half-closed protocol's
//! final bytes), as nginx ends a tunnel on either side's end.
//!
//! `upgrade_idle_timeout`: no byte either way for that long ends the tunnel. The
//! request's concurrency slots ([`Leases`]: `max_in_flight` bounds the open sockets of
//! a key) and the connection's [`Hold`] are kept until the tunnel ends.
//!
//! The copy loop is one task polling both directions: each direction reads into its own
//! buffer only once the last read went out, so a side that does not take what it is sent
//! stops the other from being read (back-pressure both ways, bounded memory).

pub mod metrics;
#[cfg(test)]
mod tests;

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::time::{Instant, Sleep};

use crate::connection::Hold;
use crate::limiter::lease::Leases;
use crate::telemetry::Gauged;
use crate::websocket::frame::{
    GOING_AWAY, INTERNAL_ERROR, MESSAGE_TOO_BIG, POLICY_VIOLATION, PROTOCOL_ERROR,
};
use crate::websocket::{self, Budget, Meter, Refill, Scanner, Side, Stop, Unit};
use metrics::{BytesLabels, Direction, EndedLabels, TunnelLabels, TunnelMetrics};

/// How much each direction reads at a time.
const BUFFER: usize = 16 * 1024;
/// Once a tunnel is to close, how long its last words (the bytes already read, a close
/// frame) and the peers' own close may take.
const CLOSING: Duration = Duration::from_secs(1);

crate::telemetry::label_enum! {
    /// How a tunnel ended (`reason=`).
    pub enum Ended {
        ClientClosed,
        UpstreamClosed,
        IdleTimeout,
        Shutdown,
        MessageLimit,
        ByteLimit,
        MessageTooBig,
        ProtocolError,
        StoreError,
        Failed,
    }
}

impl Ended {
    /// The close frame a WebSocket gets for it, where the gateway ends it.
    fn close(self) -> Option<(u16, &'static str)> {
        match self {
            Ended::Shutdown => Some((GOING_AWAY, "the gateway is shutting down")),
            Ended::MessageLimit => Some((POLICY_VIOLATION, "message rate limit exceeded")),
            Ended::ByteLimit => Some((POLICY_VIOLATION, "byte rate limit exceeded")),
            Ended::MessageTooBig => Some((MESSAGE_TOO_BIG, "message too big")),
            Ended::ProtocolError => Some((PROTOCOL_ERROR, "WebSocket protocol error")),
            Ended::StoreError => Some((INTERNAL_ERROR, "the rate-limit store is unavailable")),
            Ended::IdleTimeout => Some((GOING_AWAY, "idle for upgrade_idle_timeout")),
            _ => None,
        }
    }
}

/// One tunnel, ready to run once the client's side of the upgrade is there.
pub struct Tunnel {
    /// Whether both ends speak WebSocket (asked and switched to): its frames are read.
    pub websocket: bool,
    /// The message and byte limits of the rules that admitted it (WebSocket only).
    pub meters: Vec<Meter>,
    /// How long a client past a message or byte limit is held back before it is closed.
    pub max_delay: Duration,
    /// The largest message the client may send, in payload bytes (the smallest
    /// `messages.max_bytes` of the rules that admitted it; WebSocket only).
    pub max_message: Option<u64>,
    /// `upgrade_idle_timeout`.
    pub idle: Duration,
    pub hold: Hold,
    pub leases: Option<Leases>,
    pub labels: TunnelLabels,
}

/// The message and byte meters of the rules that admitted a WebSocket (`limited`: each
/// rule with who the request is under it): each rule's message meter, then its byte
/// meter, in the rules' order.
pub fn meters<'r>(
    limiter: &std::sync::Arc<crate::limiter::breaker::Limiter>,
    limited: impl Iterator<Item = (&'r crate::rules::Rule, crate::identity::IdentityDigest)>,
    on_error: crate::limiter::OnError,
) -> Vec<Meter> {
    let mut meters = Vec::new();
    for (rule, digest) in limited {
        if let Some(m) = &rule.messages {
            let meter = Meter::messages(limiter.clone(), digest, &rule.name, m, on_error);
            meters.push(meter);
        }
        if let Some(b) = &rule.bytes {
            meters.push(Meter::bytes(
                limiter.clone(),
                digest,
                &rule.name,
                b,
                on_error,
            ));
        }
    }
    meters
}

/// What a tunnel counts into, resolved once.
struct Counts {
    up: Counter,
    down: Counter,
}

impl Tunnel {
    /// Copy between `client` and `upstream` until the tunnel ends; how it ended.
    pub async fn run<C, U>(self, client: C, upstream: U, metrics: &TunnelMetrics) -> Ended
    where
        C: AsyncRead + AsyncWrite + Unpin,
        U: AsyncRead + AsyncWrite + Unpin,
    {
        let open = metrics.open.get_or_create(&self.labels).clone();
        let _open = Gauged::new(&open);
        // One at a time: a family's guard held while another series is created would
        // deadlock on its lock.
        let bytes = |direction| {
            let labels = BytesLabels {
                route: self.labels.route.clone(),
                pool: self.labels.pool.clone(),
                direction,
            };
            metrics.bytes.get_or_create(&labels).clone()
        };
        let up = bytes(Direction::Upstream);
        let down = bytes(Direction::Downstream);
        let counts = Counts { up, down };
        let Tunnel {
            websocket,
            meters,
            max_delay,
            max_message,
            idle,
            hold,
            leases,
            labels: _,
        } = self;
        let sent = websocket
            .then(|| Scanner::new(Side::Client).with_max_message(max_message.unwrap_or(u64::MAX)));
        let mut copy = Copy {
            up: Pipe::new(sent),
            down: Pipe::new(websocket.then(|| Scanner::new(Side::Server))),
            client,
            upstream,
            meters: Some(meters),
            refill: None,
            wait: None,
            need: 0,
            blocked_since: None,
            max_delay,
            idle,
            last: Instant::now(),
            idle_timer: Box::pin(tokio::time::sleep(idle)),
            counts,
            first: None,
            ending: None,
        };
        let ended = {
            let closing = hold.closing();
            tokio::pin!(closing);
            std::future::poll_fn(|cx| {
                if closing.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Ended::Shutdown);
                }
                copy.poll(cx)
            })
            .await
        };
        if let Some(close) = ended.close().filter(|_| websocket) {
            let _ = tokio::time::timeout(CLOSING, copy.close(close)).await;
        } else if ended != Ended::Failed {
            let _ = tokio::time::timeout(CLOSING, copy.shut()).await;
        }
        metrics
            .ended
            .get_or_create(&EndedLabels { reason: ended })
            .inc();
        // The slots are given back as the socket closes, and the connection let go.
        drop(leases);
        drop(hold);
        ended
    }
}

/// One direction's bytes: `buf[start..passed]` read and let through, still to be written;
/// `buf[passed..filled]` read and held back (a data frame past a limit, or the start of a
/// data frame's header whose rest is still to be read).
struct Pipe {
    buf: Box<[u8]>,
    start: usize,
    passed: usize,
    filled: usize,
    /// The source ended (and, once all is written, the destination was told).
    eof: bool,
    shut: bool,
    /// Written since the last flush (TLS holds writes until flushed).
    unflushed: bool,
    /// Held back for want of tokens: the next data frame's payload length.
    held: Option<u64>,
    /// Its source had nothing more to read at the last try: all it sent has been taken.
    drained: bool,
    scanner: Option<Scanner>,
}

impl Pipe {
    fn new(scanner: Option<Scanner>) -> Pipe {
        Pipe {
            buf: vec![0; BUFFER].into_boxed_slice(),
            start: 0,
            passed: 0,
            filled: 0,
            eof: false,
            shut: false,
            unflushed: false,
            held: None,
            drained: false,
            scanner,
        }
    }

    /// Whether a close frame may go after what went out: everything read has, the stream
    /// stands between frames, and its sender has not begun to close it already (a second
    /// close frame would break the closing handshake, RFC 6455 §5.5.1).
    fn may_close(&self) -> bool {
        self.start == self.filled
            && !self.shut
            && self
                .scanner
                .as_ref()
                .is_none_or(|s| s.at_boundary() && !s.closed())
    }

    /// Let through what the scanner allows of the held bytes within `budget`, and drop
    /// what it drops.
    fn scan(&mut self, budget: Budget) -> Result<Scanned, Ended> {
        let held = &self.buf[self.passed..self.filled];
        let Some(scanner) = self.scanner.as_mut() else {
            self.passed = self.filled;
            return Ok(Scanned {
                moved: !held.is_empty(),
                ..Scanned::default()
            });
        };
        let scan = scanner.scan(held, budget).map_err(|v| {
            tracing::debug!(violation = %v, "WebSocket frames break RFC 6455: closed");
            Ended::ProtocolError
        })?;
        self.passed += scan.passed;
        self.held = None;
        let mut scanned = Scanned {
            frames: scan.frames,
            bytes: scan.bytes,
            moved: scan.passed > 0,
            partial: false,
        };
        match scan.stop {
            None => {}
            Some(Stop::Tokens { bytes }) => self.held = Some(bytes),
            Some(Stop::Header) => scanned.partial = true,
            Some(Stop::Discard(n)) => {
                // Data after a close: the bytes behind it move up over it.
                self.buf
                    .copy_within(self.passed + n..self.filled, self.passed);
                self.filled -= n;
                scanned.moved = true;
            }
            Some(Stop::TooBig { size }) => {
                tracing::debug!(size, "WebSocket message over max_bytes: closed");
                return Err(Ended::MessageTooBig);
            }
        }
        Ok(scanned)
    }
}

/// What one [`Pipe::scan`] did.
#[derive(Default)]
struct Scanned {
    /// Data frames and payload bytes let through (tokens spent).
    frames: u64,
    bytes: u64,
    /// Bytes were let through or dropped.
    moved: bool,
    /// It stopped at a data frame's header not all read: more is to be read behind it.
    partial: bool,
}

/// What one [`pump`] moved.
#[derive(Default)]
struct Pumped {
    written: usize,
    frames: u64,
    bytes: u64,
}

/// A refill under way: it holds the meters until it is done, and says what the last meter
/// it asked got (and what that meter counts).
type Refilling = Pin<Box<dyn Future<Output = (Vec<Meter>, Refill, Unit)> + Send>>;

/// The copy loop's state (see [`Tunnel::run`]).
struct Copy<C, U> {
    /// Client to upstream: metered.
    up: Pipe,
    /// Upstream to client.
    down: Pipe,
    client: C,
    upstream: U,
    /// The meters, while no refill holds them.
    meters: Option<Vec<Meter>>,
    refill: Option<Refilling>,
    /// The store's wait before the next refill.
    wait: Option<Pin<Box<Sleep>>>,
    /// The payload length of the data frame held back for want of tokens.
    need: u64,
    /// Since when the client has been behind a limit: from the first frame held back until
    /// all it sent has gone through.
    blocked_since: Option<Instant>,
    max_delay: Duration,
    idle: Duration,
    /// The last byte either way.
    last: Instant,
    /// Armed for `last + idle` or earlier: moved on only when it fires, not per byte.
    idle_timer: Pin<Box<Sleep>>,
    counts: Counts,
    /// The side whose stream ended first.
    first: Option<Ended>,
    /// Armed once one side ended: the other's last words may take until then.
    ending: Option<Pin<Box<Sleep>>>,
}

impl<C, U> Copy<C, U>
where
    C: AsyncRead + AsyncWrite + Unpin,
    U: AsyncRead + AsyncWrite + Unpin,
{
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Ended> {
        let mut any = false;
        loop {
            let mut moved = false;
            match self.poll_meters(cx) {
                Poll::Ready(Err(ended)) => return Poll::Ready(ended),
                Poll::Ready(Ok(())) => moved = true,
                Poll::Pending => {}
            }
            // What a pump moved is counted even where it ends the tunnel: the bytes it
            // wrote before the frame that ends it did reach the other side.
            let (budget, mut p) = (self.budget(), Pumped::default());
            let up = pump(
                &mut self.up,
                &mut self.client,
                &mut self.upstream,
                budget,
                cx,
                &mut p,
            );
            if p.written > 0 || p.frames > 0 {
                moved = true;
                self.counts.up.inc_by(p.written as u64);
            }
            self.spend(&p);
            if let Err(ended) = up {
                return Poll::Ready(ended);
            }
            let mut p = Pumped::default();
            let down = pump(
                &mut self.down,
                &mut self.upstream,
                &mut self.client,
                Budget::UNLIMITED,
                cx,
                &mut p,
            );
            if p.written > 0 {
                moved = true;
                self.counts.down.inc_by(p.written as u64);
            }
            if let Err(ended) = down {
                return Poll::Ready(ended);
            }
            if self.up.drained {
                // The client has caught up: all it sent went through.
                self.blocked_since = None;
            }
            if self.first.is_none() {
                self.first = match (self.up.eof, self.down.eof) {
                    (true, _) => Some(Ended::ClientClosed),
                    (_, true) => Some(Ended::UpstreamClosed),
                    _ => None,
                };
                if self.first.is_some() {
                    // One side closed: the other gets `CLOSING` to say its last (a
                    // WebSocket's answering close frame), then the tunnel ends.
                    self.ending = Some(Box::pin(tokio::time::sleep(CLOSING)));
                }
            }
            if let Some(first) = self.first {
                let late = self
                    .ending
                    .as_mut()
                    .is_some_and(|t| t.as_mut().poll(cx).is_ready());
                if (self.up.shut && self.down.shut) || late {
                    return Poll::Ready(first);
                }
            }
            if let Some(need) = self
                .up
                .held
                .filter(|_| self.refill.is_none() && self.wait.is_none())
            {
                self.blocked_since.get_or_insert_with(Instant::now);
                self.need = need;
                self.start_refill();
                continue;
            }
            if moved {
                any = true;
                continue;
            }
            break;
        }
        if any {
            // Once a wake-up, not once a read: the idle clock needs no finer.
            self.last = Instant::now();
        }
        while self.idle_timer.as_mut().poll(cx).is_ready() {
            let deadline = self.last + self.idle;
            if Instant::now() >= deadline {
                return Poll::Ready(Ended::IdleTimeout);
            }
            // Bytes moved since it was armed: due again a full period after the last.
            self.idle_timer.as_mut().reset(deadline);
        }
        Poll::Pending
    }

    /// The data frames (and their payload bytes) the client may start now without asking
    /// the store: the fewest any meter of each unit holds.
    fn budget(&self) -> Budget {
        let Some(meters) = &self.meters else {
            // A refill holds them: nothing more until it is back.
            return Budget {
                frames: 0,
                bytes: 0,
            };
        };
        let mut budget = Budget::UNLIMITED;
        for m in meters {
            let of = match m.unit() {
                Unit::Frames => &mut budget.frames,
                Unit::Bytes => &mut budget.bytes,
            };
            *of = (*of).min(m.tokens());
        }
        budget
    }

    fn spend(&mut self, p: &Pumped) {
        if p.frames == 0 {
            return;
        }
        if let Some(meters) = self.meters.as_mut() {
            for m in meters {
                m.spend(match m.unit() {
                    Unit::Frames => p.frames,
                    Unit::Bytes => p.bytes,
                });
            }
        }
    }

    /// Ask the store for what each meter lacks toward the frame held back: a message
    /// meter its frame, a byte meter its payload (or a burst of it, for a payload larger).
    fn start_refill(&mut self) {
        let Some(mut meters) = self.meters.take() else {
            return;
        };
        let need = self.need;
        self.refill = Some(Box::pin(async move {
            let mut how = (Refill::Granted, Unit::Frames);
            for m in meters.iter_mut() {
                let want = match m.unit() {
                    Unit::Frames => 1,
                    Unit::Bytes => need,
                };
                if m.tokens() >= want {
                    continue;
                }
                how = (m.refill(want).await, m.unit());
                if !matches!(how.0, Refill::Granted) {
                    break;
                }
            }
            (meters, how.0, how.1)
        }));
    }

    /// A refill or the wait before one: `Ok` when the client may be read again (or a
    /// refill is to start), `Err` when the tunnel ends.
    fn poll_meters(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Ended>> {
        if let Some(wait) = self.wait.as_mut() {
            if wait.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.wait = None;
            self.start_refill();
        }
        let Some(refill) = self.refill.as_mut() else {
            return Poll::Pending;
        };
        let Poll::Ready((meters, how, unit)) = refill.as_mut().poll(cx) else {
            return Poll::Pending;
        };
        self.refill = None;
        self.meters = Some(meters);
        match how {
            Refill::Granted => {
                // Still held back until it has caught up (`drained`): a client that keeps
                // sending faster than its limit is closed once it has been behind for
                // `max_delay`, however many batches trickle through meanwhile. (A grant
                // always brings tokens: the frame passes, or, short still, the next
                // refill asks for the rest.)
                self.up.held = None;
                Poll::Ready(Ok(()))
            }
            Refill::Wait(d) => {
                let since = *self.blocked_since.get_or_insert_with(Instant::now);
                if since.elapsed() + d > self.max_delay {
                    tracing::debug!(waited = ?since.elapsed(), limit = unit.suffix(), "WebSocket client past its limit: closed");
                    return Poll::Ready(Err(match unit {
                        Unit::Frames => Ended::MessageLimit,
                        Unit::Bytes => Ended::ByteLimit,
                    }));
                }
                let mut wait = Box::pin(tokio::time::sleep(d));
                // Registered now, so that its end wakes the task.
                if wait.as_mut().poll(cx).is_ready() {
                    self.start_refill();
                    return Poll::Ready(Ok(()));
                }
                self.wait = Some(wait);
                Poll::Pending
            }
            Refill::Unavailable => Poll::Ready(Err(Ended::StoreError)),
        }
    }

    /// The last words of a WebSocket the gateway ends: what was let through goes out, then
    /// a close frame to each end whose stream stands between frames (the client's to the
    /// backend masked, as a client's must be), then each side is shut and its close read.
    async fn close(&mut self, (code, reason): (u16, &str)) {
        let (mut up_ok, mut down_ok) = (true, true);
        // What was held back (a frame past a limit, bytes that break RFC 6455) never goes;
        // what was let through but not yet written goes first, and is counted.
        self.up.filled = self.up.passed;
        self.down.filled = self.down.passed;
        if self.up.start < self.up.passed {
            let (s, p) = (self.up.start, self.up.passed);
            up_ok = self.upstream.write_all(&self.up.buf[s..p]).await.is_ok();
            if up_ok {
                self.counts.up.inc_by((p - s) as u64);
            }
            self.up.start = p;
        }
        if self.down.start < self.down.passed {
            let (s, p) = (self.down.start, self.down.passed);
            down_ok = self.client.write_all(&self.down.buf[s..p]).await.is_ok();
            if down_ok {
                self.counts.down.inc_by((p - s) as u64);
            }
            self.down.start = p;
        }
        if up_ok && self.up.may_close() {
            let frame = websocket::close_frame(code, reason, Some(mask()));
            let _ = self.upstream.write_all(&frame).await;
        }
        if down_ok && self.down.may_close() {
            let frame = websocket::close_frame(code, reason, None);
            let _ = self.client.write_all(&frame).await;
        }
        self.shut().await;
    }

    /// Shut both sides' writes and read what they still send until each ends (a lingering
    /// close: a peer still sending when the socket is dropped would get a reset, which can
    /// cost it the last bytes it was sent).
    async fn shut(&mut self) {
        let _ = self.upstream.flush().await;
        let _ = self.client.flush().await;
        let _ = self.upstream.shutdown().await;
        let _ = self.client.shutdown().await;
        let (mut from_client, mut from_upstream) = ([0u8; 2048], [0u8; 2048]);
        let (mut a, mut b) = (self.up.eof, self.down.eof);
        while !(a && b) {
            tokio::select! {
                r = self.client.read(&mut from_client), if !a => a = !matches!(r, Ok(n) if n > 0),
                r = self.upstream.read(&mut from_upstream), if !b => b = !matches!(r, Ok(n) if n > 0),
            }
        }
    }
}

/// Move one direction on: write what waits, let through what the scanner allows within
/// `budget` (dropping what it drops), read more once all is out. Adds to `p` what was
/// written and the data frames and payload bytes that started; `Err`: how the tunnel ends.
fn pump<R, W>(
    pipe: &mut Pipe,
    src: &mut R,
    dst: &mut W,
    budget: Budget,
    cx: &mut Context<'_>,
    p: &mut Pumped,
) -> Result<(), Ended>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    loop {
        while pipe.start < pipe.passed {
            match Pin::new(&mut *dst).poll_write(cx, &pipe.buf[pipe.start..pipe.passed]) {
                Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => return Err(Ended::Failed),
                Poll::Ready(Ok(n)) => {
                    pipe.start += n;
                    p.written += n;
                    pipe.unflushed = true;
                }
                Poll::Pending => return Ok(()),
            }
        }
        if pipe.unflushed {
            match Pin::new(&mut *dst).poll_flush(cx) {
                Poll::Ready(Ok(())) => pipe.unflushed = false,
                Poll::Ready(Err(_)) => return Err(Ended::Failed),
                Poll::Pending => return Ok(()),
            }
        }
        if pipe.passed < pipe.filled {
            let left = Budget {
                frames: budget.frames.saturating_sub(p.frames),
                bytes: budget.bytes.saturating_sub(p.bytes),
            };
            let scanned = pipe.scan(left)?;
            p.frames += scanned.frames;
            p.bytes += scanned.bytes;
            if scanned.moved {
                continue;
            }
            if !scanned.partial {
                // Held back: the next data frame needs tokens.
                return Ok(());
            }
            // The start of a data frame's header: read the rest behind it.
        }
        if pipe.eof {
            if !pipe.shut {
                match Pin::new(&mut *dst).poll_shutdown(cx) {
                    Poll::Ready(_) => pipe.shut = true,
                    Poll::Pending => return Ok(()),
                }
            }
            return Ok(());
        }
        // Everything read went out (but for the start of a header, kept at the front, at
        // most 13 bytes): read more.
        pipe.drained = false;
        let kept = pipe.filled - pipe.passed;
        pipe.buf.copy_within(pipe.passed..pipe.filled, 0);
        pipe.start = 0;
        pipe.passed = 0;
        pipe.filled = kept;
        let mut rb = ReadBuf::new(&mut pipe.buf[kept..]);
        match Pin::new(&mut *src).poll_read(cx, &mut rb) {
            Poll::Ready(Ok(())) => {
                let n = rb.filled().len();
                if n == 0 {
                    pipe.eof = true;
                } else {
                    pipe.filled = kept + n;
                }
            }
            Poll::Ready(Err(_)) => return Err(Ended::Failed),
            Poll::Pending => {
                pipe.drained = true;
                return Ok(());
            }
        }
    }
}

/// A masking key for a frame the gateway sends the backend (RFC 6455 §5.3: a client's
/// frames are masked; the key need only be unpredictable to the page, not secret).
fn mask() -> [u8; 4] {
    let b = crate::random::bits().to_le_bytes();
    [b[0], b[1], b[2], b[3]]
}
