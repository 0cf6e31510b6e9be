//! The docs stand alone and keep up with the code.
//!
//! - Every table and key of `config/limits.toml` (the commented-out ones too), and every
//!   key the config parser accepts (the fields of the `Raw*` structs in `src/config/`),
//!   has a table row of its own in its table's section of `docs/configuration.md`, and
//!   every table a heading.
//! - README.md and docs/*.md link only to files inside the repository that exist, and to
//!   headings that exist; none mentions a path outside it.
//! - docs/configuration.md has a row for every option and environment variable
//!   `ratewall --help` lists; docs/observability.md's metrics table has a row for every
//!   metric the gateway exports on the shipped config (with its type, labels and their
//!   fixed values), and none for a metric it does not; its `check` example is what
//!   `ratewall check` prints.
//!
//! Plain text checks on the files as shipped, and for the last three the binary: its
//! `--help`, `check`, and `/metrics` of the gateway started on the shipped config.

use crate::common;

use std::collections::{BTreeMap, HashMap};
use std::path::{Component, Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// A Markdown file's lines, with fenced code blocks blanked: a `# comment` in a code
/// block is no heading, and a `|` in one no table row.
struct Doc {
    name: String,
    lines: Vec<String>,
}

impl Doc {
    fn load(rel: &str) -> Doc {
        let mut fenced = false;
        let lines = read(rel)
            .lines()
            .map(|l| {
                if l.trim_start().starts_with("```") {
                    fenced = !fenced;
                    return String::new();
                }
                if fenced {
                    String::new()
                } else {
                    l.to_string()
                }
            })
            .collect();
        Doc {
            name: rel.to_string(),
            lines,
        }
    }

    /// The anchors of its headings, as GitHub makes them.
    fn anchors(&self) -> Vec<String> {
        let mut seen: HashMap<String, usize> = HashMap::new();
        self.lines
            .iter()
            .filter_map(|l| heading(l).map(|(_, text)| slug(text)))
            .map(|s| {
                let n = seen.entry(s.clone()).or_insert(0);
                *n += 1;
                if *n == 1 {
                    s
                } else {
                    format!("{s}-{}", *n - 1)
                }
            })
            .collect()
    }
}

/// `## text` -> (2, "text").
fn heading(line: &str) -> Option<(usize, &str)> {
    let level = line.bytes().take_while(|&b| b == b'#').count();
    if !(1..=6).contains(&level) {
        return None;
    }
    line[level..]
        .strip_prefix(' ')
        .map(|text| (level, text.trim()))
}

/// GitHub's heading anchor: lower case, spaces to `-`, punctuation other than `-` and `_`
/// dropped.
fn slug(text: &str) -> String {
    let mut s = String::new();
    for c in text.chars() {
        if c.is_alphanumeric() || c == '-' || c == '_' {
            s.extend(c.to_lowercase());
        } else if c == ' ' {
            s.push('-');
        }
    }
    s
}

/// The section whose heading holds `` `token` ``: its heading and every line up to the
/// next heading of the same or a higher level (its subsections included).
fn section<'a>(lines: &'a [String], token: &str) -> Option<&'a [String]> {
    let code = format!("`{token}`");
    let (start, level) = lines.iter().enumerate().find_map(|(i, l)| {
        heading(l)
            .filter(|(_, text)| text.contains(&code))
            .map(|(level, _)| (i, level))
    })?;
    let end = lines[start + 1..]
        .iter()
        .position(|l| heading(l).is_some_and(|(lv, _)| lv <= level))
        .map_or(lines.len(), |p| start + 1 + p);
    Some(&lines[start..end])
}

/// Whether `key` has a table row of its own, its first cell naming it, in `section`. (A
/// heading is not enough: a subsection about a key does not say its default or range.)
fn documented(section: &[String], key: &str) -> bool {
    let code = format!("`{key}`");
    section.iter().any(|l| {
        let row = l.trim();
        row.starts_with('|')
            && row[1..]
                .split('|')
                .next()
                .is_some_and(|cell| cell.contains(&code))
    })
}

/// The section of `docs/configuration.md` for `token`, or a complaint.
fn section_of<'a>(doc: &'a Doc, token: &str, missing: &mut Vec<String>) -> Option<&'a [String]> {
    let s = section(&doc.lines, token);
    if s.is_none() {
        missing.push(format!("{}: no heading with `{token}`", doc.name));
    }
    s
}

/// Check one table of the config against its section `token`.
fn check_table(doc: &Doc, token: &str, path: &str, table: &toml::Table, missing: &mut Vec<String>) {
    let Some(sec) = section_of(doc, token, missing) else {
        return;
    };
    for (key, value) in table {
        if !documented(sec, key) {
            missing.push(format!(
                "{path}.{key}: no row `{key}` in the `{token}` section"
            ));
        }
        let toml::Value::Table(inner) = value else {
            continue;
        };
        match (path, key.as_str()) {
            // API key -> plan: the entries are users' keys, not settings.
            ("keys", "plans") => {
                section_of(doc, "[keys.plans]", missing);
            }
            // Plan name -> overrides: each plan's keys are the overrides'.
            ("rules", "plans") => {
                for (plan, over) in inner {
                    match over {
                        toml::Value::Table(t) => check_table(
                            doc,
                            "[rules.plans.<plan>]",
                            &format!("rules.plans.{plan}"),
                            t,
                            missing,
                        ),
                        _ => missing.push(format!("rules.plans.{plan} is not a table")),
                    }
                }
            }
            // An inline table documented inside its table's section (`match`).
            _ => match section(sec, key) {
                Some(sub) => {
                    for k in inner.keys() {
                        if !documented(sub, k) {
                            missing.push(format!(
                                "{path}.{key}.{k}: no row `{k}` in the `{key}` section"
                            ));
                        }
                    }
                }
                None => missing.push(format!(
                    "{path}.{key}: no heading with `{key}` inside the `{token}` section"
                )),
            },
        }
    }
}

