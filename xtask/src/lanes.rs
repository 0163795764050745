//! `cargo xtask test`'s run of the test binaries: two at a time, most of them.
//!
//! Many of the integration tests wait (for an API server, a kubelet, a conntrack timeout, a
//! packet that must not arrive) more than they compute, so on a two-core machine two binaries
//! side by side finish in little more than the longer lane. Binaries whose assertions are about
//! rates or about what *every other* process left behind run alone, after the rest:
//! [`ALONE`]. Each binary's output is kept in `target/tmp/test-logs/<name>.log` and printed
//! whole when it ends, so lanes never interleave their lines; every binary runs even after one
//! fails (as `--no-fail-fast`), and the summary names each with its time.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{bail, Context, Result};

/// Test binaries (target names) that run alone, in this order, after the others:
/// `faults` asserts apply rates under load; `paths` checks what every exited process left
/// behind, so nothing may be starting or stopping beside it.
const ALONE: [&str; 2] = ["faults", "paths"];

/// The longest binaries first (longest-first scheduling keeps the two lanes even); the rest
/// follow in cargo's order.
const LONGEST: [&str; 6] = [
    "kube",
    "differential",
    "netpol",
    "names",
    "protection",
    "nftables",
];

/// One test executable as cargo built it.
#[derive(Debug, Clone)]
struct Binary {
    /// `package/target`, e.g. `peerwall/kube`.
    name: String,
    target: String,
    exe: PathBuf,
    /// The package's directory: cargo runs a test binary there.
    cwd: PathBuf,
}

/// Build every test binary of `build` (a `cargo test ... ` command without `--no-run`), then
/// run them in two lanes plus the [`ALONE`] ones; `env` goes to each binary.
pub fn run(mut build: Command, logs: &Path, env: &[(&str, String)]) -> Result<()> {
    let bins = built(&mut build)?;
    std::fs::create_dir_all(logs).with_context(|| format!("creating {}", logs.display()))?;
    let (alone, shared): (Vec<Binary>, Vec<Binary>) = bins
        .into_iter()
        .partition(|b| ALONE.contains(&b.target.as_str()));
    let mut queue: Vec<Binary> = shared;
    let rank = |b: &Binary| {
        LONGEST
            .iter()
            .position(|t| *t == b.target)
            .unwrap_or(LONGEST.len())
    };
    queue.sort_by_key(rank);
    let queue = Arc::new(Mutex::new(VecDeque::from(queue)));
    let results: Arc<Mutex<Vec<(String, f64, bool)>>> = Arc::default();
    let started = Instant::now();
    let lanes: Vec<_> = (0..2)
        .map(|_| {
            let (queue, results) = (queue.clone(), results.clone());
            let (logs, env) = (logs.to_path_buf(), owned(env));
            std::thread::spawn(move || loop {
                let next = queue.lock().map(|mut q| q.pop_front()).unwrap_or(None);
                let Some(b) = next else { break };
                let r = one(&b, &logs, &env);
                if let Ok(mut all) = results.lock() {
                    all.push(r);
                }
            })
        })
        .collect();
    for l in lanes {
        let _ = l.join();
    }
    let env = owned(env);
    for b in &alone {
        let r = one(b, logs, &env);
        if let Ok(mut all) = results.lock() {
            all.push(r);
        }
    }
    let all = results.lock().map(|r| r.clone()).unwrap_or_default();
    println!(
        "\ntest binaries: {} in {:.0} s",
        all.len(),
        started.elapsed().as_secs_f64()
    );
    for (name, secs, ok) in &all {
        println!(
            "  {:<8} {secs:>6.0} s  {name}",
            if *ok { "ok" } else { "FAILED" }
        );
    }
    let failed: Vec<&str> = all
        .iter()
        .filter(|(_, _, ok)| !ok)
        .map(|(n, _, _)| n.as_str())
        .collect();
    if !failed.is_empty() {
        bail!("test binaries failed: {}", failed.join(", "));
    }
    Ok(())
}

fn owned(env: &[(&str, String)]) -> Vec<(String, String)> {
    env.iter()
        .map(|(k, v)| ((*k).to_string(), v.clone()))
        .collect()
}

