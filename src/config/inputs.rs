//! What a configuration file names outside its own text: settings the environment gives
//! (`RATEWALL_ADMIN_TOKEN`, `RATEWALL_TAG_SECRET`, a `[jwt] secret_env`) and files it
//! points at (the keys file, `[server.tls]`'s certificates, `[jwt]`'s key files).
//! [`Config::load`](super::Config::load) reads them into [`Inputs`];
//! [`Config::parse_with`](super::Config::parse_with) only looks them up, so that parsing
//! reads nothing and a test gives what it needs as values.
//!
//! An https:// upstream's (or `jwks_url`'s) `ca`, `cert` and `key` are not among them: the
//! upstream client reads those itself ([`crate::upstream::tls_for`]), during validation.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

use super::RawConfig;

/// The environment's settings and the files' contents a configuration file names.
#[derive(Debug, Default)]
pub struct Inputs {
    env: BTreeMap<String, String>,
    /// By path (the file's folder joined to the path written), what reading it gave.
    files: BTreeMap<PathBuf, io::Result<Vec<u8>>>,
}

/// The environment variables read whatever the file says.
const ENVIRONMENT: [&str; 3] = [
    "RATEWALL_ADMIN_TOKEN",
    "RATEWALL_TAG_SECRET",
    "RATEWALL_DECIDE_TOKEN",
];

impl Inputs {
    /// With the environment variable `name` set to `value`.
    pub fn env(mut self, name: &str, value: &str) -> Inputs {
        self.env.insert(name.to_string(), value.to_string());
        self
    }

    /// With the file at `path` holding `bytes`.
    pub fn file(mut self, path: impl Into<PathBuf>, bytes: impl Into<Vec<u8>>) -> Inputs {
        self.files.insert(path.into(), Ok(bytes.into()));
        self
    }

    /// Read the environment variables and the files `raw` (the file at whose folder is
    /// `dir`) names. A file that cannot be read is kept with its error, reported where the
    /// file names it.
    pub(super) fn read(raw: &RawConfig, dir: &Path) -> Inputs {
        let mut inputs = Inputs::default();
        let jwt = raw.jwt.as_ref().map(|j| j.get_ref());
        let variables = ENVIRONMENT
            .into_iter()
            .chain(jwt.and_then(|j| j.secret_env()));
        for name in variables {
            if let Ok(value) = std::env::var(name) {
                inputs.env.insert(name.to_string(), value);
            }
        }
        let keys = raw.keys.file.iter().map(|f| dir.join(f.get_ref().trim()));
        let tls = raw.server.tls.iter().flat_map(|t| t.files(dir));
        let jwt = jwt.into_iter().flat_map(|j| j.files(dir));
        for path in keys.chain(tls).chain(jwt) {
            let contents = std::fs::read(&path);
            inputs.files.insert(path, contents);
        }
        inputs
    }

    /// The environment variable `name`: None where it is unset (or not valid unicode).
    pub(super) fn var(&self, name: &str) -> Option<String> {
        self.env.get(name).cloned()
    }

    /// The bytes of the file at `path`, or why they could not be read.
    pub(super) fn contents(&self, path: &Path) -> io::Result<Vec<u8>> {
        match self.files.get(path) {
            Some(Ok(bytes)) => Ok(bytes.clone()),
            // io::Error is not Clone: the same kind and words.
            Some(Err(e)) => Err(io::Error::new(e.kind(), e.to_string())),
            None => Err(io::Error::new(
                io::ErrorKind::NotFound,
                "not among the inputs given to the parse",
            )),
        }
    }

    /// The file at `path` as text, as `std::fs::read_to_string` would give it.
    pub(super) fn text(&self, path: &Path) -> io::Result<String> {
        String::from_utf8(self.contents(path)?).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                "stream did not contain valid UTF-8",
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    /// `parse` reads no file and no variable: what it needs is given, or it is missing.
    #[test]
    fn parse_reads_only_what_it_is_given() {
        let text = "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\nurl = \"http://127.0.0.1:2\"\n\
                    [keys]\nfile = \"keys.toml\"\n[[rules]]\nname = \"a\"\nkey = \"api_key\"\nrate = \"1/s\"\n[rules.plans.pro]\n";
        let path = Path::new("/nowhere/limits.toml");
        let e = Config::parse(text, path).unwrap_err().to_string();
        assert!(e.contains("cannot read the keys file \"keys.toml\""), "{e}");
        let inputs = Inputs::default()
            .file("/nowhere/keys.toml", "[plans]\n\"k\" = \"pro\"\n")
            .env("RATEWALL_ADMIN_TOKEN", "a-token-of-sixteen-or-more");
        let cfg = Config::parse_with(text, path, &inputs).unwrap();
        assert_eq!(cfg.keys.plan_of(b"k"), Some("pro"));
        assert!(cfg.admin.token.is_some());
    }
}
