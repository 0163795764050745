//! What the probe engine (`peerwall verdict --engine bpf`, the differential tests) needs of a
//! loaded datapath beyond enforcing: flows put into and flushed from conntrack, the verdict
//! cache switched on for probe packets, inspected and flushed, the programs for
//! BPF_PROG_TEST_RUN, raw map access.

use aya::maps::MapData;
use aya::programs::{SchedClassifier, Xdp};
use peerwall_common::map;

use super::{map_err, BpfError, Datapath, TC_PROGRAM};

impl Datapath {
    /// Insert a conntrack flow (probe engine: reproduce established/related states), in the
    /// table the datapath keeps it in: `FLOWS` when replied, else its slot of `FLOWS_NEW`.
    pub fn insert_flow(
        &mut self,
        key: peerwall_common::FlowKey,
        replied: bool,
    ) -> Result<(), BpfError> {
        let now = super::seen::ktime_ns();
        // Its FLOW_SEEN entry first, as the datapath stamps it.
        self.note_seen(&key, now)?;
        let state = peerwall_common::FlowState {
            last_seen_ns: now,
            replied: u8::from(replied),
            ended: 0,
            _pad: [0; 6],
        };
        if !replied {
            return self.put_new_flow(key, state);
        }
        let mut m: aya::maps::HashMap<
            &mut MapData,
            peerwall_common::FlowKey,
            peerwall_common::FlowState,
        > = aya::maps::HashMap::try_from(self.map(map::FLOWS)?).map_err(map_err(map::FLOWS))?;
        m.insert(key, state, 0).map_err(map_err(map::FLOWS))
    }

    /// Forget every conntrack flow (both tables).
    pub fn flush_flows(&mut self) -> Result<(), BpfError> {
        {
            let mut m: aya::maps::HashMap<
                &mut MapData,
                peerwall_common::FlowKey,
                peerwall_common::FlowState,
            > = aya::maps::HashMap::try_from(self.map(map::FLOWS)?).map_err(map_err(map::FLOWS))?;
            let keys: Vec<peerwall_common::FlowKey> = m.keys().filter_map(Result::ok).collect();
            for k in keys {
                match m.remove(&k) {
                    // Evicted by the LRU since it was listed: gone either way.
                    Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
                    Err(e) => return Err(map_err(map::FLOWS)(e)),
                }
            }
        }
        for (i, _) in self.new_flow_slots()? {
            self.set_new_flow_slot(i, peerwall_common::NewFlowSlot::EMPTY)?;
        }
        Ok(())
    }

    /// The tc program (for BPF_PROG_TEST_RUN).
    pub fn tc_program(&mut self) -> Result<&mut SchedClassifier, BpfError> {
        self.loaded(TC_PROGRAM)
    }

    /// The tc entry for every device type, loaded (verified); an error where the kernel
    /// does not offer the cast it needs.
    pub fn tc_any_program(&mut self) -> Result<&mut SchedClassifier, BpfError> {
        self.loaded(super::TC_ANY_PROGRAM)
    }

    /// Whether the tc entry for every device type is the one attached here.
    pub fn tc_any(&self) -> bool {
        self.tc_any
    }

    /// The tc entry for devices without a link-layer header, loaded (verified).
    pub fn tc_l3_program(&mut self) -> Result<&mut SchedClassifier, BpfError> {
        self.loaded(super::TC_L3_PROGRAM)
    }

    /// The XDP entry (`--xdp`), loaded (verified).
    pub fn xdp_program(&mut self) -> Result<&mut Xdp, BpfError> {
        self.loaded(super::XDP_PROGRAM)
    }

    /// Probe packets also cached and served from the verdict cache
    /// ([`peerwall_common::flags::PROBE_CACHE`]): the cache's differential test.
    pub fn set_probe_cache(&mut self, on: bool) -> Result<(), BpfError> {
        let mut c = self.config()?;
        if on {
            c.flags |= peerwall_common::flags::PROBE_CACHE;
        } else {
            c.flags &= !peerwall_common::flags::PROBE_CACHE;
        }
        self.set_config(c)
    }

    /// Forget the cached verdicts of the shared level (`VERDICTS4`, `VERDICTS6`) and keep
    /// every CPU's own level: what a packet is served then comes from its CPU's level (the
    /// cache's tests).
    pub fn flush_shared_verdicts(&mut self) -> Result<(), BpfError> {
        fn flush<K: aya::Pod>(b: &mut Datapath, name: &str) -> Result<(), BpfError> {
            let mut m: aya::maps::HashMap<&mut MapData, K, peerwall_common::CachedVerdict> =
                aya::maps::HashMap::try_from(b.map(name)?).map_err(map_err(name))?;
            let keys: Vec<K> = m.keys().filter_map(Result::ok).collect();
            for k in keys {
                match m.remove(&k) {
                    Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
                    Err(e) => return Err(map_err(name)(e)),
                }
            }
            Ok(())
        }
        flush::<peerwall_common::VerdictKey4>(self, map::VERDICTS4)?;
        flush::<peerwall_common::FlowKey>(self, map::VERDICTS6)?;
        Ok(())
    }

    /// Forget every cached verdict (both families).
    pub fn flush_verdicts(&mut self) -> Result<(), BpfError> {
        fn zero<V: aya::Pod + Default>(b: &mut Datapath, name: &str) -> Result<(), BpfError> {
            let mut m: aya::maps::Array<&mut MapData, V> =
                aya::maps::Array::try_from(b.map(name)?).map_err(map_err(name))?;
            for i in 0..m.len() {
                m.set(i, V::default(), 0).map_err(map_err(name))?;
            }
            Ok(())
        }
        self.flush_shared_verdicts()?;
        zero::<peerwall_common::CpuVerdicts4>(self, map::VERDICTS4_CPU)?;
        zero::<peerwall_common::CpuVerdictTags>(self, map::VERDICTS4_TAGS)?;
        zero::<peerwall_common::PairDrops>(self, map::PAIR_DROPS)
    }

    /// The CPUs whose first-level verdict cache (`VERDICTS4_CPU`) holds a verdict for `k`
    /// under the current generation of its set (the cache's tests).
    pub fn cpu_cached(&mut self, k: &peerwall_common::VerdictKey4) -> Result<Vec<u32>, BpfError> {
        let set = peerwall_common::verdict_set(k.words());
        let gen = {
            let name = map::VERDICT_GENS;
            let g: aya::maps::Array<&mut MapData, u32> =
                aya::maps::Array::try_from(self.map(name)?).map_err(map_err(name))?;
            g.get(&set, 0).map_err(map_err(name))?
        };
        let name = map::VERDICTS4_CPU;
        let m: aya::maps::Array<&mut MapData, peerwall_common::CpuVerdicts4> =
            aya::maps::Array::try_from(self.map(name)?).map_err(map_err(name))?;
        let cpus = m.len() / peerwall_common::CPU_VERDICT_SETS;
        let mut found = Vec::new();
        for cpu in 0..cpus {
            let s = m
                .get(&(cpu * peerwall_common::CPU_VERDICT_SETS + set), 0)
                .map_err(map_err(name))?;
            if s.ways
                .iter()
                .any(|w| w.key == *k && w.v.gen == gen && w.v.ttl != 0)
            {
                found.push(cpu);
            }
        }
        Ok(found)
    }

    /// Map access for the probe engine.
    pub fn map_mut(&mut self, name: &str) -> Result<&mut aya::maps::Map, BpfError> {
        self.map(name)
    }
}
