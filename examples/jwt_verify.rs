//! Cache-miss JWT verifications per second on one thread, for RS256 (RSA 2048), ES256
//! (P-256) and EdDSA (Ed25519): ratewall's own verifier (`identity::jwt::Verifier`: the
//! token's parts, its header, the key by algorithm, the signature, then `exp`, `iss` and
//! `aud`), with a cache of one entry and 1,000 tokens in turn, so that every token is
//! verified in full. Beside it, `openssl speed`'s verify/s for the same algorithms on the
//! same machine (one thread too), and the ratio. The keys are made with `openssl genpkey`
//! in a temporary folder; the tokens are signed with jsonwebtoken.
//!
//!     cargo run --release --example jwt_verify [SECONDS]     # 3 s per algorithm
//!
//! docs/performance.md ("Verified identities") records its figures.

use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http::HeaderName;
use jsonwebtoken::{encode, EncodingKey, Header};
use ratewall::identity::jwt::{Alg, KeySet, KeysFrom, Settings, TokenFrom, Verifier};

const TOKENS: usize = 1000;

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `openssl` with `args`, its standard output (exits on failure).
fn openssl(args: &[&str]) -> Vec<u8> {
    let out = Command::new("openssl")
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            fail(&format!(
                "openssl: {e} (install it: apt-get install openssl)"
            ))
        });
    if !out.status.success() {
        fail(&format!(
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    out.stdout
}

fn fail(message: &str) -> ! {
    eprintln!("jwt_verify: {message}");
    std::process::exit(1)
}

/// A private key of `genpkey` arguments, and its public key, both PEM.
fn pair(dir: &std::path::Path, name: &str, genpkey: &[&str]) -> (Vec<u8>, Vec<u8>) {
    let private = dir.join(format!("{name}.pem"));
    let path = private.to_str().unwrap_or_else(|| fail("temporary path"));
    let mut args = vec!["genpkey", "-out", path];
    args.extend_from_slice(genpkey);
    openssl(&args);
    let public = openssl(&["pkey", "-in", path, "-pubout"]);
    let private = std::fs::read(&private).unwrap_or_else(|e| fail(&format!("{name}: {e}")));
    (private, public)
}

/// ratewall's verifier for `alg` with `public` as its one key, remembering one token.
fn verifier(alg: Alg, public: &[u8]) -> Verifier {
    let keys = KeySet::from_pems(&[("bench.pem".to_string(), public.to_vec())])
        .unwrap_or_else(|e| fail(&format!("{}: {e}", alg.name())));
    let settings = Settings {
        from: TokenFrom::Bearer(HeaderName::from_static("authorization")),
        algorithms: vec![alg],
        keys_from: KeysFrom::Pems(vec!["bench.pem".into()]),
        issuer: vec!["https://issuer.bench".to_string()],
        audience: vec!["bench".to_string()],
        leeway: 30,
        required_claims: Vec::new(),
        plan_claim: None,
        forward_claims: Vec::new(),
        failures: ratewall::identity::jwt::DEFAULT_FAILURES,
    };
    Verifier::with_clock(settings, Some(keys), now, 1)
}

/// Verifications per second of `TOKENS` distinct tokens in turn, for `secs`.
fn measure(alg: Alg, private: &EncodingKey, public: &[u8], secs: Duration) -> f64 {
    let header = Header::new(match alg.name() {
        "RS256" => jsonwebtoken::Algorithm::RS256,
        "ES256" => jsonwebtoken::Algorithm::ES256,
        _ => jsonwebtoken::Algorithm::EdDSA,
    });
    let exp = now() + 3600;
    let tokens: Vec<String> = (0..TOKENS)
        .map(|i| {
            let claims = serde_json::json!({
                "sub": format!("user-{i}"), "iss": "https://issuer.bench", "aud": "bench",
                "iat": exp - 3600, "exp": exp,
            });
            encode(&header, &claims, private).unwrap_or_else(|e| fail(&format!("sign: {e}")))
        })
        .collect();
    let v = verifier(alg, public);
    // Every token once, checked, before the clock starts.
    for t in &tokens {
        if let Err(e) = v.verify(t) {
            fail(&format!("{}: a token was refused: {e:?}", alg.name()));
        }
    }
    let started = Instant::now();
    let mut n = 0u64;
    while started.elapsed() < secs {
        for t in &tokens {
            if v.verify(t).is_err() {
                fail("a token was refused");
            }
        }
        n += TOKENS as u64;
    }
    n as f64 / started.elapsed().as_secs_f64()
}

/// `openssl speed`'s verify/s for rsa2048, ecdsap256 and ed25519, in that order.
fn openssl_speed(secs: u64) -> [Option<f64>; 3] {
    let out = openssl(&[
        "speed",
        "-seconds",
        &secs.to_string(),
        "rsa2048",
        "ecdsap256",
        "ed25519",
    ]);
    let text = String::from_utf8_lossy(&out);
    let last = |pick: &dyn Fn(&str) -> bool| {
        text.lines()
            .find(|l| pick(l))
            .and_then(|l| l.split_whitespace().last()?.parse().ok())
    };
    [
        last(&|l| l.starts_with("rsa 2048 bits") || l.starts_with("rsa  2048 bits")),
        last(&|l| l.contains("ecdsa (nistp256)")),
        last(&|l| l.contains("EdDSA (Ed25519)")),
    ]
}

fn main() {
    let secs: u64 = std::env::args()
        .nth(1)
        .map(|s| {
            s.parse()
                .unwrap_or_else(|_| fail("SECONDS: a whole number"))
        })
        .unwrap_or(3);
    let dir = tempfile_dir();
    let rsa = pair(
        &dir,
        "rsa",
        &["-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048"],
    );
    let ec = pair(
        &dir,
        "ec",
        &["-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256"],
    );
    let ed = pair(&dir, "ed", &["-algorithm", "ED25519"]);
    let key = |r: Result<EncodingKey, jsonwebtoken::errors::Error>| {
        r.unwrap_or_else(|e| fail(&format!("a private key: {e}")))
    };
    let cases = [
        ("RS256", key(EncodingKey::from_rsa_pem(&rsa.0)), &rsa.1),
        ("ES256", key(EncodingKey::from_ec_pem(&ec.0)), &ec.1),
        ("EdDSA", key(EncodingKey::from_ed_pem(&ed.0)), &ed.1),
    ];
    let time = Duration::from_secs(secs);
    let ours: Vec<f64> = cases
        .iter()
        .map(|(name, private, public)| {
            let alg = Alg::of_name(name).unwrap_or_else(|| fail(name));
            measure(alg, private, public, time)
        })
        .collect();
    let theirs = openssl_speed(secs);
    let _ = std::fs::remove_dir_all(&dir);
    println!("cache-miss verifications per second, one thread, {secs} s each");
    println!(
        "{:8}{:>14}{:>22}{:>8}",
        "", "ratewall", "openssl speed verify", "ratio"
    );
    for (i, (name, _, _)) in cases.iter().enumerate() {
        let (o, t) = (ours[i], theirs[i]);
        let t_text = t.map_or("?".to_string(), |t| format!("{t:.0}"));
        let ratio = t.map_or(String::new(), |t| format!("{:.2}x", o / t));
        println!("{name:8}{o:>14.0}{t_text:>22}{ratio:>8}");
    }
    println!("(openssl speed: rsa2048, ecdsap256, ed25519, its verify/s column)");
}

/// A fresh folder under the system's temporary one.
fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("ratewall-jwt-verify-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| fail(&format!("{}: {e}", dir.display())));
    dir
}
