//! The cluster side: a real etcd + kube-apiserver on loopback (Debian's v1.20 build from the
//! cache), peerwall's CRDs, a Liqo tenant with an offloaded namespace, pods with addresses,
//! and peerwall processes with their peak memory.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::Client;
use serde_json::json;

pub const PEER: &str = "bench";
pub const TENANT: &str = "liqo-tenant-bench";
pub const OFFLOADED: &str = "offloaded-bench";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repo root")
        .to_path_buf()
}

fn kube_bin() -> PathBuf {
    let cache = std::env::var_os("PEERWALL_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into()))
                .join(".cache/peerwall")
        });
    cache.join("kube-1.20.2")
}

/// A port P for the API server with P+10000 and P+10001 (etcd) free too.
fn free_api_port() -> u16 {
    let free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
    (0..5000u16)
        .map(|k| 20001 + (k + std::process::id() as u16 % 5000) % 5000 * 2)
        .find(|p| free(*p) && free(p + 10000) && free(p + 10001))
        .expect("free ports for the API server")
}

pub struct ApiServer {
    pub dir: PathBuf,
    pub kubeconfig: PathBuf,
}

impl ApiServer {
    pub fn start() -> Self {
        let dir = std::env::temp_dir().join(format!("peerwall-bench-kube-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("run dir");
        let me = Self {
            kubeconfig: dir.join("kubeconfig"),
            dir,
        };
        let out = Command::new("bash")
            .arg(repo().join("xtask/kube/start-apiserver.sh"))
            .arg(kube_bin())
            .arg(&me.dir)
            .arg(free_api_port().to_string())
            .output()
            .expect("start-apiserver.sh");
        assert!(
            out.status.success(),
            "apiserver did not start (cargo xtask kube-build first): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let crd = Command::new(kube_bin().join("kubectl"))
            .args(["--kubeconfig"])
            .arg(&me.kubeconfig)
            .args(["apply", "-f"])
            .arg(repo().join("deploy/base/crd.yaml"))
            .output()
            .expect("kubectl");
        assert!(
            crd.status.success(),
            "{}",
            String::from_utf8_lossy(&crd.stderr)
        );
        let wait = Command::new(kube_bin().join("kubectl"))
            .args(["--kubeconfig"])
            .arg(&me.kubeconfig)
            .args([
                "wait",
                "--for=condition=Established",
                "crd/firewallconfigurations.peerwall.io",
                "crd/addresssets.peerwall.io",
            ])
            .output()
            .expect("kubectl");
        assert!(
            wait.status.success(),
            "{}",
            String::from_utf8_lossy(&wait.stderr)
        );
        me
    }

    pub async fn client(&self) -> Client {
        let kc = kube::config::Kubeconfig::read_from(&self.kubeconfig).expect("kubeconfig");
        let mut cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .expect("config");
        cfg.read_timeout = Some(Duration::from_secs(300));
        Client::try_from(cfg).expect("client")
    }

    /// `peerwall ARGS` against this server (its log in the run directory).
    pub fn peerwall(&self, name: &str, args: &[&str]) -> Proc {
        let bin = std::env::var_os("PEERWALL_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| repo().join("target/release/peerwall"));
        let child = Command::new(bin)
            .args(args)
            .env("KUBECONFIG", &self.kubeconfig)
            .env("PEERWALL_LOG", "info,kube=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.dir.join(format!("{name}.log"))).expect("log"))
            .spawn()
            .expect("peerwall");
        Proc { child }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        for p in ["kcm", "apiserver", "etcd"] {
            if let Ok(pid) = std::fs::read_to_string(self.dir.join(format!("{p}.pid"))) {
                if let Ok(pid) = pid.trim().parse::<i32>() {
                    // SAFETY: kill(2) on a process this bench started.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
        }
        std::thread::sleep(Duration::from_millis(200));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub struct Proc {
    pub child: Child,
}

impl Proc {
    /// Peak resident memory (VmHWM), MiB.
    pub fn peak_rss_mib(&self) -> f64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| {
                v.split_whitespace()
                    .next()
                    .and_then(|n| n.parse::<f64>().ok())
            })
            .unwrap_or(0.0)
            / 1024.0
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

/// The tenant namespace of the peer and the namespace it offloaded.
pub async fn peering(client: &Client) {
    let ns: Api<Namespace> = Api::all(client.clone());
    for (name, labels) in [
        (
            TENANT,
            json!({"liqo.io/tenant-namespace": "true", "liqo.io/remote-cluster-id": PEER}),
        ),
        (OFFLOADED, json!({"liqo.io/remote-cluster-id": PEER})),
    ] {
        let body = json!({"metadata": {"name": name, "labels": labels}});
        ns.create(
            &PostParams::default(),
            &serde_json::from_value(body).expect("ns"),
        )
        .await
        .expect("namespace");
    }
    // The default service account is not needed: the ServiceAccount admission is off.
}

/// Pod number `i`'s address.
pub fn pod_ip(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(0x0a20_0000 + i)
}

fn pod_name(i: u32) -> String {
    format!("p{i}")
}

/// Create offloaded pod `i` and give it its address (the kubelet's status update).
pub async fn offload(client: &Client, i: u32) {
    offload_timed(client, i).await;
}

/// [`offload`], returning when the address was given (just before the status update).
pub async fn offload_timed(client: &Client, i: u32) -> Instant {
    let pods: Api<Pod> = Api::namespaced(client.clone(), OFFLOADED);
    let body = json!({
        "metadata": {"name": pod_name(i)},
        "spec": {"nodeName": "node-1", "containers": [{"name": "c", "image": "x"}]},
    });
    pods.create(
        &PostParams::default(),
        &serde_json::from_value(body).expect("pod"),
    )
    .await
    .expect("create pod");
    let ip = pod_ip(i).to_string();
    let status = json!({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}});
    let at = Instant::now();
    pods.patch_status(
        &pod_name(i),
        &PatchParams::default(),
        &Patch::Merge(&status),
    )
    .await
    .expect("pod status");
    at
}

/// Delete offloaded pod `i` (at once: no kubelet runs here).
pub async fn remove(client: &Client, i: u32) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), OFFLOADED);
    pods.delete(&pod_name(i), &DeleteParams::default().grace_period(0))
        .await
        .expect("delete pod");
}

/// Offload pods `range`, 64 requests in flight.
pub async fn offload_many(client: &Client, range: std::ops::Range<u32>) -> Duration {
    let started = Instant::now();
    futures::stream::iter(range)
        .map(|i| offload(client, i))
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await;
    started.elapsed()
}

/// Addresses of the `offloaded` set over all published slices.
pub async fn published(client: &Client) -> usize {
    let api: Api<kube::api::DynamicObject> = Api::namespaced_with(
        client.clone(),
        TENANT,
        &peerwall::k8s::address_set_resource(),
    );
    let Ok(list) = api.list(&Default::default()).await else {
        return 0;
    };
    list.items
        .iter()
        .filter(|o| o.data["spec"]["set"] == "offloaded")
        .map(|o| o.data["spec"]["addresses"].as_array().map_or(0, Vec::len))
        .sum()
}
