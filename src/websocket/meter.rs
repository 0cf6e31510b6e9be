//! The buckets of one identity under one rule that its WebSocket sockets share through
//! the limiter's store, charged in batches: never one store call per frame.
//!
//! - `messages = { rate, burst }`: data frames ([`Unit::Frames`]);
//! - `bytes = { rate, burst }`: the data frames' payload bytes as sent ([`Unit::Bytes`]):
//!   a permessage-deflate payload counts compressed, as it crosses the wire.
//!
//! Each is an ordinary token bucket of its rate and burst, kept under the identity's key
//! for the rule `"<rule>:messages"` or `"<rule>:bytes"` (names no rule can have: a rule's
//! name has no `:`), so it sits beside the rule's own request limit, in memory or in
//! Redis, shared by gateways like any limit.
//!
//! # Batches
//!
//! A socket's [`Meter`] takes tokens from the bucket a batch at a time (one store call,
//! the batch as the check's cost) and hands them out to frames locally. The batch is a
//! tenth of a second of the rate, at least 1 and at most the burst ([`batch`]): a socket
//! sending at the full rate asks the store about ten times a second, however many frames
//! it sends; at 50/s a batch is 5 frames, at `"1MiB/s"` 104,857 bytes.
//!
//! A frame's payload is paid whole before the frame passes: a byte meter short of it
//! asks for what it lacks at once, in whole batches, at most a burst a call (a frame
//! larger than the burst is paid over several calls, each waiting for the bucket to
//! refill).
//!
//! What batching costs, and why it is small:
//! - A batch is taken whole or not at all: a bucket holding fewer tokens than a batch
//!   makes the socket wait for the rest to drip in, at most a tenth of a second.
//! - Tokens a socket took and did not use are not given back: a socket that closes
//!   holding them overcharges its identity by at most one batch (under a tenth of a
//!   second of the rate), refilled like any token. While several sockets of one identity
//!   are open, each may hold up to a batch the others cannot use.

use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::Duration;

use crate::identity::IdentityDigest;
use crate::limiter::breaker::{Limiter, Now, StoreAnswer};
use crate::limiter::{Algorithm, Check, OnError, Quota, QuotaError, Rate};
use crate::rules::{Bytes, Messages};

/// What [`Meter::refill`] got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refill {
    /// Tokens were taken: [`Meter::tokens`] grew.
    Granted,
    /// The bucket cannot pay for what was asked yet: ask again after this long (the
    /// store's retry time).
    Wait(Duration),
    /// The store failed and `on_error` denies: the socket gets no more frames through.
    Unavailable,
}

/// What a meter counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Data frames (text, binary, continuation): `messages`.
    Frames,
    /// Data frames' payload bytes, as framed: `bytes`.
    Bytes,
}

impl Unit {
    /// The part of the bucket's rule name after the rule's own: `"<rule>:<suffix>"`.
    pub fn suffix(self) -> &'static str {
        match self {
            Unit::Frames => "messages",
            Unit::Bytes => "bytes",
        }
    }
}

/// The shortest wait [`Refill::Wait`] gives, so that a caller never spins on the store.
const MIN_WAIT: Duration = Duration::from_millis(1);

/// Tokens one store call takes for a socket of a bucket of `rate` and `burst`: a tenth of
/// a second of the rate (rounded down, at least 1), at most the burst.
pub fn batch(rate: Rate, burst: u64) -> u64 {
    let secs = rate.period.as_secs().max(1);
    let tenth = rate.count / secs.saturating_mul(10);
    tenth.max(1).min(burst.max(1))
}

/// The bucket of `rate` and `burst` as the store keeps it, charged [`batch`] tokens a
/// call. The config validates `messages` and `bytes` with it, so it cannot fail for a
/// rule that loaded.
pub fn quota(rate: Rate, burst: u64) -> Result<Quota, QuotaError> {
    Quota::new(
        Algorithm::TokenBucket,
        rate,
        NonZeroU64::new(burst),
        NonZeroU64::new(batch(rate, burst)).unwrap_or(NonZeroU64::MIN),
    )
}

