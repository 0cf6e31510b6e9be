//! The copy loop over in-memory pipes, on tokio's paused clock: what passes each way,
//! when a tunnel ends and with which close frames, and that a side that does not read
//! holds the other back.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

use super::*;
use crate::identity::IdentityDigest;
use crate::limiter::breaker::Limiter;
use crate::limiter::memory::MemoryStore;
use crate::limiter::metrics::LimiterMetrics;
use crate::limiter::{ManualClock, OnError, Rate};
use crate::rules::Messages;
use crate::telemetry::stats::Stats;

const IDLE: Duration = Duration::from_secs(60);
const MAX_DELAY: Duration = Duration::from_secs(2);

fn metrics() -> TunnelMetrics {
    TunnelMetrics::register(&mut prometheus_client::registry::Registry::default())
}

fn tunnel(websocket: bool, meters: Vec<Meter>) -> Tunnel {
    Tunnel {
        websocket,
        meters,
        max_delay: MAX_DELAY,
        max_message: None,
        idle: IDLE,
        hold: Hold::detached(),
        leases: None,
        labels: TunnelLabels {
            route: "r".into(),
            pool: "p".into(),
        },
    }
}

/// A limiter on the memory store whose clock never moves: no token comes back.
fn still_limiter() -> Arc<Limiter> {
    let clock = ManualClock::new(1_000_000_000);
    Limiter::new(
        Box::new(MemoryStore::new(clock)),
        &crate::limiter::store::Settings::default(),
        LimiterMetrics::register(&mut prometheus_client::registry::Registry::default()),
        Arc::new(Stats::new()),
    )
}

/// A meter on the memory store whose clock never moves: `burst` frames, then none.
fn meter(burst: u64) -> Meter {
    let limiter = still_limiter();
    let messages = Messages {
        rate: Rate::parse("10/s").expect("a rate"),
        burst,
        max_bytes: None,
    };
    Meter::messages(
        limiter,
        IdentityDigest([7; 16]),
        "chat",
        &messages,
        OnError::Deny,
    )
}

/// The client's and the backend's ends of a tunnel started on `t`; its task's result.
fn start(
    t: Tunnel,
    capacity: usize,
) -> (
    DuplexStream,
    DuplexStream,
    tokio::task::JoinHandle<(Ended, TunnelMetrics)>,
) {
    let (client, gateway_client) = tokio::io::duplex(capacity);
    let (backend, gateway_backend) = tokio::io::duplex(capacity);
    let task = tokio::spawn(async move {
        let m = metrics();
        let ended = t.run(gateway_client, gateway_backend, &m).await;
        (ended, m)
    });
    (client, backend, task)
}

/// A frame as a client sends it: masked.
fn client_frame(opcode: u8, payload: &[u8]) -> Vec<u8> {
    let key = [0x11, 0x22, 0x33, 0x44];
    let mut f = vec![0x80 | opcode];
    assert!(payload.len() < 126);
    f.push(0x80 | payload.len() as u8);
    f.extend_from_slice(&key);
    f.extend(payload.iter().enumerate().map(|(i, b)| b ^ key[i % 4]));
    f
}

/// A frame as a server sends it: unmasked.
fn server_frame(opcode: u8, payload: &[u8]) -> Vec<u8> {
    assert!(payload.len() < 126);
    let mut f = vec![0x80 | opcode, payload.len() as u8];
    f.extend_from_slice(payload);
    f
}

/// Every frame in `bytes` (small frames only): opcode and unmasked payload.
fn frames(mut bytes: &[u8]) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let opcode = bytes[0] & 0x0f;
        let masked = bytes[1] & 0x80 != 0;
        let len = usize::from(bytes[1] & 0x7f);
        assert!(len < 126, "a small frame");
        let (key, at) = if masked {
            ([bytes[2], bytes[3], bytes[4], bytes[5]], 6)
        } else {
            ([0; 4], 2)
        };
        let payload = bytes[at..at + len]
            .iter()
            .enumerate()
            .map(|(i, b)| b ^ key[i % 4])
            .collect();
        out.push((opcode, payload));
        bytes = &bytes[at + len..];
    }
    out
}

/// The close code of a close frame's payload.
fn code(payload: &[u8]) -> u16 {
    u16::from_be_bytes([payload[0], payload[1]])
}

