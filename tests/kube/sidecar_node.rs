//! Sidecar mode on the real node, as docs/deploy.md ("Sidecar") installs it: `deploy/sidecar/`
//! (no DaemonSet), the gateway template patched by `peerwall sidecar-patch` (the `peerwall`
//! container and the `peerwall-boot` init container), the shipped ClusterRole bound to the
//! gateway's ServiceAccount. The sidecar enforces inside its own pod, in a container whose
//! `/proc/sys` is read-only: the matrix holds, and a closing ends an exchange for good while
//! both sides keep sending.

use serde_json::{json, Value};

use super::*;

/// The gateway Deployment as Liqo instantiates it from a template `peerwall sidecar-patch`
/// patched: `gateway` (the test's Deployment, YAML) under Liqo's template path, the patch the
/// command printed applied (RFC 6902), `{{ .ClusterID }}` filled in with `peer`.
fn patched_gateway(gateway: &str, image: &str, peer: &str) -> String {
    let deployment: Value = serde_yaml::from_str(gateway).expect("the gateway Deployment");
    let mut template = json!({"apiVersion": "networking.liqo.io/v1beta1",
        "kind": "WgGatewayServerTemplate",
        "metadata": {"name": "wireguard-server", "namespace": "liqo"},
        "spec": {"template": {"spec": {"deployment": deployment}}}});
    let mut cmd = Command::new(peerwall());
    cmd.args(["sidecar-patch", "--image", image])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("peerwall sidecar-patch");
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("stdin");
        stdin
            .write_all(template.to_string().as_bytes())
            .expect("the template to sidecar-patch");
    }
    let out = child.wait_with_output().expect("sidecar-patch's output");
    assert!(
        out.status.success(),
        "sidecar-patch: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let patch: json_patch::Patch =
        serde_json::from_slice(&out.stdout).expect("sidecar-patch prints a JSON patch");
    json_patch::patch(&mut template, &patch).expect("the patch applies to the template");
    let deployment = template["spec"]["template"]["spec"]["deployment"].to_string();
    deployment.replace("{{ .ClusterID }}", peer)
}

/// The sidecar phase: the DaemonSet gone, one gateway pod carrying peerwall (nftables, the
/// default backend), then removed with its binding.
pub(super) fn sidecar_mode(
    node: &Node,
    consumer: &Consumer,
    peer: &str,
    gw_key: &str,
    web: &(String, String),
    db: &(String, String),
) {
    node.kubectl_ok(&[
        "-n",
        "peerwall-system",
        "delete",
        "daemonset",
        "peerwall-agent",
        "--timeout=60s",
    ]);
    node.kubectl_ok(&["apply", "-k", &repo("deploy/sidecar").to_string_lossy()]);
    wait_agents_gone(node, "the agent pods gone");
    let tenant = format!("liqo-tenant-{peer}");
    let binding = format!("peerwall-gw-{peer}");
    node.kubectl_ok(&[
        "create",
        "clusterrolebinding",
        &binding,
        "--clusterrole=peerwall-gateway-sidecar",
        &format!("--serviceaccount={tenant}:default"),
    ]);
    let image = node.kubectl_ok(&[
        "-n",
        "peerwall-system",
        "get",
        "deploy",
        "peerwall-controller",
        "-o",
        "jsonpath={.spec.template.spec.containers[0].image}",
    ]);
    let gateway = patched_gateway(
        &gateway_yaml(peer, gw_key, &consumer.public_key()),
        image.trim(),
        peer,
    );
    node.apply(&gateway);
    let (gw, took) = bring_up_gateway(node, consumer, peer, gw_key, "nftables", None);
    eprintln!(
        "sidecar: enforced {} ms after the gateway pod's namespace appeared",
        took.as_millis()
    );
    assert_matrix(consumer, web, db, "sidecar");
    a_closing_ends_an_exchange_for_good(node, consumer, peer, web, &gw, 6002, "sidecar");
    // In the container `/proc/sys` is read-only: conntrack's mid-stream pickup stays on, and
    // the ended table, in force from the first policy, holds the rule that drops what it
    // would pick up.
    let logs = node.kubectl_ok(&["-n", &tenant, "logs", "deploy/gw", "-c", "peerwall"]);
    assert!(
        logs.contains("mid-stream pickup stays on"),
        "the sidecar could not switch pickup off: {logs}"
    );
    let table = Command::new("nsenter")
        .arg(format!("--net={}", gw.netns.display()))
        .args(["nft", "list", "table", "inet", "peerwall-ended"])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(
        table.contains("mid_stream"),
        "the ended table's mid-stream rule in the sidecar's gateway: {table}"
    );
    delete_gateway(node, peer);
    wait(
        "the sidecar's gateway namespace to go",
        Duration::from_secs(60),
        || {
            pod_netns(Path::new("/proc"), &gw.uid)
                .is_none()
                .then_some(())
        },
    );
    node.kubectl_ok(&["delete", "clusterrolebinding", &binding]);
}
