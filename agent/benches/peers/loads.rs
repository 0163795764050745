//! What the agent's log says of the bpf datapath's loads: how long each gateway's maps and
//! verification took, which loads took the spare, which gateways started through nftables
//! while their load waited (`enforcement/bridge.rs`).

use std::time::Duration;

/// How long the datapath's own loads took in the agent, from its loader's debug lines: the
/// maps created (`datapath object loaded (its maps)`) and the programs verified (`program
/// loaded (verified)`), each a list of milliseconds, one per gateway load.
#[derive(Default)]
pub struct Loads {
    pub maps: Vec<f64>,
    pub verified: Vec<f64>,
    /// Gateways whose datapath had to load (no turn free, or no spare ready) and had
    /// nftables enforce their policy meanwhile (`the datapath must load`), and of those, the
    /// ones whose datapath took over once loaded (`the datapath took over from nftables`).
    pub bridged: usize,
    pub took_over: usize,
}

impl Loads {
    pub fn of(log: &str) -> Self {
        let ms = |l: &str| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix("ms="))
                .and_then(|v| v.parse::<f64>().ok())
        };
        let mut out = Self::default();
        for l in log.lines() {
            if l.contains("datapath object loaded (its maps)") {
                out.maps.extend(ms(l));
            } else if l.contains("program loaded (verified)") {
                out.verified.extend(ms(l));
            } else if l.contains("the datapath must load") {
                out.bridged += 1;
            } else if l.contains("the datapath took over from nftables") {
                out.took_over += 1;
            }
        }
        out
    }

    /// How many loads took the spare datapath made ahead (`loader/spare.rs`).
    pub fn spares_taken(log: &str) -> usize {
        log.lines()
            .filter(|l| l.contains("took the spare datapath"))
            .count()
    }

    pub fn median(v: &[f64]) -> f64 {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    }

    /// The least time N gateways' loads take on `cpus` CPUs, at the medians measured: each
    /// gateway's maps and verification, one load per CPU at a time (a load runs on one
    /// thread), so ⌈N ÷ CPUs⌉ loads one after the other.
    pub fn floor(&self, n: usize, cpus: usize) -> Duration {
        let per = Self::median(&self.maps) + Self::median(&self.verified);
        Duration::from_secs_f64(per * n.div_ceil(cpus.max(1)) as f64 / 1000.0)
    }
}
