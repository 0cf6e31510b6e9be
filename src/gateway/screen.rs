//! Requests a front proxy and its upstream could read differently, refused before
//! anything else: smuggling-prone framing, mis-cased or tunnelling methods, hosts that
//! do not add up.

use http::request::Parts;
use http::{HeaderMap, StatusCode};

use crate::headers::Problem;

/// What is wrong with a request's head, if anything: answered at once, and the connection
/// closed (nothing after such a request can be trusted to start where a request starts).
pub(super) fn problem(parts: &Parts) -> Option<Problem> {
    method_problem(&parts.method)
        .or_else(|| framing_problem(&parts.headers))
        .or_else(|| host_problem(parts.version, &parts.uri, &parts.headers))
}

/// Requests a front proxy and its upstream could read differently (request smuggling),
/// refused before anything else. hyper's HTTP/1 parser already answers 400 to conflicting
/// `Content-Length`s, `Transfer-Encoding` on HTTP/1.0 and codings that do not end in
/// `chunked`; and for `Transfer-Encoding` with `Content-Length` it does what RFC 9112 §6.3
/// asks of an intermediary that forwards such a message: it drops the `Content-Length`,
/// reads the body as chunked, and closes the connection after the answer, so nothing queued
/// behind the request is ever read. This refuses what it lets through:
/// - a `Transfer-Encoding` other than one plain `chunked` (`gzip, chunked`, repeated
///   lines): the only coding a proxy may pass on without knowing it (RFC 9112 §6.1);
/// - more than one `Host`: RFC 9112 §3.2 requires a 400.
fn framing_problem(headers: &HeaderMap) -> Option<Problem> {
    use http::header::{HOST, TRANSFER_ENCODING};
    let mut te = headers.get_all(TRANSFER_ENCODING).iter();
    match (te.next(), te.next()) {
        (None, _) => {}
        (Some(_), Some(_)) => {
            return Some(Problem::new(
                StatusCode::BAD_REQUEST,
                "Transfer-Encoding sent more than once",
            ));
        }
        (Some(v), None) => {
            if !v.as_bytes().trim_ascii().eq_ignore_ascii_case(b"chunked") {
                return Some(Problem::new(
                    StatusCode::NOT_IMPLEMENTED,
                    "only Transfer-Encoding: chunked is supported",
                ));
            }
        }
    }
    if headers.get_all(HOST).iter().nth(1).is_some() {
        return Some(Problem::new(
            StatusCode::BAD_REQUEST,
            "more than one Host header",
        ));
    }
    None
}

/// Methods a rule's filter or the upstream could read differently from the gateway:
/// - a standard method spelled other than in upper case (`get`): methods are
///   case-sensitive (RFC 9110 §9.1), so `get` is not `GET` to a `methods = ["GET"]` filter,
///   yet some backends route it as `GET`; the ambiguity itself is refused (400), as nginx
///   does;
/// - `CONNECT`: a tunnel, not a request to forward (501).
fn method_problem(method: &http::Method) -> Option<Problem> {
    const STANDARD: [&str; 9] = [
        "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
    ];
    if *method == http::Method::CONNECT {
        return Some(Problem::new(
            StatusCode::NOT_IMPLEMENTED,
            "CONNECT is not supported: this gateway forwards requests, it does not open tunnels",
        ));
    }
    let name = method.as_str();
    let miscased = name.bytes().any(|b| b.is_ascii_lowercase())
        && STANDARD.iter().any(|s| s.eq_ignore_ascii_case(name));
    miscased.then(|| {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "method names are case-sensitive: standard methods are upper case",
        )
    })
}

/// Hosts that do not add up: an HTTP/1.1 request without `Host` (RFC 9112 §3.2: 400,
/// whatever its target), and a request target with an authority (absolute form, or
/// HTTP/2's `:authority`) with a `Host` that names another host. HTTP/2 asks for that
/// one to be treated as malformed (RFC 9113 §8.3.1); for HTTP/1's absolute form, RFC 9112
/// §3.2.2 has a proxy replace `Host` with the target's authority, which the rules match
/// too — but a client naming two hosts is asking whoever reads the other one (a backend
/// that trusts a copied `Host`, a cache) to see another request than the rules saw, so
/// the gateway refuses to choose for them, over either protocol.
fn host_problem(version: http::Version, uri: &http::Uri, headers: &HeaderMap) -> Option<Problem> {
    if version == http::Version::HTTP_11 && !headers.contains_key(http::header::HOST) {
        return Some(Problem::new(
            StatusCode::BAD_REQUEST,
            "an HTTP/1.1 request must carry a Host header",
        ));
    }
    let authority = uri.authority()?;
    let host = headers.get(http::header::HOST)?;
    if host
        .as_bytes()
        .eq_ignore_ascii_case(authority.as_str().as_bytes())
    {
        return None;
    }
    Some(Problem::new(
        StatusCode::BAD_REQUEST,
        "the Host header does not match the request target's authority",
    ))
}
