//! The rule counters of a slot (`COUNTERS<s>`, per CPU): zeroed when a slot is written whole,
//! read summed over CPUs with the chain and rule names the policy gave them.

use aya::maps::{MapData, PerCpuArray};
use peerwall_common::{map, Counter};

use super::{map_err, BpfError};
use crate::maps::RuleMeta;

/// A chain's identity and rules (what counters are reported under).
struct Named {
    /// Index of its rule 0's counter.
    counters: u32,
    table: String,
    chain: String,
    rules: Vec<RuleMeta>,
}

impl super::Datapath {
    pub(super) fn zero_counters(&mut self, slot: u32) -> Result<(), BpfError> {
        let name = format!("{}{slot}", map::COUNTERS);
        let ncpus = aya::util::nr_cpus().map_err(|(_, source)| BpfError::Io {
            path: "/sys/devices/system/cpu/possible".into(),
            source,
        })?;
        super::batch::zero_percpu_array::<Counter>(self.map(&name)?, &name, ncpus)
    }

    /// Packets and bytes per rule (and per chain policy) of the live slot, summed over CPUs.
    pub fn counters(&mut self) -> Result<Vec<peerwall_backend::RuleCounter>, BpfError> {
        // Names only: the live policy's address entries (100k at scale) are not copied.
        let Some(chains) = self.policy().map(|p| {
            p.chains
                .iter()
                .map(|c| Named {
                    counters: c.counters,
                    table: c.table.clone(),
                    chain: c.chain.clone(),
                    rules: c.rules.clone(),
                })
                .collect::<Vec<_>>()
        }) else {
            return Ok(Vec::new());
        };
        let name = format!("{}{}", map::COUNTERS, self.active);
        let capacity = self.layout.counters;
        let m: PerCpuArray<&mut MapData, Counter> =
            PerCpuArray::try_from(self.map(&name)?).map_err(map_err(&name))?;
        let mut out = Vec::new();
        for c in &chains {
            let mut read = |idx: u32, rule: String| -> Result<(), BpfError> {
                // Past the table: enforced, not counted (the apply report said so).
                let at = c.counters + idx;
                if at >= capacity {
                    return Ok(());
                }
                let v = m.get(&at, 0).map_err(map_err(&name))?;
                let (packets, bytes) = v
                    .iter()
                    .fold((0, 0), |(p, b), x| (p + x.packets, b + x.bytes));
                out.push(peerwall_backend::RuleCounter {
                    table: c.table.clone(),
                    chain: c.chain.clone(),
                    rule,
                    packets,
                    bytes,
                });
                Ok(())
            };
            for (i, r) in c.rules.iter().enumerate() {
                read(i as u32, r.name.clone())?;
            }
            read(c.rules.len() as u32, "(policy)".into())?;
        }
        Ok(out)
    }
}
