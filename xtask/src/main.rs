//! Project orchestration: `cargo xtask <task>`.
//!
//! - `setup`: install what building and testing need on a Debian 12 machine (apt packages,
//!   rustup components). Idempotent; run as root.
//! - `test`: formatting and lint checks, then every test (unit, then integration tests that
//!   build their own network namespaces; run as root).
//! - `crd`: regenerate `deploy/crd.yaml` from the Rust types.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

/// Debian packages the tests and the gateway lab use.
const APT_PACKAGES: &[&str] = &[
    "nftables",
    "iproute2",
    "conntrack",
    "iputils-ping",
    "socat",
    "procps",
];

fn root() -> PathBuf {
    // xtask lives in <root>/xtask.
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

fn run(mut c: Command) -> Result<()> {
    let shown = format!("{c:?}");
    let status = c.status().with_context(|| format!("running {shown}"))?;
    if !status.success() {
        bail!("{shown} failed: {status}");
    }
    Ok(())
}

fn setup() -> Result<()> {
    let missing: Vec<&str> = APT_PACKAGES
        .iter()
        .copied()
        .filter(|p| {
            !Command::new("dpkg-query")
                .args(["-W", "-f=${Status}", p])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
                .unwrap_or(false)
        })
        .collect();
    if !missing.is_empty() {
        println!("installing {}", missing.join(" "));
        let mut update = Command::new("apt-get");
        update.args(["update", "-qq"]);
        run(update)?;
        let mut install = Command::new("apt-get");
        install
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive");
        run(install)?;
    }
    let mut comps = Command::new("rustup");
    comps.args(["component", "add", "rustfmt", "clippy"]);
    run(comps)?;
    println!("setup done");
    Ok(())
}

fn test(extra: &[String]) -> Result<()> {
    let mut fmt = cargo();
    fmt.args(["fmt", "--all", "--", "--check"]);
    run(fmt).context("code is not formatted: run `cargo fmt --all`")?;
    let mut clippy = cargo();
    clippy.args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]);
    run(clippy)?;
    let mut t = cargo();
    t.args(["test", "--workspace"]).args(extra);
    run(t)
}

fn crd() -> Result<()> {
    let mut c = cargo();
    c.args(["run", "-q", "--bin", "peerwall", "--", "crd"]);
    let out = c.output().context("running peerwall crd")?;
    if !out.status.success() {
        bail!(
            "peerwall crd failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let path = root().join("deploy/crd.yaml");
    std::fs::write(&path, out.stdout).with_context(|| format!("writing {}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("setup") => setup(),
        Some("test") => test(&args[1..]),
        Some("crd") => crd(),
        _ => {
            eprintln!("usage: cargo xtask <setup|test|crd>");
            eprintln!("  setup  install apt packages and rustup components the tests need (root)");
            eprintln!("  test   fmt + clippy checks, then the whole test suite (root)");
            eprintln!("  crd    regenerate deploy/crd.yaml from the Rust types");
            bail!("unknown task")
        }
    }
}
