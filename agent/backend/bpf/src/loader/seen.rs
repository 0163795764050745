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
use peerwall_common::{
    flags, flow_seen_pair_slot_of_words, flow_seen_slot_of_words, flow_seen_stamp, flow_words, map,
    seen_line_of, FlowKey, FlowState, SeenLine, FLOW_SEEN_LINES, FLOW_SEEN_SLOTS,
};

use super::{map_err, BpfError, Datapath};

/// `FLOW_SEEN`'s stamps mapped into this process (the datapath creates the map
/// `BPF_F_MMAPABLE`), each written in place as one `u16` store. An entry holds the stamps of
/// 32 slots ([`SeenLine`]), which the datapath renews on other CPUs meanwhile: a map update
/// would write the whole entry back, and could put an older stamp over one just renewed, after
/// which a live flow's packet would look new.
pub(crate) struct SeenStamps {
    lines: *mut SeenLine,
    count: usize,
}

impl SeenStamps {
    /// Map `d`, `FLOW_SEEN`, read-write.
    pub(crate) fn map(d: &MapData) -> Result<Self, BpfError> {
        let info = d.info().map_err(map_err(map::FLOW_SEEN))?;
        if info.value_size() as usize != std::mem::size_of::<SeenLine>()
            || info.max_entries() != FLOW_SEEN_LINES
        {
            return Err(BpfError::MissingMap(map::FLOW_SEEN.to_string()));
        }
        let count = info.max_entries() as usize;
        let len = count * std::mem::size_of::<SeenLine>();
        // Unmapped on drop, accessed only through volatile `u16` reads and writes below.
        let p = super::mapping::map_values(d, len, true).map_err(|source| BpfError::Io {
            path: map::FLOW_SEEN.into(),
            source,
        })?;
        Ok(Self {
            lines: p.cast(),
            count,
        })
    }

    /// The stamp of slot `slot` (a flow's, [`flow_seen_slot_of_words`], or a pair's,
    /// [`flow_seen_pair_slot_of_words`]), in place; None past the map.
    fn lane(&self, slot: u32) -> Option<*mut u16> {
        let (line, lane) = seen_line_of(slot);
        if line as usize >= self.count {
            return None;
        }
        // SAFETY: `line` < `count` (checked above), `lane` < 32: within the mapping.
        Some(unsafe {
            (&raw mut (*self.lines.add(line as usize)).stamps)
                .cast::<u16>()
                .add(lane)
        })
    }

    /// Write `stamp` into slot `slot`.
    fn set(&self, slot: u32, stamp: u16) {
        if let Some(p) = self.lane(slot) {
            // SAFETY: a `u16` of the mapping (`lane`), aligned (entries are 64 bytes,
            // page-aligned).
            unsafe { std::ptr::write_volatile(p, stamp) }
        }
    }

    /// Stamp flow `k` (either direction) with `stamp`: its flow stamp and its pair's, as the
    /// datapath's `note_seen` does (an idle pair stamp says every flow of the pair is idle).
    pub(crate) fn stamp_flow(&self, k: &FlowKey, stamp: u16) {
        let words = flow_words(k);
        self.set(flow_seen_slot_of_words(&words, FLOW_SEEN_SLOTS - 1), stamp);
        self.set(flow_seen_pair_slot_of_words(&words), stamp);
    }

    /// Write `stamp` into every slot, flows' and pairs' (the benchmarks' baseline).
    #[cfg(feature = "bench")]
    pub(crate) fn fill(&self, stamp: u16) {
        for slot in 0..self.count as u32 * peerwall_common::FLOW_SEEN_LANES {
            self.set(slot, stamp);
        }
    }
}

impl Drop for SeenStamps {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, not used after this.
        unsafe {
            libc::munmap(
                self.lines.cast(),
                self.count * std::mem::size_of::<SeenLine>(),
            )
        };
    }
}

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
        self.seen_stamps()?.stamp_flow(key, flow_seen_stamp(now_ns));
        Ok(())
    }

    /// `FLOW_SEEN`'s stamps, mapped for writing in place.
    pub(crate) fn seen_stamps(&mut self) -> Result<SeenStamps, BpfError> {
        match self.map(map::FLOW_SEEN)? {
            aya::maps::Map::Array(d) => SeenStamps::map(d),
            _ => Err(BpfError::MissingMap(map::FLOW_SEEN.to_string())),
        }
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

    /// This load made `FLOW_SEEN` (none was pinned, or one of another layout was dropped): it
    /// holds no stamp of the flows the pinned tables and the kernel already track. Before any
    /// of the object's programs is attached, the shortcut goes off (a pinned `CONFIG` that
    /// armed it over the dropped map would have them take every fresh, idle stamp for "no
    /// live flow") and the sweep's vouch is withdrawn (a pinned `CT_SWEPT` vouches for stamps
    /// written into the dropped map). [`Datapath::arm_flow_seen`] and the next sweep stamp
    /// this map before either is given back.
    pub(super) fn distrust_new_seen(&mut self) -> Result<(), BpfError> {
        let mut c = self.config()?;
        if c.flags & flags::FLOW_SEEN != 0 {
            c.flags &= !flags::FLOW_SEEN;
            self.set_config(c)?;
            tracing::info!(
                "conntrack's FLOW_SEEN shortcut off: its map is new (another layout was pinned)"
            );
        }
        if self.kernel_swept_until()? != 0 {
            self.forget_kernel_sweep()?;
        }
        Ok(())
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
        let m = self.seen_stamps()?;
        let stamp = flow_seen_stamp(now_ns);
        for k in keys {
            m.stamp_flow(k, stamp);
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
