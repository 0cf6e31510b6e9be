//! `reserve = "max_tokens"` (issue 27): a request to an LLM API reserves the tokens it
//! asks the model for at most, read from its own JSON body, before the rules decide. The
//! body is read only when it is JSON (`application/json`, `…+json`) that says its length
//! and is at most [`MAX_BODY`]; it then goes upstream as read. Any other request reserves
//! its rule's `cost`, its body streamed as always.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::request::Parts;
use http::StatusCode;
use http_body_util::BodyExt;
use hyper::body::Body;

use crate::headers::Problem;
use crate::upstream::RequestBody;

/// The largest body read for its `max_tokens`.
pub const MAX_BODY: u64 = 1 << 20;

/// Whether `parts` announce a body worth reading: JSON, of a known length up to
/// [`MAX_BODY`].
fn readable(parts: &Parts, body: &RequestBody) -> bool {
    if body.is_end_stream() {
        return false;
    }
    let json = parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            let essence = v.split(';').next().unwrap_or("").trim();
            let (kind, sub) = essence.split_once('/').unwrap_or(("", ""));
            kind.eq_ignore_ascii_case("application")
                && (sub.eq_ignore_ascii_case("json")
                    || sub.len() > 5 && sub[sub.len() - 5..].eq_ignore_ascii_case("+json"))
        })
        .unwrap_or(false);
    json && body.size_hint().exact().is_some_and(|n| n <= MAX_BODY)
        && parts.headers.contains_key(http::header::CONTENT_LENGTH)
}

/// The request's body, read whole if it is one to look into, and the `max_tokens` (or
/// `max_completion_tokens`) it asks for, if it says; a client that stalls past
/// `timeout` between reads, or whose body breaks, gets the documented 408 or 400.
pub async fn read(
    parts: &Parts,
    body: RequestBody,
    timeout: Duration,
) -> Result<(RequestBody, Option<u64>), Problem> {
    if !readable(parts, &body) {
        return Ok((body, None));
    }
    let mut body = body;
    let mut read = BytesMut::new();
    loop {
        let frame = match tokio::time::timeout(timeout, body.frame()).await {
            Err(_) => {
                return Err(Problem::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "the request body stalled",
                ))
            }
            Ok(None) => break,
            Ok(Some(Err(_))) => {
                return Err(Problem::new(
                    StatusCode::BAD_REQUEST,
                    "the request body could not be read as framed",
                ))
            }
            Ok(Some(Ok(frame))) => frame,
        };
        if let Ok(data) = frame.into_data() {
            // The length was checked; hyper holds the client to it.
            if read.len() as u64 + data.len() as u64 > MAX_BODY {
                return Err(Problem::new(
                    StatusCode::BAD_REQUEST,
                    "the request body is longer than it said",
                ));
            }
            read.extend_from_slice(&data);
        }
    }
    let read: Bytes = read.freeze();
    let asked = max_tokens(&read);
    Ok((RequestBody::Read(Some(read)), asked))
}

/// The request's body as it goes up, and the `max_tokens` it asks for where a rule of
/// `live` reserves them (else its body streamed, untouched); or the gateway's answer to a
/// body that stalled or broke while it was read (408, 400; the connection closes after).
pub async fn asked(
    live: &super::live::Live,
    parts: &Parts,
    body: hyper::body::Incoming,
    dialect: super::grpc::Dialect,
) -> Result<(RequestBody, Option<u64>), http::Response<super::body::Body>> {
    let body = RequestBody::from(body);
    if !live.reserves_max_tokens {
        return Ok((body, None));
    }
    read(parts, body, live.config.server.timeouts.body)
        .await
        .map_err(|p| {
            let mut resp = super::problem(p, &live.config, &[], dialect);
            super::close_after(&mut resp);
            resp
        })
}

/// The tokens a chat or completion request asks for at most, if its JSON says.
pub fn max_tokens(body: &[u8]) -> Option<u64> {
    #[derive(serde::Deserialize)]
    struct Asked {
        max_tokens: Option<serde_json::Value>,
        max_completion_tokens: Option<serde_json::Value>,
    }
    // An object only: serde would read a struct from an array too, by position.
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return None;
    }
    let asked: Asked = serde_json::from_slice(body).ok()?;
    asked
        .max_tokens
        .or(asked.max_completion_tokens)
        .and_then(|v| v.as_u64())
        .filter(|&n| n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_tokens_is_read_from_the_request_json() {
        let b = br#"{"model":"m","messages":[{"role":"user","content":"max_tokens: 9"}],"max_tokens":256}"#;
        assert_eq!(max_tokens(b), Some(256));
        assert_eq!(max_tokens(br#"{"max_completion_tokens":64}"#), Some(64));
        assert_eq!(
            max_tokens(br#"{"max_tokens":100,"max_completion_tokens":64}"#),
            Some(100)
        );
        for none in [
            &br#"{"model":"m"}"#[..],
            br#"{"max_tokens":-1}"#,
            br#"{"max_tokens":1.5}"#,
            br#"{"max_tokens":"100"}"#,
            br#"{"max_tokens":0}"#,
            br#"[1,2]"#,
            b"not json",
            b"",
        ] {
            assert_eq!(max_tokens(none), None, "{}", String::from_utf8_lossy(none));
        }
    }
}
