//! `[jwt]` end to end: the real binary, a real upstream, a real HTTP client, tokens signed
//! in the test (RS256 by an `openssl genpkey` key, ES256 and EdDSA by rcgen keys, HS256 by
//! a secret). Limited per `sub` exactly under concurrency; every kind of invalid token a
//! 401 with its Bearer challenge that never reaches the upstream; a plan from a claim;
//! claims forwarded as headers, a client's copies dropped; a JWKS over https rotated
//! without a reload and outliving its server; no JWKS ever fetched: 503; a `crit` or
//! `b64: false` header, the token cookie or `Authorization` sent twice: 401, never
//! forwarded.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::jwt::{claims, jwks, unix_now, JwksServer, SigningKey};
use common::{metric, Gateway, HttpClient, Upstream};
use http::StatusCode;

const ISS: &str = "https://issuer.test";
const AUD: &str = "api";

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

/// `n` requests at once per token: for each token, how many were 200 and 429.
async fn at_once(url: &str, tokens: &[String], n: usize) -> Vec<(usize, usize)> {
    let client = HttpClient::new();
    let mut tasks = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        for _ in 0..n {
            let (client, url, auth) = (client.clone(), url.to_string(), bearer(t));
            tasks.push(tokio::spawn(async move {
                (
                    i,
                    client.get(&url, &[("authorization", &auth)]).await.status,
                )
            }));
        }
    }
    let mut out = vec![(0, 0); tokens.len()];
    for t in tasks {
        let (i, status) = t.await.expect("request");
        match status {
            StatusCode::OK => out[i].0 += 1,
            StatusCode::TOO_MANY_REQUESTS => out[i].1 += 1,
            other => panic!("token {i}: {other}"),
        }
    }
    out
}

/// How many requests the upstream saw for each `x-user-id` (the forwarded `sub`).
fn seen_by_user(upstream: &Upstream) -> HashMap<String, usize> {
    let mut by = HashMap::new();
    for s in upstream.seen() {
        let user = s
            .headers
            .get("x-user-id")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("(none)")
            .to_string();
        *by.entry(user).or_default() += 1;
    }
    by
}

fn jwt_rule(burst: u64) -> String {
    format!(
        "[[rules]]\nname = \"per-user\"\nkey = \"jwt:sub\"\nrate = \"1/h\"\nburst = {burst}\nmatch = {{ path_prefix = \"/api/\" }}\n"
    )
}

/// RS256, ES256 and EdDSA tokens (one gateway, a key file each) and HS256 ones (another:
/// a secret is never listed beside public keys): for each algorithm two subs, 100
/// requests each at once (200 concurrent), burst 10: exactly 10 of each sub's pass and
/// reach the upstream, the other 90 are 429.
#[tokio::test(flavor = "multi_thread")]
async fn tokens_of_every_algorithm_are_limited_per_sub_exactly() {
    let _watch = common::watchdog();
    let dir = tempfile::tempdir().unwrap();
    let rsa = SigningKey::rsa(dir.path());
    let (ec, ed) = (SigningKey::p256(), SigningKey::ed25519());
    let files: Vec<String> = [(&rsa, "rsa.pem"), (&ec, "ec.pem"), (&ed, "ed.pem")]
        .iter()
        .map(|(k, n)| format!("\"{}\"", common::toml_path(&k.public_file(dir.path(), n))))
        .collect();
    let upstream = Upstream::start().await;
    let public = Gateway::start(&format!(
        "[upstream]\nurl = \"{}\"\n[jwt]\nalgorithms = [\"RS256\", \"ES256\", \"EdDSA\"]\nkeys = [{}]\n\
         issuer = \"{ISS}\"\naudience = \"{AUD}\"\nforward_claims = {{ sub = \"x-user-id\" }}\n{}",
        upstream.url(),
        files.join(", "),
        jwt_rule(10)
    ));
    let hs_upstream = Upstream::start().await;
    let hs = Gateway::start_with(
        &format!(
            "[upstream]\nurl = \"{}\"\n[jwt]\nalgorithms = [\"HS256\"]\nsecret_env = \"JWT_TEST_SECRET\"\n\
             issuer = \"{ISS}\"\naudience = \"{AUD}\"\nforward_claims = {{ sub = \"x-user-id\" }}\n{}",
            hs_upstream.url(),
            jwt_rule(10)
        ),
        &[],
        &[("JWT_TEST_SECRET", "a-test-secret-of-some-length")],
    );
    let secret = SigningKey::secret(b"a-test-secret-of-some-length");
    for (gw, up, key, name) in [
        (&public, &upstream, &rsa, "rs256"),
        (&public, &upstream, &ec, "es256"),
        (&public, &upstream, &ed, "eddsa"),
        (&hs, &hs_upstream, &secret, "hs256"),
    ] {
        let subs = [format!("{name}-a"), format!("{name}-b")];
        let tokens: Vec<String> = subs
            .iter()
            .map(|s| key.sign(&claims(s, ISS, AUD), None))
            .collect();
        let got = at_once(&gw.url("/api/x"), &tokens, 100).await;
        assert_eq!(got, [(10, 90), (10, 90)], "{name}: {}", gw.logs());
        let seen = seen_by_user(up);
        for s in &subs {
            assert_eq!(seen.get(s), Some(&10), "{name}: the upstream saw {seen:?}");
        }
    }
}

