//! What the command line and the environment override in the file: where the gateway and
//! its admin listener listen, and the upstream. A container or a service manager sets
//! these without a file of its own (`docker run -e RATEWALL_LISTEN=0.0.0.0:8080`).
//!
//! Each is validated once, at start, exactly as the file's value is (the same
//! deserialisers), and named in its error by where it came from; then applied to every
//! load of the file, so a SIGHUP reload re-reads the file and keeps them.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;

use serde::de::value::{Error as ValueError, StrDeserializer};
use serde::Deserialize;

use super::values::UpstreamUrl;
use super::{Config, ConfigError};

/// A value given on the command line or in the environment, and which of them gave it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Given {
    pub value: String,
    /// The flag (`--listen`) or the environment variable (`RATEWALL_LISTEN`), for errors
    /// and for `ratewall check`.
    pub origin: String,
}

/// An override that is not a valid value: the flag or variable, the value, and why.
#[derive(Debug, thiserror::Error)]
#[error("{origin} = {value:?}: {message}")]
pub struct OverrideError {
    pub origin: String,
    pub value: String,
    pub message: String,
}

/// The settings that override the file's, validated.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    listen: Option<(SocketAddr, String)>,
    admin_listen: Option<(SocketAddr, String)>,
    /// `[server.tls] listen`: only where the file has a `[server.tls]`.
    tls_listen: Option<(SocketAddr, String)>,
    upstream: Option<(http::Uri, String, String)>,
}

/// `given`'s value, read by the deserialiser the file's value goes through.
fn parse<'a, T: Deserialize<'a>>(given: &'a Given) -> Result<T, OverrideError> {
    T::deserialize(StrDeserializer::<ValueError>::new(given.value.trim())).map_err(|e| {
        OverrideError {
            origin: given.origin.clone(),
            value: given.value.clone(),
            message: e.to_string(),
        }
    })
}

impl Overrides {
    /// Validate `[server] listen`, `[server] admin_listen`, `[server.tls] listen` and
    /// `[upstream] url` overrides.
    pub fn new(
        listen: Option<Given>,
        admin_listen: Option<Given>,
        tls_listen: Option<Given>,
        upstream: Option<Given>,
    ) -> Result<Overrides, OverrideError> {
        let addr = |g: Option<Given>| -> Result<_, OverrideError> {
            g.map(|g| parse::<SocketAddr>(&g).map(|a| (a, g.origin)))
                .transpose()
        };
        Ok(Overrides {
            listen: addr(listen)?,
            admin_listen: addr(admin_listen)?,
            tls_listen: addr(tls_listen)?,
            upstream: upstream
                .map(|g| parse::<UpstreamUrl>(&g).map(|u| (u.uri, u.base_path, g.origin)))
                .transpose()?,
        })
    }

    pub fn is_empty(&self) -> bool {
        self.listen.is_none()
            && self.admin_listen.is_none()
            && self.tls_listen.is_none()
            && self.upstream.is_none()
    }

    /// Replace the file's values with these. An `https://` upstream's TLS is set up for
    /// its host, with the file's TLS keys; that can fail (a system without roots).
    pub fn apply(&self, config: &mut Config) -> Result<(), crate::upstream::TlsError> {
        if let Some((a, _)) = &self.listen {
            config.server.listen = *a;
        }
        if let Some((a, _)) = &self.admin_listen {
            config.server.admin_listen = Some(*a);
        }
        if let (Some((a, _)), Some(tls)) = (&self.tls_listen, &mut config.server.tls) {
            tls.listen = *a;
        }
        if let Some((uri, base_path, _)) = &self.upstream {
            retarget_default_pool(config, uri, base_path)?;
        }
        Ok(())
    }
}

