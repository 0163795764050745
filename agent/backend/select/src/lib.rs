//! The backend layer's one entry: which backends exist ([`BackendKind`]), each opened as a
//! `Box<dyn Backend>` from one description ([`Settings`], [`open`]) in this network
//! namespace or another, and what peerwall has installed on a host ([`installed()`]) with the
//! commands that act on it (remove, flip the switch, read counters) whatever backend it is.
//! Nothing above this crate names a backend's own types.

mod boot_tables;
pub mod guard;
pub mod installed;
mod kernel_table;
pub mod rendering;
pub mod tracking;

use std::path::PathBuf;

use peerwall_backend::{Backend, BackendError, InNetns};
use peerwall_backend_bpf::{loader, BpfBackend};
use peerwall_backend_nftables::{Nft, NftBackend};

pub use installed::{installed, Installed};
pub use kernel_table::CtTable;

/// A backend, by the name `--backend` takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum BackendKind {
    /// One nftables table per FirewallConfiguration, applied atomically.
    Nftables,
    /// tc (tcx) and XDP programs over LPM-trie maps pinned under bpffs.
    Bpf,
}

impl BackendKind {
    /// The name `--backend` takes (and metrics and logs carry).
    pub fn name(self) -> &'static str {
        match self {
            Self::Nftables => peerwall_backend_nftables::NAME,
            Self::Bpf => peerwall_backend_bpf::backend::NAME,
        }
    }

    /// Whether this backend's datapath classifies before the host's NAT
    /// (`Enforce::classifies_before_nat` of every enforcer it opens), known before one is
    /// opened: a gateway's policy source then watches the NAT while the datapath loads.
    pub fn classifies_before_nat(self) -> bool {
        match self {
            Self::Nftables => false,
            Self::Bpf => peerwall_backend_bpf::backend::CLASSIFIES_BEFORE_NAT,
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a backend reports as events (`--events`, `--flow-log`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventSettings {
    /// Also the first packet of every accepted flow.
    pub flow_log: bool,
    /// Events per second (nftables: per table; bpf: per CPU), burst twice that.
    pub rate: u32,
    /// NFLOG group (nftables).
    pub nflog_group: u16,
}

/// Everything needed to open a backend. Fields a backend does not use are ignored by it.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Which backend.
    pub kind: BackendKind,
    /// bpf: where its maps and links are pinned.
    pub pin_dir: PathBuf,
    /// bpf: interfaces to attach to (names, or prefixes ending in `*`).
    pub interfaces: Vec<String>,
    /// bpf: attach XDP too.
    pub xdp: bool,
    /// bpf: flow table entries, when it is created.
    pub flows: Option<u32>,
    /// bpf: hosts each exact-match host map holds, when it is created.
    pub hosts: Option<u32>,
    /// bpf: rule counters per slot, when they are created.
    pub counters: Option<u32>,
    /// Events to report; None: none.
    pub events: Option<EventSettings>,
    /// bpf: refuse to open when no interface matches now (a one-shot `peerwall apply`, which
    /// must attach somewhere; the agent instead waits for interfaces to appear).
    pub must_attach: bool,
    /// Connections the backend ends stay ended until neither side has sent for this many
    /// seconds: nftables in its ended table ([`peerwall_backend_nftables::ended`]), bpf by its
    /// flows' `ended` mark ([`loader::LoadOptions::ended_secs`]). 0: they are only deleted
    /// from the connection table, so the next packet of either side starts over. None: the
    /// default for bpf, no table for nftables (one-shot commands, which end nothing).
    pub ended_secs: Option<u32>,
    /// bpf: whose connection table TCP and UDP use.
    pub conntrack: Conntrack,
    /// nftables: the decided-flow cache where it helps
    /// ([`peerwall_backend_nftables::decided`]).
    pub nft_flow_cache: bool,
}

impl Settings {
    /// `kind` with its defaults: pins in [`loader::PIN_DIR`], Liqo's interfaces, no events,
    /// nftables' decided-flow cache on.
    pub fn new(kind: BackendKind) -> Self {
        Self {
            kind,
            pin_dir: PathBuf::from(loader::PIN_DIR),
            interfaces: Vec::new(),
            xdp: false,
            flows: None,
            hosts: None,
            counters: None,
            events: None,
            must_attach: false,
            ended_secs: None,
            conntrack: Conntrack::Own,
            nft_flow_cache: true,
        }
    }
}

/// Whose connection table the bpf datapath reads for TCP and UDP (`--bpf-conntrack`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Conntrack {
    /// The kernel's, for the families it tracks in the namespace when the datapath loads;
    /// loading fails where it tracks none or lacks the kfuncs.
    Kernel,
    /// The kernel's for the families it tracks there, where it offers the kfuncs; the
    /// datapath's own otherwise.
    Auto,
    /// The datapath's own.
    #[default]
    Own,
}

impl Conntrack {
    /// What the loader is asked for, with the families the kernel tracks in this namespace
    /// ([`kernel_table::tracks`]).
    fn load(self) -> Result<loader::Conntrack, loader::BpfError> {
        let found = || loader::Conntrack::Kernel {
            v4: kernel_table::tracks(false),
            v6: kernel_table::tracks(true),
        };
        match self {
            Self::Own => Ok(loader::Conntrack::Own),
            Self::Auto if loader::KernelCt::detected().kfuncs().is_none() => {
                Ok(loader::Conntrack::Own)
            }
            Self::Auto => Ok(found()),
            Self::Kernel => match found() {
                loader::Conntrack::Kernel {
                    v4: false,
                    v6: false,
                } => Err(loader::BpfError::KernelConntrack(
                    "--bpf-conntrack kernel: the kernel tracks no connections in this namespace (no NAT or conntrack rule of either family)".into(),
                )),
                k => Ok(k),
            },
        }
    }
}

/// Where the bpf backend pins its maps and links unless told otherwise (`--pin-dir`).
pub const PIN_DIR: &str = loader::PIN_DIR;

/// Whether `path` is on a bpf filesystem (where pins can go).
pub fn is_bpffs(path: &std::path::Path) -> bool {
    loader::is_bpffs(path)
}

/// Keep a bpf datapath made ready ahead for the bpf loads whose pin directory is under
/// `serves`, its maps pinned under `root` while it loads: such a load then takes it when it
/// fits, and the next is made once no load runs ([`loader::keep_spares`]; the gateway-pod
/// mode, where a new peer's gateway would otherwise wait for its datapath to load and verify).
pub fn keep_spare_datapaths(
    root: &std::path::Path,
    serves: &std::path::Path,
) -> Result<(), BackendError> {
    loader::keep_spares(root, serves).map_err(BackendError::host(
        peerwall_backend_bpf::backend::NAME,
        "removing an earlier agent's spare datapath",
    ))
}

/// Whether a spare datapath is ready ([`keep_spare_datapaths`]): a bpf load that takes it
/// neither creates maps nor verifies programs.
pub fn spare_datapath_ready() -> bool {
    loader::spare_ready()
}

/// The bpf filesystem's mount point, mounted first where it is not.
pub fn ensure_bpffs() -> Result<PathBuf, BackendError> {
    loader::ensure_bpffs().map_err(BackendError::host(
        peerwall_backend_bpf::backend::NAME,
        "mounting the bpf filesystem",
    ))
}

/// How long the nftables backend keeps a connection it ended ended after its last packet, by
/// default ([`Settings::ended_secs`]).
pub const DEFAULT_ENDED_SECS: u32 = peerwall_backend_nftables::ended::DEFAULT_TIMEOUT_SECS;

/// The table the nftables backend keeps ended connections in: no policy may name it.
pub const ENDED_TABLE: &str = peerwall_backend_nftables::ended::ENDED_TABLE;

/// Open the backend `s` describes, in the current network namespace or, with `netns`, in a
/// named one from a thread that entered it ([`InNetns`]; a name under `/run/netns` or a path
/// such as `/proc/<pid>/ns/net`).
pub fn open(s: &Settings, netns: Option<&str>) -> Result<Box<dyn Backend>, BackendError> {
    let name = s.kind.name();
    let here = {
        let s = s.clone();
        move || -> Result<Box<dyn Backend>, BackendError> {
            match s.kind {
                BackendKind::Nftables => Ok(Box::new(nftables(&s))),
                BackendKind::Bpf => Ok(Box::new(bpf(&s)?)),
            }
        }
    };
    match netns {
        None => here(),
        Some(ns) => Ok(Box::new(InNetns::spawn(ns, name, here)?)),
    }
}

fn nftables(s: &Settings) -> NftBackend {
    let b = NftBackend::new(Nft::host())
        .with_ended_connections(s.ended_secs.filter(|&n| n > 0))
        .with_flow_cache(s.nft_flow_cache);
    match s.events {
        Some(e) => b.with_events(peerwall_backend_nftables::EventOptions {
            group: e.nflog_group,
            rate: e.rate,
            burst: e.rate.saturating_mul(2),
            flow_log: e.flow_log,
        }),
        None => b,
    }
}

fn bpf(s: &Settings) -> Result<BpfBackend, BackendError> {
    const NAME: &str = peerwall_backend_bpf::backend::NAME;
    if s.must_attach {
        let host = loader::host_ifaces().map_err(BackendError::host(NAME, "listing interfaces"))?;
        if loader::matching(&host, &s.interfaces).is_empty() {
            return Err(BackendError::host(NAME, "attaching")(
                loader::BpfError::NoInterface(s.interfaces.clone()),
            ));
        }
    }
    let mut b = BpfBackend::load_with(
        &s.pin_dir,
        s.interfaces.clone(),
        s.xdp,
        &loader::LoadOptions {
            flows: s.flows,
            hosts: s.hosts,
            counters: s.counters,
            ended_secs: s.ended_secs.unwrap_or(DEFAULT_ENDED_SECS),
            conntrack: s.conntrack.load().map_err(|e| {
                BackendError::host(NAME, "choosing the connection table")(LoadError {
                    pin_dir: s.pin_dir.clone(),
                    source: e,
                })
            })?,
            baselines: false,
        },
    )
    .map_err(|e| {
        BackendError::host(NAME, "loading the datapath")(LoadError {
            pin_dir: s.pin_dir.clone(),
            source: e,
        })
    })?;
    b.set_events(
        s.events
            .map(|e| peerwall_backend_bpf::events::EventSettings {
                flow_log: e.flow_log,
                rate: e.rate,
                burst: e.rate.saturating_mul(2),
                interval: peerwall_backend_nftables::EVENT_INTERVAL,
            }),
    )
    .map_err(BackendError::host(NAME, "turning events on or off"))?;
    // Where the datapath reads the kernel's connection table, revocation lists and ends the
    // kernel's connections.
    b.set_kernel_table(Box::new(kernel_table::CtTable::default()));
    // Until the tunnel is attached, a gateway's boot policy holds as `peerwall boot` puts it:
    // an nftables table matching the tunnel by name, unless peerwall's tables are here already;
    // deleted over netlink once the tunnel is attached.
    b.set_boot_tables(Box::new(boot_tables::NftBootTables::default()));
    // An interface the patterns pick is dropped by nftables until the datapath is attached
    // to it (a tunnel made again under its name, while no agent runs).
    b.set_guard(Box::new(guard::NftGuard::default()));
    Ok(b)
}

/// Loading the bpf datapath failed, with where its pins go.
#[derive(Debug, thiserror::Error)]
#[error("pins in {}: {source}", pin_dir.display())]
pub struct LoadError {
    /// Pin directory.
    pub pin_dir: PathBuf,
    /// Cause.
    #[source]
    pub source: loader::BpfError,
}

#[cfg(test)]
mod tests {
    use super::*;
    use peerwall_backend::Enforce;

    /// What a gateway's policy source watches before its enforcer opens is what the opened
    /// enforcer says it needs (bpf shares the constant its enforcer returns; nftables's
    /// enforcer is built here without touching the kernel).
    #[test]
    fn the_kind_knows_whether_its_enforcer_classifies_before_nat() {
        let nft = nftables(&Settings::new(BackendKind::Nftables));
        assert_eq!(
            nft.classifies_before_nat(),
            BackendKind::Nftables.classifies_before_nat()
        );
        assert!(BackendKind::Bpf.classifies_before_nat());
    }
}
