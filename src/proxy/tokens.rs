//! `reserve = "max_tokens"` (issue 27): a request to an LLM API reserves the tokens it
//! asks the model for at most, read from its own JSON body, before the rules decide.
//!
//! What the request asks for is read whatever its `Content-Type` says and however it is
//! framed (a `Content-Length`, chunked, HTTP/2 DATA frames): backends parse the body as
//! JSON whatever its label, so a `text/plain` or chunked request must not dodge its bill.
//! A body of at most [`MAX_BODY`] is read whole and goes upstream as read; a longer one is
//! read that far, then goes up whole, the rest streamed after what was read
//! ([`RequestBody::Prefixed`]).
//!
//! The answer is an [`Asked`]: the tokens, or why they could not be read
//! ([`Unreadable`]), for each rule to settle its own way (its `default_reserve`, or a
//! refusal with [`Unreadable::status`]). The fields that bound an answer are the Chat
//! Completions' `max_tokens` and `max_completion_tokens` and the Responses API's
//! `max_output_tokens`; every top-level occurrence of each counts, the largest valid one
//! wins ([`asked_of`]).

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::request::Parts;
use http::{Method, StatusCode};
use http_body_util::BodyExt;
use hyper::body::{Body, Incoming};

use crate::headers::Problem;
pub use crate::settle::max_tokens::{asked_of, Asked, Unreadable, MAX_BODY};
use crate::upstream::RequestBody;

/// The request's body as it goes up, and what it asks for; a client that stalls past
/// `timeout` between two frames, or whose body breaks, gets the documented 408 or 400.
pub async fn read(
    parts: &Parts,
    body: Incoming,
    timeout: Duration,
) -> Result<(RequestBody, Asked), Problem> {
    if parts.method == Method::CONNECT || body.is_end_stream() {
        return Ok((body.into(), Asked::Unreadable(Unreadable::NoBody)));
    }
    // A length over the limit is refused unread: the body streams up untouched.
    let announced = body.size_hint().lower();
    if announced > MAX_BODY {
        return Ok((body.into(), Asked::Unreadable(Unreadable::TooLarge)));
    }
    match take(body, announced, timeout).await? {
        Taken::Whole(read) => {
            let asked = asked_of(&read);
            Ok((RequestBody::Read(Some(read)), asked))
        }
        Taken::Over(read, rest) => Ok((
            RequestBody::Prefixed {
                read: Some(read),
                rest,
            },
            Asked::Unreadable(Unreadable::TooLarge),
        )),
    }
}

/// How much of a body [`take`] read.
enum Taken {
    Whole(Bytes),
    /// More than [`MAX_BODY`]: what was read, and the rest to come.
    Over(Bytes, Incoming),
}

/// Read `body` whole, or until it is over [`MAX_BODY`] (the last frame read may take it
/// past by up to one frame's length: hyper's own buffer bounds that). `announced`: the
/// least it said it has, the room made at once.
async fn take(mut body: Incoming, announced: u64, timeout: Duration) -> Result<Taken, Problem> {
    let mut read = BytesMut::with_capacity(usize::try_from(announced).unwrap_or(0));
    loop {
        if read.len() as u64 > MAX_BODY {
            return Ok(Taken::Over(read.freeze(), body));
        }
        let frame = match tokio::time::timeout(timeout, body.frame()).await {
            Err(_) => {
                return Err(Problem::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "the request body stalled",
                ))
            }
            Ok(None) => return Ok(Taken::Whole(read.freeze())),
            Ok(Some(Err(_))) => {
                return Err(Problem::new(
                    StatusCode::BAD_REQUEST,
                    "the request body could not be read as framed",
                ))
            }
            Ok(Some(Ok(frame))) => frame,
        };
        // Trailers (a frame other than data) end the body; they are not passed on.
        if let Ok(data) = frame.into_data() {
            read.extend_from_slice(&data);
        }
    }
}

/// Read `body` (still streaming from the client) for what it asks for, leaving in its
/// place the body as it goes up ([`read`]); a body already read says none.
pub async fn read_into(
    body: &mut RequestBody,
    parts: &Parts,
    timeout: Duration,
) -> Result<Asked, Problem> {
    let incoming = match std::mem::replace(body, RequestBody::Read(None)) {
        RequestBody::Streaming(incoming) => incoming,
        other => {
            *body = other;
            return Ok(Asked::Unreadable(Unreadable::NoBody));
        }
    };
    let (read, asked) = read(parts, incoming, timeout).await?;
    *body = read;
    Ok(asked)
}

#[cfg(test)]
use crate::decide::unreadable as refusal;

#[cfg(test)]
#[path = "tokens_tests.rs"]
mod tests;
