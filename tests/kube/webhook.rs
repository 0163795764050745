//! The admission webhook through the API server.

use std::process::{Command, Stdio};
use std::time::Duration;

use kube::api::{Api, DeleteParams, DynamicObject, PostParams};
use kube::ResourceExt;
use serde_json::json;

use crate::liqo::liqo_shapes;
use crate::support::*;

/// One webhook registered once, long on purpose: refusal, admission, every Liqo shape, an
/// invalid update and a certificate rotation run against the same registration, as in a cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_refuses_invalid_objects_through_the_api_server() {
    let server = api_server();
    let client = server.client().await;
    install_crd(&client).await;
    let ca = webhook_certs(&server.dir);
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let _wh = server.peerwall(
        "webhook",
        &[
            "webhook",
            "--listen",
            &listen,
            "--tls-cert",
            server.dir.join("wh.crt").to_str().unwrap(),
            "--tls-key",
            server.dir.join("wh.key").to_str().unwrap(),
        ],
    );
    let b64 = {
        use std::io::Write;
        let mut c = Command::new("base64")
            .args(["-w0"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        c.stdin.take().unwrap().write_all(ca.as_bytes()).unwrap();
        String::from_utf8(c.wait_with_output().unwrap().stdout).unwrap()
    };
    let cfg = json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "peerwall-test"},
        "webhooks": [{
            "name": "firewallconfigurations.peerwall.io",
            "clientConfig": {"url": format!("https://{listen}/validate"), "caBundle": b64},
            "rules": [{"apiGroups": ["peerwall.io"], "apiVersions": ["v1alpha1"], "operations": ["CREATE", "UPDATE"], "resources": ["firewallconfigurations", "protectionpolicies"]}],
            "failurePolicy": "Fail",
            "sideEffects": "None",
            "admissionReviewVersions": ["v1"],
        }],
    });
    let vwc: Api<k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration> =
        Api::all(client.clone());
    vwc.create(
        &PostParams::default(),
        &serde_json::from_value(cfg).unwrap(),
    )
    .await
    .unwrap();
    namespace(&client, "liqo-tenant-cluster1", json!({})).await;
    let api = fwc_api(&client, "liqo-tenant-cluster1");
    let mut bad = thesis_block();
    bad["spec"]["table"]["chains"][0]["rules"]["filterRules"][0]["match"][1]["ip"]["value"] =
        json!("10.20.1.300");
    bad["metadata"]["name"] = json!("bad");
    // The API server picks the webhook configuration up asynchronously: retry until refused.
    let msg = eventually(
        "the webhook to refuse the invalid object",
        Duration::from_secs(30),
        || {
            let api = api.clone();
            let bad: DynamicObject = serde_json::from_value(bad.clone()).unwrap();
            async move {
                match api.create(&PostParams::default(), &bad).await {
                    Err(kube::Error::Api(e)) => Some(e.message),
                    Ok(_) => {
                        api.delete("bad", &DeleteParams::default()).await.ok();
                        None
                    }
                    Err(_) => None,
                }
            }
        },
    )
    .await;
    assert!(
        msg.contains("spec.table.chains[0].rules.filterRules[0].match[1].ip.value")
            && msg.contains("10.20.1.300"),
        "refusal must name the field and value: {msg}"
    );
    assert!(msg.contains("firewallconfigurations.peerwall.io"), "{msg}");
    // A valid object is admitted, an invalid update refused.
    let good: DynamicObject = serde_json::from_value(thesis_block()).unwrap();
    let created = api.create(&PostParams::default(), &good).await.unwrap();
    let mut update = serde_json::to_value(&created).unwrap();
    update["spec"]["table"]["chains"][0]["policy"] = json!("deny");
    let err = api
        .replace(
            &created.name_any(),
            &PostParams::default(),
            &serde_json::from_value(update).unwrap(),
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("policy"), "{err}");
    // Every shape Liqo creates, as a peerwall object (only the apiVersion changed), is admitted
    // and stored as written: peerwall's schema takes Liqo's objects whole.
    for (file, mut obj) in liqo_shapes() {
        obj["apiVersion"] = json!("peerwall.io/v1alpha1");
        let ns = obj["metadata"]["namespace"].as_str().unwrap().to_string();
        namespace(&client, &ns, json!({})).await;
        let api = fwc_api(&client, &ns);
        let created = api
            .create(
                &PostParams::default(),
                &serde_json::from_value(obj.clone()).unwrap(),
            )
            .await
            .unwrap_or_else(|e| panic!("{file} refused: {e}"));
        let stored = serde_json::to_value(&created).unwrap();
        assert_eq!(stored["spec"], obj["spec"], "{file}: stored as written");
    }

    // A ProtectionPolicy is checked as the controller checks it: refused with the field path
    // and the value, a valid one admitted.
    let pp: Api<peerwall_intent::ProtectionPolicy> = Api::all(client.clone());
    let policy = |name: &str, protocol: &str| -> peerwall_intent::ProtectionPolicy {
        serde_json::from_value(json!({
            "apiVersion": "peerwall.io/v1alpha1", "kind": "ProtectionPolicy",
            "metadata": {"name": name},
            "spec": {"open": [{"name": "metrics", "from": ["PeerPods"], "podSelector": {},
                               "ports": [{"protocol": protocol, "port": 9090}]}]}}))
        .unwrap()
    };
    let refused = pp
        .create(&PostParams::default(), &policy("bad-proto", "ICMP"))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("spec.open[0].ports[0].protocol") && refused.contains("ICMP"),
        "{refused}"
    );
    pp.create(&PostParams::default(), &policy("good", "TCP"))
        .await
        .unwrap();

    // Certificate rotation: new connections get the new certificate without a restart, and
    // the API server keeps calling the webhook.
    let before = served_serial(&listen);
    assert!(before.starts_with("serial="), "{before}");
    std::thread::sleep(Duration::from_millis(1100));
    server_cert(&server.dir);
    let after = eventually(
        "the rotated certificate",
        Duration::from_secs(10),
        || async {
            let now = served_serial(&listen);
            (now.starts_with("serial=") && now != before).then_some(now)
        },
    )
    .await;
    assert_ne!(before, after);
    let mut bad2 = bad.clone();
    bad2["metadata"]["name"] = json!("bad2");
    let refused = api
        .create(
            &PostParams::default(),
            &serde_json::from_value(bad2).unwrap(),
        )
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("10.20.1.300"), "{refused}");
}
