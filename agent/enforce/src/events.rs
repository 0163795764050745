//! The agent's record of its backend's events (the engine's event thread pushes what the
//! backend's `EventSource` reads): it keeps the last [`EVENT_LOG_SIZE`] events for `GET /events?after=N` (what `peerwall observe` reads
//! from a running agent), counts `peerwall_drops_total`, and logs nothing per event.

use std::collections::{BTreeMap, VecDeque};

use peerwall_backend::Event;

/// Events kept for readers.
pub const EVENT_LOG_SIZE: usize = 4096;
/// `peerwall_drops_total` series kept (labels are rules of the policy; this bounds them even
/// across many policy changes).
pub const MAX_DROP_SERIES: usize = 4096;

/// (rule, verdict, source, destination) pairs counted between two drop summaries at most:
/// beyond, new pairs wait for the next period (the summary reports the largest five per
/// table anyway).
pub const MAX_PENDING_DROPS: usize = 4096;

/// Drop counts by (table, chain, rule, verdict).
pub type DropCounts = BTreeMap<(String, String, String, &'static str), u64>;

/// Numbers of events, across every log of the process (the gateway-pod mode keeps one log per
/// gateway and serves them merged, in number order).
static NUMBERED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The last number given to an event in this process.
pub fn last_number() -> u64 {
    NUMBERED.load(std::sync::atomic::Ordering::SeqCst)
}

/// The last events, numbered, and the drop counts.
#[derive(Debug, Default, Clone)]
pub struct EventLog {
    ring: VecDeque<(u64, Event)>,
    /// Packets dropped, rejected or audited per rule, as the events counted them.
    pub drops: DropCounts,
    /// Packets dropped per (rule, verdict, source, destination) since the last
    /// [`EventLog::take_drop_summary`].
    pending: BTreeMap<DropKey, u64>,
    /// Whether events are being read.
    pub on: bool,
}

impl EventLog {
    /// Record one event.
    pub fn push(&mut self, e: Event) {
        if let Some(v) = e.verdict.drop_label() {
            let key = (
                e.table.clone(),
                e.chain.clone(),
                e.rule.clone().unwrap_or_else(|| "policy".into()),
                v,
            );
            let pending = (key.0.clone(), key.1.clone(), key.2.clone(), v, e.src, e.dst);
            if self.drops.contains_key(&key) || self.drops.len() < MAX_DROP_SERIES {
                *self.drops.entry(key).or_default() += e.packets;
            }
            if self.pending.contains_key(&pending) || self.pending.len() < MAX_PENDING_DROPS {
                *self.pending.entry(pending).or_default() += e.packets;
            }
        }
        let n = NUMBERED.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        self.ring.push_back((n, e));
        while self.ring.len() > EVENT_LOG_SIZE {
            self.ring.pop_front();
        }
    }

    /// Events numbered after `after`, and the number to ask after next time.
    pub fn after(&self, after: u64) -> (Vec<(u64, &Event)>, u64) {
        let next = last_number();
        let v = self
            .ring
            .iter()
            .filter(|(n, _)| *n > after && *n <= next)
            .map(|(n, e)| (*n, e))
            .collect();
        (v, next)
    }

    /// `after`'s answer as NDJSON: one event per line.
    pub fn ndjson_after(&self, after: u64) -> (String, u64) {
        let (events, next) = self.after(after);
        (ndjson(events.into_iter().map(|(_, e)| e)), next)
    }
}

/// Events as NDJSON, one per line.
pub fn ndjson<'a>(events: impl Iterator<Item = &'a Event>) -> String {
    let mut out = String::new();
    for e in events {
        if let Ok(line) = serde_json::to_string(e) {
            out.push_str(&line);
            out.push('\n');
        }
    }
    out
}

/// Packets one rule dropped (or would have) between two addresses, over a period: what the
/// agent reports as a Kubernetes Event on the rule's object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DropSummary {
    /// Table.
    pub table: String,
    /// Chain.
    pub chain: String,
    /// Rule (`policy` for the chain policy).
    pub rule: String,
    /// `drop`, `reject` or `audit`.
    pub verdict: &'static str,
    /// Source.
    pub src: std::net::IpAddr,
    /// Destination.
    pub dst: std::net::IpAddr,
    /// Packets.
    pub packets: u64,
}

