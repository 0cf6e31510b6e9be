//! Random property runs that replay: a fixed seed unless `RATEWALL_TEST_SEED` names
//! another, printed before the run (so a failing test's output names it), and a bound on
//! the time spent shrinking a failure.

use proptest::test_runner::{Config, RngSeed};

/// The seed when `RATEWALL_TEST_SEED` is not set.
pub const DEFAULT_SEED: u64 = 0x5EED_2A7E_0F7E_5700;

/// The seed of this run: `RATEWALL_TEST_SEED` (decimal or `0x` hex), else [`DEFAULT_SEED`].
pub fn test_seed() -> u64 {
    match std::env::var("RATEWALL_TEST_SEED") {
        Ok(s) => {
            let s = s.trim();
            let parsed = match s.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => s.parse(),
            };
            parsed.unwrap_or_else(|_| panic!("RATEWALL_TEST_SEED={s:?} is not a u64"))
        }
        Err(_) => DEFAULT_SEED,
    }
}

/// A proptest config for `cases` cases of `test`: seeded by [`test_seed`] (printed, and
/// shown by `cargo test` when the test fails), failures not persisted into the repository
/// (the seed replays them), and at most 15 s of shrinking.
pub fn proptest_config(test: &str, cases: u32) -> Config {
    let seed = test_seed();
    eprintln!("{test}: {cases} cases, seed {seed:#x} (replay with RATEWALL_TEST_SEED={seed:#x})");
    Config {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        failure_persistence: None,
        max_shrink_iters: 2_000,
        max_shrink_time: 15_000,
        ..Config::default()
    }
}
