//! `reserve = "max_tokens"` (issues 27 and 41): what a request to an LLM API asks the
//! model for at most, as its own body says — the most a rule reserves for it before the
//! answer reports what it used.
//!
//! The fields that bound an answer are the Chat Completions' `max_tokens` and
//! `max_completion_tokens` and the Responses API's `max_output_tokens`; every top-level
//! occurrence of each counts, the largest valid one wins ([`asked_of`]). What a body that
//! says none reserves is each rule's `default_reserve`, or it is refused with
//! [`Unreadable::status`] (`on_unreadable = "reject"`). The gateway reads the body
//! (`proxy/tokens.rs`) whatever its `Content-Type` and framing.

use std::fmt;

use http::StatusCode;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// The largest body read for its `max_tokens`.
pub const MAX_BODY: u64 = 1 << 20;

/// The fields whose value bounds the tokens of the answer.
const BOUNDS: [&str; 3] = ["max_tokens", "max_completion_tokens", "max_output_tokens"];

/// The fields that ask for several answers, each up to the bound: the Chat Completions'
/// `n` (choices) and the Completions' `best_of` (candidates generated, the best returned).
const MULTIPLES: [&str; 2] = ["n", "best_of"];

/// UTF-8's byte order mark: one is skipped at the body's start, as Python's `utf-8-sig`
/// and .NET's readers do.
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// What a request asks the model for at most, as its body says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Asked {
    /// The largest of its bounds (`max_tokens`, …), and the length of the body it was
    /// read from (the prompt's size, see [`prompt_estimate`]).
    Tokens { max: u64, body_bytes: u64 },
    /// Why its bounds could not be read.
    Unreadable(Unreadable),
}

impl Asked {
    /// The tokens asked for, where the body said.
    pub fn max(self) -> Option<u64> {
        match self {
            Asked::Tokens { max, .. } => Some(max),
            Asked::Unreadable(_) => None,
        }
    }
}

/// Why a request's `max_tokens` could not be read: a rule reserves its `default_reserve`
/// for it, or refuses it with [`Unreadable::status`] (`on_unreadable = "reject"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unreadable {
    /// No body at all (none announced, an empty one, or a `CONNECT`: an HTTP/2 extended
    /// CONNECT's stream is its tunnel's, as an HTTP/1.1 upgrade request has no body).
    NoBody,
    /// More than [`MAX_BODY`].
    TooLarge,
    /// Not one JSON object (malformed, an array, text, a second BOM, …).
    NotJson,
    /// A JSON object without any of the fields.
    NoMaxTokens,
    /// A field present, but none of its values a whole number of at least 1 that fits a
    /// `u64` (`0`, `-1`, `1e9`, `1.5`, `"500"`, `null`, …).
    BadMaxTokens,
}

impl Unreadable {
    /// The status a rule that refuses such a request answers with.
    pub fn status(self) -> StatusCode {
        match self {
            Unreadable::NoBody => StatusCode::LENGTH_REQUIRED,
            Unreadable::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Unreadable::NotJson | Unreadable::NoMaxTokens | Unreadable::BadMaxTokens => {
                StatusCode::BAD_REQUEST
            }
        }
    }

    /// The problem's `detail`: what the client can change.
    pub fn detail(self) -> &'static str {
        match self {
            Unreadable::NoBody => "the request has no body to read max_tokens from",
            Unreadable::TooLarge => {
                "the request body is over 1 MiB, too large to read max_tokens from"
            }
            Unreadable::NotJson => "the request body is not a JSON object",
            Unreadable::NoMaxTokens => {
                "the request body sets none of max_tokens, max_completion_tokens, max_output_tokens"
            }
            Unreadable::BadMaxTokens => {
                "max_tokens (or max_completion_tokens, max_output_tokens) is not a whole number of at least 1"
            }
        }
    }

    /// The reason as logs and metrics label it.
    pub fn name(self) -> &'static str {
        match self {
            Unreadable::NoBody => "no_body",
            Unreadable::TooLarge => "too_large",
            Unreadable::NotJson => "not_json",
            Unreadable::NoMaxTokens => "no_max_tokens",
            Unreadable::BadMaxTokens => "bad_max_tokens",
        }
    }
}

/// The prompt's tokens, estimated from the body's bytes, for a rule that settles
/// `total_tokens` and so reserves the prompt too: a token per four bytes, rounded up.
/// English text runs about four bytes a token in OpenAI's tokenizers, a little more on
/// the whole, so this errs high; the body's JSON syntax, field names and other parameters
/// only add bytes that are no prompt: an English prompt is over-reserved. Text in other
/// scripts may run fewer bytes a token (CJK about three: a quarter under); the settlement
/// corrects it either way once the answer reports its usage.
pub fn prompt_estimate(body_bytes: u64) -> u64 {
    body_bytes.div_ceil(4)
}

