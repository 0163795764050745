//! The connections a backend ended and keeps ended ([`crate::Revoke::end_flows`]), recorded
//! so that a change that allows them again can let them go ([`crate::Revoke::release_flows`])
//! without walking the datapath's tables. Bounded: past `cap` records the oldest go first
//! (those most likely expired in the kernel already; one still held is then only let go once
//! both its sides have been quiet).

use std::collections::HashMap;
use std::time::Instant;

use crate::Flow;

/// A bounded record of ended connections, with when each was ended.
#[derive(Debug)]
pub struct Kept {
    flows: HashMap<Flow, Instant>,
    cap: usize,
}

impl Default for Kept {
    /// At most 32768 connections (the nftables ended table holds 65536 elements, two each).
    fn default() -> Self {
        Self::new(1 << 15)
    }
}

impl Kept {
    /// An empty record of at most `cap` connections.
    pub fn new(cap: usize) -> Self {
        Self {
            flows: HashMap::new(),
            cap: cap.max(1),
        }
    }

    /// Record `flows` as ended now.
    pub fn record(&mut self, flows: impl IntoIterator<Item = Flow>) {
        let now = Instant::now();
        self.flows.extend(flows.into_iter().map(|f| (f, now)));
        if self.flows.len() > self.cap {
            let mut by_age: Vec<Instant> = self.flows.values().copied().collect();
            by_age.sort_unstable();
            let cut = by_age[self.flows.len() - self.cap];
            self.flows.retain(|_, t| *t >= cut);
        }
    }

    /// The recorded connections.
    pub fn flows(&self) -> Vec<Flow> {
        self.flows.keys().copied().collect()
    }

    /// Forget those of `flows` that were recorded; returns them.
    pub fn take(&mut self, flows: &[Flow]) -> Vec<Flow> {
        flows
            .iter()
            .filter(|f| self.flows.remove(f).is_some())
            .copied()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(port: u16) -> Flow {
        Flow {
            src: "10.10.1.67".parse().unwrap(),
            dst: "10.20.1.2".parse().unwrap(),
            proto: 17,
            sport: port,
            dport: 6000,
        }
    }

    #[test]
    fn records_are_bounded_and_taken_once() {
        let mut k = Kept::new(2);
        k.record([flow(1)]);
        std::thread::sleep(std::time::Duration::from_millis(2));
        k.record([flow(2), flow(3)]);
        let mut kept = k.flows();
        kept.sort_by_key(|f| f.sport);
        assert_eq!(kept, [flow(2), flow(3)], "the oldest went first");
        assert_eq!(k.take(&[flow(1), flow(2)]), [flow(2)]);
        assert_eq!(k.take(&[flow(2)]), []);
        assert_eq!(k.flows(), [flow(3)]);
    }
}
