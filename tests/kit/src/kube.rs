//! A real etcd + kube-apiserver + kube-controller-manager on loopback (Debian's build of
//! [`KUBE_VERSION`] from the cache `cargo xtask kube-build` fills), started by
//! `xtask/kube/start-apiserver.sh` and stopped on drop; peerwall processes against it.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kube::Client;

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
        let liqo_crd = server.dir.join("liqo-configuration-crd.yaml");
        std::fs::write(&liqo_crd, crate::liqo::CONFIGURATION_CRD).expect("CRD file");
        let kubectl = |args: &[&str], file: Option<&Path>| {
            let mut c = server.kubectl();
            c.args(args);
            if let Some(f) = file {
                c.arg(f);
            }
            let out = c.output().expect("kubectl");
            assert!(
                out.status.success(),
                "kubectl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let crds = crate::repo_root().join("deploy/common/crd.yaml");
        kubectl(&["apply", "-f"], Some(&crds));
        kubectl(&["apply", "-f"], Some(&liqo_crd));
        kubectl(
            &[
                "wait",
                "--for=condition=Established",
                "crd/firewallconfigurations.peerwall.io",
                "crd/addresssets.peerwall.io",
                "crd/configurations.networking.liqo.io",
            ],
            None,
        );
        server
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
        Proc { child, log }
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

/// A child process, terminated on drop; its log is printed when a test fails.
pub struct Proc {
    /// The process.
    pub child: Child,
    /// Its stderr.
    pub log: PathBuf,
}

impl Proc {
    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Where its log is.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// SIGTERM, then SIGKILL after 5 s.
    pub fn stop(&mut self) {
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
        self.stop();
        if std::thread::panicking() {
            eprintln!("---- {} ----\n{}", self.log.display(), self.log());
        }
    }
}
