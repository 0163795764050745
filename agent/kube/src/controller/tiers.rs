//! Each peer's NetworkPolicy tier, kept with the view of the cluster it was computed from
//! ([`super::view`]): a pass that gets the same view (no cache changed since, as when an
//! agent's condition wakes it) takes the tier kept instead of computing it again, which at
//! 1,000 NetworkPolicies and 10,000 pods was a sixth of each pass. The tier is a function of
//! the view, the peer and the audit setting alone (`peerwall_netpol::tier::tier`). The view is
//! known here by a weak reference: its allocation stays while the reference does (so another
//! view never takes its address), its contents go with the last pass that holds it (two views
//! are never alive because of a tier kept).

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use peerwall_intent::types::FirewallConfigurationSpec;

use super::view::NetpolView;
use crate::netpol;

/// A tier as the controller publishes it: the spec (shared with the plan kept for it, which
/// knows it by address), and what of the policies it left out.
pub(super) type TierParts = (
    Arc<FirewallConfigurationSpec>,
    Vec<netpol::tier::Unenforced>,
);

/// The last tier of each peer, with the view and the audit setting it was computed from.
#[derive(Default)]
pub(super) struct Tiers {
    kept: HashMap<String, (Weak<NetpolView>, bool, TierParts)>,
}

impl Tiers {
    /// `peer`'s tier kept when it was computed from this very `view` with `audit`.
    pub(super) fn get(&self, view: &Arc<NetpolView>, peer: &str, audit: bool) -> Option<TierParts> {
        self.kept
            .get(peer)
            .filter(|(v, a, _)| std::ptr::eq(v.as_ptr(), Arc::as_ptr(view)) && *a == audit)
            .map(|(_, _, parts)| parts.clone())
    }

    /// Keep `parts`, `peer`'s tier computed from `view` with `audit`.
    pub(super) fn keep(
        &mut self,
        view: &Arc<NetpolView>,
        peer: &str,
        audit: bool,
        parts: TierParts,
    ) {
        // Tiers of other peers computed from an older view are no use any more.
        self.kept
            .retain(|_, (v, _, _)| std::ptr::eq(v.as_ptr(), Arc::as_ptr(view)));
        self.kept
            .insert(peer.to_string(), (Arc::downgrade(view), audit, parts));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view() -> Arc<NetpolView> {
        Arc::new(Default::default())
    }

    fn parts(name: &str) -> TierParts {
        let spec: FirewallConfigurationSpec =
            serde_json::from_value(serde_json::json!({"table": {"name": name, "family": "INET"}}))
                .unwrap();
        (Arc::new(spec), Vec::new())
    }

    #[test]
    fn a_tier_is_computed_again_for_another_view_peer_or_setting() {
        let mut tiers = Tiers::default();
        let (v1, v2) = (view(), view());
        let mut computed = 0;
        let mut get = |t: &mut Tiers, v: &Arc<NetpolView>, peer: &str, audit: bool| {
            let parts = t.get(v, peer, audit).unwrap_or_else(|| {
                computed += 1;
                let p = parts(&format!("{peer}-{computed}"));
                t.keep(v, peer, audit, p.clone());
                p
            });
            parts.0.table.name.clone().unwrap_or_default()
        };
        assert_eq!(get(&mut tiers, &v1, "a", false), "a-1");
        assert_eq!(get(&mut tiers, &v1, "a", false), "a-1", "kept");
        assert_eq!(get(&mut tiers, &v1, "a", true), "a-2", "audit changed");
        assert_eq!(get(&mut tiers, &v1, "b", true), "b-3", "another peer");
        // An equal but distinct view (a later count): computed anew.
        assert_eq!(get(&mut tiers, &v2, "a", true), "a-4");
        assert_eq!(
            get(&mut tiers, &v2, "b", true),
            "b-5",
            "b's older tier dropped"
        );
    }
}
