//! `--engine bpf`: run the real tc program, verified and loaded in this kernel with the policy
//! in its maps, on one packet via BPF_PROG_TEST_RUN.
//!
//! The object is loaded with its maps pinned in a private bpffs directory (removed on drop) and
//! probe mode on: the path (forward or input) and the interface indexes come from `skb->cb`
//! instead of a FIB lookup, and the deciding chain and rule are recorded in the per-CPU `LAST`
//! map. Interface names get private indexes; nothing is attached to any interface.
//! Conntrack states are made real by writing flows into `FLOWS` and shaping the packet, as the
//! nftables engine does with `conntrack -I`. With the kernel's connection table
//! ([`BpfProbe::with_kernel_conntrack`]) TCP and UDP flows are written into the kernel's table of
//! a scratch namespace with `conntrack -I` instead, and every test run happens inside it (the
//! kfunc looks the connection up in the namespace of the run's device).

// size: the bpf probe engine: building the probe packet, running it through BPF_PROG_TEST_RUN,
// decoding the result; split candidates are its frame builder and decoder.

use peerwall_common::map;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use aya::maps::{MapData, PerCpuArray};
use aya::programs::{TestRun, TestRunOptions};
use peerwall_common::{FlowKey, ProbeRecord, PROBE_MAGIC};

use super::packet::{self, Shape};
use super::ProbeError;
use peerwall_backend_bpf::loader::{self, BpfError, Datapath};
use peerwall_backend_bpf::maps::{family_code, BpfPolicy, Iface};
use peerwall_policy::ir::{
    eval::proto, CtState, Packet, PacketPath, Policy, Verdict, VerdictAction,
};

static COUNTER: AtomicU32 = AtomicU32::new(0);
const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;
/// First private interface index.
const IFINDEX_BASE: u32 = 1000;

/// Hosts per exact-match map of the scratch datapath.
const PROBE_HOSTS: u32 = 4;

impl From<BpfError> for ProbeError {
    fn from(e: BpfError) -> Self {
        ProbeError::Bpf(e)
    }
}

/// What BPF_PROG_TEST_RUN reported.
struct RunResult {
    return_value: u32,
    data_size_out: u32,
}

/// tc actions the program returns.
pub mod tc_action {
    /// Pass the packet on.
    pub const OK: u32 = super::TC_ACT_OK;
    /// Drop it.
    pub const SHOT: u32 = super::TC_ACT_SHOT;
    /// Sent elsewhere (a reject's ICMP answer).
    pub const REDIRECT: u32 = super::TC_ACT_REDIRECT;
}

/// What the datapath did with a raw frame ([`BpfProbe::frame_verdict`]).
#[derive(Clone, Debug, PartialEq)]
pub struct FrameRun {
    /// The tc action returned ([`tc_action`]).
    pub tc_action: u32,
    /// The verdict, when the frame was classified.
    pub verdict: Option<Verdict>,
}

/// What the second of two identical packets got ([`BpfProbe::verdict_repeated`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Repeat {
    /// The verdict cache served it (it was not classified again).
    pub cached: bool,
    /// Serving it copied the verdict into this CPU's first-level cache (`VERDICTS4_CPU`), and a
    /// third identical packet, served from there, got the same tc action and counts.
    pub per_cpu: bool,
}

/// The calling thread kept on the CPU it runs on until dropped (its affinity then restored):
/// BPF_PROG_TEST_RUN runs the program on the caller's CPU, and the per-CPU cache's test needs
/// its runs on one CPU.
struct StayOnCpu {
    cpu: u32,
    saved: libc::cpu_set_t,
}

impl StayOnCpu {
    fn here() -> Result<Self, ProbeError> {
        Self::on(None)
    }

    /// Kept on `cpu`, or (None) on the CPU it runs on now.
    fn on(cpu: Option<u32>) -> Result<Self, ProbeError> {
        let err = |what| {
            move |()| ProbeError::Socket {
                what,
                source: std::io::Error::last_os_error(),
            }
        };
        // SAFETY: cpu_set_t is plain data; the calls read and write only these sets and affect
        // only the calling thread (pid 0).
        unsafe {
            let mut saved: libc::cpu_set_t = std::mem::zeroed();
            let size = std::mem::size_of::<libc::cpu_set_t>();
            (libc::sched_getaffinity(0, size, &mut saved) == 0)
                .then_some(())
                .ok_or(())
                .map_err(err("sched_getaffinity"))?;
            let cpu = match cpu {
                Some(c) => c,
                None => u32::try_from(libc::sched_getcpu())
                    .map_err(|_| ())
                    .map_err(err("sched_getcpu"))?,
            };
            let mut one: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu as usize, &mut one);
            (libc::sched_setaffinity(0, size, &one) == 0)
                .then_some(())
                .ok_or(())
                .map_err(err("sched_setaffinity"))?;
            Ok(Self { cpu, saved })
        }
    }
}

