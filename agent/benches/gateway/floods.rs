//! The traffic an attacker chooses: every packet a new flow (allowed and denied), TCP SYN
//! floods (towards allowed and denied destinations), and more flows than the tables hold,
//! cycled; each beside a paced flow that was there before, whose packets must all arrive.
//!
//! Same method as the main table: interleaved rounds, every datapath installed afresh once per
//! round and measured in its own window; ratios to the no-filter gateway of the same round on
//! the same traffic, then the median and spread over the rounds. The sender restamps every
//! frame (source port, source address, checksums) whatever the datapath, so every row of a
//! traffic kind pays the same sender cost.

use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::*;

/// What the sender sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Traffic {
    NewAllowed,
    NewDenied,
    SynAllowed,
    SynDenied,
    /// 200 704 flows (196 × the 1024 destinations) cycled: more than `FLOWS` (64k) and every
    /// verdict cache, each flow back every ~0.2 s.
    CycledAllowed,
    /// [`Traffic::NewAllowed`] measured after [`SUSTAINED_FOR`] of it: the state a flood
    /// leaves the gateway's tables in once it lasts (every `FLOW_SEEN` stamp live, the
    /// kernel's connection table full), which a window after a fresh install does not reach.
    SustainedAllowed,
}

/// How long [`Traffic::SustainedAllowed`] floods the gateway before its window: at this VM's
/// rates (100–300 k new flows per second) several times the 131 072 `FLOW_SEEN` flow stamps,
/// whose flows count as live for 10 minutes, and the kernel's connection table's limit.
const SUSTAINED_FOR: Duration = Duration::from_secs(5);

/// Flows of [`Traffic::CycledAllowed`]: a multiple of the 1024 frames, so each flow number
/// always meets the same destination and exactly this many 5-tuples recur.
const CYCLED_FLOWS: u32 = 196 * 1024;

impl Traffic {
    pub(crate) const ALL: [Traffic; 6] = [
        Traffic::NewAllowed,
        Traffic::NewDenied,
        Traffic::SynAllowed,
        Traffic::SynDenied,
        Traffic::CycledAllowed,
        Traffic::SustainedAllowed,
    ];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Traffic::NewAllowed => "new flow per packet, allowed (UDP)",
            Traffic::NewDenied => "new flow per packet, denied (UDP)",
            Traffic::SynAllowed => "SYN flood, allowed destinations",
            Traffic::SynDenied => "SYN flood, denied destinations",
            Traffic::CycledAllowed => "200k flows cycled, allowed (UDP)",
            Traffic::SustainedAllowed => "new flow per packet, allowed (UDP), after 5 s of it",
        }
    }

    /// The name `PEERWALL_BENCH_TRAFFIC` selects it by.
    pub(crate) fn key(self) -> &'static str {
        match self {
            Traffic::NewAllowed => "new-allowed",
            Traffic::NewDenied => "new-denied",
            Traffic::SynAllowed => "syn-allowed",
            Traffic::SynDenied => "syn-denied",
            Traffic::CycledAllowed => "cycled",
            Traffic::SustainedAllowed => "sustained",
        }
    }

    fn allowed(self) -> bool {
        matches!(
            self,
            Traffic::NewAllowed
                | Traffic::SynAllowed
                | Traffic::CycledAllowed
                | Traffic::SustainedAllowed
        )
    }

    fn vary(self) -> Vary {
        match self {
            Traffic::CycledAllowed => Vary::Cycle(CYCLED_FLOWS),
            _ => Vary::Fresh,
        }
    }
}

/// The datapaths measured under floods. Not XDP: on veth its native mode moves every packet
/// of both senders into the receiving veth's NAPI, run on whichever CPU scheduled it, so the
/// one-core accounting this method relies on (and the flow beside, on its own CPU) no longer
/// holds; its rows measured the veth, not the filter (see the main table for XDP).
///
/// `TcHash` is the limit: a tcx program that looks the destination up in one hash and drops
/// what it does not find, no state, no flow tables: what dropping a flood can cost at least.
/// `TcFacts` is the limit of a tc datapath enforcing the policy: one lookup per fact it tests.
pub(crate) const FLOOD_DATAPATHS: [Datapath; 11] = [
    Datapath::None,
    Datapath::ConntrackOnly,
    Datapath::TcHash,
    Datapath::TcFacts,
    Datapath::TcHashConntrack,
    Datapath::NfHashConntrack,
    Datapath::PeerwallNft,
    Datapath::PeerwallNftConntrack,
    Datapath::PeerwallBpf,
    Datapath::PeerwallBpfConntrack,
    Datapath::PeerwallBpfKernelCt,
];

