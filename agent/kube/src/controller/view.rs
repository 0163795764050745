//! The controller's view of the cluster as NetworkPolicies see it ([`NetpolView`]), and the
//! slot that keeps one view while the caches stand still ([`SharedView`]), so that the peers
//! of a pass share it. Computed from the caches in [`super::policies::shared_view`].

use std::sync::{Arc, Mutex, PoisonError};

use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::DynamicObject;

use crate::netpol;

/// The cluster as NetworkPolicies and ClusterNetworkPolicies see it, from the caches; the
/// NetworkPolicies that do not read; every NetworkPolicy object (for Events and companions);
/// what of the ClusterNetworkPolicies is refused or not enforced as written (the object, why).
pub(super) type NetpolView = (
    netpol::Cluster,
    Vec<crate::model::Unreadable>,
    Vec<Arc<NetworkPolicy>>,
    Vec<(Arc<DynamicObject>, String)>,
);

/// The cluster of a shared view.
pub(super) struct ClusterOf(pub Arc<NetpolView>);

impl std::ops::Deref for ClusterOf {
    type Target = netpol::Cluster;
    fn deref(&self) -> &netpol::Cluster {
        &self.0 .0
    }
}

/// One view, kept under the caches' change count it was computed at.
#[derive(Default)]
pub(super) struct SharedView {
    slot: Mutex<Option<(u64, Arc<NetpolView>)>>,
}

impl SharedView {
    /// The view kept at `count`, or the one `compute` makes now, then kept at `count`. The
    /// caller reads `count` before `compute` reads the caches, so a view is never older than
    /// the count it is kept under. Whoever asks while a view is computed waits for it; the
    /// old view goes first, so that two are never alive here.
    pub(super) fn at(&self, count: u64, compute: impl FnOnce() -> NetpolView) -> Arc<NetpolView> {
        let mut slot = self.slot.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((at, view)) = slot.as_ref() {
            if *at == count {
                return view.clone();
            }
        }
        *slot = None;
        let view = Arc::new(compute());
        *slot = Some((count, view.clone()));
        view
    }
}
