//! The admin token's guard against guessing: a small allowance of failed calls per peer,
//! in front of the token check.
//!
//! Each peer (an IPv4 address, or an IPv6 /64: one host holds a whole /64) may fail
//! [`BURST`] admin calls at once, then one more every [`EVERY_MS`] (a GCRA, one integer
//! per peer, as the limiter's own). While its allowance is used up, its `/admin/*` calls
//! are answered 429 with a `Retry-After`, and their token is not even checked: a guesser
//! learns nothing from them, so it gets through one guess a second instead of a hundred
//! thousand. A call is charged before its token is checked, under one lock
//! ([`Guard::reserve`]), so concurrent calls (HTTP/2 streams on several workers) cannot
//! all pass an allowance of one; a call whose token was right is given its charge back
//! ([`Guard::refund`]). So a peer that sends the right token is never slowed — unless it
//! shares its address with a guesser, and then it waits for the allowance as the guesser
//! does (at most a second at a time).
//!
//! The peers are bounded ([`MAX_PEERS`]): when the table is full, peers whose allowance is
//! whole again are forgotten first (forgetting them changes nothing). If every one is
//! still throttled, a newcomer is not let in by forgetting one (a guesser cycling through
//! more networks than the table holds would come back fresh each time): newcomers share
//! one allowance, the overflow's, until room is made. Failures are logged at most once
//! every [`WARN_EVERY_MS`], with the peer and how many failed since; never the token.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::gateway::all_metrics::AdminFailureLabels;

/// Failed calls a peer may make at once.
pub const BURST: u64 = 10;
/// Then one more per this long, in milliseconds.
pub const EVERY_MS: u64 = 1_000;
/// Peers remembered at most (about 50 bytes each).
pub const MAX_PEERS: usize = 4096;
/// At most one log line about failed admin calls per this long.
const WARN_EVERY_MS: u64 = 10_000;

crate::metrics::label_enum! {
    /// Why an admin call was refused for its token.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Failure {
        /// No `Authorization: Bearer` token.
        Missing = "missing",
        Wrong = "wrong",
        /// Not checked: the peer's allowance of failures is used up.
        Throttled = "throttled",
    }
}

/// `ratewall_admin_auth_failures_total` (registered with the gateway's metrics, which sit
/// below the admin listener and so cannot name [`Failure`]): every reason's series, at zero.
pub fn count_from_zero(failures: &Family<AdminFailureLabels, Counter>) {
    for why in Failure::ALL {
        let _ = failures.get_or_create(&AdminFailureLabels { reason: why.name() });
    }
}

/// Count one call refused for its token.
pub fn count(failures: &Family<AdminFailureLabels, Counter>, why: Failure) {
    failures
        .get_or_create(&AdminFailureLabels { reason: why.name() })
        .inc();
}

/// The guard of one admin listener. Times are milliseconds on the caller's clock
/// ([`Guard::now_ms`] in the listener; tests move it by hand).
pub struct Guard {
    epoch: std::time::Instant,
    /// Per peer, the GCRA's theoretical arrival time: when its allowance is whole again.
    peers: Mutex<HashMap<IpAddr, u64>>,
    /// When failures were last logged (0: never), and how many came since.
    warned_ms: AtomicU64,
    since: AtomicU64,
}

impl Default for Guard {
    fn default() -> Self {
        Guard::new()
    }
}

impl Guard {
    pub fn new() -> Guard {
        Guard {
            epoch: std::time::Instant::now(),
            peers: Mutex::new(HashMap::new()),
            warned_ms: AtomicU64::new(0),
            since: AtomicU64::new(0),
        }
    }

    /// Milliseconds since the guard was made.
    pub fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, u64>> {
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How long `peer` must wait (ms) before its next admin call is checked, if it must.
    #[cfg(test)]
    fn throttled(&self, peer: IpAddr, now_ms: u64) -> Option<u64> {
        let peers = self.lock();
        let tat = *peers.get(&peer_key(peer)).or_else(|| {
            // A newcomer while the table is full shares the overflow's allowance.
            (peers.len() >= MAX_PEERS)
                .then(|| peers.get(&OVERFLOW))
                .flatten()
        })?;
        wait(tat, now_ms)
    }

    /// Before `peer`'s token is checked: charge its allowance, or say how long (ms) it must
    /// wait. One lock for both, so no two calls spend one allowance. Give the charge back
    /// with [`Guard::refund`] if the token was right.
    pub fn reserve(&self, peer: IpAddr, now_ms: u64) -> Result<IpAddr, u64> {
        let mut key = peer_key(peer);
        let mut peers = self.lock();
        if !peers.contains_key(&key) && peers.len() >= MAX_PEERS {
            make_room(&mut peers, now_ms);
            if peers.len() >= MAX_PEERS {
                key = OVERFLOW;
            }
        }
        let tat = peers.entry(key).or_insert(now_ms);
        if let Some(ms) = wait(*tat, now_ms) {
            return Err(ms);
        }
        *tat = (*tat).max(now_ms) + EVERY_MS;
        Ok(key)
    }

    /// The call `reserve` charged to `key` was authorized: its charge back.
    pub fn refund(&self, key: IpAddr, now_ms: u64) {
        let mut peers = self.lock();
        if let Some(tat) = peers.get_mut(&key) {
            *tat = tat.saturating_sub(EVERY_MS);
            if *tat <= now_ms {
                peers.remove(&key);
            }
        }
    }

    /// Peers remembered now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
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
}

/// The key newcomers share while the table is full of throttled peers (no peer has it:
/// [`peer_key`] never gives the unspecified address, which no TCP peer has).
const OVERFLOW: IpAddr = IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED);

