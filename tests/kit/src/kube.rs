//! A real etcd + kube-apiserver + kube-controller-manager on loopback (Debian's build of
//! [`KUBE_VERSION`] from the cache `cargo xtask kube-build` fills), started by
//! `xtask/kube/start-apiserver.sh` and stopped on drop; peerwall processes against it.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use kube::Client;

pub use crate::proc::Proc;

/// The Kubernetes release the tests run against.
pub const KUBE_VERSION: &str = "1.20.2";

/// Where the Kubernetes binaries are: `PEERWALL_KUBE_BIN`, else the cache
/// (`PEERWALL_CACHE`, default `~/.cache/peerwall`).
pub fn kube_bin_dir() -> PathBuf {
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

/// Whether TCP port `p` of the loopback is free.
pub fn port_free(p: u16) -> bool {
    TcpListener::bind(("127.0.0.1", p)).is_ok()
}

/// A free loopback port, never one handed out before in this process (a port given back by
/// the OS could otherwise go to two processes, and one would answer for the other).
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    loop {
        let p = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let mut given = GIVEN.lock().expect("ports");
        if !given.contains(&p) {
            given.push(p);
            return p;
        }
    }
}

/// etcd + kube-apiserver + kube-controller-manager on loopback; stopped on drop.
pub struct ApiServer {
    /// Run directory: logs, pid files, certificates.
    pub dir: PathBuf,
    /// Its kubeconfig.
    pub kubeconfig: PathBuf,
    /// The peerwall binary [`ApiServer::peerwall`] runs.
    peerwall: PathBuf,
}

impl ApiServer {
    /// Start one on free ports below the ephemeral range (API server, etcd and its peer port); `peerwall`: the
    /// binary [`ApiServer::peerwall`] runs against it.
    pub fn start(peerwall: impl Into<PathBuf>) -> Self {
        let bin = kube_bin_dir();
        assert!(
            bin.join("kube-apiserver").exists(),
            "no kube-apiserver in {}: run `cargo xtask setup` (or `cargo xtask kube-build`)",
            bin.display()
        );
        // All three below the kernel's ephemeral range (32768 and up by default): a port
        // there can be taken between this check and etcd's bind by any outgoing connection of
        // the tests running beside (seen: etcd never came up, "context deadline exceeded").
        let (port, etcd) = loop {
            let p = 20000 + (rand::random::<u16>() % 6000) * 2;
            let e = 10000 + (rand::random::<u16>() % 6000) * 2;
            if port_free(p) && port_free(e) && port_free(e + 1) {
                break (p, e);
            }
        };
        let dir = std::env::temp_dir().join(format!("peerwall-kube-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("the API server's run directory");
        let me = Self {
            kubeconfig: dir.join("kubeconfig"),
            dir,
            peerwall: peerwall.into(),
        };
        let out = Command::new("bash")
            .arg(crate::repo_root().join("xtask/kube/start-apiserver.sh"))
            .arg(&bin)
            .arg(&me.dir)
            .arg(port.to_string())
            .arg(etcd.to_string())
            .output()
            .expect("running start-apiserver.sh");
        assert!(
            out.status.success(),
            "apiserver did not start: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(me.dir.join("apiserver.log")).unwrap_or_default()
        );
        me
    }

    /// [`start`](Self::start), then peerwall's CRDs and Liqo's `Configuration` CRD applied
    /// and established (Liqo is installed before peerwall's controller starts).
    pub fn start_with_crds(peerwall: impl Into<PathBuf>) -> Self {
        let server = Self::start(peerwall);
        server.install_crds();
        server
    }

    /// peerwall's CRDs (`deploy/common/crd.yaml`) and Liqo's `Configuration` CRD
    /// ([`crate::liqo::CONFIGURATION_CRD`]) installed as a user installs them (`kubectl apply`),
    /// established, and served (a FirewallConfiguration list answers: discovery lags
    /// establishment a little). The one way tests and benchmarks install them.
    pub fn install_crds(&self) {
        let liqo_crd = self.dir.join("liqo-configuration-crd.yaml");
        std::fs::write(&liqo_crd, crate::liqo::CONFIGURATION_CRD).expect("CRD file");
        let crds = crate::repo("deploy/common/crd.yaml");
        let kubectl = |args: &[&str]| {
            let out = self.kubectl().args(args).output().expect("kubectl");
            (
                out.status.success(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        };
        for f in [&crds, &liqo_crd] {
            let f = f.to_str().expect("UTF-8 path");
            let (ok, err) = kubectl(&["apply", "-f", f]);
            assert!(ok, "kubectl apply -f {f}: {err}");
            let (ok, err) = kubectl(&[
                "wait",
                "--for=condition=Established",
                "--timeout=60s",
                "-f",
                f,
            ]);
            assert!(ok, "kubectl wait Established -f {f}: {err}");
        }
        let served = crate::wait::poll(20, || {
            kubectl(&["get", "firewallconfigurations.peerwall.io", "-A"]).0
        });
        assert!(
            served,
            "FirewallConfigurations are not served 20 s after their CRD"
        );
    }

    /// The client configuration of its kubeconfig.
    pub async fn config(&self) -> kube::Config {
        let kc = kube::config::Kubeconfig::read_from(&self.kubeconfig).expect("kubeconfig");
        kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .expect("client configuration")
    }

    /// A client of it.
    pub async fn client(&self) -> Client {
        Client::try_from(self.config().await).expect("client")
    }

    /// `kubectl` against it.
    pub fn kubectl(&self) -> Command {
        let mut c = Command::new(kube_bin_dir().join("kubectl"));
        c.arg("--kubeconfig").arg(&self.kubeconfig);
        c
    }

    /// A peerwall subcommand talking to this server, its log in the run directory; stopped
    /// (SIGTERM) on drop.
    pub fn peerwall(&self, name: &str, args: &[&str]) -> Proc {
        self.peerwall_logging(name, args, "info,kube=warn")
    }

    /// [`peerwall`](Self::peerwall) with its own log filter (`PEERWALL_LOG`).
    pub fn peerwall_logging(&self, name: &str, args: &[&str], filter: &str) -> Proc {
        let log = self.dir.join(format!("{name}.log"));
        let child = Command::new(&self.peerwall)
            .args(args)
            .env("KUBECONFIG", &self.kubeconfig)
            .env("PEERWALL_LOG", filter)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("starting peerwall");
        Proc::logged(child, log)
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        for p in ["kcm", "apiserver", "etcd"] {
            if let Ok(pid) = std::fs::read_to_string(self.dir.join(format!("{p}.pid"))) {
                if let Ok(pid) = pid.trim().parse::<i32>() {
                    // SAFETY: kill(2) on a process this harness started.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
        }
        std::thread::sleep(Duration::from_millis(200));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
