//! A NetworkPolicy change reaches the kernel through the agent's incremental path exactly as
//! a full recompute puts it there (issue 55): the controller's tier before and after a pod
//! relabel, a namespace relabel, a policy edit, a pod deletion and a policy deletion; the
//! agent's path for each (the sets whose inline elements alone changed edited in place, the
//! backend's set update; else the whole policy over what is in force), against the same tier
//! applied whole into an empty namespace. Compared as a user reads the kernels: `nft -j list
//! ruleset` (set elements in any order, handles and counters aside) and, for the eBPF
//! datapath, the live slot's policy maps dumped with `bpftool`.

#[path = "../agent/benches/shared/np_cluster.rs"]
mod np_cluster;

use std::collections::BTreeMap;

use peerwall::netpol::{self, Cluster, Protocol};
use peerwall_backend_select::{BackendKind, Settings};
use peerwall_policy::sliced::Sliced;
use peerwall_testkit::bpf::{active_slot, bpftool_json, Pins};
use peerwall_testkit::prelude::*;
use serde_json::Value;

use np_cluster::{cluster, PEER};

/// The tier's FirewallConfiguration as the agent reads it.
fn objects(c: &Cluster) -> Vec<peerwall_intent::PolicyObject> {
    let t = netpol::tier::tier(c, PEER, false);
    let doc = serde_json::json!({
        "apiVersion": "peerwall.io/v1alpha1", "kind": "FirewallConfiguration",
        "metadata": {"name": netpol::tier::TIER_CONFIG, "namespace": "liqo-tenant-p1"},
        "spec": t.spec,
    });
    vec![
        peerwall_intent::load::object_from_json(doc, peerwall_intent::load::Group::Peerwall)
            .expect("the tier loads"),
    ]
}

fn compile(objs: &[peerwall_intent::PolicyObject]) -> peerwall_policy::compile::Compiled {
    peerwall_policy::compile::compile(objs).expect("the tier compiles")
}

