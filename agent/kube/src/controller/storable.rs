//! The controller's FirewallConfigurations written so that etcd can store them: a spec whose
//! JSON would outgrow the budget has its largest address sets moved into AddressSet slices
//! ([`protection::spill`]), written before the configuration that counts them
//! (`addressSets`); emptied slices are deleted after it, and the slices of a set back inline
//! once every host applied it. An agent that sees the configuration before its slices keeps
//! the previous generation in force. A configuration is serialized once per pass: its JSON
//! gives its size and a digest ([`Written`]) that tells an unchanged pass from one to write.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams, DynamicObject};
use kube::ResourceExt;
use peerwall_intent::types::{AddressSet, FirewallConfiguration, FirewallConfigurationSpec};
use sha2::{Digest, Sha256};

use super::context::Ctx;
use super::enforcement::applied_everywhere;
use super::plans::{LaidOut, Plan, PlanKey};
use super::publish::{api_error, apply, owned_by_namespace, typed, ReconcileError, Seen};
use crate::protection;
use crate::protection::spill::{self, CONFIGURATION_LABEL};

/// A slice of a moved set as the cache shows it: its name, the version of its spec
/// (`uid/generation`, None when the object lacks either), the object (read into a
/// [`protection::Slice`] only where its set is laid out again).
struct Shown {
    name: String,
    version: Option<String>,
    object: std::sync::Arc<DynamicObject>,
}

/// The slices of `config`'s moved sets in namespace `ns` as the cache shows them, by set.
fn current_slices(ctx: &Ctx, ns: &str, config: &str) -> BTreeMap<String, Vec<Shown>> {
    let mut out: BTreeMap<String, Vec<Shown>> = BTreeMap::new();
    for o in ctx.slices.state() {
        if o.namespace().as_deref() != Some(ns)
            || o.labels().get(CONFIGURATION_LABEL).map(String::as_str) != Some(config)
        {
            continue;
        }
        let set = o
            .data
            .pointer("/spec/set")
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_string();
        out.entry(set).or_default().push(Shown {
            name: o.name_any(),
            version: version_of(&o.metadata),
            object: o,
        });
    }
    out
}

/// The layout of `moved` over its slices `shown`: the one `before` kept when it serves
/// ([`LaidOut::serves`]), else laid out ([`spill::lay_out`]). Returns it with what it was
/// found from, to keep for the next plan.
fn laid_out(
    config: &str,
    moved: spill::Moved,
    shown: &[Shown],
    taken: &BTreeSet<String>,
    before: Option<&LaidOut>,
) -> LaidOut {
    let versions: Option<Vec<(String, String)>> = shown
        .iter()
        .map(|s| Some((s.name.clone(), s.version.clone()?)))
        .collect();
    if let (Some(b), Some(v)) = (before, &versions) {
        if b.serves(&moved.elements, v) {
            // The elements move over (a copy of each set's addresses at every pass would be
            // what laying out cost).
            return LaidOut {
                elements: moved.elements,
                slices: v.clone(),
                result: b.result.clone(),
            };
        }
    }
    let slices: Vec<protection::Slice<String>> =
        shown.iter().map(|s| slice_of(&s.object)).collect();
    let result = spill::lay_out(config, &moved, &slices, taken);
    LaidOut {
        elements: moved.elements,
        // A slice without a version is never taken as unchanged.
        slices: versions.unwrap_or_else(|| vec![(String::new(), String::new())]),
        result,
    }
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
    spec: std::sync::Arc<FirewallConfigurationSpec>,
    labels: &BTreeMap<String, String>,
) -> Result<bool, ReconcileError> {
    let ns_name = ns.name_any();
    let started = std::time::Instant::now();
    let plan = planned(ctx, ns, config, spec, labels)?;
    let plan_ms = started.elapsed().as_secs_f64() * 1e3;
    let slices: Api<AddressSet> = Api::namespaced(ctx.client.clone(), &ns_name);
    for s in &plan.write {
        let object: AddressSet = typed(
            spill::slice_object(&ns_name, config, labels, s),
            Some(owned_by_namespace(ns)),
        )?;
        apply(&slices, &object).await?;
        ctx.count(|m| m.slice_writes += 1);
    }
    let mut delete = plan.delete.clone();
    if plan.bytes > peerwall_intent::size::ETCD_REQUEST_MAX {
        ctx.count(|m| m.too_large += 1);
        return Err(ReconcileError::TooLarge {
            object: format!("{ns_name}/{config}"),
            bytes: plan.bytes,
        });
    }
    let stored = ctx
        .configs
        .state()
        .into_iter()
        .find(|c| c.name_any() == config && c.namespace().as_deref() == Some(&ns_name));
    let key = (ns_name.clone(), config.to_string());
    let wrote = !already_there(ctx, &key, stored.as_deref(), &plan.object, plan.digest);
    if wrote {
        let api: Api<FirewallConfiguration> = Api::namespaced(ctx.client.clone(), &ns_name);
        let after = apply(&api, &plan.object).await?;
        ctx.written()
            .remember(key, version_of(&after.metadata), plan.digest);
    }
    // Not written: the cache shows what was built; applied by every host, the slices it no
    // longer takes can go (a host's condition wakes this pass again).
    if !wrote && stored.as_deref().is_some_and(applied_everywhere) {
        delete.extend(plan.unneeded.iter().cloned());
    }
    for name in delete {
        match slices.delete(&name, &DeleteParams::default()).await {
            Ok(_) => ctx.count(|m| m.slice_deletes += 1),
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(source) => return Err(api_error("deleting", &ns_name, &name)(source)),
        }
    }
    tracing::debug!(
        configuration = %format!("{ns_name}/{config}"),
        plan_ms,
        writes = plan.write.len(),
        wrote,
        ms = started.elapsed().as_secs_f64() * 1e3,
        "configuration published"
    );
    if plan.moved > 0 && wrote {
        tracing::info!(
            configuration = %format!("{ns_name}/{config}"),
            sets = plan.moved,
            "sets too large to keep inline published as AddressSets"
        );
    }
    Ok(wrote)
}

