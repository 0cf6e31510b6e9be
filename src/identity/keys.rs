//! API keys: the value a client sends, checked for shape, and the keys an operator lists
//! with their plans (held as digests only).

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use http::header::{HeaderMap, HeaderName};
use serde::Deserialize;

use super::directory::{Directory, Entries, Entry};

/// How a key is listed ([`Keys::listing`]): its plan, if a rule of this config defines it,
/// and its label, if it has one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Listing<'k> {
    pub plan: Option<&'k str>,
    pub label: Option<Arc<str>>,
}

/// The header API keys come in, unless `[keys] header` says.
pub const DEFAULT_KEY_HEADER: HeaderName = HeaderName::from_static("x-api-key");

/// Longest API key accepted. Longer values are refused rather than hashed.
pub const MAX_KEY_LEN: usize = 1024;

/// An API key as sent, checked for shape. `Ok(None)`: no key was sent.
pub fn api_key<'h>(
    headers: &'h HeaderMap,
    name: &HeaderName,
) -> Result<Option<&'h [u8]>, KeyError> {
    let mut values = headers.get_all(name).iter();
    let Some(v) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    let v = trim(v.as_bytes());
    if v.is_empty() {
        return Ok(None);
    }
    if v.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong);
    }
    Ok(Some(v))
}

fn trim(b: &[u8]) -> &[u8] {
    let start = b
        .iter()
        .position(|c| !c.is_ascii_whitespace())
        .unwrap_or(b.len());
    let end = b
        .iter()
        .rposition(|c| !c.is_ascii_whitespace())
        .map_or(start, |e| e + 1);
    &b[start..end]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("the key header was sent more than once")]
    Repeated,
    #[error("the key is longer than {MAX_KEY_LEN} bytes")]
    TooLong,
    #[error("the credential is longer than {} bytes", super::MAX_CREDENTIAL_LEN)]
    CredentialTooLong,
}

/// What to do with an API key that is not listed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnknownKeys {
    /// Limited by the rules' defaults (no plan).
    #[default]
    Allow,
    /// Refused with 401.
    Reject,
}

/// `[keys]`: the header API keys come in, and the listed keys' plans: static ones (the
/// config's), and the runtime [`Directory`], shared across reloads.
#[derive(Debug)]
pub struct Keys {
    pub header: HeaderName,
    pub unknown: UnknownKeys,
    /// SHA-256 of an API key -> its plan and label, listed in the config: `[keys.plans]`,
    /// and the keys file with a shared store (with the memory store the keys file is the
    /// directory's). Keys are held as digests only, so the process never holds a listed
    /// key it has not seen in a request.
    plans: Entries,
    /// Whether an entry of `plans` has a label.
    labelled: bool,
    /// The keys listed at runtime, looked up before `plans`.
    directory: Arc<Directory>,
    /// Whether `directory` is the keys file's (the memory store), and what the file held
    /// when this config was loaded.
    file_entries: Option<Entries>,
    /// The keys file, if any (re-read on every reload).
    pub file: Option<PathBuf>,
    /// The plans some rule defines: the only ones a key may be given at runtime.
    defined: BTreeSet<String>,
    /// How often a shared store's directory is read whole (`[keys] resync`).
    pub resync: Duration,
    /// The unknown keys each client address sent (`[keys] failures`; counted only with
    /// `unknown = "reject"`): past its allowance, an address's keys are not looked up.
    pub failures: super::failures::Failures,
}

/// `[keys] failures`' default: 20 unknown keys at once per client address, then one more
/// every 6 s ("10/m").
pub const DEFAULT_FAILURES: super::failures::Allowance = super::failures::Allowance {
    burst: 20,
    every_ms: 6_000,
};

/// `[keys] resync`'s default.
pub const DEFAULT_RESYNC: Duration = Duration::from_secs(30);

impl Keys {
    /// `plans`: [`sha256`] of each listed key -> its plan. No runtime directory: see
    /// [`Keys::with_directory`].
    pub fn new(
        header: HeaderName,
        unknown: UnknownKeys,
        plans: HashMap<[u8; 32], String>,
        file: Option<PathBuf>,
    ) -> Keys {
        Keys {
            header,
            unknown,
            defined: plans.values().cloned().collect(),
            plans: plans
                .into_iter()
                .map(|(d, p)| (d, Entry::from(p.as_str())))
                .collect(),
            labelled: false,
            directory: Arc::default(),
            file_entries: None,
            file,
            resync: DEFAULT_RESYNC,
            failures: super::failures::Failures::new(DEFAULT_FAILURES),
        }
    }

    /// The labels of listed keys (a label of a key not in `plans` is not kept).
    pub fn with_labels(mut self, labels: HashMap<[u8; 32], Arc<str>>) -> Self {
        for (d, label) in labels {
            if let Some(entry) = self.plans.get_mut(&d) {
                entry.label = Some(label);
                self.labelled = true;
            }
        }
        self
    }

