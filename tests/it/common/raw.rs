//! Raw TCP exchanges with the gateway: bytes no well-behaved client would send, and
//! connections held in states a client library would not leave them in.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The longest a test waits on the network for any one thing.
pub const WAIT: Duration = Duration::from_secs(10);

/// A new connection to the gateway (Nagle off, so small writes go out as written).
pub async fn connect(port: u16) -> TcpStream {
    let stream = tokio::time::timeout(WAIT, TcpStream::connect(("127.0.0.1", port)))
        .await
        .expect("connect within the wait")
        .expect("connect");
    let _ = stream.set_nodelay(true);
    stream
}

/// The status code of the first answer in `bytes`.
pub fn status_of(bytes: &[u8]) -> u16 {
    let text = String::from_utf8_lossy(bytes);
    text.strip_prefix("HTTP/1.1 ")
        .or_else(|| text.strip_prefix("HTTP/1.0 "))
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {:?}", &text[..text.len().min(200)]))
}

/// What came back for one raw request.
#[derive(Debug)]
pub struct RawAnswer {
    pub status: u16,
    /// The server closed the connection after its answer (EOF within 2 s of its head).
    pub closed: bool,
    /// Everything read, for assertions and messages.
    pub text: String,
}

/// Send `request` on a new connection and read what comes back: the answer's head within
/// [`WAIT`], then everything until the server closes the connection or 2 s pass without
/// it closing (`closed` says which). The server may answer and close before it has read
/// all of `request`: a failed write is not an error. An error when nothing that starts
/// like an HTTP/1 answer came.
///
/// Requests that end with `Connection: close` are answered and closed at once; for the
/// others, `closed` is what a test of connection handling looks at.
pub async fn try_raw_exchange(port: u16, request: &[u8]) -> Result<RawAnswer, String> {
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let _ = s.write_all(request).await;
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let mut deadline = tokio::time::Instant::now() + WAIT;
    let mut head_seen = false;
    let mut closed = false;
    loop {
        if !head_seen && out.windows(4).any(|w| w == b"\r\n\r\n") {
            head_seen = true;
            deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        }
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => break,
            Ok(Ok(0)) => {
                closed = true;
                break;
            }
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Ok(Err(e)) => {
                if out.is_empty() {
                    return Err(format!("read: {e}"));
                }
                closed = true;
                break;
            }
        }
    }
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .or_else(|| text.strip_prefix("HTTP/1.0 "))
        .and_then(|r| r.get(..3))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("no status line in {text:?}"))?;
    Ok(RawAnswer {
        status,
        closed,
        text,
    })
}

/// [`try_raw_exchange`], which must get an answer.
pub async fn raw_exchange(port: u16, request: &[u8]) -> RawAnswer {
    let line = request.split(|&b| b == b'\r').next().unwrap_or_default();
    try_raw_exchange(port, request)
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", String::from_utf8_lossy(line)))
}

/// Everything the gateway sends until it closes the connection (or [`WAIT`] passes: then
/// the bytes so far and `None`), and how long that took from the call. Unlike
/// [`raw_exchange`], this measures when the server closes, however long after an answer
/// (or without one) that is: it is for tests of the connection clocks.
pub async fn until_closed(stream: &mut TcpStream) -> (Vec<u8>, Option<Duration>) {
    let start = Instant::now();
    let mut got = Vec::new();
    let read = async {
        let mut buf = [0u8; 16 * 1024];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    };
    let closed = tokio::time::timeout(WAIT, read).await.is_ok();
    (got, closed.then(|| start.elapsed()))
}

/// Send `request` on a new connection; [`until_closed`] of it.
pub async fn raw_until_closed(port: u16, request: &[u8]) -> (Vec<u8>, Option<Duration>) {
    let mut s = connect(port).await;
    s.write_all(request).await.expect("send");
    until_closed(&mut s).await
}

/// One whole answer to a request on a kept-alive connection (its head, and a
/// Content-Length body): its status.
pub async fn exchange(stream: &mut TcpStream, request: &[u8]) -> u16 {
    stream.write_all(request).await.expect("send");
    let mut got = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    let read = async {
        loop {
            if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                if got.len() >= end + 4 + length {
                    return status_of(&got);
                }
            }
            let n = stream.read(&mut buf).await.expect("read");
            assert!(
                n > 0,
                "closed before a whole answer: {:?}",
                String::from_utf8_lossy(&got)
            );
            got.extend_from_slice(&buf[..n]);
        }
    };
    tokio::time::timeout(WAIT, read)
        .await
        .expect("an answer within the wait")
}

// ---------------------------------------------------------------------------------------
// HTTP/2 as raw frames (h2c on the cleartext listener)

/// HTTP/2's connection preface and an empty SETTINGS frame.
pub const H2_START: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

/// An HTTP/2 frame: length, type, flags, stream, payload.
pub fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// An HPACK header block of `fields`, each a literal without indexing (RFC 7541 §6.2.2,
/// new name, no Huffman coding): the bytes exactly as given, pseudo-fields included, so
/// a test can send what no client library would (two `content-length`s, a userinfo in
/// `:authority`, no `:authority` at all). Names and values under 128 bytes.
pub fn hpack(fields: &[(&str, &str)]) -> Vec<u8> {
    let mut block = Vec::new();
    for (name, value) in fields {
        assert!(name.len() < 128 && value.len() < 128, "short literals only");
        block.push(0x00);
        block.push(name.len() as u8);
        block.extend_from_slice(name.as_bytes());
        block.push(value.len() as u8);
        block.extend_from_slice(value.as_bytes());
    }
    block
}

