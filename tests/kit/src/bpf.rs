//! The bpf backend's pins and maps as a user reads them (bpftool), and its agent.

use std::path::PathBuf;

use peerwall_backend_bpf::loader;

use crate::net::{sh, spawn_agent};
use crate::proc::Proc;
use crate::{peerwall, NetNs};

/// A private pin directory under bpffs, removed (with its links) on drop.
pub struct Pins(pub PathBuf);

impl Pins {
    pub fn new(tag: &str) -> Self {
        let root = loader::ensure_bpffs().expect("bpffs");
        Pins(root.join(format!("pwt-{tag}-{}", std::process::id())))
    }
    pub fn arg(&self) -> &str {
        self.0.to_str().unwrap_or_default()
    }
}

impl Drop for Pins {
    fn drop(&mut self) {
        let _ = loader::remove_pins(&self.0);
    }
}

/// `peerwall ARGS` in the namespace's network (nsenter keeps /sys/fs/bpf visible).
pub fn peerwall_net(ns: &NetNs, args: &[&str]) -> std::process::Output {
    let bin = peerwall();
    let net = format!("--net=/run/netns/{}", ns.name());
    let mut full = vec![net.as_str(), bin.to_str().unwrap_or_default()];
    full.extend_from_slice(args);
    sh("nsenter", &full)
}

/// `peerwall apply --backend bpf --pin-dir PINS [EXTRA...] -f FILE` in the namespace; must succeed.
pub fn apply_bpf(ns: &NetNs, pins: &Pins, extra: &[&str], file: &std::path::Path) {
    apply_bpf_said(ns, pins, extra, file);
}

/// `peerwall inspect --output json` of the datapath pinned in `pins`.
pub fn inspect_json(ns: &NetNs, pins: &Pins) -> serde_json::Value {
    let o = peerwall_net(
        ns,
        &["inspect", "--pin-dir", pins.arg(), "--output", "json"],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).expect("inspect json")
}

/// [`apply_bpf`], returning what the command printed (stdout, then stderr: its warnings).
pub fn apply_bpf_said(ns: &NetNs, pins: &Pins, extra: &[&str], file: &std::path::Path) -> String {
    let mut args = vec!["apply", "--backend", "bpf", "--pin-dir", pins.arg()];
    args.extend_from_slice(extra);
    args.extend(["-f", file.to_str().unwrap_or_default()]);
    let o = peerwall_net(ns, &args);
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "{out}");
    out
}

pub fn ok(o: std::process::Output) {
    assert!(
        o.status.success(),
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

pub fn bpftool_json(args: &[&str]) -> serde_json::Value {
    let mut full = vec!["-j"];
    full.extend_from_slice(args);
    let o = sh("bpftool", &full);
    assert!(
        o.status.success(),
        "bpftool {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).expect("bpftool json")
}

/// The name of the program a pinned link (`<pins>/links/<link>`) runs, read with bpftool.
pub fn linked_program(pins: &std::path::Path, link: &str) -> String {
    let pin = pins.join("links").join(link);
    let l = bpftool_json(&["link", "show", "pinned", pin.to_str().expect("UTF-8 path")]);
    let id = l["prog_id"]
        .as_u64()
        .expect("the link's prog_id")
        .to_string();
    let p = bpftool_json(&["prog", "show", "id", id.as_str()]);
    p["name"].as_str().expect("the program's name").to_string()
}

/// Packets counted at `COUNTERS<slot>[index]`, summed over CPUs, read with bpftool.
pub fn counted(pins: &Pins, slot: u64, index: u32) -> u64 {
    let map = format!("{}/COUNTERS{slot}", pins.arg());
    let key: Vec<String> = index.to_le_bytes().iter().map(|b| b.to_string()).collect();
    let mut args = vec!["map", "lookup", "pinned", map.as_str(), "key"];
    args.extend(key.iter().map(String::as_str));
    let v = bpftool_json(&args);
    v["values"]
        .as_array()
        .expect("per-cpu values")
        .iter()
        .map(|c| {
            let bytes: Vec<u8> = value_bytes(&c["value"]).into_iter().take(8).collect();
            u64::from_le_bytes(bytes.try_into().unwrap_or([0; 8]))
        })
        .sum()
}

/// The bytes of entry 0 of the pinned array `name` (`CONFIG`, `CT_SWEPT`), read with bpftool.
pub fn entry0(pins: &Pins, name: &str) -> Vec<u8> {
    let map = format!("{}/{name}", pins.arg());
    let v = bpftool_json(&["map", "lookup", "pinned", &map, "key", "0", "0", "0", "0"]);
    value_bytes(&v["value"])
}

/// The live slot: bit 0 of `CONFIG.active` (the rest counts policy changes).
pub fn active_slot(pins: &Pins) -> u64 {
    u64::from(entry0(pins, "CONFIG")[0] & 1)
}

/// A `peerwall agent --backend bpf` over the YAML files of `dir` in `ns`'s network, polling
/// every `interval_ms`; killed on drop.
pub fn bpf_agent(ns: &NetNs, pins: &Pins, dir: &std::path::Path, interval_ms: u32) -> Proc {
    let args = [
        "--backend".to_string(),
        "bpf".into(),
        "--interval-ms".into(),
        interval_ms.to_string(),
        "--pin-dir".into(),
        pins.arg().into(),
        "--source".into(),
        format!("dir:{}", dir.display()),
    ];
    spawn_agent(ns, &args)
}

/// The bytes of a value bpftool prints as `["0x01", ...]`.
pub fn value_bytes(v: &serde_json::Value) -> Vec<u8> {
    v.as_array()
        .expect("bytes")
        .iter()
        .map(|b| {
            u8::from_str_radix(b.as_str().unwrap_or("0").trim_start_matches("0x"), 16).unwrap_or(0)
        })
        .collect()
}

/// `CONFIG.flags` (`peerwall_common::flags`), read with bpftool.
pub fn config_flags(pins: &Pins) -> u32 {
    let b = entry0(pins, "CONFIG");
    u32::from_le_bytes([b[4], b[5], b[6], b[7]])
}

/// `FLOW_SEEN`'s stamp (u16) of `slot`, with bpftool: the lane of its entry
/// ([`peerwall_common::seen_line_of`]: 32 stamps to an entry).
pub fn seen_entry(pins: &Pins, slot: u32) -> u16 {
    let map = format!("{}/FLOW_SEEN", pins.arg());
    let (line, lane) = peerwall_common::seen_line_of(slot);
    let key: Vec<String> = line.to_le_bytes().iter().map(|b| b.to_string()).collect();
    let mut args = vec!["map", "lookup", "pinned", map.as_str(), "key"];
    args.extend(key.iter().map(String::as_str));
    let b = value_bytes(&bpftool_json(&args)["value"]);
    assert_eq!(b.len(), 64, "a FLOW_SEEN entry holds 32 stamps");
    u16::from_le_bytes([b[2 * lane], b[2 * lane + 1]])
}

/// `CLOCK_MONOTONIC` in ns (`bpf_ktime_get_ns`).
pub fn clock_monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into `ts`.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
