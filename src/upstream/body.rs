//! Bodies both ways, framed per RFC 9112 §6: the client's request body written up as it
//! comes (as its `Content-Length` frames it, or chunked), and the upstream's response body
//! read from its connection as the client takes it (`Content-Length`, chunked with its
//! trailers, or until the connection closes).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_LENGTH, HOST};
use http::Response;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};

use super::forward::strip_hop_by_hop;
use super::head::{Close, FEW_FIELDS};
use super::kept::Kept;
use super::stream::{ReadSide, Stream, WriteSide};
use super::{Error, READ_SIZE};

/// The most a chunk-size line or the trailer section may take.
const MAX_CHUNK_LINE: usize = 4096;
const MAX_TRAILERS: usize = 64 * 1024;

/// How the request body goes upstream.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Sending {
    None,
    /// As it came: the client's `Content-Length` frames it.
    Length,
    /// Chunked (the client sent it chunked, or with no length known).
    Chunked,
}

impl Sending {
    /// How `body` goes up; a `Content-Length` that will not frame it is removed, and a
    /// body read whole is framed by its length whatever framed it from the client.
    pub(super) fn of(body: &RequestBody, headers: &mut HeaderMap) -> Sending {
        if body.is_end_stream() {
            Sending::None
        } else if let RequestBody::Read(Some(read)) = body {
            // A chunked body read whole (or one sent over HTTP/2 without a length) goes up
            // with its length: the client's `Transfer-Encoding` is hop-by-hop, already gone.
            headers.insert(CONTENT_LENGTH, HeaderValue::from(read.len()));
            Sending::Length
        } else if body.size_hint().exact().is_some() && headers.contains_key(CONTENT_LENGTH) {
            Sending::Length
        } else {
            headers.remove(CONTENT_LENGTH);
            Sending::Chunked
        }
    }
}

/// A client's request body on its way up: streamed as it comes, or already read (whole,
/// or its start) by the gateway, which had to look into it (`reserve = "max_tokens"`).
#[derive(Debug)]
pub enum RequestBody {
    Streaming(Incoming),
    /// Read whole; `None` once it has gone up.
    Read(Option<Bytes>),
    /// Its start read (a body too long to look into), then the rest as it comes: the
    /// request goes up whole all the same. `read` is `None` once it has gone up.
    Prefixed {
        read: Option<Bytes>,
        rest: Incoming,
    },
}

