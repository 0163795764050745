//! Builds the eBPF object (`ebpf/`, nightly + bpf-linker) and leaves it in OUT_DIR, from where
//! the loader embeds it: users run one binary. `cargo xtask setup` installs the toolchain.
//!
//! One build for every profile: aya-build builds in a target directory under the directory
//! `OUT_DIR` names, and each profile (dev, release, clippy's check, doc, the fuzz targets')
//! runs this script with an `OUT_DIR` of its own, so each built `core` for the BPF target
//! again (about 80 s each from an empty target directory). Here aya-build gets one directory
//! beside the profiles (`<target>/ebpf-build`), under a file lock (two profiles may build at
//! once), and the object is copied into this run's own `OUT_DIR`.

use std::path::{Path, PathBuf};

use anyhow::Context;

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
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let shared = shared_dir(&out);
    std::fs::create_dir_all(&shared).with_context(|| format!("creating {}", shared.display()))?;
    let lock = std::fs::File::create(shared.join("lock"))
        .with_context(|| format!("creating {}/lock", shared.display()))?;
    lock.lock()
        .with_context(|| format!("locking {}/lock", shared.display()))?;
    // aya-build reads OUT_DIR from the environment; the crate embeds from its own OUT_DIR,
    // which cargo gives rustc, not this process's environment.
    std::env::set_var("OUT_DIR", &shared);
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "peerwall-ebpf",
            root_dir: ebpf_dir,
            ..Default::default()
        }],
        aya_build::Toolchain::default(),
    )?;
    std::fs::copy(shared.join("peerwall"), out.join("peerwall"))
        .with_context(|| format!("copying the eBPF object into {}", out.display()))?;
    Ok(())
}

/// `<target>/ebpf-build` for an `OUT_DIR` of `<target>/<profile>/build/<package>-<hash>/out`
/// (or, building for a named target, `<target>/<triple>/<profile>/…`); `OUT_DIR` itself where
/// it is laid out otherwise.
fn shared_dir(out: &Path) -> PathBuf {
    match out.ancestors().nth(4) {
        Some(target)
            if out
                .parent()
                .and_then(Path::parent)
                .is_some_and(|b| b.ends_with("build")) =>
        {
            target.join("ebpf-build")
        }
        _ => out.to_path_buf(),
    }
}
