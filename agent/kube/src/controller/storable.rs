//! The controller's FirewallConfigurations written so that etcd can store them: a spec whose
//! JSON would outgrow the budget has its largest address sets moved into AddressSet slices
//! ([`protection::spill`]), written before the configuration that counts them
//! (`addressSets`); emptied slices are deleted after it, and the slices of a set back inline
//! once every host applied it. An agent that sees the configuration before its slices keeps
//! the previous generation in force.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams, DynamicObject};
use kube::ResourceExt;
use peerwall_intent::types::{AddressSet, FirewallConfiguration, FirewallConfigurationSpec};

use super::context::Ctx;
use super::enforcement::applied_everywhere;
use super::publish::{api_error, apply, owned_by_namespace, publish, typed, ReconcileError, Seen};
use crate::protection;
use crate::protection::spill::{self, CONFIGURATION_LABEL};

/// The slices of `config`'s moved sets in namespace `ns` as the cache shows them, by set.
fn current_slices(
    ctx: &Ctx,
    ns: &str,
    config: &str,
) -> BTreeMap<String, Vec<protection::Slice<String>>> {
    let mut out: BTreeMap<String, Vec<protection::Slice<String>>> = BTreeMap::new();
    for o in ctx.slices.state() {
        if o.namespace().as_deref() != Some(ns)
            || o.labels().get(CONFIGURATION_LABEL).map(String::as_str) != Some(config)
        {
            continue;
        }
        let s = slice_of(&o);
        out.entry(s.set.clone()).or_default().push(s);
    }
    out
}

/// A moved set's slice as the layout sees it.
fn slice_of(o: &DynamicObject) -> protection::Slice<String> {
    let text = |p: &str| {
        o.data
            .pointer(p)
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_string()
    };
    protection::Slice {
        name: o.name_any(),
        set: text("/spec/set"),
        addresses: o
            .data
            .pointer("/spec/addresses")
            .and_then(|v| v.as_array())
            .into_iter()
            .flatten()
            .filter_map(|a| a.as_str().map(str::to_string))
            .collect(),
    }
}

/// Keep `config` (in the tenant namespace `ns`, with `labels`) at `spec`, storable: its
/// largest sets in slices while it would outgrow the budget. Returns whether the
/// configuration itself was written.
pub(super) async fn publish_configuration(
    ctx: &Ctx,
    ns: &Namespace,
    config: &str,
    mut spec: FirewallConfigurationSpec,
    labels: &BTreeMap<String, String>,
) -> Result<bool, ReconcileError> {
    let ns_name = ns.name_any();
    let mut current = current_slices(ctx, &ns_name, config);
    let in_slices: BTreeSet<String> = current.keys().cloned().collect();
    let moved = spill::spill(&mut spec, ctx.opts.inline_budget, &in_slices);
    // Every name in use: a new slice of one set never takes another's.
    let mut taken: BTreeSet<String> = current.values().flatten().map(|s| s.name.clone()).collect();
    let slices: Api<AddressSet> = Api::namespaced(ctx.client.clone(), &ns_name);
    let mut counts = Vec::new();
    // Slices emptied: their addresses leave the set, which is what their deletion does.
    let mut delete = Vec::new();
    for m in &moved {
        let laid = spill::lay_out(
            config,
            m,
            &current.remove(&m.set).unwrap_or_default(),
            &taken,
        );
        taken.extend(laid.write.iter().map(|s| s.name.clone()));
        for s in &laid.write {
            let object: AddressSet = typed(
                spill::slice_object(&ns_name, config, labels, s),
                Some(owned_by_namespace(ns)),
            )?;
            apply(&slices, &object).await?;
            ctx.count(|m| m.slice_writes += 1);
        }
        delete.extend(laid.delete);
        counts.push((m.set.clone(), laid.count));
    }
    // Sets back inline (or gone): their slices hold addresses the configuration in force on
    // a host may still take from them (a host waiting for another set's slices keeps the
    // previous generation), so they go only once every host applied the configuration that
    // no longer takes them.
    let unneeded: Vec<String> = current.into_values().flatten().map(|s| s.name).collect();
    spill::declare(&mut spec, &counts);
    let body = peerwall_intent::object::object(
        peerwall_intent::load::KIND,
        &ns_name,
        config,
        labels,
        spec,
    );
    let bytes = serde_json::to_vec(&body).map_or(0, |v| v.len());
    if bytes > peerwall_intent::size::ETCD_REQUEST_MAX {
        ctx.count(|m| m.too_large += 1);
        return Err(ReconcileError::TooLarge {
            object: format!("{ns_name}/{config}"),
            bytes,
        });
    }
    let stored = ctx
        .configs
        .state()
        .into_iter()
        .find(|c| c.name_any() == config && c.namespace().as_deref() == Some(&ns_name));
    let seen = stored.as_deref().map(Seen::of_dynamic);
    let api: Api<FirewallConfiguration> = Api::namespaced(ctx.client.clone(), &ns_name);
    let wrote = publish(&api, seen.as_ref(), body, Some(owned_by_namespace(ns))).await?;
    // Not written: the cache shows what was built; applied by every host, the slices it no
    // longer takes can go (a host's condition wakes this pass again).
    if !wrote && stored.as_deref().is_some_and(applied_everywhere) {
        delete.extend(unneeded);
    }
    for name in delete {
        match slices.delete(&name, &DeleteParams::default()).await {
            Ok(_) => ctx.count(|m| m.slice_deletes += 1),
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(source) => return Err(api_error("deleting", &ns_name, &name)(source)),
        }
    }
    if !moved.is_empty() && wrote {
        tracing::info!(
            configuration = %format!("{ns_name}/{config}"),
            sets = moved.len(),
            "sets too large to keep inline published as AddressSets"
        );
    }
    Ok(wrote)
}
