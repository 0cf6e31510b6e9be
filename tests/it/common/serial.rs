//! One timed test at a time.
//!
//! The integration tests are one binary (`tests/it/`), whose tests `cargo test` runs in
//! parallel threads. A test that asserts a bound in wall-clock time (an answer within the
//! store timeout plus a margin, a refusal that does not wait) holds this lock, and so does
//! a test that loads the machine enough to stretch another's latencies; tests that assert
//! only counts and states run beside them freely. The lock is the binary's: one for the
//! tests of every module.

use tokio::sync::{Mutex, MutexGuard};

static SERIAL: Mutex<()> = Mutex::const_new(());

/// Hold this for the whole test: `let _serial = serial().await;`. The test's watchdog
/// clock stops while it waits, and starts again once it holds the lock.
pub async fn serial() -> MutexGuard<'static, ()> {
    let _waiting = super::watchdog::waiting();
    SERIAL.lock().await
}