/// One socket's share of one of its identity's buckets.
pub struct Meter {
    limiter: Arc<Limiter>,
    identity: IdentityDigest,
    unit: Unit,
    /// `"<rule>:messages"` or `"<rule>:bytes"`: the rule part of the bucket's store key.
    rule: String,
    /// The bucket, with the batch as its cost; `None` only for a limit the config
    /// refuses (then every refill is a store failure).
    quota: Option<Quota>,
    on_error: OnError,
    /// Tokens taken from the bucket and not yet spent.
    tokens: u64,
}

impl Meter {
    /// The data frames of a socket the rule `rule` admitted (`messages`).
    pub fn messages(
        limiter: Arc<Limiter>,
        identity: IdentityDigest,
        rule: &str,
        messages: &Messages,
        on_error: OnError,
    ) -> Meter {
        let bucket = (messages.rate, messages.burst);
        Meter::new(limiter, identity, rule, Unit::Frames, bucket, on_error)
    }

    /// The payload bytes of a socket the rule `rule` admitted (`bytes`).
    pub fn bytes(
        limiter: Arc<Limiter>,
        identity: IdentityDigest,
        rule: &str,
        bytes: &Bytes,
        on_error: OnError,
    ) -> Meter {
        let bucket = (bytes.rate, bytes.burst);
        Meter::new(limiter, identity, rule, Unit::Bytes, bucket, on_error)
    }

    /// The store key is the identity's under `"<rule>:<unit>"`, a token bucket of `rate`
    /// and `burst`.
    fn new(
        limiter: Arc<Limiter>,
        identity: IdentityDigest,
        rule: &str,
        unit: Unit,
        (rate, burst): (Rate, u64),
        on_error: OnError,
    ) -> Meter {
        let what = unit.suffix();
        let quota = quota(rate, burst)
            .inspect_err(|e| {
                tracing::error!(rule, limit = what, error = %e, "WebSocket limit refused; its sockets are treated as if the store failed");
            })
            .ok();
        Meter {
            limiter,
            identity,
            unit,
            rule: format!("{rule}:{what}"),
            quota,
            on_error,
            tokens: 0,
        }
    }

    pub fn unit(&self) -> Unit {
        self.unit
    }

    /// Frames (or bytes) this socket may pass now without asking the store.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Tokens one refill takes from the bucket, at least.
    pub fn batch(&self) -> u64 {
        self.quota.map_or(1, |q| q.cost)
    }

    /// `n` frames (or bytes) passed (at most [`Meter::tokens`]).
    pub fn spend(&mut self, n: u64) {
        debug_assert!(n <= self.tokens, "spent {n} of {} tokens", self.tokens);
        self.tokens = self.tokens.saturating_sub(n);
    }

    /// What a refill for `need` tokens asks the bucket for: what [`Meter::tokens`] lacks
    /// of it, in whole batches (at least one), at most the burst.
    fn ask_for(&self, need: u64) -> u64 {
        let batch = self.batch();
        let lacking = need.saturating_sub(self.tokens).max(1);
        let batches = lacking.div_ceil(batch).saturating_mul(batch);
        batches.min(self.quota.map_or(batch, |q| q.burst.max(batch)))
    }

