//! The verifier: what it accepts and refuses, its cache (a hit, an expiry on the
//! injected clock, emptied on a new key set), and claim paths.

use super::*;
use std::sync::atomic::AtomicU64;

fn settings(algorithms: Vec<Alg>) -> Settings {
    Settings {
        from: TokenFrom::Bearer(http::header::AUTHORIZATION),
        algorithms,
        keys_from: KeysFrom::SecretEnv("X".into()),
        issuer: vec!["iss-a".into()],
        audience: vec!["api".into()],
        leeway: 30,
        required_claims: vec![ClaimPath::parse("sub").unwrap()],
        plan_claim: None,
        forward_claims: Vec::new(),
        failures: DEFAULT_FAILURES,
    }
}

fn sign(secret: &[u8], claims: serde_json::Value) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &claims,
        &jsonwebtoken::EncodingKey::from_secret(secret),
    )
    .unwrap()
}

static NOW_A: AtomicU64 = AtomicU64::new(1_000_000);
fn now_a() -> u64 {
    NOW_A.load(Ordering::Relaxed)
}

#[test]
fn tokens_are_verified_then_served_from_the_cache_until_they_expire() {
    let v = Verifier::with_clock(
        settings(vec![Alg::HS256]),
        Some(KeySet::from_secret(b"k1")),
        now_a,
        100,
    );
    let exp = 1_000_100;
    let good = sign(
        b"k1",
        serde_json::json!({"sub": "alice", "iss": "iss-a", "aud": ["x", "api"], "exp": exp}),
    );
    let id = v.verify(&good).expect("verified");
    assert_eq!(id.claims["sub"], "alice");
    assert_eq!(v.cached(), 1);
    // A hit: the same value, not verified again.
    assert!(Arc::ptr_eq(&id, &v.verify(&good).unwrap()));
    // Within the leeway it still passes; past it, the cached entry is dropped and the
    // full check says expired.
    NOW_A.store(exp + 29, Ordering::Relaxed);
    assert!(v.verify(&good).is_ok());
    NOW_A.store(exp + 30, Ordering::Relaxed);
    assert_eq!(
        v.verify(&good).unwrap_err(),
        Failure::Invalid(TokenError::Expired)
    );
    assert_eq!(v.cached(), 0);
}

static NOW_B: AtomicU64 = AtomicU64::new(1_000_000);
fn now_b() -> u64 {
    NOW_B.load(Ordering::Relaxed)
}

#[test]
fn a_new_key_set_empties_the_cache_and_stops_the_old_keys_tokens() {
    let v = Verifier::with_clock(
        settings(vec![Alg::HS256]),
        Some(KeySet::from_secret(b"k1")),
        now_b,
        100,
    );
    let t = sign(
        b"k1",
        serde_json::json!({"sub": "a", "iss": "iss-a", "aud": "api", "exp": 2_000_000}),
    );
    assert!(v.verify(&t).is_ok());
    assert!(!v.set_keys(KeySet::from_secret(b"k1")), "the same set");
    assert_eq!(v.cached(), 1);
    assert!(v.set_keys(KeySet::from_secret(b"k2")));
    assert_eq!(v.cached(), 0);
    assert_eq!(
        v.verify(&t).unwrap_err(),
        Failure::Invalid(TokenError::BadSignature)
    );
}

