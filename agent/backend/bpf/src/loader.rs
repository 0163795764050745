//! The kernel edge of the bpf backend: load the embedded object, pin maps and links under a
//! bpffs directory, attach to interfaces (tcx ingress; XDP for early drop), write policies into
//! the idle copy of the maps and switch with one store, read counters.
//!
//! Pins (default `/sys/fs/bpf/peerwall/`): every map by its name (`SRC0`, `DSTH1`, `CONFIG`, ...),
//! and links as `links/<ifname>.tc` / `links/<ifname>.xdp`. Pinned links keep the programs
//! attached when the agent exits; a restarted agent reuses the pinned maps and links it finds,
//! so enforcement has no gap.

use std::collections::{BTreeMap, HashMap};
use std::ffi::CStr;
use std::path::{Path, PathBuf};

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{Array, HashMap as BpfHashMap, MapData, PerCpuArray};
use aya::programs::links::{FdLink, LinkOrder, PinnedLink};
use aya::programs::tc::{TcAttachOptions, TcAttachType};
use aya::programs::{SchedClassifier, Xdp, XdpMode};
use aya::{Ebpf, EbpfLoader, Pod};
use ipnet::IpNet;
use peerwall_common::{
    AddrKeyData, Bitmap, ChainInfo, Config, Counter, DimMasks, HookChains, IfKey, IfaceInfo,
    PortKeyData, ProtoKey, RuleInfo, ADDR_KEY_FIXED_BITS, MAX_RULES, PORT_KEY_FIXED_BITS,
};

use super::compile::{self, family_code, BpfPolicy, ChainMaps, Iface};
use peerwall_policy::ir;

/// The eBPF object, built by `agent/build.rs` from `ebpf/`.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/peerwall"));

/// Default pin directory.
pub const PIN_DIR: &str = "/sys/fs/bpf/peerwall";
/// Name of the tc program in the object.
pub const TC_PROGRAM: &str = "peerwall_tc";
/// Name of the XDP program in the object.
pub const XDP_PROGRAM: &str = "peerwall_xdp";

/// Failures of the bpf backend.
#[derive(Debug, thiserror::Error)]
pub enum BpfError {
    /// bpffs is not mounted where pins go.
    #[error("{0} is not on a bpf filesystem: mount it with `mount -t bpf bpf /sys/fs/bpf`")]
    NoBpffs(PathBuf),
    /// Loading or verifying the object failed.
    #[error("loading the eBPF object: {0}")]
    Load(#[from] aya::EbpfError),
    /// A program operation failed.
    #[error("{what}: {source}")]
    Program {
        /// What was attempted.
        what: String,
        /// Cause.
        source: aya::programs::ProgramError,
    },
    /// A map operation failed.
    #[error("map {map}: {source}")]
    Map {
        /// Map name.
        map: String,
        /// Cause.
        source: aya::maps::MapError,
    },
    /// A map missing from the object.
    #[error("map {0} is missing from the eBPF object")]
    MissingMap(String),
    /// A program missing from the object.
    #[error("program {0} is missing from the eBPF object")]
    MissingProgram(String),
    /// Pinning failed.
    #[error("pinning {path}: {source}")]
    Pin {
        /// Path.
        path: PathBuf,
        /// Cause.
        source: aya::pin::PinError,
    },
    /// Reading a pinned link failed.
    #[error("reading pinned link {path}: {source}")]
    Link {
        /// Path.
        path: PathBuf,
        /// Cause.
        source: aya::programs::links::LinkError,
    },
    /// Filesystem work failed.
    #[error("{path}: {source}")]
    Io {
        /// Path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The policy does not fit the datapath.
    #[error(transparent)]
    Compile(#[from] compile::BpfCompileError),
    /// No interface matched the attach patterns.
    #[error("no interface matches {0:?}")]
    NoInterface(Vec<String>),
    /// The host's interfaces could not be listed.
    #[error("listing interfaces: {0}")]
    ListInterfaces(#[source] std::io::Error),
}

fn map_err(map: &str) -> impl FnOnce(aya::maps::MapError) -> BpfError + '_ {
    move |source| BpfError::Map {
        map: map.to_string(),
        source,
    }
}

/// An interface of this network namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostIface {
    /// Name.
    pub name: String,
    /// Index.
    pub ifindex: u32,
    /// Bytes before the IP header: 14 for Ethernet, 0 for L3 devices (WireGuard, TUN).
    pub l2_len: u32,
}

/// Interfaces of the calling thread's network namespace (netlink via `if_nameindex`, device
/// type via `SIOCGIFHWADDR`), so it works on a thread that entered another namespace.
pub fn host_ifaces() -> std::io::Result<Vec<HostIface>> {
    // SAFETY: if_nameindex returns a heap array terminated by a zero entry, freed below.
    let list = unsafe { libc::if_nameindex() };
    if list.is_null() {
        return Err(std::io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut i = 0;
    loop {
        // SAFETY: within the array until the terminating entry.
        let e = unsafe { &*list.add(i) };
        if e.if_index == 0 || e.if_name.is_null() {
            break;
        }
        // SAFETY: if_name is a NUL-terminated string owned by the array.
        let name = unsafe { CStr::from_ptr(e.if_name) }
            .to_string_lossy()
            .into_owned();
        out.push((name, e.if_index));
        i += 1;
    }
    // SAFETY: `list` came from if_nameindex.
    unsafe { libc::if_freenameindex(list) };
    // SAFETY: plain socket(2) call for the ioctl below; closed on drop via OwnedFd.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor we own.
    let sock = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let mut ifaces = Vec::new();
    for (name, ifindex) in out {
        // SAFETY: ifreq is plain old data; zeroed is a valid start.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        for (d, s) in req.ifr_name.iter_mut().zip(name.bytes().take(15)) {
            *d = s as libc::c_char;
        }
        // SAFETY: SIOCGIFHWADDR fills ifr_hwaddr of a valid ifreq.
        let rc = unsafe {
            libc::ioctl(
                std::os::fd::AsRawFd::as_raw_fd(&sock),
                libc::SIOCGIFHWADDR,
                &mut req,
            )
        };
        // SAFETY: the union member ifru_hwaddr is what SIOCGIFHWADDR wrote.
        let family = unsafe { req.ifr_ifru.ifru_hwaddr.sa_family };
        let l2_len = if rc == 0 && family == libc::ARPHRD_ETHER {
            14
        } else {
            0
        };
        ifaces.push(HostIface {
            name,
            ifindex,
            l2_len,
        });
    }
    Ok(ifaces)
}

/// Interfaces whose names match a pattern (`name`, or `prefix*`).
pub fn matching<'a>(ifaces: &'a [HostIface], patterns: &[String]) -> Vec<&'a HostIface> {
    ifaces
        .iter()
        .filter(|i| {
            patterns.iter().any(|p| match p.strip_suffix('*') {
                Some(prefix) => i.name.starts_with(prefix),
                None => i.name == *p,
            })
        })
        .collect()
}

fn is_bpffs(path: &Path) -> bool {
    // SAFETY: statfs on a NUL-terminated path into a zeroed struct.
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
    rc == 0 && st.f_type as i64 == BPF_FS_MAGIC
}

/// Make sure `/sys/fs/bpf` is a bpf filesystem (mounting it when absent); returns it.
pub fn ensure_bpffs() -> Result<PathBuf, BpfError> {
    let root = PathBuf::from("/sys/fs/bpf");
    if is_bpffs(&root) {
        return Ok(root);
    }
    std::fs::create_dir_all(&root).map_err(|source| BpfError::Io {
        path: root.clone(),
        source,
    })?;
    let c = |s: &str| std::ffi::CString::new(s).unwrap_or_default();
    let (src, target, fstype) = (c("bpf"), c("/sys/fs/bpf"), c("bpf"));
    // SAFETY: mount(2) with NUL-terminated strings and no data.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 || !is_bpffs(&root) {
        return Err(BpfError::NoBpffs(root));
    }
    tracing::info!("mounted bpffs on /sys/fs/bpf");
    Ok(root)
}

