//! Latencies in µs, counted in buckets of about 3% (six significant bits): exact below 64
//! µs, then 32 buckets per power of two.

pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
}

const BUCKETS: usize = 64 + 58 * 32;

fn index(us: u64) -> usize {
    if us < 64 {
        return us as usize;
    }
    let shift = 63 - us.leading_zeros() - 5;
    64 + (shift as usize - 1) * 32 + ((us >> shift) as usize - 32)
}

/// The lower bound of bucket `i`.
fn value(i: usize) -> u64 {
    if i < 64 {
        return i as u64;
    }
    let shift = (i - 64) / 32 + 1;
    (((i - 64) % 32 + 32) as u64) << shift
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: vec![0; BUCKETS],
            total: 0,
        }
    }
}

impl Histogram {
    pub fn record(&mut self, us: u64, n: u64) {
        self.counts[index(us)] += n;
        self.total += n;
    }

    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
    }

    /// The `q` quantile (0 to 1), in µs; 0 when nothing was recorded.
    pub fn quantile(&self, q: f64) -> u64 {
        let want = ((self.total as f64 * q).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, &n) in self.counts.iter().enumerate() {
            seen += n;
            if seen >= want {
                return value(i);
            }
        }
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_round_down_within_three_percent() {
        for us in [0, 1, 63, 64, 65, 127, 128, 1000, 12_345, 1 << 40, u64::MAX] {
            let v = value(index(us));
            assert!(v <= us && us - v <= us / 32, "{us} -> {v}");
        }
        assert_eq!(index(u64::MAX), BUCKETS - 1);
    }

    #[test]
    fn quantiles() {
        let mut h = Histogram::default();
        for us in 1..=100 {
            h.record(us, 1);
        }
        assert_eq!(h.quantile(0.5), 50);
        assert_eq!(h.quantile(0.99), 98);
    }
}
