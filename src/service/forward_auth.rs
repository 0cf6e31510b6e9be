//! Forward-auth (`GET|POST /v1/forward-auth`): being written on its own branch.

use std::net::SocketAddr;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;

use super::Ctx;

pub async fn call(_ctx: &Ctx, _peer: SocketAddr, _req: Request<Incoming>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from_static(b"not yet")));
    *r.status_mut() = StatusCode::NOT_IMPLEMENTED;
    r
}
