//! The modules of `src/` depend on each other in one direction only: no import cycle.
//!
//! A module is a top-level one (`src/rules.rs`, or everything under `src/limiter/`); it
//! depends on another when its code names `crate::<other>` (comments, doc links and
//! `#[cfg(test)]` modules aside: tests may build their cases through any module). The
//! test prints the graph in dependency order, so `cargo test --test it layering:: --
//! --nocapture` shows the layers, and fails naming a cycle if there is one.
//!
//! Beside the order the imports happen to make, the tiers the crate is built in
//! ([`TIERS`], docs/architecture.md): a module imports only from its own tier or those
//! below, so an upward import fails even where it makes no cycle; and no module uses more
//! than [`MAX_SIBLINGS`] of the others (a module that needs more is doing several jobs).
//! The front-ends on listeners of their own are in the front-ends tier by their line in
//! `src/lib.rs`' `front_ends!` ([`listed_front_ends`]): a new one needs no line here.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("src/ is readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `text` without comments, string and char literals (their bytes become spaces), so
/// braces and `crate::` inside them are not taken for code.
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let rest = &b[i..];
        if rest.starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                out.push(b' ');
                i += 1;
            }
        } else if rest.starts_with(b"/*") {
            let mut depth = 0;
            while i < b.len() {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    out.extend_from_slice(b"  ");
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    out.extend_from_slice(b"  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(if b[i] == b'\n' { b'\n' } else { b' ' });
                    i += 1;
                }
            }
        } else if rest.starts_with(b"r#\"") || rest.starts_with(b"r\"") || rest.starts_with(b"br\"")
        {
            // A raw string: r"…", r#"…"#, br"…".
            let start = i;
            while b[i] != b'"' {
                i += 1;
            }
            let hashes = b[start..i].iter().filter(|&&c| c == b'#').count();
            let mut close = vec![b'"'];
            close.extend(std::iter::repeat_n(b'#', hashes));
            i += 1;
            while i < b.len() && !b[i..].starts_with(&close) {
                i += 1;
            }
            i = (i + close.len()).min(b.len());
            out.extend(std::iter::repeat_n(b' ', i - start));
        } else if b[i] == b'"' {
            out.push(b' ');
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
                out.push(b' ');
            }
            out.push(b' ');
            i += 1;
        } else if rest.starts_with(b"'{'") || rest.starts_with(b"'}'") || rest.starts_with(b"'\"'")
        {
            out.extend_from_slice(b"   ");
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `code` without its `#[cfg(test)]` modules.
fn without_tests(code: &str) -> String {
    let mut out = code.to_string();
    while let Some(at) = out.find("#[cfg(test)]") {
        let after = &out[at..];
        let Some(open) = after.find('{') else { break };
        // Only a module (or an item) whose body follows: cut through its closing brace.
        let mut depth = 0;
        let mut end = None;
        for (k, c) in after[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = Some(at + open + k + 1);
                        break;
                    }
                }
                _ => {}
            }
        }
        let Some(end) = end else { break };
        out.replace_range(at..end, "");
    }
    out
}

/// The top-level module a file belongs to (`None` for the crate root and the binary).
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (!matches!(name, "lib" | "main")).then(|| name.to_string())
}

fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut deps: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let Some(module) = module_of(&src, file) else {
            continue;
        };
        let text = std::fs::read_to_string(file).expect("a source file is readable");
        let code = without_tests(&code_only(&text));
        let entry = deps.entry(module.clone()).or_default();
        let mut named = Vec::new();
        for (at, _) in code.match_indices("crate::") {
            let rest = &code[at + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                // `use crate::{a, b::c}`: every first segment in the group.
                let inner = &group[..group.find('}').unwrap_or(group.len())];
                named.extend(inner.split(',').map(|s| s.trim().to_string()));
            } else {
                named.push(rest.to_string());
            }
        }
        for n in named {
            let m: String = n
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !m.is_empty() && m != module {
                entry.insert(m);
            }
        }
    }
    // Only modules with a file in src/ are nodes: `crate::seed`, which the unit tests of
    // a test-only file (limiter/properties.rs) name, is tests/it/common/seed.rs included.
    let modules: BTreeSet<String> = deps.keys().cloned().collect();
    for named in deps.values_mut() {
        named.retain(|m| modules.contains(m));
    }
    deps
}

