//! After a backend's `101`: the tunnel of an upgraded connection, set up from what the
//! request's rules said (`crate::tunnel` runs it).

use std::time::Duration;

use http::Response;

use super::context::Context;
use super::{Gateway, RequestCtx};
use crate::upstream;

impl Gateway {
    /// The backend switched protocols: the client's side is answered (`101`, or `200` to
    /// an extended CONNECT) and a task copies between the two once the client's side is
    /// there, holding the request's slots and its connection until the socket closes.
    pub(super) fn tunnel(
        &self,
        ctx: &mut RequestCtx<'_>,
        conn: &Context,
        resp: &mut Response<upstream::ResponseBody>,
        asked: upstream::Upgrade,
        on: hyper::upgrade::OnUpgrade,
    ) {
        let Some(io) = resp
            .extensions_mut()
            .remove::<upstream::Switched>()
            .and_then(|s| s.take())
        else {
            return;
        };
        let live = ctx.live;
        let cfg = &*live.config;
        ctx.upgrade = Some(if asked.websocket {
            "websocket"
        } else {
            "other"
        });
        let websocket = asked.websocket
            && (asked.extended
                || resp
                    .headers()
                    .get(http::header::UPGRADE)
                    .is_some_and(|u| u.as_bytes().eq_ignore_ascii_case(b"websocket")));
        // Each rule's message meter and byte meter, in that order.
        let limited = || {
            ctx.decided
                .messages
                .iter()
                .filter(|_| websocket)
                .filter_map(|&(index, digest, _)| Some((cfg.rules.get(index)?, digest)))
        };
        let meters = crate::tunnel::meters(&live.limiter, limited(), cfg.store.on_error);
        let max_message = limited()
            .filter_map(|(rule, _)| rule.messages?.max_bytes)
            .min();
        let max_delay = ctx
            .decided
            .messages
            .iter()
            .map(|&(_, _, us)| us)
            .min()
            .unwrap_or(0);
        let tunnel = crate::tunnel::Tunnel {
            websocket,
            meters,
            max_delay: Duration::from_micros(max_delay),
            max_message,
            idle: cfg.server.upgrade_idle_timeout,
            hold: conn
                .connection
                .as_ref()
                .map_or_else(crate::connection::Hold::detached, |t| t.hold()),
            leases: ctx.decided.leases.take(),
            labels: crate::tunnel::metrics::TunnelLabels {
                route: ctx.route().unwrap_or("").to_string(),
                pool: ctx.pool().unwrap_or("").to_string(),
            },
        };
        let metrics = self.metrics.clone();
        tokio::spawn(async move {
            match on.await {
                Ok(client) => {
                    let client = hyper_util::rt::TokioIo::new(client);
                    let ended = tunnel.run(client, io, &metrics.tunnel).await;
                    tracing::debug!(reason = ended.name(), "upgraded connection closed");
                }
                Err(e) => tracing::debug!(error = %e, "the client's side of an upgrade failed"),
            }
        });
    }
}
