//! Set-up from the command line and the environment: `--listen`, `--admin-listen` and
//! `--upstream` (and `RATEWALL_LISTEN`, `RATEWALL_ADMIN_LISTEN`, `RATEWALL_UPSTREAM`)
//! override the file — the flag beats the variable, which beats the file — at start, on
//! every SIGHUP reload, and in `ratewall check`; a bad value is an error naming the flag
//! or variable, exit 1, before anything binds. The real binary, a real upstream.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{api_rule, binary, free_port, Gateway, HttpClient, Upstream};
use http::StatusCode;

/// An upstream nothing listens on: a request forwarded there is a 502.
const DEAD: &str = "http://127.0.0.1:1";

fn file_upstream(url: &str) -> String {
    format!("[upstream]\nurl = \"{url}\"\nconnect_timeout = \"1s\"\ntimeout = \"5s\"\n")
}

fn local(port: u16, path: &str) -> String {
    format!("http://127.0.0.1:{port}{path}")
}

/// Whether anything accepts a connection on `port` now.
fn listening(port: u16) -> bool {
    std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
}

#[tokio::test(flavor = "multi_thread")]
async fn flags_override_the_files_listen_admin_listen_and_upstream() {
    let upstream = Upstream::start().await;
    let (listen, admin) = (free_port(), free_port());
    let gw = Gateway::start_with(
        &file_upstream(DEAD),
        &[
            "--listen",
            &format!("127.0.0.1:{listen}"),
            "--admin-listen",
            &format!("127.0.0.1:{admin}"),
            "--upstream",
            &format!("{}/base", upstream.url()),
        ],
        &[],
    );
    let client = HttpClient::new();
    let r = client.get(&local(listen, "/x"), &[]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", gw.logs());
    assert_eq!(
        upstream.seen()[0].path,
        "/base/x",
        "the override's base path"
    );
    let r = client.get(&local(admin, "/healthz"), &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(
        !listening(gw.port),
        "the file's listen address is not bound"
    );
    assert!(!listening(gw.admin_port), "nor its admin_listen");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_environment_overrides_the_file_and_a_flag_overrides_the_environment() {
    let upstream = Upstream::start().await;
    let (env_listen, env_admin, flag_admin) = (free_port(), free_port(), free_port());
    let gw = Gateway::start_with(
        &file_upstream(DEAD),
        &[
            "--admin-listen",
            &format!("127.0.0.1:{flag_admin}"),
            "--upstream",
            &upstream.url(),
        ],
        &[
            ("RATEWALL_LISTEN", &format!("127.0.0.1:{env_listen}")),
            ("RATEWALL_ADMIN_LISTEN", &format!("127.0.0.1:{env_admin}")),
            // Beaten by --upstream: were it used, the answer would be 502.
            ("RATEWALL_UPSTREAM", DEAD),
        ],
    );
    let client = HttpClient::new();
    // The variable beats the file...
    let r = client.get(&local(env_listen, "/x"), &[]).await;
    assert!(
        !listening(gw.port),
        "the file's listen address is not bound"
    );
    // ...and the flag beats the variable.
    assert_eq!(r.status, StatusCode::OK, "{}", gw.logs());
    let r = client.get(&local(flag_admin, "/healthz"), &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(
        !listening(env_admin),
        "RATEWALL_ADMIN_LISTEN lost to the flag"
    );

    // An empty variable counts as unset: the file's value holds.
    let gw = Gateway::start_with(
        &file_upstream(&upstream.url()),
        &[],
        &[("RATEWALL_LISTEN", ""), ("RATEWALL_UPSTREAM", "")],
    );
    let r = client.get(&gw.url("/y"), &[]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", gw.logs());
}

#[tokio::test(flavor = "multi_thread")]
async fn overrides_survive_a_reload() {
    let upstream = Upstream::start().await;
    let listen = free_port();
    let gw = Gateway::start_with(
        &file_upstream(DEAD),
        &["--listen", &format!("127.0.0.1:{listen}")],
        &[("RATEWALL_UPSTREAM", &upstream.url())],
    );
    let client = HttpClient::new();
    let key = [("x-api-key", "k1")];
    assert_eq!(
        client.get(&local(listen, "/a"), &key).await.status,
        StatusCode::OK
    );
    // The file gains a rule (so the reload visibly took effect) and still names a dead
    // upstream; the overrides hold.
    gw.rewrite_config(&format!("{}{}", file_upstream(DEAD), api_rule(1)));
    gw.reload(1);
    let statuses = [
        client.get(&local(listen, "/b"), &key).await.status,
        client.get(&local(listen, "/c"), &key).await.status,
    ];
    assert_eq!(
        statuses,
        [StatusCode::OK, StatusCode::TOO_MANY_REQUESTS],
        "the reloaded rule applies, and the allowed request reached the overriding upstream:\n{}",
        gw.logs()
    );
    assert_eq!(upstream.seen().len(), 2);
    assert!(!listening(gw.port));
    assert!(
        !gw.logs().contains("take effect on restart only"),
        "the reload saw the same listen address:\n{}",
        gw.logs()
    );
}

/// `ratewall` with `args` and `env` on `config`: (exit code, stdout, stderr).
fn run(config: &str, args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("limits.toml");
    std::fs::write(&path, config).unwrap();
    let mut cmd = Command::new(binary());
    cmd.arg("--config").arg(&path).args(args);
    for v in [
        "RATEWALL_LISTEN",
        "RATEWALL_ADMIN_LISTEN",
        "RATEWALL_UPSTREAM",
    ] {
        cmd.env_remove(v);
    }
    let mut child = cmd
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn ratewall");
    // A run that wrongly starts serving would never exit: bound it.
    let end = std::time::Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > end {
            let _ = child.kill();
            panic!("ratewall {args:?} {env:?} did not exit");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_bad_override_is_an_error_that_names_it_and_exits_1_before_binding() {
    let port = free_port();
    let config = format!(
        "[server]\nlisten = \"127.0.0.1:{port}\"\n{}",
        file_upstream(DEAD)
    );
    for (args, env, says) in [
        (
            &["--listen", "0.0.0.0"][..],
            &[][..],
            "ratewall: invalid override: --listen = \"0.0.0.0\": invalid socket address syntax",
        ),
        (
            &[],
            &[("RATEWALL_ADMIN_LISTEN", "localhost:9090")][..],
            "ratewall: invalid override: RATEWALL_ADMIN_LISTEN = \"localhost:9090\": invalid socket address syntax",
        ),
        (
            &[],
            &[("RATEWALL_UPSTREAM", "ftp://backend")],
            "ratewall: invalid override: RATEWALL_UPSTREAM = \"ftp://backend\": invalid upstream url \"ftp://backend\": only http:// and https:// upstreams are supported",
        ),
        // The flag is checked even where it beats a good variable, and in `check`.
        (
            &["check", "--upstream", "http://"],
            &[("RATEWALL_UPSTREAM", "http://127.0.0.1:3000")],
            "ratewall: invalid override: --upstream = \"http://\": invalid upstream url \"http://\": ",
        ),
    ] {
        let (code, _, stderr) = run(&config, args, env);
        assert_eq!(code, 1, "{args:?} {env:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?} {env:?}: {stderr}");
        assert!(!listening(port), "{args:?} {env:?}: bound a port");
    }
}

#[test]
fn check_applies_the_overrides_and_says_so() {
    let config = format!(
        "[server]\nlisten = \"127.0.0.1:8080\"\n{}",
        file_upstream("http://127.0.0.1:3000")
    );
    let (code, stdout, stderr) = run(
        &config,
        &["check", "--listen", "0.0.0.0:8080"],
        &[
            ("RATEWALL_ADMIN_LISTEN", "0.0.0.0:9090"),
            ("RATEWALL_UPSTREAM", "http://host.docker.internal:3000"),
        ],
    );
    assert_eq!(code, 0, "{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines[1..5],
        [
            "--listen overrides [server] listen, RATEWALL_ADMIN_LISTEN overrides [server] admin_listen, RATEWALL_UPSTREAM overrides [upstream] url",
            "listen        0.0.0.0:8080",
            "admin_listen  0.0.0.0:9090",
            "upstream      http://host.docker.internal:3000",
        ],
        "{stdout}"
    );
}

/// The shipped `config/limits.toml`, run as the README's Docker example runs it: the
/// listeners and the upstream from the environment. Killed on drop.
struct Shipped {
    child: std::process::Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Shipped {
    fn start(upstream: &str) -> Shipped {
        let mut last = String::new();
        for _ in 0..5 {
            let dir = tempfile::tempdir().unwrap();
            let log = dir.path().join("log");
            let (port, admin) = (free_port(), free_port());
            let mut child = Command::new(binary())
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .env("RATEWALL_LISTEN", format!("127.0.0.1:{port}"))
                .env("RATEWALL_ADMIN_LISTEN", format!("127.0.0.1:{admin}"))
                .env("RATEWALL_UPSTREAM", upstream)
                .stdout(std::process::Stdio::null())
                .stderr(std::fs::File::create(&log).unwrap())
                .spawn()
                .expect("spawn ratewall");
            let end = std::time::Instant::now() + Duration::from_secs(20);
            while std::time::Instant::now() < end {
                last = std::fs::read_to_string(&log).unwrap_or_default();
                if last.contains("ratewall listening") {
                    return Shipped {
                        child,
                        port,
                        _dir: dir,
                    };
                }
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
            if !last.contains("cannot listen") {
                break;
            }
        }
        panic!("the shipped config did not start:\n{last}");
    }
}

impl Drop for Shipped {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The README's quick-start session, on the shipped config (the demo backend replaced by
/// the test upstream): 20 of a burst of 25 pass, three exports pass and the fourth is a
/// 429 for about ten minutes, no key is a 401, the pro plan passes.
#[tokio::test(flavor = "multi_thread")]
async fn the_readme_session_holds_on_the_shipped_config() {
    let upstream = Upstream::start().await;
    let gw = Shipped::start(&upstream.url());
    let client = HttpClient::new();
    let free = [("x-api-key", "demo-free-key")];
    let orders = local(gw.port, "/api/orders");
    // Warm the connection pool, then wait for the bucket to be full again (2 s at 10/s).
    assert_eq!(client.get(&orders, &free).await.status, StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(2_100)).await;
    let started = std::time::Instant::now();
    let burst: Vec<_> = (0..25)
        .map(|i| {
            let (client, url) = (client.clone(), format!("{orders}?n={i}"));
            tokio::spawn(async move { client.get(&url, &free).await.status })
        })
        .collect();
    let mut passed = 0;
    for t in burst {
        passed += usize::from(t.await.unwrap() == StatusCode::OK);
    }
    // 20 at once; one more per 100 ms the burst took (none when it is as quick as curl's).
    let refilled = (started.elapsed().as_millis() / 100) as usize;
    assert!(
        (20..=20 + refilled).contains(&passed),
        "{passed} of 25 passed in {:?}",
        started.elapsed()
    );

    // A reader types the next command well after `api` refilled; each export takes 1 of it.
    tokio::time::sleep(Duration::from_millis(2_100)).await;
    let export = local(gw.port, "/api/reports/export");
    for _ in 0..3 {
        assert_eq!(client.get(&export, &free).await.status, StatusCode::OK);
    }
    let denied = client.get(&export, &free).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = denied.header("retry-after").unwrap().parse().unwrap();
    assert!((590..=600).contains(&retry), "retry-after {retry}");
    assert_eq!(
        denied.json()["violated-policies"],
        serde_json::json!(["exports"])
    );

    let r = client.get(&orders, &[]).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = client.get(&orders, &[("x-api-key", "demo-pro-key")]).await;
    assert_eq!(r.status, StatusCode::OK);
}