/// A cycle in `deps`, if there is one, as the modules along it.
fn cycle(deps: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        m: &str,
        deps: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == m) {
            let mut c = path[at..].to_vec();
            c.push(m.to_string());
            return Some(c);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_string());
        for d in deps.get(m).into_iter().flatten() {
            if let Some(c) = visit(d, deps, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_string());
        None
    }
    let mut done = BTreeSet::new();
    deps.keys()
        .find_map(|m| visit(m, deps, &mut Vec::new(), &mut done))
}

/// The tiers of `src/`, bottom first (docs/architecture.md): what everything counts with
/// and who a request is; the parts a request meets (the store, the pools, the rules, the
/// config that builds them); what every request runs on; the decision; the front-ends
/// that take requests and ask it; and what starts them.
const TIERS: &[(&str, &[&str])] = &[
    (
        "bottom",
        &["identity", "random", "telemetry", "tls", "worker"],
    ),
    (
        "parts",
        &[
            "config",
            "connection",
            "headers",
            "limiter",
            "overload",
            "rules",
            "settle",
            "tunnel",
            "upstream",
            "websocket",
        ],
    ),
    ("runtime", &["front_end", "runtime"]),
    ("decision", &["decide"]),
    // With every module `front_ends!` lists (the admin listener's among them).
    ("front-ends", &["proxy"]),
    ("top", &["cli", "server"]),
];

/// The index of the front-ends tier in [`TIERS`].
const FRONT_ENDS: usize = 4;

/// The modules `src/lib.rs` lists in `front_ends! { … }`: the front-ends the server starts
/// on listeners of their own.
fn listed_front_ends() -> Vec<String> {
    let lib = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs");
    let text = std::fs::read_to_string(lib).expect("src/lib.rs is readable");
    let code = code_only(&text);
    let list = code
        .find("front_ends!")
        .and_then(|at| {
            let rest = &code[at..];
            let open = rest.find('{')?;
            let close = rest.find('}')?;
            Some(rest[open + 1..close].to_string())
        })
        .expect("src/lib.rs lists its front-ends in `front_ends! { … }`");
    list.split(',')
        .map(|m| {
            // Attributes before the module's name (comments are gone already).
            let m = m.trim();
            m.rsplit(|c: char| c.is_whitespace() || c == ']')
                .next()
                .unwrap_or(m)
                .to_string()
        })
        .filter(|m| !m.is_empty())
        .collect()
}

/// The most other modules one may use.
const MAX_SIBLINGS: usize = 10;

fn tier_of(m: &str) -> Option<usize> {
    use std::sync::OnceLock;
    static LISTED: OnceLock<Vec<String>> = OnceLock::new();
    let listed = LISTED.get_or_init(listed_front_ends);
    if listed.iter().any(|l| l == m) {
        return Some(FRONT_ENDS);
    }
    TIERS.iter().position(|(_, ms)| ms.contains(&m))
}

/// Every import of `deps` that goes up a tier, as "module -> import".
fn upward(deps: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let mut up = Vec::new();
    for (m, named) in deps {
        let Some(t) = tier_of(m) else { continue };
        for n in named {
            if tier_of(n).is_some_and(|u| u > t) {
                up.push(format!(
                    "{m} ({}) -> {n} ({})",
                    TIERS[t].0,
                    TIERS[tier_of(n).unwrap_or(t)].0
                ));
            }
        }
    }
    up
}

#[test]
fn modules_import_only_from_their_tier_or_below() {
    let _watch = common::watchdog();
    let deps = graph();
    let unplaced: Vec<&String> = deps.keys().filter(|m| tier_of(m).is_none()).collect();
    assert!(
        unplaced.is_empty(),
        "modules in no tier (place them in TIERS and docs/architecture.md, or a front-end in src/lib.rs' `front_ends!`): {unplaced:?}"
    );
    let up = upward(&deps);
    assert!(up.is_empty(), "imports up a tier: {up:#?}");
    let crowded: Vec<String> = deps
        .iter()
        .filter(|(_, d)| d.len() > MAX_SIBLINGS)
        .map(|(m, d)| format!("{m} uses {}: {d:?}", d.len()))
        .collect();
    assert!(
        crowded.is_empty(),
        "modules using more than {MAX_SIBLINGS} others: {crowded:#?}"
    );
}

