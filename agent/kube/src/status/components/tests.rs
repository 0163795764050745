use super::*;

fn ready(n: i32, image: &str) -> Workload {
    Workload {
        desired: n,
        ready: n,
        updated: n,
        images: BTreeMap::from([(image.to_string(), n as u32)]),
        not_ready: vec![],
    }
}

fn crds_ok() -> Vec<Found<Crd>> {
    CRDS.iter()
        .map(|(_, _, v, _)| {
            Found::Yes(Crd {
                established: true,
                served: vec![v.to_string()],
            })
        })
        .collect()
}

fn healthy() -> Install {
    Install {
        agents: Found::Yes(ready(2, "peerwall:0.1.0")),
        sidecars: Workload::default(),
        controller: Found::Yes(ready(1, "peerwall:0.1.0")),
        webhook: Found::Yes(ready(2, "peerwall:0.1.0")),
        webhook_config: Found::Yes(WebhookConfig {
            ca_bundles: vec![("firewallconfigurations.peerwall.io".into(), true)],
        }),
        crds: crds_ok(),
    }
}

fn health(cs: &[Component], name: &str) -> Health {
    cs.iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no {name} in {cs:?}"))
        .health
}

#[test]
fn a_working_install_is_all_ok() {
    let cs = check(&healthy(), &[]);
    assert!(cs.iter().all(|c| c.health == Health::Ok), "{cs:?}");
    let text = render(&cs);
    assert!(
        text.contains("agents") && text.contains("2/2 ready, peerwall:0.1.0 ×2"),
        "{text}"
    );
}

/// The user's report: the DaemonSet at 0/0 and the controller at 0/1 (manifests applied,
/// nothing running). Both are errors, each says why, and the webhook without its CA too.
#[test]
fn a_half_installed_cluster_says_what_does_not_run() {
    let mut i = healthy();
    i.agents = Found::Yes(Workload::default());
    i.controller = Found::Yes(Workload {
        desired: 1,
        updated: 1,
        not_ready: vec!["peerwall-controller-abc (no node)".into()],
        ..Default::default()
    });
    i.webhook_config = Found::Yes(WebhookConfig {
        ca_bundles: vec![("firewallconfigurations.peerwall.io".into(), false)],
    });
    let cs = check(&i, &[]);
    assert_eq!(health(&cs, "agents"), Health::Error);
    assert_eq!(health(&cs, CONTROLLER), Health::Error);
    assert_eq!(health(&cs, "webhook registration"), Health::Error);
    let text = render(&cs);
    assert!(text.contains("0/0: no agent pods"), "{text}");
    assert!(text.contains("0/1 ready"), "{text}");
    assert!(
        text.contains("peerwall-controller-abc (no node)"),
        "the pod not ready is named: {text}"
    );
    assert!(text.contains("no caBundle"), "{text}");
}

#[test]
fn nothing_installed_is_an_error_for_each_part() {
    let i = Install {
        agents: Found::No,
        sidecars: Workload::default(),
        controller: Found::No,
        webhook: Found::No,
        webhook_config: Found::No,
        crds: vec![Found::No; CRDS.len()],
    };
    let cs = check(&i, &[]);
    assert_eq!(health(&cs, "agents"), Health::Error);
    assert_eq!(health(&cs, CONTROLLER), Health::Error);
    assert_eq!(health(&cs, WEBHOOK), Health::Error);
    // Agents that report from outside the cluster: there, but not kept running by it.
    let outside = check(&i, &["gw-1".to_string()]);
    assert_eq!(health(&outside, "agents"), Health::Warning);
    assert!(render(&outside).contains("not run by Kubernetes: gw-1 report"));
    assert_eq!(health(&cs, "crd FirewallConfiguration"), Health::Error);
    // Features, not protection: warnings.
    assert_eq!(health(&cs, "crd ClusterNetworkPolicy"), Health::Warning);
    assert_eq!(health(&cs, "crd Configuration (Liqo)"), Health::Warning);
}

#[test]
fn sidecar_mode_counts_the_gateway_pods_containers() {
    let mut i = healthy();
    i.agents = Found::No;
    i.sidecars = Workload {
        desired: 3,
        ready: 2,
        updated: 3,
        images: BTreeMap::from([("peerwall:0.1.0".into(), 3)]),
        not_ready: vec!["liqo-tenant-a/gw-x (node-2)".into()],
    };
    let cs = check(&i, &[]);
    assert_eq!(health(&cs, "agents (sidecars)"), Health::Error);
    assert!(render(&cs).contains("2/3 gateway pods with a ready peerwall container"));
    i.sidecars.ready = 3;
    assert_eq!(health(&check(&i, &[]), "agents (sidecars)"), Health::Ok);
}

#[test]
fn a_rollout_and_a_crd_of_another_version_are_named() {
    let mut i = healthy();
    i.agents = Found::Yes(Workload {
        desired: 2,
        ready: 2,
        updated: 1,
        images: BTreeMap::from([("peerwall:0.1.0".into(), 1), ("peerwall:0.2.0".into(), 1)]),
        not_ready: vec![],
    });
    i.crds[0] = Found::Yes(Crd {
        established: true,
        served: vec!["v1beta1".into()],
    });
    let cs = check(&i, &[]);
    assert_eq!(health(&cs, "agents"), Health::Warning);
    let text = render(&cs);
    assert!(
        text.contains("1/2 updated") && text.contains("peerwall:0.2.0 ×1"),
        "{text}"
    );
    assert_eq!(health(&cs, "crd FirewallConfiguration"), Health::Error);
    assert!(text.contains("serves v1beta1, not v1alpha1"), "{text}");
}

/// A part the user may not read (RBAC) is a warning that says so, not an error or an ok.
#[test]
fn what_cannot_be_read_is_unknown() {
    let mut i = healthy();
    i.agents = Found::Unknown("forbidden".into());
    let cs = check(&i, &[]);
    assert_eq!(health(&cs, "agents"), Health::Warning);
    assert!(render(&cs).contains("could not be read: forbidden"));
}