impl Drop for StayOnCpu {
    fn drop(&mut self) {
        // SAFETY: restores the mask read in `here`, for the calling thread only.
        unsafe {
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &self.saved);
        }
    }
}

/// The `VERDICTS4` key of an IPv4 TCP or UDP packet (what the known-flow path reads).
fn verdict_key4(pkt: &Packet) -> Option<peerwall_common::VerdictKey4> {
    let (std::net::IpAddr::V4(src), std::net::IpAddr::V4(dst)) = (pkt.src, pkt.dst) else {
        return None;
    };
    if pkt.proto != proto::TCP && pkt.proto != proto::UDP {
        return None;
    }
    Some(peerwall_common::VerdictKey4 {
        src: src.octets(),
        dst: dst.octets(),
        sport: pkt.sport.to_be_bytes(),
        dport: pkt.dport.to_be_bytes(),
        proto: pkt.proto,
        icmp_type: 0,
        _pad: [0; 2],
    })
}

/// A probe packet classified in full, and what rebuilds its frame.
struct Classified {
    verdict: Verdict,
    marker: u32,
    shape: Shape,
    iif: u32,
    oif: u32,
    tc_action: u32,
}

/// The loaded datapath with a policy, answering verdict queries.
pub struct BpfProbe {
    backend: Datapath,
    bp: BpfPolicy,
    ifindex: HashMap<String, u32>,
    pin_dir: PathBuf,
    marker: u32,
    /// TCP connections a conversation opened since the flows were last reset, either way
    /// (source, destination, ports): their next segments are ACKs, the first a SYN.
    opened: std::collections::HashSet<(std::net::IpAddr, std::net::IpAddr, u16, u16)>,
    /// The kernel's connection table, when the datapath reads it for TCP and UDP.
    kernel: Option<KernelTable>,
}

/// The namespace whose kernel connection table a kernel-conntrack probe writes and runs in.
struct KernelTable {
    ns: peerwall_netns::NetNs,
    /// Entries were written since the table was last flushed.
    dirty: bool,
}

impl Drop for BpfProbe {
    fn drop(&mut self) {
        let _ = loader::remove_pins(&self.pin_dir);
    }
}

fn key(src: &std::net::IpAddr, dst: &std::net::IpAddr, p: u8, sport: u16, dport: u16) -> FlowKey {
    let octets = |a: &std::net::IpAddr| {
        let mut b = [0u8; 16];
        match a {
            std::net::IpAddr::V4(v) => b[..4].copy_from_slice(&v.octets()),
            std::net::IpAddr::V6(v) => b.copy_from_slice(&v.octets()),
        }
        b
    };
    FlowKey {
        src: octets(src),
        dst: octets(dst),
        sport: sport.to_be_bytes(),
        dport: dport.to_be_bytes(),
        proto: p,
        family: family_code(peerwall_policy::ir::IpFamily::of(src)),
        _pad: [0; 2],
    }
}

/// The protocols whose state a kernel-conntrack datapath takes from the kernel's table.
fn kernel_proto(p: u8) -> bool {
    p == proto::TCP || p == proto::UDP
}

/// Prefix of a kernel-conntrack probe's namespace (`pwct-<pid>-<n>`).
const KERNEL_NS_PREFIX: &str = "pwct";

/// Delete the namespaces of kernel-conntrack probes whose process is gone (ended by `exit`, as a
/// fuzzer does, their namespaces were never dropped).
fn sweep_namespaces() {
    for e in std::fs::read_dir("/run/netns")
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(KERNEL_NS_PREFIX)
            .and_then(|r| r.strip_prefix('-'))
            .and_then(|r| r.split('-').next())
            .filter(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        if !std::path::Path::new("/proc").join(pid).exists() {
            let _ = peerwall_netns::run("ip", &["netns", "del", &name]);
        }
    }
}

/// Remove the scratch datapaths of probe processes that are gone without cleaning up (killed,
/// or ended by `exit` as a fuzzer does): `pwprobe-<pid>-<n>` in `parent` whose process no
/// longer exists, with their slot metadata.
fn sweep(parent: &std::path::Path) {
    for e in std::fs::read_dir(parent).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix("pwprobe-")
            .and_then(|r| r.split('-').next())
            .filter(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        if !std::path::Path::new("/proc").join(pid).exists() {
            let _ = loader::remove_pins(&e.path());
        }
    }
}

impl BpfProbe {
    /// Load the datapath under a private pin directory (in `parent`, a bpffs mount) with
    /// `policy`, for interfaces `ifnames`.
    pub fn new(
        policy: &Policy,
        ifnames: &[String],
        parent: &std::path::Path,
    ) -> Result<Self, ProbeError> {
        Self::load(policy, ifnames, parent, None)
    }