    /// Unknown keys are allowed `allowance` per client address (`[keys] failures`).
    pub fn with_failures(mut self, allowance: super::failures::Allowance) -> Self {
        self.failures = super::failures::Failures::new(allowance);
        self
    }

    /// The runtime directory starts with `file_entries` (the keys file's, with the memory
    /// store), runtime plans may be any of `defined`; a shared store's directory is
    /// read whole every `resync`.
    pub fn with_directory(
        mut self,
        file_entries: Option<Entries>,
        defined: BTreeSet<String>,
        resync: Duration,
    ) -> Keys {
        self.directory = Arc::new(Directory::new(file_entries.clone().unwrap_or_default()));
        self.file_entries = file_entries;
        self.defined = defined;
        self.resync = resync;
        self
    }

    /// Take over `old`'s directory (a reload: it outlives configs). With the memory
    /// store it is filled again from the keys file: `reread` reads it now, under the
    /// writers' lock (so that no admin change made since this config was parsed is
    /// lost), or else what the file held at load serves.
    pub fn adopt(&mut self, old: &Keys, reread: impl FnOnce(&Keys) -> Option<Entries>) {
        let directory = old.directory.clone();
        if let Some(loaded) = &self.file_entries {
            let _writing = directory.writer();
            let entries = reread(self).unwrap_or_else(|| loaded.clone());
            directory.replace(entries);
        } else if old.file_entries.is_some() {
            // From the keys file to a shared store: its keys are static now, and the
            // store's follower fills the directory.
            directory.replace(Entries::new());
        }
        self.directory = directory;
    }

    pub fn directory(&self) -> &Arc<Directory> {
        &self.directory
    }

    /// Whether the runtime directory is the keys file's (the memory store).
    pub fn directory_in_file(&self) -> bool {
        self.file_entries.is_some()
    }

    /// Whether `digest` is listed in the config itself (inline, or in a shared store's
    /// keys file): not the admin API's to change.
    pub fn static_plan(&self, digest: &[u8; 32]) -> Option<&str> {
        self.plans.get(digest).map(|e| &*e.plan)
    }

    /// The keys the config itself lists, with their plans and labels.
    pub fn static_entries(&self) -> impl Iterator<Item = (&[u8; 32], &Entry)> {
        self.plans.iter()
    }

    /// Whether any listed key may have a label (the config's, or the runtime directory's):
    /// a request's key's label is looked up only then.
    pub fn labelled(&self) -> bool {
        self.labelled || self.directory.labelled()
    }

    /// Every label known now, the config's and the runtime directory's (which, with the
    /// memory store, holds the keys file's), with each key's plan, sorted by label: what
    /// `ratewall check` names. A runtime entry hides the config's for its key.
    pub fn labels(&self) -> Vec<(String, String)> {
        let runtime = self.directory.snapshot();
        let mut out: Vec<(String, String)> = self
            .plans
            .iter()
            .filter(|(d, _)| !runtime.contains_key(*d))
            .map(|(_, e)| e)
            .chain(runtime.values())
            .filter_map(|e| Some((e.label.as_deref()?.to_string(), e.plan.to_string())))
            .collect();
        out.sort_unstable();
        out
    }

    /// Whether `plan` is one a rule defines.
    pub fn defines(&self, plan: &str) -> bool {
        self.defined.contains(plan)
    }

    /// The plans rules define, sorted.
    pub fn defined(&self) -> impl Iterator<Item = &str> {
        self.defined.iter().map(String::as_str)
    }

