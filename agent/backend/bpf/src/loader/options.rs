//! How the datapath is loaded: [`LoadOptions`] (the flow table's size, how long ended flows
//! stay ended, whose connection table TCP and UDP use) and the globals the loader writes into
//! the object for them.

use super::kfunc::KernelCt;
use crate::error::BpfError;

/// The datapath's global holding how long an ended flow stays ended after its last packet.
pub(super) const ENDED_IDLE_NS: &str = "ENDED_IDLE_NS";
/// The datapath's globals of the kernel-conntrack mode (`ebpf/src/kernel_ct.rs`).
const KERNEL_CT: &str = "KERNEL_CT";
const NF_CONN_STATUS_OFF: &str = "NF_CONN_STATUS_OFF";
/// The tc entry of every device type's global (`ebpf/src/l2.rs`).
const SKB_MAC_LEN_OFF: &str = "SKB_MAC_LEN_OFF";

/// Whose connection table the datapath reads for TCP and UDP.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Conntrack {
    /// The kernel's (`bpf_skb_ct_lookup`) for the families it tracks here (`v4`, `v6`: the
    /// caller found it tracking them, e.g. a Liqo gateway's NAT), the datapath's own for the
    /// others: one table per connection. Loading fails without the kfuncs.
    Kernel { v4: bool, v6: bool },
    /// The datapath's own tables (`FLOWS`, `FLOWS_NEW`), as where the kernel tracks nothing.
    #[default]
    Own,
}

/// How [`Datapath::load_with`](super::Datapath::load_with) loads the object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadOptions {
    /// The flow table (`FLOWS`, the datapath's conntrack) has this many entries instead of the
    /// default 65536. The size is the map's when it is created: a table already pinned keeps
    /// its own (see [`Datapath::flow_table`](super::Datapath::flow_table)).
    pub flows: Option<u32>,
    /// A flow user space ended ([`Datapath::end_flows`](super::Datapath::end_flows)) stays ended until neither side has
    /// sent for this long (the agent's `--ended-connection-secs`; 0: it is gone at once, and
    /// its next packet is judged as a new flow's); at most 12 hours
    /// ([`peerwall_common::ENDED_IDLE_MAX_NS`]).
    pub ended_secs: u32,
    /// Whose connection table TCP and UDP packets take their state from.
    pub conntrack: Conntrack,
    /// The exact-match host maps (`SRCH<s>`, `DSTH<s>`) hold this many hosts each instead of
    /// the default [`peerwall_common::HOST_TABLE_DEFAULT`]; hosts past it are looked up in the tries
    /// (`layout.rs`). Like the flow table, the size of a map when it is created.
    pub hosts: Option<u32>,
    /// The rule counters (`COUNTERS<s>`, per CPU) hold this many instead of the default
    /// [`peerwall_common::COUNTERS_DEFAULT`]: one per rule and one per chain policy, in chain
    /// order; rules past it are enforced, not counted. The size of the maps when created.
    pub counters: Option<u32>,
    /// The benchmarks' baseline tables (`BARE`, `BARE_HASH`, `BARE_SEEN`, `ebpf/src/bare.rs`)
    /// at their full size, for the baseline programs the benchmarks attach; otherwise one entry
    /// each.
    /// They are part of the object, so every load creates them, and `BARE_HASH` is a
    /// preallocated hash: at full size 80 MiB of kernel memory and 44 ms of the load, per
    /// gateway and for as long as the datapath is open, for programs the agent never runs.
    pub baselines: bool,
}

/// The flow table's entries by default where the kernel's table holds TCP and UDP: the own
/// tables then hold ICMP and SCTP flows and the marks of ended connections only.
pub const KERNEL_MODE_FLOWS: u32 = 1 << 13;

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            flows: None,
            ended_secs: (peerwall_common::FLOW_IDLE_NS / 1_000_000_000) as u32,
            conntrack: Conntrack::Own,
            hosts: None,
            counters: None,
            baselines: false,
        }
    }
}

impl LoadOptions {
    /// The defaults with the benchmarks' baseline tables at full size.
    #[cfg(feature = "bench")]
    pub fn with_baselines() -> Self {
        Self {
            baselines: true,
            ..Self::default()
        }
    }

    /// [`ended_secs`](Self::ended_secs) in nanoseconds, within the datapath's bound.
    pub(super) fn ended_idle_ns(&self) -> u64 {
        (u64::from(self.ended_secs) * 1_000_000_000).min(peerwall_common::ENDED_IDLE_MAX_NS)
    }
}

/// The benchmarks' tables: one entry each unless `opts` asks for them
/// ([`LoadOptions::baselines`]), not a preallocated million.
pub(super) fn size_baselines(opts: &LoadOptions, loader: &mut aya::EbpfLoader<'static>) {
    if !opts.baselines {
        loader.map_max_entries(peerwall_common::map::BARE, 1);
        loader.map_max_entries(peerwall_common::map::BARE_HASH, 1);
        loader.map_max_entries(peerwall_common::map::BARE_SEEN, 1);
    }
}

