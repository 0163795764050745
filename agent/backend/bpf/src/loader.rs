//! The kernel edge of the bpf backend: load the embedded object, pin maps and links under a
//! bpffs directory, attach to interfaces (tcx ingress; XDP for early drop), write policies into
//! the idle copy of the maps and switch with one store, read counters.
//!
//! Pins (default `/sys/fs/bpf/peerwall/`): every map by its name (`SRC0`, `DSTH1`, `CONFIG`, ...),
//! and links as `links/<ifname>.tc` / `links/<ifname>.xdp`. Pinned links keep the programs
//! attached when the agent exits; a restarted agent reuses the pinned maps and links it finds,
//! so enforcement has no gap.

mod attach;
#[cfg(feature = "bench")]
mod baseline;
mod batch;
mod counters;
mod entries;
mod flows;
pub use flows::key_of;
pub(crate) use flows::occupied_new_flow_slots;
mod host;
mod layout;
mod lines;
mod linkinfo;
mod mapping;
mod names;
mod open;
mod options;
pub use kfunc::KernelCt;
pub use linkinfo::{filters_a_device, link_state, LinkState};
pub use options::{Conntrack, LoadOptions};
mod btf;
pub use btf::KernelBtf;
pub mod kfunc;
mod pins;
mod pool;
mod probe;
mod seen;
mod slots;
mod spare;
pub use spare::{keep_spares, spare_ready, spares_taken};

use entries::*;
pub use entries::{addr_key, port_key};
pub use host::{ensure_bpffs, host_ifaces, is_bpffs, matching, HostIface};
pub use layout::Layout;
use peerwall_common::map;
#[cfg(feature = "bench")]
use pins::pin_link;
pub use pins::{
    attached_in, link_pin_name, parse_link_pin_name, remove_pins, set_allow_all_pinned,
};
pub(crate) use seen::ktime_ns;

use std::path::{Path, PathBuf};

use aya::maps::{Array, HashMap as BpfHashMap, MapData};
use aya::Ebpf;
use peerwall_common::{Config, IfaceInfo};

use crate::maps::{self, BpfPolicy, Iface};
use peerwall_policy::ir;

/// The eBPF object, built by `agent/backend/bpf/build.rs` from `ebpf/`.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/peerwall"));

/// Default pin directory.
pub const PIN_DIR: &str = "/sys/fs/bpf/peerwall";
/// Name of the tc program in the object.
pub const TC_PROGRAM: &str = "peerwall_tc";
/// The tc entry for devices without a link-layer header (WireGuard, TUN).
pub const TC_L3_PROGRAM: &str = "peerwall_tc_l3";
/// The tc entry for every device type (`ebpf/src/l2.rs`), where the kernel offers its kfunc.
pub const TC_ANY_PROGRAM: &str = "peerwall_tc_any";
/// Name of the XDP program in the object.
pub const XDP_PROGRAM: &str = "peerwall_xdp";

pub(crate) use crate::error::map_err;
pub use crate::error::BpfError;

/// What a slot's maps hold, as written by this process (for O(changes) updates).
type SlotContents = Option<BpfPolicy>;

/// What an apply did.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct BpfApplyReport {
    /// Slot now live.
    pub active: u32,
    /// Map entries written or deleted.
    pub entries_changed: usize,
    /// Whether the change went to the idle slot and was switched to (else: in place).
    pub switched: bool,
    /// Trie prefixes in the policy.
    pub prefixes: usize,
    /// What of the policy the datapath does not enforce ([`diagnostics`]), and what it holds
    /// only in part (hosts past the host maps, rules past the counter table): warnings.
    pub diagnostics: Vec<String>,
}

/// What of `policy` the datapath does not enforce itself: rules whose action is not a verdict
/// (left to nftables), and NAT rewrites before the forward hook it cannot follow. Each names
/// its rule; none is an error.
pub fn diagnostics(policy: &ir::Policy) -> Vec<String> {
    let mut out: Vec<String> = maps::left_to_nftables(policy)
        .iter()
        .map(ToString::to_string)
        .collect();
    let (_, unexpressed) = policy.dst_rewrites();
    out.extend(unexpressed.iter().map(|u| {
        format!(
            "{}/{}/{}: {}: a NAT rule changes addresses before the forward hook in a way the datapath cannot follow; packets it rewrites are classified on their addresses at ingress",
            u.rule.table, u.rule.chain, u.rule.rule, u.why
        )
    }));
    out
}

