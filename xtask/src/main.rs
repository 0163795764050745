//! Project orchestration: `cargo xtask <task>`.

use std::process::Command;

use anyhow::{bail, Context, Result};

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

fn run(mut c: Command) -> Result<()> {
    let shown = format!("{c:?}");
    let status = c.status().with_context(|| format!("running {shown}"))?;
    if !status.success() {
        bail!("{shown} failed: {status}");
    }
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("test") => {
            // Everything: unit tests, then root integration tests in network namespaces.
            let mut c = cargo();
            c.args(["test", "--workspace"]).args(&args[1..]);
            run(c)
        }
        Some("crd") => {
            let mut c = cargo();
            c.args(["run", "-q", "-p", "peerwall", "--", "crd"]);
            let out = c.output().context("running peerwall crd")?;
            if !out.status.success() {
                bail!(
                    "peerwall crd failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            std::fs::write("deploy/crd.yaml", out.stdout).context("writing deploy/crd.yaml")?;
            println!("wrote deploy/crd.yaml");
            Ok(())
        }
        _ => {
            eprintln!("usage: cargo xtask <test|crd>");
            eprintln!("  test   run the whole test suite (root needed for the namespace tests)");
            eprintln!("  crd    regenerate deploy/crd.yaml from the Rust types");
            bail!("unknown task")
        }
    }
}
