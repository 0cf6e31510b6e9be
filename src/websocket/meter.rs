//! The message bucket of one identity under one rule (`messages = { rate, burst }`),
//! shared by that identity's sockets through the limiter's store, and charged in
//! batches: never one store call per frame.
//!
//! The bucket is an ordinary token bucket of `messages.rate` and `messages.burst`, kept
//! under the identity's key for the rule `"<rule>:messages"` (a name no rule can have: a
//! rule's name has no `:`), so it sits beside the rule's own request limit, in memory or
//! in Redis, shared by gateways like any limit.
//!
//! # Batches
//!
//! A socket's [`Meter`] takes tokens from the bucket a batch at a time (one store call,
//! the batch as the check's cost) and hands them out to frames locally. The batch is a
//! tenth of a second of the rate, at least 1 and at most the burst ([`batch`]): a socket
//! sending at the full rate asks the store about ten times a second, however many frames
//! it sends; at 50/s a batch is 5 frames.
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
use crate::limiter::guard::{Answer, Limiter, Now};
use crate::limiter::{Algorithm, Check, OnError, Quota, QuotaError};
use crate::rules::Messages;

/// What [`Meter::refill`] got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refill {
    /// A batch was taken: [`Meter::tokens`] is above zero.
    Granted,
    /// The bucket cannot pay for a batch yet: ask again after this long (the store's
    /// retry time for the batch).
    Wait(Duration),
    /// The store failed and `on_error` denies: the socket gets no more frames through.
    Unavailable,
}

/// The shortest wait [`Refill::Wait`] gives, so that a caller never spins on the store.
const MIN_WAIT: Duration = Duration::from_millis(1);

/// Frames one store call takes for a socket of `messages`: a tenth of a second of the
/// rate (rounded down, at least 1), at most the burst.
pub fn batch(messages: &Messages) -> u64 {
    let secs = messages.rate.period.as_secs().max(1);
    let tenth = messages.rate.count / secs.saturating_mul(10);
    tenth.max(1).min(messages.burst.max(1))
}

/// The bucket of `messages` as the store keeps it, charged [`batch`] tokens a call. The
/// config validates `messages` with it, so it cannot fail for a rule that loaded.
pub fn quota(messages: &Messages) -> Result<Quota, QuotaError> {
    Quota::new(
        Algorithm::TokenBucket,
        messages.rate,
        NonZeroU64::new(messages.burst),
        NonZeroU64::new(batch(messages)).unwrap_or(NonZeroU64::MIN),
    )
}

/// One socket's share of its identity's message bucket.
pub struct Meter {
    limiter: Arc<Limiter>,
    identity: IdentityDigest,
    /// `"<rule>:messages"`: the rule part of the bucket's store key.
    rule: String,
    /// The bucket, with the batch as its cost; `None` only for `messages` the config
    /// refuses (then every refill is a store failure).
    quota: Option<Quota>,
    on_error: OnError,
    /// Frames taken from the bucket and not yet spent.
    tokens: u64,
}

impl Meter {
    /// `rule`: the admitting rule's name; the store key is the identity's under
    /// `"<rule>:messages"` (a token bucket of `messages.rate`, `messages.burst`).
    pub fn new(
        limiter: Arc<Limiter>,
        identity: IdentityDigest,
        rule: &str,
        messages: Messages,
        on_error: OnError,
    ) -> Meter {
        let quota = quota(&messages)
            .inspect_err(|e| {
                tracing::error!(rule, error = %e, "messages limit refused; its sockets are treated as if the store failed");
            })
            .ok();
        Meter {
            limiter,
            identity,
            rule: format!("{rule}:messages"),
            quota,
            on_error,
            tokens: 0,
        }
    }

    /// Frames this socket may pass now without asking the store.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Frames one refill takes from the bucket.
    pub fn batch(&self) -> u64 {
        self.quota.map_or(1, |q| q.cost)
    }

    /// `n` frames passed (at most [`Meter::tokens`]).
    pub fn spend(&mut self, n: u64) {
        debug_assert!(n <= self.tokens, "spent {n} of {} tokens", self.tokens);
        self.tokens = self.tokens.saturating_sub(n);
    }

