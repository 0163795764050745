//! The previous release's `peerwall`, for the upgrade fault (`tests/faults.rs`): the commit
//! `tests/previous-release` names, built once into the cache as
//! `<cache>/previous-<12 hex>/peerwall` (its sources are removed afterwards; it builds in the
//! project's target directory in the dev profile, sharing the dependencies' builds with the
//! tests).
//! The test finds it there, or at `$PEERWALL_PREVIOUS`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::docs::Step;

/// `[profile.dev] debug` of this workspace's Cargo.toml (a unit test holds them together).
const DEV_DEBUG: &str = "line-tables-only";

/// Build the previous release unless the cache holds it; returns the binary. It builds in the
/// project's own target directory (`target`), in the dev profile as this workspace sets it
/// (`[profile.dev]` in Cargo.toml: debug line tables only), so the dependencies both releases
/// share (most of them, and the slowest to build) are compiled once, for it and for the
/// tests' build; the upgrade test needs its behaviour, not its speed (the datapath it leaves
/// is the kernel's: nftables, or the eBPF object its build script builds optimized). Run it
/// before the tests are built, which then link this release's own `debug/peerwall` over the
/// previous one's.
pub fn ensure(root: &Path, cache: &Path, target: &Path, step: Step) -> Result<PathBuf> {
    let named = root.join("tests").join("previous-release");
    let commit =
        std::fs::read_to_string(&named).with_context(|| format!("reading {}", named.display()))?;
    let commit = commit.trim();
    if commit.len() < 12 || !commit.bytes().all(|b| b.is_ascii_hexdigit()) {
        bail!("{}: {commit:?} is not a commit id", named.display());
    }
    let dir = cache.join(format!("previous-{}", &commit[..12]));
    let bin = dir.join("peerwall");
    if bin.exists() {
        return Ok(bin);
    }
    let known = || {
        Command::new("git")
            .current_dir(root)
            .args(["cat-file", "-e", &format!("{commit}^{{commit}}")])
            .status()
            .is_ok_and(|s| s.success())
    };
    if !known() {
        // A shallow clone lacks the history: fetch it from where the clone came from.
        let _ = Command::new("git")
            .current_dir(root)
            .args(["fetch", "--quiet", "--unshallow"])
            .status();
        let _ = Command::new("git")
            .current_dir(root)
            .args(["fetch", "--quiet", "origin", commit])
            .status();
    }
    if !known() {
        bail!(
            "the previous release {commit} is not in this clone (a shallow clone?): `git fetch --unshallow`, or set PEERWALL_PREVIOUS to its peerwall binary"
        );
    }
    let src = dir.join("src");
    let _ = std::fs::remove_dir_all(&src);
    std::fs::create_dir_all(&src)?;
    let tar = dir.join("src.tar");
    let mut archive = Command::new("git");
    archive
        .current_dir(root)
        .args(["archive", "--format=tar", "-o"])
        .arg(&tar)
        .arg(commit);
    step(&format!("git archive {}", &commit[..12]), archive)?;
    let mut untar = Command::new("tar");
    untar.arg("-xf").arg(&tar).arg("-C").arg(&src);
    step("unpacking the previous release", untar)?;
    println!(
        "building the previous release {} for the upgrade test (a few minutes, once)",
        &commit[..12]
    );
    let mut build = Command::new("cargo");
    build
        .current_dir(&src)
        .args(["build", "--locked", "-p", "peerwall"])
        // This workspace's dev profile, which that release's Cargo.toml may not set: the
        // same settings, the same compiled dependencies.
        .env("CARGO_PROFILE_DEV_DEBUG", DEV_DEBUG)
        .env("CARGO_TARGET_DIR", target)
        .env_remove("RUSTC")
        .env_remove("CARGO");
    step(&format!("building peerwall {}", &commit[..12]), build)?;
    std::fs::copy(target.join("debug").join("peerwall"), &bin)
        .with_context(|| format!("copying the previous release to {}", bin.display()))?;
    let _ = std::fs::remove_dir_all(&src);
    let _ = std::fs::remove_file(&tar);
    Ok(bin)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_previous_release_builds_with_this_workspaces_dev_profile() {
        let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.toml");
        let text = std::fs::read_to_string(manifest).unwrap();
        let dev = text.split("[profile.dev]").nth(1).expect("[profile.dev]");
        let section = dev.split("\n[").next().unwrap();
        assert!(
            section.contains(&format!("debug = \"{}\"", super::DEV_DEBUG)),
            "Cargo.toml's [profile.dev] is not what the previous release builds with:{section}"
        );
    }
}
