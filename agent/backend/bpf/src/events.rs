//! Events of the bpf backend: the datapath writes [`FlowEvent`]s into the pinned `EVENTS` ring
//! buffer (rate-limited per flow and per CPU in the kernel, `ebpf/src/events.rs`); [`BpfEvents`]
//! reads them and names their chain and rule from the slot metadata the loader writes
//! ([`crate::inspect::meta_path`]). Works from the agent and, straight from the pins, from
//! `peerwall observe` when no agent runs. A ring buffer has one reader position: run one
//! reader per pin directory.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aya::maps::{MapData, RingBuf};
use peerwall_backend::{Event, EventError, EventKind, EventSource, IfNames};
use peerwall_common::{event, family, map, EventConfig, FlowEvent};
use peerwall_policy::ir::CtState;

use crate::meta::{meta_path, SlotMeta};

mod bursts;

/// Event settings of the datapath (`EVENT_CONF` and the `EVENTS`/`FLOW_LOG` flags).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventSettings {
    /// Also report the first packet of each accepted flow, per accepting chain.
    pub flow_log: bool,
    /// Events per second per CPU.
    pub rate: u32,
    /// Burst.
    pub burst: u32,
    /// At most one event per flow, kind and rule in this interval.
    pub interval: Duration,
}

impl EventSettings {
    /// The kernel's form.
    pub fn config(&self) -> EventConfig {
        EventConfig {
            flow_interval_ns: self.interval.as_nanos().min(u64::MAX as u128) as u64,
            rate: self.rate,
            burst: self.burst.max(1),
        }
    }
}

/// Whether the datapath pinned in `pin_dir` reports events (its `EVENTS` flag): without it,
/// nothing will ever arrive in the ring buffer.
pub fn events_enabled(pin_dir: &Path) -> Result<bool, crate::error::BpfError> {
    let path = pin_dir.join(map::CONFIG);
    let data = MapData::from_pin(&path).map_err(|source| crate::error::BpfError::Map {
        map: path.display().to_string(),
        source,
    })?;
    let config: aya::maps::Array<MapData, peerwall_common::Config> =
        aya::maps::Array::try_from(aya::maps::Map::Array(data)).map_err(|source| {
            crate::error::BpfError::Map {
                map: map::CONFIG.to_string(),
                source,
            }
        })?;
    let c = config
        .get(&0, 0)
        .map_err(|source| crate::error::BpfError::Map {
            map: map::CONFIG.to_string(),
            source,
        })?;
    Ok(c.flags & peerwall_common::flags::EVENTS != 0)
}

/// The reader of a pinned datapath's events.
pub struct BpfEvents {
    ring: RingBuf<MapData>,
    pin_dir: PathBuf,
    ifnames: IfNames,
    metas: [Option<(SystemTime, SlotMeta)>; 2],
    /// Wall clock minus CLOCK_MONOTONIC (what `bpf_ktime_get_ns` counts).
    offset: Duration,
    /// The ends of bursts (None: a datapath without per-flow state of this layout), and
    /// when to look for them next (CLOCK_MONOTONIC).
    bursts: Option<bursts::Bursts>,
    next_bursts: Duration,
}

fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> EventError {
    move |source| EventError::Io { what, source }
}

fn monotonic() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid timespec pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

impl BpfEvents {
    /// Open the ring buffer pinned in `pin_dir`; interface names are those of the calling
    /// thread's network namespace.
    pub fn open(pin_dir: &Path) -> Result<Self, EventError> {
        let path = pin_dir.join(map::EVENTS);
        let data = MapData::from_pin(&path).map_err(|e| EventError::Io {
            what: "opening the pinned EVENTS ring buffer",
            source: std::io::Error::other(format!("{}: {e}", path.display())),
        })?;
        let ring =
            RingBuf::try_from(aya::maps::Map::RingBuf(data)).map_err(|e| EventError::Io {
                what: "mapping the EVENTS ring buffer",
                source: std::io::Error::other(e.to_string()),
            })?;
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        Ok(Self {
            ring,
            pin_dir: pin_dir.to_path_buf(),
            ifnames: IfNames::here()?,
            metas: [None, None],
            offset: wall.saturating_sub(monotonic()),
            bursts: bursts::Bursts::open(pin_dir),
            next_bursts: Duration::ZERO,
        })
    }

