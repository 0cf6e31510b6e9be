//! Set-up from the command line and the environment: `--listen`, `--admin-listen`,
//! `--tls-listen` and `--upstream` (and `RATEWALL_LISTEN`, `RATEWALL_ADMIN_LISTEN`,
//! `RATEWALL_TLS_LISTEN`, `RATEWALL_UPSTREAM`) override the file — the flag beats the
//! variable, which beats the file — at start, on every SIGHUP reload, and in `ratewall
//! check`; a bad value is an error naming the flag or variable, exit 1, before anything
//! binds. Then the README as a newcomer runs it, on the shipped config: the quick-start
//! session, `ratewall check`, the status page's identity tags and counts, the RateLimit
//! fields, the TLS quick start. The real binary, a real upstream.

use crate::common;

use std::process::Command;
use std::time::Duration;

use common::headers::{int, sf_list};
use common::{api_key_hash, api_rule, binary, free_port, Gateway, HttpClient, Upstream};
use http::StatusCode;

/// The variables that override the file: none leaks from the test's own environment.
const OVERRIDES: [&str; 4] = [
    "RATEWALL_LISTEN",
    "RATEWALL_ADMIN_LISTEN",
    "RATEWALL_TLS_LISTEN",
    "RATEWALL_UPSTREAM",
];

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
    let _watch = common::watchdog();
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
    let _watch = common::watchdog();
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
    let _watch = common::watchdog();
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
    for v in OVERRIDES {
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
    let _watch = common::watchdog();
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
    let _watch = common::watchdog();
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

/// The log at `log` once it says "ratewall listening" (or after 20 s, whatever it says).
fn log_once_listening(log: &std::path::Path) -> String {
    let end = std::time::Instant::now() + Duration::from_secs(20);
    let mut text = String::new();
    while std::time::Instant::now() < end && !text.contains("ratewall listening") {
        std::thread::sleep(Duration::from_millis(20));
        text = std::fs::read_to_string(log).unwrap_or_default();
    }
    text
}

/// The shipped `config/limits.toml`, run as the README's Docker example runs it: the
/// listeners and the upstream from the environment, under an open-file limit of 20,000
/// (a common distribution default, and the one the newcomer's machine had). Killed on
/// drop.
struct Shipped {
    child: std::process::Child,
    port: u16,
    admin: u16,
    log: std::path::PathBuf,
    _dir: tempfile::TempDir,
    /// When it said it listens.
    started: std::time::Instant,
}

/// The open-file limit the shipped config is run under.
const OPEN_FILES: u64 = 20_000;

/// `ratewall` under an open-file limit of [`OPEN_FILES`] (util-linux `prlimit`).
fn limited_ratewall() -> Command {
    let mut c = Command::new("prlimit");
    c.arg(format!("--nofile={OPEN_FILES}:{OPEN_FILES}"))
        .arg("--")
        .arg(binary());
    for v in OVERRIDES {
        c.env_remove(v);
    }
    c
}

impl Shipped {
    fn start(upstream: &str) -> Shipped {
        let mut last = String::new();
        for _ in 0..5 {
            let dir = tempfile::tempdir().unwrap();
            let log = dir.path().join("log");
            let (port, admin) = (free_port(), free_port());
            let mut child = limited_ratewall()
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .env("RATEWALL_LISTEN", format!("127.0.0.1:{port}"))
                .env("RATEWALL_ADMIN_LISTEN", format!("127.0.0.1:{admin}"))
                .env("RATEWALL_UPSTREAM", upstream)
                .env("RUST_LOG", "info")
                .stdout(std::process::Stdio::null())
                .stderr(std::fs::File::create(&log).unwrap())
                .spawn()
                .expect("spawn ratewall (under prlimit)");
            let end = std::time::Instant::now() + Duration::from_secs(20);
            while std::time::Instant::now() < end {
                last = std::fs::read_to_string(&log).unwrap_or_default();
                if last.contains("ratewall listening") {
                    return Shipped {
                        child,
                        port,
                        admin,
                        log,
                        _dir: dir,
                        started: std::time::Instant::now(),
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

    fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
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
/// 429 for about ten minutes, no key is a 401, the pro plan passes. Then what the README
/// says of it: the RateLimit fields (parsed as Structured Fields) never promise more than
/// the rule gives; the status page names the limited key by the tag the access log and
/// `ratewall check --path` use (the shipped config has no admin token: observability.rs
/// holds `/admin/state` and `/admin/top` to the same tag); each rule's counts add up; the
/// 401's access line names its rule; the first log line is no warning.
#[tokio::test(flavor = "multi_thread")]
async fn the_readme_session_holds_on_the_shipped_config() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = Shipped::start(&upstream.url());
    let client = HttpClient::new();
    let free = [("x-api-key", "demo-free-key")];
    let orders = local(gw.port, "/api/orders");
    // Warm the connection pool, then wait for the bucket to be full again (2 s at 10/s).
    let first = client.get(&orders, &free).await;
    assert_eq!(first.status, StatusCode::OK);
    assert!(first.header("date").is_some(), "{:?}", first.headers);
    // The fields as a client reads them: `api` advertises its burst (q=20) and the time
    // the rate takes to refill it (w=2); `r` is never above `q`.
    let policy = sf_list(first.header("ratelimit-policy").expect("RateLimit-Policy"));
    let state = sf_list(first.header("ratelimit").expect("RateLimit"));
    let names: Vec<&str> = policy.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["api", "per-ip"], "{policy:?}");
    assert_eq!((int(&policy[0].1, "q"), int(&policy[0].1, "w")), (20, 2));
    assert_eq!((int(&policy[1].1, "q"), int(&policy[1].1, "w")), (300, 60));
    for ((name, p), (same, st)) in policy.iter().zip(&state) {
        assert_eq!(name, same);
        assert!(int(st, "r") <= int(p, "q"), "{name}: r above q: {state:?}");
    }
    assert_eq!(int(&state[0].1, "r"), 19);
    // Real time on purpose: the README's reader runs the next command after `api` has
    // refilled (10/s, on the gateway's clock).
    tokio::time::sleep(Duration::from_millis(2_100)).await;
    let started = std::time::Instant::now();
    let burst: Vec<_> = (0..25)
        .map(|i| {
            let (client, url) = (client.clone(), format!("{orders}?n={i}"));
            tokio::spawn(async move {
                let r = client.get(&url, &free).await;
                // What `api` advertises and what it says is left, on the same answer.
                let q = r
                    .header("ratelimit-policy")
                    .map(|v| int(&sf_list(v)[0].1, "q"));
                let left = r.header("ratelimit").map(|v| int(&sf_list(v)[0].1, "r"));
                (r.status, q, left)
            })
        })
        .collect();
    let mut passed = 0;
    for t in burst {
        let (status, q, left) = t.await.unwrap();
        passed += usize::from(status == StatusCode::OK);
        assert_eq!(q, Some(20), "api's q on every answer");
        assert!(
            left.zip(q).is_some_and(|(r, q)| r <= q),
            "r {left:?} above the advertised q {q:?}"
        );
    }
    // 20 at once; one more per 100 ms the burst took (none when it is as quick as curl's).
    let refilled = (started.elapsed().as_millis() / 100) as usize;
    assert!(
        (20..=20 + refilled).contains(&passed),
        "{passed} of 25 passed in {:?}",
        started.elapsed()
    );

    // A reader types the next command well after `api` refilled (real time on purpose);
    // each export takes 1 of it.
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
    let policy = sf_list(denied.header("ratelimit-policy").expect("RateLimit-Policy"));
    let exports = policy
        .iter()
        .find(|(n, _)| n == "exports")
        .expect("exports");
    // 30 tokens, three exports of 10, refilled at one a minute: 30 minutes.
    assert_eq!((int(&exports.1, "q"), int(&exports.1, "w")), (3, 1800));
    let state = sf_list(denied.header("ratelimit").expect("RateLimit"));
    let left = state.iter().find(|(n, _)| n == "exports").expect("exports");
    assert_eq!(int(&left.1, "r"), 0, "no export left");

    let r = client.get(&orders, &[]).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = client.get(&orders, &[("x-api-key", "demo-pro-key")]).await;
    assert_eq!(r.status, StatusCode::OK);

    // One tag for the key, stable: keyed by the secret the gateway keeps beside the keys
    // file (config/.ratewall-tag-secret, made at the first start; computed here), never
    // the first digits of the digest that names its Redis keys. On the public status
    // page...
    let secret = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/.ratewall-tag-secret"),
    )
    .expect("the tag secret kept beside the keys file");
    let tag = ratewall::identity::tag::TagKey::from_secret(secret.trim().as_bytes())
        .tag(&ratewall::identity::digest_api_key(b"demo-free-key"))
        .as_str()
        .to_string();
    assert_ne!(tag, api_key_hash("demo-free-key")[..8]);
    let stats = client
        .get(&local(gw.admin, "/status.json"), &[])
        .await
        .json();
    let top = stats["top"].as_array().expect("top");
    assert!(
        top.iter()
            .any(|t| t["id"] == tag.as_str() && t["rule"] == "exports" && t["hint"] == "key"),
        "the limited key as {tag} on the status page: {top:?}"
    );
    // ...in the access log...
    let logs = gw.logs();
    assert!(logs.contains(&format!("id=\"{tag}\"")), "{logs}");
    // ...and in `ratewall check --path`.
    let check = limited_ratewall()
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args([
            "check",
            "--path",
            "/api/orders",
            "--header",
            "x-api-key: demo-free-key",
        ])
        .output()
        .expect("ratewall check");
    let explained = String::from_utf8_lossy(&check.stdout);
    assert!(
        explained.contains(&format!("(identity {tag})")),
        "{explained}"
    );

    // Every rule's counts add up: a request one rule denied is no other rule's pass, and
    // no rule's allowed (or delayed) exceeds the requests that passed.
    let totals = &stats["totals"];
    let allowed_in_all = totals["allowed"].as_u64().unwrap();
    for rule in stats["rules"].as_array().expect("rules") {
        let o = &rule["outcomes"];
        let own = o["allowed"].as_u64().unwrap() + o["delayed"].as_u64().unwrap();
        assert!(
            own <= allowed_in_all,
            "{}: {own} allowed, {allowed_in_all} allowed in all: {stats}",
            rule["name"]
        );
    }
    let rule = |name: &str| {
        stats["rules"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == name)
            .unwrap_or_else(|| panic!("rule {name}"))["outcomes"]
            .clone()
    };
    // The fourth export: `exports` denied it, `api` and `daily` would have let it pass.
    assert_eq!(rule("exports")["denied"], 1, "{stats}");
    for name in ["api", "daily"] {
        assert!(
            rule(name)["denied_by_other"].as_u64().unwrap() >= 1,
            "{name}: {stats}"
        );
    }
    // The 429s of the burst were `api`'s own; `per-ip` let them pass, charged nothing,
    // and the fourth export too.
    let api_denied = rule("api")["denied"].as_u64().unwrap();
    assert_eq!(api_denied, 25 - passed as u64, "{stats}");
    assert!(
        rule("per-ip")["denied_by_other"].as_u64().unwrap() > api_denied,
        "{stats}"
    );
    assert_eq!(totals["unauthorized"], 1, "{stats}");

    // The 401's access line names the rule that refused it.
    let refused = logs
        .lines()
        .find(|l| l.contains("status=401"))
        .unwrap_or_else(|| panic!("no 401 in the log:\n{logs}"));
    assert!(refused.contains("rule=\"api\""), "{refused}");
    // No warning on the first line, nor anywhere at start: max_connections is derived
    // from the open-file limit, not set beyond it.
    let start: Vec<&str> = logs
        .lines()
        .take_while(|l| !l.contains("ratewall::access"))
        .collect();
    assert!(
        !start.iter().any(|l| l.contains("WARN")),
        "a warning at start:\n{}",
        start.join("\n")
    );
    // Nor later, with no backend on the shipped config's own addresses (issue 42: a pool
    // on 127.0.0.1:3000 with health checks warned 6 s in, 3 failed checks 2 s apart).
    let quiet_until = gw.started + Duration::from_secs(8);
    while std::time::Instant::now() < quiet_until {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let logs = gw.logs();
    let warned: Vec<&str> = logs.lines().filter(|l| l.contains("WARN")).collect();
    assert!(
        warned.is_empty(),
        "a warning 8 s in:\n{}",
        warned.join("\n")
    );
}

/// `ratewall check` as the README runs it on the shipped config, under the same open-file
/// limit: max_connections is what the limit holds, and says where it came from; a
/// `max_connections` the file sets beyond the limit is warned of at start.
#[test]
fn max_connections_is_derived_from_the_open_file_limit_unless_set() {
    let _watch = common::watchdog();
    let out = limited_ratewall()
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .arg("check")
        .output()
        .expect("ratewall check");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    let want = (OPEN_FILES - 64) / 2;
    assert!(
        stdout.contains(&format!(
            "max_connections {want} (not set: 10000, or what the open-file limit holds)"
        )),
        "{stdout}"
    );

    // Set beyond the limit: a warning that says so.
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("limits.toml");
    std::fs::write(
        &path,
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\nmax_connections = 10000\n{}",
            file_upstream(DEAD)
        ),
    )
    .unwrap();
    let log = dir.path().join("log");
    let mut child = limited_ratewall()
        .arg("--config")
        .arg(&path)
        .env("RUST_LOG", "info")
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("spawn");
    let text = log_once_listening(&log);
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        text.lines()
            .any(|l| l.contains("WARN")
                && l.contains("max_connections may need 20064 file descriptors")),
        "{text}"
    );
}

/// The README's TLS quick start, as written: its openssl command makes the pair in
/// `config/`, which git ignores and Docker builds leave out; the shipped `[server.tls]`
/// lines, uncommented, listen on loopback; and an https request with the README's
/// headers gets 200 over HTTP/2.
#[tokio::test(flavor = "multi_thread")]
async fn the_tls_quick_start_works_as_written_on_loopback() {
    let _watch = common::watchdog();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let tls = &readme[readme.find("### TLS").expect("README: ### TLS")..];
    let block = tls
        .split("```sh\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("README's TLS openssl block");
    let command = block.replace("\\\n", " ");
    assert!(command.trim_start().starts_with("openssl req"), "{command}");

    // A copy of the config folder, where a newcomer's checkout would have it.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config");
    std::fs::create_dir(&config).unwrap();
    for f in ["limits.toml", "keys.toml"] {
        std::fs::copy(root.join("config").join(f), config.join(f)).unwrap();
    }
    let made = Command::new("sh")
        .arg("-c")
        .arg(command.trim())
        .current_dir(dir.path())
        .output()
        .expect("openssl");
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    for f in ["cert.pem", "key.pem"] {
        assert!(
            config.join(f).exists(),
            "the README's openssl wrote config/{f}"
        );
        // Never one `git add -A` from a commit, never in an image.
        let ignored = Command::new("git")
            .args(["check-ignore", "-q", &format!("config/{f}")])
            .current_dir(root)
            .status()
            .expect("git");
        assert!(ignored.success(), "config/{f} is not ignored by git");
    }
    let dockerignore = std::fs::read_to_string(root.join(".dockerignore")).unwrap();
    assert!(
        dockerignore.lines().any(|l| l.trim() == "config/*.pem"),
        "{dockerignore}"
    );

    // Uncomment [server.tls]'s listen and certificates lines, as the README says.
    let shipped = std::fs::read_to_string(config.join("limits.toml")).unwrap();
    let mut uncommented = Vec::new();
    let mut listen = None;
    // Inside the commented-out `[server.tls]` table (other tables shown commented out,
    // `[decide]`, have a `listen` of their own).
    let mut in_tls = false;
    for line in shipped.lines() {
        let bare = line.strip_prefix("# ").unwrap_or(line);
        if bare.starts_with('[') {
            in_tls = bare == "[server.tls]";
        }
        if bare == "[server.tls]" || (in_tls && bare.starts_with("certificates = ")) {
            uncommented.push(bare.to_string());
        } else if in_tls && bare.starts_with("listen = \"") && line.starts_with("# ") {
            listen = Some(bare.to_string());
            uncommented.push(bare.to_string());
        } else {
            uncommented.push(line.to_string());
        }
    }
    assert_eq!(
        listen.as_deref(),
        Some("listen = \"127.0.0.1:8443\""),
        "the shipped TLS listener listens on loopback, as everything else"
    );
    std::fs::write(config.join("limits.toml"), uncommented.join("\n")).unwrap();

    // The file's 8443 may be taken on this machine: the override moves it, on loopback.
    let upstream = Upstream::start().await;
    let (port, admin, tls_port) = (free_port(), free_port(), free_port());
    let log = dir.path().join("log");
    let mut child = limited_ratewall()
        .current_dir(dir.path())
        .env("RATEWALL_LISTEN", format!("127.0.0.1:{port}"))
        .env("RATEWALL_ADMIN_LISTEN", format!("127.0.0.1:{admin}"))
        .env("RATEWALL_TLS_LISTEN", format!("127.0.0.1:{tls_port}"))
        .env("RATEWALL_UPSTREAM", upstream.url())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("spawn");
    let text = log_once_listening(&log);
    let roots = [rustls_pki_types::CertificateDer::from(common::cert_der(
        &config.join("cert.pem"),
    ))];
    let reply = common::tls_get(
        tls_port,
        "localhost",
        common::client_config(&roots, &[b"h2", b"http/1.1"], None),
        "/api/orders",
        &[("x-api-key", "demo-free-key")],
    )
    .await;
    // The README's own curl: `200 2`.
    let curl = Command::new("curl")
        .current_dir(dir.path())
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code} %{http_version}",
        ])
        .args([
            "--cacert",
            "config/cert.pem",
            "-H",
            "x-api-key: demo-free-key",
        ])
        .arg(format!("https://localhost:{tls_port}/api/orders"))
        .output();
    let _ = child.kill();
    let _ = child.wait();
    let reply = reply.unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(reply.status, StatusCode::OK, "{text}");
    assert_eq!(
        reply.alpn.as_deref(),
        Some(&b"h2"[..]),
        "HTTP/2, as `200 2` says"
    );
    let out = curl.expect("run curl (./scripts/test installs it, or: apt-get install curl)");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "200 2",
        "curl, as the README runs it: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