    /// [`new`](Self::new), the datapath reading the kernel's connection table for TCP and UDP
    /// (`--bpf-conntrack kernel`), in a scratch network namespace of its own.
    pub fn with_kernel_conntrack(
        policy: &Policy,
        ifnames: &[String],
        parent: &std::path::Path,
    ) -> Result<Self, ProbeError> {
        sweep_namespaces();
        let ns = peerwall_netns::NetNs::new(KERNEL_NS_PREFIX)?;
        Self::load(
            policy,
            ifnames,
            parent,
            Some(KernelTable { ns, dirty: false }),
        )
    }

    fn load(
        policy: &Policy,
        ifnames: &[String],
        parent: &std::path::Path,
        kernel: Option<KernelTable>,
    ) -> Result<Self, ProbeError> {
        sweep(parent);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let pin_dir = parent.join(format!("pwprobe-{}-{n}", std::process::id()));
        let mut names: Vec<String> = ifnames.to_vec();
        names.sort();
        names.dedup();
        let ifaces: Vec<Iface> = names
            .iter()
            .enumerate()
            .map(|(i, n)| Iface {
                name: n.clone(),
                ifindex: IFINDEX_BASE + i as u32,
            })
            .collect();
        let opts = loader::LoadOptions {
            conntrack: if kernel.is_some() {
                loader::Conntrack::Kernel { v4: true, v6: true }
            } else {
                loader::Conntrack::Own
            },
            // Room for four hosts per map, and one line of three for them in the one-line
            // tables: a policy of more (most differential tests' and fuzz cases' with hosts:
            // their pools are small) has hosts in the lines, in an overflowed line's host map,
            // and in the tries, so the reference judges every lookup (`loader/layout.rs`,
            // `loader/lines.rs`).
            hosts: Some(PROBE_HOSTS),
            ..loader::LoadOptions::default()
        };
        let mut backend = Datapath::load_with(&pin_dir, &opts)?;
        let mut probe = Self {
            bp: BpfPolicy::default(),
            ifindex: ifaces.iter().map(|i| (i.name.clone(), i.ifindex)).collect(),
            pin_dir,
            marker: std::process::id().wrapping_mul(2_246_822_519),
            opened: Default::default(),
            kernel,
            backend: {
                backend.set_probe_mode()?;
                backend
            },
        };
        probe.backend.apply(policy, &ifaces)?;
        if probe.kernel.is_some() {
            // As an agent's first apply: the shortcut armed (no program is attached, so none
            // can miss a stamp), then the kernel's table swept (`kernel_insert` sweeps again
            // after each connection it writes, as the agent's upkeep would find it).
            probe.backend.arm_flow_seen()?;
            probe.sweep_kernel_table()?;
        }
        probe.bp = probe.backend.policy().cloned().unwrap_or_default();
        // Verify the program now, so a verifier failure is reported as such.
        probe.backend.tc_program()?;
        Ok(probe)
    }

    fn last_records(&mut self) -> Result<Vec<ProbeRecord>, ProbeError> {
        let m: PerCpuArray<&mut MapData, ProbeRecord> =
            PerCpuArray::try_from(self.backend.map_mut(map::LAST)?).map_err(|source| {
                BpfError::Map {
                    map: map::LAST.into(),
                    source,
                }
            })?;
        let v = m.get(&0, 0).map_err(|source| BpfError::Map {
            map: map::LAST.into(),
            source,
        })?;
        Ok(v.iter().copied().collect())
    }