impl From<Incoming> for RequestBody {
    fn from(body: Incoming) -> RequestBody {
        RequestBody::Streaming(body)
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            RequestBody::Streaming(body) => Pin::new(body).poll_frame(cx),
            RequestBody::Read(read) => std::task::Poll::Ready(
                read.take()
                    .filter(|b| !b.is_empty())
                    .map(|b| Ok(Frame::data(b))),
            ),
            RequestBody::Prefixed { read, rest } => match read.take().filter(|b| !b.is_empty()) {
                Some(first) => std::task::Poll::Ready(Some(Ok(Frame::data(first)))),
                None => Pin::new(rest).poll_frame(cx),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RequestBody::Streaming(body) => body.is_end_stream(),
            RequestBody::Read(read) => read.as_ref().is_none_or(Bytes::is_empty),
            RequestBody::Prefixed { read, rest } => {
                read.as_ref().is_none_or(Bytes::is_empty) && rest.is_end_stream()
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RequestBody::Streaming(body) => body.size_hint(),
            RequestBody::Read(read) => {
                SizeHint::with_exact(read.as_ref().map_or(0, |b| b.len() as u64))
            }
            // hyper's hint is what is left of the body: with the client's `Content-Length`,
            // exact, and the prefix plus it is that length again ([`Sending::of`] then
            // sends the client's `Content-Length`); chunked, unknown (sent chunked).
            RequestBody::Prefixed { read, rest } => {
                let first = read.as_ref().map_or(0, |b| b.len() as u64);
                let rest = rest.size_hint();
                if let Some(exact) = rest.exact() {
                    return SizeHint::with_exact(exact.saturating_add(first));
                }
                let mut hint = SizeHint::new();
                hint.set_lower(rest.lower().saturating_add(first));
                if let Some(upper) = rest.upper().map(|u| u.saturating_add(first)) {
                    // Never below the lower bound (`set_upper` would panic): hyper's upper
                    // is at least its lower, and both grew by the same.
                    if upper >= hint.lower() {
                        hint.set_upper(upper);
                    }
                }
                hint
            }
        }
    }
}

/// The rest of a request body going up, and the write half once it is all sent.
pub(super) type Upload =
    Pin<Box<dyn std::future::Future<Output = Result<WriteSide, UploadError>> + Send>>;

/// Why a request body did not all go up, and whose fault that is.
#[derive(Debug)]
pub(super) enum UploadError {
    /// The client's body could not be read as framed.
    Client(hyper::Error),
    /// The client sent nothing for `body_timeout`.
    Stalled,
    /// Writing to the upstream failed, or it took nothing for its `timeout`
    /// ([`Error::Write`], [`Error::WriteStalled`]).
    Upstream(Error),
}

/// Write the head and stream the body after it: each read of the client's body within
/// `body_timeout`, each write to the upstream within `write_timeout`. `replayable`: whether
/// the request could go again if writing its head fails ([`Error::retryable`]); once a
/// byte of the body is read, it cannot.
pub(super) async fn send<W: AsyncWrite + Unpin>(
    conn: &mut W,
    head: &[u8],
    mut body: RequestBody,
    chunked: bool,
    body_timeout: Duration,
    write_timeout: Duration,
    replayable: bool,
) -> Result<(), UploadError> {
    async fn write<W: AsyncWrite + Unpin>(
        conn: &mut W,
        buf: &mut impl Buf,
        within: Duration,
        replayable: bool,
    ) -> Result<(), UploadError> {
        // The flush: TLS may hold what was written in its buffer (nothing on plain TCP).
        let written = async {
            conn.write_all_buf(buf).await?;
            conn.flush().await
        };
        match tokio::time::timeout(within, written).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(source)) => Err(UploadError::Upstream(Error::Write { source, replayable })),
            Err(_) => Err(UploadError::Upstream(Error::WriteStalled(within))),
        }
    }
    write(conn, &mut &head[..], write_timeout, replayable).await?;
    loop {
        let frame = match tokio::time::timeout(body_timeout, body.frame()).await {
            Err(_) => return Err(UploadError::Stalled),
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(UploadError::Client(e)),
            Ok(Some(Ok(frame))) => frame,
        };
        // Trailers are not forwarded (a hop-by-hop `TE: trailers` never reaches here).
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if data.is_empty() {
            continue;
        }
        if chunked {
            // Size line, data and CRLF in one vectored write.
            let size = format!("{:x}\r\n", data.len());
            let mut chunk = size.as_bytes().chain(data).chain(&b"\r\n"[..]);
            write(conn, &mut chunk, write_timeout, false).await?;
        } else {
            write(conn, &mut &data[..], write_timeout, false).await?;
        }
    }
    if chunked {
        write(conn, &mut &b"0\r\n\r\n"[..], write_timeout, false).await?;
    }
    Ok(())
}

/// How the rest of a response body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Framing {
    /// This many bytes left.
    Length(u64),
    Chunked(Chunk),
    /// Until the upstream closes the connection.
    UntilClose,
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Chunk {
    /// At a chunk-size line.
    Size,
    /// Inside a chunk's data: this many bytes left.
    Data(u64),
    /// After a chunk's data: its CRLF.
    DataEnd,
    /// After the last chunk: the trailer section, up to its blank line.
    Trailers,
}

