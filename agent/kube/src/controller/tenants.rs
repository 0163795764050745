//! Each peer's gateway FirewallConfiguration and its AddressSet slices: the tenant namespaces'
//! reconcile, the publisher synced with what the API shows, only the slices that changed written.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams, DynamicObject};
use kube::runtime::controller::Action;
use kube::ResourceExt;
use peerwall_intent::types::AddressSet;

use super::context::{exceptions_for, labels_of, per_peer, remaps, Ctx};
use super::enforcement::applied_everywhere;
use super::offloaded::refresh_offloaded;
use super::policies::{publish_companions, publish_tier, shared_view};
use super::publish::{api_error, apply, typed, ReconcileError};
use super::storable::publish_configuration;
use super::GATEWAY_CONFIG;
use crate::protection;
use crate::protection::publish::Publisher;
use crate::PEER;

/// The namespaces, virtual nodes and remaps the sets depend on (few objects: read whole at
/// every pass; the index re-derives only when they changed).
pub(super) fn sync_context(pb: &mut Publisher, ctx: &Ctx) {
    let namespaces = ctx
        .namespaces
        .state()
        .iter()
        .map(|n| protection::Namespace {
            name: n.name_any(),
            labels: labels_of(n.labels()),
        })
        .collect();
    let nodes = ctx
        .nodes
        .state()
        .iter()
        .map(|n| protection::Node {
            name: n.name_any(),
            labels: labels_of(n.labels()),
        })
        .collect();
    pb.desired.set_context(namespaces, nodes, remaps(ctx));
}

/// What the API shows of every peer's slices and gateway configuration. A slice's addresses
/// are read only when its version is new to the publisher.
pub(super) fn sync_published(pb: &mut Publisher, ctx: &Ctx) {
    let mut by_peer: BTreeMap<String, Vec<Arc<DynamicObject>>> = pb
        .published_peers()
        .into_iter()
        .map(|p| (p, vec![]))
        .collect();
    for obj in ctx.slices.state() {
        // Slices of sets moved out of a configuration are kept by `storable`.
        if obj
            .labels()
            .contains_key(protection::spill::CONFIGURATION_LABEL)
        {
            continue;
        }
        if let Some(peer) = obj.labels().get(PEER) {
            by_peer.entry(peer.clone()).or_default().push(obj);
        }
    }
    for (peer, objs) in by_peer {
        let slices = pb.slices_mut(&peer);
        slices.begin_sync();
        for o in objs {
            let version = o.resource_version().unwrap_or_default();
            let generation = o.metadata.generation;
            slices.observe(
                &o.name_any(),
                &version,
                generation,
                applied_everywhere(&o),
                || slice_of(&o),
            );
        }
        slices.end_sync();
    }
    pb.observe_configs(published_configs(ctx));
}

/// A published slice as the layout sees it.
pub(super) fn slice_of(obj: &DynamicObject) -> protection::Slice {
    protection::Slice {
        name: obj.name_any(),
        set: obj
            .data
            .pointer("/spec/set")
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_string(),
        addresses: obj
            .data
            .pointer("/spec/addresses")
            .and_then(|v| v.as_array())
            .into_iter()
            .flatten()
            .filter_map(|a| a.as_str().and_then(|a| a.parse().ok()))
            .collect(),
    }
}

/// Each peer's gateway configuration as the API shows it: applied everywhere or not, and the
/// offloaded addresses listed inline (older controllers published them there).
pub(super) fn published_configs(ctx: &Ctx) -> BTreeMap<String, (bool, BTreeSet<IpAddr>)> {
    let mut out = BTreeMap::new();
    for c in ctx.configs.state() {
        if c.name_any() != GATEWAY_CONFIG {
            continue;
        }
        let Some(peer) = c.labels().get(PEER) else {
            continue;
        };
        let offloaded: BTreeSet<IpAddr> = c
            .data
            .pointer("/spec/table/sets")
            .and_then(|v| v.as_array())
            .into_iter()
            .flatten()
            .filter(|s| {
                s.get("name")
                    .and_then(|n| n.as_str())
                    .and_then(crate::protection::index::Kind::of_set)
                    .is_some_and(|(kind, _)| kind == crate::protection::index::Kind::Offloaded)
            })
            .flat_map(|s| {
                s.get("elements")
                    .and_then(|e| e.as_array())
                    .cloned()
                    .unwrap_or_default()
            })
            .filter_map(|e| {
                e.get("key")
                    .and_then(|k| k.as_str())
                    .and_then(|k| k.parse().ok())
            })
            .collect();
        out.insert(peer.clone(), (applied_everywhere(&c), offloaded));
    }
    out
}

