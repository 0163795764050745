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
    server.install_crds();
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
            // Liqo's shapes below carry NAT, notrack and marks: admitted where an
            // administrator enabled packet changes (refused by default: the next test).
            "--allow-packet-changes",
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
    register(
        &client,
        "peerwall-test",
        &listen,
        Some(&b64),
        &["firewallconfigurations", "protectionpolicies"],
    )
    .await;
    tenant_namespace(&client, "cluster1").await;
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
                    // Until the webhook listens: "failed calling webhook … connection refused".
                    Err(kube::Error::Api(e)) if e.message.contains("failed calling webhook") => {
                        None
                    }
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
    // A misspelt field reaches the webhook (the CRD keeps unknown fields instead of pruning
    // them before admission) and is refused with a did-you-mean.
    let mut misspelt = thesis_block();
    misspelt["metadata"]["name"] = json!("misspelt");
    misspelt["spec"]["table"]["chains"][0]["rules"]["filterRules"][0]["match"][0]["ctState"] =
        json!({"value": ["established"]});
    let refused = api
        .create(
            &PostParams::default(),
            &serde_json::from_value(misspelt).unwrap(),
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("spec.table.chains[0].rules.filterRules[0].match[0]")
            && refused.contains("did you mean `ctstate`"),
        "{refused}"
    );
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
    // A misspelt ProtectionPolicy field (`prots`: pruned, the opening covered every port).
    let pp_dyn: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &peerwall::k8s::protection_policies::resource(),
    );
    let refused = pp_dyn
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "peerwall.io/v1alpha1", "kind": "ProtectionPolicy",
                "metadata": {"name": "misspelt"},
                "spec": {"open": [{"name": "metrics", "from": ["PeerPods"], "podSelector": {},
                                   "prots": [{"protocol": "TCP", "port": 9090}]}]}}))
            .unwrap(),
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("spec.open[0]") && refused.contains("did you mean `ports`"),
        "{refused}"
    );

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

