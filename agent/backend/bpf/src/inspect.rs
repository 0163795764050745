//! `peerwall inspect`: decode a pinned datapath (maps and counters) without loading anything.
//!
//! Maps are opened from their pins; chain and rule names come from the metadata file the loader
//! writes next to nothing in bpffs (bpffs holds only BPF objects) but under
//! `/run/peerwall/<pin dir>/slot<N>.json`. Without it, chains and rules show as ids.

use peerwall_common::map;
use std::path::Path;

use aya::maps::{Array, HashMap as BpfHashMap, LpmTrie, Map, MapData, PerCpuArray};
use peerwall_common::{
    AddrKeyData, Bitmap, ChainInfo, Config, Counter, HookChains, PortKeyData, ProtoKey, RuleInfo,
    MAX_RULES,
};
use serde::Serialize;

use crate::error::BpfError;
use crate::loader::attached_in;

pub use crate::meta::{meta_path, write_meta, ChainMeta, SlotMeta, META_ROOT};

fn open(pin_dir: &Path, name: &str) -> Result<MapData, BpfError> {
    let path = pin_dir.join(name);
    MapData::from_pin(&path).map_err(|source| BpfError::Map {
        map: path.display().to_string(),
        source,
    })
}

fn map_err(name: &str) -> impl FnOnce(aya::maps::MapError) -> BpfError + '_ {
    move |source| BpfError::Map {
        map: name.to_string(),
        source,
    }
}

/// One rule's state.
#[derive(Clone, Debug, Serialize)]
pub struct RuleState {
    /// Bit / index.
    pub index: u32,
    /// Name (or `#index` without metadata).
    pub name: String,
    /// accept / drop / reject.
    pub action: &'static str,
    /// Packets (all CPUs); None: past the counter table, not counted.
    pub packets: Option<u64>,
    /// Bytes (all CPUs).
    pub bytes: Option<u64>,
}

/// One chain's state.
#[derive(Clone, Debug, Serialize)]
pub struct ChainState {
    /// Chain id.
    pub id: u32,
    /// table/chain (or `#id`).
    pub name: String,
    /// Policy.
    pub policy: &'static str,
    /// Packets decided by the policy (None: past the counter table, not counted).
    pub policy_packets: Option<u64>,
    /// Rules.
    pub rules: Vec<RuleState>,
}

/// A decoded pinned datapath.
#[derive(Clone, Debug, Serialize)]
pub struct Inspection {
    /// Pin directory.
    pub pin_dir: String,
    /// Live slot.
    pub active_slot: u32,
    /// Emergency switch on.
    pub allow_all: bool,
    /// Attached programs (`tc:liqo-tunnel`, `xdp:liqo.abc`).
    pub attached: Vec<String>,
    /// Entries per map of the live slot.
    pub entries: Vec<(String, usize)>,
    /// Hooks: `hook/family -> chain ids`.
    pub hooks: Vec<String>,
    /// Chains with counters.
    pub chains: Vec<ChainState>,
    /// Tracked flows.
    pub flows: usize,
    /// Conntrack's shortcut for unknown flows is armed (`FLOW_SEEN`: off while a program that
    /// does not keep it, an older release's, is attached here).
    pub flow_seen: bool,
    /// Whose connection table TCP and UDP take their state from, per family: `kernel`
    /// (`--bpf-conntrack`) or `own`.
    pub conntrack: Vec<String>,
    /// Destination rewrites of the live slot (`VIEW<s>`): `ifindex N: FROM -> TO`.
    pub views: Vec<String>,
    /// Where new flows' paths come from, per family: the local-address mirror (`LOCAL`,
    /// `ROUTES`) or the FIB, and why.
    pub paths: Vec<String>,
    /// The kernel memory its pinned maps hold.
    pub memory: crate::memory::PinnedMemory,
    /// The live slot's exact-match host maps: hosts past their capacity are in the tries.
    pub host_maps: Vec<HostMap>,
}

/// An exact-match host map of the live slot.
#[derive(Clone, Debug, Serialize)]
pub struct HostMap {
    /// Pin name (`SRCH1`).
    pub name: String,
    /// Hosts it holds.
    pub hosts: usize,
    /// Hosts it can hold (`--host-table-size` when it was created).
    pub capacity: u32,
    /// Its one-line table (`HOST_LINES`): None where none is pinned (an older peerwall).
    pub lines: Option<HostLines>,
}

