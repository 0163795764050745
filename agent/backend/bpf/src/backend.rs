//! [`BpfBackend`]: the bpf datapath ([`Datapath`], the loaded object and its pins) as a
//! [`Backend`](peerwall_backend::Backend). One apply path for the CLI and the agent:
//! resolve the host's interfaces in the maps, write the policy (in place or through the idle
//! slot), then attach to the interfaces the patterns pick — maps first, so a newly attached
//! interface never sees an empty policy.

use std::fmt;
use std::path::Path;

use peerwall_backend::{
    BackendError, Enforce, EventError, EventSource, Fault, HoldBoot, HostInterface, Observe,
    Report, Revoke, RuleCounter,
};
use peerwall_policy::ir::Policy;

use crate::loader::{self, BpfApplyReport, BpfError, Datapath, LoadOptions};
use crate::maps::Iface;
use crate::routing::watch::RouteWatch;

mod guard;
use guard::Guards;
pub use guard::{Guard, GUARD_TABLE};

/// The backend's name, as `--backend` spells it.
pub const NAME: &str = "bpf";

/// The datapath classifies at tc ingress, before prerouting's DNAT
/// ([`peerwall_backend::Enforce::classifies_before_nat`]): known before it is opened, so a
/// gateway's policy source can watch the NAT it needs while the datapath loads.
pub const CLASSIFIES_BEFORE_NAT: bool = true;

/// Where a gateway's boot policy holds until its tunnel is attached: nftables tables
/// ([`HoldBoot`]). Given by whoever builds the backend (this crate neither renders nor
/// writes nftables).
pub trait BootTables: Send {
    /// Put `boot` in force: Ok(true) when it did, Ok(false) when peerwall's tables already
    /// enforce here.
    fn hold(&mut self, boot: &Policy) -> Result<bool, BackendError>;
    /// Delete the inet table `table`, there or not.
    fn release(&mut self, table: &str) -> Result<(), BackendError>;
}

/// The nftables table (family `ip` and/or `ip6`) that keeps the kernel tracking connections
/// where the datapath reads the kernel's table ([`KernelTable::keep_tracking`]).
pub const KEEP_TRACKING_TABLE: &str = "peerwall-conntrack";

/// The kernel's connection table of the backend's namespace, as the kernel-conntrack mode
/// lists and ends its TCP and UDP connections ([`BpfBackend::set_kernel_table`]): given by
/// whoever builds the backend (ctnetlink lives with the nftables backend).
pub trait KernelTable: Send {
    /// Every connection the kernel tracks, as the forward hook sees it (after its NAT).
    fn flows(&mut self) -> Result<Vec<peerwall_backend::Flow>, BackendError>;
    /// Delete these connections from the kernel's table; how many it held.
    fn end(&mut self, flows: &[peerwall_backend::Flow]) -> Result<usize, BackendError>;
    /// Make sure the kernel keeps tracking IPv4 (`v4`) and IPv6 (`v6`) connections in this
    /// namespace, whatever else stops using conntrack there; the families it had to act for.
    fn keep_tracking(&mut self, v4: bool, v6: bool) -> Result<Vec<&'static str>, BackendError>;
}

/// An optional [`KernelTable`], shown by name in debug output.
struct Table(Option<Box<dyn KernelTable>>);

impl fmt::Debug for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "Some(KernelTable)"
        } else {
            "None"
        })
    }
}

/// The optional [`BootTables`], shown by name in debug output.
struct Boots(Option<Box<dyn BootTables>>);

impl fmt::Debug for Boots {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "Some(BootTables)"
        } else {
            "None"
        })
    }
}

/// The loaded datapath and where it attaches.
#[derive(Debug)]
pub struct BpfBackend {
    datapath: Datapath,
    patterns: Vec<String>,
    xdp: bool,
    boot_tables: Boots,
    /// The guard of interfaces not attached yet ([`Guard`]), with the ifindexes attached
    /// when it was last kept.
    guard: Guards,
    guarded: Option<Vec<u32>>,
    /// The local-address mirror's watcher, started by the first apply (in the namespace the
    /// backend serves); dropping it withdraws the mirror.
    routes: Option<RouteWatch>,
    /// The flows this backend ended: what a change that allows them again lets go, without
    /// walking the flow tables on every policy change.
    kept: peerwall_backend::Kept,
    /// The kernel's connection table, where the datapath reads it (kernel-conntrack mode).
    kernel_table: Table,
}

