//! NetworkPolicies as read ([`super::policy`]), kept per object version: the controller's view
//! of the cluster is built again after every pod event, and reading every NetworkPolicy anew
//! each time (through its JSON, defaults applied) was a seventh of the controller's pass at
//! 1,000 policies (perf on `bench-netpol`'s API-server part), for policies that had not
//! changed.
//!
//! A read is reused only for the same object at the same `resourceVersion`: the API server
//! gives every write of an object a new one, and nobody else sets it, so no change to a
//! policy is ever served from an older read. An object without one (a snapshot, a fixture)
//! is read every time.

use std::collections::HashMap;
use std::sync::Arc;

use k8s_openapi::api::networking::v1 as np;
use kube::ResourceExt;

use super::Unreadable;
use crate::netpol;

/// The object a read was of: namespace, name, uid.
type Key = (String, String, String);

/// The last read of each NetworkPolicy, by object, with the version it was of.
#[derive(Debug, Default)]
pub struct PolicyReads {
    reads: HashMap<Key, (String, Result<Arc<netpol::NetworkPolicy>, Unreadable>)>,
}

impl PolicyReads {
    /// [`super::policies`] of `policies`, each read again only when its `resourceVersion`
    /// moved; reads of objects no longer there are dropped. A read is shared between the
    /// views that hold it (each view used to copy every policy: at 1,000 policies, most of
    /// the view's time on a pod event).
    pub fn policies<'a>(
        &mut self,
        policies: impl IntoIterator<Item = &'a np::NetworkPolicy>,
    ) -> (Vec<Arc<netpol::NetworkPolicy>>, Vec<Unreadable>) {
        let mut kept = HashMap::with_capacity(self.reads.len());
        let (mut good, mut bad) = (Vec::new(), Vec::new());
        for p in policies.into_iter().filter(|p| !super::ours(p)) {
            let version = p.resource_version().unwrap_or_default();
            let key = (
                p.namespace().unwrap_or_default(),
                p.name_any(),
                p.uid().unwrap_or_default(),
            );
            let read = match self.reads.remove(&key) {
                Some((v, read)) if !version.is_empty() && v == version => read,
                _ => super::policy(p).map(Arc::new),
            };
            match &read {
                Ok(r) => good.push(r.clone()),
                Err(e) => bad.push(e.clone()),
            }
            if !version.is_empty() {
                kept.insert(key, (version, read));
            }
        }
        self.reads = kept;
        (good, bad)
    }

    /// How many reads are kept.
    pub fn len(&self) -> usize {
        self.reads.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.reads.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn policy(name: &str, version: &str, port: u16) -> np::NetworkPolicy {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "app", "uid": format!("uid-{name}"),
                         "resourceVersion": version},
            "spec": {"podSelector": {}, "ingress": [{"ports": [{"port": port}]}]},
        }))
        .unwrap()
    }

    /// The reads as owned values, to compare with [`super::super::policies`].
    fn owned(
        (good, bad): (Vec<Arc<netpol::NetworkPolicy>>, Vec<Unreadable>),
    ) -> (Vec<netpol::NetworkPolicy>, Vec<Unreadable>) {
        (good.iter().map(|p| (**p).clone()).collect(), bad)
    }

    fn ports(read: &(Vec<netpol::NetworkPolicy>, Vec<Unreadable>)) -> Vec<String> {
        read.0
            .iter()
            .map(|p| format!("{}:{:?}", p.name, p.ingress.as_ref().unwrap()[0].ports))
            .collect()
    }

    #[test]
    fn a_policy_is_read_again_once_its_version_moves_and_never_served_stale() {
        let mut reads = PolicyReads::default();
        let (a, b) = (policy("a", "10", 80), policy("b", "11", 81));
        let first = owned(reads.policies([&a, &b]));
        assert_eq!(first, super::super::policies([&a, &b]));
        assert_eq!(reads.len(), 2);
        // Edited: a new version, read again.
        let a2 = policy("a", "12", 8080);
        let second = owned(reads.policies([&a2, &b]));
        assert_eq!(second, super::super::policies([&a2, &b]));
        assert!(ports(&second)[0].contains("8080"), "{:?}", ports(&second));
        // Same version: the read kept is served (the object below differs only to show it:
        // the API server never serves two contents under one version).
        let same_version = policy("a", "12", 9);
        let third = owned(reads.policies([&same_version, &b]));
        assert!(ports(&third)[0].contains("8080"), "{:?}", ports(&third));
        // Deleted and created again under the name: another uid, read anew.
        let mut again = policy("a", "12", 7);
        again.metadata.uid = Some("uid-other".into());
        let fourth = owned(reads.policies([&again]));
        assert!(ports(&fourth)[0].contains('7'), "{:?}", ports(&fourth));
        assert_eq!(reads.len(), 1, "b's read went with b");
        // Without a version: read every time, kept never.
        let mut bare = policy("c", "", 1);
        bare.metadata.resource_version = None;
        let fifth = owned(reads.policies([&bare]));
        assert_eq!(fifth, super::super::policies([&bare]));
        assert!(reads.is_empty());
    }

    #[test]
    fn an_unreadable_policy_stays_reported_and_peerwalls_own_stay_out() {
        let mut reads = PolicyReads::default();
        let bad: np::NetworkPolicy = serde_json::from_value(json!({
            "metadata": {"name": "bad", "namespace": "app", "uid": "u1", "resourceVersion": "5"},
            "spec": {"podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": "nope"}}]}]},
        }))
        .unwrap();
        let mut ours = policy("companion", "6", 80);
        ours.metadata.labels = Some(
            [(
                crate::protection::MANAGED_BY.to_string(),
                crate::protection::MANAGER.to_string(),
            )]
            .into(),
        );
        for _ in 0..2 {
            let (good, unreadable) = owned(reads.policies([&bad, &ours]));
            assert!(good.is_empty());
            assert_eq!(unreadable.len(), 1, "{unreadable:?}");
            assert!(unreadable[0].why.contains("nope"), "{unreadable:?}");
        }
    }
}
