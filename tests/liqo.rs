//! Liqo's own FirewallConfigurations, as Liqo creates them (`examples/liqo/`, each file names
//! the Liqo source that creates the object): loaded, validated and compiled for both backends
//! (root, as CI runs them: without it the tests fail, not pass unseen); applied by the nftables backend in a gateway namespace with Liqo's interface
//! names (listing, counters, drift, idempotent re-apply); accepted by the bpf backend, which
//! says which rules it leaves to nftables.

use std::path::PathBuf;

use peerwall_backend_bpf::maps::{self as bpf, Iface};
use peerwall_backend_nftables::{render, Nft, NftBackend};
use peerwall_intent::load;
use peerwall_policy::compile::{self, PolicyObject};
use peerwall_testkit::prelude::*;

/// Every Liqo shape with what its nftables rendering must say, and whether a gateway enforces
/// it (gateway objects are applied together, as in one gateway; fabric objects run on nodes,
/// and `fabric-notrack` shares its table name with `gw-notrack`).
const SHAPES: &[(&str, bool, &[&str])] = &[
    (
        "gw-mss-clamping.yaml",
        true,
        &["tcp option maxseg size set rt mtu"],
    ),
    ("gw-notrack.yaml", true, &["notrack", "th dport 6091"]),
    ("fabric-notrack.yaml", false, &["notrack", "th sport 6091"]),
    (
        "remap-podcidr.yaml",
        true,
        &[
            "dnat prefix to 10.243.0.0/16",
            "snat prefix to 10.71.0.0/16",
            "iifname != \"liqo-tunnel\"",
        ],
    ),
    (
        "remap-externalcidr.yaml",
        true,
        &["dnat prefix to 10.70.0.0/16", "snat prefix to 10.72.0.0/16"],
    ),
    (
        "remap-ipmapping-gw.yaml",
        true,
        &["dnat to 10.80.0.10", "snat to 10.80.0.10"],
    ),
    (
        "remap-ipmapping-fabric.yaml",
        false,
        &["masquerade", "dnat to 10.80.0.10"],
    ),
    (
        "masquerade-bypass.yaml",
        false,
        &[
            "snat prefix to 10.244.0.0/16",
            "ip saddr != 10.244.0.0/16",
            "snat to 10.70.0.1",
        ],
    ),
    (
        "gw-masquerade-bypass.yaml",
        false,
        &["snat to 10.244.1.17", "th dport 6091"],
    ),
    (
        "service-nodeport-routing.yaml",
        true,
        &["ct mark set", "meta mark set ct mark"],
    ),
];

const GENEVE_IF: &str = "liqo.8ds4xk2pqn";

/// Every shape file: `examples/liqo/gateway/` (what a gateway enforces) and
/// `examples/liqo/fabric/` (what the nodes enforce; one host never enforces both, and the
/// two sets share a table name).
fn shape_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = ["gateway", "fabric"]
        .iter()
        .flat_map(|d| std::fs::read_dir(repo("examples/liqo").join(d)).expect("examples/liqo"))
        .map(|e| e.expect("entry").path())
        .collect();
    files.sort();
    files
}

fn shape_path(file: &str) -> PathBuf {
    shape_files()
        .into_iter()
        .find(|p| p.file_name().is_some_and(|n| n == file))
        .unwrap_or_else(|| panic!("no shape {file} under examples/liqo"))
}

fn load_shape(file: &str) -> PolicyObject {
    let mut objs = load::load_paths(&[shape_path(file)]).expect("load");
    assert_eq!(objs.len(), 1, "{file}");
    objs.remove(0)
}

fn ifaces() -> Vec<Iface> {
    ["lo", "eth0", "liqo-tunnel", GENEVE_IF]
        .iter()
        .enumerate()
        .map(|(i, n)| Iface {
            name: (*n).into(),
            ifindex: i as u32 + 1,
        })
        .collect()
}

/// The rule names of a compiled table.
fn rule_names(p: &peerwall_policy::ir::Policy) -> Vec<String> {
    p.tables
        .iter()
        .flat_map(|t| &t.chains)
        .flat_map(|c| &c.rules)
        .map(|r| r.name.clone())
        .collect()
}

