//! The CLI contract: `verdict` with every engine (reference, nftables, bpf) agrees on the thesis
//! examples, JSON output,
//! exit codes, field-path errors; `compile` prints sets, not rule-per-address.

use peerwall_testkit::prelude::*;
use std::process::Command;

fn verdict(files: &[&str], extra: &[&str]) -> (Option<i32>, String, String) {
    let mut args = vec!["verdict".to_string()];
    for f in files {
        args.push("-f".into());
        args.push(repo(f).to_string_lossy().into_owned());
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args.extend(["--output".into(), "json".into()]);
    let o = Command::new(peerwall()).args(&args).output().unwrap();
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).trim().to_string(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn both_engines(files: &[&str], pkt: &[&str], expected: &str) {
    let bpf_limits = pkt.contains(&"invalid") && pkt.contains(&"udp");
    for engine in ["reference", "nftables", "bpf"] {
        if engine == "bpf" && bpf_limits {
            // The bpf datapath does not check UDP checksums: refused as input (exit 2).
            let mut extra: Vec<&str> = pkt.to_vec();
            extra.extend(["--engine", engine]);
            let (code, _, err) = verdict(files, &extra);
            assert_eq!(code, Some(2), "{err}");
            continue;
        }
        let mut extra: Vec<&str> = pkt.to_vec();
        extra.extend(["--engine", engine]);
        let (code, out, err) = verdict(files, &extra);
        assert_eq!(code, Some(0), "{engine}: {err}");
        assert_eq!(out, expected, "engine {engine} on {pkt:?}");
    }
}

const FWD: [&str; 4] = ["--iif", "liqo-tunnel", "--oif", "liqo.abcdefghij"];

#[test]
fn thesis_block_both_engines() {
    require_root();
    let f = ["examples/thesis-block.yaml"];
    let mut p: Vec<&str> = FWD.to_vec();
    p.extend([
        "--src",
        "10.10.1.67",
        "--dst",
        "10.20.1.2",
        "--proto",
        "icmp",
    ]);
    both_engines(
        &f,
        &p,
        r#"{"verdict":"drop","table":"table_name","chain":"filter_chain_name","rule":"drop_traffic"}"#,
    );
    let mut p: Vec<&str> = FWD.to_vec();
    p.extend([
        "--src",
        "10.20.1.2",
        "--dst",
        "10.10.1.67",
        "--proto",
        "udp",
    ]);
    both_engines(
        &f,
        &p,
        r#"{"verdict":"accept","table":"table_name","chain":"filter_chain_name","rule":null}"#,
    );
}

#[test]
fn provider_protection_both_engines() {
    require_root();
    let f = ["examples/provider-protection.yaml"];
    let cases: [(&[&str], &str); 5] = [
        (
            &[
                "--src",
                "10.10.1.67",
                "--dst",
                "10.20.2.10",
                "--proto",
                "tcp",
                "--dport",
                "443",
            ],
            r#"{"verdict":"accept","table":"peerwall_cluster1","chain":"from_consumer","rule":"to_offloaded_pods"}"#,
        ),
        (
            &[
                "--src",
                "10.10.1.67",
                "--dst",
                "10.20.9.9",
                "--proto",
                "tcp",
            ],
            r#"{"verdict":"drop","table":"peerwall_cluster1","chain":"from_consumer","rule":"default_deny"}"#,
        ),
        (
            &[
                "--src",
                "10.10.1.67",
                "--dst",
                "10.20.9.9",
                "--proto",
                "tcp",
                "--ct-state",
                "established",
            ],
            r#"{"verdict":"accept","table":"peerwall_cluster1","chain":"from_consumer","rule":"replies"}"#,
        ),
        (
            &[
                "--src",
                "10.10.1.67",
                "--dst",
                "10.20.9.9",
                "--proto",
                "icmp",
                "--ct-state",
                "related",
            ],
            r#"{"verdict":"accept","table":"peerwall_cluster1","chain":"from_consumer","rule":"replies"}"#,
        ),
        (
            &[
                "--src",
                "10.10.1.67",
                "--dst",
                "10.20.9.9",
                "--proto",
                "udp",
                "--ct-state",
                "invalid",
            ],
            r#"{"verdict":"drop","table":"peerwall_cluster1","chain":"from_consumer","rule":"default_deny"}"#,
        ),
    ];
    for (pkt, expected) in cases {
        let mut p: Vec<&str> = FWD.to_vec();
        p.extend_from_slice(pkt);
        both_engines(&f, &p, expected);
    }
    // Traffic to the gateway itself crosses no forward chain.
    both_engines(
        &f,
        &[
            "--iif",
            "liqo-tunnel",
            "--src",
            "10.10.1.67",
            "--dst",
            "10.20.9.9",
        ],
        r#"{"verdict":"accept","table":null,"chain":null,"rule":null}"#,
    );
}

/// The controller's own gateway policy (`protection::gateway_spec`, what `peerwall controller`
/// writes for a peer), judged by all three engines: replies to connections the provider side
/// opened pass before the default deny; the consumer still opens nothing but what it
/// offloaded, through any of Liqo's tunnels (`liqo-tunnel`, `liqo-tunnel1`, …). Without
/// Liqo's `Configuration` of the peer (sources unknown) nothing from the tunnel is forwarded.
#[test]
fn controller_policy_passes_replies_on_all_engines() {
    use peerwall::protection::{gateway_object, Options, Peer, PeerSets, DEFAULT_TUNNEL};
    require_root();
    let sets = PeerSets {
        offloaded: ["10.20.1.2".parse().unwrap()].into(),
        remote: ["10.10.9.9".parse().unwrap()].into(),
        elsewhere: Default::default(),
    };
    let opts = Options {
        tunnel: DEFAULT_TUNNEL.into(),
        block_leaf_to_leaf: false,
        audit: false,
        liqo_ping_port: peerwall::protection::LIQO_PING_PORT,
        own_namespace_only: false,
        inline_budget: peerwall::protection::spill::INLINE_BUDGET,
    };
    let mut peer = Peer {
        id: "cluster1".into(),
        tenant_namespace: "liqo-tenant-cluster1".into(),
        sources: vec!["10.10.0.0/16".parse().unwrap()],
    };
    let doc = gateway_object(&peer, &sets, &opts);
    let dir = std::env::temp_dir().join(format!("pw-cli-ctrl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("gateway.yaml");
    std::fs::write(&file, doc.to_string()).unwrap();
    let f = [file.to_str().unwrap()];
    // (packet, deciding rule, verdict)
    let cases = [
        // A provider pod's connection to a consumer pod: its reply comes back through the tunnel.
        (
            "--src 10.10.1.67 --dst 10.20.3.1 --proto tcp --sport 80 --dport 40000 --ct-state established",
            "replies",
            "accept",
        ),
        (
            "--src 10.10.1.67 --dst 10.20.3.1 --proto icmp --ct-state related",
            "replies",
            "accept",
        ),
        // The consumer opening a connection to a pod it did not offload: dropped.
        (
            "--src 10.10.1.67 --dst 10.20.3.1 --proto tcp",
            "default_deny",
            "drop",
        ),
        // To what it offloaded: accepted.
        (
            "--src 10.10.1.67 --dst 10.20.1.2 --proto tcp",
            "to_offloaded",
            "accept",
        ),
    ];
    for tunnel in ["liqo-tunnel", "liqo-tunnel1"] {
        for (pkt, rule, verdict) in cases {
            let mut p = vec!["--iif", tunnel, "--oif", "liqo.abcdefghij"];
            p.extend(pkt.split_whitespace());
            let expected = format!(
                r#"{{"verdict":"{verdict}","table":"peerwall_cluster1","chain":"from_peer","rule":"{rule}"}}"#
            );
            both_engines(&f, &p, &expected);
        }
    }
    // Before Liqo's Configuration of the peer is known: nothing from the tunnel is forwarded,
    // not the replies, not what it offloaded; Liqo's tunnel check to the gateway passes.
    peer.sources.clear();
    std::fs::write(&file, gateway_object(&peer, &sets, &opts).to_string()).unwrap();
    for (pkt, _, _) in cases {
        let mut p = vec!["--iif", "liqo-tunnel", "--oif", "liqo.abcdefghij"];
        p.extend(pkt.split_whitespace());
        both_engines(
            &f,
            &p,
            r#"{"verdict":"drop","table":"peerwall_cluster1","chain":"from_peer","rule":"no_liqo_configuration"}"#,
        );
    }
    let ping = "--iif liqo-tunnel --src 169.254.18.1 --dst 169.254.18.2 --proto udp --dport 12345";
    both_engines(
        &f,
        &ping.split_whitespace().collect::<Vec<_>>(),
        r#"{"verdict":"accept","table":"peerwall_cluster1","chain":"to_gateway","rule":"liqo_tunnel_check"}"#,
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_values_exit_2_with_field_paths() {
    let dir = std::env::temp_dir().join(format!("pw-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.yaml");
    let good = std::fs::read_to_string(repo("examples/thesis-block.yaml")).unwrap();
    std::fs::write(&bad, good.replace("10.20.1.2", "10.0.0.300")).unwrap();
    for cmd in ["compile", "verdict"] {
        let mut args = vec![cmd, "-f", bad.to_str().unwrap()];
        if cmd == "verdict" {
            args.extend(["--iif", "a", "--src", "10.0.0.1", "--dst", "10.0.0.2"]);
        }
        let o = Command::new(peerwall()).args(&args).output().unwrap();
        assert_eq!(o.status.code(), Some(2), "{cmd}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("spec.table.chains[0].rules.filterRules[0].match[1].ip.value: \"10.0.0.300\" is not an address, CIDR or range"), "{err}");
        assert!(o.stdout.is_empty());
    }
    // `compile` of the file as it is now: refused (exit 2), and what it said.
    let refused = || {
        let o = Command::new(peerwall())
            .args(["compile", "-f", bad.to_str().unwrap()])
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2));
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    std::fs::write(&bad, "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {name: x}\nspec: {table: {name: t, family: IPV4, chains: [{name: c, type: filter, hook: forward, policy: deny}]}}\n").unwrap();
    let err = refused();
    assert!(
        err.contains(
            "spec.table.chains[0].policy: unknown value `deny` (accepted: `drop`, `accept`)"
        ),
        "{err}"
    );
    // Every type and enum error of a file in one run, each at its line (rules 0 and 2 of
    // the first document, the chain of the second; rule 1 is fine).
    let doc = |name: &str, chain: &str| {
        format!("apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {{name: {name}}}\nspec:\n  table:\n    name: {name}\n    family: IPV4\n    chains:\n{chain}")
    };
    let rules = "    - name: c\n      type: filter\n      hook: forward\n      policy: accept\n      rules:\n        filterRules:\n        - name: r0\n          action: dorp\n        - name: r1\n          action: drop\n        - name: r2\n          action: drop\n          mtach: []\n";
    let typed = "    - name: c\n      type: filter\n      hook: forward\n      priority: high\n      policy: accept\n";
    std::fs::write(
        &bad,
        format!("{}---\n{}", doc("one", rules), doc("two", typed)),
    )
    .unwrap();
    let err = refused();
    let f = bad.to_str().unwrap();
    for (line, doc, path) in [
        (
            16,
            1,
            "spec.table.chains[0].rules.filterRules[0].action: unknown value `dorp`",
        ),
        (
            21,
            1,
            "spec.table.chains[0].rules.filterRules[2].mtach: unknown field `mtach`",
        ),
        (34, 2, "spec.table.chains[0].priority: "),
    ] {
        let want = format!("{f}:{line} (document {doc}): {path}");
        assert!(err.contains(&want), "{want}\n{err}");
    }
    assert!(err.contains("3 errors"), "{err}");
    std::fs::write(&bad, "not: [valid").unwrap();
    let o = Command::new(peerwall())
        .args(["compile", "-f", bad.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not valid YAML"));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn compile_uses_sets_not_rule_per_address() {
    let o = Command::new(peerwall())
        .args(["compile", "-f", repo("examples").to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success());
    let s = String::from_utf8_lossy(&o.stdout);
    assert!(s.contains("set offloaded_cluster1 {"), "{s}");
    assert!(s.contains("ip daddr @offloaded_cluster1"), "{s}");
    assert_eq!(s.matches("comment \"to_offloaded_pods\"").count(), 1);
    let o = Command::new(peerwall())
        .args([
            "compile",
            "-f",
            repo("examples").to_str().unwrap(),
            "--output",
            "json",
        ])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["nftables"].as_array().unwrap().len() > 5);
}

/// Every `peerwall <command>` the README and the book show (in code spans and code blocks) is
/// a command this binary has: `peerwall <command> --help` answers.
#[test]
fn every_command_the_docs_show_exists() {
    let root = peerwall_testkit::repo("");
    let mut pages = vec![root.join("README.md")];
    for e in std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .flatten()
    {
        if e.path().extension().and_then(|x| x.to_str()) == Some("md") {
            pages.push(e.path());
        }
    }
    let mut commands = std::collections::BTreeSet::new();
    for page in &pages {
        let text = std::fs::read_to_string(page).expect("a page");
        let mut code = false;
        for line in text.lines() {
            if line.starts_with("```") {
                code = !code;
                continue;
            }
            // Code blocks: lines that run peerwall; prose: code spans that start with it.
            let candidates: Vec<&str> = if code {
                vec![line.trim_start()]
            } else {
                line.split('`').skip(1).step_by(2).collect()
            };
            for c in candidates {
                let Some(rest) = c.strip_prefix("peerwall ") else {
                    continue;
                };
                let word: String = rest
                    .chars()
                    .take_while(|ch| ch.is_ascii_lowercase() || *ch == '-')
                    .collect();
                // A command is a word of its own (`peerwall owner=…` is a marker comment).
                let next = rest[word.len()..].chars().next();
                if !word.is_empty() && next.is_none_or(|ch| ch == ' ') {
                    commands.insert(word);
                }
            }
        }
    }
    assert!(commands.len() >= 10, "{commands:?}");
    for c in &commands {
        let o = Command::new(peerwall())
            .args([c.as_str(), "--help"])
            .output()
            .expect("peerwall");
        assert!(
            o.status.success(),
            "the docs show `peerwall {c}`, which is no command: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

/// A host command without the privileges it needs says which, exits non-zero, and changes
/// nothing: never "nothing to delete" for "not allowed to look" (before: a warning, then
/// "nothing to delete: found no nftables table …", exit 0, the table still there), and no
/// advice a non-root user cannot follow (mounting bpffs).
#[test]
fn host_commands_without_privileges_say_which_and_change_nothing() {
    require_root();
    let ns = NetNs::new("pwx-cli-priv").expect("netns");
    let bin = peerwall();
    let o = peerwall_in(
        &ns,
        &[
            "apply",
            "-f",
            &repo("examples/thesis-block.yaml").to_string_lossy(),
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let tables =
        || String::from_utf8_lossy(&in_ns(&ns, "nft", &["list", "tables"]).stdout).to_string();
    assert!(tables().contains("table_name"), "{}", tables());
    for cmd in [
        &["delete"][..],
        &["counters"],
        &["allow-all", "on"],
        &["inspect"],
    ] {
        let mut args = vec![
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
            bin.to_str().unwrap(),
        ];
        args.extend_from_slice(cmd);
        let o = in_ns(&ns, "setpriv", &args);
        let (out, err) = (
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr),
        );
        assert_eq!(o.status.code(), Some(1), "{cmd:?}: {out}{err}");
        assert!(
            err.contains(&format!("peerwall {}: not permitted", cmd[0]))
                && err.contains("CAP_NET_ADMIN")
                && err.contains("root"),
            "{cmd:?}: {err}"
        );
        assert!(
            !out.contains("nothing to delete") && !err.contains("mount"),
            "{cmd:?}: {out}{err}"
        );
    }
    assert!(
        tables().contains("table_name"),
        "the table stays: {}",
        tables()
    );
}

/// A multi-document file with a near-miss `kind` or `apiVersion`: named with its line and a
/// did-you-mean, exit 2 (before: skipped silently, exit 0); read on past with
/// `--skip-unknown-kinds`, which names what it skipped.
#[test]
fn near_miss_kinds_are_refused_unless_skipped() {
    let dir = std::env::temp_dir().join(format!("pwx-near-miss-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = std::fs::read_to_string(repo("examples/thesis-block.yaml")).unwrap();
    for (typo, says) in [
        (
            "kind: FirewallConfigration",
            "did you mean `FirewallConfiguration`?",
        ),
        (
            "apiVersion: networking.liqo.io/v1alpha1",
            "did you mean networking.liqo.io/v1beta1?",
        ),
    ] {
        let bad = good
            .replace(
                "kind: FirewallConfiguration",
                if typo.starts_with("kind") {
                    typo
                } else {
                    "kind: FirewallConfiguration"
                },
            )
            .replace(
                "apiVersion: networking.liqo.io/v1beta1",
                if typo.starts_with("apiVersion") {
                    typo
                } else {
                    "apiVersion: networking.liqo.io/v1beta1"
                },
            )
            .replace("name: block-pod1-pod2", "name: second")
            .replace("name: table_name", "name: second_table");
        let f = dir.join("two.yaml");
        std::fs::write(&f, format!("{good}---\n{bad}")).unwrap();
        let f = f.to_string_lossy().to_string();
        let o = Command::new(peerwall())
            .args(["compile", "-f", &f])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{typo}: {err}");
        assert!(
            err.contains("(document 2)") && err.contains(says),
            "{typo}: {err}"
        );
        let o = Command::new(peerwall())
            .args(["compile", "-f", &f, "--skip-unknown-kinds"])
            .output()
            .unwrap();
        let (out, err) = (
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr),
        );
        assert!(o.status.success(), "{typo}: {err}");
        assert!(
            out.contains("table_name") && !out.contains("second_table"),
            "{out}"
        );
        assert!(
            err.contains("skipped") && err.contains(says),
            "{typo}: {err}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `verdict` has two modes and says which needs what (before, clap listed `--file --from --to`
/// together); `compile --cluster --backend bpf` renders what the bpf backend loads (it printed
/// nftables), and refuses `--output json`/`yaml`, which print backend-independent objects.
#[test]
fn each_mode_says_what_it_needs_and_compile_cluster_honours_the_backend() {
    let run = |args: &[&str]| Command::new(peerwall()).args(args).output().unwrap();
    let o = run(&[
        "verdict",
        "--iif",
        "liqo-tunnel",
        "--src",
        "10.0.0.1",
        "--dst",
        "10.0.0.2",
    ]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("verdict judges either a packet against FirewallConfigurations (-f FILES --iif IF --src ADDR --dst ADDR"), "{err}");
    assert!(err.contains("for a packet this lacks -f/--file"), "{err}");
    assert!(!err.contains("required arguments"), "{err}");
    let thesis = repo("examples/thesis-block.yaml");
    let o = run(&[
        "verdict",
        "-f",
        thesis.to_str().unwrap(),
        "--src",
        "10.0.0.1",
    ]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("for a packet this lacks --iif, --dst"),
        "{err}"
    );
    let cluster = repo("examples/cluster");
    let o = run(&[
        "verdict",
        "--cluster",
        cluster.to_str().unwrap(),
        "--from",
        "frontend/web",
    ]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("(--from NS/NAME --to NS/NAME) or all pairs (--matrix): this lacks --to"),
        "{err}"
    );
    // Both renderings of the example cluster's gateway.
    let compile = |backend: &str| {
        run(&[
            "compile",
            "--cluster",
            cluster.to_str().unwrap(),
            "--backend",
            backend,
        ])
    };
    let (nft, bpf) = (compile("nftables"), compile("bpf"));
    assert!(
        nft.status.success() && bpf.status.success(),
        "{}",
        String::from_utf8_lossy(&bpf.stderr)
    );
    let (nft, bpf) = (
        String::from_utf8_lossy(&nft.stdout),
        String::from_utf8_lossy(&bpf.stdout),
    );
    assert!(nft.contains("table inet peerwall_provider1 {"), "{nft}");
    assert!(bpf.contains("# the gateway of peer provider1"), "{bpf}");
    assert!(bpf.contains("hook forward/ipv4 -> ["), "{bpf}");
    assert!(!bpf.contains("table inet"), "{bpf}");
    let o = run(&[
        "compile",
        "--cluster",
        cluster.to_str().unwrap(),
        "--backend",
        "bpf",
        "--output",
        "json",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("leave --backend out"));
}

/// Output into a pipe whose reader has gone (`| head`) ends quietly: exit 0, nothing on stderr
/// (it printed "error: writing to stdout: Broken pipe", exit 1).
#[test]
fn a_closed_pipe_ends_output_quietly() {
    let mut child = Command::new(peerwall())
        .args(["compile", "--cluster"])
        .arg(repo("examples/cluster"))
        .args(["--output", "yaml"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The reader goes before the first write.
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !err.contains("Broken pipe") && !err.contains("error"),
        "{err}"
    );
    assert_eq!(o.status.code(), Some(0), "{err}");
}

/// `peerwall version` and `--version` name this release (Cargo.toml's version, which the image
/// tag in deploy/ matches: tests/kube/deploy.rs) and the commit the binary was built from.
#[test]
fn version_names_the_release_and_the_commit() {
    let head = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(repo(""))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let o = Command::new(peerwall())
        .args(["version", "--output", "json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"), "{v}");
    let commit = v["commit"].as_str().unwrap();
    match &head {
        // Built here: this checkout's HEAD.
        Some(h) => assert_eq!(commit, h, "the commit is not HEAD"),
        None => assert_eq!(commit, "unknown"),
    }
    for args in [&["version"][..], &["--version"][..]] {
        let o = Command::new(peerwall()).args(args).output().unwrap();
        let text = String::from_utf8_lossy(&o.stdout);
        assert_eq!(
            text.trim(),
            format!("peerwall {} (commit {commit})", env!("CARGO_PKG_VERSION")),
            "{args:?}"
        );
    }
}

/// A release is named alike everywhere: CHANGELOG.md's newest section is Cargo.toml's version
/// (unreleased, or released with its tag and commit), each released section names tag
/// `v<version>` and its commit, the tag (where this clone has it) points at that commit, and
/// `tests/previous-release` (what the upgrade test starts from) is the newest released commit.
#[test]
fn releases_are_named_alike_in_the_changelog_the_tags_and_the_upgrade_test() {
    let log = std::fs::read_to_string(repo("CHANGELOG.md")).unwrap();
    let sections: Vec<&str> = log.lines().filter_map(|l| l.strip_prefix("## ")).collect();
    assert_eq!(
        sections[0].split_whitespace().next(),
        Some(env!("CARGO_PKG_VERSION")),
        "CHANGELOG.md's newest section is not Cargo.toml's version: {sections:?}"
    );
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(repo(""))
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let mut released = Vec::new();
    for s in &sections {
        let (version, rest) = s.split_once(' ').unwrap();
        if rest == "(unreleased)" {
            assert_eq!(
                version,
                sections[0].split(' ').next().unwrap(),
                "only the newest may be unreleased"
            );
            continue;
        }
        // `(date, tag v<version>, commit <hex>)`
        let inner = rest.trim_start_matches('(').trim_end_matches(')');
        let parts: Vec<&str> = inner.split(", ").collect();
        assert_eq!(
            parts.len(),
            3,
            "{s}: expected (date, tag v{version}, commit <hex>)"
        );
        assert_eq!(parts[1], format!("tag v{version}"), "{s}");
        let commit = parts[2].strip_prefix("commit ").unwrap();
        assert!(
            commit.len() >= 12 && commit.bytes().all(|b| b.is_ascii_hexdigit()),
            "{s}"
        );
        if let Some(tagged) = git(&["rev-parse", &format!("v{version}^{{commit}}")]) {
            assert!(
                tagged.starts_with(commit),
                "tag v{version} is {tagged}, CHANGELOG.md says {commit}"
            );
        }
        released.push(commit.to_string());
    }
    let previous = std::fs::read_to_string(repo("tests/previous-release")).unwrap();
    assert!(
        previous.trim().starts_with(&released[0]),
        "tests/previous-release is {}, the newest release in CHANGELOG.md {}",
        previous.trim(),
        released[0]
    );
}

/// A controller that cannot reach the API server says so first, with the reason, and retries
/// with a growing delay (not "controller started" while nothing works); a SIGTERM meanwhile
/// ends it at once, as Kubernetes stops a pod.
#[test]
fn a_controller_without_its_api_server_says_so_and_stops_when_told() {
    let dir = std::env::temp_dir().join(format!("peerwall-noapi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Nothing listens on a port just freed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters: [{{name: t, cluster: {{server: \"https://127.0.0.1:{port}\", insecure-skip-tls-verify: true}}}}]\nusers: [{{name: a, user: {{token: x}}}}]\ncontexts: [{{name: t, context: {{cluster: t, user: a}}}}]\ncurrent-context: t\n"
        ),
    )
    .unwrap();
    let log = dir.join("controller.log");
    let mut child = Command::new(peerwall())
        .args([
            "controller",
            "--metrics-addr",
            "127.0.0.1:0",
            "--kubeconfig",
        ])
        .arg(&kubeconfig)
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(3500));
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < std::time::Duration::from_secs(5),
            "the controller did not stop on SIGTERM"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(status.success(), "{status:?}\n{text}");
    let warned: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("cannot reach the API server"))
        .collect();
    // 1 s, then 2 s: two or three attempts in 3.5 s, not a storm.
    assert!((2..=3).contains(&warned.len()), "{text}");
    assert!(
        warned[0].contains("retry_in_secs=1") && warned[1].contains("retry_in_secs=2"),
        "{text}"
    );
    assert!(!text.contains("controller started"), "{text}");
    assert!(text.contains("controller stopping"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}
