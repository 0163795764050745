//! What every Kubernetes test uses: a real etcd + kube-apiserver + kube-controller-manager
//! per test and peerwall processes against it (`peerwall_testkit::kube`), objects,
//! conditions, certificates.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::Client;
use serde_json::json;

use peerwall_testkit::prelude::*;

pub(crate) use peerwall_testkit::kube::{free_port, kube_bin_dir, ApiServer, Proc};
pub(crate) use peerwall_testkit::wait::eventually;

/// A real API server for one test, running this build's peerwall.
pub(crate) fn api_server() -> ApiServer {
    ApiServer::start(peerwall())
}

/// Liqo's `Configuration` of `peer` in its tenant namespace: the peer's pod CIDRs (`pod`) as
/// Liqo writes them when the peering's network is set up, before its gateways exist
/// (`pkg/liqoctl/network/handler.go`, `RunConnect` → `initNetworkConfigs`). Until it exists
/// peerwall drops everything from the peer's tunnel.
pub(crate) async fn liqo_configuration(client: &Client, peer: &str, pod: &[&str]) {
    let configs: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        &format!("liqo-tenant-{peer}"),
        &peerwall::k8s::liqo_configuration_resource(),
    );
    let cfg: DynamicObject =
        serde_yaml::from_str(&peerwall_testkit::liqo::configuration(peer, pod)).unwrap();
    configs.create(&PostParams::default(), &cfg).await.unwrap();
}

pub(crate) fn fwc_api(client: &Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, &peerwall::k8s::fwc_resource())
}

/// Create a namespace (an existing one is fine).
pub(crate) async fn namespace(client: &Client, name: &str, labels: serde_json::Value) {
    let api: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace =
        serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).unwrap();
    match api.create(&PostParams::default(), &ns).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("namespace {name}: {e}"),
    }
}

/// Liqo's tenant namespace of `peer` (`liqo-tenant-<peer>`), labelled as Liqo labels it: the
/// namespace where peerwall takes that peer's gateway objects from.
pub(crate) async fn tenant_namespace(client: &Client, peer: &str) {
    namespace(client, &format!("liqo-tenant-{peer}"), tenant_labels(peer)).await;
}

pub(crate) async fn pod(
    client: &Client,
    ns: &str,
    name: &str,
    ip: &str,
    labels: serde_json::Value,
    node: Option<&str>,
) {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let mut spec = json!({"containers": [{"name": "c", "image": "registry.invalid/app"}]});
    if let Some(n) = node {
        spec["nodeName"] = json!(n);
    }
    let p: Pod =
        serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}, "spec": spec}))
            .unwrap();
    running(&api, &p, ip).await;
}

/// Create `pod` and give it `ip`, Running (no kubelet: its status written directly).
pub(crate) async fn running(api: &Api<Pod>, pod: &Pod, ip: &str) {
    api.create(&PostParams::default(), pod).await.unwrap();
    let name = pod.metadata.name.as_deref().unwrap();
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}})),
    )
    .await
    .unwrap();
}

pub(crate) async fn delete_pod(client: &Client, ns: &str, name: &str) {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    api.delete(
        name,
        &DeleteParams {
            grace_period_seconds: Some(0),
            ..Default::default()
        },
    )
    .await
    .unwrap();
}

/// Elements of a set in a FirewallConfiguration.
pub(crate) fn set_elements(obj: &DynamicObject, set: &str) -> BTreeSet<String> {
    obj.data
        .pointer("/spec/table/sets")
        .and_then(|v| v.as_array())
        .into_iter()
        .flatten()
        .filter(|s| s["name"] == set)
        .flat_map(|s| s["elements"].as_array().cloned().unwrap_or_default())
        .filter_map(|e| e["key"].as_str().map(str::to_string))
        .collect()
}

/// The addresses of an AddressSet slice, when it fills `set`.
pub(crate) fn slice_addresses(obj: &DynamicObject, set: &str) -> BTreeSet<String> {
    if obj.data["spec"]["set"] != set {
        return BTreeSet::new();
    }
    obj.data["spec"]["addresses"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| a.as_str().map(str::to_string))
        .collect()
}

pub(crate) fn slice_api(client: &Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, &peerwall::k8s::address_set_resource())
}

/// What set `set` of a tenant's gateway configuration holds: its inline elements and the
/// addresses of its AddressSet slices (`None` until the configuration exists).
pub(crate) async fn gateway_set(
    client: &Client,
    tenant: &str,
    set: &str,
) -> Option<BTreeSet<String>> {
    let o = fwc_api(client, tenant)
        .get_opt("peerwall-gateway")
        .await
        .ok()??;
    let mut out = set_elements(&o, set);
    for s in slice_api(client, tenant)
        .list(&Default::default())
        .await
        .ok()?
        .items
    {
        out.extend(slice_addresses(&s, set));
    }
    Some(out)
}

pub(crate) fn ips(v: &[&str]) -> BTreeSet<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// This host's condition on an object: (type, message).
pub(crate) async fn condition(
    api: &Api<DynamicObject>,
    name: &str,
    host: &str,
) -> Option<(String, String, i64, i64)> {
    let o = api.get_opt(name).await.ok()??;
    let generation = o.metadata.generation.unwrap_or_default();
    let c = o
        .data
        .pointer("/status/conditions")?
        .as_array()?
        .iter()
        .find(|c| c["host"] == host)?
        .clone();
    Some((
        c["type"].as_str()?.to_string(),
        c["message"].as_str().unwrap_or_default().to_string(),
        c["observedGeneration"].as_i64().unwrap_or_default(),
        generation,
    ))
}

