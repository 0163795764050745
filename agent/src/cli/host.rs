//! Commands on this host's kernel: apply, delete, inspect, allow-all, counters. Each acts in
//! the network namespace it runs in (or `--netns`), keeps bpf pins on the host's bpffs
//! ([`scope::host_bpffs`]) and, except `apply`, acts on what it finds installed.

use super::scope::{self, backends_to_act_on};
use super::*;

/// Where a host command acts (`--netns`, `--pin-dir`).
#[derive(clap::Args, Debug, Clone)]
pub struct HostArgs {
    /// Act in this network namespace (`ip netns` name, or a path such as
    /// `/proc/<pid>/ns/net`) instead of the one the command runs in.
    #[arg(long)]
    pub netns: Option<String>,
    /// Where the bpf datapath's maps and links are pinned.
    #[arg(long, default_value = peerwall_backend_bpf::loader::PIN_DIR)]
    pub pin_dir: PathBuf,
}

impl HostArgs {
    /// Enter the host's bpffs, then the network namespace (in that order: the namespace file
    /// is then opened in the host's mount namespace).
    fn enter(&self, create: bool) -> Result<(), CliError> {
        scope::host_bpffs(&self.pin_dir, create)?;
        if let Some(ns) = &self.netns {
            scope::enter_netns(ns)?;
        }
        Ok(())
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
    };
    match backend {
        BackendKind::Bpf => {
            at.enter(true)?;
            apply_bpf(&compiled, bpf)
        }
        BackendKind::Nftables => {
            if let Some(ns) = &at.netns {
                scope::enter_netns(ns)?;
            }
            let mut b = NftBackend::new(Nft::host());
            b.adopt_unchanged(&compiled.policy)
                .context("reading peerwall's tables in the kernel")
                .map_err(runtime)?;
            apply_with(&mut b, &compiled.policy, |_| false)
        }
    }
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
    let obj = peerwall_intent::load::object_from_json(
        crate::protection::boot::boot_object(peer, &opts),
        peerwall_intent::load::Group::Peerwall,
    )
    .map_err(input)?;
    let compiled = peerwall_policy::compile::compile(&[obj])
        .context("the boot policy does not compile")
        .map_err(input)?;
    if let Some(ns) = &netns {
        scope::enter_netns(ns)?;
    }
    let mut b = NftBackend::new(Nft::host());
    // A namespace where peerwall already enforces (the agent came first, a container
    // restarted): what is in force stays, nothing to add.
    let owned = b
        .owned_tables()
        .context("reading peerwall's tables in the kernel")
        .map_err(runtime)?;
    if !owned.is_empty() {
        out(&format!(
            "peerwall already enforces here ({}): boot policy not needed\n",
            owned.join(", ")
        ))?;
        return Ok(());
    }
    apply_with(&mut b, &compiled.policy, |_| false)
}

fn apply_bpf(compiled: &Compiled, bpf: BpfOpts) -> Result<(), CliError> {
    use peerwall_backend_bpf::loader;
    // `apply` must attach somewhere (the agent instead waits for interfaces to appear).
    let host = loader::host_ifaces()
        .context("listing interfaces")
        .map_err(runtime)?;
    if loader::matching(&host, &bpf.interfaces).is_empty() {
        return Err(runtime(loader::BpfError::NoInterface(
            bpf.interfaces.clone(),
        )));
    }
    let mut b = BpfEnforcer::load_sized(
        &bpf.pin_dir,
        bpf.interfaces.clone(),
        bpf.xdp,
        bpf.flow_table_size,
    )
    .with_context(|| format!("loading the datapath (pins in {})", bpf.pin_dir.display()))
    .map_err(runtime)?;
    apply_with(&mut b, &compiled.policy, |e| {
        matches!(e, loader::BpfError::Compile(_))
    })?;
    tracing::info!(attached = ?b.attached(), "bpf datapath attached");
    Ok(())
}

