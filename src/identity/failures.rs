//! A small allowance of failures per peer, in front of a check a guesser would repeat: the
//! admin token's, a bearer token's signature, an API key's lookup.
//!
//! Each peer (an IPv4 address, or an IPv6 /64: one host holds a whole /64) may fail
//! `burst` checks at once, then one more every `every_ms` (a GCRA, one integer per peer,
//! as the limiter's own). While its allowance is used up, its checks are answered 429 with
//! a `Retry-After` and not even made: a guesser learns nothing from them, and a forger's
//! bad signatures cost no CPU. A check is charged before it is made, under one lock
//! ([`Failures::charge`]), so concurrent ones (HTTP/2 streams on several workers) cannot
//! all pass an allowance of one; one that succeeded is given its charge back
//! ([`Failures::refund`]). So a peer that passes is never slowed — unless it shares its
//! address with a guesser, and then it waits for the allowance as the guesser does.
//!
//! The peers are bounded ([`MAX_PEERS`]): when the table is full, peers whose allowance is
//! whole again are forgotten first (forgetting them changes nothing). If every one is
//! still throttled, a newcomer is not let in by forgetting one (a guesser cycling through
//! more networks than the table holds would come back fresh each time): newcomers share
//! one allowance, the overflow's, until room is made. An empty table costs a request one
//! atomic load ([`Failures::throttled`]).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

/// Peers remembered at most (about 50 bytes each).
pub const MAX_PEERS: usize = 4096;
/// At most one log line about failures per this long.
const WARN_EVERY_MS: u64 = 10_000;

/// How many failures a peer may make: `burst` at once, then one per `every_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allowance {
    pub burst: u64,
    pub every_ms: u64,
}

/// The failures of every peer under one [`Allowance`]. Times are milliseconds on the
/// caller's clock ([`Failures::now_ms`] in the gateway; tests move it by hand).
pub struct Failures {
    pub allowance: Allowance,
    epoch: std::time::Instant,
    /// Per peer, the GCRA's theoretical arrival time: when its allowance is whole again.
    peers: Mutex<HashMap<IpAddr, u64>>,
    /// Whether any peer is remembered (read without the lock).
    any: AtomicBool,
    /// When failures were last logged (0: never), and how many came since.
    warned_ms: AtomicU64,
    since: AtomicU64,
}

impl std::fmt::Debug for Failures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Failures")
            .field("allowance", &self.allowance)
            .finish_non_exhaustive()
    }
}

impl Failures {
    pub fn new(allowance: Allowance) -> Failures {
        Failures {
            allowance: Allowance {
                burst: allowance.burst.max(1),
                every_ms: allowance.every_ms.max(1),
            },
            epoch: std::time::Instant::now(),
            peers: Mutex::new(HashMap::new()),
            any: AtomicBool::new(false),
            warned_ms: AtomicU64::new(0),
            since: AtomicU64::new(0),
        }
    }

