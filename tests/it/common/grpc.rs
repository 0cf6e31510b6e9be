//! gRPC's own server and client (grpcio, Python), for end-to-end calls through the
//! gateway: `tests/it/py/grpc_backend.py` as a backend process, `tests/it/py/grpc_client.py`
//! run once per plan of calls. Raw bytes both ways (no protoc); what the client saw comes
//! back as JSON: codes in grpcio's own words (`grpc.StatusCode` names), messages in order,
//! both metadata blocks. Every process is killed on drop, a test's failure included.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/it/py")
        .join(name)
}

/// Lower-case hex, as the scripts write bytes in JSON.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn unhex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2), "odd hex {s:?}");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// Messages as the backend's `Expand` takes them and its `Collect` answers: each a 4-byte
/// big-endian length and its bytes.
pub fn pack(messages: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for m in messages {
        out.extend_from_slice(&u32::try_from(m.len()).expect("a message").to_be_bytes());
        out.extend_from_slice(m);
    }
    out
}

// ---------------------------------------------------------------------------------------
// The backend

/// grpcio's server (`grpc_backend.py`, its docstring lists the methods) on a port of the
/// kernel's choice, cleartext or TLS; killed on drop.
pub struct GrpcBackend {
    pub port: u16,
    child: Option<Child>,
    dir: tempfile::TempDir,
}

impl GrpcBackend {
    /// Cleartext HTTP/2 (an `h2c` pool's server).
    pub fn start() -> GrpcBackend {
        Self::spawn(None)
    }

    /// TLS with ALPN `h2` (an `h2` pool's server), presenting `cert` (PEM files).
    pub fn start_tls(cert: &Path, key: &Path) -> GrpcBackend {
        Self::spawn(Some((cert, key)))
    }

    fn spawn(tls: Option<(&Path, &Path)>) -> GrpcBackend {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut command = Command::new("python3");
        command
            .arg(script("grpc_backend.py"))
            .arg("--seen")
            .arg(dir.path().join("seen"));
        if let Some((cert, key)) = tls {
            command.arg("--cert").arg(cert).arg("--key").arg(key);
        }
        let stderr = dir.path().join("stderr");
        let mut child = command
            // No proxy for what grpcio itself might connect to.
            .env_remove("http_proxy")
            .env_remove("https_proxy")
            .env_remove("grpc_proxy")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).expect("stderr file"))
            .spawn()
            .expect("spawn python3 grpc_backend.py (tests/requirements.txt)");
        let stdout = child.stdout.take().expect("stdout");
        let mut backend = GrpcBackend {
            port: 0,
            child: Some(child),
            dir,
        };
        // Its own word that it serves, read on a thread so that it can time out.
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx.recv_timeout(Duration::from_secs(30)).unwrap_or_default();
        match line.trim().strip_prefix("listening ") {
            Some(port) => backend.port = port.parse().expect("a port"),
            None => panic!(
                "the gRPC backend did not start ({line:?}):\n{}",
                backend.stderr()
            ),
        }
        backend
    }

    /// What it wrote on stderr.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stderr")).unwrap_or_default()
    }

    /// The methods of the calls that reached its handlers, in order.
    pub fn seen(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.path().join("seen"))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// How many calls of `method` reached its handlers.
    pub fn calls(&self, method: &str) -> usize {
        self.seen().iter().filter(|m| *m == method).count()
    }

    /// Kill it (SIGKILL) and wait until it is gone: a dead backend.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for GrpcBackend {
    fn drop(&mut self) {
        self.kill();
    }
}

// ---------------------------------------------------------------------------------------
// The client

/// One call of a plan for `grpc_client.py`.
#[derive(Clone)]
pub struct Call {
    kind: &'static str,
    method: String,
    messages: Vec<Vec<u8>>,
    generate: Option<(usize, usize)>,
    timeout_s: f64,
}

impl Call {
    fn new(kind: &'static str, method: &str, messages: Vec<Vec<u8>>) -> Call {
        Call {
            kind,
            method: method.to_string(),
            messages,
            generate: None,
            timeout_s: 30.0,
        }
    }

    pub fn unary(method: &str, request: &[u8]) -> Call {
        Self::new("unary", method, vec![request.to_vec()])
    }

    pub fn server_stream(method: &str, request: &[u8]) -> Call {
        Self::new("server_stream", method, vec![request.to_vec()])
    }

    pub fn client_stream(method: &str, messages: Vec<Vec<u8>>) -> Call {
        Self::new("client_stream", method, messages)
    }

    /// A ping-pong: each message sent once the previous one's answer came back.
    pub fn bidi(method: &str, messages: Vec<Vec<u8>>) -> Call {
        Self::new("bidi", method, messages)
    }

    /// A client stream of `count` messages of `size` bytes, generated by the client as it
    /// sends them (never held whole); the result's `generated` says what went.
    pub fn generated(method: &str, count: usize, size: usize) -> Call {
        Call {
            generate: Some((count, size)),
            ..Self::new("client_stream", method, Vec::new())
        }
    }

