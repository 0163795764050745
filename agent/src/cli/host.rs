//! Commands on this host's kernel: apply, delete, inspect, allow-all, counters.

use super::*;

/// `peerwall apply`.
pub(super) fn apply(files: &[PathBuf], backend: BackendKind, bpf: BpfOpts) -> Result<(), CliError> {
    match backend {
        BackendKind::Bpf => apply_bpf(files, bpf),
        BackendKind::Nftables => {
            let compiled = load_and_compile(files)?;
            apply_with(&mut NftBackend::new(Nft::host()), &compiled.policy, |_| {
                false
            })
        }
    }
}

fn apply_bpf(files: &[PathBuf], bpf: BpfOpts) -> Result<(), CliError> {
    use peerwall_backend_bpf::loader;
    let compiled = load_and_compile(files)?;
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

/// `peerwall delete`.
pub(super) fn delete(backend: BackendKind, pin_dir: &Path) -> Result<(), CliError> {
    match backend {
        BackendKind::Bpf => {
            let gone = peerwall_backend_bpf::loader::remove_pins(pin_dir)
                .with_context(|| format!("removing {}", pin_dir.display()))
                .map_err(runtime)?;
            tracing::info!(pins = gone.len(), "bpf datapath detached and unpinned");
            Ok(())
        }
        BackendKind::Nftables => {
            let mut b = NftBackend::new(Nft::host());
            let gone = b
                .delete_all()
                .context("deleting peerwall tables")
                .map_err(runtime)?;
            tracing::info!(tables = ?gone, "peerwall tables deleted");
            Ok(())
        }
    }
}

/// `peerwall inspect`.
pub(super) fn inspect(pin_dir: &Path, output: Output) -> Result<(), CliError> {
    let i = peerwall_backend_bpf::inspect::inspect(pin_dir)
        .with_context(|| format!("pinned datapath in {}", pin_dir.display()))
        .map_err(runtime)?;
    match output {
        Output::Json => out(&format!(
            "{}\n",
            serde_json::to_string(&i).map_err(runtime)?
        )),
        Output::Text => out(&peerwall_backend_bpf::inspect::text(&i)),
    }
}

/// `peerwall allow-all`.
pub(super) fn allow_all(
    state: OnOff,
    backend: BackendKind,
    pin_dir: &Path,
) -> Result<(), CliError> {
    match backend {
        BackendKind::Bpf => {
            peerwall_backend_bpf::loader::set_allow_all_pinned(pin_dir, state == OnOff::On)
                .with_context(|| format!("pinned datapath in {}", pin_dir.display()))
                .map_err(runtime)?
        }
        BackendKind::Nftables => {
            use peerwall_backend_nftables::{switch, Runner};
            let nft = Nft::host();
            let listing = nft.list_ruleset_terse().map_err(runtime)?;
            let cmds = match state {
                OnOff::On => switch::on_commands(&listing),
                OnOff::Off => switch::off_commands(&listing),
            };
            if !cmds.is_empty() {
                nft.apply_json(&serde_json::json!({ "nftables": cmds }))
                    .context("setting the nftables emergency switch")
                    .map_err(runtime)?;
            }
        }
    }
    tracing::warn!(allow_all = state == OnOff::On, "emergency switch set");
    Ok(())
}

/// `peerwall counters`.
pub(super) fn counters(output: Output) -> Result<(), CliError> {
    let b = NftBackend::new(Nft::host());
    let counters = b
        .counters()
        .context("reading rule counters")
        .map_err(runtime)?;
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
