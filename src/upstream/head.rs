//! Heads both ways: the request head written as bytes, and the response head read and
//! parsed with `httparse` (hyper's own parser) into the parts the client is answered with
//! and the framing of the body that follows (RFC 9112 §6: `Content-Length`, `chunked`, or
//! the connection's end).

use bytes::{Buf, Bytes, BytesMut};
use http::header::{
    HeaderMap, HeaderName, HeaderValue, CONNECTION, CONTENT_LENGTH, TRANSFER_ENCODING,
};
use http::uri::PathAndQuery;
use http::{Response, StatusCode, Version};
use tokio::io::{AsyncRead, AsyncReadExt};

use super::body::{Chunk, Framing};
use super::forward::{self, is_hop_by_hop, Downstream, HOP_BY_HOP};
use super::{Error, Malformed, ResponseBody, READ_SIZE};

/// The most a response head (status line and fields) may take, and the most field lines
/// (room for `FEW_FIELDS` is made on the stack; more, up to `MAX_FIELDS`, on the heap).
pub(super) const MAX_HEAD: usize = 64 * 1024;
pub(super) const FEW_FIELDS: usize = 48;
const MAX_FIELDS: usize = 2048;

/// `METHOD /base/path?query HTTP/1.1`, the fields with the forwarding fields of this hop
/// ([`forward::fields`]), the body's framing and the blank line. `target` is the path and
/// query to send where a route rewrote them (`strip_prefix`, `add_prefix`), else the
/// request's own bytes go.
pub(super) fn request(
    parts: &http::request::Parts,
    base_path: &str,
    chunked: bool,
    down: &Downstream<'_>,
    host: Option<&HeaderValue>,
    target: Option<&str>,
) -> Result<Vec<u8>, Error> {
    let pq = target.unwrap_or_else(|| parts.uri.path_and_query().map_or("/", PathAndQuery::as_str));
    let target_ok = pq.starts_with('/') || pq == "*";
    if !target_ok {
        return Err(Error::Target(parts.uri.clone()));
    }
    let fields: usize = parts
        .headers
        .iter()
        .map(|(n, v)| n.as_str().len() + v.len() + 4)
        .sum();
    let mut head = Vec::with_capacity(256 + base_path.len() + pq.len() + fields);
    head.extend_from_slice(parts.method.as_str().as_bytes());
    head.push(b' ');
    head.extend_from_slice(base_path.as_bytes());
    head.extend_from_slice(pq.as_bytes());
    head.extend_from_slice(b" HTTP/1.1\r\n");
    forward::fields(&mut head, &parts.headers, down, host);
    if chunked {
        head.extend_from_slice(b"transfer-encoding: chunked\r\n");
    }
    head.extend_from_slice(b"\r\n");
    Ok(head)
}

/// `name: part1part2...\r\n`.
pub(super) fn field_line(head: &mut Vec<u8>, name: &str, parts: &[&[u8]]) {
    head.extend_from_slice(name.as_bytes());
    head.extend_from_slice(b": ");
    for p in parts {
        head.extend_from_slice(p);
    }
    head.extend_from_slice(b"\r\n");
}

/// Read until a final (non-1xx) response head is complete. Returns it, what was read past
/// it, and how its body is framed. `replayable`: whether the request could go again were
/// the connection to end before any answer ([`Error::retryable`]).
pub(super) async fn read<R: AsyncRead + Unpin>(
    conn: &mut R,
    is_head: bool,
    replayable: bool,
) -> Result<(http::response::Parts, BytesMut, Framing), Error> {
    match read_as(conn, is_head, replayable, false).await? {
        Answer::Final(parts, buf, framing) => Ok((parts, buf, framing)),
        // Never: a 101 is an answer only where the request asked to upgrade.
        Answer::Switched(..) => Err(Malformed::SwitchedProtocols.into()),
    }
}

/// The answer to a request that asked to upgrade: a final head (the upstream declined), or
/// its `101` — with the `Upgrade` it switched to among its fields, and the bytes read past
/// it, the first of the new protocol's.
pub(super) enum Answer {
    Final(http::response::Parts, BytesMut, Framing),
    Switched(http::response::Parts, BytesMut),
}

