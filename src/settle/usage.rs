//! The tokens an OpenAI-compatible backend reports, read from its answer's body as the
//! bytes pass (`cost_from = "openai_usage"`): streaming, bounded, never copying the body.
//!
//! Two framings, told by the answer's content-type ([`Framing::of`]):
//! - a JSON answer (a chat completion): its top-level `"usage"` object;
//! - server-sent events (`"stream": true`): each event's data is one JSON document, and
//!   the count is the one of the last event that reports it. With `stream_options:
//!   {"include_usage": true}` OpenAI sends `"usage": null` on every chunk but the last,
//!   whose `choices` is empty, then `data: [DONE]`.
//!
//! # What counts
//!
//! A document reports a count when it is one JSON object (only whitespace around it) with
//! a member spelled exactly `"usage"` (an escaped spelling is not recognised) whose value
//! is an object of at most [`MAX_USAGE`] bytes in which the field ([`UsageField`]) is a
//! whole number that fits a `u64`. A `"usage"` deeper in the document (in `choices`, in a
//! string) is not the usage. Of a document's top-level `"usage"` members the last decides,
//! as in JavaScript's `JSON.parse`. The scanner checks a document's structure (strings,
//! escapes, brackets matched by kind, the members of the top-level object, nesting at most
//! 128 deep as serde_json allows), not every token; the usage object itself is parsed
//! whole by serde_json.
//!
//! What a document says: nothing (no usage, `"usage": null`, a usage without
//! the field or with the field null, or not a JSON object at all: `[DONE]`, garbage, a
//! truncated body), a count, or an unusable usage (not an object, too large, malformed, or
//! the field negative, fractional, an exponent or over `u64::MAX`). In an event stream an
//! unusable usage clears the count an earlier event gave: the backend's last word on the
//! usage could not be read, and an older, smaller count would undercharge.
//!
//! # Event streams
//!
//! Lines and fields as HTML's "Parsing an event stream" says
//! (<https://html.spec.whatwg.org/multipage/server-sent-events.html#parsing-an-event-stream>):
//! a line ends at LF, CR or CRLF; a leading BOM is dropped; a line starting with `:` is a
//! comment; `data:` (one optional space after the colon; `data` alone is an empty value)
//! appends to the event's data, its lines joined with LF; a blank line dispatches the
//! event; other fields are ignored. An event the stream ends in, before its blank line, is
//! not dispatched (the spec's rule) and counts for nothing.
//!
//! # Bounds
//!
//! The scanner keeps a few bytes of state and, from the first usage object it reads to
//! [`UsageScanner::finish`], a buffer of [`MAX_USAGE`] bytes ([`UsageScanner::retained`]);
//! a longer usage object is given up, whatever the length of a line, an event or the
//! body. Its answer does not depend on how the body is cut into [`UsageScanner::feed`]
//! calls. Strings, most of an answer's bytes, are skipped a word (8 bytes) at a time, a
//! long one by memchr; `examples/usage_scan.rs` measures it against a plain copy.

use memchr::memchr2;
use serde_json::{Map, Value};

/// The longest usage object kept to be parsed (OpenAI's, with its `*_details`, is under
/// 400 bytes): a longer one is unusable, and its bytes are not kept.
pub const MAX_USAGE: usize = 4096;

/// The deepest nesting a document may have, as serde_json's recursion limit allows.
const MAX_DEPTH: u32 = 128;

/// The key of the usage object.
const USAGE: &[u8] = b"usage";
/// The field of an event's data lines.
const DATA: &[u8] = b"data";
/// UTF-8's byte order mark, dropped at an event stream's start.
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// Which usage count settles the charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UsageField {
    TotalTokens,
    PromptTokens,
    CompletionTokens,
}

impl UsageField {
    /// The field's name in the Responses API's usage object, where it differs
    /// (`input_tokens`, `output_tokens`): read where the first is absent.
    fn alias(self) -> Option<&'static str> {
        match self {
            UsageField::PromptTokens => Some("input_tokens"),
            UsageField::CompletionTokens => Some("output_tokens"),
            UsageField::TotalTokens => None,
        }
    }

    /// The field's name in the usage object, as the config spells it.
    pub fn name(self) -> &'static str {
        match self {
            UsageField::TotalTokens => "total_tokens",
            UsageField::PromptTokens => "prompt_tokens",
            UsageField::CompletionTokens => "completion_tokens",
        }
    }
}

/// How the answer's body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    Json,
    EventStream,
}

