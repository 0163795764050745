//! Beside Liqo: Liqo's CRD and objects left alone, Liqo's objects enforced only on request.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

use crate::support::*;
use peerwall_testkit::prelude::*;

/// Every FirewallConfiguration shape Liqo creates (`examples/liqo/`), as JSON, with owner
/// references dropped (their owners, Liqo's Configurations, do not exist on a test server and
/// the garbage collector would remove the objects).
pub(crate) fn liqo_shapes() -> Vec<(String, serde_json::Value)> {
    let mut files: Vec<PathBuf> = ["gateway", "fabric"]
        .iter()
        .flat_map(|d| std::fs::read_dir(repo("examples/liqo").join(d)).unwrap())
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|f| {
            let mut v: serde_json::Value =
                serde_yaml::from_str(&std::fs::read_to_string(&f).unwrap()).unwrap();
            if let Some(m) = v["metadata"].as_object_mut() {
                m.remove("ownerReferences");
            }
            (f.file_name().unwrap().to_string_lossy().into_owned(), v)
        })
        .collect()
}

/// Remove peerwall's extension fields from a CRD schema (what Liqo's own CRD lacks), and its
/// keeping of unknown fields.
pub(crate) fn strip_extensions(v: &mut serde_json::Value) {
    if let Some(o) = v.as_object_mut() {
        if let Some(props) = o.get_mut("properties").and_then(|p| p.as_object_mut()) {
            for ext in [
                "sets",
                "ctstate",
                "wildcard",
                "message",
                "observedGeneration",
            ] {
                props.remove(ext);
            }
        }
        o.remove("x-kubernetes-list-type");
        o.remove("x-kubernetes-list-map-keys");
        // Liqo's schema prunes unknown fields (peerwall's keeps them to refuse them).
        o.remove("x-kubernetes-preserve-unknown-fields");
        for (_, child) in o.iter_mut() {
            strip_extensions(child);
        }
    } else if let Some(a) = v.as_array_mut() {
        for child in a {
            strip_extensions(child);
        }
    }
}

/// Liqo's CRD as Liqo's chart installs it, owned by someone else ("liqo-chart"): group
/// `networking.liqo.io`, version v1beta1, Liqo's names, and the schema without peerwall's
/// extensions (derived from peerwall's CRD, whose spec mirrors Liqo's field for field).
pub(crate) async fn install_liqo_crd(client: &Client) {
    use serde::Deserialize;
    let text = std::fs::read_to_string(repo("deploy/common/crd.yaml")).unwrap();
    // The first document: FirewallConfiguration.
    let mut crd =
        serde_json::Value::deserialize(serde_yaml::Deserializer::from_str(&text).next().unwrap())
            .unwrap();
    crd["metadata"] = json!({"name": "firewallconfigurations.networking.liqo.io",
        "labels": {"app.kubernetes.io/managed-by": "Helm"}});
    crd["spec"]["group"] = json!("networking.liqo.io");
    crd["spec"]["names"]["shortNames"] = json!(["fw", "fwconfig", "fwcfg"]);
    crd["spec"]["names"]["categories"] = json!(["liqo"]);
    crd["spec"]["versions"][0]["name"] = json!("v1beta1");
    strip_extensions(&mut crd["spec"]["versions"][0]["schema"]);
    let liqo = peerwall::k8s::resource_of(peerwall_intent::load::Group::Liqo);
    create_as_liqo_chart(client, crd, Api::all_with(client.clone(), &liqo)).await;
}

/// Create `crd` as Liqo's chart would (field manager "liqo-chart"), untyped: k8s-openapi's
/// schema type reads `default: ""` as no default. Returns once `served` lists.
async fn create_as_liqo_chart(client: &Client, crd: serde_json::Value, served: Api<DynamicObject>) {
    let api: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &kube::api::ApiResource::erase::<CustomResourceDefinition>(&()),
    );
    let pp = PostParams {
        field_manager: Some("liqo-chart".into()),
        ..Default::default()
    };
    api.create(&pp, &serde_json::from_value(crd).unwrap())
        .await
        .unwrap();
    eventually(
        "Liqo's resource to be served",
        Duration::from_secs(20),
        || {
            let served = served.clone();
            async move { served.list(&Default::default()).await.ok().map(|_| ()) }
        },
    )
    .await;
}

