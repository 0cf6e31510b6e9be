//! Tags give nothing back (issue 42, item 6): the tag an identity is shown by — the status
//! page's `/status.json`, the access line, the admin API, `ratewall check` — is keyed by a
//! deployment secret, so no address is found again by hashing them all, and it is the
//! same on every gateway of a deployment: the configured secret, the shared store's (made
//! once), or the one a gateway on the memory store keeps beside its keys file.

use crate::common;

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use common::{Gateway, HttpClient, RedisServer, Upstream};
use ratewall::identity::digest_ip;
use ratewall::identity::tag::TagKey;

const TOKEN: &str = "tags-admin-token-0123456789";

/// A config whose one rule limits each client address to one request an hour, with the
/// admin token, the keys file `keys` (absolute), `store` and `extra` ([server] keys).
fn config(upstream: &Upstream, keys: &Path, store: &str) -> String {
    format!(
        "[admin]\ntoken = \"{TOKEN}\"\n\
         [upstream]\nurl = \"{}\"\n{store}\
         [keys]\nfile = \"{}\"\n\
         [[rules]]\nname = \"per-ip\"\nkey = \"client_ip\"\nrate = \"1/h\"\nburst = 1\n\
         [[rules]]\nname = \"per-tenant\"\nkey = \"header:x-tenant\"\nrate = \"1000/h\"\n\
         match = {{ path_prefix = \"/t/\" }}\n",
        upstream.url(),
        common::toml_path(keys)
    )
}

fn keys_file(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("keys.toml");
    std::fs::write(&path, "[plans]\n").expect("keys file");
    path
}

/// What this gateway shows 127.0.0.1 by under `per-ip`, once denied: the tag of
/// `/status.json`'s top, `/admin/state`'s identity (and digest), the access line's id.
struct Shown {
    public: String,
    state: String,
    digest: String,
}

async fn shown(gw: &Gateway) -> Shown {
    let client = HttpClient::new();
    let statuses = [
        client.get(&gw.url("/x"), &[]).await.status.as_u16(),
        client.get(&gw.url("/x"), &[]).await.status.as_u16(),
    ];
    // (On a shared store another gateway may have taken the one request already.)
    assert_eq!(statuses[1], 429, "{}", gw.logs());
    let end = Instant::now() + common::WAIT;
    let public = loop {
        let stats = client.get(&gw.admin_url("/status.json"), &[]).await.json();
        let tag = stats["top"][0]["id"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if (!tag.is_empty() && tag != "--------") || Instant::now() > end {
            break tag;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    let auth = format!("Bearer {TOKEN}");
    let state = client
        .get(
            &gw.admin_url("/admin/state?rule=per-ip&ip=127.0.0.1"),
            &[("authorization", auth.as_str())],
        )
        .await
        .json();
    Shown {
        public,
        state: state["identity"].as_str().expect("identity").to_string(),
        digest: state["digest"].as_str().expect("digest").to_string(),
    }
}

/// The memory store: the tag is the keyed one, the same on the page, the admin API and
/// the access line, not the digest's first digits; the secret is kept beside the keys
/// file (0600) and a second gateway using that file shows the same tag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tag_is_keyed_by_the_secret_kept_beside_the_keys_file() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let keys = keys_file(dir.path());
    let body = config(&upstream, &keys, "[store]\nbackend = \"memory\"\n");
    let gw = Gateway::start_with(&body, &["--log-format", "json"], &[]);
    let s = shown(&gw).await;
    let digest = digest_ip("127.0.0.1".parse().expect("ip"));
    assert_eq!(s.digest, digest.hex(), "the digest names the Redis keys");
    // Before issue 42 the tag was the digest's first 8 digits: one hash per address
    // found it again.
    assert_ne!(
        s.public,
        &s.digest[..8],
        "the tag is not the digest's start"
    );
    assert_eq!(s.public, s.state, "the page and the admin API agree");
    let secret_path = dir.path().join(".ratewall-tag-secret");
    let secret = std::fs::read_to_string(&secret_path).expect("the secret is kept");
    let key = TagKey::from_secret(secret.trim().as_bytes());
    assert_eq!(
        s.public,
        key.tag(&digest).as_str(),
        "keyed by the kept secret"
    );
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&secret_path)
            .expect("meta")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "the secret is its owner's only");
    }
    assert!(
        gw.wait_for_log(&format!("\"id\":\"{}\"", s.public), 1, common::WAIT),
        "the access line shows the tag:\n{}",
        gw.logs()
    );
    assert!(!gw
        .logs()
        .contains(&format!("\"id\":\"{}\"", &s.digest[..8])));
    drop(gw);

    // Another gateway on the same keys file (a restart): the same tag.
    let again = Gateway::start(&body);
    assert_eq!(
        shown(&again).await.public,
        s.public,
        "the same after a restart"
    );

    // `ratewall check` shows an identity by the same keyed tag.
    let cfg = dir.path().join("limits.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nlisten = \"127.0.0.1:1\"\n{}",
            config(&upstream, &keys, "")
        ),
    )
    .expect("config");
    let out = Command::new(common::binary())
        .args(["check", "--config"])
        .arg(&cfg)
        .args(["--path", "/t/x", "--header", "x-tenant: acme"])
        .output()
        .expect("check");
    let text = String::from_utf8_lossy(&out.stdout);
    let tenant =
        ratewall::identity::digest_header(&http::HeaderName::from_static("x-tenant"), b"acme");
    assert!(
        text.contains(&format!("(identity {})", key.tag(&tenant).as_str())),
        "{text}"
    );
    assert!(!text.contains(&tenant.hex()[..8]), "{text}");
}