/// Why an upstream's response body was cut off: the inner error of the `io::Error` the
/// body ends with (the answer has begun; the client's connection is cut).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    #[error("upstream response body: chunk data not followed by CRLF")]
    ChunkEnd,
    #[error("upstream response body: chunk-size line too long")]
    ChunkLineTooLong,
    #[error("upstream response body: bad chunk size")]
    ChunkSize,
    #[error("upstream response body: chunk size too large")]
    ChunkTooLarge,
    #[error("upstream response body: trailer section too long")]
    TrailersTooLong,
    #[error("upstream response body: malformed trailer section")]
    Trailers,
    #[error("the upstream closed the connection inside the response body")]
    Cut,
    #[error("the upstream sent nothing of its body for {0:?}")]
    Stalled(Duration),
}

impl From<BodyError> for io::Error {
    fn from(e: BodyError) -> io::Error {
        let kind = match e {
            BodyError::Cut => io::ErrorKind::UnexpectedEof,
            BodyError::Stalled(_) => io::ErrorKind::TimedOut,
            _ => io::ErrorKind::InvalidData,
        };
        io::Error::new(kind, e)
    }
}

/// What keeps the next frame from being taken out of the buffer.
enum Wanting {
    /// More bytes from the upstream.
    More,
    /// Nothing: the body is malformed.
    Bad(BodyError),
}

/// The upstream's response body, streamed to the client as it takes it: from an HTTP/1.1
/// connection of this worker's ([`Http1Body`]), or from an HTTP/2 stream
/// (`super::h2::Http2Body`), trailers passed on either way. One type for the gateway.
///
/// An upstream that sends nothing of the body for `timeout` (as nginx's
/// `proxy_read_timeout`: between two reads) fails it: the client's connection is cut, and
/// neither the client nor the upstream connection is held by a silent upstream.
pub struct ResponseBody(Kind);

enum Kind {
    Http1(Http1Body),
    Http2(super::h2::Http2Body),
    /// Moved elsewhere (a body read on after its client left): nothing.
    Taken,
}

impl ResponseBody {
    pub(super) fn http2(body: super::h2::Http2Body) -> ResponseBody {
        ResponseBody(Kind::Http2(body))
    }

