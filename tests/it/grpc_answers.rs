//! What the gateway answers a gRPC call (`content-type: application/grpc`...): a gRPC
//! answer, never a bare HTTP status — HTTP 200, empty body, Trailers-Only (`grpc-status`,
//! `grpc-message` percent-encoded), the RateLimit fields, and on a denial
//! `grpc-retry-pushback-ms`. In process through `Gateway::admit` (as in request_path.rs)
//! for the answers themselves; the real binary for what only a process shows: the
//! passed-on answers' statuses counted and logged (from a Trailers-Only head, and from
//! trailers once the body ends), and `ratewall check --path` on a gRPC method.

use std::io::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::BodyExt;
use ratewall::config::Config;
use ratewall::limiter::ManualClock;
use ratewall::proxy::{Admission, Context, Gateway, Live, Metrics};
use ratewall::upstream::ClientPeer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::common::{self, Gateway as Binary, HttpClient};

const UPSTREAM: &str =
    "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\nurl = \"http://127.0.0.1:2\"\n";

const GRPC: (&str, &str) = ("content-type", "application/grpc+proto");

/// A gateway in process on `config` (after a `[server]` and `[upstream]`).
fn in_process(config: &str) -> Gateway {
    let text = format!("{UPSTREAM}{config}");
    let config = Config::parse(&text, Path::new("grpc.toml")).expect("a valid config");
    let metrics = Arc::new(Metrics::new());
    let live = Live::build_with_clock(config, None, &metrics, ManualClock::new(1_000_000_000))
        .expect("a store");
    Gateway::new(live, None, metrics)
}

/// What the gateway answered itself (none: forwarded).
struct Answered {
    status: StatusCode,
    headers: HeaderMap,
    body: Vec<u8>,
    decision: &'static str,
}

impl Answered {
    fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .map(|v| v.to_str().expect("ASCII"))
            .unwrap_or_else(|| panic!("no {name} in {:?}", self.headers))
    }

    /// A Trailers-Only gRPC answer of `code`: HTTP 200, empty body, the status fields.
    fn assert_grpc(&self, code: &str) {
        assert_eq!(self.status, StatusCode::OK, "{:?}", self.headers);
        assert!(self.body.is_empty(), "{:?}", self.body);
        assert_eq!(self.header("content-type"), "application/grpc");
        assert_eq!(self.header("grpc-status"), code, "{:?}", self.headers);
        let message = self.header("grpc-message");
        assert!(!message.is_empty());
        assert!(
            message.bytes().all(|b| (0x20..=0x7E).contains(&b)),
            "{message}"
        );
    }
}

async fn send(gw: &Gateway, live: &Live, path: &str, headers: &[(&str, &str)]) -> Option<Answered> {
    let mut req = Request::builder()
        .method(Method::POST)
        .uri(path)
        .version(http::Version::HTTP_2)
        .header("host", "app.test");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let parts = req.body(()).expect("a request").into_parts().0;
    let peer: IpAddr = "203.0.113.7".parse().expect("an address");
    let ctx = Context::new(ClientPeer::new(SocketAddr::new(peer, 40_000)), 0);
    match gw.admit(live, &parts, &ctx).await {
        Admission::Answer(resp, note) => {
            let (head, body) = resp.into_parts();
            let body = body.collect().await.expect("a body").to_bytes();
            Some(Answered {
                status: head.status,
                headers: head.headers,
                body: body.to_vec(),
                decision: note.decided.disposition.decision(),
            })
        }
        Admission::Forward(_) => None,
    }
}

const LIMITED: &str = "[[rules]]\nname = \"calls\"\nmatch = { path_prefix = \"/pkg.Service/\" }\n\
     key = \"client_ip\"\nalgorithm = \"fixed_window\"\nrate = \"2/m\"\n";

#[tokio::test]
async fn a_denied_grpc_call_is_resource_exhausted_with_its_ratelimit_fields_and_pushback() {
    let _watch = common::watchdog();
    let gw = in_process(LIMITED);
    let live = gw.live();
    for _ in 0..2 {
        assert!(send(&gw, &live, "/pkg.Service/Method", &[GRPC])
            .await
            .is_none());
    }
    let denied = send(
        &gw,
        &live,
        "/pkg.Service/Method",
        &[GRPC, ("te", "trailers")],
    )
    .await
    .expect("answered by the gateway");
    assert_eq!(denied.decision, "denied");
    denied.assert_grpc("8");
    assert_eq!(
        denied.header("grpc-message"),
        "Too Many Requests: rate limited by calls"
    );
    // The window opened at the clock's start: a minute to go, to the second and to the ms.
    assert_eq!(denied.header("retry-after"), "60");
    assert_eq!(denied.header("grpc-retry-pushback-ms"), "60000");
    assert_eq!(denied.header("ratelimit-policy"), "\"calls\";q=2;w=60");
    assert_eq!(denied.header("ratelimit"), "\"calls\";r=0;t=60");
}

