//! What the gateway knows of a request's connection: one [`Context`] per request, built at
//! its connection and handed beside the request's own [`super::RequestCtx`] to the phases
//! that need it ([`super::Gateway::handle`], [`super::Gateway::admit`], the forward), in
//! place of values carried sideways in request extensions or looked up in thread-locals.

use std::sync::Arc;

use crate::connection::Track;
use crate::identity::ClientCert;
use crate::upstream::ClientPeer;

/// A request's context: who sent it, over what, and which worker serves it.
#[derive(Clone)]
pub struct Context {
    /// The client's end of the connection: its address (rendered once per connection for
    /// the forwarded headers) and, over the TLS listener, what its handshake agreed.
    pub peer: ClientPeer,
    /// The client certificate the connection's TLS handshake verified, if one was
    /// presented. It comes from the handshake only: no request field can set it.
    pub client_cert: Option<ClientCert>,
    /// The worker thread serving the connection (`0..[server] workers`): per-worker
    /// resources are picked by it, so a request's I/O stays on the thread that serves it.
    pub worker: usize,
    /// The connection the request came on, where a listener serves it: what an upgrade's
    /// tunnel holds until it ends ([`crate::connection::Track::hold`]). `None` in process.
    pub connection: Option<Arc<Track>>,
    // What is known of the connection goes here, a field each, with why it is kept. What
    // the phases find of the request travels in its `RequestCtx` instead (the route and
    // pool the decision chooses in its `Decided`, to the forward).
}

impl Context {
    /// A request on `peer`'s connection, served by worker `worker`: its client certificate
    /// is the one `peer`'s TLS handshake verified, if any.
    pub fn new(peer: ClientPeer, worker: usize) -> Context {
        let client_cert = peer
            .tls
            .as_ref()
            .and_then(|t| t.client_cert)
            .map(ClientCert);
        Context {
            peer,
            client_cert,
            worker,
            connection: None,
        }
    }

    /// This context, for requests on the connection `track`.
    pub fn on(self, track: Arc<Track>) -> Context {
        Context {
            connection: Some(track),
            ..self
        }
    }
}