impl Framing {
    /// From the answer's content-type: `application/json` (and `application/*+json`, RFC
    /// 6839), any parameters or case → Json; `text/event-stream` → EventStream; anything
    /// else, or none → None (the body is not scanned).
    pub fn of(content_type: Option<&http::HeaderValue>) -> Option<Framing> {
        // A value that is not visible ASCII names no media type the gateway knows.
        let value = content_type?.to_str().ok()?;
        let essence = value.split(';').next().unwrap_or_default().trim();
        let (kind, subtype) = essence.split_once('/')?;
        let (kind, subtype) = (kind.trim_end(), subtype.trim_start());
        if kind.eq_ignore_ascii_case("text") && subtype.eq_ignore_ascii_case("event-stream") {
            return Some(Framing::EventStream);
        }
        let json = subtype.eq_ignore_ascii_case("json")
            || subtype.len() > 5
                && subtype.as_bytes()[subtype.len() - 5..].eq_ignore_ascii_case(b"+json");
        (kind.eq_ignore_ascii_case("application") && json).then_some(Framing::Json)
    }
}

/// Reads the usage count from an answer's body as it passes.
#[derive(Debug)]
pub struct UsageScanner {
    doc: Document,
    /// The event stream's line state; None for a JSON answer (one document).
    events: Option<Events>,
}

impl UsageScanner {
    pub fn new(framing: Framing, field: UsageField) -> Self {
        UsageScanner {
            doc: Document::new(field),
            events: (framing == Framing::EventStream).then(Events::new),
        }
    }

    /// Looks at the next bytes of the body as they pass; never copies the body, keeps at
    /// most [`MAX_USAGE`] bytes of a usage object and a few bytes of state.
    pub fn feed(&mut self, bytes: &[u8]) {
        match &mut self.events {
            Some(events) => events.feed(&mut self.doc, bytes),
            None => self.doc.feed(bytes),
        }
    }

    /// The count once the body has ended: for a JSON answer its usage's field; for an
    /// event stream the field of the last event that reported it (see the module's
    /// documentation). None when never seen or unusable. Frees the usage buffer.
    pub fn finish(&mut self) -> Option<u64> {
        let count = self.seen();
        self.doc.capture = Vec::new();
        count
    }

    /// What [`finish`](Self::finish) would answer if the body ended here: a JSON answer's
    /// count once its document is whole; an event stream's latest count, which a later
    /// event may still change.
    pub fn seen(&self) -> Option<u64> {
        match &self.events {
            Some(events) => events.latest,
            None => match self.doc.said() {
                Said::Count(n) => Some(n),
                Said::Nothing | Said::Unusable => None,
            },
        }
    }

    /// Heap bytes the scanner holds (its usage buffer): at most [`MAX_USAGE`].
    pub fn retained(&self) -> usize {
        self.doc.capture.capacity()
    }
}

/// What one document says of the usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Said {
    /// No usage, `"usage": null`, a usage without the field (or with it null), or a
    /// document that is not one JSON object.
    Nothing,
    Count(u64),
    /// A usage the count cannot be read from: not an object, over [`MAX_USAGE`] bytes,
    /// malformed, or its field not a whole number >= 0 that fits a `u64`.
    Unusable,
}

/// How far a document has come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Only whitespace so far.
    Before,
    /// Inside the top-level object.
    Inside,
    /// The top-level object closed; only whitespace may follow.
    After,
    /// Not one JSON object: the rest is skipped, and the document says nothing.
    Broken,
}

/// Where the scan is among the members of the top-level object (depth 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Member {
    /// Just after `{`: a key or `}`.
    Open,
    /// After `,`: a key.
    Key,
    /// In a key's string.
    InKey,
    /// After a key: `:`.
    Colon,
    /// After `:`: a value.
    Value,
    /// In a value (a scalar, a string, or a container deeper down): `,` or `}` next.
    InValue,
}

/// A capture edge one structural byte made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Edge {
    None,
    /// The `{` of a top-level usage's value: capture from this byte.
    Open,
    /// The `}` that closes it: capture to this byte, then read it.
    Close,
}

