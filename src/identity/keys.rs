//! API keys: the value a client sends, checked for shape, and the keys an operator lists
//! with their plans (held as digests only).

use std::collections::HashMap;
use std::path::PathBuf;

use http::header::{HeaderMap, HeaderName};
use serde::Deserialize;
use sha2::{Digest, Sha256};

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

/// `[keys]`: the header API keys come in, and the listed keys' plans.
#[derive(Debug)]
pub struct Keys {
    pub header: HeaderName,
    pub unknown: UnknownKeys,
    /// SHA-256 of an API key -> plan name, from `[keys.plans]` and the keys file. Keys
    /// are held as digests only, so the process never holds a listed key it has not seen
    /// in a request.
    plans: HashMap<[u8; 32], String>,
    /// The keys file, if any (re-read on every reload).
    pub file: Option<PathBuf>,
}

impl Keys {
    /// `plans`: [`sha256`] of each listed key -> its plan.
    pub fn new(
        header: HeaderName,
        unknown: UnknownKeys,
        plans: HashMap<[u8; 32], String>,
        file: Option<PathBuf>,
    ) -> Keys {
        Keys {
            header,
            unknown,
            plans,
            file,
        }
    }

    /// The plan `key` maps to, if it is listed.
    pub fn plan_of(&self, key: &[u8]) -> Option<&str> {
        if self.plans.is_empty() {
            return None;
        }
        self.plans.get(&sha256(key)).map(String::as_str)
    }

    /// The plans listed keys have.
    pub fn plan_names(&self) -> impl Iterator<Item = &str> {
        self.plans.values().map(String::as_str)
    }

    /// Whether `other` lists the same keys with the same plans (what a reload compares).
    pub fn same_plans(&self, other: &Keys) -> bool {
        self.plans == other.plans
    }

    /// How many keys are listed.
    pub fn len(&self) -> usize {
        self.plans.len()
    }

    pub fn is_empty(&self) -> bool {
        self.plans.is_empty()
    }
}

/// The SHA-256 of an API key, as listed keys are held.
pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(name: &str, values: &[&[u8]]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_bytes(v).unwrap(),
            );
        }
        h
    }

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

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(crate::seed::proptest_config("identity::keys::fuzz", 256))]

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
