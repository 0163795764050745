//! What a backend would install for a policy, printed (`peerwall compile`, `compile
//! --cluster`): each backend's own rendering behind one call, so that the commands above name
//! no backend's types. nftables: its tables as `nft list` prints them, or the JSON commands
//! `nft -j -f` takes; bpf: the map contents it would load on this host's interfaces.

use peerwall_backend_bpf::{describe, loader, maps};
use peerwall_backend_nftables::{self as nftables, RenderOptions};
use peerwall_policy::ir::Policy;

use crate::BackendKind;

/// How a rendering is printed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// As the backend's own tools show it.
    Text,
    /// JSON (nftables: `nft -j` commands; bpf: the map contents).
    Json,
}

/// A backend's rendering of a policy, and what it says about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rendering {
    /// The rendering, newline-terminated.
    pub text: String,
    /// Warnings: rules this backend leaves to another enforcer (bpf: to nftables), one each.
    pub notes: Vec<String>,
}

/// Rendering failed.
#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    /// The host's interfaces could not be listed (bpf resolves the policy's interfaces).
    #[error("listing interfaces: {0}")]
    Interfaces(#[source] std::io::Error),
    /// The policy asks for what the backend cannot load.
    #[error(transparent)]
    Policy(#[from] peerwall_backend_bpf::maps::BpfCompileError),
    /// Writing JSON.
    #[error("writing JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// `policy` as backend `kind` would install it.
pub fn render(
    policy: &Policy,
    kind: BackendKind,
    format: Format,
) -> Result<Rendering, RenderError> {
    match kind {
        BackendKind::Nftables => Ok(Rendering {
            text: nftables_text(policy, format)?,
            notes: Vec::new(),
        }),
        BackendKind::Bpf => bpf(policy, format),
    }
}

fn nftables_text(policy: &Policy, format: Format) -> Result<String, serde_json::Error> {
    let tables = nftables::render_policy(policy, RenderOptions::default());
    match format {
        Format::Text => Ok(tables
            .iter()
            .map(nftables::text::table_text)
            .collect::<Vec<_>>()
            .join("\n")),
        Format::Json => {
            let cmds: Vec<nftables::model::Command<'_>> = tables
                .iter()
                .map(nftables::model::Command::Create)
                .collect();
            Ok(format!(
                "{}\n",
                serde_json::to_string_pretty(&nftables::json::document(&cmds))?
            ))
        }
    }
}

/// What the bpf backend loads for `policy` on this host's interfaces; the rules it leaves to
/// an nftables enforcer in the notes.
fn bpf(policy: &Policy, format: Format) -> Result<Rendering, RenderError> {
    let ifaces: Vec<maps::Iface> = loader::host_ifaces()
        .map_err(RenderError::Interfaces)?
        .into_iter()
        .map(|i| maps::Iface {
            name: i.name,
            ifindex: i.ifindex,
        })
        .collect();
    let described = describe::describe(&maps::compile(policy, &ifaces)?);
    let text = match format {
        Format::Text => describe::text(&described),
        Format::Json => format!("{}\n", serde_json::to_string_pretty(&described)?),
    };
    Ok(Rendering {
        text,
        notes: maps::left_to_nftables(policy)
            .iter()
            .map(ToString::to_string)
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> Policy {
        let yaml = include_str!("../../../../examples/provider-protection.yaml");
        let objects = peerwall_intent::load::parse_documents(yaml, "example").expect("parses");
        peerwall_policy::compile::compile(&objects)
            .expect("compiles")
            .policy
    }

    #[test]
    fn nftables_prints_its_table_as_nft_lists_it_and_as_nft_json_commands() {
        let r = render(&policy(), BackendKind::Nftables, Format::Text).expect("renders");
        assert!(
            r.text.contains("table inet peerwall_cluster1 {"),
            "{}",
            r.text
        );
        assert!(r.text.contains("10.20.1.2"), "{}", r.text);
        assert!(r.notes.is_empty());
        let j = render(&policy(), BackendKind::Nftables, Format::Json).expect("renders");
        let doc: serde_json::Value = serde_json::from_str(&j.text).expect("JSON");
        assert!(doc["nftables"].is_array(), "{doc}");
    }
}