/// The section token of a TOML table header line: `[server]`, `[[rules]]`,
/// `[rules.plans.pro]` -> `[rules.plans.<plan>]`.
fn header_token(line: &str) -> Option<(String, String)> {
    let l = line.trim();
    if let Some(name) = l.strip_prefix("[[").and_then(|r| r.strip_suffix("]]")) {
        return Some((format!("[[{name}]]"), name.to_string()));
    }
    let name = l.strip_prefix('[')?.strip_suffix(']')?;
    if let Some(plan) = name.strip_prefix("rules.plans.") {
        return Some((
            "[rules.plans.<plan>]".to_string(),
            format!("rules.plans.{plan}"),
        ));
    }
    Some((format!("[{name}]"), name.to_string()))
}

#[test]
fn every_key_of_the_shipped_config_is_documented() {
    let _watch = common::watchdog();
    let doc = Doc::load("docs/configuration.md");
    let text = read("config/limits.toml");
    let config: toml::Table = toml::from_str(&text).expect("config/limits.toml parses");
    let mut missing = Vec::new();
    let mut tables = 0;
    for (name, value) in &config {
        match value {
            toml::Value::Table(t) => {
                tables += 1;
                check_table(&doc, &format!("[{name}]"), name, t, &mut missing);
            }
            toml::Value::Array(items) => {
                for item in items {
                    tables += 1;
                    match item {
                        toml::Value::Table(t) => {
                            check_table(&doc, &format!("[[{name}]]"), name, t, &mut missing)
                        }
                        _ => missing.push(format!("{name}: an array of something else")),
                    }
                }
            }
            _ => missing.push(format!("{name}: a top-level key outside any table")),
        }
    }
    assert!(tables >= 8, "config/limits.toml: only {tables} tables read");

    // Keys shown commented out (`# workers = 2`): a line that is a TOML assignment once
    // its `# ` is taken off, under the table header above it.
    let mut current: Option<(String, String)> = None;
    let mut commented = 0;
    for line in text.lines() {
        // A table shown commented out (`# [server.tls]`) heads the keys commented below it.
        if let Some(h) = header_token(line.strip_prefix("# ").unwrap_or(line)) {
            current = Some(h);
            continue;
        }
        let Some(rest) = line.strip_prefix("# ") else {
            continue;
        };
        if rest.starts_with(char::is_whitespace) {
            continue;
        }
        let Ok(t) = toml::from_str::<toml::Table>(rest) else {
            continue;
        };
        let (Some((token, path)), 1) = (&current, t.len()) else {
            continue;
        };
        commented += 1;
        let key = t.keys().next().map(String::as_str).unwrap_or_default();
        match section_of(&doc, token, &mut missing) {
            Some(sec) if !documented(sec, key) => missing.push(format!(
                "{path}.{key} (commented out in limits.toml): no row `{key}` in the `{token}` section"
            )),
            _ => {}
        }
    }
    assert!(
        commented > 0 || !text.contains("\n# workers ="),
        "commented-out keys were not recognised"
    );
    missing.sort();
    missing.dedup();
    assert!(
        missing.is_empty(),
        "docs/configuration.md does not document these keys of config/limits.toml:\n  {}",
        missing.join("\n  ")
    );
}

