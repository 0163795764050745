//! Gateway benchmark (`cargo xtask bench-gateway`, as root): the datapaths a platform engineer
//! would choose between, enforcing the same provider-protection policy in a gateway network
//! namespace between a sender and a receiver namespace over veth, measured side by side in one
//! run. Writes the `gateway` section of docs/bench.md and docs/bench-gateway.svg.
//!
//! Topology: `snd` (eth0) —veth— (`liqo-tunnel`) `gw` (`liqo.benchgw000`) —veth— (eth0) `rcv`.
//! The gateway forwards 10.0.0.0/8 towards `rcv` (one permanent next hop: no neighbour per
//! destination); `rcv` has forwarding off and drops them after a route lookup (no ICMP back).
//!
//! Traffic: 64-byte UDP frames from 172.16.0.0/16 written by an AF_PACKET socket
//! (PACKET_QDISC_BYPASS, sendmmsg batches of 64) on one core. On veth the whole path (send,
//! gateway, filter, forward) runs on that core, so the achieved rate is the inverse of the
//! per-packet CPU cost; the filter's cost per packet is `1/pps − 1/pps_baseline`.
//! - allowed: destinations drawn uniformly from the N offloaded pod IPs; figure = packets the
//!   gateway forwarded per second (tx of its receiver-side veth);
//! - denied: destinations outside the set; figure = packets the gateway took in and dropped per
//!   second (sender tx minus drops for lack of CPU: veth `tx_dropped`, softnet `dropped`); a
//!   run in which a filtering datapath let a single denied packet reach the receiver (counted
//!   there exactly, by an nft rule installed around the denied windows) aborts the benchmark,
//!   and so does an allowed window forwarding less than 90 % of what the gateway took in (the
//!   two are interface counters read a few hundred microseconds apart around a one-second
//!   window, so they differ by that skew without any packet lost; an allowed packet dropped by
//!   a filter would show as a collapse far below that, and the differential tests prove the
//!   verdicts packet by packet).
//!
//! Both are shown as ratios to the no-filter baseline forwarding the same frames.
//!
//! Datapaths: none; peerwall nftables; peerwall bpf (tcx); peerwall bpf + XDP early drop;
//! Liqo's rendering (one nftables rule per IP); iptables-legacy with one rule per IP; iptables +
//! ipset. Policies: the controller's gateway policy (`protection::gateway_spec`: default deny on
//! the tunnel, allow the consumer's offloaded pods) at 10 / 1k / 10k / 100k pod IPs, and a
//! mixed policy of 64 rules (CIDRs, ranges, port ranges; rule-per-IP renderings keep one rule
//! per FirewallConfiguration rule; ipset has nothing to offer there).
//!
//! Control plane at 100k pods: full load per datapath; one pod added → first packet through
//! (a probe stream to the new IP; for peerwall the agent watching a policy directory); agent
//! peak RSS. Settings: PEERWALL_BENCH_REPEATS (5), PEERWALL_BENCH_WINDOW_MS (1000),
//! PEERWALL_BENCH_SIZES (10,1000,10000,100000), PEERWALL_SEED (1), and for bpf against the
//! limits in alternating windows (`limits.rs`) PEERWALL_BENCH_LIMIT_CYCLES (6 per round; 0:
//! none) and PEERWALL_BENCH_LIMIT_WINDOW_MS (400); PEERWALL_BENCH_TRAFFIC (the floods by
//! name: new-allowed, new-denied, syn-allowed, syn-denied, cycled; all when unset).

#[path = "../doc/mod.rs"]
mod doc;
#[path = "../shared/np_cluster.rs"]
mod np_cluster;

mod control;
mod datapaths;
mod deployed;
mod events;
mod floods;
mod lab;
mod limits;
mod nf_limit;
mod report;
mod traffic;

use control::*;
use datapaths::*;
use events::*;
use floods::*;
use lab::*;
use limits::*;
use report::*;
use traffic::*;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use peerwall_netns::NetNs;

pub(crate) const TUNNEL: &str = "liqo-tunnel";
pub(crate) const GENEVE: &str = "liqo.benchgw000";
pub(crate) const SENDER_CPU: usize = 1;
pub(crate) const BATCH: usize = 64;

pub(crate) fn env_or<T: std::str::FromStr>(k: &str, d: T) -> T {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

pub(crate) fn peerwall_bin() -> &'static str {
    env!("CARGO_BIN_EXE_peerwall")
}

pub(crate) fn run(program: &str, args: &[&str]) -> String {
    let o = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        o.status.success(),
        "{program} {}: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub(crate) fn in_ns(ns: &NetNs, program: &str, args: &[&str]) -> String {
    let mut full = vec!["netns", "exec", ns.name(), program];
    full.extend_from_slice(args);
    run("ip", &full)
}