/// Liqo's FirewallConfigurationBinding CRD (liqotech/liqo PR #3290) as Liqo's chart installs
/// it (`examples/liqo/crds/`), served before this returns.
pub(crate) async fn install_liqo_binding_crd(client: &Client) {
    use serde::Deserialize;
    let text = std::fs::read_to_string(repo(
        "examples/liqo/crds/networking.liqo.io_firewallconfigurationbindings.yaml",
    ))
    .unwrap();
    let mut crd = serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde_json::Value::deserialize(d).unwrap())
        .find(|v| v["kind"] == "CustomResourceDefinition")
        .unwrap();
    // The test's kube-apiserver 1.20 reads the empty-string default of
    // `spec.firewallConfigurationRef.name` (controller-gen's for a LocalObjectReference) as
    // null and refuses the CRD; current servers take it. Without that default the schema is
    // Liqo's otherwise, and a binding naming no configuration binds nothing either way.
    let name = &mut crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        ["properties"]["firewallConfigurationRef"]["properties"]["name"];
    assert_eq!(name["default"], "", "{name}");
    name.as_object_mut().unwrap().remove("default");
    create_as_liqo_chart(client, crd, binding_api(client, None)).await;
}

/// Liqo's FirewallConfigurationBindings, of namespace `ns` or all.
pub(crate) fn binding_api(client: &Client, ns: Option<&str>) -> Api<DynamicObject> {
    let r = peerwall::k8s::liqo_binding_resource();
    match ns {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &r),
        None => Api::all_with(client.clone(), &r),
    }
}

/// A binding as Liqo's gateway makes it (`<configuration>-<pod>`, in the configuration's
/// namespace) of `configuration` in `ns` to the gateway pod `pod` (of `pod_ns`).
async fn bind(client: &Client, ns: &str, configuration: &str, pod_ns: &str, pod: &str) -> String {
    let name = format!("{configuration}-{pod}");
    let obj = json!({"apiVersion": "networking.liqo.io/v1beta1", "kind": "FirewallConfigurationBinding",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"firewallConfigurationRef": {"name": configuration},
            "targetRef": {"apiVersion": "v1", "kind": "Pod", "name": pod, "namespace": pod_ns}}});
    binding_api(client, Some(ns))
        .create(
            &PostParams::default(),
            &serde_json::from_value(obj).unwrap(),
        )
        .await
        .unwrap();
    name
}

pub(crate) fn liqo_api(client: &Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(
        client.clone(),
        ns,
        &peerwall::k8s::resource_of(peerwall_intent::load::Group::Liqo),
    )
}

/// Create Liqo's shapes in Liqo's group; returns (namespace, name) of each.
pub(crate) async fn create_liqo_shapes(client: &Client, suffix: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (file, mut obj) in liqo_shapes() {
        let ns = obj["metadata"]["namespace"].as_str().unwrap().to_string();
        let name = format!("{}{suffix}", obj["metadata"]["name"].as_str().unwrap());
        obj["metadata"]["name"] = json!(name);
        namespace(client, &ns, json!({})).await;
        liqo_api(client, &ns)
            .create(
                &PostParams::default(),
                &serde_json::from_value(obj).unwrap(),
            )
            .await
            .unwrap_or_else(|e| panic!("{file}: Liqo's object refused: {e}"));
        out.push((ns, name));
    }
    out
}

