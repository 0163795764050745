//! The controller's edge for ProtectionPolicies (`peerwall.io/v1alpha1`, cluster-scoped): the
//! policies in force (the last good version of each: an edit that does not validate leaves
//! the previous one in force and says so in its status), and their `status` per peer.
//!
//! The decisions are pure ([`crate::protection::exceptions`]); this module only reads the
//! cache and writes status.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt};
use peerwall_intent::protection::{PeerStatus, ProtectionPolicyStatus};

use crate::netpol;
use crate::protection::exceptions::{self, Checked, Invalid};

const STATUS_MANAGER: &str = "peerwall-controller/protection-policies";

/// The ProtectionPolicy resource, read untyped: a policy whose spec does not decode (an
/// unknown field the CRD kept instead of pruning it) is one refused policy with its field
/// path, never a watch that cannot decode the list.
pub fn resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(
            peerwall_intent::load::GROUP,
            peerwall_intent::load::VERSION,
            peerwall_intent::load::PROTECTION_POLICY_KIND,
        ),
        "protectionpolicies",
    )
}

/// A stored ProtectionPolicy's spec, decoded ([`exceptions::decode`]) and checked.
pub fn check_object(obj: &DynamicObject) -> Result<Checked, Invalid> {
    let spec = obj
        .data
        .get("spec")
        .cloned()
        .unwrap_or(serde_json::Value::Object(Default::default()));
    exceptions::check(&obj.name_any(), &exceptions::decode(spec)?)
}

/// The status the controller last wrote on `obj`, if it reads.
fn status_in(obj: &DynamicObject) -> Option<ProtectionPolicyStatus> {
    serde_json::from_value(obj.data.get("status")?.clone()).ok()
}

/// The policies in force, from the cache.
pub struct InForce {
    store: Store<DynamicObject>,
    /// Per policy name: the generation and the checked form of its last version that validated.
    last_good: Mutex<BTreeMap<String, (i64, Checked)>>,
}

/// One policy as the controller reads it.
pub struct Read {
    /// The object.
    pub object: Arc<DynamicObject>,
    /// Its current generation's problem, if it does not validate.
    pub invalid: Option<Invalid>,
    /// What is in force of it: the current generation, or the last good one.
    pub in_force: Option<(i64, Checked)>,
}

impl InForce {
    /// Over `store`.
    pub fn new(store: Store<DynamicObject>) -> Self {
        Self {
            store,
            last_good: Mutex::new(BTreeMap::new()),
        }
    }

    /// Waits for the first list.
    pub async fn ready(&self) -> anyhow::Result<()> {
        self.store
            .wait_until_ready()
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))
    }

    /// Every policy: its problem and what of it is in force. A policy deleted is forgotten.
    pub fn read(&self) -> Vec<Read> {
        let mut last = self
            .last_good
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let objects = self.store.state();
        last.retain(|name, _| objects.iter().any(|o| &o.name_any() == name));
        objects
            .into_iter()
            .map(|object| {
                let name = object.name_any();
                let generation = object.metadata.generation.unwrap_or_default();
                match check_object(&object) {
                    Ok(c) => {
                        last.insert(name, (generation, c.clone()));
                        Read {
                            object,
                            invalid: None,
                            in_force: Some((generation, c)),
                        }
                    }
                    Err(e) => Read {
                        in_force: last.get(&name).cloned(),
                        object,
                        invalid: Some(e),
                    },
                }
            })
            .collect()
    }

    /// The checked policies in force.
    pub fn checked(&self) -> Vec<Checked> {
        self.read()
            .into_iter()
            .filter_map(|r| r.in_force.map(|(_, c)| c))
            .collect()
    }
}

/// The status of one policy, given every peer's resolution (`peers`: peer → reports by policy).
fn status_of(
    r: &Read,
    peers: &BTreeMap<String, BTreeMap<String, exceptions::PeerReport>>,
) -> ProtectionPolicyStatus {
    let name = r.object.name_any();
    let generation = r.object.metadata.generation.unwrap_or_default();
    let error = r.invalid.as_ref().map(|e| match &r.in_force {
        Some((g, _)) => {
            format!("generation {generation} refused: {e}; generation {g} stays in force")
        }
        None => format!("generation {generation} refused: {e}; nothing of it is in force"),
    });
    let mut out = ProtectionPolicyStatus {
        observed_generation: Some(generation),
        error,
        summary: None,
        peers: vec![],
        unknown_peers: vec![],
    };
    if let Some((_, c)) = &r.in_force {
        out.unknown_peers = c
            .peers
            .iter()
            .filter(|p| !peers.contains_key(*p))
            .cloned()
            .collect();
        for (peer, by_policy) in peers {
            if !c.applies_to(peer) {
                continue;
            }
            let rep = by_policy.get(&name).cloned().unwrap_or_default();
            out.peers.push(PeerStatus {
                peer: peer.clone(),
                gateway_rules: rep.gateway_rules,
                selected_addresses: rep.selected_addresses,
                network_policy_rules: rep.network_policy_rules,
            });
        }
    }
    let summary = match (&r.invalid, out.peers.len()) {
        (Some(_), _) if r.in_force.is_none() => "invalid".into(),
        (Some(_), n) => format!("{n} (previous generation; current invalid)"),
        (None, n) => n.to_string(),
    };
    out.summary = Some(if out.unknown_peers.is_empty() {
        summary
    } else {
        format!("{summary} (no such peer: {})", out.unknown_peers.join(", "))
    });
    out
}

