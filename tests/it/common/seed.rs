//! Random property runs that replay, and that search.
//!
//! Every property test runs the cases of a fixed seed ([`DEFAULT_SEED`], or the one
//! `RATEWALL_TEST_SEED` names), so that a run on a machine where nothing changed says what
//! the last one said; with `RATEWALL_FRESH_SEED=1` (CI sets it) it then runs as many cases
//! of a fresh seed, so that every CI run searches somewhere new. Each seed is printed
//! before its cases with the command that replays it (`cargo test` shows a failing test's
//! output).
//!
//! Before any of them, the cases saved in `proptest-regressions/` run again: proptest's
//! own file persistence (`FileFailurePersistence::SourceParallel`), which reads the file
//! of the test's source file (`src/limiter/properties.rs` → `proptest-regressions/
//! limiter/properties.txt`; `tests/it/<name>.rs` → `tests/proptest-regressions/<name>.txt`)
//! and writes a new failure's seed there: commit it, and every later run tries that case
//! first. Shrinking a failure is bounded in time.

use proptest::test_runner::{Config, FileFailurePersistence, RngSeed};

/// The seed when `RATEWALL_TEST_SEED` is not set.
pub const DEFAULT_SEED: u64 = 0x5EED_2A7E_0F7E_5700;

/// Where the saved failing cases are: proptest's default, beside the source tree.
pub const REGRESSIONS: FileFailurePersistence =
    FileFailurePersistence::SourceParallel("proptest-regressions");

/// The seed of this run: `RATEWALL_TEST_SEED` (decimal or `0x` hex), else [`DEFAULT_SEED`].
pub fn test_seed() -> u64 {
    replayed().unwrap_or(DEFAULT_SEED)
}

/// The seed `RATEWALL_TEST_SEED` names, if it is set.
fn replayed() -> Option<u64> {
    let s = std::env::var("RATEWALL_TEST_SEED").ok()?;
    let s = s.trim();
    let parsed = match s.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => s.parse(),
    };
    Some(parsed.unwrap_or_else(|_| panic!("RATEWALL_TEST_SEED={s:?} is not a u64")))
}

/// This process's fresh seed, when `RATEWALL_FRESH_SEED=1` and no seed is replayed: one
/// for every property test of the run (one value replays them all).
pub fn fresh_seed() -> Option<u64> {
    static FRESH: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let wanted = std::env::var("RATEWALL_FRESH_SEED").is_ok_and(|v| v.trim() == "1");
    if !wanted || replayed().is_some() {
        return None;
    }
    Some(*FRESH.get_or_init(|| {
        use std::hash::BuildHasher;
        // std's per-process random keys: 64 bits from the OS, no dependency for it.
        std::collections::hash_map::RandomState::new().hash_one(std::process::id())
    }))
}

/// The configs `test` runs, in order, `cases` cases each: the fixed seed's (after the
/// saved regressions), then a fresh seed's where [`fresh_seed`] gives one. Each seed is
/// printed, with the command that replays it, as its run begins: a failure's output ends
/// with the seed that failed.
pub fn proptest_configs(test: &str, cases: u32) -> impl Iterator<Item = Config> {
    let test = test.to_string();
    let fixed = std::iter::once((test_seed(), true));
    let fresh = fresh_seed().map(|seed| (seed, false));
    fixed.chain(fresh).map(move |(seed, first)| {
        let which = if first { "" } else { "then a fresh seed, " };
        eprintln!(
            "{test}: {cases} cases, {which}seed {seed:#x} (replay with RATEWALL_TEST_SEED={seed:#x})"
        );
        Config {
            // The saved regressions run once, before the first seed's cases; a failure is
            // saved there (with a fresh seed's too: replayed with RATEWALL_TEST_SEED, it
            // is the first seed).
            failure_persistence: first.then(|| Box::new(REGRESSIONS) as Box<_>),
            ..config(seed, cases)
        }
    })
}

/// `cases` cases of `seed`, at most 15 s of shrinking, nothing saved.
fn config(seed: u64, cases: u32) -> Config {
    Config {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        failure_persistence: None,
        max_shrink_iters: 2_000,
        max_shrink_time: 15_000,
        ..Config::default()
    }
}

/// `proptest!`, each property run once per config of [`proptest_configs`]. The block form,
/// whose tests are named for the seed by their module path and function name:
///
/// ```ignore
/// crate::proptest_seeds! {
///     #![cases(300)]
///     /// What it claims.
///     #[test]
///     fn a_property(x in 0u64..10, ys in vec(any::<u8>(), 0..4)) { prop_assert!(..); }
/// }
/// ```
///
/// and the closure form, inside a test: `crate::proptest_seeds!("name", 64, |(x in 0u64..10)| {
/// .. });`. (`seed` is at the root of both crates that include this file: the library's
/// unit tests, and `tests/it`, which re-exports `common::seed`.)
#[macro_export]
macro_rules! proptest_seeds {
    (
        #![cases($cases:expr)]
        $(
            $(#[$meta:meta])*
            fn $test:ident($($args:tt)+) $body:block
        )*
    ) => {
        $(
            $(#[$meta])*
            fn $test() {
                let name = concat!(module_path!(), "::", stringify!($test));
                for config in $crate::seed::proptest_configs(name, $cases) {
                    ::proptest::proptest!(config, |($($args)+)| $body);
                }
            }
        )*
    };
    // (After the block form: its `#` never starts an expression.)
    ($name:expr, $cases:expr, |($($args:tt)+)| $body:expr) => {
        for config in $crate::seed::proptest_configs($name, $cases) {
            ::proptest::proptest!(config, |($($args)+)| $body);
        }
    };
}