    /// Conntrack state as the datapath will see it: flows inserted into its table, and the
    /// shape of the packet (an ACK, an ICMP error, bad flags) that produces the state.
    fn prepare_ct(&mut self, pkt: &Packet, marker: u32) -> Result<Shape, ProbeError> {
        let unsupported = |m: &str| Err(ProbeError::Unsupported(m.to_string()));
        let icmp = if pkt.src.is_ipv6() {
            proto::ICMPV6
        } else {
            proto::ICMP
        };
        let mut shape = Shape::default();
        self.flush_kernel_table()?;
        match pkt.ct_state {
            CtState::New => {}
            CtState::Established if self.kernel.is_some() && kernel_proto(pkt.proto) => {
                shape.tcp_ack = pkt.proto == proto::TCP;
                // Either way round: the kernel finds a reply by its reply tuple.
                let reply = marker & (1 << 30) != 0;
                let (s, d, sp, dp) = if reply {
                    (&pkt.dst, &pkt.src, pkt.dport, pkt.sport)
                } else {
                    (&pkt.src, &pkt.dst, pkt.sport, pkt.dport)
                };
                self.kernel_insert(pkt.proto, (s, d, sp, dp), !reply || pkt.proto == proto::TCP)?;
            }
            CtState::Related if self.kernel.is_some() && pkt.proto == icmp => {
                shape.icmp_error = true;
                let (qs, qd) = packet::related_inner_ports(marker);
                self.kernel_insert(proto::UDP, (&pkt.dst, &pkt.src, qs, qd), false)?;
            }
            CtState::Established => match pkt.proto {
                proto::TCP => {
                    shape.tcp_ack = true;
                    let k = key(&pkt.src, &pkt.dst, pkt.proto, pkt.sport, pkt.dport);
                    self.backend.insert_flow(k, true)?;
                }
                proto::UDP | proto::SCTP => {
                    shape.sctp_data = pkt.proto == proto::SCTP;
                    let k = key(&pkt.src, &pkt.dst, pkt.proto, pkt.sport, pkt.dport);
                    self.backend.insert_flow(k, true)?;
                }
                p if p == icmp => {
                    let k = key(&pkt.src, &pkt.dst, pkt.proto, (marker >> 16) as u16, 0);
                    self.backend.insert_flow(k, true)?;
                }
                _ => return unsupported("ct state established needs tcp, udp, sctp or icmp"),
            },
            CtState::Related => {
                if pkt.proto != icmp {
                    return unsupported(
                        "ct state related is reproduced with an ICMP error: use --proto icmp",
                    );
                }
                shape.icmp_error = true;
                let (qs, qd) = packet::related_inner_ports(marker);
                let k = key(&pkt.dst, &pkt.src, proto::UDP, qs, qd);
                self.backend.insert_flow(k, false)?;
            }
            CtState::Invalid => match pkt.proto {
                proto::TCP => shape.tcp_syn_fin = true,
                proto::SCTP => shape.sctp_data = true,
                p if p == icmp => shape.echo_reply = true,
                _ => {
                    return unsupported(
                        "the bpf datapath classifies only TCP (bad flags), SCTP (chunks that open no association) and ICMP (unsolicited replies, errors about unknown flows) as invalid",
                    )
                }
            },
            CtState::Untracked => {
                return unsupported("the bpf datapath never produces ct state untracked (no notrack)")
            }
        }
        Ok(shape)
    }

    /// Empty the kernel's connection table of a kernel-conntrack probe if anything was written.
    fn flush_kernel_table(&mut self) -> Result<(), ProbeError> {
        if let Some(k) = self.kernel.as_mut().filter(|k| k.dirty) {
            k.ns.exec("conntrack", &["-F"])?;
            k.dirty = false;
        }
        Ok(())
    }

    /// Write one connection into the kernel's table (`conntrack -I`), as `(source,
    /// destination, source port, destination port)` of its original direction; `replied`:
    /// the kernel saw its reply (a TCP connection is then established).
    fn kernel_insert(
        &mut self,
        p: u8,
        (s, d, sp, dp): (&std::net::IpAddr, &std::net::IpAddr, u16, u16),
        replied: bool,
    ) -> Result<(), ProbeError> {
        let Some(k) = self.kernel.as_mut() else {
            return Err(ProbeError::Unsupported(
                "the kernel's connection table is not this probe's".into(),
            ));
        };
        let (s, d, sp, dp) = (s.to_string(), d.to_string(), sp.to_string(), dp.to_string());
        let name = if p == proto::TCP { "tcp" } else { "udp" };
        let mut args = vec![
            "-I", "-s", &s, "-d", &d, "-p", name, "--sport", &sp, "--dport", &dp, "-t", "120",
        ];
        if p == proto::TCP {
            args.extend(["--state", "ESTABLISHED"]);
        }
        if replied {
            args.extend(["-u", "SEEN_REPLY,ASSURED"]);
        }
        k.dirty = true;
        k.ns.exec("conntrack", &args)?;
        self.sweep_kernel_table()
    }

    /// The namespace whose connection table a kernel-conntrack probe reads (None: the probe
    /// keeps connections in the datapath's own tables).
    pub fn kernel_ns(&self) -> Option<&peerwall_netns::NetNs> {
        self.kernel.as_ref().map(|k| &k.ns)
    }

    /// Make `policy` live on the loaded program, for the same interfaces, as an agent's next
    /// apply does (the idle slot written and switched to, or the live one changed in place):
    /// the program and its per-CPU state stay.
    pub fn apply(&mut self, policy: &Policy) -> Result<(), ProbeError> {
        let mut ifaces: Vec<Iface> = self
            .ifindex
            .iter()
            .map(|(name, ifindex)| Iface {
                name: name.clone(),
                ifindex: *ifindex,
            })
            .collect();
        ifaces.sort_by_key(|i| i.ifindex);
        self.backend.apply(policy, &ifaces)?;
        self.bp = self.backend.policy().cloned().unwrap_or_default();
        Ok(())
    }

    /// The loaded datapath (tests: its maps and switches).
    pub fn datapath(&mut self) -> &mut Datapath {
        &mut self.backend
    }

