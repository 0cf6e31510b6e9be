//! Envoy's rate limit service, called as Envoy calls it: the real binary, gRPC's own
//! Python client generated (grpcio-tools) from envoyproxy's `rls.proto` and its imports
//! as vendored in `proto/` (`tests/rls/client.py`), and a real redis-server where the
//! shared store is the point.
//!
//! envoyproxy/ratelimit's README examples (`tests/fixtures/envoy/`, verbatim) answer as
//! that README says; every limit here lets exactly its N through within the test (days
//! and hours, or token buckets that refill far slower than the test runs), and the one
//! per-second limit asserted on is counted without regard to where a second ends.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use serde_json::{json, Value};

use crate::common::client::HttpClient;
use crate::common::free_port;
use crate::common::gateway::{toml_path, Gateway, Store};
use crate::common::redis_server::{scan, RedisServer};

const TOKEN: &str = "rls-test-token-0123456789";

/// `tests/rls/client.py`, one call per line; killed on drop.
struct Client {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Client {
    /// A client of the decision listener on `port`, with `token`.
    fn start(port: u16, token: &str) -> Client {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut child = Command::new("python3")
            .arg(root.join("tests/rls/client.py"))
            .arg(root.join("proto"))
            .arg(format!("127.0.0.1:{port}"))
            .arg(token)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 tests/rls/client.py (scripts/test installs grpcio and grpcio-tools)");
        let stdin = child.stdin.take().expect("stdin");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut ready = String::new();
        stdout
            .read_line(&mut ready)
            .expect("the client's first line");
        assert!(
            ready.contains("ready"),
            "the client did not start: {ready:?}"
        );
        Client {
            child,
            stdin,
            stdout,
        }
    }

    fn call(&mut self, call: Value) -> Value {
        writeln!(self.stdin, "{call}").expect("write a call");
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("read an answer");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"))
    }