    /// The names of `slot`, re-read when the loader rewrote them.
    fn meta(&mut self, slot: usize) -> Option<&SlotMeta> {
        let path = meta_path(&self.pin_dir, slot as u32);
        let mtime = std::fs::metadata(&path).and_then(|m| m.modified()).ok()?;
        let fresh = self.metas[slot].as_ref().is_some_and(|(t, _)| *t == mtime);
        if !fresh {
            let text = std::fs::read_to_string(&path).ok()?;
            let meta: SlotMeta = serde_json::from_str(&text).ok()?;
            self.metas[slot] = Some((mtime, meta));
        }
        self.metas[slot].as_ref().map(|(_, m)| m)
    }

    fn event(&mut self, f: &FlowEvent) -> Option<Event> {
        let verdict = match f.kind {
            event::DROP => EventKind::Drop,
            event::REJECT => EventKind::Reject,
            event::AUDIT_DROP => EventKind::AuditDrop,
            event::AUDIT_REJECT => EventKind::AuditReject,
            event::ACCEPT => EventKind::Accept,
            _ => return None,
        };
        let (table, chain, rule) = match self.meta((f.epoch & 1) as usize) {
            Some(m) => match m.chains.get(f.chain as usize) {
                Some(c) => (
                    c.table.clone(),
                    c.chain.clone(),
                    (f.rule != event::POLICY).then(|| {
                        c.rules
                            .get(f.rule as usize)
                            .cloned()
                            .unwrap_or_else(|| format!("#{}", f.rule))
                    }),
                ),
                None => (String::new(), format!("#{}", f.chain), None),
            },
            None => (String::new(), format!("#{}", f.chain), None),
        };
        let addr = |b: &[u8; 16]| -> std::net::IpAddr {
            if f.family == family::V4 {
                std::net::Ipv4Addr::new(b[0], b[1], b[2], b[3]).into()
            } else {
                std::net::Ipv6Addr::from(*b).into()
            }
        };
        let ct_state = match u32::from(f.state) {
            peerwall_common::ct::NEW => CtState::New,
            peerwall_common::ct::ESTABLISHED => CtState::Established,
            peerwall_common::ct::RELATED => CtState::Related,
            peerwall_common::ct::UNTRACKED => CtState::Untracked,
            _ => CtState::Invalid,
        };
        Some(Event {
            time: UNIX_EPOCH + self.offset + Duration::from_nanos(f.ts_ns),
            verdict,
            table,
            chain,
            rule,
            src: addr(&f.src),
            dst: addr(&f.dst),
            proto: f.proto,
            sport: f.sport,
            dport: f.dport,
            iif: self.ifnames.name(f.iif),
            oif: self.ifnames.name(f.oif),
            ct_state: Some(ct_state),
            packets: f.packets,
            bytes: f.bytes,
        })
    }

    fn drain(&mut self, out: &mut Vec<Event>) {
        let mut raw = Vec::new();
        while let Some(item) = self.ring.next() {
            if item.len() >= std::mem::size_of::<FlowEvent>() {
                // SAFETY: the datapath writes whole FlowEvents; read unaligned from the ring.
                raw.push(unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<FlowEvent>()) });
            }
            if raw.len() >= 4096 {
                break;
            }
        }
        out.extend(raw.iter().filter_map(|f| self.event(f)));
    }
}

impl BpfEvents {
    /// The ends of bursts ([`bursts`]), when it is time to look.
    fn ends_of_bursts(&mut self, out: &mut Vec<Event>) {
        let now = monotonic();
        let Some(b) = self.bursts.as_mut() else {
            return;
        };
        if now < self.next_bursts {
            return;
        }
        self.next_bursts = now + b.period();
        let raw = b.take(now.as_nanos().min(u64::MAX as u128) as u64);
        out.extend(raw.iter().filter_map(|f| self.event(f)));
    }
}

impl EventSource for BpfEvents {
    fn next_batch(&mut self, timeout: Duration) -> Result<Vec<Event>, EventError> {
        let mut out = Vec::new();
        self.drain(&mut out);
        if out.is_empty() {
            use std::os::fd::AsFd;
            peerwall_backend::events::wait_readable(self.ring.as_fd(), timeout)
                .map_err(io("waiting for bpf events"))?;
            self.drain(&mut out);
        }
        self.ends_of_bursts(&mut out);
        Ok(out)
    }
}