    /// The agent's sweep of the kernel's table (`peerwall_backend_bpf::sweep`), in the
    /// probe's namespace: every connection there stamped into `FLOW_SEEN` and vouched for.
    pub fn sweep_kernel_table(&mut self) -> Result<(), ProbeError> {
        let Some(k) = self.kernel.as_ref() else {
            return Ok(());
        };
        let _inside = k.ns.enter()?;
        let mut table = peerwall_backend_select::CtTable::default();
        peerwall_backend_bpf::sweep::sweep(&mut self.backend, &mut table)?;
        Ok(())
    }

    /// Run the tc program on the packet with BPF_PROG_TEST_RUN (probe mode: the interfaces
    /// and path come in the skb's control block); returns the datapath's record of the
    /// decision, the run's result and the frame it left (an ICMP answer for reject).
    fn run_program(
        &mut self,
        pkt: &Packet,
        marker: u32,
        shape: Shape,
        iif: u32,
        oif: u32,
    ) -> Result<(ProbeRecord, RunResult, Vec<u8>), ProbeError> {
        let ip = packet::build_ip(pkt, marker, shape);
        let frame = packet::ethernet([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2], &ip);
        let (rec, result, out) =
            self.test_run(&frame, pkt.path() == PacketPath::Forward, iif, oif)?;
        let rec = rec.ok_or_else(|| {
            ProbeError::Unsupported(format!(
                "the datapath did not classify the packet (returned {}): not IP?",
                result.return_value
            ))
        })?;
        Ok((rec, result, out))
    }

    /// One BPF_PROG_TEST_RUN of the tc program on `frame` in probe mode: the record of the
    /// decision (None when the program did not classify the frame), the run's result and the
    /// frame it left.
    fn test_run(
        &mut self,
        frame: &[u8],
        forward: bool,
        iif: u32,
        oif: u32,
    ) -> Result<(Option<ProbeRecord>, RunResult, Vec<u8>), ProbeError> {
        // struct __sk_buff: cb[0..5] at offset 48.
        let mut ctx = [0u8; 192];
        let cb = [PROBE_MAGIC, u32::from(forward), oif, iif];
        for (i, v) in cb.iter().enumerate() {
            ctx[48 + i * 4..52 + i * 4].copy_from_slice(&v.to_ne_bytes());
        }
        let before = self.last_records()?;
        // The kernel's table is the one of the run's device, this thread's namespace's loopback.
        let _inside = match &self.kernel {
            Some(k) => Some(k.ns.enter()?),
            None => None,
        };
        let mut out = vec![0u8; frame.len() + 256];
        let result = self
            .backend
            .tc_program()?
            .test_run(TestRunOptions {
                data_in: Some(frame),
                data_out: Some(&mut out),
                ctx_in: Some(&ctx),
                ..TestRunOptions::default()
            })
            .map_err(|source| BpfError::Program {
                what: "BPF_PROG_TEST_RUN".into(),
                source,
            })?;
        let after = self.last_records()?;
        let rec = after
            .iter()
            .zip(
                before
                    .iter()
                    .chain(std::iter::repeat(&ProbeRecord::default())),
            )
            .find(|(a, b)| a.seq != b.seq)
            .map(|(a, _)| *a);
        Ok((
            rec,
            RunResult {
                return_value: result.return_value,
                data_size_out: result.data_size_out,
            },
            out,
        ))
    }

    /// The datapath's verdict on one packet (forward or input path).
    pub fn verdict(&mut self, pkt: &Packet) -> Result<Verdict, ProbeError> {
        self.classify(pkt).map(|c| c.verdict)
    }

    /// The datapath's verdict on `pkt` with the verdict cache on
    /// ([`peerwall_common::flags::PROBE_CACHE`]), then the same frame once more. The second run
    /// must return the same tc action and count the same rules, packets and bytes as the first,
    /// whether the cache served it or it was classified again (then with the same verdict);
    /// otherwise [`ProbeError::Inconsistent`]. Returns the first run's verdict and whether the
    /// cache served the second.
    pub fn verdict_repeated(&mut self, pkt: &Packet) -> Result<(Verdict, Repeat), ProbeError> {
        self.backend.set_probe_cache(true)?;
        let r = self.classify_twice(pkt);
        self.backend.set_probe_cache(false)?;
        r
    }

    /// Forget every flow and cached verdict (before a [`conversation`](Self::conversation)).
    pub fn reset_flows(&mut self) -> Result<(), ProbeError> {
        self.opened.clear();
        self.backend.flush_flows()?;
        Ok(self.backend.flush_verdicts()?)
    }

