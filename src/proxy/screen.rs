//! Requests a front proxy and its upstream could read differently, refused before
//! anything else: smuggling-prone framing, mis-cased or tunnelling methods, hosts that
//! do not add up, paths with encoded control bytes.

use http::request::Parts;
use http::{HeaderMap, HeaderValue, StatusCode};

pub use crate::decide::head::{is_host_and_port, parameter_problem, path_problem};
use crate::headers::Problem;

/// What is wrong with a request's head, if anything: answered at once, and the connection
/// closed (nothing after such a request can be trusted to start where a request starts).
pub(super) fn problem(parts: &Parts) -> Option<Problem> {
    // HTTP/2's extended CONNECT (RFC 8441, `:protocol`) is an upgrade, not a tunnel to an
    // address: it goes to the backend as an HTTP/1.1 upgrade.
    let extended = parts.version == http::Version::HTTP_2
        && parts.extensions.get::<hyper::ext::Protocol>().is_some();
    let method = (!extended).then_some(&parts.method);
    let fields = Fields::of(&parts.headers);
    method
        .and_then(method_problem)
        .or_else(|| framing_problem(&fields))
        .or_else(|| host_problem_of(parts.version, &parts.uri, fields.host))
        .or_else(|| path_problem(parts.uri.path()))
        .or_else(|| parameter_problem(parts.uri.path()))
}

/// Drop every header field whose name has an underscore (`X_Api_Key`,
/// `X_Forwarded_For`), before anything reads the request: CGI, WSGI and Rack map `_` and
/// `-` to the same variable (`HTTP_X_API_KEY`), so a backend behind them would read a key
/// the limiter never counted, or a forwarding chain the gateway never rewrote. nginx drops
/// them too (`underscores_in_headers off`). Returns how many fields went.
pub fn drop_underscored(headers: &mut HeaderMap) -> u64 {
    // Most requests have none: one pass over the names, nothing allocated.
    if !headers.keys().any(|n| n.as_str().contains('_')) {
        return 0;
    }
    let names: Vec<http::HeaderName> = headers
        .keys()
        .filter(|n| n.as_str().contains('_'))
        .cloned()
        .collect();
    let mut dropped = 0;
    for name in names {
        dropped += headers.get_all(&name).iter().count() as u64;
        headers.remove(&name);
    }
    dropped
}

/// The fields the screen judges a head's framing and host by, read in one pass over its
/// fields (a lookup of each would hash its name again, and a head has few fields).
#[derive(Default)]
struct Fields<'a> {
    /// Whether a `Content-Length` differs from the first.
    lengths_differ: bool,
    /// The first `Transfer-Encoding`, and how many there are.
    coding: Option<&'a HeaderValue>,
    codings: usize,
    /// The first `Host`, and how many there are.
    host: Option<&'a HeaderValue>,
    hosts: usize,
}