/// What a request body read whole asks for: one JSON object (after one optional BOM), the
/// largest valid value among all the top-level occurrences of [`BOUNDS`], times the
/// largest of [`MULTIPLES`] (`{"max_tokens":1000,"n":8}` may generate 8,000; an `n` that
/// is not a whole number of at least 1 makes the body unusable). One pass over
/// the body by serde_json, other values skipped unparsed ([`IgnoredAny`]); a duplicated
/// key is seen each time (a derived struct would refuse or drop it), as backends differ
/// in which one they keep.
pub fn asked_of(body: &[u8]) -> Asked {
    if body.is_empty() {
        return Asked::Unreadable(Unreadable::NoBody);
    }
    let json = body.strip_prefix(BOM).unwrap_or(body);
    let mut de = serde_json::Deserializer::from_slice(json);
    let found = de.deserialize_map(TopLevel).and_then(|found| {
        de.end()?;
        Ok(found)
    });
    match found {
        Err(_) => Asked::Unreadable(Unreadable::NotJson),
        // A count of answers that is not a whole number of at least 1 says nothing usable
        // of what the answer may cost.
        Ok(Found {
            bad_multiple: true, ..
        }) => Asked::Unreadable(Unreadable::BadMaxTokens),
        Ok(Found {
            largest: Some(max),
            multiple,
            ..
        }) => Asked::Tokens {
            max: max.saturating_mul(multiple.unwrap_or(1)),
            body_bytes: body.len() as u64,
        },
        Ok(Found { invalid: true, .. }) => Asked::Unreadable(Unreadable::BadMaxTokens),
        Ok(Found { .. }) => Asked::Unreadable(Unreadable::NoMaxTokens),
    }
}

/// What the top-level object's bounds say, over all their occurrences.
#[derive(Debug, Default)]
struct Found {
    largest: Option<u64>,
    /// Whether any occurrence was not a valid bound.
    invalid: bool,
    /// The largest `n` or `best_of`: the answers generated, each up to the bound.
    multiple: Option<u64>,
    /// Whether an `n` or `best_of` was not a whole number of at least 1.
    bad_multiple: bool,
}

/// The top-level object, a member at a time.
struct TopLevel;

impl<'de> Visitor<'de> for TopLevel {
    type Value = Found;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Found, A::Error> {
        let mut found = Found::default();
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Multiple => match map.next_value::<Bound>()? {
                    Bound::Valid(n) => found.multiple = found.multiple.max(Some(n)),
                    Bound::Invalid => found.bad_multiple = true,
                },
                Key::Bound => match map.next_value::<Bound>()? {
                    Bound::Valid(n) => found.largest = found.largest.max(Some(n)),
                    Bound::Invalid => found.invalid = true,
                },
                Key::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(found)
    }
}

/// A top-level key: one of [`BOUNDS`] (spelled with escapes or not: serde_json hands it
/// over unescaped, as the backend reads it), or another.
enum Key {
    Bound,
    /// One of [`MULTIPLES`].
    Multiple,
    Other,
}

impl<'de> de::Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Key, D::Error> {
        struct KeyVisitor;
        impl Visitor<'_> for KeyVisitor {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a key")
            }
            fn visit_str<E: de::Error>(self, key: &str) -> Result<Key, E> {
                Ok(if BOUNDS.contains(&key) {
                    Key::Bound
                } else if MULTIPLES.contains(&key) {
                    Key::Multiple
                } else {
                    Key::Other
                })
            }
        }
        d.deserialize_str(KeyVisitor)
    }
}

/// A bound's value: valid only as a JSON integer of at least 1 that fits a `u64`
/// (serde_json hands a larger one, or one written with a fraction or an exponent, over as
/// a float). Any other value is read to its end and invalid.
enum Bound {
    Valid(u64),
    Invalid,
}

impl<'de> de::Deserialize<'de> for Bound {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Bound, D::Error> {
        d.deserialize_any(BoundVisitor)
    }
}

struct BoundVisitor;

impl<'de> Visitor<'de> for BoundVisitor {
    type Value = Bound;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_u64<E: de::Error>(self, n: u64) -> Result<Bound, E> {
        Ok(if n >= 1 {
            Bound::Valid(n)
        } else {
            Bound::Invalid
        })
    }

    fn visit_i64<E: de::Error>(self, n: i64) -> Result<Bound, E> {
        Ok(u64::try_from(n)
            .ok()
            .filter(|&n| n >= 1)
            .map_or(Bound::Invalid, Bound::Valid))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Bound, E> {
        Ok(Bound::Invalid)
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Bound, E> {
        Ok(Bound::Invalid)
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<Bound, E> {
        Ok(Bound::Invalid)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Bound, E> {
        Ok(Bound::Invalid)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Bound, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Bound::Invalid)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Bound, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Bound::Invalid)
    }
}

#[cfg(test)]
#[path = "max_tokens_tests.rs"]
pub(crate) mod tests;
