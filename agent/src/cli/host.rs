//! Commands on this host's kernel: apply, delete, inspect, allow-all, counters. Each acts in
//! the network namespace it runs in (or `--netns`), keeps bpf pins on the host's bpffs
//! ([`scope::host_bpffs`]) and, except `apply`, acts on what it finds installed.

use super::scope::{self, backends_to_act_on};
use super::*;

/// Where a host command acts (`--netns`, `--pin-dir`, or `--gateway`).
#[derive(clap::Args, Debug, Clone)]
pub struct HostArgs {
    /// Act in this network namespace (`ip netns` name, or a path such as
    /// `/proc/<pid>/ns/net`) instead of the one the command runs in.
    #[arg(long)]
    pub netns: Option<String>,
    /// Where the bpf datapath's maps and links are pinned.
    #[arg(long, default_value = peerwall_backend_select::PIN_DIR)]
    pub pin_dir: PathBuf,
    /// In the DaemonSet's agent pod: act inside the gateway pod of this peer on this node (its
    /// network namespace and pins, as the agent recorded them), e.g. `kubectl -n
    /// peerwall-system exec ds/peerwall-agent -- peerwall allow-all on --gateway PEER`.
    #[arg(long, conflicts_with = "netns")]
    pub gateway: Option<String>,
}

impl HostArgs {
    /// `--gateway` resolved into a namespace and a pin directory.
    fn resolved(&self) -> Result<Self, CliError> {
        let Some(peer) = &self.gateway else {
            return Ok(self.clone());
        };
        let (ns, pins) = crate::k8s::gateway_pods::handles::resolve(
            std::path::Path::new(crate::k8s::gateway_pods::handles::HANDLES),
            std::path::Path::new("/proc"),
            peer,
        )
        .map_err(|e| CliError::Input(anyhow::anyhow!(e)))?;
        Ok(HostArgs {
            netns: Some(ns.to_string_lossy().into_owned()),
            pin_dir: pins,
            gateway: None,
        })
    }

    /// Enter the host's bpffs, then the network namespace (in that order: the namespace file
    /// is then opened in the host's mount namespace); where the command acts, resolved.
    fn enter(&self, command: &str, create: bool) -> Result<Self, CliError> {
        super::privileges::require(
            command,
            super::privileges::Needs {
                bpf: create || self.pin_dir.exists(),
                netns: self.netns.is_some() || self.gateway.is_some(),
            },
        )?;
        let mut at = self.resolved()?;
        scope::host_bpffs(&at.pin_dir, create)?;
        if let Some(ns) = &at.netns {
            scope::enter_netns(ns)?;
        }
        if !create && self.gateway.is_none() {
            // No --pin-dir: the pins this namespace's last apply left, if elsewhere.
            let found = super::pins::resolve(&at.pin_dir);
            if found != at.pin_dir {
                scope::host_bpffs(&found, false)?;
                at.pin_dir = found;
            }
        }
        Ok(at)
    }
}

/// `peerwall apply`.
pub(super) fn apply(
    files: &[PathBuf],
    backend: BackendKind,
    bpf: BpfOpts,
    netns: Option<String>,
) -> Result<(), CliError> {
    // Input first: relative paths are read where the command was started.
    let compiled = load_and_compile(files)?;
    let at = HostArgs {
        netns,
        pin_dir: bpf.pin_dir.clone(),
        gateway: None,
    };
    match backend {
        BackendKind::Bpf => {
            at.enter("apply", true)?;
        }
        BackendKind::Nftables => {
            super::privileges::require(
                "apply",
                super::privileges::Needs {
                    bpf: false,
                    netns: at.netns.is_some(),
                },
            )?;
            if let Some(ns) = &at.netns {
                scope::enter_netns(ns)?;
            }
        }
    }
    let settings = peerwall_backend_select::Settings {
        // `apply` must attach somewhere (the agent instead waits for interfaces to appear).
        must_attach: true,
        ..bpf.settings(backend)
    };
    let mut b = peerwall_backend_select::open(&settings, None).map_err(runtime)?;
    // A process that applied nothing yet keeps what is installed and unchanged (and its
    // counters).
    b.adopt(&compiled.policy).map_err(runtime)?;
    apply_with(b.as_mut(), &compiled.policy)?;
    if backend == BackendKind::Bpf {
        // Later commands in this namespace find these pins without --pin-dir.
        super::pins::remember(&bpf.pin_dir);
    }
    Ok(())
}