/// The loaded datapath.
pub struct Datapath {
    ebpf: Ebpf,
    pin_dir: PathBuf,
    slots: [SlotContents; 2],
    active: u32,
    /// What the policy applied last does not get from the datapath ([`diagnostics`]): a set
    /// update changes no rule, so it reports these again instead of walking the rules.
    diagnostics: Vec<String>,
    /// The pinned links [`Datapath::arm_flow_seen`] found all stamping `FLOW_SEEN`, when it
    /// armed the shortcut (checked again when they change).
    seen_checked: Option<Vec<PathBuf>>,
    /// Whose connection table the program reads for TCP and UDP.
    conntrack: KernelCt,
    /// The families whose TCP and UDP it reads from the kernel's table
    /// ([`peerwall_common::kfunc::KERNEL_CT_V4`], `_V6`).
    kernel_families: u32,
    /// How many hosts the exact-match maps hold (the rest go into the tries) and how many
    /// counters the counter table holds.
    layout: Layout,
    /// How long a flow user space ended stays ended after its last packet, ns (the program's
    /// `ENDED_IDLE_NS`, as loaded).
    ended_idle_ns: u64,
    /// Whether [`TC_ANY_PROGRAM`] loads here: then every device gets it (one tc program).
    tc_any: bool,
}

impl std::fmt::Debug for Datapath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Datapath")
            .field("pin_dir", &self.pin_dir)
            .field("active", &self.active)
            .finish()
    }
}

/// Changes at most this many entries in place; more go through the idle slot.
const IN_PLACE_LIMIT: usize = 256;

impl Datapath {
    /// Load the object with its maps pinned in `pin_dir` (reusing maps already pinned there).
    pub fn load(pin_dir: &Path) -> Result<Self, BpfError> {
        Self::load_with(pin_dir, &LoadOptions::default())
    }

    /// [`load`](Self::load) as `opts` says (the flow table's size when it is created, how long
    /// ended flows stay ended). Where spares are kept ([`keep_spares`]) and `pin_dir` holds no
    /// datapath yet, the spare made ready for these options is taken instead of loading one;
    /// either way a spare for the next load is made once no load runs.
    pub fn load_with(pin_dir: &Path, opts: &LoadOptions) -> Result<Self, BpfError> {
        let loading = spare::Loading::start();
        let taken = spare::take(pin_dir, opts);
        let d = match taken {
            Some(d) => d,
            None => Self::load_fresh(pin_dir, opts)?,
        };
        drop(loading);
        spare::refill(pin_dir, opts);
        Ok(d)
    }

    /// Fill of the established flows' table (`FLOWS`, the one whose overflow costs
    /// connections): (live entries, capacity). Counting walks the keys (one syscall each;
    /// about 30 ms for a full table of 65536), so call it seldom.
    pub fn flow_table(&mut self) -> Result<(u64, u32), BpfError> {
        let m = self.map(map::FLOWS)?;
        let capacity = match m {
            aya::maps::Map::LruHashMap(d) => d.info().map_err(map_err(map::FLOWS))?.max_entries(),
            _ => return Err(BpfError::MissingMap(map::FLOWS.to_string())),
        };
        let flows: BpfHashMap<&mut MapData, peerwall_common::FlowKey, peerwall_common::FlowState> =
            BpfHashMap::try_from(self.map(map::FLOWS)?).map_err(map_err(map::FLOWS))?;
        let entries = flows.keys().filter(Result::is_ok).count() as u64;
        Ok((entries, capacity))
    }

    /// Pin directory.
    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    fn map(&mut self, name: &str) -> Result<&mut aya::maps::Map, BpfError> {
        self.ebpf
            .map_mut(name)
            .ok_or_else(|| BpfError::MissingMap(name.to_string()))
    }

    /// Current `CONFIG[0]`.
    pub fn config(&mut self) -> Result<Config, BpfError> {
        let m: Array<&mut MapData, Config> =
            Array::try_from(self.map(map::CONFIG)?).map_err(map_err(map::CONFIG))?;
        m.get(&0, 0).map_err(map_err(map::CONFIG))
    }

    fn set_config(&mut self, c: Config) -> Result<(), BpfError> {
        let mut m: Array<&mut MapData, Config> =
            Array::try_from(self.map(map::CONFIG)?).map_err(map_err(map::CONFIG))?;
        m.set(0, c, 0).map_err(map_err(map::CONFIG))
    }

