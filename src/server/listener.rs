//! The accept loop, written once: a [`Listener`] is a listening socket, the registry of
//! its connections, and the [`Handler`] that serves each one. Every listener runs it: the
//! gateway's cleartext and TLS ones in each worker, and the admin one (mini-redis'
//! `Listener { run }` is the model).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::OwnedSemaphorePermit;

use crate::connection::Registry;

/// What a listener does with each connection it accepted and found room for.
pub trait Handler {
    /// The task that serves `stream`, from `peer`, to its end, holding `permit`, its place
    /// in `registry`; or `None` where this listener serves no connection now (the
    /// connection is closed at once).
    fn serve(
        &self,
        stream: TcpStream,
        peer: SocketAddr,
        registry: &Arc<Registry>,
        permit: OwnedSemaphorePermit,
    ) -> Option<impl Future<Output = ()> + Send + 'static>;
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
            let (stream, peer, permit) = tokio::select! {
                accepted = self.accept() => accepted,
                () = &mut shutdown => break,
            };
            if let Some(task) = self.handler.serve(stream, peer, &self.registry, permit) {
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
        }
    }

    /// The next connection, and a place for it in the registry.
    ///
    /// A connection is accepted before it is admitted: at `max_connections` it waits here
    /// while idle connections are closed to make room, and the ones behind it wait in the
    /// listen backlog. A failed accept (out of file descriptors and the like) makes room
    /// and backs off; it never stops the loop.
    async fn accept(&self) -> (TcpStream, SocketAddr, OwnedSemaphorePermit) {
        loop {
            match self.socket.accept().await {
                Ok((stream, peer)) => return (stream, peer, self.registry.admit().await),
                Err(e) => self.registry.accept_failed(&e).await,
            }
        }
    }
}
