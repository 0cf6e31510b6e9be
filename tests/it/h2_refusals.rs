//! An HTTP/2 server's refusals, as `src/upstream/h2.rs` and `src/upstream/error.rs` answer
//! them: the real binary in front of an h2c server written here frame by frame, so that
//! each connection refuses exactly as a test says.
//!
//! What is pinned (RFC 9113 §8.7: a stream reset with REFUSED_STREAM, or above a GOAWAY's
//! last stream id, was not processed): such a request goes again once, on a new
//! connection to the same server, and is answered; a second refusal is the client's 502
//! (once, not for ever); a request whose body went up with the refused stream is not
//! replayed (the body cannot be read again: 502, one stream at the server); a stream reset
//! for another reason (INTERNAL_ERROR: maybe processed) is not sent again to the server.
//! Each pool has one server and `retries = 0`: what goes again here is the HTTP/2 client's
//! own retry, not the pool's.

use crate::common;

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use common::{h2_frame, Gateway, HttpClient, Store};
use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// What a connection does with each request stream it gets (a connection past the list
/// answers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Plan {
    /// `:status 200`, body `ok`.
    Answer,
    /// RST_STREAM with REFUSED_STREAM (0x7): not processed.
    Refuse,
    /// A graceful GOAWAY (NO_ERROR) whose last stream id is 0: below every stream, none
    /// processed.
    GoAway,
    /// RST_STREAM with INTERNAL_ERROR (0x2): maybe processed.
    Reset,
}

/// One request stream as the server got it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Got {
    /// The connection (0, 1, ... in accept order) and the stream id.
    connection: usize,
    stream: u32,
    plan: Plan,
}

/// An h2c server (prior knowledge) that treats the streams of its `n`-th connection as
/// `plans[n]` says.
struct ScriptedH2 {
    port: u16,
    got: Arc<Mutex<Vec<Got>>>,
    task: JoinHandle<()>,
}

impl Drop for ScriptedH2 {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ScriptedH2 {
    async fn start(plans: &[Plan]) -> ScriptedH2 {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let got = Arc::new(Mutex::new(Vec::new()));
        let (plans, seen) = (plans.to_vec(), got.clone());
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            for n in 0.. {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let plan = plans.get(n).copied().unwrap_or(Plan::Answer);
                connections.spawn(serve(tcp, n, plan, seen.clone()));
            }
        });
        ScriptedH2 { port, got, task }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn got(&self) -> Vec<Got> {
        self.got.lock().unwrap().clone()
    }
}

const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const ACK: u8 = 0x1;

