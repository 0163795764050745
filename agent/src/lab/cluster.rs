//! The lab's cluster: its pods, namespaces, NetworkPolicies and ProtectionPolicies, and the
//! FirewallConfigurations the controller publishes for it (its consumers: `consumers.rs`).

use anyhow::{Context, Result};
use serde_json::Value;

use crate::{netpol, protection};

pub(super) use super::consumers::{consumers, Consumer, PROVIDER_CIDR, TWIN_POD};

pub(super) const LOCAL_POD: &str = "10.20.3.10";
/// A provider pod in `local` that no NetworkPolicy isolates (`local/cache`): the Baseline
/// tier of the lab's ClusterNetworkPolicies decides for it.
pub(super) const CACHE_POD: &str = "10.20.3.12";
/// A provider service the lab's ProtectionPolicy opens to consumer a (TCP 8080).
pub(super) const OPENED_POD: &str = "10.20.5.10";
/// A provider pod beside it that no policy opens.
pub(super) const UNOPENED_POD: &str = "10.20.5.11";
/// The provider's `monitoring` namespace: (pod name, address).
const MONITORING: [(&str, &str); 2] = [("prometheus", OPENED_POD), ("grafana", UNOPENED_POD)];

/// The provider admin's ProtectionPolicies in the lab, as a user writes them: consumer a's
/// pods may reach the provider's prometheus on TCP 8080 (nothing else in `monitoring`), and
/// consumer b's tunnel may not open UDP 9090 even to the pods b offloaded.
pub const LAB_PROTECTION_POLICIES: &str = r#"
apiVersion: peerwall.io/v1alpha1
kind: ProtectionPolicy
metadata:
  name: open-metrics
spec:
  peers: [a]
  open:
    - name: prometheus
      from: [PeerPods]
      namespaceSelector:
        matchLabels: {kubernetes.io/metadata.name: monitoring}
      podSelector:
        matchLabels: {app: prometheus}
      ports: [{protocol: TCP, port: 8080}]
---
apiVersion: peerwall.io/v1alpha1
kind: ProtectionPolicy
metadata:
  name: no-echo-from-b
spec:
  peers: [b]
  close:
    - name: echo
      ports: [{protocol: UDP, port: 9090}]
"#;