impl BpfBackend {
    /// Load (or adopt) the datapath pinned in `pin_dir`; attach to interfaces matching
    /// `patterns` (names, or prefixes ending in `*`), with XDP too when `xdp`.
    pub fn load(pin_dir: &Path, patterns: Vec<String>, xdp: bool) -> Result<Self, BpfError> {
        Self::load_with(pin_dir, patterns, xdp, &LoadOptions::default())
    }

    /// [`load`](Self::load) as `opts` says ([`Datapath::load_with`]).
    pub fn load_with(
        pin_dir: &Path,
        patterns: Vec<String>,
        xdp: bool,
        opts: &LoadOptions,
    ) -> Result<Self, BpfError> {
        loader::ensure_bpffs()?;
        let mut datapath = Datapath::load_with(pin_dir, opts)?;
        if let Some(want) = opts.flows {
            let (_, capacity) = datapath.flow_table()?;
            if capacity != want {
                tracing::warn!(
                    requested = want,
                    capacity,
                    "the flow table is already pinned with another size and keeps it; `peerwall delete --backend bpf` and restart to resize"
                );
            }
        }
        Ok(Self {
            datapath,
            patterns,
            xdp,
            boot_tables: Boots(None),
            guard: Guards(None),
            guarded: None,
            routes: None,
            kept: peerwall_backend::Kept::new(1 << 16),
            kernel_table: Table(None),
        })
    }

    /// Where [`HoldBoot::hold_boot`] puts a boot policy in force while the tunnel is not
    /// attached, and [`HoldBoot::release_boot`] lets it go (without them, the backend holds
    /// and releases nothing).
    pub fn set_boot_tables(&mut self, tables: Box<dyn BootTables>) {
        self.boot_tables = Boots(Some(tables));
    }

    /// How the backend lists and ends the kernel's connections where the datapath reads the
    /// kernel's table (without one, listing or ending connections there fails: revocation
    /// must not pass over them).
    pub fn set_kernel_table(&mut self, table: Box<dyn KernelTable>) {
        self.kernel_table = Table(Some(table));
    }

    /// Whether any connections live in the kernel's table (kernel-conntrack mode).
    fn kernel_tracks(&self) -> bool {
        self.datapath.kernel_holds(false, 6) || self.datapath.kernel_holds(true, 6)
    }

    /// Whether the kernel's table holds `f`'s connection (TCP and UDP of a family the
    /// datapath reads from the kernel; ICMP and SCTP stay in its own tables).
    fn kernel_holds(&self, f: &peerwall_backend::Flow) -> bool {
        self.datapath.kernel_holds(f.src.is_ipv6(), f.proto)
    }

    /// The datapath and, where it reads the kernel's table and was given a way to list it,
    /// that table (`sweep.rs`).
    pub(crate) fn sweep_parts(&mut self) -> (&mut Datapath, Option<&mut dyn KernelTable>) {
        let kernel = self.kernel_tracks();
        let table = match self.kernel_table.0.as_mut() {
            Some(t) if kernel => Some(t.as_mut() as &mut dyn KernelTable),
            _ => None,
        };
        (&mut self.datapath, table)
    }

    /// The kernel's table, where the datapath reads it.
    fn kernel_table(&mut self) -> Result<Option<&mut Box<dyn KernelTable>>, BpfError> {
        if !self.kernel_tracks() {
            return Ok(None);
        }
        match self.kernel_table.0.as_mut() {
            Some(t) => Ok(Some(t)),
            None => Err(BpfError::KernelConntrack(
                "the datapath reads the kernel's connection table, and this backend was given no way to list or end its connections".into(),
            )),
        }
    }

