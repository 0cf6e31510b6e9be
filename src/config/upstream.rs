//! `[upstream]`: the backend requests are forwarded to.

use std::time::Duration;

use serde::Deserialize;

use super::values::{HumanDuration, UpstreamUrl};

/// `[upstream]`, validated.
#[derive(Debug, PartialEq)]
pub struct Upstream {
    /// Scheme and authority of the backend, e.g. `http://127.0.0.1:3000`.
    pub url: http::Uri,
    /// Path the request path is appended to, without a trailing `/` (empty for `/`).
    pub base_path: String,
    pub connect_timeout: Duration,
    pub timeout: Duration,
}

pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
pub const TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUpstream {
    url: UpstreamUrl,
    connect_timeout: Option<HumanDuration>,
    timeout: Option<HumanDuration>,
}

impl RawUpstream {
    pub(super) fn validate(self) -> Upstream {
        Upstream {
            url: self.url.uri,
            base_path: self.url.base_path,
            connect_timeout: self.connect_timeout.map_or(CONNECT_TIMEOUT, |d| d.0),
            timeout: self.timeout.map_or(TIMEOUT, |d| d.0),
        }
    }
}
