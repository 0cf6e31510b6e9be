//! Real `redis-server` processes: one on its own port, or a Redis Cluster, and what the
//! tests read from them.
//!
//! Nothing a server started here writes reaches the disk the tests run from: no RDB
//! snapshots (`--save ""`), no AOF (`--appendonly no`), and a `--dir` in a temporary
//! directory removed on drop for anything Redis writes all the same (a replica's
//! full-sync file, a cluster's `nodes.conf`).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::free_port;

/// The arguments every redis-server here starts with.
pub(super) fn redis_args(port: u16, dir: &Path) -> Vec<String> {
    [
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        dir.to_str().expect("utf-8 temp dir"),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// How a `redis-server` start ended.
pub(super) enum Started {
    /// It runs and answers on its port, as itself.
    Up(Child),
    /// It exited because its port (or a cluster node's bus port, the port + 10000) was
    /// taken: by another process here, or an outgoing connection's.
    Taken,
}

/// Start `redis-server <args>` listening on `port` (its output in `log`), and wait until
/// it answers there as itself: `INFO server` names the child's process id (a bare
/// connect could reach another process that took the port first). `Taken` when it exited
/// for a port in use; any other exit, or no answer within 10 s, panics with its log.
pub(super) fn start_redis(port: u16, args: &[String], log: &Path) -> Started {
    let out = std::fs::File::create(log).expect("a redis-server log file");
    let err = out.try_clone().expect("a redis-server log file");
    let mut child = Command::new("redis-server")
        .args(args)
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .spawn()
        .expect("redis-server must be installed (the README's test command installs it)");
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            let said = std::fs::read_to_string(log).unwrap_or_default();
            if said.contains("Address already in use") {
                return Started::Taken;
            }
            panic!("redis-server on {port} exited ({status}):\n{said}");
        }
        let pid: Option<u32> = connect(port, Duration::from_secs(1))
            .and_then(|mut c| redis::cmd("INFO").arg("server").query::<String>(&mut c))
            .ok()
            .and_then(|info| {
                info.lines()
                    .find_map(|l| l.strip_prefix("process_id:"))
                    .and_then(|p| p.trim().parse().ok())
            });
        if pid == Some(child.id()) {
            return Started::Up(child);
        }
        if Instant::now() >= end {
            let _ = child.kill();
            let _ = child.wait();
            let said = std::fs::read_to_string(log).unwrap_or_default();
            panic!("redis-server on {port} did not answer within 10 s:\n{said}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Start `redis-server` with `args(port)` on a free port, its log in `dir`; on a port
/// taken meanwhile (as [`super::Gateway::start`] does), again on another. The port and
/// the process.
pub(super) fn start_on_free_port(dir: &Path, args: impl Fn(u16) -> Vec<String>) -> (u16, Child) {
    for _ in 0..5 {
        let port = free_port();
        let log = dir.join(format!("redis-{port}.log"));
        if let Started::Up(child) = start_redis(port, &args(port), &log) {
            return (port, child);
        }
    }
    panic!("redis-server found its port taken five times in a row");
}

/// Start `redis-server <args>` again on `port`, its own port before (a restart keeps the
/// address the gateway was given).
pub(super) fn restart_on(port: u16, dir: &Path, args: &[String]) -> Child {
    match start_redis(port, args, &dir.join(format!("redis-{port}.log"))) {
        Started::Up(child) => child,
        Started::Taken => panic!("port {port} was taken while its redis-server was down"),
    }
}

/// A server's arguments: [`redis_args`], and `--replicaof` for a replica.
fn args(port: u16, dir: &Path, replica_of: Option<u16>) -> Vec<String> {
    let mut args = redis_args(port, dir);
    if let Some(primary) = replica_of {
        args.extend([
            "--replicaof".into(),
            "127.0.0.1".into(),
            primary.to_string(),
        ]);
    }
    args
}

fn connect(port: u16, within: Duration) -> redis::RedisResult<redis::Connection> {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))?.get_connection_with_timeout(within)
}

// ---------------------------------------------------------------------------------------

/// A real redis-server, no persistence, on its own port.
pub struct RedisServer {
    pub port: u16,
    child: Option<Child>,
    dir: tempfile::TempDir,
    /// The primary's port, for a replica.
    replica_of: Option<u16>,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        Self::start_as(None)
    }

    /// A server of its own, or a replica of the primary on `replica_of`.
    fn start_as(replica_of: Option<u16>) -> RedisServer {
        let dir = tempfile::tempdir().expect("tempdir");
        let (port, child) =
            start_on_free_port(dir.path(), |port| args(port, dir.path(), replica_of));
        RedisServer {
            port,
            child: Some(child),
            dir,
            replica_of,
        }
    }

    /// A replica of `primary` (`--replicaof`), returned once its link is up and it has
    /// everything the primary had.
    pub fn start_replica_of(primary: &RedisServer) -> RedisServer {
        let s = Self::start_as(Some(primary.port));
        let end = Instant::now() + Duration::from_secs(20);
        loop {
            let info: String = redis::cmd("INFO")
                .arg("replication")
                .query(&mut s.conn())
                .unwrap_or_default();
            // In sync on its side, and counted by the primary: a `WAIT` the primary
            // answers with this replica's acknowledgement (until the primary has marked it
            // online, `WAIT 1` answers 0 though the link is up).
            if info.contains("master_link_status:up") {
                let acked: i64 = redis::cmd("WAIT")
                    .arg(1)
                    .arg(100)
                    .query(&mut primary.conn())
                    .unwrap_or(0);
                if acked >= 1 {
                    return s;
                }
            }
            assert!(Instant::now() < end, "the replica never synced:\n{info}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn connection(&self) -> redis::RedisResult<redis::Connection> {
        let mut c = connect(self.port, Duration::from_secs(2))?;
        redis::cmd("PING").query::<String>(&mut c)?;
        Ok(c)
    }

    /// A synchronous connection for inspecting what the gateway wrote.
    pub fn conn(&self) -> redis::Connection {
        self.connection().expect("redis connection")
    }

    /// Kill the server (SIGKILL) and wait until it is gone.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start it again on the same port (empty: no persistence).
    pub fn restart(&mut self) {
        self.kill();
        let args = args(self.port, self.dir.path(), self.replica_of);
        self.child = Some(restart_on(self.port, self.dir.path(), &args));
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

// ---------------------------------------------------------------------------------------
// What the tests read from a server

/// How many times Redis has run `command` since it started (INFO commandstats; a
/// subcommand is written `script|load`).
pub fn command_calls(conn: &mut redis::Connection, command: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(conn)
        .expect("INFO commandstats");
    let prefix = format!("cmdstat_{command}:calls=");
    info.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().expect("a number of calls"))
}

/// How many EVALSHA calls Redis has run since it started.
pub fn evalsha_calls(redis: &RedisServer) -> u64 {
    command_calls(&mut redis.conn(), "evalsha")
}

pub fn pttl(conn: &mut redis::Connection, key: &str) -> i64 {
    redis::cmd("PTTL").arg(key).query(conn).expect("PTTL")
}

pub fn get(conn: &mut redis::Connection, key: &str) -> Option<String> {
    redis::cmd("GET").arg(key).query(conn).expect("GET")
}

/// The keys a node holds, the deployment's identity tag secret (`<prefix>:tag-secret`,
/// which one node of a cluster holds) aside, as [`scan`] leaves it out.
pub fn dbsize(conn: &mut redis::Connection) -> usize {
    let all: usize = redis::cmd("DBSIZE").query(conn).expect("DBSIZE");
    all - scan_all(conn, "*:tag-secret").len()
}

/// Redis' clock, in microseconds.
pub fn redis_now_us(conn: &mut redis::Connection) -> u64 {
    let (s, us): (u64, u64) = redis::cmd("TIME").query(conn).expect("TIME");
    s * 1_000_000 + us
}

/// Every key matching `pattern`, by SCAN, sorted and without repeats; the deployment's
/// identity tag secret (`<prefix>:tag-secret`, which every gateway on a Redis store makes
/// or reads at start) aside: the tests count what requests wrote.
pub fn scan(conn: &mut redis::Connection, pattern: &str) -> Vec<String> {
    let mut keys = scan_all(conn, pattern);
    keys.retain(|k| !k.ends_with(":tag-secret"));
    keys
}

/// Every key matching `pattern`, by SCAN, sorted and without repeats.
fn scan_all(conn: &mut redis::Connection, pattern: &str) -> Vec<String> {
    let mut cursor: u64 = 0;
    let mut keys = Vec::new();
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query(conn)
            .expect("SCAN");
        keys.extend(batch);
        if next == 0 {
            break;
        }
        cursor = next;
    }
    keys.sort();
    keys.dedup();
    keys
}

// ---------------------------------------------------------------------------------------

/// The cluster slot of `key`, as the Redis Cluster specification defines it: CRC16
/// (XMODEM) of the key, or of its hash tag (the part between the first `{` and the next
/// `}`, when not empty), modulo 16384.
pub fn key_slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let hashed = bytes
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &bytes[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(bytes);
    let mut crc: u16 = 0;
    for &b in hashed {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

/// A real Redis Cluster of 3 masters, and replicas for each when asked, on loopback
/// ports, torn down on drop. Node `i` is the `i`-th process started: 0, 1, 2 start as
/// masters, 3 and on (with replicas) as their replicas; a failover changes who is what.
pub struct RedisCluster {
    pub ports: Vec<u16>,
    children: Vec<Option<Child>>,
    /// The nodes' folder, removed on drop.
    _dir: tempfile::TempDir,
}

impl RedisCluster {
    /// Three masters, no replicas.
    pub fn start() -> RedisCluster {
        Self::start_with(0)
    }

    /// Three masters with one replica each.
    pub fn start_with_replicas() -> RedisCluster {
        Self::start_with(1)
    }

    /// Three masters with `replicas` replicas each (two: a promoted replica still has one
    /// to confirm writes, for `replication = { wait = 1 }`).
    pub fn start_with(replicas: usize) -> RedisCluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut ports = Vec::new();
        let mut children = Vec::new();
        for _ in 0..3 * (1 + replicas) {
            let (port, child) = start_on_free_port(dir.path(), |port| {
                let mut args = redis_args(port, dir.path());
                args.extend(
                    [
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        &format!("nodes-{port}.conf"),
                        "--cluster-node-timeout",
                        "2000",
                    ]
                    .iter()
                    .map(|s| s.to_string()),
                );
                args
            });
            ports.push(port);
            children.push(Some(child));
        }
        // `--cluster create` makes the first three masters and, in order, the rest their
        // replicas; which replica gets which master is its choice, read back below.
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for &port in &ports {
            create.arg(format!("127.0.0.1:{port}"));
        }
        let out = create
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .expect("redis-cli must be installed");
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = RedisCluster {
            ports,
            children,
            _dir: dir,
        };
        cluster.wait_until_ok(Duration::from_secs(30));
        if replicas > 0 {
            let end = Instant::now() + Duration::from_secs(30);
            while !(0..3).all(|m| cluster.replica_of(m).is_some_and(|r| cluster.in_sync(r))) {
                assert!(
                    Instant::now() < end,
                    "the replicas never caught up:\n{}",
                    cluster.cluster_nodes()
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        cluster
    }

    /// Wait until every live node says `cluster_state:ok` and agrees on who serves every
    /// slot.
    pub fn wait_until_ok(&self, within: Duration) {
        let end = Instant::now() + within;
        while Instant::now() < end {
            let live: Vec<usize> = (0..self.ports.len()).filter(|&i| self.is_live(i)).collect();
            if live
                .iter()
                .all(|&i| self.info(self.ports[i]).contains("cluster_state:ok"))
                // Every node knows a master for every slot: `state:ok` can come a moment
                // before a replica's view of the slot map is whole.
                && live
                    .iter()
                    .all(|&i| self.slot_owners(i).iter().all(Option::is_some))
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!(
            "the cluster never reached cluster_state:ok:\n{}",
            self.cluster_nodes()
        );
    }

    fn is_live(&self, i: usize) -> bool {
        self.children[i].is_some()
    }

    /// Seed node URLs for `[store].nodes`: every node started.
    pub fn nodes(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect()
    }

    /// `[store]` for a gateway on this cluster.
    pub fn store_toml(&self, on_error: &str, timeout: &str) -> String {
        let nodes: Vec<String> = self.nodes().iter().map(|n| format!("\"{n}\"")).collect();
        format!(
            "[store]\nbackend = \"redis_cluster\"\nnodes = [{}]\nprefix = \"{}\"\ntimeout = \"{timeout}\"\non_error = \"{on_error}\"\n",
            nodes.join(", "),
            super::keys::PREFIX
        )
    }

    /// A direct connection to one node (no redirections).
    pub fn node(&self, i: usize) -> redis::Connection {
        connect(self.ports[i], Duration::from_secs(2)).expect("node connection")
    }

    fn info(&self, port: u16) -> String {
        connect(port, Duration::from_secs(1))
            .and_then(|mut c| redis::cmd("CLUSTER").arg("INFO").query::<String>(&mut c))
            .unwrap_or_default()
    }

    /// `CLUSTER NODES` as the first live node sees it (for messages, and roles).
    pub fn cluster_nodes(&self) -> String {
        (0..self.ports.len())
            .filter(|&i| self.is_live(i))
            .find_map(|i| {
                connect(self.ports[i], Duration::from_secs(1))
                    .and_then(|mut c| redis::cmd("CLUSTER").arg("NODES").query::<String>(&mut c))
                    .ok()
            })
            .unwrap_or_default()
    }

    /// Node `i`'s cluster id.
    pub fn node_id(&self, i: usize) -> String {
        redis::cmd("CLUSTER")
            .arg("MYID")
            .query(&mut self.node(i))
            .expect("CLUSTER MYID")
    }

    /// The slot of `key` ([`key_slot`]).
    pub fn slot_of(&self, key: &str) -> u16 {
        key_slot(key)
    }

    /// For every slot, the node (index) that serves it as master, as the first live node
    /// sees it (`None` while nobody does, or the slot is being moved).
    pub fn masters_by_slot(&self) -> Vec<Option<usize>> {
        let live = (0..self.ports.len())
            .find(|&i| self.is_live(i))
            .expect("a live node");
        self.slot_owners(live)
    }

    fn slot_owners(&self, asked: usize) -> Vec<Option<usize>> {
        let mut owners = vec![None; 16384];
        let nodes: String = redis::cmd("CLUSTER")
            .arg("NODES")
            .query(&mut self.node(asked))
            .unwrap_or_default();
        for line in nodes.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 9 || !fields[2].contains("master") || fields[2].contains("fail") {
                continue;
            }
            let Some(node) = fields[1]
                .split('@')
                .next()
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| p.parse::<u16>().ok())
                .and_then(|port| self.ports.iter().position(|&p| p == port))
            else {
                continue;
            };
            for range in &fields[8..] {
                if range.starts_with('[') {
                    continue; // a slot being migrated or imported
                }
                let (lo, hi) = range.split_once('-').unwrap_or((range, range));
                if let (Ok(lo), Ok(hi)) = (lo.parse::<usize>(), hi.parse::<usize>()) {
                    for owner in &mut owners[lo..=hi.min(16383)] {
                        *owner = Some(node);
                    }
                }
            }
        }
        owners
    }

    /// Which node (index) serves `key`'s slot as master.
    pub fn node_of(&self, key: &str) -> usize {
        let slot = self.slot_of(key);
        self.masters_by_slot()[usize::from(slot)]
            .unwrap_or_else(|| panic!("no master serves slot {slot}:\n{}", self.cluster_nodes()))
    }

    /// The node (index) that replicates master `m`, if any.
    pub fn replica_of(&self, m: usize) -> Option<usize> {
        let id = self.node_id(m);
        (0..self.ports.len())
            .filter(|&i| i != m && self.is_live(i))
            .find(|&i| {
                let info: String = redis::cmd("CLUSTER")
                    .arg("NODES")
                    .query(&mut self.node(i))
                    .unwrap_or_default();
                info.lines()
                    .any(|l| l.contains("myself") && l.contains("slave") && l.contains(&id))
            })
    }

    /// Whether replica `r` has every write its master acknowledged (INFO replication:
    /// its offset equals its master's).
    pub fn in_sync(&self, r: usize) -> bool {
        let field = |info: &str, name: &str| -> Option<i64> {
            info.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().parse().ok())
        };
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query(&mut self.node(r))
            .unwrap_or_default();
        if !info.contains("master_link_status:up") {
            return false;
        }
        let Some(master_port) = field(&info, "master_port:") else {
            return false;
        };
        let Some(mine) = field(&info, "slave_repl_offset:") else {
            return false;
        };
        let master: String = connect(master_port as u16, Duration::from_secs(1))
            .and_then(|mut c| redis::cmd("INFO").arg("replication").query(&mut c))
            .unwrap_or_default();
        field(&master, "master_repl_offset:") == Some(mine)
    }

    /// Kill node `i` (SIGKILL).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.children[i].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for i in 0..self.children.len() {
            self.kill(i);
        }
    }
}