impl EventLog {
    /// The drops counted since the last call, by (rule, verdict, source, destination), the
    /// `per_table` largest of each table; the count starts again from zero.
    ///
    /// Counted as events arrive, not by packet time: a backend may deliver an event well
    /// after its packet (NFLOG batches in the kernel), and a window of packet times misses
    /// every event that arrives after its window closed. Nor is it read from the ring, which a
    /// long period of drops overruns.
    pub fn take_drop_summary(&mut self, per_table: usize) -> Vec<DropSummary> {
        let mut all: Vec<DropSummary> = std::mem::take(&mut self.pending)
            .into_iter()
            .map(
                |((table, chain, rule, verdict, src, dst), packets)| DropSummary {
                    table,
                    chain,
                    rule,
                    verdict,
                    src,
                    dst,
                    packets,
                },
            )
            .collect();
        all.sort_by(|a, b| a.table.cmp(&b.table).then(b.packets.cmp(&a.packets)));
        let mut out: Vec<DropSummary> = Vec::new();
        for s in all {
            if out.iter().filter(|o| o.table == s.table).count() < per_table {
                out.push(s);
            }
        }
        out
    }
}

type DropKey = (
    String,
    String,
    String,
    &'static str,
    std::net::IpAddr,
    std::net::IpAddr,
);

#[cfg(test)]
mod tests {
    use super::*;
    use peerwall_backend::EventKind;

    fn ev(kind: EventKind, rule: Option<&str>, packets: u64) -> Event {
        Event {
            time: std::time::UNIX_EPOCH,
            verdict: kind,
            table: "t".into(),
            chain: "c".into(),
            rule: rule.map(String::from),
            src: "10.0.0.1".parse().unwrap(),
            dst: "10.0.0.2".parse().unwrap(),
            proto: 1,
            sport: 0,
            dport: 8,
            iif: String::new(),
            oif: String::new(),
            ct_state: None,
            packets,
            bytes: 84 * packets,
        }
    }

    #[test]
    fn readers_get_what_came_after_their_mark_and_drops_are_counted_per_rule() {
        let mut log = EventLog::default();
        log.push(ev(EventKind::Drop, Some("r"), 3));
        log.push(ev(EventKind::AuditDrop, None, 2));
        log.push(ev(EventKind::Accept, Some("ok"), 1));
        let (all, next) = log.after(0);
        assert_eq!(all.len(), 3);
        assert!(next >= all[2].0);
        let (tail, _) = log.after(all[1].0);
        assert_eq!(tail.len(), 1);
        assert_eq!(tail[0].1.verdict, EventKind::Accept);
        assert_eq!(log.drops[&("t".into(), "c".into(), "r".into(), "drop")], 3);
        assert_eq!(
            log.drops[&("t".into(), "c".into(), "policy".into(), "audit")],
            2
        );
        assert_eq!(log.drops.len(), 2);
        let (text, _) = log.ndjson_after(all[1].0);
        assert_eq!(text.lines().count(), 1);
        for _ in 0..EVENT_LOG_SIZE + 10 {
            log.push(ev(EventKind::Drop, Some("r"), 1));
        }
        assert_eq!(log.after(0).0.len(), EVENT_LOG_SIZE);
    }

    /// A summary holds what arrived since the previous one, whatever the packets' times (NFLOG
    /// delivers a packet's event up to a second late), each packet once, even when the ring
    /// overran in between.
    #[test]
    fn drop_summaries_count_each_arrival_once_whatever_its_packet_time() {
        let mut log = EventLog::default();
        log.push(ev(EventKind::Drop, Some("r"), 3));
        log.push(ev(EventKind::AuditDrop, None, 2));
        log.push(ev(EventKind::Accept, Some("ok"), 1));
        let s = log.take_drop_summary(5);
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].packets, s[1].packets), (3, 2));
        assert_eq!((s[0].verdict, s[1].verdict), ("drop", "audit"));
        assert!(log.take_drop_summary(5).is_empty(), "counted once");
        // Arrives after the summary, stamped long before it.
        log.push(ev(EventKind::Drop, Some("r"), 1));
        let s = log.take_drop_summary(5);
        assert_eq!((s.len(), s[0].packets), (1, 1));
        for _ in 0..EVENT_LOG_SIZE + 10 {
            log.push(ev(EventKind::Drop, Some("r"), 1));
        }
        let s = log.take_drop_summary(5);
        assert_eq!(s[0].packets as usize, EVENT_LOG_SIZE + 10);
        // The largest five pairs of a table.
        for i in 0..8u8 {
            let mut e = ev(EventKind::Drop, Some("r"), u64::from(i) + 1);
            e.src = std::net::IpAddr::from([10, 0, 1, i]);
            log.push(e);
        }
        let s = log.take_drop_summary(5);
        let packets: Vec<u64> = s.iter().map(|d| d.packets).collect();
        assert_eq!(packets, [8, 7, 6, 5, 4]);
    }
}
