//! The datapath's flow table as user space reads and ends it: [`Datapath::flows`] lists the
//! tracked connections, [`Datapath::end_flows`] marks them ended (`FlowState::ended`: their
//! packets read `ct state invalid` both ways until they expire, and none restarts them), then
//! makes the verdicts cached for them stale.

use std::net::IpAddr;

use aya::maps::{Array, HashMap as BpfHashMap, MapData};
use peerwall_backend::Flow;
use peerwall_common::{family, map, FlowKey, FlowState, NewFlowSlot, VerdictKey4};
use peerwall_policy::ir::eval::proto;

use super::{map_err, BpfError, Datapath};

/// The flow a `FLOWS` key stands for.
fn flow_of(k: &FlowKey) -> Option<Flow> {
    let addr = |b: &[u8; 16]| -> Option<IpAddr> {
        match k.family {
            family::V4 => Some(IpAddr::from([b[0], b[1], b[2], b[3]])),
            family::V6 => Some(IpAddr::from(*b)),
            _ => None,
        }
    };
    Some(Flow {
        src: addr(&k.src)?,
        dst: addr(&k.dst)?,
        proto: k.proto,
        sport: u16::from_be_bytes(k.sport),
        dport: u16::from_be_bytes(k.dport),
    })
}

/// The `FLOWS` key of a flow (original direction).
pub fn key_of(f: &Flow) -> FlowKey {
    let (fam, src, dst) = match (f.src, f.dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let mut a = [0u8; 16];
            let mut b = [0u8; 16];
            a[..4].copy_from_slice(&s.octets());
            b[..4].copy_from_slice(&d.octets());
            (family::V4, a, b)
        }
        (s, d) => {
            let six = |a: IpAddr| match a {
                IpAddr::V6(v) => v.octets(),
                IpAddr::V4(v) => v.to_ipv6_mapped().octets(),
            };
            (family::V6, six(s), six(d))
        }
    };
    FlowKey {
        src,
        dst,
        sport: f.sport.to_be_bytes(),
        dport: f.dport.to_be_bytes(),
        proto: f.proto,
        family: fam,
        _pad: [0; 2],
    }
}

/// The key of the opposite direction (ICMP echo keeps its identifier in `sport` both ways),
/// as the datapath's `conntrack::reverse`.
fn reverse(k: &FlowKey) -> FlowKey {
    let icmp = k.proto == proto::ICMP || k.proto == proto::ICMPV6;
    FlowKey {
        src: k.dst,
        dst: k.src,
        sport: if icmp { k.sport } else { k.dport },
        dport: if icmp { k.dport } else { k.sport },
        ..*k
    }
}

/// The verdict-cache sets (`VERDICT_GENS` indexes) packets of `k`'s direction fall in, as the
/// datapath computes them: IPv4 from the 16-byte key (ICMP echo: request and reply types),
/// IPv6 from the folded flow key.
fn verdict_sets_of(k: &FlowKey) -> Vec<u32> {
    if k.family != family::V4 {
        return vec![peerwall_common::verdict_set(peerwall_common::fold_key6(k))];
    }
    let types: &[u8] = if k.proto == proto::ICMP {
        &[0, 8]
    } else {
        &[0]
    };
    types
        .iter()
        .map(|&icmp_type| {
            let key = VerdictKey4 {
                src: [k.src[0], k.src[1], k.src[2], k.src[3]],
                dst: [k.dst[0], k.dst[1], k.dst[2], k.dst[3]],
                sport: k.sport,
                dport: k.dport,
                proto: k.proto,
                icmp_type,
                _pad: [0; 2],
            };
            peerwall_common::verdict_set(key.words())
        })
        .collect()
}