/// All `end` receives until it ends.
/// Await the tunnel's end, checking it is `ended` and came after the frame was held back
/// about `MAX_DELAY`: the frames that went to the backend.
async fn held_then_closed(
    task: tokio::task::JoinHandle<(Ended, TunnelMetrics)>,
    ended: Ended,
    backend: &mut DuplexStream,
) -> Vec<(u8, Vec<u8>)> {
    let began = tokio::time::Instant::now();
    let (got, _) = task.await.unwrap();
    assert_eq!(got, ended);
    let held = began.elapsed();
    assert!(
        held >= MAX_DELAY - Duration::from_millis(200) && held <= MAX_DELAY * 2,
        "closed after {held:?}, max_delay {MAX_DELAY:?}"
    );
    frames(&rest(backend).await)
}

/// The bytes the tunnel of route "r" to pool "p" counted going upstream.
fn upstream_bytes(m: &TunnelMetrics) -> u64 {
    m.bytes
        .get_or_create(&BytesLabels {
            route: "r".into(),
            pool: "p".into(),
            direction: Direction::Upstream,
        })
        .get()
}

async fn rest(end: &mut DuplexStream) -> Vec<u8> {
    let mut all = Vec::new();
    end.read_to_end(&mut all).await.expect("read");
    all
}

#[tokio::test(start_paused = true)]
async fn raw_bytes_pass_both_ways_and_the_tunnel_ends_when_either_side_closes() {
    let (mut client, mut backend, task) = start(tunnel(false, Vec::new()), 64 * 1024);
    client.write_all(b"hello backend").await.unwrap();
    let mut got = [0u8; 13];
    backend.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"hello backend");
    backend.write_all(b"hello client").await.unwrap();
    let mut got = [0u8; 12];
    client.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"hello client");

    // The backend closes; the client, still open, is not waited for past the grace.
    drop(backend);
    let (ended, m) = tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("ended within the grace")
        .unwrap();
    assert_eq!(ended, Ended::UpstreamClosed);
    assert!(
        rest(&mut client).await.is_empty(),
        "the client sees the end"
    );
    let up = upstream_bytes(&m);
    assert_eq!(up, 13);
    let open = m.open.get_or_create(&TunnelLabels {
        route: "r".into(),
        pool: "p".into(),
    });
    assert_eq!(open.get(), 0, "no longer counted open");
}

#[tokio::test(start_paused = true)]
async fn a_closing_handshake_from_the_client_passes_both_close_frames() {
    let (mut client, mut backend, task) = start(tunnel(true, Vec::new()), 64 * 1024);
    let close = client_frame(0x8, &[0x03, 0xe8]);
    client.write_all(&client_frame(0x1, b"hi")).await.unwrap();
    client.write_all(&close).await.unwrap();
    let mut got = vec![0u8; 8 + close.len()];
    backend.read_exact(&mut got).await.unwrap();
    assert_eq!(
        frames(&got),
        vec![(0x1, b"hi".to_vec()), (0x8, vec![0x03, 0xe8])]
    );
    // The backend answers the close and ends its side; the client then ends its own.
    backend
        .write_all(&server_frame(0x8, &[0x03, 0xe8]))
        .await
        .unwrap();
    drop(backend);
    let mut answer = [0u8; 4];
    client.read_exact(&mut answer).await.unwrap();
    assert_eq!(frames(&answer), vec![(0x8, vec![0x03, 0xe8])]);
    drop(client);
    let (ended, _) = task.await.unwrap();
    assert_eq!(ended, Ended::UpstreamClosed);
}

#[tokio::test(start_paused = true)]
async fn a_client_past_its_message_limit_is_held_back_then_closed_with_1008() {
    let (mut client, mut backend, task) = start(tunnel(true, vec![meter(3)]), 64 * 1024);
    for n in 0..10u8 {
        client.write_all(&client_frame(0x2, &[n])).await.unwrap();
    }
    let to_backend = held_then_closed(task, Ended::MessageLimit, &mut backend).await;
    // Three frames had tokens, then the gateway's close, masked as a client's must be.
    let data: Vec<_> = to_backend.iter().filter(|(op, _)| *op == 0x2).collect();
    assert_eq!(data.len(), 3, "{to_backend:?}");
    let (op, payload) = to_backend.last().unwrap();
    assert_eq!(*op, 0x8);
    assert_eq!(code(payload), 1008);
    let to_client = frames(&rest(&mut client).await);
    assert_eq!(to_client.len(), 1);
    assert_eq!(to_client[0].0, 0x8);
    assert_eq!(code(&to_client[0].1), 1008);
    assert_eq!(&to_client[0].1[2..], b"message rate limit exceeded");
}

