//! Conntrack states produced for real in the scratch gateway: `established` and `related` by
//! inserting flows with `conntrack -I`, `untracked` with a `notrack` rule at raw priority,
//! `invalid` with a corrupt TCP/UDP checksum, a TCP SYN+FIN, SCTP DATA outside any association
//! or an unsolicited ICMP echo reply.

use super::NftProbe;
use crate::packet::{self, Shape};
use crate::ProbeError;
use peerwall_backend_nftables::Nft;
use peerwall_netns::NetnsError;
use peerwall_policy::ir::eval::proto;
use peerwall_policy::ir::{CtState, Packet};

impl NftProbe {
    fn conntrack(&self, args: &[&str]) -> Result<(), ProbeError> {
        self.gw
            .exec("conntrack", args)
            .map(|_| ())
            .map_err(|e| match e {
                NetnsError::Failed { stderr, command }
                    if stderr.contains("not found") || stderr.contains("No such file") =>
                {
                    ProbeError::Unsupported(format!(
                        "{command}: {stderr} (install the conntrack package)"
                    ))
                }
                other => other.into(),
            })
    }

    // size: one arm per conntrack state the probe reproduces in a real kernel.
    /// Prepare conntrack so the probe has `pkt.ct_state`; returns the probe's shape.
    pub(super) fn prepare_ct(&self, pkt: &Packet, marker: u32) -> Result<Shape, ProbeError> {
        let mut shape = Shape::default();
        if !self.uses_ct {
            return Ok(shape);
        }
        self.conntrack(&["-F"])?;
        let (s, d) = (pkt.src.to_string(), pkt.dst.to_string());
        let (sp, dp) = (pkt.sport.to_string(), pkt.dport.to_string());
        let v6 = pkt.src.is_ipv6();
        match pkt.ct_state {
            CtState::New => {}
            // Conntrack classifies as invalid: TCP with SYN+FIN, an ICMP echo reply nobody asked
            // for, UDP with a corrupt checksum (the one case where the probe itself is damaged).
            CtState::Invalid => match pkt.proto {
                proto::TCP => shape.tcp_syn_fin = true,
                proto::UDP => shape.bad_checksum = true,
                // DATA outside any association: conntrack's sctp_new refuses it.
                proto::SCTP => shape.sctp_data = true,
                proto::ICMP | proto::ICMPV6 => shape.echo_reply = true,
                other => {
                    return Err(ProbeError::Unsupported(format!(
                        "ct state invalid for protocol {other} (use tcp, udp, sctp or icmp)"
                    )))
                }
            },
            CtState::Untracked => {
                Nft::in_netns(self.gw.name()).apply_text(
                    "table inet pwv_notrack {\nchain raw {\ntype filter hook prerouting priority -300; policy accept;\nnotrack\n}\n}\n",
                )?;
            }
            CtState::Established => match pkt.proto {
                proto::TCP | proto::UDP => {
                    let tcp = pkt.proto == proto::TCP;
                    let name = if tcp { "tcp" } else { "udp" };
                    let mut args = vec![
                        "-I", "-s", &s, "-d", &d, "-p", name, "--sport", &sp, "--dport", &dp,
                    ];
                    if tcp {
                        shape.tcp_ack = true;
                        args.extend(["--state", "ESTABLISHED", "-u", "SEEN_REPLY,ASSURED"]);
                    } else {
                        args.extend(["-u", "SEEN_REPLY"]);
                    }
                    args.extend(["-t", "120"]);
                    self.conntrack(&args)?;
                }
                proto::SCTP => {
                    // An association in ESTABLISHED whose tags the DATA probe carries.
                    shape.sctp_data = true;
                    let tag = packet::SCTP_VTAG.to_string();
                    self.conntrack(&[
                        "-I",
                        "-s",
                        &s,
                        "-d",
                        &d,
                        "-p",
                        "sctp",
                        "--sport",
                        &sp,
                        "--dport",
                        &dp,
                        "--state",
                        "ESTABLISHED",
                        "--orig-vtag",
                        &tag,
                        "--reply-vtag",
                        &tag,
                        "-u",
                        "SEEN_REPLY,ASSURED",
                        "-t",
                        "120",
                    ])?;
                }
                proto::ICMP | proto::ICMPV6 => {
                    let id = ((marker >> 16) as u16).to_string();
                    let mut args = vec!["-I", "-s", &s, "-d", &d];
                    if v6 {
                        args.extend([
                            "-p",
                            "icmpv6",
                            "--icmpv6-type",
                            "128",
                            "--icmpv6-code",
                            "0",
                            "--icmpv6-id",
                            &id,
                        ]);
                    } else {
                        args.extend([
                            "-p",
                            "icmp",
                            "--icmp-type",
                            "8",
                            "--icmp-code",
                            "0",
                            "--icmp-id",
                            &id,
                        ]);
                    }
                    args.extend(["-u", "SEEN_REPLY", "-t", "120"]);
                    self.conntrack(&args)?;
                }
                other => {
                    return Err(ProbeError::Unsupported(format!(
                        "ct state established for protocol {other} (use tcp, udp, sctp or icmp)"
                    )))
                }
            },
            CtState::Related => {
                shape.icmp_error = true;
                let (qs, qd) = packet::related_inner_ports(marker);
                let (qs, qd) = (qs.to_string(), qd.to_string());
                self.conntrack(&[
                    "-I", "-s", &d, "-d", &s, "-p", "udp", "--sport", &qs, "--dport", &qd, "-t",
                    "120",
                ])?;
            }
        }
        Ok(shape)
    }
}
