//! The answers the gateway writes itself, rather than the upstream's: [`problem`], the
//! one function every such answer goes through, and [`close_after`].

use bytes::Bytes;
use http::Response;
use http_body_util::{Either, Full};

use super::grpc::{self, Dialect};
use super::Body;
use crate::config::Config;
use crate::headers::{self, Applied, Problem};

/// Ask hyper to close the client connection once `resp` is sent (HTTP/1).
pub(super) fn close_after<B>(resp: &mut Response<B>) {
    resp.headers_mut().insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("close"),
    );
}

/// A response the gateway writes itself: every one goes through here. To HTTP, `p`'s
/// status and problem+json body; to a gRPC call, a Trailers-Only gRPC answer (HTTP 200,
/// empty body, `grpc-status` by [`grpc::Code::of_status`], [`grpc::trailers_only`]).
/// Either way with the `RateLimit-*` fields of `applied` and `Retry-After` where `p` has
/// one.
pub fn problem(
    p: Problem,
    cfg: &Config,
    applied: &[Applied<'_>],
    dialect: Dialect,
) -> Response<Body> {
    let mut resp = match dialect {
        Dialect::Http => {
            let mut resp = Response::new(Either::Right(Full::new(p.body.clone())));
            *resp.status_mut() = p.status;
            p.headers(resp.headers_mut());
            resp
        }
        Dialect::Grpc => {
            let mut resp = Response::new(Either::Right(Full::new(Bytes::new())));
            grpc::trailers_only(&p, applied, resp.headers_mut());
            resp
        }
    };
    headers::add_ratelimit(resp.headers_mut(), cfg.response, applied);
    resp
}