#[tokio::test]
async fn a_non_grpc_requests_answers_are_unchanged() {
    let _watch = common::watchdog();
    let gw = in_process(LIMITED);
    let live = gw.live();
    for _ in 0..2 {
        assert!(send(&gw, &live, "/pkg.Service/Method", &[]).await.is_none());
    }
    // gRPC-Web is not gRPC: its clients read HTTP statuses.
    for headers in [
        &[][..],
        &[("content-type", "application/json")][..],
        &[("content-type", "application/grpc-web+proto")][..],
    ] {
        let denied = send(&gw, &live, "/pkg.Service/Method", headers)
            .await
            .expect("denied");
        assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(denied.header("content-type"), "application/problem+json");
        assert_eq!(denied.header("retry-after"), "60");
        assert_eq!(denied.header("ratelimit"), "\"calls\";r=0;t=60");
        assert!(denied.headers.get("grpc-status").is_none());
        assert!(denied.headers.get("grpc-retry-pushback-ms").is_none());
        let body = String::from_utf8_lossy(&denied.body);
        assert!(body.contains("\"violated-policies\":[\"calls\"]"), "{body}");
    }
    let gw = in_process(
        "[[rules]]\nname = \"keyed\"\nkey = \"api_key\"\nrate = \"10/s\"\n\
         [store]\nbackend = \"redis\"\nurl = \"redis://127.0.0.1:1\"\ntimeout = \"50ms\"\non_error = \"deny\"\n",
    );
    let live = gw.live();
    let unauthorized = send(&gw, &live, "/x", &[]).await.expect("refused");
    assert_eq!(unauthorized.status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        unauthorized.header("content-type"),
        "application/problem+json"
    );
    let outage = send(&gw, &live, "/x", &[("x-api-key", "k1")])
        .await
        .expect("answered");
    assert_eq!(outage.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(outage.header("retry-after"), "1");
    assert!(outage.headers.get("grpc-status").is_none());
}

#[tokio::test]
async fn a_store_outage_under_deny_is_unavailable_and_a_missing_key_unauthenticated() {
    let _watch = common::watchdog();
    let gw = in_process(
        "[[rules]]\nname = \"keyed\"\nkey = \"api_key\"\nrate = \"10/s\"\n\
         [store]\nbackend = \"redis\"\nurl = \"redis://127.0.0.1:1\"\ntimeout = \"50ms\"\non_error = \"deny\"\n",
    );
    let live = gw.live();
    let outage = send(
        &gw,
        &live,
        "/pkg.Service/Method",
        &[GRPC, ("x-api-key", "k1")],
    )
    .await
    .expect("answered");
    assert_eq!(outage.decision, "store_error");
    outage.assert_grpc("14");
    assert_eq!(
        outage.header("grpc-message"),
        "the rate-limit store is unavailable"
    );
    assert_eq!(outage.header("retry-after"), "1");
    assert_eq!(outage.header("grpc-retry-pushback-ms"), "1000");

    let unauthenticated = send(&gw, &live, "/pkg.Service/Method", &[GRPC])
        .await
        .expect("refused");
    assert_eq!(unauthenticated.decision, "unauthorized");
    unauthenticated.assert_grpc("16");
    assert!(unauthenticated
        .headers
        .get("grpc-retry-pushback-ms")
        .is_none());
}

#[tokio::test]
async fn a_malformed_call_is_internal() {
    let _watch = common::watchdog();
    let gw = in_process(
        "[[upstreams]]\nname = \"svc\"\nservers = [\"http://127.0.0.1:3\"]\n\
         [[routes]]\nname = \"svc\"\nmatch = { path_prefix = \"/pkg.Service/\" }\nupstream = \"svc\"\n",
    );
    let live = gw.live();
    // A pool `default` ([upstream] url) takes what no route fits: forwarded.
    assert!(send(&gw, &live, "/other.Service/M", &[GRPC])
        .await
        .is_none());
    let gw = in_process("[[rules]]\nname = \"r\"\nkey = \"header:x-tenant\"\nrate = \"10/s\"\n");
    let live = gw.live();
    let malformed = send(
        &gw,
        &live,
        "/pkg.Service/Method",
        &[GRPC, ("x-tenant", "a"), ("x-tenant", "b")],
    )
    .await
    .expect("refused");
    assert_eq!(malformed.decision, "bad_key");
    malformed.assert_grpc("13");
    let screened = send(&gw, &live, "/pkg.Service/%00Method", &[GRPC])
        .await
        .expect("refused");
    assert_eq!(screened.decision, "bad_request");
    screened.assert_grpc("13");
}

#[tokio::test]
async fn a_call_no_route_fits_is_unimplemented() {
    let _watch = common::watchdog();
    let text = "[server]\nlisten = \"127.0.0.1:1\"\n\
        [[upstreams]]\nname = \"svc\"\nservers = [\"http://127.0.0.1:3\"]\n\
        [[routes]]\nname = \"svc\"\nmatch = { path_prefix = \"/pkg.Service/\" }\nupstream = \"svc\"\n";
    let config = Config::parse(text, Path::new("grpc.toml")).expect("a valid config");
    let metrics = Arc::new(Metrics::new());
    let live =
        Live::build_with_clock(config, None, &metrics, ManualClock::new(1)).expect("a store");
    let gw = Gateway::new(live, None, metrics);
    let live = gw.live();
    assert!(send(&gw, &live, "/pkg.Service/M", &[GRPC]).await.is_none());
    let none = send(&gw, &live, "/other.Service/M", &[GRPC])
        .await
        .expect("no route");
    assert_eq!(none.decision, "no_route");
    none.assert_grpc("12");
    assert_eq!(none.header("grpc-message"), "no route matches this request");
    let http = send(&gw, &live, "/other.Service/M", &[])
        .await
        .expect("no route");
    assert_eq!(http.status, StatusCode::NOT_FOUND);
}

// ---------------------------------------------------------------------------------------
// The real binary: passed-on statuses counted and logged.

/// A backend speaking HTTP/1.1 by hand: `/pkg.Echo/Trailers` answers a streamed gRPC body
/// with `grpc-status: 0` in its trailers, `/pkg.Echo/Only` a Trailers-Only `grpc-status:
/// 5`. One answer per connection.
async fn grpc_backend() -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("an address"));
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let text = String::from_utf8_lossy(&head);
                let answer: &[u8] = if text.starts_with("POST /pkg.Echo/Trailers ") {
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\ntransfer-encoding: chunked\r\n\
                      trailer: grpc-status\r\nconnection: close\r\n\r\n\
                      5\r\n\x00\x00\x00\x00\x00\r\n0\r\ngrpc-status: 0\r\ngrpc-message: fine\r\n\r\n"
                } else {
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\ngrpc-status: 5\r\n\
                      grpc-message: no%20such%20thing\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                };
                let _ = s.write_all(answer).await;
                let _ = s.shutdown().await;
            });
        }
    });
    (url, task)
}