    /// Ask the store for the next batch: one store call (or none, where the deny cache
    /// or an open breaker answers). [`Refill::Granted`]: [`Meter::tokens`] is above zero
    /// after. [`Refill::Wait`]: the store's retry time for the batch. A store failure
    /// follows `on_error`: `deny` gives [`Refill::Unavailable`], `allow` a batch
    /// without a store (so frames pass, and the store is asked again a batch later).
    /// With `local` the limiter has already answered from its in-process fallback; if
    /// even that fails (it is full), the socket is denied, as requests are.
    pub async fn refill(&mut self) -> Refill {
        let Some(quota) = self.quota else {
            return self.failed(1);
        };
        let answer = {
            let checks = [Check::new(&self.identity, &self.rule, &quota)];
            // One identity under one rule: no charge of another check can be refunded,
            // so the deny cache may answer (and remember) denials.
            let answer = match self.limiter.decide_now(&checks, true) {
                Now::Answered(a) => a,
                Now::Ask(asking) => self.limiter.ask(&checks, true, asking).await,
            };
            answer
        };
        let decision = match answer {
            Answer::Store(d) | Answer::Local(d) => d.into_iter().next(),
            Answer::Cached(d) => d.into_iter().next().flatten(),
            Answer::Failed(_) => None,
        };
        match decision {
            Some(d) if d.allowed => {
                self.tokens += quota.cost;
                Refill::Granted
            }
            Some(d) => Refill::Wait(Duration::from_micros(d.retry_after_us).max(MIN_WAIT)),
            None => self.failed(quota.cost),
        }
    }

