//! The docs stand alone and keep up with the code.
//!
//! - Every table and key of `config/limits.toml` (the commented-out ones too), and every
//!   key the config parser accepts (the fields of the `Raw*` structs in `src/config/`),
//!   has a table row of its own in its table's section of `docs/configuration.md`, and
//!   every table a heading.
//! - README.md and docs/*.md link only to files inside the repository that exist, and to
//!   headings that exist; none mentions a path outside it.
//!
//! Plain text checks on the files as shipped: no gateway is started.

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
        if let Some(h) = header_token(line) {
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
        "RawUpstream" => Place::Section("[upstream]"),
        "RawStore" => Place::Section("[store]"),
        "RawClientIp" => Place::Section("[client_ip]"),
        "RawKeys" => Place::Section("[keys]"),
        "RawResponse" => Place::Section("[response]"),
        "RawRule" => Place::Section("[[rules]]"),
        "RawMatch" => Place::Within("[[rules]]", "match"),
        "RawPlanOverride" => Place::Section("[rules.plans.<plan>]"),
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
                    "Raw{name}: a flattened field; teach tests/docs.rs where its keys go"
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
                "{name}: a table tests/docs.rs does not know; document it in docs/configuration.md and add it to place()"
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
