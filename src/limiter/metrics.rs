//! The metrics the limiter and its stores own: store calls (time, errors), the deny
//! cache, the circuit breaker, and the in-process stores' keys and evictions.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

crate::telemetry::label_enum! {
    pub enum StoreErrorKind {
        /// No answer within `[store].timeout`.
        Timeout,
        /// Refused, dropped or otherwise unreachable.
        Connection,
        /// One key's data (wrong type, corrupt state).
        Data,
        /// A write fewer replicas confirmed in time than `[store] replication` asks.
        Unreplicated,
        /// Not tried: the circuit breaker is open.
        BreakerOpen,
        /// The memory store had no room for a new key (every key in the way counts requests
        /// in flight).
        Full,
        /// Anything else the store answered unexpectedly.
        Other,
    }
}

crate::telemetry::label_enum! {
    /// What keeping a shared store's key directory in step did.
    pub enum SyncOutcome {
        /// The hash read whole and made the directory.
        Resynced,
        /// A resynchronisation failed (Redis down, timeout): the last directory serves.
        Failed,
        /// `<prefix>:keys` is not a hash: the last directory serves.
        WrongType,
        /// A change received on the channel and applied.
        Change,
        /// A malformed message, or hash fields that are not an entry, left out.
        Ignored,
        /// Subscribed to the changes channel.
        Subscribed,
        /// Could not subscribe.
        SubscribeFailed,
        /// The subscription's connection was lost.
        Lost,
    }
}

crate::telemetry::label_sets! {
    pub struct SyncLabels {
        pub outcome: SyncOutcome,
    }

    pub struct StoreErrorLabels {
        pub kind: StoreErrorKind,
    }

    pub struct StoreLabels {
        pub backend: &'static str,
    }

    /// The Redis primary a `redis_sentinel` store sends its calls to, by `host:port`.
    pub struct PrimaryLabels {
        pub address: String,
    }

    /// An in-process store: `memory` (the configured backend) or `local` (the `on_error =
    /// "local"` fallback).
    pub struct MemoryLabels {
        pub store: &'static str,
    }

    pub struct EvictionLabels {
        pub store: &'static str,
        /// `expired` (equivalent to no entry) or `lru` (live, not being denied). An entry
        /// being denied is never dropped: the new key is refused instead (`store_refused_keys`).
        pub reason: &'static str,
    }
}

/// The in-process stores `store_keys`, `store_evictions` and `store_refused_keys` count by.
const MEMORY_STORES: [&str; 2] = ["memory", "local"];
const EVICTION_REASONS: [&str; 2] = ["expired", "lru"];

crate::telemetry::metrics! {
    /// Clones share the registered series.
    #[derive(Clone)]
    pub struct LimiterMetrics {
        /// Time of one store call, by backend.
        pub store_duration: Family<StoreLabels, Histogram> = ("store_call_duration_seconds", "Time of one store call (one per limited request), by backend",
            buckets = [
                0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                0.25, 0.5, 1.0,
            ],
        ),
        pub store_errors: Family<StoreErrorLabels, Counter> = ("store_errors", "Store calls that failed, by kind",
            zero = StoreErrorKind::ALL.map(|kind| StoreErrorLabels { kind }),
        ),
        pub deny_cache_hits: Counter = ("deny_cache_hits", "Requests denied from the local cache of denials, without a store call"),
        pub breaker_open: Gauge = ("store_breaker_open", "1 while the store's circuit breaker is open (on_error applied without trying the store)"),
        /// Keys the in-process stores hold, as of the last sweep.
        pub memory_keys: Family<MemoryLabels, Gauge> = ("store_keys", "Keys the in-process store holds (store=memory: the memory backend; store=local: the on_error = \"local\" fallback), as of the last sweep",
            zero = MEMORY_STORES.map(|store| MemoryLabels { store }),
        ),
        /// Entries the in-process stores dropped to make room for new keys.
        pub memory_evictions: Family<EvictionLabels, Counter> = ("store_evictions", "Entries an in-process store dropped to make room for a new key at max_keys: reason=expired (already equivalent to none), lru (the least recently used not being denied); an identity being denied is never dropped",
            zero = MEMORY_STORES.into_iter().flat_map(|store| {
                EVICTION_REASONS.map(|reason| EvictionLabels { store, reason })
            }),
        ),
        /// New keys an in-process store refused (their requests denied): every entry in the
        /// way was an identity being denied.
        pub memory_refused: Family<MemoryLabels, Counter> = ("store_refused_keys", "New keys an in-process store at max_keys refused, their requests denied (429), because every state in the way was an identity being denied (store=memory or local)",
            zero = MEMORY_STORES.map(|store| MemoryLabels { store }),
        ),
        /// Keys the runtime key directory holds, as of the last second.
        pub key_directory_keys: Gauge = ("key_directory_keys", "API keys the runtime key directory holds (added through /admin/keys: the keys file's with the memory store, the <prefix>:keys hash's with Redis), as of the last second"),
        /// What following a shared store's key directory did, by outcome.
        pub key_directory_syncs: Family<SyncLabels, Counter> = ("key_directory_syncs", "What following a shared store's key directory did, by outcome: resynced (read whole), failed, wrong_type (the last directory serves), change (a published change applied), ignored (malformed), subscribed, subscribe_failed, lost (the subscription's connection)",
            zero = SyncOutcome::ALL.map(|outcome| SyncLabels { outcome }),
        ),
        /// The gateways seen writing their heartbeat to the shared store lately
        /// (`local_share = "auto"`'s N); 1 where none is written.
        pub gateways_seen: Gauge = ("gateways_seen", "Gateways (this one included) seen writing their heartbeat to the shared store within the last 15 s, as of the last heartbeat answered: the N of local_share = \"auto\" (kept while the store fails; 1 before any heartbeat, with the memory store, or where no rule has local_share = \"auto\")"),
        /// Times a `redis_sentinel` store moved its calls to another primary.
        pub primary_changes: Counter = ("store_primary_changes", "Times a backend = \"redis_sentinel\" store moved its calls to another primary (a failover it followed); finding the first primary is not counted"),
        /// 1 for the primary a `redis_sentinel` store calls now (no series before one is found).
        pub primary: Family<PrimaryLabels, Gauge> = ("store_primary", "1 for the Redis primary a backend = \"redis_sentinel\" store sends its calls to now, by address (host:port, as the sentinels name it), no series while none is known"),
    }
}

impl LimiterMetrics {
    /// The refused keys counter of the in-process store `store`.
    pub fn refused_keys(&self, store: &'static str) -> Counter {
        self.memory_refused
            .get_or_create(&MemoryLabels { store })
            .clone()
    }

    /// The key count gauge of the in-process store `store`.
    pub fn store_keys(&self, store: &'static str) -> Gauge {
        self.memory_keys
            .get_or_create(&MemoryLabels { store })
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::{StoreErrorKind, SyncOutcome};

    #[test]
    fn the_label_values_are_the_ones_dashboards_query() {
        assert_eq!(
            StoreErrorKind::ALL.map(StoreErrorKind::name),
            [
                "timeout",
                "connection",
                "data",
                "unreplicated",
                "breaker_open",
                "full",
                "other"
            ]
        );
        assert_eq!(
            SyncOutcome::ALL.map(SyncOutcome::name),
            [
                "resynced",
                "failed",
                "wrong_type",
                "change",
                "ignored",
                "subscribed",
                "subscribe_failed",
                "lost"
            ]
        );
    }
}