/// The peer a tenant namespace stands for, unless it is being deleted.
fn tenant_peer(ns: &Namespace, ctx: &Ctx) -> Option<protection::Peer> {
    let peer = ns.labels().get(crate::REMOTE_CLUSTER_ID)?.clone();
    if ns.metadata.deletion_timestamp.is_some() {
        return None;
    }
    Some(protection::Peer {
        tenant_namespace: ns.name_any(),
        sources: per_peer(ctx, protection::configuration_sources)
            .remove(&peer)
            .unwrap_or_default(),
        id: peer,
    })
}

/// Requeued while an address waits for another tenant to release it.
fn after_slices(held: usize) -> Action {
    if held > 0 {
        Action::requeue(Duration::from_millis(500))
    } else {
        Action::await_change()
    }
}

/// The fast loop's pass (`slices_loop.rs`): only the slices of `ns`'s peer (the addresses
/// pods bring and take away). Returns how many addresses the reuse gate holds back (0 for a
/// namespace of no peer).
pub(super) async fn slices_pass(ns: &Namespace, ctx: &Ctx) -> Result<usize, ReconcileError> {
    let Some(who) = tenant_peer(ns, ctx) else {
        return Ok(0);
    };
    tracing::trace!(peer = %who.id, "slices pass");
    publish_slices(&who, ctx).await
}

/// The whole peer: its slices first (nothing to write when the fast loop already did), then
/// what is read from the whole cluster: the NetworkPolicy tier, the gateway configuration,
/// the offloaded namespaces' policies, the companions.
pub(super) async fn reconcile_gateway(
    ns: Arc<Namespace>,
    ctx: Arc<Ctx>,
) -> Result<Action, ReconcileError> {
    let Some(who) = tenant_peer(&ns, &ctx) else {
        return Ok(Action::await_change());
    };
    let peer = who.id.clone();
    let started = std::time::Instant::now();
    let mut at = started;
    // How long each step of the pass took (debug log): where a change waits.
    let mut lap = || {
        let now = std::time::Instant::now();
        let ms = now.duration_since(at).as_secs_f64() * 1e3;
        at = now;
        ms
    };
    // Addresses first, as slices: the configuration that takes them comes after, so a set
    // never misses addresses it had.
    let held = publish_slices(&who, &ctx).await?;
    let slices_ms = lap();
    // One view of pods and NetworkPolicies serves the declared sets, the tier and the
    // companions.
    // CPU over every pod (~0.1 s at 100k): off the runtime's workers' async duty meanwhile.
    let (view, declared) = tokio::task::block_in_place(|| {
        let view = shared_view(&ctx);
        let declared = protection::Declared {
            namespaces: ctx
                .pods
                .namespace_sets(&peer, |ns| protection::namespaces::is_tenant(&view.0, ns)),
            exceptions: exceptions_for(&ctx, &peer, &view.0),
        };
        (view, declared)
    });
    let view_ms = lap();
    // The tier first: a NetworkPolicy or a pod's labels changing is what this pass most often
    // serves, and the tier is what they change; the two configurations are apart (each a
    // table of its own), so neither waits for the other to be in force.
    publish_tier(&ns, &who, &ctx, &view, declared.exceptions.settings.audit).await?;
    let tier_ms = lap();
    // The pod sets' addresses live in the publisher's slices; the configuration declares the
    // sets, and what is declared (per namespace, ProtectionPolicies) moves into slices of
    // its own when the object would outgrow etcd.
    let spec = protection::gateway_spec_with(
        &peer,
        &who.sources,
        &Default::default(),
        &ctx.opts,
        &declared,
    );
    let labels = peerwall_intent::labels::for_gateway(&peer);
    if publish_configuration(&ctx, &ns, GATEWAY_CONFIG, Arc::new(spec), &labels).await? {
        ctx.count(|m| m.gateway_writes += 1);
        tracing::info!(peer = %peer, "gateway configuration updated");
    }
    let gateway_ms = lap();
    refresh_offloaded(&peer, &ctx, &declared.exceptions).await?;
    let offloaded_ms = lap();
    publish_companions(&ctx, &view).await?;
    let companions_ms = lap();
    tracing::debug!(
        peer = %peer,
        ms = started.elapsed().as_secs_f64() * 1e3,
        slices_ms,
        view_ms,
        tier_ms,
        gateway_ms,
        offloaded_ms,
        companions_ms,
        "gateway pass"
    );
    Ok(after_slices(held))
}