/// Pin name of a link: bpffs refuses names with a dot, so `liqo.abc` is pinned as
/// `tc-liqo:abc` (interface names cannot contain ':').
pub fn link_pin_name(kind: &str, ifname: &str) -> String {
    format!("{kind}-{}", ifname.replace('.', ":"))
}

/// Attached programs of a pin directory, as `kind:interface`, from its pinned links.
pub fn attached_in(pin_dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(pin_dir.join("links"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| {
                    let n = e.file_name().to_string_lossy().into_owned();
                    parse_link_pin_name(&n).map(|(k, i)| format!("{k}:{i}"))
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Decode a link pin name into (kind, interface name).
pub fn parse_link_pin_name(pin: &str) -> Option<(&str, String)> {
    let (kind, name) = pin.split_once('-')?;
    Some((kind, name.replace(':', ".")))
}

/// What a slot's maps hold, as written by this process (for O(changes) updates).
type SlotContents = Option<BpfPolicy>;

/// What an apply did.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct BpfApplyReport {
    /// Slot now live.
    pub active: u32,
    /// Map entries written or deleted.
    pub entries_changed: usize,
    /// Whether the change went to the idle slot and was switched to (else: in place).
    pub switched: bool,
    /// Trie prefixes in the policy.
    pub prefixes: usize,
}

/// The loaded datapath.
pub struct BpfBackend {
    ebpf: Ebpf,
    pin_dir: PathBuf,
    slots: [SlotContents; 2],
    active: u32,
    policy: Option<BpfPolicy>,
}

impl std::fmt::Debug for BpfBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BpfBackend")
            .field("pin_dir", &self.pin_dir)
            .field("active", &self.active)
            .finish()
    }
}

/// Changes at most this many entries in place; more go through the idle slot.
const IN_PLACE_LIMIT: usize = 256;

impl BpfBackend {
    /// Load the object with its maps pinned in `pin_dir` (reusing maps already pinned there).
    pub fn load(pin_dir: &Path) -> Result<Self, BpfError> {
        let parent = pin_dir.parent().unwrap_or(Path::new("/"));
        if !is_bpffs(parent) && !is_bpffs(pin_dir) {
            return Err(BpfError::NoBpffs(parent.to_path_buf()));
        }
        std::fs::create_dir_all(pin_dir.join("links")).map_err(|source| BpfError::Io {
            path: pin_dir.to_path_buf(),
            source,
        })?;
        let ebpf = EbpfLoader::new()
            .default_map_pin_directory(pin_dir)
            .load(OBJECT)?;
        let mut b = Self {
            ebpf,
            pin_dir: pin_dir.to_path_buf(),
            slots: [None, None],
            active: 0,
            policy: None,
        };
        b.active = b.config()?.active & 1;
        Ok(b)
    }

    /// Pin directory.
    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    fn map(&mut self, name: &str) -> Result<&mut aya::maps::Map, BpfError> {
        self.ebpf
            .map_mut(name)
            .ok_or_else(|| BpfError::MissingMap(name.to_string()))
    }

    /// Current `CONFIG[0]`.
    pub fn config(&mut self) -> Result<Config, BpfError> {
        let m: Array<&mut MapData, Config> =
            Array::try_from(self.map("CONFIG")?).map_err(map_err("CONFIG"))?;
        m.get(&0, 0).map_err(map_err("CONFIG"))
    }

    fn set_config(&mut self, c: Config) -> Result<(), BpfError> {
        let mut m: Array<&mut MapData, Config> =
            Array::try_from(self.map("CONFIG")?).map_err(map_err("CONFIG"))?;
        m.set(0, c, 0).map_err(map_err("CONFIG"))
    }

    /// Emergency switch: pass everything (true) or enforce again (false).
    pub fn set_allow_all(&mut self, on: bool) -> Result<(), BpfError> {
        let mut m: Array<&mut MapData, u32> =
            Array::try_from(self.map("ALLOW_ALL")?).map_err(map_err("ALLOW_ALL"))?;
        m.set(0, u32::from(on), 0).map_err(map_err("ALLOW_ALL"))
    }

    /// Turn probe mode on (scratch engine only).
    pub fn set_probe_mode(&mut self) -> Result<(), BpfError> {
        let mut c = self.config()?;
        c.flags |= peerwall_common::flags::PROBE;
        self.set_config(c)
    }

    /// Tell the datapath how each interface frames packets.
    pub fn register_ifaces(&mut self, ifaces: &[HostIface]) -> Result<(), BpfError> {
        let mut m: BpfHashMap<&mut MapData, u32, IfaceInfo> =
            BpfHashMap::try_from(self.map("IFACES")?).map_err(map_err("IFACES"))?;
        for i in ifaces {
            m.insert(i.ifindex, IfaceInfo { l2_len: i.l2_len }, 0)
                .map_err(map_err("IFACES"))?;
        }
        Ok(())
    }

    /// A program of the object, loaded (verified) on first use.
    fn loaded<'a, P>(&'a mut self, name: &str) -> Result<&'a mut P, BpfError>
    where
        &'a mut P: TryFrom<&'a mut aya::programs::Program, Error = aya::programs::ProgramError>,
        P: ProgramLoad,
    {
        let prog: &mut P = self
            .ebpf
            .program_mut(name)
            .ok_or_else(|| BpfError::MissingProgram(name.into()))?
            .try_into()
            .map_err(|source| BpfError::Program {
                what: format!("{name} program type"),
                source,
            })?;
        prog.ensure_loaded().map_err(|source| BpfError::Program {
            what: format!("loading {name} (verifier)"),
            source,
        })?;
        Ok(prog)
    }

    /// Attach the tc program (tcx ingress) to an interface, and XDP when asked; pin the links.
    /// An interface that already has a pinned link keeps it (adoption without a gap).
    pub fn attach(&mut self, iface: &HostIface, xdp: bool) -> Result<(), BpfError> {
        self.register_ifaces(std::slice::from_ref(iface))?;
        let links = self.pin_dir.join("links");
        let tc_pin = links.join(link_pin_name("tc", &iface.name));
        if !tc_pin.exists() {
            let prog: &mut SchedClassifier = self.loaded(TC_PROGRAM)?;
            let attach_err = |what: String| move |source| BpfError::Program { what, source };
            let id = prog
                .attach_with_options(
                    &iface.name,
                    TcAttachType::Ingress,
                    TcAttachOptions::TcxOrder(LinkOrder::default()),
                )
                .map_err(attach_err(format!(
                    "attaching tcx ingress on {}",
                    iface.name
                )))?;
            let link = prog
                .take_link(id)
                .map_err(attach_err("taking the tc link".into()))?;
            pin_link(link.try_into(), &tc_pin)?;
        }
        let xdp_pin = links.join(link_pin_name("xdp", &iface.name));
        if xdp && iface.l2_len == 14 && !xdp_pin.exists() {
            let prog: &mut Xdp = self.loaded(XDP_PROGRAM)?;
            // Native where the driver has it, generic (skb) otherwise.
            let id = match prog.attach(&iface.name, XdpMode::Driver) {
                Ok(id) => id,
                Err(_) => {
                    prog.attach(&iface.name, XdpMode::Skb)
                        .map_err(|source| BpfError::Program {
                            what: format!("attaching XDP on {}", iface.name),
                            source,
                        })?
                }
            };
            let link = prog.take_link(id).map_err(|source| BpfError::Program {
                what: "taking the xdp link".into(),
                source,
            })?;
            pin_link(link.try_into(), &xdp_pin)?;
        }
        Ok(())
    }

    /// Attached programs as `kind:interface` (from the pinned links).
    pub fn attached(&self) -> Vec<String> {
        attached_in(&self.pin_dir)
    }

    /// Write `policy` for a host with `ifaces`: small trie-only changes in place on the live
    /// slot (each entry update is atomic and no other map changes), everything else into the
    /// idle slot followed by one switch of `CONFIG.active`.
    pub fn apply(
        &mut self,
        policy: &ir::Policy,
        ifaces: &[Iface],
    ) -> Result<BpfApplyReport, BpfError> {
        let new = compile::compile(policy, ifaces)?;
        for note in compile::left_to_nftables(policy) {
            tracing::warn!(table = %note.table, chain = %note.chain, rule = %note.rule, "{note}");
        }
        let prefixes = new.prefix_count();
        let active = self.active as usize;
        if let Some(live) = &self.slots[active] {
            if only_trie_entries_differ(live, &new) {
                let changes = count_changes(live, &new);
                if changes <= IN_PLACE_LIMIT {
                    let live = live.clone();
                    let n = self.write_slot(self.active, Some(&live), &new)?;
                    self.slots[active] = Some(new.clone());
                    self.policy = Some(new);
                    return Ok(BpfApplyReport {
                        active: self.active,
                        entries_changed: n,
                        switched: false,
                        prefixes,
                    });
                }
            }
        }
        let idle = self.active ^ 1;
        let old = self.slots[idle as usize].clone();
        let n = self.write_slot(idle, old.as_ref(), &new)?;
        let mut c = self.config()?;
        c.active = idle;
        self.set_config(c)?;
        self.active = idle;
        self.slots[idle as usize] = Some(new.clone());
        self.policy = Some(new);
        Ok(BpfApplyReport {
            active: idle,
            entries_changed: n,
            switched: true,
            prefixes,
        })
    }

    /// The policy as last written.
    pub fn policy(&self) -> Option<&BpfPolicy> {
        self.policy.as_ref()
    }

    /// Live slot.
    pub fn active_slot(&self) -> u32 {
        self.active
    }

    fn write_slot(
        &mut self,
        slot: u32,
        old: Option<&BpfPolicy>,
        new: &BpfPolicy,
    ) -> Result<usize, BpfError> {
        let meta = super::pinned::SlotMeta {
            chains: new
                .chains
                .iter()
                .map(|c| super::pinned::ChainMeta {
                    table: c.table.clone(),
                    chain: c.chain.clone(),
                    rules: c.rules.iter().map(|r| r.name.clone()).collect(),
                })
                .collect(),
        };
        // Names for `peerwall inspect`; the maps alone hold only ids. Best effort: a read-only
        // /run must not stop enforcement.
        if let Err(e) = super::pinned::write_meta(&self.pin_dir, slot, &meta) {
            tracing::warn!(error = %e, "cannot record chain and rule names for inspect");
        }
        let s = slot.to_string();
        let mut n = 0;
        // Hosts go to the exact-match maps the datapath consults first, prefixes to the tries.
        for (dim, f) in [
            (
                "SRC",
                (|c| &c.src) as fn(&ChainMaps) -> &Vec<(IpNet, Bitmap)>,
            ),
            ("DST", |c| &c.dst),
        ] {
            n += sync_trie(
                self.map(&format!("{dim}{s}"))?,
                &format!("{dim}{s}"),
                old.map(|o| addr_entries(o, f, false)),
                addr_entries(new, f, false),
            )?;
            n += sync_hash(
                self.map(&format!("{dim}H{s}"))?,
                &format!("{dim}H{s}"),
                old.map(|o| host_entries(o, f)),
                host_entries(new, f),
            )?;
        }
        n += sync_trie(
            self.map(&format!("SPORT{s}"))?,
            &format!("SPORT{s}"),
            old.map(|o| port_entries(o, |c| &c.sport)),
            port_entries(new, |c| &c.sport),
        )?;
        n += sync_trie(
            self.map(&format!("DPORT{s}"))?,
            &format!("DPORT{s}"),
            old.map(|o| port_entries(o, |c| &c.dport)),
            port_entries(new, |c| &c.dport),
        )?;
        n += sync_hash(
            self.map(&format!("PROTO{s}"))?,
            &format!("PROTO{s}"),
            old.map(proto_entries),
            proto_entries(new),
        )?;
        n += sync_hash(
            self.map(&format!("IIF{s}"))?,
            &format!("IIF{s}"),
            old.map(|o| if_entries(o, |c| &c.iif)),
            if_entries(new, |c| &c.iif),
        )?;
        n += sync_hash(
            self.map(&format!("OIF{s}"))?,
            &format!("OIF{s}"),
            old.map(|o| if_entries(o, |c| &c.oif)),
            if_entries(new, |c| &c.oif),
        )?;
        n += sync_array(
            self.map(&format!("CT{s}"))?,
            &format!("CT{s}"),
            old.map(ct_entries),
            ct_entries(new),
            Bitmap::EMPTY,
        )?;
        let empty_masks = DimMasks {
            any: Bitmap::EMPTY,
            neg: Bitmap::EMPTY,
        };
        n += sync_array(
            self.map(&format!("MASKS{s}"))?,
            &format!("MASKS{s}"),
            old.map(mask_entries),
            mask_entries(new),
            empty_masks,
        )?;
        n += sync_array(
            self.map(&format!("RULES{s}"))?,
            &format!("RULES{s}"),
            old.map(rule_entries),
            rule_entries(new),
            RuleInfo {
                action: 1,
                counter: 0,
                _pad: [0; 2],
            },
        )?;
        n += sync_array(
            self.map(&format!("CHAINS{s}"))?,
            &format!("CHAINS{s}"),
            old.map(chain_entries),
            chain_entries(new),
            ChainInfo {
                rules: 0,
                policy: 1,
                _pad: [0; 3],
                constrained: 0,
            },
        )?;
        // Hooks last: a chain becomes reachable only once all its maps are written.
        n += sync_array(
            self.map(&format!("HOOKS{s}"))?,
            &format!("HOOKS{s}"),
            old.map(hook_entries),
            hook_entries(new),
            HookChains {
                count: 0,
                chains: [0; peerwall_common::MAX_HOOK_CHAINS],
            },
        )?;
        if old.is_none() {
            self.zero_counters(slot)?;
        }
        Ok(n)
    }

    fn zero_counters(&mut self, slot: u32) -> Result<(), BpfError> {
        let name = format!("COUNTERS{slot}");
        let mut m: PerCpuArray<&mut MapData, Counter> =
            PerCpuArray::try_from(self.map(&name)?).map_err(map_err(&name))?;
        let ncpus = aya::util::nr_cpus().map_err(|(_, source)| BpfError::Io {
            path: "/sys/devices/system/cpu/possible".into(),
            source,
        })?;
        let len = m.len();
        for i in 0..len {
            let zero = aya::maps::PerCpuValues::try_from(vec![Counter::default(); ncpus]).map_err(
                |source| BpfError::Io {
                    path: PathBuf::from(&name),
                    source,
                },
            )?;
            m.set(i, zero, 0).map_err(map_err(&name))?;
        }
        Ok(())
    }

    /// Packets and bytes per rule (and per chain policy) of the live slot, summed over CPUs.
    pub fn counters(&mut self) -> Result<Vec<peerwall_backend::RuleCounter>, BpfError> {
        let Some(p) = self.policy.clone() else {
            return Ok(Vec::new());
        };
        let name = format!("COUNTERS{}", self.active);
        let m: PerCpuArray<&mut MapData, Counter> =
            PerCpuArray::try_from(self.map(&name)?).map_err(map_err(&name))?;
        let mut out = Vec::new();
        for c in &p.chains {
            let mut read = |idx: u32, rule: String| -> Result<(), BpfError> {
                let v = m
                    .get(&(c.id * MAX_RULES as u32 + idx), 0)
                    .map_err(map_err(&name))?;
                let (packets, bytes) = v
                    .iter()
                    .fold((0, 0), |(p, b), x| (p + x.packets, b + x.bytes));
                out.push(peerwall_backend::RuleCounter {
                    table: c.table.clone(),
                    chain: c.chain.clone(),
                    rule,
                    packets,
                    bytes,
                });
                Ok(())
            };
            for (i, r) in c.rules.iter().enumerate() {
                read(i as u32, r.name.clone())?;
            }
            read(MAX_RULES as u32 - 1, "(policy)".into())?;
        }
        Ok(out)
    }

    /// Insert a conntrack flow (probe engine: reproduce established/related states).
    pub fn insert_flow(
        &mut self,
        key: peerwall_common::FlowKey,
        replied: bool,
    ) -> Result<(), BpfError> {
        let mut m: aya::maps::HashMap<
            &mut MapData,
            peerwall_common::FlowKey,
            peerwall_common::FlowState,
        > = aya::maps::HashMap::try_from(self.map("FLOWS")?).map_err(map_err("FLOWS"))?;
        // Monotonic clock of the kernel (bpf_ktime_get_ns).
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes into `ts`.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        let now = ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64;
        m.insert(
            key,
            peerwall_common::FlowState {
                last_seen_ns: now,
                replied: u8::from(replied),
                _pad: [0; 7],
            },
            0,
        )
        .map_err(map_err("FLOWS"))
    }

    /// Forget every conntrack flow.
    pub fn flush_flows(&mut self) -> Result<(), BpfError> {
        let mut m: aya::maps::HashMap<
            &mut MapData,
            peerwall_common::FlowKey,
            peerwall_common::FlowState,
        > = aya::maps::HashMap::try_from(self.map("FLOWS")?).map_err(map_err("FLOWS"))?;
        let keys: Vec<peerwall_common::FlowKey> = m.keys().filter_map(Result::ok).collect();
        for k in keys {
            let _ = m.remove(&k);
        }
        Ok(())
    }

    /// The tc program (for BPF_PROG_TEST_RUN).
    pub fn tc_program(&mut self) -> Result<&mut SchedClassifier, BpfError> {
        self.loaded(TC_PROGRAM)
    }

    /// The benchmark baseline program (one LPM lookup), loaded.
    pub fn bare_program(&mut self) -> Result<&mut SchedClassifier, BpfError> {
        self.loaded("peerwall_bare")
    }

    /// Fill the baseline's trie with IPv4 prefixes.
    pub fn fill_bare(&mut self, prefixes: &[ipnet::Ipv4Net]) -> Result<(), BpfError> {
        let mut m: LpmTrie<&mut MapData, [u8; 4], u32> =
            LpmTrie::try_from(self.map("BARE")?).map_err(map_err("BARE"))?;
        for p in prefixes {
            m.insert(
                &Key::new(u32::from(p.prefix_len()), p.network().octets()),
                1,
                0,
            )
            .map_err(map_err("BARE"))?;
        }
        Ok(())
    }

    /// Map access for the probe engine.
    pub fn map_mut(&mut self, name: &str) -> Result<&mut aya::maps::Map, BpfError> {
        self.map(name)
    }
}

