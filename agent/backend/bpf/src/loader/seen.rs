//! `FLOW_SEEN`, conntrack's shortcut for flows it cannot know: every write of a flow's
//! `last_seen_ns` stamps the flow's entry (both directions share one,
//! [`peerwall_common::flow_seen_slot`]), and a packet whose entry is idle longer than flows
//! live is a new flow without the two table lookups (cold misses under a flood of new flows).
//!
//! The shortcut is only sound when every flow in the tables has its entry stamped, so the
//! datapath takes it only under [`peerwall_common::flags::FLOW_SEEN`], which
//! [`Datapath::arm_flow_seen`] sets once (1) every program attached through this pin
//! directory is one that stamps (its maps include this `FLOW_SEEN`: an older release's
//! program, adopted through its pinned link, does not) and (2) the flows already in the tables
//! are stamped. It clears the flag whenever (1) does not hold.

use aya::maps::{Array, HashMap as BpfHashMap, MapData};
use aya::programs::links::PinnedLink;
use peerwall_common::{flags, flow_seen_slot, flow_seen_stamp, map, FlowKey, FlowState};

use super::{map_err, BpfError, Datapath};

/// Whether the shortcut may be armed: every attached program uses `ours` (the `FLOW_SEEN`
/// map's id) among its maps. `programs`: per pinned link, its program's map ids (None: the
/// link or its program could not be read, which counts as a program that does not stamp).
pub(crate) fn all_stamp(programs: &[Option<Vec<u32>>], ours: u32) -> bool {
    programs
        .iter()
        .all(|p| p.as_ref().is_some_and(|ids| ids.contains(&ours)))
}

/// The kernel's monotonic clock, as `bpf_ktime_get_ns` reads it.
pub(crate) fn ktime_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into `ts`.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The program id behind a pinned link.
fn link_program(pin: &std::path::Path) -> Option<u32> {
    let link = PinnedLink::from_pin(pin).ok()?;
    Some(
        aya::programs::links::FdLink::from(link)
            .info()
            .ok()?
            .program_id(),
    )
}

/// The map ids of the programs `ids` (one walk of the loaded programs; None for a program that
/// is gone or unreadable).
fn program_maps(ids: &[Option<u32>]) -> Vec<Option<Vec<u32>>> {
    let mut maps = std::collections::HashMap::new();
    for p in aya::programs::loaded_programs().filter_map(Result::ok) {
        if ids.contains(&Some(p.id())) {
            if let Ok(Some(m)) = p.map_ids() {
                maps.insert(p.id(), m);
            }
        }
    }
    ids.iter()
        .map(|id| id.and_then(|id| maps.get(&id).cloned()))
        .collect()
}

impl Datapath {
    /// Stamp flow `key`'s `FLOW_SEEN` entry at `now_ns` (user space writing a flow: the
    /// probe engine).
    pub(crate) fn note_seen(&mut self, key: &FlowKey, now_ns: u64) -> Result<(), BpfError> {
        let mut m: Array<&mut MapData, u16> =
            Array::try_from(self.map(map::FLOW_SEEN)?).map_err(map_err(map::FLOW_SEEN))?;
        let i = flow_seen_slot(key, m.len().saturating_sub(1));
        m.set(i, flow_seen_stamp(now_ns), 0)
            .map_err(map_err(map::FLOW_SEEN))
    }

    /// Turn the shortcut on when it is sound, off when it is not (see the module). Cheap when
    /// nothing changed since the last call (the attached links are the ones checked then).
    /// Returns whether it is on.
    pub fn arm_flow_seen(&mut self) -> Result<bool, BpfError> {
        let links = self.pin_dir.join("links");
        let mut pins: Vec<std::path::PathBuf> = std::fs::read_dir(&links)
            .map(|d| d.filter_map(Result::ok).map(|e| e.path()).collect())
            .unwrap_or_default();
        pins.sort();
        let armed = self.config()?.flags & flags::FLOW_SEEN != 0;
        if armed && self.seen_checked.as_ref() == Some(&pins) {
            return Ok(true);
        }
        let ours = match self.map(map::FLOW_SEEN)? {
            aya::maps::Map::Array(d) => d.info().map_err(map_err(map::FLOW_SEEN))?.id(),
            _ => return Err(BpfError::MissingMap(map::FLOW_SEEN.to_string())),
        };
        let ids: Vec<Option<u32>> = pins.iter().map(|p| link_program(p)).collect();
        let programs = program_maps(&ids);
        let on = all_stamp(&programs, ours);
        if on && !armed {
            // Every attached program stamps from now on; the flows from before are stamped
            // here, then the flag tells the programs to trust the entries.
            self.stamp_live_flows()?;
        }
        let mut c = self.config()?;
        let before = c.flags;
        if on {
            c.flags |= flags::FLOW_SEEN;
        } else {
            c.flags &= !flags::FLOW_SEEN;
        }
        if c.flags != before {
            self.set_config(c)?;
            tracing::debug!(on, links = pins.len(), "conntrack's FLOW_SEEN shortcut");
        }
        self.seen_checked = on.then_some(pins);
        Ok(on)
    }