/// [`read`], where `switch` says whether a `101` may end it (the request asked to upgrade).
pub(super) async fn read_as<R: AsyncRead + Unpin>(
    conn: &mut R,
    is_head: bool,
    replayable: bool,
    switch: bool,
) -> Result<Answer, Error> {
    let mut buf = BytesMut::with_capacity(READ_SIZE);
    // Whether any byte of an answer came (a 1xx, skipped, included).
    let mut answered = false;
    loop {
        if !buf.is_empty() {
            match parse_as(&buf, is_head, switch)? {
                Parsed::Partial if buf.len() >= MAX_HEAD => return Err(Malformed::TooLarge.into()),
                Parsed::Partial => {}
                Parsed::Interim(n) => {
                    buf.advance(n);
                    continue;
                }
                Parsed::Final(n, parts, framing) => {
                    buf.advance(n);
                    return Ok(Answer::Final(parts, buf, framing));
                }
                Parsed::Switched(n, parts) => {
                    buf.advance(n);
                    return Ok(Answer::Switched(parts, buf));
                }
            }
        }
        buf.reserve(READ_SIZE);
        let replayable = replayable && !answered;
        match conn.read_buf(&mut buf).await {
            Ok(0) if buf.is_empty() => return Err(Error::Closed { replayable }),
            Ok(0) => return Err(Error::ClosedInHead),
            Ok(_) => answered = true,
            Err(source) => return Err(Error::Read { source, replayable }),
        }
    }
}

enum Parsed {
    Partial,
    /// An informational (1xx) head of this many bytes, to skip.
    Interim(usize),
    Final(usize, http::response::Parts, Framing),
    /// A `101` of this many bytes, to a request that asked to upgrade.
    Switched(usize, http::response::Parts),
}

/// Parse one response head at the start of `buf`.
#[cfg(test)]
fn parse(buf: &[u8], is_head: bool) -> Result<Parsed, Malformed> {
    parse_as(buf, is_head, false)
}

/// Parse one response head at the start of `buf`; `switch`: a `101` may be the answer.
fn parse_as(buf: &[u8], is_head: bool, switch: bool) -> Result<Parsed, Malformed> {
    let mut fields = [httparse::EMPTY_HEADER; FEW_FIELDS];
    match parse_with(buf, is_head, switch, &mut fields) {
        Err(Malformed::Syntax(httparse::Error::TooManyHeaders)) => {
            let mut fields = vec![httparse::EMPTY_HEADER; MAX_FIELDS];
            parse_with(buf, is_head, switch, &mut fields)
        }
        other => other,
    }
}

/// [`parse_as`] with room for `fields.len()` field lines.
fn parse_with<'b>(
    buf: &'b [u8],
    is_head: bool,
    switch: bool,
    fields: &mut [httparse::Header<'b>],
) -> Result<Parsed, Malformed> {
    let mut res = httparse::Response::new(fields);
    match res.parse(buf).map_err(Malformed::Syntax)? {
        httparse::Status::Complete(n) => head_parts(buf, n, &res, is_head, switch),
        httparse::Status::Partial => Ok(Parsed::Partial),
    }
}

/// The parts of a complete head of `n` bytes, and its body's framing.
fn head_parts(
    buf: &[u8],
    n: usize,
    res: &httparse::Response<'_, '_>,
    is_head: bool,
    switch: bool,
) -> Result<Parsed, Malformed> {
    let code = res.code.unwrap_or(0);
    let status = StatusCode::from_u16(code).map_err(|_| Malformed::Status(code))?;
    if status == StatusCode::SWITCHING_PROTOCOLS {
        // Never asked for: `Upgrade` is forwarded only for a request that asked to upgrade.
        if !switch {
            return Err(Malformed::SwitchedProtocols);
        }
        return switched(buf, n, res);
    }
    if status.is_informational() {
        return Ok(Parsed::Interim(n));
    }
    let version = match res.version {
        Some(1) => Version::HTTP_11,
        _ => Version::HTTP_10,
    };
    let mut fields = Fields::read(buf, n, res.headers)?;
    let bodiless =
        is_head || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED;
    let (framing, close) = fields.framing(version, bodiless)?;
    let mut parts = Response::new(()).into_parts().0;
    parts.status = status;
    // The upstream's version is of its own connection: only the framing above reads it.
    // An intermediary answers in its own version (RFC 9110 §6.2), so an HTTP/1.0 backend
    // does not make an HTTP/1.1 client's answer HTTP/1.0 (and close its connection).
    // hyper writes the answer in the client's version: HTTP/1.1 frames a body without a
    // length as chunked and keeps the connection; to an HTTP/1.0 client the same body is
    // close-delimited, as HTTP/1.0 allows.
    parts.version = Version::HTTP_11;
    if close {
        parts.extensions.insert(Close);
    }
    if !bodiless && !fields.applied().is_empty() {
        // The body is still coded (gzip, say) once its chunked framing is read: the
        // codings go on with it, or the client gets bytes it cannot decode (`pass_codings`).
        let joined = fields.applied().join(", ");
        let value = HeaderValue::from_str(&joined).map_err(|_| Malformed::TransferEncoding)?;
        parts.extensions.insert(Codings(value));
    }
    // A reason phrase of the upstream's own is passed on as it was.
    if let Some(reason) = res.reason.filter(|r| Some(*r) != status.canonical_reason()) {
        if let Ok(reason) = hyper::ext::ReasonPhrase::try_from(reason.as_bytes()) {
            parts.extensions.insert(reason);
        }
    }
    parts.headers = fields.headers;
    Ok(Parsed::Final(n, parts, framing))
}

