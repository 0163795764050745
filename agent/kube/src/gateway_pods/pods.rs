//! Which pods on this node are Liqo gateways peerwall enforces in, and for which peer (pure:
//! a pod object in, a decision out).
//!
//! What Liqo's source says about its gateway pods:
//! - They carry `networking.liqo.io/component=gateway` (`pkg/consts/labels.go`
//!   `NetworkingComponentKey`, `pkg/gateway/label.go` `GatewayComponentGateway`, set by the
//!   gateway templates' `liqo.selectorTemplate` in `deployments/liqo/templates/_helpers.tpl`).
//! - With several replicas one is active and labelled `networking.liqo.io/active=true`
//!   (`pkg/gateway/concurrent/label.go`); with one replica the template sets that label itself
//!   (`liqo.labelsTemplate`).
//! - The peer is not a pod label: the gateway containers get `--remote-cluster-id=<id>`
//!   (`pkg/gateway/flags.go` `FlagNameRemoteClusterID`, passed by
//!   `liqo-wireguard-gateway-{server,client}-template.yaml`).

use k8s_openapi::api::core::v1::Pod;

/// Liqo's gateway pod label key (`networking.liqo.io/component`) and value (`gateway`).
pub const COMPONENT: (&str, &str) = ("networking.liqo.io/component", "gateway");
/// Liqo's active-replica label (`networking.liqo.io/active=true`).
pub const ACTIVE: (&str, &str) = ("networking.liqo.io/active", "true");
/// The pod selector that finds active Liqo gateways.
pub const GATEWAY_SELECTOR: &str =
    "networking.liqo.io/component=gateway,networking.liqo.io/active=true";
/// The gateway containers' flag naming the peer (Liqo's `pkg/gateway/flags.go`).
pub const REMOTE_CLUSTER_ID_FLAG: &str = "--remote-cluster-id";

/// A gateway pod peerwall enforces in.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct GatewayPod {
    /// Pod UID (finds its network namespace; a recreated pod is a new gateway).
    pub uid: String,
    /// `namespace/name`.
    pub name: String,
    /// The peer cluster id it tunnels to.
    pub peer: String,
}

impl GatewayPod {
    /// A short, stable, bpffs-safe directory name for this gateway's pins: the peer and the
    /// first 8 characters of the pod UID (bpffs refuses names with a dot).
    pub fn pin_name(&self) -> String {
        let uid: String = self.uid.chars().filter(|c| *c != '-').take(8).collect();
        let peer: String = self
            .peer
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        format!("{peer}_{uid}")
    }
}

/// Why a pod that looks like a gateway is not enforced in (logged once per pod).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Skip {
    /// Not (or no longer) the active replica.
    #[error("not the active replica (no {}={})", ACTIVE.0, ACTIVE.1)]
    Inactive,
    /// None of its containers names the peer.
    #[error("no container has {REMOTE_CLUSTER_ID_FLAG}=<peer> (is it a Liqo gateway?)")]
    NoPeer,
    /// Being deleted, or finished.
    #[error("terminating")]
    Terminating,
    /// Its network namespace does not exist yet.
    #[error("not started yet")]
    NotStarted,
}

/// The value of `flag` in `args` (`--flag=v` or `--flag v`), last one winning as with Go's
/// flag packages.
pub fn flag_value(args: &[String], flag: &str) -> Option<String> {
    let mut found = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if let Some(v) = a.strip_prefix(flag) {
            if let Some(v) = v.strip_prefix('=') {
                found = Some(v.to_string());
            } else if v.is_empty() {
                found = it.next().cloned();
            }
        }
    }
    found.filter(|v| !v.is_empty())
}