/// Programs that can be loaded on demand.
pub trait ProgramLoad {
    /// Load (verify) unless already loaded.
    fn ensure_loaded(&mut self) -> Result<(), aya::programs::ProgramError>;
}

impl ProgramLoad for SchedClassifier {
    fn ensure_loaded(&mut self) -> Result<(), aya::programs::ProgramError> {
        if self.fd().is_err() {
            self.load()?;
        }
        Ok(())
    }
}

impl ProgramLoad for Xdp {
    fn ensure_loaded(&mut self) -> Result<(), aya::programs::ProgramError> {
        if self.fd().is_err() {
            self.load()?;
        }
        Ok(())
    }
}

/// Pin a link (it must be a bpf_link) so that it outlives this process.
fn pin_link<E: std::fmt::Display>(link: Result<FdLink, E>, path: &Path) -> Result<(), BpfError> {
    let fd = link.map_err(|e| BpfError::Program {
        what: format!("{} is not a bpf_link: {e}", path.display()),
        source: aya::programs::ProgramError::NotAttached,
    })?;
    fd.pin(path).map_err(|source| BpfError::Pin {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(())
}

/// Remove every pin under `pin_dir` (links first: that detaches the programs), then the dir.
pub fn remove_pins(pin_dir: &Path) -> Result<Vec<String>, BpfError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| BpfError::Io { path, source }
    };
    let mut removed = Vec::new();
    let links = pin_dir.join("links");
    if links.exists() {
        for e in std::fs::read_dir(&links).map_err(io(&links))? {
            let p = e.map_err(io(&links))?.path();
            // Unpinning the link detaches it.
            let l = PinnedLink::from_pin(&p).map_err(|source| BpfError::Link {
                path: p.clone(),
                source,
            })?;
            l.unpin().map_err(|source| BpfError::Io {
                path: p.clone(),
                source,
            })?;
            removed.push(p.display().to_string());
        }
        std::fs::remove_dir(&links).map_err(io(&links))?;
    }
    if pin_dir.exists() {
        for e in std::fs::read_dir(pin_dir).map_err(io(pin_dir))? {
            let p = e.map_err(io(pin_dir))?.path();
            std::fs::remove_file(&p).map_err(io(&p))?;
            removed.push(p.display().to_string());
        }
        std::fs::remove_dir(pin_dir).map_err(io(pin_dir))?;
    }
    Ok(removed)
}

