//! The datapaths that run under `peerwall agent`, as a gateway runs them.
//!
//! The bpf rows: a deployed agent's route watcher holds the local-address mirror's lease, so a
//! new flow's path is one trie lookup (`ebpf/src/local.rs`). `peerwall apply` exits once the
//! policy is in force and withdraws that lease with it, which would leave every new flow's
//! path to a FIB lookup that no deployed gateway pays. So these rows are installed by the
//! agent, and measured only once `peerwall inspect` says the mirror answers IPv4 paths.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::control::Agent;
use super::*;

/// Where the agent serves `/metrics` (and `/events` for the events rows), inside the
/// gateway's own network namespace.
pub(crate) const METRICS_ADDR: &str = "127.0.0.1:9464";

/// `p` as the only file of a directory of its own under the lab's, for a `dir:` source.
pub(crate) fn policy_dir(lab: &Lab, name: &str, p: &Policy) -> PathBuf {
    let dir = lab.dir.join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(
        dir.join("gateway.yaml"),
        serde_yaml::to_string(&p.fwc).expect("yaml"),
    )
    .expect("write");
    dir
}

/// `peerwall inspect` of the lab's pins, or None while there is nothing to inspect yet.
fn inspect(lab: &Lab) -> Option<String> {
    let o = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", lab.gw.name()))
        .arg(peerwall_bin())
        .args(["inspect", "--pin-dir", &lab.pins()])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).into_owned())
}

/// Whether the pinned datapath takes new IPv4 flows' paths from the local-address mirror.
pub(crate) fn mirror_answers(lab: &Lab) -> bool {
    inspect(lab).is_some_and(|out| {
        out.lines()
            .any(|l| l.starts_with("paths IPv4 from the local-address mirror"))
    })
}

/// What a datapath's backend refused to enforce in this run (policy, datapath, the agent's
/// error), for the results page: such a row is left out, not measured on a stale policy.
pub(crate) static REFUSED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// `peerwall agent --backend bpf` enforcing `p` in the gateway (with `--xdp` when asked),
/// once its policy is in force and the mirror answers: the agent starts its route watcher
/// after its first apply has attached the programs. None when the agent refused the policy
/// (its error noted in [`REFUSED`]).
pub(crate) fn bpf_agent(lab: &Lab, p: &Policy, extra: &[&str]) -> Option<Agent> {
    let dir = policy_dir(lab, "bpf-policies", p);
    let agent = Agent::spawn(lab, &dir, "bpf", METRICS_ADDR, extra);
    let started = Instant::now();
    while !mirror_answers(lab) {
        let log = agent.log_tail();
        if let Some(line) = log.lines().find(|l| l.contains("apply failed")) {
            let why = line.split("error=").nth(1).unwrap_or(line).to_string();
            eprintln!("{}: the bpf agent refused the policy: {why}", p.name);
            if let Ok(mut r) = REFUSED.lock() {
                r.push(format!(
                    "{}, peerwall bpf{}: {why}",
                    p.name,
                    if extra.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", extra.join(" "))
                    }
                ));
            }
            return None;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the bpf agent's local-address mirror never answered IPv4 paths: {}\nthe agent's log:\n{log}",
            inspect(lab).unwrap_or_default(),
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Some(agent)
}