/// Write the slices of `peer`'s sets that the changes since its last pass touch (O(changed
/// addresses): [`Publisher::plan`]), and delete slices that are empty and whose emptying
/// every host has applied. Returns how many offloaded addresses the reuse gate holds back.
pub(super) async fn publish_slices(
    peer: &protection::Peer,
    ctx: &Ctx,
) -> Result<usize, ReconcileError> {
    let ns_name = &peer.tenant_namespace;
    let api: Api<AddressSet> = Api::namespaced(ctx.client.clone(), ns_name);
    let plan = {
        let mut pb = ctx.publisher();
        sync_context(&mut pb, ctx);
        sync_published(&mut pb, ctx);
        let plan = pb.plan(&peer.id, &ctx.opts);
        let wanted: u64 = pb
            .desired
            .peers()
            .iter()
            .map(|p| pb.desired.len(p, protection::index::Kind::Offloaded) as u64)
            .sum();
        let held = pb.held_back() as u64;
        let peers = pb.desired.peers().len() as u64;
        ctx.count(|m| {
            m.peers = peers;
            m.offloaded_addresses = wanted.saturating_sub(held);
            m.held_back_addresses = held;
        });
        plan
    };
    if !plan.writes.is_empty() {
        tracing::trace!(peer = %peer.id, slices = plan.writes.len(), "address sets planned");
    }
    for slice in &plan.writes {
        // No owner reference: a slice lives in the tenant namespace it would name, whose
        // deletion deletes it anyway, and on this path (a pod's address on its way to the
        // gateways) the API server's handling of one costs 0.5–0.7 ms of a 4–6 ms apply
        // (docs/benchmarking.md). An older controller's reference goes with the next apply.
        let object: AddressSet = typed(protection::address_set_object(peer, slice), None)?;
        let sent = std::time::Instant::now();
        match apply(&api, &object).await {
            Ok(obj) => {
                tracing::trace!(
                    slice = %slice.name,
                    addresses = slice.addresses.len(),
                    ms = sent.elapsed().as_secs_f64() * 1e3,
                    "address set applied"
                );
                let version = obj.resource_version().unwrap_or_default();
                ctx.publisher()
                    .slices_mut(&peer.id)
                    .written(&slice.name, version);
                ctx.count(|m| m.slice_writes += 1);
            }
            Err(e) => {
                // Whatever was not written is planned again from the API's view.
                let mut pb = ctx.publisher();
                let slices = pb.slices_mut(&peer.id);
                let failed = plan.writes.iter().skip_while(|s| s.name != slice.name);
                for s in failed {
                    slices.write_failed(&s.name);
                }
                return Err(e);
            }
        }
    }
    if !plan.writes.is_empty() {
        tracing::debug!(peer = %peer.id, slices = plan.writes.len(), held_back = plan.held, "address sets updated");
    }
    let set_names: Vec<String> = protection::set_contents(&Default::default(), &ctx.opts)
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    let deletable = ctx.publisher().slices_mut(&peer.id).deletable(&set_names);
    for name in deletable {
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => ctx.count(|m| m.slice_deletes += 1),
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(source) => return Err(api_error("deleting", ns_name, &name)(source)),
        }
        ctx.publisher().slices_mut(&peer.id).deleted(&name);
    }
    Ok(plan.held)
}

#[cfg(test)]
#[path = "tenants/tests.rs"]
mod tests;