    /// Milliseconds since the table was made.
    pub fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, u64>> {
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How long `peer` must wait (ms) before its next check is made, if it must. Charges
    /// nothing; one atomic load while no peer has failed.
    pub fn throttled(&self, peer: IpAddr, now_ms: u64) -> Option<u64> {
        if !self.any.load(Relaxed) {
            return None;
        }
        let peers = self.lock();
        let tat = *peers.get(&peer_key(peer)).or_else(|| {
            // A newcomer while the table is full shares the overflow's allowance.
            (peers.len() >= MAX_PEERS)
                .then(|| peers.get(&OVERFLOW))
                .flatten()
        })?;
        self.wait(tat, now_ms)
    }

    /// Before `peer`'s check is made: charge its allowance, or say how long (ms) it must
    /// wait. One lock for both, so no two checks spend one allowance. Give the charge
    /// back with [`Failures::refund`] if the check passed.
    pub fn charge(&self, peer: IpAddr, now_ms: u64) -> Result<IpAddr, u64> {
        let mut key = peer_key(peer);
        let mut peers = self.lock();
        if !peers.contains_key(&key) && peers.len() >= MAX_PEERS {
            make_room(&mut peers, now_ms);
            if peers.len() >= MAX_PEERS {
                key = OVERFLOW;
            }
        }
        let tat = peers.entry(key).or_insert(now_ms);
        self.any.store(true, Relaxed);
        if let Some(ms) = self.wait(*tat, now_ms) {
            return Err(ms);
        }
        *tat = (*tat).max(now_ms) + self.allowance.every_ms;
        Ok(key)
    }

    /// The check `reserve` charged to `key` passed: its charge back.
    pub fn refund(&self, key: IpAddr, now_ms: u64) {
        let mut peers = self.lock();
        if let Some(tat) = peers.get_mut(&key) {
            *tat = tat.saturating_sub(self.allowance.every_ms);
            if *tat <= now_ms {
                peers.remove(&key);
            }
        }
        if peers.is_empty() {
            self.any.store(false, Relaxed);
        }
    }

    /// Whether no peer has failed since the table was made (or since its last peer's
    /// charge was given back): one atomic load.
    pub fn quiet(&self) -> bool {
        !self.any.load(Relaxed)
    }

    /// Peers remembered now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no peer is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether a failure may be logged now (then with how many came since the last line,
    /// this one included), or only counted.
    pub fn log_due(&self, now_ms: u64) -> Option<u64> {
        let since = self.since.fetch_add(1, Relaxed) + 1;
        let now = now_ms.max(1);
        let then = self.warned_ms.load(Relaxed);
        let due = (then == 0 || now >= then + WARN_EVERY_MS)
            && self
                .warned_ms
                .compare_exchange(then, now, Relaxed, Relaxed)
                .is_ok();
        if !due {
            return None;
        }
        self.since.fetch_sub(since, Relaxed);
        Some(since)
    }

    /// How long (ms) a peer whose GCRA stands at `tat` must wait, if it must.
    fn wait(&self, tat: u64, now_ms: u64) -> Option<u64> {
        let Allowance { burst, every_ms } = self.allowance;
        let allowed_from = tat.saturating_sub((burst - 1).saturating_mul(every_ms));
        (allowed_from > now_ms).then(|| allowed_from - now_ms)
    }
}

/// The key newcomers share while the table is full of throttled peers (no peer has it:
/// [`peer_key`] never gives the unspecified address, which no TCP peer has).
const OVERFLOW: IpAddr = IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED);

/// Room in a full table: forget every peer whose allowance is whole again (forgetting
/// them changes nothing). A throttled peer is never forgotten to let another in.
fn make_room(peers: &mut HashMap<IpAddr, u64>, now_ms: u64) {
    peers.retain(|_, tat| *tat > now_ms);
}

