//! The backend of bench/run's grpc and h2 tables: HTTP/1.1 and cleartext HTTP/2 with prior
//! knowledge on one port (hyper-util's auto builder tells them apart by the preface), one
//! thread: `taskset` it.
//!
//! - A `POST` with `content-type: application/grpc…`: its body read whole, then `200`,
//!   `content-type: application/grpc`, the request's messages sent back as they came
//!   (length-prefixed, gRPC over HTTP/2's framing) or one empty message where there were
//!   none, and trailers `grpc-status: 0`: a unary echo.
//! - Anything else: `200`, `ok\n`.
//!
//!     bench-h2-backend 127.0.0.1:18680

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{HeaderMap, HeaderValue, CONTENT_TYPE};
use hyper::service::service_fn;
use hyper::{Method, Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::io::Result<()> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:18680".into());
    let listener = ratewall_bench::listen(&addr)?;
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // More streams than any client of the benchmark keeps open on one connection, so that
    // the limit is the client's (h2load's -m, the gateway's own).
    builder.http2().max_concurrent_streams(1024);
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                eprintln!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let builder = builder.clone();
        tokio::spawn(async move {
            let _ = builder
                .serve_connection(TokioIo::new(stream), service_fn(answer))
                .await;
        });
    }
}

async fn answer(req: Request<Incoming>) -> Result<Response<Reply>, Infallible> {
    let grpc = req.method() == Method::POST
        && req
            .headers()
            .get(CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    if !grpc {
        return Ok(Response::new(Reply {
            data: Some(Bytes::from_static(b"ok\n")),
            trailers: None,
        }));
    }
    let body = match req.into_body().collect().await {
        Ok(body) => body.to_bytes(),
        Err(_) => Bytes::new(),
    };
    // One empty message: the compressed flag, then a length of 0.
    let data = if body.is_empty() {
        Bytes::from_static(&[0, 0, 0, 0, 0])
    } else {
        body
    };
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    let mut response = Response::new(Reply {
        data: Some(data),
        trailers: Some(trailers),
    });
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    Ok(response)
}

/// A body of one data frame, then trailers where there are some.
struct Reply {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

impl Body for Reply {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some(data) = self.data.take() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        // Exact where no trailers follow, so that an answer carries a content-length (and
        // no chunks over HTTP/1.1); a gRPC answer has none, as gRPC servers send it.
        match self.trailers {
            None => SizeHint::with_exact(self.data.as_ref().map_or(0, |d| d.len() as u64)),
            Some(_) => SizeHint::default(),
        }
    }
}
