//! The last plan of each configuration the controller publishes ([`super::storable`]), kept
//! for the next pass when nothing it was computed from changed.
//!
//! A plan is a function of the spec asked for, of the slices the cache shows, of the tenant
//! namespace and the labels, and of the options (fixed for the process). The caches' change
//! counter ([`crate::Changes`]) moves on every event that changes an object other than in its
//! status, and a plan reads no status. So a pass at the same count, for an equal spec, the same
//! namespace object and labels, would compute the same plan: it takes the kept one. Such passes
//! are those a host's condition wakes (an agent reporting that it applied the last
//! configuration): at 1,000 NetworkPolicies, laying the tier's sets out again was a sixth of
//! each pass, and every change waits behind a pass in progress.
//!
//! What a plan leads to is still decided at each pass: its writes are applied, the object is
//! compared with what the cache shows, and slices go only once every host applied it.
//!
//! Within a plan computed anew, each moved set's layout is kept too ([`LaidOut`]), under what
//! laying it out reads: the set's elements and its slices as the cache shows them, each by
//! name, uid and generation (which moves with every change of a slice's spec, not with the
//! hosts' reports in its status). A pod relabelled under 1,000 NetworkPolicies changes two of
//! the tier's 170 sets: the other 168 are not read from their slices and compared again.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use peerwall_intent::types::{FirewallConfiguration, FirewallConfigurationSpec};

/// A configuration's plan (`storable::plan`): the slices to write and delete, the configuration to write, its
/// JSON's size and digest.
#[derive(Debug)]
pub(super) struct Plan {
    /// Slices to write, before the configuration.
    pub(super) write: Vec<crate::protection::Slice<String>>,
    /// Slices emptied: deleted after it.
    pub(super) delete: Vec<String>,
    /// Slices of sets back inline (or gone): deleted once every host applied it.
    pub(super) unneeded: Vec<String>,
    /// How many sets are in slices.
    pub(super) moved: usize,
    /// The configuration to write.
    pub(super) object: FirewallConfiguration,
    /// Its JSON's size.
    pub(super) bytes: usize,
    /// Its JSON's SHA-256.
    pub(super) digest: [u8; 32],
    /// The size of the spec's JSON as it was asked for (before any set moved out), where it
    /// was measured: the next plan's size by difference starts from it.
    pub(super) asked_bytes: Option<usize>,
}

#[cfg(test)]
impl Plan {
    /// A plan that writes nothing, of an empty configuration.
    pub(super) fn for_tests() -> Self {
        let spec: FirewallConfigurationSpec =
            serde_json::from_value(serde_json::json!({"table": {"name": "t", "family": "INET"}}))
                .expect("a spec");
        Self {
            write: Vec::new(),
            delete: Vec::new(),
            unneeded: Vec::new(),
            moved: 0,
            object: FirewallConfiguration::new("c", spec),
            bytes: 0,
            digest: [0; 32],
            asked_bytes: None,
        }
    }
}

/// Which configuration a plan is of, and what besides the spec and the caches it reads.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct PlanKey {
    pub(super) namespace: String,
    /// The tenant namespace object (its owner reference is in the configuration).
    pub(super) namespace_uid: String,
    pub(super) config: String,
    pub(super) labels: BTreeMap<String, String>,
}

/// The last plan per configuration: the caches' change count it was computed at, the spec it
/// was asked for.
/// One moved set's layout as a plan computed it ([`crate::protection::spill::lay_out`]): from
/// which elements (in the spec's order) and which slices (name and `uid/generation` each), and
/// what it found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct LaidOut {
    /// The set's elements.
    pub(super) elements: Vec<String>,
    /// Its slices as the cache showed them, in the cache's order.
    pub(super) slices: Vec<(String, String)>,
    /// What laying them out found.
    pub(super) result: crate::protection::spill::SetSlices,
}

impl LaidOut {
    /// The layout of a set of `elements` whose slices the cache shows as `slices`, if this one
    /// was found from the same and wrote nothing: laying out is a function of the elements,
    /// the slices' contents, and (for the names of new slices alone) of the names other sets
    /// take, so only a layout without writes or deletions is taken as it is.
    pub(super) fn serves(&self, elements: &[String], slices: &[(String, String)]) -> bool {
        self.result.write.is_empty()
            && self.result.delete.is_empty()
            && self.elements == elements
            && self.slices == slices
    }
}

#[derive(Debug, Default)]
pub(super) struct Plans {
    kept: HashMap<PlanKey, (u64, Arc<FirewallConfigurationSpec>, Arc<Plan>)>,
    /// Each configuration's moved sets as last laid out, by set.
    laid: HashMap<PlanKey, HashMap<String, LaidOut>>,
}

impl Plans {
    /// The plan kept for `key` when it was computed at `count` for a spec equal to `spec` (the
    /// same one, shared with the tier kept, is known without comparing).
    pub(super) fn get(
        &self,
        key: &PlanKey,
        count: u64,
        spec: &Arc<FirewallConfigurationSpec>,
    ) -> Option<Arc<Plan>> {
        self.kept
            .get(key)
            .filter(|(at, asked, _)| *at == count && (Arc::ptr_eq(asked, spec) || asked == spec))
            .map(|(_, _, p)| p.clone())
    }

    /// `key`'s last plan and the spec it was asked for, whatever changed since (what the next
    /// plan may start from, [`super::storable`]).
    pub(super) fn prior(
        &self,
        key: &PlanKey,
    ) -> Option<(Arc<FirewallConfigurationSpec>, Arc<Plan>)> {
        self.kept
            .get(key)
            .map(|(_, spec, plan)| (spec.clone(), plan.clone()))
    }