/// A `101`'s parts: its fields but the hop-by-hop ones, and the `Upgrade` it switched to
/// (hop-by-hop, but what the client's own 101 must say); without one it is no switch
/// (RFC 9110 §15.2.2: a 101 names the protocol it switches to).
fn switched(buf: &[u8], n: usize, res: &httparse::Response<'_, '_>) -> Result<Parsed, Malformed> {
    let fields = Fields::read(buf, n, res.headers)?;
    let upgrade = res
        .headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("upgrade"))
        .and_then(|h| HeaderValue::from_bytes(h.value).ok())
        .ok_or(Malformed::SwitchedProtocols)?;
    let mut parts = Response::new(()).into_parts().0;
    parts.status = StatusCode::SWITCHING_PROTOCOLS;
    parts.version = Version::HTTP_11;
    parts.headers = fields.headers;
    parts.headers.insert(http::header::UPGRADE, upgrade);
    Ok(Parsed::Switched(n, parts))
}

/// What the field lines of a response head say, read in one pass.
struct Fields<'b> {
    /// Every field but the hop-by-hop ones: what the client is sent.
    headers: HeaderMap,
    length: Option<u64>,
    transfer_coded: bool,
    /// The transfer codings, in the order they were applied, across every field line.
    codings: Vec<&'b str>,
    /// The `Connection` options `close` and `keep-alive`.
    close: bool,
    keep_alive: bool,
}