fn only_trie_entries_differ(a: &BpfPolicy, b: &BpfPolicy) -> bool {
    a.hooks == b.hooks
        && a.chains.len() == b.chains.len()
        && a.chains.iter().zip(&b.chains).all(|(x, y)| {
            x.rules == y.rules
                && x.proto == y.proto
                && x.iif == y.iif
                && x.oif == y.oif
                && x.ct == y.ct
                && x.masks == y.masks
                && x.policy == y.policy
        })
}

fn count_changes(a: &BpfPolicy, b: &BpfPolicy) -> usize {
    let diff = |x: BTreeMap<(u32, IpNet), Bitmap>, y: BTreeMap<(u32, IpNet), Bitmap>| {
        x.iter().filter(|(k, v)| y.get(k) != Some(v)).count()
            + y.keys().filter(|k| !x.contains_key(k)).count()
    };
    let pd = |x: BTreeMap<(u32, u16, u8), Bitmap>, y: BTreeMap<(u32, u16, u8), Bitmap>| {
        x.iter().filter(|(k, v)| y.get(k) != Some(v)).count()
            + y.keys().filter(|k| !x.contains_key(k)).count()
    };
    let am = |p: &BpfPolicy, f: fn(&ChainMaps) -> &Vec<(IpNet, Bitmap)>| {
        p.chains
            .iter()
            .flat_map(|c| f(c).iter().map(move |(n, b)| ((c.id, *n), *b)))
            .collect::<BTreeMap<_, _>>()
    };
    let pm = |p: &BpfPolicy, f: fn(&ChainMaps) -> &Vec<(u16, u8, Bitmap)>| {
        p.chains
            .iter()
            .flat_map(|c| f(c).iter().map(move |(port, l, b)| ((c.id, *port, *l), *b)))
            .collect::<BTreeMap<_, _>>()
    };
    diff(am(a, |c| &c.src), am(b, |c| &c.src))
        + diff(am(a, |c| &c.dst), am(b, |c| &c.dst))
        + pd(pm(a, |c| &c.sport), pm(b, |c| &c.sport))
        + pd(pm(a, |c| &c.dport), pm(b, |c| &c.dport))
}

