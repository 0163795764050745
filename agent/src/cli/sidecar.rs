//! `peerwall sidecar-patch`: the JSON patch that makes peerwall a container of a Liqo gateway
//! template (`WgGatewayServerTemplate` / `WgGatewayClientTemplate`), computed from the
//! template itself so that it adds the container and its volume when absent and replaces them
//! when present: applying it twice leaves one peerwall container, with the image asked for.
//! Liqo's templates are custom resources: no strategic merge by container name, and a JSON
//! patch appending to `containers/-` would add a second container on every run.

use std::io::Read;

use anyhow::Context;
use serde_json::{json, Value};

use super::{input, out, runtime, BackendKind, CliError, PathBuf};

/// Name of the container in the gateway pod (what the controller's coverage check looks for).
pub use crate::protection::coverage::SIDECAR_CONTAINER as CONTAINER;
const VOLUME: &str = "peerwall-bpffs";
/// Where a gateway template keeps its pod spec: a Deployment under `spec.template.spec`
/// (Liqo's chart, `deployments/liqo/templates/liqo-wireguard-gateway-server-template.yaml`
/// and `…-client-template.yaml`: containers `gateway`, `wireguard`, `geneve`, volumes `ipc`
/// and `wireguard-config`).
const POD_SPEC: &str = "/spec/template/spec/deployment/spec/template/spec";

/// Arguments of `peerwall sidecar-patch`.
#[derive(clap::Args, Debug)]
pub struct SidecarArgs {
    /// The template as JSON (`kubectl get … -o json`); standard input when omitted or `-`.
    #[arg(short = 'f', long = "file")]
    pub file: Option<PathBuf>,
    /// The peerwall image: the one `deploy/` installed, e.g. `kubectl -n peerwall-system get
    /// deploy peerwall-controller -o jsonpath='{.spec.template.spec.containers[0].image}'`.
    #[arg(long)]
    pub image: String,
    /// Backend of the sidecar.
    #[arg(long, value_enum, default_value_t = BackendKind::Nftables)]
    pub backend: BackendKind,
}

/// The sidecar container for `image` and `backend` (the template's `{{ .ClusterID }}` is
/// filled in by Liqo for each gateway).
pub fn container(image: &str, backend: BackendKind) -> Value {
    let mut args = vec![
        "agent".to_string(),
        "--source=kube".into(),
        format!("--backend={backend}"),
        "--selector=peerwall.io/target=gateway,peerwall.io/remote-cluster-id={{ .ClusterID }}"
            .into(),
        "--host=$(NODE_NAME)".into(),
        "--boot-peer={{ .ClusterID }}".into(),
        "--metrics-addr=0.0.0.0:9095".into(),
        "--log-format=json".into(),
    ];
    if backend == BackendKind::Bpf {
        // Liqo's NAT objects of this gateway, read only: the datapath classifies at ingress.
        args.push("--observe=networking.liqo.io/firewall-category=gateway,networking.liqo.io/firewall-unique={{ .ClusterID }}".into());
        args.push("--observe=networking.liqo.io/firewall-category=gateway,networking.liqo.io/firewall-subcategory=ip-mapping".into());
        // Where Liqo binds its configurations (FirewallConfigurationBinding), those bound to
        // this gateway pod.
        args.push("--liqo-target=Pod:$(POD_NAMESPACE)/$(POD_NAME)".into());
    }
    json!({
        "name": CONTAINER,
        "image": image,
        "args": args,
        "env": [
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        ],
        "ports": [{"name": "pw-metrics", "containerPort": 9095, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": 9095}},
        "securityContext": {"capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN", "BPF", "PERFMON"]}},
        "volumeMounts": [{"name": VOLUME, "mountPath": "/sys/fs/bpf", "mountPropagation": "HostToContainer"}],
    })
}

/// Name of the init container that puts the boot policy in force.
pub const BOOT_CONTAINER: &str = "peerwall-boot";

/// The init container: `peerwall boot` for the gateway's peer, before Liqo's containers
/// (init containers complete before any other starts) create the tunnel.
pub fn boot_container(image: &str) -> Value {
    json!({
        "name": BOOT_CONTAINER,
        "image": image,
        "args": ["boot", "--peer={{ .ClusterID }}"],
        "securityContext": {"capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN"]}},
    })
}

/// Why a template cannot take the sidecar.
#[derive(Debug, thiserror::Error)]
pub enum SidecarError {
    /// Not a gateway template.
    #[error("{0} is not a list: is this a Liqo gateway template (WgGatewayServerTemplate or WgGatewayClientTemplate, `kubectl get … -o json`)?")]
    NoContainers(String),
}