/// Where a `Raw*` struct of src/config/ is documented: its fields are tables (each a
/// heading), or keys of one section (`within`: a subsection of another).
enum Place {
    Tables,
    Section(&'static str),
    Within(&'static str, &'static str),
}

fn place(name: &str) -> Option<Place> {
    Some(match name {
        "RawConfig" | "RawKeysFile" => Place::Tables,
        "RawServer" => Place::Section("[server]"),
        "RawAdmin" => Place::Section("[admin]"),
        "RawDecide" => Place::Section("[decide]"),
        "RawForwardAuth" => Place::Within("[decide]", "forward_auth"),
        "RawUpstream" => Place::Section("[upstream]"),
        "RawPool" => Place::Section("[[upstreams]]"),
        "RawPoolServer" => Place::Within("[[upstreams]]", "servers"),
        "RawHealth" => Place::Within("[[upstreams]]", "health"),
        "RawOverload" => Place::Within("[[upstreams]]", "overload"),
        "RawRoute" => Place::Section("[[routes]]"),
        "RawStore" => Place::Section("[store]"),
        "RawClientIp" => Place::Section("[client_ip]"),
        "RawKeys" => Place::Section("[keys]"),
        "RawJwt" => Place::Section("[jwt]"),
        "RawResponse" => Place::Section("[response]"),
        "RawLog" => Place::Section("[log]"),
        "RawRule" => Place::Section("[[rules]]"),
        "RawMatch" => Place::Within("[[rules]]", "match"),
        "RawMessages" => Place::Within("[[rules]]", "messages"),
        "RawBytes" => Place::Within("[[rules]]", "bytes"),
        "RawStatuses" => Place::Within("[[rules]]", "charge"),
        "RawAttempts" => Place::Within("[[rules]]", "attempts"),
        "RawDrain" => Place::Within("[[rules]]", "settle_drain"),
        "RawFailures" => Place::Within("[keys]", "failures"),
        "RawTls" | "RawCertificate" => Place::Within("[server]", "tls"),
        "RawPlanOverride" => Place::Section("[rules.plans.<plan>]"),
        // issue 44 (rls): Envoy's descriptors.
        "RawDescriptors" => Place::Section("[[descriptors]]"),
        "RawEntry" => Place::Within("[[descriptors]]", "entries"),
        // issue 45: the egress gateway.
        "RawEgress" => Place::Section("[egress]"),
        "RawTarget" => Place::Section("[[egress.targets]]"),
        _ => return None,
    })
}

/// The serde structs of src/config/ named `Raw*`, with the keys they accept (a field's
/// name, or its `rename`).
fn raw_structs(src: &str) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    let mut lines = src.lines();
    while let Some(line) = lines.next() {
        let line = line.trim();
        let line = line.strip_prefix("pub(super) ").unwrap_or(line);
        let Some(name) = line
            .strip_prefix("struct Raw")
            .and_then(|r| r.strip_suffix(" {"))
        else {
            continue;
        };
        let mut fields = Vec::new();
        let mut rename = None;
        for l in lines.by_ref() {
            let l = l.trim();
            if l == "}" {
                break;
            }
            if l.starts_with("#[") {
                assert!(
                    !l.contains("flatten"),
                    "Raw{name}: a flattened field; teach tests/it/docs.rs where its keys go"
                );
                if let Some(r) = l.split("rename = \"").nth(1) {
                    rename = r.split('"').next().map(str::to_string);
                }
                continue;
            }
            // A key a hand-written `Deserialize` reads, named in the field's doc comment.
            if let Some(k) = l
                .strip_prefix("/// In the file: `")
                .and_then(|r| r.strip_suffix('`'))
            {
                rename = Some(k.to_string());
                continue;
            }
            if l.is_empty() || l.starts_with("//") {
                continue;
            }
            let ident = l
                .trim_start_matches("pub(super) ")
                .trim_start_matches("pub ")
                .split(':')
                .next()
                .unwrap_or("");
            assert!(
                !ident.is_empty() && ident.chars().all(|c| c.is_alphanumeric() || c == '_'),
                "Raw{name}: cannot read the field in {l:?}"
            );
            fields.push(rename.take().unwrap_or_else(|| ident.to_string()));
        }
        out.insert(format!("Raw{name}"), fields);
    }
    out
}

