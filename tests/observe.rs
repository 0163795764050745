//! Audit mode and events, end to end with real packets, for both backends: the agent
//! (`--events`) enforcing a FirewallConfiguration inside a gateway namespace, `peerwall observe`
//! reading its events, through the agent and straight from the kernel.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use peerwall_testkit::prelude::*;

/// The thesis's block (10.10.1.67 → 10.20.1.2 dropped by `drop_traffic`), audited or not.
fn block(audit: bool) -> String {
    let spec = if audit {
        "spec:\n  audit: true\n"
    } else {
        "spec:\n"
    };
    std::fs::read_to_string(repo("examples/thesis-block.yaml"))
        .unwrap()
        .replace("networking.liqo.io/v1beta1", "peerwall.io/v1alpha1")
        .replacen("spec:\n", spec, 1)
}

/// A private bpf pin directory, removed on drop.
struct Pins(PathBuf);

impl Drop for Pins {
    fn drop(&mut self) {
        let _ = peerwall_backend_bpf::loader::remove_pins(&self.0);
    }
}

fn nsenter(ns: &NetNs) -> Command {
    peerwall_nsenter(ns)
}

fn backend_args(backend: &str, pins: &Option<Pins>) -> Vec<String> {
    let mut v = vec!["--backend".to_string(), backend.to_string()];
    if let Some(p) = pins {
        v.push("--pin-dir".into());
        v.push(p.0.display().to_string());
    }
    v
}

fn start_agent(ns: &NetNs, backend: &str, pins: &Option<Pins>, dir: &Path) -> Proc {
    let mut args = backend_args(backend, pins);
    args.extend(
        [
            "--interval-ms",
            "50",
            "--flow-log",
            "--event-rate",
            "100",
            "--metrics-addr",
            "127.0.0.1:9090",
            "--source",
        ]
        .map(String::from),
    );
    args.push(format!("dir:{}", dir.display()));
    spawn_agent(ns, &args)
}

/// `peerwall observe ARGS --output json` in the gateway: its events as JSON.
fn observe(ns: &NetNs, args: &[&str]) -> Vec<serde_json::Value> {
    let o = nsenter(ns)
        .arg("observe")
        .args(args)
        .args(["--output", "json"])
        .output()
        .expect("peerwall observe");
    assert!(
        o.status.success(),
        "observe failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON event per line"))
        .collect()
}

fn of_flow<'a>(
    events: &'a [serde_json::Value],
    verdict: &str,
    src: &str,
) -> Vec<&'a serde_json::Value> {
    events
        .iter()
        .filter(|e| e["verdict"] == verdict && e["src"] == src && e["dst"] == "10.20.1.2")
        .collect()
}