    fn failed(&mut self, batch: u64) -> Refill {
        match self.on_error {
            OnError::Allow => {
                self.tokens += batch;
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
    use crate::stats::Stats;

    fn messages(rate: &str, burst: u64) -> Messages {
        Messages {
            rate: Rate::parse(rate).unwrap(),
            burst,
            max_bytes: None,
        }
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
            match meter.refill().await {
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
        assert_eq!(batch(&messages("50/s", 100)), 5);
        assert_eq!(batch(&messages("1/s", 1)), 1);
        assert_eq!(batch(&messages("9/s", 100)), 1, "rounded down, at least 1");
        assert_eq!(batch(&messages("10000/s", 20)), 20, "never above the burst");
        assert_eq!(batch(&messages("600/m", 50)), 1);
        assert_eq!(batch(&messages("6000/m", 50)), 10);
        assert_eq!(batch(&messages("1000/10s", 100)), 10);
        assert_eq!(batch(&messages("5/h", 5)), 1);
        assert_eq!(
            batch(&messages("50/s", 0)),
            1,
            "a zero burst still takes a frame"
        );
        assert_eq!(quota(&messages("50/s", 100)).unwrap().cost, 5);
    }

    #[tokio::test]
    async fn frames_are_charged_a_batch_per_store_call() {
        let (limiter, _clock) = memory();
        let mut m = Meter::new(
            limiter.clone(),
            id(1),
            "chat",
            messages("50/s", 100),
            OnError::Deny,
        );
        assert_eq!((m.tokens(), m.batch()), (0, 5));
        assert_eq!(m.refill().await, Refill::Granted);
        assert_eq!(m.tokens(), 5);
        m.spend(3);
        assert_eq!(m.tokens(), 2);
        // The store saw one charge of 5, under "<rule>:messages".
        let q = quota(&messages("50/s", 100)).unwrap();
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
        let mut m = Meter::new(limiter, id(1), "chat", messages("50/s", 100), OnError::Deny);
        let (frames, _, wait) = drain(&mut m).await;
        assert_eq!(frames, 100);
        // 5 tokens at 50/s: 100 ms.
        assert_eq!(wait, Refill::Wait(Duration::from_millis(100)));
        clock.advance(60_000);
        // 3 tokens dripped in: a batch is taken whole or not at all.
        assert_eq!(m.refill().await, Refill::Wait(Duration::from_millis(40)));
        clock.advance(40_000);
        assert_eq!(m.refill().await, Refill::Granted);
        assert_eq!(m.tokens(), 5);
        assert_eq!(m.refill().await, Refill::Wait(Duration::from_millis(100)));
    }

    #[tokio::test]
    async fn the_sockets_of_one_identity_share_one_bucket_and_others_have_their_own() {
        let (limiter, clock) = memory();
        let rule = messages("50/s", 100);
        let mut a = Meter::new(limiter.clone(), id(1), "chat", rule, OnError::Deny);
        let mut b = Meter::new(limiter.clone(), id(1), "chat", rule, OnError::Deny);
        let mut other = Meter::new(limiter.clone(), id(2), "chat", rule, OnError::Deny);
        let mut other_rule = Meter::new(limiter, id(1), "feed", rule, OnError::Deny);
        assert_eq!(a.refill().await, Refill::Granted);
        let (b_frames, _, _) = drain(&mut b).await;
        assert_eq!(b_frames, 95, "a holds one batch");
        assert!(matches!(a.refill().await, Refill::Wait(_)));
        assert_eq!(a.tokens(), 5, "what a holds is still its own");
        assert_eq!(drain(&mut other).await.0, 100);
        assert_eq!(drain(&mut other_rule).await.0, 100);
        // Two seconds later (100 at 50/s) the bucket is full again, for whichever socket
        // asks.
        clock.advance(2_000_000);
        a.spend(5);
        assert_eq!(drain(&mut a).await.0, 100);
        assert!(matches!(b.refill().await, Refill::Wait(_)));
    }

    #[tokio::test]
    async fn a_closed_socket_s_unused_tokens_stay_charged() {
        let (limiter, _clock) = memory();
        let rule = messages("50/s", 100);
        let mut a = Meter::new(limiter.clone(), id(1), "chat", rule, OnError::Deny);
        assert_eq!(a.refill().await, Refill::Granted);
        a.spend(1);
        drop(a);
        // The documented overcharge: at most one batch, here 4 frames.
        let mut b = Meter::new(limiter, id(1), "chat", rule, OnError::Deny);
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
        let mut m = Meter::new(
            limiter_on(Box::new(store)),
            id(1),
            "chat",
            messages("50/s", 100),
            OnError::Deny,
        );
        assert_eq!(m.refill().await, Refill::Wait(Duration::from_millis(250)));
    }

    #[tokio::test]
    async fn a_store_failure_follows_on_error() {
        let down = || {
            Box::new(Scripted::new(vec![Err(StoreError::Timeout(
                Duration::from_millis(50),
            ))]))
        };
        let rule = messages("50/s", 100);
        let mut deny = Meter::new(limiter_on(down()), id(1), "chat", rule, OnError::Deny);
        assert_eq!(deny.refill().await, Refill::Unavailable);
        assert_eq!(deny.tokens(), 0);
        let mut allow = Meter::new(limiter_on(down()), id(1), "chat", rule, OnError::Allow);
        assert_eq!(allow.refill().await, Refill::Granted);
        assert_eq!(allow.tokens(), 5);
        let mut local = Meter::new(limiter_on(down()), id(1), "chat", rule, OnError::Local);
        assert_eq!(local.refill().await, Refill::Unavailable);
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
        assert!(quota(&bad).is_err());
        let mut m = Meter::new(limiter.clone(), id(1), "chat", bad, OnError::Deny);
        assert_eq!(m.refill().await, Refill::Unavailable);
        let mut m = Meter::new(limiter, id(1), "chat", bad, OnError::Allow);
        assert_eq!(m.refill().await, Refill::Granted);
        assert_eq!(m.tokens(), 1);
    }

    #[test]
    fn a_meter_and_its_refill_can_move_between_threads() {
        fn send<T: Send>(_: &T) {}
        let (limiter, _clock) = memory();
        let mut m = Meter::new(limiter, id(1), "chat", messages("50/s", 100), OnError::Deny);
        send(&m);
        send(&m.refill());
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
