//! What the good-client SLO's demand meter costs a limited request, per rule: nanoseconds
//! per `DemandMeter::record` (the clock read, one key mixed, one shard locked, one entry
//! found or added),
//! for 1,000 identities asking again and again, for a flood of a million distinct ones
//! (the meter at its bound, sweeping and evicting), on one thread and on two at once. Each
//! thread's time on a CPU is read from `/proc/thread-self/schedstat` (Linux), so that a
//! loaded machine's waits for a core are not counted; wall-clock time is shown beside it.
//!
//!     cargo run --release --example demand_meter

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use ratewall::identity::IdentityDigest;
use ratewall::runtime::demand::{DemandMeter, Terms};

const OPS: u64 = 4_000_000;

fn digest(n: u64) -> IdentityDigest {
    // Uniform, as SHA-256 digests are.
    let mut z = n.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let mut d = [0u8; 16];
    d[..8].copy_from_slice(&z.to_le_bytes());
    d[8..].copy_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    IdentityDigest(d)
}

/// This thread's time on a CPU so far, in ns (0 where the kernel does not say).
fn cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// `OPS` records over `identities` distinct identities by `threads` threads at once:
/// (CPU ns, wall ns) per record, per thread.
fn run(identities: u64, threads: u64) -> (f64, f64) {
    let meter = Arc::new(DemandMeter::default());
    let digests: Arc<Vec<IdentityDigest>> =
        Arc::new((0..identities.min(OPS)).map(digest).collect());
    let terms = Terms {
        period_us: 60_000_000,
        limit: 100,
    };
    let started = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (meter, digests) = (meter.clone(), digests.clone());
            std::thread::spawn(move || {
                let cpu = cpu_ns();
                let mut within = 0u64;
                for i in 0..OPS / threads {
                    let n = (i * threads + t) % digests.len() as u64;
                    let key = meter.key(0x5eed, &digests[n as usize]);
                    within += u64::from(meter.record(key, terms, 1, meter.now_us()));
                }
                black_box(within);
                cpu_ns() - cpu
            })
        })
        .collect();
    let cpu: u64 = handles.into_iter().map(|h| h.join().unwrap_or(0)).sum();
    let wall = started.elapsed().as_nanos() as f64 * threads as f64;
    (cpu as f64 / OPS as f64, wall / OPS as f64)
}

fn main() {
    println!("identities  threads  CPU ns per record (median of 5, range)  wall ns per record");
    for (identities, threads) in [(1_000, 1), (1_000, 2), (1_000_000, 1), (1_000_000, 2)] {
        let mut rounds: Vec<(f64, f64)> = (0..5).map(|_| run(identities, threads)).collect();
        rounds.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut wall: Vec<f64> = rounds.iter().map(|r| r.1).collect();
        wall.sort_by(f64::total_cmp);
        println!(
            "{identities:>10}  {threads:>7}  {:>8.1} ({:.1}..{:.1}){:>27.1}",
            rounds[2].0, rounds[0].0, rounds[4].0, wall[2]
        );
    }
}
