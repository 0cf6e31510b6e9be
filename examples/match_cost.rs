//! What matching a request's rules costs as the config grows: nanoseconds per request for
//! configs of 10 to 10,000 rules (prefix, exact-path and a few glob rules), through the
//! compiled index, next to checking every rule one by one.
//!
//!     cargo run --release --example match_cost

use std::hint::black_box;
use std::path::Path;
use std::time::Instant;

use http::Method;
use ratewall::config::Config;
use ratewall::rules::PathMatch;

fn config(rules: usize) -> Config {
    let mut text = String::from(
        "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\nurl = \"http://127.0.0.1:2\"\n",
    );
    for i in 0..rules {
        // Mostly prefixes and exact paths, as API configs are; one glob in 50.
        let matcher = match i % 50 {
            0 => format!("glob = \"/svc{}/*/export\"", i % 97),
            n if n % 2 == 0 => format!("path_prefix = \"/svc{}/v{}/\"", i % 97, i),
            _ => format!("path = \"/svc{}/v{}/item\", methods = [\"GET\"]", i % 97, i),
        };
        text.push_str(&format!(
            "[[rules]]\nname = \"r{i}\"\nkey = \"global\"\nrate = \"10/s\"\nmatch = {{ {matcher} }}\n"
        ));
    }
    Config::parse(&text, Path::new("bench.toml")).expect("valid config")
}

/// Every rule checked in turn: what matching costs without the index.
fn scan(cfg: &Config, method: &Method, path: &str) -> Vec<usize> {
    (0..cfg.rules.len())
        .filter(|&i| {
            let m = &cfg.rules[i].matcher;
            (m.methods.is_empty() || m.methods.contains(method))
                && match &m.path {
                    PathMatch::Any => true,
                    PathMatch::Prefix(p) => path.starts_with(p.as_str()),
                    PathMatch::Exact(p) => path == p,
                    PathMatch::Glob(g) => g.matches(path),
                }
        })
        .collect()
}

fn main() {
    println!("rules   index ns/request   scan ns/request   rules matched per request");
    for n in [10, 100, 1_000, 10_000] {
        let cfg = config(n);
        // Paths some rule is about (half of them), and near misses.
        let paths: Vec<String> = (0..1_000)
            .map(|k| {
                let i = (k * 7) % n;
                match k % 4 {
                    0 | 1 => format!("/svc{}/v{}/item", i % 97, i),
                    2 => format!("/svc{}/v{}x/item", i % 97, i),
                    _ => format!("/svc{}/q{}/export", i % 97, k),
                }
            })
            .collect();
        let get = Method::GET;
        let rounds = 200_000 / paths.len().max(1);
        let time = |f: &dyn Fn(&str) -> usize| {
            let start = Instant::now();
            let mut matched = 0;
            for _ in 0..rounds {
                for p in &paths {
                    matched += f(black_box(p));
                }
            }
            let count = (rounds * paths.len()) as f64;
            (
                start.elapsed().as_nanos() as f64 / count,
                matched as f64 / count,
            )
        };
        let (index_ns, matched) = time(&|p| cfg.index.matching(&get, p, None).len());
        let (scan_ns, _) = time(&|p| scan(&cfg, &get, p).len());
        for p in &paths {
            assert_eq!(cfg.index.matching(&get, p, None), scan(&cfg, &get, p));
        }
        println!("{n:>6}   {index_ns:>16.0}   {scan_ns:>15.0}   {matched:>.2}");
    }
}