pub(crate) async fn applied(api: &Api<DynamicObject>, name: &str, host: &str) {
    applied_within(api, name, host, Duration::from_secs(20)).await
}

/// [`applied`], waiting up to `bound`.
pub(crate) async fn applied_within(
    api: &Api<DynamicObject>,
    name: &str,
    host: &str,
    bound: Duration,
) {
    eventually(&format!("{name}: Applied on {host}"), bound, || async {
        let (t, _, observed, generation) = condition(api, name, host).await?;
        (t == "Applied" && observed == generation).then_some(())
    })
    .await
}

pub(crate) fn tenant_labels(id: &str) -> serde_json::Value {
    json!({"liqo.io/tenant-namespace": "true", "liqo.io/remote-cluster-id": id})
}

pub(crate) fn openssl(args: &[&str]) {
    let o = Command::new("openssl").args(args).output().unwrap();
    assert!(
        o.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A CA and a server certificate for 127.0.0.1 in `dir`; returns the CA's PEM.
pub(crate) fn webhook_certs(dir: &Path) -> String {
    let p = |f: &str| dir.join(f).to_str().unwrap().to_string();
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        &p("wh-ca.key"),
        "-out",
        &p("wh-ca.crt"),
        "-days",
        "2",
        "-subj",
        "/CN=peerwall-test-ca",
    ]);
    server_cert(dir);
    std::fs::read_to_string(dir.join("wh-ca.crt")).unwrap()
}

/// A (new) server certificate for 127.0.0.1 from the CA in `dir`: wh.crt / wh.key.
pub(crate) fn server_cert(dir: &Path) {
    let p = |f: &str| dir.join(f).to_str().unwrap().to_string();
    std::fs::write(
        dir.join("wh.ext"),
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        &p("wh.key.new"),
        "-out",
        &p("wh.csr"),
        "-subj",
        "/CN=peerwall-webhook",
    ]);
    openssl(&[
        "x509",
        "-req",
        "-in",
        &p("wh.csr"),
        "-CA",
        &p("wh-ca.crt"),
        "-CAkey",
        &p("wh-ca.key"),
        "-CAcreateserial",
        "-out",
        &p("wh.crt.new"),
        "-days",
        "2",
        "-extfile",
        &p("wh.ext"),
    ]);
    // Swap both files in (as a Secret volume update does).
    std::fs::rename(dir.join("wh.key.new"), dir.join("wh.key")).unwrap();
    std::fs::rename(dir.join("wh.crt.new"), dir.join("wh.crt")).unwrap();
}

/// Serial number of the certificate a TLS server presents.
pub(crate) fn served_serial(addr: &str) -> String {
    let o = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "openssl s_client -connect {addr} </dev/null 2>/dev/null | openssl x509 -noout -serial"
        ))
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}

/// The thesis's example (a Liqo object) as a peerwall object for gateways of peer `cluster1`:
/// the same spec under `peerwall.io/v1alpha1` with peerwall's labels.
pub(crate) fn thesis_block() -> serde_json::Value {
    let y = std::fs::read_to_string(repo("examples/thesis-block.yaml")).unwrap();
    let mut v: serde_json::Value = serde_yaml::from_str(&y).unwrap();
    v["apiVersion"] = json!("peerwall.io/v1alpha1");
    v["metadata"]["labels"] = json!({
        "peerwall.io/target": "gateway",
        "peerwall.io/remote-cluster-id": "cluster1",
    });
    v
}

/// Run `peerwall agent --source kube` enforcing in `gw`'s namespace.
pub(crate) fn agent(server: &ApiServer, gw: &NetNs, host: &str, selector: &str) -> Proc {
    agent_with(server, gw, host, selector, &[])
}

pub(crate) fn agent_with(
    server: &ApiServer,
    gw: &NetNs,
    host: &str,
    selector: &str,
    extra: &[&str],
) -> Proc {
    let mut args = vec![
        "agent",
        "--source",
        "kube",
        "--netns",
        gw.name(),
        "--host",
        host,
        "--selector",
        selector,
        "--metrics-addr",
        "127.0.0.1:0",
        "--interval-ms",
        "200",
    ];
    args.extend_from_slice(extra);
    server.peerwall(&format!("agent-{host}"), &args)
}

/// A bpf pin directory removed (datapath detached) on drop.
pub(crate) struct BpfPins {
    pub(crate) dir: String,
    pub(crate) ns: String,
}

impl Drop for BpfPins {
    fn drop(&mut self) {
        let _ = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", self.ns))
            .arg(peerwall())
            .args(["delete", "--backend", "bpf", "--pin-dir", &self.dir])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub(crate) fn nft_tables(ns: &NetNs) -> String {
    String::from_utf8_lossy(&in_ns(ns, "nft", &["list", "tables"]).stdout).into_owned()
}

/// ClusterNetworkPolicies (`policy.networking.k8s.io/v1alpha2`), once the server serves them
/// (the controller installs their CRD where there is none).
pub(crate) async fn cluster_network_policies(client: &Client) -> Api<DynamicObject> {
    let resource = kube::api::ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk(
            "policy.networking.k8s.io",
            "v1alpha2",
            "ClusterNetworkPolicy",
        ),
        "clusternetworkpolicies",
    );
    let cnps: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
    eventually(
        "the ClusterNetworkPolicy CRD, installed by the controller",
        Duration::from_secs(90),
        || {
            let cnps = cnps.clone();
            async move { cnps.list(&Default::default()).await.ok() }
        },
    )
    .await;
    cnps
}