    /// A body with nothing in it, left where one was taken away to be read elsewhere.
    pub fn taken() -> ResponseBody {
        ResponseBody(Kind::Taken)
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        match &mut self.0 {
            Kind::Http1(b) => Pin::new(b).poll_frame(cx),
            Kind::Http2(b) => Pin::new(b).poll_frame(cx),
            Kind::Taken => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.0 {
            Kind::Http1(b) => b.is_end_stream(),
            Kind::Http2(b) => b.is_end_stream(),
            Kind::Taken => true,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.0 {
            Kind::Http1(b) => b.size_hint(),
            Kind::Http2(b) => b.size_hint(),
            Kind::Taken => SizeHint::with_exact(0),
        }
    }
}

/// An HTTP/1.1 upstream's response body, read from its connection as the client takes it. The
/// connection goes back to the pool when the body ended cleanly and can carry another
/// request; a body dropped early takes its connection with it.
///
/// An upstream that sends nothing of the body for `timeout` (as nginx's
/// `proxy_read_timeout`: between two reads) fails it: the client's connection is cut, and
/// neither the client nor the upstream connection is held by a silent upstream.
pub(super) struct Http1Body {
    conn: Option<Conn>,
    /// The rest of the request body, still going up (an early answer).
    upload: Option<Upload>,
    buf: BytesMut,
    framing: Framing,
    reuse: bool,
    pool: Arc<Kept>,
    silence: Silence,
}

/// The clock on a peer's silences inside a body (the upstream's in an answer, the
/// client's in an upload to HTTP/2): since when it has sent nothing, and the timer on it,
/// made at the first wait only (boxed: most bodies never wait, and a body is moved whole
/// through every layer).
#[derive(Default)]
pub(super) struct Silence(Option<Box<Stall>>);

struct Stall {
    /// `None`: counted from the next poll that finds nothing.
    since: Option<tokio::time::Instant>,
    clock: Option<(tokio::time::Instant, Pin<Box<tokio::time::Sleep>>)>,
}

impl Silence {
    /// The peer sent something: the silence starts again now.
    pub(super) fn heard(&mut self) {
        if let Some(stall) = self.0.as_mut() {
            stall.since = Some(tokio::time::Instant::now());
        }
    }

    /// The peer sent something, and the silence is counted from the next poll that finds
    /// nothing (where what follows is not polled at once: h2 waiting for a window).
    pub(super) fn heard_until_asked(&mut self) {
        if let Some(stall) = self.0.as_mut() {
            stall.since = None;
        }
    }

    /// Nothing came this poll: whether the silence has lasted `timeout` (if not, `cx` is
    /// woken when it will have).
    pub(super) fn past(&mut self, timeout: Duration, cx: &mut Context<'_>) -> bool {
        let stall = self.0.get_or_insert_with(|| {
            Box::new(Stall {
                since: None,
                clock: None,
            })
        });
        let since = *stall.since.get_or_insert_with(tokio::time::Instant::now);
        crate::connection::expired(&mut stall.clock, since + timeout, cx)
    }
}

/// The connection an answer is read from: whole (and maybe kept), or the read half of one
/// whose write half carries an upload (never kept).
pub(super) enum Conn {
    Whole(Stream),
    Half(ReadSide),
}

impl Http1Body {
    /// The answer whose head is `parts`: its body is what follows in `buf`, then on `conn`.
    pub(super) fn answer(
        mut parts: http::response::Parts,
        conn: Conn,
        upload: Option<Upload>,
        buf: BytesMut,
        framing: Framing,
        pool: &Arc<Kept>,
    ) -> Response<ResponseBody> {
        let reuse = parts.extensions.remove::<Close>().is_none();
        let mut body = Http1Body {
            conn: Some(conn),
            upload,
            buf,
            framing,
            reuse,
            pool: pool.clone(),
            silence: Silence::default(),
        };
        body.finish_if_done();
        Response::from_parts(parts, ResponseBody(Kind::Http1(body)))
    }

    /// An answer without a body and without a connection to read one from (a `101`'s:
    /// its connection is the tunnel's).
    pub(super) fn none(pool: &Arc<Kept>) -> ResponseBody {
        ResponseBody(Kind::Http1(Http1Body {
            conn: None,
            upload: None,
            buf: BytesMut::new(),
            framing: Framing::Done,
            reuse: false,
            pool: pool.clone(),
            silence: Silence::default(),
        }))
    }

    /// Once the body is over, give the connection back (or close it), and drop what is
    /// left of an upload.
    fn finish_if_done(&mut self) {
        if self.framing == Framing::Length(0) {
            self.framing = Framing::Done;
        }
        if self.framing != Framing::Done {
            return;
        }
        self.upload = None;
        if let Some(Conn::Whole(conn)) = self.conn.take() {
            // Bytes past the end of the answer would be read as the next one: never reuse.
            if self.reuse && self.buf.is_empty() {
                self.pool.put(conn);
            }
        }
    }

    /// The body ends here, badly: its connection is closed.
    fn cut(&mut self) {
        self.conn = None;
        self.framing = Framing::Done;
    }

    /// Read more from the upstream into `buf`; `Ok(0)` at its end.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        match self.conn.as_mut() {
            None => Poll::Ready(Ok(0)),
            // Plain TCP reads straight into `buf`'s spare room, without a copy.
            Some(Conn::Whole(Stream::Plain(conn))) => loop {
                self.buf.reserve(READ_SIZE);
                match conn.try_read_buf(&mut self.buf) {
                    Ok(n) => return Poll::Ready(Ok(n)),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        ready!(conn.poll_read_ready(cx))?;
                    }
                    Err(e) => return Poll::Ready(Err(e)),
                }
            },
            Some(Conn::Whole(Stream::Tls(tls))) => {
                let mut chunk = [0u8; 8192];
                let mut read = ReadBuf::new(&mut chunk);
                ready!(Pin::new(tls).poll_read(cx, &mut read))?;
                self.buf.extend_from_slice(read.filled());
                Poll::Ready(Ok(read.filled().len()))
            }
            Some(Conn::Half(half)) => {
                let mut chunk = [0u8; 8192];
                let mut read = ReadBuf::new(&mut chunk);
                ready!(Pin::new(half).poll_read(cx, &mut read))?;
                self.buf.extend_from_slice(read.filled());
                Poll::Ready(Ok(read.filled().len()))
            }
        }
    }

    /// [`Self::poll_fill`] under the clock on the upstream's silences: an error once it
    /// sent nothing for its `timeout`.
    fn poll_fill_timed(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if let Poll::Ready(filled) = self.poll_fill(cx) {
            self.silence.heard();
            return Poll::Ready(filled);
        }
        let timeout = self.pool.timeout;
        if self.silence.past(timeout, cx) {
            return Poll::Ready(Err(BodyError::Stalled(timeout).into()));
        }
        Poll::Pending
    }

    /// The next frame already in `buf`, or what keeps it from being there.
    fn next_in_buffer(&mut self) -> Result<Option<Frame<Bytes>>, Wanting> {
        loop {
            match self.framing {
                Framing::Done => return Ok(None),
                Framing::Length(0) => {
                    self.framing = Framing::Done;
                    return Ok(None);
                }
                Framing::Length(left) | Framing::Chunked(Chunk::Data(left)) => {
                    if self.buf.is_empty() {
                        return Err(Wanting::More);
                    }
                    let take = (self.buf.len() as u64).min(left) as usize;
                    let data = self.buf.split_to(take).freeze();
                    let left = left - take as u64;
                    self.framing = match self.framing {
                        Framing::Length(_) => Framing::Length(left),
                        _ if left == 0 => Framing::Chunked(Chunk::DataEnd),
                        _ => Framing::Chunked(Chunk::Data(left)),
                    };
                    return Ok(Some(Frame::data(data)));
                }
                Framing::UntilClose => {
                    if self.buf.is_empty() {
                        return Err(Wanting::More);
                    }
                    return Ok(Some(Frame::data(self.buf.split().freeze())));
                }
                Framing::Chunked(Chunk::DataEnd) => {
                    if self.buf.len() < 2 {
                        return Err(Wanting::More);
                    }
                    if &self.buf[..2] != b"\r\n" {
                        return Err(Wanting::Bad(BodyError::ChunkEnd));
                    }
                    self.buf.advance(2);
                    self.framing = Framing::Chunked(Chunk::Size);
                }
                Framing::Chunked(Chunk::Size) => self.framing = self.size_line()?,
                Framing::Chunked(Chunk::Trailers) => return self.trailer_section(),
            }
        }
    }

    /// A chunk-size line, taken out of `buf`: the framing after it.
    fn size_line(&mut self) -> Result<Framing, Wanting> {
        let Some(end) = find(&self.buf, b"\r\n") else {
            return Err(if self.buf.len() > MAX_CHUNK_LINE {
                Wanting::Bad(BodyError::ChunkLineTooLong)
            } else {
                Wanting::More
            });
        };
        let size = chunk_size(&self.buf[..end]).map_err(Wanting::Bad)?;
        self.buf.advance(end + 2);
        Ok(Framing::Chunked(if size == 0 {
            Chunk::Trailers
        } else {
            Chunk::Data(size)
        }))
    }

    /// The trailer section: fields up to a blank line, passed on as trailers (hyper sends
    /// them to clients that can take them). The end of the body.
    fn trailer_section(&mut self) -> Result<Option<Frame<Bytes>>, Wanting> {
        if self.buf.starts_with(b"\r\n") {
            self.buf.advance(2);
            self.framing = Framing::Done;
            return Ok(None);
        }
        let Some(end) = find(&self.buf, b"\r\n\r\n") else {
            return Err(if self.buf.len() > MAX_TRAILERS {
                Wanting::Bad(BodyError::TrailersTooLong)
            } else {
                Wanting::More
            });
        };
        let section = self.buf.split_to(end + 4);
        self.framing = Framing::Done;
        let fields = trailers(&section).map_err(Wanting::Bad)?;
        Ok(fields.map(Frame::trailers))
    }
}

