//! `[upstream]`: the backend requests are forwarded to.

use serde::Deserialize;

use super::values::{HumanDuration, UpstreamUrl};
use crate::upstream::{Settings, CONNECT_TIMEOUT, TIMEOUT};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUpstream {
    url: UpstreamUrl,
    connect_timeout: Option<HumanDuration>,
    timeout: Option<HumanDuration>,
}

impl RawUpstream {
    pub(super) fn validate(self) -> Settings {
        Settings {
            url: self.url.uri,
            base_path: self.url.base_path,
            connect_timeout: self.connect_timeout.map_or(CONNECT_TIMEOUT, |d| d.0),
            timeout: self.timeout.map_or(TIMEOUT, |d| d.0),
        }
    }
}