/// `metadata.resourceVersion` of every Liqo FirewallConfiguration.
pub(crate) async fn liqo_versions(client: &Client) -> BTreeSet<(String, String)> {
    let liqo = peerwall::k8s::resource_of(peerwall_intent::load::Group::Liqo);
    Api::<DynamicObject>::all_with(client.clone(), &liqo)
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|o| (o.name_any(), o.resource_version().unwrap_or_default()))
        .collect()
}

/// Installing peerwall next to Liqo: `kubectl apply -k deploy/` leaves Liqo's CRD (owned by
/// Liqo's chart) byte-identical and Liqo's objects untouched; with peerwall's webhook
/// registered (and unreachable, failurePolicy Fail) Liqo keeps creating and updating every
/// object it needs, while peerwall's own objects fail closed. A server running Liqo's schema
/// prunes peerwall's extensions: the reason peerwall keeps its intent in its own CRD.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn installing_peerwall_leaves_liqo_crd_and_objects_alone() {
    let server = api_server();
    let client = server.client().await;
    install_liqo_crd(&client).await;
    let created = create_liqo_shapes(&client, "").await;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let before = serde_json::to_string(
        &crds
            .get("firewallconfigurations.networking.liqo.io")
            .await
            .unwrap(),
    )
    .unwrap();
    let objects_before = liqo_versions(&client).await;
    assert_eq!(objects_before.len(), created.len());
    let o = Command::new(kube_bin_dir().join("kubectl"))
        .arg("--kubeconfig")
        .arg(&server.kubeconfig)
        .args(["apply", "-k"])
        .arg(repo("deploy"))
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "kubectl apply -k deploy/: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let applied = String::from_utf8_lossy(&o.stdout);
    assert!(
        applied.contains("firewallconfigurations.peerwall.io created"),
        "{applied}"
    );
    assert!(!applied.contains("networking.liqo.io"), "{applied}");
    let after = serde_json::to_string(
        &crds
            .get("firewallconfigurations.networking.liqo.io")
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(before, after, "Liqo's CRD is byte-identical");
    assert_eq!(
        objects_before,
        liqo_versions(&client).await,
        "Liqo's objects untouched"
    );
    // peerwall's webhook is registered but has no endpoints here: it must fail closed for
    // peerwall's objects (once the API server has picked the configuration up)...
    let ours = fwc_api(&client, "liqo-tenant-cluster1");
    tenant_namespace(&client, "cluster1").await;
    let refusal = eventually(
        "peerwall's webhook to be called",
        Duration::from_secs(30),
        || {
            let ours = ours.clone();
            async move {
                let obj: DynamicObject = serde_json::from_value(thesis_block()).unwrap();
                match ours.create(&PostParams::default(), &obj).await {
                    Err(kube::Error::Api(e)) if e.message.contains("peerwall") => Some(e.message),
                    Ok(o) => {
                        ours.delete(&o.name_any(), &DeleteParams::default())
                            .await
                            .ok();
                        None
                    }
                    Err(_) => None,
                }
            }
        },
    )
    .await;
    assert!(
        refusal.contains("firewallconfigurations.peerwall.io"),
        "{refusal}"
    );
    // ... the controller's label included: no label exempts an object from the webhook
    // (anyone may set one; before, this object was admitted unreviewed). The controller
    // retries until the webhook serves, while each gateway's boot policy holds.
    let mut generated = thesis_block();
    generated["metadata"]["name"] = json!("peerwall-gateway");
    generated["metadata"]["labels"] = json!({"app.kubernetes.io/managed-by": "peerwall"});
    let refused = ours
        .create(
            &PostParams::default(),
            &serde_json::from_value(generated).unwrap(),
        )
        .await
        .expect_err("an object labelled as the controller's is reviewed like any other");
    assert!(refused.to_string().contains("peerwall"), "{refused}");
    // ... and never stand in Liqo's way: every shape is created again and updated.
    let again = create_liqo_shapes(&client, "-2").await;
    for (ns, name) in &again {
        let api = liqo_api(&client, ns);
        let patch = json!({"metadata": {"labels": {"liqo.io/touched": "yes"}}});
        api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap_or_else(|e| panic!("{ns}/{name}: update refused: {e}"));
    }
    // Liqo's schema has no sets: the API server drops them from Liqo's objects.
    let mut with_sets = thesis_block();
    with_sets["apiVersion"] = json!("networking.liqo.io/v1beta1");
    with_sets["metadata"]["name"] = json!("with-sets");
    with_sets["spec"]["table"]["sets"] =
        json!([{"name": "s", "keyType": "ipv4_addr", "elements": [{"key": "10.0.0.1"}]}]);
    let stored = liqo_api(&client, "liqo-tenant-cluster1")
        .create(
            &PostParams::default(),
            &serde_json::from_value(with_sets).unwrap(),
        )
        .await
        .unwrap();
    assert!(
        stored.data["spec"]["table"].get("sets").is_none(),
        "pruned by Liqo's schema: {}",
        stored.data["spec"]
    );
}

