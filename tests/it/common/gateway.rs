//! The `ratewall` binary under test, run on a generated config, and the config snippets
//! the tests build it from.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::free_port;
use super::redis_server::RedisServer;

/// The binary under test: this build's, or the one `RATEWALL_BIN` names (to see a test
/// fail against an older build).
pub fn binary() -> PathBuf {
    std::env::var_os("RATEWALL_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_ratewall")))
}

/// The real `ratewall` binary, run on a generated config.
pub struct Gateway {
    pub port: u16,
    pub admin_port: u16,
    child: Child,
    _dir: tempfile::TempDir,
    pub log: PathBuf,
    /// The config file the gateway reads (rewrite it, then `signal("HUP")` to reload).
    pub config: PathBuf,
    /// The `[server]` table the config starts with; `rewrite_config` keeps it.
    server: String,
}

impl Gateway {
    /// Start the binary with `body` appended to a `[server]` table on free ports.
    pub fn start(body: &str) -> Gateway {
        Self::try_start(body).expect("ratewall did not start")
    }

    pub fn try_start(body: &str) -> Result<Gateway, String> {
        Self::try_start_with_grace(body, "2s")
    }

    /// Start with a `shutdown_grace` of `grace`.
    pub fn try_start_with_grace(body: &str, grace: &str) -> Result<Gateway, String> {
        Self::try_start_with(body, grace, &[], &[])
    }

    /// Start with extra command-line `args` (e.g. `["--log-format", "json"]`) and
    /// environment variables.
    pub fn start_with(body: &str, args: &[&str], env: &[(&str, &str)]) -> Gateway {
        Self::try_start_with(body, "2s", args, env).expect("ratewall did not start")
    }

