//! What a newcomer tripped on (issue 42, item 9), against the real binary: the status
//! page's "applies to" names a rule's route, and the default `connect_timeout` outlasts
//! Linux's SYN retransmits, so a backend whose listen queue is full for a moment is
//! reached instead of answered 502.

use crate::common;

use std::time::{Duration, Instant};

use common::{Gateway, HttpClient, Upstream};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// `applies_to` on the status page said "every request" for a rule limited to a route.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_says_which_route_a_rule_applies_to() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "[[upstreams]]\nname = \"default\"\nservers = [\"{u}\"]\n\
         [[upstreams]]\nname = \"billing\"\nservers = [\"{u}\"]\n\
         [[routes]]\nname = \"billing\"\nmatch = {{ path_prefix = \"/billing/\" }}\nupstream = \"billing\"\n\
         [[rules]]\nname = \"billing-per-ip\"\nkey = \"client_ip\"\nrate = \"10/s\"\n\
         match = {{ route = \"billing\" }}\n\
         [[rules]]\nname = \"all\"\nkey = \"client_ip\"\nrate = \"10/s\"\n",
        u = upstream.url()
    ));
    let client = HttpClient::new();
    let end = Instant::now() + common::WAIT;
    let stats = loop {
        let reply = client.get(&gw.admin_url("/status.json"), &[]).await;
        if reply.status.as_u16() == 200 || Instant::now() > end {
            break reply.json();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let applies: Vec<&str> = stats["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .map(|r| r["applies_to"].as_str().expect("applies_to"))
        .collect();
    assert_eq!(applies, ["every request, route billing", "every request"]);
}

/// A backend whose listen queue (backlog 0) is full, one connection waiting in it, that
/// starts accepting after 1.5 s: a connection opened meanwhile is not refused, its SYN is
/// dropped, and Linux sends it again after 1 s, then after 3 s in all. With the old 1 s
/// default the gateway gave up first (502); with the default now it is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_with_a_full_listen_queue_is_waited_for_by_default() {
    let _watch = common::watchdog();
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind("127.0.0.1:0".parse().expect("addr"))
        .expect("bind");
    let listener = socket.listen(0).expect("listen");
    let port = listener.local_addr().expect("addr").port();
    // Fill the queue: this one is accepted by the kernel and waits for `accept`.
    let filler = std::net::TcpStream::connect(("127.0.0.1", port)).expect("filler");
    let gw = Gateway::start(&format!(
        "[upstream]\nurl = \"http://127.0.0.1:{port}\"\ntimeout = \"30s\"\n"
    ));
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let mut head = Vec::new();
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = s
                    .write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok",
                    )
                    .await;
            });
        }
    });
    let started = Instant::now();
    let reply = HttpClient::new().get(&gw.url("/x"), &[]).await;
    assert_eq!(
        reply.status.as_u16(),
        200,
        "after {:?}: {}\n{}",
        started.elapsed(),
        String::from_utf8_lossy(&reply.body),
        gw.logs()
    );
    drop(filler);
}
