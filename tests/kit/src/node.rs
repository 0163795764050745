//! A real node: kubelet + containerd + runc + CNI (`xtask/kube/start-node.sh`) in a network
//! namespace of its own, running peerwall's images (`cargo xtask image`), with `kubectl`
//! against it. Started on creation, everything removed on drop (logs printed when a test
//! panics).

use std::path::PathBuf;
use std::process::{Command, Output};

use crate::kube::kube_bin_dir;
use crate::repo_root;

/// The node: started on creation, everything removed on drop.
pub struct Node {
    /// The network namespace the node runs in.
    pub ns: String,
    /// Its working directory (kubeconfig, logs, anything a test writes for it).
    pub dir: PathBuf,
    /// Its administrator's kubeconfig (the API server listens in the node's namespace).
    pub kubeconfig: PathBuf,
}

impl Node {
    pub fn start() -> Self {
        let ns = format!("pwn-{}", std::process::id());
        let dir = std::env::temp_dir().join(&ns);
        let images = images_dir();
        assert!(
            images.join("names").exists(),
            "no images in {}: run `cargo xtask image` (cargo xtask test does)",
            images.display()
        );
        let node = Self {
            ns: ns.clone(),
            kubeconfig: dir.join("kubeconfig"),
            dir: dir.clone(),
        };
        let out = Command::new("bash")
            .arg(repo_root().join("xtask/kube/start-node.sh"))
            .arg(kube_bin_dir())
            .arg(&dir)
            .arg(&ns)
            .arg(&images)
            .output()
            .expect("starting the node");
        assert!(
            out.status.success(),
            "the node did not start: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(dir.join("kubelet.log"))
                .unwrap_or_default()
                .lines()
                .rev()
                .take(30)
                .collect::<Vec<_>>()
                .join("\n")
        );
        node
    }

    pub fn kubectl(&self, args: &[&str]) -> Output {
        Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", self.ns))
            .arg(kube_bin_dir().join("kubectl"))
            .arg(format!("--kubeconfig={}", self.kubeconfig.display()))
            // Every node has the same address: a shared discovery cache would be stale.
            .arg(format!(
                "--cache-dir={}",
                self.dir.join("kubectl-cache").display()
            ))
            .args(args)
            .output()
            .unwrap()
    }

    pub fn kubectl_ok(&self, args: &[&str]) -> String {
        let out = self.kubectl(args);
        assert!(
            out.status.success(),
            "kubectl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    }

    pub fn apply(&self, yaml: &str) {
        let f = self
            .dir
            .join(format!("apply-{}.yaml", rand::random::<u32>()));
        std::fs::write(&f, yaml).unwrap();
        self.kubectl_ok(&["apply", "-f", &f.to_string_lossy()]);
    }

    /// `ip -n <node ns> ARGS`.
    pub fn ip(&self, args: &[&str]) {
        let mut a = vec!["-n", self.ns.as_str()];
        a.extend_from_slice(args);
        let out = Command::new("ip").args(&a).output().expect("running ip");
        assert!(
            out.status.success(),
            "ip {a:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    pub fn logs(&self) -> String {
        let mut s = String::new();
        for f in ["kubelet.log", "containerd.log"] {
            let text = std::fs::read_to_string(self.dir.join(f)).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            s += &format!("---- {f} (last lines, newest first)\n{}\n", tail.join("\n"));
        }
        // Disk space where the node keeps its pods and images (a full disk fails pods in ways
        // the logs above only hint at).
        if let Ok(out) = Command::new("df")
            .arg("-h")
            .arg("-i")
            .arg(&self.dir)
            .output()
        {
            s += &format!(
                "---- df -h -i {}\n{}",
                self.dir.display(),
                String::from_utf8_lossy(&out.stdout)
            );
        }
        if let Ok(out) = Command::new("df").arg("-h").arg(&self.dir).output() {
            s += &format!("{}\n", String::from_utf8_lossy(&out.stdout));
        }
        for args in [
            vec!["get", "pods", "-A", "-o", "wide"],
            vec![
                "-n",
                "peerwall-system",
                "logs",
                "ds/peerwall-agent",
                "--tail=40",
            ],
            vec![
                "-n",
                "peerwall-system",
                "logs",
                "deploy/peerwall-controller",
                "--tail=20",
            ],
        ] {
            let out = self.kubectl(&args);
            s += &format!(
                "---- kubectl {}\n{}{}\n",
                args.join(" "),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        s
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}", self.logs());
        }
        let _ = Command::new("bash")
            .arg(repo_root().join("xtask/kube/stop-node.sh"))
            .arg(&self.dir)
            .arg(&self.ns)
            .status();
    }
}

/// `cargo xtask image`'s output: `<target>/images` (beside the test binary's profile dir).
pub fn images_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("PEERWALL_IMAGES") {
        return PathBuf::from(d);
    }
    let exe = std::env::current_exe().unwrap();
    // <target>/<profile>/deps/<test binary>
    exe.ancestors().nth(3).unwrap().join("images")
}