    /// The call's own deadline (default 30 s).
    pub fn timeout(mut self, seconds: f64) -> Call {
        self.timeout_s = seconds;
        self
    }

    fn json(&self) -> Value {
        let mut v = json!({
            "kind": self.kind,
            "method": self.method,
            "messages": self.messages.iter().map(|m| hex(m)).collect::<Vec<_>>(),
            "timeout": self.timeout_s,
        });
        if let Some((count, size)) = self.generate {
            v["generate"] = json!({ "count": count, "size": size });
        }
        v
    }
}

/// What the client generated for a `Call::generated`.
#[derive(Debug, Deserialize, PartialEq, Eq)]
pub struct Generated {
    pub messages: u64,
    pub bytes: u64,
    pub sha256: String,
}

#[derive(Deserialize)]
struct RawOutcome {
    code: String,
    code_number: u8,
    details: Option<String>,
    responses: Vec<String>,
    initial_metadata: Vec<(String, String)>,
    trailing_metadata: Vec<(String, String)>,
    elapsed_ms: u64,
    generated: Option<Generated>,
}

/// One call's outcome, as grpcio gave it to its application.
pub struct Outcome {
    /// `grpc.StatusCode`'s name: `OK`, `RESOURCE_EXHAUSTED`, `UNAVAILABLE`...
    pub code: String,
    pub code_number: u8,
    pub details: Option<String>,
    /// The answer's messages, in the order they arrived.
    pub responses: Vec<Vec<u8>>,
    /// Metadata, `-bin` values in hex.
    pub initial: Vec<(String, String)>,
    /// Trailing metadata; for a Trailers-Only answer (the gateway's own) grpcio puts its
    /// fields here.
    pub trailing: Vec<(String, String)>,
    pub elapsed: Duration,
    pub generated: Option<Generated>,
}

/// Messages by their sizes: a failed assertion does not print megabytes.
impl std::fmt::Debug for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sizes: Vec<usize> = self.responses.iter().map(Vec::len).collect();
        f.debug_struct("Outcome")
            .field("code", &self.code)
            .field("details", &self.details)
            .field("response_sizes", &sizes)
            .field("initial", &self.initial)
            .field("trailing", &self.trailing)
            .field("elapsed", &self.elapsed)
            .field("generated", &self.generated)
            .finish()
    }
}

impl Outcome {
    /// The value of trailing metadata `key` (the first, if several).
    pub fn trailer(&self, key: &str) -> Option<&str> {
        self.trailing
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// The value of initial metadata `key`.
    pub fn header(&self, key: &str) -> Option<&str> {
        self.initial
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// `grpc_client.py` making `calls`, one after the other on one channel to the gateway's
/// listener on `port` (cleartext HTTP/2); killed on drop.
pub struct GrpcClient {
    child: tokio::process::Child,
}

impl GrpcClient {
    pub async fn spawn(port: u16, calls: &[Call]) -> GrpcClient {
        let plan = json!({
            "target": format!("127.0.0.1:{port}"),
            "calls": calls.iter().map(Call::json).collect::<Vec<_>>(),
        });
        let mut child = tokio::process::Command::new("python3")
            .arg(script("grpc_client.py"))
            .env_remove("http_proxy")
            .env_remove("https_proxy")
            .env_remove("grpc_proxy")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn python3 grpc_client.py (tests/requirements.txt)");
        let mut stdin = child.stdin.take().expect("stdin");
        stdin
            .write_all(plan.to_string().as_bytes())
            .await
            .expect("write the plan");
        drop(stdin);
        GrpcClient { child }
    }

    /// Whether it is still making its calls.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Its outcomes, one per call, once it is done (within `within`).
    pub async fn finish(self, within: Duration) -> Vec<Outcome> {
        let out = tokio::time::timeout(within, self.child.wait_with_output())
            .await
            .unwrap_or_else(|_| panic!("the gRPC client did not finish within {within:?}"))
            .expect("the gRPC client's output");
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(
            out.status.success(),
            "grpc_client.py failed ({}):\n{stdout}\n{stderr}",
            out.status
        );
        let raw: Vec<RawOutcome> = serde_json::from_str(stdout.trim())
            .unwrap_or_else(|e| panic!("grpc_client.py's output ({e}):\n{stdout}\n{stderr}"));
        raw.into_iter()
            .map(|r| Outcome {
                code: r.code,
                code_number: r.code_number,
                details: r.details,
                responses: r.responses.iter().map(|h| unhex(h)).collect(),
                initial: r.initial_metadata,
                trailing: r.trailing_metadata,
                elapsed: Duration::from_millis(r.elapsed_ms),
                generated: r.generated,
            })
            .collect()
    }
}

/// Make `calls` through the gateway on `port`: their outcomes, in order.
pub async fn grpc_calls(port: u16, calls: &[Call]) -> Vec<Outcome> {
    let outcomes = GrpcClient::spawn(port, calls)
        .await
        .finish(Duration::from_secs(90))
        .await;
    assert_eq!(outcomes.len(), calls.len());
    outcomes
}