    /// Where the datapath reads the kernel's table for a family, make sure the kernel keeps
    /// tracking that family here (`peerwall_backend_select::tracking`): the datapath's choice
    /// was made when it loaded, from what used conntrack then (the boot table's replies rule
    /// among them), and without tracking every packet would look new to it. Returns the
    /// families whose table it had to create.
    fn keep_tracking(&mut self) -> Result<Vec<&'static str>, BackendError> {
        let (v4, v6) = (
            self.datapath.kernel_holds(false, 6),
            self.datapath.kernel_holds(true, 6),
        );
        if !v4 && !v6 {
            return Ok(Vec::new());
        }
        let Some(t) = self.kernel_table.0.as_mut() else {
            return Err(failed("keeping the kernel tracking connections")(
                BpfError::KernelConntrack(
                    "the datapath reads the kernel's connection table, and this backend was given no way to keep the kernel tracking".into(),
                ),
            ));
        };
        let created = t.keep_tracking(v4, v6)?;
        if !created.is_empty() {
            tracing::info!(
                families = ?created,
                "the kernel's connection tracking held on for the datapath that reads its table"
            );
        }
        Ok(created)
    }

    /// Whether an interface matching `tunnel` (a name, or a prefix ending in `*`) is attached.
    fn tunnel_attached(&self, tunnel: &str) -> bool {
        // Attached entries read `kind:interface`.
        let attached: Vec<loader::HostIface> = self
            .attached()
            .into_iter()
            .filter_map(|a| {
                a.split_once(':').map(|(_, name)| loader::HostIface {
                    name: name.to_string(),
                    ifindex: 0,
                    l2_len: 0,
                })
            })
            .collect();
        !loader::matching(&attached, &[tunnel.to_string()]).is_empty()
    }

    /// Interfaces the datapath is attached to.
    pub fn attached(&self) -> Vec<String> {
        self.datapath.attached()
    }

    /// Report events or not (see [`crate::events`]); takes effect at once.
    pub fn set_events(&mut self, ev: Option<crate::events::EventSettings>) -> Result<(), BpfError> {
        self.datapath.set_events(ev)
    }
}

impl fmt::Display for BpfApplyReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "slot={} switched={} entries={} prefixes={}",
            self.active, self.switched, self.entries_changed, self.prefixes
        )
    }
}

impl BpfBackend {
    /// The flows the datapath tracks, by original direction.
    pub fn flows(&mut self) -> Result<Vec<peerwall_backend::Flow>, BackendError> {
        let mut out = self
            .datapath
            .flows()
            .map_err(failed("listing connections"))?;
        if let Some(t) = self
            .kernel_table()
            .map_err(failed("listing the kernel's connections"))?
        {
            // The kernel's TCP and UDP connections; the datapath's own tables hold the rest.
            let kernel = t.flows()?;
            let datapath = &self.datapath;
            let holds =
                |f: &peerwall_backend::Flow| datapath.kernel_holds(f.src.is_ipv6(), f.proto);
            out.retain(|f| !holds(f));
            out.extend(kernel.into_iter().filter(holds));
        }
        Ok(out)
    }

    /// End these flows (invalid both ways, cached verdicts stale); how many were found. Where
    /// the kernel tracks TCP and UDP, those are marked ended in the datapath first, then
    /// deleted from the kernel's table: no packet between the two starts them again.
    pub fn end_flows(&mut self, flows: &[peerwall_backend::Flow]) -> Result<usize, BackendError> {
        let (kernel, own): (Vec<_>, Vec<_>) =
            flows.iter().copied().partition(|f| self.kernel_holds(f));
        let mut n = self
            .datapath
            .end_flows(&own)
            .map_err(failed("ending connections"))?;
        if !kernel.is_empty() {
            self.datapath
                .mark_ended(&kernel)
                .map_err(failed("marking connections ended"))?;
            if let Some(t) = self
                .kernel_table()
                .map_err(failed("ending the kernel's connections"))?
            {
                n += t.end(&kernel)?;
            }
        }
        self.kept.record(flows.iter().copied());
        Ok(n)
    }

    /// The flows this backend ended ([`BpfBackend::end_flows`]), as recorded.
    pub fn ended_flows(&self) -> Vec<peerwall_backend::Flow> {
        self.kept.flows()
    }

    /// Forget these ended flows: their next packet is judged afresh.
    pub fn release_flows(&mut self, flows: &[peerwall_backend::Flow]) -> Result<usize, BpfError> {
        let held = self.kept.take(flows);
        self.datapath.release_flows(&held)
    }

    /// The connection table's (entries, capacity): the kernel's where the datapath reads it,
    /// else the flow table's.
    pub fn conntrack(&mut self) -> Result<Option<(u64, u64)>, BpfError> {
        // Where the datapath reads the kernel's table, TCP and UDP connections live there and
        // its fill is what runs out (the own table then holds ICMP, SCTP and ended marks).
        if self.datapath.kernel_holds(false, 6) || self.datapath.kernel_holds(true, 6) {
            if let Some(fill) = peerwall_backend::kernel_conntrack_fill() {
                return Ok(Some(fill));
            }
        }
        let (entries, capacity) = self.datapath.flow_table()?;
        Ok(Some((entries, u64::from(capacity))))
    }

    /// Whether the emergency switch is on.
    pub fn allow_all(&mut self) -> Result<bool, BpfError> {
        self.datapath.allow_all()
    }

