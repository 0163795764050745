//! Stopping on SIGINT/SIGTERM as a signal every loop waits on, synchronous or async, so a
//! stop takes effect at once instead of at the next poll of a flag.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Set once; wakes every waiter.
#[derive(Debug, Default)]
pub struct Shutdown {
    stopped: Mutex<bool>,
    cv: Condvar,
    notify: tokio::sync::Notify,
}

impl Shutdown {
    /// A signal not yet triggered.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Stop: every waiter returns.
    pub fn trigger(&self) {
        // A poisoned lock still holds the flag; stopping must not depend on it being clean.
        *self.stopped.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.cv.notify_all();
        self.notify.notify_waiters();
    }

    /// Whether a stop was requested.
    pub fn is_set(&self) -> bool {
        *self.stopped.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sleep up to `d`, or less if a stop is requested meanwhile; true when stopping.
    pub fn wait_timeout(&self, d: Duration) -> bool {
        let guard = self.stopped.lock().unwrap_or_else(|p| p.into_inner());
        let (guard, _) = self
            .cv
            .wait_timeout_while(guard, d, |stopped| !*stopped)
            .unwrap_or_else(|p| p.into_inner());
        *guard
    }

    /// Resolves once a stop is requested.
    pub async fn wait(&self) {
        let notified = self.notify.notified();
        tokio::pin!(notified);
        // Registered before the check, so a trigger in between is not missed.
        notified.as_mut().enable();
        if self.is_set() {
            return;
        }
        notified.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trigger_wakes_a_sleeper_at_once() {
        let s = Shutdown::new();
        let t = s.clone();
        let waiter = std::thread::spawn(move || {
            let started = std::time::Instant::now();
            let stopped = t.wait_timeout(Duration::from_secs(30));
            (stopped, started.elapsed())
        });
        std::thread::sleep(Duration::from_millis(50));
        s.trigger();
        let (stopped, took) = waiter.join().unwrap();
        assert!(stopped && took < Duration::from_secs(5), "{took:?}");
        assert!(!Shutdown::new().wait_timeout(Duration::from_millis(1)));
    }

    #[test]
    fn async_waiters_see_a_trigger_before_and_after_they_wait() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let s = Shutdown::new();
        let t = s.clone();
        rt.block_on(async move {
            let w = tokio::spawn(async move { t.wait().await });
            tokio::time::sleep(Duration::from_millis(20)).await;
            s.trigger();
            w.await.unwrap();
            s.wait().await; // already set: returns at once
        });
    }
}
