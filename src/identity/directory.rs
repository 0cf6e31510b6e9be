//! The key directory: the API keys an operator adds, re-plans and revokes at runtime, as
//! SHA-256 digests with their plans (and the labels operators know them by). Read on every request that carries a key, without a
//! lock: a snapshot (`ArcSwap<HashMap>`) swapped whole on each change; one per process,
//! shared across reloads.
//!
//! What fills it depends on the store: with the memory store, the keys file (`[keys]
//! file`), which the admin API rewrites; with Redis or Redis Cluster, the hash
//! `<prefix>:keys`, kept in step by `limiter::redis::directory` (pub/sub for speed, a
//! full resynchronisation for what pub/sub lost). Keys listed inline in `[keys.plans]`
//! (and, with Redis, the keys file's) are static config, outside it: a request's key is
//! looked up here first, then there (see [`super::Keys`]).
//!
//! Pure: no I/O. Also the wire format of a change (`message`/`parse_message`), the hex
//! of a digest, and the sorted pages `GET /admin/keys` answers with.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use arc_swap::ArcSwap;

/// The SHA-256 of a raw API key: how a listed key is held, everywhere.
pub type KeyDigest = [u8; 32];

/// A digest -> entry map, as one snapshot of the directory holds it.
pub type Entries = HashMap<KeyDigest, Entry>;

/// The longest plan name (as the config allows: 1 to 64 characters).
pub const MAX_PLAN_LEN: usize = 64;

/// The longest label, in characters.
pub const MAX_LABEL_LEN: usize = 64;

/// A listed key: its plan, and the label an operator gave it ("Acme Corp"), shown where
/// operators look (the status page, `/admin/top`, the access line, `ratewall check`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub plan: Arc<str>,
    pub label: Option<Arc<str>>,
}

impl Entry {
    /// As the Redis hash stores it and a change message carries it: the plan, then a
    /// space and the label where there is one. A plan has no spaces, so an entry stored
    /// before labels existed (its plan alone) reads back as it was.
    pub fn encode(&self) -> String {
        match &self.label {
            Some(label) => format!("{} {label}", self.plan),
            None => self.plan.to_string(),
        }
    }

    /// An entry as [`Entry::encode`] writes it; `None` for a bad plan or label.
    pub fn parse(text: &str) -> Option<Entry> {
        let (plan, label) = match text.split_once(' ') {
            Some((plan, label)) => (plan, Some(self::label(label).ok()?)),
            None => (text, None),
        };
        Some(Entry {
            plan: plan_name(plan)?,
            label,
        })
    }
}

impl From<&str> for Entry {
    /// A plan without a label.
    fn from(plan: &str) -> Entry {
        Entry {
            plan: Arc::from(plan),
            label: None,
        }
    }
}

/// A label as an operator may give one: 1 to [`MAX_LABEL_LEN`] characters, no spaces
/// around it, and none of the characters that break, reorder or hide text ([`hides`]):
/// it is shown in a log line and on a page. The error says so in the config's words.
pub fn label(text: &str) -> Result<Arc<str>, String> {
    let count = text.chars().count();
    if count == 0 || count > MAX_LABEL_LEN {
        return Err(format!(
            "a label is 1 to {MAX_LABEL_LEN} characters (this one has {count}), like \"Acme Corp\""
        ));
    }
    if let Some(c) = text.chars().find(|&c| hides(c)) {
        return Err(format!(
            "a label is shown in logs and on pages: no control or invisible characters (it has {})",
            c.escape_unicode()
        ));
    }
    if text.trim() != text {
        return Err("a label has no spaces around it".into());
    }
    Ok(Arc::from(text))
}

/// Characters that break, reorder or hide text on a terminal or in a viewer: controls
/// (C0, DEL, C1), and Unicode's invisible and bidirectional formatting characters. A
/// label may hold none; the access log escapes them in what clients send.
pub fn hides(c: char) -> bool {
    c.is_control()
        || matches!(c,
            '\u{200B}'..='\u{200F}'   // zero-width spaces and joiners, LRM, RLM
            | '\u{2028}' | '\u{2029}' // line and paragraph separators
            | '\u{202A}'..='\u{202E}' // bidirectional embeddings and overrides
            | '\u{2060}'..='\u{2064}' // word joiner, invisible operators
            | '\u{2066}'..='\u{2069}' // bidirectional isolates
            | '\u{FEFF}'              // zero-width no-break space
        )
}