fn access_lines(logs: &str) -> Vec<serde_json::Value> {
    logs.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"] == "ratewall::access")
        .map(|v| v["fields"].clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passed_on_grpc_statuses_are_counted_and_logged_from_headers_or_trailers() {
    let _watch = common::watchdog();
    let (url, backend) = grpc_backend().await;
    let gw = Binary::start_with(
        &format!(
            "[upstream]\nurl = \"{url}\"\n\
             [[rules]]\nname = \"calls\"\nmatch = {{ path_prefix = \"/pkg.Echo/\" }}\n\
             key = \"client_ip\"\nalgorithm = \"fixed_window\"\nrate = \"2/h\"\n"
        ),
        &["--log-format", "json"],
        &[],
    );
    let client = HttpClient::h2();
    let grpc = [GRPC, ("te", "trailers")];
    let frame = bytes::Bytes::from_static(b"\x00\x00\x00\x00\x00");
    let r = client
        .send("POST", &gw.url("/pkg.Echo/Trailers"), &grpc, frame.clone())
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let r = client
        .send("POST", &gw.url("/pkg.Echo/Only"), &grpc, frame.clone())
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("grpc-status"), Some("5"), "{:?}", r.headers);
    // The third call is denied by the gateway itself.
    let r = client
        .send("POST", &gw.url("/pkg.Echo/Only"), &grpc, frame)
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("grpc-status"), Some("8"), "{:?}", r.headers);

    let count = |code: &'static str, source: &'static str| {
        let gw = &gw;
        async move {
            common::metrics::metric(
                gw,
                "ratewall_grpc_responses_total",
                &[("code", code), ("source", source)],
            )
            .await
        }
    };
    assert!(
        gw.wait_for_log("ratewall::access", 3, Duration::from_secs(10)),
        "{}",
        gw.logs()
    );
    assert_eq!(count("0", "upstream").await, 1.0, "from the trailers");
    assert_eq!(
        count("5", "upstream").await,
        1.0,
        "from a Trailers-Only head"
    );
    assert_eq!(count("8", "gateway").await, 1.0, "the gateway's denial");
    assert_eq!(count("8", "upstream").await, 0.0);
    // The denial is a 200 on the wire, and counts as the 429 it stands for.
    let denied = common::metrics::metric(
        &gw,
        "ratewall_request_duration_seconds_count",
        &[("outcome", "denied")],
    )
    .await;
    assert_eq!(denied, 1.0);
    let gateway_4xx = common::metrics::metric(
        &gw,
        "ratewall_responses_total",
        &[("class", "4xx"), ("source", "gateway")],
    )
    .await;
    assert_eq!(gateway_4xx, 1.0);
    let logs = gw.logs();
    let lines = access_lines(&logs);
    let by = |path: &str, status: u64| {
        lines
            .iter()
            .find(|l| l["path"] == path && l["grpc_status"] == status)
            .unwrap_or_else(|| panic!("no line for {path} with grpc_status {status}:\n{logs}"))
    };
    assert_eq!(by("/pkg.Echo/Trailers", 0)["decision"], "allowed");
    assert_eq!(by("/pkg.Echo/Only", 5)["decision"], "allowed");
    assert_eq!(by("/pkg.Echo/Only", 8)["decision"], "denied");
    assert!(
        lines.iter().all(|l| l.get("upgrade").is_none()),
        "no upgrade field on these lines:\n{logs}"
    );
    backend.abort();
}