impl<'b> Fields<'b> {
    /// The field lines of the head `buf[..n]`.
    fn read(buf: &'b [u8], n: usize, lines: &[httparse::Header<'b>]) -> Result<Self, Malformed> {
        let mut fields = Fields {
            headers: HeaderMap::with_capacity(lines.len()),
            length: None,
            transfer_coded: false,
            codings: Vec::new(),
            close: false,
            keep_alive: false,
        };
        // The values are slices of one copy of the head, not a copy each.
        let raw = Bytes::copy_from_slice(&buf[..n]);
        // Fields the `Connection` header names: hop-by-hop too, removed once all are in (no
        // allocation for the usual `Connection: keep-alive`).
        let mut named: Vec<&str> = Vec::new();
        for line in lines {
            let (name, role) = field_name(line.name.as_bytes())?;
            // `line.value` lies inside `buf[..n]`, as its copy's slice does inside `raw`.
            let at = (line.value.as_ptr() as usize).wrapping_sub(buf.as_ptr() as usize);
            let value = raw
                .get(at..at.saturating_add(line.value.len()))
                .map(|v| raw.slice_ref(v))
                .and_then(|v| HeaderValue::from_maybe_shared(v).ok())
                .ok_or(Malformed::FieldValue)?;
            match role {
                Role::Length => fields.length = content_length(line.value, fields.length)?,
                Role::Codings => {
                    fields.transfer_coded = true;
                    let text =
                        std::str::from_utf8(line.value).map_err(|_| Malformed::TransferEncoding)?;
                    let codings = text.split(',').map(str::trim).filter(|c| !c.is_empty());
                    fields.codings.extend(codings);
                }
                Role::Connection => fields.options(line.value, &mut named),
                Role::HopByHop | Role::EndToEnd => {}
            }
            // Hop-by-hop fields (RFC 9110 §7.6.1) are read for framing, never passed on.
            if !matches!(role, Role::Codings | Role::Connection | Role::HopByHop) {
                fields.headers.append(name, value);
            }
        }
        for token in named {
            if let Ok(name) = HeaderName::from_bytes(token.as_bytes()) {
                fields.headers.remove(name);
            }
        }
        Ok(fields)
    }

    /// The options of a `Connection` field line; those naming fields go into `named`.
    fn options(&mut self, value: &'b [u8], named: &mut Vec<&'b str>) {
        // The usual value, at once: an option naming a hop-by-hop field only.
        if value.len() == 10 && lowercase_eq(value, b"keep-alive") {
            self.keep_alive = true;
            return;
        }
        let text = std::str::from_utf8(value).unwrap_or("");
        for token in text.split(',').map(str::trim) {
            self.close |= token.eq_ignore_ascii_case("close");
            self.keep_alive |= token.eq_ignore_ascii_case("keep-alive");
            // Every option names a field to drop, `close` included (§7.6.1); the
            // hop-by-hop ones (`keep-alive`, say) are left out anyway.
            if !token.is_empty()
                && !HOP_BY_HOP
                    .iter()
                    .any(|h| token.eq_ignore_ascii_case(h.as_str()))
            {
                named.push(token);
            }
        }
    }

    /// Whether the body is chunked: only the last coding says.
    fn chunked(&self) -> bool {
        self.codings
            .last()
            .is_some_and(|c| c.eq_ignore_ascii_case("chunked"))
    }

    /// The codings applied before the (last) chunked one, or all of them.
    fn applied(&self) -> &[&'b str] {
        &self.codings[..self.codings.len() - usize::from(self.chunked())]
    }

    /// How the body is delimited (RFC 9112 §6.3), and whether the connection must close
    /// after it (`true`) instead of carrying another request.
    fn framing(&mut self, version: Version, bodiless: bool) -> Result<(Framing, bool), Malformed> {
        // `close` wins in any order; HTTP/1.0 keeps the connection only when asked to.
        let mut close = self.close || (version == Version::HTTP_10 && !self.keep_alive);
        if self.transfer_coded && version == Version::HTTP_10 {
            // RFC 9112 §6.1: framing an HTTP/1.0 recipient cannot have asked for is faulty.
            return Err(Malformed::CodingInHttp10);
        }
        // Only the last coding says whether the body is chunked, and chunked is applied at
        // most once, last (RFC 9112 §6.1): anything else cannot be framed or passed on.
        let chunked = self.chunked();
        let applied = self.applied();
        if applied.iter().any(|c| c.eq_ignore_ascii_case("chunked")) {
            return Err(Malformed::TransferEncoding);
        }
        // An answer that has no body but says it has one: whatever the upstream writes
        // after it cannot be told from the next answer, so its connection is not used again.
        if bodiless && (self.transfer_coded || self.length.is_some_and(|n| n > 0)) {
            close = true;
        }
        let framing = if bodiless {
            Framing::Length(0)
        } else if self.transfer_coded {
            // RFC 9112 §6.3: Transfer-Encoding wins over Content-Length, and a response
            // with both may be an attack on a later answer: that connection is not used
            // again.
            if self.length.is_some() {
                close = true;
                self.headers.remove(CONTENT_LENGTH);
            }
            if chunked {
                Framing::Chunked(Chunk::Size)
            } else {
                Framing::UntilClose
            }
        } else {
            match self.length {
                Some(n) => Framing::Length(n),
                None => Framing::UntilClose,
            }
        };
        Ok((framing, close || framing == Framing::UntilClose))
    }
}

/// What a response field is to the forwarder.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Role {
    /// `Content-Length`: frames the body, and is passed on.
    Length,
    /// `Transfer-Encoding`: frames the body; hop-by-hop.
    Codings,
    /// `Connection`: its options; hop-by-hop.
    Connection,
    /// Another hop-by-hop field ([`is_hop_by_hop`]).
    HopByHop,
    /// Passed on as it is.
    EndToEnd,
}

/// A response field's name and what it is to the forwarder. The names answers carry most
/// are told at once, by comparing a word at a time; the rest go through
/// `HeaderName::from_bytes`.
fn field_name(raw: &[u8]) -> Result<(HeaderName, Role), Malformed> {
    use http::header::{
        ACCEPT_RANGES, CACHE_CONTROL, CONTENT_ENCODING, CONTENT_TYPE, DATE, ETAG, EXPIRES,
        LAST_MODIFIED, LOCATION, SERVER, SET_COOKIE, VARY,
    };
    let is = |name: &[u8]| lowercase_eq(raw, name);
    let (name, role) = match raw.len() {
        4 if is(b"date") => (DATE, Role::EndToEnd),
        4 if is(b"etag") => (ETAG, Role::EndToEnd),
        4 if is(b"vary") => (VARY, Role::EndToEnd),
        6 if is(b"server") => (SERVER, Role::EndToEnd),
        7 if is(b"expires") => (EXPIRES, Role::EndToEnd),
        8 if is(b"location") => (LOCATION, Role::EndToEnd),
        10 if is(b"connection") => (CONNECTION, Role::Connection),
        10 if is(b"set-cookie") => (SET_COOKIE, Role::EndToEnd),
        12 if is(b"content-type") => (CONTENT_TYPE, Role::EndToEnd),
        13 if is(b"cache-control") => (CACHE_CONTROL, Role::EndToEnd),
        13 if is(b"last-modified") => (LAST_MODIFIED, Role::EndToEnd),
        13 if is(b"accept-ranges") => (ACCEPT_RANGES, Role::EndToEnd),
        14 if is(b"content-length") => (CONTENT_LENGTH, Role::Length),
        16 if is(b"content-encoding") => (CONTENT_ENCODING, Role::EndToEnd),
        17 if is(b"transfer-encoding") => (TRANSFER_ENCODING, Role::Codings),
        _ => {
            let name = HeaderName::from_bytes(raw).map_err(|_| Malformed::FieldName)?;
            let role = if name == CONTENT_LENGTH {
                Role::Length
            } else if name == TRANSFER_ENCODING {
                Role::Codings
            } else if name == CONNECTION {
                Role::Connection
            } else if is_hop_by_hop(&name) {
                Role::HopByHop
            } else {
                Role::EndToEnd
            };
            return Ok((name, role));
        }
    };
    Ok((name, role))
}