    /// Stamp the entries of `keys` (the kernel's connections, as the forward hook sees them:
    /// [`super::key_of`]) and vouch for the kernel's table until their stamps could go idle
    /// (`CT_SWEPT`): the kernel-conntrack mode then skips the kernel's lookup for packets whose
    /// entry is idle. `keys` must be of a listing taken after the previous vouch was read (the
    /// caller's sweep, `sweep.rs`).
    pub fn stamp_kernel_flows(&mut self, keys: &[FlowKey]) -> Result<(), BpfError> {
        let now = ktime_ns();
        self.stamp(keys, now)?;
        let mut m: Array<&mut MapData, u64> =
            Array::try_from(self.map(map::CT_SWEPT)?).map_err(map_err(map::CT_SWEPT))?;
        m.set(0, now + peerwall_common::FLOW_IDLE_NS, 0)
            .map_err(map_err(map::CT_SWEPT))
    }

    /// Whether conntrack's `FLOW_SEEN` shortcut is armed ([`Datapath::arm_flow_seen`]).
    pub fn flow_seen_armed(&mut self) -> Result<bool, BpfError> {
        Ok(self.config()?.flags & flags::FLOW_SEEN != 0)
    }

    /// Withdraw the last sweep's vouch (`CT_SWEPT` zero, as the emergency switch's packets
    /// leave it): every packet the kernel tracks asks the kernel (the breakdown benchmark's
    /// row without the sweep).
    pub fn forget_kernel_sweep(&mut self) -> Result<(), BpfError> {
        let mut m: Array<&mut MapData, u64> =
            Array::try_from(self.map(map::CT_SWEPT)?).map_err(map_err(map::CT_SWEPT))?;
        m.set(0, 0, 0).map_err(map_err(map::CT_SWEPT))
    }

    /// Until when (`bpf_ktime_get_ns`) the last sweep vouches for the kernel's table; 0: not.
    pub fn kernel_swept_until(&mut self) -> Result<u64, BpfError> {
        let m: Array<&mut MapData, u64> =
            Array::try_from(self.map(map::CT_SWEPT)?).map_err(map_err(map::CT_SWEPT))?;
        m.get(&0, 0).map_err(map_err(map::CT_SWEPT))
    }

    /// Write stamp `now_ns` into the entries of `keys` (each entry once).
    fn stamp(&mut self, keys: &[FlowKey], now_ns: u64) -> Result<(), BpfError> {
        let mut m: Array<&mut MapData, u16> =
            Array::try_from(self.map(map::FLOW_SEEN)?).map_err(map_err(map::FLOW_SEEN))?;
        let mask = m.len().saturating_sub(1);
        let mut slots: Vec<u32> = keys.iter().map(|k| flow_seen_slot(k, mask)).collect();
        slots.sort_unstable();
        slots.dedup();
        for i in slots {
            m.set(i, flow_seen_stamp(now_ns), 0)
                .map_err(map_err(map::FLOW_SEEN))?;
        }
        Ok(())
    }

    /// Stamp the entry of every flow in both tables (now: at least as recent as each flow).
    fn stamp_live_flows(&mut self) -> Result<(), BpfError> {
        let now = ktime_ns();
        let mut keys: Vec<FlowKey> = {
            let m: BpfHashMap<&mut MapData, FlowKey, FlowState> =
                BpfHashMap::try_from(self.map(map::FLOWS)?).map_err(map_err(map::FLOWS))?;
            m.keys().filter_map(Result::ok).collect()
        };
        keys.extend(self.new_flow_slots()?.into_iter().map(|(_, s)| s.key));
        self.stamp(&keys, now)
    }
}

#[cfg(test)]
mod tests {
    use super::all_stamp;

    #[test]
    fn the_shortcut_needs_every_attached_program_to_stamp() {
        // No program attached yet (the benchmark, the probe engine): nothing can miss a stamp.
        assert!(all_stamp(&[], 7));
        assert!(all_stamp(&[Some(vec![3, 7, 9]), Some(vec![7])], 7));
        // An older release's program (its maps lack ours), or one that cannot be read.
        assert!(!all_stamp(&[Some(vec![3, 7]), Some(vec![3, 9])], 7));
        assert!(!all_stamp(&[Some(vec![7]), None], 7));
    }
}
