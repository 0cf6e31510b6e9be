//! Redis under Sentinel, for real: one primary, two replicas (`--replicaof`) and three
//! `redis-server --sentinel` processes on free loopback ports, torn down on drop. The
//! sentinels monitor the primary as [`MASTER_NAME`] with a quorum of 2, call it down after
//! 1 s of silence (`down-after-milliseconds 1000`) and promote a replica; a failover takes
//! about 2 to 5 s here, longer on a loaded machine.
//!
//! Like every server of the harness, nothing here persists: no RDB, no AOF, each node's
//! `--dir` (and each sentinel's config file, which Sentinel rewrites) in a temporary
//! directory removed on drop.

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use super::free_port;
use super::redis_server::{redis_args, restart_on, start_redis, Started};

/// The name the sentinels monitor the primary by.
pub const MASTER_NAME: &str = "m";

/// One process: a data node or a sentinel, on its port, while it runs.
struct Process {
    port: u16,
    args: Vec<String>,
    /// Its folder (its log there).
    dir: PathBuf,
    child: Option<Child>,
}

impl Process {
    /// `redis-server` with `args(port)` on a free port (again on another if it was taken
    /// meanwhile), its folder `dir(port)`.
    fn start(dir: impl Fn(u16) -> PathBuf, args: impl Fn(u16, &Path) -> Vec<String>) -> Process {
        for _ in 0..5 {
            let port = free_port();
            let home = dir(port);
            let argv = args(port, &home);
            let log = home.join(format!("redis-{port}.log"));
            if let Started::Up(child) = start_redis(port, &argv, &log) {
                return Process {
                    port,
                    args: argv,
                    dir: home,
                    child: Some(child),
                };
            }
        }
        panic!("redis-server found its port taken five times in a row");
    }

    /// Start it again on its port.
    fn respawn(&mut self) {
        self.child = Some(restart_on(self.port, &self.dir, &self.args));
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// One primary, two replicas, three sentinels.
pub struct RedisSentinel {
    /// The data nodes: 0 the primary at start, 1 and 2 its replicas. A failover changes
    /// who is what: ask [`RedisSentinel::primary_port`].
    nodes: Vec<Process>,
    sentinels: Vec<Process>,
    _dir: tempfile::TempDir,
}

fn connect(port: u16) -> redis::RedisResult<redis::Connection> {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))?
        .get_connection_with_timeout(Duration::from_secs(1))
}

/// A folder of its own for one process (a replica's full-sync file, a sentinel's config).
fn subdir(dir: &Path, name: &str) -> PathBuf {
    let d = dir.join(name);
    std::fs::create_dir_all(&d).expect("create a node's folder");
    d
}

impl RedisSentinel {
    /// Start it all and wait until the replicas are in sync and every sentinel sees both
    /// replicas and the two other sentinels (what a failover needs).
    pub fn start() -> RedisSentinel {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().to_path_buf();
        let node_dir = |port: u16| subdir(&root, &format!("node-{port}"));
        let primary = Process::start(node_dir, redis_args);
        let first = primary.port;
        let mut nodes = vec![primary];
        for _ in 0..2 {
            nodes.push(Process::start(node_dir, |port, home| {
                let mut args = redis_args(port, home);
                args.extend(["--replicaof".into(), "127.0.0.1".into(), first.to_string()]);
                args
            }));
        }
        let mut s = RedisSentinel {
            nodes,
            sentinels: Vec::new(),
            _dir: dir,
        };
        s.wait_in_sync(first, 2, Duration::from_secs(30));
        for _ in 0..3 {
            let sentinel = Process::start(
                |port| subdir(&root, &format!("sentinel-{port}")),
                |port, home| {
                    let conf = home.join("sentinel.conf");
                    std::fs::write(
                        &conf,
                        format!(
                            "port {port}\nbind 127.0.0.1\ndir {}\n\
                             sentinel monitor {MASTER_NAME} 127.0.0.1 {first} 2\n\
                             sentinel down-after-milliseconds {MASTER_NAME} 1000\n\
                             sentinel failover-timeout {MASTER_NAME} 5000\n\
                             sentinel parallel-syncs {MASTER_NAME} 1\n",
                            home.display(),
                        ),
                    )
                    .expect("write sentinel.conf");
                    vec![conf.display().to_string(), "--sentinel".to_string()]
                },
            );
            s.sentinels.push(sentinel);
        }
        s.wait_for_sentinels(Duration::from_secs(30));
        s
    }