    /// Delete the boot table `table` once an interface matching `tunnel` is attached
    /// (false: not yet).
    pub fn release_boot_table(&mut self, table: &str, tunnel: &str) -> Result<bool, BackendError> {
        if !self.tunnel_attached(tunnel) {
            return Ok(false);
        }
        if let Some(t) = self.boot_tables.0.as_mut() {
            t.release(table)?;
        }
        Ok(true)
    }

    /// Make `policy` the whole policy in force, then attach to the interfaces the patterns
    /// pick (maps first: a newly attached interface never sees an empty policy).
    pub fn apply(&mut self, policy: &Policy) -> Result<BpfApplyReport, BpfError> {
        let host = loader::host_ifaces().map_err(BpfError::ListInterfaces)?;
        self.datapath.register_ifaces(&host)?;
        let ifaces: Vec<Iface> = host
            .iter()
            .map(|i| Iface {
                name: i.name.clone(),
                ifindex: i.ifindex,
            })
            .collect();
        let report = self.datapath.apply(policy, &ifaces)?;
        let targets = loader::matching(&host, &self.patterns);
        tracing::debug!(
            interfaces = ?targets.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(),
            patterns = ?self.patterns,
            "attaching"
        );
        self.datapath.prepare(&targets, self.xdp)?;
        for t in &targets {
            self.datapath.attach(t, self.xdp)?;
        }
        // Only now are the new interfaces let through the guard: attached first, so none of
        // them passes a packet unfiltered.
        let mut attached: Vec<u32> = targets.iter().map(|t| t.ifindex).collect();
        attached.sort_unstable();
        self.keep_guard(attached)?;
        // A pattern nothing matches yet waits for its interface (a gateway's tunnel comes up
        // after the pod's namespace, where the agent starts): verify both tc entries now, so
        // the interface poll that finds it attaches at once instead of running the verifier
        // (seconds) while only the boot policy holds the tunnel.
        if self
            .patterns
            .iter()
            .any(|p| loader::matching(&host, std::slice::from_ref(p)).is_empty())
        {
            self.datapath.preload_tc()?;
        }
        // Conntrack's shortcut for unknown flows, once every attached program keeps it; where
        // the datapath reads the kernel's table, the shortcut covers its connections once
        // they are stamped (`sweep.rs`: the first apply sweeps, and upkeep keeps it current).
        self.datapath.arm_flow_seen()?;
        self.sweep_if_due();
        // New flows' paths from the local-address mirror where the routing allows it. Without
        // the watcher the FIB answers, as exactly and a little slower: not a failure.
        if self.routes.is_none() {
            match RouteWatch::start(self.datapath.pin_dir()) {
                Ok(w) => self.routes = Some(w),
                Err(e) => {
                    tracing::warn!(error = %e, "no local-address mirror: every new flow's path from the FIB")
                }
            }
        }
        Ok(report)
    }

    /// Change only the set elements `changes` names, in place when the datapath can; else
    /// apply `policy` whole.
    pub fn update_sets(
        &mut self,
        policy: &Policy,
        changes: &[peerwall_policy::ir::SetChange],
    ) -> Result<BpfApplyReport, BpfError> {
        match self.datapath.update_sets(policy, changes)? {
            Some(report) => Ok(report),
            None => self.apply(policy),
        }
    }

    /// Detach and remove every pin of the datapath, and the guard.
    pub fn delete(&mut self) -> Result<Vec<String>, BpfError> {
        self.routes = None;
        if let Some(g) = self.guard.0.as_mut() {
            g.release().map_err(BpfError::Guard)?;
        }
        loader::remove_pins(self.datapath.pin_dir())
    }

    /// Rule counters of the slot in force.
    pub fn counters(&mut self) -> Result<Vec<RuleCounter>, BpfError> {
        self.datapath.counters()
    }
}

/// `map_err` for this backend's errors: a policy the datapath cannot take is the policy's
/// fault; everything else the host's.
fn failed(action: &'static str) -> impl FnOnce(BpfError) -> BackendError {
    move |e| BackendError {
        backend: NAME,
        action,
        fault: if matches!(e, BpfError::Compile(_)) {
            Fault::Input
        } else {
            Fault::Host
        },
        source: Box::new(e),
    }
}