/// Make the pool `default` the one server `uri` (with `base_path`): the file's pool
/// `default` keeps its other settings, and its TLS keys for an `https://` URL; where the
/// file has none, it is made from what every pool inherits, and put first (the routes'
/// pool positions move up by one).
fn retarget_default_pool(
    config: &mut Config,
    uri: &http::Uri,
    base_path: &str,
) -> Result<(), crate::upstream::TlsError> {
    use crate::upstream::{ServerSettings, DEFAULT_POOL};
    let existing = config.upstreams.iter().position(|p| p.name == DEFAULT_POOL);
    let options = match existing {
        Some(i) => config.upstreams[i]
            .servers
            .iter()
            .find_map(|s| s.tls.as_ref().map(|t| t.options().clone()))
            .unwrap_or_default(),
        None => config.pool_defaults.tls.clone(),
    };
    // Inherited TLS keys are for https:// pools only; an http:// URL takes none.
    let options = if uri.scheme_str() == Some("https") {
        options
    } else {
        Default::default()
    };
    let server = ServerSettings {
        url: uri.clone(),
        base_path: base_path.to_string(),
        weight: 1,
        tls: crate::upstream::tls_for(uri, options)?,
    };
    let protocol = match existing {
        Some(i) => config.upstreams[i].protocol,
        None => config.pool_defaults.pool.protocol,
    };
    // The pool's protocol holds for the URL given too: h2 and auto need TLS, h2c none.
    if protocol.is_http2() && (server.tls.is_some() != (protocol != crate::upstream::Protocol::H2c))
    {
        return Err(crate::upstream::TlsError {
            key: "protocol",
            message: format!(
                "protocol = {:?} cannot speak to {}: h2 and auto need an https:// url, h2c an http:// one",
                protocol.name(),
                server.label()
            ),
        });
    }
    match existing {
        Some(i) => config.upstreams[i].servers = vec![server],
        None => {
            let mut pool = config.pool_defaults.pool.clone();
            pool.name = DEFAULT_POOL.to_string();
            pool.servers = vec![server];
            config.upstreams.insert(0, pool);
            for r in &mut config.routes.list {
                r.pool += 1;
            }
            config.routes.default_pool = Some(0);
        }
    }
    Ok(())
}

/// For `ratewall check`: `--listen overrides [server] listen, ...`.
impl fmt::Display for Overrides {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let entries = [
            self.listen.as_ref().map(|(_, o)| (o, "[server] listen")),
            self.admin_listen
                .as_ref()
                .map(|(_, o)| (o, "[server] admin_listen")),
            self.tls_listen
                .as_ref()
                .map(|(_, o)| (o, "[server.tls] listen")),
            self.upstream
                .as_ref()
                .map(|(_, _, o)| (o, "[upstream] url")),
        ];
        let mut first = true;
        for (origin, key) in entries.into_iter().flatten() {
            if !first {
                f.write_str(", ")?;
            }
            first = false;
            write!(f, "{origin} overrides {key}")?;
        }
        Ok(())
    }
}

/// Where the configuration comes from: the file, and what overrides it. Every load (at
/// start and on each SIGHUP) goes through [`Source::load`].
#[derive(Clone, Debug)]
pub struct Source {
    pub path: PathBuf,
    pub overrides: Overrides,
}

impl Source {
    pub fn new(path: impl Into<PathBuf>, overrides: Overrides) -> Source {
        Source {
            path: path.into(),
            overrides,
        }
    }

