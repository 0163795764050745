//! The benchmarks' baselines on a loaded datapath (feature `bench`, enabled by the benches
//! only): the bare-lookup, one-hash and empty programs, their tables, tcx attachment in front
//! of the datapath, and the diagnostic flags that turn parts of the datapath off.

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::MapData;
use aya::programs::SchedClassifier;
use peerwall_common::map;

use super::{map_err, BpfError, Datapath};

impl Datapath {
    /// The benchmark baseline program (one LPM lookup), loaded.
    pub fn bare_program(&mut self) -> Result<&mut SchedClassifier, BpfError> {
        self.loaded("peerwall_bare")
    }

    /// The baseline program that does nothing, loaded.
    pub fn empty_program(&mut self) -> Result<&mut SchedClassifier, BpfError> {
        self.loaded("peerwall_empty")
    }

    /// The baseline program doing one hash lookup on the destination, loaded.
    pub fn hash_program(&mut self) -> Result<&mut SchedClassifier, BpfError> {
        self.loaded("peerwall_hash")
    }

    /// Fill the one-hash-lookup baseline's table with IPv4 hosts.
    pub fn fill_bare_hash(&mut self, hosts: &[std::net::Ipv4Addr]) -> Result<(), BpfError> {
        let mut m: aya::maps::HashMap<&mut MapData, [u8; 4], u32> =
            aya::maps::HashMap::try_from(self.map(map::BARE_HASH)?)
                .map_err(map_err(map::BARE_HASH))?;
        for h in hosts {
            m.insert(h.octets(), 1, 0)
                .map_err(map_err(map::BARE_HASH))?;
        }
        Ok(())
    }

    /// Attach one of the benchmark's baseline programs (`peerwall_empty`, `peerwall_hash`,
    /// `peerwall_facts`) with tcx at ingress of `iface` in the current network namespace, its
    /// link pinned where the tc program's would be (removing the pins detaches it). The gateway
    /// benchmark's limits.
    pub fn attach_baseline(&mut self, program: &str, iface: &str) -> Result<(), BpfError> {
        let pin = self
            .pin_dir
            .join("links")
            .join(super::link_pin_name("tc", iface));
        let link = self.attach_tcx(program, iface, aya::programs::links::LinkOrder::default())?;
        super::pin_link(link.try_into(), &pin)
    }

    /// Attach one of the benchmark's baseline programs with tcx at ingress of `iface` in the
    /// current network namespace *in front of* every program already there, its link not
    /// pinned: dropping the returned link detaches it. A baseline that passes the packet
    /// (`TC_ACT_OK`, tcx's `TCX_PASS`) ends tcx's walk, so the programs behind it do not run:
    /// the gateway benchmark alternates between an installed datapath and a limit on the same
    /// interface, under one running stream, without reinstalling either.
    pub fn attach_first(
        &mut self,
        program: &str,
        iface: &str,
    ) -> Result<aya::programs::tc::SchedClassifierLink, BpfError> {
        self.attach_tcx(program, iface, aya::programs::links::LinkOrder::first())
    }

    /// Attach loaded program `program` with tcx at ingress of `iface`, at `order`.
    fn attach_tcx(
        &mut self,
        program: &str,
        iface: &str,
        order: aya::programs::links::LinkOrder,
    ) -> Result<aya::programs::tc::SchedClassifierLink, BpfError> {
        use aya::programs::tc::{TcAttachOptions, TcAttachType};
        let prog: &mut SchedClassifier = self.loaded(program)?;
        let attach_err = |what: String| move |source| BpfError::Program { what, source };
        let id = prog
            .attach_with_options(
                iface,
                TcAttachType::Ingress,
                TcAttachOptions::TcxOrder(order),
            )
            .map_err(attach_err(format!("attaching {program} on {iface}")))?;
        prog.take_link(id)
            .map_err(attach_err("taking the tc link".into()))
    }

    /// Set the benchmark's diagnostic flags ([`peerwall_common::flags::DIAG_ALL`] bits; the
    /// others are kept). They change verdicts: benchmarks only.
    pub fn set_diagnostic_flags(&mut self, diag: u32) -> Result<(), BpfError> {
        let mut c = self.config()?;
        c.flags = (c.flags & !peerwall_common::flags::DIAG_ALL)
            | (diag & peerwall_common::flags::DIAG_ALL);
        self.set_config(c)
    }

    /// Turn conntrack's `FLOW_SEEN` shortcut on or off without the checks of
    /// [`arm_flow_seen`](Self::arm_flow_seen) (no program is attached in the benchmarks; off
    /// measures what the shortcut saves).
    pub fn set_flow_seen(&mut self, on: bool) -> Result<(), BpfError> {
        let mut c = self.config()?;
        if on {
            c.flags |= peerwall_common::flags::FLOW_SEEN;
        } else {
            c.flags &= !peerwall_common::flags::FLOW_SEEN;
        }
        self.set_config(c)
    }

    /// Make every `FLOW_SEEN` entry idle, as on a gateway whose flows are long gone; only
    /// right after [`flush_flows`](Self::flush_flows) (an idle entry hides any flow still
    /// tracked under it). The benchmark's first packet then finds its flow unknown by its
    /// entry, as the first packet of a new connection does.
    pub fn forget_flow_seen(&mut self) -> Result<(), BpfError> {
        let idle = peerwall_common::flow_seen_idle_stamp(
            super::seen::ktime_ns(),
            peerwall_common::FLOW_IDLE_NS,
        );
        self.seen_stamps()?.fill(idle);
        Ok(())
    }

    /// Fill the baseline's trie with IPv4 prefixes.
    pub fn fill_bare(&mut self, prefixes: &[ipnet::Ipv4Net]) -> Result<(), BpfError> {
        let mut m: LpmTrie<&mut MapData, [u8; 4], u32> =
            LpmTrie::try_from(self.map(map::BARE)?).map_err(map_err(map::BARE))?;
        for p in prefixes {
            m.insert(
                &Key::new(u32::from(p.prefix_len()), p.network().octets()),
                1,
                0,
            )
            .map_err(map_err(map::BARE))?;
        }
        Ok(())
    }
}