/// Every kind of invalid token gets 401 with `WWW-Authenticate: Bearer
/// error="invalid_token", error_description="…"`, and the upstream sees none of them;
/// no token at all gets 401 with a bare `Bearer` challenge.
#[tokio::test(flavor = "multi_thread")]
async fn every_invalid_token_is_a_401_that_never_reaches_the_upstream() {
    let _watch = common::watchdog();
    let dir = tempfile::tempdir().unwrap();
    let rsa = SigningKey::rsa(dir.path());
    let ec = SigningKey::p256();
    let files = [
        format!(
            "\"{}\"",
            common::toml_path(&rsa.public_file(dir.path(), "rsa.pem"))
        ),
        format!(
            "\"{}\"",
            common::toml_path(&ec.public_file(dir.path(), "ec.pem"))
        ),
    ];
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "[upstream]\nurl = \"{}\"\n[jwt]\nalgorithms = [\"RS256\", \"ES256\"]\nkeys = [{}, {}]\n\
         issuer = \"{ISS}\"\naudience = [\"{AUD}\", \"other-api\"]\nrequired_claims = [\"sub\", \"tenant\"]\n{}",
        upstream.url(),
        files[0],
        files[1],
        jwt_rule(1000)
    ));
    let now = unix_now();
    let good =
        serde_json::json!({"sub": "u", "tenant": "t", "iss": ISS, "aud": AUD, "exp": now + 600});
    let with = |k: &str, v: serde_json::Value| {
        let mut c = good.clone();
        c[k] = v;
        c
    };
    let client = HttpClient::new();
    let url = gw.url("/api/x");
    // The valid token passes: the rest differ from it in one way each.
    let ok = client
        .get(&url, &[("authorization", &bearer(&rsa.sign(&good, None)))])
        .await;
    assert_eq!(ok.status, StatusCode::OK, "{}", gw.logs());
    let b64 = |s: &str| {
        use base64::Engine;
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s)
    };
    let payload = b64(&good.to_string());
    let other_rsa = SigningKey::p256();
    let mut no_tenant = good.clone();
    no_tenant.as_object_mut().unwrap().remove("tenant");
    // HS256, its secret the RSA public key's PEM: the classic key confusion.
    let confused = SigningKey::secret(rsa.public_pem.as_bytes()).sign(&good, None);
    let tampered = {
        let t = ec.sign(&good, None);
        let (head, _) = t.rsplit_once('.').unwrap();
        let forged = b64(&with("sub", "admin".into()).to_string());
        let sig = t.rsplit('.').next().unwrap();
        format!("{}.{forged}.{sig}", head.split('.').next().unwrap())
    };
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "bad signature",
            other_rsa.sign(&good, None),
            "signature is invalid",
        ),
        ("tampered claims", tampered, "signature is invalid"),
        (
            "expired",
            rsa.sign(&with("exp", (now - 120).into()), None),
            "has expired",
        ),
        (
            "not yet valid",
            rsa.sign(&with("nbf", (now + 600).into()), None),
            "not valid yet",
        ),
        (
            "wrong issuer",
            rsa.sign(&with("iss", "https://evil.test".into()), None),
            "issuer",
        ),
        (
            "wrong audience",
            ec.sign(&with("aud", "billing".into()), None),
            "audience",
        ),
        (
            "algorithm not allowed",
            SigningKey::p384().sign(&good, None),
            "algorithm is not allowed",
        ),
        (
            "alg none",
            format!("{}.{payload}.", b64(r#"{"alg":"none","typ":"JWT"}"#)),
            "algorithm is not allowed",
        ),
        (
            "HS256 signed with the public key",
            confused,
            "algorithm is not allowed",
        ),
        ("unknown kid", rsa.sign(&good, Some("no-such-kid")), "kid"),
        ("malformed", "not.a.token".to_string(), "malformed"),
        (
            "over 8 KiB",
            rsa.sign(&with("pad", "x".repeat(9000).into()), None),
            "over 8 KiB",
        ),
        (
            "missing required claim",
            rsa.sign(&no_tenant, None),
            "required claim",
        ),
    ];
    for (what, token, says) in &cases {
        let r = client.get(&url, &[("authorization", &bearer(token))]).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{what}");
        assert_eq!(
            r.header("content-type"),
            Some("application/problem+json"),
            "{what}"
        );
        let challenge = r.header("www-authenticate").unwrap_or_default();
        assert!(
            challenge.starts_with("Bearer error=\"invalid_token\", error_description=\"")
                && challenge.contains(says),
            "{what}: {challenge}"
        );
    }
    let none = client.get(&url, &[]).await;
    assert_eq!(none.status, StatusCode::UNAUTHORIZED);
    assert_eq!(none.header("www-authenticate"), Some("Bearer"));
    assert_eq!(none.json()["detail"], "a bearer token is required");
    assert_eq!(
        upstream.arrived(),
        1,
        "only the valid token reached the upstream"
    );
    let refused = metric(
        &gw,
        "ratewall_refusals_total",
        &[("reason", "invalid_token")],
    )
    .await;
    assert_eq!(refused, cases.len() as f64);
}