#[test]
fn the_corpus_covers_every_liqo_file_that_creates_firewallconfigurations() {
    let mut sources: Vec<String> = shape_files()
        .into_iter()
        .map(|p| std::fs::read_to_string(p).expect("read"))
        .flat_map(|text| {
            text.lines()
                .take(2)
                .filter_map(|l| {
                    l.strip_prefix("# Liqo: ")
                        .or(l.strip_prefix("# Liqo Helm chart: "))
                })
                .map(|l| l.split_whitespace().next().unwrap_or_default().to_string())
                .collect::<Vec<_>>()
        })
        .collect();
    sources.sort();
    sources.dedup();
    for f in [
        "deployments/liqo/templates/liqo-gw-mssclamp-firewallconfiguration.yaml",
        "deployments/liqo/templates/liqo-notrack-firewallconfiguration.yaml",
        "pkg/liqo-controller-manager/networking/external-network/remapping/cidr.go",
        "pkg/liqo-controller-manager/networking/external-network/remapping/ip.go",
        "pkg/liqo-controller-manager/networking/internal-network/configuration-controller/firewall.go",
        "pkg/liqo-controller-manager/networking/internal-network/gw-masq-bypass/k8s.go",
        "pkg/liqo-controller-manager/networking/internal-network/route/internalnode_k8s.go",
    ] {
        assert!(sources.iter().any(|s| s == f), "no shape from {f}: {sources:?}");
    }
    assert_eq!(
        SHAPES.len(),
        shape_files().len(),
        "every file in examples/liqo is tested"
    );
}

