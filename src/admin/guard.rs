//! The admin token's guard against guessing: a small allowance of failed calls per peer,
//! in front of the token check ([`Failures`]: the same table that guards bearer tokens
//! and API keys on the request path).
//!
//! Each peer may fail [`BURST`] admin calls at once, then one more every [`EVERY_MS`].
//! While its allowance is used up, its `/admin/*` calls are answered 429 with a
//! `Retry-After`, and their token is not even checked: a guesser gets through one guess a
//! second instead of a hundred thousand. A call whose token was right is given its charge
//! back, so a peer that sends the right token is never slowed — unless it shares its
//! address with a guesser, and then it waits for the allowance as the guesser does (at
//! most a second at a time). Failures are logged at most once every 10 s, with the peer
//! and how many failed since; never the token.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::identity::failures::{Allowance, Failures};
use crate::telemetry::AdminFailureLabels;

/// Failed calls a peer may make at once.
pub const BURST: u64 = 10;
/// Then one more per this long, in milliseconds.
pub const EVERY_MS: u64 = 1_000;

crate::telemetry::label_enum! {
    /// Why an admin call was refused for its token.
    pub enum Failure {
        /// No `Authorization: Bearer` token.
        Missing,
        Wrong,
        /// Not checked: the peer's allowance of failures is used up.
        Throttled,
    }
}

/// `ratewall_admin_auth_failures_total` (declared in `telemetry/`, below the registry
/// root that holds it, and so unable to name [`Failure`]): every reason's series, at zero.
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

/// The guard of one admin listener: [`Failures`] with the admin's allowance.
pub type Guard = Failures;

/// A new guard: [`BURST`] failed calls at once, then one every [`EVERY_MS`].
pub fn new_guard() -> Guard {
    Failures::new(Allowance {
        burst: BURST,
        every_ms: EVERY_MS,
    })
}