/// The one-line table in front of a host map (`peerwall_common::lines`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct HostLines {
    /// Whether lookups read it (else they ask the host map).
    pub on: bool,
    /// Its lines.
    pub lines: u32,
    /// IPv4 hosts it holds.
    pub hosts: usize,
    /// Lines whose further hosts are asked from the host map.
    pub overflowed: usize,
}

/// The one-line table `table` in `pin_dir`'s `HOST_LINES`, as its entries say.
fn host_lines(pin_dir: &Path, table: u32) -> Result<Option<HostLines>, BpfError> {
    use peerwall_common::{HostLine, HOST_LINES_ON, HOST_LINE_OVERFLOW, HOST_LINE_SLOTS};
    if !pin_dir.join(map::HOST_LINES).exists() {
        return Ok(None);
    }
    let m: Array<MapData, HostLine> = Array::try_from(Map::Array(open(pin_dir, map::HOST_LINES)?))
        .map_err(map_err(map::HOST_LINES))?;
    let head = m.get(&0, 0).map_err(map_err(map::HOST_LINES))?;
    let h = head.w[(table as usize).min(7)];
    let mask = h as u32;
    let mut out = HostLines {
        on: h & HOST_LINES_ON != 0,
        ..HostLines::default()
    };
    if !out.on {
        return Ok(Some(out));
    }
    out.lines = mask.wrapping_add(1);
    for l in 1..=out.lines {
        let e = peerwall_common::host_line_entry(table, l, mask);
        let line = m.get(&e, 0).map_err(map_err(map::HOST_LINES))?;
        out.hosts += (0..HOST_LINE_SLOTS)
            .filter(|i| line.w[1 + 2 * i] != 0)
            .count();
        out.overflowed += usize::from(line.w[0] & HOST_LINE_OVERFLOW != 0);
    }
    Ok(Some(out))
}

fn action_name(a: u8) -> &'static str {
    match peerwall_common::ActionCode::from_u8(a) {
        Some(peerwall_common::ActionCode::Accept) => "accept",
        Some(peerwall_common::ActionCode::Drop) => "drop",
        Some(peerwall_common::ActionCode::Reject) => "reject",
        Some(peerwall_common::ActionCode::AuditDrop) => "drop (audit)",
        Some(peerwall_common::ActionCode::AuditReject) => "reject (audit)",
        None => "?",
    }
}