    /// Whether the emergency switch is on (the `ALLOW_ALL` map or the config flag).
    pub fn allow_all(&mut self) -> Result<bool, BpfError> {
        let flag = self.config()?.flags & peerwall_common::flags::ALLOW_ALL != 0;
        let m: Array<&mut MapData, u32> =
            Array::try_from(self.map(map::ALLOW_ALL)?).map_err(map_err(map::ALLOW_ALL))?;
        Ok(flag || m.get(&0, 0).map_err(map_err(map::ALLOW_ALL))? != 0)
    }

    /// Emergency switch: pass everything (true) or enforce again (false).
    pub fn set_allow_all(&mut self, on: bool) -> Result<(), BpfError> {
        let mut m: Array<&mut MapData, u32> =
            Array::try_from(self.map(map::ALLOW_ALL)?).map_err(map_err(map::ALLOW_ALL))?;
        m.set(0, u32::from(on), 0).map_err(map_err(map::ALLOW_ALL))
    }

    /// Report events (Some: `EVENT_CONF` and the `EVENTS`, `FLOW_LOG` flags) or not (None).
    pub fn set_events(&mut self, ev: Option<crate::events::EventSettings>) -> Result<(), BpfError> {
        use peerwall_common::flags::{EVENTS, FLOW_LOG};
        if let Some(s) = ev {
            let mut m: Array<&mut MapData, peerwall_common::EventConfig> =
                Array::try_from(self.map(map::EVENT_CONF)?).map_err(map_err(map::EVENT_CONF))?;
            m.set(0, s.config(), 0).map_err(map_err(map::EVENT_CONF))?;
        }
        let mut c = self.config()?;
        c.flags &= !(EVENTS | FLOW_LOG);
        if let Some(s) = ev {
            c.flags |= EVENTS;
            if s.flow_log {
                c.flags |= FLOW_LOG;
            }
        }
        self.set_config(c)
    }

    /// Turn probe mode on (scratch engine only).
    pub fn set_probe_mode(&mut self) -> Result<(), BpfError> {
        let mut c = self.config()?;
        c.flags |= peerwall_common::flags::PROBE;
        self.set_config(c)
    }

    /// Tell the datapath how each interface frames packets.
    pub fn register_ifaces(&mut self, ifaces: &[HostIface]) -> Result<(), BpfError> {
        let mut m: BpfHashMap<&mut MapData, u32, IfaceInfo> =
            BpfHashMap::try_from(self.map(map::IFACES)?).map_err(map_err(map::IFACES))?;
        for i in ifaces {
            m.insert(i.ifindex, IfaceInfo { l2_len: i.l2_len }, 0)
                .map_err(map_err(map::IFACES))?;
        }
        Ok(())
    }

