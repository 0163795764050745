//! Every path a user takes works or says why, through the real binary: host commands started
//! by `ip netns exec` (a private mount namespace) keep their bpf pins and so their enforcement;
//! commands acting on "what is installed" find the backend instead of assuming one; a second
//! `apply` keeps unchanged tables and their counters; nothing is left behind in /run or bpffs;
//! the errors a user meets first name the file, line and value, once each.

use peerwall_testkit::prelude::*;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::atomic::{AtomicUsize, Ordering};

static PINS: AtomicUsize = AtomicUsize::new(0);

/// A pin directory of this test process, removed (with its /run metadata) when dropped.
struct Pins(PathBuf);

impl Pins {
    fn new() -> Self {
        let n = PINS.fetch_add(1, Ordering::Relaxed);
        Self(PathBuf::from(format!(
            "/sys/fs/bpf/pwt-paths-{}-{n}",
            std::process::id()
        )))
    }
    fn arg(&self) -> String {
        self.0.display().to_string()
    }
    /// Where the loader keeps the slots' names for this pin directory.
    fn meta(&self) -> PathBuf {
        Path::new("/run/peerwall").join(self.0.strip_prefix("/").unwrap())
    }
}

impl Drop for Pins {
    fn drop(&mut self) {
        let _ = peerwall_backend_bpf::loader::remove_pins(&self.0);
    }
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// `ip netns exec NS peerwall ARGS` (a private mount namespace, as users run it).
fn pw(ns: &NetNs, args: &[&str]) -> Output {
    peerwall_in(ns, args)
}

fn ok(ns: &NetNs, args: &[&str]) -> String {
    let o = pw(ns, args);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "peerwall {args:?}: {out}{err}");
    out
}

#[test]
fn bpf_apply_under_ip_netns_exec_keeps_enforcing_and_delete_finds_it() {
    let t = Topology::new();
    let pins = Pins::new();
    let _offloaded = Listener::tcp(&t.provider, "10.20.1.2", 8080);
    let _other = Listener::tcp(&t.provider, "10.20.3.1", 8080);
    // Without a policy the other pod answers: the denial below is the policy's doing.
    assert!(tcp_connects(&t.consumer, "10.10.1.67", "10.20.3.1", 8080));
    let policy = repo("examples/provider-protection.yaml");
    let out = ok(
        &t.gateway,
        &[
            "apply",
            "--backend",
            "bpf",
            "--pin-dir",
            &pins.arg(),
            "-f",
            policy.to_str().unwrap(),
        ],
    );
    assert!(out.starts_with("bpf: "), "a status line: {out}");
    // The pins outlived the command (they vanished with its mount namespace before).
    assert!(
        pins.0.join("links").read_dir().unwrap().count() >= 2,
        "links pinned on the host's bpffs"
    );
    assert!(
        tcp_connects(&t.consumer, "10.10.1.67", "10.20.1.2", 8080),
        "offloaded pod reachable"
    );
    assert!(
        !tcp_connects(&t.consumer, "10.10.1.67", "10.20.3.1", 8080),
        "the datapath still enforces after `ip netns exec … apply` exited"
    );
    assert!(pins.meta().join("slot1.json").exists() || pins.meta().join("slot0.json").exists());

    // `inspect` and `counters` find it from the same kind of shell, without --pin-dir: the
    // apply recorded this namespace's pins (docs/cli.md).
    let out = ok(&t.gateway, &["inspect"]);
    assert!(out.contains("tc:liqo-tunnel"), "{out}");
    let out = ok(&t.gateway, &["counters"]);
    let denied = out
        .lines()
        .find(|l| l.starts_with("peerwall_cluster1/from_consumer/default_deny\t"))
        .unwrap_or_else(|| panic!("bpf counters listed: {out}"));
    assert!(
        !denied.contains("\t0 packets"),
        "the denial counted: {denied}"
    );

    let out = ok(&t.gateway, &["delete", "--pin-dir", &pins.arg()]);
    let n: usize = out
        .strip_prefix("bpf: detached and unpinned ")
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("delete says what it removed: {out}"));
    assert!(n > 10, "{out}");
    assert!(!pins.0.exists(), "pins removed");
    assert!(!pins.meta().exists(), "slot metadata under /run removed");
    assert!(
        tcp_connects(&t.consumer, "10.10.1.67", "10.20.3.1", 8080),
        "detached: the other pod answers again"
    );
    // A second delete finds nothing and says so.
    let out = ok(&t.gateway, &["delete", "--pin-dir", &pins.arg()]);
    assert!(
        out.starts_with("nothing to delete: found no peerwall nftables table"),
        "{out}"
    );
}