/// The peer as the table counts it: an IPv4 address (an IPv4-mapped IPv6 one as IPv4),
/// or the /64 of an IPv6 one.
fn peer_key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => {
            let bits = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(bits.into())
        }
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BURST: u64 = 10;
    const EVERY_MS: u64 = 1_000;

    fn failures() -> Failures {
        Failures::new(Allowance {
            burst: BURST,
            every_ms: EVERY_MS,
        })
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_peer_fails_a_burst_then_one_per_interval() {
        let g = failures();
        let p = ip("198.51.100.7");
        for _ in 0..BURST {
            assert_eq!(g.throttled(p, 0), None);
            let _ = g.charge(p, 0);
        }
        assert_eq!(
            g.throttled(p, 0),
            Some(EVERY_MS),
            "the allowance is used up"
        );
        assert_eq!(g.throttled(p, 400), Some(600));
        assert_eq!(g.throttled(p, 1_000), None, "one more a second");
        let _ = g.charge(p, 1_000);
        assert_eq!(g.throttled(p, 1_000), Some(1_000));
        assert_eq!(
            g.throttled(ip("198.51.100.8"), 1_000),
            None,
            "others are not slowed"
        );
        // Idle long enough, the whole burst again.
        assert_eq!(g.throttled(p, 11_000), None);
        for _ in 0..BURST {
            assert_eq!(g.throttled(p, 11_000), None);
            let _ = g.charge(p, 11_000);
        }
        assert!(g.throttled(p, 11_000).is_some());
    }

    #[test]
    fn an_ipv6_host_is_its_64_and_mapped_v4_is_v4() {
        let g = failures();
        for i in 0..BURST {
            let _ = g.charge(ip(&format!("2001:db8:1:2::{i:x}")), 0);
        }
        assert!(g.throttled(ip("2001:db8:1:2:ffff::1"), 0).is_some());
        assert_eq!(g.throttled(ip("2001:db8:1:3::1"), 0), None);
        for _ in 0..BURST {
            let _ = g.charge(ip("::ffff:192.0.2.1"), 0);
        }
        assert!(g.throttled(ip("192.0.2.1"), 0).is_some());
    }

    #[test]
    fn the_table_is_bounded_and_forgets_whole_peers_first() {
        let g = failures();
        let held = ip("203.0.113.1");
        for _ in 0..BURST {
            assert!(g.charge(held, 0).is_ok());
        }
        assert!(g.charge(held, 0).is_err(), "its allowance is used up");
        for i in 0..MAX_PEERS as u32 + 500 {
            let _ = g.charge(IpAddr::from((10u32 << 24 | i).to_be_bytes()), 0);
            assert!(g.len() <= MAX_PEERS + 1);
        }
        assert!(
            g.throttled(held, 0).is_some(),
            "a throttled peer is never forgotten to let another in"
        );
        // A second later `held` fails once more; the others, one failure each, are whole.
        assert!(g.charge(held, 1_000).is_ok());
        // A newcomer then clears out the whole ones, not the held one.
        assert!(g.charge(ip("203.0.113.2"), 1_500).is_ok());
        assert!(g.len() < 10, "{}", g.len());
        assert!(g.throttled(held, 1_500).is_some());
    }

    #[test]
    fn a_guesser_rotating_networks_past_the_table_gets_one_allowance_for_all() {
        let g = failures();
        // Fill the table with throttled /64s of one /48.
        let net = |i: u32| {
            IpAddr::from(((0x2001_0db8_0001u128 << 80) | (u128::from(i) << 64) | 1).to_be_bytes())
        };
        for i in 0..MAX_PEERS as u32 {
            for _ in 0..BURST {
                assert!(g.charge(net(i), 0).is_ok());
            }
        }
        assert_eq!(g.len(), MAX_PEERS);
        // Newcomers: BURST calls in all, then 429s, however many networks they come from.
        let passed = (MAX_PEERS as u32..MAX_PEERS as u32 + 200)
            .filter(|&i| g.charge(net(i), 0).is_ok())
            .count();
        assert_eq!(passed, BURST as usize);
        assert!(g.len() <= MAX_PEERS + 1, "{}", g.len());
        assert!(g.throttled(net(MAX_PEERS as u32 + 300), 0).is_some());
    }

    #[test]
    fn a_check_that_passed_gets_its_charge_back_and_reservations_are_atomic() {
        let g = failures();
        let p = ip("198.51.100.9");
        for _ in 0..3 * BURST {
            let key = g.charge(p, 0).expect("never slowed");
            g.refund(key, 0);
        }
        assert!(g.is_empty(), "nothing kept of a peer that only succeeded");
        assert!(!g.any.load(Relaxed), "and the fast path is open again");
        // Concurrent failures spend one allowance: BURST pass, however many threads.
        let g = std::sync::Arc::new(failures());
        let passed: usize = (0..8)
            .map(|_| {
                let g = g.clone();
                std::thread::spawn(move || (0..10).filter(|_| g.charge(p, 0).is_ok()).count())
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .sum();
        assert_eq!(passed, BURST as usize);
    }

    #[test]
    fn a_slow_allowance_refills_at_its_own_pace() {
        // "10/m", burst 20: 20 at once, then one every 6 s.
        let g = Failures::new(Allowance {
            burst: 20,
            every_ms: 6_000,
        });
        let p = ip("192.0.2.44");
        assert_eq!((0..30).filter(|_| g.charge(p, 0).is_ok()).count(), 20);
        assert_eq!(g.throttled(p, 0), Some(6_000));
        assert_eq!(g.throttled(p, 5_999), Some(1));
        assert!(g.charge(p, 6_000).is_ok());
        assert!(g.charge(p, 6_000).is_err());
    }

    #[test]
    fn failures_are_logged_at_most_once_per_interval_with_the_count() {
        let g = failures();
        assert_eq!(g.log_due(5), Some(1));
        assert_eq!(g.log_due(6), None);
        assert_eq!(g.log_due(7), None);
        assert_eq!(g.log_due(5 + WARN_EVERY_MS), Some(3));
        assert_eq!(g.log_due(6 + WARN_EVERY_MS), None);
    }
}
