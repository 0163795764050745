//! Object size: what `peerwall compile` warns of is what the real API server then refuses.

use crate::support::*;
use peerwall_testkit::prelude::*;

/// A FirewallConfiguration whose one set holds `n` addresses.
fn with_addresses(name: &str, n: u32) -> String {
    let mut s = format!(
        "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {{name: {name}, namespace: sized}}\nspec:\n  table:\n    name: {name}\n    family: IPV4\n    sets:\n      - name: pods\n        keyType: ipv4_addr\n        elements:\n"
    );
    for i in 0..n {
        s.push_str(&format!(
            "          - {{key: 10.{}.{}.{}}}\n",
            i >> 16,
            (i >> 8) & 0xff,
            i & 0xff
        ));
    }
    s.push_str("    chains:\n      - name: c\n        type: filter\n        hook: forward\n        policy: drop\n        rules:\n          filterRules:\n            - {name: pods, action: accept, match: [{op: eq, ip: {value: '@pods', position: dst}}]}\n");
    s
}

/// `peerwall compile -f`'s stderr for `yaml` (it must compile: exit 0).
fn compile_warnings(dir: &std::path::Path, name: &str, yaml: &str) -> String {
    let f = dir.join(format!("{name}.yaml"));
    std::fs::write(&f, yaml).unwrap();
    let o = std::process::Command::new(peerwall())
        .arg("compile")
        .arg("-f")
        .arg(&f)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{name}: {err}");
    err
}

/// `kubectl ARGS -f -` with `yaml` on stdin: (success, stderr).
fn kubectl_stdin(server: &ApiServer, args: &[&str], yaml: &str) -> (bool, String) {
    use std::io::Write;
    let mut c = std::process::Command::new(kube_bin_dir().join("kubectl"))
        .arg("--kubeconfig")
        .arg(&server.kubeconfig)
        .args(args)
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    c.stdin.take().unwrap().write_all(yaml.as_bytes()).unwrap();
    let o = c.wait_with_output().unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Three sizes: 1000 addresses (no warning, `kubectl apply` stores it), 20000 (the warning
/// names `kubectl apply`'s annotation: kubectl apply is refused with "Too long", server-side
/// apply stores it), 80000 (the warning says it cannot be stored: etcd refuses it, "request is too
/// large").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compile_warns_of_the_sizes_the_api_server_refuses() {
    let server = api_server();
    let client = server.client().await;
    server.install_crds();
    namespace(&client, "sized", serde_json::json!({})).await;
    let dir = server.dir.join("sized");
    std::fs::create_dir_all(&dir).unwrap();

    let small = with_addresses("small", 1000);
    assert!(
        !compile_warnings(&dir, "small", &small).contains("bytes as JSON"),
        "a small object is not warned of"
    );
    let (ok, err) = kubectl_stdin(&server, &["apply"], &small);
    assert!(ok, "{err}");

    let large = with_addresses("large", 20_000);
    let warned = compile_warnings(&dir, "large", &large);
    assert!(
        warned.contains("`kubectl apply` will fail") && warned.contains("--server-side"),
        "{warned}"
    );
    let (ok, err) = kubectl_stdin(&server, &["apply"], &large);
    assert!(!ok && err.contains("Too long"), "kubectl apply: {err}");
    let (ok, err) = kubectl_stdin(
        &server,
        &["apply", "--server-side", "--field-manager", "test"],
        &large,
    );
    assert!(ok, "kubectl apply --server-side: {err}");

    let huge = with_addresses("huge", 80_000);
    let warned = compile_warnings(&dir, "huge", &huge);
    assert!(
        warned.contains("too large to store") && warned.contains("AddressSets"),
        "{warned}"
    );
    let (ok, err) = kubectl_stdin(&server, &["create"], &huge);
    assert!(
        !ok && err.contains("request is too large"),
        "kubectl create of an object etcd should refuse: {err}"
    );
}
