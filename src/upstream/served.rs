//! Tests only: requests as hyper's server hands them to the gateway, their bodies still
//! arriving, so that what reads and forwards a body is tested against hyper's own framing
//! (`Content-Length`, chunked) rather than a stand-in body type.

use std::convert::Infallible;
use std::future::Pending;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Empty;
use hyper::body::Incoming;
use hyper::service::Service;
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt;
use tokio::sync::oneshot;

/// The connection's service: hands the request over and never answers, so that the
/// connection (which feeds the body) stays up while the test reads it.
#[derive(Clone)]
struct HandOver(Arc<Mutex<Option<oneshot::Sender<Request<Incoming>>>>>);

impl HandOver {
    fn new(tx: oneshot::Sender<Request<Incoming>>) -> HandOver {
        HandOver(Arc::new(Mutex::new(Some(tx))))
    }
}

impl Service<Request<Incoming>> for HandOver {
    type Response = Response<Empty<Bytes>>;
    type Error = Infallible;
    type Future = Pending<Result<Response<Empty<Bytes>>, Infallible>>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        if let Some(tx) = self.0.lock().ok().and_then(|mut t| t.take()) {
            let _ = tx.send(req);
        }
        std::future::pending()
    }
}

/// The request an HTTP/1.1 client sends as `wire` (head and body bytes, written as fast as
/// the server reads them; the client's side stays open after).
pub(crate) async fn http1(wire: Vec<u8>) -> Request<Incoming> {
    let (mut client, server) = tokio::io::duplex(64 * 1024);
    tokio::spawn(async move {
        let _ = client.write_all(&wire).await;
        std::future::pending::<()>().await;
        drop(client);
    });
    let (tx, rx) = oneshot::channel();
    let conn = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(server), HandOver::new(tx));
    tokio::spawn(conn);
    rx.await.expect("hyper hands the request over")
}
