//! The usage scanner: real OpenAI answers (a completion, a stream), every cut of them, the
//! event-stream spec's lines and fields, which numbers count, bounded memory, and serde_json
//! as the oracle for random documents, streams and cuts.

use super::*;
use proptest::prelude::*;
use UsageField::*;

const FIELDS: [UsageField; 3] = [TotalTokens, PromptTokens, CompletionTokens];

/// The body fed in the pieces `cuts` (ascending offsets) make; the answer, and the
/// most the scanner held at any point.
fn cut(framing: Framing, field: UsageField, body: &[u8], cuts: &[usize]) -> (Option<u64>, usize) {
    let mut s = UsageScanner::new(framing, field);
    let (mut at, mut held) = (0, 0);
    for &c in cuts.iter().chain([&body.len()]) {
        s.feed(&body[at..c]);
        held = held.max(s.retained());
        at = c;
    }
    (s.finish(), held)
}

fn whole(framing: Framing, field: UsageField, body: &[u8]) -> Option<u64> {
    cut(framing, field, body, &[]).0
}

/// The answer for the whole body, after checking that every single cut, and feeding
/// a byte at a time, give the same.
fn every_cut(framing: Framing, field: UsageField, body: &[u8]) -> Option<u64> {
    let answer = whole(framing, field, body);
    for c in 0..=body.len() {
        assert_eq!(cut(framing, field, body, &[c]).0, answer, "cut at {c}");
    }
    let bytes: Vec<usize> = (1..body.len()).collect();
    assert_eq!(
        cut(framing, field, body, &bytes).0,
        answer,
        "a byte at a time"
    );
    answer
}

/// A chat completion as OpenAI's API reference shows one, with decoys: "usage" in a
/// string, as a value, as a nested key, and as a key's prefix.
const COMPLETION: &str = r#"{
  "id": "chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG",
  "object": "chat.completion",
  "created": 1741570283,
  "model": "gpt-4o-2024-08-06",
  "choices": [
{
  "index": 0,
  "message": {
    "role": "assistant",
    "content": "It said \"usage\": {\"total_tokens\": 999} \\",
    "refusal": null,
    "annotations": [],
    "usage": {"total_tokens": 998, "prompt_tokens": 998, "completion_tokens": 998}
  },
  "logprobs": null,
  "finish_reason": "stop"
}
  ],
  "note": "usage",
  "usage_x": {"total_tokens": 996},
  "usage" : {
"prompt_tokens": 1117,
"completion_tokens": 46,
"total_tokens": 1163,
"prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
"completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0, "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
  },
  "service_tier": "default",
  "metadata": {"usage": {"total_tokens": 997}},
  "system_fingerprint": "fp_fc9f1d7035"
}
"#;