/// One datapath under one kind of traffic, every round.
#[derive(Clone, Debug)]
pub(crate) struct FloodRow {
    pub(crate) traffic: Traffic,
    pub(crate) dp: Datapath,
    /// Allowed traffic: packets forwarded per second; denied: taken in and dropped (not
    /// filters: forwarded).
    pub(crate) rate: Vec<f64>,
    /// Allowed traffic: forwarded ÷ taken in.
    pub(crate) delivered: Vec<f64>,
    /// The flow beside: packets sent, packets that reached the receiver.
    pub(crate) beside: Vec<(u64, u64)>,
    /// peerwall bpf: its tc program's mean run time per packet under this traffic, ns
    /// ([`program_ns`]).
    pub(crate) program_ns: Vec<f64>,
}

/// Run time and runs of the loaded tc programs named `peerwall_tc*` (the kernel's `bpf_stats`).
fn tc_program_stats() -> (u128, u64) {
    aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .filter(|p| {
            p.name_as_str()
                .is_some_and(|n| n.starts_with("peerwall_tc"))
        })
        .fold((0, 0), |(t, n), p| {
            (t + p.run_time().as_nanos(), n + p.run_count())
        })
}

/// The peerwall tc program's mean run time per packet of `traffic`, in a window of its own
/// after the measured one: the kernel's `bpf_stats` are on only for this window (timing every
/// run costs the program two clock reads, which the rates must not pay).
fn program_ns(lab: &Lab, frames: &Arc<Vec<Vec<u8>>>, traffic: Traffic, beside_to: Ipv4Addr) -> f64 {
    let stats = aya::sys::enable_stats(aya::sys::Stats::RunTime).expect("BPF_ENABLE_STATS");
    let (t0, n0) = tc_program_stats();
    let _ = window(
        lab,
        frames,
        traffic,
        beside_to,
        Duration::from_millis(50),
        Duration::from_millis(300),
    );
    let (t1, n1) = tc_program_stats();
    drop(stats);
    assert!(n1 > n0, "{}: the tc program never ran", traffic.label());
    (t1 - t0) as f64 / (n1 - n0) as f64
}

/// The flow that was there before the flood: one allowed UDP flow, one packet every
/// millisecond from another CPU, counted at the receiver (`pwbeside` in its prerouting). Its
/// source is a peer pod's (inside `traffic::SOURCES`, which the gateway configuration's source
/// check admits; checked in `floods`), one the floods never use (they draw below .255.254).
const BESIDE_SRC: Ipv4Addr = Ipv4Addr::new(172, 16, 255, 254);
const BESIDE_SPORT: u16 = 4242;

fn beside_counter_install(lab: &Lab) {
    rcv_counter_install(
        lab,
        "pwbeside",
        &format!("ip saddr {BESIDE_SRC} udp sport {BESIDE_SPORT}"),
    );
}

fn beside_counted(lab: &Lab) -> u64 {
    rcv_counted(lab, "pwbeside")
}

/// One window of `traffic` with the flow beside it: (rate, delivered, beside sent, seen).
fn window(
    lab: &Lab,
    frames: &Arc<Vec<Vec<u8>>>,
    traffic: Traffic,
    beside_to: Ipv4Addr,
    warmup: Duration,
    win: Duration,
) -> (f64, f64, u64, u64) {
    let stop = Arc::new(AtomicBool::new(false));
    let beside_sent = Arc::new(AtomicU64::new(0));
    let beside_frame = Arc::new(vec![frame(
        lab.snd_mac,
        lab.gw_mac,
        BESIDE_SRC,
        beside_to,
        BESIDE_SPORT,
        8080,
    )]);
    // The flow beside starts first: it was there before the flood.
    let seen0 = beside_counted(lab);
    let b = blast_with(
        &lab.snd,
        beside_frame,
        stop.clone(),
        Some(Duration::from_millis(1)),
        beside_sent.clone(),
        Vary::Fixed,
        0,
    );
    std::thread::sleep(Duration::from_millis(200));
    let flood_stop = Arc::new(AtomicBool::new(false));
    let h = blast_with(
        &lab.snd,
        frames.clone(),
        flood_stop.clone(),
        None,
        Arc::new(AtomicU64::new(0)),
        traffic.vary(),
        SENDER_CPU,
    );
    std::thread::sleep(warmup);
    let (fwd_all, taken) = rates_over(lab, win);
    flood_stop.store(true, Ordering::Relaxed);
    let _ = h.join();
    // The flow beside outlives the flood a little: its last packets cross a quiet gateway.
    std::thread::sleep(Duration::from_millis(100));
    stop.store(true, Ordering::Relaxed);
    let _ = b.join();
    std::thread::sleep(Duration::from_millis(50));
    let seen = beside_counted(lab) - seen0;
    // The beside flow's packets are forwarded too: take them out (one per millisecond).
    let fwd = (fwd_all - 1000.0).max(0.0);
    (fwd, taken, beside_sent.load(Ordering::Relaxed), seen)
}