#[test]
fn an_upward_import_is_found() {
    let _watch = common::watchdog();
    let mut deps: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    deps.entry("proxy".into())
        .or_default()
        .insert("decide".into());
    deps.entry("decide".into())
        .or_default()
        .insert("runtime".into());
    assert!(upward(&deps).is_empty());
    deps.entry("telemetry".into())
        .or_default()
        .insert("proxy".into());
    assert_eq!(upward(&deps), ["telemetry (bottom) -> proxy (front-ends)"]);
}

#[test]
fn the_front_ends_listed_in_lib_rs_are_in_their_tier() {
    let _watch = common::watchdog();
    assert_eq!(TIERS[FRONT_ENDS].0, "front-ends");
    let listed = listed_front_ends();
    assert!(listed.iter().any(|m| m == "admin"), "{listed:?}");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    for m in &listed {
        assert!(
            src.join(format!("{m}.rs")).exists() || src.join(m).is_dir(),
            "`front_ends!` lists {m}, which src/ does not hold"
        );
        assert_eq!(tier_of(m), Some(FRONT_ENDS), "{m}");
    }
    // An import from a listed front-end into the proxy's tier is allowed; one from below
    // into a listed front-end is found.
    let mut deps: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    deps.entry("admin".into())
        .or_default()
        .insert("front_end".into());
    assert!(upward(&deps).is_empty());
    deps.entry("runtime".into())
        .or_default()
        .insert("admin".into());
    assert_eq!(upward(&deps), ["runtime (runtime) -> admin (front-ends)"]);
}

#[test]
fn modules_form_no_import_cycle() {
    let _watch = common::watchdog();
    let deps = graph();
    assert!(
        deps.len() >= 8,
        "the walk found too few modules to mean anything: {deps:?}"
    );
    if let Some(c) = cycle(&deps) {
        panic!("import cycle among src/ modules: {}", c.join(" -> "));
    }
    // The layers, each depending only on the ones above it.
    let mut placed: BTreeSet<String> = BTreeSet::new();
    let mut layer = 0;
    while placed.len() < deps.len() {
        let next: Vec<&String> = deps
            .iter()
            .filter(|(m, d)| {
                !placed.contains(*m)
                    && d.iter()
                        .all(|x| placed.contains(x) || !deps.contains_key(x))
            })
            .map(|(m, _)| m)
            .collect();
        assert!(!next.is_empty(), "no cycle, yet no module could be placed");
        println!("layer {layer}:");
        for m in &next {
            let d: Vec<&str> = deps[*m].iter().map(String::as_str).collect();
            println!("  {m:<12} -> {}", d.join(", "));
        }
        placed.extend(next.into_iter().cloned());
        layer += 1;
    }
}

#[test]
fn the_cycle_finder_finds_a_cycle() {
    let _watch = common::watchdog();
    let mut deps: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    deps.entry("a".into()).or_default().insert("b".into());
    deps.entry("b".into()).or_default().insert("c".into());
    deps.entry("c".into()).or_default();
    assert_eq!(cycle(&deps), None);
    deps.entry("c".into()).or_default().insert("a".into());
    assert_eq!(
        cycle(&deps),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
}

#[test]
fn literals_comments_and_tests_are_not_code() {
    let _watch = common::watchdog();
    let text = "use crate::a; // crate::b\nlet s = \"crate::c {\"; let r = r#\"crate::d\"#;\n/* crate::e */ let c = '{';\n#[cfg(test)]\nmod tests { use crate::f; }\nfn g() { crate::h::x() }";
    let code = without_tests(&code_only(text));
    for gone in ["crate::b", "crate::c", "crate::d", "crate::e", "crate::f"] {
        assert!(!code.contains(gone), "{gone} left in {code:?}");
    }
    assert!(code.contains("crate::a") && code.contains("crate::h"));
}
