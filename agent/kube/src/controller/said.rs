//! What the cache already showed as it should be, per object: the offloaded namespaces'
//! NetworkPolicies ([`super::offloaded`]) by namespace.

use std::collections::HashMap;

/// Per offloaded namespace, the policy the cache showed (by `resourceVersion`, which the API
/// server moves on every write of the object) when it already said the body a pass built: a
/// later pass building the same body for the same version has nothing to compare. At 100
/// offloaded namespaces, reading each policy back into JSON to compare it was a tenth of the
/// controller's time under `bench-netpol`, on every pass.
#[derive(Debug, Default)]
pub(super) struct Said(HashMap<String, (String, serde_json::Value)>);

impl Said {
    /// Whether the policy of `ns` at `version` was found saying `body`.
    pub(super) fn holds(&self, ns: &str, version: &str, body: &serde_json::Value) -> bool {
        self.0
            .get(ns)
            .is_some_and(|(v, b)| v == version && b == body)
    }

    /// The policy of `ns` at `version` says `body`.
    pub(super) fn note(&mut self, ns: String, version: String, body: serde_json::Value) {
        self.0.insert(ns, (version, body));
    }

    /// Forget the namespaces `live` does not keep.
    pub(super) fn keep_only(&mut self, live: impl Fn(&str) -> bool) {
        self.0.retain(|ns, _| live(ns));
    }

    /// How many namespaces are held.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.0.len()
    }
}
