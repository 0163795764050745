//! The benchmark topology: sender, gateway and receiver namespaces over veth.

use std::path::{Path, PathBuf};
use std::process::Command;

use peerwall_netns::NetNs;

use super::*;

pub(crate) struct Lab {
    pub(crate) snd: NetNs,
    pub(crate) gw: NetNs,
    pub(crate) rcv: NetNs,
    pub(crate) gw_mac: [u8; 6],
    pub(crate) snd_mac: [u8; 6],
    pub(crate) dir: PathBuf,
    /// The agent of a datapath that runs under one (the bpf and events rows: `deployed.rs`),
    /// stopped on uninstall.
    pub(crate) agent: std::cell::RefCell<Option<control::Agent>>,
}

pub(crate) fn mac_of(ns: &NetNs, dev: &str) -> [u8; 6] {
    let out = in_ns(ns, "cat", &[&format!("/sys/class/net/{dev}/address")]);
    let mut m = [0u8; 6];
    for (i, p) in out.trim().split(':').enumerate().take(6) {
        m[i] = u8::from_str_radix(p, 16).unwrap_or(0);
    }
    m
}

impl Lab {
    pub(crate) fn new() -> Self {
        let snd = NetNs::new("pwb-snd").expect("netns");
        let gw = NetNs::new("pwb-gw").expect("netns");
        let rcv = NetNs::new("pwb-rcv").expect("netns");
        let link = |a: &NetNs, an: &str, b: &NetNs, bn: &str| a.veth(an, b, bn).expect("veth");
        link(&snd, "eth0", &gw, TUNNEL);
        link(&gw, GENEVE, &rcv, "eth0");
        let ip = |ns: &NetNs, args: &[&str]| {
            ns.ip(args).unwrap_or_else(|e| panic!("ip {args:?}: {e}"));
        };
        ip(&snd, &["addr", "add", "172.30.0.2/30", "dev", "eth0"]);
        ip(&gw, &["addr", "add", "172.30.0.1/30", "dev", TUNNEL]);
        ip(&gw, &["addr", "add", "172.31.0.1/30", "dev", GENEVE]);
        ip(&rcv, &["addr", "add", "172.31.0.2/30", "dev", "eth0"]);
        let rcv_mac = mac_of(&rcv, "eth0");
        let snd_mac = mac_of(&snd, "eth0");
        let fmt = |m: [u8; 6]| {
            m.iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(":")
        };
        ip(
            &gw,
            &[
                "neigh",
                "replace",
                "172.31.0.2",
                "lladdr",
                &fmt(rcv_mac),
                "dev",
                GENEVE,
                "nud",
                "permanent",
            ],
        );
        ip(
            &gw,
            &[
                "neigh",
                "replace",
                "172.30.0.2",
                "lladdr",
                &fmt(snd_mac),
                "dev",
                TUNNEL,
                "nud",
                "permanent",
            ],
        );
        ip(&gw, &["route", "add", "10.0.0.0/8", "via", "172.31.0.2"]);
        ip(&gw, &["route", "add", "172.16.0.0/12", "via", "172.30.0.2"]);
        // A gateway pod's default route (its pod network): the bpf agent's local-address
        // mirror answers new flows' paths where every destination is routable.
        ip(&gw, &["route", "add", "default", "via", "172.31.0.2"]);
        for (k, v) in [
            ("net.ipv4.ip_forward", "1"),
            ("net.ipv4.conf.all.rp_filter", "0"),
            ("net.ipv4.conf.default.rp_filter", "0"),
        ] {
            gw.sysctl(k, v).expect("sysctl");
        }
        // `rcv` does not forward: it drops the packets after one route lookup, silently (no
        // ICMP is sent when forwarding is off).
        rcv.sysctl("net.ipv4.ip_forward", "0").expect("sysctl");
        let gw_mac = mac_of(&gw, TUNNEL);
        peerwall_backend_bpf::loader::ensure_bpffs().expect("bpffs");
        sweep_interrupted_runs();
        let dir = std::env::temp_dir().join(format!("peerwall-bench-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("tmp dir");
        Lab {
            snd,
            gw,
            rcv,
            gw_mac,
            snd_mac,
            dir,
            agent: Default::default(),
        }
    }

    pub(crate) fn pins(&self) -> String {
        format!("/sys/fs/bpf/peerwall-bench-{}", std::process::id())
    }
}

/// Pins (and their /run metadata) of benchmark runs that were killed before their lab's drop:
/// removed, so they hold no kernel memory and no leak check counts them.
fn sweep_interrupted_runs() {
    let meta = Path::new(peerwall_backend_bpf::inspect::META_ROOT).join("sys/fs/bpf");
    let mut names: Vec<String> = ["/sys/fs/bpf", &meta.to_string_lossy()]
        .iter()
        .flat_map(|d| std::fs::read_dir(d).into_iter().flatten().flatten())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names.dedup();
    for name in names {
        let Some(pid) = name.strip_prefix("peerwall-bench-") else {
            continue;
        };
        if pid.parse::<u32>().is_err() || Path::new("/proc").join(pid).exists() {
            continue;
        }
        let pins = Path::new("/sys/fs/bpf").join(&name);
        match peerwall_backend_bpf::loader::remove_pins(&pins) {
            Ok(_) => eprintln!("removed the pins of interrupted run {pid}"),
            Err(err) => eprintln!("could not remove the pins of interrupted run {pid}: {err}"),
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let pins = self.pins();
        let _ = Command::new("nsenter")
            .args([
                &format!("--net=/run/netns/{}", self.gw.name()),
                peerwall_bin(),
                "delete",
                "--backend",
                "bpf",
                "--pin-dir",
                &pins,
            ])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = &self.rcv;
    }
}

/// Interface counters read with `ip -s -j`.
pub(crate) fn link_stats(ns: &NetNs, dev: &str) -> (u64, u64, u64) {
    let out = in_ns(ns, "ip", &["-s", "-j", "link", "show", "dev", dev]);
    let v: serde_json::Value = serde_json::from_str(&out).expect("ip -j");
    let s = &v[0]["stats64"];
    let g = |p: &str| s.pointer(p).and_then(|x| x.as_u64()).unwrap_or(0);
    (g("/rx/packets"), g("/tx/packets"), g("/tx/dropped"))
}

/// Sum of the `dropped` column of /proc/net/softnet_stat (backlog overflows, all CPUs).
pub(crate) fn softnet_dropped() -> u64 {
    std::fs::read_to_string("/proc/net/softnet_stat")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .filter_map(|h| u64::from_str_radix(h, 16).ok())
        .sum()
}