/// The conntrack tables: replied flows in `FLOWS` (an LRU hash), flows not replied yet in
/// `FLOWS_NEW` (a direct-mapped array of [`NewFlowSlot`]s, indexed by
/// [`peerwall_common::new_flow_slot`]).
impl Datapath {
    /// The occupied slots of `FLOWS_NEW`: (index, slot).
    pub(crate) fn new_flow_slots(&mut self) -> Result<Vec<(u32, NewFlowSlot)>, BpfError> {
        match self.map(map::FLOWS_NEW)? {
            aya::maps::Map::Array(d) => occupied_new_flow_slots(d),
            _ => Err(BpfError::MissingMap(map::FLOWS_NEW.to_string())),
        }
    }

    /// Write slot `i` of `FLOWS_NEW`.
    pub(crate) fn set_new_flow_slot(&mut self, i: u32, s: NewFlowSlot) -> Result<(), BpfError> {
        let mut m: Array<&mut MapData, NewFlowSlot> =
            Array::try_from(self.map(map::FLOWS_NEW)?).map_err(map_err(map::FLOWS_NEW))?;
        m.set(i, s, 0).map_err(map_err(map::FLOWS_NEW))
    }

    /// Put flow `key` into its slot of `FLOWS_NEW` (the slot the datapath indexes: the key's
    /// hash under the table's size less one), whatever was there.
    pub(crate) fn put_new_flow(&mut self, key: FlowKey, state: FlowState) -> Result<(), BpfError> {
        let mut m: Array<&mut MapData, NewFlowSlot> =
            Array::try_from(self.map(map::FLOWS_NEW)?).map_err(map_err(map::FLOWS_NEW))?;
        let i = peerwall_common::new_flow_slot(&key, m.len().saturating_sub(1));
        m.set(
            i,
            NewFlowSlot {
                key,
                _pad: [0; 8],
                state,
            },
            0,
        )
        .map_err(map_err(map::FLOWS_NEW))
    }

    /// Every live flow of the datapath's tables (established and not yet replied), by
    /// original direction.
    pub fn flows(&mut self) -> Result<Vec<Flow>, BpfError> {
        let mut out = Vec::new();
        let m: BpfHashMap<&mut MapData, FlowKey, FlowState> =
            BpfHashMap::try_from(self.map(map::FLOWS)?).map_err(map_err(map::FLOWS))?;
        out.extend(
            m.iter()
                .filter_map(Result::ok)
                .filter(|(_, st)| st.ended == 0)
                .filter_map(|(k, _)| flow_of(&k)),
        );
        out.extend(
            self.new_flow_slots()?
                .into_iter()
                .filter(|(_, s)| s.state.ended == 0)
                .filter_map(|(_, s)| flow_of(&s.key)),
        );
        Ok(out)
    }

    /// Forget the ended flows among `flows` (their next packet is new to the datapath, judged
    /// afresh) and make the verdicts cached for either direction stale; how many were held.
    pub fn release_flows(&mut self, flows: &[Flow]) -> Result<usize, BpfError> {
        let mut sets = Vec::new();
        let mut found = std::collections::BTreeSet::new();
        {
            let mut m: BpfHashMap<&mut MapData, FlowKey, FlowState> =
                BpfHashMap::try_from(self.map(map::FLOWS)?).map_err(map_err(map::FLOWS))?;
            for (n, f) in flows.iter().enumerate() {
                let k = key_of(f);
                if m.get(&k, 0).is_ok_and(|st| st.ended != 0) && m.remove(&k).is_ok() {
                    found.insert(n);
                    sets.extend(verdict_sets_of(&k));
                    sets.extend(verdict_sets_of(&reverse(&k)));
                }
            }
        }
        {
            let mut m: Array<&mut MapData, NewFlowSlot> =
                Array::try_from(self.map(map::FLOWS_NEW)?).map_err(map_err(map::FLOWS_NEW))?;
            let mask = m.len().saturating_sub(1);
            for (n, f) in flows.iter().enumerate() {
                let k = key_of(f);
                let i = peerwall_common::new_flow_slot(&k, mask);
                let Ok(s) = m.get(&i, 0) else {
                    continue;
                };
                if s.key != k || s.state.ended == 0 {
                    continue;
                }
                m.set(i, NewFlowSlot::EMPTY, 0)
                    .map_err(map_err(map::FLOWS_NEW))?;
                found.insert(n);
                sets.extend(verdict_sets_of(&k));
                sets.extend(verdict_sets_of(&reverse(&k)));
            }
        }
        self.outdate(sets)?;
        Ok(found.len())
    }