impl<'a> Fields<'a> {
    fn of(headers: &'a HeaderMap) -> Fields<'a> {
        use http::header::{CONTENT_LENGTH, HOST, TRANSFER_ENCODING};
        let mut f = Fields::default();
        let mut length: Option<&HeaderValue> = None;
        for (name, value) in headers {
            if name == CONTENT_LENGTH {
                f.lengths_differ |= *length.get_or_insert(value) != value;
            } else if name == TRANSFER_ENCODING {
                f.codings += 1;
                f.coding.get_or_insert(value);
            } else if name == HOST {
                f.hosts += 1;
                f.host.get_or_insert(value);
            }
        }
        f
    }
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
/// - more than one `Host`: RFC 9112 §3.2 requires a 400;
/// - `Content-Length`s that differ: HTTP/2's layer checks the body against the first one
///   only, so a second could tell the backend another length (RFC 9110 §8.6: a recipient
///   of differing values must treat the message as invalid). Equal ones are sent up as
///   one line (`upstream::forward`): an nginx backend answers 400 to two.
fn framing_problem(fields: &Fields<'_>) -> Option<Problem> {
    if fields.lengths_differ {
        return Some(Problem::new(
            StatusCode::BAD_REQUEST,
            "Content-Length sent more than once, with different values",
        ));
    }
    match (fields.coding, fields.codings) {
        (None, _) => {}
        (Some(_), 2..) => {
            return Some(Problem::new(
                StatusCode::BAD_REQUEST,
                "Transfer-Encoding sent more than once",
            ));
        }
        (Some(v), _) => {
            if !v.as_bytes().trim_ascii().eq_ignore_ascii_case(b"chunked") {
                return Some(Problem::new(
                    StatusCode::NOT_IMPLEMENTED,
                    "only Transfer-Encoding: chunked is supported",
                ));
            }
        }
    }
    if fields.hosts > 1 {
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
/// - `CONNECT`: a tunnel, not a request to forward (501); an extended CONNECT (RFC 8441)
///   is not looked at here.
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

/// Hosts that do not add up:
/// - an HTTP/1.1 request without `Host` (RFC 9112 §3.2: 400, whatever its target), and an
///   HTTP/2 request with neither `:authority` nor `host` (RFC 9113 §8.3.1): forwarded, it
///   would get the upstream's own host, which no `host` rule is written for;
/// - a `Host` or an authority (absolute form, HTTP/2's `:authority`) that is not
///   `uri-host [ ":" port ]` ([`is_host_and_port`]): RFC 9110 §7.2's `Host` has no
///   userinfo, and RFC 9113 §8.3.1 forbids it in `:authority`. Forwarded, such a host is
///   read one way by the rules and another by the backend: `api.example.com:80@x.invalid`
///   is `x.invalid` to a URI parser and `api.example.com` to nginx's vhost lookup;
/// - a request target with an authority and a `Host` that names another host. HTTP/2
///   asks for that one to be treated as malformed (RFC 9113 §8.3.1); for HTTP/1's absolute
///   form, RFC 9112 §3.2.2 has a proxy replace `Host` with the target's authority, which
///   the rules match too — but a client naming two hosts is asking whoever reads the other
///   one (a backend that trusts a copied `Host`, a cache) to see another request than the
///   rules saw, so the gateway refuses to choose for them, over either protocol.
pub(super) fn host_problem(
    version: http::Version,
    uri: &http::Uri,
    headers: &HeaderMap,
) -> Option<Problem> {
    host_problem_of(version, uri, headers.get(http::header::HOST))
}

/// [`host_problem`], given the request's first `Host`.
fn host_problem_of(
    version: http::Version,
    uri: &http::Uri,
    host: Option<&HeaderValue>,
) -> Option<Problem> {
    let authority = uri.authority();
    match (host, authority) {
        (None, _) if version == http::Version::HTTP_11 => {
            return Some(Problem::new(
                StatusCode::BAD_REQUEST,
                "an HTTP/1.1 request must carry a Host header",
            ));
        }
        (None, None) if version == http::Version::HTTP_2 => {
            return Some(Problem::new(
                StatusCode::BAD_REQUEST,
                "an HTTP/2 request must carry :authority or host",
            ));
        }
        _ => {}
    }
    if host.is_some_and(|h| !is_host_and_port(h.as_bytes())) {
        return Some(Problem::new(
            StatusCode::BAD_REQUEST,
            "the Host header is not a host and optional port (RFC 9110 §7.2): no userinfo, path or other characters",
        ));
    }
    let authority = authority?;
    if !is_host_and_port(authority.as_str().as_bytes()) {
        return Some(Problem::new(
            StatusCode::BAD_REQUEST,
            "the request target's authority is not a host and optional port (RFC 9113 §8.3.1): no userinfo",
        ));
    }
    let host = host?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_a_host_and_an_optional_port_only() {
        for good in [
            "api.example.com",
            "api.example.com:8080",
            "API.Example.COM.",
            "a_b-c~d",
            "127.0.0.1:80",
            "[::1]",
            "[::1]:8443",
            "[2001:db8::1]",
            "host:",
            "host:65535",
            "host:00080",
        ] {
            assert!(is_host_and_port(good.as_bytes()), "{good:?}");
        }
        for bad in [
            "api.example.com:80@x.invalid",
            "user@api.example.com",
            "api.example.com/x",
            "api.example.com:80:80",
            "api.example.com:8o",
            "api.example.com:123456",
            "a.test,b.test",
            "a%2Etest",
            "a test",
            "",
            ":80",
            "[::1",
            "[zz]",
            "[::1]x",
            "[::1]@x",
            "a\\b",
            "host:65536",
            "[::1]:99999",
            "h\u{e9}te",
        ] {
            assert!(!is_host_and_port(bad.as_bytes()), "{bad:?}");
        }
    }

    #[test]
    fn fields_with_underscores_are_dropped_every_line_of_them() {
        let mut h = HeaderMap::new();
        h.append("x_api_key", "stolen".parse().unwrap());
        h.append("x_api_key", "again".parse().unwrap());
        h.append("x_forwarded_for", "1.2.3.4".parse().unwrap());
        h.append("x-api-key", "mine".parse().unwrap());
        assert_eq!(drop_underscored(&mut h), 3);
        assert_eq!(h.len(), 1);
        assert_eq!(h["x-api-key"], "mine");
        assert_eq!(drop_underscored(&mut h), 0);
    }

    #[test]
    fn parameters_holding_a_slash_are_refused_as_ambiguous() {
        for bad in [
            "/api;x%2F..%2F/orders",
            "/api;x%2f../orders",
            "/a/b;%5C..%5c/c",
            "/api;x\\../o",
        ] {
            assert!(parameter_problem(bad).is_some(), "{bad}");
        }
        for good in [
            "/api;v=1/orders",
            "/api/x%2Fy",
            "/a;b=c;d/e",
            "/api%3Bx/o",
            "/x",
        ] {
            assert!(parameter_problem(good).is_none(), "{good}");
        }
    }

    #[test]
    fn encoded_control_bytes_in_the_path_are_refused() {
        for bad in ["/api/%00", "/a%0a", "/a%0D%0Ab", "/a%1f", "/a%7F", "/%09x"] {
            assert!(path_problem(bad).is_some(), "{bad}");
        }
        for good in [
            "/api/x",
            "/a%20b",
            "/a%2F",
            "/a%",
            "/a%0",
            "/a%0g",
            "/caf%C3%A9",
            "/a%80",
        ] {
            assert!(path_problem(good).is_none(), "{good}");
        }
    }
}
