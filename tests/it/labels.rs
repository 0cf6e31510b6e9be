//! Who is that? (issue 42, item 8): a key listed with a label ("Acme Corp", in the config or
//! added at runtime) is shown by it on the status page (`/status.json`), in `/admin/top`,
//! on the access line and by `ratewall check`; a JWT identity's claim values (`sub=alice`)
//! are shown to admin token holders (`/admin/top`, `/admin/stats`) and never on the public
//! page, `/status.json` or `/metrics`. The real binary, a real upstream, a real client.

use crate::common;

use std::process::Command;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::jwt::{unix_now, SigningKey};
use common::{Gateway, HttpClient, RedisServer, Store, Upstream};
use http::StatusCode;

const TOKEN: &str = "labels-admin-token-0123456789";
const AUTH: (&str, &str) = ("authorization", "Bearer labels-admin-token-0123456789");

/// The configured key (never to be seen anywhere but in the config).
const ACME_KEY: &str = "sk_live_acme_secret_0001";

/// Rule `api` per API key: 1 request an hour for a key with no plan, 2 for `pro`.
const RULES: &str = "[[rules]]\nname = \"api\"\nkey = \"api_key\"\nrate = \"1/h\"\nburst = 1\n[rules.plans.pro]\nburst = 2\n";

/// Send `key`'s requests until one is denied (429).
async fn until_denied(client: &HttpClient, gw: &Gateway, headers: &[(&str, &str)]) {
    for _ in 0..5 {
        if client.get(&gw.url("/x"), headers).await.status == StatusCode::TOO_MANY_REQUESTS {
            return;
        }
    }
    panic!("never denied:\n{}", gw.logs());
}

/// The first of `path`'s most limited identities (`top`, or the array itself), polled
/// until one is there.
async fn first_top(client: &HttpClient, gw: &Gateway, path: &str) -> serde_json::Value {
    let end = Instant::now() + common::WAIT;
    loop {
        let reply = client.get(&gw.admin_url(path), &[AUTH]).await;
        let v = reply.json();
        let top = if v.is_array() {
            v.clone()
        } else {
            v["top"].clone()
        };
        if top[0].is_object() || Instant::now() > end {
            return top[0].clone();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn body_of(client: &HttpClient, gw: &Gateway, path: &str, auth: bool) -> String {
    let headers: &[(&str, &str)] = if auth { &[AUTH] } else { &[] };
    let reply = client.get(&gw.admin_url(path), headers).await;
    String::from_utf8_lossy(&reply.body).into_owned()
}

/// A key labelled in `[keys.plans]`: its label on `/status.json` (beside a hint with no
/// key material), on the page's rendering of it, in `/admin/top` (beside the key's hint)
/// and `/admin/state`,
/// on the access line, and in `ratewall check`, both in the effective config and for a
/// sample request carrying the key. The raw key nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_label_is_shown_on_the_page_admin_top_the_access_line_and_check() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let keys = format!(
        "[keys.plans]\n\"{ACME_KEY}\" = {{ plan = \"pro\", label = \"Acme Corp\" }}\n\"sk_live_plain_key_0002\" = \"pro\"\n"
    );
    let body = format!(
        "[admin]\ntoken = \"{TOKEN}\"\n[upstream]\nurl = \"{}\"\n{keys}{RULES}",
        upstream.url()
    );
    let gw = Gateway::start_with(&body, &["--log-format", "json"], &[]);
    let client = HttpClient::new();
    until_denied(&client, &gw, &[("x-api-key", ACME_KEY)]).await;

    let public = first_top(&client, &gw, "/status.json").await;
    assert_eq!(public["label"], "Acme Corp", "{public}");
    assert_eq!(public["hint"], "key", "no key material in public: {public}");
    assert_eq!(public["rule"], "api");
    let admin = first_top(&client, &gw, "/admin/top").await;
    assert_eq!(admin["label"], "Acme Corp", "{admin}");
    assert_eq!(admin["hint"], "key …0001", "{admin}");
    assert_eq!(admin["id"], public["id"], "one tag for both");
    let state = client
        .get(
            &gw.admin_url(&format!("/admin/state?rule=api&key={ACME_KEY}")),
            &[AUTH],
        )
        .await
        .json();
    assert_eq!(state["label"], "Acme Corp", "{state}");
    assert_eq!(state["identity"], public["id"], "{state}");
    // The page draws the label from /status.json, escaped as every value it shows.
    let page = body_of(&client, &gw, "/", false).await;
    assert!(page.contains("esc(t.label)"), "the page renders the label");

    assert!(
        gw.wait_for_log("\"label\":\"Acme Corp\"", 2, common::WAIT),
        "the access line names the label:\n{}",
        gw.logs()
    );
    let logs = gw.logs();
    let denied = logs
        .lines()
        .find(|l| l.contains("ratewall::access") && l.contains("\"decision\":\"denied\""))
        .expect("a denied line");
    assert!(denied.contains("\"label\":\"Acme Corp\""), "{denied}");
    assert!(!logs.contains(ACME_KEY), "never the key:\n{logs}");
    let stats = body_of(&client, &gw, "/status.json", false).await;
    assert!(
        !stats.contains(ACME_KEY) && !stats.contains("0001"),
        "{stats}"
    );
    drop(gw);

    // `ratewall check`: the effective config names the labels, and a sample request
    // carrying the key is told whose it is.
    let dir = tempfile::tempdir().expect("temp dir");
    let cfg = dir.path().join("limits.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\nurl = \"{}\"\n{keys}{RULES}",
            upstream.url()
        ),
    )
    .expect("config");
    let out = Command::new(common::binary())
        .args(["check", "--config"])
        .arg(&cfg)
        .output()
        .expect("check");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("\"Acme Corp\" (plan pro)"), "{text}");
    let out = Command::new(common::binary())
        .args(["check", "--config"])
        .arg(&cfg)
        .args([
            "--path",
            "/x",
            "--header",
            &format!("x-api-key: {ACME_KEY}"),
        ])
        .output()
        .expect("check");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("key labelled \"Acme Corp\""), "{text}");
    assert!(!text.contains(ACME_KEY), "{text}");
}

