//! `deploy/` accepted by the API server.

use std::collections::BTreeSet;

use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::ResourceExt;
use serde_json::json;

use crate::common::*;
use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deploy_manifests_pass_server_side_dry_run() {
    let server = ApiServer::start();
    let client = server.client().await;
    install_crd(&client).await;
    let kustomization: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(repo("deploy/kustomization.yaml")).unwrap())
            .unwrap();
    let target_ns = kustomization["namespace"]
        .as_str()
        .unwrap_or("peerwall-system")
        .to_string();
    // Dry runs persist nothing, so the namespace the others live in must exist for real.
    namespace(&client, &target_ns, json!({})).await;
    let discovery = kube::Discovery::new(client.clone()).run().await.unwrap();
    let mut kinds = BTreeSet::new();
    for res in kustomization["resources"].as_sequence().unwrap() {
        let file = res.as_str().unwrap();
        let text = std::fs::read_to_string(repo(&format!("deploy/{file}"))).unwrap();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            use serde::Deserialize;
            let v = serde_yaml::Value::deserialize(doc).unwrap();
            if v.is_null() {
                continue;
            }
            let obj: DynamicObject = serde_yaml::from_value(v).unwrap();
            let tm = obj.types.clone().unwrap();
            let (group, version) = tm
                .api_version
                .split_once('/')
                .unwrap_or(("", &tm.api_version));
            let gvk = kube::api::GroupVersionKind::gvk(group, version, &tm.kind);
            let (ar, caps) = discovery
                .resolve_gvk(&gvk)
                .unwrap_or_else(|| panic!("{file}: unknown kind {gvk:?}"));
            let api: Api<DynamicObject> = if caps.scope == kube::discovery::Scope::Namespaced {
                let ns = obj.namespace().unwrap_or_else(|| target_ns.clone());
                Api::namespaced_with(client.clone(), &ns, &ar)
            } else {
                Api::all_with(client.clone(), &ar)
            };
            let mut obj = obj;
            if caps.scope == kube::discovery::Scope::Namespaced && obj.metadata.namespace.is_none()
            {
                obj.metadata.namespace = Some(target_ns.clone());
            }
            let name = obj.name_any();
            let pp = PatchParams::apply("peerwall-test").dry_run();
            let r = api.patch(&name, &pp, &Patch::Apply(&obj)).await;
            // The CRD and namespace exist already (a no-op apply is fine).
            assert!(
                r.is_ok(),
                "{file}: {} {name} refused by the API server: {:?}",
                tm.kind,
                r.err()
            );
            kinds.insert(tm.kind.clone());
        }
    }
    for k in [
        "CustomResourceDefinition",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "DaemonSet",
        "Deployment",
        "Service",
        "ValidatingWebhookConfiguration",
    ] {
        assert!(kinds.contains(k), "deploy/ has no {k}: {kinds:?}");
    }
}
