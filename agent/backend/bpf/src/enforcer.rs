//! [`BpfEnforcer`]: the bpf datapath as a [`Backend`]. One apply path for the CLI and the agent:
//! resolve the host's interfaces in the maps, write the policy (in place or through the idle
//! slot), then attach to the interfaces the patterns pick — maps first, so a newly attached
//! interface never sees an empty policy.

use std::fmt;
use std::path::Path;

use peerwall_backend::{Backend, EventError, EventSource, HostInterface, RuleCounter};
use peerwall_policy::ir::Policy;

use crate::loader::{self, BpfApplyReport, BpfBackend, BpfError};
use crate::maps::Iface;

/// The loaded datapath and where it attaches.
#[derive(Debug)]
pub struct BpfEnforcer {
    backend: BpfBackend,
    patterns: Vec<String>,
    xdp: bool,
}

impl BpfEnforcer {
    /// Load (or adopt) the datapath pinned in `pin_dir`; attach to interfaces matching
    /// `patterns` (names, or prefixes ending in `*`), with XDP too when `xdp`.
    pub fn load(pin_dir: &Path, patterns: Vec<String>, xdp: bool) -> Result<Self, BpfError> {
        Self::load_sized(pin_dir, patterns, xdp, None)
    }

    /// [`load`](Self::load) with a flow table of `flows` entries when it is created
    /// ([`BpfBackend::load_sized`]).
    pub fn load_sized(
        pin_dir: &Path,
        patterns: Vec<String>,
        xdp: bool,
        flows: Option<u32>,
    ) -> Result<Self, BpfError> {
        loader::ensure_bpffs()?;
        let mut backend = BpfBackend::load_sized(pin_dir, flows)?;
        if let Some(want) = flows {
            let (_, capacity) = backend.flow_table()?;
            if capacity != want {
                tracing::warn!(
                    requested = want,
                    capacity,
                    "the flow table is already pinned with another size and keeps it; `peerwall delete --backend bpf` and restart to resize"
                );
            }
        }
        Ok(Self {
            backend,
            patterns,
            xdp,
        })
    }

    /// Interfaces the datapath is attached to.
    pub fn attached(&self) -> Vec<String> {
        self.backend.attached()
    }

    /// Report events or not (see [`crate::events`]); takes effect at once.
    pub fn set_events(&mut self, ev: Option<crate::events::EventSettings>) -> Result<(), BpfError> {
        self.backend.set_events(ev)
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

impl Backend for BpfEnforcer {
    type Report = BpfApplyReport;
    type Error = BpfError;

    fn flows(&mut self) -> Result<Vec<peerwall_backend::Flow>, BpfError> {
        self.backend.flows()
    }

    fn end_flows(&mut self, flows: &[peerwall_backend::Flow]) -> Result<usize, BpfError> {
        self.backend.end_flows(flows)
    }

    fn conntrack(&mut self) -> Result<Option<(u64, u64)>, BpfError> {
        let (entries, capacity) = self.backend.flow_table()?;
        Ok(Some((entries, u64::from(capacity))))
    }

    fn allow_all(&mut self) -> Result<bool, BpfError> {
        self.backend.allow_all()
    }

    fn events(&mut self) -> Result<Box<dyn EventSource>, EventError> {
        if self
            .backend
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
            self.backend.pin_dir(),
        )?))
    }

    fn name(&self) -> &'static str {
        "bpf"
    }

    fn release_boot(&mut self, table: &str, tunnel: &str) -> Result<bool, BpfError> {
        // Attached entries read `kind:interface`.
        let pattern = [tunnel.to_string()];
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
        if loader::matching(&attached, &pattern).is_empty() {
            return Ok(false);
        }
        let out = std::process::Command::new("nft")
            .args(["delete", "table", "inet", table])
            .output()
            .map_err(|e| BpfError::BootTable {
                table: table.into(),
                message: format!("running nft: {e}"),
            })?;
        let said = String::from_utf8_lossy(&out.stderr);
        if out.status.success() || said.contains("No such file or directory") {
            Ok(true)
        } else {
            Err(BpfError::BootTable {
                table: table.into(),
                message: said.trim().to_string(),
            })
        }
    }

    fn apply(&mut self, policy: &Policy) -> Result<BpfApplyReport, BpfError> {
        let host = loader::host_ifaces().map_err(BpfError::ListInterfaces)?;
        self.backend.register_ifaces(&host)?;
        let ifaces: Vec<Iface> = host
            .iter()
            .map(|i| Iface {
                name: i.name.clone(),
                ifindex: i.ifindex,
            })
            .collect();
        let report = self.backend.apply(policy, &ifaces)?;
        let targets = loader::matching(&host, &self.patterns);
        tracing::debug!(
            interfaces = ?targets.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(),
            patterns = ?self.patterns,
            "attaching"
        );
        self.backend.prepare(&targets, self.xdp)?;
        for t in targets {
            self.backend.attach(t, self.xdp)?;
        }
        Ok(report)
    }

    fn update_sets(
        &mut self,
        policy: &Policy,
        changes: &[peerwall_policy::ir::SetChange],
    ) -> Result<BpfApplyReport, BpfError> {
        match self.backend.update_sets(policy, changes)? {
            Some(report) => Ok(report),
            None => self.apply(policy),
        }
    }

    fn delete(&mut self) -> Result<Vec<String>, BpfError> {
        loader::remove_pins(self.backend.pin_dir())
    }

    fn counters(&mut self) -> Result<Vec<RuleCounter>, BpfError> {
        self.backend.counters()
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
}