/// LPM key of an address prefix in a chain.
pub fn addr_key(chain: u32, net: &IpNet) -> Key<AddrKeyData> {
    let mut addr = [0u8; 16];
    let fam = match net {
        IpNet::V4(n) => {
            addr[..4].copy_from_slice(&n.network().octets());
            ir::IpFamily::V4
        }
        IpNet::V6(n) => {
            addr.copy_from_slice(&n.network().octets());
            ir::IpFamily::V6
        }
    };
    Key::new(
        ADDR_KEY_FIXED_BITS + u32::from(net.prefix_len()),
        AddrKeyData {
            chain: chain.to_be_bytes(),
            family: u32::from(family_code(fam)).to_be_bytes(),
            addr,
        },
    )
}

/// LPM key of a port prefix in a chain.
pub fn port_key(chain: u32, port: u16, len: u8) -> Key<PortKeyData> {
    Key::new(
        PORT_KEY_FIXED_BITS + u32::from(len),
        PortKeyData {
            chain: chain.to_be_bytes(),
            port: port.to_be_bytes(),
            _pad: [0; 2],
        },
    )
}

type KeyBytes = Vec<u8>;

fn bytes_of<T: Pod>(v: &T) -> Vec<u8> {
    // SAFETY: Pod types are plain bytes.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
        .to_vec()
}