// size: one read per pinned map, in the order `peerwall inspect` prints them; no decision to cut
// out.
/// Decode the pinned datapath in `pin_dir`.
pub fn inspect(pin_dir: &Path) -> Result<Inspection, BpfError> {
    let config: Array<MapData, Config> =
        Array::try_from(Map::Array(open(pin_dir, map::CONFIG)?)).map_err(map_err(map::CONFIG))?;
    let cfg = config.get(&0, 0).map_err(map_err(map::CONFIG))?;
    let slot = cfg.active & 1;
    let allow: Array<MapData, u32> = Array::try_from(Map::Array(open(pin_dir, map::ALLOW_ALL)?))
        .map_err(map_err(map::ALLOW_ALL))?;
    let allow_all = allow.get(&0, 0).map_err(map_err(map::ALLOW_ALL))? != 0
        || cfg.flags & peerwall_common::flags::ALLOW_ALL != 0;
    let meta: SlotMeta = std::fs::read_to_string(meta_path(pin_dir, slot))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
    let s = slot.to_string();
    let mut entries = Vec::new();
    let mut host_maps = Vec::new();
    for (name, hosts) in [(map::SRC, map::SRCH), (map::DST, map::DSTH)] {
        let n = format!("{name}{s}");
        let m: LpmTrie<MapData, AddrKeyData, Bitmap> =
            LpmTrie::try_from(Map::LpmTrie(open(pin_dir, &n)?)).map_err(map_err(&n))?;
        entries.push((n, m.keys().count()));
        let n = format!("{hosts}{s}");
        let d = open(pin_dir, &n)?;
        let capacity = d.info().map_err(map_err(&n))?.max_entries();
        let m: BpfHashMap<MapData, AddrKeyData, Bitmap> =
            BpfHashMap::try_from(Map::HashMap(d)).map_err(map_err(&n))?;
        let count = m.keys().count();
        let table = peerwall_common::host_table(slot, hosts == map::DSTH);
        host_maps.push(HostMap {
            name: n.clone(),
            hosts: count,
            capacity,
            lines: host_lines(pin_dir, table)?,
        });
        entries.push((n, count));
    }
    for name in [map::SPORT, map::DPORT] {
        let n = format!("{name}{s}");
        let m: LpmTrie<MapData, PortKeyData, Bitmap> =
            LpmTrie::try_from(Map::LpmTrie(open(pin_dir, &n)?)).map_err(map_err(&n))?;
        entries.push((n, m.keys().count()));
    }
    let n = format!("{}{s}", map::PROTO);
    let m: BpfHashMap<MapData, ProtoKey, Bitmap> =
        BpfHashMap::try_from(Map::HashMap(open(pin_dir, &n)?)).map_err(map_err(&n))?;
    entries.push((n, m.keys().count()));
    let m: BpfHashMap<MapData, peerwall_common::FlowKey, peerwall_common::FlowState> =
        BpfHashMap::try_from(Map::LruHashMap(open(pin_dir, map::FLOWS)?))
            .map_err(map_err(map::FLOWS))?;
    let mut flows = m.keys().count();
    // Flows not replied yet: the occupied slots of FLOWS_NEW (a datapath pinned by a release
    // before the split has none; one before the array, an LRU hash, replaced at its next load).
    let path = pin_dir.join(map::FLOWS_NEW);
    if path.exists() {
        match MapData::from_pin(&path).map_err(map_err(map::FLOWS_NEW))? {
            d if matches!(
                d.info().map(|i| i.map_type()),
                Ok(Ok(aya::maps::MapType::Array))
            ) =>
            {
                flows += crate::loader::occupied_new_flow_slots(&d)?.len();
            }
            d => {
                let m: BpfHashMap<MapData, peerwall_common::FlowKey, peerwall_common::FlowState> =
                    BpfHashMap::try_from(Map::LruHashMap(d)).map_err(map_err(map::FLOWS_NEW))?;
                flows += m.keys().count();
            }
        }
    }
    let hn = format!("{}{s}", map::HOOKS);
    let hooks_map: Array<MapData, HookChains> =
        Array::try_from(Map::Array(open(pin_dir, &hn)?)).map_err(map_err(&hn))?;
    let cn = format!("{}{s}", map::CHAINS);
    let chains_map: Array<MapData, ChainInfo> =
        Array::try_from(Map::Array(open(pin_dir, &cn)?)).map_err(map_err(&cn))?;
    let rn = format!("{}{s}", map::RULES);
    let rules_map: Array<MapData, RuleInfo> =
        Array::try_from(Map::Array(open(pin_dir, &rn)?)).map_err(map_err(&rn))?;
    let kn = format!("{}{s}", map::COUNTERS);
    let counters: PerCpuArray<MapData, Counter> =
        PerCpuArray::try_from(Map::PerCpuArray(open(pin_dir, &kn)?)).map_err(map_err(&kn))?;
    // Past the table's end: the rule is enforced, not counted.
    let capacity = counters.len();
    let count = |idx: u32| -> Result<(Option<u64>, Option<u64>), BpfError> {
        if idx >= capacity {
            return Ok((None, None));
        }
        let v = counters.get(&idx, 0).map_err(map_err(&kn))?;
        let (p, b) = v
            .iter()
            .fold((0, 0), |(p, b), c| (p + c.packets, b + c.bytes));
        Ok((Some(p), Some(b)))
    };
    let names = ["prerouting", "input", "forward", "output", "postrouting"];
    let mut hooks = Vec::new();
    let mut ids: Vec<u32> = Vec::new();
    for i in 0..10u32 {
        let h = hooks_map.get(&i, 0).map_err(map_err(&hn))?;
        let used = &h.chains[..(h.count as usize).min(h.chains.len())];
        if !used.is_empty() {
            hooks.push(format!(
                "{}/ipv{} -> {:?}",
                names[(i / 2) as usize],
                if i % 2 == 0 { 4 } else { 6 },
                used
            ));
            ids.extend(used);
        }
    }
    ids.sort_unstable();
    ids.dedup();
    let mut chains = Vec::new();
    for id in ids {
        let info = chains_map.get(&id, 0).map_err(map_err(&cn))?;
        let cm = meta.chains.get(id as usize);
        let mut rules = Vec::new();
        for r in 0..info.rules {
            let idx = id * MAX_RULES as u32 + r;
            let ri = rules_map.get(&idx, 0).map_err(map_err(&rn))?;
            let (packets, bytes) = count(u32::from(info.counters) + r)?;
            rules.push(RuleState {
                index: r,
                name: cm
                    .and_then(|c| c.rules.get(r as usize).cloned())
                    .unwrap_or_else(|| format!("#{r}")),
                action: action_name(ri.action),
                packets,
                bytes,
            });
        }
        let (policy_packets, _) = count(u32::from(info.counters) + info.rules)?;
        chains.push(ChainState {
            id,
            name: cm.map_or(format!("#{id}"), |c| format!("{}/{}", c.table, c.chain)),
            policy: action_name(info.policy),
            policy_packets,
            rules,
        });
    }
    let vn = format!("{}{s}", map::VIEW);
    let view_map: LpmTrie<MapData, AddrKeyData, peerwall_common::ViewTarget> =
        LpmTrie::try_from(Map::LpmTrie(open(pin_dir, &vn)?)).map_err(map_err(&vn))?;
    let mut views = Vec::new();
    for item in view_map.iter() {
        let (k, t) = item.map_err(map_err(&vn))?;
        let d = k.data();
        let len = k
            .prefix_len()
            .saturating_sub(peerwall_common::ADDR_KEY_FIXED_BITS);
        let (from, to) = if u32::from_be_bytes(d.family) == u32::from(peerwall_common::family::V4) {
            let a = |b: &[u8; 16]| std::net::Ipv4Addr::new(b[0], b[1], b[2], b[3]).to_string();
            (a(&d.addr), a(&t.to))
        } else {
            (
                std::net::Ipv6Addr::from(d.addr).to_string(),
                std::net::Ipv6Addr::from(t.to).to_string(),
            )
        };
        views.push(format!(
            "ifindex {}: {from}/{len} -> {to}/{}",
            u32::from_be_bytes(d.chain),
            t.prefix_len
        ));
    }
    views.sort();
    let attached = attached_in(pin_dir);
    let swept = kernel_swept(pin_dir);
    Ok(Inspection {
        pin_dir: pin_dir.display().to_string(),
        active_slot: slot,
        allow_all,
        attached,
        entries,
        hooks,
        chains,
        flows,
        flow_seen: cfg.flags & peerwall_common::flags::FLOW_SEEN != 0,
        conntrack: [
            ("IPv4", peerwall_common::flags::KERNEL_CT4),
            ("IPv6", peerwall_common::flags::KERNEL_CT6),
        ]
        .iter()
        .map(|(f, bit)| {
            let whose = if cfg.flags & bit == 0 {
                "the datapath's own tables".to_string()
            } else {
                match swept {
                    Some(s) if s > 0 => format!("the kernel's table, its connections stamped for {s} s more (the agent's sweep: new flows known without asking the kernel)"),
                    _ => "the kernel's table, not swept (every packet asks the kernel: run the agent, or apply again)".to_string(),
                }
            };
            format!("{f} TCP and UDP: {whose}")
        })
        .collect(),
        views,
        paths: paths(pin_dir, &cfg),
        memory: crate::memory::pinned_memory(pin_dir)?,
        host_maps,
    })
}