/// `plan_claim`: a token's `plan` claim picks the rule's plan (no key lists it); a plan
/// no rule defines gets the rule's own limits. `forward_claims`: the verified claims reach
/// the backend as headers; a client's own copy of those headers never does, with or
/// without a token, on a path no rule limits too.
#[tokio::test(flavor = "multi_thread")]
async fn a_plan_comes_from_a_claim_and_claims_are_forwarded_never_forged() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = Gateway::start_with(
        &format!(
            "[upstream]\nurl = \"{}\"\n[jwt]\nalgorithms = [\"HS256\"]\nsecret_env = \"JWT_TEST_SECRET\"\n\
             plan_claim = \"plan\"\nforward_claims = {{ sub = \"x-user-id\", \"org.id\" = \"x-org-id\" }}\n{}\
             [rules.plans.pro]\nburst = 5\n",
            upstream.url(),
            jwt_rule(2)
        ),
        &[],
        &[("JWT_TEST_SECRET", "plan-secret")],
    );
    let key = SigningKey::secret(b"plan-secret");
    let token = |sub: &str, plan: Option<&str>| {
        let mut c = serde_json::json!({"sub": sub, "org": {"id": "acme"}, "exp": unix_now() + 600});
        if let Some(p) = plan {
            c["plan"] = p.into();
        }
        key.sign(&c, None)
    };
    let url = gw.url("/api/x");
    let per_plan = at_once(
        &url,
        &[
            token("free-user", None),
            token("pro-user", Some("pro")),
            token("odd-user", Some("platinum")),
        ],
        8,
    )
    .await;
    assert_eq!(per_plan, [(2, 6), (5, 3), (2, 6)], "{}", gw.logs());

    let client = HttpClient::new();
    let before = upstream.seen().len();
    let forged = [("x-user-id", "mallory"), ("x-org-id", "evil")];
    let t = bearer(&token("carol", Some("pro")));
    let with_token: Vec<(&str, &str)> = forged
        .iter()
        .copied()
        .chain([("authorization", t.as_str())])
        .collect();
    assert_eq!(client.get(&url, &with_token).await.status, StatusCode::OK);
    // A path no rule limits, with the token and without one.
    assert_eq!(
        client.get(&gw.url("/open"), &with_token).await.status,
        StatusCode::OK
    );
    assert_eq!(
        client.get(&gw.url("/open"), &forged).await.status,
        StatusCode::OK
    );
    let seen = upstream.seen();
    let headers = |i: usize, name: &str| -> Vec<String> {
        seen[before + i]
            .headers
            .get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(headers(0, "x-user-id"), ["carol"]);
    assert_eq!(headers(0, "x-org-id"), ["acme"]);
    assert_eq!(headers(1, "x-user-id"), ["carol"]);
    assert!(headers(2, "x-user-id").is_empty() && headers(2, "x-org-id").is_empty());
}

