//! `deploy/` accepted by the API server.

use std::collections::BTreeSet;

use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::ResourceExt;
use serde_json::json;

use crate::support::*;
use peerwall_testkit::prelude::*;

/// `kubectl kustomize DIR` with the real kubectl: the objects of an install, as YAML text.
pub(crate) fn kustomize(dir: &str) -> String {
    let o = std::process::Command::new(kube_bin_dir().join("kubectl"))
        .arg("kustomize")
        .arg(repo(dir))
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "kubectl kustomize {dir}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The objects of an install.
fn objects(dir: &str) -> Vec<DynamicObject> {
    use serde::Deserialize;
    serde_yaml::Deserializer::from_str(&kustomize(dir))
        .map(|doc| serde_yaml::Value::deserialize(doc).unwrap())
        .filter(|v| !v.is_null())
        .map(|v| {
            // An empty document (what kubectl 1.20's kustomize left of a `$patch: delete`)
            // makes `kubectl apply -k` refuse the whole install.
            assert!(
                v.as_mapping().is_none_or(|m| !m.is_empty()),
                "{dir} renders an empty document: `kubectl apply -k {dir}` refuses it"
            );
            serde_yaml::from_value(v).unwrap()
        })
        .collect()
}

fn kinds_of(objs: &[DynamicObject]) -> BTreeSet<String> {
    objs.iter()
        .map(|o| o.types.as_ref().unwrap().kind.clone())
        .collect()
}

/// The container args of the first container of `kind/name` in an install.
fn args_of(objs: &[DynamicObject], kind: &str, name: &str) -> Vec<String> {
    let o = objs
        .iter()
        .find(|o| o.types.as_ref().unwrap().kind == kind && o.name_any() == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"));
    serde_json::from_value(o.data["spec"]["template"]["spec"]["containers"][0]["args"].clone())
        .unwrap()
}

/// What the shipped manifests say, read off the rendered install: the controller's tunnel
/// match is the default that covers numbered tunnels; the agent's metrics are not on a port
/// Prometheus takes, its /events stays on localhost, it tolerates no taint it was not given
/// and runs on every Linux node; the sidecar install has no DaemonSet; both use one image.
#[test]
fn shipped_manifests_leave_nothing_unprotected_or_exposed() {
    let default = objects("deploy");
    let ctl = args_of(&default, "Deployment", "peerwall-controller");
    assert!(
        !ctl.iter().any(|a| a.starts_with("--tunnel-interface")),
        "the controller keeps the liqo-tunnel* default: {ctl:?}"
    );
    let agent = args_of(&default, "DaemonSet", "peerwall-agent");
    let metrics = agent
        .iter()
        .find_map(|a| a.strip_prefix("--metrics-addr="))
        .unwrap_or("0.0.0.0:9977");
    assert!(!metrics.ends_with(":9090"), "{metrics}");
    assert!(
        agent
            .iter()
            .filter_map(|a| a.strip_prefix("--events-addr="))
            .all(|e| e.starts_with("127.0.0.1:")),
        "/events on localhost: {agent:?}"
    );
    let ds = default
        .iter()
        .find(|o| o.types.as_ref().unwrap().kind == "DaemonSet")
        .unwrap();
    let pod = &ds.data["spec"]["template"]["spec"];
    assert!(
        pod["tolerations"].is_null(),
        "tolerations are the user's choice: {}",
        pod["tolerations"]
    );
    assert_eq!(
        pod["nodeSelector"],
        json!({"kubernetes.io/os": "linux"}),
        "every node a gateway may land on"
    );
    let sidecar = objects("deploy/sidecar");
    let kinds = kinds_of(&sidecar);
    assert!(!kinds.contains("DaemonSet"), "{kinds:?}");
    assert!(sidecar
        .iter()
        .any(|o| o.name_any() == "peerwall-gateway-sidecar"));
    let images = |objs: &[DynamicObject]| -> BTreeSet<String> {
        objs.iter()
            .flat_map(|o| {
                o.data["spec"]["template"]["spec"]["containers"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .map(|c| c["image"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(images(&default), images(&sidecar));
    assert_eq!(images(&default).len(), 1, "{:?}", images(&default));
    // The image of this release: tagged with the version `peerwall version` prints.
    assert_eq!(
        images(&default).into_iter().collect::<Vec<_>>(),
        [format!("peerwall:{}", env!("CARGO_PKG_VERSION"))],
        "deploy/ names another release's image than Cargo.toml's version"
    );
    // No manual TLS step: the webhook issues its own certificate (no mounted Secret, no
    // cert-manager annotation), with API access for it.
    let wh = args_of(&default, "Deployment", "peerwall-webhook");
    assert!(!wh.iter().any(|a| a.starts_with("--tls-")), "{wh:?}");
    let sa = default
        .iter()
        .find(|o| {
            o.types.as_ref().unwrap().kind == "ServiceAccount" && o.name_any() == "peerwall-webhook"
        })
        .unwrap();
    assert_ne!(sa.data["automountServiceAccountToken"], json!(false));
    // Nothing peerwall installs aggregates into the namespace admin/edit/view roles.
    for o in &default {
        let labels = o.labels();
        assert!(
            !labels
                .keys()
                .any(|k| k.starts_with("rbac.authorization.k8s.io/aggregate-to-")),
            "{} aggregates: {labels:?}",
            o.name_any()
        );
    }
    // The overlays change exactly their choice.
    let agent_of = |dir: &str| args_of(&objects(dir), "DaemonSet", "peerwall-agent");
    let bpf = agent_of("deploy/bpf");
    assert!(
        bpf.contains(&"--backend=bpf".to_string())
            && !bpf.iter().any(|a| a == "--backend=nftables"),
        "{bpf:?}"
    );
    let audit = agent_of("deploy/audit");
    assert!(audit.contains(&"--audit".to_string()), "{audit:?}");
    assert_eq!(audit.len(), agent.len() + 1, "{audit:?}");
    let nodes = objects("deploy/gateway-nodes");
    let ds = nodes
        .iter()
        .find(|o| o.types.as_ref().unwrap().kind == "DaemonSet")
        .unwrap();
    assert_eq!(
        ds.data["spec"]["template"]["spec"]["nodeSelector"],
        json!({"kubernetes.io/os": "linux", "peerwall.io/gateway-node": "true"})
    );
    let cm = objects("deploy/cert-manager");
    let wh = args_of(&cm, "Deployment", "peerwall-webhook");
    assert!(wh.iter().any(|a| a == "--tls-cert=/tls/tls.crt"), "{wh:?}");
    let vwc = cm
        .iter()
        .find(|o| o.types.as_ref().unwrap().kind == "ValidatingWebhookConfiguration")
        .unwrap();
    assert_eq!(
        vwc.annotations()
            .get("cert-manager.io/inject-ca-from")
            .map(String::as_str),
        Some("peerwall-system/peerwall-webhook")
    );
    assert!(kinds_of(&cm).contains("Certificate"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deploy_manifests_pass_server_side_dry_run() {
    // One API server for every install: a dry run persists nothing, so each install meets the
    // server as if it were the first.
    let server = api_server();
    let client = server.client().await;
    server.install_crds();
    let target_ns = "peerwall-system".to_string();
    // The namespace the others live in must exist for real.
    namespace(&client, &target_ns, json!({})).await;
    let discovery = kube::Discovery::new(client.clone()).run().await.unwrap();
    for dir in [
        "deploy",
        "deploy/sidecar",
        "deploy/bpf",
        "deploy/audit",
        "deploy/gateway-nodes",
        "deploy/cert-manager",
    ] {
        dry_run(&client, &discovery, &target_ns, dir).await;
    }
}

async fn dry_run(client: &kube::Client, discovery: &kube::Discovery, target_ns: &str, dir: &str) {
    let mut kinds = BTreeSet::new();
    let file = dir;
    for obj in objects(dir) {
        {
            let tm = obj.types.clone().unwrap();
            // cert-manager's kinds need cert-manager installed, which this API server has not.
            if tm.api_version.starts_with("cert-manager.io/") {
                continue;
            }
            let (group, version) = tm
                .api_version
                .split_once('/')
                .unwrap_or(("", &tm.api_version));
            let gvk = kube::api::GroupVersionKind::gvk(group, version, &tm.kind);
            let (ar, caps) = discovery
                .resolve_gvk(&gvk)
                .unwrap_or_else(|| panic!("{file}: unknown kind {gvk:?}"));
            let api: Api<DynamicObject> = if caps.scope == kube::discovery::Scope::Namespaced {
                let ns = obj.namespace().unwrap_or_else(|| target_ns.to_string());
                Api::namespaced_with(client.clone(), &ns, &ar)
            } else {
                Api::all_with(client.clone(), &ar)
            };
            let mut obj = obj;
            if caps.scope == kube::discovery::Scope::Namespaced && obj.metadata.namespace.is_none()
            {
                obj.metadata.namespace = Some(target_ns.to_string());
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
    let mut expected = vec![
        "CustomResourceDefinition",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "Service",
        "ValidatingWebhookConfiguration",
    ];
    if dir != "deploy/sidecar" {
        expected.push("DaemonSet");
    }
    for k in expected {
        assert!(kinds.contains(k), "{dir} has no {k}: {kinds:?}");
    }
}

/// `kubectl --kubeconfig … ARGS` against `server`, with `stdin`; must succeed.
pub(crate) fn kubectl(server: &ApiServer, args: &[&str], stdin: Option<&str>) -> String {
    use std::io::Write;
    let mut c = std::process::Command::new(kube_bin_dir().join("kubectl"));
    c.arg("--kubeconfig")
        .arg(&server.kubeconfig)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = c.spawn().unwrap();
    if let Some(s) = stdin {
        child.stdin.take().unwrap().write_all(s.as_bytes()).unwrap();
    }
    drop(child.stdin.take());
    let o = child.wait_with_output().unwrap();
    assert!(
        o.status.success(),
        "kubectl {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Sidecar mode as the README runs it, on a real API server: Liqo's gateway template (its CRD
/// shape: a Deployment under spec.template.spec.deployment) patched with what
/// `peerwall sidecar-patch` computes, twice, the second time with another image: one peerwall
/// container, the last image, the gateway's own container untouched.
#[test]
fn the_sidecar_patch_is_idempotent_on_a_real_template() {
    let server = api_server();
    let crd = json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "wggatewayservertemplates.networking.liqo.io"},
        "spec": {"group": "networking.liqo.io", "scope": "Namespaced",
            "names": {"plural": "wggatewayservertemplates", "singular": "wggatewayservertemplate",
                "kind": "WgGatewayServerTemplate"},
            "versions": [{"name": "v1beta1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object",
                    "x-kubernetes-preserve-unknown-fields": true}}}]}});
    kubectl(&server, &["apply", "-f", "-"], Some(&crd.to_string()));
    kubectl(
        &server,
        &[
            "wait",
            "--for=condition=established",
            "--timeout=30s",
            "crd/wggatewayservertemplates.networking.liqo.io",
        ],
        None,
    );
    let template = json!({
        "apiVersion": "networking.liqo.io/v1beta1", "kind": "WgGatewayServerTemplate",
        "metadata": {"name": "wireguard-server", "namespace": "default"},
        "spec": {"template": {"spec": {"deployment": {"spec": {"template": {"spec": {
            "containers": [{"name": "gateway", "image": "liqo/gateway:v1"}]}}}}}}}});
    // The resource is served a moment after it is established.
    let mut created = false;
    for _ in 0..50 {
        let o = std::process::Command::new(kube_bin_dir().join("kubectl"))
            .arg("--kubeconfig")
            .arg(&server.kubeconfig)
            .args(["create", "-f", "-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write;
                c.stdin
                    .take()
                    .unwrap()
                    .write_all(template.to_string().as_bytes())?;
                c.wait()
            })
            .unwrap();
        if o.success() {
            created = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    assert!(created, "the template was created");
    let get = || {
        kubectl(
            &server,
            &[
                "get",
                "wggatewayservertemplate",
                "wireguard-server",
                "-o",
                "json",
            ],
            None,
        )
    };
    for image in ["reg/peerwall:1", "reg/peerwall:2"] {
        let o = std::process::Command::new(peerwall())
            .args(["sidecar-patch", "--image", image, "-f", "-"])
            .arg("--backend=bpf")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write;
                let t = get();
                c.stdin.take().unwrap().write_all(t.as_bytes())?;
                c.wait_with_output()
            })
            .unwrap();
        assert!(o.status.success());
        let patch = String::from_utf8_lossy(&o.stdout).into_owned();
        kubectl(
            &server,
            &[
                "patch",
                "wggatewayservertemplate",
                "wireguard-server",
                "--type=json",
                "-p",
                patch.trim(),
            ],
            None,
        );
    }
    let t: serde_json::Value = serde_json::from_str(&get()).unwrap();
    let spec = &t["spec"]["template"]["spec"]["deployment"]["spec"]["template"]["spec"];
    let containers: Vec<(String, String)> = spec["containers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap().to_string(),
                c["image"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        containers,
        [
            ("gateway".to_string(), "liqo/gateway:v1".to_string()),
            ("peerwall".to_string(), "reg/peerwall:2".to_string())
        ]
    );
    assert_eq!(spec["volumes"].as_array().unwrap().len(), 1, "{spec}");
    // The boot policy's init container, once, with the last image.
    let inits = spec["initContainers"].as_array().unwrap();
    assert_eq!(inits.len(), 1, "{spec}");
    assert_eq!(inits[0]["name"], "peerwall-boot");
    assert_eq!(inits[0]["image"], "reg/peerwall:2");
}
