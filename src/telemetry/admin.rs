//! The admin listener's metrics. The admin listener sits above the gateway, whose
//! registry root (`runtime::Metrics`) holds every metric: declared here, at the bottom,
//! both name them without the admin listener importing the root. Its vocabulary
//! (`admin::guard::Failure`) stays with it, and creates the series at zero.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

crate::telemetry::label_sets! {
    pub struct AdminFailureLabels {
        /// `missing`, `wrong` or `throttled` (`admin::guard::Failure`).
        pub reason: &'static str,
    }
}

super::metrics! {
    pub struct AdminMetrics {
        /// `/admin/*` calls refused for their token, by reason (`missing`, `wrong`,
        /// `throttled`).
        pub auth_failures: Family<AdminFailureLabels, Counter> = ("admin_auth_failures", "Admin API calls refused for their token, by reason: missing (no Bearer token), wrong, throttled (the peer's failed calls used up its allowance: 429, the token not checked)"),
    }
}