/// How long (ms) a peer whose GCRA stands at `tat` must wait, if it must.
fn wait(tat: u64, now_ms: u64) -> Option<u64> {
    let allowed_from = tat.saturating_sub((BURST - 1) * EVERY_MS);
    (allowed_from > now_ms).then(|| allowed_from - now_ms)
}

/// Room in a full table: forget every peer whose allowance is whole again (forgetting
/// them changes nothing). A throttled peer is never forgotten to let another in.
fn make_room(peers: &mut HashMap<IpAddr, u64>, now_ms: u64) {
    peers.retain(|_, tat| *tat > now_ms);
}

/// The peer as the guard counts it: an IPv4 address (an IPv4-mapped IPv6 one as IPv4), or
/// the /64 of an IPv6 one.
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

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_peer_fails_a_burst_then_one_a_second() {
        let g = Guard::new();
        let p = ip("198.51.100.7");
        for _ in 0..BURST {
            assert_eq!(g.throttled(p, 0), None);
            let _ = g.reserve(p, 0);
        }
        assert_eq!(
            g.throttled(p, 0),
            Some(EVERY_MS),
            "the allowance is used up"
        );
        assert_eq!(g.throttled(p, 400), Some(600));
        assert_eq!(g.throttled(p, 1_000), None, "one more a second");
        let _ = g.reserve(p, 1_000);
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
            let _ = g.reserve(p, 11_000);
        }
        assert!(g.throttled(p, 11_000).is_some());
    }

    #[test]
    fn an_ipv6_host_is_its_64_and_mapped_v4_is_v4() {
        let g = Guard::new();
        for i in 0..BURST {
            let _ = g.reserve(ip(&format!("2001:db8:1:2::{i:x}")), 0);
        }
        assert!(g.throttled(ip("2001:db8:1:2:ffff::1"), 0).is_some());
        assert_eq!(g.throttled(ip("2001:db8:1:3::1"), 0), None);
        for _ in 0..BURST {
            let _ = g.reserve(ip("::ffff:192.0.2.1"), 0);
        }
        assert!(g.throttled(ip("192.0.2.1"), 0).is_some());
    }

    #[test]
    fn the_table_is_bounded_and_forgets_whole_peers_first() {
        let g = Guard::new();
        let held = ip("203.0.113.1");
        for _ in 0..BURST {
            assert!(g.reserve(held, 0).is_ok());
        }
        assert!(g.reserve(held, 0).is_err(), "its allowance is used up");
        for i in 0..MAX_PEERS as u32 + 500 {
            let _ = g.reserve(IpAddr::from((10u32 << 24 | i).to_be_bytes()), 0);
            assert!(g.len() <= MAX_PEERS + 1);
        }
        assert!(
            g.throttled(held, 0).is_some(),
            "a throttled peer is never forgotten to let another in"
        );
        // A second later `held` fails once more; the others, one failure each, are whole.
        assert!(g.reserve(held, 1_000).is_ok());
        // A newcomer then clears out the whole ones, not the held one.
        assert!(g.reserve(ip("203.0.113.2"), 1_500).is_ok());
        assert!(g.len() < 10, "{}", g.len());
        assert!(g.throttled(held, 1_500).is_some());
    }

    #[test]
    fn a_guesser_rotating_networks_past_the_table_gets_one_allowance_for_all() {
        let g = Guard::new();
        // Fill the table with throttled /64s of one /48.
        let net = |i: u32| {
            IpAddr::from(((0x2001_0db8_0001u128 << 80) | (u128::from(i) << 64) | 1).to_be_bytes())
        };
        for i in 0..MAX_PEERS as u32 {
            for _ in 0..BURST {
                assert!(g.reserve(net(i), 0).is_ok());
            }
        }
        assert_eq!(g.len(), MAX_PEERS);
        // Newcomers: BURST calls in all, then 429s, however many networks they come from.
        let passed = (MAX_PEERS as u32..MAX_PEERS as u32 + 200)
            .filter(|&i| g.reserve(net(i), 0).is_ok())
            .count();
        assert_eq!(passed, BURST as usize);
        assert!(g.len() <= MAX_PEERS + 1, "{}", g.len());
        assert!(g.throttled(net(MAX_PEERS as u32 + 300), 0).is_some());
    }

    #[test]
    fn a_right_token_gets_its_charge_back_and_reservations_are_atomic() {
        let g = Guard::new();
        let p = ip("198.51.100.9");
        for _ in 0..3 * BURST {
            let key = g.reserve(p, 0).expect("never slowed");
            g.refund(key, 0);
        }
        assert_eq!(g.len(), 0, "nothing kept of a peer that only succeeded");
        // Concurrent failures spend one allowance: BURST pass, however many threads.
        let g = std::sync::Arc::new(Guard::new());
        let passed: usize = (0..8)
            .map(|_| {
                let g = g.clone();
                std::thread::spawn(move || (0..10).filter(|_| g.reserve(p, 0).is_ok()).count())
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .sum();
        assert_eq!(passed, BURST as usize);
    }

    #[test]
    fn failures_are_logged_at_most_once_per_interval_with_the_count() {
        let g = Guard::new();
        assert_eq!(g.log_due(5), Some(1));
        assert_eq!(g.log_due(6), None);
        assert_eq!(g.log_due(7), None);
        assert_eq!(g.log_due(5 + WARN_EVERY_MS), Some(3));
        assert_eq!(g.log_due(6 + WARN_EVERY_MS), None);
    }
}
