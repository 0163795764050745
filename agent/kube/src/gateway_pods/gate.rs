//! How many gateways of a node load their bpf datapath at once: as many as the node has CPUs.
//! A load is CPU-bound (creating the maps, the verifier) and briefly holds tens of MiB of
//! the kernel's parsed BTF; all at once, 50 gateways after a node's reboot each waited for all
//! 50 loads (the first enforced after 16 s) and the agent peaked at 613 MiB (`cargo xtask
//! bench-peers`). In turns, the first gateways enforce after one load and the last no later
//! than before.
//!
//! A turn lasts from opening the enforcer to its programs verified (`Enforce::warm_up`), not
//! to its first apply: that waits for the policy source's first listing, which waits on the
//! API server, not on this node's CPUs. A turn that never ends must not stall the others: a
//! gateway waits at most [`LONGEST_WAIT`], then loads anyway.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The longest a gateway waits for its turn.
pub const LONGEST_WAIT: Duration = Duration::from_secs(20);

/// How often a wait that may be given up looks whether it is ([`Gate::wait_unless`]).
pub const STOP_POLL: Duration = Duration::from_millis(50);

/// The turns of a node's gateways.
#[derive(Debug)]
pub struct Gate {
    busy: Mutex<usize>,
    freed: Condvar,
    turns: usize,
}

/// A gateway's turn, given back when dropped.
#[derive(Debug)]
pub struct Turn {
    gate: Option<Arc<Gate>>,
}

impl Gate {
    /// `turns` loads at a time (at least one).
    pub fn new(turns: usize) -> Arc<Self> {
        Arc::new(Self {
            busy: Mutex::new(0),
            freed: Condvar::new(),
            turns: turns.max(1),
        })
    }

    /// One turn per CPU the agent may run on.
    pub fn per_cpu() -> Arc<Self> {
        Self::new(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }

    /// A turn if one is free now.
    pub fn try_take(self: &Arc<Self>) -> Option<Turn> {
        let mut busy = self.busy.lock().ok()?;
        if *busy >= self.turns {
            return None;
        }
        *busy += 1;
        Some(Turn {
            gate: Some(self.clone()),
        })
    }

    /// Wait for a turn, at most `longest`; past it, a turn that counts for nobody.
    pub fn wait(self: &Arc<Self>, longest: Duration) -> Turn {
        self.wait_unless(longest, &AtomicBool::new(false))
    }

    /// [`wait`](Self::wait), given up (a turn that counts for nobody) once `stop` is set:
    /// looked at every [`STOP_POLL`].
    pub fn wait_unless(self: &Arc<Self>, longest: Duration, stop: &AtomicBool) -> Turn {
        let deadline = Instant::now() + longest;
        let Ok(mut busy) = self.busy.lock() else {
            return Turn { gate: None };
        };
        while *busy >= self.turns {
            if stop.load(Ordering::SeqCst) {
                return Turn { gate: None };
            }
            let left = deadline
                .saturating_duration_since(Instant::now())
                .min(STOP_POLL);
            if left.is_zero() {
                tracing::warn!(
                    waited_secs = longest.as_secs(),
                    "loading a gateway's datapath without waiting longer for the others"
                );
                return Turn { gate: None };
            }
            busy = match self.freed.wait_timeout(busy, left) {
                Ok((b, _)) => b,
                Err(_) => return Turn { gate: None },
            };
        }
        *busy += 1;
        Turn {
            gate: Some(self.clone()),
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        if let Some(g) = self.gate.take() {
            if let Ok(mut busy) = g.busy.lock() {
                *busy = busy.saturating_sub(1);
            }
            g.freed.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turns_are_bounded_given_back_and_never_wait_forever() {
        let gate = Gate::new(2);
        let a = gate.wait(Duration::from_secs(1));
        let b = gate.wait(Duration::from_secs(1));
        assert_eq!(*gate.busy.lock().unwrap(), 2);
        // A third waits until one is given back.
        let g = gate.clone();
        let waiter = std::thread::spawn(move || {
            let started = Instant::now();
            let t = g.wait(Duration::from_secs(10));
            (started.elapsed(), t.gate.is_some())
        });
        std::thread::sleep(Duration::from_millis(200));
        drop(a);
        let (waited, counted) = waiter.join().unwrap();
        assert!(waited >= Duration::from_millis(150), "{waited:?}");
        assert!(counted);
        // Given back on drop: one busy (b).
        assert_eq!(*gate.busy.lock().unwrap(), 1);
        // Full, and nobody gives back: the wait ends, with a turn that counts for nobody.
        let c = gate.wait(Duration::from_secs(1));
        let started = Instant::now();
        let d = gate.wait(Duration::from_millis(100));
        assert!(started.elapsed() >= Duration::from_millis(100));
        assert!(d.gate.is_none());
        drop(d);
        assert_eq!(*gate.busy.lock().unwrap(), 2);
        drop((b, c));
        assert_eq!(*gate.busy.lock().unwrap(), 0);
    }

    #[test]
    fn a_wait_is_given_up_once_told_to() {
        let gate = Gate::new(1);
        let _held = gate.wait(Duration::from_secs(1));
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let (g, s) = (gate.clone(), stop.clone());
        let waiter = std::thread::spawn(move || {
            let started = Instant::now();
            let t = g.wait_unless(Duration::from_secs(20), &s);
            (started.elapsed(), t.gate.is_some())
        });
        std::thread::sleep(Duration::from_millis(150));
        stop.store(true, Ordering::SeqCst);
        let (waited, counted) = waiter.join().unwrap();
        assert!(waited < Duration::from_secs(2), "{waited:?}");
        assert!(!counted, "a given-up wait takes no turn");
        assert_eq!(*gate.busy.lock().unwrap(), 1);
    }

    #[test]
    fn a_turn_is_taken_without_waiting_only_when_one_is_free() {
        let gate = Gate::new(1);
        let a = gate.try_take().expect("free");
        assert!(gate.try_take().is_none());
        assert_eq!(*gate.busy.lock().unwrap(), 1);
        drop(a);
        assert!(gate.try_take().is_some());
        assert_eq!(*gate.busy.lock().unwrap(), 0);
    }
}