/// A change: what it is, how it edits the cluster, whether only set elements change.
type Change = (&'static str, fn(&mut Cluster), bool);

/// The changes, each on the cluster the previous one left, and whether the agent may take
/// the element path for it (a structure change may not).
fn changes() -> Vec<Change> {
    fn relabel_pod(c: &mut Cluster) {
        let p = c
            .pods
            .iter_mut()
            .filter(|p| p.peer.is_some())
            .map(std::sync::Arc::make_mut)
            .nth(7)
            .expect("a remote pod");
        let old: usize = p.labels["tier"][1..].parse().unwrap_or(0);
        p.labels
            .insert("tier".into(), format!("x{}", (old + 1) % 7));
    }
    fn relabel_local_pod(c: &mut Cluster) {
        let p = c
            .pods
            .iter_mut()
            .filter(|p| p.peer.is_none())
            .map(std::sync::Arc::make_mut)
            .nth(3)
            .expect("a local pod");
        let old: usize = p.labels["app"][1..].parse().unwrap_or(0);
        p.labels
            .insert("app".into(), format!("a{}", (old + 1) % 50));
    }
    fn relabel_namespace(c: &mut Cluster) {
        let ns = c.namespaces.get_mut("ns3").expect("ns3");
        ns.insert("team".into(), "t4".into());
    }
    fn edit_policy(c: &mut Cluster) {
        let p = std::sync::Arc::make_mut(&mut c.policies[5]);
        p.pod_selector.labels.insert("app".into(), "a17".into());
    }
    fn delete_pod(c: &mut Cluster) {
        let i = c
            .pods
            .iter()
            .position(|p| p.peer.is_some())
            .expect("a remote pod");
        c.pods.remove(i);
    }
    fn delete_policy(c: &mut Cluster) {
        c.policies.remove(11);
    }
    vec![
        ("a remote pod relabelled", relabel_pod, true),
        ("a local pod relabelled", relabel_local_pod, true),
        ("a namespace relabelled", relabel_namespace, true),
        ("a policy's pod selector edited", edit_policy, false),
        ("a remote pod deleted", delete_pod, true),
        ("a policy deleted", delete_policy, false),
    ]
}

/// The ruleset as `nft -j` lists it, handles and counters taken out, set elements sorted.
fn nft_state(ns: &NetNs) -> Value {
    fn norm(v: &mut Value) {
        match v {
            Value::Object(m) => {
                m.remove("handle");
                m.remove("metainfo");
                if let Some(c) = m.get_mut("counter") {
                    *c = Value::Null;
                }
                if let Some(Value::Array(elems)) = m.get_mut("elem") {
                    elems.sort_by_key(|e| e.to_string());
                }
                m.values_mut().for_each(norm);
            }
            Value::Array(a) => a.iter_mut().for_each(norm),
            _ => {}
        }
    }
    let o = in_ns(ns, "nft", &["-j", "list", "ruleset"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut v: Value = serde_json::from_slice(&o.stdout).expect("nft json");
    norm(&mut v);
    v
}

/// The live slot's policy maps (tries, host hashes, ports, chains, rules, hooks, views), each
/// dumped with bpftool, entries sorted: what decides a packet's verdict. What packets write
/// (flows, counters, caches) and the policy epoch (it counts changes) are not compared.
fn bpf_state(pins: &Pins) -> BTreeMap<String, Vec<String>> {
    let slot = active_slot(pins);
    let mut out = BTreeMap::new();
    for name in SLOT_MAPS {
        let path = format!("{}/{name}{slot}", pins.arg());
        let dump = bpftool_json(&["map", "dump", "pinned", &path]);
        let mut entries: Vec<String> = dump
            .as_array()
            .map(|a| a.iter().map(Value::to_string).collect())
            .unwrap_or_default();
        entries.sort();
        out.insert(name.to_string(), entries);
    }
    out
}

/// The maps of a policy slot (`ebpf/src/maps.rs`, `slot_maps!` and `VIEW`), without its slot
/// digit.
const SLOT_MAPS: &[&str] = &[
    "SRC", "DST", "SRCH", "DSTH", "SPORT", "DPORT", "PROTO", "IIF", "OIF", "CT", "MASKS", "CHAINS",
    "RULES", "HOOKS", "OWNERS", "VIEW",
];

#[test]
fn a_netpol_change_reaches_the_kernel_as_a_full_recompute_would() {
    require_root();
    for kind in [BackendKind::Nftables, BackendKind::Bpf] {
        let mut c = cluster(600, 60, Protocol::Tcp, |i| i % 5 == 0);
        let mut objs = objects(&c);
        let mut compiled = compile(&objs);
        let open = |ns: &NetNs, pins: &Pins| {
            ns.veth("liqo-tunnel", ns, "liqo.bench00001")
                .expect("links");
            peerwall_backend_select::open(
                &Settings {
                    pin_dir: pins.0.clone(),
                    interfaces: vec!["liqo-tunnel*".into(), "liqo.*".into()],
                    ..Settings::new(kind)
                },
                Some(ns.name()),
            )
            .expect("backend")
        };
        let (inc_ns, inc_pins) = (NetNs::new("pwinc").expect("ns"), Pins::new("inc"));
        let mut inc = open(&inc_ns, &inc_pins);
        inc.apply(&compiled.policy).expect("first apply");
        let mut element_paths = 0;
        for (what, change, elements_only) in changes() {
            change(&mut c);
            let new_objs = objects(&c);
            let whole = compile(&new_objs);
            // The agent's path (agent/kube/src/agent.rs `settle`, then `enforce`): the sets
            // whose inline elements alone changed parsed and patched into what it compiled,
            // then edited in place in the kernel; the whole compiled and applied otherwise.
            let changed_sets = peerwall_intent::elements::inline_element_changes(&objs, &new_objs);
            let refs: Vec<&peerwall_intent::PolicyObject> = new_objs.iter().collect();
            let patched = changed_sets.as_ref().and_then(|sets| {
                peerwall_policy::compile::patch_elements(compiled.clone(), &refs, sets)
            });
            if elements_only {
                assert!(
                    patched.is_some(),
                    "{what}: the agent compiled the whole tier"
                );
            }
            let new_compiled = patched.unwrap_or_else(|| whole.clone());
            let (mut sliced, _) = Sliced::new(compiled.clone(), &[]);
            let edits = changed_sets.and_then(|sets| sliced.replace_inline(&new_compiled, &sets));
            let took_elements = edits.is_some();
            match edits {
                Some(changes) => {
                    assert!(!changes.is_empty(), "{what}: the change moved no element");
                    inc.update_sets(sliced.policy(), &changes)
                        .expect("set update");
                    element_paths += 1;
                }
                None => {
                    inc.apply(&new_compiled.policy).expect("apply");
                }
            }
            if elements_only {
                assert!(
                    took_elements,
                    "{what}: the agent applied the whole policy where only set elements changed"
                );
            }
            // The same tier, whole, into a namespace that held nothing.
            let (full_ns, full_pins) = (NetNs::new("pwfull").expect("ns"), Pins::new("full"));
            let mut full = open(&full_ns, &full_pins);
            full.apply(&whole.policy).expect("full apply");
            match kind {
                BackendKind::Nftables => assert_eq!(
                    nft_state(&inc_ns),
                    nft_state(&full_ns),
                    "{what}: nftables after the agent's path differs from a full apply"
                ),
                BackendKind::Bpf => assert_eq!(
                    bpf_state(&inc_pins),
                    bpf_state(&full_pins),
                    "{what}: the eBPF maps after the agent's path differ from a full apply"
                ),
            }
            drop(full);
            (objs, compiled) = (new_objs, new_compiled);
        }
        assert!(
            element_paths >= 4,
            "{kind:?}: {element_paths} element paths"
        );
    }
}
