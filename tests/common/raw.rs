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
