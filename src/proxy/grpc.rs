//! gRPC answers: which requests are gRPC calls, what the gateway's own answers become for
//! them, and the status of the answers it passes on.
//!
//! A gRPC client reads the call's outcome from `grpc-status`, not from the HTTP status: an
//! HTTP 429 reaches its application as UNAVAILABLE (the gRPC spec's
//! http-grpc-status-mapping), which its retry policy retries at once. So every answer the
//! gateway writes to a gRPC request is a gRPC answer (linkerd's synthetic responses are
//! the model): HTTP 200, an empty body, and everything in the headers — a
//! *Trailers-Only* response (gRPC over HTTP/2, "Responses": `HTTP-Status`,
//! `Content-Type`, `Status`, `Status-Message` in one HEADERS frame that ends the stream).
//! [`Code::of_status`] is the table from the gateway's HTTP status to the gRPC status,
//! [`trailers_only`] writes the fields; `super::problem` is the one function through which
//! every answer of the gateway goes, HTTP or gRPC as [`Dialect::of`] the request says.
//!
//! Answers passed on are the backend's: their `grpc-status` is read, never changed —
//! from the headers of a Trailers-Only answer, or from the trailers as the body passes
//! (`Watch`, on gRPC requests only), to count it and to log it.

use std::borrow::Cow;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};

use super::access::Deferred;
use super::Metrics;
use crate::headers::{Applied, Problem};
pub use crate::telemetry::grpc::{Code, Origin};

pub static GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
pub static GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
/// gRPC's retry design (A6): the delay, in ms, a client's retry policy waits before its
/// next attempt.
pub static GRPC_RETRY_PUSHBACK_MS: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// How a request is answered: as HTTP, or as a gRPC call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    Http,
    Grpc,
}

impl Dialect {
    /// A gRPC call is a request whose `content-type` is `application/grpc`, or starts
    /// with `application/grpc+` (`+proto`, `+json`...) or `application/grpc;` (gRPC over
    /// HTTP/2, "Requests": `Content-Type`), the type compared without regard to case.
    /// One header lookup: what every request pays for gRPC.
    pub fn of(headers: &HeaderMap) -> Dialect {
        const GRPC: &[u8] = b"application/grpc";
        let Some(v) = headers.get(CONTENT_TYPE) else {
            return Dialect::Http;
        };
        let b = v.as_bytes();
        match b.get(..GRPC.len()) {
            Some(head) if head.eq_ignore_ascii_case(GRPC) => match b.get(GRPC.len()) {
                None | Some(b'+') | Some(b';') => Dialect::Grpc,
                Some(_) => Dialect::Http,
            },
            _ => Dialect::Http,
        }
    }
}

/// The `grpc-status` of a Trailers-Only answer's headers, or of a trailers block.
pub fn status_of(fields: &HeaderMap) -> Option<Code> {
    fields.get(&GRPC_STATUS).map(|v| Code::parse(v.as_bytes()))
}

/// `grpc-message` as the gRPC spec writes it (gRPC over HTTP/2, "Responses":
/// `Status-Message`): the UTF-8 bytes of `message`, each outside space..`~` (0x20-0x7E),
/// and `%` itself, written `%XX` in upper-case hex.
pub fn percent_encode(message: &str) -> Cow<'_, str> {
    let plain = |b: u8| (0x20..=0x7E).contains(&b) && b != b'%';
    if message.bytes().all(plain) {
        return Cow::Borrowed(message);
    }
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = String::with_capacity(message.len() + 16);
    for b in message.bytes() {
        if plain(b) {
            out.push(char::from(b));
        } else {
            out.push('%');
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0xF)]));
        }
    }
    Cow::Owned(out)
}