/// Whether `pod` is an active Liqo gateway to enforce in, and for which peer.
pub fn gateway_of(pod: &Pod) -> Result<GatewayPod, Skip> {
    let labels = pod.metadata.labels.clone().unwrap_or_default();
    if labels.get(ACTIVE.0).map(String::as_str) != Some(ACTIVE.1) {
        return Err(Skip::Inactive);
    }
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    if pod.metadata.deletion_timestamp.is_some() || matches!(phase, Some("Succeeded" | "Failed")) {
        return Err(Skip::Terminating);
    }
    let spec = pod.spec.as_ref().ok_or(Skip::NoPeer)?;
    let peer = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .find_map(|c| {
            let mut args = c.command.clone().unwrap_or_default();
            args.extend(c.args.clone().unwrap_or_default());
            flag_value(&args, REMOTE_CLUSTER_ID_FLAG)
        })
        .ok_or(Skip::NoPeer)?;
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    if uid.is_empty() {
        return Err(Skip::NotStarted);
    }
    Ok(GatewayPod {
        uid,
        name: format!(
            "{}/{}",
            pod.metadata.namespace.as_deref().unwrap_or_default(),
            pod.metadata.name.as_deref().unwrap_or_default()
        ),
        peer,
    })
}

/// Label selectors of the Liqo FirewallConfigurations whose NAT Liqo's firewall controller
/// keeps in force in the gateway of `peer`, which a datapath classifying at ingress must see
/// through: the per-peer remapping of overlapping CIDRs (`ForgeFirewallTargetLabels`) and the
/// gateways' IP mapping (`ForgeFirewallTargetLabelsIPMappingGw`), both in Liqo's
/// `pkg/liqo-controller-manager/networking/external-network/remapping/label.go`; the keys are
/// `pkg/firewall/label.go`'s.
pub fn observed_selectors(peer: &str) -> Vec<String> {
    vec![
        format!("networking.liqo.io/firewall-category=gateway,networking.liqo.io/firewall-unique={peer}"),
        "networking.liqo.io/firewall-category=gateway,networking.liqo.io/firewall-subcategory=ip-mapping".into(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(labels: serde_json::Value, args: &[&str], deleting: bool) -> Pod {
        let mut p = json!({
            "metadata": {"name": "gw", "namespace": "liqo-tenant-x", "uid": "0a1b2c3d-4e5f", "labels": labels},
            "spec": {"containers": [
                {"name": "gateway", "image": "liqo/gateway", "args": args},
                {"name": "wireguard", "image": "liqo/gateway-wireguard"}
            ]},
            "status": {"phase": "Running"}
        });
        if deleting {
            p["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        }
        serde_json::from_value(p).unwrap()
    }

    fn active() -> serde_json::Value {
        json!({COMPONENT.0: COMPONENT.1, ACTIVE.0: ACTIVE.1})
    }

    #[test]
    fn liqo_template_args_name_the_peer() {
        let p = pod(
            active(),
            &[
                "--name=gw",
                "--remote-cluster-id=cluster-b",
                "--mode=server",
            ],
            false,
        );
        let g = gateway_of(&p).unwrap();
        assert_eq!(g.peer, "cluster-b");
        assert_eq!(g.name, "liqo-tenant-x/gw");
        assert_eq!(g.pin_name(), "cluster-b_0a1b2c3d");
    }

    #[test]
    fn space_separated_flag_and_last_wins() {
        let args: Vec<String> = ["--remote-cluster-id", "a", "--remote-cluster-id=b"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(
            flag_value(&args, REMOTE_CLUSTER_ID_FLAG).as_deref(),
            Some("b")
        );
        // A longer flag with the same prefix is another flag.
        let other = vec!["--remote-cluster-id-file=x".to_string()];
        assert_eq!(flag_value(&other, REMOTE_CLUSTER_ID_FLAG), None);
    }

    #[test]
    fn inactive_terminating_and_unnamed_peers_are_skipped() {
        let inactive = pod(
            json!({COMPONENT.0: COMPONENT.1}),
            &["--remote-cluster-id=b"],
            false,
        );
        assert_eq!(gateway_of(&inactive), Err(Skip::Inactive));
        let deleting = pod(active(), &["--remote-cluster-id=b"], true);
        assert_eq!(gateway_of(&deleting), Err(Skip::Terminating));
        let no_peer = pod(active(), &["--mode=server"], false);
        assert_eq!(gateway_of(&no_peer), Err(Skip::NoPeer));
    }

    #[test]
    fn pin_names_are_bpffs_safe() {
        let g = GatewayPod {
            uid: "ffff-0000-1111".into(),
            name: "a/b".into(),
            peer: "we/ird id".into(),
        };
        assert_eq!(g.pin_name(), "we_ird_id_ffff0000");
    }
}