/// One connection: the preface, SETTINGS both ways, then each request stream's HEADERS
/// met with `plan` (DATA, WINDOW_UPDATE and the rest read and let be).
async fn serve(mut tcp: TcpStream, connection: usize, plan: Plan, got: Arc<Mutex<Vec<Got>>>) {
    let mut preface = [0u8; 24];
    if tcp.read_exact(&mut preface).await.is_err() || &preface[..3] != b"PRI" {
        return;
    }
    if tcp.write_all(&h2_frame(SETTINGS, 0, 0, &[])).await.is_err() {
        return;
    }
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        while buf.len() >= 9 {
            let len =
                (usize::from(buf[0]) << 16) | (usize::from(buf[1]) << 8) | usize::from(buf[2]);
            if buf.len() < 9 + len {
                break;
            }
            let (kind, flags) = (buf[3], buf[4]);
            let stream = u32::from_be_bytes([buf[5], buf[6], buf[7], buf[8]]) & 0x7fff_ffff;
            let payload: Vec<u8> = buf[9..9 + len].to_vec();
            buf.drain(..9 + len);
            let reply = match kind {
                SETTINGS if flags & ACK == 0 => h2_frame(SETTINGS, ACK, 0, &[]),
                PING if flags & ACK == 0 => h2_frame(PING, ACK, 0, &payload),
                HEADERS => {
                    got.lock().unwrap().push(Got {
                        connection,
                        stream,
                        plan,
                    });
                    match plan {
                        // `:status: 200` is entry 8 of HPACK's static table.
                        Plan::Answer => {
                            let mut a = h2_frame(HEADERS, END_HEADERS, stream, &[0x88]);
                            a.extend(h2_frame(DATA, END_STREAM, stream, b"ok"));
                            a
                        }
                        Plan::Refuse => h2_frame(RST_STREAM, 0, stream, &7u32.to_be_bytes()),
                        Plan::Reset => h2_frame(RST_STREAM, 0, stream, &2u32.to_be_bytes()),
                        Plan::GoAway => {
                            // Last stream id 0, NO_ERROR.
                            h2_frame(GOAWAY, 0, 0, &[0; 8])
                        }
                    }
                }
                _ => Vec::new(),
            };
            if !reply.is_empty() && tcp.write_all(&reply).await.is_err() {
                return;
            }
        }
        match tcp.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// A gateway with one h2c pool of `server`, no retry to another server, never ejecting it.
fn gateway(server: &ScriptedH2) -> Gateway {
    Gateway::start(&format!(
        "[[upstreams]]\nname = \"default\"\nservers = [\"{}\"]\nprotocol = \"h2c\"\n\
         connect_timeout = \"2s\"\ntimeout = \"5s\"\nretries = 0\nmax_fails = 0\n{}",
        server.url(),
        Store::Memory.toml()
    ))
}

/// Each request stream the server got, in order: its connection and what was done with it
/// (every one is its connection's stream 1).
fn streams(server: &ScriptedH2) -> Vec<(usize, Plan)> {
    let got = server.got();
    assert!(got.iter().all(|g| g.stream == 1), "{got:?}");
    got.iter().map(|g| (g.connection, g.plan)).collect()
}

/// A GET the first connection cuts as `plan` says goes again once, on a second
/// connection, and is answered there.
async fn answered_on_a_second_connection(plan: Plan, why: &str) {
    let server = ScriptedH2::start(&[plan]).await;
    let gw = gateway(&server);
    let r = HttpClient::new().get(&gw.url("/x"), &[]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", gw.logs());
    assert_eq!(&r.body[..], b"ok");
    assert_eq!(streams(&server), [(0, plan), (1, Plan::Answer)], "{why}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_stream_goes_again_once_on_a_new_connection_and_is_answered() {
    let _watch = common::watchdog();
    answered_on_a_second_connection(
        Plan::Refuse,
        "refused on the first connection, answered on a second",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_above_a_graceful_goaway_goes_again_once_and_is_answered() {
    let _watch = common::watchdog();
    answered_on_a_second_connection(
        Plan::GoAway,
        "cut by the GOAWAY on the first connection, answered on a second",
    )
    .await;
}

/// A POST without a body is unprocessed all the same when refused: it goes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_post_without_a_body_goes_again() {
    let _watch = common::watchdog();
    let server = ScriptedH2::start(&[Plan::Refuse]).await;
    let gw = gateway(&server);
    let r = HttpClient::new()
        .send("POST", &gw.url("/x"), &[], Bytes::new())
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", gw.logs());
    assert_eq!(streams(&server), [(0, Plan::Refuse), (1, Plan::Answer)]);
}

/// Refused twice: the second refusal is the client's 502, and nothing goes a third time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_refused_twice_is_a_502_and_not_sent_a_third_time() {
    let _watch = common::watchdog();
    let server = ScriptedH2::start(&[Plan::Refuse, Plan::GoAway]).await;
    let gw = gateway(&server);
    let r = HttpClient::new().get(&gw.url("/x"), &[]).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{}", gw.logs());
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert_eq!(streams(&server), [(0, Plan::Refuse), (1, Plan::GoAway)]);
    // The third connection answers: the next request is served.
    let r = HttpClient::new().get(&gw.url("/y"), &[]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", gw.logs());
}

/// A POST whose body went up on the refused stream: the body was handed over and cannot be
/// read again, so the request is not replayed (one stream at the server, 502).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_post_whose_body_went_up_is_not_replayed() {
    let _watch = common::watchdog();
    for plan in [Plan::Refuse, Plan::GoAway] {
        let server = ScriptedH2::start(&[plan]).await;
        let gw = gateway(&server);
        let body = Bytes::from(vec![b'b'; 4096]);
        let r = HttpClient::new()
            .send("POST", &gw.url("/x"), &[], body)
            .await;
        assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{plan:?}: {}", gw.logs());
        // Nothing of it went a second time, on any connection (a second attempt would
        // have come before the 502).
        assert_eq!(streams(&server), [(0, plan)], "{plan:?}: replayed");
    }
}

/// A stream reset for another reason may have been processed: it is not sent again to the
/// server (the pool's own retries, 0 here, decide whether another server is tried).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_reset_with_internal_error_is_not_sent_again() {
    let _watch = common::watchdog();
    let server = ScriptedH2::start(&[Plan::Reset]).await;
    let gw = gateway(&server);
    let r = HttpClient::new().get(&gw.url("/x"), &[]).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{}", gw.logs());
    // A second attempt would have come before the 502.
    assert_eq!(streams(&server), [(0, Plan::Reset)]);
}