/// The agent enforces Liqo's own objects only when asked (`--liqo-selector`), and then only
/// reads them: no finalizer, no status, no change of any kind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_enforces_liqo_objects_only_on_request_and_read_only() {
    let t = Topology::new();
    let server = api_server();
    let client = server.client().await;
    server.install_crds();
    install_liqo_crd(&client).await;
    create_liqo_shapes(&client, "").await;
    let versions = liqo_versions(&client).await;
    // Default selection: peerwall's objects only; Liqo's tables never appear.
    let plain = agent(
        &server,
        &t.gateway,
        "gw-plain",
        "peerwall.io/target=gateway",
    );
    tenant_namespace(&client, "cluster1").await;
    let api = fwc_api(&client, "liqo-tenant-cluster1");
    let obj: DynamicObject = serde_json::from_value(thesis_block()).unwrap();
    api.create(&PostParams::default(), &obj).await.unwrap();
    applied(&api, "block-pod1-pod2", "gw-plain").await;
    let tables = nft_tables(&t.gateway);
    assert!(tables.contains("table_name"), "{tables}");
    assert!(!tables.contains("remap-podcidr"), "{tables}");
    drop(plain);
    // Opt-in: Liqo's gateway objects for peer cluster-b, enforced next to peerwall's.
    let _optin = agent_with(
        &server,
        &t.gateway,
        "gw-liqo",
        "peerwall.io/target=gateway",
        &[
            "--liqo-selector",
            "networking.liqo.io/firewall-category=gateway,networking.liqo.io/firewall-unique=cluster-b",
        ],
    );
    eventually(
        "Liqo's remapping tables",
        Duration::from_secs(20),
        || async {
            let tables = nft_tables(&t.gateway);
            (tables.contains("remap-podcidr") && tables.contains("remap-externalcidr"))
                .then_some(())
        },
    )
    .await;
    applied(&api, "block-pod1-pod2", "gw-liqo").await;
    let listed = String::from_utf8_lossy(
        &in_ns(&t.gateway, "nft", &["list", "table", "ip", "remap-podcidr"]).stdout,
    )
    .into_owned();
    assert!(listed.contains("dnat prefix to 10.243.0.0/16"), "{listed}");
    // Objects of other peers or other enforcers are not taken.
    assert!(!nft_tables(&t.gateway).contains("masquerade-bypass"));
    // Nothing was written to Liqo's objects: same resourceVersions, no finalizer, no status.
    assert_eq!(versions, liqo_versions(&client).await);
    let remap = liqo_api(&client, "liqo-tenant-cluster-b")
        .get("cluster-b-remap-podcidr")
        .await
        .unwrap();
    assert!(remap.finalizers().is_empty());
    assert!(remap.data.get("status").is_none(), "{:?}", remap.data);
}

