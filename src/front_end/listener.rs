//! The accept loop, written once: a [`Listener`] is a listening socket, the registry of
//! its connections, and the [`Handler`] that serves each one. Every listener runs it: the
//! proxy's cleartext and TLS ones in each worker, and each front-end's (the admin one;
//! mini-redis' `Listener { run }` is the model).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::OwnedSemaphorePermit;

use crate::connection::Registry;

/// What a listener does with each connection it accepted and found room for.
pub trait Handler {
    /// The task that serves `conn` to its end; or `None` where this listener serves no
    /// connection now (the connection is closed at once).
    fn serve(&self, conn: Accepted<'_>) -> Option<impl Future<Output = ()> + Send + 'static>;
}

/// A connection accepted and found room for, as a [`Handler`] is given it.
pub struct Accepted<'a> {
    pub stream: TcpStream,
    pub peer: SocketAddr,
    /// The listener's registry, which the connection's task registers in.
    pub registry: &'a Arc<Registry>,
    /// Its room under `max_connections`, held until it ends.
    pub permit: OwnedSemaphorePermit,
}

/// One listening socket and what serves its connections.
pub struct Listener<H> {
    socket: TcpListener,
    /// Its open connections, and the bound on their number (a worker's cleartext and TLS
    /// listeners share one).
    registry: Arc<Registry>,
    handler: H,
    /// How long its connections get to finish what they have in flight once it stops.
    grace: Duration,
}

impl<H: Handler> Listener<H> {
    pub fn new(socket: TcpListener, registry: Arc<Registry>, handler: H, grace: Duration) -> Self {
        Listener {
            socket,
            registry,
            handler,
            grace,
        }
    }

    /// Accept connections until `shutdown` resolves, each served on a task of its own;
    /// then stop accepting, ask every connection to close once what it has in flight is
    /// answered, and give them up to `grace`.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        loop {
            let conn = tokio::select! {
                accepted = self.accept() => accepted,
                () = &mut shutdown => break,
            };
            if let Some(task) = self.handler.serve(conn) {
                tokio::spawn(task);
            }
        }
        let Listener {
            socket,
            registry,
            grace,
            ..
        } = self;
        drop(socket);
        registry.shut_down();
        if tokio::time::timeout(grace, registry.drained())
            .await
            .is_err()
        {
            tracing::warn!("shutdown grace ran out; closing the remaining connections");
            // Upgraded connections (WebSocket) are closed with a word to both ends.
            registry.close_tunnels().await;
        }
    }

    /// The next connection, and a place for it in the registry.
    ///
    /// A connection is accepted before it is admitted: at `max_connections` it waits here
    /// while idle connections are closed to make room, and the ones behind it wait in the
    /// listen backlog. A failed accept (out of file descriptors and the like) makes room
    /// and backs off; it never stops the loop.
    async fn accept(&self) -> Accepted<'_> {
        loop {
            match self.socket.accept().await {
                Ok((stream, peer)) => {
                    let permit = self.registry.admit().await;
                    return Accepted {
                        stream,
                        peer,
                        registry: &self.registry,
                        permit,
                    };
                }
                Err(e) => self.registry.accept_failed(&e).await,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::connection::ListenerMetrics;
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Answers every request 204, counting the connections it was given.
    struct NoContent(Arc<AtomicUsize>);

    impl Handler for NoContent {
        fn serve(&self, conn: Accepted<'_>) -> Option<impl Future<Output = ()> + Send + 'static> {
            self.0.fetch_add(1, Relaxed);
            let (stream, registry, permit) = (conn.stream, conn.registry.clone(), conn.permit);
            let settings = crate::connection::Settings {
                timeouts: crate::connection::Timeouts::default(),
                max_header_bytes: 32 * 1024,
                max_header_fields: 100,
            };
            Some(async move {
                crate::connection::serve(stream, &registry, permit, settings, |track| {
                    hyper::service::service_fn(move |_req| {
                        let request = crate::connection::InFlight::new(&track);
                        async move {
                            let mut resp =
                                http::Response::new(http_body_util::Empty::<bytes::Bytes>::new());
                            *resp.status_mut() = http::StatusCode::NO_CONTENT;
                            Ok::<_, Infallible>(
                                resp.map(|b| crate::connection::Tracked::new(b, request, false)),
                            )
                        }
                    })
                })
                .await
            })
        }
    }

    /// A listener serves what it accepts until its shutdown; then it stops accepting,
    /// closes its idle kept-alive connection at once (well within the grace) and returns.
    #[tokio::test]
    async fn a_listener_serves_until_its_shutdown_then_drains() {
        let socket = TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let addr = socket.local_addr().expect("an address");
        let registry = Registry::new("test", 4, ListenerMetrics::default());
        let seen = Arc::new(AtomicUsize::new(0));
        let listener = Listener::new(
            socket,
            registry.clone(),
            NoContent(seen.clone()),
            Duration::from_secs(30),
        );
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let run = tokio::spawn(listener.run(async move {
            let _ = stopped.await;
        }));

        let mut client = TcpStream::connect(addr).await.expect("connected");
        client
            .write_all(b"GET / HTTP/1.1\r\nhost: t\r\n\r\n")
            .await
            .expect("written");
        let mut answer = [0u8; 12];
        client.read_exact(&mut answer).await.expect("an answer");
        assert_eq!(&answer, b"HTTP/1.1 204");
        assert_eq!((seen.load(Relaxed), registry.len()), (1, 1));

        let _ = stop.send(());
        tokio::time::timeout(Duration::from_secs(5), run)
            .await
            .expect("drained long before the grace")
            .expect("the loop ended");
        assert!(registry.is_empty());
        let mut rest = Vec::new();
        let _ = client.read_to_end(&mut rest).await;
        assert!(
            TcpStream::connect(addr).await.is_err(),
            "no longer listening"
        );
    }

    /// A front-end's handler, boxed as the server holds it, serves as the handler itself.
    #[tokio::test]
    async fn a_boxed_handler_serves_its_connections() {
        let socket = TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let addr = socket.local_addr().expect("an address");
        let registry = Registry::new("test", 4, ListenerMetrics::default());
        let seen = Arc::new(AtomicUsize::new(0));
        let handler: Box<dyn crate::front_end::Serves> = Box::new(NoContent(seen.clone()));
        let listener = Listener::new(socket, registry, handler, Duration::from_secs(30));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let run = tokio::spawn(listener.run(async move {
            let _ = stopped.await;
        }));
        let mut client = TcpStream::connect(addr).await.expect("connected");
        client
            .write_all(b"GET / HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
            .await
            .expect("written");
        let mut answer = [0u8; 12];
        client.read_exact(&mut answer).await.expect("an answer");
        assert_eq!((&answer, seen.load(Relaxed)), (b"HTTP/1.1 204", 1));
        let _ = stop.send(());
        tokio::time::timeout(Duration::from_secs(5), run)
            .await
            .expect("drained")
            .expect("the loop ended");
    }
}