/// Whether `raw` is `lower` (lowercase) in any case, ASCII letters only folded: eight
/// bytes at a time.
fn lowercase_eq(raw: &[u8], lower: &[u8]) -> bool {
    if raw.len() != lower.len() {
        return false;
    }
    let mut at = 0;
    while at < raw.len() {
        // The last word overlaps the one before where the length is no multiple of 8.
        let start = at.min(raw.len().saturating_sub(8));
        let end = (start + 8).min(raw.len());
        if let (Some(r), Some(l)) = (raw.get(start..end), lower.get(start..end)) {
            if fold_ascii(word(r)) != word(l) {
                return false;
            }
        }
        at = end;
    }
    true
}

/// Up to eight bytes as a word, zero-padded.
fn word(bytes: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    let n = bytes.len().min(8);
    w[..n].copy_from_slice(&bytes[..n]);
    u64::from_le_bytes(w)
}

/// Every byte of `x` that is an ASCII capital letter made lowercase; the others untouched.
fn fold_ascii(x: u64) -> u64 {
    const ONES: u64 = 0x0101_0101_0101_0101;
    let low7 = x & (0x7f * ONES);
    // Per byte, the high bit: at least `A`, above `Z` (no carry crosses a byte: low7 < 0x80).
    let from_a = low7 + (0x80 - u64::from(b'A')) * ONES;
    let past_z = low7 + (0x80 - u64::from(b'Z') - 1) * ONES;
    let capital = from_a & !past_z & !x & (0x80 * ONES);
    x | (capital >> 2)
}

/// A `Content-Length` field line (a list of equal lengths is one length), given the length
/// of the lines before it.
fn content_length(value: &[u8], before: Option<u64>) -> Result<Option<u64>, Malformed> {
    // The usual line, one number (19 digits cannot overflow), read at once.
    if !value.is_empty() && value.len() <= 19 && value.iter().all(u8::is_ascii_digit) {
        let n = value.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
        if before.is_some_and(|l| l != n) {
            return Err(Malformed::ConflictingLengths);
        }
        return Ok(Some(n));
    }
    let text = std::str::from_utf8(value).unwrap_or("");
    let mut length = before;
    for part in text.split(',') {
        let part = part.trim();
        let n = (!part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()))
            .then(|| part.parse::<u64>().ok())
            .flatten()
            .ok_or(Malformed::ContentLength)?;
        if length.is_some_and(|l| l != n) {
            return Err(Malformed::ConflictingLengths);
        }
        length = Some(n);
    }
    Ok(length)
}

/// Marks an answer whose connection must not be used again.
#[derive(Clone, Copy)]
pub(super) struct Close;

/// The transfer codings (other than chunked) the upstream applied to an answer's body.
#[derive(Clone)]
pub(super) struct Codings(HeaderValue);