/// A key added at runtime with a label (`POST /admin/keys`): shown on `/status.json`, in
/// `/admin/top` and on the access line as a configured one is, listed with it by `GET
/// /admin/keys`; a label that could break a log line is refused (400) and nothing is
/// listed. On the memory store (the keys file keeps it) with the text log, where the
/// label is quoted as every text value; on Redis with the JSON log. The config and its
/// upstream, for another gateway.
async fn a_runtime_label_is_shown(
    store: Store,
    keys_file: Option<&std::path::Path>,
) -> (String, Upstream) {
    let json = keys_file.is_none();
    let upstream = Upstream::start().await;
    let file = keys_file.map_or(String::new(), |p| {
        format!("[keys]\nfile = \"{}\"\n", common::toml_path(p))
    });
    let body = format!(
        "[admin]\ntoken = \"{TOKEN}\"\n{}{file}{RULES}",
        common::upstream_and_store(&upstream.url(), &store)
    );
    let format = if json { "json" } else { "text" };
    let gw = Gateway::start_with(&body, &["--log-format", format], &[]);
    let client = HttpClient::new();
    let admin = |method: &'static str, path: &'static str, body: &'static str| {
        let (client, url) = (client.clone(), gw.admin_url(path));
        async move {
            client
                .send(
                    method,
                    &url,
                    &[AUTH, ("content-type", "application/json")],
                    Bytes::from(body),
                )
                .await
        }
    };
    let bad = admin(
        "POST",
        "/admin/keys",
        r#"{"key":"sk_live_globex_0003","plan":"pro","label":"Globex\nINFO forged=1"}"#,
    )
    .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    let added = admin(
        "POST",
        "/admin/keys",
        r#"{"key":"sk_live_globex_0003","plan":"pro","label":"Globex Inc"}"#,
    )
    .await;
    assert_eq!(added.status, StatusCode::CREATED, "{:?}", added.json());
    assert_eq!(added.json()["label"], "Globex Inc");
    let listed = admin("GET", "/admin/keys", "").await.json();
    assert_eq!(listed["keys"].as_array().map(Vec::len), Some(1), "{listed}");
    assert_eq!(listed["keys"][0]["label"], "Globex Inc", "{listed}");
    until_denied(&client, &gw, &[("x-api-key", "sk_live_globex_0003")]).await;
    let public = first_top(&client, &gw, "/status.json").await;
    assert_eq!(public["label"], "Globex Inc", "{public}");
    assert_eq!(public["hint"], "key", "{public}");
    let top = first_top(&client, &gw, "/admin/top").await;
    assert_eq!(top["label"], "Globex Inc", "{top}");
    let field = if json {
        "\"label\":\"Globex Inc\""
    } else {
        "label=\"Globex Inc\""
    };
    assert!(gw.wait_for_log(field, 2, common::WAIT), "{}", gw.logs());
    assert!(!gw.logs().contains("forged"), "{}", gw.logs());
    if let Some(path) = keys_file {
        let text = std::fs::read_to_string(path).expect("keys file");
        assert!(text.contains("label = \"Globex Inc\""), "{text}");
        assert!(!text.contains("sk_live_globex"), "{text}");
    }
    drop(gw);
    (body, upstream)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_label_is_shown_with_the_memory_store() {
    let _watch = common::watchdog();
    let dir = tempfile::tempdir().expect("temp dir");
    let keys = dir.path().join("keys.toml");
    std::fs::write(&keys, "[plans]\n").expect("keys file");
    a_runtime_label_is_shown(Store::Memory, Some(&keys)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_label_is_shown_with_redis() {
    let _watch = common::watchdog();
    let redis = RedisServer::start();
    let (body, _upstream) = a_runtime_label_is_shown(Store::redis(&redis), None).await;
    // The hash holds the plan, then the label; no raw key in any name or value.
    let hash = format!("{}:keys", common::keys::PREFIX);
    let mut conn = redis.conn();
    let values: Vec<String> = redis::cmd("HVALS")
        .arg(&hash)
        .query(&mut conn)
        .expect("HVALS");
    assert_eq!(values, vec!["pro Globex Inc".to_string()]);
    // An entry as a gateway before labels wrote it (the plan alone) reads as it did: a
    // new gateway reads the hash whole, old entry and labelled one alike.
    let _: () = redis::cmd("HSET")
        .arg(&hash)
        .arg(common::sha256_hex(b"sk_live_older_0004"))
        .arg("pro")
        .query(&mut conn)
        .expect("HSET");
    let gw = Gateway::start(&body);
    let client = HttpClient::new();
    let end = Instant::now() + common::WAIT;
    let listed = loop {
        let listed = client
            .get(&gw.admin_url("/admin/keys"), &[AUTH])
            .await
            .json();
        if listed["keys"].as_array().map(Vec::len) == Some(2) || Instant::now() > end {
            break listed;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let keys = listed["keys"].as_array().expect("keys");
    let labels: Vec<&serde_json::Value> = keys.iter().map(|k| &k["label"]).collect();
    assert!(
        labels.contains(&&serde_json::json!("Globex Inc")),
        "{listed}"
    );
    assert!(labels.contains(&&serde_json::Value::Null), "{listed}");
    assert!(keys.iter().all(|k| k["plan"] == "pro"), "{listed}");
    // The plan-only key has its plan: 2 requests (pro), then 429.
    let statuses = client
        .statuses(&gw.url("/x"), "sk_live_older_0004", 3)
        .await;
    assert_eq!(statuses, vec![200, 200, 429], "{}", gw.logs());
}

/// A rule counting by a token's `sub`: `/admin/top` and `/admin/stats` (token required)
/// show the claim, `sub=alice`; `/status.json`, the page and `/metrics` never do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jwt_identity_shows_its_claims_to_admins_only() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = Gateway::start_with(
        &format!(
            "[admin]\ntoken = \"{TOKEN}\"\n[upstream]\nurl = \"{}\"\n[jwt]\nalgorithms = [\"HS256\"]\nsecret_env = \"LABELS_JWT_SECRET\"\n\
             [[rules]]\nname = \"per-user\"\nkey = \"jwt:sub\"\nrate = \"1/h\"\nburst = 1\n",
            upstream.url()
        ),
        &[],
        &[("LABELS_JWT_SECRET", "labels-secret")],
    );
    let key = SigningKey::secret(b"labels-secret");
    let token = format!(
        "Bearer {}",
        key.sign(
            &serde_json::json!({"sub": "alice", "exp": unix_now() + 600}),
            None
        )
    );
    let client = HttpClient::new();
    until_denied(&client, &gw, &[("authorization", &token)]).await;
    let top = first_top(&client, &gw, "/admin/top").await;
    assert_eq!(top["claims"], "sub=alice", "{top}");
    let stats = first_top(&client, &gw, "/admin/stats").await;
    assert_eq!(stats["claims"], "sub=alice", "{stats}");
    let public = first_top(&client, &gw, "/status.json").await;
    assert_eq!(public["hint"], "jwt", "{public}");
    assert!(public.get("claims").is_none(), "{public}");
    for path in ["/status.json", "/metrics", "/"] {
        let text = body_of(&client, &gw, path, false).await;
        assert!(!text.contains("alice"), "{path}: {text}");
    }
}