    /// Make the verdicts cached for `sets` stale (a new generation each).
    fn outdate(&mut self, mut sets: Vec<u32>) -> Result<(), BpfError> {
        if sets.is_empty() {
            return Ok(());
        }
        let mut gens: Array<&mut MapData, u32> =
            Array::try_from(self.map(map::VERDICT_GENS)?).map_err(map_err(map::VERDICT_GENS))?;
        sets.sort_unstable();
        sets.dedup();
        for s in sets {
            let g = gens.get(&s, 0).map_err(map_err(map::VERDICT_GENS))?;
            gens.set(s, g.wrapping_add(1), 0)
                .map_err(map_err(map::VERDICT_GENS))?;
        }
        Ok(())
    }

    /// Mark `flows` ended and make the verdicts cached for either direction stale; how many
    /// of them the table held.
    ///
    /// `FLOWS_NEW` first, then `FLOWS`: the datapath moves a flow from the first to the
    /// second on its first reply (copying its state, `ended` included). Read the other way, a
    /// flow that moved between the two passes was in neither when looked at, and stayed open.
    /// In this order every interleaving ends it: marked in its slot before the move (the move
    /// copies the mark), or found in `FLOWS` after it.
    pub fn end_flows(&mut self, flows: &[Flow]) -> Result<usize, BpfError> {
        let mut sets = Vec::new();
        let mut found = std::collections::BTreeSet::new();
        {
            let mut m: Array<&mut MapData, NewFlowSlot> =
                Array::try_from(self.map(map::FLOWS_NEW)?).map_err(map_err(map::FLOWS_NEW))?;
            let mask = m.len().saturating_sub(1);
            for (n, f) in flows.iter().enumerate() {
                let k = key_of(f);
                let i = peerwall_common::new_flow_slot(&k, mask);
                let Ok(mut s) = m.get(&i, 0) else {
                    continue;
                };
                if s.key != k {
                    continue;
                }
                s.state.ended = 1;
                m.set(i, s, 0).map_err(map_err(map::FLOWS_NEW))?;
                found.insert(n);
                sets.extend(verdict_sets_of(&k));
                sets.extend(verdict_sets_of(&reverse(&k)));
            }
        }
        {
            let mut m: BpfHashMap<&mut MapData, FlowKey, FlowState> =
                BpfHashMap::try_from(self.map(map::FLOWS)?).map_err(map_err(map::FLOWS))?;
            for (n, f) in flows.iter().enumerate() {
                let k = key_of(f);
                let Ok(mut st) = m.get(&k, 0) else {
                    continue;
                };
                st.ended = 1;
                m.insert(k, st, 0).map_err(map_err(map::FLOWS))?;
                found.insert(n);
                sets.extend(verdict_sets_of(&k));
                sets.extend(verdict_sets_of(&reverse(&k)));
            }
        }
        let ended = found.len();
        if sets.is_empty() {
            return Ok(0);
        }
        self.outdate(sets)?;
        Ok(ended)
    }
}

/// The occupied slots of a `FLOWS_NEW` array, read in one go from its memory mapped into this
/// process (the datapath creates it `BPF_F_MMAPABLE`): a table of 65536 slots read one lookup
/// at a time would take a syscall each, which the agent pays while it ends the flows a policy
/// change no longer allows. (index, slot).
pub(crate) fn occupied_new_flow_slots(d: &MapData) -> Result<Vec<(u32, NewFlowSlot)>, BpfError> {
    let info = d.info().map_err(map_err(map::FLOWS_NEW))?;
    let slots = info.max_entries() as usize;
    let slot = std::mem::size_of::<NewFlowSlot>();
    if info.value_size() as usize != slot {
        return Err(BpfError::MissingMap(map::FLOWS_NEW.to_string()));
    }
    let len = slots * slot;
    if len == 0 {
        return Ok(Vec::new());
    }
    // Read-only, unmapped below.
    let p = super::mapping::map_values(d, len, false).map_err(|source| BpfError::Io {
        path: map::FLOWS_NEW.into(),
        source,
    })?;
    let mut out = Vec::new();
    for i in 0..slots {
        // SAFETY: within the mapping; the slot may be written by the datapath meanwhile, so it
        // is copied with a volatile read of plain data (any bit pattern is a valid slot).
        let s = unsafe { std::ptr::read_volatile((p as *const NewFlowSlot).add(i)) };
        if s.key.family != 0 {
            out.push((i as u32, s));
        }
    }
    // SAFETY: the mapping made above, not used after this.
    unsafe { libc::munmap(p, len) };
    Ok(out)
}

