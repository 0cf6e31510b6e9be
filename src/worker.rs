//! Which worker thread the current code runs on ([`crate::server`] starts them). Per-worker
//! resources — an upstream pool, a Redis connection — are picked by it, so a request's
//! I/O is driven by the thread that serves it and never wakes another thread. A request
//! carries its worker in its context ([`crate::proxy::Context::worker`]); this is for
//! what is reached without one.

use std::cell::Cell;

thread_local! {
    static WORKER: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Mark this thread as worker `n`.
pub fn set(n: usize) {
    WORKER.with(|w| w.set(Some(n)));
}

/// This thread's worker number; `None` on the control thread (admin, signals, upkeep).
pub fn current() -> Option<usize> {
    WORKER.with(Cell::get)
}
