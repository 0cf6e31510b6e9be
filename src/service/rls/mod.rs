//! Envoy's rate limit service: being written on its own branch.

use http::{Request, StatusCode};
use hyper::body::Incoming;

use super::{Ctx, Reply};
use crate::headers::Problem;

/// The gRPC method's path.
pub const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

pub async fn call(_ctx: &Ctx, _req: Request<Incoming>) -> Reply {
    super::problem(&Problem::new(StatusCode::NOT_IMPLEMENTED, "not yet"))
}
