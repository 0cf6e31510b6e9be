//! The tunnels' metrics, registered here: open upgraded connections and the bytes each
//! way, by route and pool (names from the config), and how tunnels ended. A tunnel
//! resolves its handles once when it opens: nothing is hashed per byte.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use super::Ended;

crate::telemetry::label_sets! {
    pub struct TunnelLabels {
        /// The route's name (empty: no route, the pool `default`).
        pub route: String,
        pub pool: String,
    }

    pub struct BytesLabels {
        pub route: String,
        pub pool: String,
        pub direction: Direction,
    }

    pub struct EndedLabels {
        pub reason: Ended,
    }
}

crate::telemetry::label_enum! {
    /// Which way bytes went through a tunnel (`direction=`).
    pub enum Direction {
        /// From the client to the backend.
        Upstream,
        /// From the backend to the client.
        Downstream,
    }
}

crate::telemetry::metrics! {
    /// The tunnels' metrics.
    #[derive(Clone, Default)]
    pub struct TunnelMetrics {
        pub open: Family<TunnelLabels, Gauge> = ("upgraded_connections", "Upgraded connections (WebSocket and other HTTP/1.1 upgrades, HTTP/2 extended CONNECT) open now, by route and pool"),
        pub bytes: Family<BytesLabels, Counter> = ("upgraded_bytes", "Bytes copied through upgraded connections, by route, pool and direction (upstream: from the client to the backend; downstream: back)"),
        pub ended: Family<EndedLabels, Counter> = ("upgraded_closed", "Upgraded connections closed, by reason: client_closed, upstream_closed, idle_timeout (upgrade_idle_timeout), shutdown (the shutdown grace ran out), message_limit (a rule's messages limit, close code 1008), byte_limit (a rule's bytes limit, 1008), message_too_big (a message over messages.max_bytes, 1009), protocol_error (frames that break RFC 6455, 1002), store_error (the store failed under on_error = deny, 1011), failed (an I/O error)",
            zero = Ended::ALL.map(|reason| EndedLabels { reason }),
        ),
    }
}
