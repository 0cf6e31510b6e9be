//! A request's failed credentials, as the request path counts them
//! ([`Requester::counting_failures`]): a token that does not verify or an unknown key is
//! one failure of the client's address; past the allowance, the address's credentials
//! are refused with 429 unchecked.

use std::collections::HashMap;

use http::header::{HeaderMap, HeaderValue, AUTHORIZATION};

use super::failures::Allowance;
use super::jwt::{KeySet, Settings};
use super::*;

const BURST: u64 = 5;

/// [`super::tests::hs256_settings`]' verifier, allowing `BURST` failures a minute.
fn verifier() -> Verifier {
    let settings = Settings {
        failures: Allowance {
            burst: BURST,
            every_ms: 60_000,
        },
        ..super::tests::hs256_settings(None)
    };
    Verifier::new(settings, Some(KeySet::from_secret(b"s")))
}

fn bearer(secret: &[u8], sub: &str) -> HeaderMap {
    let t = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &serde_json::json!({"sub": sub, "exp": 4_000_000_000u64}),
        &jsonwebtoken::EncodingKey::from_secret(secret),
    )
    .unwrap();
    let mut h = HeaderMap::new();
    h.insert(
        AUTHORIZATION,
        HeaderValue::from_str(&format!("Bearer {t}")).unwrap(),
    );
    h
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn keys(unknown: UnknownKeys) -> Keys {
    let listed = HashMap::from([(sha256(b"good-key-000001"), "pro".to_string())]);
    Keys::new(DEFAULT_KEY_HEADER, unknown, listed, None).with_failures(Allowance {
        burst: BURST,
        every_ms: 60_000,
    })
}

/// Forged tokens from one address: `BURST` are checked and refused 401, the next are
/// refused 429 without a check (the refused-token cache does not grow); another address
/// is not slowed; a token verified before still passes from the throttled address, a new
/// one does not.
#[test]
fn forged_tokens_are_checked_up_to_the_allowance_then_refused_unchecked() {
    let v = verifier();
    let keys = keys(UnknownKeys::Allow);
    let trust = ClientIp::default();
    let token_of = |h: &HeaderMap, from: &str| {
        Requester::new(h, ip(from), &keys, &trust)
            .with_jwt(Some(&v))
            .counting_failures()
            .token()
            .map(|t| t.is_some())
    };
    let good = bearer(b"s", "alice");
    assert_eq!(
        token_of(&good, "192.0.2.1"),
        Ok(true),
        "verified and cached"
    );
    let mut answers = Vec::new();
    for i in 0..3 * BURST {
        let forged = bearer(b"guess", &format!("s{i}"));
        answers.push(match token_of(&forged, "192.0.2.1") {
            Err(Refusal::InvalidToken(TokenError::BadSignature)) => 401,
            Err(Refusal::Throttled(ms)) if ms > 0 => 429,
            other => panic!("{other:?}"),
        });
    }
    assert_eq!(
        answers.iter().filter(|&&a| a == 401).count() as u64,
        BURST,
        "{answers:?}"
    );
    assert!(answers[BURST as usize..].iter().all(|&a| a == 429));
    assert_eq!(v.refused(), BURST as usize, "no signature checked past it");
    // The same forgery again: known refused, and still throttled.
    let first = bearer(b"guess", "s0");
    assert!(matches!(
        token_of(&first, "192.0.2.1"),
        Err(Refusal::Throttled(_))
    ));
    // A token verified before passes; a new good one waits like the forger's.
    assert_eq!(token_of(&good, "192.0.2.1"), Ok(true));
    assert!(matches!(
        token_of(&bearer(b"s", "bob"), "192.0.2.1"),
        Err(Refusal::Throttled(_))
    ));
    // Another address is not slowed, and a good token's check costs it nothing.
    for _ in 0..3 * BURST {
        assert_eq!(token_of(&bearer(b"s", "carol"), "192.0.2.2"), Ok(true));
    }
    assert!(matches!(
        token_of(&bearer(b"guess", "x"), "192.0.2.2"),
        Err(Refusal::InvalidToken(_))
    ));
    // Without counting (check, the admin API), nothing is throttled.
    let plain = Requester::new(&first, ip("192.0.2.1"), &keys, &trust).with_jwt(Some(&v));
    assert!(matches!(plain.token(), Err(Refusal::InvalidToken(_))));
}

