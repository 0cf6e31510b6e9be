//! Whether the upstream answers, as the log tells it: one line when it starts failing and
//! one when it answers again, with how many requests failed in between and for how long,
//! never one per failed request (a dead backend under load would bury every other line).
//! The store's outage is logged the same way (`limiter::breaker`).
//!
//! Shared by every worker: one atomic add per failed request, and on an answer one load
//! that finds nothing to do while the upstream is healthy.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use super::Error;

/// The upstream's state, as far as the log is concerned.
pub struct OutageLog {
    /// Requests that failed since the upstream last answered.
    failures: AtomicU64,
    /// When the first of them failed: ms since `epoch`.
    since_ms: AtomicU64,
    epoch: Instant,
}

/// A change of the upstream's state, for the caller to log.
#[derive(Debug, PartialEq, Eq)]
pub enum OutageChange {
    /// The first failure after answers (or since start).
    Failing,
    /// An answer after `failures` failed requests, the first of them `down_for` ago.
    Recovered { failures: u64, down_for: Duration },
}

impl Default for OutageLog {
    fn default() -> Self {
        OutageLog {
            failures: AtomicU64::new(0),
            since_ms: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }
}

impl OutageLog {
    /// A request failed. `Some` when this starts an outage. The client's own failures (a
    /// body malformed or stalled), a target that cannot go upstream, and an answer in a
    /// coding the client cannot take say nothing of whether the upstream answers.
    pub fn failed(&self, e: &Error) -> Option<OutageChange> {
        if e.is_client_error() || matches!(e, Error::Target(_) | Error::Coding(_)) {
            return None;
        }
        let n = self.failures.fetch_add(1, Relaxed);
        if n == 0 {
            self.since_ms
                .store(self.epoch.elapsed().as_millis() as u64, Relaxed);
            return Some(OutageChange::Failing);
        }
        None
    }

    /// The upstream answered (with any status). `Some` when this ends an outage.
    pub fn answered(&self) -> Option<OutageChange> {
        if self.failures.load(Relaxed) == 0 {
            return None;
        }
        let failures = self.failures.swap(0, Relaxed);
        if failures == 0 {
            // Another request's answer ended the outage first.
            return None;
        }
        let now = self.epoch.elapsed().as_millis() as u64;
        let since = self.since_ms.load(Relaxed);
        Some(OutageChange::Recovered {
            failures,
            down_for: Duration::from_millis(now.saturating_sub(since)),
        })
    }

    /// Requests failed since the upstream last answered.
    pub fn failures(&self) -> u64 {
        self.failures.load(Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused() -> Error {
        Error::Connect {
            addr: "127.0.0.1:9".parse().expect("address"),
            source: std::io::ErrorKind::ConnectionRefused.into(),
        }
    }

    #[test]
    fn an_outage_is_one_change_in_and_one_out_with_its_count() {
        let h = OutageLog::default();
        assert_eq!(h.answered(), None, "healthy: nothing to say");
        assert_eq!(h.failed(&refused()), Some(OutageChange::Failing));
        for _ in 0..99 {
            assert_eq!(h.failed(&Error::Timeout(Duration::from_secs(1))), None);
        }
        assert_eq!(h.failures(), 100);
        match h.answered() {
            Some(OutageChange::Recovered { failures, .. }) => assert_eq!(failures, 100),
            other => panic!("{other:?}"),
        }
        assert_eq!(h.answered(), None, "said once");
        assert_eq!(
            h.failed(&refused()),
            Some(OutageChange::Failing),
            "a new outage"
        );
    }

    #[test]
    fn the_clients_own_failures_say_nothing_of_the_upstream() {
        let h = OutageLog::default();
        let stalled = Error::ClientStalled(Duration::from_secs(1));
        assert_eq!(h.failed(&stalled), None);
        assert_eq!(h.failures(), 0);
    }
}