/// A streamed answer with `stream_options: {"include_usage": true}`, as OpenAI sends it.
fn stream() -> String {
    let head = r#"{"id":"chatcmpl-123","object":"chat.completion.chunk","created":1694268190,"model":"gpt-4o-mini","system_fingerprint":"fp_44709d6fcb","choices":"#;
    let mut s = String::new();
    for delta in [
        r#"{"role":"assistant","content":""}"#,
        r#"{"content":"Hello"}"#,
        r#"{"content":" \"usage\": {}"}"#,
        "{}",
    ] {
        let finish = if delta == "{}" { r#""stop""# } else { "null" };
        s += &format!("data: {head}[{{\"index\":0,\"delta\":{delta},\"logprobs\":null,\"finish_reason\":{finish}}}],\"usage\":null}}\n\n");
    }
    s += &format!("data: {head}[],\"usage\":{{\"prompt_tokens\":9,\"completion_tokens\":12,\"total_tokens\":21,\"prompt_tokens_details\":{{\"cached_tokens\":0,\"audio_tokens\":0}},\"completion_tokens_details\":{{\"reasoning_tokens\":0,\"audio_tokens\":0,\"accepted_prediction_tokens\":0,\"rejected_prediction_tokens\":0}}}}}}\n\n");
    s + "data: [DONE]\n\n"
}

#[test]
fn a_chat_completion_is_charged_its_top_level_usage_only() {
    for (field, n) in [
        (TotalTokens, 1163),
        (PromptTokens, 1117),
        (CompletionTokens, 46),
    ] {
        assert_eq!(
            every_cut(Framing::Json, field, COMPLETION.as_bytes()),
            Some(n),
            "{field:?}"
        );
    }
}

#[test]
fn a_stream_is_charged_its_final_usage_chunk() {
    let body = stream();
    for (field, n) in [(TotalTokens, 21), (PromptTokens, 9), (CompletionTokens, 12)] {
        assert_eq!(
            every_cut(Framing::EventStream, field, body.as_bytes()),
            Some(n),
            "{field:?}"
        );
        for ending in ["\r\n", "\r"] {
            let other = body.replace('\n', ending);
            assert_eq!(
                every_cut(Framing::EventStream, field, other.as_bytes()),
                Some(n),
                "{ending:?}"
            );
        }
    }
    // Seen as soon as its event ends, before [DONE].
    let mut s = UsageScanner::new(Framing::EventStream, TotalTokens);
    let before_done = body.rfind("data: [DONE]").unwrap();
    s.feed(&body.as_bytes()[..before_done - 1]);
    assert_eq!(s.seen(), None, "its blank line has not come");
    s.feed(b"\n");
    assert_eq!(s.seen(), Some(21));
    // A body read as the other framing counts nothing.
    assert_eq!(whole(Framing::Json, TotalTokens, body.as_bytes()), None);
    assert_eq!(
        whole(Framing::EventStream, TotalTokens, COMPLETION.as_bytes()),
        None
    );
}

#[test]
fn every_two_cuts_of_a_small_stream_give_the_same_answer() {
    let body = b"\xEF\xBB\xBF: hi\r\ndata: {\"usage\":null}\r\n\r\ndata:{\"a\":[1,{\"b\":\"\\\"\"}],\r\ndata: \"usage\" :\rdata\rdata: { \"total_tokens\" : 42 }}\n\n";
    assert_eq!(whole(Framing::EventStream, TotalTokens, body), Some(42));
    for a in 0..=body.len() {
        for b in a..=body.len() {
            assert_eq!(
                cut(Framing::EventStream, TotalTokens, body, &[a, b]).0,
                Some(42),
                "cuts {a} {b}"
            );
        }
    }
}

#[test]
fn event_stream_lines_and_fields_follow_the_spec() {
    let sse = |body: &str| every_cut(Framing::EventStream, TotalTokens, body.as_bytes());
    let usage = r#"{"usage":{"total_tokens":7}}"#;
    assert_eq!(sse(&format!("data: {usage}\n\n")), Some(7));
    assert_eq!(sse(&format!("data:{usage}\n\n")), Some(7), "no space");
    assert_eq!(
        sse(&format!("data:  {usage}\n\n")),
        Some(7),
        "a second space is JSON's"
    );
    assert_eq!(sse(&format!("\u{feff}data: {usage}\n\n")), Some(7), "a BOM");
    assert_eq!(
        sse(&format!(
            ": comment\nevent: x\nid: 1\nretry: 5\ndata: {usage}\n\n"
        )),
        Some(7)
    );
    assert_eq!(
        sse("data: {\"usage\":\ndata\ndata: {\"total_tokens\":\ndata: 8}}\n\n"),
        Some(8),
        "lines joined"
    );
    assert_eq!(
        sse("data: {\"usage\":{\"total_tokens\":1\ndata: 2}}\n\n"),
        None,
        "joined with LF: 1 2, not 12"
    );
    assert_eq!(
        sse(&format!(
            "data: {usage}\n\ndata: {{\"usage\":null}}\n\ndata: [DONE]\n\n"
        )),
        Some(7),
        "null keeps"
    );
    assert_eq!(
        sse(&format!(
            "data: {usage}\n\ndata: {{\"usage\":{{\"total_tokens\":9}}}}\n\n"
        )),
        Some(9),
        "the last"
    );
    assert_eq!(
        sse(&format!(
            "data: {usage}\n\ndata: {{\"usage\":{{\"total_tokens\":-9}}}}\n\n"
        )),
        None,
        "unusable clears"
    );
    assert_eq!(
        sse(&format!(
            "data: {usage}\n\ndata: {{\"usage\":{{\"other\":1}}}}\n\n"
        )),
        Some(7),
        "without the field"
    );
    assert_eq!(
        sse(&format!("data: {usage}\n")),
        None,
        "not dispatched: no blank line"
    );
    assert_eq!(sse(&format!("data: {usage}")), None);
    assert_eq!(
        sse(&format!("Data: {usage}\n\n")),
        None,
        "field names are exact"
    );
    assert_eq!(sse(&format!("data : {usage}\n\n")), None);
    assert_eq!(sse(&format!("datum: {usage}\n\n")), None);
    assert_eq!(sse(&format!(":data: {usage}\n\n")), None, "a comment");
    assert_eq!(
        sse(&format!("\u{feff}\u{feff}data: {usage}\n\n")),
        None,
        "one BOM only"
    );
    assert_eq!(sse(&format!("data: x{usage}\n\n")), None, "not JSON");
    assert_eq!(
        sse(&format!("data: {usage}\ndata: x\n\n")),
        None,
        "not JSON after"
    );
    assert_eq!(
        sse(&format!("data: {usage}\ndata: {usage}\n\n")),
        None,
        "two documents"
    );
}

#[test]
fn only_a_whole_number_that_fits_counts() {
    let json = |usage: &str| {
        every_cut(
            Framing::Json,
            TotalTokens,
            format!(r#"{{"usage":{usage}}}"#).as_bytes(),
        )
    };
    assert_eq!(json(r#"{"total_tokens":0}"#), Some(0));
    assert_eq!(
        json(r#"{"total_tokens":18446744073709551615}"#),
        Some(u64::MAX)
    );
    assert_eq!(json(r#"{ "total_tokens" : 5 , "x" : [ { } ] }"#), Some(5));
    for bad in [
        "-1",
        "1.0",
        "1.5",
        "1e3",
        "18446744073709551616",
        "99999999999999999999999",
        "01",
        "\"21\"",
        "true",
        "[21]",
        "{}",
        "1e400",
        "--1",
        "0x10",
    ] {
        assert_eq!(json(&format!(r#"{{"total_tokens":{bad}}}"#)), None, "{bad}");
    }
    for usage in [
        "null",
        "21",
        "\"21\"",
        "[21]",
        "{\"total_tokens\":null}",
        "{\"total_tokens\":1,}",
        "{\"total_tokens\":1 2}",
    ] {
        assert_eq!(json(usage), None, "{usage}");
    }
}

#[test]
fn a_json_answer_counts_only_as_one_whole_object() {
    let json = |body: &str| every_cut(Framing::Json, TotalTokens, body.as_bytes());
    let usage = r#""usage":{"total_tokens":7}"#;
    assert_eq!(json(&format!(" \r\n\t{{ {usage} }} \n")), Some(7));
    assert_eq!(
        json(&format!(r#"{{"a":{{"b":[]}},{usage},"c":"}}"}}"#)),
        Some(7)
    );
    assert_eq!(
        json(&format!(r#"{{{usage},"usage":null}}"#)),
        None,
        "the last usage decides"
    );
    assert_eq!(json(&format!(r#"{{"usage":null,{usage}}}"#)), Some(7));
    for body in [
        format!("{{{usage}"),       // truncated
        format!("{{{usage}}}x"),    // trailing garbage
        format!("{{{usage}}}{{}}"), // two documents
        format!("[{{{usage}}}]"),   // not an object
        format!("x{{{usage}}}"),
        format!("{{{usage},]"), // brackets of another kind
        format!("{{\"a\":[}},{usage}}}"),
        format!("{{\"a\" 1,{usage}}}"), // no colon
        format!("{{\"a\":1 \"b\":2,{usage}}}"),
        format!("{{1:2,{usage}}}"), // a key that is not a string
        r#"{"us\u0061ge":{"total_tokens":7}}"#.to_string(), // an escaped key
        "{\"usage\"\n:\n{\"total_tokens\":7},}".to_string(), // trailing comma
        format!("{}{{{usage}}}{}", "[".repeat(130), "]".repeat(130)),
        format!("{{\"a\":{}{}, {usage}}}", "[".repeat(128), "]".repeat(128)), // deeper than 128
        String::new(),
    ] {
        assert_eq!(json(&body), None, "{body}");
    }
    assert_eq!(
        json(&format!(
            "{{\"a\":{}{}, {usage}}}",
            "[".repeat(127),
            "]".repeat(127)
        )),
        Some(7),
        "128 deep"
    );
}

#[test]
fn content_types_choose_the_framing() {
    let of = |v: &str| Framing::of(Some(&http::HeaderValue::from_str(v).unwrap()));
    for v in [
        "application/json",
        "Application/JSON; charset=utf-8",
        "application/problem+json",
        "application/vnd.api+JSON ;x=y",
        " application/json ",
    ] {
        assert_eq!(of(v), Some(Framing::Json), "{v}");
    }
    for v in ["text/event-stream", "Text/Event-Stream; charset=utf-8"] {
        assert_eq!(of(v), Some(Framing::EventStream), "{v}");
    }
    for v in [
        "text/plain",
        "text/json",
        "application/jsonx",
        "application/+json",
        "json",
        "",
        "application/x-ndjson",
        "multipart/mixed",
    ] {
        assert_eq!(of(v), None, "{v}");
    }
    assert_eq!(
        Framing::of(Some(
            &http::HeaderValue::from_bytes(b"application/json\xff").unwrap()
        )),
        None
    );
    assert_eq!(Framing::of(None), None);
}

#[test]
fn a_responses_api_usage_is_read_by_its_own_names() {
    let body = br#"{"object":"response","usage":{"input_tokens":12,"output_tokens":30,"total_tokens":42}}"#;
    assert_eq!(whole(Framing::Json, PromptTokens, body), Some(12));
    assert_eq!(whole(Framing::Json, CompletionTokens, body), Some(30));
    assert_eq!(whole(Framing::Json, TotalTokens, body), Some(42));
    // The Chat Completions' name wins where both are there.
    let both = br#"{"usage":{"prompt_tokens":5,"input_tokens":12,"completion_tokens":7}}"#;
    assert_eq!(whole(Framing::Json, PromptTokens, both), Some(5));
}

#[test]
fn field_names_are_the_configs() {
    for f in FIELDS {
        let parsed: UsageField = serde_json::from_value(Value::String(f.name().into())).unwrap();
        assert_eq!(parsed, f);
    }
    assert!(serde_json::from_value::<UsageField>(Value::String("tokens".into())).is_err());
}

/// `n` bytes made by `next`, fed in 64 KiB pieces; the answer and the most held.
fn flood(
    framing: Framing,
    head: &[u8],
    n: usize,
    tail: &[u8],
    mut next: impl FnMut() -> u8,
) -> (Option<u64>, usize) {
    let mut s = UsageScanner::new(framing, TotalTokens);
    s.feed(head);
    let mut piece = vec![0; 64 * 1024];
    let mut held = s.retained();
    for _ in 0..n / piece.len() {
        piece.iter_mut().for_each(|b| *b = next());
        s.feed(&piece);
        held = held.max(s.retained());
    }
    s.feed(tail);
    held = held.max(s.retained());
    (s.finish(), held)
}

#[test]
fn memory_stays_bounded_whatever_the_body() {
    const MIB: usize = 1 << 20;
    // 100 MiB of garbage made of JSON's and the stream's own bytes.
    let alphabet = b"{}[]\":,\\ \r\ndata:usage0123456789";
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut garbage = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        alphabet[(x % alphabet.len() as u64) as usize]
    };
    let (_, held) = flood(Framing::EventStream, b"", 100 * MIB, b"", &mut garbage);
    assert!(held <= MAX_USAGE, "{held}");
    let (_, held) = flood(Framing::Json, b"{\"usage\":{", 100 * MIB, b"", &mut garbage);
    assert!(held <= MAX_USAGE, "{held}");
    // A usage object of 1 MiB is unusable, and an earlier count does not stand.
    let valid = b"data: {\"usage\":{\"total_tokens\":5}}\n\n";
    let mut head = valid.to_vec();
    head.extend_from_slice(b"data: {\"usage\":{\"total_tokens\":6,\"pad\":\"");
    assert_eq!(
        flood(Framing::EventStream, &head, MIB, b"\"}}\n\n", || b'x'),
        (None, MAX_USAGE)
    );
    assert_eq!(
        flood(
            Framing::Json,
            b"{\"usage\":{\"total_tokens\":6,\"pad\":[",
            MIB,
            b"]}}",
            || b' '
        ),
        (None, MAX_USAGE)
    );
    // A line of 10 MiB holds nothing, and the usage after it counts.
    let (n, held) = flood(
        Framing::EventStream,
        b"data: {\"choices\":[{\"content\":\"",
        10 * MIB,
        b"\"}],\"usage\":null}\n\n",
        || b'y',
    );
    assert_eq!((n, held), (None, 0));
    let mut tail = b"\"}\n\n".to_vec();
    tail.extend_from_slice(valid);
    assert_eq!(
        flood(
            Framing::EventStream,
            b"data: {\"x\":\"",
            10 * MIB,
            &tail,
            || b'y'
        ),
        (Some(5), MAX_USAGE)
    );
    assert_eq!(
        flood(
            Framing::Json,
            b"{\"x\":\"",
            10 * MIB,
            b"\",\"usage\":{\"total_tokens\":5}}",
            || b'y'
        ),
        (Some(5), MAX_USAGE)
    );
    // A usage of exactly MAX_USAGE bytes still counts; one byte more does not.
    let pad = |n: usize| {
        format!(
            "{{\"usage\":{{\"total_tokens\":3,\"p\":\"{}\"}}}}",
            "z".repeat(n)
        )
    };
    let fits = pad(MAX_USAGE - "{\"total_tokens\":3,\"p\":\"\"}".len());
    assert_eq!(
        cut(Framing::Json, TotalTokens, fits.as_bytes(), &[100, 3000]),
        (Some(3), MAX_USAGE)
    );
    assert_eq!(
        whole(
            Framing::Json,
            TotalTokens,
            pad(MAX_USAGE + 1 - 24).as_bytes()
        ),
        None
    );
    // finish frees the buffer.
    let mut s = UsageScanner::new(Framing::Json, TotalTokens);
    s.feed(fits.as_bytes());
    assert_eq!((s.finish(), s.retained()), (Some(3), 0));
}

/// What serde_json, reading the whole document, says of its usage.
fn oracle(doc: &str, field: UsageField) -> Said {
    let Ok(Value::Object(top)) = serde_json::from_str::<Value>(doc) else {
        return Said::Nothing;
    };
    match top.get("usage") {
        None | Some(Value::Null) => Said::Nothing,
        Some(Value::Object(usage)) => match usage.get(field.name()) {
            None | Some(Value::Null) => Said::Nothing,
            Some(n) => n.as_u64().map_or(Said::Unusable, Said::Count),
        },
        Some(_) => Said::Unusable,
    }
}

/// JSON values whose keys and strings are often the ones the scanner looks for.
fn value() -> impl Strategy<Value = Value> {
    let word = prop_oneof![
        Just("usage".to_string()),
        Just("total_tokens".to_string()),
        Just("prompt_tokens".to_string()),
        Just("completion_tokens".to_string()),
        Just("usag".to_string()),
        Just("usage\"".to_string()),
        Just("a\\\"usage\":{".to_string()),
        "[a-z{}\\[\\]\":,\\\\ ]{0,6}",
        Just("ü\n".to_string()),
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<u64>().prop_map(Value::from),
        (0u64..100).prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (-1e6f64..1e6).prop_map(Value::from),
        word.clone().prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 40, 5, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::vec((word.clone(), inner), 0..5)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A document: an object (often with a usage), compact or pretty (lines apart), or
/// what is not one JSON object.
fn document() -> impl Strategy<Value = String> {
    let usage = prop_oneof![
        1 => Just(None), 1 => value().prop_map(Some),
        3 => (any::<u64>(), 0u64..1000, any::<bool>()).prop_map(|(a, b, c)| {
            Some(serde_json::json!({"prompt_tokens": a, "completion_tokens": b, "total_tokens": if c { Value::from(a) } else { Value::Null }}))
        }),
    ];
    (
        prop::collection::vec((value(), value()), 0..3),
        usage,
        any::<bool>(),
        0u8..8,
    )
        .prop_map(|(around, usage, pretty, kind)| {
            let mut top = Map::new();
            top.insert(
                "choices".into(),
                Value::Array(around.iter().map(|(a, _)| a.clone()).collect()),
            );
            if let Some(u) = usage {
                top.insert("usage".into(), u);
            }
            top.insert(
                "z".into(),
                Value::Array(around.into_iter().map(|(_, b)| b).collect()),
            );
            let top = Value::Object(top);
            let text = if pretty {
                serde_json::to_string_pretty(&top)
            } else {
                serde_json::to_string(&top)
            }
            .unwrap_or_default();
            match kind {
                0 => "[DONE]".into(),
                1 => text[..(0..=text.len() / 2)
                    .rev()
                    .find(|&i| text.is_char_boundary(i))
                    .unwrap_or(0)]
                    .into(),
                2 => format!("{text} x"),
                3 => format!("[{text}]"),
                _ => text,
            }
        })
}

fn cuts(len: usize, at: &[f64]) -> Vec<usize> {
    let mut c: Vec<usize> = at.iter().map(|f| (f * len as f64) as usize).collect();
    c.sort_unstable();
    c
}

crate::proptest_seeds! {
    #![cases(300)]

    /// A JSON answer, cut anywhere, counts what serde_json reads in the whole document.
    #[test]
    fn a_json_answer_counts_what_serde_json_reads(doc in document(), field in prop::sample::select(&FIELDS[..]), at in prop::collection::vec(0.0f64..1.0, 0..8)) {
        prop_assume!(doc.len() < MAX_USAGE);
        let expected = match oracle(&doc, field) { Said::Count(n) => Some(n), _ => None };
        prop_assert_eq!(cut(Framing::Json, field, doc.as_bytes(), &cuts(doc.len(), &at)).0, expected);
    }

    /// An event stream of such documents (pretty ones on several data lines), with
    /// comments, other fields and any line endings, cut anywhere, counts the last
    /// event whose usage serde_json reads.
    #[test]
    fn a_stream_counts_the_last_usage_serde_json_reads(
        events in prop::collection::vec((document(), 0u8..3, 0u8..4, any::<bool>()), 0..6),
        field in prop::sample::select(&FIELDS[..]),
        at in prop::collection::vec(0.0f64..1.0, 0..12),
    ) {
        let mut body = String::new();
        let mut expected = None;
        let mut last_cr = false;
        let mut line = |body: &mut String, text: &str, ending: u8| {
            // CR then an empty line's LF would read as one CRLF: give it a CR too.
            let ending = if last_cr && text.is_empty() && ending == 1 { 0 } else { ending };
            *body += text;
            *body += ["\r", "\n", "\r\n"][usize::from(ending)];
            last_cr = ending == 0;
        };
        for (doc, ending, extra, space) in events {
            prop_assume!(doc.len() < MAX_USAGE);
            match extra { 0 => line(&mut body, ": keep-alive", ending), 1 => line(&mut body, "event: message", ending), _ => {} }
            for part in doc.split('\n') {
                line(&mut body, &format!("data:{}{part}", if space { " " } else { "" }), ending);
            }
            line(&mut body, "", ending);
            match oracle(&doc, field) { Said::Count(n) => expected = Some(n), Said::Unusable => expected = None, Said::Nothing => {} }
        }
        prop_assert_eq!(cut(Framing::EventStream, field, body.as_bytes(), &cuts(body.len(), &at)).0, expected);
    }

    /// Any bytes, cut anywhere: no panic, the same answer as whole, never more held
    /// than one usage object.
    #[test]
    fn any_bytes_are_safe_and_split_invariant(
        body in prop::collection::vec(prop_oneof![any::<u8>(), prop::sample::select(&b"{}[]\":,\\ \r\ndatausage0123456789"[..])], 0..3000),
        at in prop::collection::vec(0.0f64..1.0, 0..12),
    ) {
        for framing in [Framing::Json, Framing::EventStream] {
            let (answer, held) = cut(framing, TotalTokens, &body, &cuts(body.len(), &at));
            prop_assert_eq!(answer, whole(framing, TotalTokens, &body));
            prop_assert!(held <= MAX_USAGE);
        }
    }
}

#[test]
fn a_string_runs_to_its_first_quote_or_backslash() {
    // Fillers next to the stops' bit patterns, and the bytes a borrow could confuse.
    for filler in [0x00u8, 0x21, 0x23, 0x5B, 0x5D, 0xA2, 0xDC, 0x01, 0xFF, b'a'] {
        for len in 0..48 {
            for at in 0..=len {
                for stop in [b'"', b'\\'] {
                    let mut s = vec![filler; len];
                    if at < len {
                        s[at] = stop;
                        // Another stop after the first, and bytes that borrow.
                        s[at..]
                            .iter_mut()
                            .skip(1)
                            .step_by(3)
                            .for_each(|b| *b = b'"');
                    }
                    assert_eq!(string_run(&s), at, "filler {filler:#x}, len {len}, at {at}");
                }
            }
        }
    }
}
