//! A claim of a bearer token named by its dotted path (`org.id`), as rules count by it
//! (`key = "jwt:org.id"`), plans are read from it (`plan_claim`) and headers made of it
//! (`forward_claims`).

use std::borrow::Cow;
use std::fmt;

use serde_json::{Map, Value};

/// A claim of a token by its dotted path (`org.id`: the `id` member of the `org` object).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ClaimPath {
    /// As written, for digests, errors and `ratewall check`.
    text: String,
    segments: Vec<String>,
}

impl ClaimPath {
    /// `text`, or why it is not a claim path (empty, or an empty segment).
    pub fn parse(text: &str) -> Result<ClaimPath, String> {
        let text = text.trim();
        let segments: Vec<String> = text.split('.').map(str::to_string).collect();
        if text.is_empty() || segments.iter().any(String::is_empty) {
            return Err(format!(
                "invalid claim path {text:?}: a claim name, or names joined by dots (org.id)"
            ));
        }
        Ok(ClaimPath {
            text: text.to_string(),
            segments,
        })
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The claim's value in `claims`, if it has one.
    pub fn lookup<'c>(&self, claims: &'c Map<String, Value>) -> Option<&'c Value> {
        let (first, rest) = self.segments.split_first()?;
        let mut v = claims.get(first)?;
        for s in rest {
            v = v.as_object()?.get(s)?;
        }
        Some(v)
    }

    /// The claim as an identity's or a header's text: a string as it is, a number or a
    /// boolean as its JSON text. An object, an array, null or no claim: none.
    pub fn text<'c>(&self, claims: &'c Map<String, Value>) -> Option<Cow<'c, str>> {
        match self.lookup(claims)? {
            Value::String(s) => Some(Cow::Borrowed(s)),
            v @ (Value::Number(_) | Value::Bool(_)) => Some(Cow::Owned(v.to_string())),
            _ => None,
        }
    }
}

impl fmt::Display for ClaimPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}