/// A Warning Event `UnknownPeers` on a policy whose `spec.peers` names clusters that are not
/// peers (once per change of that list).
async fn warn_unknown_peers(client: &Client, obj: &DynamicObject, unknown: &[String]) {
    let recorder = crate::recorder::Recorder::new(
        client.clone(),
        kube::runtime::events::Reporter {
            controller: "peerwall-controller".into(),
            instance: None,
        },
    );
    let ev = kube::runtime::events::Event {
        type_: kube::runtime::events::EventType::Warning,
        reason: "UnknownPeers".into(),
        note: Some(
            format!(
                "spec.peers names {} that match no peer (no Liqo tenant namespace labelled liqo.io/remote-cluster-id with that id): it applies to no such cluster",
                unknown.iter().map(|p| format!("{p:?}")).collect::<Vec<_>>().join(", ")
            )
            .chars()
            .take(1000)
            .collect(),
        ),
        action: "Resolve".into(),
        secondary: None,
    };
    if let Err(e) = recorder
        .publish(&ev, &kube::Resource::object_ref(obj, &resource()))
        .await
    {
        tracing::warn!(policy = %obj.name_any(), error = %e, "could not publish the event");
    }
}

/// Every 2 s: each policy's status (what it became for each peer it applies to, or why it is
/// refused), written when it changed. `peers` lists the peers now; `cluster` the cluster.
pub async fn write_status<V>(
    client: Client,
    policies: Arc<InForce>,
    defaults: exceptions::Settings,
    view: impl Fn() -> (Vec<String>, V),
) where
    V: std::ops::Deref<Target = netpol::Cluster>,
{
    let api_client = client.clone();
    let api: Api<DynamicObject> = Api::all_with(client, &resource());
    let mut written: BTreeMap<String, ProtectionPolicyStatus> = BTreeMap::new();
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let reads = policies.read();
        if reads.is_empty() {
            written.clear();
            continue;
        }
        let checked: Vec<Checked> = reads
            .iter()
            .filter_map(|r| r.in_force.clone().map(|(_, c)| c))
            .collect();
        let (peer_ids, cluster) = view();
        let peers: BTreeMap<String, BTreeMap<String, exceptions::PeerReport>> = peer_ids
            .into_iter()
            .map(|p| {
                let f = exceptions::for_peer(&checked, &p, defaults, &cluster);
                (p, exceptions::reports(&f))
            })
            .collect();
        for r in &reads {
            let name = r.object.name_any();
            let status = status_of(r, &peers);
            if status_in(&r.object).as_ref() == Some(&status) && written.get(&name) == Some(&status)
            {
                continue;
            }
            if let Some(e) = &r.invalid {
                if written.get(&name).map(|s| &s.error) != Some(&status.error) {
                    tracing::warn!(policy = %name, error = %e, "ProtectionPolicy refused");
                }
            }
            if !status.unknown_peers.is_empty()
                && written.get(&name).map(|s| &s.unknown_peers) != Some(&status.unknown_peers)
            {
                tracing::warn!(policy = %name, unknown = ?status.unknown_peers, "ProtectionPolicy names peers that do not exist");
                warn_unknown_peers(&api_client, &r.object, &status.unknown_peers).await;
            }
            let body = serde_json::json!({
                "apiVersion": peerwall_intent::load::API_VERSION,
                "kind": peerwall_intent::load::PROTECTION_POLICY_KIND,
                "status": status,
            });
            match api
                .patch_status(
                    &name,
                    &PatchParams::apply(STATUS_MANAGER).force(),
                    &Patch::Apply(&body),
                )
                .await
            {
                Ok(_) => {
                    written.insert(name, status);
                }
                Err(e) => {
                    tracing::warn!(policy = %name, error = %e, "could not write the ProtectionPolicy's status")
                }
            }
        }
        written.retain(|n, _| reads.iter().any(|r| &r.object.name_any() == n));
    }
}
