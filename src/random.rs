//! Random numbers where they need only be unpredictable, not secret: retry jitter, the
//! balancer's two random choices, a gateway-made `Sec-WebSocket-Key`, WebSocket masking
//! keys. Each `RandomState` has fresh keys (from the OS once, then stepped per thread);
//! hashing nothing with them gives 64 random bits, with no dependency for it.

use std::hash::{BuildHasher, Hasher};

/// 64 random bits.
pub fn bits() -> u64 {
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}

/// A uniformly random number in `0..=max` (multiply-shift: unbiased enough for jitter).
pub fn up_to(max: u64) -> u64 {
    if max == 0 {
        return 0;
    }
    ((u128::from(bits()) * (u128::from(max) + 1)) >> 64) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn up_to_stays_in_range_and_varies() {
        assert_eq!(up_to(0), 0);
        let seen: std::collections::HashSet<u64> = (0..200).map(|_| up_to(3)).collect();
        assert!(seen.iter().all(|&n| n <= 3));
        // 200 draws from 4 values: all four show (a miss has odds below 4 * 0.75^200).
        assert_eq!(seen.len(), 4);
        assert_ne!(bits(), bits());
    }
}