pub struct Directory {
    entries: ArcSwap<Entries>,
    /// Whether any entry has had a label since the set was last replaced whole: a request
    /// looks its key's label up only then.
    labelled: AtomicBool,
    /// Held by whoever changes the set and its backing copy together (the admin API
    /// rewriting the keys file, a reload re-reading it), so that the two never disagree.
    /// Never held across an `.await`.
    writer: Mutex<()>,
}

impl fmt::Debug for Directory {
    /// Its size only: never a digest.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Directory({} keys)", self.len())
    }
}

impl Default for Directory {
    fn default() -> Self {
        Directory::new(Entries::new())
    }
}

impl Directory {
    pub fn new(entries: Entries) -> Directory {
        Directory {
            labelled: AtomicBool::new(entries.values().any(|e| e.label.is_some())),
            entries: ArcSwap::from_pointee(entries),
            writer: Mutex::new(()),
        }
    }

    /// How `digest` is listed here, if it is.
    pub fn get(&self, digest: &KeyDigest) -> Option<Entry> {
        self.entries.load().get(digest).cloned()
    }

    /// `resolve` of the entry `digest` is listed with, if it is: read in place, without
    /// touching its reference counts (the request path's lookup).
    pub fn resolve<R>(&self, digest: &KeyDigest, resolve: impl FnOnce(&Entry) -> R) -> Option<R> {
        self.entries.load().get(digest).map(resolve)
    }

    /// Whether nothing is listed (read without hashing a request's key).
    pub fn is_empty(&self) -> bool {
        self.entries.load().is_empty()
    }

    pub fn len(&self) -> usize {
        self.entries.load().len()
    }

    /// Whether an entry may have a label (see the field).
    pub fn labelled(&self) -> bool {
        self.labelled.load(Ordering::Relaxed)
    }

    fn note_labels<'c>(&self, mut changes: impl Iterator<Item = &'c Change>) {
        if changes.any(|c| matches!(c, Change::Set(_, e) if e.label.is_some())) {
            self.labelled.store(true, Ordering::Relaxed);
        }
    }

    /// The whole set now (for a page, or a rewrite of the keys file).
    pub fn snapshot(&self) -> Arc<Entries> {
        self.entries.load_full()
    }

    /// Apply one change; the entry the key had before it.
    pub fn apply(&self, change: &Change) -> Option<Entry> {
        self.note_labels(std::iter::once(change));
        let mut old = None;
        self.entries.rcu(|current| {
            let mut next = Entries::clone(current);
            old = match change {
                Change::Set(d, entry) => next.insert(*d, entry.clone()),
                Change::Delete(d) => next.remove(d),
            };
            next
        });
        old
    }

    /// Apply several changes in one swap (the messages a subscriber found waiting).
    pub fn apply_all(&self, changes: &[Change]) {
        if changes.is_empty() {
            return;
        }
        self.note_labels(changes.iter());
        self.entries.rcu(|current| {
            let mut next = Entries::clone(current);
            for change in changes {
                match change {
                    Change::Set(d, entry) => next.insert(*d, entry.clone()),
                    Change::Delete(d) => next.remove(d),
                };
            }
            next
        });
    }

    /// Replace the whole set (a resynchronisation, a reload of the keys file).
    pub fn replace(&self, entries: Entries) {
        let labelled = entries.values().any(|e| e.label.is_some());
        self.labelled.store(labelled, Ordering::Relaxed);
        self.entries.store(Arc::new(entries));
    }

    /// The writers' lock (see the field).
    pub fn writer(&self) -> MutexGuard<'_, ()> {
        self.writer.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One change to the directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Set(KeyDigest, Entry),
    Delete(KeyDigest),
}

impl Change {
    pub fn digest(&self) -> &KeyDigest {
        match self {
            Change::Set(d, _) | Change::Delete(d) => d,
        }
    }

    /// As published on `<prefix>:keys:changes`: `set <hex> <plan>`, `set <hex> <plan>
    /// <label>` or `del <hex>`.
    pub fn message(&self) -> String {
        match self {
            Change::Set(d, entry) => format!("set {} {}", hex(d), entry.encode()),
            Change::Delete(d) => format!("del {}", hex(d)),
        }
    }

    /// A published change read back; `None` for anything else (logged by the caller).
    pub fn parse_message(text: &str) -> Option<Change> {
        let (verb, rest) = text.split_once(' ')?;
        match verb {
            "set" => {
                let (d, entry) = rest.split_once(' ')?;
                Some(Change::Set(parse_hex(d)?, Entry::parse(entry)?))
            }
            "del" => Some(Change::Delete(parse_hex(rest)?)),
            _ => None,
        }
    }
}

