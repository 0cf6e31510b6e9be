//! Which of a pool's servers a request goes to: the pure choice, given what the runtime
//! knows of each server at that moment (available or not, requests in flight, weight).
//!
//! A [`Balancer`] is built once per server list (at load, and again when a re-resolve or
//! a reload changes the list: building is a few passes over the weights) and shared by
//! every worker thread. [`Balancer::pick`] allocates nothing and takes no lock: round
//! robin is one atomic add on a cursor over a schedule computed at build time, the others
//! read the runtime's view of the servers and nothing else.
//!
//! - Round robin is nginx's smooth weighted round robin (`ngx_http_upstream_round_robin.c`,
//!   `ngx_http_upstream_get_peer`): with weights 2:1:1 the order is `a b c a`, never `a a b
//!   c`, so a heavier server does not take bursts. Its whole cycle is computed at build
//!   time (the weights divided by their greatest common divisor first, which leaves the
//!   order unchanged and the cycle short), and `pick` walks it with an atomic cursor.
//! - Least requests is nginx's `least_conn`: the fewest requests in flight for the
//!   weight, compared by cross-multiplication (`a.in_flight * b.weight < b.in_flight *
//!   a.weight`), integers only; ties go to one of the tied servers at random.
//! - Random two is the power of two choices (Mitzenmacher; nginx's `random two`, Envoy's
//!   `LEAST_REQUEST` with `choice_count = 2`): two distinct servers at random, the one
//!   with fewer requests in flight for its weight.
//! - Hash is ketama-style consistent hashing, as nginx's `hash … consistent`: each server
//!   owns [`POINTS_PER_WEIGHT`] points per unit of weight on a ring of `u64`s, placed by
//!   the SHA-256 of its label, and a key goes to the first point at or after its hash.
//!   Adding or removing one of N servers moves about 1/N of the keys, and every gateway
//!   maps a key the same way (no per-process hash seed). An unavailable server's keys go
//!   to the next available server on the ring; a request without a key is balanced round
//!   robin.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use super::Balance;
use crate::identity::sha256;

/// Ring points per unit of weight: four times nginx's 160 (`hash … consistent`), so that a
/// server's share of the keys strays about half as far from its weight's (at 160, a fourth
/// server of weight 1 took 20.5 % to 29.3 % of keys over 25 runs, and past 30 % about once
/// in a hundred; Envoy's rings hold at least 1,024 points). Building costs one SHA-256 per
/// four points, at load and on re-resolve only; a pick is one binary search.
pub const POINTS_PER_WEIGHT: usize = 640;

/// The most points a ring holds (12 bytes each, under 8 MiB): a pool whose weights sum past 1,024 has
/// its servers' points scaled down to fit, in proportion to their weights (Envoy's
/// `maximum_ring_size` does the same). Below it, adding or removing a server leaves every
/// other server's points where they were.
pub const MAX_RING_POINTS: usize = 1024 * POINTS_PER_WEIGHT;

/// What `pick` needs to know of one server, read by the runtime at the moment of the pick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// Whether the server may take a request now (its health says so).
    pub available: bool,
    /// Requests sent to it whose answer has not come back.
    pub in_flight: u32,
    /// Its weight (0 counts as 1).
    pub weight: u32,
}

