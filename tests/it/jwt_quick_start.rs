//! The README's JWT quick start, as written: `config/jwt.toml` with the secret its
//! `export` line makes, tokens from `scripts/jwt-token`, and the README's claims — a
//! token passes and its `sub` reaches the backend as `x-user-id` (a client's own copy
//! dropped), `not.a.token` is a 401 that never reaches the backend, each `sub` has a burst
//! of 20 and a `pro` token one of 200. The real binary, a real upstream, real clients.

use crate::common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{binary, free_port, wait_for_port, HttpClient, Upstream};
use http::StatusCode;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `scripts/jwt-token` with `args`, signed with `secret`.
fn token(secret: &str, args: &[&str]) -> String {
    let out = Command::new(root().join("scripts/jwt-token"))
        .args(args)
        .env("RATEWALL_JWT_SECRET", secret)
        .output()
        .expect("scripts/jwt-token (python3)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// `n` requests at once with `token` to `url`: how many got each status, and how long
/// they took.
async fn at_once(url: &str, token: &str, n: usize) -> (usize, usize, Duration) {
    let client = HttpClient::new();
    let bearer = format!("Bearer {token}");
    let started = Instant::now();
    let replies = futures_join(
        (0..n)
            .map(|_| {
                let (client, url, bearer) = (client.clone(), url.to_string(), bearer.clone());
                tokio::spawn(async move {
                    client
                        .get(&url, &[("authorization", bearer.as_str())])
                        .await
                        .status
                })
            })
            .collect(),
    )
    .await;
    let took = started.elapsed();
    let ok = replies.iter().filter(|s| **s == StatusCode::OK).count();
    let denied = replies
        .iter()
        .filter(|s| **s == StatusCode::TOO_MANY_REQUESTS)
        .count();
    assert_eq!(ok + denied, n, "{replies:?}");
    (ok, denied, took)
}

async fn futures_join(handles: Vec<tokio::task::JoinHandle<StatusCode>>) -> Vec<StatusCode> {
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(h.await.expect("request task"));
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn the_jwt_quick_start_works_as_written() {
    let _watch = common::watchdog();
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let section = &readme[readme
        .find("### Signed tokens (JWT)")
        .expect("README: ### Signed tokens (JWT)")..];
    let section = &section[..section.find("\n### ").unwrap_or(section.len())];
    for said in [
        "export RATEWALL_JWT_SECRET=$(openssl rand -hex 32)",
        "cargo run --release -- --config config/jwt.toml",
        "$(scripts/jwt-token alice)",
        "'authorization: Bearer not.a.token'",
        "scripts/jwt-token bob pro",
    ] {
        assert!(section.contains(said), "the README's JWT section: {said}");
    }
    // The README's secret, as its export line makes it.
    let rand = Command::new("openssl")
        .args(["rand", "-hex", "32"])
        .output()
        .expect("openssl");
    let secret = String::from_utf8(rand.stdout).unwrap().trim().to_string();
    assert_eq!(secret.len(), 64);

    let upstream = Upstream::start().await;
    let (port, admin) = (free_port(), free_port());
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let mut child = Command::new(binary())
        .arg("--config")
        .arg(root().join("config/jwt.toml"))
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
        .args(["--upstream", &upstream.url()])
        .env("RATEWALL_JWT_SECRET", &secret)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("spawn ratewall");
    let up = wait_for_port(port, Duration::from_secs(20));
    let logs = || std::fs::read_to_string(&log).unwrap_or_default();
    assert!(up, "ratewall did not listen: {}", logs());
    let url = format!("http://127.0.0.1:{port}/orders");
    let client = HttpClient::new();

    // A token passes; the backend gets its verified sub, and only that.
    let alice = token(&secret, &["alice"]);
    let r = client
        .get(
            &url,
            &[
                ("authorization", &format!("Bearer {alice}")),
                ("x-user-id", "mallory"),
            ],
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", logs());
    let seen = upstream.seen();
    assert_eq!(seen.len(), 1);
    let ids: Vec<_> = seen[0].headers.get_all("x-user-id").iter().collect();
    assert_eq!(ids, ["alice"], "the verified sub, never the client's copy");

    // Not a token: 401 with the Bearer challenge, and the backend never sees it.
    let r = client
        .get(&url, &[("authorization", "Bearer not.a.token")])
        .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let challenge = r.header("www-authenticate").unwrap_or_default();
    assert!(
        challenge.starts_with("Bearer error=\"invalid_token\""),
        "{challenge}"
    );
    assert_eq!(upstream.arrived(), 1);

    // A burst of 20 per sub (refilled at 10/s while the requests run), 200 for pro.
    let (ok, denied, took) = at_once(&url, &token(&secret, &["carol"]), 40).await;
    let refilled = (took.as_secs_f64() * 10.0).ceil() as usize;
    assert!(
        (20..=20 + refilled).contains(&ok) && denied > 0,
        "{ok} passed, {denied} denied in {took:?}"
    );
    let (ok, denied, _) = at_once(&url, &token(&secret, &["bob", "pro"]), 60).await;
    assert_eq!((ok, denied), (60, 0), "a pro token's burst is 200");

    let _ = child.kill();
    let _ = child.wait();
}
