//! The access log: one event per request, target `ratewall::access`, at `info`.
//!
//! What a client sends in it (its `Host`, its `User-Agent`) is the client's to choose, so
//! it is bounded and escaped: a line can never be split, forged or made to hide another
//! (log injection). Never the query string, never an API key.

use std::fmt::Write;
use std::net::IpAddr;
use std::time::Instant;

use http::header::{HeaderValue, HOST, USER_AGENT};
use http::{Method, Request};

use super::grpc::Code;
use crate::config::Config;
use crate::identity::directory::hides;
use crate::upstream::ClientPeer;

/// The most of a client-chosen value (host, user agent) a line carries, in bytes before
/// escaping; past it the value is cut and marked with `…`.
pub const MAX_FIELD: usize = 256;

/// The access log's line for one request, when the log is on: what it needs of the
/// request, taken before the request is forwarded.
pub(super) struct AccessLine {
    method: Method,
    path: String,
    /// `HTTP/1.1`, `HTTP/2`...
    protocol: &'static str,
    /// `TLSv1.3` or `TLSv1.2` over the TLS listener; `-` in cleartext.
    tls: &'static str,
    client_ip: Option<IpAddr>,
    host: Option<String>,
    user_agent: Option<String>,
    started: Instant,
}

impl AccessLine {
    pub(super) fn start<B>(
        req: &Request<B>,
        peer: &ClientPeer,
        cfg: &Config,
    ) -> Option<AccessLine> {
        if !tracing::enabled!(target: "ratewall::access", tracing::Level::INFO) {
            return None;
        }
        let headers = req.headers();
        // HTTP/2 names the host in `:authority` (the URI), HTTP/1.1 in `Host`.
        let host = headers
            .get(HOST)
            .map(|h| field(h.as_bytes()))
            .or_else(|| req.uri().authority().map(|a| field(a.as_str().as_bytes())));
        Some(AccessLine {
            method: req.method().clone(),
            path: req.uri().path().to_string(),
            protocol: protocol(req.version()),
            tls: peer.tls.as_ref().map_or("-", |t| t.version),
            client_ip: cfg
                .log
                .client_ip
                .then(|| crate::identity::client_ip(peer.ip(), headers, &cfg.client_ip)),
            host,
            user_agent: headers
                .get(USER_AGENT)
                .map(HeaderValue::as_bytes)
                .map(field),
            started: Instant::now(),
        })
    }

    /// This line, held until the answer's body ends (a passed-on gRPC answer, whose
    /// status comes in its trailers): what `entry` borrows is copied.
    pub(super) fn defer(self, status: u16, entry: &Entry<'_>) -> Deferred {
        let owned = |s: Option<&str>| s.map(Box::<str>::from);
        Deferred {
            line: self,
            status,
            rule: owned(entry.rule),
            decision: entry.decision,
            identity: entry.identity,
            label: owned(entry.label),
            shadow_denied: owned(entry.shadow_denied),
            waited: entry.waited,
            route: owned(entry.route),
            pool: owned(entry.pool),
            server: owned(entry.server),
            attempts: entry.attempts,
            upgrade: entry.upgrade,
        }
    }

    pub(super) fn write(self, status: u16, note: &Entry<'_>) {
        let id = note.identity.map(|d| d.tag());
        // Text values go as `&str`: the text format quotes and escapes them, the JSON one
        // writes them as JSON strings. An absent `Option` leaves its field out.
        tracing::info!(
            target: "ratewall::access",
            method = %self.method,
            path = %self.path,
            protocol = self.protocol,
            tls = self.tls,
            status,
            client_ip = self.client_ip.map(tracing::field::display),
            host = self.host.as_deref().unwrap_or("-"),
            user_agent = self.user_agent.as_deref().unwrap_or("-"),
            rule = note.rule.unwrap_or("-"),
            decision = note.decision,
            shadow_denied = note.shadow_denied.unwrap_or("-"),
            waited_ms = note.waited.as_millis() as u64,
            id = id.as_ref().map_or("-", |h| h.as_str()),
            // An operator's name for the key (checked when it was given: no control
            // character), quoted and escaped as every text value; absent without one.
            label = note.label,
            route = note.route.unwrap_or("-"),
            pool = note.pool.unwrap_or("-"),
            server = note.server.unwrap_or("-"),
            attempts = note.attempts,
            upgrade = note.upgrade,
            grpc_status = note.grpc_status.map(|c| u64::from(c.number())),
            latency_us = self.started.elapsed().as_micros() as u64,
        );
    }
}

/// What an access line says of a request beside its head, borrowed from the request's
/// context ([`super::RequestCtx::entry`]).
pub(super) struct Entry<'a> {
    pub rule: Option<&'a str>,
    pub decision: &'static str,
    pub identity: Option<crate::identity::IdentityDigest>,
    pub label: Option<&'a str>,
    pub shadow_denied: Option<&'a str>,
    pub waited: std::time::Duration,
    pub route: Option<&'a str>,
    pub pool: Option<&'a str>,
    pub server: Option<&'a str>,
    pub attempts: u32,
    pub upgrade: Option<&'static str>,
    pub grpc_status: Option<Code>,
}

