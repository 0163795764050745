//! `peerwall status`, first part: whether each component of an install works, as `cilium
//! status` says it: the agents (the DaemonSet, or the sidecars in Liqo's gateway pods), the
//! controller, the webhook (serving, with the CA the API server needs in its configuration),
//! and the CRDs at the versions this binary speaks. Pure: [`check`] takes what the API server
//! holds as plain data ([`Install`]); `fetch.rs` reads it.

use std::collections::BTreeMap;

use serde::Serialize;

/// The namespace `deploy/` installs into.
pub const INSTALL_NAMESPACE: &str = "peerwall-system";
/// The agent DaemonSet of `deploy/`.
pub const AGENT_DAEMONSET: &str = "peerwall-agent";
/// The controller Deployment of `deploy/common/`.
pub const CONTROLLER: &str = "peerwall-controller";
/// The webhook Deployment (and Service) of `deploy/common/`.
pub const WEBHOOK: &str = "peerwall-webhook";
/// The ValidatingWebhookConfiguration of `deploy/common/webhook.yaml`.
pub const WEBHOOK_CONFIGURATION: &str = "peerwall";
/// The container `peerwall sidecar-patch` adds to a Liqo gateway template.
pub const SIDECAR_CONTAINER: &str = "peerwall";

/// The CRDs peerwall needs: name, kind, the version this binary reads and writes, and whether
/// their absence breaks protection (`true`) or only a feature.
pub const CRDS: [(&str, &str, &str, bool); 5] = [
    (
        "firewallconfigurations.peerwall.io",
        "FirewallConfiguration",
        "v1alpha1",
        true,
    ),
    ("addresssets.peerwall.io", "AddressSet", "v1alpha1", true),
    (
        "protectionpolicies.peerwall.io",
        "ProtectionPolicy",
        "v1alpha1",
        true,
    ),
    (
        "clusternetworkpolicies.policy.networking.k8s.io",
        "ClusterNetworkPolicy",
        "v1alpha2",
        false,
    ),
    (
        "configurations.networking.liqo.io",
        "Configuration (Liqo)",
        "v1beta1",
        false,
    ),
];

/// A Deployment or DaemonSet as its status says, with its pods' images.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Workload {
    /// Pods it should have: a Deployment's `spec.replicas`, a DaemonSet's
    /// `status.desiredNumberScheduled`.
    pub desired: i32,
    /// Pods ready.
    pub ready: i32,
    /// Pods running the current template.
    pub updated: i32,
    /// Image → pods running it (their peerwall container's).
    pub images: BTreeMap<String, u32>,
    /// Pods not ready, as `pod (node)`, at most a few.
    pub not_ready: Vec<String>,
}

/// What the API server answered about one object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found<T> {
    /// It exists.
    Yes(T),
    /// It does not (404).
    No,
    /// It could not be read (403, ...): the message.
    Unknown(String),
}

/// A CRD as the API server serves it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Crd {
    /// `Established` is true.
    pub established: bool,
    /// Versions served.
    pub served: Vec<String>,
}

/// The webhook's registration.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WebhookConfig {
    /// Its webhooks by name, each with whether its `clientConfig.caBundle` is set.
    pub ca_bundles: Vec<(String, bool)>,
}

/// Everything [`check`] reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Install {
    /// The agent DaemonSet.
    pub agents: Found<Workload>,
    /// Sidecar agents: pods of Liqo's tenant namespaces with a [`SIDECAR_CONTAINER`].
    pub sidecars: Workload,
    /// The controller Deployment.
    pub controller: Found<Workload>,
    /// The webhook Deployment.
    pub webhook: Found<Workload>,
    /// The webhook's registration.
    pub webhook_config: Found<WebhookConfig>,
    /// Each of [`CRDS`], in order.
    pub crds: Vec<Found<Crd>>,
}

/// How a component is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Health {
    /// Works.
    Ok,
    /// Works, with something to know (a feature off, a rollout under way, not readable).
    Warning,
    /// Does not work: protection is missing or cannot change.
    Error,
}

/// One line of the components' part.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Component {
    /// `agents`, `controller`, `webhook`, `crd <name>`.
    pub name: String,
    /// How it is.
    pub health: Health,
    /// What was found, in a few words (`2/2 ready, peerwall:0.1.0 ×2`).
    pub summary: String,
    /// What it means and what to do, when not [`Health::Ok`].
    pub hint: Option<String>,
}