/// Frames of `traffic` for policy `p`: UDP or SYN, towards its allowed or denied destinations.
fn frames_of(lab: &Lab, p: &Policy, traffic: Traffic, seed: u64) -> Arc<Vec<Vec<u8>>> {
    let dsts = if traffic.allowed() {
        &p.allowed
    } else {
        &p.denied
    };
    if matches!(traffic, Traffic::SynAllowed | Traffic::SynDenied) {
        Arc::new(
            dsts.iter()
                .map(|&(d, port)| {
                    syn_frame(
                        lab.snd_mac,
                        lab.gw_mac,
                        Ipv4Addr::new(172, 16, 0, 1),
                        d,
                        1024,
                        port,
                    )
                })
                .collect(),
        )
    } else {
        frames_for(lab, dsts, None, seed)
    }
}

/// Every flood on every datapath of [`FLOOD_DATAPATHS`], `repeats` interleaved rounds.
pub(crate) fn floods(
    lab: &Lab,
    p: &Policy,
    repeats: usize,
    warmup: Duration,
    win: Duration,
    seed: u64,
    wanted: impl Fn(Datapath) -> bool,
) -> Vec<FloodRow> {
    let peer: ipnet::Ipv4Net = crate::traffic::SOURCES.parse().expect("CIDR");
    assert!(
        peer.contains(&BESIDE_SRC),
        "the flow beside comes from {BESIDE_SRC}, outside the peer's pods {peer}: the policy drops it"
    );
    beside_counter_install(lab);
    let beside_to = p.allowed[0].0;
    let mut rows: Vec<FloodRow> = Vec::new();
    // `PEERWALL_BENCH_TRAFFIC=new-allowed,syn-denied,...`: some floods only (a partial run).
    let kinds: Option<Vec<String>> = std::env::var("PEERWALL_BENCH_TRAFFIC")
        .ok()
        .map(|v| v.split(',').map(|x| x.trim().to_lowercase()).collect());
    let chosen = |t: Traffic| {
        kinds
            .as_ref()
            .is_none_or(|k| k.iter().any(|x| x == t.key()))
    };
    for traffic in Traffic::ALL.into_iter().filter(|&t| chosen(t)) {
        let frames = frames_of(lab, p, traffic, seed);
        for round in 0..repeats {
            for dp in FLOOD_DATAPATHS.into_iter().filter(|&d| wanted(d)) {
                if install(lab, dp, p).is_none() {
                    continue;
                }
                let filters = !matches!(dp, Datapath::None | Datapath::ConntrackOnly);
                let guard =
                    (filters && !traffic.allowed()).then(|| DeniedGuard::install(lab, BESIDE_SRC));
                let warm = if traffic == Traffic::SustainedAllowed {
                    warmup.max(SUSTAINED_FOR)
                } else {
                    warmup
                };
                let (fwd, taken, sent, seen) = window(lab, &frames, traffic, beside_to, warm, win);
                let prog = matches!(
                    dp,
                    Datapath::PeerwallBpf
                        | Datapath::PeerwallBpfConntrack
                        | Datapath::PeerwallBpfKernelCt
                )
                .then(|| program_ns(lab, &frames, traffic, beside_to));
                uninstall(lab, dp);
                let rate = match guard {
                    None => fwd,
                    Some(g) => {
                        assert_eq!(
                            g.leaked(),
                            0,
                            "{}: {}: denied packets reached the receiver ({fwd:.0} pps forwarded)",
                            traffic.label(),
                            dp.label()
                        );
                        taken
                    }
                };
                assert!(
                    rate > 0.0 && sent > 100,
                    "{}: {}: nothing flowed ({rate:.0} pps, {sent} beside)",
                    traffic.label(),
                    dp.label()
                );
                eprintln!(
                    "{:>34} | round {} | {:<34} | {:>9} pps | delivered {:.3} | beside {seen}/{sent}",
                    traffic.label(),
                    round + 1,
                    dp.label(),
                    fmt_pps(rate),
                    if taken > 0.0 { fwd / taken } else { 0.0 }
                );
                let at = match rows.iter().position(|r| r.traffic == traffic && r.dp == dp) {
                    Some(i) => i,
                    None => {
                        rows.push(FloodRow {
                            traffic,
                            dp,
                            rate: vec![],
                            delivered: vec![],
                            beside: vec![],
                            program_ns: vec![],
                        });
                        rows.len() - 1
                    }
                };
                let r = &mut rows[at];
                r.rate.push(rate);
                r.delivered.push(if taken > 0.0 {
                    (fwd / taken).min(1.0)
                } else {
                    0.0
                });
                r.beside.push((sent, seen));
                r.program_ns.extend(prog);
            }
        }
    }
    in_ns(&lab.rcv, "nft", &["delete", "table", "ip", "pwbeside"]);
    rows
}