    /// The layouts kept for `key`'s sets, taken out (a plan computed anew puts back its own);
    /// None when none were kept (a configuration planned for the first time).
    pub(super) fn take_laid(&mut self, key: &PlanKey) -> Option<HashMap<String, LaidOut>> {
        self.laid.remove(key)
    }

    /// Keep `laid` for `key`.
    pub(super) fn keep_laid(&mut self, key: PlanKey, laid: HashMap<String, LaidOut>) {
        self.laid.insert(key, laid);
    }

    /// Drop the plans and layouts of namespaces no longer among `live` (their uids): a peer's
    /// tenant namespace deleted takes them along. Asked when a configuration is planned for
    /// the first time, so what is kept stays within the configurations that exist, plus one.
    pub(super) fn forget_gone(&mut self, live: &HashSet<String>) {
        self.laid.retain(|k, _| live.contains(&k.namespace_uid));
        self.kept.retain(|k, _| live.contains(&k.namespace_uid));
    }

    /// Keep `plan`, computed at `count` for `spec`, in place of `key`'s last (the plans of
    /// other configurations stay: the next plan of each starts from its last).
    pub(super) fn keep(
        &mut self,
        key: PlanKey,
        count: u64,
        spec: Arc<FirewallConfigurationSpec>,
        plan: Arc<Plan>,
    ) {
        self.kept.insert(key, (count, spec, plan));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(config: &str) -> PlanKey {
        PlanKey {
            namespace: "liqo-tenant-a".into(),
            namespace_uid: "u1".into(),
            config: config.into(),
            labels: BTreeMap::new(),
        }
    }

    /// A spec of one set, new each time: an equal spec at another address.
    fn spec(set: &str) -> Arc<FirewallConfigurationSpec> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "table": {"name": "t", "family": "INET",
                          "sets": [{"name": set, "keyType": "ipv4_addr", "elements": []}]}
            }))
            .unwrap(),
        )
    }

    #[test]
    fn a_layout_serves_only_the_same_elements_and_slice_versions_without_writes() {
        use crate::protection::spill::SetSlices;
        let laid = LaidOut {
            elements: vec!["10.0.0.1".into(), "10.0.0.2".into()],
            slices: vec![("s-0000".into(), "u/3".into())],
            result: SetSlices {
                write: vec![],
                delete: vec![],
                count: 1,
            },
        };
        let (elements, slices) = (laid.elements.clone(), laid.slices.clone());
        assert!(laid.serves(&elements, &slices));
        assert!(!laid.serves(&elements[..1], &slices), "other elements");
        let newer = vec![("s-0000".to_string(), "u/4".to_string())];
        assert!(!laid.serves(&elements, &newer), "a slice changed since");
        let mut wrote = laid.clone();
        wrote.result.write.push(crate::protection::Slice {
            name: "s-0001".into(),
            set: "s".into(),
            addresses: Default::default(),
        });
        assert!(
            !wrote.serves(&elements, &slices),
            "its writes name new slices"
        );
        let mut deleted = laid.clone();
        deleted.result.delete.push("s-0001".into());
        assert!(!deleted.serves(&elements, &slices));
        // Kept per configuration; a namespace gone takes its layouts along.
        let mut plans = Plans::default();
        plans.keep_laid(key("c"), [("s".to_string(), laid.clone())].into());
        assert_eq!(plans.take_laid(&key("c")).unwrap_or_default().len(), 1);
        assert!(
            plans.take_laid(&key("c")).unwrap_or_default().is_empty(),
            "taken out"
        );
        plans.keep_laid(key("c"), [("s".to_string(), laid)].into());
        plans.forget_gone(&HashSet::new());
        plans.keep_laid(key("d"), HashMap::new());
        assert!(
            plans.take_laid(&key("c")).unwrap_or_default().is_empty(),
            "its namespace is gone"
        );
    }

    #[test]
    fn a_plan_serves_only_the_same_spec_at_the_same_count() {
        let mut plans = Plans::default();
        let p = Arc::new(Plan::for_tests());
        let asked = spec("s");
        plans.keep(key("c"), 7, asked.clone(), p.clone());
        assert!(plans.get(&key("c"), 7, &asked).is_some(), "the same spec");
        assert!(
            plans.get(&key("c"), 7, &spec("s")).is_some(),
            "an equal one"
        );
        assert!(
            plans.get(&key("c"), 8, &spec("s")).is_none(),
            "a change since"
        );
        assert!(
            plans.get(&key("c"), 7, &spec("other")).is_none(),
            "another spec"
        );
        assert!(
            plans.get(&key("d"), 7, &spec("s")).is_none(),
            "another object"
        );
        let mut moved = key("c");
        moved.namespace_uid = "u2".into();
        assert!(
            plans.get(&moved, 7, &spec("s")).is_none(),
            "namespace recreated"
        );
        // Kept at a later count, the older plans of other configurations stay as what their
        // next plans start from (never served at the later count), until their namespace goes.
        plans.keep(key("d"), 9, spec("s"), p);
        assert!(plans.get(&key("c"), 9, &spec("s")).is_none());
        assert!(plans.get(&key("d"), 9, &spec("s")).is_some());
        assert!(plans
            .prior(&key("c"))
            .is_some_and(|(s, _)| Arc::ptr_eq(&s, &asked)));
        plans.forget_gone(&HashSet::new());
        assert!(plans.prior(&key("c")).is_none() && plans.prior(&key("d")).is_none());
    }
}
