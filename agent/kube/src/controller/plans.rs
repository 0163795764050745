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

use std::collections::{BTreeMap, HashMap};
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
#[derive(Debug, Default)]
pub(super) struct Plans {
    kept: HashMap<PlanKey, (u64, FirewallConfigurationSpec, Arc<Plan>)>,
}

impl Plans {
    /// The plan kept for `key` when it was computed at `count` for a spec equal to `spec`.
    pub(super) fn get(
        &self,
        key: &PlanKey,
        count: u64,
        spec: &FirewallConfigurationSpec,
    ) -> Option<Arc<Plan>> {
        self.kept
            .get(key)
            .filter(|(at, asked, _)| *at == count && asked == spec)
            .map(|(_, _, p)| p.clone())
    }

    /// Keep `plan`, computed at `count` for `spec`, in place of `key`'s last.
    pub(super) fn keep(
        &mut self,
        key: PlanKey,
        count: u64,
        spec: FirewallConfigurationSpec,
        plan: Arc<Plan>,
    ) {
        // Only configurations published since the last change stay: a peer gone takes its
        // plans with it at the next change.
        self.kept.retain(|_, (at, _, _)| *at == count);
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

    fn spec(set: &str) -> FirewallConfigurationSpec {
        serde_json::from_value(serde_json::json!({
            "table": {"name": "t", "family": "INET",
                      "sets": [{"name": set, "keyType": "ipv4_addr", "elements": []}]}
        }))
        .unwrap()
    }

    #[test]
    fn a_plan_serves_only_the_same_spec_at_the_same_count() {
        let mut plans = Plans::default();
        let p = Arc::new(Plan::for_tests());
        plans.keep(key("c"), 7, spec("s"), p.clone());
        assert!(plans.get(&key("c"), 7, &spec("s")).is_some());
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
        // Kept at a later count, the older plans of other configurations go.
        plans.keep(key("d"), 9, spec("s"), p);
        assert!(plans.get(&key("c"), 7, &spec("s")).is_none());
        assert!(plans.get(&key("d"), 9, &spec("s")).is_some());
    }
}