#[test]
fn check_shows_the_rules_a_grpc_method_matches() {
    let _watch = common::watchdog();
    let mut file = tempfile::NamedTempFile::new().expect("a temp file");
    write!(
        file,
        "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nurl = \"http://127.0.0.1:3000\"\n\
         [[rules]]\nname = \"service\"\nmatch = {{ path_prefix = \"/pkg.Service/\" }}\n\
         key = \"client_ip\"\nrate = \"10/s\"\n\
         [[rules]]\nname = \"method\"\nmatch = {{ path = \"/pkg.Service/Slow\" }}\n\
         key = \"client_ip\"\nrate = \"1/s\"\n\
         [[rules]]\nname = \"other\"\nmatch = {{ path_prefix = \"/pkg.Other/\" }}\n\
         key = \"client_ip\"\nrate = \"1/s\"\n"
    )
    .expect("write the config");
    let config = file.path().to_str().expect("a UTF-8 path");
    let run = |path: &str| {
        let out = Command::new(common::binary())
            .args([
                "check", "--config", config, "--path", path, "--method", "POST",
            ])
            .args(["--header", "content-type: application/grpc"])
            .output()
            .expect("run ratewall check");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
            .split_once("sample request:")
            .map(|(_, s)| s.to_string())
            .unwrap_or_else(|| panic!("no sample request in:\n{stdout}"))
    };
    let applying = |s: &str| -> Vec<String> {
        let (_, rest) = s.split_once("rule(s) apply").unwrap_or(("", ""));
        let rest = rest.split("do not apply").next().unwrap_or_default();
        rest.lines()
            .filter_map(|l| l.trim_start().strip_prefix("- "))
            .filter_map(|l| l.split_once(':').map(|(n, _)| n.to_string()))
            .collect()
    };
    let s = run("/pkg.Service/Fast");
    assert!(s.contains("1 rule(s) apply"), "{s}");
    assert_eq!(applying(&s), ["service"], "{s}");
    assert!(
        s.contains("other: the path does not start with /pkg.Other/"),
        "{s}"
    );
    let s = run("/pkg.Service/Slow");
    assert!(s.contains("2 rule(s) apply"), "{s}");
    assert_eq!(applying(&s), ["service", "method"], "{s}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_upstream_is_unavailable_to_a_grpc_call_and_a_502_to_others() {
    let _watch = common::watchdog();
    let refusing = common::RefusingPort::new();
    let gw = Binary::start(&format!(
        "[upstream]\nurl = \"{}\"\nconnect_timeout = \"1s\"\n",
        refusing.url()
    ));
    let client = HttpClient::h2();
    let frame = bytes::Bytes::from_static(b"\x00\x00\x00\x00\x00");
    let r = client
        .send("POST", &gw.url("/pkg.Service/M"), &[GRPC], frame.clone())
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("grpc-status"), Some("14"), "{:?}", r.headers);
    assert!(r.body.is_empty());
    let r = client
        .send("POST", &gw.url("/pkg.Service/M"), &[], frame)
        .await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    assert!(r.headers.get("grpc-status").is_none());
    let counted = common::metrics::metric(
        &gw,
        "ratewall_grpc_responses_total",
        &[("code", "14"), ("source", "gateway")],
    )
    .await;
    assert_eq!(counted, 1.0);
}
