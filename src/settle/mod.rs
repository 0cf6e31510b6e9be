//! Settling what a request was charged once its answer is known (issue 27): which
//! answers a rule charges for and where the real cost comes from ([`policy`]), the usage
//! an LLM answer reports ([`usage`]; a compressed answer decoded for it first,
//! [`decode`]), and the charges a request holds until then
//! ([`Settling`], over the limiter's [`Reservation`](crate::limiter::reservation)).

pub mod decode;
pub mod max_tokens;
pub mod metrics;
pub mod policy;
pub mod settling;
pub mod usage;

pub use settling::{Held, Meter, Settling, Shown};