/// One JSON document, scanned structurally: the whole body of a JSON answer, or one
/// event's data.
#[derive(Debug)]
struct Document {
    field: UsageField,
    phase: Phase,
    /// Containers open: 1 inside the top-level object.
    depth: u32,
    /// Bit `d - 1` set: the container at depth `d` is an array (to match brackets by kind).
    arrays: u128,
    in_string: bool,
    /// The previous byte was a backslash in a string: this one is escaped.
    escaped: bool,
    member: Member,
    /// Bytes of `usage` the key being read has matched; None once it cannot be `usage`.
    key: Option<u8>,
    /// The last key read at depth 1 was `usage`, and its value has not begun.
    usage_key: bool,
    /// Inside the usage object: its bytes go to `capture`.
    capturing: bool,
    /// The usage object's bytes so far (capacity [`MAX_USAGE`] once used, never more).
    capture: Vec<u8>,
    /// The usage object outgrew [`MAX_USAGE`]: its other bytes are not kept.
    overflow: bool,
    said: Said,
}

impl Document {
    fn new(field: UsageField) -> Self {
        Document {
            field,
            phase: Phase::Before,
            depth: 0,
            arrays: 0,
            in_string: false,
            escaped: false,
            member: Member::Open,
            key: None,
            usage_key: false,
            capturing: false,
            capture: Vec::new(),
            overflow: false,
            said: Said::Nothing,
        }
    }

    /// Ready for the next document; the usage buffer's allocation is kept.
    fn reset(&mut self) {
        let mut capture = std::mem::take(&mut self.capture);
        capture.clear();
        *self = Document {
            capture,
            ..Document::new(self.field)
        };
    }

    /// What the document says, if it ended here.
    fn said(&self) -> Said {
        if self.phase == Phase::After {
            self.said
        } else {
            Said::Nothing
        }
    }