/// Where Liqo serves FirewallConfigurationBindings (liqotech/liqo PR #3290), Liqo applies in a
/// gateway only the configurations bound to its pod, and peerwall takes Liqo's objects
/// (`--liqo-selector` here; the bpf datapath's `--observe` alike) on the same terms: the
/// binding examples (`examples/liqo/bindings/`) are admitted by Liqo's own CRD; the pod-CIDR
/// remapping bound to this gateway's pod is in force, the external-CIDR one its labels select
/// too is not while only the other replica is bound to it, and is once this pod is; the
/// binding deleted, its table goes. Liqo's objects stay untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn liqo_objects_count_only_where_a_binding_names_the_gateway() {
    let t = Topology::new();
    let server = api_server();
    let client = server.client().await;
    server.install_crds();
    install_liqo_crd(&client).await;
    install_liqo_binding_crd(&client).await;
    create_liqo_shapes(&client, "").await;
    let (pod_ns, pod) = ("liqo-tenant-cluster-b", "gw-cluster-b-6d5f7c8b9-k2xqz");
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo("examples/liqo/bindings"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert_eq!(files.len(), 3, "{files:?}");
    for f in &files {
        let mut v: serde_json::Value =
            serde_yaml::from_str(&std::fs::read_to_string(f).unwrap()).unwrap();
        // Their owners' uids are the examples' (the garbage collector would take them).
        v["metadata"]
            .as_object_mut()
            .unwrap()
            .remove("ownerReferences");
        let ns = v["metadata"]["namespace"].as_str().unwrap().to_string();
        binding_api(&client, Some(&ns))
            .create(&PostParams::default(), &serde_json::from_value(v).unwrap())
            .await
            .unwrap_or_else(|e| panic!("{}: Liqo's CRD refused it: {e}", f.display()));
    }
    let versions = liqo_versions(&client).await;
    let target = format!("Pod:{pod_ns}/{pod}");
    let _agent = agent_with(
        &server,
        &t.gateway,
        "gw-bound",
        "peerwall.io/target=gateway",
        &[
            "--liqo-selector",
            "networking.liqo.io/firewall-category=gateway,networking.liqo.io/firewall-unique=cluster-b",
            "--liqo-target",
            &target,
        ],
    );
    eventually(
        "the bound remapping's table",
        Duration::from_secs(20),
        || async {
            nft_tables(&t.gateway)
                .contains("remap-podcidr")
                .then_some(())
        },
    )
    .await;
    // Selected by its labels, bound to the other replica only.
    bind(
        &client,
        pod_ns,
        "cluster-b-remap-externalcidr",
        pod_ns,
        "gw-cluster-b-6d5f7c8b9-zz9wq",
    )
    .await;
    // Bound to this pod, but not selected (a fabric object): a binding only narrows what the
    // selector picks, it never brings in another object.
    bind(&client, pod_ns, "cluster-b-masquerade-bypass", pod_ns, pod).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let tables = nft_tables(&t.gateway);
    assert!(!tables.contains("remap-externalcidr"), "{tables}");
    assert!(!tables.contains("masquerade-bypass"), "{tables}");
    // Bound here too: in force.
    bind(&client, pod_ns, "cluster-b-remap-externalcidr", pod_ns, pod).await;
    eventually(
        "the remapping bound to this pod too",
        Duration::from_secs(20),
        || async {
            nft_tables(&t.gateway)
                .contains("remap-externalcidr")
                .then_some(())
        },
    )
    .await;
    // The pod-CIDR binding deleted: Liqo removes its table, and so does peerwall.
    binding_api(&client, Some(pod_ns))
        .delete(
            &format!("cluster-b-remap-podcidr-{pod}"),
            &DeleteParams::default(),
        )
        .await
        .unwrap();
    eventually(
        "the unbound remapping's table gone",
        Duration::from_secs(20),
        || async {
            let tables = nft_tables(&t.gateway);
            (!tables.contains("remap-podcidr") && tables.contains("remap-externalcidr"))
                .then_some(())
        },
    )
    .await;
    assert_eq!(versions, liqo_versions(&client).await);
}
