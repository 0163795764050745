//! The one way tests wait for something to come true: [`poll`] (and [`wait_until`], which
//! fails the test) from threads, [`eventually`] from async tests; both look every 100 ms until
//! a deadline.

use std::time::{Duration, Instant};

/// How often a condition is looked at.
const EVERY: Duration = Duration::from_millis(100);

/// Look at `cond` every 100 ms for up to `secs` seconds; whether it came true.
pub fn poll(secs: u64, mut cond: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if cond() {
            return true;
        }
        if start.elapsed() >= Duration::from_secs(secs) {
            return false;
        }
        std::thread::sleep(EVERY);
    }
}

/// [`poll`], failing the test with `what` when `cond` never came true.
pub fn wait_until(what: &str, secs: u64, cond: impl FnMut() -> bool) {
    assert!(
        poll(secs, cond),
        "timed out after {secs} s waiting for: {what}"
    );
}

/// Await `f` every 100 ms until it returns Some, or fail the test naming `what`.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(EVERY).await;
    }
}