    fn feed(&mut self, bytes: &[u8]) {
        // Where this call's part of the usage object starts, while capturing.
        let mut from = 0;
        let mut i = 0;
        while i < bytes.len() {
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                    i += 1;
                    continue;
                }
                let rest = &bytes[i..];
                let run = string_run(rest);
                if self.member == Member::InKey {
                    self.match_key(&rest[..run]);
                }
                i += run;
                match bytes.get(i) {
                    Some(b'\\') => {
                        self.escaped = true;
                        // An escaped key is not the plain spelling.
                        self.key = None;
                    }
                    Some(_) => self.end_string(),
                    None => break,
                }
                i += 1;
                continue;
            }
            // Below the top level, and in a top-level scalar, most bytes change nothing.
            let quiet = match (self.phase, self.member) {
                (Phase::Inside, _) if self.depth > 1 => Some(&NESTED),
                (Phase::Inside, Member::InValue) => Some(&SCALAR),
                _ => None,
            };
            if let Some(stops) = quiet {
                match bytes[i..].iter().position(|&b| stops[usize::from(b)]) {
                    Some(run) => i += run,
                    None => break,
                }
            }
            match self.byte(bytes[i]) {
                Edge::None => {}
                Edge::Open => from = i,
                Edge::Close => {
                    self.keep(&bytes[from..=i]);
                    self.said = self.read();
                }
            }
            if self.phase == Phase::Broken {
                return;
            }
            i += 1;
        }
        if self.capturing {
            self.keep(&bytes[from..]);
        }
    }

    /// A byte outside strings.
    fn byte(&mut self, b: u8) -> Edge {
        match self.phase {
            Phase::Inside if self.depth == 1 => return self.member_byte(b),
            Phase::Inside => match b {
                b'"' => self.in_string = true,
                b'{' | b'[' => self.push(b),
                b'}' | b']' => {
                    self.pop(b);
                    if self.depth == 1 && self.capturing {
                        self.capturing = false;
                        return Edge::Close;
                    }
                }
                _ => {}
            },
            Phase::Before => match b {
                b'{' => {
                    self.phase = Phase::Inside;
                    self.depth = 1;
                    self.member = Member::Open;
                }
                b if is_space(b) => {}
                _ => self.broken(),
            },
            Phase::After => {
                if !is_space(b) {
                    self.broken();
                }
            }
            Phase::Broken => {}
        }
        Edge::None
    }

    /// A byte between the top-level object's members, or in a scalar member.
    fn member_byte(&mut self, b: u8) -> Edge {
        if is_space(b) {
            return Edge::None;
        }
        match (self.member, b) {
            (Member::Open | Member::Key, b'"') => {
                self.member = Member::InKey;
                self.key = Some(0);
                self.in_string = true;
            }
            (Member::Colon, b':') => self.member = Member::Value,
            (Member::Value, b'}' | b']' | b',' | b':') => self.broken(),
            (Member::Value, _) => {
                self.member = Member::InValue;
                let usage = std::mem::take(&mut self.usage_key);
                match b {
                    b'"' => self.in_string = true,
                    b'{' | b'[' => self.push(b),
                    _ => {}
                }
                if usage && self.phase != Phase::Broken {
                    if b == b'{' {
                        self.capturing = true;
                        self.overflow = false;
                        self.capture.clear();
                        return Edge::Open;
                    }
                    // Only `null` starts with `n`: OpenAI's "no usage in this chunk".
                    self.said = if b == b'n' {
                        Said::Nothing
                    } else {
                        Said::Unusable
                    };
                }
            }
            (Member::InValue, b',') => self.member = Member::Key,
            (Member::Open | Member::InValue, b'}') => {
                self.depth = 0;
                self.phase = Phase::After;
            }
            // A second value without a comma between.
            (Member::InValue, b'"' | b'{' | b'[' | b']' | b':') => self.broken(),
            // The rest of a scalar (its tokens are not checked).
            (Member::InValue, _) => {}
            _ => self.broken(),
        }
        Edge::None
    }

    fn push(&mut self, b: u8) {
        if self.depth >= MAX_DEPTH {
            return self.broken();
        }
        self.depth += 1;
        if b == b'[' {
            self.arrays |= 1 << (self.depth - 1);
        }
    }

    /// Closes the container at the current depth (>= 2) with `b`, which must match it.
    fn pop(&mut self, b: u8) {
        let bit = 1u128 << (self.depth - 1);
        if (self.arrays & bit != 0) != (b == b']') {
            return self.broken();
        }
        self.arrays &= !bit;
        self.depth -= 1;
    }

    fn broken(&mut self) {
        self.phase = Phase::Broken;
        self.capturing = false;
        self.said = Said::Nothing;
    }

    /// The next run of a key's string (no quote, no backslash in it).
    fn match_key(&mut self, run: &[u8]) {
        if let Some(k) = self.key {
            let k = usize::from(k);
            self.key = match USAGE.get(k..k + run.len()) {
                Some(part) if part == run => u8::try_from(k + run.len()).ok(),
                _ => None,
            };
        }
    }

    fn end_string(&mut self) {
        self.in_string = false;
        if self.member == Member::InKey {
            self.usage_key = self.key == Some(USAGE.len() as u8);
            self.key = None;
            self.member = Member::Colon;
        }
    }

    /// Keeps a part of the usage object, while it fits.
    fn keep(&mut self, part: &[u8]) {
        if self.overflow {
            return;
        }
        if self.capture.len() + part.len() > MAX_USAGE {
            self.overflow = true;
            self.capture.clear();
            return;
        }
        if self.capture.capacity() < MAX_USAGE {
            // Exactly MAX_USAGE, once: never grown past it.
            self.capture.reserve_exact(MAX_USAGE - self.capture.len());
        }
        self.capture.extend_from_slice(part);
    }

    /// The field of the usage object just captured.
    fn read(&mut self) -> Said {
        if std::mem::take(&mut self.overflow) {
            return Said::Unusable;
        }
        let said = match serde_json::from_slice::<Map<String, Value>>(&self.capture) {
            Err(_) => Said::Unusable,
            Ok(usage) => match usage
                .get(self.field.name())
                .or_else(|| usage.get(self.field.alias()?))
            {
                None | Some(Value::Null) => Said::Nothing,
                Some(n) => n.as_u64().map_or(Said::Unusable, Said::Count),
            },
        };
        self.capture.clear();
        said
    }
}

/// The bytes that matter outside strings below the top level.
const NESTED: [bool; 256] = bytes(b"\"{}[]");
/// The bytes that matter in a scalar member of the top-level object.
const SCALAR: [bool; 256] = bytes(b"\"{}[],:");

const fn bytes(set: &[u8]) -> [bool; 256] {
    let mut table = [false; 256];
    let mut i = 0;
    while i < set.len() {
        table[set[i] as usize] = true;
        i += 1;
    }
    table
}

/// How far a string runs before its next quote or backslash.
fn string_run(rest: &[u8]) -> usize {
    // Most strings of an answer are short (keys, ids, a token's text): eight bytes at a
    // time in a word first, then memchr's vector search for a long one.
    let mut words = rest.chunks_exact(8);
    for (n, word) in words.by_ref().take(4).enumerate() {
        let mut w = [0; 8];
        w.copy_from_slice(word);
        let w = u64::from_le_bytes(w);
        let found =
            zero_byte(w ^ (LOW * u64::from(b'"'))) | zero_byte(w ^ (LOW * u64::from(b'\\')));
        if found != 0 {
            return n * 8 + (found.trailing_zeros() / 8) as usize;
        }
    }
    let done = rest.len() - words.remainder().len() - words.len() * 8;
    memchr2(b'"', b'\\', &rest[done..]).map_or(rest.len(), |run| done + run)
}