/// [`LAB_PROTECTION_POLICIES`], checked as the controller checks them.
pub fn lab_protection_policies() -> Result<Vec<protection::exceptions::Checked>> {
    use serde::Deserialize;
    let mut out = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(LAB_PROTECTION_POLICIES) {
        let v = Value::deserialize(doc).context("the lab's ProtectionPolicies")?;
        let name = v["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let spec: peerwall_intent::ProtectionPolicySpec =
            serde_json::from_value(v["spec"].clone()).context("a lab ProtectionPolicy's spec")?;
        out.push(protection::exceptions::check(&name, &spec)?);
    }
    Ok(out)
}

/// What the controller declares for consumer `name`'s gateway besides its sets.
fn lab_declared(name: &str) -> Result<protection::Declared> {
    let cluster = lab_cluster()?;
    Ok(protection::Declared {
        namespaces: protection::namespaces::namespace_sets(&cluster, name),
        exceptions: protection::exceptions::for_peer(
            &lab_protection_policies()?,
            name,
            lab_options().settings(),
            &cluster,
        ),
    })
}
pub(super) const NEW_POD: &str = "10.20.1.12";

/// Liqo's `Configuration` of consumer `c` in its tenant namespace, as its labels and body
/// (`apis/networking/v1beta1/configuration_types.go`): `spec.remote.cidr.pod` the consumer's
/// own pod CIDR, `status.remote.cidr.pod` how this cluster sees it (remapped when it overlaps
/// the provider's).
fn configuration(c: &Consumer) -> (std::collections::BTreeMap<String, String>, Value) {
    let labels = [(
        crate::k8s::REMOTE_CLUSTER_ID.to_string(),
        c.name.to_string(),
    )]
    .into_iter()
    .collect();
    let body = serde_json::json!({
        "spec": { "remote": { "cidr": { "pod": [c.cidr] } } },
        "status": { "remote": { "cidr": { "pod": [c.seen_cidr()] } } },
    });
    (labels, body)
}

/// The provider cluster as the controller sees it: a tenant namespace per consumer, a
/// namespace each consumer offloaded (holding its pods), and the provider's local pods.
/// `extra` adds pods offloaded later, as `(consumer, ip)`.
pub fn lab_world(extra: &[(&str, &str)]) -> protection::World {
    use std::collections::BTreeMap;
    let label = |kv: &[(&str, &str)]| -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    let mut w = protection::World::default();
    let pod = |ns: String, name: String, ip: &str| protection::Pod {
        namespace: ns,
        name,
        ips: ip.parse().into_iter().collect(),
        ..Default::default()
    };
    for c in consumers() {
        w.namespaces.push(protection::Namespace {
            name: format!("liqo-tenant-{}", c.name),
            labels: label(&[
                ("liqo.io/tenant-namespace", "true"),
                ("liqo.io/remote-cluster-id", c.name),
            ]),
        });
        // Liqo's Configuration of the peer, read as the controller reads it: the CIDRs its
        // packets carry through the tunnel, and how they are remapped here.
        let (labels, body) = configuration(&c);
        if let Some((peer, sources)) = protection::configuration_sources(&labels, &body) {
            w.sources.insert(peer, sources);
        }
        if let Some((peer, remaps)) = protection::configuration_remaps(&labels, &body) {
            if !remaps.is_empty() {
                w.remaps.insert(peer, remaps);
            }
        }
        let offloaded_ns = format!("app-{}", c.name);
        w.namespaces.push(protection::Namespace {
            name: offloaded_ns.clone(),
            labels: label(&[("liqo.io/remote-cluster-id", c.name)]),
        });
        let more = extra
            .iter()
            .filter(|(who, _)| *who == c.name)
            .map(|(_, ip)| *ip);
        for (i, ip) in c
            .offloaded
            .iter()
            .map(String::as_str)
            .chain(more)
            .enumerate()
        {
            w.pods
                .push(pod(offloaded_ns.clone(), format!("web-{i}"), ip));
        }
    }
    for c in consumers() {
        let Some(ours) = c.hosts_ours else {
            continue;
        };
        // A provider pod running there, through the virtual node; Liqo's virtual kubelet
        // reflects its IP remapped (`MapPodIP`).
        let node = format!("liqo-{}", c.name);
        w.virtual_nodes.push(protection::Node {
            name: node.clone(),
            labels: label(&[
                ("liqo.io/type", "virtual-node"),
                ("liqo.io/remote-cluster-id", c.name),
            ]),
        });
        if let Ok(seen) = c.seen(ours) {
            w.pods.push(protection::Pod {
                node: Some(node),
                ..pod("local".into(), format!("ours-on-{}", c.name), &seen)
            });
        }
    }
    w.namespaces.push(protection::Namespace {
        name: "local".into(),
        labels: Default::default(),
    });
    w.pods
        .push(pod("local".into(), "local-0".into(), LOCAL_POD));
    w.pods.push(pod("local".into(), "twin".into(), TWIN_POD));
    w.pods.push(pod("local".into(), "cache".into(), CACHE_POD));
    w.namespaces.push(protection::Namespace {
        name: "monitoring".into(),
        labels: Default::default(),
    });
    for (name, ip) in MONITORING {
        w.pods.push(pod("monitoring".into(), name.into(), ip));
    }
    w
}

fn lab_peer(world: &protection::World, name: &str) -> Result<protection::Peer> {
    protection::peers(world)
        .into_iter()
        .find(|p| p.id == name)
        .with_context(|| format!("no tenant namespace for consumer {name}"))
}

fn lab_options() -> protection::Options {
    protection::Options {
        tunnel: protection::DEFAULT_TUNNEL.into(),
        block_leaf_to_leaf: false,
        audit: false,
        liqo_ping_port: protection::LIQO_PING_PORT,
        own_namespace_only: true,
        inline_budget: peerwall_protection::spill::INLINE_BUDGET,
    }
}

/// The gateway configuration the controller publishes for consumer `name` in `world`, as the
/// agent's file (its sets declared, their addresses in slices: [`controller_slices`]).
pub fn controller_policy(world: &protection::World, name: &str) -> Result<String> {
    let doc = protection::gateway_object_with(
        &lab_peer(world, name)?,
        &Default::default(),
        &lab_options(),
        &lab_declared(name)?,
    );
    serde_json::to_string_pretty(&doc).context("encoding the gateway FirewallConfiguration")
}

/// The AddressSet slices the controller writes for consumer `name` in `world` when `current`
/// is published (only those that change), each with its file content.
pub fn controller_slices(
    world: &protection::World,
    name: &str,
    current: &[protection::Slice],
) -> Result<Vec<(protection::Slice, String)>> {
    let peer = lab_peer(world, name)?;
    let sets = protection::sets(world).remove(name).unwrap_or_default();
    let mut out = Vec::new();
    for (set, desired) in protection::set_contents(&sets, &lab_options()) {
        let mine: Vec<protection::Slice> =
            current.iter().filter(|s| s.set == set).cloned().collect();
        for slice in protection::layout(&set, &mine, &desired) {
            let text = serde_json::to_string_pretty(&protection::address_set_object(&peer, &slice))
                .context("encoding an AddressSet")?;
            out.push((slice, text));
        }
    }
    Ok(out)
}

// size: data: the lab's pods and policies as a user would write them.
/// The provider's own NetworkPolicies in the lab, and the pods they select, as the controller
/// reads them ([`crate::k8s::model::cluster`] builds the same from the API server): the pods
/// of [`lab_world`] with labels and container ports (`http` 8080/TCP, `echo` 9090/UDP), the
/// provider's pod running on consumer c as a remote pod of namespace `local`, and
/// - `app-a/web-1-http`: web-1 takes its named port `http` from consumer a's pod 10.10.1.10
///   only (ingress, pod selector, named port);
/// - `app-b/b-except-11`: the pods of app-b take anything from consumer b's CIDR except
///   10.30.1.11 (ingress, `ipBlock` with `except`);
/// - `local/local-egress`: the local pod opens connections only to consumer a's CIDR on TCP
///   8080 and UDP 9090, and to the pods labelled `app: ours` (the remote one on c) on any port
///   (an egress allowlist naming a remote pod by label);
/// - `local/local-from-ours`: the local pod takes its port `http` from the pods labelled
///   `app: ours` only (a remote pod by label, on the consumer's side of its tunnel).
pub fn lab_cluster() -> Result<netpol::Cluster> {
    use netpol::{ContainerPort, IpBlock, NetworkPolicy, Peer, Pod, Port, Ports, Protocol};
    use netpol::{Rule, Selector};
    use std::collections::BTreeMap;
    let labels = |kv: &[(&str, &str)]| -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    let selector = |kv: &[(&str, &str)]| Selector {
        labels: labels(kv),
        exprs: Vec::new(),
    };
    let ports = vec![
        ContainerPort {
            name: Some("http".into()),
            protocol: Protocol::Tcp,
            port: 8080,
        },
        ContainerPort {
            name: Some("echo".into()),
            protocol: Protocol::Udp,
            port: 9090,
        },
    ];
    let pod = |ns: &str, name: &str, ip: &str, local: Option<String>, peer: Option<&str>| Pod {
        namespace: ns.into(),
        name: name.into(),
        labels: labels(&[("app", name)]),
        ips: ip.parse().into_iter().collect(),
        local_ips: local.and_then(|l| l.parse().ok()).into_iter().collect(),
        ports: ports.clone(),
        peer: peer.map(str::to_string),
    };
    let mut cluster = netpol::Cluster::default();
    for c in consumers() {
        cluster.namespaces.insert(
            format!("app-{}", c.name),
            labels(&[
                ("kubernetes.io/metadata.name", &format!("app-{}", c.name)),
                (crate::k8s::REMOTE_CLUSTER_ID, c.name),
            ]),
        );
    }
    let mut namespace = |name: &str| {
        cluster.namespaces.insert(
            name.to_string(),
            labels(&[("kubernetes.io/metadata.name", name)]),
        );
    };
    namespace("local");
    namespace("monitoring");
    let mut push = |p: Pod| cluster.pods.push(std::sync::Arc::new(p));
    for c in consumers() {
        for (i, ip) in c.offloaded.iter().enumerate() {
            push(pod(
                &format!("app-{}", c.name),
                &format!("web-{i}"),
                ip,
                None,
                None,
            ));
        }
        // The provider's pod running on c: through the tunnel by c's own address, here by
        // the remapped one.
        if let Some(ours) = c.hosts_ours {
            let mut p = pod("local", "ours", ours, c.seen(ours).ok(), Some(c.name));
            p.name = format!("ours-on-{}", c.name);
            push(p);
        }
    }
    push(pod("local", "twin", TWIN_POD, None, None));
    push(pod("local", "cache", CACHE_POD, None, None));
    let mut local = pod("local", "local-0", LOCAL_POD, None, None);
    local.labels = labels(&[("app", "local")]);
    push(local);
    for (name, ip) in MONITORING {
        push(pod("monitoring", name, ip, None, None));
    }
    let block = |cidr: &str, except: &[&str]| {
        Peer::Block(IpBlock {
            cidr: cidr.parse().unwrap_or_else(|_| ipnet::IpNet::default()),
            except: except.iter().filter_map(|e| e.parse().ok()).collect(),
        })
    };
    let port = |protocol, ports| Port { protocol, ports };
    let ours = || Peer::Pods {
        namespaces: None,
        pods: Some(selector(&[("app", "ours")])),
    };
    cluster.policies = vec![
        NetworkPolicy {
            namespace: "app-a".into(),
            name: "web-1-http".into(),
            pod_selector: selector(&[("app", "web-1")]),
            ingress: Some(vec![Rule {
                peers: vec![block("10.10.1.10/32", &[])],
                ports: vec![port(Protocol::Tcp, Ports::Named("http".into()))],
            }]),
            egress: None,
        },
        NetworkPolicy {
            namespace: "app-b".into(),
            name: "b-except-11".into(),
            pod_selector: Selector::default(),
            ingress: Some(vec![Rule {
                peers: vec![block("10.30.0.0/16", &["10.30.1.11/32"])],
                ports: Vec::new(),
            }]),
            egress: None,
        },
        NetworkPolicy {
            namespace: "local".into(),
            name: "local-egress".into(),
            pod_selector: selector(&[("app", "local")]),
            ingress: None,
            egress: Some(vec![
                Rule {
                    peers: vec![block("10.10.0.0/16", &[])],
                    ports: vec![
                        port(Protocol::Tcp, Ports::Range(8080, 8080)),
                        port(Protocol::Udp, Ports::Range(9090, 9090)),
                    ],
                },
                Rule {
                    peers: vec![ours()],
                    ports: Vec::new(),
                },
            ]),
        },
        // c's offloaded pod admits c's pods by block (as seen here: remapped) and the
        // provider's local pod `twin` by label: a pod of c posing as it (its address is in
        // c's CIDR too) is not it.
        NetworkPolicy {
            namespace: "app-c".into(),
            name: "web-0-from-c-and-local".into(),
            pod_selector: selector(&[("app", "web-0")]),
            ingress: Some(vec![Rule {
                peers: vec![
                    block("10.71.9.0/24", &[]),
                    Peer::Pods {
                        namespaces: Some(selector(&[("kubernetes.io/metadata.name", "local")])),
                        pods: Some(selector(&[("app", "twin")])),
                    },
                ],
                ports: Vec::new(),
            }]),
            egress: None,
        },
        NetworkPolicy {
            namespace: "local".into(),
            name: "local-from-ours".into(),
            pod_selector: selector(&[("app", "local")]),
            ingress: Some(vec![Rule {
                peers: vec![ours()],
                ports: vec![port(Protocol::Tcp, Ports::Named("http".into()))],
            }]),
            egress: None,
        },
    ]
    .into_iter()
    .map(std::sync::Arc::new)
    .collect();
    // Liqo's Configurations: how each consumer's CIDRs are seen here.
    for c in consumers() {
        let (labels, body) = configuration(&c);
        if let Some((peer, remaps)) = protection::configuration_remaps(&labels, &body) {
            if !remaps.is_empty() {
                cluster.remaps.insert(peer, remaps);
            }
        }
    }
    let offloaded = offloaded_policies(&cluster)?;
    cluster
        .policies
        .extend(offloaded.into_iter().map(std::sync::Arc::new));
    cluster.cluster_policies = super::admin::lab_cluster_policies();
    Ok(cluster)
}

/// The NetworkPolicy the controller keeps in each consumer's offloaded namespace
/// ([`protection::offloaded_network_policy`]: egress home, to the consumer's other offloaded
/// namespaces, DNS and what a ProtectionPolicy opens), read back as the controller reads
/// every NetworkPolicy of the cluster into the tier.
fn offloaded_policies(cluster: &netpol::Cluster) -> Result<Vec<netpol::NetworkPolicy>> {
    let checked = lab_protection_policies()?;
    let mut out = Vec::new();
    for c in consumers() {
        let (labels, body) = configuration(&c);
        let home = protection::configuration_cidrs(&labels, &body)
            .map(|(_, h)| h)
            .unwrap_or_default();
        let exceptions =
            protection::exceptions::for_peer(&checked, c.name, lab_options().settings(), cluster);
        let open: Vec<_> = exceptions.for_offloaded().collect();
        let doc =
            protection::offloaded_network_policy(&format!("app-{}", c.name), c.name, &home, &open);
        let np: k8s_openapi::api::networking::v1::NetworkPolicy =
            serde_json::from_value(doc).context("the offloaded namespace's NetworkPolicy")?;
        out.push(crate::k8s::model::policy(&np).map_err(|u| {
            anyhow::anyhow!("the NetworkPolicy {} does not read: {}", u.policy, u.why)
        })?);
    }
    Ok(out)
}

/// The NetworkPolicy tier the controller publishes for consumer `name`'s gateway
/// ([`netpol::tier::tier`], [`netpol::tier::object`]), as the agent's file content.
pub fn controller_tier(
    world: &protection::World,
    cluster: &netpol::Cluster,
    name: &str,
) -> Result<Value> {
    let peer = lab_peer(world, name)?;
    let tier = netpol::tier::tier(cluster, name, false);
    if let Some(u) = tier.unenforced.first() {
        anyhow::bail!(
            "the lab's NetworkPolicy {} is not enforced: {}",
            u.policy,
            u.why
        );
    }
    Ok(netpol::tier::object(
        &peer.tenant_namespace,
        &peer.id,
        &tier.spec,
    ))
}

/// What consumer `c`'s gateway enforces, compiled as the agent compiles it (the gateway
/// configuration with its addresses inline, the NetworkPolicy tier, and Liqo's remapping
/// table it observes): the policy the lab's expected matrix is judged on.
pub(super) fn gateway_policy(c: &Consumer) -> Result<peerwall_policy::ir::Policy> {
    use peerwall_intent::load::{object_from_json, Group};
    let world = lab_world(&[]);
    let peer = lab_peer(&world, c.name)?;
    let sets = protection::sets(&world).remove(c.name).unwrap_or_default();
    let mut objects = vec![
        object_from_json(
            protection::gateway_object_with(&peer, &sets, &lab_options(), &lab_declared(c.name)?),
            Group::Peerwall,
        )?,
        object_from_json(
            controller_tier(&world, &lab_cluster()?, c.name)?,
            Group::Peerwall,
        )?,
    ];
    if let Some(remap) = c.remap_object() {
        let mut o = object_from_json(remap, Group::Liqo)?;
        o.role = peerwall_intent::Role::Observe;
        objects.push(o);
    }
    Ok(peerwall_policy::compile::compile(&objects)
        .context("the controller's output for the lab does not compile")?
        .policy)
}
