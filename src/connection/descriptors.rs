//! The process's open-file limit, raised to fit `max_connections`.

/// Descriptors kept for everything but client and upstream connections: listeners, Redis,
/// the event loops, log files.
pub const RESERVED_DESCRIPTORS: u64 = 64;

/// Raise the process's open-file limit to what it is allowed (the soft limit to the hard
/// one, as nginx's `worker_rlimit_nofile` and Go's runtime do), and warn when a
/// `max_connections` the operator set could still need more: each client connection can
/// hold one to its upstream too. (One left unset was derived to fit the hard limit, so
/// warns only where the raise fell short of it.)
pub fn raise_descriptor_limit(max_connections: usize, set: bool) {
    let limit = match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(n) => n,
        Err(e) => {
            tracing::debug!(error = %e, "cannot read or raise the open-file limit");
            return;
        }
    };
    let needed = (max_connections as u64)
        .saturating_mul(2)
        .saturating_add(RESERVED_DESCRIPTORS);
    if needed <= limit {
        tracing::debug!(
            max_connections,
            set,
            open_files_limit = limit,
            "max_connections fits the open-file limit"
        );
    } else if set {
        tracing::warn!(
            max_connections,
            open_files_limit = limit,
            "max_connections may need {needed} file descriptors (a client and an upstream connection each) but the process may open {limit}: raise the hard limit (ulimit -Hn, LimitNOFILE=) or lower max_connections; past it, accepts fail and idle connections are closed to make room"
        );
    } else {
        // Derived from the hard limit, which the raise did not reach (macOS caps it).
        tracing::warn!(
            max_connections,
            open_files_limit = limit,
            "max_connections was derived from the hard open-file limit, but the process could raise its own only to {limit}: set max_connections to at most {} or raise the limit",
            limit.saturating_sub(RESERVED_DESCRIPTORS) / 2
        );
    }
}