fn images(w: &Workload) -> String {
    w.images
        .iter()
        .map(|(i, n)| format!("{i} ×{n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn counts(w: &Workload) -> String {
    let mut s = format!("{}/{} ready", w.ready, w.desired);
    if w.updated < w.desired {
        s.push_str(&format!(", {}/{} updated", w.updated, w.desired));
    }
    let i = images(w);
    if !i.is_empty() {
        s.push_str(&format!(", {i}"));
    }
    s
}

fn not_ready(w: &Workload) -> String {
    if w.not_ready.is_empty() {
        String::new()
    } else {
        format!(" Not ready: {}.", w.not_ready.join(", "))
    }
}

fn agents(install: &Install, reporting: &[String]) -> Component {
    let name = "agents".to_string();
    let side = &install.sidecars;
    let unknown = |why: &str| Component {
        name: name.clone(),
        health: Health::Warning,
        summary: "unknown".into(),
        hint: Some(format!(
            "the DaemonSet {INSTALL_NAMESPACE}/{AGENT_DAEMONSET} could not be read: {why}"
        )),
    };
    match &install.agents {
        Found::Unknown(why) => unknown(why),
        Found::No if side.desired == 0 && !reporting.is_empty() => Component {
            name,
            health: Health::Warning,
            summary: format!("not run by Kubernetes: {} report", reporting.join(", ")),
            hint: Some(format!(
                "no DaemonSet {INSTALL_NAMESPACE}/{AGENT_DAEMONSET} and no sidecars: the hosts named report their configurations from outside the cluster, and nothing restarts them (deploy/ runs them as a DaemonSet)"
            )),
        },
        Found::No if side.desired == 0 => Component {
            name,
            health: Health::Error,
            summary: "none".into(),
            hint: Some(format!(
                "no DaemonSet {INSTALL_NAMESPACE}/{AGENT_DAEMONSET} and no `{SIDECAR_CONTAINER}` container in a Liqo gateway pod: nothing enforces any configuration (`kubectl apply -k deploy/`, or the sidecar patch)"
            )),
        },
        Found::No => Component {
            name: "agents (sidecars)".into(),
            health: if side.ready == side.desired {
                Health::Ok
            } else {
                Health::Error
            },
            summary: format!(
                "{}/{} gateway pods with a ready peerwall container{}",
                side.ready,
                side.desired,
                if images(side).is_empty() {
                    String::new()
                } else {
                    format!(", {}", images(side))
                }
            ),
            hint: (side.ready < side.desired).then(|| {
                format!(
                    "a gateway pod whose peerwall container is not ready enforces nothing new.{}",
                    not_ready(side)
                )
            }),
        },
        Found::Yes(w) if w.desired == 0 => Component {
            name,
            health: Health::Error,
            summary: "0/0: no agent pods".into(),
            hint: Some(format!(
                "the DaemonSet {INSTALL_NAMESPACE}/{AGENT_DAEMONSET} schedules no pod: no node matches its nodeSelector and tolerations (deploy/gateway-nodes selects the nodes that run Liqo's gateways), or no node is ready"
            )),
        },
        Found::Yes(w) => Component {
            name,
            health: if w.ready < w.desired {
                Health::Error
            } else if w.updated < w.desired || w.images.len() > 1 {
                Health::Warning
            } else {
                Health::Ok
            },
            summary: counts(w),
            hint: if w.ready < w.desired {
                Some(format!(
                    "gateways on a node whose agent is not ready keep their last policy and take no change.{} `kubectl -n {INSTALL_NAMESPACE} describe ds {AGENT_DAEMONSET}`",
                    not_ready(w)
                ))
            } else if w.updated < w.desired || w.images.len() > 1 {
                Some("a rollout is under way: agents run different versions".into())
            } else {
                None
            },
        },
    }
}

fn deployment(name: &str, what: &str, found: &Found<Workload>) -> Component {
    match found {
        Found::Unknown(why) => Component {
            name: name.into(),
            health: Health::Warning,
            summary: "unknown".into(),
            hint: Some(format!(
                "the Deployment {INSTALL_NAMESPACE}/{name} could not be read: {why}"
            )),
        },
        Found::No => Component {
            name: name.into(),
            health: Health::Error,
            summary: "not installed".into(),
            hint: Some(format!(
                "no Deployment {INSTALL_NAMESPACE}/{name}: {what} (`kubectl apply -k deploy/`)"
            )),
        },
        Found::Yes(w) if w.ready == 0 => Component {
            name: name.into(),
            health: Health::Error,
            summary: counts(w),
            hint: Some(format!(
                "no ready pod: {what}.{} `kubectl -n {INSTALL_NAMESPACE} describe deploy {name}`",
                not_ready(w)
            )),
        },
        Found::Yes(w) => Component {
            name: name.into(),
            health: if w.ready < w.desired || w.updated < w.desired {
                Health::Warning
            } else {
                Health::Ok
            },
            summary: counts(w),
            hint: (w.ready < w.desired || w.updated < w.desired)
                .then(|| format!("not every replica is ready and current.{}", not_ready(w))),
        },
    }
}

fn webhook_config(found: &Found<WebhookConfig>) -> Component {
    let name = "webhook registration".to_string();
    match found {
        Found::Unknown(why) => Component {
            name,
            health: Health::Warning,
            summary: "unknown".into(),
            hint: Some(format!(
                "the ValidatingWebhookConfiguration {WEBHOOK_CONFIGURATION} could not be read: {why}"
            )),
        },
        Found::No => Component {
            name,
            health: Health::Warning,
            summary: "not registered".into(),
            hint: Some(format!(
                "no ValidatingWebhookConfiguration {WEBHOOK_CONFIGURATION}: invalid configurations are admitted and only refused by the agents (an `Error` condition, the last good policy stays)"
            )),
        },
        Found::Yes(c) => {
            let missing: Vec<&str> = c
                .ca_bundles
                .iter()
                .filter(|(_, ca)| !ca)
                .map(|(n, _)| n.as_str())
                .collect();
            if missing.is_empty() {
                Component {
                    name,
                    health: Health::Ok,
                    summary: format!("{} webhooks, caBundle set", c.ca_bundles.len()),
                    hint: None,
                }
            } else {
                Component {
                    name,
                    health: Health::Error,
                    summary: format!("no caBundle in {}", missing.join(", ")),
                    hint: Some(
                        "the webhook has not written its CA yet (it does when it starts): the API server cannot call it, and with failurePolicy Fail it refuses every FirewallConfiguration write".into(),
                    ),
                }
            }
        }
    }
}

fn crd(i: usize, found: &Found<Crd>) -> Component {
    let (full, kind, version, required) = CRDS[i];
    let name = format!("crd {kind}");
    let missing = |summary: String, hint: String| Component {
        name: name.clone(),
        health: if required {
            Health::Error
        } else {
            Health::Warning
        },
        summary,
        hint: Some(hint),
    };
    let feature = if full.ends_with("liqo.io") {
        "Liqo is not installed (or not this version): no peer's sources are known, every gateway configuration closes its tunnel"
    } else if full.starts_with("clusternetworkpolicies") {
        "the controller installs it when it starts; until then ClusterNetworkPolicies are not enforced"
    } else {
        "peerwall cannot store or read its configurations (`kubectl apply -k deploy/`)"
    };
    match found {
        Found::Unknown(why) => Component {
            name,
            health: Health::Warning,
            summary: "unknown".into(),
            hint: Some(format!("could not be read: {why}")),
        },
        Found::No => missing("not installed".into(), feature.into()),
        Found::Yes(c) if !c.served.iter().any(|v| v == version) => missing(
            format!("serves {}, not {version}", c.served.join(", ")),
            format!("this peerwall reads and writes {version}: {feature}"),
        ),
        Found::Yes(c) if !c.established => missing(
            "not established".into(),
            "the API server has not accepted its names yet".into(),
        ),
        Found::Yes(_) => Component {
            name,
            health: Health::Ok,
            summary: format!("{full} {version} served"),
            hint: None,
        },
    }
}

/// The components' health, in the order `peerwall status` prints them. `reporting`: the hosts
/// that report conditions on gateway configurations (agents, wherever they run).
pub fn check(install: &Install, reporting: &[String]) -> Vec<Component> {
    let mut out = vec![
        agents(install, reporting),
        deployment(
            CONTROLLER,
            "no gateway configuration is written or updated (new peers, offloaded pods, NetworkPolicy changes wait)",
            &install.controller,
        ),
        deployment(
            WEBHOOK,
            "the API server cannot call the webhook, and with failurePolicy Fail it refuses every FirewallConfiguration write",
            &install.webhook,
        ),
        webhook_config(&install.webhook_config),
    ];
    out.extend(install.crds.iter().enumerate().map(|(i, c)| crd(i, c)));
    out
}

/// The components' part of `peerwall status`: one line each, hints below, never cut.
pub fn render(components: &[Component]) -> String {
    let width = components
        .iter()
        .map(|c| c.name.chars().count())
        .max()
        .unwrap_or(0);
    let mut out = String::new();
    for c in components {
        let mark = match c.health {
            Health::Ok => "ok     ",
            Health::Warning => "warning",
            Health::Error => "ERROR  ",
        };
        out.push_str(&format!(
            "{:<width$}  {mark}  {}\n",
            c.name,
            c.summary,
            width = width
        ));
        if let Some(h) = &c.hint {
            out.push_str(&format!("{:<width$}           {h}\n", "", width = width));
        }
    }
    out
}

#[cfg(test)]
mod tests;