/// A full-length prefix: one host, kept in the exact-match map.
fn is_host(n: &IpNet) -> bool {
    n.prefix_len() == n.max_prefix_len()
}

/// Trie entries of an address dimension (`hosts`: only hosts, otherwise only the rest).
fn addr_entries(
    p: &BpfPolicy,
    f: fn(&ChainMaps) -> &Vec<(IpNet, Bitmap)>,
    hosts: bool,
) -> HashMap<KeyBytes, (Key<AddrKeyData>, Bitmap)> {
    p.chains
        .iter()
        .flat_map(|c| {
            f(c).iter()
                .filter(move |(n, _)| is_host(n) == hosts)
                .map(move |(n, b)| {
                    let k = addr_key(c.id, n);
                    (bytes_of(&k), (k, *b))
                })
        })
        .collect()
}

/// Exact-match entries of an address dimension: its hosts. A host's bitmap already carries
/// the rules of every enclosing prefix, so "host map, else trie" is the trie's answer.
fn host_entries(
    p: &BpfPolicy,
    f: fn(&ChainMaps) -> &Vec<(IpNet, Bitmap)>,
) -> HashMap<KeyBytes, (AddrKeyData, Bitmap)> {
    addr_entries(p, f, true)
        .into_values()
        .map(|(k, b)| (bytes_of(&k.data()), (k.data(), b)))
        .collect()
}