impl Enforce for BpfBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn apply(&mut self, policy: &Policy) -> Result<Report, BackendError> {
        let report = BpfBackend::apply(self, policy)
            .map(|r| Report {
                summary: format!("{r} attached={:?}", self.attached()),
                warnings: r.diagnostics,
            })
            .map_err(failed("applying"))?;
        self.keep_tracking()?;
        Ok(report)
    }

    fn update_sets(
        &mut self,
        policy: &Policy,
        changes: &[peerwall_policy::ir::SetChange],
    ) -> Result<Report, BackendError> {
        BpfBackend::update_sets(self, policy, changes)
            .map(|r| Report {
                summary: r.to_string(),
                warnings: r.diagnostics,
            })
            .map_err(failed("updating sets"))
    }

    /// Verify the programs the interfaces matching the patterns need (or will need) before
    /// any policy is known: the first apply then fills maps and attaches.
    fn warm_up(&mut self) -> Result<(), BackendError> {
        let host = loader::host_ifaces()
            .map_err(BpfError::ListInterfaces)
            .map_err(failed("listing the interfaces"))?;
        let targets = loader::matching(&host, &self.patterns);
        self.datapath
            .warm_up(&targets, self.xdp)
            .map_err(failed("verifying the programs"))
    }

    fn delete(&mut self) -> Result<Vec<String>, BackendError> {
        BpfBackend::delete(self).map_err(failed("removing the pins"))
    }

    /// Nothing of the bpf datapath drifts (its pins are its state); where it reads the
    /// kernel's table, its upkeep is the sweep of that table (`sweep.rs`) and the kernel's
    /// tracking held on (the table [`KEEP_TRACKING_TABLE`], put back when gone: drift).
    fn repair(&mut self) -> Result<Vec<peerwall_backend::Drift>, BackendError> {
        self.sweep_if_due();
        let mut drift: Vec<peerwall_backend::Drift> = self
            .keep_tracking()?
            .into_iter()
            .map(|family| peerwall_backend::Drift::Missing {
                table: format!("{family} {KEEP_TRACKING_TABLE}"),
            })
            .collect();
        drift.extend(self.repair_guard()?);
        Ok(drift)
    }

    fn environment(&self) -> Vec<HostInterface> {
        // An interface list that cannot be read is treated as unchanged (empty): the next
        // apply reports the error.
        loader::host_ifaces()
            .map(|v| {
                v.into_iter()
                    .map(|i| HostInterface {
                        name: i.name,
                        ifindex: i.ifindex,
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// At tc ingress, before prerouting's DNAT.
    fn classifies_before_nat(&self) -> bool {
        CLASSIFIES_BEFORE_NAT
    }
}

impl Observe for BpfBackend {
    fn counters(&mut self) -> Result<Vec<RuleCounter>, BackendError> {
        BpfBackend::counters(self).map_err(failed("reading rule counters"))
    }

    fn allow_all(&mut self) -> Result<bool, BackendError> {
        BpfBackend::allow_all(self).map_err(failed("reading the switch"))
    }

    fn conntrack(&mut self) -> Result<Option<(u64, u64)>, BackendError> {
        BpfBackend::conntrack(self).map_err(failed("reading the flow table"))
    }

    fn flows(&mut self) -> Result<Vec<peerwall_backend::Flow>, BackendError> {
        BpfBackend::flows(self)
    }

    fn events(&mut self) -> Result<Box<dyn EventSource>, EventError> {
        if self
            .datapath
            .config()
            .map_err(|e| EventError::Io {
                what: "reading the datapath's configuration",
                source: std::io::Error::other(e.to_string()),
            })?
            .flags
            & peerwall_common::flags::EVENTS
            == 0
        {
            return Err(EventError::Off);
        }
        Ok(Box::new(crate::events::BpfEvents::open(
            self.datapath.pin_dir(),
        )?))
    }
}

impl Revoke for BpfBackend {
    fn end_flows(&mut self, flows: &[peerwall_backend::Flow]) -> Result<usize, BackendError> {
        BpfBackend::end_flows(self, flows)
    }

    fn ended_flows(&mut self) -> Result<Vec<peerwall_backend::Flow>, BackendError> {
        Ok(BpfBackend::ended_flows(self))
    }

    fn release_flows(&mut self, flows: &[peerwall_backend::Flow]) -> Result<usize, BackendError> {
        BpfBackend::release_flows(self, flows).map_err(failed("releasing ended connections"))
    }
}

impl HoldBoot for BpfBackend {
    fn release_boot(&mut self, table: &str, tunnel: &str) -> Result<bool, BackendError> {
        self.release_boot_table(table, tunnel)
    }

    fn hold_boot(&mut self, boot: &Policy, tunnel: &str) -> Result<bool, BackendError> {
        if self.tunnel_attached(tunnel) {
            return Ok(false);
        }
        match self.boot_tables.0.as_mut() {
            Some(t) => t.hold(boot),
            None => Ok(false),
        }
    }
}