/// The runtime's view of a pool's servers, read one at a time so that a pick copies
/// nothing: implemented for `[Candidate]`, and by the runtime for its own server list.
/// Index `i` must be the `i`-th server the [`Balancer`] was built from.
pub trait Candidates {
    /// How many servers there are.
    fn len(&self) -> usize;
    /// The `i`-th server as it is now (`i < len()`).
    fn candidate(&self, i: usize) -> Candidate;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Candidates for [Candidate] {
    fn len(&self) -> usize {
        <[Candidate]>::len(self)
    }
    fn candidate(&self, i: usize) -> Candidate {
        self[i]
    }
}

/// A pool's way of picking a server, built from its `balance` and its servers.
#[derive(Debug)]
pub struct Balancer {
    kind: Kind,
    /// One cycle of smooth weighted round robin, as server indices (round robin and hash,
    /// whose keyless requests go round robin; empty otherwise).
    schedule: Box<[u32]>,
    /// The next slot of `schedule`, shared by every worker.
    cursor: AtomicUsize,
}

#[derive(Debug)]
enum Kind {
    RoundRobin,
    LeastRequests,
    RandomTwo,
    Hash(Ring),
}

/// The consistent-hashing ring: sorted points, and the server owning each.
#[derive(Debug)]
struct Ring {
    points: Box<[u64]>,
    owners: Box<[u32]>,
}

impl Balancer {
    /// The balancer for `balance` over `servers`, each its label (what the metrics show:
    /// a hashed key's server is found by it, so it must be the same on every gateway) and
    /// its weight (0 counts as 1).
    pub fn new<'a>(
        balance: &Balance,
        servers: impl IntoIterator<Item = (&'a str, u32)>,
    ) -> Balancer {
        let servers: Vec<(&str, u32)> = servers.into_iter().map(|(l, w)| (l, w.max(1))).collect();
        let (kind, schedule) = match balance {
            Balance::RoundRobin => (Kind::RoundRobin, smooth_schedule(&servers)),
            Balance::LeastRequests => (Kind::LeastRequests, Box::default()),
            Balance::RandomTwo => (Kind::RandomTwo, Box::default()),
            Balance::Hash(_) => (Kind::Hash(Ring::new(&servers)), smooth_schedule(&servers)),
        };
        Balancer {
            kind,
            schedule,
            cursor: AtomicUsize::new(0),
        }
    }

    /// The server the next request goes to, as an index into `servers`, or `None` when no
    /// server is available. `hash` is the request's key for a hashing pool ([`key_hash`]
    /// of its identity; `None` balances it round robin); `random` is 64 random bits (ties
    /// and random choices take them, so the same inputs give the same pick).
    pub fn pick<S: Candidates + ?Sized>(
        &self,
        servers: &S,
        hash: Option<u64>,
        random: u64,
    ) -> Option<usize> {
        match (&self.kind, hash) {
            (Kind::Hash(ring), Some(h)) => ring.pick(servers, h),
            (Kind::RoundRobin | Kind::Hash(_), _) => self.round_robin(servers),
            (Kind::LeastRequests, _) => least_requests(servers, random),
            (Kind::RandomTwo, _) => random_two(servers, random),
        }
    }