/// Run one binary with its output to its log; print the log when it ends.
fn one(b: &Binary, logs: &Path, env: &[(String, String)]) -> (String, f64, bool) {
    let log_path = logs.join(format!("{}.log", b.name.replace('/', "-")));
    let t = Instant::now();
    println!("running {} ({})", b.name, b.exe.display());
    let ok = match std::fs::File::create(&log_path) {
        Ok(log) => {
            let mut c = Command::new(&b.exe);
            c.current_dir(&b.cwd).envs(env.iter().map(|(k, v)| (k, v)));
            match log.try_clone() {
                Ok(err) => c
                    .stdout(log)
                    .stderr(err)
                    .status()
                    .is_ok_and(|s| s.success()),
                Err(_) => false,
            }
        }
        Err(_) => false,
    };
    let secs = t.elapsed().as_secs_f64();
    let text = std::fs::read_to_string(&log_path).unwrap_or_default();
    println!(
        "---- {} {} in {secs:.0} s (log: {})\n{text}",
        b.name,
        if ok { "passed" } else { "FAILED" },
        log_path.display()
    );
    (b.name.clone(), secs, ok)
}

/// `cargo test --no-run --message-format=json-render-diagnostics`: the test executables.
fn built(build: &mut Command) -> Result<Vec<Binary>> {
    build
        .args(["--no-run", "--message-format=json-render-diagnostics"])
        .stdout(Stdio::piped());
    let shown = format!("{build:?}");
    let mut child = build.spawn().with_context(|| format!("running {shown}"))?;
    let out = child.stdout.take().context("cargo's stdout")?;
    let mut bins = Vec::new();
    for line in BufReader::new(out).lines() {
        let line = line.context("reading cargo's messages")?;
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        if let Some(b) = binary(&msg) {
            bins.push(b);
        }
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("{shown} failed: {status}");
    }
    if bins.is_empty() {
        bail!("{shown} built no test binary");
    }
    Ok(bins)
}

/// A `compiler-artifact` message of a test executable, as a [`Binary`].
fn binary(msg: &serde_json::Value) -> Option<Binary> {
    if msg["reason"] != "compiler-artifact" || msg["profile"]["test"] != true {
        return None;
    }
    let exe = PathBuf::from(msg["executable"].as_str()?);
    let manifest = PathBuf::from(msg["manifest_path"].as_str()?);
    let target = msg["target"]["name"].as_str()?.to_string();
    // package_id: "path+file:///…/agent#peerwall@0.1.0" (or "…#0.1.0" when the name is the dir's).
    let id = msg["package_id"].as_str().unwrap_or_default();
    let package = manifest
        .parent()
        .and_then(|d| d.file_name())
        .map(|d| d.to_string_lossy().into_owned())
        .unwrap_or_default();
    let package = id
        .rsplit_once('#')
        .and_then(|(_, v)| v.split_once('@').map(|(n, _)| n.to_string()))
        .unwrap_or(package);
    Some(Binary {
        name: format!("{package}/{target}"),
        target,
        exe,
        cwd: manifest.parent()?.to_path_buf(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_test_artifact_names_its_package_target_and_directory() {
        let msg = serde_json::json!({
            "reason": "compiler-artifact",
            "package_id": "path+file:///w/agent#peerwall@0.1.0",
            "manifest_path": "/w/agent/Cargo.toml",
            "target": {"name": "kube", "kind": ["test"]},
            "profile": {"test": true},
            "executable": "/w/target/debug/deps/kube-0123"
        });
        let b = binary(&msg).expect("a test binary");
        assert_eq!(b.name, "peerwall/kube");
        assert_eq!(b.target, "kube");
        assert_eq!(b.cwd, PathBuf::from("/w/agent"));
        assert_eq!(b.exe, PathBuf::from("/w/target/debug/deps/kube-0123"));
        let mut lib = msg.clone();
        lib["profile"]["test"] = false.into();
        assert!(binary(&lib).is_none(), "a library artifact is no test");
        lib["profile"]["test"] = true.into();
        lib["package_id"] = "path+file:///w/policy#0.1.0".into();
        lib["manifest_path"] = "/w/policy/Cargo.toml".into();
        assert_eq!(binary(&lib).map(|b| b.name), Some("policy/kube".into()));
    }
}