/// A plan name as a directory entry holds it: 1 to [`MAX_PLAN_LEN`] bytes, printable,
/// no spaces (a message separates its parts with them).
pub fn plan_name(text: &str) -> Option<Arc<str>> {
    let ok = !text.is_empty()
        && text.len() <= MAX_PLAN_LEN
        && text.bytes().all(|b| b.is_ascii_graphic() || b >= 0x80);
    ok.then(|| Arc::from(text))
}

/// 64 lower-case hex digits.
pub fn hex(d: &KeyDigest) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(64);
    for b in d {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
    s
}

/// 64 hex digits (either case) -> a digest; anything else, `None`.
pub fn parse_hex(text: &str) -> Option<KeyDigest> {
    let b = text.as_bytes();
    if b.len() != 64 {
        return None;
    }
    let mut d = [0u8; 32];
    for (i, pair) in b.chunks_exact(2).enumerate() {
        let hi = char::from(pair[0]).to_digit(16)?;
        let lo = char::from(pair[1]).to_digit(16)?;
        d[i] = u8::try_from(hi * 16 + lo).ok()?;
    }
    Some(d)
}

/// One page of a listing: entries sorted by digest, those after `after` (exclusive),
/// with plan `plan` if given, at most `limit` of them; and the cursor of the next page
/// (the last digest given), if more follow.
pub fn page(
    entries: &Entries,
    plan: Option<&str>,
    after: Option<&KeyDigest>,
    limit: usize,
) -> (Vec<(KeyDigest, Entry)>, Option<KeyDigest>) {
    let mut picked: Vec<(KeyDigest, Entry)> = entries
        .iter()
        .filter(|(d, e)| after.is_none_or(|a| *d > a) && plan.is_none_or(|want| &*e.plan == want))
        .map(|(d, p)| (*d, p.clone()))
        .collect();
    picked.sort_unstable_by_key(|e| e.0);
    let more = picked.len() > limit;
    picked.truncate(limit);
    let next = more.then(|| picked.last().map(|(d, _)| *d)).flatten();
    (picked, next)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(n: u8) -> KeyDigest {
        [n; 32]
    }

    #[test]
    fn changes_apply_and_say_the_old_plan() {
        let dir = Directory::default();
        assert!(dir.is_empty());
        assert_eq!(dir.apply(&Change::Set(d(1), "pro".into())), None);
        assert!(!dir.labelled(), "no label yet");
        assert_eq!(dir.get(&d(1)), Some(Entry::from("pro")));
        let before = dir.snapshot();
        assert_eq!(
            dir.apply(&Change::Set(d(1), "free".into())),
            Some(Entry::from("pro"))
        );
        // A snapshot taken before a change keeps what it saw: a request reads one set.
        assert_eq!(before.get(&d(1)), Some(&Entry::from("pro")));
        assert_eq!(dir.apply(&Change::Delete(d(1))), Some(Entry::from("free")));
        assert_eq!(dir.apply(&Change::Delete(d(1))), None);
        assert_eq!(dir.len(), 0);
        dir.apply_all(&[
            Change::Set(d(2), "a".into()),
            Change::Set(d(3), "b".into()),
            Change::Delete(d(2)),
        ]);
        assert_eq!(dir.len(), 1);
        assert_eq!(dir.get(&d(3)), Some(Entry::from("b")));
        dir.replace(Entries::from([(d(4), Entry::from("c"))]));
        assert_eq!((dir.len(), dir.get(&d(3))), (1, None));
        assert_eq!(format!("{dir:?}"), "Directory(1 keys)");
    }

    #[test]
    fn messages_round_trip_and_garbage_is_refused() {
        let set = Change::Set(d(0xab), "pro".into());
        let del = Change::Delete(d(0x01));
        assert_eq!(set.message(), format!("set {} pro", "ab".repeat(32)));
        for c in [&set, &del] {
            assert_eq!(Change::parse_message(&c.message()).as_ref(), Some(c));
        }
        let h = "ab".repeat(32);
        for bad in [
            "",
            "set",
            &format!("set {h}"),
            &format!("set {h} "),
            // Two words: a plan and its label; a label with spaces around it is refused.
            &format!("set {h} pro  Acme"),
            &format!("set {h} pro Acme\nCorp"),
            &format!("put {h} pro"),
            &format!("del {h}x"),
            "del 1234",
            &format!("set {} pro", "zz".repeat(32)),
            &format!("set {h} {}", "p".repeat(MAX_PLAN_LEN + 1)),
        ] {
            assert_eq!(Change::parse_message(bad), None, "{bad:?}");
        }
    }

    /// A label travels with its plan (`set <hex> <plan> <label>`, spaces in the label
    /// kept); an entry stored before labels (its plan alone) reads as it was; a label
    /// that could break a log line or a page is refused.
    #[test]
    fn labels_round_trip_and_bad_ones_are_refused() {
        let acme = Entry {
            plan: Arc::from("pro"),
            label: Some(Arc::from("Acme Corp")),
        };
        assert_eq!(acme.encode(), "pro Acme Corp");
        assert_eq!(Entry::parse("pro Acme Corp"), Some(acme.clone()));
        assert_eq!(Entry::parse("pro"), Some(Entry::from("pro")));
        let dir = Directory::default();
        dir.apply(&Change::Set(d(7), acme.clone()));
        assert!(dir.labelled());
        dir.replace(Entries::from([(d(7), Entry::from("pro"))]));
        assert!(!dir.labelled(), "recounted on a whole replacement");
        let set = Change::Set(d(7), acme);
        assert_eq!(
            set.message(),
            format!("set {} pro Acme Corp", "07".repeat(32))
        );
        assert_eq!(Change::parse_message(&set.message()), Some(set));
        assert_eq!(
            label("Müller GmbH — Süd").as_deref(),
            Ok("Müller GmbH — Süd")
        );
        assert!(label(&"é".repeat(MAX_LABEL_LEN)).is_ok());
        for bad in [
            String::new(),
            "x".repeat(MAX_LABEL_LEN + 1),
            "Acme\nINFO forged=1".into(),
            "Acme\r".into(),
            "tab\there".into(),
            "abc\u{202E}gpj".into(),
            "zero\u{200B}width".into(),
            " Acme".into(),
            "Acme ".into(),
        ] {
            assert!(label(&bad).is_err(), "{bad:?}");
            assert_eq!(Entry::parse(&format!("pro {bad}")), None, "{bad:?}");
        }
        assert_eq!(
            label(&"x".repeat(65)).unwrap_err(),
            "a label is 1 to 64 characters (this one has 65), like \"Acme Corp\""
        );
        assert_eq!(
            label("Acme\nCorp").unwrap_err(),
            "a label is shown in logs and on pages: no control or invisible characters (it has \\u{a})"
        );
    }

    #[test]
    fn hex_is_64_digits_either_case_in_lower_case_out() {
        let mut x = [0u8; 32];
        x[0] = 0xAB;
        x[31] = 0x0f;
        let h = hex(&x);
        assert_eq!(h.len(), 64);
        assert!(h.starts_with("ab") && h.ends_with("0f"));
        assert_eq!(parse_hex(&h), Some(x));
        assert_eq!(parse_hex(&h.to_uppercase()), Some(x));
        assert_eq!(parse_hex(&h[..63]), None);
        assert_eq!(parse_hex(&format!("{h}0")), None);
        assert_eq!(parse_hex(&format!("+{}", &h[1..])), None);
        assert_eq!(parse_hex(&"é".repeat(32)), None);
    }

    /// Pages in order of digest, each key once, the cursor the last digest given.
    #[test]
    fn pages_cover_every_entry_once_in_order() {
        let entries: Entries = (0..=250u8)
            .map(|n| (d(n), Entry::from(if n % 3 == 0 { "pro" } else { "free" })))
            .collect();
        for (plan, want) in [(None, 251), (Some("pro"), 84), (Some("none"), 0)] {
            let mut seen = Vec::new();
            let mut after = None;
            loop {
                let (got, next) = page(&entries, plan, after.as_ref(), 7);
                assert!(got.len() <= 7);
                seen.extend(got.iter().map(|(d, _)| *d));
                match next {
                    Some(n) => after = Some(n),
                    None => break,
                }
            }
            assert_eq!(seen.len(), want, "{plan:?}");
            assert!(seen.windows(2).all(|w| w[0] < w[1]), "sorted, no repeats");
        }
        let (all, next) = page(&entries, None, None, 1000);
        assert_eq!((all.len(), next), (251, None));
        let (one, next) = page(&entries, None, Some(&d(249)), 1);
        assert_eq!((one[0].0, next), (d(250), None));
    }
}