/// What publishing `spec` as `config` takes, from the caches alone: the last pass's plan when
/// nothing the plan reads changed since ([`Plans`]), else [`plan`].
fn planned(
    ctx: &Ctx,
    ns: &Namespace,
    config: &str,
    spec: std::sync::Arc<FirewallConfigurationSpec>,
    labels: &BTreeMap<String, String>,
) -> Result<std::sync::Arc<Plan>, ReconcileError> {
    // Read before the caches: a change that lands meanwhile moves the count past this plan's.
    let count = ctx.changes.count();
    let key = PlanKey {
        namespace: ns.name_any(),
        namespace_uid: ns.uid().unwrap_or_default(),
        config: config.to_string(),
        labels: labels.clone(),
    };
    if let Some(p) = ctx.plans().get(&key, count, &spec) {
        return Ok(p);
    }
    let before = ctx.plans().take_laid(&key);
    let prior = ctx.plans().prior(&key);
    if before.is_none() {
        // A configuration planned for the first time: those of deleted namespaces go.
        let live: HashSet<String> = ctx
            .namespaces
            .state()
            .iter()
            .filter_map(|n| n.uid())
            .collect();
        ctx.plans().forget_gone(&live);
    }
    // Laying out moves sets' elements out of the spec: a copy of it, the kept one (shared with
    // the tier's memo) staying as it was asked for.
    let owned = FirewallConfigurationSpec::clone(&spec);
    let prior = prior.as_ref().map(|(s, p)| (&**s, &**p));
    let (p, laid) = plan(
        ctx,
        ns,
        config,
        owned,
        labels,
        &before.unwrap_or_default(),
        prior,
    )?;
    let p = std::sync::Arc::new(p);
    let mut plans = ctx.plans();
    plans.keep(key.clone(), count, spec, p.clone());
    plans.keep_laid(key, laid);
    Ok(p)
}