/// Per family, where the datapath takes new flows' paths from (`route.rs`'s conditions).
fn paths(pin_dir: &Path, cfg: &peerwall_common::Config) -> Vec<String> {
    use peerwall_common::{flags, routes, RouteMirror};
    let lease = open(pin_dir, map::ROUTES)
        .ok()
        .and_then(|d| Array::<MapData, RouteMirror>::try_from(Map::Array(d)).ok())
        .and_then(|a| a.get(&0, 0).ok());
    let local = open(pin_dir, map::LOCAL)
        .ok()
        .and_then(|d| LpmTrie::<MapData, AddrKeyData, u32>::try_from(Map::LpmTrie(d)).ok())
        .map_or(0, |t| t.keys().count());
    let now = crate::loader::ktime_ns();
    [("IPv4", routes::V4), ("IPv6", routes::V6)]
        .into_iter()
        .map(|(name, bit)| {
            let why = match lease {
                None => Some("no mirror pinned"),
                Some(_) if cfg.flags & flags::oif_tested(cfg.active & 1) != 0 => {
                    Some("a chain tests the output interface")
                }
                Some(_) if cfg.flags & flags::EVENTS != 0 => {
                    Some("events name the output interface")
                }
                Some(l) if l.families & bit == 0 => {
                    Some("the routing does not allow the mirror (the agent's log says why)")
                }
                Some(l) if l.until_ns <= now => Some("the lease ran out (no agent renews it)"),
                Some(_) => None,
            };
            match why {
                None => format!(
                    "{name} from the local-address mirror ({local} local prefixes, both families)"
                ),
                Some(w) => format!("{name} from the FIB: {w}"),
            }
        })
        .collect()
}