/// The per-CPU caches, a region of sets per possible CPU (`ncpus`): the verdict cache's first
/// level with its tags, and the pair-drop cache.
pub(super) fn size_per_cpu_caches(ncpus: u32, loader: &mut aya::EbpfLoader<'static>) {
    let cpu_sets = ncpus.saturating_mul(peerwall_common::CPU_VERDICT_SETS);
    loader.map_max_entries(peerwall_common::map::VERDICTS4_CPU, cpu_sets);
    let tag_lines = cpu_sets / peerwall_common::CPU_VERDICT_TAG_SETS;
    loader.map_max_entries(peerwall_common::map::VERDICTS4_TAGS, tag_lines);
    let pair_sets = ncpus.saturating_mul(peerwall_common::PAIR_DROP_SETS);
    loader.map_max_entries(peerwall_common::map::PAIR_DROPS, pair_sets);
}

/// Whose connection table `opts.conntrack` asks for: the kernel's (with the families whose TCP
/// and UDP the datapath reads from it, [`peerwall_common::kfunc::KERNEL_CT_V4`], `_V6`) or the
/// datapath's own (families 0, and why).
pub(super) fn kernel_table(opts: &LoadOptions) -> Result<(KernelCt, u32), BpfError> {
    Ok(match opts.conntrack {
        Conntrack::Own => (KernelCt::Own("chosen (--bpf-conntrack own)".into()), 0),
        Conntrack::Kernel {
            v4: false,
            v6: false,
        } => (
            KernelCt::Own(
                "the kernel tracks no connections here (no NAT or conntrack rule)".into(),
            ),
            0,
        ),
        Conntrack::Kernel { v4, v6 } => {
            let k = KernelCt::detected().clone();
            if let KernelCt::Own(why) = &k {
                return Err(BpfError::KernelConntrack(why.clone()));
            }
            let bits = (u32::from(v4) * peerwall_common::kfunc::KERNEL_CT_V4)
                | (u32::from(v6) * peerwall_common::kfunc::KERNEL_CT_V6);
            (k, bits)
        }
    })
}

/// The object to load for the connection table `kernel` (reading `families` from it), its
/// kfunc calls resolved (or made dead), and the cast of the tc entry for every device type
/// (`tc_any`: whether this kernel offers it); its globals for them go into `loader`.
pub(super) fn conntrack_object(
    kernel: &KernelCt,
    families: u32,
    loader: &mut aya::EbpfLoader<'static>,
) -> Result<(Vec<u8>, bool), BpfError> {
    let kern = super::kfunc::KernCtx::detected();
    let object = super::kfunc::patch(super::OBJECT, kernel, kern)
        .map_err(|e| BpfError::KernelConntrack(e.to_string()))?;
    let [on, status_off] = kernel
        .kfuncs()
        .map_or([0, 0], |k| [families, k.status_offset]);
    let global = super::pool::global_u32;
    loader.override_global(KERNEL_CT, global(on), true);
    loader.override_global(NF_CONN_STATUS_OFF, global(status_off), true);
    loader.override_global(
        SKB_MAC_LEN_OFF,
        global(kern.map_or(0, |k| k.mac_len_offset)),
        true,
    );
    Ok((object, kern.is_some()))
}

impl super::Datapath {
    /// Whose connection table the loaded program reads for TCP and UDP (and, for its own,
    /// why not the kernel's).
    pub fn conntrack(&self) -> &KernelCt {
        &self.conntrack
    }

    /// Whether the kernel's table holds connections of this family and protocol here (TCP
    /// and UDP of a family the datapath reads from the kernel).
    pub fn kernel_holds(&self, v6: bool, proto: u8) -> bool {
        let bit = if v6 {
            peerwall_common::kfunc::KERNEL_CT_V6
        } else {
            peerwall_common::kfunc::KERNEL_CT_V4
        };
        self.kernel_families & bit != 0 && (proto == 6 || proto == 17)
    }
}

/// The datapath's global holding `FLOWS_NEW`'s slot count less one.
pub(super) const NEW_FLOW_MASK: &str = "NEW_FLOW_MASK";

/// `FLOWS_NEW`'s slot count for a flow table of `n` entries: the power of two at or above it
/// (at least 2, at most 2^24).
pub(super) fn new_flow_slots(n: u32) -> u32 {
    n.clamp(2, 1 << 24).next_power_of_two()
}

#[cfg(test)]
mod tests {
    use super::new_flow_slots;

    #[test]
    fn new_flow_tables_are_powers_of_two_at_or_above_the_size_asked() {
        assert_eq!(new_flow_slots(1024), 1024);
        assert_eq!(new_flow_slots(1000), 1024);
        assert_eq!(new_flow_slots(65_537), 131_072);
        assert_eq!(new_flow_slots(0), 2);
        assert_eq!(new_flow_slots(u32::MAX), 1 << 24);
        assert_eq!(
            peerwall_common::NEW_FLOW_SLOTS,
            new_flow_slots(peerwall_common::NEW_FLOW_SLOTS)
        );
    }
}