#[test]
fn allow_all_counters_and_delete_find_the_nftables_backend() {
    let t = Topology::new();
    let pins = Pins::new();
    let _other = Listener::tcp(&t.provider, "10.20.3.1", 8080);
    let policy = repo("examples/provider-protection.yaml");
    ok(&t.gateway, &["apply", "-f", policy.to_str().unwrap()]);
    assert!(!tcp_connects(&t.consumer, "10.10.1.67", "10.20.3.1", 8080));

    // No --backend: the switch finds nftables (it assumed bpf and failed before).
    let out = ok(&t.gateway, &["allow-all", "on", "--pin-dir", &pins.arg()]);
    assert_eq!(out.trim(), "nftables: allow-all ON: every packet passes");
    assert!(
        tcp_connects(&t.consumer, "10.10.1.67", "10.20.3.1", 8080),
        "allow-all lets the denied pair through"
    );
    let out = ok(&t.gateway, &["allow-all", "off", "--pin-dir", &pins.arg()]);
    assert_eq!(out.trim(), "nftables: allow-all off: enforcing");
    assert!(!tcp_connects(&t.consumer, "10.10.1.67", "10.20.3.1", 8080));

    let out = ok(&t.gateway, &["counters", "--pin-dir", &pins.arg()]);
    assert!(
        out.contains("peerwall_cluster1/from_consumer/default_deny\t"),
        "{out}"
    );

    // Asking for a backend that is not installed says what is.
    let o = pw(&t.gateway, &["inspect", "--pin-dir", &pins.arg()]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains(
            "nothing to inspect for --backend bpf: found nftables tables inet peerwall_cluster1"
        ),
        "{err}"
    );
    // Nothing emits events after a plain apply: observe says so instead of waiting.
    let o = pw(
        &t.gateway,
        &["observe", "--kernel", "--pin-dir", &pins.arg()],
    );
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("no peerwall rule here reports events"),
        "{err}"
    );

    let out = ok(&t.gateway, &["delete", "--pin-dir", &pins.arg()]);
    assert_eq!(out.trim(), "nftables: deleted peerwall_cluster1");
    assert!(tcp_connects(&t.consumer, "10.10.1.67", "10.20.3.1", 8080));
    // Where nothing is installed, the emergency switch refuses with the reason.
    let o = pw(&t.gateway, &["allow-all", "on", "--pin-dir", &pins.arg()]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("nothing to switch: found no peerwall nftables table"),
        "{err}"
    );
}

#[test]
fn a_second_apply_keeps_unchanged_tables_and_their_counters() {
    let t = Topology::new();
    let _other = Listener::tcp(&t.provider, "10.20.3.1", 8080);
    let policy = repo("examples/provider-protection.yaml");
    let p = policy.to_str().unwrap();
    let out = ok(&t.gateway, &["apply", "-f", p]);
    assert!(
        out.contains("created or recreated peerwall_cluster1"),
        "{out}"
    );
    assert!(!tcp_connects(&t.consumer, "10.10.1.67", "10.20.3.1", 8080));
    let count = || -> u64 {
        let out = ok(&t.gateway, &["counters", "--backend", "nftables"]);
        out.lines()
            .find(|l| l.starts_with("peerwall_cluster1/from_consumer/default_deny\t"))
            .and_then(|l| l.split('\t').nth(1))
            .and_then(|c| c.split_whitespace().next())
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("counter listed: {out}"))
    };
    let before = count();
    assert!(before > 0, "the denied connection counted");
    let out = ok(&t.gateway, &["apply", "-f", p]);
    assert!(
        out.contains("created or recreated -;") && out.contains("kept peerwall_cluster1"),
        "{out}"
    );
    assert_eq!(count(), before, "counters survive an unchanged apply");
    // A table edited behind peerwall's back is not kept: it is recreated.
    must(
        "ip",
        &[
            "netns",
            "exec",
            t.gateway.name(),
            "nft",
            "flush",
            "chain",
            "inet",
            "peerwall_cluster1",
            "from_consumer",
        ],
    );
    assert!(tcp_connects(&t.consumer, "10.10.1.67", "10.20.3.1", 8080));
    let out = ok(&t.gateway, &["apply", "-f", p]);
    assert!(
        out.contains("created or recreated peerwall_cluster1"),
        "{out}"
    );
    assert!(!tcp_connects(&t.consumer, "10.10.1.67", "10.20.3.1", 8080));
}

