//! A local cache of denials, so an identity hammering far past its limit costs no store
//! call per request (the abuse path).
//!
//! When the store denies a rule for an identity with "retry after R", no request on that
//! rule and identity can pass before R has elapsed: under every algorithm a state only
//! grows more permissive with time, and other requests only make it stricter. So the
//! gateway may deny such requests itself until then. Two guarantees, by construction:
//! - it never admits anything: a miss goes to the store as before;
//! - it never denies past the retry time: R is counted from the moment *before* the store
//!   call was sent, which is no later than the moment Redis measured it from.
//!
//! (A cluster refund or an admin reset can make a state more permissive early; the cache
//! then denies until R at most — never longer than the store said. Reset also clears the
//! entry.) Entries are keyed by identity, rule and quota, so a reload or a plan with other
//! numbers never reuses a denial. Bounded: at most `capacity` entries, expired ones swept.

use std::collections::HashMap;
use std::sync::Mutex;

use super::{Check, Decision, Fnv1a, Quota};

const SHARDS: usize = 16;

#[derive(Clone, Copy)]
struct Denied {
    /// Local monotonic µs until which the rule denies.
    until_us: u64,
    /// The rule's reset at the time of the denial, as local monotonic µs.
    reset_at_us: u64,
}

pub struct DenyCache {
    shards: Vec<Mutex<HashMap<u128, Denied>>>,
    per_shard: usize,
}

fn key(check: &Check<'_>) -> u128 {
    // The rule name and the quota's numbers, folded into the identity digest.
    let mut h = Fnv1a::new();
    h.write(check.rule.as_bytes());
    let q: &Quota = check.quota;
    for n in [
        q.algorithm.code() as u64,
        q.rate.count,
        q.period_us(),
        q.burst,
        q.cost,
        q.max_delay_us,
    ] {
        h.write_u64(n);
    }
    if let Some(c) = q.calendar {
        // Another zone or anchor day cuts other periods: a denial until one's edge is not
        // the other's.
        h.write(&[c.period as u8, c.anchor_day]);
        h.write(c.zone_name().as_bytes());
    }
    u128::from_le_bytes(check.identity.0) ^ h.finish()
}

/// Whether a check's denial may be remembered: not a shadow check (it denies nothing),
/// and not a concurrency limit (a slot frees whenever a response ends, before any time).
fn cacheable(check: &Check<'_>) -> bool {
    !check.shadow && check.quota.algorithm != super::Algorithm::Concurrency
}

impl DenyCache {
    pub fn new(capacity: usize) -> DenyCache {
        DenyCache {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            per_shard: (capacity / SHARDS).max(1),
        }
    }

