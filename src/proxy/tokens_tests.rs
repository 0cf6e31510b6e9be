//! Bodies read as hyper's server hands them ([`read`], HTTP/1.1 and HTTP/2, any
//! `Content-Type`, any framing, too long, stalled, broken).

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::BodyExt;

use super::*;
use crate::settle::max_tokens::tests::{tokens, unreadable};
use crate::upstream::served;

const SECOND: Duration = Duration::from_secs(5);

#[test]
fn a_refused_body_is_answered_with_its_reason() {
    use Unreadable::*;
    for u in [NoBody, TooLarge, NotJson, NoMaxTokens, BadMaxTokens] {
        let p = refusal(u);
        assert_eq!(p.status, u.status());
        assert_eq!(p.detail.as_deref(), Some(u.detail()));
    }
}

/// An HTTP/1.1 request of `head` (its fields, each line ending in CRLF) and `body` as
/// is (framed by the fields).
fn http1(head: &str, body: &[u8]) -> Vec<u8> {
    [
        format!("POST /v1/chat/completions HTTP/1.1\r\nhost: a\r\n{head}\r\n").as_bytes(),
        body,
    ]
    .concat()
}

/// `body` chunked in pieces of `size` bytes.
fn chunked(body: &[u8], size: usize) -> Vec<u8> {
    let mut wire = Vec::new();
    for piece in body.chunks(size) {
        wire.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
        wire.extend_from_slice(piece);
        wire.extend_from_slice(b"\r\n");
    }
    wire.extend_from_slice(b"0\r\n\r\n");
    wire
}

/// What [`read`] makes of a body it reads to the end.
async fn read_ok(parts: &Parts, body: Incoming) -> (RequestBody, Asked) {
    match read(parts, body, SECOND).await {
        Ok(read) => read,
        Err(p) => panic!("answered {} {:?}", p.status, p.detail),
    }
}

/// What [`read`] makes of `req`, its body then read to the end as it goes up.
async fn read_all(req: Request<Incoming>) -> (Asked, Vec<u8>, RequestBody) {
    let (parts, body) = req.into_parts();
    let (mut body, asked) = read_ok(&parts, body).await;
    let mut up = Vec::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.expect("a frame").into_data() {
            up.extend_from_slice(&data);
        }
    }
    (asked, up, body)
}

#[tokio::test]
async fn any_content_type_and_framing_is_read() {
    let json = br#"{"model":"m","max_tokens":500}"#;
    let length = format!("content-length: {}\r\n", json.len());
    // application/json alone was read before: the others dodged the reservation.
    for head in [
        format!("content-type: application/json\r\n{length}"),
        format!("content-type: text/plain\r\n{length}"),
        format!("content-type: text/json; charset=utf-8\r\n{length}"),
        format!("content-type: application/x-www-form-urlencoded\r\n{length}"),
        length.clone(),
    ] {
        let req = served::http1(http1(&head, json)).await;
        let (asked, up, _) = read_all(req).await;
        assert_eq!(asked, tokens(500, json), "{head}");
        assert_eq!(up, json);
    }
    for size in [1, 7, json.len()] {
        let wire = http1("transfer-encoding: chunked\r\n", &chunked(json, size));
        let (asked, up, body) = read_all(served::http1(wire).await).await;
        assert_eq!(asked, tokens(500, json), "chunks of {size}");
        assert_eq!(up, json);
        assert!(matches!(body, RequestBody::Read(None)), "{body:?}");
    }
}

#[tokio::test]
async fn http2_bodies_are_read_with_a_length_or_without() {
    let json = br#"{"max_output_tokens":42,"input":"hello"}"#;
    let pieces: Vec<Bytes> = json.chunks(5).map(Bytes::copy_from_slice).collect();
    for length in [Some(json.len()), None] {
        let mut req = Request::post("http://a/v1/responses");
        if let Some(n) = length {
            req = req.header("content-length", n);
        }
        let req = req.body(()).expect("a request");
        let (asked, up, _) = read_all(served::http2(req, pieces.clone()).await).await;
        assert_eq!(asked, tokens(42, json), "length {length:?}");
        assert_eq!(up, json);
    }
}