/// A JWKS over https (the test's CA as `jwks_ca`): rotated to a new kid, the new kid's
/// tokens pass without a reload (the first one seen asks for a refetch, and gets its
/// 401), the old kid's stop; with the JWKS server stopped, a gateway that fails to
/// refresh keeps serving the last good keys, and one reloaded keeps them too.
#[tokio::test(flavor = "multi_thread")]
async fn a_jwks_is_rotated_without_reload_and_outlives_its_server() {
    let _watch = common::watchdog();
    let dir = tempfile::tempdir().unwrap();
    let (k1, k2) = (SigningKey::p256(), SigningKey::ed25519());
    let server = JwksServer::start(dir.path(), jwks(&[("k1", &k1)])).await;
    let upstream = Upstream::start().await;
    let config = |refresh: &str| {
        format!(
            "[upstream]\nurl = \"{}\"\n[jwt]\nalgorithms = [\"ES256\", \"EdDSA\"]\njwks_url = \"{}\"\n\
             jwks_ca = \"{}\"\njwks_refresh = \"{refresh}\"\n{}",
            upstream.url(),
            server.url(),
            common::toml_path(&server.ca_file),
            jwt_rule(1000)
        )
    };
    let rotating = Gateway::start(&config("1h"));
    let refreshing = Gateway::start(&config("1s"));
    let client = HttpClient::new();
    let claims_of = |sub: &str| claims(sub, ISS, AUD);
    let old = bearer(&k1.sign(&claims_of("a"), Some("k1")));
    for gw in [&rotating, &refreshing] {
        let took = client
            .until_status(
                &gw.url("/api/x"),
                &[("authorization", &old)],
                StatusCode::OK,
                Duration::from_secs(10),
            )
            .await;
        assert!(took.is_some(), "the first fetch: {}", gw.logs());
    }

    server.replace(jwks(&[("k2", &k2)]));
    let new = bearer(&k2.sign(&claims_of("b"), Some("k2")));
    let url = rotating.url("/api/x");
    let first = client.get(&url, &[("authorization", &new)]).await;
    assert_eq!(
        first.status,
        StatusCode::UNAUTHORIZED,
        "unknown until refetched"
    );
    assert!(first
        .header("www-authenticate")
        .unwrap_or_default()
        .contains("kid"));
    let took = client
        .until_status(
            &url,
            &[("authorization", &new)],
            StatusCode::OK,
            Duration::from_secs(5),
        )
        .await;
    assert!(
        took.is_some(),
        "the new kid, refetched: {}",
        rotating.logs()
    );
    let stale = client.get(&url, &[("authorization", &old)]).await;
    assert_eq!(
        stale.status,
        StatusCode::UNAUTHORIZED,
        "the rotated-out key's token, even cached"
    );

    // The server goes away; the gateway refreshing every second fails, and keeps k2.
    let ok_before = client
        .until_status(
            &refreshing.url("/api/x"),
            &[("authorization", &new)],
            StatusCode::OK,
            Duration::from_secs(5),
        )
        .await;
    assert!(ok_before.is_some(), "k2 by refresh: {}", refreshing.logs());
    server.stop();
    let failed = || {
        metric(
            &refreshing,
            "ratewall_jwks_fetches_total",
            &[("result", "failed")],
        )
    };
    let end = std::time::Instant::now() + Duration::from_secs(10);
    while failed().await < 2.0 && std::time::Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(failed().await >= 2.0, "{}", refreshing.logs());
    // A token never seen (not in the cache): verified with the kept keys.
    let fresh = bearer(&k2.sign(&claims_of("c"), Some("k2")));
    let r = client
        .get(&refreshing.url("/api/x"), &[("authorization", &fresh)])
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", refreshing.logs());
    assert!(refreshing
        .logs()
        .contains("the last good key set keeps serving"));

    // A reload that leaves [jwt] alone keeps the fetched set: the server is gone, and a
    // new token still verifies (a fresh verifier would have no keys, and answer 503).
    rotating.reload(1);
    let after = bearer(&k2.sign(&claims_of("d"), Some("k2")));
    let r = client.get(&url, &[("authorization", &after)]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", rotating.logs());
}

/// A gateway whose `jwks_url` never answered has nothing to verify with: its JWT rules
/// answer 503 problem+json and forward nothing; a request without a token is still 401.
#[tokio::test(flavor = "multi_thread")]
async fn a_gateway_that_never_fetched_its_jwks_answers_503() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let refusing = common::RefusingPort::new();
    let nothing = refusing.port;
    let gw = Gateway::start(&format!(
        "[upstream]\nurl = \"{}\"\n[jwt]\nalgorithms = [\"ES256\"]\njwks_url = \"https://127.0.0.1:{nothing}/jwks.json\"\n{}",
        upstream.url(),
        jwt_rule(10)
    ));
    let token = SigningKey::p256().sign(&claims("a", ISS, AUD), None);
    let client = HttpClient::new();
    let r = client
        .get(&gw.url("/api/x"), &[("authorization", &bearer(&token))])
        .await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert_eq!(r.header("retry-after"), Some("1"));
    let none = client.get(&gw.url("/api/x"), &[]).await;
    assert_eq!(none.status, StatusCode::UNAUTHORIZED);
    assert_eq!(upstream.arrived(), 0);
    let refused = metric(
        &gw,
        "ratewall_refusals_total",
        &[("reason", "keys_unavailable")],
    )
    .await;
    assert_eq!(refused, 1.0);
}