    /// Run `steps` in order with the verdict cache on, as a live gateway would: conntrack and
    /// the caches carry over from one packet to the next, and from the conversation before (no
    /// state is prepared: a packet's state is whatever the ones before it left). Each runs on the CPU
    /// given with it (the caller's is restored after). A TCP connection's first segment in
    /// either direction since [`reset_flows`](Self::reset_flows) is a SYN, the rest ACKs
    /// (the datapath picks no connection up mid-stream). Returns, per step, the tc action and
    /// whether the datapath classified the packet (false: a cached verdict served it).
    pub fn conversation(
        &mut self,
        steps: &[(u32, Packet)],
    ) -> Result<Vec<(u32, bool)>, ProbeError> {
        self.backend.set_probe_cache(true)?;
        let r = self.converse(steps);
        self.backend.set_probe_cache(false)?;
        r
    }

    fn converse(&mut self, steps: &[(u32, Packet)]) -> Result<Vec<(u32, bool)>, ProbeError> {
        let idx = |p: &Self, n: &Option<String>| -> Result<u32, ProbeError> {
            match n {
                None => Ok(0),
                Some(n) => p.ifindex.get(n).copied().ok_or_else(|| {
                    ProbeError::Unsupported(format!("interface {n:?} was not declared"))
                }),
            }
        };
        let mut out = Vec::with_capacity(steps.len());
        for (cpu, pkt) in steps {
            let _on = StayOnCpu::on(Some(*cpu))?;
            let (iif, oif) = (idx(self, &pkt.iif)?, idx(self, &pkt.oif)?);
            // A TCP connection opens with a SYN (none is picked up mid-stream); every segment
            // after it, either way, is an ACK.
            let fresh = pkt.proto == proto::TCP
                && !self
                    .opened
                    .contains(&(pkt.dst, pkt.src, pkt.dport, pkt.sport))
                && self.opened.insert((pkt.src, pkt.dst, pkt.sport, pkt.dport));
            let shape = Shape {
                tcp_ack: pkt.proto == proto::TCP && !fresh,
                ..Shape::default()
            };
            let ip = packet::build_ip(pkt, self.marker, shape);
            let frame = packet::ethernet([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2], &ip);
            let forward = pkt.path() == PacketPath::Forward;
            let (rec, ret, _) = self.test_run(&frame, forward, iif, oif)?;
            out.push((ret.return_value, rec.is_some()));
        }
        Ok(out)
    }

    /// Forget the shared level of the verdict cache and keep every CPU's own (see
    /// [`cpu_cached`](Self::cpu_cached)): a packet served after this was served by its CPU's
    /// level.
    pub fn forget_shared_verdicts(&mut self) -> Result<(), ProbeError> {
        Ok(self.backend.flush_shared_verdicts()?)
    }

    /// The set of the per-CPU verdict cache (`VERDICTS4_CPU`) that `pkt`'s flow falls in, for
    /// an IPv4 TCP or UDP packet (the only ones that cache has).
    pub fn cpu_cache_set(pkt: &Packet) -> Option<u32> {
        verdict_key4(pkt).map(|k| peerwall_common::verdict_set(k.words()))
    }

    /// The CPUs whose first-level verdict cache holds a current verdict for IPv4 TCP or UDP
    /// packet `pkt`'s flow (empty for other packets).
    pub fn cpu_cached(&mut self, pkt: &Packet) -> Result<Vec<u32>, ProbeError> {
        match verdict_key4(pkt) {
            Some(k) => Ok(self.backend.cpu_cached(&k)?),
            None => Ok(Vec::new()),
        }
    }

