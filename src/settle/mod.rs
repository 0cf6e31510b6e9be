//! Settling what a request was charged once its answer is known (issue 27): which
//! answers a rule charges for and where the real cost comes from ([`policy`]), the usage
//! an LLM answer reports ([`usage`]; a compressed answer decoded for it first,
//! [`decode`]), and the charges a request holds until then
//! ([`Settling`], over a [`Reservation`](reservation::Reservation): the charges held in
//! the limiter's store). The pure per-algorithm step stays in
//! [`limiter::settle`](mod@crate::limiter::settle).

pub mod decode;
pub mod max_tokens;
pub mod metrics;
pub mod policy;
#[cfg(test)]
mod properties;
pub mod reservation;
pub mod settling;
pub mod usage;

pub use settling::{Held, Meter, Settling, Shown};
