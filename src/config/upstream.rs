//! `[upstream]`: the backend requests are forwarded to.

use std::path::Path;

use serde::Deserialize;
use toml::Spanned;

use super::values::{HumanDuration, UpstreamUrl};
use super::Invalid;
use crate::upstream::{tls_for, Settings, TlsOptions, CONNECT_TIMEOUT, TIMEOUT};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUpstream {
    url: Spanned<UpstreamUrl>,
    connect_timeout: Option<HumanDuration>,
    timeout: Option<HumanDuration>,
    // https:// only: see `crate::upstream::TlsOptions`.
    ca: Option<Spanned<String>>,
    sni: Option<Spanned<String>>,
    cert: Option<Spanned<String>>,
    key: Option<Spanned<String>>,
    insecure_skip_verify: Option<Spanned<bool>>,
}

impl RawUpstream {
    /// Validate; the files named are read relative to `dir`, the config file's folder.
    pub(super) fn validate(self, dir: &Path) -> Result<Settings, Invalid> {
        let path = |p: &Option<Spanned<String>>| p.as_ref().map(|p| dir.join(p.get_ref().trim()));
        let options = TlsOptions {
            ca: path(&self.ca),
            sni: self.sni.as_ref().map(|s| s.get_ref().clone()),
            cert: path(&self.cert),
            key: path(&self.key),
            insecure_skip_verify: self
                .insecure_skip_verify
                .as_ref()
                .is_some_and(|b| *b.get_ref()),
        };
        let url_span = self.url.span();
        let url = self.url.into_inner();
        let tls = tls_for(&url.uri, options).map_err(|e| {
            let given = match e.key {
                "ca" => self.ca.as_ref(),
                "sni" => self.sni.as_ref(),
                "cert" => self.cert.as_ref(),
                "key" => self.key.as_ref(),
                _ => None,
            };
            let span = given.map(Spanned::span);
            // The file's own words, not the path resolved here (which depends on where
            // the file lies).
            let message = match given {
                Some(g) if e.key != "sni" => {
                    let resolved = dir.join(g.get_ref().trim()).display().to_string();
                    let named = format!("{:?} (relative to this file's folder)", g.get_ref());
                    e.message.replace(&resolved, &named)
                }
                _ => e.message,
            };
            Invalid::new(
                Some(span.unwrap_or(url_span)),
                format!("upstream.{}", e.key),
                message,
            )
        })?;
        Ok(Settings {
            url: url.uri,
            tls,
            base_path: url.base_path,
            connect_timeout: self.connect_timeout.map_or(CONNECT_TIMEOUT, |d| d.0),
            timeout: self.timeout.map_or(TIMEOUT, |d| d.0),
        })
    }
}
