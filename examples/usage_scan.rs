//! What reading an LLM backend's token usage costs as its answer streams past: the usage
//! scanner (`ratewall::settle::usage`) fed an answer in 16 KiB pieces, against passing the
//! same pieces through unparsed (a copy into a reused buffer, as a proxy's copy loop does).
//!
//! Two answers: a streamed chat completion (~20 MB of ~200-byte chunks with `"usage":null`,
//! then the final usage chunk and `data: [DONE]`) and a JSON completion of ~2 MB (a long
//! reply with its logprobs). Three rounds each, scanner and pass-through interleaved; MB/s
//! (10^6 bytes) of each, and how many times the pass-through's is the scanner's: the median
//! and the range of the rounds.
//!
//!     cargo run --release --example usage_scan

use std::hint::black_box;
use std::time::Instant;

use ratewall::settle::usage::{Framing, UsageField, UsageScanner};

const PIECE: usize = 16 * 1024;
const ROUNDS: usize = 3;
/// Bytes each round reads: passes over the answer until this many.
const ROUND_BYTES: usize = 400_000_000;

/// A deterministic word list for the replies (with the escapes real text has).
const WORDS: [&str; 12] = [
    " the",
    " gateway",
    " limits",
    " tokens",
    ",",
    " and",
    " \\\"quoted\\\"",
    "\\n",
    " usage",
    " per",
    " second",
    ".",
];

fn stream() -> Vec<u8> {
    let head = r#"{"id":"chatcmpl-AqR7c4T2bLrVxG1nYz8pQ0sD","object":"chat.completion.chunk","created":1741570283,"model":"gpt-4o-mini-2024-07-18","system_fingerprint":"fp_06737a9306","choices":"#;
    let mut s = String::new();
    let mut i = 0;
    while s.len() < 20_000_000 {
        let word = WORDS[i % WORDS.len()];
        s += &format!(
            "data: {head}[{{\"index\":0,\"delta\":{{\"content\":\"{word}\"}},\"logprobs\":null,\"finish_reason\":null}}],\"usage\":null}}\n\n"
        );
        i += 7;
    }
    s += &format!("data: {head}[],\"usage\":{{\"prompt_tokens\":1117,\"completion_tokens\":{i},\"total_tokens\":{},\"prompt_tokens_details\":{{\"cached_tokens\":0,\"audio_tokens\":0}},\"completion_tokens_details\":{{\"reasoning_tokens\":0,\"audio_tokens\":0,\"accepted_prediction_tokens\":0,\"rejected_prediction_tokens\":0}}}}}}\n\ndata: [DONE]\n\n", i + 1117);
    s.into_bytes()
}

fn completion() -> Vec<u8> {
    let mut content = String::new();
    let mut logprobs = Vec::new();
    let mut i = 0;
    while content.len() + logprobs.iter().map(String::len).sum::<usize>() < 2_000_000 {
        let word = WORDS[i % WORDS.len()];
        content += word;
        let bytes: Vec<String> = word.bytes().map(|b| b.to_string()).collect();
        logprobs.push(format!(
            "{{\"token\":\"{word}\",\"logprob\":-0.{i:04},\"bytes\":[{}],\"top_logprobs\":[]}}",
            bytes.join(",")
        ));
        i += 1;
    }
    format!(
        r#"{{"id":"chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG","object":"chat.completion","created":1741570283,"model":"gpt-4o-2024-08-06","choices":[{{"index":0,"message":{{"role":"assistant","content":"{content}","refusal":null,"annotations":[]}},"logprobs":{{"content":[{}],"refusal":null}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":1117,"completion_tokens":{i},"total_tokens":{},"prompt_tokens_details":{{"cached_tokens":0,"audio_tokens":0}},"completion_tokens_details":{{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}}},"service_tier":"default","system_fingerprint":"fp_fc9f1d7035"}}"#,
        logprobs.join(","),
        i + 1117
    )
    .into_bytes()
}

/// The total in the answer's final usage, which the scanner must find.
fn expected(body: &[u8]) -> u64 {
    let text = String::from_utf8_lossy(body);
    let at = text.rfind("\"total_tokens\":").expect("a usage") + "\"total_tokens\":".len();
    let digits: String = text[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().expect("a count")
}

/// MB/s of one round: `passes` times through `body` in 16 KiB pieces.
fn round(body: &[u8], passes: usize, mut pass: impl FnMut(&[u8])) -> f64 {
    let start = Instant::now();
    for _ in 0..passes {
        pass(black_box(body));
    }
    (body.len() * passes) as f64 / 1e6 / start.elapsed().as_secs_f64()
}

fn median_and_range(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn main() {
    println!(
        "answer                       size     scanner MB/s          pass-through MB/s       pass/scan (x)"
    );
    for (name, framing, body) in [
        ("event stream, 200 B chunks", Framing::EventStream, stream()),
        ("JSON completion + logprobs", Framing::Json, completion()),
    ] {
        let want = expected(&body);
        let passes = (ROUND_BYTES / body.len()).max(1);
        let mut buffer = vec![0u8; PIECE];
        let (mut scans, mut copies, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let scan = round(&body, passes, |body| {
                let mut s = UsageScanner::new(framing, UsageField::TotalTokens);
                for piece in body.chunks(PIECE) {
                    s.feed(piece);
                }
                assert_eq!(s.finish(), Some(want), "{name}: the scanner's count");
            });
            let copy = round(&body, passes, |body| {
                let mut sum = 0usize;
                for piece in body.chunks(PIECE) {
                    buffer[..piece.len()].copy_from_slice(piece);
                    sum += black_box(&buffer[..piece.len()]).len();
                }
                assert_eq!(sum, body.len());
            });
            scans.push(scan);
            copies.push(copy);
            ratios.push(copy / scan);
        }
        let (s, s0, s1) = median_and_range(scans);
        let (c, c0, c1) = median_and_range(copies);
        let (r, r0, r1) = median_and_range(ratios);
        println!(
            "{name}   {:>5.1} MB   {s:>6.0} ({s0:.0}-{s1:.0})   {c:>7.0} ({c0:.0}-{c1:.0})   {r:>6.2} ({r0:.2}-{r1:.2})",
            body.len() as f64 / 1e6
        );
    }
}
