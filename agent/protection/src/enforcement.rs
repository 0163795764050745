//! Which peers' gateway configurations no host enforces: a configuration is enforced when at
//! least one host (an agent, a sidecar) reports its current generation `Applied`. One that
//! stays unapplied everywhere past a grace period (no agent selects it, every agent fails on
//! it, every gateway is gone) leaves its peer's traffic unfiltered: the controller says so on
//! the object (a `NotEnforced` condition of host [`CONTROLLER_HOST`], an Event), in a metric
//! and in its log, and takes the condition back once a host applies it.
//!
//! Pure: the controller feeds what each configuration's status says in, gets what to report
//! out.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// The `host` of the condition the controller writes (agents write their node or pod).
pub const CONTROLLER_HOST: &str = "peerwall-controller";

/// One configuration as its status describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reported {
    /// `namespace/name`.
    pub key: String,
    /// `metadata.generation`.
    pub generation: i64,
    /// Whether some host (other than the controller) reports this generation `Applied`.
    pub applied: bool,
}

/// What changed since the last look.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Findings {
    /// Configurations unapplied for the whole grace period, newly: report these.
    pub newly_unenforced: Vec<String>,
    /// Configurations reported before that some host applies now (or that are gone).
    pub recovered: Vec<String>,
    /// Configurations unapplied past the grace period, now.
    pub unenforced: usize,
}

/// The state kept between looks.
#[derive(Debug)]
pub struct Enforcement {
    grace: Duration,
    /// Since when each configuration has been unapplied, at which generation.
    since: BTreeMap<String, (i64, Instant)>,
    reported: BTreeSet<String>,
}

impl Enforcement {
    /// Report what stays unapplied for longer than `grace`.
    pub fn new(grace: Duration) -> Self {
        Self {
            grace,
            since: BTreeMap::new(),
            reported: BTreeSet::new(),
        }
    }

    /// Look at the configurations as they are at `now`.
    pub fn observe(&mut self, now: Instant, configs: &[Reported]) -> Findings {
        let mut f = Findings::default();
        let mut unapplied = BTreeSet::new();
        for c in configs.iter().filter(|c| !c.applied) {
            unapplied.insert(c.key.clone());
            // A new generation starts the clock again: the hosts have to catch up with it.
            let since = self
                .since
                .entry(c.key.clone())
                .and_modify(|s| {
                    if s.0 != c.generation && !self.reported.contains(&c.key) {
                        *s = (c.generation, now);
                    }
                })
                .or_insert((c.generation, now));
            if now.saturating_duration_since(since.1) >= self.grace {
                f.unenforced += 1;
                if self.reported.insert(c.key.clone()) {
                    f.newly_unenforced.push(c.key.clone());
                }
            }
        }
        self.since.retain(|k, _| unapplied.contains(k));
        let back: Vec<String> = self
            .reported
            .iter()
            .filter(|k| !unapplied.contains(*k))
            .cloned()
            .collect();
        for k in back {
            self.reported.remove(&k);
            f.recovered.push(k);
        }
        f
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(key: &str, generation: i64, applied: bool) -> Reported {
        Reported {
            key: key.into(),
            generation,
            applied,
        }
    }

    #[test]
    fn unapplied_past_the_grace_period_is_reported_once_and_taken_back() {
        let t0 = Instant::now();
        let s = |n| t0 + Duration::from_secs(n);
        let mut e = Enforcement::new(Duration::from_secs(10));
        assert_eq!(
            e.observe(s(0), &[c("t/a", 1, false), c("t/b", 1, true)])
                .unenforced,
            0
        );
        assert_eq!(e.observe(s(9), &[c("t/a", 1, false)]).unenforced, 0);
        let f = e.observe(s(10), &[c("t/a", 1, false)]);
        assert_eq!(
            (f.newly_unenforced, f.unenforced),
            (vec!["t/a".to_string()], 1)
        );
        // Once: still counted, not reported again.
        let f = e.observe(s(30), &[c("t/a", 1, false)]);
        assert_eq!((f.newly_unenforced.len(), f.unenforced), (0, 1));
        // A host applies it: taken back.
        let f = e.observe(s(31), &[c("t/a", 1, true)]);
        assert_eq!((f.recovered, f.unenforced), (vec!["t/a".to_string()], 0));
    }

    #[test]
    fn a_new_generation_restarts_the_clock_and_a_gone_configuration_recovers() {
        let t0 = Instant::now();
        let s = |n| t0 + Duration::from_secs(n);
        let mut e = Enforcement::new(Duration::from_secs(10));
        e.observe(s(0), &[c("t/a", 1, false)]);
        // Edited at 8 s: the hosts get 10 s from there.
        assert_eq!(e.observe(s(8), &[c("t/a", 2, false)]).unenforced, 0);
        assert_eq!(e.observe(s(12), &[c("t/a", 2, false)]).unenforced, 0);
        assert_eq!(e.observe(s(18), &[c("t/a", 2, false)]).unenforced, 1);
        let f = e.observe(s(19), &[]);
        assert_eq!(f.recovered, vec!["t/a".to_string()]);
    }
}
