//! The commit this binary is built from, for `peerwall version` and `--version`: `git
//! rev-parse` at build time into `PEERWALL_GIT_COMMIT` (`unknown` outside a git checkout).
//! Rebuilt when HEAD moves (a commit, a checkout); uncommitted edits are not tracked here (that
//! would rebuild the binary on every `git add`).

use std::path::Path;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let o = Command::new("git").args(args).output().ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

fn main() {
    let commit = git(&["rev-parse", "HEAD"]);
    if let Some(dir) = git(&["rev-parse", "--absolute-git-dir"]) {
        let dir = Path::new(&dir);
        // Only files that exist: a missing one would rerun this script on every build.
        let mut watched = vec![dir.join("HEAD"), dir.join("packed-refs")];
        if let Some(head) = git(&["symbolic-ref", "-q", "HEAD"]) {
            watched.push(dir.join(head));
        }
        for f in watched.iter().filter(|f| f.exists()) {
            println!("cargo:rerun-if-changed={}", f.display());
        }
    }
    let shown = commit.unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=PEERWALL_GIT_COMMIT={shown}");
}
