//! The ends of bursts: the datapath counts a flow's packets between two of its events in
//! `EVENT_FLOWS` and reports them with the flow's next event, which never comes when the flow
//! stops. [`Bursts`] finds the flows quiet for an interval with packets counted and not
//! reported, hands them on as events (each the flow's latest packet, with the counts) and
//! clears their counts, so every packet the datapath counted is in exactly one event, as
//! nftables' [`peerwall_backend::FlowLimiter::flush`] does in user space.

use std::path::Path;
use std::time::Duration;

use aya::maps::{Array, HashMap, Map, MapData};
use peerwall_common::{map, EventConfig, EventFlow, FlowEvent, FlowKey};

/// A flow's counted packets as the event the datapath would have sent: `None` unless the flow
/// had an event (the rate limit let its first through: a flood's flows that it kept out stay
/// out, so at most one more event per reported flow and interval), has packets not reported
/// since and none for `interval_ns` by `now_ns` (`bpf_ktime_get_ns`).
pub(crate) fn quiet_event(
    k: &FlowKey,
    v: &EventFlow,
    now_ns: u64,
    interval_ns: u64,
) -> Option<FlowEvent> {
    if v.last_ns == 0 || v.packets == 0 || now_ns.saturating_sub(v.seen_ns) < interval_ns {
        return None;
    }
    Some(FlowEvent {
        ts_ns: v.seen_ns,
        packets: v.packets,
        bytes: v.bytes,
        src: k.src,
        dst: k.dst,
        sport: v.sport,
        dport: v.dport,
        iif: v.iif,
        oif: v.oif,
        chain: u32::from(k._pad[1]),
        rule: v.rule,
        epoch: v.epoch,
        family: k.family,
        proto: k.proto,
        state: v.state,
        kind: k._pad[0],
        _pad: [0; 4],
    })
}

/// The pinned per-flow event state and settings of one datapath.
pub(crate) struct Bursts {
    flows: HashMap<MapData, FlowKey, EventFlow>,
    conf: Array<MapData, EventConfig>,
}

impl Bursts {
    /// The maps pinned in `pin_dir`; None when absent or of another layout (an older
    /// datapath: its bursts' ends stay unreported, as they were).
    pub(crate) fn open(pin_dir: &Path) -> Option<Self> {
        let flows = MapData::from_pin(pin_dir.join(map::EVENT_FLOWS)).ok()?;
        let info = flows.info().ok()?;
        if info.value_size() as usize != std::mem::size_of::<EventFlow>()
            || info.key_size() as usize != std::mem::size_of::<FlowKey>()
        {
            return None;
        }
        let conf = MapData::from_pin(pin_dir.join(map::EVENT_CONF)).ok()?;
        Some(Self {
            flows: HashMap::try_from(Map::LruHashMap(flows)).ok()?,
            conf: Array::try_from(Map::Array(conf)).ok()?,
        })
    }

    /// The quiet flows' events, their counts cleared (`now_ns`: `bpf_ktime_get_ns` now). A
    /// packet the datapath counts between our read and our write is lost from the totals,
    /// as counts racing between CPUs are in the datapath itself.
    pub(crate) fn take(&mut self, now_ns: u64) -> Vec<FlowEvent> {
        let Ok(conf) = self.conf.get(&0, 0) else {
            return Vec::new();
        };
        let interval = conf.flow_interval_ns;
        let keys: Vec<FlowKey> = self.flows.keys().filter_map(Result::ok).collect();
        let mut out = Vec::new();
        for k in keys {
            let Ok(v) = self.flows.get(&k, 0) else {
                continue;
            };
            let Some(e) = quiet_event(&k, &v, now_ns, interval) else {
                continue;
            };
            // Reported now: the flow's next packet counts from zero, an interval after this
            // one (as if the datapath had sent it).
            let cleared = EventFlow {
                last_ns: v.seen_ns,
                packets: 0,
                bytes: 0,
                ..v
            };
            if self.flows.insert(k, cleared, 0).is_ok() {
                out.push(e);
            }
        }
        out
    }

    /// How often to look: once per interval. A walk is two system calls per flow the table
    /// holds (16k under a flood of new flows: tens of milliseconds of one CPU), so not more
    /// often; the end of a burst is reported one to two intervals after its last packet.
    pub(crate) fn period(&self) -> Duration {
        let ns = self
            .conf
            .get(&0, 0)
            .map(|c| c.flow_interval_ns)
            .unwrap_or(1_000_000_000);
        Duration::from_nanos(ns.max(10_000_000))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> FlowKey {
        FlowKey {
            src: [10, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            dst: [10, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            sport: 1000u16.to_be_bytes(),
            dport: 80u16.to_be_bytes(),
            proto: 17,
            family: peerwall_common::family::V4,
            _pad: [peerwall_common::event::DROP, 3],
        }
    }

    #[test]
    fn only_a_quiet_flow_with_unreported_packets_gives_an_event() {
        let v = EventFlow {
            last_ns: 1_000,
            packets: 9,
            bytes: 540,
            seen_ns: 5_000,
            iif: 4,
            oif: 5,
            rule: 2,
            epoch: 7,
            sport: 1000,
            dport: 80,
            state: 1,
            _pad: [0; 3],
        };
        // Its latest packet less than an interval ago: the flow may go on, its next event
        // will carry them.
        assert!(quiet_event(&key(), &v, 5_999, 1_000).is_none());
        let e = quiet_event(&key(), &v, 6_000, 1_000).unwrap();
        assert_eq!((e.ts_ns, e.packets, e.bytes), (5_000, 9, 540));
        assert_eq!((e.sport, e.dport, e.iif, e.oif), (1000, 80, 4, 5));
        assert_eq!((e.chain, e.rule, e.epoch, e.state), (3, 2, 7, 1));
        assert_eq!(
            (e.kind, e.proto, e.src, e.dst),
            (peerwall_common::event::DROP, 17, key().src, key().dst)
        );
        // Everything already reported: nothing.
        let none = EventFlow {
            packets: 0,
            bytes: 0,
            ..v
        };
        assert!(quiet_event(&key(), &none, 1 << 40, 1_000).is_none());
        // A flow whose first event the rate limit refused (a flood's): it stays unreported.
        let refused = EventFlow { last_ns: 0, ..v };
        assert!(quiet_event(&key(), &refused, 1 << 40, 1_000).is_none());
    }
}
