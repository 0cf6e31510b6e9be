//! `[client_ip]` and `[keys]`: whose forwarding headers are believed, the API key header,
//! and the listed keys' plans (inline, or in a keys file of their own).

use std::collections::{BTreeSet, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

use super::values::{Cidr, Header, HumanDuration, KeyListing};
use super::{from_toml, ConfigError, Invalid};
use crate::identity::directory::{self, Entries, Entry};
use crate::identity::{
    sha256, ClientIp, ForwardingHeader, Keys, UnknownKeys, DEFAULT_KEY_HEADER, DEFAULT_RESYNC,
};

/// `[keys] resync`'s bounds: often enough to matter, rarely enough not to load Redis.
const RESYNC_BOUNDS: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(3600));

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawClientIp {
    #[serde(default)]
    trusted_proxies: Vec<Cidr>,
    #[serde(default)]
    header: ForwardingHeader,
}

impl RawClientIp {
    pub(super) fn validate(self) -> ClientIp {
        ClientIp {
            trusted_proxies: self.trusted_proxies.into_iter().map(|c| c.0).collect(),
            header: self.header,
        }
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawKeys {
    header: Option<Header>,
    #[serde(default)]
    unknown: UnknownKeys,
    #[serde(default)]
    plans: HashMap<String, Spanned<KeyListing>>,
    pub(super) file: Option<Spanned<String>>,
    resync: Option<Spanned<HumanDuration>>,
    failures: Option<super::values::RawFailures>,
}

/// The keys file: `[plans]`, API key (or `sha256:<hex>` of one) -> plan name, or
/// `{ plan, label }`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKeysFile {
    #[serde(default)]
    plans: HashMap<String, Spanned<KeyListing>>,
}

/// A listed key's plan must be one some rule has a `[rules.plans.<plan>]` table for
/// (`defined`): a typo (`"Pro"` for `"pro"`) would otherwise give the key no plan at all,
/// and its customer the default limits, without a word.
fn check_plan(plan: &str, defined: &BTreeSet<&str>) -> Result<(), String> {
    if defined.contains(plan) {
        return Ok(());
    }
    let mut m = format!("plan {plan:?} is not defined by any rule: ");
    if defined.is_empty() {
        m.push_str("no rule has a [rules.plans.<plan>] table");
    } else {
        let names: Vec<String> = defined.iter().map(|p| format!("{p:?}")).collect();
        m.push_str(&format!("the rules define {}", names.join(", ")));
        if let Some(near) = defined.iter().find(|p| p.eq_ignore_ascii_case(plan)) {
            m.push_str(&format!(" (did you mean {near:?}?)"));
        }
    }
    m.push_str(
        "; a key with the rules' default limits needs no plan, or an empty [rules.plans.<plan>] table",
    );
    Err(m)
}

impl RawKeys {
    /// Every listed key as a digest: inline ones, then `file`'s (its path, and what
    /// [`keys_file_entries`] made of it). Every plan must be one of `defined`. With the
    /// memory store (`shared` false) the keys file's entries are the runtime directory's,
    /// which the admin API changes; with a shared store they are static, like inline ones.
    pub(super) fn validate(
        self,
        file: Option<(PathBuf, HashMap<[u8; 32], Entry>)>,
        defined: &BTreeSet<&str>,
        shared: bool,
    ) -> Result<Keys, Invalid> {
        let resync = match &self.resync {
            None => DEFAULT_RESYNC,
            Some(r) => {
                let v = r.get_ref().0;
                let (low, high) = RESYNC_BOUNDS;
                if v < low || v > high {
                    return Err(Invalid::new(
                        Some(r.span()),
                        "keys.resync",
                        "resync is 1s to 1h: how often a shared store's key directory is read whole",
                    ));
                }
                v
            }
        };
        let failures = match &self.failures {
            Some(f) => f.allowance("keys")?,
            None => crate::identity::DEFAULT_KEY_FAILURES,
        };
        let mut listed: HashMap<[u8; 32], String> = HashMap::new();
        let mut labels: HashMap<[u8; 32], Arc<str>> = HashMap::new();
        let mut inline: Vec<(&String, &Spanned<KeyListing>)> = self.plans.iter().collect();
        inline.sort_by(|a, b| a.0.cmp(b.0));
        for (k, spanned) in inline {
            let listing = spanned.get_ref();
            let d =
                key_digest(k).map_err(|m| Invalid::new(Some(spanned.span()), "keys.plans", m))?;
            check_plan(&listing.plan, defined)
                .map_err(|m| Invalid::new(Some(spanned.span()), "keys.plans.<key>", m))?;
            let label = checked_label(listing.label.as_deref())
                .map_err(|m| Invalid::new(Some(spanned.span()), "keys.plans.<key>", m))?;
            if listed.get(&d).is_some_and(|p| *p != listing.plan)
                || (listed.contains_key(&d) && labels.get(&d) != label.as_ref())
            {
                return Err(Invalid::new(
                    Some(spanned.span()),
                    "keys.plans",
                    "one API key is listed twice with different plans or labels (as itself and as its sha256:)",
                ));
            }
            listed.insert(d, listing.plan.clone());
            if let Some(label) = label {
                labels.insert(d, label);
            }
        }
        let (path, from_file) = match file {
            Some((p, k)) => (Some(p), k),
            None => (None, HashMap::new()),
        };
        let mut file_entries = Entries::new();
        for (d, entry) in from_file {
            let plan = &*entry.plan;
            if let Some(inline) = listed.get(&d).filter(|p| **p != plan) {
                return Err(Invalid::new(
                    self.file.as_ref().map(Spanned::span),
                    "keys.file",
                    format!("an API key in the keys file has plan {plan:?} there and {inline:?} in [keys.plans]"),
                ));
            }
            if shared {
                listed.insert(d, plan.to_string());
                if let Some(label) = &entry.label {
                    labels.insert(d, label.clone());
                }
            } else {
                file_entries.insert(d, entry);
            }
        }
        // With the memory store and no file, the directory is empty and stays so (the
        // admin API refuses changes that would not survive a restart).
        let in_file = (!shared && path.is_some()).then_some(file_entries);
        Ok(Keys::new(
            self.header.map_or(DEFAULT_KEY_HEADER, |h| h.0),
            self.unknown,
            listed,
            path,
        )
        .with_directory(
            in_file,
            defined.iter().map(|p| p.to_string()).collect(),
            resync,
        )
        .with_labels(labels)
        .with_failures(failures))
    }
}

/// A listed key's label, if it has one, as [`directory::label`] takes it.
fn checked_label(label: Option<&str>) -> Result<Option<Arc<str>>, String> {
    label.map(directory::label).transpose()
}

/// An API key as listed: the key itself, or `sha256:<64 hex digits>` of it.
fn key_digest(listed: &str) -> Result<[u8; 32], String> {
    if let Some(hex) = listed.strip_prefix("sha256:") {
        return crate::identity::directory::parse_hex(hex.trim()).ok_or_else(|| {
            format!("{listed:?}: a sha256: key is 64 hex digits (`printf %s KEY | sha256sum`)")
        });
    }
    // A key no client can send (empty, control characters) would never match.
    if listed.is_empty() || http::HeaderValue::from_str(listed).is_err() {
        return Err("an API key is a non-empty header value without control characters".into());
    }
    Ok(sha256(listed.as_bytes()))
}

/// Read a keys file (see [`keys_file_entries`]).
fn load_keys_file(
    path: &Path,
    defined: &BTreeSet<&str>,
) -> Result<HashMap<[u8; 32], Entry>, ConfigError> {
    keys_file_entries(&super::read(path)?, path, defined)
}

/// A keys file's `text`: `[plans]`, each API key (or `sha256:<hex>`) -> plan name or `{
/// plan, label }`, each plan one of `defined`. Errors name the keys file (`path`), its
/// line and column.
pub(super) fn keys_file_entries(
    text: &str,
    path: &Path,
    defined: &BTreeSet<&str>,
) -> Result<HashMap<[u8; 32], Entry>, ConfigError> {
    let raw: RawKeysFile = from_toml(text, path, "plans.")?;
    let mut out = HashMap::with_capacity(raw.plans.len());
    // In file order, so the first bad line is the one reported.
    let mut entries: Vec<(String, Spanned<KeyListing>)> = raw.plans.into_iter().collect();
    entries.sort_by_key(|(_, p)| p.span().start);
    for (listed, spanned) in entries {
        let span = spanned.span();
        let listing = spanned.into_inner();
        let invalid = |m: String| Invalid::new(Some(span.clone()), "plans", m).locate(text, path);
        let d = key_digest(&listed).map_err(invalid)?;
        check_plan(&listing.plan, defined)
            .map_err(|m| Invalid::new(Some(span.clone()), "plans.<key>", m).locate(text, path))?;
        let label = checked_label(listing.label.as_deref())
            .map_err(|m| Invalid::new(Some(span.clone()), "plans.<key>", m).locate(text, path))?;
        let entry = Entry {
            plan: Arc::from(listing.plan),
            label,
        };
        if out.get(&d).is_some_and(|e: &Entry| *e != entry) {
            return Err(invalid(
                "one API key is listed twice with different plans or labels (as itself and as its sha256:)"
                    .into(),
            ));
        }
        out.insert(d, entry);
    }
    Ok(out)
}

/// Read the keys file again, as a runtime directory holds it (a reload, under the
/// directory's writers' lock; see [`Keys::adopt`]).
pub fn reread_keys_file(path: &Path, keys: &Keys) -> Result<Entries, ConfigError> {
    let defined: BTreeSet<&str> = keys.defined().collect();
    load_keys_file(path, &defined)
}

/// Rewrite the keys file with `entries`, atomically: a temporary file in the same folder,
/// written and flushed to disk, renamed over the file, and the folder flushed (so that the
/// rename itself survives a crash). A reader sees the old file or the new one, never part
/// of one. Entries are written as digests, sorted: raw keys an operator wrote become
/// `sha256:` lines, and comments are not kept. The file keeps its permissions.
pub fn write_keys_file(path: &Path, entries: &Entries) -> std::io::Result<()> {
    let mut sorted: Vec<(&[u8; 32], &Entry)> = entries.iter().collect();
    sorted.sort_unstable_by(|a, b| a.0.cmp(b.0));
    let mut text = String::from(
        "# API key digests -> plans (and labels). Rewritten by ratewall on every change through\n\
         # the admin API (/admin/keys): comments are not kept, raw keys become their sha256.\n[plans]\n",
    );
    // Plans and labels are TOML basic strings: escaped where they need it.
    let quoted = |s: &str| toml::Value::String(s.to_string()).to_string();
    for (d, entry) in sorted {
        let value = match &entry.label {
            None => quoted(&entry.plan),
            Some(label) => format!(
                "{{ plan = {}, label = {} }}",
                quoted(&entry.plan),
                quoted(label)
            ),
        };
        text.push_str(&format!("\"sha256:{}\" = {value}\n", directory::hex(d)));
    }
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .map_or_else(|| "keys".into(), |n| n.to_string_lossy().into_owned());
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let written = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        if let Ok(meta) = std::fs::metadata(path) {
            f.set_permissions(meta.permissions())?;
        }
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The file the admin API writes reads back as the same entries, with digests only,
    /// sorted; its permissions are kept and no temporary file is left.
    #[test]
    fn a_rewritten_keys_file_reads_back_the_same() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.toml");
        std::fs::write(&path, "# mine\n[plans]\n\"raw-key\" = \"pro\"\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        let entries: Entries = [
            (sha256(b"raw-key"), Entry::from("pro")),
            ([0u8; 32], Entry::from("gold \"quoted\"")),
            (
                [0xff; 32],
                Entry {
                    plan: Arc::from("pro"),
                    label: Some(Arc::from("Acme \"Corp\" — Süd")),
                },
            ),
        ]
        .into_iter()
        .collect();
        write_keys_file(&path, &entries).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            !text.contains("raw-key") && !text.contains("# mine"),
            "{text}"
        );
        let zeros = text.find(&"00".repeat(32)).unwrap();
        let ones = text.find(&"ff".repeat(32)).unwrap();
        assert!(zeros < ones, "sorted by digest:\n{text}");
        let defined = BTreeSet::from(["pro", "gold \"quoted\""]);
        let back = load_keys_file(&path, &defined).unwrap();
        assert_eq!(back.len(), 3);
        assert_eq!(back, entries, "labels too");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o640);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        // A folder that cannot be written: an error, the file as it was.
        assert!(write_keys_file(&dir.path().join("no/such/keys.toml"), &entries).is_err());
    }
}