#[test]
fn verdict_with_the_bpf_engine_leaves_nothing_behind() {
    require_root();
    let before = leftovers();
    for _ in 0..2 {
        let o = std::process::Command::new(peerwall())
            .args(["verdict", "-f"])
            .arg(repo("examples/thesis-block.yaml"))
            .args([
                "--iif",
                "liqo-tunnel",
                "--oif",
                "liqo.abcdefghij",
                "--src",
                "10.10.1.67",
                "--dst",
                "10.20.1.2",
                "--proto",
                "icmp",
                "--engine",
                "bpf",
            ])
            .output()
            .unwrap();
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(0), "{err}");
        assert!(out.starts_with("drop"), "the probe ran: {out}");
    }
    let after = leftovers();
    let new: Vec<&String> = after.iter().filter(|l| !before.contains(l)).collect();
    assert!(new.is_empty(), "left behind: {new:?}");
}

/// Nothing the tests before this one ran (cargo runs test binaries one after another, this one
/// late) left pins or slot metadata behind: every peerwall-made entry of bpffs and of
/// `/run/peerwall` whose name carries a process id belongs to a process still running.
///
/// `cargo xtask test` passes the time the run started (`PEERWALL_TESTS_SINCE`, Unix seconds):
/// an entry last changed before it is not this run's (an interrupted benchmark on the same
/// machine, say) and is named on stderr instead. Without it, every entry counts.
#[test]
fn no_exited_process_left_pins_or_metadata_behind() {
    require_root();
    let alive = |name: &str| {
        name.split(|c: char| !c.is_ascii_digit())
            .filter(|d| d.len() >= 2)
            .any(|pid| Path::new("/proc").join(pid).exists())
    };
    let since = std::env::var("PEERWALL_TESTS_SINCE")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .map(|s| std::time::UNIX_EPOCH + std::time::Duration::from_secs(s));
    let (mut left, mut older) = (Vec::new(), Vec::new());
    for dir in ["/sys/fs/bpf", "/run/peerwall/sys/fs/bpf"] {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let ours = name.starts_with("pw") || name.starts_with("peerwall-");
            if !ours || !name.bytes().any(|b| b.is_ascii_digit()) || alive(&name) {
                continue;
            }
            let changed = e.metadata().and_then(|m| m.modified()).ok();
            match (since, changed) {
                (Some(since), Some(changed)) if changed < since => {
                    older.push(format!("{dir}/{name}"))
                }
                _ => left.push(format!("{dir}/{name}")),
            }
        }
    }
    if !older.is_empty() {
        eprintln!("left by exited processes before this run started (not counted): {older:?}");
    }
    assert!(left.is_empty(), "left behind by exited processes: {left:?}");
}

/// Scratch pin directories (and their /run metadata) of `verdict --engine bpf` processes that
/// have exited.
fn leftovers() -> Vec<String> {
    let mut out = Vec::new();
    for dir in ["/sys/fs/bpf", "/run/peerwall/sys/fs/bpf"] {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(pid) = name
                .strip_prefix("pwprobe-")
                .and_then(|r| r.split('-').next())
            else {
                continue;
            };
            if !Path::new("/proc").join(pid).exists() {
                out.push(format!("{dir}/{name}"));
            }
        }
    }
    out
}

