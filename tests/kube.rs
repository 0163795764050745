//! The Kubernetes side against a real kube-apiserver (v1.20.2 built from Debian's source by
//! `cargo xtask kube-build`, started on loopback per test): webhook, deploy manifests,
//! provider-protection controller, agent status/finalizer, and the end-to-end promise (a pod
//! offloaded by consumer A becomes reachable through A's tunnel and only A's).

mod common;

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Client, ResourceExt};
use serde_json::json;

const KUBE_VERSION: &str = "1.20.2";

fn kube_bin_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("PEERWALL_KUBE_BIN") {
        return PathBuf::from(d);
    }
    let cache = std::env::var_os("PEERWALL_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into()))
                .join(".cache/peerwall")
        });
    cache.join(format!("kube-{KUBE_VERSION}"))
}

fn port_free(p: u16) -> bool {
    TcpListener::bind(("127.0.0.1", p)).is_ok()
}

/// etcd + kube-apiserver + kube-controller-manager on loopback; stopped on drop.
struct ApiServer {
    dir: PathBuf,
    kubeconfig: PathBuf,
}

impl ApiServer {
    fn start() -> Self {
        let bin = kube_bin_dir();
        assert!(
            bin.join("kube-apiserver").exists(),
            "no kube-apiserver in {}: run `cargo xtask setup` (or `cargo xtask kube-build`)",
            bin.display()
        );
        let port = loop {
            let p = 20000 + (rand::random::<u16>() % 5000) * 2;
            if port_free(p) && port_free(p + 10000) && port_free(p + 10001) {
                break p;
            }
        };
        let dir = std::env::temp_dir().join(format!("peerwall-kube-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let me = Self {
            dir: dir.clone(),
            kubeconfig: dir.join("kubeconfig"),
        };
        let out = Command::new("bash")
            .arg(repo("xtask/kube/start-apiserver.sh"))
            .arg(&bin)
            .arg(&dir)
            .arg(port.to_string())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "apiserver did not start: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(dir.join("apiserver.log")).unwrap_or_default()
        );
        me
    }

    async fn client(&self) -> Client {
        let kc = kube::config::Kubeconfig::read_from(&self.kubeconfig).unwrap();
        let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .unwrap();
        Client::try_from(cfg).unwrap()
    }

    /// A peerwall subcommand talking to this server; stopped (SIGTERM) on drop.
    fn peerwall(&self, name: &str, args: &[&str]) -> Proc {
        let log = self.dir.join(format!("{name}.log"));
        let child = Command::new(peerwall())
            .args(args)
            .env("KUBECONFIG", &self.kubeconfig)
            .env("PEERWALL_LOG", "info,kube=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Proc { child, log }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        for p in ["kcm", "apiserver", "etcd"] {
            if let Ok(pid) = std::fs::read_to_string(self.dir.join(format!("{p}.pid"))) {
                if let Ok(pid) = pid.trim().parse::<i32>() {
                    // SAFETY: kill(2) on a process this test started.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
        }
        std::thread::sleep(Duration::from_millis(200));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A child process, terminated on drop; its log is printed when a test fails.
struct Proc {
    child: Child,
    log: PathBuf,
}

impl Proc {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
    fn stop(&mut self) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
        if std::thread::panicking() {
            eprintln!("---- {} ----\n{}", self.log.display(), self.log());
        }
    }
}

/// Poll `f` until it returns Some, or panic naming `what`.
async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn install_crd(client: &Client) {
    let crd: CustomResourceDefinition =
        serde_yaml::from_str(&std::fs::read_to_string(repo("deploy/crd.yaml")).unwrap()).unwrap();
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    api.create(&PostParams::default(), &crd).await.unwrap();
    eventually("the CRD to be established", Duration::from_secs(20), || {
        let api = api.clone();
        async move {
            let c = api.get("firewallconfigurations.peerwall.io").await.ok()?;
            let ok = c
                .status?
                .conditions?
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True");
            ok.then_some(())
        }
    })
    .await;
    // Discovery of the new resource lags establishment a little.
    let fwc = fwc_api(client, "default");
    eventually("the resource to be served", Duration::from_secs(20), || {
        let fwc = fwc.clone();
        async move { fwc.list(&Default::default()).await.ok().map(|_| ()) }
    })
    .await;
}

fn fwc_api(client: &Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, &peerwall::k8s::fwc_resource())
}

/// Create a namespace (an existing one is fine).
async fn namespace(client: &Client, name: &str, labels: serde_json::Value) {
    let api: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace =
        serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).unwrap();
    match api.create(&PostParams::default(), &ns).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("namespace {name}: {e}"),
    }
}