/// An answer whose body carries transfer codings other than chunked (`Transfer-Encoding:
/// gzip, chunked`) keeps them for an HTTP/1.1 client: the codings are named again and
/// hyper frames the still-coded bytes as chunked after them. HTTP/1.0 has no transfer
/// codings and HTTP/2 forbids them: such a client gets a 502 rather than bytes that are
/// not what the upstream's fields describe.
pub(super) fn pass_codings(
    mut answer: Response<ResponseBody>,
    client: Version,
) -> Result<Response<ResponseBody>, Error> {
    let Some(Codings(codings)) = answer.extensions_mut().remove::<Codings>() else {
        return Ok(answer);
    };
    if client != Version::HTTP_11 {
        // Dropping the answer closes its connection: its body is never read.
        return Err(Error::Coding(codings));
    }
    answer.headers_mut().insert(TRANSFER_ENCODING, codings);
    Ok(answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(text: &str, is_head: bool) -> Result<(usize, http::response::Parts, Framing), String> {
        match parse(text.as_bytes(), is_head).map_err(|e| e.to_string())? {
            Parsed::Final(n, parts, framing) => Ok((n, parts, framing)),
            Parsed::Interim(n) => Err(format!("interim of {n}")),
            Parsed::Partial => Err("partial".into()),
            Parsed::Switched(n, _) => Err(format!("switched in {n}")),
        }
    }

    /// A 101 ends an upgrade's head only where the request asked to upgrade, and only with
    /// the `Upgrade` it switched to; what follows it is the new protocol's.
    #[test]
    fn a_switch_is_an_answer_only_to_an_upgrade() {
        let text = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: abc\r\n\r\n\x81\x00";
        match parse_as(text, false, true) {
            Ok(Parsed::Switched(n, parts)) => {
                assert_eq!(&text[n..], b"\x81\x00", "the frame after the head is left");
                assert_eq!(parts.headers["upgrade"], "websocket");
                assert_eq!(parts.headers["sec-websocket-accept"], "abc");
                assert!(!parts.headers.contains_key("connection"));
            }
            other => panic!("not a switch: {:?}", other.map(|_| ())),
        }
        assert!(matches!(
            parse_as(text, false, false),
            Err(Malformed::SwitchedProtocols)
        ));
        let unnamed = b"HTTP/1.1 101 Switching Protocols\r\n\r\n";
        assert!(matches!(
            parse_as(unnamed, false, true),
            Err(Malformed::SwitchedProtocols)
        ));
    }

    /// The names told at once are exactly those `HeaderName` would read, in any case, and
    /// a byte off (a letter, a case fold of a non-letter) is no match.
    #[test]
    fn common_field_names_are_told_as_header_name_reads_them() {
        let names = [
            "date",
            "etag",
            "vary",
            "server",
            "expires",
            "location",
            "connection",
            "set-cookie",
            "content-type",
            "cache-control",
            "last-modified",
            "accept-ranges",
            "content-length",
            "content-encoding",
            "transfer-encoding",
            "keep-alive",
            "x-custom",
            "te",
            "trailer",
            "upgrade",
            "proxy-authenticate",
        ];
        for name in names {
            let upper = name.to_ascii_uppercase();
            let mixed: String = name
                .chars()
                .enumerate()
                .map(|(i, c)| {
                    if i % 2 == 0 {
                        c.to_ascii_uppercase()
                    } else {
                        c
                    }
                })
                .collect();
            for spelled in [name, upper.as_str(), mixed.as_str()] {
                let (n, role) = field_name(spelled.as_bytes()).expect("a name");
                let read = HeaderName::from_bytes(spelled.as_bytes()).expect("a name");
                assert_eq!(n, read, "{spelled}");
                assert_eq!(
                    matches!(role, Role::Codings | Role::Connection | Role::HopByHop),
                    is_hop_by_hop(&read),
                    "{spelled}"
                );
            }
            for at in 0..name.len() {
                for b in [b'_', b'~', b'!', b'^', b'`', b'|', b'z'] {
                    let mut off = name.as_bytes().to_vec();
                    if off[at] == b {
                        continue;
                    }
                    off[at] = b;
                    if let Ok((n, _)) = field_name(&off) {
                        assert_eq!(Ok(n.clone()), HeaderName::from_bytes(&off).map_err(|_| ()));
                        assert_ne!(n.as_str(), name);
                    }
                }
            }
        }
        for b in 0..=255u8 {
            for lower in b'a'..=b'z' {
                let word8 = [b; 8];
                let want = b.to_ascii_lowercase() == lower;
                assert_eq!(lowercase_eq(&word8, &[lower; 8]), want, "{b} {lower}");
            }
            assert_eq!(lowercase_eq(&[b], b"-"), b == b'-');
        }
    }

    #[test]
    fn response_framing_follows_rfc_9112_lengths() {
        let (_, p, f) = head("HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n", false).unwrap();
        assert_eq!((p.status, f), (StatusCode::OK, Framing::Length(12)));
        assert!(p.extensions.get::<Close>().is_none());
        // Repeated equal lengths are one length; different ones are an error.
        let (_, _, f) = head("HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\n\r\n", false).unwrap();
        assert_eq!(f, Framing::Length(5));
        assert!(head(
            "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
            false
        )
        .is_err());
        assert!(head("HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", false).is_err());
        assert!(head("HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\n", false).is_err());
    }

    #[test]
    fn response_framing_follows_rfc_9112_transfer_codings() {
        // Chunked wins over a length, and the connection is not reused after it.
        let (_, p, f) = head(
            "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
            false,
        )
        .unwrap();
        assert_eq!(f, Framing::Chunked(Chunk::Size));
        assert!(p.extensions.get::<Close>().is_some());
        assert!(p.headers.get(CONTENT_LENGTH).is_none());
        // A coding other than chunked last: read until close, the coding kept.
        let (_, p, f) = head("HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", false).unwrap();
        assert_eq!(f, Framing::UntilClose);
        assert!(p.extensions.get::<Close>().is_some());
        assert_eq!(
            p.extensions.get::<Codings>().map(|c| c.0.clone()),
            Some(HeaderValue::from_static("gzip"))
        );
        // Chunked last: the other codings are kept for the client, across field lines.
        let (_, p, f) = head(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: br, chunked\r\n\r\n",
            false,
        )
        .unwrap();
        assert_eq!(f, Framing::Chunked(Chunk::Size));
        assert_eq!(
            p.extensions.get::<Codings>().map(|c| c.0.clone()),
            Some(HeaderValue::from_static("gzip, br"))
        );
        assert!(p.extensions.get::<Close>().is_none());
        // Chunked applied, then something over it: no framing can be trusted.
        assert!(head(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n",
            false
        )
        .is_err());
        assert!(head(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, chunked\r\n\r\n",
            false
        )
        .is_err());
        // No framing at all: until close.
        let (_, _, f) = head("HTTP/1.1 200 OK\r\n\r\n", false).unwrap();
        assert_eq!(f, Framing::UntilClose);
    }

    #[test]
    fn response_framing_follows_rfc_9112_no_body() {
        // No body: HEAD, 204, 304, whatever the fields say; and a connection that carried
        // one that said it had a body is not used again (what follows is ambiguous).
        for (text, is_head, reuse) in [
            ("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", true, true),
            ("HTTP/1.1 204 No Content\r\n\r\n", false, true),
            (
                "HTTP/1.1 304 Not Modified\r\nContent-Length: 0\r\n\r\n",
                false,
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n",
                true,
                false,
            ),
            (
                "HTTP/1.1 204 No Content\r\nContent-Length: 9\r\n\r\n",
                false,
                false,
            ),
            (
                "HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n",
                false,
                false,
            ),
        ] {
            let (_, p, f) = head(text, is_head).unwrap();
            assert_eq!(f, Framing::Length(0), "{text}");
            assert_eq!(p.extensions.get::<Close>().is_none(), reuse, "{text}");
        }
        for (text, is_head) in [
            ("HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n", true),
            (
                "HTTP/1.1 204 No Content\r\nContent-Length: 9\r\n\r\n",
                false,
            ),
            (
                "HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n",
                false,
            ),
        ] {
            assert_eq!(head(text, is_head).unwrap().2, Framing::Length(0), "{text}");
        }
    }

    #[test]
    fn response_framing_follows_rfc_9112_connection_end() {
        // Connection: close and HTTP/1.0 (unless keep-alive) end the connection.
        let (_, p, _) = head(
            "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
            false,
        )
        .unwrap();
        assert!(p.extensions.get::<Close>().is_some());
        let (_, p, _) = head("HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n", false).unwrap();
        assert!(p.extensions.get::<Close>().is_some());
        let (_, p, _) = head(
            "HTTP/1.0 200 OK\r\nConnection: Keep-Alive\r\nContent-Length: 0\r\n\r\n",
            false,
        )
        .unwrap();
        assert!(p.extensions.get::<Close>().is_none());
    }

    #[test]
    fn an_http10_answer_is_passed_on_in_the_gateways_own_version() {
        // RFC 9110 §6.2: the client is answered in HTTP/1.1 whatever the upstream spoke;
        // the upstream's HTTP/1.0 still decides the framing and the connection's end.
        let (_, p, f) = head("HTTP/1.0 200 OK\r\nContent-Type: a/b\r\n\r\n", false).unwrap();
        assert_eq!((p.version, f), (Version::HTTP_11, Framing::UntilClose));
        assert!(p.extensions.get::<Close>().is_some());
        let (_, p, f) = head("HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\n", false).unwrap();
        assert_eq!((p.version, f), (Version::HTTP_11, Framing::Length(3)));
        assert_eq!(p.headers[CONTENT_LENGTH], "3");
    }

    #[test]
    fn interim_answers_are_skipped_and_bad_heads_refused() {
        assert!(matches!(
            parse(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n", false),
            Ok(Parsed::Interim(25))
        ));
        assert!(matches!(
            parse(b"HTTP/1.1 200 OK\r\nA: b", false),
            Ok(Parsed::Partial)
        ));
        assert!(matches!(
            parse(b"HTTP/1.1 101 Switching Protocols\r\n\r\n", false),
            Err(Malformed::SwitchedProtocols)
        ));
        assert!(matches!(
            parse(b"garbage\r\n\r\n", false),
            Err(Malformed::Syntax(_))
        ));
        assert!(parse(b"HTTP/1.1 999x OK\r\n\r\n", false).is_err());
    }

    #[test]
    fn connection_rules_and_reason_phrases() {
        // `close` wins whatever the order, on either version.
        for text in [
            "HTTP/1.0 200 OK\r\nConnection: close, keep-alive\r\nContent-Length: 0\r\n\r\n",
            "HTTP/1.1 200 OK\r\nConnection: keep-alive, close\r\nContent-Length: 0\r\n\r\n",
        ] {
            assert!(
                head(text, false)
                    .unwrap()
                    .1
                    .extensions
                    .get::<Close>()
                    .is_some(),
                "{text}"
            );
        }
        // Transfer-Encoding in an HTTP/1.0 answer is faulty framing.
        assert!(matches!(
            parse(
                b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                false
            ),
            Err(Malformed::CodingInHttp10)
        ));
        // An own reason phrase is kept; the standard one needs nothing.
        let (_, p, _) = head(
            "HTTP/1.1 599 Custom Thing\r\nContent-Length: 0\r\n\r\n",
            false,
        )
        .unwrap();
        let reason = p
            .extensions
            .get::<hyper::ext::ReasonPhrase>()
            .expect("reason");
        assert_eq!(reason.as_bytes(), b"Custom Thing");
        let (_, p, _) = head("HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n", false).unwrap();
        assert!(p.extensions.get::<hyper::ext::ReasonPhrase>().is_none());
    }

    #[test]
    fn an_answers_hop_by_hop_fields_are_left_out_as_it_is_parsed() {
        // Every Connection option names a field to drop, whichever side of it that field
        // stands and whatever its case: `close` and `keep-alive` too.
        let (_, p, _) = head(
            "HTTP/1.1 200 OK\r\nX-Early: 1\r\nClose: secret\r\nConnection: close, X-EARLY\r\n\
             Connection: x-late ,\r\nKeep-Alive: timeout=5\r\nX-Late: 2\r\nTE: trailers\r\n\
             Upgrade: h2c\r\nTrailer: x\r\nProxy-Authenticate: Basic\r\nX-Kept: 3\r\n\
             Content-Length: 0\r\n\r\n",
            false,
        )
        .unwrap();
        let names: Vec<&str> = p.headers.keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["x-kept", "content-length"]);
        assert!(p.extensions.get::<Close>().is_some());
    }

    /// What [`read`] makes of an upstream that sends `wire` and closes.
    async fn read_all(wire: &[u8], replayable: bool) -> Result<u16, Error> {
        let mut conn = wire;
        read(&mut conn, false, replayable)
            .await
            .map(|(parts, _, _)| parts.status.as_u16())
    }

    #[tokio::test]
    async fn a_connection_that_ends_before_any_answer_byte_may_carry_the_request_again() {
        let ok = read_all(b"HTTP/1.1 204 No Content\r\n\r\n", true).await;
        assert_eq!(ok.ok(), Some(204));
        for (wire, replayable, expected) in [
            // Nothing at all: replayable if the request is.
            (&b""[..], true, true),
            (b"", false, false),
            // An interim answer came: the upstream read the request.
            (b"HTTP/1.1 100 Continue\r\n\r\n", true, false),
        ] {
            match read_all(wire, replayable).await {
                Err(e @ Error::Closed { .. }) => assert_eq!(e.retryable(), expected, "{wire:?}"),
                other => panic!("{wire:?}: {other:?}"),
            }
        }
        let cut = read_all(b"HTTP/1.1 200 OK\r\nContent-", true).await;
        assert!(matches!(cut, Err(Error::ClosedInHead)), "{cut:?}");
        let big = vec![b'a'; MAX_HEAD + 1];
        let too_large = read_all(&[&b"HTTP/1.1 200 OK\r\nX: "[..], &big].concat(), true).await;
        assert!(
            matches!(too_large, Err(Error::Malformed(Malformed::TooLarge))),
            "{too_large:?}"
        );
    }
}
