//! How many retries a pool may send: at most [`RETRY_PERCENT`] of its requests over the
//! last [`WINDOW_SECS`] seconds, plus [`MIN_RETRIES_PER_SECOND`] a second (so a pool with
//! little traffic may still retry a few). A sick backend then gets its requests and a
//! fifth more, never a retry storm that multiplies its load by `retries`.
//!
//! This is Finagle's `RetryBudget` (and linkerd's `retryBudget`: `retryRatio`,
//! `minRetriesPerSecond`, `ttl`), rather than Envoy's, which bounds retries in flight:
//! a budget of retries over time needs no count of what is in flight, and says the same
//! thing to the operator ("a fifth more requests, at most"). Over the window the floor
//! is `3 × 10 = 30` retries, which an idle pool may take at once.
//!
//! The window is ten one-second buckets, each one `AtomicU64` holding its second (20
//! bits, so a bucket ten seconds old is told from a current one), its first attempts (24
//! bits) and its retries (20 bits), each saturating. Counting a request is one
//! compare-and-swap on the current second's bucket; a retry is admitted by a
//! compare-and-swap on that bucket after reading the nine before it, so two threads
//! cannot both take the budget's last retry. Integers only, no lock.

use std::sync::atomic::{AtomicU64, Ordering::AcqRel, Ordering::Acquire};
use std::time::Instant;

/// Retries may be this share (in percent) of the window's first attempts.
pub const RETRY_PERCENT: u64 = 20;
/// Retries allowed a second whatever the traffic.
pub const MIN_RETRIES_PER_SECOND: u64 = 3;
/// The window, in one-second buckets.
pub const WINDOW_SECS: u64 = 10;

const TAG_BITS: u32 = 20;
const REQUEST_BITS: u32 = 24;
const RETRY_BITS: u32 = 20;
const TAG_MASK: u64 = (1 << TAG_BITS) - 1;
const REQUEST_MAX: u64 = (1 << REQUEST_BITS) - 1;
const RETRY_MAX: u64 = (1 << RETRY_BITS) - 1;

/// One pool's retry budget, shared by every worker.
#[derive(Debug)]
pub struct RetryBudget {
    /// Seconds are counted from it.
    epoch: Instant,
    /// Second `s` is counted in `buckets[s % WINDOW_SECS]`.
    buckets: [AtomicU64; WINDOW_SECS as usize],
}

/// One second's counts, as a bucket holds them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Bucket {
    /// The second, modulo 2^20.
    tag: u64,
    requests: u64,
    retries: u64,
}

impl Bucket {
    fn unpack(word: u64) -> Bucket {
        Bucket {
            tag: word >> (REQUEST_BITS + RETRY_BITS),
            requests: (word >> RETRY_BITS) & REQUEST_MAX,
            retries: word & RETRY_MAX,
        }
    }

    fn pack(self) -> u64 {
        (self.tag << (REQUEST_BITS + RETRY_BITS))
            | (self.requests.min(REQUEST_MAX) << RETRY_BITS)
            | self.retries.min(RETRY_MAX)
    }

    /// The bucket as second `second` (tagged `tag`) finds it: its counts if it is that
    /// second's, empty if it is older; `None` if it is newer (the caller's `now` lags
    /// the others' by ten seconds or more).
    fn at(word: u64, tag: u64) -> Option<Bucket> {
        let b = Bucket::unpack(word);
        let ahead = b.tag.wrapping_sub(tag) & TAG_MASK;
        match ahead {
            0 => Some(b),
            // Within half the tag space ahead: newer than this second.
            a if a < (1 << (TAG_BITS - 1)) => None,
            _ => Some(Bucket {
                tag,
                requests: 0,
                retries: 0,
            }),
        }
    }
}

impl RetryBudget {
    /// An empty budget, its seconds counted from `now`.
    pub fn new(now: Instant) -> RetryBudget {
        RetryBudget {
            epoch: now,
            buckets: Default::default(),
        }
    }

