//! `peerwall compile`: validate and print what a backend would install (its rendering).

use super::*;

/// Print the rendering of `files` for `backend`.
pub(super) fn compile(
    files: &[PathBuf],
    backend: BackendKind,
    output: Output,
) -> Result<(), CliError> {
    match backend {
        BackendKind::Bpf => compile_bpf(files, output),
        BackendKind::Nftables => compile_nftables(files, output),
    }
}

fn compile_bpf(files: &[PathBuf], output: Output) -> Result<(), CliError> {
    let compiled = load_and_compile(files)?;
    let view = bpf_view(&compiled.policy)?;
    match output {
        Output::Json => out(&format!(
            "{}\n",
            serde_json::to_string_pretty(&view).map_err(runtime)?
        )),
        Output::Text => out(&peerwall_backend_bpf::view::text(&view)),
    }
}

/// What the bpf backend loads for `policy` on this host's interfaces (its rules left to an
/// nftables enforcer named in warnings).
pub(super) fn bpf_view(
    policy: &peerwall_policy::ir::Policy,
) -> Result<peerwall_backend_bpf::view::PolicyView, CliError> {
    let ifaces = peerwall_backend_bpf::loader::host_ifaces()
        .context("listing interfaces")
        .map_err(runtime)?;
    let ifaces: Vec<peerwall_backend_bpf::maps::Iface> = ifaces
        .into_iter()
        .map(|i| peerwall_backend_bpf::maps::Iface {
            name: i.name,
            ifindex: i.ifindex,
        })
        .collect();
    let bp = peerwall_backend_bpf::maps::compile(policy, &ifaces).map_err(input)?;
    for note in peerwall_backend_bpf::maps::left_to_nftables(policy) {
        tracing::warn!("{note}");
    }
    Ok(peerwall_backend_bpf::view::describe(&bp))
}

fn compile_nftables(files: &[PathBuf], output: Output) -> Result<(), CliError> {
    let compiled = load_and_compile(files)?;
    let tables = nftables::render_policy(&compiled.policy, RenderOptions::default());
    match output {
        Output::Text => {
            let s: Vec<String> = tables.iter().map(text::table_text).collect();
            out(&s.join("\n"))
        }
        Output::Json => {
            let cmds: Vec<nftables::model::Command<'_>> = tables
                .iter()
                .map(nftables::model::Command::Create)
                .collect();
            let doc = nftables::json::document(&cmds);
            out(&format!(
                "{}\n",
                serde_json::to_string_pretty(&doc).map_err(runtime)?
            ))
        }
    }
}