/// The message of the gateway's gRPC answer: the problem's detail, or for a denial its
/// title and the rules that denied (the 429 body's `violated-policies`).
fn message(p: &Problem, applied: &[Applied<'_>]) -> String {
    if let Some(detail) = &p.detail {
        return detail.to_string();
    }
    let title = p.status.canonical_reason().unwrap_or("Error");
    let mut denied = applied.iter().filter(|a| !a.decision.allowed).peekable();
    if denied.peek().is_none() {
        return title.to_string();
    }
    let mut m = format!("{title}: rate limited by ");
    for (i, a) in denied.enumerate() {
        if i > 0 {
            m.push_str(", ");
        }
        m.push_str(a.rule);
    }
    m
}

/// Write `p` as a Trailers-Only gRPC answer into `headers` (the response's status stays
/// 200, its body empty): `content-type: application/grpc`, `grpc-status` by
/// [`Code::of_status`], `grpc-message` percent-encoded, and where the answer says when to
/// come back, `Retry-After` (kept, for what reads HTTP) and `grpc-retry-pushback-ms`.
/// Returns the status written.
pub fn trailers_only(p: &Problem, applied: &[Applied<'_>], headers: &mut HeaderMap) -> Code {
    let code = Code::of_status(p.status);
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    headers.insert(GRPC_STATUS.clone(), HeaderValue::from_static(code.name()));
    let message = message(p, applied);
    // Percent-encoded: printable ASCII only, always a valid field value.
    if let Ok(v) =
        HeaderValue::from_maybe_shared(Bytes::from(percent_encode(&message).into_owned()))
    {
        headers.insert(GRPC_MESSAGE.clone(), v);
    }
    if let Some(s) = p.retry_after {
        headers.insert(RETRY_AFTER, HeaderValue::from(s));
    }
    if let Some(ms) = p.retry_after_ms {
        headers.insert(GRPC_RETRY_PUSHBACK_MS.clone(), HeaderValue::from(ms));
    }
    code
}

/// A passed-on gRPC answer's body, watched for the `grpc-status` of its trailers: when it
/// ends (or the client goes away first) the status is counted
/// (`ratewall_grpc_responses_total{source="upstream"}`) and the request's access line,
/// held until then, is written with it. Made for gRPC requests whose answer's headers
/// carry no status; other bodies are never watched.
pub(super) struct Watch {
    metrics: Arc<Metrics>,
    log: Option<Deferred>,
    status: Option<Code>,
    ended: bool,
}

impl Watch {
    pub(super) fn new(metrics: Arc<Metrics>, log: Option<Deferred>) -> Watch {
        Watch {
            metrics,
            log,
            status: None,
            ended: false,
        }
    }

    /// A frame on its way to the client: trailers carry the status.
    pub(super) fn frame(&mut self, frame: &hyper::body::Frame<Bytes>) {
        if let Some(status) = frame.trailers_ref().and_then(status_of) {
            self.status = Some(status);
        }
    }

    /// The body ended, failed, or was dropped: count and log, once. A body that ended
    /// without a status (cut short, or not gRPC) is logged without one and not counted.
    pub(super) fn end(&mut self) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        if let Some(code) = self.status {
            self.metrics.gateway.count_grpc(code, Origin::Upstream);
        }
        if let Some(log) = self.log.take() {
            log.write(self.status);
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;

    fn dialect(ct: &str) -> Dialect {
        let mut h = HeaderMap::new();
        h.insert(CONTENT_TYPE, HeaderValue::from_str(ct).unwrap());
        Dialect::of(&h)
    }

    #[test]
    fn a_grpc_call_is_told_by_its_content_type() {
        for ct in [
            "application/grpc",
            "application/grpc+proto",
            "application/grpc+json",
            "application/grpc;charset=utf-8",
            "Application/GRPC",
            "APPLICATION/GRPC+PROTO",
        ] {
            assert_eq!(dialect(ct), Dialect::Grpc, "{ct}");
        }
        for ct in [
            "application/grpc-web",
            "application/grpc-web+proto",
            "application/grpcx",
            "application/json",
            "text/plain",
            "application/gr",
            "",
        ] {
            assert_eq!(dialect(ct), Dialect::Http, "{ct}");
        }
        assert_eq!(Dialect::of(&HeaderMap::new()), Dialect::Http);
    }

    #[test]
    fn the_gateways_statuses_map_to_grpc_codes() {
        let table = [
            (429, 8),
            (401, 16),
            (503, 14),
            (502, 14),
            (504, 4),
            (400, 13),
            (408, 13),
            (413, 13),
            (431, 13),
            (404, 12),
            (403, 7),
            (501, 2),
            (405, 2),
            (500, 2),
            (308, 2),
        ];
        for (http, grpc) in table {
            let code = Code::of_status(StatusCode::from_u16(http).unwrap());
            assert_eq!(code.number(), grpc, "{http}");
            assert_eq!(code.name(), grpc.to_string(), "{http}");
        }
    }

    #[test]
    fn a_gateway_answer_counts_as_the_http_status_it_stands_for() {
        for http in [429, 401, 504, 404, 403, 400, 501] {
            let code = Code::of_status(StatusCode::from_u16(http).unwrap());
            assert_eq!(code.stands_for(false), http, "{http}");
        }
        assert_eq!(Code::Unavailable.stands_for(false), 503, "the store failed");
        assert_eq!(
            Code::Unavailable.stands_for(true),
            502,
            "the upstream failed"
        );
        // The client's stalled body (408) and the like are the same outcome as a 400.
        assert_eq!(
            Code::of_status(StatusCode::REQUEST_TIMEOUT).stands_for(true),
            400
        );
    }

    #[test]
    fn codes_are_numbered_in_order_and_parsed_as_clients_read_them() {
        for (n, code) in Code::ALL.iter().enumerate() {
            assert_eq!(usize::from(code.number()), n);
            assert_eq!(code.name(), n.to_string());
            assert_eq!(Code::parse(n.to_string().as_bytes()), *code);
        }
        assert_eq!(Code::ALL.len(), 17);
        assert_eq!(Code::parse(b"17"), Code::Unknown);
        assert_eq!(Code::parse(b"x"), Code::Unknown);
        assert_eq!(Code::parse(b""), Code::Unknown);
        assert_eq!(Code::parse(b"-1"), Code::Unknown);
    }

    #[test]
    fn grpc_messages_are_percent_encoded_as_the_spec_writes_them() {
        assert!(matches!(
            percent_encode("no route matches this request"),
            Cow::Borrowed(_)
        ));
        assert_eq!(percent_encode("a b~c"), "a b~c");
        assert_eq!(percent_encode("100%"), "100%25");
        assert_eq!(percent_encode("line\nbreak\r\t"), "line%0Abreak%0D%09");
        assert_eq!(percent_encode("é"), "%C3%A9");
        assert_eq!(percent_encode("\u{7f}"), "%7F");
        assert_eq!(percent_encode("日本"), "%E6%97%A5%E6%9C%AC");
        // Decoding gives the message back, byte for byte.
        let m = "quota: 50% — «api» used\u{0}";
        let enc = percent_encode(m);
        assert!(enc.bytes().all(|b| (0x20..=0x7E).contains(&b)), "{enc}");
        let mut dec = Vec::new();
        let b = enc.as_bytes();
        let mut i = 0;
        while i < b.len() {
            if b[i] == b'%' {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap();
                dec.push(u8::from_str_radix(hex, 16).unwrap());
                i += 3;
            } else {
                dec.push(b[i]);
                i += 1;
            }
        }
        assert_eq!(String::from_utf8(dec).unwrap(), m);
    }

    #[test]
    fn a_trailers_only_answer_carries_status_message_and_pushback() {
        let p = Problem::new(StatusCode::SERVICE_UNAVAILABLE, "the store is 100% down")
            .with_retry_after(1);
        let mut h = HeaderMap::new();
        assert_eq!(trailers_only(&p, &[], &mut h), Code::Unavailable);
        assert_eq!(h[CONTENT_TYPE], "application/grpc");
        assert_eq!(h[&GRPC_STATUS], "14");
        assert_eq!(h[&GRPC_MESSAGE], "the store is 100%25 down");
        assert_eq!(h[RETRY_AFTER], "1");
        assert_eq!(h[&GRPC_RETRY_PUSHBACK_MS], "1000");
        let mut h = HeaderMap::new();
        let p = Problem::new(StatusCode::UNAUTHORIZED, "no key");
        assert_eq!(trailers_only(&p, &[], &mut h), Code::Unauthenticated);
        assert!(h.get(RETRY_AFTER).is_none() && h.get(&GRPC_RETRY_PUSHBACK_MS).is_none());
        assert_eq!(h[&GRPC_MESSAGE], "no key");
        assert_eq!(status_of(&h), Some(Code::Unauthenticated));
    }
}
