//! A request and its pool's overload protection (`crate::overload`): the permit it holds while the backend has it — or the 503 it gets when shed.
//!
//! Asked after the rate limits admitted the request (and after any `max_delay` wait), so
//! a request the limits deny never takes a place in the queue. A shed request was not
//! answered by the backend: its settling charges are refunded as a 502's are
//! ([`RequestCtx::unanswered`]); a charge that stands as taken (no settlement policy) stays
//! spent, as it does for a 502.

use http::{Response, StatusCode};

use super::{problem, Body, Gateway, RequestCtx};
use crate::headers::{self, Problem};
use crate::telemetry::disposition::Disposition;
use crate::upstream::{Permit, Pool, SHED_RETRY_AFTER};

impl Gateway {
    /// The pool's permit for the request, where the pool has overload protection (none
    /// needed where it has not); or the 503 of a shed request, its charges refunded.
    pub(super) async fn permit(
        &self,
        ctx: &mut RequestCtx<'_>,
        pool: &Pool,
    ) -> Result<Option<Permit>, Response<Body>> {
        match pool.admit(ctx.decided.priority).await {
            Ok(permit) => Ok(permit),
            Err(shed) => {
                tracing::debug!(
                    pool = ctx.pool(),
                    priority = ctx.decided.priority,
                    reason = shed.detail(),
                    "overloaded: request shed"
                );
                ctx.unanswered().await;
                let cfg = ctx.config();
                let p = Problem::new(StatusCode::SERVICE_UNAVAILABLE, shed.detail())
                    .with_retry_after(SHED_RETRY_AFTER);
                let mut resp = problem(p, cfg, &ctx.decided.applied, ctx.dialect);
                headers::add_shadow(resp.headers_mut(), cfg.response, &ctx.decided.shadow);
                ctx.decided.disposed(Disposition::Shed);
                Err(resp)
            }
        }
    }
}
