//! An HTTP/1 request head as it arrives: when it started, a scan for bare CRs
//! (RFC 9112 §2.2), the bound on its fields, and the answers written straight to the
//! socket where no HTTP layer is left to.

use std::sync::atomic::Ordering::Relaxed;

use tokio::time::Instant;

use super::track::Track;

/// How many fields an HTTP/1 request head may have unless `[server] max_header_fields`
/// says: one per [`BYTES_PER_FIELD`] of `max_header_bytes` (1,024 at the default 32 KiB),
/// and never fewer than hyper's own 100. Past it, 431, as past `max_header_bytes`. Not one
/// per byte the bound allows by default: hyper parses into an array of this many entries
/// (64 bytes each), allocated for every parse of a head, so the count is bounded by the
/// size it is taken from; an operator whose clients send many tiny fields raises it.
pub fn default_max_fields(max_header_bytes: usize) -> usize {
    (max_header_bytes / BYTES_PER_FIELD).max(100)
}

/// The request head bytes that allow one more field ([`default_max_fields`]).
const BYTES_PER_FIELD: usize = 32;

/// The head of the request being read: since when, and for which request.
#[derive(Debug, Clone, Copy)]
pub(super) struct Head {
    /// Since when (`None`: its first byte came in the last read, and the head may well be
    /// whole already; the clock is read only if it waits for more).
    pub(super) since: Option<Instant>,
    /// [`Track::started`] when its first byte came: a later start means it was read.
    pub(super) request: u64,
}

/// Where a scan of a request head is (HTTP/1 line endings are CRLF, or a lone LF, which
/// parsers accept; a CR is always followed by LF).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Scan {
    /// Inside a line.
    Line,
    /// After a CR inside a line.
    Cr,
    /// At the start of a line.
    LineStart,
    /// After a CR at the start of a line.
    LineStartCr,
    /// Past the empty line that ends the head: what follows is a body.
    Done,
}

impl Scan {
    /// The state after `b`; `None` at a bare CR.
    fn next(self, b: u8) -> Option<Scan> {
        Some(match (self, b) {
            (Scan::Done, _) => Scan::Done,
            (Scan::Cr, b'\n') => Scan::LineStart,
            (Scan::LineStartCr, b'\n') | (Scan::LineStart, b'\n') => Scan::Done,
            (Scan::Cr | Scan::LineStartCr, _) => return None,
            (Scan::LineStart, b'\r') => Scan::LineStartCr,
            (_, b'\r') => Scan::Cr,
            (_, b'\n') => Scan::LineStart,
            _ => Scan::Line,
        })
    }
}

/// HTTP/1 head bytes just read (`track`'s connection, nothing in flight): note when the
/// head started, and find a bare CR before the head's end. `Err`: a CR followed by
/// anything but LF.
pub(super) fn head_bytes(
    head: &mut Option<Head>,
    scan: &mut Scan,
    track: &Track,
    bytes: &[u8],
) -> Result<(), ()> {
    let request = track.started.load(Relaxed);
    if head.is_none_or(|h| h.request != request) {
        *head = Some(Head {
            since: None,
            request,
        });
        *scan = Scan::Line;
    }
    scan_head(scan, bytes)
}

/// Run `scan` over `bytes` up to the head's end: [`Scan::next`] byte by byte, but jumping
/// from one line ending to the next (only they, and the byte after a CR, change it).
fn scan_head(scan: &mut Scan, bytes: &[u8]) -> Result<(), ()> {
    let mut at = 0;
    while *scan != Scan::Done && at < bytes.len() {
        if matches!(*scan, Scan::Cr | Scan::LineStartCr) {
            *scan = scan.next(bytes[at]).ok_or(())?;
            at += 1;
            continue;
        }
        let Some(i) = memchr::memchr2(b'\r', b'\n', &bytes[at..]) else {
            if *scan == Scan::LineStart {
                *scan = Scan::Line;
            }
            break;
        };
        if i > 0 && *scan == Scan::LineStart {
            *scan = Scan::Line;
        }
        *scan = scan.next(bytes[at + i]).ok_or(())?;
        at += i + 1;
    }
    Ok(())
}

