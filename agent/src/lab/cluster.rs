//! The lab's cluster: its consumers (pod CIDRs, underlay and Geneve addresses, offloaded
//! pods), and the FirewallConfiguration the controller publishes for it.

use anyhow::{Context, Result};

use crate::protection;

pub(super) struct Consumer {
    pub(super) name: &'static str,
    pub(super) cidr: &'static str,
    pub(super) pods: [&'static str; 2],
    pub(super) underlay: (&'static str, &'static str),
    pub(super) geneve: &'static str,
    pub(super) link: (&'static str, &'static str),
    pub(super) offloaded: Vec<String>,
}

pub(super) fn consumers() -> Vec<Consumer> {
    vec![
        Consumer {
            name: "a",
            cidr: "10.10.0.0/16",
            pods: ["10.10.1.10", "10.10.1.11"],
            underlay: ("192.168.210.1", "192.168.210.2"),
            geneve: "liqo.a1b2c3d4e5",
            link: ("169.254.10.1", "169.254.10.2"),
            offloaded: vec!["10.20.1.10".into(), "10.20.1.11".into()],
        },
        Consumer {
            name: "b",
            cidr: "10.30.0.0/16",
            pods: ["10.30.1.10", "10.30.1.11"],
            underlay: ("192.168.230.1", "192.168.230.2"),
            geneve: "liqo.f6g7h8i9j0",
            link: ("169.254.30.1", "169.254.30.2"),
            offloaded: vec!["10.20.2.10".into()],
        },
    ]
}

pub(super) const LOCAL_POD: &str = "10.20.3.10";
pub(super) const NEW_POD: &str = "10.20.1.12";

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
    w.namespaces.push(protection::Namespace {
        name: "local".into(),
        labels: Default::default(),
    });
    w.pods
        .push(pod("local".into(), "local-0".into(), LOCAL_POD));
    w
}

/// What the controller would publish for consumer `name` in `world`, as the agent's file.
pub fn controller_policy(world: &protection::World, name: &str) -> Result<String> {
    let peer = protection::peers(world)
        .into_iter()
        .find(|p| p.id == name)
        .with_context(|| format!("no tenant namespace for consumer {name}"))?;
    let sets = protection::sets(world).remove(name).unwrap_or_default();
    let opts = protection::Options {
        tunnel: protection::DEFAULT_TUNNEL.into(),
        block_leaf_to_leaf: false,
    };
    let doc = protection::gateway_object(&peer, &sets, &opts);
    serde_json::to_string_pretty(&doc).context("encoding the gateway FirewallConfiguration")
}
