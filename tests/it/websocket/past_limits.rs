//! What a WebSocket client sends past the line, end to end (issue 42, item 7): the real
//! binary between a real client (Python's `websockets`, or frames written by hand) and
//! the echo backend.
//!
//! - Data frames after the client's own close frame are discarded, as RFC 6455 §5.5.1 has
//!   a receiver do (Autobahn case 7.1.4: a close, then a text message): the close and the
//!   backend's answer pass, the data never reaches the backend, and nobody gets a 1002.
//! - `messages.max_bytes`: a message larger than it (one frame, or the sum of a fragmented
//!   message's frames) closes the socket with 1009 to both ends, before the frame that
//!   makes it too large reaches the backend.
//! - `bytes = { rate, burst }`: the payload bytes an identity sends across its sockets,
//!   counted as sent on the wire (a permessage-deflate message compressed); past it the
//!   client is held back for up to `max_delay`, then closed with 1008.

use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::AsyncWriteExt;

use super::{closed_for, config, number, status, ws_url, MASK, WAIT};
use crate::common::{
    self, close_payload, frame, send_raw, serial, ws_handshake, EchoServer, Gateway, WsClient,
    BINARY, CLOSE, TEXT,
};

/// `ratewall_upgraded_bytes_total{direction="upstream"}`: what went from clients to the
/// backend through every socket so far.
async fn upstream_bytes(gw: &Gateway) -> f64 {
    common::metric(
        gw,
        "ratewall_upgraded_bytes_total",
        &[("direction", "upstream")],
    )
    .await
}

// ---------------------------------------------------------------------------------------
// (a) Data after the client's close

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_frames_after_the_client_s_close_are_discarded_not_answered_with_1002() {
    let _watch = common::watchdog();
    let echo = EchoServer::start().await;
    let gw = Gateway::start(&config(&echo.url(), ""));
    let mut r = send_raw(gw.port, &ws_handshake("/after-close", "")).await;
    let head = r.head().await;
    assert_eq!(status(&head), 101, "{head}");
    r.io.write_all(&frame(TEXT, b"before", MASK))
        .await
        .expect("send");
    let back = r.frame().await.expect("the echo");
    assert_eq!(back.payload, b"before");

    // Autobahn 7.1.4: the close, then a text message, back to back (one write); then
    // more a client must not send, each of which would break §5.4 were it not after a
    // close: a continuation with no message begun, an unfinished fragment, a new message
    // inside it.
    let mut after = frame(CLOSE, &close_payload(1000, "done"), MASK);
    after.extend(frame(TEXT, b"after the close", MASK));
    let mut stray = frame(BINARY, &[7; 300], MASK);
    stray[0] &= 0xf0;
    after.extend(stray);
    let mut fragment = frame(BINARY, b"half", MASK);
    fragment[0] &= 0x7f;
    after.extend(fragment);
    after.extend(frame(BINARY, &[9; 70_000], MASK));
    r.io.write_all(&after).await.expect("send");

    // The backend's answer to the close comes back, and nothing else.
    let answer = r.frame().await.expect("the backend's close");
    assert_eq!(
        answer.close(),
        Some((1000, "done".to_string())),
        "{answer:?}"
    );
    let (rest, ended) = r.until_end().await;
    assert!(
        ended.is_some(),
        "the socket ends after the closing handshake"
    );
    assert!(rest.is_empty(), "nothing after the close: {rest:?}");
    let seen = echo.wait_closed("/after-close").await;
    assert_eq!(
        (&seen["code"], &seen["reason"], &seen["received"]),
        (&json!(1000), &json!("done"), &json!(1)),
        "the close reached the backend, the data after it did not: {seen}"
    );
    // To the byte: "before" (2 + 4 + 6) and the close (2 + 4 + 2 + 4), nothing after.
    assert_eq!(upstream_bytes(&gw).await, f64::from(12 + 12));
    assert_eq!(closed_for(&gw, "protocol_error", 0.0).await, 0.0);
}

// ---------------------------------------------------------------------------------------
// (b) messages.max_bytes

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_over_max_bytes_is_closed_1009_before_its_bytes_reach_the_backend() {
    let _watch = common::watchdog();
    let echo = EchoServer::start().await;
    let rule = "[[rules]]\nname = \"chat\"\nkey = \"api_key\"\nrate = \"60/m\"\n\
                messages = { rate = \"50/s\", burst = 100, max_bytes = \"64KiB\" }\n";
    let gw = Gateway::start(&config(&echo.url(), rule));
    let key = [("x-api-key", "k1")];

    // One frame: 64 KiB is not over the limit; 16 MiB in one frame is, and costs one
    // message token: none of it (header included) goes on.
    let mut c = WsClient::open(&ws_url(&gw, "/one-frame"), &key).await;
    let sent = c
        .call(json!({ "send_binary": 64 << 10, "seed": 1 }), WAIT)
        .await;
    let back = c.recv(WAIT).await;
    assert_eq!(
        back,
        json!({ "binary": 64 << 10, "sha256": sent["sha256"] })
    );
    c.call(json!({ "send_binary": 16 << 20, "seed": 2 }), WAIT)
        .await;
    let end = c.wait_closed(WAIT).await;
    assert_eq!(
        (&end["closed"]["code"], &end["closed"]["reason"]),
        (&json!(1009), &json!("message too big")),
        "{end}"
    );
    let seen = echo.wait_closed("/one-frame").await;
    assert_eq!(
        (&seen["code"], &seen["reason"], &seen["received"]),
        (&json!(1009), &json!("message too big"), &json!(1)),
        "{seen}"
    );
    // The 64 KiB message (a 14-byte header: 64-bit length and mask), nothing more.
    assert_eq!(upstream_bytes(&gw).await, f64::from((64 << 10) + 14));

    // Fragmented: the sum of the fragments counts. 96 KiB in 32 KiB fragments: the third
    // fragment would make it 96 KiB, and is held back.
    let mut f = WsClient::open(&ws_url(&gw, "/fragments"), &key).await;
    f.echo("small").await;
    f.call(
        json!({ "send_fragments": 96 << 10, "fragment": 32 << 10, "seed": 3 }),
        WAIT,
    )
    .await;
    let end = f.wait_closed(WAIT).await;
    assert_eq!(end["closed"]["code"], 1009, "{end}");
    let seen = echo.wait_closed("/fragments").await;
    assert_eq!(
        (&seen["code"], &seen["received"]),
        (&json!(1009), &json!(1)),
        "{seen}"
    );
    // "small" (2 + 4 + 5) and two 32 KiB fragments (2 + 2 + 4 each), not the third.
    let fragments = 11 + 2 * ((32 << 10) + 8);
    assert_eq!(
        upstream_bytes(&gw).await,
        f64::from((64 << 10) + 14 + fragments)
    );
    assert_eq!(closed_for(&gw, "message_too_big", 2.0).await, 2.0);
    assert_eq!(closed_for(&gw, "protocol_error", 0.0).await, 0.0);
}