/// A response the gateway writes straight to the socket, where no HTTP layer is left to
/// (a head that never completed, or that cannot be parsed).
pub(super) fn canned(status: u16) -> Vec<u8> {
    let (reason, detail) = match status {
        408 => (
            "Request Timeout",
            "the request head did not arrive within header_timeout",
        ),
        _ => (
            "Bad Request",
            "a bare CR in the request head: lines end with CRLF",
        ),
    };
    let body = format!(
        "{{\"type\":\"about:blank\",\"title\":\"{reason}\",\"status\":{status},\"detail\":\"{detail}\"}}"
    );
    format!(
        "HTTP/1.1 {status} {reason}\r\nconnection: close\r\ncontent-type: application/problem+json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(bytes: &[u8]) -> Option<Scan> {
        bytes.iter().try_fold(Scan::Line, |s, &b| s.next(b))
    }

    #[test]
    fn a_head_scan_finds_bare_crs_and_stops_at_the_head_end() {
        assert_eq!(scan(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"), Some(Scan::Done));
        assert_eq!(scan(b"GET / HTTP/1.1\nHost: a\n\n"), Some(Scan::Done));
        assert_eq!(scan(b"GET / HTTP/1.1\r\nHost: a\r\n\n"), Some(Scan::Done));
        assert_eq!(
            scan(b"GET / HTTP/1.1\r\nHost: a\r\n"),
            Some(Scan::LineStart)
        );
        assert_eq!(
            scan(b"GET / HTTP/1.1\r"),
            Some(Scan::Cr),
            "a CR may end a read"
        );
        for bare in [
            &b"GET / HTTP/1.1\rHost: a\r\n\r\n"[..],
            b"GET / HTTP/1.1\r\nHost: a\r\r",
            b"GET / HTTP/1.1\r\nHost: a\rb\r\n\r\n",
            b"GET / HTTP/1.1\r\n\rX",
        ] {
            assert_eq!(scan(bare), None, "{:?}", String::from_utf8_lossy(bare));
        }
        // After the head, a body's bytes are not looked at.
        assert_eq!(
            scan(b"POST / HTTP/1.1\r\nContent-Length: 3\r\n\r\n\r\rx"),
            Some(Scan::Done)
        );
    }

    /// The jumping scan agrees with the byte-by-byte one on any bytes, however they are
    /// split across reads.
    #[test]
    fn the_fast_head_scan_is_the_byte_scan() {
        let mut rng = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        for _ in 0..20_000 {
            let len = (next() % 40) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|_| [b'a', b'b', b'\r', b'\n', b':'][(next() % 5) as usize])
                .collect();
            let slow = scan(&bytes);
            let mut fast = Scan::Line;
            let mut result = Ok(());
            let mut rest = &bytes[..];
            while !rest.is_empty() && result.is_ok() {
                let take = 1 + (next() as usize % rest.len());
                result = scan_head(&mut fast, &rest[..take]);
                rest = &rest[take..];
            }
            match slow {
                None => assert!(result.is_err(), "{bytes:?}"),
                Some(state) => assert_eq!((result, fast), (Ok(()), state), "{bytes:?}"),
            }
        }
    }

    #[test]
    fn canned_answers_are_whole_http_responses() {
        for status in [400u16, 408] {
            let bytes = canned(status);
            let mut fields = [httparse::EMPTY_HEADER; 8];
            let mut resp = httparse::Response::new(&mut fields);
            let n = match resp.parse(&bytes) {
                Ok(httparse::Status::Complete(n)) => n,
                other => panic!("{status}: {other:?}"),
            };
            assert_eq!(resp.code, Some(status));
            let length: usize = resp
                .headers
                .iter()
                .find(|h| h.name == "content-length")
                .and_then(|h| std::str::from_utf8(h.value).ok()?.parse().ok())
                .expect("a content-length");
            assert_eq!(bytes.len() - n, length);
            let body: serde_json::Value = serde_json::from_slice(&bytes[n..]).expect("json");
            assert_eq!(body["status"], status);
        }
    }
}