    /// Start the binary and wait until it says it listens.
    pub fn try_start_with(
        body: &str,
        grace: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Gateway, String> {
        Self::try_start_wrapped(body, grace, args, env, &[])
    }

    /// Start the binary under `wrapper` (a command that runs the rest of its arguments,
    /// such as `prlimit --nofile=64:64 --`).
    pub fn start_wrapped(body: &str, wrapper: &[&str]) -> Gateway {
        Self::try_start_wrapped(body, "2s", &[], &[], wrapper).expect("ratewall did not start")
    }

    /// Ports are picked free just before; if one was taken in between (by another process
    /// here, a cluster node's bus port, an outgoing connection: the gateway exits with
    /// "cannot listen ... Address already in use"), start again on new ports.
    fn try_start_wrapped(
        body: &str,
        grace: &str,
        args: &[&str],
        env: &[(&str, &str)],
        wrapper: &[&str],
    ) -> Result<Gateway, String> {
        let mut last = String::new();
        for _ in 0..5 {
            match Self::start_once(body, grace, args, env, wrapper) {
                Ok(g) => return Ok(g),
                Err(logs)
                    if logs.contains("cannot listen")
                        || logs.contains("Address already in use") =>
                {
                    last = logs
                }
                Err(logs) => return Err(logs),
            }
        }
        Err(last)
    }

    fn start_once(
        body: &str,
        grace: &str,
        args: &[&str],
        env: &[(&str, &str)],
        wrapper: &[&str],
    ) -> Result<Gateway, String> {
        let dir = tempfile::tempdir().expect("tempdir");
        let (port, admin_port) = (free_port(), free_port());
        let server = format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\nadmin_listen = \"127.0.0.1:{admin_port}\"\nshutdown_grace = \"{grace}\"\n"
        );
        let cfg = dir.path().join("limits.toml");
        std::fs::write(&cfg, format!("{server}{body}")).expect("write config");
        let log = dir.path().join("ratewall.log");
        let mut command = match wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(binary());
                c
            }
            None => Command::new(binary()),
        };
        let child = command
            .arg("--config")
            .arg(&cfg)
            .args(args)
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("spawn ratewall");
        let mut g = Gateway {
            port,
            admin_port,
            child,
            _dir: dir,
            log,
            config: cfg,
            server,
        };
        // Its own word that both ports are bound: a bare connect could reach another
        // process that took the port first.
        let end = Instant::now() + Duration::from_secs(20);
        while Instant::now() < end {
            if g.logs().contains("ratewall listening") {
                return Ok(g);
            }
            if let Ok(Some(_)) = g.child.try_wait() {
                return Err(g.logs());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = g.child.kill();
        Err(g.logs())
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.port, path)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.admin_port, path)
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Replace everything after the `[server]` table with `body` (not yet reloaded).
    pub fn rewrite_config(&self, body: &str) {
        std::fs::write(&self.config, format!("{}{body}", self.server)).expect("rewrite config");
    }

    /// The gateway's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The gateway's resident set size (`VmRSS` in `/proc/<pid>/status`), in KiB.
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .expect("/proc/<pid>/status of the gateway");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().strip_suffix("kB"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no VmRSS in:\n{status}"))
    }

    /// Send a signal by name ("HUP", "TERM", "INT", "KILL") to the gateway process.
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.child.id().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{name} failed");
    }

    /// Send SIGHUP and wait until the log says "config reloaded" for the `nth` time.
    pub fn reload(&self, nth: usize) {
        self.signal("HUP");
        let ok = tokio::task::block_in_place(|| {
            self.wait_for_log("config reloaded", nth, Duration::from_secs(15))
        });
        assert!(ok, "reload #{nth} was not logged:\n{}", self.logs());
    }

    /// Wait up to `within` for the process to exit; its status, or `None` if it still runs.
    pub fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let end = Instant::now() + within;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if Instant::now() >= end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Wait until the log contains `needle` `count` times (at most `within`).
    pub fn wait_for_log(&self, needle: &str, count: usize, within: Duration) -> bool {
        let end = Instant::now() + within;
        while Instant::now() < end {
            if self.logs().matches(needle).count() >= count {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------
// Config snippets

/// The `[upstream]` and `[store]` tables for a test config.
pub fn upstream_and_store(upstream: &str, store: &Store) -> String {
    format!(
        "[upstream]\nurl = \"{upstream}\"\nconnect_timeout = \"1s\"\ntimeout = \"5s\"\n{}",
        store.toml()
    )
}

/// Which store a gateway under test runs.
#[derive(Clone)]
pub enum Store {
    Memory,
    Redis {
        url: String,
        on_error: &'static str,
        timeout: &'static str,
    },
}

impl Store {
    /// A Redis store that denies on errors, with a 200 ms call timeout.
    pub fn redis(r: &RedisServer) -> Store {
        Store::Redis {
            url: r.url(),
            on_error: "deny",
            timeout: "200ms",
        }
    }

    /// A Redis store with a generous call timeout: for tests about exactness or features,
    /// not store faults, on a machine that may be loaded.
    pub fn redis_roomy(r: &RedisServer) -> Store {
        Store::Redis {
            url: r.url(),
            on_error: "deny",
            timeout: "2s",
        }
    }

    pub fn toml(&self) -> String {
        match self {
            Store::Memory => "[store]\nbackend = \"memory\"\n".to_string(),
            Store::Redis { url, on_error, timeout } => format!(
                "[store]\nbackend = \"redis\"\nurl = \"{url}\"\nprefix = \"{}\"\ntimeout = \"{timeout}\"\non_error = \"{on_error}\"\n",
                super::keys::PREFIX
            ),
        }
    }
}

/// Every algorithm, as the config names them.
pub const ALGORITHMS: [&str; 4] = ["token_bucket", "gcra", "fixed_window", "sliding_window"];

/// A rule named `name` on `key` with `algorithm` that lets exactly `n` requests pass during
/// a test: nothing refills or rolls over within an hour.
pub fn exact_rule(name: &str, key: &str, algorithm: &str, n: u64) -> String {
    let limit = if algorithm == "token_bucket" || algorithm == "gcra" {
        format!("rate = \"1/h\"\nburst = {n}\n")
    } else {
        format!("rate = \"{n}/h\"\n")
    };
    format!("[[rules]]\nname = \"{name}\"\nkey = \"{key}\"\nalgorithm = \"{algorithm}\"\n{limit}")
}

/// A rule `api` per API key, on every path, that does not refill during a test: exactly
/// `burst` requests of one key pass.
pub fn api_rule(burst: u64) -> String {
    format!("[[rules]]\nname = \"api\"\nkey = \"api_key\"\nrate = \"1/h\"\nburst = {burst}\n")
}

/// A config value for a path (a TOML basic string, quotes and backslashes escaped).
pub fn toml_path(p: &std::path::Path) -> String {
    p.to_str()
        .expect("utf-8 path")
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
}