/// One Liqo shape, end to end: it loads (marked as Liqo's), validates and compiles; its
/// nftables rendering says what Liqo asked for; the bpf compiler accepts it and names every
/// rule it leaves to nftables; the same object in peerwall's group compiles to the same chains;
/// and it applies alone with nftables in a namespace with Liqo's interface names,
/// where the kernel lists it.
fn check_shape(file: &str) {
    let (_, _, expect) = SHAPES
        .iter()
        .find(|(f, _, _)| *f == file)
        .unwrap_or_else(|| panic!("{file} is not in SHAPES"));
    let obj = load_shape(file);
    assert!(
        obj.origin.0.starts_with(load::LIQO_ORIGIN_PREFIX),
        "{file}: {}",
        obj.origin
    );
    let compiled =
        compile::compile(std::slice::from_ref(&obj)).unwrap_or_else(|e| panic!("{file}: {e}"));
    let text: String = render::render_policy(&compiled.policy, Default::default())
        .iter()
        .map(peerwall_backend_nftables::text::table_text)
        .collect();
    for e in *expect {
        assert!(text.contains(e), "{file}: {e:?} not in\n{text}");
    }
    bpf::compile(&compiled.policy, &ifaces()).unwrap_or_else(|e| panic!("{file}: {e}"));
    let left = bpf::left_to_nftables(&compiled.policy);
    let non_verdict = compiled
        .policy
        .tables
        .iter()
        .flat_map(|t| &t.chains)
        .flat_map(|c| &c.rules)
        .filter(|r| r.action.verdict().is_none())
        .count();
    assert_eq!(left.len(), non_verdict, "{file}: {left:?}");
    assert!(
        non_verdict > 0,
        "{file}: Liqo's objects only mark, track or translate"
    );
    let text_yaml = std::fs::read_to_string(shape_path(file)).unwrap();
    let as_ours = text_yaml.replace(load::LIQO_API_VERSION, load::API_VERSION);
    let ours = load::parse_documents(&as_ours, file).expect("peerwall.io");
    assert_eq!(ours[0].origin.0, obj.origin.0.trim_start_matches("liqo:"));
    let ours = compile::compile(&ours).expect("compile");
    assert_eq!(
        format!("{:?}", ours.policy.tables[0].chains),
        format!("{:?}", compiled.policy.tables[0].chains),
        "{file}"
    );
    // The kernel part is the point: without root this test fails, it does not pass unseen.
    require_root();
    let g = Gateway::new();
    let o = peerwall_in(&g.gw, &["apply", "-f", shape_path(file).to_str().unwrap()]);
    assert!(
        o.status.success(),
        "{file}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let listed = nft_text(&g.gw);
    for e in *expect {
        assert!(
            listed.contains(e),
            "{file}: {e:?} not in the kernel:\n{listed}"
        );
    }
    for name in rule_names(&compiled.policy) {
        assert!(
            listed.contains(&format!("comment \"{name}\"")),
            "{file}: {name} not in\n{listed}"
        );
    }
}

macro_rules! shape_tests {
    ($($test:ident => $file:literal,)*) => {
        $(
            #[test]
            fn $test() {
                check_shape($file);
            }
        )*

        #[test]
        fn every_shape_has_its_test() {
            let tested = [$($file),*];
            for (f, _, _) in SHAPES {
                assert!(tested.contains(f), "{f} has no test");
            }
        }
    };
}

shape_tests! {
    helm_gw_mss_clamping => "gw-mss-clamping.yaml",
    helm_gw_notrack => "gw-notrack.yaml",
    helm_fabric_notrack => "fabric-notrack.yaml",
    remapping_pod_cidr => "remap-podcidr.yaml",
    remapping_external_cidr => "remap-externalcidr.yaml",
    remapping_ip_gateway => "remap-ipmapping-gw.yaml",
    remapping_ip_fabric_masquerade => "remap-ipmapping-fabric.yaml",
    configuration_masquerade_bypass => "masquerade-bypass.yaml",
    gateway_masquerade_bypass => "gw-masquerade-bypass.yaml",
    internal_node_port_routing_marks => "service-nodeport-routing.yaml",
}

#[test]
fn rules_without_a_name_get_stable_names_and_a_warning() {
    let obj = load_shape("remap-podcidr.yaml");
    let a = compile::compile(std::slice::from_ref(&obj)).unwrap();
    let b = compile::compile(std::slice::from_ref(&obj)).unwrap();
    let names = rule_names(&a.policy);
    assert_eq!(names, rule_names(&b.policy), "deterministic");
    assert_eq!(names.len(), 2);
    assert!(names.iter().all(|n| n.starts_with("rule-")), "{names:?}");
    assert_ne!(names[0], names[1]);
    let warned: Vec<String> = a.warnings.iter().map(|(_, w)| w.to_string()).collect();
    assert_eq!(warned.len(), 2, "{warned:?}");
    assert!(
        warned[0]
            .starts_with("spec.table.chains[0].rules.natRules[0].name: missing; named \"rule-"),
        "{warned:?}"
    );
    // A name written in the chain is never taken by a generated one: the unnamed rule steps
    // aside with a suffix.
    let y = std::fs::read_to_string(shape_path("remap-podcidr.yaml")).unwrap();
    let taken = y.replacen(
        "          natRules:\n            - natType: dnat",
        &format!(
            "          natRules:\n            - natType: dnat\n              name: {}\n              match: [{{op: eq, ip: {{value: 10.1.0.0/16, position: dst}}}}]\n              to: 10.2.0.0/16\n            - natType: dnat",
            names[1]
        ),
        1,
    );
    // Chains are listed by name: incoming (snat), then outgoing (dnat, where the clash is).
    let c = compile::compile(&load::parse_documents(&taken, "taken").unwrap()).unwrap();
    let got = rule_names(&c.policy);
    assert_eq!(got[0], names[0], "{got:?}");
    assert_eq!(got[1], names[1], "the written name: {got:?}");
    assert_eq!(got[2], format!("{}-2", names[1]), "{got:?}");
}

/// A gateway namespace with Liqo's interfaces: the tunnel, a Geneve link to a node, eth0.
struct Gateway {
    gw: NetNs,
    _peers: Vec<NetNs>,
}

impl Gateway {
    fn new() -> Self {
        require_root();
        let gw = NetNs::new("pwl-g").expect("netns");
        let peer = NetNs::new("pwl-p").expect("netns");
        let node = NetNs::new("pwl-n").expect("netns");
        let out = NetNs::new("pwl-o").expect("netns");
        veth(&gw, "liqo-tunnel", &peer, "eth0");
        veth(&gw, GENEVE_IF, &node, "eth0");
        veth(&gw, "eth0", &out, "eth0");
        Self {
            gw,
            _peers: vec![peer, node, out],
        }
    }
}

fn nft_text(ns: &NetNs) -> String {
    String::from_utf8_lossy(&in_ns(ns, "nft", &["list", "ruleset"]).stdout).into_owned()
}

#[test]
fn liqo_shapes_apply_with_nftables_in_a_gateway_namespace() {
    let g = Gateway::new();
    let gateway: Vec<PathBuf> = SHAPES
        .iter()
        .filter(|(_, gw, _)| *gw)
        .map(|(f, _, _)| shape_path(f))
        .collect();
    // The user's command: one transaction with every gateway object.
    let mut args = vec!["apply".to_string()];
    for p in &gateway {
        args.push("-f".into());
        args.push(p.display().to_string());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = peerwall_in(&g.gw, &args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let listed = nft_text(&g.gw);
    for (file, gw, expect) in SHAPES {
        if !gw {
            continue;
        }
        for e in *expect {
            assert!(
                listed.contains(e),
                "{file}: {e:?} not in the kernel:\n{listed}"
            );
        }
    }
    // Every rule is listed under its (possibly generated) name, counters included.
    let objs = load::load_paths(&gateway).unwrap();
    let policy = compile::compile(&objs).unwrap().policy;
    let counters = peerwall_in(&g.gw, &["counters"]);
    let counters = String::from_utf8_lossy(&counters.stdout);
    for t in &policy.tables {
        for c in &t.chains {
            for r in &c.rules {
                let name = &r.name;
                assert!(
                    listed.contains(&format!("comment \"{name}\"")),
                    "{name} not in\n{listed}"
                );
                let id = format!("{}/{}/{name}\t", t.name, c.name);
                assert_eq!(
                    counters.contains(&id),
                    r.counter,
                    "{id} in counters:\n{counters}"
                );
            }
        }
    }
    // Listing, drift detection and re-apply work on these names: no drift, nothing to change.
    let mut backend = NftBackend::new(Nft::in_netns(g.gw.name()));
    backend.apply(&policy).expect("adopt");
    let r = backend.apply(&policy).expect("re-apply");
    assert!(
        r.recreated.is_empty() && r.updated.is_empty() && r.deleted.is_empty(),
        "{r:?}"
    );
    assert!(backend.drift().expect("drift").is_empty());
    // And they leave as they came.
    let o = peerwall_in(&g.gw, &["delete"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!nft_text(&g.gw).contains("table"), "{}", nft_text(&g.gw));
}

#[test]
fn the_bpf_backend_accepts_liqo_shapes_and_names_what_it_leaves_to_nftables() {
    let g = Gateway::new();
    let pins = loader_pins("liqo");
    let mut args = vec![
        "apply".to_string(),
        "--backend".into(),
        "bpf".into(),
        "--pin-dir".into(),
        pins.display().to_string(),
    ];
    for (f, gw, _) in SHAPES {
        if *gw {
            args.push("-f".into());
            args.push(shape_path(f).display().to_string());
        }
    }
    let bin = peerwall();
    let net = format!("--net=/run/netns/{}", g.gw.name());
    let mut full = vec![net.clone(), bin.display().to_string()];
    full.extend(args);
    let full: Vec<&str> = full.iter().map(String::as_str).collect();
    let o = sh("nsenter", &full);
    let _cleanup = RemovePins(pins.clone());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    for what in [
        "remap-podcidr/outgoing/rule-",
        ": dnat is not enforced by the bpf backend",
        "mss-clamping/mss-clamping/mss-clamping-out: tcp mss clamping is not enforced",
        "service-nodeport-routing/mark-to-conntrack/worker-1: ct mark set is not enforced",
    ] {
        assert!(err.contains(what), "{what:?} not in\n{err}");
    }
    // Attached to Liqo's interfaces in the gateway; `inspect` decodes the pins.
    let inspect = format!("{}", bin.display());
    let o = sh(
        "nsenter",
        &[
            &net,
            &inspect,
            "inspect",
            "--pin-dir",
            pins.to_str().unwrap(),
            "--output",
            "json",
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    for dev in ["tc:liqo-tunnel", &format!("tc:{GENEVE_IF}")] {
        assert!(
            v["attached"].as_array().unwrap().iter().any(|a| a == dev),
            "{dev} not attached: {v}"
        );
    }
    assert!(
        v["chains"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["name"] == "service-nodeport-routing/mark-to-conntrack"),
        "{v}"
    );
}

fn loader_pins(tag: &str) -> PathBuf {
    let root = peerwall_backend_bpf::loader::ensure_bpffs().expect("bpffs");
    root.join(format!("pwt-{tag}-{}", std::process::id()))
}

/// Removes a pin directory (and its links) on drop.
struct RemovePins(PathBuf);

impl Drop for RemovePins {
    fn drop(&mut self) {
        let _ = peerwall_backend_bpf::loader::remove_pins(&self.0);
    }
}