    fn shard(&self, k: u128) -> std::sync::MutexGuard<'_, HashMap<u128, Denied>> {
        self.shards[(k >> 120) as usize % SHARDS]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// If a rule of `checks` is known to deny at `now_us`, the decisions to answer with:
    /// the denying rules (with their remaining retry time), and `None` for rules whose
    /// state is not known here.
    pub fn lookup(&self, checks: &[Check<'_>], now_us: u64) -> Option<Vec<Option<Decision>>> {
        let mut out: Vec<Option<Decision>> = Vec::with_capacity(checks.len());
        let mut hit = false;
        for c in checks {
            if !cacheable(c) {
                out.push(None);
                continue;
            }
            let k = key(c);
            let found = self
                .shard(k)
                .get(&k)
                .copied()
                .filter(|d| d.until_us > now_us);
            out.push(found.map(|d| {
                hit = true;
                Decision {
                    allowed: false,
                    remaining: 0,
                    retry_after_us: d.until_us - now_us,
                    reset_us: d.reset_at_us.saturating_sub(now_us),
                    window: 0,
                }
            }));
        }
        hit.then_some(out)
    }

    /// Remember the denials in `decisions`, counted from `sent_us` (before the store call).
    pub fn remember(&self, checks: &[Check<'_>], decisions: &[Decision], sent_us: u64) {
        for (c, d) in checks.iter().zip(decisions) {
            if d.allowed || d.retry_after_us == 0 || !cacheable(c) {
                continue;
            }
            let k = key(c);
            let mut shard = self.shard(k);
            if shard.len() >= self.per_shard && !shard.contains_key(&k) {
                shard.retain(|_, e| e.until_us > sent_us);
                if shard.len() >= self.per_shard {
                    continue;
                }
            }
            shard.insert(
                k,
                Denied {
                    until_us: sent_us + d.retry_after_us,
                    reset_at_us: sent_us + d.reset_us,
                },
            );
        }
    }

    /// Forget one rule and identity (an admin reset).
    pub fn forget(&self, check: &Check<'_>) {
        let k = key(check);
        self.shard(k).remove(&k);
    }

    /// Drop expired entries.
    pub fn sweep(&self, now_us: u64) {
        for s in &self.shards {
            s.lock()
                .unwrap_or_else(|p| p.into_inner())
                .retain(|_, e| e.until_us > now_us);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::IdentityDigest;
    use crate::limiter::tests::quota;
    use crate::limiter::Algorithm;

    fn denied(retry: u64) -> Decision {
        Decision {
            allowed: false,
            remaining: 0,
            retry_after_us: retry,
            reset_us: retry * 2,
            window: 0,
        }
    }

    #[test]
    fn a_denial_holds_until_its_retry_time_and_not_a_microsecond_longer() {
        let cache = DenyCache::new(1000);
        let q = quota(Algorithm::TokenBucket, "1/s", None, 1);
        let id = IdentityDigest([7; 16]);
        let c = [Check::new(&id, "api", &q)];
        cache.remember(&c, &[denied(500)], 1_000);
        let hit = cache.lookup(&c, 1_200).expect("cached");
        assert_eq!(hit[0].map(|d| d.retry_after_us), Some(300));
        assert!(cache.lookup(&c, 1_499).is_some());
        assert!(
            cache.lookup(&c, 1_500).is_none(),
            "at the retry time the store decides again"
        );
    }

    #[test]
    fn other_rules_quotas_and_identities_are_not_affected() {
        let cache = DenyCache::new(1000);
        let (q1, q2) = (
            quota(Algorithm::TokenBucket, "1/s", None, 1),
            quota(Algorithm::TokenBucket, "2/s", None, 1),
        );
        let (a, b) = (IdentityDigest([1; 16]), IdentityDigest([2; 16]));
        cache.remember(&[Check::new(&a, "api", &q1)], &[denied(1_000)], 0);
        assert!(cache.lookup(&[Check::new(&b, "api", &q1)], 1).is_none());
        assert!(cache.lookup(&[Check::new(&a, "web", &q1)], 1).is_none());
        assert!(
            cache.lookup(&[Check::new(&a, "api", &q2)], 1).is_none(),
            "a reload with new numbers"
        );
        let both = [Check::new(&b, "x", &q1), Check::new(&a, "api", &q1)];
        let hit = cache.lookup(&both, 1).expect("the api rule denies");
        assert!(hit[0].is_none() && hit[1].is_some());
    }

    #[test]
    fn allowed_decisions_are_never_cached_and_reset_forgets() {
        let cache = DenyCache::new(1000);
        let q = quota(Algorithm::Gcra, "1/s", None, 1);
        let id = IdentityDigest([3; 16]);
        let c = [Check::new(&id, "api", &q)];
        let ok = Decision {
            allowed: true,
            remaining: 0,
            retry_after_us: 0,
            reset_us: 10,
            window: 0,
        };
        cache.remember(&c, &[ok], 0);
        assert!(cache.lookup(&c, 1).is_none());
        cache.remember(&c, &[denied(100)], 0);
        cache.forget(&c[0]);
        assert!(cache.lookup(&c, 1).is_none());
    }

    #[test]
    fn capacity_bounds_the_cache() {
        let cache = DenyCache::new(SHARDS * 4);
        let q = quota(Algorithm::TokenBucket, "1/s", None, 1);
        let ids: Vec<IdentityDigest> = (0..1000u32)
            .map(|i| {
                let mut d = [0u8; 16];
                d[..4].copy_from_slice(&i.to_le_bytes());
                d[15] = (i % 251) as u8;
                IdentityDigest(d)
            })
            .collect();
        for id in &ids {
            cache.remember(&[Check::new(id, "api", &q)], &[denied(1_000_000)], 0);
        }
        let held: usize = cache.shards.iter().map(|s| s.lock().unwrap().len()).sum();
        assert!(held <= SHARDS * 4, "{held} entries held");
    }
}