    /// How `key` is listed: `None`, not at all; else with its plan if a rule of this
    /// config defines it (a runtime entry may name a plan only another gateway's config
    /// defines: the key is known, and gets the rules' own limits), and its label. The
    /// runtime directory first, then the config's own.
    pub fn listing(&self, key: &[u8]) -> Option<Listing<'_>> {
        if self.plans.is_empty() && self.directory.is_empty() {
            return None;
        }
        let digest = sha256(key);
        if let Some(listing) = self.directory.resolve(&digest, |e| Listing {
            plan: self.defined.get(&*e.plan).map(String::as_str),
            label: e.label.clone(),
        }) {
            return Some(listing);
        }
        self.plans.get(&digest).map(|e| Listing {
            plan: Some(&*e.plan),
            label: e.label.clone(),
        })
    }

    /// The plan `key` maps to, if it is listed with one.
    pub fn plan_of(&self, key: &[u8]) -> Option<&str> {
        self.listing(key)?.plan
    }

    /// The plans listed keys have.
    pub fn plan_names(&self) -> impl Iterator<Item = &str> {
        self.plans.values().map(|e| &*e.plan)
    }

    /// Whether `other` lists the same keys with the same plans and labels in its files
    /// (what a reload compares).
    pub fn same_plans(&self, other: &Keys) -> bool {
        self.plans == other.plans && self.file_entries == other.file_entries
    }

    /// How many keys the config lists (inline and in the keys file).
    pub fn len(&self) -> usize {
        self.plans.len() + self.file_entries.as_ref().map_or(0, HashMap::len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The SHA-256 of an API key, as listed keys are held.
pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    out.copy_from_slice(ring::digest::digest(&ring::digest::SHA256, bytes).as_ref());
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::tests::headers;

    #[test]
    fn api_keys_are_checked_for_shape() {
        let name = HeaderName::from_static("x-api-key");
        assert_eq!(
            api_key(&headers("x-api-key", &[b" k1 "]), &name),
            Ok(Some(&b"k1"[..]))
        );
        assert_eq!(api_key(&headers("x-api-key", &[b""]), &name), Ok(None));
        assert_eq!(api_key(&HeaderMap::new(), &name), Ok(None));
        assert_eq!(
            api_key(&headers("x-api-key", &[b"a", b"b"]), &name),
            Err(KeyError::Repeated)
        );
        let long = vec![b'a'; MAX_KEY_LEN + 1];
        assert_eq!(
            api_key(&headers("x-api-key", &[&long]), &name),
            Err(KeyError::TooLong)
        );
        assert_eq!(
            api_key(&headers("x-api-key", &[b"\xff\xfek"]), &name),
            Ok(Some(&b"\xff\xfek"[..]))
        );
    }

    /// The runtime directory is read first, then the config's keys; a key deleted from
    /// the directory is refused (`unknown = "reject"`) from the next request on; a runtime
    /// plan no rule here defines leaves the key listed, with the rules' own limits.
    #[test]
    fn the_directory_comes_first_and_unknown_reject_consults_it() {
        use crate::identity::directory::Change;
        use crate::identity::{ClientIp, Key, KeyKind, MissingKey, Refusal, Requester};
        let inline = HashMap::from([(sha256(b"inline"), "pro".to_string())]);
        let keys = Keys::new(DEFAULT_KEY_HEADER, UnknownKeys::Reject, inline, None).with_directory(
            None,
            BTreeSet::from(["pro".to_string(), "gold".to_string()]),
            DEFAULT_RESYNC,
        );
        let rule = Key {
            kind: KeyKind::ApiKey,
            missing: MissingKey::Reject,
        };
        let trust = ClientIp::default();
        let ask = |key: &str| {
            let h = headers("x-api-key", &[key.as_bytes()]);
            let r = Requester::new(&h, "192.0.2.1".parse().unwrap(), &keys, &trust);
            (r.identify(&rule).map(|_| ()), r.plan().map(str::to_string))
        };
        assert_eq!(ask("inline"), (Ok(()), Some("pro".into())));
        assert_eq!(ask("runtime"), (Err(Refusal::UnknownKey), None));
        let dir = keys.directory();
        dir.apply(&Change::Set(sha256(b"runtime"), "gold".into()));
        assert_eq!(ask("runtime"), (Ok(()), Some("gold".into())));
        // A runtime entry overrides the config's.
        dir.apply(&Change::Set(sha256(b"inline"), "gold".into()));
        assert_eq!(ask("inline"), (Ok(()), Some("gold".into())));
        // A plan only another gateway's config defines: listed, no plan here.
        dir.apply(&Change::Set(sha256(b"runtime"), "enterprise".into()));
        assert_eq!(ask("runtime"), (Ok(()), None));
        dir.apply(&Change::Delete(sha256(b"runtime")));
        assert_eq!(ask("runtime"), (Err(Refusal::UnknownKey), None));
        // One lookup per request: a change after it does not split a request's rules.
        let h = headers("x-api-key", &[b"inline"]);
        let r = Requester::new(&h, "192.0.2.1".parse().unwrap(), &keys, &trust);
        assert_eq!(r.plan(), Some("gold"));
        dir.apply(&Change::Delete(sha256(b"inline")));
        assert_eq!(r.plan(), Some("gold"));
        assert_eq!(ask("inline"), (Ok(()), Some("pro".into())));
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        crate::proptest_seeds! {
            #![cases(256)]

            /// Any key header bytes: a clean answer, never a panic; accepted keys are bounded.
            #[test]
            fn any_key_header_is_handled(lines in prop::collection::vec(prop::collection::vec(prop_oneof![0x20u8..0x7f, 0x80u8..=0xff], 0..1100), 0..3)) {
                let lines: Vec<&[u8]> = lines.iter().map(Vec::as_slice).collect();
                let h = headers("x-api-key", &lines);
                if let Ok(Some(k)) = api_key(&h, &HeaderName::from_static("x-api-key")) {
                    prop_assert!(!k.is_empty() && k.len() <= MAX_KEY_LEN);
                    prop_assert_eq!(lines.len(), 1);
                }
            }
        }
    }
}