fn compile(files: &[&Path]) -> (Option<i32>, String) {
    let mut c = std::process::Command::new(peerwall());
    c.arg("compile");
    for f in files {
        c.arg("-f").arg(f);
    }
    let o = c.output().unwrap();
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn scratch(name: &str, body: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pwt-paths-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, body).unwrap();
    p
}

const BAD_VALUES: &str = "# two errors in one object
apiVersion: peerwall.io/v1alpha1
kind: FirewallConfiguration
metadata: {name: x, namespace: t}
spec:
  table:
    name: t
    family: IPV4
    chains:
    - name: c
      type: filter
      hook: forward
      priority: 0
      policy: drop
      rules:
        filterRules:
        - name: r
          action: accept
          match:
          - op: eq
            port: {value: \"90-80\", position: dst}
          - op: eq
            ip: {value: \"10.0.0.300\", position: src}
";

#[test]
fn errors_name_the_file_line_and_value_once_each() {
    // Semantic errors: file:line of the object, one line per error.
    let bad = scratch("bad-values.yaml", BAD_VALUES);
    let (code, err) = compile(&[&bad]);
    assert_eq!(code, Some(2), "{err}");
    let at = format!("{}:2: t/x: ", bad.display());
    let lines: Vec<&str> = err.trim().lines().collect();
    assert_eq!(
        lines,
        [
            format!(
                "error: {at}spec.table.chains[0].rules.filterRules[0].match[0].port.value: \"90-80\" is a range whose start is after its end"
            ),
            format!(
                "{at}spec.table.chains[0].rules.filterRules[0].match[1].ip.value: \"10.0.0.300\" is not an address, CIDR or range"
            ),
        ],
        "{err}"
    );
    // A misspelt enum value: a suggestion, and only values peerwall enforces.
    let fam = scratch("family.yaml", &BAD_VALUES.replace("IPV4", "IPv4"));
    let (code, err) = compile(&[&fam]);
    assert_eq!(code, Some(2));
    assert!(
        err.contains("spec.table.family: unknown value `IPv4`: did you mean `IPV4`? (accepted: `INET`, `IPV4`, `IPV6`)"),
        "{err}"
    );
    assert!(!err.contains("ARP"), "{err}");
    // A YAML error: its location once.
    let yaml = scratch("broken.yaml", "a: [\n");
    let (code, err) = compile(&[&yaml]);
    assert_eq!(code, Some(2));
    assert_eq!(err.matches("line 2 column 1").count(), 1, "{err}");
    // An I/O error: its cause once.
    let (code, err) = compile(&[Path::new("/nonexistent/pw.yaml")]);
    assert_eq!(code, Some(2));
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
    // A file named twice is read once (it collided with itself).
    let (code, err) = compile(&[&repo("examples"), &repo("examples/thesis-block.yaml")]);
    assert_eq!(code, Some(0), "{err}");
    // The shipped examples compile per host kind; their parent says why it reads nothing.
    for dir in ["examples/liqo/gateway", "examples/liqo/fabric"] {
        let (code, err) = compile(&[&repo(dir)]);
        assert_eq!(code, Some(0), "{dir}: {err}");
    }
    let (code, err) = compile(&[&repo("examples/liqo")]);
    assert_eq!(code, Some(2));
    assert!(err.contains("not its subdirectories"), "{err}");
}

#[test]
fn interface_names_are_checked_up_front_on_every_engine() {
    for engine in ["reference", "nftables", "bpf"] {
        let o = std::process::Command::new(peerwall())
            .args(["verdict", "-f"])
            .arg(repo("examples/thesis-block.yaml"))
            .args([
                "--iif",
                "liqo-tunnel-0123456789",
                "--src",
                "10.10.1.67",
                "--dst",
                "10.20.1.2",
                "--engine",
                engine,
            ])
            .output()
            .unwrap();
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{engine}: {err}");
        assert!(
            err.contains("--iif \"liqo-tunnel-0123456789\": an interface name is 1 to 15 bytes"),
            "{engine}: {err}"
        );
    }
}