    /// The sentinels' URLs, for `[store] sentinels`.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|s| format!("redis://127.0.0.1:{}", s.port))
            .collect()
    }

    /// `[store]` for a gateway on these sentinels.
    pub fn store_toml(&self, on_error: &str, timeout: &str) -> String {
        let urls: Vec<String> = self
            .sentinel_urls()
            .iter()
            .map(|u| format!("\"{u}\""))
            .collect();
        format!(
            "[store]\nbackend = \"redis_sentinel\"\nsentinels = [{}]\nmaster_name = \"{MASTER_NAME}\"\nprefix = \"{}\"\ntimeout = \"{timeout}\"\non_error = \"{on_error}\"\n",
            urls.join(", "),
            super::keys::PREFIX
        )
    }

    /// The primary's port, as the first sentinel that answers names it.
    pub fn primary_port(&self) -> u16 {
        self.sentinels
            .iter()
            .filter(|s| s.child.is_some())
            .find_map(|s| {
                let mut c = connect(s.port).ok()?;
                let (_, port): (String, u16) = redis::cmd("SENTINEL")
                    .arg("get-master-addr-by-name")
                    .arg(MASTER_NAME)
                    .query(&mut c)
                    .ok()?;
                Some(port)
            })
            .expect("no sentinel names a primary")
    }

    /// A connection to the primary now (to read what the gateway wrote).
    pub fn primary(&self) -> redis::Connection {
        connect(self.primary_port()).expect("primary connection")
    }

    /// A connection to the data node on `port`.
    pub fn node(&self, port: u16) -> redis::Connection {
        connect(port).expect("node connection")
    }

    /// SIGKILL the primary; its port.
    pub fn kill_primary(&mut self) -> u16 {
        let port = self.primary_port();
        self.kill_node(port);
        port
    }

    /// SIGKILL the data node on `port`.
    pub fn kill_node(&mut self, port: u16) {
        if let Some(n) = self.nodes.iter_mut().find(|n| n.port == port) {
            n.kill();
        }
    }

    /// Start the data node on `port` again, empty, as it was started (the sentinels make
    /// an old primary a replica of the new one once they see it).
    pub fn restart_node(&mut self, port: u16) {
        if let Some(n) = self.nodes.iter_mut().find(|n| n.port == port) {
            n.kill();
            n.respawn();
        }
    }

    /// Wait until every live sentinel names a primary other than `old` and that node
    /// answers `ROLE` as master; its port.
    pub fn wait_for_new_primary(&self, old: u16, within: Duration) -> u16 {
        let end = Instant::now() + within;
        while Instant::now() < end {
            let named: Vec<Option<u16>> = self
                .sentinels
                .iter()
                .filter(|s| s.child.is_some())
                .map(|s| {
                    let mut c = connect(s.port).ok()?;
                    redis::cmd("SENTINEL")
                        .arg("get-master-addr-by-name")
                        .arg(MASTER_NAME)
                        .query::<(String, u16)>(&mut c)
                        .ok()
                        .map(|(_, p)| p)
                })
                .collect();
            if let Some(Some(port)) = named.first() {
                if *port != old && named.iter().all(|n| n == &Some(*port)) && self.is_master(*port)
                {
                    return *port;
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("no new primary within {within:?} (the old one: {old})");
    }

    fn is_master(&self, port: u16) -> bool {
        connect(port)
            .and_then(|mut c| redis::cmd("ROLE").query::<Vec<redis::Value>>(&mut c))
            .is_ok_and(
                |role| matches!(role.first(), Some(redis::Value::BulkString(b)) if b == b"master"),
            )
    }

    /// Wait until the primary on `primary` has `replicas` replicas online, each at its
    /// offset.
    fn wait_in_sync(&self, primary: u16, replicas: usize, within: Duration) {
        let end = Instant::now() + within;
        while Instant::now() < end {
            let info: String = connect(primary)
                .and_then(|mut c| redis::cmd("INFO").arg("replication").query(&mut c))
                .unwrap_or_default();
            let offset = info
                .lines()
                .find_map(|l| l.strip_prefix("master_repl_offset:"))
                .map(str::trim);
            let online = info
                .lines()
                .filter(|l| l.starts_with("slave") && l.contains("state=online"))
                .filter(|l| offset.is_some_and(|o| l.contains(&format!("offset={o},"))))
                .count();
            if online >= replicas {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the replicas never caught up with {primary}");
    }

    /// Wait until every sentinel sees the replicas and the other sentinels.
    fn wait_for_sentinels(&self, within: Duration) {
        let field = |fields: &[String], name: &str| -> Option<usize> {
            let at = fields.iter().position(|f| f == name)?;
            fields.get(at + 1)?.parse().ok()
        };
        let end = Instant::now() + within;
        while Instant::now() < end {
            let ready = self.sentinels.iter().all(|s| {
                let Ok(mut c) = connect(s.port) else {
                    return false;
                };
                let Ok(fields) = redis::cmd("SENTINEL")
                    .arg("master")
                    .arg(MASTER_NAME)
                    .query::<Vec<String>>(&mut c)
                else {
                    return false;
                };
                field(&fields, "num-slaves") >= Some(2)
                    && field(&fields, "num-other-sentinels") >= Some(2)
            });
            if ready {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("the sentinels never saw the replicas and each other");
    }
}

impl Drop for RedisSentinel {
    fn drop(&mut self) {
        for p in self.sentinels.iter_mut().chain(self.nodes.iter_mut()) {
            p.kill();
        }
    }
}

/// For a test's own checks of a node's role.
pub fn role(conn: &mut redis::Connection) -> String {
    let role: Vec<redis::Value> = redis::cmd("ROLE").query(conn).expect("ROLE");
    match role.first() {
        Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
        Some(redis::Value::SimpleString(s)) => s.clone(),
        other => panic!("ROLE answered {other:?}"),
    }
}