const LOW: u64 = 0x0101_0101_0101_0101;

/// The high bit of each byte of `x` that is 0; above the lowest such byte, perhaps of
/// others too (a borrow): only its lowest set bit is exact.
fn zero_byte(x: u64) -> u64 {
    x.wrapping_sub(LOW) & !x & (LOW << 7)
}

/// JSON's whitespace (RFC 8259 §2).
fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// Where the scan is in an event stream's line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    /// At a line's start.
    Start,
    /// In the field's name, which so far matches this many bytes of `data`.
    Name(u8),
    /// Just after `data:`: an optional space, then the value.
    Colon,
    /// In a data line's value: its bytes go to the event's document.
    Value,
    /// In a comment or another field's line.
    Skip,
}

/// An event stream's lines and events; each event's data is fed to one [`Document`].
#[derive(Debug)]
struct Events {
    line: Line,
    /// The last line ended with CR: an LF right after it is part of that line's end.
    cr: bool,
    /// Bytes of a BOM matched at the stream's start; None once past the start.
    bom: Option<u8>,
    /// The event has had a data line: the next is joined to it with LF.
    data: bool,
    /// The count of the last event that reported one (cleared by an unusable one).
    latest: Option<u64>,
}

impl Events {
    fn new() -> Self {
        Events {
            line: Line::Start,
            cr: false,
            bom: Some(0),
            data: false,
            latest: None,
        }
    }

    fn feed(&mut self, doc: &mut Document, bytes: &[u8]) {
        let mut i = 0;
        while i < bytes.len() {
            let b = bytes[i];
            if std::mem::take(&mut self.cr) && b == b'\n' {
                i += 1;
                continue;
            }
            if let Some(k) = self.bom {
                let k = usize::from(k);
                if BOM.get(k) == Some(&b) {
                    self.bom = (k + 1 < BOM.len()).then_some(k as u8 + 1);
                    i += 1;
                    continue;
                }
                self.bom = None;
                if k > 0 {
                    // The line began with a part of a BOM: a field no one knows.
                    self.line = Line::Skip;
                }
            }
            match self.line {
                Line::Value | Line::Skip => {
                    let rest = &bytes[i..];
                    let run = memchr2(b'\n', b'\r', rest).unwrap_or(rest.len());
                    if self.line == Line::Value {
                        doc.feed(&rest[..run]);
                    }
                    i += run;
                    if let Some(&end) = bytes.get(i) {
                        self.end_line(doc, end);
                    }
                }
                _ if b == b'\n' || b == b'\r' => self.end_line(doc, b),
                Line::Start if b == b'd' => self.line = Line::Name(1),
                Line::Start => self.line = Line::Skip,
                Line::Name(k) if DATA.get(usize::from(k)) == Some(&b) => {
                    self.line = Line::Name(k + 1)
                }
                Line::Name(4) if b == b':' => {
                    self.begin_data(doc);
                    self.line = Line::Colon;
                }
                Line::Name(_) => self.line = Line::Skip,
                Line::Colon => {
                    self.line = Line::Value;
                    if b != b' ' {
                        continue;
                    }
                }
            }
            i += 1;
        }
    }

    /// A line ends with `end` (CR or LF).
    fn end_line(&mut self, doc: &mut Document, end: u8) {
        self.cr = end == b'\r';
        match self.line {
            Line::Start => self.dispatch(doc),
            // `data` with no colon: an empty value.
            Line::Name(4) => self.begin_data(doc),
            _ => {}
        }
        self.line = Line::Start;
    }

    fn begin_data(&mut self, doc: &mut Document) {
        if std::mem::replace(&mut self.data, true) {
            doc.feed(b"\n");
        }
    }

    fn dispatch(&mut self, doc: &mut Document) {
        if std::mem::take(&mut self.data) {
            match doc.said() {
                Said::Nothing => {}
                Said::Count(n) => self.latest = Some(n),
                Said::Unusable => self.latest = None,
            }
            doc.reset();
        }
    }
}

#[cfg(test)]
#[path = "usage_tests.rs"]
mod tests;
