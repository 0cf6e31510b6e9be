//! Combined keys end to end (`key = ["jwt:org_id", "header:x-project"]`): each
//! combination of a verified token's claim and a header is counted apart, exactly; a
//! request missing a part follows `missing_key` (401, or counted by its client IP); the
//! admin API names one identity part by part. The real binary, a real upstream, a real
//! client.

use crate::common;

use common::jwt::{unix_now, SigningKey};
use common::{Gateway, HttpClient, Upstream};
use http::StatusCode;

const ADMIN_TOKEN: &str = "combined-keys-admin-token";

#[tokio::test(flavor = "multi_thread")]
async fn each_combination_is_counted_apart_and_a_missing_part_follows_missing_key() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = Gateway::start_with(
        &format!(
            "[admin]\ntoken = \"{ADMIN_TOKEN}\"\n[upstream]\nurl = \"{}\"\n[jwt]\nalgorithms = [\"HS256\"]\nsecret_env = \"JWT_TEST_SECRET\"\n\
             [[rules]]\nname = \"per-project\"\nkey = [\"jwt:org_id\", \"header:x-project\"]\nrate = \"1/h\"\nburst = 3\n\
             match = {{ path_prefix = \"/api/\" }}\n\
             [[rules]]\nname = \"per-project-or-ip\"\nkey = [\"jwt:org_id\", \"header:x-project\"]\nmissing_key = \"client_ip\"\n\
             rate = \"1/h\"\nburst = 2\nmatch = {{ path_prefix = \"/ip/\" }}\n",
            upstream.url()
        ),
        &[],
        &[("JWT_TEST_SECRET", "combined-secret")],
    );
    let key = SigningKey::secret(b"combined-secret");
    let org = |id: &str| {
        format!(
            "Bearer {}",
            key.sign(
                &serde_json::json!({"sub": "u", "org_id": id, "exp": unix_now() + 600}),
                None
            )
        )
    };
    let client = HttpClient::new();
    let url = gw.url("/api/x");
    let combos = [("acme", "p1"), ("acme", "p2"), ("globex", "p1")];
    // 5 each, at once: exactly 3 of each combination pass.
    let mut tasks = Vec::new();
    for (i, (o, p)) in combos.iter().enumerate() {
        for _ in 0..5 {
            let (client, url, auth, p) = (client.clone(), url.clone(), org(o), p.to_string());
            tasks.push(tokio::spawn(async move {
                let r = client
                    .get(&url, &[("authorization", &auth), ("x-project", &p)])
                    .await;
                (i, r.status)
            }));
        }
    }
    let mut passed = [0usize; 3];
    for t in tasks {
        let (i, status) = t.await.unwrap();
        match status {
            StatusCode::OK => passed[i] += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            other => panic!("{other}: {}", gw.logs()),
        }
    }
    assert_eq!(passed, [3, 3, 3], "{}", gw.logs());
    assert_eq!(upstream.arrived(), 9);
    // The admin API names the identity part by part, as the rule's key writes them.
    assert!(common::wait_for_port(
        gw.admin_port,
        std::time::Duration::from_secs(10)
    ));
    let admin = format!("Bearer {ADMIN_TOKEN}");
    let call = |path: &str| gw.admin_url(path);
    let state = client
        .get(
            &call("/admin/state?rule=per-project&jwt:org_id=acme&header:x-project=p1"),
            &[("authorization", &admin)],
        )
        .await;
    assert_eq!(state.status, StatusCode::OK, "{:?}", state.body);
    assert_eq!(state.json()["remaining"], 0);
    let fresh = client
        .get(
            &call("/admin/state?rule=per-project&jwt:org_id=acme&header:x-project=p3"),
            &[("authorization", &admin)],
        )
        .await;
    assert_eq!(fresh.json()["remaining"], 3);
    let half = client
        .get(
            &call("/admin/state?rule=per-project&jwt:org_id=acme"),
            &[("authorization", &admin)],
        )
        .await;
    assert_eq!(half.status, StatusCode::BAD_REQUEST);
    assert!(String::from_utf8_lossy(&half.body).contains("give header:x-project="));
    let reset = client
        .send(
            "POST",
            &call("/admin/reset?rule=per-project&jwt:org_id=acme&header:x-project=p1"),
            &[("authorization", &admin)],
            bytes::Bytes::new(),
        )
        .await;
    assert_eq!(reset.status, StatusCode::OK, "{:?}", reset.body);
    let again = client
        .get(
            &url,
            &[("authorization", &org("acme")), ("x-project", "p1")],
        )
        .await;
    assert_eq!(again.status, StatusCode::OK, "reset through the admin API");
    assert_eq!(upstream.arrived(), 10);
    // A part missing: 401 (the token's own, or the header's), never forwarded.
    let no_project = client
        .get(&url, &[("authorization", &org("initech"))])
        .await;
    assert_eq!(no_project.status, StatusCode::UNAUTHORIZED);
    let no_token = client.get(&url, &[("x-project", "p9")]).await;
    assert_eq!(no_token.status, StatusCode::UNAUTHORIZED);
    assert_eq!(no_token.header("www-authenticate"), Some("Bearer"));
    assert_eq!(upstream.arrived(), 10);
    // With missing_key = "client_ip", the requests missing a part share their IP's
    // count: 2 pass, whichever part they lack; a whole combination is apart from it.
    let ip_url = gw.url("/ip/x");
    let mut statuses = Vec::new();
    let acme = org("acme");
    for headers in [
        [("x-project", "p1")],
        [("authorization", acme.as_str())],
        [("x-project", "p2")],
    ] {
        statuses.push(client.get(&ip_url, &headers).await.status.as_u16());
    }
    assert_eq!(statuses, [200, 200, 429]);
    let whole = client
        .get(
            &ip_url,
            &[("authorization", &org("acme")), ("x-project", "p1")],
        )
        .await;
    assert_eq!(whole.status, StatusCode::OK);
}