#[tokio::test(start_paused = true)]
async fn a_client_frame_that_breaks_rfc_6455_closes_both_ends_with_1002() {
    let (mut client, mut backend, task) = start(tunnel(true, Vec::new()), 64 * 1024);
    client.write_all(&client_frame(0x1, b"ok")).await.unwrap();
    let mut first = [0u8; 8];
    backend.read_exact(&mut first).await.unwrap();
    // Unmasked, as no client may send.
    client.write_all(&server_frame(0x1, b"bad")).await.unwrap();
    let (ended, _) = task.await.unwrap();
    assert_eq!(ended, Ended::ProtocolError);
    let to_backend = frames(&rest(&mut backend).await);
    assert_eq!(to_backend.len(), 1, "only the close: {to_backend:?}");
    assert_eq!(to_backend[0].0, 0x8);
    assert_eq!(code(&to_backend[0].1), 1002);
    let to_client = frames(&rest(&mut client).await);
    assert_eq!(to_client.len(), 1);
    assert_eq!(code(&to_client[0].1), 1002);
}

#[tokio::test(start_paused = true)]
async fn an_idle_tunnel_closes_with_1001_after_upgrade_idle_timeout() {
    let (mut client, mut backend, task) = start(tunnel(true, Vec::new()), 64 * 1024);
    let began = tokio::time::Instant::now();
    // Traffic half-way through keeps it open a full period more.
    tokio::time::sleep(IDLE / 2).await;
    client.write_all(&client_frame(0x1, b"x")).await.unwrap();
    let mut got = [0u8; 7];
    backend.read_exact(&mut got).await.unwrap();
    let (ended, _) = task.await.unwrap();
    assert_eq!(ended, Ended::IdleTimeout);
    let lasted = began.elapsed();
    assert!(
        lasted >= IDLE / 2 + IDLE && lasted < IDLE * 2,
        "ended after {lasted:?}"
    );
    let to_client = frames(&rest(&mut client).await);
    assert_eq!(code(&to_client[0].1), 1001);
    let to_backend = frames(&rest(&mut backend).await);
    assert_eq!(code(&to_backend[0].1), 1001);
}

#[tokio::test(start_paused = true)]
async fn a_backend_that_does_not_read_holds_the_client_back() {
    // 4 KiB a pipe: the tunnel itself may hold one buffer per direction.
    let (mut client, mut backend, task) = start(tunnel(false, Vec::new()), 4 * 1024);
    let chunk = vec![0x5a; 1024];
    let mut sent = 0usize;
    while let Ok(r) = tokio::time::timeout(Duration::from_secs(1), client.write_all(&chunk)).await {
        r.unwrap();
        sent += chunk.len();
        assert!(sent <= 1024 * 1024, "1 MiB went in, nothing read it");
    }
    // Two pipes of 4 KiB and the tunnel's one buffer, at most.
    assert!(sent <= 4 * 1024 * 2 + BUFFER, "{sent} bytes taken");
    // Once the backend reads, everything comes through in order.
    drop(client);
    let got = rest(&mut backend).await;
    assert_eq!(got.len(), sent);
    assert!(got.iter().all(|&b| b == 0x5a));
    let (ended, _) = task.await.unwrap();
    assert_eq!(ended, Ended::ClientClosed);
}

/// A byte meter on the memory store whose clock never moves: `burst` payload bytes (at
/// 100 a second: batches of 10), then none.
fn byte_meter(burst: u64) -> Meter {
    let limiter = still_limiter();
    let bytes = crate::rules::Bytes {
        rate: Rate::parse("100/s").expect("a rate"),
        burst,
    };
    Meter::bytes(
        limiter,
        IdentityDigest([7; 16]),
        "chat",
        &bytes,
        OnError::Deny,
    )
}

