//! `peerwall verdict`: the fate of one packet, from the reference evaluator or a real kernel.

use super::*;

/// Judge the packet described by `a` and print the verdict.
pub(super) fn verdict(a: VerdictArgs) -> Result<(), CliError> {
    let VerdictArgs {
        files,
        iif,
        oif,
        src,
        dst,
        proto: p,
        sport,
        dport,
        ct_state,
        engine,
        output,
    } = a;
    // Linux interface names are at most 15 bytes (IFNAMSIZ 16 with the NUL): a longer one
    // names no interface, whichever engine judges.
    for (flag, name) in [("--iif", Some(&iif)), ("--oif", oif.as_ref())] {
        if let Some(n) = name.filter(|n| n.len() > 15 || n.is_empty()) {
            return Err(input(anyhow::anyhow!(
                "{flag} {n:?}: an interface name is 1 to 15 bytes long (Linux IFNAMSIZ), this \
                 one is {}",
                n.len()
            )));
        }
    }
    if src.is_ipv4() != dst.is_ipv4() {
        return Err(input(anyhow::anyhow!(
            "--src {src} and --dst {dst} are of different address families"
        )));
    }
    let compiled = load_and_compile(&files)?;
    let pkt = Packet {
        src,
        dst,
        proto: match (p, src.is_ipv6()) {
            (ProtoArg::Tcp, _) => proto::TCP,
            (ProtoArg::Udp, _) => proto::UDP,
            (ProtoArg::Icmp, false) => proto::ICMP,
            (ProtoArg::Icmp, true) => proto::ICMPV6,
        },
        sport,
        dport,
        iif: Some(iif),
        oif,
        ct_state: match ct_state {
            CtArg::New => CtState::New,
            CtArg::Established => CtState::Established,
            CtArg::Related => CtState::Related,
            CtArg::Untracked => CtState::Untracked,
            CtArg::Invalid => CtState::Invalid,
        },
    };
    let verdict = match engine {
        VerdictEngine::Reference => ir::evaluate(&compiled.policy, &pkt),
        VerdictEngine::Nftables => {
            let mut probe = NftProbe::new(&compiled.policy, &probe::interfaces_of([&pkt]))
                .context("building the scratch gateway")
                .map_err(runtime)?;
            probe.verdict(&pkt).map_err(|e| match e {
                probe::ProbeError::Unsupported(_) => input(e),
                other => runtime(other),
            })?
        }
        VerdictEngine::Bpf => {
            let parent = peerwall_backend_bpf::loader::ensure_bpffs()
                .context("bpf filesystem")
                .map_err(runtime)?;
            let mut probe =
                probe::bpf::BpfProbe::new(&compiled.policy, &probe::interfaces_of([&pkt]), &parent)
                    .context("loading the eBPF datapath")
                    .map_err(runtime)?;
            probe.verdict(&pkt).map_err(|e| match e {
                probe::ProbeError::Unsupported(_) => input(e),
                other => runtime(other),
            })?
        }
    };
    match output {
        Output::Json => out(&format!(
            "{}\n",
            serde_json::to_string(&verdict).map_err(runtime)?
        )),
        Output::Text => {
            let by = match (&verdict.table, &verdict.chain, &verdict.rule) {
                (Some(t), Some(c), Some(r)) => format!("rule {t}/{c}/{r}"),
                (Some(t), Some(c), None) => format!("policy of chain {t}/{c}"),
                _ => "no chain on the path".to_string(),
            };
            let audit = match &verdict.audit {
                Some(h) => format!(
                    "; audit: would {} by {}",
                    h.would.as_str(),
                    match &h.rule {
                        Some(r) => format!("rule {}/{}/{r}", h.table, h.chain),
                        None => format!("policy of chain {}/{}", h.table, h.chain),
                    }
                ),
                None => String::new(),
            };
            out(&format!("{} ({by}{audit})\n", verdict.verdict.as_str()))
        }
    }
}
