//! The kernel-conntrack mode's sweep: the entries of every connection the kernel's table
//! holds stamped into `FLOW_SEEN`, so that the datapath may take an idle entry as "no
//! connection in either table" and spare the kernel's lookup (a cold miss in a large hash
//! table, what a denied flood paid per packet; `ebpf/src/conntrack.rs`, `kernel_state`).
//!
//! Every accept of the datapath stamps its flow's entry; what the sweep adds are the
//! connections the datapath did not accept within an entry's lifetime: those from before it
//! was attached, TCP connections idle longer than [`peerwall_common::FLOW_IDLE_NS`] (the
//! kernel keeps established TCP for days), those started while the emergency switch was on.
//! A sweep vouches for the table until its stamps could go idle (`CT_SWEPT`); the agent sweeps
//! again every [`SWEEP_EVERY`], and whenever the vouch lapsed (the switch zeroes it). Without
//! an agent sweeping (a `peerwall apply` run alone, an agent that died) the vouch lapses and
//! every packet the kernel tracks asks the kernel again: exact, as before, and slower. The one
//! window left: a connection started between sweeps through an interface the datapath is not
//! attached to is judged as new by its next packets here until the next sweep (as the
//! datapath's own tables judge it always).

use std::time::Duration;

use peerwall_backend::BackendError;

use crate::backend::{BpfBackend, KernelTable, NAME};
use crate::loader::{ktime_ns, Datapath};

/// How often at most the agent sweeps: a sweep is due once its vouch has less than
/// `FLOW_IDLE_NS - SWEEP_EVERY` left (8 of its 10 minutes), so a missed upkeep or two never
/// lets it lapse.
pub const SWEEP_EVERY: Duration = Duration::from_secs(120);

/// Whether a sweep is due at `now_ns` when the last one vouches until `until_ns` (0: none).
pub fn due(until_ns: u64, now_ns: u64) -> bool {
    let keep = peerwall_common::FLOW_IDLE_NS.saturating_sub(SWEEP_EVERY.as_nanos() as u64);
    until_ns <= now_ns.saturating_add(keep)
}

/// Stamp every connection `table` lists into `datapath`'s `FLOW_SEEN` and vouch for them
/// (unconditionally); how many connections were listed.
pub fn sweep(datapath: &mut Datapath, table: &mut dyn KernelTable) -> Result<usize, BackendError> {
    let flows = table.flows()?;
    let keys: Vec<_> = flows.iter().map(crate::loader::key_of).collect();
    datapath
        .stamp_kernel_flows(&keys)
        .map_err(BackendError::host(
            NAME,
            "stamping the kernel's connections",
        ))?;
    Ok(flows.len())
}

impl BpfBackend {
    /// Sweep the kernel's table when it is due (kernel-conntrack mode, the switch off, the
    /// shortcut armed); a failure is logged and leaves the vouch to lapse (the datapath then
    /// asks the kernel: exact). Whether it swept.
    pub fn sweep_if_due(&mut self) -> bool {
        match self.try_sweep() {
            Ok(Some(n)) => {
                tracing::debug!(connections = n, "the kernel's connections stamped");
                true
            }
            Ok(None) => false,
            Err(e) => {
                tracing::warn!(error = %e, "could not stamp the kernel's connections: the datapath asks the kernel for every packet of them once the last sweep lapses");
                false
            }
        }
    }

    fn try_sweep(&mut self) -> Result<Option<usize>, BackendError> {
        let (datapath, table) = self.sweep_parts();
        let Some(table) = table else {
            return Ok(None);
        };
        if datapath
            .allow_all()
            .map_err(BackendError::host(NAME, "reading the switch"))?
            || !datapath
                .flow_seen_armed()
                .map_err(BackendError::host(NAME, "reading the config"))?
        {
            return Ok(None);
        }
        let until = datapath
            .kernel_swept_until()
            .map_err(BackendError::host(NAME, "reading the last sweep"))?;
        if !due(until, ktime_ns()) {
            return Ok(None);
        }
        sweep(datapath, table).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sweep_is_due_before_its_vouch_can_lapse() {
        let now = 5_000_000_000_000;
        let idle = peerwall_common::FLOW_IDLE_NS;
        let every = SWEEP_EVERY.as_nanos() as u64;
        // Never swept, or the switch zeroed it; or lapsed.
        assert!(due(0, now));
        assert!(due(now - 1, now));
        // Just swept: not due for SWEEP_EVERY.
        assert!(!due(now + idle, now));
        assert!(!due(now + idle, now + every - 1));
        assert!(due(now + idle, now + every));
    }
}
