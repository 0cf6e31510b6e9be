//! Tests only: requests as hyper's server hands them to the gateway, their bodies still
//! arriving, so that what reads and forwards a body is tested against hyper's own framing
//! (`Content-Length`, chunked, HTTP/2 DATA frames) rather than a stand-in body type.

use std::convert::Infallible;
use std::future::Pending;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{Empty, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::Service;
use hyper_util::rt::{TokioExecutor, TokioIo};
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

/// The request an HTTP/2 client sends: `req`'s head, its body the `chunks` in DATA frames
/// (a `content-length` among `req`'s fields is sent as given).
pub(crate) async fn http2(req: Request<()>, chunks: Vec<Bytes>) -> Request<Incoming> {
    let (client, server) = tokio::io::duplex(64 * 1024);
    let (tx, rx) = oneshot::channel();
    let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .serve_connection(TokioIo::new(server), HandOver::new(tx));
    tokio::spawn(conn);
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(client))
            .await
            .expect("an HTTP/2 handshake over a pipe");
    tokio::spawn(conn);
    let frames = chunks
        .into_iter()
        .map(|c| Ok::<_, Infallible>(Frame::data(c)));
    let body = StreamBody::new(futures_util::stream::iter(frames));
    let (parts, ()) = req.into_parts();
    tokio::spawn(async move {
        // The answer never comes (see `HandOver`); the request's frames go all the same.
        let _ = send.send_request(Request::from_parts(parts, body)).await;
    });
    rx.await.expect("hyper hands the request over")
}