fn port_entries(
    p: &BpfPolicy,
    f: fn(&ChainMaps) -> &Vec<(u16, u8, Bitmap)>,
) -> HashMap<KeyBytes, (Key<PortKeyData>, Bitmap)> {
    p.chains
        .iter()
        .flat_map(|c| {
            f(c).iter().map(move |(port, l, b)| {
                let k = port_key(c.id, *port, *l);
                (bytes_of(&k), (k, *b))
            })
        })
        .collect()
}

fn proto_entries(p: &BpfPolicy) -> HashMap<KeyBytes, (ProtoKey, Bitmap)> {
    p.chains
        .iter()
        .flat_map(|c| {
            c.proto.iter().map(move |(fam, pr, b)| {
                let k = ProtoKey {
                    chain: c.id,
                    family: *fam,
                    proto: pr.unwrap_or(0),
                    // `_pad[0] = 1` marks the "other protocols" entry of a family.
                    _pad: [u8::from(pr.is_none()), 0],
                };
                (bytes_of(&k), (k, *b))
            })
        })
        .collect()
}

fn if_entries(
    p: &BpfPolicy,
    f: fn(&ChainMaps) -> &Vec<(u32, Bitmap)>,
) -> HashMap<KeyBytes, (IfKey, Bitmap)> {
    p.chains
        .iter()
        .flat_map(|c| {
            f(c).iter().map(move |(i, b)| {
                let k = IfKey {
                    chain: c.id,
                    ifindex: *i,
                };
                (bytes_of(&k), (k, *b))
            })
        })
        .collect()
}

fn ct_entries(p: &BpfPolicy) -> BTreeMap<u32, Bitmap> {
    p.chains
        .iter()
        .flat_map(|c| {
            c.ct.iter()
                .enumerate()
                .map(move |(s, b)| (c.id * peerwall_common::ct::SLOTS + s as u32, *b))
        })
        .collect()
}

fn mask_entries(p: &BpfPolicy) -> BTreeMap<u32, DimMasks> {
    p.chains
        .iter()
        .flat_map(|c| {
            c.masks
                .iter()
                .enumerate()
                .map(move |(d, m)| (c.id * 4 + d as u32, *m))
        })
        .collect()
}

fn rule_entries(p: &BpfPolicy) -> BTreeMap<u32, RuleInfo> {
    p.chains
        .iter()
        .flat_map(|c| {
            c.rule_infos()
                .into_iter()
                .enumerate()
                .map(move |(r, i)| (c.id * MAX_RULES as u32 + r as u32, i))
        })
        .collect()
}

fn chain_entries(p: &BpfPolicy) -> BTreeMap<u32, ChainInfo> {
    p.chains.iter().map(|c| (c.id, c.info())).collect()
}