/// A gateway limiting `/api/` by `jwt:sub`, HS256 with `secret`, reading the token where
/// `from` says (`header = ...` or `cookie = ...`; empty: `Authorization`).
fn hs_gateway(upstream: &Upstream, secret: &str, from: &str) -> Gateway {
    Gateway::start_with(
        &format!(
            "[upstream]\nurl = \"{}\"\n[jwt]\nalgorithms = [\"HS256\"]\nsecret_env = \"JWT_TEST_SECRET\"\n{from}{}",
            upstream.url(),
            jwt_rule(1000)
        ),
        &[],
        &[("JWT_TEST_SECRET", secret)],
    )
}

/// `GET /api/x` with each of `fields` as a header line of its own, on a raw connection:
/// the status, and the `error_description` of an `invalid_token` challenge if it has one.
async fn raw_get(gw: &Gateway, fields: &[String]) -> (u16, Option<String>) {
    let mut request = String::from("GET /api/x HTTP/1.1\r\nHost: api.test\r\n");
    for f in fields {
        request.push_str(f);
        request.push_str("\r\n");
    }
    request.push_str("Connection: close\r\n\r\n");
    let a = common::raw_exchange(gw.port, request.as_bytes()).await;
    let challenge = a.text.lines().find_map(|l| {
        let (name, value) = l.split_once(':')?;
        let value = value.trim();
        let rest = value.strip_prefix("Bearer error=\"invalid_token\", error_description=\"")?;
        name.eq_ignore_ascii_case("www-authenticate")
            .then(|| rest.trim_end_matches('"').to_string())
    });
    (a.status, challenge)
}