    /// Read and validate the file, then apply the overrides.
    pub fn load(&self) -> Result<Config, ConfigError> {
        let mut config = Config::load(&self.path)?;
        if let (Some((_, origin)), None) = (&self.overrides.tls_listen, &config.server.tls) {
            return Err(ConfigError::Invalid {
                path: self.path.clone(),
                line: 1,
                column: 1,
                key: "server.tls".to_string(),
                message: format!(
                    "{origin} overrides [server.tls] listen, but the file has no [server.tls] (its certificates)"
                ),
            });
        }
        self.overrides
            .apply(&mut config)
            .map_err(|e| ConfigError::Invalid {
                path: self.path.clone(),
                line: 1,
                column: 1,
                key: format!("upstream.{}", e.key),
                message: format!("with {}: {}", self.overrides, e.message),
            })?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn given(value: &str, origin: &str) -> Option<Given> {
        Some(Given {
            value: value.into(),
            origin: origin.into(),
        })
    }

    #[test]
    fn overrides_replace_the_files_values() {
        let o = Overrides::new(
            given("0.0.0.0:8080", "--listen"),
            given("[::]:9090", "RATEWALL_ADMIN_LISTEN"),
            None,
            given("http://host.docker.internal:3000/base/", "--upstream"),
        )
        .unwrap();
        let mut c = Config::parse(
            "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\nurl = \"http://127.0.0.1:2\"\n",
            Path::new("t.toml"),
        )
        .unwrap();
        o.apply(&mut c).unwrap();
        assert_eq!(c.server.listen, "0.0.0.0:8080".parse().unwrap());
        assert_eq!(c.server.admin_listen, Some("[::]:9090".parse().unwrap()));
        assert_eq!(
            c.upstream().url.authority().unwrap().as_str(),
            "host.docker.internal:3000"
        );
        assert_eq!(c.upstream().base_path, "/base");
        assert_eq!(
            o.to_string(),
            "--listen overrides [server] listen, RATEWALL_ADMIN_LISTEN overrides [server] admin_listen, --upstream overrides [upstream] url"
        );
    }

    #[test]
    fn the_upstream_override_retargets_the_pool_default_or_makes_it() {
        let o = Overrides::new(
            None,
            None,
            None,
            given("http://10.9.9.9:80/b", "--upstream"),
        )
        .unwrap();
        // A pool named default keeps its settings and loses its servers.
        let mut c = Config::parse(
            "[server]\nlisten = \"127.0.0.1:1\"\n[[upstreams]]\nname = \"api\"\nservers = [\"http://127.0.0.1:2\"]\n[[upstreams]]\nname = \"default\"\nservers = [\"http://127.0.0.1:3\", \"http://127.0.0.1:4\"]\nretries = 3\n",
            Path::new("t.toml"),
        )
        .unwrap();
        o.apply(&mut c).unwrap();
        let d = &c.upstreams[0];
        assert_eq!((d.name.as_str(), d.retries), ("default", 3));
        let servers: Vec<String> = d.servers.iter().map(|s| s.label()).collect();
        assert_eq!(servers, ["http://10.9.9.9:80"]);
        assert_eq!(d.servers[0].base_path, "/b");
        assert_eq!(c.upstream().url, d.servers[0].url);
        // Without one, it is made first, with what [upstream] gives every pool, and the
        // routes still send to the pools they named.
        let mut c = Config::parse(
            "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\ntimeout = \"7s\"\n[[upstreams]]\nname = \"api\"\nservers = [\"http://127.0.0.1:2\"]\n[[routes]]\nupstream = \"api\"\n",
            Path::new("t.toml"),
        )
        .unwrap();
        assert_eq!(c.routes.default_pool, None);
        o.apply(&mut c).unwrap();
        let names: Vec<&str> = c.upstreams.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["default", "api"]);
        assert_eq!(c.upstreams[0].timeout, std::time::Duration::from_secs(7));
        assert_eq!(c.routes.default_pool, Some(0));
        assert_eq!(c.upstreams[c.routes.list[0].pool].name, "api");
        assert_eq!(c.upstream().url, c.upstreams[0].servers[0].url);
        assert_eq!(c.upstream().timeout, std::time::Duration::from_secs(7));
    }

    #[test]
    fn a_tls_listen_override_needs_a_tls_listener() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("limits.toml");
        std::fs::write(
            &path,
            "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\nurl = \"http://127.0.0.1:2\"\n",
        )
        .unwrap();
        let o = Overrides::new(
            None,
            None,
            given("0.0.0.0:8443", "RATEWALL_TLS_LISTEN"),
            None,
        )
        .unwrap();
        let e = Source::new(&path, o).load().unwrap_err().to_string();
        assert!(
            e.ends_with("server.tls: RATEWALL_TLS_LISTEN overrides [server.tls] listen, but the file has no [server.tls] (its certificates)"),
            "{e}"
        );
    }

    #[test]
    fn a_bad_override_names_its_origin_and_says_why_as_the_file_would() {
        let e = Overrides::new(given("0.0.0.0", "RATEWALL_LISTEN"), None, None, None).unwrap_err();
        assert_eq!(
            e.to_string(),
            "RATEWALL_LISTEN = \"0.0.0.0\": invalid socket address syntax"
        );
        let e = Overrides::new(None, None, None, given("ftp://x", "--upstream")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--upstream = \"ftp://x\": invalid upstream url \"ftp://x\": only http:// and https:// upstreams are supported"
        );
        // The file says the same of the same value.
        let file = Config::parse(
            "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\nurl = \"ftp://x\"\n",
            Path::new("t.toml"),
        )
        .unwrap_err()
        .to_string();
        assert!(file.ends_with(&e.message), "{file}");
    }
}