    fn second(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_secs()
    }

    fn bucket(&self, second: u64) -> &AtomicU64 {
        &self.buckets[(second % WINDOW_SECS) as usize]
    }

    /// A request's first attempt went to the pool at `now` (the moment of the call).
    pub fn request(&self, now: Instant) {
        let second = self.second(now);
        let tag = second & TAG_MASK;
        // `Err`: the bucket belongs to a later second (this call's `now` is ten seconds
        // late): not counted.
        let _ = self.bucket(second).fetch_update(AcqRel, Acquire, |word| {
            let mut b = Bucket::at(word, tag)?;
            b.requests = b.requests.saturating_add(1);
            Some(b.pack())
        });
    }

    /// Whether a failed request may go again at `now` (the moment of the call): `true`
    /// counts the retry. `false` when the window's retries already reach its budget:
    /// [`RETRY_PERCENT`] of its requests, plus [`MIN_RETRIES_PER_SECOND`] × [`WINDOW_SECS`].
    pub fn try_retry(&self, now: Instant) -> bool {
        let second = self.second(now);
        let tag = second & TAG_MASK;
        let current = self.bucket(second);
        let mut word = current.load(Acquire);
        loop {
            // The nine seconds before this one (those since the epoch), as they are now:
            // a bucket of an older second counts nothing.
            let (mut requests, mut retries) = (0u64, 0u64);
            for back in 1..WINDOW_SECS.min(second + 1) {
                let s = second - back;
                let b = Bucket::unpack(self.bucket(s).load(Acquire));
                if b.tag == s & TAG_MASK {
                    requests += b.requests;
                    retries += b.retries;
                }
            }
            let Some(mut now_bucket) = Bucket::at(word, tag) else {
                return false;
            };
            requests += now_bucket.requests;
            retries += now_bucket.retries;
            if retries >= budget(requests) || now_bucket.retries >= RETRY_MAX {
                return false;
            }
            now_bucket.retries += 1;
            match current.compare_exchange(word, now_bucket.pack(), AcqRel, Acquire) {
                Ok(_) => return true,
                Err(changed) => word = changed,
            }
        }
    }
}

