//! Clients that leave before their answer, on raw sockets: each sends a request, waits
//! until the test says it reached the backend (`reached`), then leaves in its own way —
//! a FIN, a RST (`SO_LINGER` 0), an HTTP/2 RST_STREAM, a body cut short, a chunk size
//! that is not one, a body that stalls.

use std::future::Future;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::raw::{connect, h2_frame, hpack, H2_START, WAIT};

/// How a client leaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Leave {
    /// Closes its socket (FIN) once the request reached the backend.
    Fin,
    /// Resets its socket (RST: `SO_LINGER` 0) once the request reached the backend.
    Rst,
    /// Says `Content-Length: 100`, sends 10 bytes, then closes (FIN).
    ShortBody,
    /// Sends a chunked body whose second chunk size is not hexadecimal (`zz`), then waits
    /// for the gateway's answer.
    BadChunk,
    /// Says `Content-Length: 100`, sends 10 bytes, then sends nothing more, waiting for
    /// the gateway to give up on it (`body_timeout`).
    Stall,
}

impl Leave {
    pub fn name(self) -> &'static str {
        match self {
            Leave::Fin => "fin",
            Leave::Rst => "rst",
            Leave::ShortBody => "short-body",
            Leave::BadChunk => "bad-chunk",
            Leave::Stall => "stall",
        }
    }
}

/// One HTTP/1.1 request to `path` with API key `key` on a new connection, leaving as
/// `how` says once `reached` resolves (the test's word that the backend has the head).
/// What the gateway answered before the client left, if it answered (its status).
pub async fn leave_early(
    port: u16,
    path: &str,
    key: &str,
    how: Leave,
    reached: impl Future<Output = bool>,
) -> Option<u16> {
    let mut s = connect(port).await;
    let head = |extra: &str| {
        format!("POST {path} HTTP/1.1\r\nHost: attacks.test\r\nx-api-key: {key}\r\n{extra}\r\n")
    };
    let first = match how {
        Leave::Fin | Leave::Rst => head("content-length: 0\r\n"),
        Leave::ShortBody | Leave::Stall => head("content-length: 100\r\n") + "0123456789",
        Leave::BadChunk => head("transfer-encoding: chunked\r\n") + "5\r\nhello\r\n",
    };
    s.write_all(first.as_bytes()).await.expect("send the head");
    assert!(
        reached.await,
        "{}: the request never reached the backend",
        how.name()
    );
    match how {
        Leave::Fin | Leave::ShortBody => {
            drop(s);
            None
        }
        Leave::Rst => {
            let _ = s.set_zero_linger();
            drop(s);
            None
        }
        Leave::BadChunk => {
            let _ = s.write_all(b"zz\r\nnot a chunk\r\n").await;
            status_then_close(s).await
        }
        Leave::Stall => status_then_close(s).await,
    }
}

/// The status of the first answer on `s` (within [`WAIT`]), then the socket dropped.
async fn status_then_close(mut s: TcpStream) -> Option<u16> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let read = async {
        while !got.windows(2).any(|w| w == b"\r\n") {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    };
    let _ = tokio::time::timeout(WAIT, read).await;
    let text = String::from_utf8_lossy(&got);
    text.strip_prefix("HTTP/1.1 ")
        .and_then(|r| r.get(..3))
        .and_then(|c| c.parse().ok())
}

/// An h2c connection whose streams are each cancelled (RST_STREAM, CANCEL) once the
/// test says their request reached the backend; the connection itself stays open.
pub struct H2Canceller {
    s: TcpStream,
    next: u32,
    port: u16,
}

impl H2Canceller {
    pub async fn connect(port: u16) -> H2Canceller {
        let mut s = connect(port).await;
        s.write_all(H2_START).await.expect("h2 preface");
        H2Canceller { s, next: 1, port }
    }

    /// GET `path` with API key `key` on a new stream; RST_STREAM (CANCEL) once `reached`.
    pub async fn cancel(&mut self, path: &str, key: &str, reached: impl Future<Output = bool>) {
        let stream = self.next;
        self.next += 2;
        let authority = format!("127.0.0.1:{}", self.port);
        let block = hpack(&[
            (":method", "GET"),
            (":scheme", "http"),
            (":path", path),
            (":authority", &authority),
            ("x-api-key", key),
        ]);
        // END_HEADERS | END_STREAM.
        let headers = h2_frame(0x1, 0x5, stream, &block);
        self.s.write_all(&headers).await.expect("h2 HEADERS");
        assert!(
            reached.await,
            "h2 stream {stream}: the request never reached the backend"
        );
        // CANCEL (0x8).
        let reset = h2_frame(0x3, 0, stream, &8u32.to_be_bytes());
        self.s.write_all(&reset).await.expect("h2 RST_STREAM");
        // Take what the server sent meanwhile (SETTINGS, its ACK...), without waiting.
        let mut buf = [0u8; 16 * 1024];
        let _ = tokio::time::timeout(Duration::from_millis(10), self.s.read(&mut buf)).await;
    }
}
