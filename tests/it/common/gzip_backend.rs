//! An OpenAI-compatible backend that gzips its answers (`tests/it/py/gzip_backend.py`, run
//! as a subprocess with Python's own `gzip`): `/accept/…` when the request's
//! `Accept-Encoding` allows it, `/always/…` whatever the request says. Its usage comes
//! from the query (`?prompt=10&completion=4000`). Killed on drop; the script also exits
//! when its standard input ends.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::task::JoinHandle;

pub struct GzipBackend {
    pub port: u16,
    answers: Arc<Mutex<Vec<Value>>>,
    stderr: tempfile::NamedTempFile,
    reader: JoinHandle<()>,
    // Dropped last: the server ends with them.
    _stdin: ChildStdin,
    _child: Child,
}

impl GzipBackend {
    pub async fn start() -> GzipBackend {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/it/py/gzip_backend.py");
        let stderr = tempfile::NamedTempFile::new().expect("a file for stderr");
        let mut child = Command::new("python3")
            .arg(&script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr.reopen().expect("reopen stderr file"))
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("run python3 {}: {e}", script.display()));
        let stdin = child.stdin.take().expect("stdin");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let first = tokio::time::timeout(Duration::from_secs(20), lines.next_line()).await;
        let port = first
            .ok()
            .and_then(|l| l.ok().flatten())
            .and_then(|l| serde_json::from_str::<Value>(&l).ok())
            .and_then(|v| v["listening"].as_u64())
            .unwrap_or_else(|| {
                panic!(
                    "gzip_backend.py did not start:\n{}",
                    std::fs::read_to_string(stderr.path()).unwrap_or_default()
                )
            });
        let answers = Arc::new(Mutex::new(Vec::new()));
        let kept = answers.clone();
        let reader = tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    kept.lock().unwrap_or_else(|p| p.into_inner()).push(v);
                }
            }
        });
        GzipBackend {
            port: u16::try_from(port).expect("a port"),
            answers,
            stderr,
            reader,
            _stdin: stdin,
            _child: child,
        }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The answer it gave to `path` (target as sent), once it said so (at most 10 s):
    /// `{"path", "accept_encoding", "gzipped"}`.
    pub async fn answered(&self, path: &str) -> Value {
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            let found = self
                .answers
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .find(|v| v["path"] == path)
                .cloned();
            if let Some(v) = found {
                return v;
            }
            assert!(
                Instant::now() < end,
                "gzip_backend.py never answered {path}:\n{}",
                std::fs::read_to_string(self.stderr.path()).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for GzipBackend {
    fn drop(&mut self) {
        self.reader.abort();
    }
}