async fn pod(
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
    api.create(&PostParams::default(), &p).await.unwrap();
    // No kubelet: the pod's IP is set through the status subresource.
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}})),
    )
    .await
    .unwrap();
}

async fn delete_pod(client: &Client, ns: &str, name: &str) {
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
fn set_elements(obj: &DynamicObject, set: &str) -> BTreeSet<String> {
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

async fn gateway_set(client: &Client, tenant: &str, set: &str) -> Option<BTreeSet<String>> {
    let o = fwc_api(client, tenant)
        .get_opt("peerwall-gateway")
        .await
        .ok()??;
    Some(set_elements(&o, set))
}

fn ips(v: &[&str]) -> BTreeSet<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// This host's condition on an object: (type, message).
async fn condition(
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

async fn applied(api: &Api<DynamicObject>, name: &str, host: &str) {
    eventually(
        &format!("{name}: Applied on {host}"),
        Duration::from_secs(20),
        || async {
            let (t, _, observed, generation) = condition(api, name, host).await?;
            (t == "Applied" && observed == generation).then_some(())
        },
    )
    .await
}

fn tenant_labels(id: &str) -> serde_json::Value {
    json!({"liqo.io/tenant-namespace": "true", "liqo.io/remote-cluster-id": id})
}

fn openssl(args: &[&str]) {
    let o = Command::new("openssl").args(args).output().unwrap();
    assert!(
        o.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A CA and a server certificate for 127.0.0.1 in `dir`; returns the CA's PEM.
fn webhook_certs(dir: &Path) -> String {
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
fn server_cert(dir: &Path) {
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
fn served_serial(addr: &str) -> String {
    let o = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "openssl s_client -connect {addr} </dev/null 2>/dev/null | openssl x509 -noout -serial"
        ))
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The thesis's example (a Liqo object) as a peerwall object for gateways of peer `cluster1`:
/// the same spec under `peerwall.io/v1alpha1` with peerwall's labels.
fn thesis_block() -> serde_json::Value {
    let y = std::fs::read_to_string(repo("examples/thesis-block.yaml")).unwrap();
    let mut v: serde_json::Value = serde_yaml::from_str(&y).unwrap();
    v["apiVersion"] = json!("peerwall.io/v1alpha1");
    v["metadata"]["labels"] = json!({
        "peerwall.io/target": "gateway",
        "peerwall.io/remote-cluster-id": "cluster1",
    });
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_refuses_invalid_objects_through_the_api_server() {
    let server = ApiServer::start();
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
            "rules": [{"apiGroups": ["peerwall.io"], "apiVersions": ["v1alpha1"], "operations": ["CREATE", "UPDATE"], "resources": ["firewallconfigurations"]}],
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

/// Every FirewallConfiguration shape Liqo creates (`examples/liqo/`), as JSON, with owner
/// references dropped (their owners, Liqo's Configurations, do not exist on a test server and
/// the garbage collector would remove the objects).
fn liqo_shapes() -> Vec<(String, serde_json::Value)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo("examples/liqo"))
        .unwrap()
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

/// Remove peerwall's extension fields from a CRD schema (what Liqo's own CRD lacks).
fn strip_extensions(v: &mut serde_json::Value) {
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
async fn install_liqo_crd(client: &Client) {
    let mut crd: serde_json::Value =
        serde_yaml::from_str(&std::fs::read_to_string(repo("deploy/crd.yaml")).unwrap()).unwrap();
    crd["metadata"] = json!({"name": "firewallconfigurations.networking.liqo.io",
        "labels": {"app.kubernetes.io/managed-by": "Helm"}});
    crd["spec"]["group"] = json!("networking.liqo.io");
    crd["spec"]["names"]["shortNames"] = json!(["fw", "fwconfig", "fwcfg"]);
    crd["spec"]["names"]["categories"] = json!(["liqo"]);
    crd["spec"]["versions"][0]["name"] = json!("v1beta1");
    strip_extensions(&mut crd["spec"]["versions"][0]["schema"]);
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let pp = PostParams {
        field_manager: Some("liqo-chart".into()),
        ..Default::default()
    };
    api.create(&pp, &serde_json::from_value(crd).unwrap())
        .await
        .unwrap();
    let liqo = peerwall::k8s::resource_of(peerwall_intent::load::Group::Liqo);
    let fwc: Api<DynamicObject> = Api::all_with(client.clone(), &liqo);
    eventually(
        "Liqo's resource to be served",
        Duration::from_secs(20),
        || {
            let fwc = fwc.clone();
            async move { fwc.list(&Default::default()).await.ok().map(|_| ()) }
        },
    )
    .await;
}

fn liqo_api(client: &Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(
        client.clone(),
        ns,
        &peerwall::k8s::resource_of(peerwall_intent::load::Group::Liqo),
    )
}

/// Create Liqo's shapes in Liqo's group; returns (namespace, name) of each.
async fn create_liqo_shapes(client: &Client, suffix: &str) -> Vec<(String, String)> {
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
async fn liqo_versions(client: &Client) -> BTreeSet<(String, String)> {
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
    let server = ApiServer::start();
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
    namespace(&client, "liqo-tenant-cluster1", json!({})).await;
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
    let server = ApiServer::start();
    let client = server.client().await;
    install_crd(&client).await;
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
    namespace(&client, "liqo-tenant-cluster1", json!({})).await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_keeps_gateway_sets_and_network_policies_in_sync() {
    let server = ApiServer::start();
    let client = server.client().await;
    install_crd(&client).await;
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let controller_args = [
        "controller",
        "--block-leaf-to-leaf",
        "--metrics-addr",
        metrics_addr.as_str(),
    ];
    let mut controller = server.peerwall("controller", &controller_args);
    namespace(&client, "liqo-tenant-a", tenant_labels("a")).await;
    namespace(&client, "liqo-tenant-b", tenant_labels("b")).await;
    // Default deny from the moment the peering exists.
    for t in ["liqo-tenant-a", "liqo-tenant-b"] {
        let s = eventually("the gateway configuration", Duration::from_secs(20), || {
            gateway_set(&client, t, "offloaded")
        })
        .await;
        assert!(s.is_empty());
    }
    let gw = fwc_api(&client, "liqo-tenant-a")
        .get("peerwall-gateway")
        .await
        .unwrap();
    assert_eq!(gw.labels()["peerwall.io/target"], "gateway");
    assert_eq!(gw.labels()["peerwall.io/remote-cluster-id"], "a");
    assert!(
        !gw.labels()
            .keys()
            .any(|k| k.starts_with("networking.liqo.io/")),
        "nothing Liqo's gateway or fabric selects: {:?}",
        gw.labels()
    );
    assert_eq!(gw.owner_references()[0].kind, "Namespace");
    let rules: Vec<String> = gw.data["spec"]["table"]["chains"][0]["rules"]["filterRules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(rules.last().map(String::as_str), Some("default_deny"));
    assert!(rules.contains(&"leaf_to_leaf".to_string()), "{rules:?}");

    // Offloaded namespaces and labeled pods; pods without an IP yet are left out.
    namespace(&client, "app-a", json!({"liqo.io/remote-cluster-id": "a"})).await;
    namespace(&client, "local", json!({})).await;
    pod(&client, "app-a", "web", "10.200.0.5", json!({}), None).await;
    pod(&client, "app-a", "db", "10.200.0.6", json!({}), None).await;
    pod(
        &client,
        "local",
        "shadow-b",
        "10.200.0.7",
        json!({"liqo.io/remote-cluster-id": "b", "liqo.io/managed-by": "shadowpod"}),
        None,
    )
    .await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "app-a");
    pods.create(&PostParams::default(), &serde_json::from_value(json!({"metadata": {"name": "pending"}, "spec": {"containers": [{"name": "c", "image": "x"}]}})).unwrap()).await.unwrap();
    eventually("a's set", Duration::from_secs(10), || async {
        (gateway_set(&client, "liqo-tenant-a", "offloaded").await?
            == ips(&["10.200.0.5", "10.200.0.6"]))
        .then_some(())
    })
    .await;
    eventually("b's set", Duration::from_secs(10), || async {
        (gateway_set(&client, "liqo-tenant-b", "offloaded").await? == ips(&["10.200.0.7"]))
            .then_some(())
    })
    .await;
    // Consumer side: our pod on a's virtual node.
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    nodes.create(&PostParams::default(), &serde_json::from_value(json!({"metadata": {"name": "liqo-a", "labels": {"liqo.io/type": "virtual-node", "liqo.io/remote-cluster-id": "a"}}})).unwrap()).await.unwrap();
    pod(
        &client,
        "local",
        "mine",
        "10.99.0.1",
        json!({}),
        Some("liqo-a"),
    )
    .await;
    eventually("consumer-side sets", Duration::from_secs(10), || async {
        let remote = gateway_set(&client, "liqo-tenant-a", "remote").await?;
        let elsewhere = gateway_set(&client, "liqo-tenant-b", "elsewhere").await?;
        (remote == ips(&["10.99.0.1"]) && elsewhere == ips(&["10.99.0.1"])).then_some(())
    })
    .await;
    // The controller's metrics say the same.
    let scrape = |path: &'static str| {
        let addr = metrics_addr.clone();
        async move {
            tokio::task::spawn_blocking(move || {
                use std::io::{Read, Write};
                let mut c = std::net::TcpStream::connect(&addr).ok()?;
                write!(c, "GET {path} HTTP/1.0\r\n\r\n").ok()?;
                let mut out = String::new();
                c.read_to_string(&mut out).ok()?;
                Some(out)
            })
            .await
            .ok()
            .flatten()
            .unwrap_or_default()
        }
    };
    assert!(scrape("/readyz").await.ends_with("ready\n"));
    eventually("controller metrics", Duration::from_secs(10), || async {
        let m = scrape("/metrics").await;
        (m.contains("peerwall_controller_peers 2\n")
            && m.contains("peerwall_controller_offloaded_addresses 3\n")
            && !m.contains("peerwall_controller_gateway_writes_total 0\n"))
        .then_some(())
    })
    .await;
    // NetworkPolicy for the offloaded namespace only.
    let np: Api<NetworkPolicy> = Api::namespaced(client.clone(), "app-a");
    let p = eventually("the NetworkPolicy", Duration::from_secs(10), || async {
        np.get_opt("peerwall-offloaded").await.ok()?
    })
    .await;
    let spec = serde_json::to_value(p.spec.unwrap()).unwrap();
    assert_eq!(spec["policyTypes"], json!(["Egress"]));
    assert_eq!(
        spec["egress"][0]["to"][0]["namespaceSelector"]["matchExpressions"][0]["values"],
        json!(["a"])
    );
    let local_np: Api<NetworkPolicy> = Api::namespaced(client.clone(), "local");
    assert!(local_np
        .get_opt("peerwall-offloaded")
        .await
        .unwrap()
        .is_none());

    // Restart: changes made while the controller was down are resynced (stale IPs removed).
    controller.stop();
    delete_pod(&client, "app-a", "db").await;
    let mut controller = server.peerwall("controller-2", &controller_args);
    eventually("resync after restart", Duration::from_secs(15), || async {
        (gateway_set(&client, "liqo-tenant-a", "offloaded").await? == ips(&["10.200.0.5"]))
            .then_some(())
    })
    .await;

    // IP reuse: 10.200.0.5 moves from a's pod to a pod of b. It must leave a's set before it
    // appears in b's; watch every version of both objects.
    let violation = Arc::new(AtomicBool::new(false));
    let seen_in_b = Arc::new(AtomicBool::new(false));
    let watch = {
        let (violation, seen_in_b) = (violation.clone(), seen_in_b.clone());
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &peerwall::k8s::fwc_resource());
        tokio::spawn(async move {
            let mut has = std::collections::BTreeMap::new();
            let mut s = watcher(api, watcher::Config::default())
                .applied_objects()
                .boxed();
            while let Some(Ok(o)) = s.next().await {
                let x = set_elements(&o, "offloaded").contains("10.200.0.5");
                has.insert(o.namespace().unwrap_or_default(), x);
                if has.get("liqo-tenant-b") == Some(&true) {
                    seen_in_b.store(true, Ordering::SeqCst);
                    if has.get("liqo-tenant-a") == Some(&true) {
                        violation.store(true, Ordering::SeqCst);
                    }
                }
            }
        })
    };
    namespace(&client, "app-b", json!({"liqo.io/remote-cluster-id": "b"})).await;
    pod(&client, "app-b", "new", "10.200.0.5", json!({}), None).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        gateway_set(&client, "liqo-tenant-b", "offloaded")
            .await
            .unwrap(),
        ips(&["10.200.0.7"]),
        "held back while a's pod holds it"
    );
    assert!(gateway_set(&client, "liqo-tenant-a", "offloaded")
        .await
        .unwrap()
        .contains("10.200.0.5"));
    delete_pod(&client, "app-a", "web").await;
    eventually(
        "the address to move to b",
        Duration::from_secs(15),
        || async {
            let a = gateway_set(&client, "liqo-tenant-a", "offloaded").await?;
            let b = gateway_set(&client, "liqo-tenant-b", "offloaded").await?;
            (a.is_empty() && b == ips(&["10.200.0.5", "10.200.0.7"])).then_some(())
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    watch.abort();
    assert!(seen_in_b.load(Ordering::SeqCst), "the watch saw b's update");
    assert!(
        !violation.load(Ordering::SeqCst),
        "an address was in two tenants' sets at once"
    );

    // A namespace that stops being offloaded loses its NetworkPolicy.
    let nsapi: Api<Namespace> = Api::all(client.clone());
    nsapi
        .patch(
            "app-a",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"liqo.io/remote-cluster-id": null}}})),
        )
        .await
        .unwrap();
    eventually(
        "the NetworkPolicy to go",
        Duration::from_secs(10),
        || async {
            np.get_opt("peerwall-offloaded")
                .await
                .ok()?
                .is_none()
                .then_some(())
        },
    )
    .await;
    controller.stop();
}

/// Run `peerwall agent --source kube` enforcing in `gw`'s namespace.
fn agent(server: &ApiServer, gw: &NetNs, host: &str, selector: &str) -> Proc {
    agent_with(server, gw, host, selector, &[])
}

fn agent_with(server: &ApiServer, gw: &NetNs, host: &str, selector: &str, extra: &[&str]) -> Proc {
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
struct BpfPins {
    dir: String,
    ns: String,
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_enforces_through_the_bpf_backend_in_a_gateway_namespace() {
    let t = Topology::new();
    let pins = BpfPins {
        dir: format!("/sys/fs/bpf/peerwall-kube-test-{}", std::process::id()),
        ns: t.gateway.name().to_string(),
    };
    let server = ApiServer::start();
    let client = server.client().await;
    install_crd(&client).await;
    let _agent = agent_with(
        &server,
        &t.gateway,
        "gw-bpf",
        "peerwall.io/target=gateway",
        &[
            "--backend",
            "bpf",
            "--pin-dir",
            &pins.dir,
            "--interfaces",
            "liqo-tunnel,liqo.*",
        ],
    );
    namespace(&client, "liqo-tenant-cluster1", json!({})).await;
    let api = fwc_api(&client, "liqo-tenant-cluster1");
    let obj: DynamicObject = serde_json::from_value(thesis_block()).unwrap();
    let name = obj.name_any();
    api.create(&PostParams::default(), &obj).await.unwrap();
    applied(&api, &name, "gw-bpf").await;
    // The programs are attached in the gateway's namespace (tc link pinned by interface name).
    assert!(
        std::path::Path::new(&pins.dir)
            .join("links/tc-liqo-tunnel")
            .exists(),
        "tc link pinned"
    );
    assert!(
        nft_tables(&t.gateway).trim().is_empty(),
        "no nftables involved"
    );
    assert_thesis_block_enforced(&t.consumer);
    // Deleting the object empties the maps, then releases the finalizer.
    api.delete(&name, &DeleteParams::default()).await.unwrap();
    eventually("the object to be gone", Duration::from_secs(20), || async {
        api.get_opt(&name).await.ok()?.is_none().then_some(())
    })
    .await;
    assert!(
        ping(&t.consumer, "10.10.1.67", "10.20.1.2"),
        "nothing enforced any more"
    );
}

fn nft_tables(ns: &NetNs) -> String {
    String::from_utf8_lossy(&in_ns(ns, "nft", &["list", "tables"]).stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_applies_reports_status_and_cleans_up() {
    let t = Topology::new();
    let server = ApiServer::start();
    let client = server.client().await;
    install_crd(&client).await;
    let _agent = agent(&server, &t.gateway, "gw-test", "peerwall.io/target=gateway");
    namespace(&client, "liqo-tenant-cluster1", json!({})).await;
    let api = fwc_api(&client, "liqo-tenant-cluster1");
    let obj: DynamicObject = serde_json::from_value(thesis_block()).unwrap();
    let name = obj.name_any();
    api.create(&PostParams::default(), &obj).await.unwrap();
    applied(&api, &name, "gw-test").await;
    let o = api.get(&name).await.unwrap();
    assert!(
        o.finalizers()
            .iter()
            .any(|f| f == "peerwall.io/agent-gw-test"),
        "{:?}",
        o.finalizers()
    );
    let table = o.data["spec"]["table"]["name"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        nft_tables(&t.gateway).contains(&table),
        "{}",
        nft_tables(&t.gateway)
    );
    assert_thesis_block_enforced(&t.consumer);

    // An invalid edit: Error with the field path, the last good spec stays in force.
    api.patch(&name, &PatchParams::default(), &Patch::Merge(json!({"spec": {"table": {"chains": [{
        "name": "block", "type": "filter", "hook": "forward", "priority": 0, "policy": "accept",
        "rules": {"filterRules": [{"action": "drop", "match": [{"op": "eq", "ip": {"value": "10.20.1.300", "position": "dst"}}]}]}}]}}})))
        .await
        .unwrap();
    let (_, msg, _, _) = eventually("the Error condition", Duration::from_secs(20), || async {
        let c = condition(&api, &name, "gw-test").await?;
        (c.0 == "Error" && c.2 == c.3).then_some(c)
    })
    .await;
    assert!(
        msg.contains("spec.table.chains[0].rules.filterRules[0].match[0].ip.value")
            && msg.contains("10.20.1.300"),
        "{msg}"
    );
    assert!(msg.contains("stays in force"), "{msg}");
    assert_thesis_block_enforced(&t.consumer);
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), "liqo-tenant-cluster1");
    eventually("a NotApplied event", Duration::from_secs(10), || async {
        let list = events.list(&Default::default()).await.ok()?;
        list.items
            .iter()
            .any(|e| {
                e.reason.as_deref() == Some("NotApplied")
                    && e.note
                        .as_deref()
                        .unwrap_or_default()
                        .contains("10.20.1.300")
            })
            .then_some(())
    })
    .await;

    // Someone deletes the table: the agent restores it.
    in_ns(&t.gateway, "nft", &["delete", "table", "inet", &table]);
    eventually("drift repair", Duration::from_secs(10), || async {
        nft_tables(&t.gateway).contains(&table).then_some(())
    })
    .await;

    // Deleting the object removes the table, then the finalizer lets the object go.
    api.delete(&name, &DeleteParams::default()).await.unwrap();
    eventually("the object to be gone", Duration::from_secs(20), || async {
        api.get_opt(&name).await.ok()?.is_none().then_some(())
    })
    .await;
    assert!(
        !nft_tables(&t.gateway).contains(&table),
        "{}",
        nft_tables(&t.gateway)
    );
    assert!(
        ping(&t.consumer, "10.10.1.67", "10.20.1.2"),
        "nothing enforced any more"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offloaded_pod_is_reachable_through_its_consumers_tunnel_only() {
    // Two peerings: consumer a and consumer b each reach the provider through their own gateway
    // (own tunnel, own agent selecting its peer's configuration), as Liqo runs one gateway per peer.
    let ta = Topology::new();
    let tb = Topology::new();
    let server = ApiServer::start();
    let client = server.client().await;
    install_crd(&client).await;
    let _agent_a = agent(
        &server,
        &ta.gateway,
        "gw-a",
        "peerwall.io/target=gateway,peerwall.io/remote-cluster-id=a",
    );
    let _agent_b = agent(
        &server,
        &tb.gateway,
        "gw-b",
        "peerwall.io/target=gateway,peerwall.io/remote-cluster-id=b",
    );
    let _controller = server.peerwall(
        "controller",
        &["controller", "--metrics-addr", "127.0.0.1:0"],
    );
    let pod_ip = "10.20.1.2";
    assert!(
        ping(&ta.consumer, "10.10.1.67", pod_ip) && ping(&tb.consumer, "10.10.1.67", pod_ip),
        "open before peering"
    );
    namespace(&client, "liqo-tenant-a", tenant_labels("a")).await;
    namespace(&client, "liqo-tenant-b", tenant_labels("b")).await;
    applied(
        &fwc_api(&client, "liqo-tenant-a"),
        "peerwall-gateway",
        "gw-a",
    )
    .await;
    applied(
        &fwc_api(&client, "liqo-tenant-b"),
        "peerwall-gateway",
        "gw-b",
    )
    .await;
    assert!(
        !ping(&ta.consumer, "10.10.1.67", pod_ip),
        "default deny on a's tunnel"
    );
    assert!(
        !ping(&tb.consumer, "10.10.1.67", pod_ip),
        "default deny on b's tunnel"
    );

    // Consumer a offloads a namespace with one pod.
    namespace(&client, "app-a", json!({"liqo.io/remote-cluster-id": "a"})).await;
    let started = Instant::now();
    pod(&client, "app-a", "web", pod_ip, json!({}), None).await;
    eventually(
        "the pod to be reachable through a's tunnel",
        Duration::from_secs(10),
        || async {
            let ns = ta.consumer.name().to_string();
            tokio::task::spawn_blocking(move || {
                Command::new("ip")
                    .args([
                        "netns",
                        "exec",
                        &ns,
                        "ping",
                        "-c",
                        "1",
                        "-W",
                        "1",
                        "-I",
                        "10.10.1.67",
                        pod_ip,
                    ])
                    .output()
                    .map(|o| o.status.success())
                    .unwrap_or(false)
            })
            .await
            .ok()?
            .then_some(())
        },
    )
    .await;
    eprintln!("offloaded pod reachable after {:?}", started.elapsed());
    assert!(
        !ping(&tb.consumer, "10.10.1.67", pod_ip),
        "b's tunnel still denies a's pod"
    );
    assert!(
        !ping(&ta.consumer, "10.10.1.67", "10.20.1.3"),
        "a reaches only what it offloaded"
    );
}
