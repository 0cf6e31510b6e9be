//! The egress gateway (issue 45): the real binary between curl (the client people point
//! `http_proxy` at) and a real backend standing in for an external API. Calls go to
//! listed targets only, never to a name that resolves to a private address without
//! `allow_private`; an egress rule limits the calls going out (per target, per
//! credential) and never a proxied request; a credential never reaches Redis or the
//! logs; `CONNECT` tunnels only where the target allows them.

use crate::common;

use std::process::Command;

use common::backend::Backend;
use common::redis_server::{scan, RedisServer};
use common::tls_upstream::{checksum, write_pem, Ca, ClientCerts, TlsUpstream};
use common::{free_port, upstream_and_store, Gateway, Store};

/// A gateway with `[egress]` on a port of its own, its targets and rules; its egress port.
fn gateway(backend: &Backend, store: &Store, egress: &str, rules: &str) -> (Gateway, u16) {
    let mut last = String::new();
    for _ in 0..5 {
        let port = free_port();
        let body = format!(
            "{}{rules}\n[egress]\nlisten = \"127.0.0.1:{port}\"\n{egress}\n",
            upstream_and_store(&backend.url(), store)
        );
        match Gateway::try_start(&body) {
            Ok(g) => return (g, port),
            Err(logs) if logs.contains("cannot listen") || logs.contains("in use") => last = logs,
            Err(logs) => panic!("ratewall did not start: {logs}"),
        }
    }
    panic!("ratewall found its egress port taken five times: {last}");
}