#[tokio::test(start_paused = true)]
async fn data_frames_after_the_client_s_close_are_dropped_and_its_handshake_completes() {
    let (mut client, mut backend, task) = start(tunnel(true, vec![meter(1)]), 64 * 1024);
    let close = client_frame(0x8, &[0x03, 0xe8]);
    let mut sent = client_frame(0x1, b"hi");
    sent.extend(&close);
    // RFC 6455 §5.5.1: no data frame may follow a close. These are dropped, and take no
    // token (the meter holds one frame, spent on "hi").
    sent.extend(client_frame(0x1, b"after"));
    sent.extend(client_frame(0x0, b"stray continuation"));
    sent.extend(client_frame(0x9, b"ping"));
    sent.extend(client_frame(0x2, &[1; 100]));
    client.write_all(&sent).await.unwrap();
    let mut got = vec![0u8; 8 + close.len() + 10];
    backend.read_exact(&mut got).await.unwrap();
    assert_eq!(
        frames(&got),
        vec![
            (0x1, b"hi".to_vec()),
            (0x8, vec![0x03, 0xe8]),
            (0x9, b"ping".to_vec())
        ],
        "the close and the ping after it pass, the data does not"
    );
    backend
        .write_all(&server_frame(0x8, &[0x03, 0xe8]))
        .await
        .unwrap();
    drop(backend);
    let to_client = frames(&rest(&mut client).await);
    assert_eq!(to_client, vec![(0x8, vec![0x03, 0xe8])]);
    let (ended, m) = task.await.unwrap();
    assert_eq!(ended, Ended::UpstreamClosed);
    let up = upstream_bytes(&m);
    assert_eq!(up, got.len() as u64, "what was dropped is not counted");
}

#[tokio::test(start_paused = true)]
async fn a_message_over_max_message_is_closed_1009_before_its_frame_goes_on() {
    let t = Tunnel {
        max_message: Some(10),
        ..tunnel(true, Vec::new())
    };
    let (mut client, mut backend, task) = start(t, 64 * 1024);
    client
        .write_all(&client_frame(0x2, &[1; 10]))
        .await
        .unwrap();
    let mut first = [0u8; 16];
    backend.read_exact(&mut first).await.unwrap();
    // An 11-byte frame, its header in two reads: nothing of it goes on while its length
    // is unknown, nor once it is.
    let over = client_frame(0x2, &[2; 11]);
    client.write_all(&over[..1]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    client.write_all(&over[1..]).await.unwrap();
    let (ended, _) = task.await.unwrap();
    assert_eq!(ended, Ended::MessageTooBig);
    let to_backend = frames(&rest(&mut backend).await);
    assert_eq!(to_backend.len(), 1, "only the close: {to_backend:?}");
    assert_eq!((to_backend[0].0, code(&to_backend[0].1)), (0x8, 1009));
    let to_client = frames(&rest(&mut client).await);
    assert_eq!(to_client.len(), 1);
    assert_eq!(code(&to_client[0].1), 1009);
    assert_eq!(&to_client[0].1[2..], b"message too big");
}

#[tokio::test(start_paused = true)]
async fn a_client_past_its_byte_limit_is_held_back_then_closed_with_1008() {
    let (mut client, mut backend, task) = start(tunnel(true, vec![byte_meter(100)]), 64 * 1024);
    // 40 bytes a frame: two fit the burst of 100, the third waits for tokens that never
    // come (the store's clock stands still).
    for n in 0..3u8 {
        client
            .write_all(&client_frame(0x2, &[n; 40]))
            .await
            .unwrap();
    }
    // Control frames need no byte token, but wait behind the held frame.
    client.write_all(&client_frame(0x9, b"ping")).await.unwrap();
    let to_backend = held_then_closed(task, Ended::ByteLimit, &mut backend).await;
    let data: Vec<_> = to_backend.iter().filter(|(op, _)| *op == 0x2).collect();
    assert_eq!(data.len(), 2, "{to_backend:?}");
    let (op, payload) = to_backend.last().unwrap();
    assert_eq!((*op, code(payload)), (0x8, 1008));
    assert_eq!(&payload[2..], b"byte rate limit exceeded");
    let to_client = frames(&rest(&mut client).await);
    assert_eq!(to_client.len(), 1);
    assert_eq!(code(&to_client[0].1), 1008);
}