    /// Write `policy` for a host with `ifaces`: small trie-only changes in place on the live
    /// slot (each entry update is atomic and no other map changes), everything else into the
    /// idle slot followed by one switch of `CONFIG.active`.
    pub fn apply(
        &mut self,
        policy: &ir::Policy,
        ifaces: &[Iface],
    ) -> Result<BpfApplyReport, BpfError> {
        let new = maps::compile(policy, ifaces)?;
        let mut diagnostics = diagnostics(policy);
        for (dim, src) in [("source", true), ("destination", false)] {
            let hosts = new.host_count(src);
            if hosts > self.layout.hosts as usize {
                diagnostics.push(format!(
                    "the policy has {hosts} {dim} hosts and the host maps hold {}: the rest are looked up in the tries, and every change is written into the idle slot whole (--host-table-size)",
                    self.layout.hosts
                ));
            }
        }
        let counters = new.counter_count();
        if counters > self.layout.counters {
            diagnostics.push(format!(
                "the policy has {counters} counters (a rule or chain policy each) and the counter table holds {}: the rules past it are enforced but not counted (--counter-table-size)",
                self.layout.counters
            ));
        }
        let prefixes = new.prefix_count();
        let active = self.active as usize;
        let digest = crate::meta::digest(&new);
        // Opened over pins whose live slot already holds these very contents (a CLI `apply`
        // again, a restarted agent): nothing to write, counters and cached verdicts stay.
        if self.slots[active].is_none()
            && crate::meta::read_digest(&self.pin_dir, self.active)
                == Some(self.slot_digest(self.active, &digest)?)
        {
            // The load turned the one-line tables off (`lines.rs`): no packet reads them,
            // so the live slot's are written whole, and on.
            let hosts = self.slot_hosts(&new);
            self.write_lines(self.active, &hosts, false)?;
            self.slots[active] = Some(new);
            self.diagnostics.clone_from(&diagnostics);
            return Ok(BpfApplyReport {
                active: self.active,
                entries_changed: 0,
                switched: false,
                prefixes,
                diagnostics,
            });
        }
        if let Some(live) = &self.slots[active] {
            // In place only while no host moves between a host map and a trie.
            let fits = self.layout.fits(live) && self.layout.fits(&new);
            if fits && only_trie_entries_differ(live, &new) {
                let changes = count_changes(live, &new);
                if changes <= IN_PLACE_LIMIT {
                    let live = live.clone();
                    let n = self.write_slot(self.active, Some(&live), &new)?;
                    // A new epoch, same slot: verdicts cached under the old entries lapse.
                    let mut c = self.config()?;
                    c.active = c.active.wrapping_add(2);
                    self.set_config(c)?;
                    self.slots[active] = Some(new);
                    self.diagnostics.clone_from(&diagnostics);
                    let d = self.slot_digest(self.active, &digest)?;
                    crate::meta::write_digest(&self.pin_dir, self.active, &d);
                    return Ok(BpfApplyReport {
                        active: self.active,
                        entries_changed: n,
                        switched: false,
                        prefixes,
                        diagnostics,
                    });
                }
            }
        }
        let idle = self.active ^ 1;
        let old = self.slots[idle as usize].clone();
        let n = self.write_slot(idle, old.as_ref(), &new)?;
        // One store switches the slot and starts a new epoch (bit 0 is the slot).
        let mut c = self.config()?;
        c.active = (c.active & !1).wrapping_add(2) | idle;
        self.set_config(c)?;
        self.active = idle;
        self.slots[idle as usize] = Some(new);
        self.diagnostics.clone_from(&diagnostics);
        let d = self.slot_digest(idle, &digest)?;
        crate::meta::write_digest(&self.pin_dir, idle, &d);
        Ok(BpfApplyReport {
            active: idle,
            entries_changed: n,
            switched: true,
            prefixes,
            diagnostics,
        })
    }

    /// Make `policy` live when it differs from the live slot's only by `changes` (named
    /// address sets edited in place): the address entries they alter are recomputed by point
    /// queries ([`maps::set_delta`]) and written in place on the live slot, then a new epoch
    /// starts (no cached verdict of the old contents is served). `None`: the change needs a
    /// full [`apply`](Self::apply).
    pub fn update_sets(
        &mut self,
        policy: &ir::Policy,
        changes: &[ir::SetChange],
    ) -> Result<Option<BpfApplyReport>, BpfError> {
        let active = self.active as usize;
        let Some(live) = &self.slots[active] else {
            return Ok(None);
        };
        let Some(delta) = maps::set_delta(live, policy, changes) else {
            return Ok(None);
        };
        // In place only while every host, those added included, fits the host maps.
        let added = |src: bool| {
            let dir = if src { ir::Dir::Src } else { ir::Dir::Dst };
            delta
                .iter()
                .filter(|c| c.dir == dir && c.value.is_some() && is_host(&c.net))
                .count()
        };
        let cap = self.layout.hosts as usize;
        if [true, false]
            .into_iter()
            .any(|src| live.host_count(src) + added(src) > cap)
        {
            return Ok(None);
        }
        // Nor where an entry comes to a chain's dimension that had none of its kind: the
        // chain's description says that lookup is skipped (`*_NO_HOSTS`, `*_NO_PREFIXES`), and
        // only a full write changes it with the entries. (One that takes a dimension's last
        // entry of a kind leaves the description asking for a lookup that misses: safe.)
        if delta.iter().any(|c| {
            c.value.is_some()
                && live
                    .chains
                    .iter()
                    .find(|ch| ch.id == c.chain)
                    .is_none_or(|ch| !ch.has_addresses(c.dir, is_host(&c.net)))
        }) {
            return Ok(None);
        }
        // The slot's contents change: its digest no longer names them.
        crate::meta::clear_digest(&self.pin_dir, self.active)?;
        // The hosts that change leave their lines first: their lookups ask the host map.
        let forgotten = self.forget_lines(self.active, &lines::changed_hosts(&delta))?;
        let n = forgotten + write_addr_changes(&mut self.ebpf, &self.active.to_string(), &delta)?;
        let mut c = self.config()?;
        c.active = c.active.wrapping_add(2);
        self.set_config(c)?;
        let mut prefixes = 0;
        if let Some(live) = self.slots[active].as_mut() {
            maps::apply_delta(live, &delta);
            prefixes = live.prefix_count();
        }
        Ok(Some(BpfApplyReport {
            active: self.active,
            entries_changed: n,
            switched: false,
            prefixes,
            diagnostics: self.diagnostics.clone(),
        }))
    }