/// How many seconds the agent's last sweep of the kernel's table still vouches for (`CT_SWEPT`,
/// `sweep.rs`); 0 when lapsed, None when unreadable (a datapath pinned before the sweep).
fn kernel_swept(pin_dir: &Path) -> Option<u64> {
    let m: Array<MapData, u64> =
        Array::try_from(Map::Array(open(pin_dir, map::CT_SWEPT).ok()?)).ok()?;
    let until = m.get(&0, 0).ok()?;
    Some(until.saturating_sub(crate::loader::ktime_ns()) / 1_000_000_000)
}

/// Text rendering of an inspection.
pub fn text(i: &Inspection) -> String {
    let mut s = format!(
        "pins {}\nactive slot {}{}\nattached {}\nflows {} (unknown flows known without a lookup: {})\n",
        i.pin_dir,
        i.active_slot,
        if i.allow_all { "  ALLOW-ALL IS ON" } else { "" },
        i.attached.join(" "),
        i.flows,
        if i.flow_seen {
            "on"
        } else {
            "off, a program attached here does not keep FLOW_SEEN"
        }
    );
    s.push_str(&format!(
        "kernel memory {}\n",
        crate::memory::text(&i.memory)
    ));
    for c in &i.conntrack {
        s.push_str(&format!("conntrack {c}\n"));
    }
    for p in &i.paths {
        s.push_str(&format!("paths {p}\n"));
    }
    for (m, n) in &i.entries {
        s.push_str(&format!("map {m}: {n} entries\n"));
    }
    for h in &i.host_maps {
        match &h.lines {
            Some(l) if l.on => s.push_str(&format!(
                "host-lines {}: on, {} IPv4 hosts in {} lines, {} lines overflowed (their further hosts asked from the host map)\n",
                h.name, l.hosts, l.lines, l.overflowed
            )),
            Some(_) => s.push_str(&format!(
                "host-lines {}: off (every host asked from the host map: fewer than half its hosts would have a slot, --host-table-size, or the slot is not written yet)\n",
                h.name
            )),
            None => {}
        }
        if h.hosts >= h.capacity as usize {
            s.push_str(&format!(
                "hosts {} is full ({} hosts, --host-table-size): the policy's further hosts are looked up in the trie, more slowly\n",
                h.name, h.capacity
            ));
        }
    }
    for v in &i.views {
        s.push_str(&format!("view {v}\n"));
    }
    for h in &i.hooks {
        s.push_str(&format!("hook {h}\n"));
    }
    for c in &i.chains {
        s.push_str(&format!(
            "chain {} {} policy {} ({})\n",
            c.id,
            c.name,
            c.policy,
            c.policy_packets
                .map_or("not counted".to_string(), |p| format!("{p} packets"))
        ));
        for r in &c.rules {
            match (r.packets, r.bytes) {
                (Some(p), Some(b)) => s.push_str(&format!(
                    "  {:>4} {:<24} {:<7} {:>10} packets {:>12} bytes\n",
                    r.index, r.name, r.action, p, b
                )),
                _ => s.push_str(&format!(
                    "  {:>4} {:<24} {:<7} not counted (past the counter table: --counter-table-size)\n",
                    r.index, r.name, r.action
                )),
            }
        }
    }
    s
}

impl Inspection {
    /// The rule counters of the live slot, as [`peerwall_backend::RuleCounter`]s (what
    /// `peerwall counters` prints for either backend).
    pub fn counters(&self) -> Vec<peerwall_backend::RuleCounter> {
        let mut out = Vec::new();
        for c in &self.chains {
            let (table, chain) = c.name.split_once('/').unwrap_or(("", &c.name));
            // A rule not counted has no counter to report.
            out.extend(c.rules.iter().filter_map(|r| {
                Some(peerwall_backend::RuleCounter {
                    table: table.to_string(),
                    chain: chain.to_string(),
                    rule: r.name.clone(),
                    packets: r.packets?,
                    bytes: r.bytes?,
                })
            }));
        }
        out
    }
}