/// `peerwall boot`: the boot policy of `peer`'s gateway ([`crate::protection::boot`]) in
/// force through nftables, whichever backend the agent runs: its rules match the tunnel by
/// name and so hold for a tunnel created after it.
pub(super) fn boot(
    peer: &str,
    tunnel: String,
    liqo_ping_port: u16,
    netns: Option<String>,
) -> Result<(), CliError> {
    let opts = crate::protection::Options {
        tunnel,
        liqo_ping_port,
        ..crate::protection::boot::default_options()
    };
    let policy = crate::enforcement::boot_policy(crate::protection::boot::boot_object(peer, &opts))
        .map_err(input)?;
    if let Some(ns) = &netns {
        scope::enter_netns(ns)?;
    }
    // A namespace where peerwall already enforces (the agent came first, a container
    // restarted): what is in force stays, nothing to add.
    let owned = peerwall_backend_select::installed::nft_tables()
        .context("reading peerwall's tables in the kernel")
        .map_err(runtime)?;
    if !owned.is_empty() {
        out(&format!(
            "peerwall already enforces here ({}): boot policy not needed\n",
            owned.join(", ")
        ))?;
        return Ok(());
    }
    let mut b = peerwall_backend_select::open(
        &peerwall_backend_select::Settings::new(BackendKind::Nftables),
        None,
    )
    .map_err(runtime)?;
    apply_with(b.as_mut(), &policy)
}

/// `peerwall delete`: removes what it finds (or, with `--backend`, that backend's part).
/// Finding nothing is said, not an error: the host is as asked.
pub(super) fn delete(backend: Option<BackendKind>, at: &HostArgs) -> Result<(), CliError> {
    let at = at.enter("delete", false)?;
    let found = peerwall_backend_select::installed(&at.pin_dir);
    let chosen: Vec<BackendKind> = found
        .backends()
        .into_iter()
        .filter(|b| backend.is_none_or(|a| a == *b))
        .collect();
    if chosen.is_empty() {
        out(&format!(
            "nothing to delete: found {}\n",
            found.describe(&at.pin_dir)
        ))?;
        return Ok(());
    }
    for b in chosen {
        let gone = peerwall_backend_select::installed::remove(b, &at.pin_dir).map_err(runtime)?;
        out(&match b {
            BackendKind::Bpf => format!(
                "bpf: detached and unpinned {} pins in {}\n",
                gone.len(),
                at.pin_dir.display()
            ),
            BackendKind::Nftables => format!("nftables: deleted {}\n", gone.join(", ")),
        })?;
    }
    Ok(())
}

/// `peerwall inspect`.
pub(super) fn inspect(at: &HostArgs, output: Output) -> Result<(), CliError> {
    let at = at.enter("inspect", false)?;
    backends_to_act_on(Some(BackendKind::Bpf), &at.pin_dir, "inspect")?;
    let format = match output {
        Output::Json => peerwall_backend_select::rendering::Format::Json,
        Output::Text => peerwall_backend_select::rendering::Format::Text,
    };
    let printed = peerwall_backend_select::installed::inspect(&at.pin_dir, format)
        .with_context(|| format!("pinned datapath in {}", at.pin_dir.display()))
        .map_err(runtime)?;
    out(&printed)
}

/// `peerwall allow-all`: flips the switch of every backend installed here (or the one asked).
pub(super) fn allow_all(
    state: OnOff,
    backend: Option<BackendKind>,
    at: &HostArgs,
) -> Result<(), CliError> {
    let at = at.enter("allow-all", false)?;
    let on = state == OnOff::On;
    for b in backends_to_act_on(backend, &at.pin_dir, "switch")? {
        peerwall_backend_select::installed::set_switch(b, &at.pin_dir, on).map_err(runtime)?;
        tracing::warn!(backend = b.name(), allow_all = on, "emergency switch set");
        out(&format!(
            "{b}: allow-all {}\n",
            if on {
                "ON: every packet passes"
            } else {
                "off: enforcing"
            }
        ))?;
    }
    Ok(())
}

/// `peerwall counters`: the rule counters of every backend installed here.
pub(super) fn counters(
    backend: Option<BackendKind>,
    at: &HostArgs,
    output: Output,
) -> Result<(), CliError> {
    let at = at.enter("counters", false)?;
    let mut counters = Vec::new();
    for b in backends_to_act_on(backend, &at.pin_dir, "count")? {
        counters
            .extend(peerwall_backend_select::installed::counters(b, &at.pin_dir).map_err(runtime)?);
    }
    match output {
        Output::Json => out(&format!(
            "{}\n",
            serde_json::to_string(&counters).map_err(runtime)?
        )),
        Output::Text => {
            let mut s = String::new();
            for c in counters {
                s.push_str(&format!(
                    "{}/{}/{}\t{} packets\t{} bytes\n",
                    c.table, c.chain, c.rule, c.packets, c.bytes
                ));
            }
            out(&s)
        }
    }
}