    /// The policy as last written.
    pub fn policy(&self) -> Option<&BpfPolicy> {
        self.slots[self.active as usize].as_ref()
    }

    /// Live slot.
    pub fn active_slot(&self) -> u32 {
        self.active
    }

    /// Write `new` into `slot` (whose maps hold `old`, or nothing yet): the lookup maps, then
    /// the chain descriptions, the hooks last, so a chain becomes reachable only once all its
    /// maps are written. Returns the entries written or deleted.
    fn write_slot(
        &mut self,
        slot: u32,
        old: Option<&BpfPolicy>,
        new: &BpfPolicy,
    ) -> Result<usize, BpfError> {
        crate::meta::clear_digest(&self.pin_dir, slot)?;
        self.write_names(slot, new);
        let s = slot.to_string();
        // The one-line tables first: on the live slot, their in-place stores send the hosts
        // about to change to the host maps before those change.
        let hosts = self.slot_hosts(new);
        let mut n = self.write_lines(slot, &hosts, slot == self.active)?;
        n += self.write_lookups(slot, old, new)?;
        if old.map(|o| &o.views) != Some(&new.views) {
            let views = format!("{}{s}", map::VIEW);
            n += sync_views(self.map(&views)?, &views, &new.views)?;
        }
        // Packets skip the view lookup of a slot without views, and may take the local-address
        // mirror's path instead of the FIB's when no chain of the slot tests the output
        // interface (`routing`).
        let mut c = self.config()?;
        let bit = peerwall_common::flags::views(slot);
        let mut want = if new.views.is_empty() {
            c.flags & !bit
        } else {
            c.flags | bit
        };
        // Raised before the chains change, lowered after: a live slot written in place never
        // runs a chain testing the interface without it.
        let oif = peerwall_common::flags::oif_tested(slot);
        let tests_oif = new.tests_oif();
        if tests_oif {
            want |= oif;
        }
        if want != c.flags {
            c.flags = want;
            self.set_config(c)?;
        }
        n += self.write_chains(&s, old, new)?;
        let mut c = self.config()?;
        if !tests_oif && c.flags & oif != 0 {
            c.flags &= !oif;
            self.set_config(c)?;
        }
        if old.is_none() {
            self.zero_counters(slot)?;
        }
        Ok(n)
    }

    /// The per-dimension lookup maps ([`slots::LOOKUPS`], then conntrack states, then the
    /// slot's part of the chains' start bitmaps).
    fn write_lookups(
        &mut self,
        slot: u32,
        old: Option<&BpfPolicy>,
        new: &BpfPolicy,
    ) -> Result<usize, BpfError> {
        let s = slot.to_string();
        let n = self.write_maps(&s, slots::LOOKUPS.iter().chain([&slots::CT]), old, new)?;
        Ok(n + sync_start(self.map(map::START)?, slot, old, new)?)
    }

    /// Chain descriptions ([`slots::CHAINS`]: masks, rules, chains, hooks last).
    fn write_chains(
        &mut self,
        s: &str,
        old: Option<&BpfPolicy>,
        new: &BpfPolicy,
    ) -> Result<usize, BpfError> {
        self.write_maps(s, slots::CHAINS.iter(), old, new)
    }

    /// Sync each of `specs`' maps of slot `s`, in order; the entries written or deleted.
    fn write_maps<'a>(
        &mut self,
        s: &str,
        specs: impl Iterator<Item = &'a slots::SlotMap>,
        old: Option<&BpfPolicy>,
        new: &BpfPolicy,
    ) -> Result<usize, BpfError> {
        let mut n = 0;
        for spec in specs {
            let name = format!("{}{s}", spec.prefix);
            let layout = self.layout;
            n += (spec.sync)(self.map(&name)?, &name, old, new, layout)?;
        }
        Ok(n)
    }
}