    /// Ask the store for tokens toward `need` (a frame's 1, a payload's length): one
    /// store call (or none, where the deny cache or an open breaker answers) for
    /// [`Meter::ask_for`]. [`Refill::Granted`]: [`Meter::tokens`] grew by that much (a
    /// need over the burst takes several). [`Refill::Wait`]: the store's retry time for
    /// it. A store failure follows `on_error`: `deny` gives [`Refill::Unavailable`],
    /// `allow` the tokens without a store, all `need` lacks at least (so frames pass, and
    /// the store is asked again a batch later). With `local` the limiter has already answered from its in-process
    /// fallback; if even that fails (it is full), the socket is denied, as requests are.
    pub async fn refill(&mut self, need: u64) -> Refill {
        let take = self.ask_for(need);
        let Some(quota) = self.quota else {
            return self.failed(take, need);
        };
        let quota = Quota {
            cost: take,
            ..quota
        };
        let answer = {
            let checks = [Check::new(&self.identity, &self.rule, &quota)];
            // One identity under one rule: no charge of another check can be refunded,
            // so the deny cache may answer (and remember) denials. (Its entries are kept
            // per cost: a denial of a large take never answers a smaller one.)
            let answer = match self.limiter.decide_now(&checks, true) {
                Now::Answered(a) => a,
                Now::Ask(asking) => self.limiter.ask(&checks, true, asking).await,
            };
            answer
        };
        let decision = match answer {
            StoreAnswer::Store(d) | StoreAnswer::Local(d) => d.into_iter().next(),
            StoreAnswer::Cached(d) => d.into_iter().next().flatten(),
            StoreAnswer::Failed(_) => None,
        };
        match decision {
            Some(d) if d.allowed => {
                self.tokens += take;
                Refill::Granted
            }
            Some(d) => Refill::Wait(Duration::from_micros(d.retry_after_us).max(MIN_WAIT)),
            None => self.failed(take, need),
        }
    }