fn hook_entries(p: &BpfPolicy) -> BTreeMap<u32, HookChains> {
    p.hooks
        .iter()
        .enumerate()
        .map(|(i, h)| (i as u32, *h))
        .collect()
}

/// The operations a keyed map needs for syncing.
trait Keyed<K> {
    fn put(&mut self, k: &K, v: &Bitmap) -> Result<(), aya::maps::MapError>;
    fn del(&mut self, k: &K) -> Result<(), aya::maps::MapError>;
    fn all_keys(&self) -> Vec<K>;
}

impl<K: Pod> Keyed<Key<K>> for LpmTrie<&mut MapData, K, Bitmap> {
    fn put(&mut self, k: &Key<K>, v: &Bitmap) -> Result<(), aya::maps::MapError> {
        self.insert(k, v, 0)
    }
    fn del(&mut self, k: &Key<K>) -> Result<(), aya::maps::MapError> {
        self.remove(k)
    }
    fn all_keys(&self) -> Vec<Key<K>> {
        self.keys().filter_map(Result::ok).collect()
    }
}

impl<K: Pod> Keyed<K> for BpfHashMap<&mut MapData, K, Bitmap> {
    fn put(&mut self, k: &K, v: &Bitmap) -> Result<(), aya::maps::MapError> {
        self.insert(k, v, 0)
    }
    fn del(&mut self, k: &K) -> Result<(), aya::maps::MapError> {
        self.remove(k)
    }
    fn all_keys(&self) -> Vec<K> {
        self.keys().filter_map(Result::ok).collect()
    }
}

/// Make a map hold `new`: with the old contents known, only the differences (O(changes));
/// otherwise clear it and write everything.
fn sync_keyed<K, M: Keyed<K>>(
    m: &mut M,
    name: &str,
    old: Option<HashMap<KeyBytes, (K, Bitmap)>>,
    new: HashMap<KeyBytes, (K, Bitmap)>,
) -> Result<usize, BpfError> {
    let mut n = 0;
    match old {
        Some(old) => {
            for (kb, (k, _)) in &old {
                if !new.contains_key(kb) {
                    m.del(k).map_err(map_err(name))?;
                    n += 1;
                }
            }
            for (kb, (k, v)) in &new {
                if old.get(kb).map(|(_, ov)| ov) != Some(v) {
                    m.put(k, v).map_err(map_err(name))?;
                    n += 1;
                }
            }
        }
        None => {
            for k in m.all_keys() {
                let _ = m.del(&k);
            }
            for (k, v) in new.values() {
                m.put(k, v).map_err(map_err(name))?;
                n += 1;
            }
        }
    }
    Ok(n)
}

fn sync_trie<K: Pod>(
    map: &mut aya::maps::Map,
    name: &str,
    old: Option<HashMap<KeyBytes, (Key<K>, Bitmap)>>,
    new: HashMap<KeyBytes, (Key<K>, Bitmap)>,
) -> Result<usize, BpfError> {
    let mut m: LpmTrie<&mut MapData, K, Bitmap> = LpmTrie::try_from(map).map_err(map_err(name))?;
    sync_keyed(&mut m, name, old, new)
}

fn sync_hash<K: Pod>(
    map: &mut aya::maps::Map,
    name: &str,
    old: Option<HashMap<KeyBytes, (K, Bitmap)>>,
    new: HashMap<KeyBytes, (K, Bitmap)>,
) -> Result<usize, BpfError> {
    let mut m: BpfHashMap<&mut MapData, K, Bitmap> =
        BpfHashMap::try_from(map).map_err(map_err(name))?;
    sync_keyed(&mut m, name, old, new)
}

fn sync_array<V: Pod + PartialEq>(
    map: &mut aya::maps::Map,
    name: &str,
    old: Option<BTreeMap<u32, V>>,
    new: BTreeMap<u32, V>,
    empty: V,
) -> Result<usize, BpfError> {
    let mut m: Array<&mut MapData, V> = Array::try_from(map).map_err(map_err(name))?;
    let mut n = 0;
    match old {
        Some(old) => {
            for i in old.keys() {
                if !new.contains_key(i) {
                    m.set(*i, empty, 0).map_err(map_err(name))?;
                    n += 1;
                }
            }
            for (i, v) in &new {
                if old.get(i) != Some(v) {
                    m.set(*i, *v, 0).map_err(map_err(name))?;
                    n += 1;
                }
            }
        }
        None => {
            // Arrays cannot be emptied: reset every slot a previous policy might have used.
            for i in 0..m.len() {
                let v = new.get(&i).copied().unwrap_or(empty);
                m.set(i, v, 0).map_err(map_err(name))?;
            }
            n += new.len();
        }
    }
    Ok(n)
}

/// Flip the emergency switch of a pinned datapath without loading anything.
pub fn set_allow_all_pinned(pin_dir: &Path, on: bool) -> Result<(), BpfError> {
    let path = pin_dir.join("ALLOW_ALL");
    let data = MapData::from_pin(&path).map_err(|source| BpfError::Map {
        map: path.display().to_string(),
        source,
    })?;
    let map = aya::maps::Map::Array(data);
    let mut m: Array<MapData, u32> = Array::try_from(map).map_err(map_err("ALLOW_ALL"))?;
    m.set(0, u32::from(on), 0).map_err(map_err("ALLOW_ALL"))
}
