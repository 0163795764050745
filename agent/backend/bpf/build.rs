//! Builds the eBPF object (`ebpf/`, nightly + bpf-linker) and leaves it in OUT_DIR, from where
//! the loader embeds it: users run one binary. `cargo xtask setup` installs the toolchain.

use std::path::PathBuf;

fn main() -> anyhow::Result<()> {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    // agent/backend/bpf → the workspace root.
    let root = manifest
        .ancestors()
        .nth(3)
        .ok_or_else(|| anyhow::anyhow!("{} is not agent/backend/bpf", manifest.display()))?;
    let ebpf = root.join("ebpf");
    let common = root.join("common");
    println!("cargo:rerun-if-changed={}", common.join("src").display());
    println!("cargo:rerun-if-changed={}", ebpf.join("src").display());
    // bpf-linker comes from `cargo xtask setup` (linked into ~/.cargo/bin); say so if missing.
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join("bpf-linker").exists()))
        .unwrap_or(false);
    if !found {
        anyhow::bail!("bpf-linker not found on PATH: run `cargo xtask setup` (it builds bpf-linker against the nightly's LLVM)");
    }
    let ebpf_dir = ebpf
        .to_str()
        .ok_or_else(|| anyhow::anyhow!("non-UTF-8 path {}", ebpf.display()))?;
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "peerwall-ebpf",
            root_dir: ebpf_dir,
            ..Default::default()
        }],
        aya_build::Toolchain::default(),
    )
}