/// One JSON patch operation putting `value` as the element named `name` of the list at
/// `list`: `replace` at its index when present, `add` at the end otherwise (`add` of the whole
/// list when the list is absent and `create_list`).
fn upsert(template: &Value, list: &str, name: &str, value: Value) -> Option<Value> {
    match template.pointer(list) {
        Some(Value::Array(items)) => Some(match items.iter().position(|i| i["name"] == name) {
            Some(at) => json!({"op": "replace", "path": format!("{list}/{at}"), "value": value}),
            None => json!({"op": "add", "path": format!("{list}/-"), "value": value}),
        }),
        _ => None,
    }
}

/// The patch for `template`: the container (added or replaced), the boot init container
/// (added, replaced, or the init container list created) and the bpffs volume (likewise).
pub fn patch(template: &Value, image: &str, backend: BackendKind) -> Result<Value, SidecarError> {
    let containers = format!("{POD_SPEC}/containers");
    let c = upsert(template, &containers, CONTAINER, container(image, backend))
        .ok_or(SidecarError::NoContainers(containers))?;
    let inits = format!("{POD_SPEC}/initContainers");
    let boot = boot_container(image);
    let i = upsert(template, &inits, BOOT_CONTAINER, boot.clone())
        .unwrap_or_else(|| json!({"op": "add", "path": inits, "value": [boot]}));
    let volume =
        json!({"name": VOLUME, "hostPath": {"path": "/sys/fs/bpf", "type": "DirectoryOrCreate"}});
    let volumes = format!("{POD_SPEC}/volumes");
    let v = upsert(template, &volumes, VOLUME, volume.clone())
        .unwrap_or_else(|| json!({"op": "add", "path": volumes, "value": [volume]}));
    Ok(json!([c, i, v]))
}

/// `peerwall sidecar-patch`.
pub(super) fn sidecar_patch(a: SidecarArgs) -> Result<(), CliError> {
    let text = match a.file.as_ref().filter(|f| f.as_os_str() != "-") {
        Some(f) => std::fs::read_to_string(f)
            .with_context(|| format!("reading {}", f.display()))
            .map_err(input)?,
        None => {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .context("reading the template from standard input")
                .map_err(input)?;
            s
        }
    };
    let template: Value = serde_json::from_str(&text)
        .context("the template is not JSON (`kubectl get … -o json`)")
        .map_err(input)?;
    let p = patch(&template, &a.image, a.backend).map_err(input)?;
    out(&format!(
        "{}\n",
        serde_json::to_string(&p).map_err(runtime)?
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(containers: Value, volumes: Option<Value>) -> Value {
        let mut spec = json!({"containers": containers});
        if let Some(v) = volumes {
            spec["volumes"] = v;
        }
        json!({"spec": {"template": {"spec": {"deployment": {"spec": {"template": {"spec": spec}}}}}}})
    }

    /// Applies the add/replace operations this module emits (test oracle: RFC 6902 semantics
    /// of those two operations on arrays and objects).
    fn apply(doc: &mut Value, patch: &Value) {
        for op in patch.as_array().unwrap() {
            let path = op["path"].as_str().unwrap();
            let (parent, last) = path.rsplit_once('/').unwrap();
            let target = doc.pointer_mut(parent).unwrap();
            match (op["op"].as_str().unwrap(), target) {
                ("add", Value::Array(a)) if last == "-" => a.push(op["value"].clone()),
                ("replace", Value::Array(a)) => {
                    a[last.parse::<usize>().unwrap()] = op["value"].clone()
                }
                ("add", Value::Object(o)) => {
                    o.insert(last.to_string(), op["value"].clone());
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    #[test]
    fn applying_twice_leaves_one_container_with_the_last_image() {
        let mut t = template(json!([{"name": "gateway", "image": "liqo/gateway"}]), None);
        let p = patch(&t, "reg/peerwall:1", BackendKind::Nftables).unwrap();
        apply(&mut t, &p);
        let p = patch(&t, "reg/peerwall:2", BackendKind::Bpf).unwrap();
        apply(&mut t, &p);
        let spec = t.pointer(POD_SPEC).unwrap();
        let names: Vec<&str> = spec["containers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["gateway", "peerwall"]);
        assert_eq!(spec["containers"][1]["image"], "reg/peerwall:2");
        assert!(spec["containers"][1]["args"]
            .to_string()
            .contains("--backend=bpf"));
        assert_eq!(spec["volumes"].as_array().unwrap().len(), 1);
        // One boot init container, with the last image, for the template's peer.
        let inits = spec["initContainers"].as_array().unwrap();
        assert_eq!(inits.len(), 1);
        assert_eq!(inits[0]["image"], "reg/peerwall:2");
        assert_eq!(inits[0]["args"][1], "--peer={{ .ClusterID }}");
        assert!(spec["containers"][1]["args"]
            .to_string()
            .contains("--boot-peer={{ .ClusterID }}"));
    }

    #[test]
    fn a_template_without_containers_is_refused() {
        let e = patch(&json!({"spec": {}}), "x", BackendKind::Nftables).unwrap_err();
        assert!(e.to_string().contains("gateway template"), "{e}");
    }
}