/// `RATEWALL_TAG_SECRET`: every gateway given it shows the tags it keys, whatever the
/// folder; another secret, other tags.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_configured_secret_keys_every_gateway_alike() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let digest = digest_ip("127.0.0.1".parse().expect("ip"));
    let mut tags = Vec::new();
    for secret in [
        "one-deployment-secret-0001",
        "one-deployment-secret-0001",
        "another-secret-000000002",
    ] {
        let dir = tempfile::tempdir().expect("temp dir");
        let body = config(
            &upstream,
            &keys_file(dir.path()),
            "[store]\nbackend = \"memory\"\n",
        );
        let gw = Gateway::start_with(&body, &[], &[("RATEWALL_TAG_SECRET", secret)]);
        let s = shown(&gw).await;
        assert_eq!(
            s.public,
            TagKey::from_secret(secret.as_bytes()).tag(&digest).as_str()
        );
        assert!(
            !dir.path().join(".ratewall-tag-secret").exists(),
            "nothing kept"
        );
        tags.push(s.public);
    }
    assert_eq!(tags[0], tags[1]);
    assert_ne!(tags[0], tags[2]);
}

/// Redis: the first gateway makes the secret (`<prefix>:tag-secret`), the others read it:
/// two gateways show the same tag. A key of the wrong type there is an error logged, tags
/// read `--------`, and requests are served as ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_on_one_redis_share_the_stores_secret() {
    let _watch = common::watchdog();
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let store = format!(
        "[store]\nbackend = \"redis\"\nurl = \"{}\"\nprefix = \"tagtest\"\n",
        redis.url()
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let body = config(&upstream, &keys_file(dir.path()), &store);
    let a = Gateway::start(&body);
    let b = Gateway::start(&body);
    let (sa, sb) = (shown(&a).await, shown(&b).await);
    assert_eq!(sa.public, sb.public, "one tag on both gateways");
    let secret: String = redis::cmd("GET")
        .arg("tagtest:tag-secret")
        .query(&mut redis.conn())
        .expect("the store keeps the secret");
    assert_eq!(secret.len(), 64);
    let digest = digest_ip("127.0.0.1".parse().expect("ip"));
    assert_eq!(
        sa.public,
        TagKey::from_secret(secret.as_bytes()).tag(&digest).as_str()
    );
    assert_ne!(sa.public, &sa.digest[..8]);
    assert!(
        !dir.path().join(".ratewall-tag-secret").exists(),
        "nothing kept on disk"
    );
    drop((a, b));

    // A list where the secret goes: logged, never a crash; requests still limited.
    let _: () = redis::cmd("FLUSHALL")
        .query(&mut redis.conn())
        .expect("flush");
    let _: () = redis::cmd("RPUSH")
        .arg("tagtest:tag-secret")
        .arg("x")
        .query(&mut redis.conn())
        .expect("rpush");
    let c = Gateway::start(&body);
    let client = HttpClient::new();
    assert_eq!(client.get(&c.url("/x"), &[]).await.status.as_u16(), 200);
    assert_eq!(client.get(&c.url("/x"), &[]).await.status.as_u16(), 429);
    assert!(
        c.wait_for_log("tag secret", 1, common::WAIT),
        "the wrong type is logged:\n{}",
        c.logs()
    );
    let stats = client.get(&c.admin_url("/status.json"), &[]).await.json();
    assert_eq!(stats["top"][0]["id"], "--------", "{stats}");
}