    fn classify_twice(&mut self, pkt: &Packet) -> Result<(Verdict, Repeat), ProbeError> {
        let here = StayOnCpu::here()?;
        self.backend.flush_verdicts()?;
        let before = self.backend.counters()?;
        let first = self.classify(pkt)?;
        let mut last = self.backend.counters()?;
        let counted = delta(&last, &before);
        let ip = packet::build_ip(pkt, first.marker, first.shape);
        let frame = packet::ethernet([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2], &ip);
        let forward = pkt.path() == PacketPath::Forward;
        let inconsistent = |observed: &'static str| ProbeError::Inconsistent {
            observed,
            counted: "the first run's tc action, verdict and counts",
            packet: format!("{pkt:?}"),
        };
        // One run of the same packet again, held to the first: tc action, verdict when it was
        // classified, counts. Returns whether it was classified.
        let mut again = |p: &mut Self, which: [&'static str; 3]| -> Result<bool, ProbeError> {
            let (rec, ret, _) = p.test_run(&frame, forward, first.iif, first.oif)?;
            let now = p.backend.counters()?;
            if ret.return_value != first.tc_action {
                return Err(inconsistent(which[0]));
            }
            if let Some(rec) = &rec {
                if p.verdict_of(rec, first.verdict.verdict)? != first.verdict {
                    return Err(inconsistent(which[1]));
                }
            }
            if delta(&now, &last) != counted {
                return Err(inconsistent(which[2]));
            }
            last = now;
            Ok(rec.is_some())
        };
        const REPEAT: [&str; 3] = [
            "the repeated packet got another tc action than the first",
            "the repeated packet, classified again, got another verdict",
            "the repeated packet was counted in other rules than the first",
        ];
        let mut classified = again(self, REPEAT)?;
        if classified && first.tc_action == 0 {
            // An accept of a flow conntrack had never seen is not cached (its commit makes the
            // flow known, and the flow's next packet is cached): the packet after is the
            // repeat the cache is asked about.
            classified = again(self, REPEAT)?;
        }
        let cached = !classified;
        let mut per_cpu = false;
        if let Some(k) = verdict_key4(pkt).filter(|_| cached) {
            per_cpu = self.backend.cpu_cached(&k)?.contains(&here.cpu);
            let third = again(
                self,
                [
                    "the third packet got another tc action than the first",
                    "the third packet, classified again, got another verdict",
                    "the third packet was counted in other rules than the first",
                ],
            )?;
            if third {
                return Err(inconsistent(
                    "the third packet was classified again, not served from the cache",
                ));
            }
        }
        drop(here);
        Ok((first.verdict, Repeat { cached, per_cpu }))
    }

    fn classify(&mut self, pkt: &Packet) -> Result<Classified, ProbeError> {
        let unsupported = |m: &str| Err(ProbeError::Unsupported(m.to_string()));
        let path = pkt.path();
        if path == PacketPath::Output {
            return unsupported("an input interface is required (--iif)");
        }
        if pkt.src.is_ipv4() != pkt.dst.is_ipv4() {
            return unsupported("source and destination are of different families");
        }
        let idx = |n: &Option<String>| -> Result<u32, ProbeError> {
            match n {
                None => Ok(0),
                Some(n) => self.ifindex.get(n).copied().ok_or_else(|| {
                    ProbeError::Unsupported(format!("interface {n:?} was not declared"))
                }),
            }
        };
        let (iif, oif) = (idx(&pkt.iif)?, idx(&pkt.oif)?);
        self.marker = self.marker.wrapping_mul(1_103_515_245).wrapping_add(12345) | 1;
        let marker = self.marker;
        self.backend.flush_flows()?;
        let shape = self.prepare_ct(pkt, marker)?;
        let (rec, ret, out) = self.run_program(pkt, marker, shape, iif, oif)?;
        let verdict = match peerwall_common::ActionCode::from_u8(rec.verdict) {
            Some(peerwall_common::ActionCode::Accept) => VerdictAction::Accept,
            Some(peerwall_common::ActionCode::Drop) => VerdictAction::Drop,
            Some(peerwall_common::ActionCode::Reject) => VerdictAction::Reject,
            Some(
                peerwall_common::ActionCode::AuditDrop | peerwall_common::ActionCode::AuditReject,
            )
            | None => {
                return Err(ProbeError::Inconsistent {
                    observed: "unknown action code",
                    counted: "",
                    packet: format!("{pkt:?}"),
                })
            }
        };
        // What the program must have done with the frame: pass it, drop it, or (reject) turn it
        // into an ICMP port-unreachable sent back out of the input interface.
        let consistent = match (verdict, ret.return_value) {
            (VerdictAction::Accept, TC_ACT_OK) => true,
            (VerdictAction::Drop, TC_ACT_SHOT) => true,
            // The kernel never answers an ICMP error with another one.
            (VerdictAction::Reject, TC_ACT_SHOT) => shape.icmp_error,
            (VerdictAction::Reject, TC_ACT_REDIRECT) => {
                let n = (ret.data_size_out as usize).min(out.len());
                packet::strip_ethernet(&out[..n])
                    .is_some_and(|ip| packet::is_unreachable_for(ip, pkt, marker))
            }
            _ => false,
        };
        if !consistent {
            return Err(ProbeError::Inconsistent {
                observed: match ret.return_value {
                    TC_ACT_OK => "TC_ACT_OK",
                    TC_ACT_SHOT => "TC_ACT_SHOT",
                    TC_ACT_REDIRECT => "TC_ACT_REDIRECT (ICMP answer)",
                    _ => "another tc action",
                },
                counted: verdict.as_str(),
                packet: format!("{pkt:?}"),
            });
        }
        Ok(Classified {
            verdict: self.verdict_of(&rec, verdict)?,
            marker,
            shape,
            iif,
            oif,
            tc_action: ret.return_value,
        })
    }

    /// [`frame_verdict`](Self::frame_verdict) of `frame` with the verdict cache on, right after
    /// `first` went through on the same CPU until the cache served it (at most three times:
    /// a flow's first packet changes its conntrack state, which lapses the verdict it cached),
    /// from a flushed flow table and caches: the path a live gateway takes for a known flow's
    /// later packets, whose headers the datapath reads by hand before it looks the flow up
    /// (`known_flow_v4`). Returns what `first` did the first time and what `frame` did;
    /// `frame`'s verdict is `None` when a cached verdict served it (the datapath records no
    /// classification then).
    pub fn frame_verdict_after(
        &mut self,
        first: &[u8],
        frame: &[u8],
        iif: &str,
        oif: Option<&str>,
    ) -> Result<(FrameRun, FrameRun), ProbeError> {
        self.backend.flush_verdicts()?;
        self.backend.set_probe_cache(true)?;
        let runs = (|| {
            let _on = StayOnCpu::on(Some(0))?;
            let a = self.frame_verdict(first, iif, oif)?;
            if a.verdict.is_some() {
                for _ in 0..2 {
                    if self.run_frame(first, iif, oif)?.verdict.is_none() {
                        break;
                    }
                }
            }
            let b = self.run_frame(frame, iif, oif)?;
            Ok((a, b))
        })();
        self.backend.set_probe_cache(false)?;
        runs
    }

    /// What a frame the datapath was given raw did: the tc action it returned and, when it
    /// classified the frame, its verdict. No flow is known beforehand (the flow table is
    /// flushed), so the conntrack state is the one of a flow's first packet.
    pub fn frame_verdict(
        &mut self,
        frame: &[u8],
        iif: &str,
        oif: Option<&str>,
    ) -> Result<FrameRun, ProbeError> {
        self.backend.flush_flows()?;
        self.run_frame(frame, iif, oif)
    }

    /// One run of `frame` on whatever flows and caches the datapath holds.
    fn run_frame(
        &mut self,
        frame: &[u8],
        iif: &str,
        oif: Option<&str>,
    ) -> Result<FrameRun, ProbeError> {
        let idx = |n: &str| {
            self.ifindex
                .get(n)
                .copied()
                .ok_or_else(|| ProbeError::Unsupported(format!("interface {n:?} was not declared")))
        };
        let iif_idx = idx(iif)?;
        let oif_idx = oif.map(idx).transpose()?.unwrap_or(0);
        let (rec, ret, _) = self.test_run(frame, oif.is_some(), iif_idx, oif_idx)?;
        let verdict = match rec {
            None => None,
            Some(rec) => {
                let action = match peerwall_common::ActionCode::from_u8(rec.verdict) {
                    Some(peerwall_common::ActionCode::Accept) => VerdictAction::Accept,
                    Some(peerwall_common::ActionCode::Drop) => VerdictAction::Drop,
                    Some(peerwall_common::ActionCode::Reject) => VerdictAction::Reject,
                    _ => {
                        return Err(ProbeError::Inconsistent {
                            observed: "unknown action code",
                            counted: "",
                            packet: format!("a raw frame of {} bytes", frame.len()),
                        })
                    }
                };
                Some(self.verdict_of(&rec, action)?)
            }
        };
        Ok(FrameRun {
            tc_action: ret.return_value,
            verdict,
        })
    }

    /// The verdict a record of the datapath names: its chain and rule, its first would-drop.
    fn verdict_of(&self, rec: &ProbeRecord, verdict: VerdictAction) -> Result<Verdict, ProbeError> {
        let audit = match peerwall_common::ActionCode::from_u8(rec.audit) {
            None | Some(peerwall_common::ActionCode::Accept) => None,
            Some(code) => {
                let c = self
                    .bp
                    .chains
                    .get(rec.audit_chain as usize)
                    .ok_or_else(|| {
                        ProbeError::Unsupported(format!("unknown chain id {}", rec.audit_chain))
                    })?;
                Some(peerwall_policy::ir::AuditHit {
                    table: c.table.clone(),
                    chain: c.chain.clone(),
                    rule: c.rules.get(rec.audit_rule as usize).map(|r| r.name.clone()),
                    would: if code == peerwall_common::ActionCode::AuditReject {
                        VerdictAction::Reject
                    } else {
                        VerdictAction::Drop
                    },
                })
            }
        };
        if rec.has_chain == 0 {
            return Ok(Verdict {
                verdict,
                table: None,
                chain: None,
                rule: None,
                audit,
            });
        }
        let c =
            self.bp.chains.get(rec.chain as usize).ok_or_else(|| {
                ProbeError::Unsupported(format!("unknown chain id {}", rec.chain))
            })?;
        Ok(Verdict {
            verdict,
            table: Some(c.table.clone()),
            chain: Some(c.chain.clone()),
            rule: if rec.has_rule != 0 {
                c.rules.get(rec.rule as usize).map(|r| r.name.clone())
            } else {
                None
            },
            audit,
        })
    }
}

/// Per-rule (packets, bytes) counted between two counter readings.
fn delta(
    now: &[peerwall_backend::RuleCounter],
    then: &[peerwall_backend::RuleCounter],
) -> Vec<(u64, u64)> {
    now.iter()
        .zip(then)
        .map(|(x, y)| (x.packets - y.packets, x.bytes - y.bytes))
        .collect()
}
