//! Real processes for the tests: a redis-server on a free port, an upstream HTTP server,
//! the `ratewall` binary, and an HTTP client. Everything binds to 127.0.0.1 and is killed
//! on drop.
#![allow(dead_code)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr, TcpListener as StdListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free port on 127.0.0.1")
}

fn wait_for_port(port: u16, within: Duration) -> bool {
    let end = Instant::now() + within;
    while Instant::now() < end {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

// ---------------------------------------------------------------------------------------

/// A real redis-server, no persistence, on its own port.
pub struct RedisServer {
    pub port: u16,
    child: Option<Child>,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        let mut s = RedisServer {
            port: free_port(),
            child: None,
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (the README's test command installs it)");
        self.child = Some(child);
        assert!(
            wait_for_port(self.port, Duration::from_secs(10)),
            "redis-server did not start"
        );
        let end = Instant::now() + Duration::from_secs(10);
        while Instant::now() < end {
            if self.connection().is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server does not answer PING");
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn connection(&self) -> redis::RedisResult<redis::Connection> {
        let client = redis::Client::open(self.url())?;
        let mut c = client.get_connection_with_timeout(Duration::from_secs(2))?;
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
        self.spawn();
    }
}

/// How many EVALSHA calls Redis has run since it started (INFO commandstats).
pub fn evalsha_calls(redis: &RedisServer) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut redis.conn())
        .expect("INFO commandstats");
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().expect("a number of calls"))
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

// ---------------------------------------------------------------------------------------

/// What the upstream saw of one request.
#[derive(Debug, Clone)]
pub struct Seen {
    pub path: String,
    pub headers: HeaderMap,
    pub body_len: usize,
}

/// A real HTTP upstream in this test process. Paths:
/// `/slow/<ms>` answers after that many ms; `/stream` answers once the request body's first
/// chunk is in (then reads the rest); `/reset` sends its head and part of a declared body,
/// then fails the connection; `/big/<n>` answers `n` bytes; anything else answers 200 "ok"
/// after reading the body.
pub struct Upstream {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    /// Signalled by `/stream` when the first body chunk arrives.
    pub first_chunk: Arc<tokio::sync::Notify>,
    task: tokio::task::JoinHandle<()>,
}

impl Upstream {
    pub async fn start() -> Upstream {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind upstream");
        let addr = listener.local_addr().expect("upstream addr");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let first_chunk = Arc::new(tokio::sync::Notify::new());
        let (seen2, first2) = (seen.clone(), first_chunk.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (seen, first) = (seen2.clone(), first2.clone());
                tokio::spawn(async move {
                    let svc = service_fn(move |req: Request<Incoming>| {
                        let (seen, first) = (seen.clone(), first.clone());
                        async move { Ok::<_, Infallible>(upstream_answer(req, seen, first).await) }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Upstream {
            addr,
            seen,
            first_chunk,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A body that sends one chunk, then fails: the connection is cut mid-response.
pub struct ResetBody {
    sent: bool,
}

impl hyper::body::Body for ResetBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, std::io::Error>>> {
        if self.sent {
            std::task::Poll::Ready(Some(Err(std::io::Error::other(
                "upstream cut the response",
            ))))
        } else {
            self.sent = true;
            std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(Bytes::from_static(
                b"partial",
            )))))
        }
    }
}

type UpstreamBody = http_body_util::Either<Full<Bytes>, ResetBody>;

async fn upstream_answer(
    req: Request<Incoming>,
    seen: Arc<Mutex<Vec<Seen>>>,
    first: Arc<tokio::sync::Notify>,
) -> Response<UpstreamBody> {
    let path = req.uri().path().to_string();
    let headers = req.headers().clone();
    let mut body = req.into_body();
    let mut body_len = 0;
    let mut notified = false;
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else { break };
        if let Some(d) = frame.data_ref() {
            body_len += d.len();
            if path == "/stream" && !notified && body_len > 0 {
                first.notify_one();
                notified = true;
            }
        }
    }
    if let Some(ms) = path
        .strip_prefix("/slow/")
        .and_then(|m| m.parse::<u64>().ok())
    {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let big: Option<usize> = path.strip_prefix("/big/").and_then(|n| n.parse().ok());
    let reset = path == "/reset";
    seen.lock().unwrap().push(Seen {
        path,
        headers,
        body_len,
    });
    if let Some(n) = big {
        return Response::new(http_body_util::Either::Left(Full::new(Bytes::from(vec![
            b'x';
            n
        ]))));
    }
    if reset {
        let mut resp = Response::new(http_body_util::Either::Right(ResetBody { sent: false }));
        resp.headers_mut()
            .insert("content-length", http::HeaderValue::from_static("1000"));
        return resp;
    }
    let mut resp = Response::new(http_body_util::Either::Left(Full::new(Bytes::from(
        format!("ok {body_len}\n"),
    ))));
    resp.headers_mut()
        .insert("x-upstream", http::HeaderValue::from_static("yes"));
    // A hop-by-hop header the gateway must not pass back.
    resp.headers_mut().insert(
        "connection",
        http::HeaderValue::from_static("x-upstream-hop"),
    );
    resp.headers_mut()
        .insert("x-upstream-hop", http::HeaderValue::from_static("1"));
    resp
}

// ---------------------------------------------------------------------------------------

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

    /// Start the binary and wait until it says it listens. Ports are picked free just
    /// before; if one was taken in between (the gateway exits with "cannot listen"), start
    /// again on new ports.
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
                Err(logs) if logs.contains("cannot listen") => last = logs,
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

    /// Send a signal by name ("HUP", "TERM", "INT", "KILL") to the gateway process.
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.child.id().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{name} failed");
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

/// A response, read whole.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("json body")
    }
}

/// A real HTTP client (hyper-util's pooled client), optionally from a chosen local address.
#[derive(Clone)]
pub struct HttpClient {
    inner: Client<HttpConnector, Full<Bytes>>,
}

impl HttpClient {
    pub fn new() -> HttpClient {
        Self::from_addr(None)
    }

    /// Connect from `local` (any 127.0.0.0/8 address works on Linux loopback), so tests can
    /// be a peer other than 127.0.0.1.
    pub fn from_addr(local: Option<IpAddr>) -> HttpClient {
        let mut conn = HttpConnector::new();
        conn.set_local_address(local);
        HttpClient {
            inner: Client::builder(TokioExecutor::new()).build(conn),
        }
    }

    /// HTTP/2 with prior knowledge (cleartext h2c).
    pub fn h2() -> HttpClient {
        HttpClient {
            inner: Client::builder(TokioExecutor::new())
                .http2_only(true)
                .build(HttpConnector::new()),
        }
    }

    pub async fn get(&self, url: &str, headers: &[(&str, &str)]) -> Reply {
        self.send("GET", url, headers, Bytes::new()).await
    }

    pub async fn send(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> Reply {
        let mut req = Request::builder().method(method).uri(url);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Full::new(body)).expect("request");
        let resp = tokio::time::timeout(Duration::from_secs(30), self.inner.request(req))
            .await
            .expect("request timed out")
            .expect("request failed");
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.expect("body").to_bytes();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }
}

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
    pub fn redis(r: &RedisServer) -> Store {
        Store::Redis {
            url: r.url(),
            on_error: "deny",
            timeout: "200ms",
        }
    }

    pub fn toml(&self) -> String {
        match self {
            Store::Memory => "[store]\nbackend = \"memory\"\n".to_string(),
            Store::Redis { url, on_error, timeout } => format!(
                "[store]\nbackend = \"redis\"\nurl = \"{url}\"\nprefix = \"rwtest\"\ntimeout = \"{timeout}\"\non_error = \"{on_error}\"\n"
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

/// Count statuses.
pub fn tally(statuses: impl IntoIterator<Item = StatusCode>) -> HashMap<u16, usize> {
    let mut m = HashMap::new();
    for s in statuses {
        *m.entry(s.as_u16()).or_insert(0) += 1;
    }
    m
}

// ---------------------------------------------------------------------------------------

/// A real 3-master Redis Cluster (no replicas) on loopback ports, torn down on drop.
pub struct RedisCluster {
    pub ports: Vec<u16>,
    children: Vec<Option<Child>>,
    _dir: tempfile::TempDir,
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let mut children = Vec::new();
        for &port in &ports {
            let child = Command::new("redis-server")
                .current_dir(dir.path())
                .args([
                    "--port",
                    &port.to_string(),
                    "--bind",
                    "127.0.0.1",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    &format!("nodes-{port}.conf"),
                    "--cluster-node-timeout",
                    "2000",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server must be installed");
            children.push(Some(child));
        }
        for &port in &ports {
            assert!(
                wait_for_port(port, Duration::from_secs(10)),
                "cluster node {port} did not start"
            );
        }
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for &port in &ports {
            create.arg(format!("127.0.0.1:{port}"));
        }
        let out = create
            .args(["--cluster-replicas", "0", "--cluster-yes"])
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
        let end = Instant::now() + Duration::from_secs(20);
        while Instant::now() < end {
            if cluster
                .ports
                .iter()
                .all(|&p| cluster.info(p).contains("cluster_state:ok"))
            {
                return cluster;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("the cluster never reached cluster_state:ok");
    }

    /// Seed node URLs for `[store].nodes`.
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
            "[store]\nbackend = \"redis_cluster\"\nnodes = [{}]\nprefix = \"rwtest\"\ntimeout = \"{timeout}\"\non_error = \"{on_error}\"\n",
            nodes.join(", ")
        )
    }

    /// A direct connection to one node (no redirections).
    pub fn node(&self, i: usize) -> redis::Connection {
        let client =
            redis::Client::open(format!("redis://127.0.0.1:{}", self.ports[i])).expect("url");
        client
            .get_connection_with_timeout(Duration::from_secs(2))
            .expect("node connection")
    }

    fn info(&self, port: u16) -> String {
        redis::Client::open(format!("redis://127.0.0.1:{port}"))
            .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(1)))
            .and_then(|mut c| redis::cmd("CLUSTER").arg("INFO").query::<String>(&mut c))
            .unwrap_or_default()
    }

    /// Which node (index) serves `key`'s slot.
    pub fn node_of(&self, key: &str) -> usize {
        let mut c = self.node(0);
        let slot: i64 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(&mut c)
            .expect("KEYSLOT");
        let slots: Vec<(i64, i64, (String, i64))> = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query::<Vec<redis::Value>>(&mut c)
            .expect("CLUSTER SLOTS")
            .into_iter()
            .filter_map(|v| match v {
                redis::Value::Array(items) if items.len() >= 3 => {
                    let int = |v: &redis::Value| match v {
                        redis::Value::Int(i) => Some(*i),
                        _ => None,
                    };
                    let master = match &items[2] {
                        redis::Value::Array(m) if m.len() >= 2 => {
                            let host = match &m[0] {
                                redis::Value::BulkString(b) => {
                                    String::from_utf8_lossy(b).into_owned()
                                }
                                _ => String::new(),
                            };
                            (host, int(&m[1])?)
                        }
                        _ => return None,
                    };
                    Some((int(&items[0])?, int(&items[1])?, master))
                }
                _ => None,
            })
            .collect();
        let (_, _, (_, port)) = slots
            .iter()
            .find(|(lo, hi, _)| (*lo..=*hi).contains(&slot))
            .expect("a node serves every slot");
        self.ports
            .iter()
            .position(|p| i64::from(*p) == *port)
            .expect("a known node")
    }

    /// Kill node `i` (SIGKILL); its slots have no replica to fail over to.
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

// ---------------------------------------------------------------------------------------

/// A Structured Field list header (RFC 9651) of string items: each item's name and
/// parameters, in order. Panics (failing the test) on anything else.
pub fn sf_list(value: &str) -> Vec<(String, sfv::Parameters)> {
    let list = sfv::Parser::parse_list(value.as_bytes())
        .unwrap_or_else(|e| panic!("{value:?} is not a Structured Field list: {e}"));
    list.into_iter()
        .map(|entry| match entry {
            sfv::ListEntry::Item(item) => {
                let name = item
                    .bare_item
                    .as_str()
                    .unwrap_or_else(|| panic!("item of {value:?} is not a string"))
                    .to_string();
                (name, item.params)
            }
            sfv::ListEntry::InnerList(_) => panic!("{value:?} has an inner list"),
        })
        .collect()
}

/// An integer parameter of an item.
pub fn int(params: &sfv::Parameters, key: &str) -> i64 {
    params
        .get(key)
        .and_then(|v| v.as_int())
        .unwrap_or_else(|| panic!("no integer {key} in {params:?}"))
}
