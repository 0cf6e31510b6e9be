//! What a request's head must be for the rules to read it as every backend does: a path
//! without encoded control bytes or ambiguous `;` parameters, a host that is a host and
//! port. The proxy's screen refuses such heads before anything else (`proxy/screen.rs`),
//! and a front-end that is told of a request (forward-auth) refuses the same ones.

use http::StatusCode;

use crate::headers::Problem;

/// A `;` path parameter that holds an encoded slash or a backslash (`/api;x%2F..%2F/o`):
/// backends disagree on which comes first. Spring, Undertow and Jetty cut a segment's
/// parameter before they decode it (`/api/o` above), the rules decode first and would cut
/// after (`/o`), and nginx keeps `;` as text. No one reading wins every backend, so such a
/// path is refused, as Jetty 10 refuses these "ambiguous" paths.
pub fn parameter_problem(path: &str) -> Option<Problem> {
    if !path.contains(';') {
        return None;
    }
    let ambiguous = path.split('/').any(|segment| {
        segment.split_once(';').is_some_and(|(_, params)| {
            let p = params.as_bytes();
            p.contains(&b'\\')
                || p.windows(3).any(|w| {
                    w[0] == b'%'
                        && ((w[1] == b'2' && w[2].eq_ignore_ascii_case(&b'f'))
                            || (w[1] == b'5' && w[2].eq_ignore_ascii_case(&b'c')))
                })
        })
    });
    ambiguous.then(|| {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "an encoded slash or a backslash inside a ;parameter of the path: backends read it differently",
        )
    })
}

/// A path with an encoded control byte (`%00` to `%1F`, `%7F`): no route has one, and
/// backends disagree on what it means — nginx answers 400 to `%00`, a C backend's string
/// ends at it (`/api/x%00.png` is `/api/x` to one, a `.png` to another), and a log line
/// may be broken by `%0A`. Raw control bytes never get this far: the request line's parser
/// refuses them. The query is not looked at: its bytes are the application's.
pub fn path_problem(path: &str) -> Option<Problem> {
    let b = path.as_bytes();
    let hex = |c: u8| (c as char).to_digit(16);
    let control = memchr::memchr_iter(b'%', b).any(|at| {
        match (
            b.get(at + 1).copied().and_then(hex),
            b.get(at + 2).copied().and_then(hex),
        ) {
            (Some(h), Some(l)) => {
                let byte = h * 16 + l;
                byte < 0x20 || byte == 0x7f
            }
            _ => false,
        }
    });
    control.then(|| {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "an encoded control byte (%00-%1F, %7F) in the path",
        )
    })
}

/// The bytes a host name may hold: letters, digits and `-._~` (a table: this runs for
/// every request).
const NAME: [bool; 256] = {
    let mut t = [false; 256];
    let mut c = 0;
    while c < 256 {
        let b = c as u8;
        t[c] = b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~');
        c += 1;
    }
    t
};

/// Whether `b` is `uri-host [ ":" port ]` (RFC 9110 §7.2 and §4.2, RFC 3986 §3.2.2): a
/// bracketed IPv6 literal, or a name of letters, digits and `-._~`; then optionally `:`
/// and a port of up to 5 digits, at most 65535. Stricter than RFC 3986's `reg-name` in one way, on purpose: its
/// sub-delimiters (`,;=!$&'()*+`) and percent-escapes are refused too. No DNS name has
/// them, and backends disagree on them (`a.test,b.test` is one host to some, a list to
/// others; `%2E` is decoded by some): a host is matched only where every reader sees the
/// same one. An empty host is refused, as nginx refuses it.
pub fn is_host_and_port(b: &[u8]) -> bool {
    let (host, port) = if b.first() == Some(&b'[') {
        let Some(end) = b.iter().position(|&c| c == b']') else {
            return false;
        };
        let v6 = std::str::from_utf8(&b[1..end])
            .ok()
            .and_then(|s| s.parse::<std::net::Ipv6Addr>().ok());
        if v6.is_none() {
            return false;
        }
        (None, &b[end + 1..])
    } else {
        let at = b.iter().position(|&c| c == b':').unwrap_or(b.len());
        (Some(&b[..at]), &b[at..])
    };
    let name_ok =
        host.is_none_or(|name| !name.is_empty() && name.iter().all(|&c| NAME[usize::from(c)]));
    let port_ok = match port.split_first() {
        None => true,
        // Up to 5 digits, at most 65535 (none: the scheme's default).
        Some((b':', digits)) => {
            digits.len() <= 5
                && digits.iter().all(u8::is_ascii_digit)
                && digits
                    .iter()
                    .fold(0u32, |n, d| n * 10 + u32::from(d - b'0'))
                    <= 65535
        }
        Some(_) => false,
    };
    name_ok && port_ok
}
