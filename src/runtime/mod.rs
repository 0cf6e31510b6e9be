//! What every request runs on, whichever front-end it came through: the [`Live`]
//! configuration (the config, the limiter over its store, the upstream pools, the
//! per-rule counters; built once per load and swapped whole on reload, `live.rs`), the
//! JWKS fetcher that keeps a `jwks_url`'s keys fresh for it (`jwks.rs`), and the
//! [`Metrics`] registry root (`metrics.rs`): every module's metrics, with the request
//! metrics each front-end counts a request into once it is over (`requests.rs`), the
//! counts a decision returns for it to hand over (`counts.rs`) and the dashboards'
//! (`dashboards.rs`, judged by the bounded demand meter, `demand.rs`).

mod counts;
mod current;
pub mod dashboards;
pub mod demand;
pub mod jwks;
mod live;
pub mod metrics;
pub mod requests;

pub use counts::{Counted, Counts, Judgement};
pub use current::{Current, ReloadError};
pub use live::{Live, WaitSlot};
pub use metrics::{Ended, Metrics};