    /// The store failed: `allow` gives what was asked for, and at least all `need` lacks
    /// (unlimited while the store is down, and a payload larger than the burst is not
    /// paid for a burst at a time with no store to wait on).
    fn failed(&mut self, take: u64, need: u64) -> Refill {
        match self.on_error {
            OnError::Allow => {
                self.tokens += take.max(need.saturating_sub(self.tokens));
                Refill::Granted
            }
            OnError::Deny | OnError::Local => Refill::Unavailable,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::memory::MemoryStore;
    use crate::limiter::metrics::LimiterMetrics;
    use crate::limiter::store::{self, Call, Kind, Store};
    use crate::limiter::{Decision, ManualClock, Rate, StoreError};
    use crate::telemetry::stats::Stats;

    fn messages(rate: &str, burst: u64) -> Messages {
        Messages {
            rate: Rate::parse(rate).unwrap(),
            burst,
            max_bytes: None,
        }
    }

    fn rate(r: &str) -> Rate {
        Rate::parse(r).unwrap()
    }

    /// A message meter of `messages` for `identity` under the rule `rule`.
    fn meter(limiter: &Arc<Limiter>, identity: u8, rule: &str, m: Messages) -> Meter {
        Meter::messages(limiter.clone(), id(identity), rule, &m, OnError::Deny)
    }

    fn limiter_on(store: Box<dyn Store>) -> Arc<Limiter> {
        let metrics =
            LimiterMetrics::register(&mut prometheus_client::registry::Registry::default());
        Limiter::new(
            store,
            &store::Settings::default(),
            metrics,
            Arc::new(Stats::new()),
        )
    }

    /// A limiter on the memory store, its clock moved by hand.
    fn memory() -> (Arc<Limiter>, Arc<ManualClock>) {
        let clock = ManualClock::new(1_000_000_000);
        (limiter_on(Box::new(MemoryStore::new(clock.clone()))), clock)
    }

    fn id(n: u8) -> IdentityDigest {
        IdentityDigest([n; 16])
    }

    /// Frames `meter` passes before the bucket makes it wait, and how many store calls
    /// it took; the wait it got.
    async fn drain(meter: &mut Meter) -> (u64, u64, Refill) {
        let (mut frames, mut calls) = (0, 0);
        loop {
            calls += 1;
            match meter.refill(1).await {
                Refill::Granted => {
                    frames += meter.tokens();
                    meter.spend(meter.tokens());
                }
                other => return (frames, calls, other),
            }
        }
    }

    #[test]
    fn a_batch_is_a_tenth_of_a_second_of_the_rate_within_the_burst() {
        assert_eq!(batch(rate("50/s"), 100), 5);
        assert_eq!(batch(rate("1/s"), 1), 1);
        assert_eq!(batch(rate("9/s"), 100), 1, "rounded down, at least 1");
        assert_eq!(batch(rate("10000/s"), 20), 20, "never above the burst");
        assert_eq!(batch(rate("600/m"), 50), 1);
        assert_eq!(batch(rate("6000/m"), 50), 10);
        assert_eq!(batch(rate("1000/10s"), 100), 10);
        assert_eq!(batch(rate("5/h"), 5), 1);
        assert_eq!(
            batch(rate("50/s"), 0),
            1,
            "a zero burst still takes a frame"
        );
        assert_eq!(quota(rate("50/s"), 100).unwrap().cost, 5);
        // Bytes: "1MiB/s", burst "4MiB".
        assert_eq!(batch(rate("1048576/s"), 4 << 20), 104_857);
    }

    #[tokio::test]
    async fn frames_are_charged_a_batch_per_store_call() {
        let (limiter, _clock) = memory();
        let mut m = meter(&limiter, 1, "chat", messages("50/s", 100));
        assert_eq!((m.tokens(), m.batch(), m.unit()), (0, 5, Unit::Frames));
        assert_eq!(m.refill(1).await, Refill::Granted);
        assert_eq!(m.tokens(), 5);
        m.spend(3);
        assert_eq!(m.tokens(), 2);
        // The store saw one charge of 5, under "<rule>:messages".
        let q = quota(rate("50/s"), 100).unwrap();
        let peek = limiter
            .peek(&[Check::new(&id(1), "chat:messages", &q)])
            .await
            .unwrap();
        assert_eq!(peek[0].remaining, 95);
        // The rule's own bucket (the rule's name) is another key.
        let own = limiter
            .peek(&[Check::new(&id(1), "chat", &q)])
            .await
            .unwrap();
        assert_eq!(own[0].remaining, 100);
        // The bucket's 100 frames: 20 batches (the first, then 19 and a wait: 20 calls);
        // `drain` counts the 2 still held and the 95 after.
        let (frames, calls, _) = drain(&mut m).await;
        assert_eq!((frames, calls), (2 + 95, 20));
    }

    #[tokio::test]
    async fn an_empty_bucket_says_how_long_until_the_next_batch() {
        let (limiter, clock) = memory();
        let mut m = meter(&limiter, 1, "chat", messages("50/s", 100));
        let (frames, _, wait) = drain(&mut m).await;
        assert_eq!(frames, 100);
        // 5 tokens at 50/s: 100 ms.
        assert_eq!(wait, Refill::Wait(Duration::from_millis(100)));
        clock.advance(60_000);
        // 3 tokens dripped in: a batch is taken whole or not at all.
        assert_eq!(m.refill(1).await, Refill::Wait(Duration::from_millis(40)));
        clock.advance(40_000);
        assert_eq!(m.refill(1).await, Refill::Granted);
        assert_eq!(m.tokens(), 5);
        assert_eq!(m.refill(1).await, Refill::Wait(Duration::from_millis(100)));
    }

    #[tokio::test]
    async fn the_sockets_of_one_identity_share_one_bucket_and_others_have_their_own() {
        let (limiter, clock) = memory();
        let rule = messages("50/s", 100);
        let mut a = meter(&limiter, 1, "chat", rule);
        let mut b = meter(&limiter, 1, "chat", rule);
        let mut other = meter(&limiter, 2, "chat", rule);
        let mut other_rule = meter(&limiter, 1, "feed", rule);
        assert_eq!(a.refill(1).await, Refill::Granted);
        let (b_frames, _, _) = drain(&mut b).await;
        assert_eq!(b_frames, 95, "a holds one batch");
        assert!(matches!(a.refill(1).await, Refill::Wait(_)));
        assert_eq!(a.tokens(), 5, "what a holds is still its own");
        assert_eq!(drain(&mut other).await.0, 100);
        assert_eq!(drain(&mut other_rule).await.0, 100);
        // Two seconds later (100 at 50/s) the bucket is full again, for whichever socket
        // asks.
        clock.advance(2_000_000);
        a.spend(5);
        assert_eq!(drain(&mut a).await.0, 100);
        assert!(matches!(b.refill(1).await, Refill::Wait(_)));
    }

    #[tokio::test]
    async fn a_closed_socket_s_unused_tokens_stay_charged() {
        let (limiter, _clock) = memory();
        let rule = messages("50/s", 100);
        let mut a = meter(&limiter, 1, "chat", rule);
        assert_eq!(a.refill(1).await, Refill::Granted);
        a.spend(1);
        drop(a);
        // The documented overcharge: at most one batch, here 4 frames.
        let mut b = meter(&limiter, 1, "chat", rule);
        assert_eq!(drain(&mut b).await.0, 95);
    }

    #[tokio::test]
    async fn a_denied_batch_waits_the_store_s_retry_time() {
        let store = Scripted::new(vec![Ok(Decision {
            allowed: false,
            remaining: 0,
            retry_after_us: 250_000,
            reset_us: 1_000_000,
            window: 0,
        })]);
        let mut m = meter(
            &limiter_on(Box::new(store)),
            1,
            "chat",
            messages("50/s", 100),
        );
        assert_eq!(m.refill(1).await, Refill::Wait(Duration::from_millis(250)));
    }

    #[tokio::test]
    async fn a_store_failure_follows_on_error() {
        let down = || {
            Box::new(Scripted::new(vec![Err(StoreError::Timeout(
                Duration::from_millis(50),
            ))]))
        };
        let rule = messages("50/s", 100);
        let on = |on_error| Meter::messages(limiter_on(down()), id(1), "chat", &rule, on_error);
        let mut deny = on(OnError::Deny);
        assert_eq!(deny.refill(1).await, Refill::Unavailable);
        assert_eq!(deny.tokens(), 0);
        let mut allow = on(OnError::Allow);
        assert_eq!(allow.refill(1).await, Refill::Granted);
        assert_eq!(allow.tokens(), 5);
        let mut local = on(OnError::Local);
        assert_eq!(local.refill(1).await, Refill::Unavailable);
        // A byte meter under `allow` gets all a payload lacks at once, even past its burst.
        let limit = Bytes {
            rate: rate("10240/s"),
            burst: 40 << 10,
        };
        let mut bytes = Meter::bytes(limiter_on(down()), id(1), "chat", &limit, OnError::Allow);
        assert_eq!(bytes.refill(100).await, Refill::Granted);
        assert_eq!(bytes.tokens(), 1_024, "a batch");
        assert_eq!(bytes.refill(1 << 30).await, Refill::Granted);
        assert_eq!(bytes.tokens(), 1 << 30);
    }

    #[tokio::test]
    async fn a_refused_limit_is_a_store_failure() {
        let (limiter, _clock) = memory();
        // A rate whose period does not fit the store's precision: the config refuses it.
        let bad = Messages {
            rate: Rate::every(1, Duration::from_secs(u64::MAX / 1_000_000)),
            burst: 1,
            max_bytes: None,
        };
        assert!(quota(bad.rate, bad.burst).is_err());
        let mut m = meter(&limiter, 1, "chat", bad);
        assert_eq!(m.refill(1).await, Refill::Unavailable);
        let mut m = Meter::messages(limiter, id(1), "chat", &bad, OnError::Allow);
        assert_eq!(m.refill(1).await, Refill::Granted);
        assert_eq!(m.tokens(), 1);
    }

    #[tokio::test]
    async fn a_byte_meter_takes_what_a_payload_lacks_in_whole_batches_at_most_a_burst() {
        let (limiter, clock) = memory();
        // 10 KiB/s, burst 40 KiB: batches of 1,024 bytes.
        let limit = Bytes {
            rate: rate("10240/s"),
            burst: 40 << 10,
        };
        let bytes = |n| Meter::bytes(limiter.clone(), id(n), "chat", &limit, OnError::Deny);
        let mut m = bytes(1);
        assert_eq!((m.batch(), m.unit()), (1_024, Unit::Bytes));
        // A 100-byte payload: one batch.
        assert_eq!(m.refill(100).await, Refill::Granted);
        assert_eq!(m.tokens(), 1_024);
        m.spend(100);
        // 5,000 bytes, 924 held: 4,076 lacking, asked for as 4 batches in one call.
        assert_eq!(m.refill(5_000).await, Refill::Granted);
        assert_eq!(m.tokens(), 924 + 4 * 1_024);
        m.spend(5_000);
        // 100 KiB, more than the burst: a burst a call, the second one waiting for the
        // bucket to refill (35 KiB were left: 5 KiB to drip in, half a second).
        assert_eq!(
            m.refill(100 << 10).await,
            Refill::Wait(Duration::from_millis(500))
        );
        clock.advance(500_000);
        assert_eq!(m.refill(100 << 10).await, Refill::Granted);
        assert_eq!(m.tokens(), 20 + (40 << 10));
        assert!(matches!(m.refill(100 << 10).await, Refill::Wait(_)));

        // Its bucket is "<rule>:bytes", apart from the rule's messages; another identity
        // has its own.
        let q = quota(limit.rate, limit.burst).unwrap();
        let peek = |rule: &'static str, n| {
            let limiter = limiter.clone();
            async move { limiter.peek(&[Check::new(&id(n), rule, &q)]).await.unwrap()[0].remaining }
        };
        assert_eq!(peek("chat:bytes", 1).await, 0);
        assert_eq!(peek("chat:messages", 1).await, 40 << 10);
        assert_eq!(bytes(2).refill(40 << 10).await, Refill::Granted);
    }

    #[test]
    fn a_meter_and_its_refill_can_move_between_threads() {
        fn send<T: Send>(_: &T) {}
        let (limiter, _clock) = memory();
        let mut m = meter(&limiter, 1, "chat", messages("50/s", 100));
        send(&m);
        send(&m.refill(1));
    }

    /// A store that answers each decide with the next of its answers, then the last one
    /// again.
    struct Scripted {
        answers: std::sync::Mutex<Vec<Result<Decision, StoreError>>>,
    }

    impl Scripted {
        fn new(answers: Vec<Result<Decision, StoreError>>) -> Scripted {
            Scripted {
                answers: std::sync::Mutex::new(answers),
            }
        }
    }

    impl Store for Scripted {
        fn kind(&self) -> Kind {
            Kind::Memory
        }
        fn decide<'a>(&'a self, checks: &'a [Check<'a>]) -> Call<'a, Vec<Decision>> {
            let mut answers = self.answers.lock().unwrap();
            let next = if answers.len() > 1 {
                answers.remove(0)
            } else {
                answers[0].clone()
            };
            Call::Ready(next.map(|d| vec![d; checks.len()]))
        }
        fn peek<'a>(&'a self, checks: &'a [Check<'a>]) -> Call<'a, Vec<Decision>> {
            self.decide(checks)
        }
        fn settle<'a>(
            &'a self,
            items: &'a [store::Settlement<'a>],
        ) -> Call<'a, Vec<store::Receipt>> {
            // The meter never settles: its charges are frames already sent.
            let answer = self.answers.lock().unwrap()[0].clone();
            Call::Ready(answer.map(|now| vec![store::Receipt::new(now, 0); items.len()]))
        }
        fn reset<'a>(&'a self, _: &'a Check<'a>) -> Call<'a, ()> {
            Call::Ready(Ok(()))
        }
        fn release<'a>(&'a self, _: &'a Check<'a>) -> Call<'a, ()> {
            Call::Ready(Ok(()))
        }
        fn renew<'a>(&'a self, _: &'a Check<'a>) -> Call<'a, bool> {
            Call::Ready(Ok(true))
        }
        fn ping(&self) -> Call<'_, ()> {
            Call::Ready(Ok(()))
        }
    }
}