/// curl through the egress gateway on `proxy`: the status, the answer's head and body.
/// `tunnel`: CONNECT (`-p`), the status then the tunnel's answer's.
fn curl(proxy: u16, url: &str, headers: &[&str], tunnel: bool, more: &[&str]) -> (u16, String) {
    let mut cmd = Command::new("curl");
    cmd.args([
        "-s",
        "-i",
        "--max-time",
        "20",
        "-x",
        &format!("http://127.0.0.1:{proxy}"),
    ]);
    if tunnel {
        cmd.arg("-p");
    }
    for h in headers {
        cmd.args(["-H", h]);
    }
    cmd.args(more);
    cmd.args(["-w", "\n%{http_code} %{http_connect}", url]);
    let out = cmd.output().expect("run curl (scripts/test installs it)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (answer, codes) = text.rsplit_once('\n').unwrap_or(("", &text));
    let mut codes = codes.split(' ').map(|c| c.parse::<u16>().unwrap_or(0));
    let (code, connect) = (codes.next().unwrap_or(0), codes.next().unwrap_or(0));
    // A refused CONNECT is curl's failure: its answer is the CONNECT's.
    let status = if tunnel && connect != 200 {
        connect
    } else {
        code
    };
    (status, answer.to_string())
}

/// The first line of the answer to `head`, sent as it is to the egress gateway.
async fn raw_status(proxy: u16, head: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", proxy))
        .await
        .expect("connect");
    s.write_all(head.as_bytes()).await.expect("write");
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(std::time::Duration::from_secs(10), s.read(&mut buf))
        .await
        .expect("an answer in time")
        .expect("read");
    String::from_utf8_lossy(&buf[..n])
        .lines()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// A backend on 127.0.0.1 stands in for the API; `127.0.0.1` is its listed target (with
/// `allow_private`: the test's API is on loopback), `localhost` is listed without it.
fn targets(backend: &Backend, connect: bool) -> String {
    let port = backend.addr.port();
    format!(
        "[[egress.targets]]\nhost = \"127.0.0.1\"\nports = [{port}]\nallow_private = true\nconnect = {connect}\n\
         [[egress.targets]]\nhost = \"localhost\"\nports = [{port}]\nconnect = true\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_go_to_listed_public_targets_only_and_are_limited_going_out_not_coming_in() {
    let _watch = common::watchdog();
    let backend = Backend::start().await;
    let port = backend.addr.port();
    let rules = "[[rules]]\nname = \"out\"\nmatch = { egress = true }\nkey = \"target\"\nrate = \"1/h\"\nburst = 3\n";
    let (gw, proxy) = gateway(&backend, &Store::Memory, &targets(&backend, false), rules);
    let api = format!("http://127.0.0.1:{port}/v1/things?page=2");

    // Three calls of the target's budget go, whole; the fourth is refused before it.
    for left in (0..3).rev() {
        let (status, answer) = tokio::task::block_in_place(|| curl(proxy, &api, &[], false, &[]));
        assert_eq!(status, 200, "{answer}\n{}", gw.logs());
        assert!(
            answer
                .to_ascii_lowercase()
                .contains(&format!("ratelimit: \"out\";r={left};")),
            "{answer}"
        );
    }
    let (status, answer) = tokio::task::block_in_place(|| curl(proxy, &api, &[], false, &[]));
    assert_eq!(status, 429, "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("retry-after:"),
        "{answer}"
    );
    let hits = backend.hits();
    assert_eq!(
        hits.len(),
        3,
        "the API saw the calls let through only: {hits:?}"
    );
    assert!(
        hits.iter()
            .all(|h| h.method == "GET" && h.target == "/v1/things?page=2"),
        "{hits:?}"
    );

    // Never open: an unlisted host, a listed host's other port, a listed name that
    // resolves to loopback without allow_private, a request not meant for a proxy.
    let refused = [
        ("http://example.com/", "is not a listed target"),
        (
            &*format!("http://127.0.0.1:{}/", port.wrapping_add(1).max(1)),
            "is not one of its target's ports",
        ),
        (
            &*format!("http://localhost:{port}/"),
            "a private, loopback or link-local address",
        ),
    ];
    for (url, why) in refused {
        let (status, answer) = tokio::task::block_in_place(|| curl(proxy, url, &[], false, &[]));
        assert_eq!(status, 403, "{url}: {answer}");
        assert!(answer.contains(why), "{url}: {answer}");
        assert!(answer.contains("application/problem+json"), "{answer}");
    }
    let (status, _) = tokio::task::block_in_place(|| {
        curl(
            proxy,
            &format!("https://127.0.0.1:{port}/"),
            &[],
            false,
            &[],
        )
    });
    assert_ne!(
        status, 200,
        "an https:// URL is CONNECT, which the target does not allow"
    );
    let origin_form = Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            &format!("http://127.0.0.1:{proxy}/v1/things"),
        ])
        .output()
        .expect("curl");
    assert_eq!(
        String::from_utf8_lossy(&origin_form.stdout),
        "400",
        "not a proxy request"
    );
    // Userinfo would be another target key (and a credential sent in the Host): 400.
    for head in [
        format!(
            "GET http://k1@127.0.0.1:{port}/v1/things HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n"
        ),
        format!("CONNECT k2@127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n"),
    ] {
        let answer = raw_status(proxy, &head).await;
        assert!(answer.starts_with("HTTP/1.1 400"), "{head:?}: {answer}");
    }
    assert_eq!(backend.hits().len(), 3, "nothing refused reached the API");

    // The egress rule is not the proxy's: requests through the proxy pass, uncounted.
    let client = common::client::HttpClient::new();
    for _ in 0..5 {
        assert_eq!(client.get(&gw.url("/proxied"), &[]).await.status, 200);
    }
    assert_eq!(backend.count("/proxied"), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_credential_is_its_own_limit_and_never_stored_or_logged_raw() {
    let _watch = common::watchdog();
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let port = backend.addr.port();
    let rules = "[[rules]]\nname = \"per-token\"\nmatch = { egress = true }\nkey = [\"target\", \"credential\"]\n\
                 rate = \"1/h\"\nburst = 2\n";
    let (gw, proxy) = gateway(
        &backend,
        &Store::redis_roomy(&redis),
        &targets(&backend, false),
        rules,
    );
    let api = format!("http://127.0.0.1:{port}/charge");
    let tokens = [
        "sk_live_first_secret_4242424242",
        "sk_live_other_secret_8686868686",
    ];
    for token in tokens {
        let auth = format!("Authorization: Bearer {token}");
        for want in [200, 200, 429] {
            let (status, answer) =
                tokio::task::block_in_place(|| curl(proxy, &api, &[&auth], false, &[]));
            assert_eq!(status, want, "{answer}");
        }
    }
    // A call without the credential is refused (the rule counts by it).
    let (status, answer) = tokio::task::block_in_place(|| curl(proxy, &api, &[], false, &[]));
    assert_eq!(status, 401, "{answer}");
    assert_eq!(backend.count("/charge"), 4);

    let mut conn = redis.conn();
    let keys = scan(&mut conn, "*");
    assert_eq!(keys.len(), 2, "one state per token: {keys:?}");
    for token in tokens {
        let secret = &token["sk_live_".len()..];
        assert!(keys.iter().all(|k| !k.contains(secret)), "{keys:?}");
        for k in &keys {
            let value: Vec<u8> = redis::cmd("DUMP").arg(k).query(&mut conn).expect("DUMP");
            assert!(
                !String::from_utf8_lossy(&value).contains(secret),
                "{k} holds the token"
            );
        }
        assert!(!gw.logs().contains(secret), "the logs hold a token");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_tunnels_only_where_the_target_allows_and_counts_per_tunnel() {
    let _watch = common::watchdog();
    let backend = Backend::start().await;
    let port = backend.addr.port();
    // Scoped to a path and a method: a tunnel has neither, and is counted all the same.
    let rules = "[[rules]]\nname = \"tunnels\"\nmatch = { egress = true, path_prefix = \"/v1/\", methods = [\"POST\"] }\n\
                 key = \"target\"\nrate = \"1/h\"\nburst = 2\n";
    let (gw, proxy) = gateway(&backend, &Store::Memory, &targets(&backend, true), rules);
    let api = format!("http://127.0.0.1:{port}/through");
    for want in [200, 200, 429] {
        let (status, answer) = tokio::task::block_in_place(|| curl(proxy, &api, &[], true, &[]));
        assert_eq!(status, want, "{answer}\n{}", gw.logs());
    }
    assert_eq!(backend.count("/through"), 2, "two tunnels, one call each");

    // A target without connect = true is refused, as is a loopback name without
    // allow_private.
    let backend2 = Backend::start().await;
    let (gw2, proxy2) = gateway(&backend2, &Store::Memory, &targets(&backend2, false), "");
    let url = format!("http://127.0.0.1:{}/x", backend2.addr.port());
    let (status, answer) = tokio::task::block_in_place(|| curl(proxy2, &url, &[], true, &[]));
    assert_eq!(status, 403, "{answer}\n{}", gw2.logs());
    let url = format!("http://localhost:{}/x", backend2.addr.port());
    let (status, answer) = tokio::task::block_in_place(|| curl(proxy2, &url, &[], true, &[]));
    assert_eq!(status, 403, "{answer}");
    assert_eq!(backend2.hits().len(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_goes_end_to_end_through_a_tunnel_and_is_originated_for_tls_targets() {
    let _watch = common::watchdog();
    let ca = Ca::new("egress test CA");
    let up = TlsUpstream::start(&ca.leaf(&["127.0.0.1"]), ClientCerts::None, None).await;
    let dir = tempfile::tempdir().expect("a folder");
    let ca_file = write_pem(dir.path(), "ca.pem", &ca.pem());
    let backend = Backend::start().await;
    let egress = format!(
        "[[egress.targets]]\nhost = \"127.0.0.1\"\nports = [{}]\nallow_private = true\nconnect = true\ntls = true\nca = \"{}\"\n",
        up.port(),
        ca_file.display()
    );
    let (gw, proxy) = gateway(&backend, &Store::Memory, &egress, "");

    // Through a tunnel, the client's own TLS (the test's CA), with a body large enough
    // that its ciphertext holds every byte value: nothing of HTTP's reads the tunnel.
    let body: Vec<u8> = (0..300_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let file = dir.path().join("body.bin");
    std::fs::write(&file, &body).expect("write the body");
    let url = format!("https://127.0.0.1:{}/upload", up.port());
    let cacert = ca_file.display().to_string();
    let data = format!("@{}", file.display());
    let (status, answer) = tokio::task::block_in_place(|| {
        curl(
            proxy,
            &url,
            &[],
            true,
            &["--http1.1", "--cacert", &cacert, "--data-binary", &data],
        )
    });
    assert_eq!(status, 200, "{answer}\n{}", gw.logs());
    assert!(
        answer.ends_with(&format!(
            "tls ok, {} bytes, sum {}",
            body.len(),
            checksum(&body)
        )),
        "{answer}"
    );

    // Absolute-form http:// to a tls = true target: the gateway's TLS, verified with `ca`.
    let url = format!("http://127.0.0.1:{}/plain", up.port());
    let (status, answer) = tokio::task::block_in_place(|| curl(proxy, &url, &[], false, &[]));
    assert_eq!(status, 200, "{answer}\n{}", gw.logs());
    assert!(answer.ends_with("tls ok"), "{answer}");
    assert_eq!(
        up.seen.requests.load(std::sync::atomic::Ordering::SeqCst),
        2
    );
}