/// What [`h2_status`] answers for a stream the server reset (RST_STREAM) instead of
/// answering: no HTTP status has this value.
pub const H2_RESET: u16 = 0;

/// Send one HTTP/2 request on a new h2c connection: `fields` as its HEADERS on stream 1,
/// then `body` as one DATA frame (none if empty). The answer's `:status`, read from the
/// first HEADERS frame on stream 1: an index into HPACK's static table (200, 204, 206,
/// 304, 400, 404, 500 are there), or a literal (429, 502...); [`H2_RESET`] if the stream
/// was reset; `None` if the connection ended (or [`WAIT`] passed) without either.
pub async fn h2_status(port: u16, fields: &[(&str, &str)], body: &[u8]) -> Option<u16> {
    let mut s = connect(port).await;
    let mut out = H2_START.to_vec();
    let end_headers_and_stream = if body.is_empty() { 0x5 } else { 0x4 };
    out.extend(h2_frame(0x1, end_headers_and_stream, 1, &hpack(fields)));
    if !body.is_empty() {
        out.extend(h2_frame(0x0, 0x1, 1, body));
    }
    s.write_all(&out).await.ok()?;
    let read = async {
        let mut frames = Vec::new();
        let mut buf = [0u8; 16 * 1024];
        loop {
            let mut at = 0;
            while at + 9 <= frames.len() {
                let f: &[u8] = &frames[at..];
                let len = (usize::from(f[0]) << 16) | (usize::from(f[1]) << 8) | usize::from(f[2]);
                if f.len() < 9 + len {
                    break;
                }
                let stream = u32::from_be_bytes([f[5], f[6], f[7], f[8]]) & 0x7fff_ffff;
                if f[3] == 0x1 && stream == 1 {
                    return status_in_block(&f[9..9 + len], f[4]);
                }
                // RST_STREAM on the request's stream: refused by the HTTP/2 layer.
                if f[3] == 0x3 && stream == 1 {
                    return Some(H2_RESET);
                }
                at += 9 + len;
            }
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => frames.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(WAIT, read).await.ok().flatten()
}

/// `:status` at the start of a response's header block (its PADDED and PRIORITY parts
/// skipped by `flags`).
fn status_in_block(payload: &[u8], flags: u8) -> Option<u16> {
    let mut block = payload;
    if flags & 0x8 != 0 {
        let pad = usize::from(*block.first()?);
        block = block.get(1..block.len().checked_sub(pad)?)?;
    }
    if flags & 0x20 != 0 {
        block = block.get(5..)?;
    }
    // A dynamic table size update (001xxxxx) may come first.
    while block.first().is_some_and(|b| b & 0xe0 == 0x20) {
        block = &block[1..];
    }
    let first = *block.first()?;
    let statuses = [200, 204, 206, 304, 400, 404, 500];
    if first & 0x80 != 0 {
        return statuses
            .get(usize::from(first & 0x7f).checked_sub(8)?)
            .copied();
    }
    // A literal of name index 8 (`:status`): with incremental indexing (01), or without
    // (0000, 0001); its value Huffman-coded (as h2 always codes it) or not.
    let name = if first & 0xc0 == 0x40 {
        first & 0x3f
    } else {
        first & 0x0f
    };
    if name != 8 {
        return None;
    }
    let (huffman, len) = (block.get(1)? & 0x80 != 0, usize::from(block[1] & 0x7f));
    let value = block.get(2..2 + len)?;
    let digits = match huffman {
        true => huffman_digits(value)?,
        false => String::from_utf8(value.to_vec()).ok()?,
    };
    digits.parse().ok()
}

/// A Huffman-coded string of digits (RFC 7541 Appendix B: `0`-`2` are the 5-bit codes
/// 0-2, `3`-`9` the 6-bit codes 0x19-0x1f), its padding the 1 bits of EOS.
fn huffman_digits(coded: &[u8]) -> Option<String> {
    let bits: Vec<u8> = coded
        .iter()
        .flat_map(|b| (0..8).rev().map(move |i| (b >> i) & 1))
        .collect();
    let code = |from: usize, n: usize| {
        bits.get(from..from + n)
            .map(|b| b.iter().fold(0u8, |acc, bit| acc << 1 | bit))
    };
    let (mut out, mut at) = (String::new(), 0);
    while at < bits.len() {
        if bits[at..].iter().all(|&b| b == 1) && bits.len() - at < 8 {
            break;
        }
        match code(at, 5)? {
            c @ 0..=2 => {
                out.push(char::from(b'0' + c));
                at += 5;
            }
            _ => match code(at, 6)? {
                c @ 0x19..=0x1f => {
                    out.push(char::from(b'3' + (c - 0x19)));
                    at += 6;
                }
                _ => return None,
            },
        }
    }
    Some(out)
}