#[test]
fn every_key_the_parser_accepts_is_documented() {
    let _watch = common::watchdog();
    let doc = Doc::load("docs/configuration.md");
    let mut sources: Vec<String> = std::fs::read_dir(root().join("src/config"))
        .expect("src/config/")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".rs"))
        .collect();
    sources.sort();
    let text: String = sources
        .iter()
        .map(|n| read(&format!("src/config/{n}")))
        .collect::<Vec<_>>()
        .join("\n");
    let structs = raw_structs(&text);
    assert!(
        structs.len() >= 12,
        "src/config/: only {} Raw structs read: {:?}",
        structs.len(),
        structs.keys()
    );
    let mut missing = Vec::new();
    for (name, fields) in &structs {
        assert!(!fields.is_empty(), "{name}: no fields read");
        let Some(where_) = place(name) else {
            missing.push(format!(
                "{name}: a table tests/it/docs.rs does not know; document it in docs/configuration.md and add it to place()"
            ));
            continue;
        };
        for field in fields {
            let found = match where_ {
                Place::Tables => [format!("[{field}]"), format!("[[{field}]]")]
                    .iter()
                    .any(|t| section(&doc.lines, t).is_some()),
                Place::Section(token) => {
                    section(&doc.lines, token).is_some_and(|s| documented(s, field))
                }
                Place::Within(outer, inner) => section(&doc.lines, outer)
                    .and_then(|s| section(s, inner))
                    .is_some_and(|s| documented(s, field)),
            };
            if !found {
                missing.push(format!("{name}.{field}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "docs/configuration.md does not document these keys src/config/ accepts:\n  {}",
        missing.join("\n  ")
    );
}

/// README.md and every Markdown file under docs/.
fn markdown_files() -> Vec<String> {
    let mut files = vec!["README.md".to_string()];
    let mut docs: Vec<String> = std::fs::read_dir(root().join("docs"))
        .expect("docs/")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// Link targets on a line: `[text](target)`, `![alt](target)`, and `[label]: target`.
fn links(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let t = line.trim_start();
    if let Some((label, target)) = t.split_once("]: ") {
        if label.starts_with('[') && !label.contains("](") {
            out.push(target.trim().to_string());
        }
    }
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        rest = &rest[at + 2..];
        let end = rest.find(')').unwrap_or(rest.len());
        out.push(rest[..end].to_string());
        rest = &rest[end..];
    }
    out.into_iter()
        .map(|t| {
            let t = t.split_whitespace().next().unwrap_or("").to_string();
            t.trim_start_matches('<').trim_end_matches('>').to_string()
        })
        .collect()
}

/// `base` (a folder inside the repository, relative to it) joined with `rel`, resolved;
/// `None` when it climbs out of the repository.
fn resolve(base: &Path, rel: &str) -> Option<PathBuf> {
    let joined = base.join(rel);
    let mut parts: Vec<Component<'_>> = Vec::new();
    for c in joined.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                parts.pop()?;
            }
            Component::Normal(_) => parts.push(c),
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    Some(parts.iter().collect())
}

#[test]
fn docs_link_only_inside_the_repository() {
    let _watch = common::watchdog();
    let files = markdown_files();
    assert!(files.len() >= 3, "{files:?}");
    let mut anchors: HashMap<String, Vec<String>> = HashMap::new();
    let mut anchors_of = |rel: &str| -> Vec<String> {
        anchors
            .entry(rel.to_string())
            .or_insert_with(|| Doc::load(rel).anchors())
            .clone()
    };
    let mut bad = Vec::new();
    for file in &files {
        let text = read(file);
        let dir = Path::new(file).parent().unwrap_or(Path::new(""));
        // A path out of the repository, linked or not (`../shared/…`): a reader who
        // clones ratewall has no such file. (`/x/../api/` in prose is a path inside a URL.)
        for (n, line) in text.lines().enumerate() {
            for (at, _) in line.match_indices("../") {
                let before = line[..at].chars().next_back();
                if matches!(before, Some('/' | '.')) {
                    continue;
                }
                let token: String = line[at..]
                    .chars()
                    .take_while(|c| !c.is_whitespace() && !"`)]\"'".contains(*c))
                    .collect();
                if resolve(dir, &token).is_none() {
                    bad.push(format!(
                        "{file}:{}: {token} is outside the repository",
                        n + 1
                    ));
                }
            }
            if line.contains("CONTRACT.md") {
                bad.push(format!(
                    "{file}:{}: mentions CONTRACT.md, which is not in the repository",
                    n + 1
                ));
            }
        }
        let doc = Doc::load(file);
        for (n, line) in doc.lines.iter().enumerate() {
            for target in links(line) {
                let at = format!("{file}:{}: {target}", n + 1);
                if target.is_empty()
                    || target.starts_with("http://")
                    || target.starts_with("https://")
                    || target.starts_with("mailto:")
                {
                    continue;
                }
                let (path, anchor) = match target.split_once('#') {
                    Some((p, a)) => (p, Some(a)),
                    None => (target.as_str(), None),
                };
                let linked = if path.is_empty() {
                    PathBuf::from(file)
                } else {
                    match resolve(dir, path) {
                        Some(p) => p,
                        None => {
                            bad.push(format!("{at}: outside the repository"));
                            continue;
                        }
                    }
                };
                if !root().join(&linked).exists() {
                    bad.push(format!("{at}: no such file in the repository"));
                    continue;
                }
                if let Some(anchor) = anchor {
                    let md = linked.to_string_lossy().into_owned();
                    if md.ends_with(".md") && !anchors_of(&md).iter().any(|a| a == anchor) {
                        bad.push(format!("{at}: no heading #{anchor} in {md}"));
                    }
                }
            }
        }
    }
    assert!(bad.is_empty(), "broken links:\n  {}", bad.join("\n  "));
}

#[test]
fn the_reference_is_linked_from_readme_and_the_shipped_config() {
    let _watch = common::watchdog();
    let readme = read("README.md");
    for doc in ["docs/configuration.md", "docs/reference.md"] {
        assert!(
            readme.contains(&format!("]({doc})")),
            "README.md does not link {doc}"
        );
    }
    let limits = read("config/limits.toml");
    let head: String = limits.lines().take_while(|l| l.starts_with('#')).collect();
    assert!(
        head.contains("docs/configuration.md"),
        "config/limits.toml's header comment does not point at docs/configuration.md"
    );
    // Every doc the shipped config's comments name exists.
    for word in limits.split(|c: char| c.is_whitespace() || "(),;:".contains(c)) {
        let word = word.trim_end_matches('.');
        if word.starts_with("docs/") || word.starts_with("config/") {
            assert!(
                root().join(word).exists(),
                "config/limits.toml names {word}, which does not exist"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// The command line, the metrics table and the `check` example, against the binary.

/// The binary under test.
fn ratewall() -> std::process::Command {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_ratewall"));
    c.current_dir(root());
    for v in [
        "RATEWALL_LISTEN",
        "RATEWALL_ADMIN_LISTEN",
        "RATEWALL_TLS_LISTEN",
        "RATEWALL_UPSTREAM",
    ] {
        c.env_remove(v);
    }
    c
}

/// What `ratewall <args>` prints on stdout; it must exit 0.
fn stdout_of(args: &[&str]) -> String {
    let out = ratewall().args(args).output().expect("run ratewall");
    assert!(
        out.status.success(),
        "ratewall {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

#[test]
fn every_command_line_option_and_variable_is_documented() {
    let _watch = common::watchdog();
    let doc = Doc::load("docs/configuration.md");
    let mut missing = Vec::new();
    let start = doc
        .lines
        .iter()
        .position(|l| l == "## Command line")
        .expect("docs/configuration.md: a `## Command line` section");
    let end = doc.lines[start + 1..]
        .iter()
        .position(|l| heading(l).is_some_and(|(level, _)| level <= 2))
        .map_or(doc.lines.len(), |p| start + 1 + p);
    let sec = &doc.lines[start..end];
    // First cells of the section's table rows.
    let cells: Vec<&str> = sec
        .iter()
        .filter_map(|l| l.trim().strip_prefix('|')?.split('|').next())
        .collect();
    for help in [stdout_of(&["--help"]), stdout_of(&["check", "--help"])] {
        for line in help.lines() {
            let line = line.trim_start();
            if let Some(opt) = line.strip_prefix("--") {
                let opt: String = opt
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                    .collect();
                let opt = format!("--{opt}");
                if ["--help", "--version"].contains(&opt.as_str()) {
                    continue;
                }
                let written =
                    |c: &&str| c.contains(&format!("`{opt}")) || c.contains(&format!(" {opt}"));
                if !cells.iter().any(written) {
                    missing.push(format!("option {opt}: no row in Command line"));
                }
            }
            if let Some((_, var)) = line.split_once("[env: ") {
                let var = var.split('=').next().unwrap_or_default();
                if !cells.iter().any(|c| c.contains(&format!("`{var}`"))) {
                    missing.push(format!("variable {var}: no row in Command line"));
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "docs/configuration.md, Command line, misses what `ratewall --help` lists:\n  {}",
        missing.join("\n  ")
    );
}

/// A metric as the code registers it, in the name a query uses.
#[derive(Debug, Default)]
struct Registered {
    kind: String,
    help: String,
    /// Label -> the values the docs must list (from the series the gateway exports at
    /// start and the label's enum in the source); empty for free values (rule names).
    labels: BTreeMap<String, std::collections::BTreeSet<String>>,
}

/// A free port on 127.0.0.1 (free a moment ago).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// `GET /metrics` of the gateway run on the shipped config, as it stands right after start
/// (the listeners moved to free ports with `--listen` and `--admin-listen`).
fn shipped_metrics() -> String {
    use std::io::{Read, Write};
    let mut last = String::new();
    for _ in 0..5 {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("log");
        let admin = free_port();
        let mut child = ratewall()
            .args(["--config", "config/limits.toml", "--listen"])
            .arg(format!("127.0.0.1:{}", free_port()))
            .arg("--admin-listen")
            .arg(format!("127.0.0.1:{admin}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("start ratewall");
        let end = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let mut up = false;
        while std::time::Instant::now() < end {
            last = std::fs::read_to_string(&log).unwrap_or_default();
            if last.contains("ratewall listening") {
                up = true;
                break;
            }
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let text = up.then(|| {
            let mut s = std::net::TcpStream::connect(("127.0.0.1", admin)).expect("connect");
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .expect("write");
            let mut reply = String::new();
            s.read_to_string(&mut reply).expect("read /metrics");
            reply
        });
        let _ = child.kill();
        let _ = child.wait();
        match text {
            Some(reply) => {
                let (head, body) = reply.split_once("\r\n\r\n").expect("a reply");
                assert!(head.starts_with("HTTP/1.1 200"), "{head}");
                // Chunked or not, the metric lines are whole lines of the body.
                return body.to_string();
            }
            None if last.contains("cannot listen") => continue,
            None => break,
        }
    }
    panic!("the gateway did not start on the shipped config:\n{last}");
}

/// A label as the source declares it: the values of its enum, or `None` for a `String`
/// (rule names: free, not the docs' to list).
type SourceLabels = BTreeMap<String, Option<Vec<String>>>;

/// The code of every `.rs` file under `src/`, its tests aside: each module registers the
/// metrics it owns.
fn source_files() -> Vec<String> {
    fn walk(dir: &Path, out: &mut Vec<String>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.expect("a directory entry").path())
            .collect();
        entries.sort();
        for path in entries {
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|x| x == "rs") {
                let text = std::fs::read_to_string(&path)
                    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                // A file's unit tests (its `#[cfg(test)] mod`, last) register nothing the
                // gateway does.
                let code = text
                    .split("\n#[cfg(test)]\nmod ")
                    .next()
                    .unwrap_or_default();
                out.push(code.to_string());
            }
        }
    }
    let mut out = Vec::new();
    walk(&root().join("src"), &mut out);
    out
}

/// Every metric a module under `src/` registers (a family with no series yet is not
/// exported), its type, its label fields, and the values of those whose type is one of
/// the label enums: a field `name: Family<Labels, Counter> = ("name", ...)` of a
/// `telemetry::metrics!` list (or a bare `Counter`, `Gauge`, `Histogram`), or
/// `registry.register("name", ...)` of a `Family::<Labels, Counter>` (or a bare
/// `Counter::default()`, `Info::new(...)`) declared in the same file; `struct Labels { pub
/// field: Type }` and `label_enum! { pub enum Type { A = "a", ... } }` anywhere.
fn source_metrics(files: &[String]) -> BTreeMap<String, (String, SourceLabels)> {
    let all = files.join("\n");
    let mut out = BTreeMap::new();
    for src in files {
        out.extend(file_metrics(src, &all));
    }
    out
}

/// The registrations of one file (`src`), their label structs and enums found in `all`.
fn file_metrics(src: &str, all: &str) -> BTreeMap<String, (String, SourceLabels)> {
    // `let var = Family::<Labels, Kind>` or `let var = Kind::...` -> var -> (Labels, kind).
    let mut declared: HashMap<String, (Option<String>, String)> = HashMap::new();
    for line in src.lines() {
        let l = line.trim();
        let Some((var, rhs)) = l.strip_prefix("let ").and_then(|r| r.split_once(" = ")) else {
            continue;
        };
        let (labels, kind) = match rhs.strip_prefix("Family::<") {
            Some(generics) => {
                let (labels, kind) = generics.split_once(',').unwrap_or((generics, ""));
                (Some(labels.trim().to_string()), kind.trim())
            }
            None => (None, rhs),
        };
        let kind: String = kind.chars().take_while(|c| c.is_alphanumeric()).collect();
        if ["Counter", "Gauge", "Histogram", "Info"].contains(&kind.as_str()) {
            declared.insert(var.trim().to_string(), (labels, kind.to_lowercase()));
        }
    }
    // A `telemetry::metrics!` list: `field: Family<Labels, Kind> = (` then `"name",` (or
    // `field: Kind = ("name", ...`) -> field -> (Labels, kind), and name -> field.
    let mut listed: Vec<(String, String)> = Vec::new();
    let lines: Vec<&str> = src.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        let l = line.trim();
        if l.starts_with("//") {
            continue;
        }
        let l = l.strip_prefix("pub ").unwrap_or(l);
        let Some((head, init)) = l.split_once(" = (") else {
            continue;
        };
        let Some((field, ty)) = head.split_once(": ") else {
            continue;
        };
        let (labels, kind) = match ty.strip_prefix("Family<") {
            Some(generics) => {
                let (labels, kind) = generics.split_once(',').unwrap_or((generics, ""));
                (Some(labels.trim().to_string()), kind.trim())
            }
            None => (None, ty),
        };
        let kind: String = kind.chars().take_while(|c| c.is_alphanumeric()).collect();
        if !["Counter", "Gauge", "Histogram", "Info"].contains(&kind.as_str()) {
            continue;
        }
        let named = match init.trim() {
            "" => lines.get(i + 1).copied().unwrap_or_default(),
            init => init,
        };
        let Some(name) = named.split('"').nth(1) else {
            continue;
        };
        declared.insert(field.trim().to_string(), (labels, kind.to_lowercase()));
        listed.push((name.to_string(), field.trim().to_string()));
    }
    // `pub struct Labels { pub field: Type, ... }` -> Labels -> [(field, Type)].
    let mut fields: HashMap<String, Vec<(String, String)>> = HashMap::new();
    let mut current: Option<String> = None;
    for line in all.lines() {
        let l = line.trim();
        if let Some(rest) = l.strip_prefix("pub struct ") {
            current = rest.strip_suffix(" {").map(|name| name.trim().to_string());
            continue;
        }
        if let Some(name) = &current {
            if l == "}" {
                current = None;
            } else if let Some((field, ty)) = l.strip_prefix("pub ").and_then(|f| f.split_once(':'))
            {
                fields.entry(name.clone()).or_default().push((
                    field.trim().to_string(),
                    ty.trim().trim_end_matches(',').to_string(),
                ));
            }
        }
    }
    // `pub enum Type {` in a label_enum!, then `A = "a",` lines and `BeA,` lines (`be_a`:
    // the name in snake_case).
    let mut values: HashMap<String, Vec<String>> = HashMap::new();
    let mut in_macro = false;
    let mut current: Option<String> = None;
    for line in all.lines() {
        let l = line.trim();
        if l.ends_with("label_enum! {") {
            in_macro = true;
            continue;
        }
        if let Some(rest) = l.strip_prefix("pub enum ").filter(|_| in_macro) {
            current = rest.strip_suffix(" {").map(|name| name.trim().to_string());
            in_macro = false;
            continue;
        }
        let Some(ty) = &current else {
            continue;
        };
        let bare = l
            .strip_suffix(',')
            .filter(|v| !v.is_empty() && v.chars().all(|c| c.is_ascii_alphanumeric()));
        if l == "}" {
            current = None;
        } else if let Some((_, value)) = l.split_once(" = \"") {
            if let Some(value) = value.strip_suffix("\",") {
                values
                    .entry(ty.clone())
                    .or_default()
                    .push(value.to_string());
            }
        } else if let Some(variant) = bare {
            values
                .entry(ty.clone())
                .or_default()
                .push(snake_case(variant));
        }
    }
    // `registry.register(\n "name",\n "help",\n var.clone(),\n)`: name -> var.
    let mut rest = src;
    while let Some(at) = rest.find("registry.register(") {
        rest = &rest[at + "registry.register(".len()..];
        let Some(name) = rest.split('"').nth(1) else {
            continue;
        };
        // The last argument: `var.clone()` or `var` (an `Info`, registered by value).
        let Some(call_end) = rest.find(");") else {
            continue;
        };
        let last = rest[..call_end]
            .trim_end()
            .trim_end_matches(',')
            .rsplit(',')
            .next()
            .unwrap_or_default()
            .trim();
        let var = last.strip_suffix(".clone()").unwrap_or(last);
        listed.push((name.to_string(), var.to_string()));
    }
    let mut out = BTreeMap::new();
    for (name, var) in listed {
        let Some((struct_name, kind)) = declared.get(&var) else {
            continue;
        };
        let mut labels = BTreeMap::new();
        if let Some(set) = struct_name.as_ref().and_then(|l| fields.get(l)) {
            for (field, ty) in set {
                let vals = match ty.as_str() {
                    "String" => None,
                    ty => Some(values.get(ty).cloned().unwrap_or_default()),
                };
                labels.insert(field.clone(), vals);
            }
        }
        out.insert(name.to_string(), (kind.clone(), labels));
    }
    out
}

/// A variant's label as `label_enum!` derives it: `_` before each capital after the
/// first, every capital lower-cased.
fn snake_case(variant: &str) -> String {
    let mut out = String::new();
    for (i, c) in variant.char_indices() {
        if i > 0 && c.is_ascii_uppercase() {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

/// Every metric the gateway registers: names and types from what it exports (a family
/// with no series yet still has its `# TYPE`), labels from its series and the source.
fn registered_metrics() -> BTreeMap<String, Registered> {
    let text = shipped_metrics();
    let source = source_metrics(&source_files());
    assert!(
        source.len() >= 10,
        "tests/it/docs.rs no longer finds the registrations under src/: {source:?}"
    );
    let mut by_family: BTreeMap<String, Registered> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (family, kind) = rest.split_once(' ').expect("# TYPE name type");
            by_family.entry(family.to_string()).or_default().kind = kind.to_string();
        } else if let Some(rest) = line.strip_prefix("# HELP ") {
            let (family, help) = rest.split_once(' ').unwrap_or((rest, ""));
            by_family.entry(family.to_string()).or_default().help = help.to_string();
        }
    }
    for (short, (kind, _)) in &source {
        let reg = by_family.entry(format!("ratewall_{short}")).or_default();
        if reg.kind.is_empty() {
            reg.kind = kind.clone();
        }
    }
    let families: Vec<String> = by_family.keys().cloned().collect();
    // Series: `family[_suffix]{a="x",b="y"} value`.
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((name, labels)) = line.split_once('{') else {
            continue;
        };
        let Some(family) = families
            .iter()
            .filter(|f| name.starts_with(f.as_str()))
            .max_by_key(|f| f.len())
        else {
            continue;
        };
        let labels = labels.rsplit_once('}').map_or("", |(l, _)| l);
        let reg = by_family.get_mut(family).expect("family");
        for pair in labels.split(',').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').expect("label=value");
            if k == "le" && reg.kind == "histogram" {
                continue;
            }
            reg.labels
                .entry(k.to_string())
                .or_default()
                .insert(v.trim_matches('"').to_string());
        }
    }
    for (family, reg) in by_family.iter_mut() {
        if reg.kind == "info" {
            // An info's labels are its text (a version): named, their values free.
            reg.labels.values_mut().for_each(|v| v.clear());
        }
        let short = family.strip_prefix("ratewall_").unwrap_or(family);
        for (label, values) in source.get(short).cloned().unwrap_or_default().1 {
            let known = reg.labels.entry(label).or_default();
            match values {
                Some(values) => known.extend(values),
                None => known.clear(),
            }
        }
    }
    by_family
        .into_iter()
        .map(|(family, reg)| {
            let name = match reg.kind.as_str() {
                "counter" => format!("{family}_total"),
                "info" => format!("{family}_info"),
                _ => family,
            };
            (name, reg)
        })
        .collect()
}

#[test]
fn the_metrics_table_lists_every_metric_with_its_type_labels_and_values() {
    let _watch = common::watchdog();
    let registered = registered_metrics();
    assert!(
        registered.contains_key("ratewall_requests_total"),
        "{registered:?}"
    );
    let doc = Doc::load("docs/observability.md");
    let sec =
        section(&doc.lines, "GET /metrics").expect("observability.md: a `GET /metrics` section");
    // Rows: | `name` | type | labels | what |.
    let mut rows: BTreeMap<String, (String, String)> = BTreeMap::new();
    for l in sec {
        // `\|` inside a cell is a literal bar.
        let l = l.replace("\\|", "\u{1}");
        let cells: Vec<String> = l
            .trim()
            .split('|')
            .map(|c| c.trim().replace('\u{1}', "|"))
            .collect();
        if cells.len() < 5 || !cells[1].starts_with("`ratewall_") {
            continue;
        }
        rows.insert(
            cells[1].trim_matches('`').to_string(),
            (cells[2].clone(), cells[3].clone()),
        );
    }
    let mut wrong = Vec::new();
    for (name, reg) in &registered {
        let Some((kind, labels)) = rows.get(name) else {
            let cell = reg
                .labels
                .iter()
                .map(|(l, vs)| {
                    let vs: Vec<String> = vs.iter().map(|v| format!("`{v}`")).collect();
                    if vs.is_empty() {
                        format!("`{l}`")
                    } else {
                        format!("`{l}` = {}", vs.join(" \\| "))
                    }
                })
                .collect::<Vec<_>>()
                .join(", ");
            wrong.push(format!(
                "missing row: | `{name}` | {} | {cell} | {} |",
                reg.kind, reg.help
            ));
            continue;
        };
        if kind != &reg.kind {
            wrong.push(format!(
                "{name}: type {kind}, the code registers a {}",
                reg.kind
            ));
        }
        for (label, values) in &reg.labels {
            if !labels.contains(&format!("`{label}`")) {
                wrong.push(format!("{name}: label `{label}` is not listed"));
            }
            for v in values {
                if !labels.contains(&format!("`{v}`")) {
                    wrong.push(format!("{name}: `{label}` value `{v}` is not listed"));
                }
            }
        }
        if reg.labels.is_empty() && !labels.is_empty() {
            wrong.push(format!("{name}: has no labels, the row lists {labels}"));
        }
    }
    for name in rows.keys() {
        if !registered.contains_key(name) {
            wrong.push(format!(
                "{name}: a row for a metric the code does not register"
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "docs/observability.md's metrics table and the metrics the gateway registers disagree:\n  {}",
        wrong.join("\n  ")
    );
}

/// The lines of the first ```console block in `section`, as written.
fn console_block(rel: &str, heading_text: &str) -> Vec<String> {
    let text = read(rel);
    let mut lines = text
        .lines()
        .skip_while(|l| !(l.starts_with('#') && l.contains(heading_text)));
    let _ = lines
        .next()
        .unwrap_or_else(|| panic!("{rel}: no heading {heading_text:?}"));
    lines
        .skip_while(|l| l.trim() != "```console")
        .skip(1)
        .take_while(|l| l.trim() != "```")
        .map(str::to_string)
        .collect()
}

/// `$ ratewall a 'b c'` -> ["a", "b c"] (single quotes only, as the docs write them).
fn shell_words(command: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let (mut quoted, mut any) = (false, false);
    for c in command.chars() {
        match c {
            '\'' => {
                quoted = !quoted;
                any = true;
            }
            c if c.is_whitespace() && !quoted => {
                if any {
                    words.push(std::mem::take(&mut word));
                    any = false;
                }
            }
            c => {
                word.push(c);
                any = true;
            }
        }
    }
    if any {
        words.push(word);
    }
    words
}

/// Whether `actual` is `expected`, where an expected line `…` stands for one or more lines.
fn matches_with_ellipsis(expected: &[String], actual: &[&str]) -> bool {
    match expected.split_first() {
        None => actual.is_empty(),
        Some((e, rest)) if e.trim() == "…" => {
            (1..=actual.len()).any(|n| matches_with_ellipsis(rest, &actual[n..]))
        }
        Some((e, rest)) => {
            actual.first().is_some_and(|a| a.trim_end() == e.trim_end())
                && matches_with_ellipsis(rest, &actual[1..])
        }
    }
}

/// The tag secret docs/observability.md's `check` example was printed with.
const DOCS_TAG_SECRET: &str = "the-docs-example-secret";

#[test]
fn the_check_example_is_what_check_prints_on_the_shipped_config() {
    let _watch = common::watchdog();
    let block = console_block("docs/observability.md", "Testing a config without traffic");
    let (command, expected) = block.split_first().expect("a console block");
    let words = shell_words(command.strip_prefix("$ ").expect("a $ command"));
    assert_eq!(words[0], "ratewall", "{command}");
    let args: Vec<&str> = words[1..].iter().map(String::as_str).collect();
    // Identity tags are keyed by the deployment's secret: the example's is the one the
    // docs name beside it.
    let out = ratewall()
        .args(&args)
        .env("RATEWALL_TAG_SECRET", DOCS_TAG_SECRET)
        .output()
        .expect("run ratewall");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let actual = String::from_utf8(out.stdout).expect("utf-8 output");
    let actual: Vec<&str> = actual.lines().collect();
    let doc = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/observability.md"),
    )
    .expect("docs/observability.md");
    assert!(
        doc.contains(&format!("RATEWALL_TAG_SECRET={DOCS_TAG_SECRET}")),
        "the docs name the example's secret"
    );
    assert!(
        matches_with_ellipsis(expected, &actual),
        "docs/observability.md's `{command}` shows:\n{}\n\nratewall prints:\n{}",
        expected.join("\n"),
        actual.join("\n")
    );
}

/// `ratewall --help` names the environment a newcomer needs: the admin token's variable,
/// the overrides' and `RUST_LOG`.
#[test]
fn help_names_the_environment() {
    let _watch = common::watchdog();
    let help = stdout_of(&["--help"]);
    for var in [
        "RATEWALL_ADMIN_TOKEN",
        "RUST_LOG",
        "RATEWALL_LISTEN",
        "RATEWALL_TLS_LISTEN",
    ] {
        assert!(help.contains(var), "--help does not name {var}:\n{help}");
    }
}

/// The Docker image as written (CI cannot build it, so it is checked by reading): its
/// runtime stage has the system's CA roots an https:// upstream is verified against; the
/// README's `docker run` publishes the TLS port and runs as the owner of the mounted
/// config (a 0600 key is unreadable by the image's own uid); the Dockerfile's comment
/// shows the same command.
#[test]
fn the_docker_image_and_its_run_command_fit_together() {
    let _watch = common::watchdog();
    let dockerfile = read("Dockerfile");
    let runtime = dockerfile
        .rsplit("\nFROM ")
        .next()
        .expect("a runtime stage");
    assert!(
        runtime.contains("apt-get install") && runtime.contains("ca-certificates"),
        "the runtime stage installs ca-certificates:\n{runtime}"
    );
    let readme = read("README.md");
    let docker = &readme[readme.find("## Docker").expect("README: ## Docker")..];
    let run: String = docker
        .split("```sh\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("README's docker block")
        .lines()
        .filter(|l| !l.starts_with("docker build"))
        .collect::<Vec<_>>()
        .join("\n");
    for part in [
        "-p 8443:8443",
        "--user \"$(id -u):$(id -g)\"",
        "RATEWALL_LISTEN=0.0.0.0:8080",
    ] {
        assert!(
            run.contains(part),
            "README's docker run lacks {part}:\n{run}"
        );
    }
    // The Dockerfile's comment: the same command, line by line.
    let commented: Vec<String> = dockerfile
        .lines()
        .filter_map(|l| l.strip_prefix("#   "))
        .map(|l| l.trim().to_string())
        .collect();
    for line in run.lines() {
        assert!(
            commented.iter().any(|c| c == line.trim()),
            "the Dockerfile's comment lacks {line:?}"
        );
    }
    assert!(
        docker.contains("RATEWALL_TLS_LISTEN=0.0.0.0:8443"),
        "README says how the TLS listener listens in a container"
    );
}

/// The README's set-up facts hold: the Rust version it names is Cargo.toml's
/// `rust-version`, and it quotes no performance ratio of its own (docs/performance.md holds
/// every figure, with its run and its spread).
#[test]
fn the_readme_names_the_rust_version_and_quotes_no_ratio() {
    let _watch = common::watchdog();
    let readme = read("README.md");
    let cargo = read("Cargo.toml");
    let version = cargo
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = \""))
        .and_then(|v| v.strip_suffix('"'))
        .expect("Cargo.toml: rust-version");
    assert!(
        readme.contains(&format!("Rust {version} or newer")),
        "README names Rust {version}"
    );
    let perf = &readme[readme.find("## Performance").expect("## Performance")..];
    let perf = &perf[..perf[3..].find("\n## ").map_or(perf.len(), |e| e + 3)];
    let ratio = perf.split_whitespace().find(|w| {
        let w = w.trim_matches(|c: char| !c.is_ascii_digit() && c != '×' && c != '.');
        w.ends_with('×') && w[..w.len() - '×'.len_utf8()].parse::<f64>().is_ok()
    });
    assert_eq!(ratio, None, "README's Performance quotes a ratio");
}