/// A trailer section's fields; `None` when none is worth passing on.
fn trailers(section: &[u8]) -> Result<Option<HeaderMap>, BodyError> {
    let mut fields = [httparse::EMPTY_HEADER; FEW_FIELDS];
    let parsed = httparse::parse_headers(section, &mut fields);
    let Ok(httparse::Status::Complete((_, fields))) = parsed else {
        return Err(BodyError::Trailers);
    };
    let mut map = HeaderMap::new();
    for f in fields {
        let name = HeaderName::from_bytes(f.name.as_bytes());
        let value = HeaderValue::from_bytes(f.value);
        if let (Ok(name), Ok(value)) = (name, value) {
            map.append(name, value);
        }
    }
    clean_trailers(&mut map);
    Ok((!map.is_empty()).then_some(map))
}

/// Trailers as they are passed on, either way: framing and routing fields never belong
/// in them (RFC 9110 §6.5.1), nor hop-by-hop ones.
pub(super) fn clean_trailers(map: &mut HeaderMap) {
    strip_hop_by_hop(map);
    for name in [CONTENT_LENGTH, HOST, http::header::CONTENT_TYPE] {
        map.remove(name);
    }
}

fn find(buf: &[u8], what: &[u8]) -> Option<usize> {
    buf.windows(what.len()).position(|w| w == what)
}

