//! The admin token's guard against guessing: a small allowance of failed calls per peer,
//! in front of the token check.
//!
//! Each peer (an IPv4 address, or an IPv6 /64: one host holds a whole /64) may fail
//! [`BURST`] admin calls at once, then one more every [`EVERY_MS`] (a GCRA, one integer
//! per peer, as the limiter's own). While its allowance is used up, its `/admin/*` calls
//! are answered 429 with a `Retry-After`, and their token is not even checked: a guesser
//! learns nothing from them, so it gets through one guess a second instead of a hundred
//! thousand. Only failures are charged: a peer that sends the right token is never slowed
//! — unless it shares its address with a guesser, and then it waits for the allowance as
//! the guesser does (at most a second at a time).
//!
//! The peers are bounded ([`MAX_PEERS`]): when the table is full, peers whose allowance is
//! whole again are forgotten first (forgetting them changes nothing), then the one whose
//! last failure is oldest. Failures are logged at most once every [`WARN_EVERY_MS`], with
//! the peer and how many failed since; never the token.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

/// Failed calls a peer may make at once.
pub const BURST: u64 = 10;
/// Then one more per this long, in milliseconds.
pub const EVERY_MS: u64 = 1_000;
/// Peers remembered at most (about 50 bytes each).
pub const MAX_PEERS: usize = 4096;
/// At most one log line about failed admin calls per this long.
const WARN_EVERY_MS: u64 = 10_000;

/// Why an admin call was refused for its token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// No `Authorization: Bearer` token.
    Missing,
    Wrong,
    /// Not checked: the peer's allowance of failures is used up.
    Throttled,
}

impl Failure {
    pub fn name(self) -> &'static str {
        match self {
            Failure::Missing => "missing",
            Failure::Wrong => "wrong",
            Failure::Throttled => "throttled",
        }
    }
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
    pub fn throttled(&self, peer: IpAddr, now_ms: u64) -> Option<u64> {
        let tat = *self.lock().get(&peer_key(peer))?;
        let allowed_from = tat.saturating_sub((BURST - 1) * EVERY_MS);
        (allowed_from > now_ms).then(|| allowed_from - now_ms)
    }

    /// `peer` failed an admin call: charge its allowance.
    pub fn failed(&self, peer: IpAddr, now_ms: u64) {
        let key = peer_key(peer);
        let mut peers = self.lock();
        if peers.len() >= MAX_PEERS && !peers.contains_key(&key) {
            make_room(&mut peers, now_ms);
        }
        let tat = peers.entry(key).or_insert(now_ms);
        *tat = (*tat).max(now_ms) + EVERY_MS;
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

/// Room for one more peer in a full table: forget every peer whose allowance is whole
/// again; if none is, the one whose allowance is closest to whole (its failures the
/// oldest).
fn make_room(peers: &mut HashMap<IpAddr, u64>, now_ms: u64) {
    peers.retain(|_, tat| *tat > now_ms);
    if peers.len() < MAX_PEERS {
        return;
    }
    if let Some(oldest) = peers.iter().min_by_key(|(_, tat)| **tat).map(|(k, _)| *k) {
        peers.remove(&oldest);
    }
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
            g.failed(p, 0);
        }
        assert_eq!(
            g.throttled(p, 0),
            Some(EVERY_MS),
            "the allowance is used up"
        );
        assert_eq!(g.throttled(p, 400), Some(600));
        assert_eq!(g.throttled(p, 1_000), None, "one more a second");
        g.failed(p, 1_000);
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
            g.failed(p, 11_000);
        }
        assert!(g.throttled(p, 11_000).is_some());
    }

    #[test]
    fn an_ipv6_host_is_its_64_and_mapped_v4_is_v4() {
        let g = Guard::new();
        for i in 0..BURST {
            g.failed(ip(&format!("2001:db8:1:2::{i:x}")), 0);
        }
        assert!(g.throttled(ip("2001:db8:1:2:ffff::1"), 0).is_some());
        assert_eq!(g.throttled(ip("2001:db8:1:3::1"), 0), None);
        for _ in 0..BURST {
            g.failed(ip("::ffff:192.0.2.1"), 0);
        }
        assert!(g.throttled(ip("192.0.2.1"), 0).is_some());
    }

    #[test]
    fn the_table_is_bounded_and_forgets_whole_peers_first() {
        let g = Guard::new();
        let held = ip("203.0.113.1");
        for _ in 0..2 * BURST {
            g.failed(held, 0);
        }
        for i in 0..MAX_PEERS as u32 + 500 {
            g.failed(IpAddr::from((10u32 << 24 | i).to_be_bytes()), 0);
            assert!(g.len() <= MAX_PEERS);
        }
        assert!(
            g.throttled(held, 0).is_some(),
            "the peer furthest from whole is the last to go"
        );
        // Once the others are whole again, a newcomer clears them out, not the held one.
        g.failed(ip("203.0.113.2"), 1_500);
        assert!(g.len() < 10, "{}", g.len());
        assert!(g.throttled(held, 1_500).is_some());
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