#[tokio::test]
async fn a_request_without_a_body_has_no_body() {
    for head in ["", "content-length: 0\r\n"] {
        let (asked, up, _) = read_all(served::http1(http1(head, b"")).await).await;
        assert_eq!(asked, unreadable(Unreadable::NoBody), "{head:?}");
        assert!(up.is_empty());
    }
    // Chunked, and nothing in it.
    let wire = http1("transfer-encoding: chunked\r\n", b"0\r\n\r\n");
    let (asked, _, _) = read_all(served::http1(wire).await).await;
    assert_eq!(asked, unreadable(Unreadable::NoBody));
    let get = Request::get("http://a/").body(()).expect("a request");
    let (asked, _, _) = read_all(served::http2(get, vec![]).await).await;
    assert_eq!(asked, unreadable(Unreadable::NoBody));
}

/// A JSON body of `len` bytes, its `max_tokens` first.
fn long_json(len: usize) -> Vec<u8> {
    let open = br#"{"max_tokens":9,"prompt":""#;
    let mut body = open.to_vec();
    body.resize(len - 2, b'a');
    body.extend_from_slice(br#""}"#);
    body
}

#[tokio::test]
async fn a_body_over_the_limit_is_too_large_and_goes_up_whole() {
    let limit = MAX_BODY as usize;
    let exact = long_json(limit);
    let wire = http1(&format!("content-length: {limit}\r\n"), &exact);
    let (asked, up, _) = read_all(served::http1(wire).await).await;
    assert_eq!(asked, tokens(9, &exact), "at the limit: read");
    assert_eq!(up, exact);

    let over = long_json(limit + 1);
    // Its length said: not read at all, streamed.
    let wire = http1(&format!("content-length: {}\r\n", over.len()), &over);
    let (parts, body) = served::http1(wire).await.into_parts();
    let (body, asked) = read_ok(&parts, body).await;
    assert_eq!(asked, unreadable(Unreadable::TooLarge));
    assert!(matches!(body, RequestBody::Streaming(_)), "{body:?}");
    let up = body.collect().await.expect("the body").to_bytes();
    assert_eq!(up, over);

    // Chunked: read past the limit, then the rest after what was read.
    let wire = http1("transfer-encoding: chunked\r\n", &chunked(&over, 16 * 1024));
    let (parts, body) = served::http1(wire).await.into_parts();
    let (body, asked) = read_ok(&parts, body).await;
    assert_eq!(asked, unreadable(Unreadable::TooLarge));
    assert!(matches!(body, RequestBody::Prefixed { .. }), "{body:?}");
    assert_eq!(body.size_hint().exact(), None, "sent up chunked");
    let up = body.collect().await.expect("the body").to_bytes();
    assert_eq!(up, over);

    // HTTP/2 without a length, likewise.
    let pieces: Vec<Bytes> = over.chunks(60_000).map(Bytes::copy_from_slice).collect();
    let req = Request::post("http://a/").body(()).expect("a request");
    let (asked, up, _) = read_all(served::http2(req, pieces).await).await;
    assert_eq!(asked, unreadable(Unreadable::TooLarge));
    assert_eq!(up, over);
}

#[tokio::test]
async fn a_stalled_body_is_a_408_and_a_broken_one_a_400() {
    // Five bytes of the ten it announced, then nothing.
    let wire = http1("content-length: 10\r\n", b"{\"max");
    let (parts, body) = served::http1(wire).await.into_parts();
    let stalled = read(&parts, body, Duration::from_millis(50)).await;
    assert_eq!(stalled.err().map(|p| p.status.as_u16()), Some(408));

    let wire = http1("transfer-encoding: chunked\r\n", b"zz\r\n{}\r\n0\r\n\r\n");
    let (parts, body) = served::http1(wire).await.into_parts();
    let broken = read(&parts, body, SECOND).await;
    assert_eq!(broken.err().map(|p| p.status.as_u16()), Some(400));
}