/// An access line written when the answer's body ends: its `latency_us` runs to then.
pub(super) struct Deferred {
    line: AccessLine,
    status: u16,
    rule: Option<Box<str>>,
    decision: &'static str,
    identity: Option<crate::identity::IdentityDigest>,
    label: Option<Box<str>>,
    shadow_denied: Option<Box<str>>,
    waited: std::time::Duration,
    route: Option<Box<str>>,
    pool: Option<Box<str>>,
    server: Option<Box<str>>,
    attempts: u32,
    upgrade: Option<&'static str>,
}

impl Deferred {
    /// Write the line, with the gRPC status the body ended with (none if it had none).
    pub(super) fn write(self, grpc_status: Option<Code>) {
        let entry = Entry {
            rule: self.rule.as_deref(),
            decision: self.decision,
            identity: self.identity,
            label: self.label.as_deref(),
            shadow_denied: self.shadow_denied.as_deref(),
            waited: self.waited,
            route: self.route.as_deref(),
            pool: self.pool.as_deref(),
            server: self.server.as_deref(),
            attempts: self.attempts,
            upgrade: self.upgrade,
            grpc_status,
        };
        self.line.write(self.status, &entry);
    }
}

/// A request's HTTP version as the access log and metrics name it.
pub fn protocol(v: http::Version) -> &'static str {
    match v {
        http::Version::HTTP_09 => "HTTP/0.9",
        http::Version::HTTP_10 => "HTTP/1.0",
        http::Version::HTTP_11 => "HTTP/1.1",
        http::Version::HTTP_2 => "HTTP/2",
        http::Version::HTTP_3 => "HTTP/3",
        _ => "HTTP/?",
    }
}

/// A client-chosen value as a line may carry it: at most [`MAX_FIELD`] bytes of it, cut
/// at a character's end (then `…`), with every byte that could end, forge or hide part of
/// a line written as an escape: control characters (`\n`, `\r`, ESC ...) and the Unicode
/// ones that reorder or hide text as `\u{..}`, bytes that are not UTF-8 as `\xNN`, and
/// `\` itself as `\\` (so an escape in the log is always the gateway's).
pub fn field(bytes: &[u8]) -> String {
    let (bytes, cut) = if bytes.len() > MAX_FIELD {
        (&bytes[..MAX_FIELD], true)
    } else {
        (bytes, false)
    };
    let mut out = String::with_capacity(bytes.len() + 8);
    let mut chunks = bytes.utf8_chunks().peekable();
    while let Some(chunk) = chunks.next() {
        for c in chunk.valid().chars() {
            match c {
                '\\' => out.push_str("\\\\"),
                c if hides(c) => {
                    let _ = write!(out, "{}", c.escape_unicode());
                }
                c => out.push(c),
            }
        }
        // The cut may fall inside a character: its first bytes are left out, not escaped.
        let cut_inside = cut
            && chunks.peek().is_none()
            && std::str::from_utf8(chunk.invalid()).is_err_and(|e| e.error_len().is_none());
        if !cut_inside {
            for b in chunk.invalid() {
                let _ = write!(out, "\\x{b:02x}");
            }
        }
    }
    if cut {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_values_are_escaped_so_that_a_line_cannot_be_forged() {
        assert_eq!(field(b"curl/8.5.0"), "curl/8.5.0");
        assert_eq!(
            field("Mozilla/5.0 (X11) é".as_bytes()),
            "Mozilla/5.0 (X11) é"
        );
        assert_eq!(
            field(b"a\r\nINFO ratewall::access: status=200"),
            "a\\u{d}\\u{a}INFO ratewall::access: status=200"
        );
        assert_eq!(field(b"\x1b[31mred\t"), "\\u{1b}[31mred\\u{9}");
        assert_eq!(
            field(b"x\\u{a}"),
            "x\\\\u{a}",
            "a backslash is escaped itself"
        );
        assert_eq!(field(b"\xff\xfeok"), "\\xff\\xfeok");
        assert_eq!(
            field("abc\u{202E}gpj.exe".as_bytes()),
            "abc\\u{202e}gpj.exe"
        );
        assert_eq!(field("\u{85}".as_bytes()), "\\u{85}", "C1 controls too");
    }

    #[test]
    fn client_values_are_bounded_and_cut_at_a_characters_end() {
        let long = "a".repeat(10_000);
        let f = field(long.as_bytes());
        assert_eq!(f, format!("{}…", "a".repeat(MAX_FIELD)));
        // A two-byte character across the bound: cut before it, not escaped in halves.
        let mut s = "a".repeat(MAX_FIELD - 1);
        s.push('é');
        let f = field(s.as_bytes());
        assert_eq!(f, format!("{}…", "a".repeat(MAX_FIELD - 1)));
        // Exactly at the bound: whole, no mark.
        assert_eq!(
            field("b".repeat(MAX_FIELD).as_bytes()),
            "b".repeat(MAX_FIELD)
        );
    }
}
