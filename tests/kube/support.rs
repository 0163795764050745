//! What every Kubernetes test uses: a real etcd + kube-apiserver + kube-controller-manager
//! per test, peerwall processes against it, objects, conditions, certificates.

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::Client;
use serde_json::json;

use crate::common::*;

pub(crate) const KUBE_VERSION: &str = "1.20.2";

pub(crate) fn kube_bin_dir() -> PathBuf {
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

pub(crate) fn port_free(p: u16) -> bool {
    TcpListener::bind(("127.0.0.1", p)).is_ok()
}

/// etcd + kube-apiserver + kube-controller-manager on loopback; stopped on drop.
pub(crate) struct ApiServer {
    pub(crate) dir: PathBuf,
    pub(crate) kubeconfig: PathBuf,
}

impl ApiServer {
    pub(crate) fn start() -> Self {
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

    pub(crate) async fn client(&self) -> Client {
        let kc = kube::config::Kubeconfig::read_from(&self.kubeconfig).unwrap();
        let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .unwrap();
        Client::try_from(cfg).unwrap()
    }

    /// A peerwall subcommand talking to this server; stopped (SIGTERM) on drop.
    pub(crate) fn peerwall(&self, name: &str, args: &[&str]) -> Proc {
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
pub(crate) struct Proc {
    pub(crate) child: Child,
    pub(crate) log: PathBuf,
}

impl Proc {
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
    pub(crate) fn stop(&mut self) {
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
pub(crate) async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
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

/// peerwall's CRDs (`deploy/base/crd.yaml`: FirewallConfiguration and AddressSet), established and
/// served.
pub(crate) async fn install_crd(client: &Client) {
    use serde::Deserialize;
    let text = std::fs::read_to_string(repo("deploy/base/crd.yaml")).unwrap();
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let crd = CustomResourceDefinition::deserialize(doc).unwrap();
        let name = crd.metadata.name.clone().unwrap();
        api.create(&PostParams::default(), &crd).await.unwrap();
        eventually("the CRD to be established", Duration::from_secs(20), || {
            let (api, name) = (api.clone(), name.clone());
            async move {
                let c = api.get(&name).await.ok()?;
                let ok = c
                    .status?
                    .conditions?
                    .iter()
                    .any(|c| c.type_ == "Established" && c.status == "True");
                ok.then_some(())
            }
        })
        .await;
    }
    // Discovery of the new resource lags establishment a little.
    let fwc = fwc_api(client, "default");
    eventually("the resource to be served", Duration::from_secs(20), || {
        let fwc = fwc.clone();
        async move { fwc.list(&Default::default()).await.ok().map(|_| ()) }
    })
    .await;
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

pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
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