impl Datapath {
    /// Mark `flows`, which the kernel's connection table holds (the kernel-conntrack mode:
    /// TCP and UDP), ended in `FLOWS`: the datapath finds the mark before it asks the kernel,
    /// so after user space deletes the kernel's entry, neither side's next packet starts the
    /// flow again (`ebpf/src/conntrack.rs`, `ended_mark`). Each mark gets its `FLOW_SEEN`
    /// stamp (the datapath looks for marks only where the stamp is live) and the verdicts
    /// cached for either direction go stale.
    pub fn mark_ended(&mut self, flows: &[Flow]) -> Result<(), BpfError> {
        if flows.is_empty() {
            return Ok(());
        }
        let now = super::seen::ktime_ns();
        // Before any mark: the datapath looks for marks only until `ENDED_UNTIL`.
        self.marks_live_until(now.saturating_add(self.ended_idle_ns))?;
        let mut sets = Vec::new();
        let mut seen_keys = Vec::new();
        {
            let mut m: BpfHashMap<&mut MapData, FlowKey, FlowState> =
                BpfHashMap::try_from(self.map(map::FLOWS)?).map_err(map_err(map::FLOWS))?;
            for f in flows {
                let k = key_of(f);
                let st = FlowState {
                    last_seen_ns: now,
                    replied: 1,
                    ended: 1,
                    _pad: [0; 6],
                };
                m.insert(k, st, 0).map_err(map_err(map::FLOWS))?;
                seen_keys.push(k);
                sets.extend(verdict_sets_of(&k));
                sets.extend(verdict_sets_of(&reverse(&k)));
            }
        }
        {
            let seen = self.seen_stamps()?;
            let stamp = peerwall_common::flow_seen_stamp(now);
            for k in &seen_keys {
                seen.stamp_flow(k, stamp);
            }
        }
        self.outdate(sets)
    }

    /// Move `ENDED_UNTIL` on to `until` unless it is later already: until then the
    /// kernel-conntrack mode looks for marks (`ebpf/src/conntrack.rs`, `ended_mark`).
    fn marks_live_until(&mut self, until: u64) -> Result<(), BpfError> {
        let mut m: Array<&mut MapData, u64> =
            Array::try_from(self.map(map::ENDED_UNTIL)?).map_err(map_err(map::ENDED_UNTIL))?;
        let now = m.get(&0, 0).map_err(map_err(map::ENDED_UNTIL))?;
        if now >= until {
            return Ok(());
        }
        m.set(0, until, 0).map_err(map_err(map::ENDED_UNTIL))
    }

    /// `ENDED_UNTIL` was made at this load beside pinned flow tables (a datapath of 0.1.0):
    /// any mark they hold may be live for as long as marks live, so it covers that long.
    pub(super) fn cover_pinned_marks(&mut self) -> Result<(), BpfError> {
        let any = {
            let m: BpfHashMap<&mut MapData, FlowKey, FlowState> =
                BpfHashMap::try_from(self.map(map::FLOWS)?).map_err(map_err(map::FLOWS))?;
            m.keys().next().is_some()
        };
        if !any {
            return Ok(());
        }
        self.marks_live_until(super::seen::ktime_ns().saturating_add(self.ended_idle_ns))
    }
}