    /// One call of `domain` with `descriptors` (each a list of `[key, value]`).
    fn ask(&mut self, domain: &str, descriptors: &[&[(&str, &str)]]) -> Value {
        let descriptors: Vec<Value> = descriptors
            .iter()
            .map(|entries| json!({ "entries": entries }))
            .collect();
        self.call(json!({ "domain": domain, "descriptors": descriptors }))
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A gateway with `[decide]` on a free port reading `yaml` as its envoy_config, and
/// `extra` (rules, descriptors) after it.
fn gateway(store: &Store, yaml: &str, extra: &str) -> (Gateway, u16, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("ratelimit.yaml");
    std::fs::write(&file, yaml).expect("write the YAML");
    let port = free_port();
    let body = format!(
        "[upstream]\nurl = \"http://127.0.0.1:9\"\n{}[decide]\nlisten = \"127.0.0.1:{port}\"\ntoken = \"{TOKEN}\"\nenvoy_config = \"{}\"\n{extra}",
        store.toml(),
        toml_path(&file)
    );
    (Gateway::start(&body), port, dir)
}

fn fixture(name: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/envoy")
        .join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The statuses' codes, in order.
fn codes(a: &Value) -> Vec<&str> {
    a["statuses"]
        .as_array()
        .unwrap_or_else(|| panic!("no statuses: {a}"))
        .iter()
        .map(|s| s["code"].as_str().unwrap_or("?"))
        .collect()
}

fn remaining(a: &Value, i: usize) -> u64 {
    a["statuses"][i]["remaining"]
        .as_u64()
        .unwrap_or_else(|| panic!("{a}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn the_readme_examples_answer_as_envoyproxy_ratelimit_documents_them() {
    let _watch = crate::common::watchdog();
    // Three domains in one file: its documents.
    let yaml = [
        fixture("example2-messaging.yaml"),
        fixture("example3-edge-proxy-per-ip.yaml"),
        fixture("example6-shadow-mode.yaml"),
    ]
    .join("---\n");
    // And a proxy rule the rate limit service shares by the client's address.
    let extra = "[[rules]]\nname = \"per_ip\"\nkey = \"client_ip\"\nrate = \"1/h\"\nburst = 3\n\
        [[descriptors]]\ndomain = \"edge\"\nentries = [{ key = \"remote_address\" }]\nrule = \"per_ip\"\n";
    let (gw, port, _dir) = gateway(&Store::Memory, &yaml, extra);
    let mut c = Client::start(port, TOKEN);

    // Example 2: 5 marketing messages a day to one number, 100 messages to any number;
    // both descriptors in one call, decided as one.
    let both: &[&[(&str, &str)]] = &[
        &[("message_type", "marketing"), ("to_number", "2061111111")],
        &[("to_number", "2061111111")],
    ];
    for n in 1..=5u64 {
        let a = c.ask("messaging", both);
        assert_eq!(
            (a["overall"].as_str(), codes(&a)),
            (Some("OK"), vec!["OK", "OK"]),
            "{a}"
        );
        assert_eq!(
            (remaining(&a, 0), remaining(&a, 1)),
            (5 - n, 100 - n),
            "{a}"
        );
    }
    let first = &c.ask("messaging", both);
    let limit = &first["statuses"][0]["limit"];
    assert_eq!(limit["name"], "messaging.message_type_marketing.to_number");
    assert_eq!(
        (limit["requests_per_unit"].as_u64(), limit["unit"].as_str()),
        (Some(5), Some("DAY"))
    );
    assert_eq!(first["overall"], "OVER_LIMIT", "{first}");
    assert_eq!(codes(first), ["OVER_LIMIT", "OK"]);
    // The denied call took nothing from the 100: all or nothing, as the proxy decides.
    assert_eq!(remaining(first, 1), 95, "{first}");
    let retry: u64 = first["headers"]["retry-after"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=86_400).contains(&retry), "{first}");
    let rl = first["headers"]["ratelimit"].as_str().unwrap();
    assert!(
        rl.contains("\"messaging.message_type_marketing.to_number\";r=0"),
        "{rl}"
    );
    let policy = first["headers"]["ratelimit-policy"].as_str().unwrap();
    assert!(
        policy.contains("\"messaging.to_number\";q=100;w=86400"),
        "{policy}"
    );
    let alone = c.ask("messaging", &[&[("to_number", "2061111111")]]);
    assert_eq!(
        (codes(&alone), remaining(&alone, 0)),
        (vec!["OK"], 94),
        "{alone}"
    );
    // Another number has its own 5 and its own 100.
    let other = c.ask(
        "messaging",
        &[&[("message_type", "marketing"), ("to_number", "2062222222")]],
    );
    assert_eq!(remaining(&other, 0), 4, "{other}");

    // Example 3: the most specific match first; 50.0.0.5 is blocked outright.
    let blocked = c.ask("edge_proxy_per_ip", &[&[("remote_address", "50.0.0.5")]]);
    assert_eq!(
        (blocked["overall"].as_str(), codes(&blocked)),
        (Some("OVER_LIMIT"), vec!["OVER_LIMIT"])
    );
    assert_eq!(blocked["statuses"][0]["limit"]["requests_per_unit"], 0);
    let any = c.ask("edge_proxy_per_ip", &[&[("remote_address", "50.0.0.1")]]);
    assert_eq!(
        any["statuses"][0]["limit"]["requests_per_unit"], 10,
        "{any}"
    );
    assert_eq!(any["statuses"][0]["limit"]["unit"], "SECOND");
    assert_eq!(codes(&any), ["OK"]);

    // Example 6: user-a is in shadow mode at 10 a second: always OK. 25 calls in well
    // under a second fall in at most two windows, one of which saw more than 10: that
    // would-be denial is counted.
    for _ in 0..25 {
        let a = c.ask("example6", &[&[("service", "auth"), ("user", "user-a")]]);
        assert_eq!(
            (a["overall"].as_str(), codes(&a)),
            (Some("OK"), vec!["OK"]),
            "{a}"
        );
    }
    let b = c.ask("example6", &[&[("service", "auth"), ("user", "user-b")]]);
    assert_eq!(b["statuses"][0]["limit"]["requests_per_unit"], 20, "{b}");
    let metrics = HttpClient::new().get(&gw.admin_url("/metrics"), &[]).await;
    let text = String::from_utf8_lossy(&metrics.body).to_string();
    let shadowed = text.lines().any(|l| {
        l.contains("example6.service.user_user-a") && l.contains("shadow") && !l.ends_with(" 0")
    });
    assert!(
        shadowed,
        "no would-be denial of example6.service.user_user-a counted:\n{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("ratewall_decisions_total") && l.contains("frontend=\"rls\"")),
        "RLS decisions are counted apart"
    );

    // `[[descriptors]]`: the proxy and the service share the client's bucket. Two
    // proxied requests from 127.0.0.1 (their backend is gone: they were charged on
    // arrival all the same), then its last token through the service, then none.
    let http = HttpClient::new();
    for _ in 0..2 {
        let r = http.get(&gw.url("/"), &[]).await;
        assert_ne!(r.status.as_u16(), 429);
    }
    let last = c.ask("edge", &[&[("remote_address", "127.0.0.1")]]);
    assert_eq!(
        (codes(&last), remaining(&last, 0)),
        (vec!["OK"], 0),
        "{last}"
    );
    assert_eq!(last["statuses"][0]["limit"]["name"], "per_ip");
    let over = c.ask("edge", &[&[("remote_address", "127.0.0.1")]]);
    assert_eq!(codes(&over), ["OVER_LIMIT"], "{over}");
    assert_eq!(http.get(&gw.url("/"), &[]).await.status.as_u16(), 429);
    // Another address has its own bucket.
    let fresh = c.ask("edge", &[&[("remote_address", "10.9.8.7")]]);
    assert_eq!(remaining(&fresh, 0), 2, "{fresh}");
}

#[tokio::test(flavor = "multi_thread")]
async fn wildcards_costs_algorithms_reloads_and_bad_calls() {
    let _watch = crate::common::watchdog();
    let yaml = "domain: api\ndescriptors:\n  - key: path\n    value: /files/*\n    rate_limit: { unit: hour, requests_per_unit: 10, algorithm: token_bucket }\n  - key: tenant\n    descriptors:\n      - key: method\n        value: POST\n        rate_limit: { unit: hour, requests_per_unit: 6, algorithm: sliding_window }\n  - key: internal\n    rate_limit: { unlimited: true }\n";
    let (gw, port, dir) = gateway(&Store::Memory, yaml, "");
    let mut c = Client::start(port, TOKEN);

    // A wildcard value: each value its own bucket; hits_addend is the cost.
    let a = c.call(json!({ "domain": "api", "hits_addend": 4, "descriptors": [{ "entries": [["path", "/files/a"]] }] }));
    assert_eq!((codes(&a), remaining(&a, 0)), (vec!["OK"], 6), "{a}");
    assert_eq!(a["statuses"][0]["limit"]["name"], "api.path_-files--");
    assert_eq!(a["statuses"][0]["limit"]["requests_per_unit"], 10);
    let b = c.ask("api", &[&[("path", "/files/b")]]);
    assert_eq!(remaining(&b, 0), 9, "{b}");
    // 0 means 1, as Envoy says.
    let z = c.call(json!({ "domain": "api", "hits_addend": 0, "descriptors": [{ "entries": [["path", "/files/a"]] }] }));
    assert_eq!(remaining(&z, 0), 5, "{z}");
    // A descriptor's own hits_addend wins over the call's; 6 > 5 left: over, nothing taken.
    let over = c.call(json!({ "domain": "api", "hits_addend": 1, "descriptors": [{ "entries": [["path", "/files/a"]], "hits_addend": 6 }] }));
    assert_eq!(
        (over["overall"].as_str(), codes(&over)),
        (Some("OVER_LIMIT"), vec!["OVER_LIMIT"]),
        "{over}"
    );
    assert!(over["headers"]["retry-after"].as_str().is_some(), "{over}");
    let five = c.call(json!({ "domain": "api", "descriptors": [{ "entries": [["path", "/files/a"]], "hits_addend": 5 }] }));
    assert_eq!(
        (codes(&five), remaining(&five, 0)),
        (vec!["OK"], 0),
        "{five}"
    );

    // Nested: tenant (any value), then method POST; GET has no limit; unlimited is OK.
    for n in 1..=6u64 {
        let p = c.ask("api", &[&[("tenant", "t1"), ("method", "POST")]]);
        assert_eq!((codes(&p), remaining(&p, 0)), (vec!["OK"], 6 - n), "{p}");
    }
    let seventh = c.ask(
        "api",
        &[
            &[("tenant", "t1"), ("method", "POST")],
            &[("internal", "x")],
            &[("tenant", "t1"), ("method", "GET")],
        ],
    );
    assert_eq!(codes(&seventh), ["OVER_LIMIT", "OK", "OK"], "{seventh}");
    assert_eq!(seventh["statuses"][1]["remaining"], u64::from(u32::MAX));
    assert!(seventh["statuses"][2]["limit"].is_null(), "{seventh}");
    let t2 = c.ask("api", &[&[("tenant", "t2"), ("method", "POST")]]);
    assert_eq!(remaining(&t2, 0), 5, "{t2}");
    // Unknown domains and descriptors: OK, no limit.
    let none = c.ask("elsewhere", &[&[("path", "/files/a")]]);
    assert_eq!(
        (
            none["overall"].as_str(),
            none["statuses"][0]["limit"].is_null()
        ),
        (Some("OK"), true)
    );

    // Bad calls: a clear status each, and the service still answers after them.
    let garbage = c.call(json!({ "raw": "ffffffff" }));
    assert_eq!(garbage["status"], "INVALID_ARGUMENT", "{garbage}");
    let empty = c.call(json!({ "domain": "", "descriptors": [] }));
    assert_eq!(empty["status"], "INVALID_ARGUMENT", "{empty}");
    let mut wrong = Client::start(port, "not-the-token-at-all-0000");
    assert_eq!(
        wrong.ask("api", &[&[("path", "/x")]])["status"],
        "UNAUTHENTICATED"
    );
    // A frame marked compressed (and one cut short), written by hand over h2c.
    for (frame, code) in [
        (vec![1u8, 0, 0, 0, 1, 0], "12"),
        (vec![0u8, 0, 0, 0, 9, 1], "3"),
    ] {
        let r = HttpClient::h2()
            .send(
                "POST",
                &format!("http://127.0.0.1:{port}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"),
                &[("content-type", "application/grpc"), ("te", "trailers"), ("authorization", &format!("Bearer {TOKEN}"))],
                frame.into(),
            )
            .await;
        assert_eq!(r.header("grpc-status"), Some(code), "{:?}", r.headers);
    }

    // The YAML changes on SIGHUP, never a restart.
    std::fs::write(
        dir.path().join("ratelimit.yaml"),
        yaml.replace("requests_per_unit: 10", "requests_per_unit: 50"),
    )
    .unwrap();
    gw.reload(1);
    let after = c.ask("api", &[&[("path", "/files/c")]]);
    assert_eq!(
        after["statuses"][0]["limit"]["requests_per_unit"], 50,
        "{after}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_shared_store_keeps_their_keys_as_every_rule_and_a_failure_answers_by_on_error() {
    let _watch = crate::common::watchdog();
    let mut redis = RedisServer::start();
    let yaml = fixture("example2-messaging.yaml");
    let (gw, port, dir) = gateway(&Store::redis_roomy(&redis), &yaml, "");
    let mut c = Client::start(port, TOKEN);
    for n in 1..=5u64 {
        let a = c.ask(
            "messaging",
            &[&[("message_type", "marketing"), ("to_number", "2061111111")]],
        );
        assert_eq!(remaining(&a, 0), 5 - n, "{a}");
    }
    let a = c.ask(
        "messaging",
        &[&[("message_type", "marketing"), ("to_number", "2061111111")]],
    );
    assert_eq!(codes(&a), ["OVER_LIMIT"]);
    // `<prefix>:{<identity>}:<rule>`, the number nowhere in it.
    let keys = scan(&mut redis.conn(), "*");
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert!(
        keys[0].starts_with("rwtest:{")
            && keys[0].ends_with("}:messaging.message_type_marketing.to_number"),
        "{keys:?}"
    );
    assert!(!keys[0].contains("2061111111"), "{keys:?}");

    // The store down: on_error = "deny" answers UNAVAILABLE (Envoy's failure_mode_deny
    // then decides), "allow" answers OK.
    redis.kill();
    let down = c.ask("messaging", &[&[("to_number", "1")]]);
    assert_eq!(down["status"], "UNAVAILABLE", "{down}");
    let body = std::fs::read_to_string(&gw.config).unwrap();
    std::fs::write(
        &gw.config,
        body.replace("on_error = \"deny\"", "on_error = \"allow\""),
    )
    .unwrap();
    gw.reload(1);
    let allowed = c.ask("messaging", &[&[("to_number", "1")]]);
    assert_eq!(
        (allowed["overall"].as_str(), codes(&allowed)),
        (Some("OK"), vec!["OK"]),
        "{allowed}"
    );
    drop(dir);
}