/// A ValidatingWebhookConfiguration `name` for `resources` of peerwall's group, pointing at a
/// webhook on `listen`, trusting `ca` (base64 PEM) or, without it, nothing yet (the webhook
/// writes its own CA).
async fn register(
    client: &kube::Client,
    name: &str,
    listen: &str,
    ca: Option<&str>,
    resources: &[&str],
) {
    let mut client_config = json!({"url": format!("https://{listen}/validate")});
    if let Some(ca) = ca {
        client_config["caBundle"] = json!(ca);
    }
    let cfg = json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [{
            "name": "firewallconfigurations.peerwall.io",
            "clientConfig": client_config,
            "rules": [{"apiGroups": ["peerwall.io"], "apiVersions": ["v1alpha1"], "operations": ["CREATE", "UPDATE"], "resources": resources}],
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
}

/// The webhook's Secret: (ca.crt, tls.crt) as text.
async fn issued(client: &kube::Client) -> Option<(String, String)> {
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(client.clone(), "peerwall-system");
    let s = secrets.get_opt("peerwall-webhook-tls").await.ok()??;
    let data = s.data?;
    let text = |k: &str| String::from_utf8(data.get(k)?.0.clone()).ok();
    Some((text("ca.crt")?, text("tls.crt")?))
}

/// The caBundle the API server trusts for the webhook, as text.
async fn ca_bundle(client: &kube::Client) -> Option<String> {
    let vwc: Api<k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration> =
        Api::all(client.clone());
    let cfg = vwc.get_opt("peerwall").await.ok()??;
    let b = cfg.webhooks?.first()?.client_config.ca_bundle.clone()?;
    String::from_utf8(b.0).ok()
}

/// Create `obj` in `ns`: the API's refusal message, or None when admitted; retried while the
/// API server cannot reach the webhook yet ("failed calling webhook").
async fn create_in(client: &kube::Client, ns: &str, obj: serde_json::Value) -> Option<String> {
    let api = fwc_api(client, ns);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let o: DynamicObject = serde_json::from_value(obj.clone()).unwrap();
        match api.create(&PostParams::default(), &o).await {
            Ok(_) => return None,
            Err(e)
                if e.to_string().contains("failed calling webhook")
                    && std::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Some(e.to_string()),
        }
    }
}

/// No manual TLS step: the webhook issues its own CA and certificate into a Secret and writes
/// the CA into its webhook configuration's caBundle, so the API server calls it at once; the
/// certificate (validity 30 s) and the CA (90 s) rotate while the API server keeps calling it.
/// By default it refuses what the agents would ignore: a gateway object from a namespace that
/// may not steer a gateway, and packet-changing rules.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_issues_and_rotates_its_own_certificate() {
    let server = api_server();
    let client = server.client().await;
    server.install_crds();
    namespace(&client, "peerwall-system", json!({})).await;
    namespace(&client, "team-x", json!({})).await;
    tenant_namespace(&client, "cluster1").await;
    let listen = format!("127.0.0.1:{}", free_port());
    register(
        &client,
        "peerwall",
        &listen,
        None,
        &["firewallconfigurations", "addresssets"],
    )
    .await;
    let _wh = server.peerwall(
        "webhook-issued",
        &[
            "webhook",
            "--listen",
            &listen,
            "--tls-names",
            "127.0.0.1",
            "--cert-validity-secs",
            "30",
            "--ca-validity-secs",
            "90",
        ],
    );
    let (ca, cert) = eventually("the issued certificate", Duration::from_secs(30), || {
        issued(&client)
    })
    .await;
    eventually("the caBundle", Duration::from_secs(30), || async {
        (ca_bundle(&client).await? == ca).then_some(())
    })
    .await;
    let mut bad = thesis_block();
    bad["spec"]["table"]["chains"][0]["rules"]["filterRules"][0]["match"][1]["ip"]["value"] =
        json!("10.20.1.300");
    bad["metadata"]["name"] = json!("bad");
    let refused = |what: &'static str| {
        let client = client.clone();
        let bad = bad.clone();
        async move {
            let msg = eventually(what, Duration::from_secs(30), || {
                let (client, bad) = (client.clone(), bad.clone());
                async move { create_in(&client, "liqo-tenant-cluster1", bad).await }
            })
            .await;
            assert!(
                msg.contains("spec.table.chains[0].rules.filterRules[0].match[1].ip.value"),
                "{what}: {msg}"
            );
        }
    };
    refused("the invalid object refused through the issued certificate").await;
    // What the agents would ignore is refused, with the reason.
    let mut elsewhere = thesis_block();
    elsewhere["metadata"]["namespace"] = json!("team-x");
    let msg = create_in(&client, "team-x", elsewhere)
        .await
        .unwrap_or_default();
    assert!(
        msg.contains("namespace \"team-x\" is not designated for gateway objects"),
        "{msg}"
    );
    let mut nat = thesis_block();
    nat["metadata"]["name"] = json!("redirect");
    nat["spec"]["table"]["chains"] = json!([{
        "name": "dnat", "type": "nat", "hook": "prerouting", "priority": -100, "policy": "accept",
        "rules": {"natRules": [{"name": "steal", "natType": "dnat", "to": "10.20.1.3",
            "match": [{"op": "eq", "ip": {"value": "10.20.1.2", "position": "dst"}}]}]}
    }]);
    let msg = create_in(&client, "liqo-tenant-cluster1", nat)
        .await
        .unwrap_or_default();
    assert!(
        msg.contains("spec.table.chains[0].rules.natRules[0]: a NAT rule"),
        "{msg}"
    );
    // The same valid object in its peer's tenant namespace is admitted.
    assert_eq!(
        create_in(&client, "liqo-tenant-cluster1", thesis_block()).await,
        None
    );
    // A third of 30 s later the certificate is renewed from the same CA, and served.
    let served = served_serial(&listen);
    let (ca2, cert2) = eventually("a renewed certificate", Duration::from_secs(40), || async {
        issued(&client).await.filter(|(_, c)| *c != cert)
    })
    .await;
    assert_eq!(ca2, ca, "renewed by the same CA");
    eventually(
        "the renewed certificate served",
        Duration::from_secs(10),
        || async {
            let now = served_serial(&listen);
            (now.starts_with("serial=") && now != served).then_some(())
        },
    )
    .await;
    let _ = cert2;
    refused("the invalid object refused after the renewal").await;
    // With a third of the CA's 90 s left, a new CA; both are trusted until the old one ends.
    let (ca3, _) = eventually("a new CA", Duration::from_secs(80), || async {
        issued(&client).await.filter(|(c, _)| *c != ca)
    })
    .await;
    eventually(
        "both CAs in the caBundle",
        Duration::from_secs(20),
        || async {
            let b = ca_bundle(&client).await?;
            (b.contains(ca3.trim()) && b.contains(ca.trim())).then_some(())
        },
    )
    .await;
    refused("the invalid object refused under the new CA").await;
}