/// `nsenter --net` keeps the host's /sys/fs/bpf visible (`ip netns exec` remounts /sys).
pub(crate) fn nsenter(ns: &NetNs, program: &str, args: &[&str]) -> String {
    let net = format!("--net=/run/netns/{}", ns.name());
    let mut full = vec![net.as_str(), program];
    full.extend_from_slice(args);
    run("nsenter", &full)
}

/// The whole comparison, long on purpose: it is the script of the benchmark (topology, every
/// datapath on every policy, the control plane, the report), each step one call.
fn main() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("the gateway benchmark needs root (network namespaces, nftables, bpf)");
        std::process::exit(1);
    }
    if std::env::args().any(|a| a == "--list" || a == "--test") {
        // `cargo test --benches` probes harness-less benches: nothing to list or test here.
        return;
    }
    let repeats: usize = env_or("PEERWALL_BENCH_REPEATS", 5);
    let window = Duration::from_millis(env_or("PEERWALL_BENCH_WINDOW_MS", 1000));
    let warmup = Duration::from_millis(300);
    // Alternating windows against the limits (limits.rs), per round of the bpf row.
    let limit_cycles: usize = env_or("PEERWALL_BENCH_LIMIT_CYCLES", 6);
    let limit_window = Duration::from_millis(env_or("PEERWALL_BENCH_LIMIT_WINDOW_MS", 400));
    let seed: u64 = env_or("PEERWALL_SEED", 1);
    let sizes: Vec<usize> = std::env::var("PEERWALL_BENCH_SIZES")
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![10, 1000, 10_000, 100_000]);
    // `PEERWALL_BENCH_DATAPATHS=none,bpf,...` (labels' first words, lower case): a quick look
    // at a few rows; docs/bench.md is only rewritten by a full run.
    let only: Option<Vec<String>> = std::env::var("PEERWALL_BENCH_DATAPATHS")
        .ok()
        .map(|v| v.split(',').map(|x| x.trim().to_lowercase()).collect());
    let wanted = |dp: Datapath| {
        only.as_ref().is_none_or(|o| {
            dp == Datapath::None || o.iter().any(|x| format!("{dp:?}").to_lowercase() == *x)
        })
    };
    let lab = Lab::new();
    let mut policies: Vec<Policy> = sizes.iter().map(|&n| protection_policy(n, seed)).collect();
    policies.push(mixed_policy(seed));
    // The controller's tier for 1 000 NetworkPolicies (PEERWALL_BENCH_NETPOLS; 0: none).
    let netpols: usize = env_or("PEERWALL_BENCH_NETPOLS", 1000);
    if netpols > 0 {
        policies.push(netpol_policy(netpols, seed));
    }
    let mut rows: Vec<Row> = Vec::new();
    let started = Instant::now();
    for p in &policies {
        let (sa, sd) = match &p.sources {
            Some((a, d)) => (Some(a.as_slice()), Some(d.as_slice())),
            None => (None, None),
        };
        let fa = frames_for(&lab, &p.allowed, sa, seed);
        let fd = frames_for(&lab, &p.denied, sd, seed + 1);
        let dps: Vec<Datapath> = Datapath::ALL.into_iter().filter(|&d| wanted(d)).collect();
        let mut prow: Vec<Row> = Vec::new();
        // Interleaved rounds: every datapath once per round, installed afresh, so each
        // round's figures are paired with that round's baseline and slow drifts of the VM
        // fall on every row alike (ratios are taken per round, then their median).
        for round in 0..repeats {
            for &dp in &dps {
                let Some(load) = install(&lab, dp, p) else {
                    continue;
                };
                let at = match prow.iter().position(|r| r.dp == dp) {
                    Some(i) => i,
                    None => {
                        prow.push(Row {
                            policy: p.name.clone(),
                            dp,
                            allowed: vec![],
                            denied: vec![],
                            loads: vec![],
                            events_per_sec: None,
                            limits: vec![],
                        });
                        prow.len() - 1
                    }
                };
                let reports_events = dp.without_events().is_some();
                let events_before = reports_events.then(|| events_seen(&lab));
                let measuring = Instant::now();
                let (fwd, taken) = measure(&lab, &fa, warmup, window);
                assert!(
                    fwd >= 0.9 * taken && fwd > 0.0,
                    "{}: {}: allowed traffic not forwarded ({fwd:.0} of {taken:.0} pps)",
                    p.name,
                    dp.label()
                );
                let filters = !matches!(
                    dp,
                    Datapath::None
                        | Datapath::TcEmpty
                        | Datapath::TcEmptyGuard
                        | Datapath::ConntrackOnly
                );
                let guard =
                    filters.then(|| DeniedGuard::install(&lab, std::net::Ipv4Addr::UNSPECIFIED));
                let (fwd_d, taken_d) = measure(&lab, &fd, warmup, window);
                let denied = match guard {
                    // Not filters: denied frames are forwarded like allowed ones.
                    None => fwd_d,
                    Some(g) => {
                        let leaked = g.leaked();
                        assert_eq!(
                            leaked,
                            0,
                            "{}: {}: denied packets reached the receiver ({fwd_d:.0} pps forwarded)",
                            p.name,
                            dp.label()
                        );
                        taken_d
                    }
                };
                if dp == Datapath::PeerwallBpf && limit_cycles > 0 {
                    let allowed: Vec<_> = p.allowed.iter().map(|(a, _)| *a).collect();
                    let r = against_limits(&lab, &fa, &allowed, limit_cycles, limit_window);
                    eprintln!(
                        "{:>15} | round {} | bpf ÷ empty tcx, ÷ one hash lookup, alternating windows: {}",
                        p.name,
                        round + 1,
                        r.iter()
                            .map(|(e, h)| format!("{e:.2} {h:.2}"))
                            .collect::<Vec<_>>()
                            .join(" | ")
                    );
                    prow[at].limits.extend(r);
                }
                let row = &mut prow[at];
                row.allowed.push(fwd);
                row.denied.push(denied);
                if dp != Datapath::None {
                    row.loads.push(load);
                }
                if let Some(before) = events_before {
                    let seen = events_seen(&lab).saturating_sub(before) as f64;
                    let rate = seen / measuring.elapsed().as_secs_f64();
                    let n = row.allowed.len() as f64;
                    // Running mean over the rounds.
                    let mean = row.events_per_sec.unwrap_or(0.0);
                    row.events_per_sec = Some(mean + (rate - mean) / n);
                }
                uninstall(&lab, dp);
                eprintln!(
                    "{:>15} | round {} | {:<28} | allowed {:>9} pps | denied {:>9} pps | load {:?}",
                    p.name,
                    round + 1,
                    dp.label(),
                    fmt_pps(fwd),
                    fmt_pps(denied),
                    load
                );
            }
        }
        rows.extend(prow);
    }
    // Floods, on the 1k-pod policy (or the first measured), unless PEERWALL_BENCH_FLOODS=0.
    let flood_policy = policies
        .iter()
        .find(|p| p.name == "1k pods")
        .unwrap_or(&policies[0]);
    let flood_rows = if env_or("PEERWALL_BENCH_FLOODS", 1) == 1 {
        floods(&lab, flood_policy, repeats, warmup, window, seed, wanted)
    } else {
        Vec::new()
    };
    let data_secs = started.elapsed().as_secs();
    let cp_n = *sizes.iter().max().unwrap_or(&100_000);
    let cp: Vec<ControlRow> = Datapath::ALL
        .iter()
        .filter(|d| {
            // Dispatch off is a rendering compared on the data plane only (its control
            // plane is peerwall nftables').
            !matches!(
                d,
                Datapath::None
                    | Datapath::PeerwallXdp
                    | Datapath::PeerwallBpfConntrack
                    | Datapath::PeerwallBpfKernelCt
                    | Datapath::PeerwallNftConntrack
                    | Datapath::PeerwallNftNoCacheConntrack
                    | Datapath::PeerwallNftLinear
            ) && !d.is_limit()
                && d.without_events().is_none()
        })
        .filter(|_| only.is_none())
        .map(|&dp| {
            let r = control_plane(&lab, dp, cp_n, seed);
            eprintln!(
                "control plane {:<28} full {:?} one pod {:?}",
                dp.label(),
                r.full_load,
                r.one_pod
            );
            r
        })
        .collect();

    // Report.
    let date = run("date", &["-u", "+%Y-%m-%d %H:%M UTC"]);
    let uname = run("uname", &["-r"]);
    let names: Vec<String> = policies.iter().map(|p| p.name.clone()).collect();
    let mut md = String::new();
    md.push_str("## Gateway benchmark against the alternatives (`cargo xtask bench-gateway`)\n\n");
    md.push_str(&format!(
        "Generated on {} (kernel {}, {} cores); data plane {data_secs} s, {repeats} interleaved rounds per policy (every datapath installed afresh and measured once per round: {} ms after {} ms warm-up, allowed then denied), seed {seed}.\n\n",
        date.trim(), uname.trim(), std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1), window.as_millis(), warmup.as_millis()
    ));
    md.push_str("Sender → gateway → receiver network namespaces over veth; 64-byte UDP from one AF_PACKET sender on one core (the whole path runs on that core, so rate = 1 / CPU cost per packet). Every datapath enforces the same policy: the controller's provider-protection configuration (default deny on `liqo-tunnel`, allow the consumer's N offloaded pods) or a mixed policy of 64 rules. *Allowed*: destinations drawn from the N pods, figure = packets forwarded per second. *Denied*: destinations outside them, figure = packets taken in and dropped per second. Ratios are to the no-filter gateway forwarding the same frames in the same round, then the median over the rounds (spread = min–max of the rounds' ratios). *Filter ns/pkt* = 1/pps − 1/pps(no filter) from the medians, the CPU the filter adds to each allowed packet. peerwall's bpf rows run as a gateway runs them, under `peerwall agent` (`--source dir:`), whose route watcher keeps the local-address mirror that new flows take their path from (`peerwall inspect` must say so before and after every window; `peerwall apply` would leave them to a FIB lookup); their *load* is from the agent's start until its policy and mirror are in force.\n\n");
    md.push_str("![gateway benchmark](bench-gateway.svg)\n\n");
    md.push_str("| policy | datapath | allowed: ratio (spread) | allowed pps | filter ns/pkt | denied: ratio (spread) | denied pps | load |\n|---|---|---:|---:|---:|---:|---:|---:|\n");
    for r in &rows {
        let Some(b) = find_row(&rows, &r.policy, Datapath::None) else {
            continue;
        };
        let (ra, rd) = (Paired::rows(r, b, true), Paired::rows(r, b, false));
        let ma = median(r.allowed.clone());
        let ba = median(b.allowed.clone());
        let cost = if r.dp == Datapath::None {
            "–".to_string()
        } else {
            format!("{:.0}", (1e9 / ma - 1e9 / ba).max(0.0))
        };
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.policy,
            r.dp.label(),
            ra,
            fmt_pps(ma),
            cost,
            rd,
            fmt_pps(median(r.denied.clone())),
            r.load()
                .map(|d| format!("{:.0} ms", d.as_secs_f64() * 1e3))
                .unwrap_or_else(|| "–".into())
        ));
    }
    let refused = deployed::REFUSED
        .lock()
        .map(|r| r.clone())
        .unwrap_or_default();
    if !refused.is_empty() {
        md.push_str("\nRows left out because the backend refused the policy (the agent kept its previous one and said why):\n\n");
        let mut seen = std::collections::BTreeSet::new();
        for r in refused.iter().filter(|r| seen.insert(r.as_str())) {
            md.push_str(&format!("- {r}\n"));
        }
    }
    md.push_str(&limits_section(&rows, &names));
    md.push_str(&floods_section(&flood_rows, &rows, &flood_policy.name));
    md.push_str(&format!("\nControl plane at {cp_n} offloaded pods, measured with probe streams through the gateway (one packet every 200 µs). *Full sync*: from starting the agent (peerwall) or the loading command (others) until a stream to a denied address stops passing, i.e. the whole policy is in force. *One more pod*: from the change until a stream to the new pod's address passes; peerwall through `peerwall agent --source dir:` polling every 20 ms (re-parse, validate and compile all {cp_n} addresses, then the backend's incremental update: one set element or one map entry), the others through their own incremental command (`nft insert rule`, `iptables -I`, `ipset add`).\n\n| datapath | full sync | one more pod | agent peak RSS |\n|---|---:|---:|---:|\n"));
    for c in &cp {
        md.push_str(&format!(
            "| {} | {:.0} ms | {:.1} ms | {} |\n",
            c.dp.label(),
            c.full_load.as_secs_f64() * 1e3,
            c.one_pod.as_secs_f64() * 1e3,
            c.rss_kib
                .map(|k| format!("{:.0} MiB", k as f64 / 1024.0))
                .unwrap_or_else(|| "–".into())
        ));
    }
    let ev = events_section(&rows);
    if !ev.is_empty() {
        doc::write_section("events", ev.trim_end()).expect("write docs/bench.md");
        print!("{ev}");
    }
    if only.is_some() || std::env::var_os("PEERWALL_BENCH_TRAFFIC").is_some() {
        print!("{md}");
        return;
    }
    doc::write_section("gateway", md.trim_end()).expect("write docs/bench.md");
    std::fs::write(
        doc::docs_dir().join("bench-gateway.svg"),
        svg(&rows, &names),
    )
    .expect("write svg");
    print!("{md}");
}
