//! One timed test at a time.
//!
//! The integration tests are one binary (`tests/it/`), whose tests `cargo test` runs in
//! parallel threads. A test whose figures are timed (latencies compared, as the overload
//! tests' p99s; a pause or a failover timed against the load) holds this lock, and so
//! does a test that loads the machine enough to stretch another's; tests that assert only
//! counts and states run beside them freely. The lock is the binary's: one for the tests
//! of every module. (It makes such tests quieter, not safe: other processes load the
//! machine too. An upper bound in time is a count, the manual clock of `request_path.rs`,
//! or [`super::WAIT`] against an alternative several times longer.)

use tokio::sync::{Mutex, MutexGuard};

static SERIAL: Mutex<()> = Mutex::const_new(());

/// Hold this for the whole test: `let _serial = serial().await;`. The test's watchdog
/// clock stops while it waits, and starts again once it holds the lock.
pub async fn serial() -> MutexGuard<'static, ()> {
    let _waiting = super::watchdog::waiting();
    SERIAL.lock().await
}
