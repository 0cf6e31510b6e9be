//! A WebSocket echo server for bench/run's ws table: accepts any `GET` that asks to upgrade
//! to `websocket` (answers `101` with its `Sec-WebSocket-Accept`, RFC 6455 §4.2.2), then
//! sends every data frame back as it came (fin and opcode kept, unmasked), answers a ping
//! with a pong, a close with a close (its code). Whatever one read brings in goes back in
//! one write. Anything else gets a `400` and is closed. One thread: `taskset` it.
//!
//!     bench-ws-echo 127.0.0.1:18580

use std::io;
use std::time::Duration;

use bytes::{Buf, BytesMut};
use ratewall_bench::frame::{self, Parse};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The largest frame echoed; a larger one closes the socket (1009, message too big).
const MAX_PAYLOAD: usize = 1 << 20;
/// The largest handshake head read.
const MAX_HEAD: usize = 16 * 1024;

#[tokio::main(flavor = "current_thread")]
async fn main() -> io::Result<()> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:18580".into());
    let listener = ratewall_bench::listen(&addr)?;
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                eprintln!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        tokio::spawn(async move {
            if let Err(e) = serve(stream).await {
                if e.kind() != io::ErrorKind::ConnectionReset {
                    eprintln!("connection: {e}");
                }
            }
        });
    }
}

async fn serve(mut stream: TcpStream) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let mut buf = BytesMut::with_capacity(64 * 1024);
    let end = loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break end + 4;
        }
        if buf.len() > MAX_HEAD || stream.read_buf(&mut buf).await? == 0 {
            return Ok(());
        }
    };
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    buf.advance(end);
    let Some(key) = websocket_key(&head) else {
        let refusal = "HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";
        stream.write_all(refusal.as_bytes()).await?;
        return Ok(());
    };
    let answer = format!(
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Accept: {}\r\n\r\n",
        frame::accept(&key)
    );
    stream.write_all(answer.as_bytes()).await?;

    let mut out = Vec::with_capacity(64 * 1024);
    loop {
        let mut closing = false;
        loop {
            let f = match frame::parse(&buf, MAX_PAYLOAD) {
                Parse::Frame(f) => f,
                Parse::Incomplete => break,
                Parse::Invalid(why) => {
                    let code = if why == "payload too large" {
                        1009
                    } else {
                        1002
                    };
                    frame::write(
                        &mut out,
                        frame::CLOSE,
                        &frame::close_payload(code, why),
                        None,
                    );
                    closing = true;
                    break;
                }
            };
            if f.mask.is_none() {
                // §5.1: a server closes on an unmasked client frame.
                let payload = frame::close_payload(1002, "unmasked client frame");
                frame::write(&mut out, frame::CLOSE, &payload, None);
                closing = true;
                break;
            }
            let payload = f.payload(&buf);
            match f.opcode {
                frame::PING => {
                    frame::header(&mut out, true, frame::PONG, payload.len(), None);
                    frame::xor_into(&mut out, payload, f.mask);
                }
                frame::PONG => {}
                frame::CLOSE => {
                    // Echoes the code (§5.5.1); the client closes the TCP connection first.
                    frame::header(&mut out, true, frame::CLOSE, payload.len().min(2), None);
                    frame::xor_into(&mut out, &payload[..payload.len().min(2)], f.mask);
                    closing = true;
                }
                opcode => {
                    frame::header(&mut out, f.fin, opcode, payload.len(), None);
                    frame::xor_into(&mut out, payload, f.mask);
                }
            }
            buf.advance(f.len);
            if closing {
                break;
            }
        }
        if !out.is_empty() {
            stream.write_all(&out).await?;
            out.clear();
        }
        if closing {
            stream.shutdown().await?;
            // Reads until the client closes, for at most a second (§7.1.1: the server
            // should not close the TCP connection first).
            let mut sink = [0u8; 4096];
            let _ = tokio::time::timeout(Duration::from_secs(1), async {
                while stream.read(&mut sink).await.unwrap_or(0) > 0 {}
            })
            .await;
            return Ok(());
        }
        if buf.capacity() - buf.len() < 4096 {
            buf.reserve(64 * 1024);
        }
        if stream.read_buf(&mut buf).await? == 0 {
            return Ok(());
        }
    }
}

/// The `Sec-WebSocket-Key` of a `GET` that asks to upgrade to `websocket`.
fn websocket_key(head: &str) -> Option<String> {
    let mut lines = head.split("\r\n");
    if !lines.next()?.starts_with("GET ") {
        return None;
    }
    let (mut key, mut websocket) = (None, false);
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let (name, value) = (name.trim(), value.trim());
        if name.eq_ignore_ascii_case("sec-websocket-key") {
            key = Some(value.to_string());
        } else if name.eq_ignore_ascii_case("upgrade") {
            websocket = value
                .split(',')
                .any(|p| p.trim().eq_ignore_ascii_case("websocket"));
        }
    }
    key.filter(|_| websocket)
}