// ---------------------------------------------------------------------------------------
// (c) bytes = { rate, burst }

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_byte_meter_counts_bytes_as_sent_holds_a_client_back_then_closes_1008() {
    let _watch = common::watchdog();
    let _serial = serial().await;
    let echo = EchoServer::start().await;
    let rules = "[[rules]]\nname = \"chat\"\nkey = \"api_key\"\nrate = \"60/m\"\n\
                 bytes = { rate = \"100KiB/s\", burst = \"200KiB\" }\nmax_delay = \"2s\"\n";
    let gw = Gateway::start(&config(&echo.url(), rules));
    let k1 = [("x-api-key", "k1")];
    let began = Instant::now();

    // permessage-deflate: 1 MiB of zeros crosses in about a kilobyte, and that is what
    // counts. Counted inflated it could never pass: 8 s of the rate past the burst, with
    // a max_delay of 2 s.
    let mut deflated = WsClient::try_open(&ws_url(&gw, "/deflated"), &k1, &["--deflate"])
        .await
        .unwrap_or_else(|refused| panic!("did not open: {refused}"));
    let sent = deflated.call(json!({ "send_zeros": 1 << 20 }), WAIT).await;
    let back = deflated.recv(WAIT).await;
    assert_eq!(back, json!({ "binary": 1 << 20, "sha256": sent["sha256"] }));
    let wire = upstream_bytes(&gw).await;
    assert!(wire < f64::from(16 << 10), "{wire} bytes on the wire");

    // Another socket of the same key shares the bucket: 250 KiB at once, in five frames,
    // is more than the 200 KiB burst. Held back, not closed: it all passes, no sooner
    // than the rate allows (at most the burst and the rate since the first byte).
    let mut b = WsClient::open(&ws_url(&gw, "/b"), &k1).await;
    let mut sums = Vec::new();
    for seed in 0..5 {
        let sent = b
            .call(json!({ "send_binary": 50 << 10, "seed": seed }), WAIT)
            .await;
        assert_eq!(sent["sent"], true, "{sent}");
        sums.push(sent["sha256"].clone());
    }
    for sum in sums {
        let back = b.recv(WAIT).await;
        assert_eq!(back, json!({ "binary": 50 << 10, "sha256": sum }));
    }
    let took = began.elapsed();
    assert!(
        took >= Duration::from_millis(450),
        "{took:?}: 250 KiB and more passed faster than 200 KiB and 100 KiB/s allow"
    );

    // 1 MiB in one frame: 8 s of the rate, far past max_delay. Held back, then closed
    // with 1008 to both ends; none of it reached the backend.
    let before = upstream_bytes(&gw).await;
    let asked = Instant::now();
    b.call(json!({ "send_binary": 1 << 20, "seed": 9 }), WAIT)
        .await;
    let end = b.wait_closed(WAIT).await;
    assert_eq!(
        (&end["closed"]["code"], &end["closed"]["reason"]),
        (&json!(1008), &json!("byte rate limit exceeded")),
        "{end}"
    );
    let closed_after = asked.elapsed();
    assert!(
        closed_after <= Duration::from_secs(5),
        "closed only {closed_after:?} after the frame came"
    );
    let seen = echo.wait_closed("/b").await;
    assert_eq!(
        (&seen["code"], &seen["reason"], &seen["received"]),
        (&json!(1008), &json!("byte rate limit exceeded"), &json!(5)),
        "{seen}"
    );
    assert_eq!(
        upstream_bytes(&gw).await,
        before,
        "none of the 1 MiB went up"
    );
    assert_eq!(closed_for(&gw, "byte_limit", 1.0).await, 1.0);

    // Another key has a bucket of its own.
    let mut other = WsClient::open(&ws_url(&gw, "/other"), &[("x-api-key", "k2")]).await;
    let sent = other
        .call(json!({ "send_binary": 150 << 10, "seed": 4 }), WAIT)
        .await;
    let back = other.recv(WAIT).await;
    assert_eq!(
        back,
        json!({ "binary": 150 << 10, "sha256": sent["sha256"] })
    );
    assert_eq!(other.close(1000, "bye").await["code"], 1000);
    assert_eq!(number(&echo.wait_closed("/other").await["received"]), 1);
}
