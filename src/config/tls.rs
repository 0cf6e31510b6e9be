//! `[server.tls]`: the TLS listener. The certificate files, relative to the config file's
//! folder, are read with it ([`super::Inputs`]) and made into the listener's settings here,
//! so that a bad one fails the load (at start, in `ratewall check`, on SIGHUP) pointing at
//! its entry; what they become lives in [`crate::tls`].

use std::net::SocketAddr;
use std::path::Path;

use serde::Deserialize;
use toml::Spanned;

use super::{Inputs, Invalid};
use crate::tls::{ClientAuth, Settings};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTls {
    listen: SocketAddr,
    certificates: Spanned<Vec<Spanned<RawCertificate>>>,
    client_ca: Option<Spanned<String>>,
    client_auth: Option<Spanned<ClientAuthMode>>,
    redirect_https: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCertificate {
    cert: String,
    key: String,
}

#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum ClientAuthMode {
    Optional,
    Required,
}

impl RawTls {
    /// The files the listener needs: each certificate and its key, then the client CA,
    /// relative to `dir` (the config file's folder).
    pub(super) fn files(&self, dir: &Path) -> Vec<std::path::PathBuf> {
        let certificates = self.certificates.get_ref().iter().flat_map(|c| {
            let c = c.get_ref();
            [dir.join(c.cert.trim()), dir.join(c.key.trim())]
        });
        let ca = self
            .client_ca
            .iter()
            .map(|ca| dir.join(ca.get_ref().trim()));
        certificates.chain(ca).collect()
    }

    /// The listener's settings, of the files `inputs` holds (see [`RawTls::files`]).
    pub(super) fn build(&self, dir: &Path, inputs: &Inputs) -> Result<Settings, Invalid> {
        if self.certificates.get_ref().is_empty() {
            return Err(Invalid::new(
                Some(self.certificates.span()),
                "server.tls.certificates",
                "at least one { cert, key } is needed",
            ));
        }
        let files: Vec<_> = self
            .certificates
            .get_ref()
            .iter()
            .map(|c| {
                let c = c.get_ref();
                (dir.join(c.cert.trim()), dir.join(c.key.trim()))
            })
            .collect();
        let client_auth =
            match (&self.client_ca, &self.client_auth) {
                (None, Some(mode)) => return Err(Invalid::new(
                    Some(mode.span()),
                    "server.tls.client_auth",
                    "client_auth needs client_ca: the CA client certificates are verified against",
                )),
                (None, None) => None,
                (Some(ca), mode) => Some(ClientAuth {
                    ca: dir.join(ca.get_ref().trim()),
                    required: mode
                        .as_ref()
                        .is_none_or(|m| *m.get_ref() == ClientAuthMode::Required),
                }),
            };
        Settings::build(
            self.listen,
            &files,
            client_auth,
            self.redirect_https.unwrap_or(false),
            &|path| inputs.contents(path),
        )
        .map_err(|e| {
            // Point at the entry whose file failed (or at client_ca).
            let at = match &e {
                crate::tls::LoadError::Read { path, .. }
                | crate::tls::LoadError::Invalid { path, .. } => path,
            };
            let (span, key) = match self
                .certificates
                .get_ref()
                .iter()
                .zip(&files)
                .enumerate()
                .find(|(_, (_, (c, k)))| c == at || k == at)
            {
                Some((i, (c, _))) => (Some(c.span()), format!("server.tls.certificates[{i}]")),
                None => (
                    self.client_ca.as_ref().map(Spanned::span),
                    "server.tls.client_ca".to_string(),
                ),
            };
            Invalid::new(
                span,
                key,
                format!("{e} (paths are relative to this file's folder)"),
            )
        })
    }
}