/// RFC 7515 §4.1.11: a JWS whose `crit` lists an extension the recipient does not
/// understand must be rejected, and ratewall understands none; a `crit` that is not a
/// non-empty list of names, or that lists a standard header parameter, is invalid. RFC
/// 7797's `b64: false` (an unencoded payload, whose signature covers other bytes than the
/// ones decoded) is not supported. Each is a 401 `invalid_token` like any invalid token,
/// twice in a row (the second would be a cache hit had the first been remembered as
/// good), and none reaches the upstream. Before the fix, all 20 of these requests were
/// answered 200 and forwarded.
#[tokio::test(flavor = "multi_thread")]
async fn a_token_with_critical_extensions_or_an_unencoded_payload_is_refused() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = hs_gateway(&upstream, "crit-secret", "");
    let key = SigningKey::secret(b"crit-secret");
    let good = serde_json::json!({"sub": "u", "exp": unix_now() + 600});
    let with = |extra: serde_json::Value| {
        let mut h = serde_json::json!({"alg": "HS256", "typ": "JWT"});
        for (k, v) in extra.as_object().unwrap() {
            h[k] = v.clone();
        }
        key.sign_with_header(&h, &good)
    };
    let client = HttpClient::new();
    let url = gw.url("/api/x");
    // The header made here, and `b64: true` (the default, said aloud), verify.
    for token in [
        with(serde_json::json!({})),
        with(serde_json::json!({"b64": true})),
    ] {
        let r = client
            .get(&url, &[("authorization", &bearer(&token))])
            .await;
        assert_eq!(r.status, StatusCode::OK, "{}", gw.logs());
    }
    let cases = [
        (
            "crit naming an extension",
            serde_json::json!({"crit": ["https://ext.test/tenant"], "https://ext.test/tenant": "a"}),
            "critical",
        ),
        (
            "crit naming an extension the header lacks",
            serde_json::json!({"crit": ["exp"]}),
            "critical",
        ),
        (
            "crit naming a standard parameter",
            serde_json::json!({"crit": ["alg"]}),
            "crit",
        ),
        ("crit empty", serde_json::json!({"crit": []}), "crit"),
        ("crit a string", serde_json::json!({"crit": "x"}), "crit"),
        ("crit of a number", serde_json::json!({"crit": [1]}), "crit"),
        ("crit null", serde_json::json!({"crit": null}), "crit"),
        ("b64 false", serde_json::json!({"b64": false}), "unencoded"),
        (
            "b64 false, marked critical",
            serde_json::json!({"b64": false, "crit": ["b64"]}),
            "unencoded",
        ),
        (
            "b64 not a boolean",
            serde_json::json!({"b64": "false"}),
            "malformed",
        ),
    ];
    let mut wrong = Vec::new();
    for (what, extra, says) in &cases {
        let token = bearer(&with(extra.clone()));
        for attempt in 1..=2 {
            let r = client.get(&url, &[("authorization", &token)]).await;
            let challenge = r.header("www-authenticate").unwrap_or_default();
            let ok = r.status == StatusCode::UNAUTHORIZED
                && challenge.starts_with("Bearer error=\"invalid_token\", error_description=\"")
                && challenge.contains(says);
            if !ok {
                wrong.push(format!("{what} (#{attempt}): {} {challenge:?}", r.status));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {} wrong:\n{}",
        wrong.len(),
        2 * cases.len(),
        wrong.join("\n")
    );
    assert_eq!(
        upstream.arrived(),
        2,
        "only the two valid tokens were forwarded"
    );
    let refused = metric(
        &gw,
        "ratewall_refusals_total",
        &[("reason", "invalid_token")],
    )
    .await;
    assert_eq!(refused, 2.0 * cases.len() as f64);
}

/// `cookie = "session"`: the token cookie sent twice — in one `Cookie` field or in two,
/// the same token or another, or an empty one beside it — is a 401 `invalid_token` that
/// never reaches the upstream (a backend reading the last, or every, `session` would see
/// a token the gateway never verified). One `session` among other cookies passes, and a
/// cookie of another name (`Session`) is not it. Before the fix the first one won: the
/// five doubled requests were 200 and forwarded with both.
#[tokio::test(flavor = "multi_thread")]
async fn the_token_cookie_sent_twice_is_refused() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = hs_gateway(&upstream, "cookie-secret", "cookie = \"session\"\n");
    let key = SigningKey::secret(b"cookie-secret");
    let token = |sub: &str| {
        key.sign(
            &serde_json::json!({"sub": sub, "exp": unix_now() + 600}),
            None,
        )
    };
    let (a, b) = (token("alice"), token("bob"));
    let cookie = |v: &str| format!("Cookie: {v}");
    let cases: Vec<(&str, Vec<String>, u16)> = vec![
        ("one", vec![cookie(&format!("session={a}"))], 200),
        (
            "one among others",
            vec![cookie(&format!("x=1; session={a}; y=2"))],
            200,
        ),
        (
            "one, other cookies in another field",
            vec![cookie("x=1"), cookie(&format!("session={a}"))],
            200,
        ),
        (
            "another name",
            vec![cookie(&format!("session={a}; Session={b}"))],
            200,
        ),
        (
            "two in one field",
            vec![cookie(&format!("session={a}; session={b}"))],
            401,
        ),
        (
            "the same twice",
            vec![cookie(&format!("session={a}; session={a}"))],
            401,
        ),
        (
            "two fields",
            vec![
                cookie(&format!("session={a}")),
                cookie(&format!("session={b}")),
            ],
            401,
        ),
        (
            "an empty one after",
            vec![cookie(&format!("session={a}; session="))],
            401,
        ),
        (
            "a spaced name after",
            vec![cookie(&format!("session={a}; session ={b}"))],
            401,
        ),
    ];
    let mut wrong = Vec::new();
    let mut passed = 0;
    for (what, fields, want) in &cases {
        let (status, challenge) = raw_get(&gw, fields).await;
        let said = challenge.as_deref().unwrap_or_default();
        if status != *want || (status == 401) != said.contains("more than once") {
            wrong.push(format!("{what}: {status} {challenge:?}"));
        }
        passed += usize::from(status == 200);
    }
    assert!(
        wrong.is_empty(),
        "{} of {} wrong:\n{}",
        wrong.len(),
        cases.len(),
        wrong.join("\n")
    );
    assert_eq!(
        upstream.arrived(),
        passed,
        "no refused request was forwarded"
    );
}