/// A chunk-size line: hex digits, then optional whitespace and `;` extensions (ignored).
fn chunk_size(line: &[u8]) -> Result<u64, BodyError> {
    let end = line
        .iter()
        .position(|b| !b.is_ascii_hexdigit())
        .unwrap_or(line.len());
    let rest = line[end..].trim_ascii_start();
    if end == 0 || !(rest.is_empty() || rest[0] == b';') {
        return Err(BodyError::ChunkSize);
    }
    let digits = &line[..end];
    let digits = &digits[digits.iter().take_while(|&&b| b == b'0').count()..];
    if digits.len() > 15 {
        return Err(BodyError::ChunkTooLarge);
    }
    let mut size = 0u64;
    for &b in digits {
        // Hex digits only (checked above), at most 15 of them: no overflow.
        size = size * 16 + u64::from((b as char).to_digit(16).unwrap_or(0));
    }
    Ok(size)
}

impl Body for Http1Body {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = &mut *self;
        // The rest of an upload goes up while the answer comes down. Its end (sent, or
        // failed: the upstream stopped reading) changes nothing about the answer.
        if let Some(upload) = this.upload.as_mut() {
            if upload.as_mut().poll(cx).is_ready() {
                this.upload = None;
            }
        }
        loop {
            match this.next_in_buffer() {
                Ok(frame) => {
                    this.finish_if_done();
                    return Poll::Ready(frame.map(Ok));
                }
                Err(Wanting::Bad(why)) => {
                    this.cut();
                    return Poll::Ready(Some(Err(why.into())));
                }
                Err(Wanting::More) => {}
            }
            match ready!(this.poll_fill_timed(cx)) {
                Ok(0) if this.framing == Framing::UntilClose => {
                    this.cut();
                    return Poll::Ready(None);
                }
                Ok(0) => {
                    this.cut();
                    return Poll::Ready(Some(Err(BodyError::Cut.into())));
                }
                Ok(_) => {}
                Err(e) => {
                    this.cut();
                    return Poll::Ready(Some(Err(e)));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.framing == Framing::Done
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Length(n) => SizeHint::with_exact(n),
            Framing::Done => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(framing: Framing, wire: &[u8]) -> Http1Body {
        Http1Body {
            conn: None,
            upload: None,
            buf: BytesMut::from(wire),
            framing,
            reuse: false,
            pool: Arc::new(Kept::new(Duration::from_secs(1))),
            silence: Silence::default(),
        }
    }

    /// Feed `wire` to a body in pieces of `step` bytes, as reads would; the body bytes out.
    fn decode(framing: Framing, wire: &[u8], step: usize) -> Result<Vec<u8>, BodyError> {
        let (mut body, mut out) = (body(framing, b""), Vec::new());
        let mut pieces = wire.chunks(step.max(1));
        loop {
            match body.next_in_buffer() {
                Ok(Some(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        out.extend_from_slice(&data);
                    }
                }
                Ok(None) => return Ok(out),
                Err(Wanting::Bad(why)) => return Err(why),
                Err(Wanting::More) => match pieces.next() {
                    Some(p) => body.buf.extend_from_slice(p),
                    None => return Err(BodyError::Cut),
                },
            }
        }
    }

    /// The bytes `req` goes up as over HTTP/1.1: its head as this hop writes it, then its
    /// body as [`Sending::of`] frames it.
    async fn sent(req: http::Request<RequestBody>) -> String {
        let host = HeaderValue::from_static("backend");
        let (parts, body) = req.into_parts();
        let mut out = super::super::Outbound::new(parts, body, None, &host);
        let peer = super::super::ClientPeer::new(([10, 0, 0, 1], 4000).into());
        let down = super::super::Downstream {
            peer: &peer,
            trusted: false,
            body_timeout: Duration::from_secs(1),
        };
        let chunked = out.sending == Sending::Chunked;
        let head = super::super::head::request(&out.parts, "", chunked, &down, None, None)
            .expect("a head");
        let body = out.body.take().expect("the body");
        let mut wire = Vec::new();
        let second = Duration::from_secs(1);
        let sent = send(&mut wire, &head, body, chunked, second, second, true).await;
        assert!(sent.is_ok(), "{sent:?}");
        String::from_utf8(wire).expect("text")
    }

    const CHUNKED: &[u8] = b"POST / HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n\
        5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n";

    #[tokio::test]
    async fn a_chunked_body_read_whole_goes_up_with_its_length() {
        let (parts, body) = super::super::served::http1(CHUNKED.to_vec())
            .await
            .into_parts();
        let read = body.collect().await.expect("the body").to_bytes();
        let req = http::Request::from_parts(parts, RequestBody::Read(Some(read)));
        let wire = sent(req).await;
        assert!(wire.contains("\r\ncontent-length: 11\r\n"), "{wire}");
        assert!(!wire.contains("transfer-encoding"), "{wire}");
        assert!(wire.ends_with("\r\n\r\nhello world"), "{wire}");
    }

    /// `wire`'s request with the first frame of its body read, as the gateway leaves a
    /// body too long to look into.
    async fn prefixed(wire: &[u8]) -> http::Request<RequestBody> {
        let (parts, mut rest) = super::super::served::http1(wire.to_vec())
            .await
            .into_parts();
        let first = rest.frame().await.and_then(|f| f.ok()?.into_data().ok());
        let body = RequestBody::Prefixed { read: first, rest };
        http::Request::from_parts(parts, body)
    }

    #[tokio::test]
    async fn a_prefixed_body_goes_up_whole_framed_as_it_came() {
        let with_length = b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 11\r\n\r\nhello world";
        let req = prefixed(with_length).await;
        assert_eq!(req.body().size_hint().exact(), Some(11));
        let wire = sent(req).await;
        assert!(wire.contains("\r\ncontent-length: 11\r\n"), "{wire}");
        assert!(!wire.contains("transfer-encoding"), "{wire}");
        assert!(wire.ends_with("\r\n\r\nhello world"), "{wire}");

        let req = prefixed(CHUNKED).await;
        assert_eq!(req.body().size_hint().exact(), None);
        let wire = sent(req).await;
        assert!(!wire.contains("content-length"), "{wire}");
        assert!(
            wire.contains("\r\ntransfer-encoding: chunked\r\n"),
            "{wire}"
        );
        assert!(
            wire.ends_with("\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"),
            "{wire}"
        );
    }

    #[tokio::test]
    async fn a_prefixed_body_yields_its_start_then_the_rest_then_ends() {
        let mut body = prefixed(CHUNKED).await.into_body();
        assert!(!body.is_end_stream());
        let mut frames = Vec::new();
        while let Some(frame) = body.frame().await {
            frames.push(frame.expect("a frame").into_data().expect("data"));
        }
        assert_eq!(frames, ["hello", " world"]);
        // A length said, and all of it read: the end is known (a chunked one's is not).
        let with_length = b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 2\r\n\r\nok";
        let mut body = prefixed(with_length).await.into_body();
        assert!(!body.is_end_stream());
        let first = body.frame().await.and_then(|f| f.ok()?.into_data().ok());
        assert_eq!(first.as_deref(), Some(&b"ok"[..]));
        assert!(body.is_end_stream());
        assert!(body.frame().await.is_none());
        // An empty start is no frame of its own.
        let (parts, rest) = super::super::served::http1(CHUNKED.to_vec())
            .await
            .into_parts();
        let mut body = RequestBody::Prefixed {
            read: Some(Bytes::new()),
            rest,
        };
        let first = body.frame().await.and_then(|f| f.ok()?.into_data().ok());
        assert_eq!(first.as_deref(), Some(&b"hello"[..]));
        assert_eq!(parts.method, http::Method::POST);
    }

    #[test]
    fn chunked_bodies_decode_across_any_split() {
        let wire = b"5;ext=1\r\nhello\r\n7\r\n, world\r\n0\r\nX-Trailer: t\r\n\r\n";
        for step in 1..wire.len() + 1 {
            assert_eq!(
                decode(Framing::Chunked(Chunk::Size), wire, step).as_deref(),
                Ok(&b"hello, world"[..]),
                "split every {step} bytes"
            );
        }
        assert_eq!(
            decode(Framing::Length(5), b"hello", 2).as_deref(),
            Ok(&b"hello"[..])
        );
        for bad in [
            &b"zz\r\nhello\r\n0\r\n\r\n"[..],
            b"5\r\nhelloXX0\r\n\r\n",
            b"\r\n",
        ] {
            assert!(
                decode(Framing::Chunked(Chunk::Size), bad, 3).is_err(),
                "{bad:?}"
            );
        }
        // A size too large for 15 hex digits is refused, not wrapped.
        assert_eq!(
            decode(Framing::Chunked(Chunk::Size), b"1000000000000000\r\n", 64),
            Err(BodyError::ChunkTooLarge)
        );
    }

    #[test]
    fn chunk_sizes_are_hex_digits_then_only_extensions() {
        let size = |line: &[u8]| chunk_size(line).ok();
        assert_eq!(size(b"1f"), Some(31));
        assert_eq!(
            size(b"0000000000000002"),
            Some(2),
            "leading zeros are not a size"
        );
        assert_eq!(size(b"2 ;name=value"), Some(2));
        assert_eq!(size(b"2;a;b=\"c\""), Some(2));
        for bad in [
            &b"+2"[..],
            b"-2",
            b"2 junk",
            b"",
            b" 2",
            b"0x2",
            b"fffffffffffffffff",
        ] {
            assert_eq!(size(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn trailers_are_passed_on_without_framing_fields() {
        let wire = b"2\r\nok\r\n0\r\nx-checksum: abc\r\ncontent-length: 9\r\n\r\n";
        let mut body = body(Framing::Chunked(Chunk::Size), wire);
        let data = body
            .next_in_buffer()
            .ok()
            .flatten()
            .and_then(|f| f.into_data().ok());
        assert_eq!(data.as_deref(), Some(&b"ok"[..]));
        let trailers = body
            .next_in_buffer()
            .ok()
            .flatten()
            .and_then(|f| f.into_trailers().ok());
        let trailers = trailers.expect("a trailers frame");
        assert_eq!(trailers["x-checksum"], "abc");
        assert!(trailers.get(CONTENT_LENGTH).is_none());
        assert!(body.is_end_stream());
    }
}