#[test]
fn each_invalid_class_has_its_reason() {
    let v = Verifier::with_clock(
        settings(vec![Alg::HS256]),
        Some(KeySet::from_secret(b"k")),
        now_b,
        100,
    );
    let now = now_b();
    let base = serde_json::json!({"sub": "a", "iss": "iss-a", "aud": "api", "exp": now + 100});
    let with = |k: &str, val: serde_json::Value| {
        let mut c = base.clone();
        c[k] = val;
        c
    };
    let err = |t: &str| match v.verify(t) {
        Err(Failure::Invalid(e)) => e,
        other => panic!("{t}: {other:?}"),
    };
    assert_eq!(err(&sign(b"other", base.clone())), TokenError::BadSignature);
    assert_eq!(
        err(&sign(b"k", with("exp", (now - 31).into()))),
        TokenError::Expired
    );
    assert_eq!(
        err(&sign(b"k", with("nbf", (now + 31).into()))),
        TokenError::NotYetValid
    );
    assert_eq!(
        err(&sign(b"k", with("iss", "x".into()))),
        TokenError::WrongIssuer
    );
    assert_eq!(
        err(&sign(b"k", with("aud", "x".into()))),
        TokenError::WrongAudience
    );
    assert_eq!(
        err(&sign(b"k", with("sub", serde_json::Value::Null))),
        TokenError::MissingClaim
    );
    let mut no_exp = base.clone();
    no_exp.as_object_mut().unwrap().remove("exp");
    assert_eq!(err(&sign(b"k", no_exp)), TokenError::NoExpiry);
    assert_eq!(err("not.a.token"), TokenError::Malformed);
    assert_eq!(err(&"a".repeat(MAX_TOKEN_BYTES + 1)), TokenError::TooLong);
    // alg none: never allowed.
    let b64 = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
    let none = format!("{}.{}.", b64(r#"{"alg":"none"}"#), b64(&base.to_string()));
    assert_eq!(err(&none), TokenError::AlgorithmNotAllowed);
    // No key set yet: unavailable, never accepted.
    let empty = Verifier::with_clock(settings(vec![Alg::HS256]), None, now_b, 10);
    assert_eq!(
        empty.verify(&sign(b"k", base)).unwrap_err(),
        Failure::Unavailable
    );
}

#[test]
fn claim_paths_reach_nested_claims_and_only_scalars_are_values() {
    let claims = serde_json::json!({
        "sub": "alice", "n": 42, "b": true, "org": {"id": "acme", "tags": ["x"]}, "z": null
    });
    let claims = claims.as_object().unwrap();
    let text = |p: &str| {
        ClaimPath::parse(p)
            .unwrap()
            .text(claims)
            .map(|c| c.into_owned())
    };
    assert_eq!(text("sub").as_deref(), Some("alice"));
    assert_eq!(text("n").as_deref(), Some("42"));
    assert_eq!(text("b").as_deref(), Some("true"));
    assert_eq!(text("org.id").as_deref(), Some("acme"));
    assert_eq!(text("org"), None);
    assert_eq!(text("org.tags"), None);
    assert_eq!(text("z"), None);
    assert_eq!(text("missing.x"), None);
    assert!(ClaimPath::parse("a..b").is_err());
    assert!(ClaimPath::parse("").is_err());
}

/// `claims` signed with HS256 under a header of the test's making.
fn sign_with_header(
    secret: &[u8],
    header: &serde_json::Value,
    claims: &serde_json::Value,
) -> String {
    let b64 = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
    let message = format!("{}.{}", b64(&header.to_string()), b64(&claims.to_string()));
    let sig = jsonwebtoken::crypto::sign(
        message.as_bytes(),
        &jsonwebtoken::EncodingKey::from_secret(secret),
        jsonwebtoken::Algorithm::HS256,
    )
    .unwrap();
    format!("{message}.{sig}")
}

#[test]
fn a_critical_extension_or_an_unencoded_payload_is_refused_and_never_cached() {
    let v = Verifier::with_clock(
        settings(vec![Alg::HS256]),
        Some(KeySet::from_secret(b"k")),
        now_b,
        100,
    );
    let claims =
        serde_json::json!({"sub": "a", "iss": "iss-a", "aud": "api", "exp": now_b() + 100});
    let token = |extra: serde_json::Value| {
        let mut h = serde_json::json!({"alg": "HS256"});
        for (k, val) in extra.as_object().unwrap() {
            h[k] = val.clone();
        }
        sign_with_header(b"k", &h, &claims)
    };
    use serde_json::json;
    for (extra, want) in [
        (json!({"crit": ["ext"], "ext": 1}), TokenError::Critical),
        (json!({"crit": ["ext"]}), TokenError::Critical),
        (json!({"crit": ["b64"], "b64": true}), TokenError::Critical),
        (json!({"crit": ["alg"]}), TokenError::BadCritical),
        (
            json!({"crit": ["ext", "x5t#S256"]}),
            TokenError::BadCritical,
        ),
        (json!({"crit": []}), TokenError::BadCritical),
        (json!({"crit": "ext"}), TokenError::BadCritical),
        (json!({"crit": [1]}), TokenError::BadCritical),
        (json!({"crit": null}), TokenError::BadCritical),
        (json!({"crit": {}}), TokenError::BadCritical),
        (json!({"b64": false}), TokenError::UnencodedPayload),
        (
            json!({"b64": false, "crit": ["b64"]}),
            TokenError::UnencodedPayload,
        ),
        (json!({"b64": "false"}), TokenError::Malformed),
        (json!({"b64": null}), TokenError::Malformed),
    ] {
        let t = token(extra.clone());
        for _ in 0..2 {
            assert_eq!(v.verify(&t).unwrap_err(), Failure::Invalid(want), "{extra}");
        }
    }
    assert_eq!(v.cached(), 0, "no refused token is remembered");
    // The same header without them verifies (and is remembered), `b64: true` too.
    assert!(v.verify(&token(json!({}))).is_ok());
    assert!(v.verify(&token(json!({"b64": true}))).is_ok());
    assert_eq!(v.cached(), 2);
    // A header member named twice: malformed, as a JSON object with duplicate names is.
    let b64 = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
    let twice = format!(
        "{}.{}.x",
        b64(r#"{"alg":"HS256","crit":["e"],"crit":null}"#),
        b64(&claims.to_string())
    );
    assert_eq!(
        v.verify(&twice).unwrap_err(),
        Failure::Invalid(TokenError::Malformed)
    );
}

#[test]
fn the_token_is_read_once_and_its_header_or_cookie_twice_is_refused() {
    let bearer = Verifier::with_clock(settings(vec![Alg::HS256]), None, now_b, 10);
    let mut s = settings(vec![Alg::HS256]);
    s.from = TokenFrom::Cookie("session".into());
    let cookie = Verifier::with_clock(s, None, now_b, 10);
    let headers = |name: &str, values: &[&[u8]]| {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_bytes(v).unwrap(),
            );
        }
        h
    };
    let auth = |values: &[&[u8]]| {
        let h = headers("authorization", values);
        bearer.token_of(&h).map(|t| t.map(str::to_string))
    };
    assert_eq!(auth(&[]), Ok(None));
    assert_eq!(auth(&[b"Bearer t"]), Ok(Some("t".to_string())));
    assert_eq!(auth(&[b"bearer  t "]), Ok(Some("t".to_string())));
    assert_eq!(auth(&[b"Basic dTpw"]), Ok(None));
    assert_eq!(auth(&[b"Bearer "]), Ok(None));
    for twice in [
        &[&b"Bearer a"[..], b"Bearer b"][..],
        &[b"Bearer a", b"Bearer a"],
        &[b"Basic dTpw", b"Bearer a"],
        &[b"Bearer a", b""],
    ] {
        assert_eq!(auth(twice), Err(TokenError::Repeated), "{twice:?}");
    }
    let jar = |values: &[&[u8]]| {
        let h = headers("cookie", values);
        cookie.token_of(&h).map(|t| t.map(str::to_string))
    };
    assert_eq!(jar(&[]), Ok(None));
    assert_eq!(jar(&[b"session=t"]), Ok(Some("t".to_string())));
    assert_eq!(
        jar(&[b"a=1; session=\"t\"; b=2"]),
        Ok(Some("t".to_string()))
    );
    assert_eq!(
        jar(&[b"a=1", b"session=t"]),
        Ok(Some("t".to_string())),
        "HTTP/2 crumbs"
    );
    assert_eq!(jar(&[b"Session=t; sessions=u; xsession=v"]), Ok(None));
    assert_eq!(jar(&[b"session="]), Ok(None));
    assert_eq!(jar(&[b"session"]), Ok(None));
    assert_eq!(jar(&[b"session=a=b"]), Ok(Some("a=b".to_string())));
    for twice in [
        &[&b"session=a; session=b"[..]][..],
        &[b"session=a; session=a"],
        &[b"session=a", b"session=b"],
        &[b"session=a; session="],
        &[b"session=; session=a"],
        &[b"session=a; session"],
        &[b"session=a;  session =b"],
        &[b"x=\xff; session=a", b"session=b"],
    ] {
        assert_eq!(jar(twice), Err(TokenError::Repeated), "{twice:?}");
    }
    assert_eq!(jar(&[b"session=\xff"]), Err(TokenError::Malformed));
}

static NOW_C: AtomicU64 = AtomicU64::new(1_000_000);
fn now_c() -> u64 {
    NOW_C.load(Ordering::Relaxed)
}

/// A refused token is refused again from the cache, without a signature check, for
/// `REFUSED_FOR`; one not valid yet is never remembered (it may become valid); a new
/// key set forgets them all. Bounded like the accepted ones.
#[test]
fn refused_tokens_are_remembered_a_while_and_known_without_a_check() {
    let v = Verifier::with_clock(
        settings(vec![Alg::HS256]),
        Some(KeySet::from_secret(b"k")),
        now_c,
        100,
    );
    let now = now_c();
    let claims = serde_json::json!({"sub": "a", "iss": "iss-a", "aud": "api", "exp": now + 1000});
    let forged = sign(b"not-k", claims.clone());
    let hash = digest(&forged);
    assert!(matches!(v.known(&forged, &hash), Ok(Known::Unknown)));
    assert_eq!(
        v.verify(&forged).unwrap_err(),
        Failure::Invalid(TokenError::BadSignature)
    );
    assert_eq!(v.refused(), 1);
    assert!(matches!(
        v.known(&forged, &hash),
        Ok(Known::Refused(TokenError::BadSignature))
    ));
    NOW_C.store(now + REFUSED_FOR.as_secs() - 1, Ordering::Relaxed);
    assert!(matches!(v.known(&forged, &hash), Ok(Known::Refused(_))));
    NOW_C.store(now + REFUSED_FOR.as_secs(), Ordering::Relaxed);
    assert!(
        matches!(v.known(&forged, &hash), Ok(Known::Unknown)),
        "forgotten after REFUSED_FOR"
    );
    // Not valid yet: checked again every time.
    let now = now_c();
    let mut later = claims.clone();
    later["nbf"] = (now + 100).into();
    let later = sign(b"k", later);
    assert_eq!(
        v.verify(&later).unwrap_err(),
        Failure::Invalid(TokenError::NotYetValid)
    );
    assert!(matches!(
        v.known(&later, &digest(&later)),
        Ok(Known::Unknown)
    ));
    // A new key set forgets what the old one refused.
    assert!(v.verify(&forged).is_err());
    assert!(v.refused() >= 1);
    assert!(v.set_keys(KeySet::from_secret(b"not-k")));
    assert_eq!(v.refused(), 0);
    assert!(v.verify(&forged).is_ok(), "the new set signs it");
    // Bounded: a flood of distinct forgeries keeps at most REFUSED_ENTRIES (per shard,
    // rounded up).
    for i in 0..(REFUSED_ENTRIES + 2_000) {
        let mut c = claims.clone();
        c["sub"] = format!("s{i}").into();
        let _ = v.verify(&sign(b"k", c));
    }
    assert!(v.refused() <= REFUSED_ENTRIES + 16, "{}", v.refused());
}
