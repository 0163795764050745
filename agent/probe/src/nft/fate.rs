//! The fate of a packet through the rendering as deployed ([`NftProbe::deployed`]): what the
//! gateway delivered, with no counter to say which rule decided (the decided-flow cache serves
//! packets no rule's counter sees).

use super::{NftProbe, UNDELIVERED};
use crate::packet::Shape;
use crate::ProbeError;
use peerwall_policy::ir::eval::proto;
use peerwall_policy::ir::{CtState, Packet, PacketPath, Verdict, VerdictAction};

impl NftProbe {
    /// What the kernel did with `pkt`, sent `times` times in a row (the same packet, the same
    /// conntrack state prepared once), from what it delivered alone: accepted when it arrived,
    /// rejected when the gateway generated an ICMP unreachable, dropped otherwise (a reject
    /// the kernel never answers, see [`NftProbe::rejects_silently`], reads as a drop). For a
    /// probe built with [`NftProbe::deployed`], whose rendering is the agent's: what the
    /// decided-flow cache serves is judged like what the chains decide. With each fate, how
    /// many packets the cache's lookups accepted while it was sent.
    pub fn fate(
        &mut self,
        pkt: &Packet,
        times: usize,
    ) -> Result<Vec<(VerdictAction, u64)>, ProbeError> {
        self.probe(pkt, times.max(1)).map(|v| {
            v.into_iter()
                .map(|(v, served)| (v.verdict, served))
                .collect()
        })
    }

    /// Whether a reject of `pkt` is never seen (the kernel answers neither an ICMP error nor a
    /// packet with a corrupt checksum, which is how the probe makes those states): [`fate`]
    /// reads such a reject as a drop.
    ///
    /// [`fate`]: NftProbe::fate
    pub fn rejects_silently(&self, pkt: &Packet) -> bool {
        self.uses_ct
            && match pkt.ct_state {
                CtState::Related => true,
                CtState::Invalid => pkt.proto == proto::UDP,
                _ => false,
            }
    }

    /// Packets the decided-flow cache's lookups accepted so far.
    fn served(&self) -> Result<u64, ProbeError> {
        Ok(self
            .backend
            .counters()?
            .into_iter()
            .filter(|c| c.rule == peerwall_backend_nftables::decided::RULE)
            .map(|c| c.packets)
            .sum())
    }

    /// Send the probe and watch what arrives: the fate of a deployed rendering, with the
    /// decided-flow cache's accepts meanwhile.
    pub(super) fn send_observed(
        &mut self,
        pkt: &Packet,
        marker: u32,
        path: PacketPath,
        shape: Shape,
    ) -> Result<(Verdict, u64), ProbeError> {
        let v6 = pkt.src.is_ipv6();
        let mut buf = vec![0u8; 65536];
        self.drain(pkt, &mut buf);
        let served_before = self.served()?;
        let unreach_before = self.unreachables_sent(v6)?;
        self.send_frame(pkt, marker, shape)?;
        let observed = self.observe(pkt, marker, shape, path, UNDELIVERED, &mut buf)?;
        let action = match observed {
            Some(a) => a,
            None if self.unreachables_sent(v6)? > unreach_before => VerdictAction::Reject,
            None => VerdictAction::Drop,
        };
        let mut v = Verdict::nothing_on_path();
        v.verdict = action;
        Ok((v, self.served()?.saturating_sub(served_before)))
    }
}