/// The retries a window of `requests` first attempts allows.
fn budget(requests: u64) -> u64 {
    requests * RETRY_PERCENT / 100 + MIN_RETRIES_PER_SECOND * WINDOW_SECS
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn an_idle_pool_still_gets_three_a_second() {
        let t0 = Instant::now();
        let b = RetryBudget::new(t0);
        // 30 over the window, at once if need be.
        let first: usize = (0..100).filter(|_| b.try_retry(t0)).count();
        assert_eq!(first, 30);
        assert!(!b.try_retry(t0 + 9_999 * MS));
        // Asked every 100 ms for 100 s: 3 a second on average, 30 per window at most.
        let b = RetryBudget::new(t0);
        let mut per_second = vec![0u64; 100];
        for step in 0..1_000u32 {
            let now = t0 + step * 100 * MS;
            for _ in 0..5 {
                if b.try_retry(now) {
                    per_second[(step / 10) as usize] += 1;
                }
            }
        }
        assert_eq!(per_second.iter().sum::<u64>(), 300);
        for w in per_second.windows(10) {
            assert!(w.iter().sum::<u64>() <= 30, "{w:?}");
        }
    }

    #[test]
    fn retries_of_failing_requests_stay_within_a_fifth_plus_the_floor() {
        let t0 = Instant::now();
        let b = RetryBudget::new(t0);
        // 200 requests a second for 60 s, every one failing and asking to go again.
        let (mut requests, mut retries) = (vec![0u64; 60], vec![0u64; 60]);
        for s in 0..60u64 {
            for k in 0..200u32 {
                let now = t0 + Duration::from_secs(s) + k * 4 * MS;
                b.request(now);
                requests[s as usize] += 1;
                if b.try_retry(now) {
                    retries[s as usize] += 1;
                }
            }
        }
        for end in 10..=60 {
            let window = end - 10..end;
            let (req, ret): (u64, u64) = (
                requests[window.clone()].iter().sum(),
                retries[window].iter().sum(),
            );
            assert!(ret <= req / 5 + 30, "{ret} retries for {req} requests");
        }
        // In the steady state the budget is used: 2,000 × 20% + 30 per window.
        assert_eq!(retries[50..60].iter().sum::<u64>(), 430);
    }

    #[test]
    fn old_buckets_expire() {
        let t0 = Instant::now();
        let b = RetryBudget::new(t0);
        for _ in 0..1_000 {
            b.request(t0);
        }
        // 1,000 requests: 200 + 30.
        assert_eq!((0..500).filter(|_| b.try_retry(t0 + 5 * MS)).count(), 230);
        // Second 9 still sees second 0; second 10 does not.
        assert!(!b.try_retry(t0 + Duration::from_secs(9)));
        assert_eq!(
            (0..500)
                .filter(|_| b.try_retry(t0 + Duration::from_secs(10)))
                .count(),
            30
        );
        // Long idle (the bucket's second comes round again): nothing of before counts.
        let later = t0 + Duration::from_secs(10 * 1000);
        assert_eq!((0..500).filter(|_| b.try_retry(later)).count(), 30);
        // A call whose `now` lags ten seconds behind is refused, and not counted.
        b.request(later - Duration::from_secs(10));
        assert!(!b.try_retry(later - Duration::from_secs(10)));
    }

    #[test]
    fn threads_cannot_overdraw_it() {
        let t0 = Instant::now();
        let b = RetryBudget::new(t0);
        for _ in 0..100 {
            b.request(t0);
        }
        let admitted = std::thread::scope(|scope| {
            let threads: Vec<_> = (0..4)
                .map(|_| scope.spawn(|| (0..200).filter(|_| b.try_retry(t0)).count()))
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().unwrap_or(0))
                .sum::<usize>()
        });
        assert_eq!(admitted, 50);
    }

    #[test]
    fn buckets_pack_and_saturate() {
        let b = Bucket {
            tag: TAG_MASK,
            requests: 12_345,
            retries: 678,
        };
        assert_eq!(Bucket::unpack(b.pack()), b);
        let full = Bucket {
            tag: 3,
            requests: u64::MAX,
            retries: u64::MAX,
        };
        let packed = Bucket::unpack(full.pack());
        assert_eq!(
            (packed.tag, packed.requests, packed.retries),
            (3, REQUEST_MAX, RETRY_MAX)
        );
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        crate::proptest_seeds! {
            #![cases(200)]

            /// On any timeline of requests and retries, the budget admits exactly the
            /// retries a plain count over the last ten seconds allows: retries in
            /// seconds `s-9..=s` stay under 20% of the requests in them plus 30.
            #[test]
            fn the_budget_is_the_window_count(events in prop::collection::vec((prop_oneof![3 => Just(0u64), 3 => 0u64..300, 1 => 300u64..4_000, 1 => 4_000u64..30_000], any::<bool>()), 1..600)) {
                let t0 = Instant::now();
                let b = RetryBudget::new(t0);
                // (second, is retry) of everything counted.
                let mut counted: Vec<(u64, bool)> = Vec::new();
                let mut ms = 0u64;
                for (gap, retry) in events {
                    ms += gap;
                    let now = t0 + Duration::from_millis(ms);
                    let s = ms / 1000;
                    let window = |retry: bool| counted.iter().filter(|&&(t, r)| r == retry && t + 10 > s).count() as u64;
                    if retry {
                        let want = window(true) < window(false) * 20 / 100 + 30;
                        prop_assert_eq!(b.try_retry(now), want, "at {} ms", ms);
                        if want {
                            counted.push((s, true));
                        }
                    } else {
                        b.request(now);
                        counted.push((s, false));
                    }
                }
            }
        }
    }
}