    /// The next available server of the schedule. Each pick takes its slot with one atomic
    /// add; a pick that lands on an unavailable server walks on to the next available
    /// slot and moves the cursor past the slots it skipped, so the unavailable server's
    /// share is spread over the others by their weights, not handed to its neighbour.
    fn round_robin<S: Candidates + ?Sized>(&self, servers: &S) -> Option<usize> {
        let len = self.schedule.len();
        if len == 0 {
            return None;
        }
        let start = self.cursor.fetch_add(1, Relaxed);
        let first = self.schedule[start % len] as usize;
        if is_available(servers, first) {
            return Some(first);
        }
        // The slow path: first make sure the walk ends (some server is available).
        if !(0..servers.len()).any(|i| servers.candidate(i).available) {
            return None;
        }
        for skipped in 1..len {
            let i = self.schedule[start.wrapping_add(skipped) % len] as usize;
            if is_available(servers, i) {
                self.cursor.fetch_add(skipped, Relaxed);
                return Some(i);
            }
        }
        // Only servers past the ones built from are available: not this balancer's list.
        None
    }
}

/// A stable 64-bit hash of a request's key (FNV-1a, then MurmurHash3's `fmix64` so that
/// keys differing in their last byte land far apart on the ring): the same on every
/// gateway and every run, unlike std's `RandomState`.
pub fn key_hash(key: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in key {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

fn is_available<S: Candidates + ?Sized>(servers: &S, i: usize) -> bool {
    i < servers.len() && servers.candidate(i).available
}

/// Whether `a` has fewer requests in flight for its weight than `b`: `a.in_flight /
/// a.weight < b.in_flight / b.weight`, cross-multiplied (nginx's `least_conn` compares
/// the same way), so no division and no rounding.
fn lighter(a: Candidate, b: Candidate) -> bool {
    u64::from(a.in_flight) * u64::from(b.weight.max(1))
        < u64::from(b.in_flight) * u64::from(a.weight.max(1))
}

/// `r` (32 random bits) scaled to `0..n` without a division (Lemire's multiply-shift).
fn below(r: u32, n: usize) -> usize {
    ((u64::from(r) * n as u64) >> 32) as usize
}

/// The available server with the fewest requests in flight for its weight; among equals,
/// one at random. Two passes over the servers: the lightest load, then the chosen tie.
fn least_requests<S: Candidates + ?Sized>(servers: &S, random: u64) -> Option<usize> {
    let mut best: Option<Candidate> = None;
    let mut ties = 0usize;
    for i in 0..servers.len() {
        let c = servers.candidate(i);
        if !c.available {
            continue;
        }
        match best {
            Some(b) if lighter(b, c) => {}
            Some(b) if !lighter(c, b) => ties += 1,
            _ => {
                best = Some(c);
                ties = 1;
            }
        }
    }
    let best = best?;
    let mut nth = below(random as u32, ties);
    (0..servers.len()).find(|&i| {
        let c = servers.candidate(i);
        if c.available && !lighter(c, best) && !lighter(best, c) {
            if nth == 0 {
                return true;
            }
            nth -= 1;
        }
        false
    })
}

/// Two distinct available servers drawn at random (the low and the high 32 bits of
/// `random`), the one with fewer requests in flight for its weight (the first drawn on a
/// tie); the only one if one is available.
fn random_two<S: Candidates + ?Sized>(servers: &S, random: u64) -> Option<usize> {
    let available = (0..servers.len())
        .filter(|&i| servers.candidate(i).available)
        .count();
    let nth_available = |n: usize| {
        (0..servers.len())
            .filter(|&i| servers.candidate(i).available)
            .nth(n)
    };
    match available {
        0 => None,
        1 => nth_available(0),
        m => {
            let a = below(random as u32, m);
            let mut b = below((random >> 32) as u32, m - 1);
            if b >= a {
                b += 1;
            }
            let (a, b) = (nth_available(a)?, nth_available(b)?);
            if lighter(servers.candidate(b), servers.candidate(a)) {
                Some(b)
            } else {
                Some(a)
            }
        }
    }
}

/// One cycle of nginx's smooth weighted round robin over `servers`' weights: at each step
/// every server's current weight grows by its weight, the largest (the first of equals)
/// is picked and loses the total. The weights are divided by their greatest common
/// divisor first: the order is the same, and the cycle as short as it can be. Costs
/// `servers × cycle` steps, once per build.
fn smooth_schedule(servers: &[(&str, u32)]) -> Box<[u32]> {
    let g = servers.iter().fold(0, |g, &(_, w)| gcd(g, w));
    if g == 0 {
        return Box::default();
    }
    let weights: Vec<i64> = servers.iter().map(|&(_, w)| i64::from(w / g)).collect();
    let total: i64 = weights.iter().sum();
    let mut current = vec![0i64; weights.len()];
    let mut schedule = Vec::with_capacity(total as usize);
    for _ in 0..total {
        let mut best = 0;
        for (i, w) in weights.iter().enumerate() {
            current[i] += w;
            if current[i] > current[best] {
                best = i;
            }
        }
        current[best] -= total;
        schedule.push(best as u32);
    }
    schedule.into_boxed_slice()
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl Ring {
    /// Each server's points: `POINTS_PER_WEIGHT × weight` of them (scaled to fit
    /// [`MAX_RING_POINTS`], at least one each), the `u64`s read from SHA-256 digests of
    /// `"<label>-<n>"`, four per digest (ketama takes four from each MD5 the same way).
    /// Sorted by point, equal points by label, so the ring is the same whatever the
    /// servers' order.
    fn new(servers: &[(&str, u32)]) -> Ring {
        let total: u64 = servers.iter().map(|&(_, w)| u64::from(w)).sum();
        let unscaled = total.saturating_mul(POINTS_PER_WEIGHT as u64);
        let points_of = |w: u32| -> usize {
            if unscaled <= MAX_RING_POINTS as u64 {
                w as usize * POINTS_PER_WEIGHT
            } else {
                ((u64::from(w) * MAX_RING_POINTS as u64 / total) as usize).max(1)
            }
        };
        let mut ring: Vec<(u64, u32)> = Vec::new();
        for (owner, &(label, w)) in servers.iter().enumerate() {
            let n = points_of(w);
            ring.reserve(n);
            for digest in 0..n.div_ceil(4) {
                let d = sha256(format!("{label}-{digest}").as_bytes());
                for chunk in d.chunks_exact(8).take(n - digest * 4) {
                    let mut b = [0u8; 8];
                    b.copy_from_slice(chunk);
                    ring.push((u64::from_be_bytes(b), owner as u32));
                }
            }
        }
        ring.sort_unstable_by(|a, b| {
            a.0.cmp(&b.0)
                .then_with(|| servers[a.1 as usize].0.cmp(servers[b.1 as usize].0))
                .then(a.1.cmp(&b.1))
        });
        Ring {
            points: ring.iter().map(|p| p.0).collect(),
            owners: ring.iter().map(|p| p.1).collect(),
        }
    }

    /// The owner of the first point at or after `hash` (past the last, the first), or of
    /// the next point after it whose owner is available.
    fn pick<S: Candidates + ?Sized>(&self, servers: &S, hash: u64) -> Option<usize> {
        let len = self.points.len();
        let start = self.points.partition_point(|&p| p < hash);
        (0..len)
            .map(|k| self.owners[(start + k) % len] as usize)
            .find(|&i| is_available(servers, i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::{Key, KeyKind, MissingKey};

    fn up(weight: u32) -> Candidate {
        Candidate {
            available: true,
            in_flight: 0,
            weight,
        }
    }

    fn down(weight: u32) -> Candidate {
        Candidate {
            available: false,
            ..up(weight)
        }
    }

    fn labels(n: usize) -> Vec<String> {
        (0..n)
            .map(|i| format!("http://10.0.0.{}:8080", i + 1))
            .collect()
    }

    fn balancer(balance: &Balance, labels: &[String], weights: &[u32]) -> Balancer {
        Balancer::new(
            balance,
            labels
                .iter()
                .map(String::as_str)
                .zip(weights.iter().copied()),
        )
    }

    fn hash_balance() -> Balance {
        Balance::Hash(Key {
            kind: KeyKind::ApiKey,
            missing: MissingKey::Reject,
        })
    }

    /// How many of `picks` picks went to each of `servers`.
    fn split(b: &Balancer, servers: &[Candidate], picks: usize) -> Vec<usize> {
        let mut counts = vec![0; servers.len()];
        for r in 0..picks {
            counts[b
                .pick(
                    servers,
                    None,
                    (r as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
                )
                .unwrap()] += 1;
        }
        counts
    }

    #[test]
    fn round_robin_splits_exactly_by_weight() {
        let b = balancer(&Balance::RoundRobin, &labels(3), &[1, 1, 1]);
        assert_eq!(split(&b, &[up(1); 3], 30), [10, 10, 10]);
        let b = balancer(&Balance::RoundRobin, &labels(3), &[2, 1, 1]);
        let servers = [up(2), up(1), up(1)];
        assert_eq!(split(&b, &servers, 40), [20, 10, 10]);
    }

    #[test]
    fn round_robin_is_smooth() {
        // nginx's order for 5:1:1 is a a b a c a a, never five a in a row.
        let b = balancer(&Balance::RoundRobin, &labels(3), &[5, 1, 1]);
        let servers = [up(5), up(1), up(1)];
        let order: Vec<usize> = (0..7)
            .map(|_| b.pick(&servers[..], None, 0).unwrap())
            .collect();
        assert_eq!(order, [0, 0, 1, 0, 2, 0, 0]);
        // Weights 2:1:1 go a b c a.
        let b = balancer(&Balance::RoundRobin, &labels(3), &[200, 100, 100]);
        assert_eq!(&*b.schedule, &[0, 1, 2, 0]);
    }

    #[test]
    fn round_robin_spreads_an_unavailable_servers_share_by_weight() {
        let b = balancer(&Balance::RoundRobin, &labels(3), &[1, 1, 1]);
        let servers = [up(1), up(1), down(1)];
        assert_eq!(split(&b, &servers, 30), [15, 15, 0]);
        let b = balancer(&Balance::RoundRobin, &labels(4), &[2, 1, 1, 4]);
        let servers = [up(2), up(1), up(1), down(4)];
        assert_eq!(split(&b, &servers, 40), [20, 10, 10, 0]);
    }

    #[test]
    fn nothing_available_is_none() {
        for balance in [
            Balance::RoundRobin,
            Balance::LeastRequests,
            Balance::RandomTwo,
            hash_balance(),
        ] {
            let b = balancer(&balance, &labels(3), &[1, 2, 3]);
            let servers = [down(1), down(2), down(3)];
            for r in 0..10u64 {
                assert_eq!(b.pick(&servers[..], Some(r), r), None, "{balance:?}");
                assert_eq!(b.pick(&servers[..], None, r), None, "{balance:?}");
            }
            assert_eq!(b.pick(&[][..], Some(1), 1), None, "{balance:?}");
            let empty = Balancer::new(&balance, []);
            assert_eq!(empty.pick(&servers[..], Some(1), 1), None, "{balance:?}");
        }
    }

    #[test]
    fn least_requests_prefers_the_lightest_for_its_weight() {
        let b = balancer(&Balance::LeastRequests, &labels(3), &[1, 1, 1]);
        let mut servers = [up(1), up(1), up(1)];
        servers[0].in_flight = 1;
        servers[1].in_flight = 3;
        servers[2].in_flight = 0;
        for r in 0..50 {
            assert_eq!(b.pick(&servers[..], None, r), Some(2));
        }
        // 4 in flight on weight 4 is lighter than 2 on weight 1.
        let servers = [
            Candidate {
                in_flight: 2,
                ..up(1)
            },
            Candidate {
                in_flight: 4,
                ..up(4)
            },
        ];
        assert_eq!(b.pick(&servers[..], None, 7), Some(1));
        // The lightest is skipped when unavailable.
        let servers = [
            Candidate {
                in_flight: 2,
                ..up(1)
            },
            down(1),
            Candidate {
                in_flight: 5,
                ..up(1)
            },
        ];
        assert_eq!(b.pick(&servers[..], None, 7), Some(0));
    }

    #[test]
    fn least_requests_spreads_ties() {
        let b = balancer(&Balance::LeastRequests, &labels(4), &[1; 4]);
        let servers = [
            up(1),
            Candidate {
                in_flight: 1,
                ..up(1)
            },
            up(1),
            up(1),
        ];
        let mut counts = [0; 4];
        for k in 0..3000u64 {
            counts[b
                .pick(&servers[..], None, k.wrapping_mul(0x9e37_79b9_7f4a_7c15))
                .unwrap()] += 1;
        }
        assert_eq!(counts[1], 0);
        for c in [counts[0], counts[2], counts[3]] {
            assert!((900..=1100).contains(&c), "{counts:?}");
        }
    }

    #[test]
    fn random_two_takes_the_lighter_of_two_distinct_servers() {
        let b = balancer(&Balance::RandomTwo, &labels(3), &[1; 3]);
        let servers = [
            Candidate {
                in_flight: 9,
                ..up(1)
            },
            up(1),
            Candidate {
                in_flight: 5,
                ..up(1)
            },
        ];
        let mut counts = [0; 3];
        for k in 0..3000u64 {
            counts[b
                .pick(&servers[..], None, k.wrapping_mul(0x9e37_79b9_7f4a_7c15))
                .unwrap()] += 1;
        }
        // The busiest is never picked (two distinct draws, it always loses); the idle one
        // wins whenever drawn (2 pairs of 3), the other only against the busiest.
        assert_eq!(counts[0], 0, "{counts:?}");
        assert!(counts[1] > 1800 && counts[2] > 800, "{counts:?}");
        // One available: that one.
        let servers = [down(1), up(1), down(1)];
        assert_eq!(b.pick(&servers[..], None, 12345), Some(1));
    }

    /// 1,000 keys' servers over `n` servers.
    fn key_map(b: &Balancer, servers: &[Candidate]) -> Vec<usize> {
        (0..1000)
            .map(|k| {
                let h = key_hash(format!("key-{k}").as_bytes());
                b.pick(servers, Some(h), 0).unwrap()
            })
            .collect()
    }

    #[test]
    fn hash_keeps_each_key_on_one_server() {
        let names = labels(3);
        let b = balancer(&hash_balance(), &names, &[1; 3]);
        let servers = [up(1); 3];
        let first = key_map(&b, &servers);
        for _ in 0..3 {
            assert_eq!(key_map(&b, &servers), first);
        }
        // Rebuilt (a reload, another gateway) and from the servers in another order: the
        // same servers for the same keys.
        let mut reversed = names.clone();
        reversed.reverse();
        let again = balancer(&hash_balance(), &reversed, &[1; 3]);
        let mapped: Vec<usize> = key_map(&again, &servers).iter().map(|i| 2 - i).collect();
        assert_eq!(mapped, first);
        // Each server holds a fair share.
        for s in 0..3 {
            let n = first.iter().filter(|&&i| i == s).count();
            assert!((250..=420).contains(&n), "server {s}: {n} keys");
        }
    }

    #[test]
    fn hash_moves_few_keys_when_a_server_comes_or_goes() {
        let names = labels(4);
        let three = balancer(&hash_balance(), &names[..3], &[1; 3]);
        let four = balancer(&hash_balance(), &names, &[1; 4]);
        let before = key_map(&three, &[up(1); 3]);
        let after = key_map(&four, &[up(1); 4]);
        let moved = before.iter().zip(&after).filter(|(a, b)| a != b).count();
        assert!(moved <= 300, "{moved} of 1000 keys moved");
        // Every key that moved went to the new server.
        assert!(before.iter().zip(&after).all(|(a, b)| a == b || *b == 3));
        // Removing the fourth again (or marking it unavailable) moves only its keys.
        let unavailable = key_map(&four, &[up(1), up(1), up(1), down(1)]);
        assert_eq!(unavailable, before);
    }

    #[test]
    fn hash_sends_an_unavailable_servers_keys_to_the_next_on_the_ring() {
        let names = labels(3);
        let b = balancer(&hash_balance(), &names, &[1; 3]);
        let all = key_map(&b, &[up(1); 3]);
        let without_1 = key_map(&b, &[up(1), down(1), up(1)]);
        for (a, w) in all.iter().zip(&without_1) {
            assert_ne!(*w, 1);
            if *a != 1 {
                assert_eq!(a, w);
            }
        }
        // A keyless request is balanced round robin.
        assert_eq!(split(&b, &[up(1); 3], 30), [10, 10, 10]);
    }

    #[test]
    fn hash_weights_count() {
        let b = balancer(&hash_balance(), &labels(2), &[3, 1]);
        let map = key_map(&b, &[up(3), up(1)]);
        let heavy = map.iter().filter(|&&i| i == 0).count();
        assert!((650..=850).contains(&heavy), "{heavy} of 1000");
    }

    #[test]
    fn a_huge_ring_is_scaled_to_fit() {
        let b = balancer(&hash_balance(), &labels(3), &[1000, 1000, 1]);
        let Kind::Hash(ring) = &b.kind else {
            unreachable!()
        };
        assert!(ring.points.len() <= MAX_RING_POINTS);
        assert!(ring.owners.contains(&2));
    }

    #[test]
    fn key_hash_is_stable() {
        // Pinned (FNV-1a 64 then fmix64, checked by hand): every gateway, every version,
        // maps a key the same way.
        assert_eq!(key_hash(b""), key_hash(b""));
        assert_ne!(key_hash(b"tenant-a"), key_hash(b"tenant-b"));
        assert_eq!(key_hash(b"tenant-a"), 0xa02b_fa32_61e1_9aa5);
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        fn pool() -> impl Strategy<Value = Vec<(u32, bool, u32)>> {
            prop::collection::vec((1u32..8, prop::bool::weighted(0.7), 0u32..20), 1..8)
        }

        fn candidates(pool: &[(u32, bool, u32)]) -> Vec<Candidate> {
            pool.iter()
                .map(|&(weight, available, in_flight)| Candidate {
                    available,
                    in_flight,
                    weight,
                })
                .collect()
        }

        crate::proptest_seeds! {
            #![cases(200)]

            /// Over whole cycles, round robin gives each available server exactly its
            /// weight's share of the available weight, wherever the cursor started.
            #[test]
            fn round_robin_shares_are_exact(pool in pool(), cycles in 1usize..4, warmup in 0usize..20) {
                let weights: Vec<u32> = pool.iter().map(|p| p.0).collect();
                let b = balancer(&Balance::RoundRobin, &labels(pool.len()), &weights);
                let servers = candidates(&pool);
                let all_up: Vec<Candidate> = servers.iter().map(|c| Candidate { available: true, ..*c }).collect();
                for _ in 0..warmup {
                    b.pick(&all_up[..], None, 0);
                }
                let g = weights.iter().fold(0, |g, &w| gcd(g, w));
                let cycle: u32 = servers.iter().filter(|c| c.available).map(|c| c.weight / g).sum();
                if cycle == 0 {
                    prop_assert_eq!(b.pick(&servers[..], None, 0), None);
                    return Ok(());
                }
                // From any cursor, `cycle` picks take each available slot once.
                let mut counts = vec![0u32; servers.len()];
                for _ in 0..cycle as usize * cycles {
                    counts[b.pick(&servers[..], None, 0).unwrap()] += 1;
                }
                for (i, c) in servers.iter().enumerate() {
                    let want = if c.available { c.weight / g * cycles as u32 } else { 0 };
                    prop_assert_eq!(counts[i], want, "server {} of {:?}", i, servers);
                }
            }

            /// Least requests picks an available server no other available one is
            /// lighter than; random two an available one, never the only heaviest of
            /// two or more.
            #[test]
            fn load_aware_picks_are_sound(pool in pool(), random: u64) {
                let weights: Vec<u32> = pool.iter().map(|p| p.0).collect();
                let servers = candidates(&pool);
                let any = servers.iter().any(|c| c.available);
                let lr = balancer(&Balance::LeastRequests, &labels(pool.len()), &weights);
                match lr.pick(&servers[..], None, random) {
                    None => prop_assert!(!any),
                    Some(i) => {
                        prop_assert!(servers[i].available);
                        prop_assert!(!servers.iter().any(|c| c.available && lighter(*c, servers[i])));
                    }
                }
                let r2 = balancer(&Balance::RandomTwo, &labels(pool.len()), &weights);
                match r2.pick(&servers[..], None, random) {
                    None => prop_assert!(!any),
                    Some(i) => {
                        prop_assert!(servers[i].available);
                        let others = servers.iter().enumerate().filter(|&(j, c)| j != i && c.available);
                        let n = others.clone().count();
                        prop_assert!(n == 0 || others.clone().any(|(_, c)| !lighter(*c, servers[i])));
                    }
                }
            }

            /// Consistent hashing: a key's server is available; it is the one it would
            /// have on the ring built without the unavailable servers (so a server
            /// going away moves its keys only, and coming back takes back just those).
            #[test]
            fn hash_moves_only_the_missing_servers_keys(pool in pool(), keys in prop::collection::vec(any::<u64>(), 1..50)) {
                let names = labels(pool.len());
                let weights: Vec<u32> = pool.iter().map(|p| p.0).collect();
                let servers = candidates(&pool);
                let full = balancer(&hash_balance(), &names, &weights);
                let kept: Vec<usize> = (0..pool.len()).filter(|&i| servers[i].available).collect();
                let smaller = Balancer::new(&hash_balance(), kept.iter().map(|&i| (names[i].as_str(), weights[i])));
                let kept_up: Vec<Candidate> = kept.iter().map(|&i| servers[i]).collect();
                for h in keys {
                    let a = full.pick(&servers[..], Some(h), 0);
                    let b = smaller.pick(&kept_up[..], Some(h), 0).map(|j| kept[j]);
                    prop_assert_eq!(a, b);
                    prop_assert_eq!(a, full.pick(&servers[..], Some(h), 1));
                }
            }
        }
    }
}
