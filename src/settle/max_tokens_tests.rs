//! What a request asks for: the JSON read exactly ([`asked_of`]), each dodge of the token
//! bill a case.

use super::*;

/// What `body` asks for when it says `max` (the gateway's body tests use it too).
pub(crate) fn tokens(max: u64, body: &[u8]) -> Asked {
    Asked::Tokens {
        max,
        body_bytes: body.len() as u64,
    }
}

pub(crate) fn unreadable(why: Unreadable) -> Asked {
    Asked::Unreadable(why)
}

#[test]
fn the_bounds_are_read_from_the_top_level_object() {
    for (body, max) in [
        (
            &br#"{"model":"m","messages":[{"role":"user","content":"max_tokens: 9"}],"max_tokens":256}"#[..],
            256,
        ),
        (br#"{"max_completion_tokens":64}"#, 64),
        // The Responses API's field.
        (br#"{"model":"m","input":"hi","max_output_tokens":300}"#, 300),
        // Whitespace around the object is JSON's.
        (b" \r\n\t{ \"max_tokens\" : 9 }\n", 9),
        // A key spelled with an escape is the same key to the backend.
        (br#"{"max\u005ftokens":9}"#, 9),
        (br#"{"max_tokens":18446744073709551615}"#, u64::MAX),
        (br#"{"max_tokens":1}"#, 1),
    ] {
        let text = String::from_utf8_lossy(body);
        assert_eq!(asked_of(body), tokens(max, body), "{text}");
    }
}

#[test]
fn every_occurrence_of_every_bound_counts_and_the_largest_wins() {
    for (body, max) in [
        // A key given twice: whichever the backend keeps, the larger is reserved.
        (&br#"{"max_tokens":10,"max_tokens":5000}"#[..], 5000),
        (br#"{"max_tokens":5000,"max_tokens":10}"#, 5000),
        (br#"{"max_tokens":100,"max_completion_tokens":6400}"#, 6400),
        (br#"{"max_output_tokens":7,"max_tokens":3}"#, 7),
        // An invalid occurrence beside a valid one: the valid one counts.
        (br#"{"max_tokens":null,"max_completion_tokens":64}"#, 64),
        (br#"{"max_tokens":64,"max_tokens":"9000"}"#, 64),
        (br#"{"max_tokens":-1,"max_tokens":12,"max_tokens":1e9}"#, 12),
    ] {
        let text = String::from_utf8_lossy(body);
        assert_eq!(asked_of(body), tokens(max, body), "{text}");
    }
}

#[test]
fn a_bound_that_is_not_a_whole_number_of_at_least_one_is_bad() {
    for value in [
        "0",
        "-1",
        "-0",
        "1e9",
        "1E3",
        "1.0",
        "1.5",
        "\"500\"",
        "null",
        "true",
        "[]",
        "[500]",
        "{}",
        r#"{"max_tokens":500}"#,
        // One over u64::MAX: serde_json reads it as a float.
        "18446744073709551616",
        "-9223372036854775809",
    ] {
        for field in BOUNDS {
            let body = format!(r#"{{"model":"m","{field}":{value},"stream":true}}"#);
            assert_eq!(
                asked_of(body.as_bytes()),
                unreadable(Unreadable::BadMaxTokens),
                "{body}"
            );
        }
    }
    assert_eq!(
        asked_of(br#"{"max_tokens":0,"max_completion_tokens":null}"#),
        unreadable(Unreadable::BadMaxTokens)
    );
}

#[test]
fn an_object_without_a_bound_at_the_top_has_none() {
    for body in [
        &b"{}"[..],
        br#"{"model":"m"}"#,
        // Deeper, or in a string, or spelled otherwise: not the request's bound.
        br#"{"extra":{"max_tokens":5}}"#,
        br#"{"messages":[{"max_tokens":5}]}"#,
        br#"{"prompt":"\"max_tokens\":5"}"#,
        br#"{"Max_Tokens":5,"max-tokens":5,"maxTokens":5,"max_tokens ":5}"#,
    ] {
        let text = String::from_utf8_lossy(body);
        assert_eq!(
            asked_of(body),
            unreadable(Unreadable::NoMaxTokens),
            "{text}"
        );
    }
}

#[test]
fn one_leading_bom_is_skipped_and_counted_in_the_bytes() {
    let body = b"\xEF\xBB\xBF{\"max_tokens\":7}";
    assert_eq!(asked_of(body), tokens(7, body));
    assert_eq!(
        asked_of(b"\xEF\xBB\xBF\xEF\xBB\xBF{\"max_tokens\":7}"),
        unreadable(Unreadable::NotJson)
    );
    assert_eq!(asked_of(b"\xEF\xBB\xBF"), unreadable(Unreadable::NotJson));
}

#[test]
fn anything_but_one_json_object_is_not_json() {
    for body in [
        &br#"[{"max_tokens":9}]"#[..],
        br#""max_tokens""#,
        b"42",
        b"null",
        b"not json",
        b"max_tokens=9",
        b"   ",
        br#"{"max_tokens":9"#,
        br#"{"max_tokens":9} x"#,
        br#"{"max_tokens":9}{"max_tokens":1}"#,
        br#"{"max_tokens":9,}"#,
        br#"{max_tokens:9}"#,
        // Malformed elsewhere: the backend refuses it too.
        br#"{"max_tokens":9,"x":[1,2}"#,
        // UTF-16, as a few clients send.
        b"\xFF\xFE{\0\"\0m\0\"\0:\x001\0}\0",
    ] {
        let text: String = String::from_utf8_lossy(body).chars().take(60).collect();
        assert_eq!(asked_of(body), unreadable(Unreadable::NotJson), "{text}");
    }
    assert_eq!(asked_of(b""), unreadable(Unreadable::NoBody));
    // Values skipped unread are skipped without recursion (serde_json keeps the nesting
    // in a buffer): a deep one costs no stack, in a bound or beside it.
    let (open, close) = ("[".repeat(100_000), "]".repeat(100_000));
    let deep = format!(r#"{{"max_tokens":9,"x":{open}{close}}}"#);
    assert_eq!(asked_of(deep.as_bytes()), tokens(9, deep.as_bytes()));
    let deep = format!(r#"{{"max_tokens":{open}{close}}}"#);
    assert_eq!(
        asked_of(deep.as_bytes()),
        unreadable(Unreadable::BadMaxTokens)
    );
    // Bytes that are no UTF-8 inside a string skipped unread: the bound stands (serde_json
    // skips strings unchecked), and the backend refuses the body anyway.
    let body = b"{\"max_tokens\":9,\"x\":\"\xFF\"}";
    assert_eq!(asked_of(body), tokens(9, body));
}

#[test]
fn each_reason_says_its_status_detail_and_name() {
    use Unreadable::*;
    let all = [NoBody, TooLarge, NotJson, NoMaxTokens, BadMaxTokens];
    let statuses: Vec<u16> = all.iter().map(|u| u.status().as_u16()).collect();
    assert_eq!(statuses, [411, 413, 400, 400, 400]);
    let mut names: Vec<&str> = all.iter().map(|u| u.name()).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), all.len());
    for u in all {
        assert!(!u.detail().is_empty());
    }
}

#[test]
fn the_prompt_is_estimated_at_a_token_per_four_bytes_rounded_up() {
    let estimates: Vec<u64> = [0, 1, 4, 5, 8, 1 << 20].map(prompt_estimate).to_vec();
    assert_eq!(estimates, [0, 1, 1, 2, 2, 1 << 18]);
    assert_eq!(prompt_estimate(u64::MAX), u64::MAX / 4 + 1);
}

#[test]
fn several_answers_asked_for_multiply_the_bound() {
    for (body, max) in [
        (&br#"{"max_tokens":1000,"n":8}"#[..], 8000),
        (br#"{"n":3,"max_completion_tokens":100}"#, 300),
        (br#"{"max_tokens":100,"best_of":5,"n":2}"#, 500),
        (br#"{"max_tokens":100,"n":1}"#, 100),
        (br#"{"max_tokens":100,"n":2,"n":7}"#, 700),
        (br#"{"max_tokens":18446744073709551615,"n":2}"#, u64::MAX),
    ] {
        assert_eq!(
            asked_of(body),
            tokens(max, body),
            "{}",
            String::from_utf8_lossy(body)
        );
    }
    for body in [
        &br#"{"max_tokens":100,"n":0}"#[..],
        br#"{"max_tokens":100,"n":"8"}"#,
        br#"{"max_tokens":100,"n":8.0}"#,
        br#"{"max_tokens":100,"best_of":null}"#,
    ] {
        assert_eq!(
            asked_of(body),
            unreadable(Unreadable::BadMaxTokens),
            "{}",
            String::from_utf8_lossy(body)
        );
    }
}