/// `peerwall delete`: removes what it finds (or, with `--backend`, that backend's part).
/// Finding nothing is said, not an error: the host is as asked.
pub(super) fn delete(backend: Option<BackendKind>, at: &HostArgs) -> Result<(), CliError> {
    at.enter(false)?;
    let found = scope::installed(&at.pin_dir);
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
        match b {
            BackendKind::Bpf => {
                let gone = peerwall_backend_bpf::loader::remove_pins(&at.pin_dir)
                    .with_context(|| format!("removing {}", at.pin_dir.display()))
                    .map_err(runtime)?;
                out(&format!(
                    "bpf: detached and unpinned {} pins in {}\n",
                    gone.len(),
                    at.pin_dir.display()
                ))?;
            }
            BackendKind::Nftables => {
                let mut b = NftBackend::new(Nft::host());
                let gone = b
                    .delete_all()
                    .context("deleting peerwall tables")
                    .map_err(runtime)?;
                out(&format!("nftables: deleted {}\n", gone.join(", ")))?;
            }
        }
    }
    Ok(())
}

/// `peerwall inspect`.
pub(super) fn inspect(at: &HostArgs, output: Output) -> Result<(), CliError> {
    at.enter(false)?;
    backends_to_act_on(Some(BackendKind::Bpf), &at.pin_dir, "inspect")?;
    let i = peerwall_backend_bpf::inspect::inspect(&at.pin_dir)
        .with_context(|| format!("pinned datapath in {}", at.pin_dir.display()))
        .map_err(runtime)?;
    match output {
        Output::Json => out(&format!(
            "{}\n",
            serde_json::to_string(&i).map_err(runtime)?
        )),
        Output::Text => out(&peerwall_backend_bpf::inspect::text(&i)),
    }
}

/// `peerwall allow-all`: flips the switch of every backend installed here (or the one asked).
pub(super) fn allow_all(
    state: OnOff,
    backend: Option<BackendKind>,
    at: &HostArgs,
) -> Result<(), CliError> {
    at.enter(false)?;
    let on = state == OnOff::On;
    for b in backends_to_act_on(backend, &at.pin_dir, "switch")? {
        match b {
            BackendKind::Bpf => peerwall_backend_bpf::loader::set_allow_all_pinned(&at.pin_dir, on)
                .with_context(|| format!("pinned datapath in {}", at.pin_dir.display()))
                .map_err(runtime)?,
            BackendKind::Nftables => {
                use peerwall_backend_nftables::{switch, Runner};
                let nft = Nft::host();
                let listing = nft.list_ruleset_terse().map_err(runtime)?;
                let cmds = if on {
                    switch::on_commands(&listing)
                } else {
                    switch::off_commands(&listing)
                };
                if !cmds.is_empty() {
                    nft.apply_json(&serde_json::json!({ "nftables": cmds }))
                        .context("setting the nftables emergency switch")
                        .map_err(runtime)?;
                }
            }
        }
        tracing::warn!(
            backend = backend_name(b),
            allow_all = on,
            "emergency switch set"
        );
        out(&format!(
            "{}: allow-all {}\n",
            backend_name(b),
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
    at.enter(false)?;
    let mut counters = Vec::new();
    for b in backends_to_act_on(backend, &at.pin_dir, "count")? {
        match b {
            BackendKind::Nftables => counters.extend(
                NftBackend::new(Nft::host())
                    .counters()
                    .context("reading rule counters")
                    .map_err(runtime)?,
            ),
            BackendKind::Bpf => {
                let i = peerwall_backend_bpf::inspect::inspect(&at.pin_dir)
                    .with_context(|| format!("pinned datapath in {}", at.pin_dir.display()))
                    .map_err(runtime)?;
                for c in i.chains {
                    let (table, chain) = c.name.split_once('/').unwrap_or(("", &c.name));
                    counters.extend(c.rules.into_iter().map(|r| peerwall_backend::RuleCounter {
                        table: table.to_string(),
                        chain: chain.to_string(),
                        rule: r.name,
                        packets: r.packets,
                        bytes: r.bytes,
                    }));
                }
            }
        }
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
