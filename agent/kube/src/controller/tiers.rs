//! Each peer's NetworkPolicy tier, kept with the view of the cluster it was computed from
//! ([`super::view`]): a pass that gets the same view (no cache changed since, as when an
//! agent's condition wakes it) takes the tier kept instead of computing it again, which at
//! 1,000 NetworkPolicies and 10,000 pods was a sixth of each pass. The tier is a function of
//! the view, the peer and the audit setting alone (`peerwall_netpol::tier::tier`). The view is
//! known here by a weak reference: its allocation stays while the reference does (so another
//! view never takes its address), its contents go with the last pass that holds it (two views
//! are never alive because of a tier kept). A later view's tier is made from the one kept by
//! difference where only pods changed ([`netpol::tier::Kept::next`]), which holds the pods it
//! was made of (shared with the views, not copied).

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
    kept: HashMap<String, (Weak<NetpolView>, bool, netpol::tier::Kept)>,
}

impl Tiers {
    /// `peer`'s tier kept when it was computed from this very `view` with `audit`.
    pub(super) fn get(&self, view: &Arc<NetpolView>, peer: &str, audit: bool) -> Option<TierParts> {
        self.kept
            .get(peer)
            .filter(|(v, a, _)| std::ptr::eq(v.as_ptr(), Arc::as_ptr(view)) && *a == audit)
            .map(|(_, _, k)| (k.spec().clone(), k.unenforced().to_vec()))
    }

    /// `peer`'s last tier, whatever it was computed from, taken out to make the next one from.
    pub(super) fn take(&mut self, peer: &str) -> Option<netpol::tier::Kept> {
        self.kept.remove(peer).map(|(_, _, k)| k)
    }

    /// Forget the tiers of peers not in `live` (their tenant namespaces are gone).
    pub(super) fn forget_gone(&mut self, live: &std::collections::HashSet<String>) {
        self.kept.retain(|peer, _| live.contains(peer));
    }

    /// Keep `kept`, `peer`'s tier computed from `view` with `audit`.
    pub(super) fn keep(
        &mut self,
        view: &Arc<NetpolView>,
        peer: &str,
        audit: bool,
        kept: netpol::tier::Kept,
    ) {
        self.kept
            .insert(peer.to_string(), (Arc::downgrade(view), audit, kept));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(policies: usize) -> Arc<NetpolView> {
        let mut v: NetpolView = Default::default();
        for i in 0..policies {
            v.0.policies.push(Arc::new(netpol::NetworkPolicy {
                namespace: "ns".into(),
                name: format!("np{i}"),
                pod_selector: Default::default(),
                ingress: Some(Vec::new()),
                egress: None,
            }));
        }
        Arc::new(v)
    }

    #[test]
    fn a_tier_is_computed_again_for_another_view_peer_or_setting() {
        let mut tiers = Tiers::default();
        let (v1, v2) = (view(0), view(1));
        let mut computed = 0;
        let mut get = |t: &mut Tiers, v: &Arc<NetpolView>, peer: &str, audit: bool| {
            let parts = t.get(v, peer, audit).unwrap_or_else(|| {
                computed += 1;
                let k = match t.take(peer) {
                    Some(k) => k.next(&v.0, peer, audit),
                    None => netpol::tier::Kept::compute(&v.0, peer, audit),
                };
                let p = (k.spec().clone(), k.unenforced().to_vec());
                t.keep(v, peer, audit, k);
                p
            });
            (
                computed,
                parts.0.audit,
                parts.0.table.name.clone().unwrap_or_default(),
            )
        };
        assert_eq!(
            get(&mut tiers, &v1, "a", false),
            (1, false, "pwnp_a".into())
        );
        assert_eq!(
            get(&mut tiers, &v1, "a", false),
            (1, false, "pwnp_a".into()),
            "kept"
        );
        assert_eq!(
            get(&mut tiers, &v1, "a", true),
            (2, true, "pwnp_a".into()),
            "audit changed"
        );
        assert_eq!(
            get(&mut tiers, &v1, "b", true),
            (3, true, "pwnp_b".into()),
            "another peer"
        );
        // Another view: computed anew (from the tier kept where it can).
        assert_eq!(get(&mut tiers, &v2, "a", true), (4, true, "pwnp_a".into()));
        assert_eq!(
            get(&mut tiers, &v2, "a", true),
            (4, true, "pwnp_a".into()),
            "kept"
        );
        tiers.forget_gone(&["b".to_string()].into());
        assert!(tiers.take("a").is_none() && tiers.take("b").is_some());
    }
}
