//! `peerwall verdict`: the fate of one packet, from the reference evaluator or a real kernel.

use super::*;

/// Judge the packet described by `a` (its policy from files) and print the verdict.
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
        ..
    } = a;
    let lacking: Vec<&str> = [
        ("-f/--file", files.is_empty()),
        ("--iif", iif.is_none()),
        ("--src", src.is_none()),
        ("--dst", dst.is_none()),
    ]
    .into_iter()
    .filter_map(|(flag, absent)| absent.then_some(flag))
    .collect();
    let (Some(iif), Some(src), Some(dst)) = (iif, src, dst) else {
        return Err(input(anyhow::anyhow!("{}", modes(&lacking))));
    };
    if files.is_empty() {
        return Err(input(anyhow::anyhow!("{}", modes(&lacking))));
    }
    let p = p.unwrap_or(ProtoArg::Tcp);
    let dport = dport.unwrap_or(80);
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
        proto: p.number(src.is_ipv6()),
        sport,
        dport,
        iif: Some(iif),
        oif,
        ct_state: ct_state.state(),
    };
    let verdict = judge(&compiled.policy, &[pkt], engine)?
        .pop()
        .ok_or_else(|| runtime(anyhow::anyhow!("the engine gave no verdict")))?;
    print_verdict(&verdict, output)
}

/// The verdicts of `packets` under `policy`, from `engine` (one scratch kernel for all).
pub(super) fn judge(
    policy: &ir::Policy,
    packets: &[Packet],
    engine: VerdictEngine,
) -> Result<Vec<ir::Verdict>, CliError> {
    let probe_err = |e: probe::ProbeError| match e {
        probe::ProbeError::Unsupported(_) => input(e),
        other => runtime(other),
    };
    match engine {
        VerdictEngine::Reference => Ok(packets.iter().map(|p| ir::evaluate(policy, p)).collect()),
        VerdictEngine::Nftables => {
            let mut probe = NftProbe::new(policy, &probe::interfaces_of(packets))
                .context("building the scratch gateway")
                .map_err(runtime)?;
            packets
                .iter()
                .map(|p| probe.verdict(p).map_err(probe_err))
                .collect()
        }
        VerdictEngine::Bpf => {
            let parent = peerwall_backend_select::ensure_bpffs().map_err(runtime)?;
            let mut probe =
                probe::bpf::BpfProbe::new(policy, &probe::interfaces_of(packets), &parent)
                    .context("loading the eBPF datapath")
                    .map_err(runtime)?;
            packets
                .iter()
                .map(|p| probe.verdict(p).map_err(probe_err))
                .collect()
        }
    }
}

/// Print one verdict as `verdict` does.
pub(super) fn print_verdict(verdict: &ir::Verdict, output: Output) -> Result<(), CliError> {
    match output {
        Output::Json => out(&format!(
            "{}\n",
            serde_json::to_string(verdict).map_err(runtime)?
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

/// What `verdict` needs in each of its modes, and what this call lacks for the packet mode.
pub(super) fn modes(lacking: &[&str]) -> String {
    format!(
        "verdict judges either a packet against FirewallConfigurations (-f FILES --iif IF --src \
         ADDR --dst ADDR [--oif IF --proto P --dport N]) or pods of a cluster snapshot \
         (--cluster SNAPSHOT --from NS/NAME --to NS/NAME, or --matrix); for a packet this lacks {}",
        lacking.join(", ")
    )
}
