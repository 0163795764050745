//! `peerwall compile`: validate and print what a backend would install (its rendering).

use super::*;
use peerwall_backend_select::rendering::{self, Format, RenderError};

/// Print the rendering of `files` for `backend`.
pub(super) fn compile(
    files: &[PathBuf],
    backend: BackendKind,
    output: Output,
) -> Result<(), CliError> {
    let compiled = load_and_compile(files)?;
    let format = match output {
        Output::Text => Format::Text,
        Output::Json => Format::Json,
    };
    out(&rendered(&compiled.policy, backend, format)?)
}

/// `policy` as `backend` would install it here, its notes (rules a backend leaves to another
/// enforcer) logged as warnings.
pub(super) fn rendered(
    policy: &ir::Policy,
    backend: BackendKind,
    format: Format,
) -> Result<String, CliError> {
    let r = rendering::render(policy, backend, format).map_err(|e| match e {
        e @ RenderError::Policy(_) => input(e),
        e => runtime(e),
    })?;
    for note in &r.notes {
        tracing::warn!("{note}");
    }
    Ok(r.text)
}