/// Unknown keys from one address: `BURST` get 401, then every key from it — a listed one
/// too, which would tell a guesser it guessed right — gets 429 unlooked-up, whatever rule
/// or condition reads it; one request is one failure however many rules ask; another
/// address is not slowed.
#[test]
fn unknown_keys_are_refused_up_to_the_allowance_then_every_key_waits() {
    let keys = keys(UnknownKeys::Reject);
    let trust = ClientIp::default();
    let by_key = Key {
        kind: KeyKind::ApiKey,
        missing: MissingKey::Reject,
    };
    let with_key = |key: &str| {
        let mut h = HeaderMap::new();
        h.insert(DEFAULT_KEY_HEADER, HeaderValue::from_str(key).unwrap());
        h
    };
    let mut answers = Vec::new();
    for i in 0..2 * BURST {
        let h = with_key(&format!("guess-{i:08}"));
        let r = Requester::new(&h, ip("198.51.100.3"), &keys, &trust).counting_failures();
        // Two rules and a condition read it: one failure.
        let a = r.identify(&by_key).map(|_| ());
        assert_eq!(r.identify(&by_key).map(|_| ()), a);
        assert_eq!(r.carries(&Carried::ApiKey).map(|_| ()), a);
        answers.push(match a {
            Err(Refusal::UnknownKey) => 401,
            Err(Refusal::Throttled(_)) => 429,
            other => panic!("{other:?}"),
        });
    }
    assert_eq!(answers[..BURST as usize], [401; BURST as usize]);
    assert!(answers[BURST as usize..].iter().all(|&a| a == 429));
    let good = with_key("good-key-000001");
    let from = |addr| Requester::new(&good, ip(addr), &keys, &trust).counting_failures();
    assert!(matches!(
        from("198.51.100.3").identify(&by_key),
        Err(Refusal::Throttled(_))
    ));
    assert!(from("198.51.100.4").identify(&by_key).is_ok());
    // Under unknown = "allow" nothing fails, and nothing is counted.
    let open = self::keys(UnknownKeys::Allow);
    for i in 0..3 * BURST {
        let h = with_key(&format!("any-{i:08}"));
        let r = Requester::new(&h, ip("198.51.100.5"), &open, &trust).counting_failures();
        assert!(r.identify(&by_key).is_ok());
    }
    assert!(open.failures.is_empty());
}

/// A token a cache knows needs no signature check; one no cache knows does: only then
/// does the gateway decide the rules that need no credential first.
#[test]
fn a_token_is_pending_only_while_no_cache_knows_it() {
    let v = verifier();
    let keys = keys(UnknownKeys::Allow);
    let trust = ClientIp::default();
    let at = |h| Requester::new(h, ip("203.0.113.9"), &keys, &trust).with_jwt(Some(&v));
    let good = bearer(b"s", "alice");
    assert!(at(&good).token_pending());
    assert!(at(&good).token().is_ok());
    assert!(!at(&good).token_pending(), "cached");
    let forged = bearer(b"x", "alice");
    assert!(at(&forged).token_pending());
    assert!(at(&forged).token().is_err());
    assert!(!at(&forged).token_pending(), "remembered as refused");
    let none = HeaderMap::new();
    assert!(!at(&none).token_pending(), "none sent");
    let dave = bearer(b"s", "dave");
    let r = at(&dave);
    let _ = r.token();
    assert!(!r.token_pending(), "verified for this request already");
}