/// Lay `spec` out for storage against the slices the cache shows: which sets move into
/// slices, each set's slices to write and delete (a set's layout taken from `before` where it
/// serves), the configuration object and its JSON's digest; and each moved set's layout, to
/// keep. Reads the caches, writes nothing. `prior`, the last spec planned for this
/// configuration and its plan, spares measuring the spec where only sets' elements changed
/// since ([`spill::size_after`]), and serializing the object where it is the same.
// size: one plan, from the spec to the object's digest; its steps share the spec as it is
// moved out of.
fn plan(
    ctx: &Ctx,
    ns: &Namespace,
    config: &str,
    spec: FirewallConfigurationSpec,
    labels: &BTreeMap<String, String>,
    before: &HashMap<String, LaidOut>,
    prior: Option<(&FirewallConfigurationSpec, &Plan)>,
) -> Result<(Plan, HashMap<String, LaidOut>), ReconcileError> {
    let ns_name = ns.name_any();
    let mut current = current_slices(ctx, &ns_name, config);
    let in_slices: BTreeSet<String> = current.keys().cloned().collect();
    // Nothing in slices: the object as it is, serialized once; within the budget (so is its
    // spec, which is what `spill` measures), nothing moves and this JSON is the one written.
    let (mut spec, mut json) = if in_slices.is_empty() {
        let object = object_of(ns, config, spec, labels)?;
        let json = to_json(&object, &ns_name, config)?;
        (object.spec, Some(json))
    } else {
        (spec, None)
    };
    let mut asked_bytes = None;
    let moved = match &json {
        Some(j) if j.len() <= ctx.opts.inline_budget => Vec::new(),
        _ => {
            json = None;
            asked_bytes = prior
                .and_then(|(s, p)| spill::size_after(s, p.asked_bytes?, &spec))
                .or_else(|| peerwall_intent::size::json_len(&spec));
            spill::spill_sized(&mut spec, ctx.opts.inline_budget, &in_slices, asked_bytes)
        }
    };
    // Every name in use: a new slice of one set never takes another's.
    let mut taken: BTreeSet<String> = current.values().flatten().map(|s| s.name.clone()).collect();
    let (mut write, mut delete, mut counts) = (Vec::new(), Vec::new(), Vec::new());
    let moved_count = moved.len();
    let mut laid_now = HashMap::new();
    for m in moved {
        let set = m.set.clone();
        let shown = current.remove(&set).unwrap_or_default();
        let laid = laid_out(config, m, &shown, &taken, before.get(&set));
        taken.extend(laid.result.write.iter().map(|s| s.name.clone()));
        write.extend(laid.result.write.iter().cloned());
        // Slices emptied: their addresses leave the set, which is what their deletion does.
        delete.extend(laid.result.delete.iter().cloned());
        counts.push((set.clone(), laid.result.count));
        laid_now.insert(set, laid);
    }
    // Sets back inline (or gone): their slices hold addresses the configuration in force on
    // a host may still take from them (a host waiting for another set's slices keeps the
    // previous generation), so they go only once every host applied the configuration that
    // no longer takes them.
    let unneeded: Vec<String> = current.into_values().flatten().map(|s| s.name).collect();
    spill::declare(&mut spec, &counts);
    let object = object_of(ns, config, spec, labels)?;
    // The same object as the last plan's (a change of moved sets' elements alone): its JSON's
    // size and digest are that plan's.
    let same = prior.map(|(_, p)| p).filter(|p| {
        p.object.metadata == object.metadata
            && p.object.spec == object.spec
            && p.object.status.is_none()
            && object.status.is_none()
    });
    let (bytes, digest) = match (json, same) {
        (Some(j), _) => (j.len(), Sha256::digest(&j).into()),
        (None, Some(p)) => (p.bytes, p.digest),
        (None, None) => {
            let j = to_json(&object, &ns_name, config)?;
            (j.len(), Sha256::digest(&j).into())
        }
    };
    let plan = Plan {
        write,
        delete,
        unneeded,
        moved: moved_count,
        object,
        bytes,
        digest,
        asked_bytes,
    };
    Ok((plan, laid_now))
}

/// Whether the object `stored` (as the cache shows it) already says `object`, whose JSON
/// hashes to `digest`: known from what the controller wrote or saw at the spec's generation
/// the cache shows, else compared (and then remembered).
fn already_there(
    ctx: &Ctx,
    key: &(String, String),
    stored: Option<&DynamicObject>,
    object: &FirewallConfiguration,
    digest: [u8; 32],
) -> bool {
    // The object's spec generation (the hosts' conditions in the status do not change it),
    // known only while the object carries every label the controller gives it (a gateway
    // finds its configurations by them).
    let version = stored
        .filter(|o| {
            object
                .labels()
                .iter()
                .all(|(k, v)| o.labels().get(k) == Some(v))
        })
        .and_then(|o| version_of(&o.metadata));
    let known = ctx.written().check(key, version.as_deref(), &digest);
    match known {
        Some(same) => same,
        // Not known at this generation (the controller started, the object was edited by
        // someone else, the cache lags its last write): what the cache shows, compared.
        None => {
            let shows = stored.map(Seen::of_dynamic).is_some_and(|s| s.says(object));
            if shows {
                ctx.written().remember(key.clone(), version, digest);
            }
            shows
        }
    }
}

/// Which object and which generation of its spec `meta` describes: `uid/generation`. The uid
/// tells a configuration deleted and created again (its generation starts over) from the one
/// the controller wrote.
fn version_of(meta: &kube::api::ObjectMeta) -> Option<String> {
    Some(format!("{}/{}", meta.uid.as_deref()?, meta.generation?))
}

/// The configuration as written: typed as it is (its spec is the API's own type already), in
/// the tenant namespace `ns` that owns it.
fn object_of(
    ns: &Namespace,
    config: &str,
    spec: FirewallConfigurationSpec,
    labels: &BTreeMap<String, String>,
) -> Result<FirewallConfiguration, ReconcileError> {
    let mut object = FirewallConfiguration::new(config, spec);
    object.metadata.namespace = Some(ns.name_any());
    object.metadata.labels = (!labels.is_empty()).then(|| labels.clone());
    object.metadata.owner_references = serde_json::from_value(owned_by_namespace(ns))
        .map(Some)
        .map_err(|source| ReconcileError::Object {
            object: format!("{}/{config}", ns.name_any()),
            source,
        })?;
    Ok(object)
}

/// The JSON the request carries: its size is exact.
fn to_json(
    object: &FirewallConfiguration,
    ns: &str,
    config: &str,
) -> Result<Vec<u8>, ReconcileError> {
    serde_json::to_vec(object).map_err(|source| ReconcileError::Object {
        object: format!("{ns}/{config}"),
        source,
    })
}

#[cfg(test)]
#[path = "storable/tests.rs"]
mod tests;