/// UDP datagrams from `src` to 10.20.1.2:9, each from another source port (a new flow each),
/// `n` of them as fast as Python sends.
fn udp_flood(ns: &NetNs, src: &str, n: u32) {
    let script = format!(
        "import socket\nfor i in range({n}):\n    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n    s.bind(('{src}', 20000 + i % 40000))\n    s.sendto(b'x', ('10.20.1.2', 9))\n    s.close()\n"
    );
    let o = in_ns(ns, "python3", &["-c", &script]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

fn audit_then_enforce(backend: &str) {
    let t = Topology::new();
    let pins = (backend == "bpf").then(|| {
        let root = peerwall_backend_bpf::loader::ensure_bpffs().expect("bpffs");
        Pins(root.join(format!("pwt-obs-{}", std::process::id())))
    });
    let dir = std::env::temp_dir().join(format!("pw-observe-{backend}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("block.yaml");
    std::fs::write(&file, block(true)).unwrap();
    let agent = start_agent(&t.gateway, backend, &pins, &dir);
    // `observe` asks the agent first and reads the kernel only when no agent answers: wait
    // until it serves, or a slow start sends `observe` to the NFLOG group the agent holds.
    wait_until("the agent serving", 20, || {
        in_ns(
            &t.gateway,
            "curl",
            &["-s", "-m", "1", "http://127.0.0.1:9090/healthz"],
        )
        .status
        .success()
    });
    if backend == "nftables" {
        // The agent's NFLOG instance flushes within 10 ms (the kernel's own table: group,
        // port, queue, copy mode, copy range, flush timeout in 1/100 s, users), not after the
        // kernel's default second, which made every event of light traffic a second late.
        let o = in_ns(&t.gateway, "cat", &["/proc/net/netfilter/nfnetlink_log"]);
        let table = String::from_utf8_lossy(&o.stdout).to_string();
        let ours: Vec<Vec<&str>> = table
            .lines()
            .map(|l| l.split_whitespace().collect())
            .filter(|f: &Vec<&str>| f.first() == Some(&"6120"))
            .collect();
        assert_eq!(ours.len(), 1, "{table}");
        assert_eq!((ours[0][4], ours[0][5]), ("128", "1"), "{table}");
    }

    // Audited: the packets the block would drop pass, and each flow shows as a would-drop of
    // drop_traffic.
    wait_until("the audited block in force", 10, || {
        ping(&t.consumer, "10.10.1.67", "10.20.1.2")
            && !of_flow(
                &observe(&t.gateway, &["--verdict", "audit"]),
                "audit-drop",
                "10.10.1.67",
            )
            .is_empty()
    });
    let events = observe(&t.gateway, &["--verdict", "audit"]);
    let e = of_flow(&events, "audit-drop", "10.10.1.67")[0];
    assert_eq!(
        (&e["table"], &e["chain"], &e["rule"]),
        (
            &serde_json::json!("table_name"),
            &serde_json::json!("filter_chain_name"),
            &serde_json::json!("drop_traffic")
        ),
        "{e}"
    );
    assert_eq!(e["iif"], TUNNEL, "{e}");
    assert_eq!(e["oif"], GENEVE, "{e}");
    assert!(e["packets"].as_u64().unwrap() >= 1, "{e}");
    // Allowed traffic makes no drop event; with the flow log, its first packet is reported as
    // accepted by the chain's policy.
    assert!(ping(&t.consumer, "10.10.1.68", "10.20.1.2"));
    let all = observe(&t.gateway, &[]);
    assert!(of_flow(&all, "audit-drop", "10.10.1.68").is_empty());
    wait_until("the flow log's accept", 10, || {
        of_flow(
            &observe(&t.gateway, &["--verdict", "accept"]),
            "accept",
            "10.10.1.68",
        )
        .iter()
        .any(|e| e["rule"].is_null() && e["chain"] == "filter_chain_name")
    });

    // Audit off: enforced at once, the drop reported with its rule and counted.
    std::fs::write(&file, block(false)).unwrap();
    wait_until("the block enforced", 10, || {
        !ping(&t.consumer, "10.10.1.67", "10.20.1.2")
    });
    wait_until("a drop event", 10, || {
        !of_flow(
            &observe(&t.gateway, &["--verdict", "drop", "--rule", "drop_traffic"]),
            "drop",
            "10.10.1.67",
        )
        .is_empty()
    });
    // A burst of five denied pings in one flow, then silence: the first is reported at once,
    // the other four once the flow has been quiet for an interval (no later packet would
    // carry them), so the flow's events add up to exactly the five packets sent.
    let icmp_drops = || -> u64 {
        of_flow(
            &observe(&t.gateway, &["--verdict", "drop"]),
            "drop",
            "10.10.1.67",
        )
        .iter()
        .filter(|e| e["proto"] == 1)
        .map(|e| e["packets"].as_u64().unwrap())
        .sum()
    };
    std::thread::sleep(Duration::from_millis(2500));
    let before = icmp_drops();
    let burst = in_ns(
        &t.consumer,
        "ping",
        &[
            "-c",
            "5",
            "-i",
            "0.1",
            "-W",
            "1",
            "-I",
            "10.10.1.67",
            "10.20.1.2",
        ],
    );
    let out = String::from_utf8_lossy(&burst.stdout);
    assert!(out.contains("5 packets transmitted, 0 received"), "{out}");
    wait_until("the whole burst in events", 5, || {
        icmp_drops() == before + 5
    });
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(icmp_drops(), before + 5, "each packet in exactly one event");

    let metrics = in_ns(&t.gateway, "curl", &["-s", "http://127.0.0.1:9090/metrics"]);
    let metrics = String::from_utf8_lossy(&metrics.stdout);
    assert!(
        metrics.lines().any(|l| l.starts_with(
            "peerwall_drops_total{table=\"table_name\",chain=\"filter_chain_name\",rule=\"drop_traffic\",verdict=\"drop\"}"
        )),
        "{metrics}"
    );

    // A flood of new denied flows: events stay within the rate limit, allowed traffic loses
    // nothing.
    let before = observe(&t.gateway, &[]).len();
    let started = Instant::now();
    let allowed = {
        let ns = t.consumer.name().to_string();
        std::thread::spawn(move || {
            Command::new("ip")
                .args(["netns", "exec", &ns, "ping", "-c", "100", "-i", "0.02"])
                .args(["-I", "10.10.1.68", "10.20.1.2"])
                .output()
                .expect("ping")
        })
    };
    udp_flood(&t.consumer, "10.10.1.67", 20_000);
    let allowed = allowed.join().unwrap();
    let secs = started.elapsed().as_secs_f64();
    let out = String::from_utf8_lossy(&allowed.stdout);
    assert!(
        out.contains(" 0% packet loss"),
        "allowed traffic lost packets under the flood: {out}"
    );
    std::thread::sleep(Duration::from_millis(600));
    let flood: Vec<serde_json::Value> = observe(&t.gateway, &[])
        .into_iter()
        .skip(before)
        .filter(|e| e["proto"] == 17 && e["verdict"] == "drop")
        .collect();
    // 100 events/s (bpf: per CPU, nftables: per table) with a burst of 200, on 2 CPUs.
    let bound = (2.0 * (100.0 * (secs + 1.0) + 200.0)) as usize;
    assert!(
        !flood.is_empty() && flood.len() <= bound,
        "{} flood events in {secs:.1} s (bound {bound})",
        flood.len()
    );

    // No agent: observe reads the kernel itself.
    drop(agent);
    let mut args = vec!["--kernel", "--wait-ms", "2500"];
    let pin_arg;
    if let Some(p) = &pins {
        pin_arg = p.0.display().to_string();
        args.extend(["--backend", "bpf", "--pin-dir", pin_arg.as_str()]);
    }
    let reader = {
        let ns = t.gateway.name().to_string();
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        std::thread::spawn(move || {
            Command::new("nsenter")
                .arg(format!("--net=/run/netns/{ns}"))
                .arg(peerwall())
                .arg("observe")
                .args(&args)
                .args(["--output", "json"])
                .output()
                .expect("observe")
        })
    };
    std::thread::sleep(Duration::from_millis(700));
    assert!(!ping(&t.consumer, "10.10.1.67", "10.20.1.2"));
    let o = reader.join().unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.lines().any(|l| {
            let e: serde_json::Value = serde_json::from_str(l).unwrap();
            e["verdict"] == "drop" && e["rule"] == "drop_traffic" && e["src"] == "10.10.1.67"
        }),
        "kernel observe: {text}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn nftables_audit_then_enforce_with_events() {
    audit_then_enforce("nftables");
}

#[test]
fn bpf_audit_then_enforce_with_events() {
    audit_then_enforce("bpf");
}

fn metric(ns: &NetNs, name: &str) -> Option<String> {
    let o = in_ns(ns, "curl", &["-s", "http://127.0.0.1:9090/metrics"]);
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .find(|l| l.starts_with(name))
        .map(str::to_string)
}

#[test]
fn nftables_allow_all_survives_the_agents_drift_repair_and_new_policies() {
    let t = Topology::new();
    let dir = std::env::temp_dir().join(format!("pw-switch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("block.yaml"), block(false)).unwrap();
    let _agent = start_agent(&t.gateway, "nftables", &None, &dir);
    wait_until("the block enforced", 10, || {
        !ping(&t.consumer, "10.10.1.67", "10.20.1.2")
    });
    let switch = |state: &str| {
        let o = nsenter(&t.gateway)
            .args(["allow-all", state, "--backend", "nftables"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    // Drift made by hand (the block's table deleted), then waited for until the agent has
    // repaired it: the repair is the marker that the agent acted in the meantime, so what
    // holds after it held through a repair (a fixed sleep would pass with a stalled agent).
    let repairs = || {
        metric(&t.gateway, "peerwall_drift_repairs_total")
            .and_then(|l| l.rsplit(' ').next().and_then(|v| v.parse::<u64>().ok()))
            .unwrap_or(0)
    };
    let drift_then_repair = |what: &str| {
        let before = repairs();
        let o = in_ns(&t.gateway, "nft", &["delete", "table", "ip", "table_name"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        wait_until(what, 10, || {
            repairs() > before
                && in_ns(&t.gateway, "nft", &["list", "table", "ip", "table_name"])
                    .status
                    .success()
        });
    };
    switch("on");
    assert!(ping(&t.consumer, "10.10.1.67", "10.20.1.2"), "switch on");
    // The agent takes the switch in first (re-planning its tables with it): a table deleted
    // while it does so is recreated by that transaction, not by a repair, and the marker below
    // would never come.
    wait_until("the switch noticed", 10, || {
        metric(&t.gateway, "peerwall_allow_all").is_some_and(|l| l.ends_with(" 1"))
    });
    // Through a drift repair, and after a policy change, still on.
    drift_then_repair("the agent to repair the deleted table with the switch on");
    assert!(
        ping(&t.consumer, "10.10.1.67", "10.20.1.2"),
        "repaired away"
    );
    let second = block(false)
        .replace("block-pod1-pod2", "block-other")
        .replace("table_name", "other_table")
        .replace("10.10.1.67", "10.10.1.68");
    std::fs::write(dir.join("other.yaml"), second).unwrap();
    wait_until("the new policy applied", 10, || {
        in_ns(&t.gateway, "nft", &["list", "table", "ip", "other_table"])
            .status
            .success()
    });
    assert!(
        ping(&t.consumer, "10.10.1.67", "10.20.1.2"),
        "lost on apply"
    );
    assert!(ping(&t.consumer, "10.10.1.68", "10.20.1.2"), "new table");
    wait_until("the switch reported", 10, || {
        metric(&t.gateway, "peerwall_allow_all").is_some_and(|l| l.ends_with(" 1"))
    });
    switch("off");
    assert!(!ping(&t.consumer, "10.10.1.67", "10.20.1.2"), "switch off");
    assert!(!ping(&t.consumer, "10.10.1.68", "10.20.1.2"));
    wait_until("the switch reported off", 10, || {
        metric(&t.gateway, "peerwall_allow_all").is_some_and(|l| l.ends_with(" 0"))
    });
    drift_then_repair("the agent to repair the deleted table with the switch off");
    assert!(
        !ping(&t.consumer, "10.10.1.67", "10.20.1.2"),
        "still enforced"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
