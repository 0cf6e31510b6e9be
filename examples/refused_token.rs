//! What a rejected bearer token costs the request path, on one thread: the time from a
//! request's headers to its refusal (`Requester::token`, as the gateway calls it), for
//! RS256 tokens signed by a key the gateway does not trust (RSA 2048):
//!
//! - checked: every token new, no allowance spent (`[jwt] failures` out of reach): a
//!   signature check each — what every forged token cost before issue 42;
//! - remembered: one forged token again and again (the refused-token cache);
//! - throttled: every token new, from an address past its allowance (429 unchecked);
//! - no token: the same request path without one (what any refusal costs at least).
//!
//! Each case runs `SECONDS` (default 2; "checked" runs its 2,000 tokens once), three
//! rounds; the median of the rounds is shown with each round, in µs per token.
//!
//!     cargo run --release --example refused_token [SECONDS]

use std::net::IpAddr;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderName, HeaderValue};
use jsonwebtoken::{encode, EncodingKey, Header};
use ratewall::identity::failures::Allowance;
use ratewall::identity::jwt::{Alg, KeySet, KeysFrom, Settings, TokenFrom, Verifier};
use ratewall::identity::{ClientIp, Keys, Requester, UnknownKeys, DEFAULT_KEY_HEADER};

const TOKENS: usize = 2000;

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn fail(message: &str) -> ! {
    eprintln!("refused_token: {message}");
    std::process::exit(1)
}

/// A 2048-bit RSA key pair by `openssl genpkey`: (private PEM, public PEM).
fn rsa_pair(dir: &std::path::Path, name: &str) -> (Vec<u8>, Vec<u8>) {
    let private = dir.join(format!("{name}.pem"));
    let path = private.to_str().unwrap_or_else(|| fail("temporary path"));
    let run = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .output()
            .unwrap_or_else(|e| fail(&format!("openssl: {e}")));
        if !out.status.success() {
            fail(&format!("openssl {args:?}"));
        }
        out.stdout
    };
    run(&[
        "genpkey",
        "-algorithm",
        "RSA",
        "-pkeyopt",
        "rsa_keygen_bits:2048",
        "-out",
        path,
    ]);
    let public = run(&["pkey", "-in", path, "-pubout"]);
    let private = std::fs::read(&private).unwrap_or_else(|e| fail(&format!("{name}: {e}")));
    (private, public)
}

fn verifier(public: &[u8], failures: Allowance) -> Verifier {
    let keys = KeySet::from_pems(&[("trusted.pem".to_string(), public.to_vec())])
        .unwrap_or_else(|e| fail(&format!("the trusted key: {e}")));
    let settings = Settings {
        from: TokenFrom::Bearer(HeaderName::from_static("authorization")),
        algorithms: vec![Alg::RS256],
        keys_from: KeysFrom::Pems(vec!["trusted.pem".into()]),
        issuer: Vec::new(),
        audience: Vec::new(),
        leeway: 30,
        required_claims: Vec::new(),
        plan_claim: None,
        forward_claims: Vec::new(),
        failures,
    };
    Verifier::new(settings, Some(keys))
}

/// µs per call of `one(i)`, for `secs`.
fn per_call(secs: Duration, mut one: impl FnMut(usize)) -> f64 {
    let started = Instant::now();
    let mut n = 0usize;
    while started.elapsed() < secs {
        for _ in 0..100 {
            one(n);
            n += 1;
        }
    }
    started.elapsed().as_secs_f64() * 1e6 / n as f64
}

fn main() {
    let secs: u64 = std::env::args()
        .nth(1)
        .map(|s| s.parse().unwrap_or_else(|_| fail("SECONDS: a number")))
        .unwrap_or(2);
    let secs = Duration::from_secs(secs);
    let dir = std::env::temp_dir().join(format!("ratewall-refused-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| fail(&format!("{e}")));
    let (_, trusted) = rsa_pair(&dir, "trusted");
    let (forger, _) = rsa_pair(&dir, "forger");
    let _ = std::fs::remove_dir_all(&dir);
    let forger = EncodingKey::from_rsa_pem(&forger).unwrap_or_else(|e| fail(&format!("{e}")));
    let header = Header::new(jsonwebtoken::Algorithm::RS256);
    let exp = now() + 3600;
    let requests: Vec<HeaderMap> = (0..TOKENS)
        .map(|i| {
            let claims = serde_json::json!({"sub": format!("user-{i}"), "exp": exp});
            let t = encode(&header, &claims, &forger).unwrap_or_else(|e| fail(&format!("{e}")));
            let mut h = HeaderMap::new();
            let v = HeaderValue::from_str(&format!("Bearer {t}"))
                .unwrap_or_else(|e| fail(&format!("{e}")));
            h.insert(http::header::AUTHORIZATION, v);
            h
        })
        .collect();
    let keys = Keys::new(
        DEFAULT_KEY_HEADER,
        UnknownKeys::Allow,
        Default::default(),
        None,
    );
    let trust = ClientIp::default();
    let peer: IpAddr = "198.51.100.7".parse().unwrap_or_else(|_| fail("address"));
    let open = Allowance {
        burst: u64::MAX / 2,
        every_ms: 1,
    };
    let tight = Allowance {
        burst: 1,
        every_ms: 3_600_000,
    };
    let refuse = |v: &Verifier, h: &HeaderMap| {
        let r = Requester::new(h, peer, &keys, &trust)
            .with_jwt(Some(v))
            .counting_failures();
        if r.token().is_ok() {
            fail("a forged token was accepted");
        }
    };
    let empty = HeaderMap::new();
    let mut rows: Vec<(&str, Vec<f64>)> = Vec::new();
    for _ in 0..3 {
        // Checked: a fresh verifier each round, so no token is remembered yet; TOKENS
        // distinct tokens, each checked once (the cache would answer the second time).
        let checked = verifier(&trusted, open);
        let started = Instant::now();
        for h in &requests {
            refuse(&checked, h);
        }
        let t = started.elapsed().as_secs_f64() * 1e6 / TOKENS as f64;
        let remembered = verifier(&trusted, open);
        refuse(&remembered, &requests[0]);
        let r = per_call(secs, |_| refuse(&remembered, &requests[0]));
        let throttled = verifier(&trusted, tight);
        refuse(&throttled, &requests[0]);
        let th = per_call(secs, |i| {
            refuse(&throttled, &requests[1 + i % (TOKENS - 1)])
        });
        let none = verifier(&trusted, open);
        let n = per_call(secs, |_| {
            let r = Requester::new(&empty, peer, &keys, &trust)
                .with_jwt(Some(&none))
                .counting_failures();
            if !matches!(r.token(), Ok(None)) {
                fail("a token where none was sent");
            }
        });
        for (name, x) in [
            ("checked (every token new)", t),
            ("remembered (one token again)", r),
            ("throttled (past the allowance)", th),
            ("no token", n),
        ] {
            match rows.iter_mut().find(|(n, _)| *n == name) {
                Some((_, v)) => v.push(x),
                None => rows.push((name, vec![x])),
            }
        }
    }
    println!(
        "µs per rejected RS256 token (RSA 2048), one thread, {} s a case, 3 rounds",
        secs.as_secs()
    );
    println!("{:34}{:>10}{:>22}", "", "median", "rounds");
    for (name, mut v) in rows {
        v.sort_by(f64::total_cmp);
        let rounds: Vec<String> = v.iter().map(|x| format!("{x:.3}")).collect();
        println!("{name:34}{:>10.3}{:>22}", v[1], rounds.join(" "));
    }
}