/// `num ÷ den` of two flood rows, round by round.
fn paired(rows: &[FloodRow], t: Traffic, num: Datapath, den: Datapath) -> Option<Paired> {
    let find = |dp| rows.iter().find(|r| r.traffic == t && r.dp == dp);
    let (n, d) = (find(num)?, find(den)?);
    let r: Vec<f64> = n
        .rate
        .iter()
        .zip(&d.rate)
        .filter(|(_, b)| **b > 0.0)
        .map(|(a, b)| a / b)
        .collect();
    (!r.is_empty()).then(|| Paired::ratios(r))
}

fn verdict(met: bool) -> &'static str {
    if met {
        "meets"
    } else {
        "misses"
    }
}

/// The floods' table and the goals of the issue "fast for the traffic an attacker chooses",
/// each with its measured value and whether this run meets it. `main` is the main table's
/// rows (nftables against the conntrack-on baseline, every policy).
pub(crate) fn floods_section(rows: &[FloodRow], main: &[Row], policy: &str) -> String {
    if rows.is_empty() {
        return String::new();
    }
    let mut t = String::new();
    for traffic in Traffic::ALL {
        for r in rows.iter().filter(|r| r.traffic == traffic) {
            let cell = |den| {
                paired(rows, traffic, r.dp, den)
                    .filter(|_| r.dp != den)
                    .map_or("–".to_string(), |p| p.to_string())
            };
            let lost: u64 = r
                .beside
                .iter()
                .map(|(s, seen)| s.saturating_sub(*seen))
                .sum();
            let sent: u64 = r.beside.iter().map(|(s, _)| s).sum();
            t.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {lost} of {sent} |\n",
                traffic.label(),
                r.dp.label(),
                cell(Datapath::None),
                fmt_pps(median(r.rate.clone())),
                cell(Datapath::ConntrackOnly),
                if traffic.allowed() {
                    format!("{:.3}", median(r.delivered.clone()))
                } else {
                    "–".into()
                },
                if r.program_ns.is_empty() {
                    "–".into()
                } else {
                    format!("{:.0}", median(r.program_ns.clone()))
                },
            ));
        }
    }
    let mut goals = String::new();
    for traffic in [
        Traffic::NewAllowed,
        Traffic::SynAllowed,
        Traffic::CycledAllowed,
        Traffic::SustainedAllowed,
    ] {
        // Both beside Liqo's NAT chains (conntrack on): the gateway they would both run in. A
        // filter that cost nothing would run at the conntrack-on gateway's rate (the bound).
        let bound = paired(
            rows,
            traffic,
            Datapath::ConntrackOnly,
            Datapath::PeerwallNftConntrack,
        );
        // Both bpf modes: its own tables, and the kernel's (one connection table, not two).
        for (dp, what) in [
            (Datapath::PeerwallBpfConntrack, "bpf"),
            (
                Datapath::PeerwallBpfKernelCt,
                "bpf reading the kernel's table",
            ),
        ] {
            if let Some(p) = paired(rows, traffic, dp, Datapath::PeerwallNftConntrack) {
                let near = bound.as_ref().is_some_and(|b| p.median >= 0.95 * b.median);
                goals.push_str(&format!(
                    "| {}: {what} ÷ nftables, conntrack on for both | ≥ 1.0, and ≥ 0.95 × the bound | {p} | {} | {} |\n",
                    traffic.label(),
                    bound.as_ref().map_or("–".to_string(), |b| b.to_string()),
                    verdict(p.median >= 1.0 && near)
                ));
            }
        }
        // The limits, against nftables (no goal of their own): one hash lookup at tc, before
        // the kernel's conntrack (the bound of every tc datapath), and a bpf program after
        // conntrack doing nftables' least filter's work (where a datapath at netfilter's hook
        // would stand).
        for (limit, what) in [
            (Datapath::TcHashConntrack, "tcx one hash lookup"),
            (
                Datapath::NfHashConntrack,
                "bpf after conntrack (one hash lookup)",
            ),
        ] {
            if let Some(p) = paired(rows, traffic, limit, Datapath::PeerwallNftConntrack) {
                goals.push_str(&format!(
                    "| {}: limit, {what} ÷ nftables, conntrack on for both | – | {p} | – | a limit |\n",
                    traffic.label(),
                ));
            }
        }
    }
    for traffic in [Traffic::NewDenied, Traffic::SynDenied] {
        for dp in [
            Datapath::PeerwallBpf,
            Datapath::PeerwallBpfConntrack,
            Datapath::PeerwallBpfKernelCt,
        ] {
            if let Some(p) = paired(rows, traffic, dp, Datapath::None) {
                let bound = paired(rows, traffic, Datapath::TcHash, Datapath::None)
                    .map_or("–".to_string(), |b| b.to_string());
                goals.push_str(&format!(
                    "| {}: {} ÷ no filter | ≥ 1.9 | {p} | {bound} | {} |\n",
                    traffic.label(),
                    dp.label(),
                    verdict(p.median >= 1.9)
                ));
            }
        }
        // The limit of a datapath enforcing this policy (no goal of its own): what dropping
        // the flood costs when every fact the policy tests is looked up once.
        if let Some(p) = paired(rows, traffic, Datapath::TcFacts, Datapath::None) {
            goals.push_str(&format!(
                "| {}: limit, tcx one lookup per fact the policy tests ÷ no filter | – | {p} | – | a limit |\n",
                traffic.label(),
            ));
        }
    }
    let peerwall = |dp: Datapath| {
        matches!(
            dp,
            Datapath::PeerwallNft
                | Datapath::PeerwallNftConntrack
                | Datapath::PeerwallBpf
                | Datapath::PeerwallBpfConntrack
                | Datapath::PeerwallBpfKernelCt
        )
    };
    let lost: u64 = rows
        .iter()
        .filter(|r| peerwall(r.dp))
        .flat_map(|r| &r.beside)
        .map(|(s, seen)| s.saturating_sub(*seen))
        .sum();
    goals.push_str(&format!(
        "| the flow beside every flood, peerwall datapaths: packets lost | 0 | {lost} | 0 | {} |\n",
        verdict(lost == 0)
    ));
    // Known flows per policy: peerwall nftables beside Liqo's NAT chains ÷ the same gateway
    // without a filter (as the baseline is), and the bound: the least nftables filter of the
    // same traffic (one set lookup) on that gateway.
    let known: Vec<(&str, Paired, String)> = main
        .iter()
        .filter(|r| r.dp == Datapath::PeerwallNftConntrack)
        .filter_map(|r| {
            let b = find_row(main, &r.policy, Datapath::ConntrackOnly)?;
            let bound = find_row(main, &r.policy, Datapath::NftSetConntrack)
                .map_or("1 (not measured)".to_string(), |l| {
                    Paired::rows(l, b, true).to_string()
                });
            Some((r.policy.as_str(), Paired::rows(r, b, true), bound))
        })
        .collect();
    if let Some((policy, p, bound)) = known
        .iter()
        .min_by(|a, b| a.1.median.total_cmp(&b.1.median))
    {
        goals.push_str(&format!(
            "| known flows, allowed: nftables ÷ conntrack on, worst policy ({policy}) | ≥ 0.97 | {p} | {bound} | {} |\n",
            verdict(p.median >= 0.97)
        ));
    }
    // Issue "scale where Liqo grows": known flows through the NetworkPolicy tier.
    for (policy, p, bound) in known.iter().filter(|k| k.0.ends_with(" NetworkPolicies")) {
        goals.push_str(&format!(
            "| known flows, allowed: nftables ÷ conntrack on, {policy} | ≥ 0.95 | {p} | {bound} | {} |\n",
            verdict(p.median >= 0.95)
        ));
    }
    // Known flows through the bpf datapath, unchanged by the work on new flows: against the
    // empty tcx program attached in front of it for some windows of one running stream
    // (`limits.rs`), the worst policy.
    let alternating = main
        .iter()
        .filter(|r| r.dp == Datapath::PeerwallBpf && !r.limits.is_empty())
        .map(|r| {
            let ratios = r.limits.iter().map(|l| l.0).collect();
            (r.policy.as_str(), Paired::ratios(ratios))
        })
        .min_by(|a, b| a.1.median.total_cmp(&b.1.median));
    if let Some((policy, p)) = alternating {
        goals.push_str(&format!(
            "| known flows, allowed: bpf ÷ empty tcx program, alternating windows, worst policy ({policy}) | ≥ 0.93 | {p} | 1 | {} |\n",
            verdict(p.median >= 0.93)
        ));
    }
    format!(
        "\n### Floods (policy {policy})\n\nThe traffic an attacker chooses, each kind beside a \
         flow that was there before (one allowed UDP packet per millisecond from another CPU, \
         counted at the receiver). *New flow per packet*: the sender gives every packet a new \
         source port and address (inside the peer's range); *SYN flood*: the same with TCP \
         SYNs; *200k flows cycled*: 200 704 flows, more than the bpf flow tables (64k) and \
         every verdict cache, each back every ~0.2 s; *after 5 s of it*: new flows as in the \
         first, measured after the flood has run for 5 s (the others after 300 ms): by then \
         every `FLOW_SEEN` stamp of the bpf datapath is live and the kernel's connection table \
         is at its limit, the state a flood that lasts leaves a gateway in. Ratios to the \
         no-filter gateway on the \
         same traffic in the same round, and to the gateway with conntrack on (a Liqo gateway \
         tracks connections: its remapping NAT); *delivered*: forwarded ÷ taken in; *program \
         ns/pkt*: the peerwall tc program's own mean run time per packet, from the kernel's \
         `bpf_stats` in a 300 ms window after the measured one (on only there: timing each run \
         costs two clock reads), whose new flows go on from the measured window's (flows no \
         table holds yet). `cargo xtask bench breakdown` splits that cost into its parts \
         (its \"every packet a new flow\" column). *Limit: bpf after conntrack*: a \
         `BPF_PROG_TYPE_NETFILTER` program at the forward hook, where nftables' chains run, \
         reading the packet's conntrack state from it and looking its destination up in one \
         hash: the least a bpf datapath that decides after conntrack costs. *Limit: tcx, one \
         lookup per fact the policy tests* (`peerwall_facts`): the facts the protection policy \
         decides a new packet from the tunnel on, each looked up once in the cheapest table \
         the bpf datapath has for it (whether a flow between its addresses is live: a pair \
         stamp, an array read; its source among the peer's CIDRs: a trie; its destination \
         among the offloaded pods: a hash), nothing else (no ports, clock, interface, path, \
         state or verdict cache): the least a tc datapath enforcing that policy costs.\n\n\
         | traffic | datapath | ÷ no filter (spread) | pps | ÷ conntrack on (spread) | delivered | program ns/pkt | flow beside: lost |\n\
         |---|---|---:|---:|---:|---:|---:|---:|\n{t}\n\
         Goals (issue \"the eBPF datapath never slower than nftables on a real gateway's \
         traffic\"; nftables' known flows: issues \"fast for the traffic an attacker chooses\" \
         and \"scale where Liqo grows\"), as this run measured them:\n\n\
         *Best possible* is what a filter costing nothing would reach here, measured in the \
         same rounds: for bpf ÷ nftables with conntrack on (both beside Liqo's NAT chains, \
         whose per-connection work is the gateway's whatever filters), the conntrack-on \
         gateway without a filter ÷ nftables; \
         for dropping a flood, the limit program (one hash lookup, no state) ÷ no filter; \
         for nftables' known flows, the least nftables filter of the same traffic (a forward \
         chain of one rule: the tunnel's packets whose destination, or (source, destination) \
         pair, is not in one set dropped) ÷ the conntrack-on gateway, from the table above; \
         for bpf's known flows, the empty program itself.\n\n\
         | goal | target | measured (spread) | best possible (measured) | |\n|---|---:|---:|---:|---|\n{goals}"
    )
}