/// The token's header sent twice (`Authorization`, Bearer both times or one of them) is a
/// 401 `invalid_token` that never reaches the upstream, as is one field naming two tokens.
/// One `Authorization` passes. (The status held before the fix: the header twice was
/// already refused, as "malformed"; the four doubled cases now say why.)
#[tokio::test(flavor = "multi_thread")]
async fn the_authorization_header_sent_twice_is_refused() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = hs_gateway(&upstream, "auth-secret", "");
    let key = SigningKey::secret(b"auth-secret");
    let token = |sub: &str| {
        key.sign(
            &serde_json::json!({"sub": sub, "exp": unix_now() + 600}),
            None,
        )
    };
    let (a, b) = (token("alice"), token("bob"));
    let auth = |v: &str| format!("Authorization: {v}");
    let cases: Vec<(&str, Vec<String>, u16, &str)> = vec![
        ("one", vec![auth(&bearer(&a))], 200, ""),
        (
            "two tokens",
            vec![auth(&bearer(&a)), auth(&bearer(&b))],
            401,
            "more than once",
        ),
        (
            "the same twice",
            vec![auth(&bearer(&a)), auth(&bearer(&a))],
            401,
            "more than once",
        ),
        (
            "Bearer, then Basic",
            vec![auth(&bearer(&a)), auth("Basic dTpw")],
            401,
            "more than once",
        ),
        (
            "Basic, then Bearer",
            vec![auth("Basic dTpw"), auth(&bearer(&a))],
            401,
            "more than once",
        ),
        (
            "two tokens in one field",
            vec![auth(&format!("Bearer {a}, Bearer {b}"))],
            401,
            "malformed",
        ),
    ];
    let mut wrong = Vec::new();
    let client_count = cases.iter().filter(|c| c.2 == 200).count();
    for (what, fields, want, says) in &cases {
        let (status, challenge) = raw_get(&gw, fields).await;
        let said = challenge.as_deref().unwrap_or_default();
        if status != *want || (status == 401) != (challenge.is_some() && said.contains(says)) {
            wrong.push(format!("{what}: {status} {challenge:?}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {} wrong:\n{}",
        wrong.len(),
        cases.len(),
        wrong.join("\n")
    );
    assert_eq!(upstream.arrived(), client_count);
}
