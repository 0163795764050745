//! Datapath benchmark (`cargo xtask bench`, as root): ns/packet of the full classifier against a
//! bare one-LPM-lookup program measured in the same run, at 10 / 1k / 100k / 1M prefixes and
//! 1 / 64 / 1023 rules, plus single-entry update latency and full policy load time at 100k
//! prefixes. Writes `docs/bench.md`.
//!
//! Method: both programs run with BPF_PROG_TEST_RUN (`repeat` = 200k, kernel-measured mean
//! ns per run), interleaved, 5 rounds; the table shows medians and the classifier/bare ratio.
//! The packet is a forwarded TCP SYN whose destination is one of the N prefixes (a /32 host),
//! so the deciding rule is the last one and every dimension is looked up ("hot": the same
//! packet each run, caches warm).

mod breakdown;
mod doc;

use std::net::Ipv4Addr;
use std::time::Instant;

use aya::programs::{TestRun, TestRunOptions};
use ipnet::{IpNet, Ipv4Net};
use peerwall_backend_bpf::loader::{ensure_bpffs, remove_pins, BpfBackend};
use peerwall_backend_bpf::maps::Iface;
use peerwall_policy::ir::{
    self, Action, AddrSet, Chain, ChainKind, Dir, Hook, IpFamily, Match, Origin, Policy, PortSet,
    Rule, Source, Table, TableFamily, Test, VerdictAction,
};
use peerwall_probe::packet::{build_ip, ethernet, Shape};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const REPEAT: u32 = 200_000;
const ROUNDS: usize = 5;

fn hosts(n: usize, seed: u64) -> Vec<Ipv4Net> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut v: Vec<u32> = Vec::with_capacity(n);
    let mut seen = std::collections::HashSet::with_capacity(n);
    while v.len() < n {
        // 10.0.0.0/8, never 10.255.255.0/24 (the miss range).
        let a = 0x0a00_0000 | rng.random_range(0..0x00ff_ff00u32);
        if seen.insert(a) {
            v.push(a);
        }
    }
    v.into_iter()
        .map(|a| Ipv4Net::new(Ipv4Addr::from(a), 32).unwrap_or_default())
        .collect()
}

/// One forward chain: rules 0..R-1 on ports (never matching the probe), the last rule accepts
/// destinations in the N-host set; policy drop.
fn policy(prefixes: &[Ipv4Net], rules: usize) -> Policy {
    let mut rs = Vec::new();
    for i in 0..rules.saturating_sub(1) {
        rs.push(Rule {
            name: format!("port{i}"),
            matches: vec![Match {
                negate: false,
                test: Test::Port {
                    dir: Dir::Dst,
                    set: PortSet::from_ranges([(10_000 + i as u16, 10_000 + i as u16)]),
                    source: Source::Inline { count: 1 },
                },
            }],
            action: Action::Verdict(VerdictAction::Drop),
            counter: true,
        });
    }
    rs.push(Rule {
        name: "offloaded".into(),
        matches: vec![Match {
            negate: false,
            test: Test::Addr {
                dir: Dir::Dst,
                set: AddrSet::from_nets(IpFamily::V4, prefixes.iter().map(|p| IpNet::V4(*p))),
                source: Source::Named("pods".into()),
            },
        }],
        action: Action::Verdict(VerdictAction::Accept),
        counter: true,
    });
    Policy {
        tables: vec![Table {
            name: "bench".into(),
            family: TableFamily::Inet,
            origin: Origin("bench".into()),
            sets: vec![],
            chains: vec![Chain {
                name: "fwd".into(),
                kind: ChainKind::Filter,
                hook: Hook::Forward,
                priority: 0,
                policy: VerdictAction::Drop,
                rules: rs,
            }],
        }],
        observed: vec![],
    }
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    v[v.len() / 2]
}

struct Row {
    prefixes: usize,
    rules: usize,
    classifier_ns: f64,
    bare_ns: f64,
    verdict_ok: bool,
}

fn frame_to(dst: Ipv4Addr) -> Vec<u8> {
    let pkt = ir::Packet {
        src: "10.255.255.7"
            .parse()
            .unwrap_or(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST)),
        dst: std::net::IpAddr::V4(dst),
        proto: 6,
        sport: 40000,
        dport: 443,
        iif: Some("liqo-tunnel".into()),
        oif: Some("liqo.abcdefghij".into()),
        ct_state: ir::CtState::New,
    };
    ethernet(
        [2, 0, 0, 0, 0, 1],
        [2, 0, 0, 0, 0, 2],
        &build_ip(&pkt, 7, Shape::default()),
    )
}

fn ctx() -> [u8; 192] {
    // Probe mode: forward path, oif 2, iif 1 (see peerwall_probe::bpf).
    let mut c = [0u8; 192];
    for (i, v) in [peerwall_common::PROBE_MAGIC, 1, 2, 1].iter().enumerate() {
        c[48 + i * 4..52 + i * 4].copy_from_slice(&v.to_ne_bytes());
    }
    c
}

pub(crate) fn run_ns(
    prog: &aya::programs::SchedClassifier,
    frame: &[u8],
    ctx: &[u8],
) -> (f64, u32) {
    let mut out = vec![0u8; frame.len() + 64];
    let r = prog
        .test_run(TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut out),
            ctx_in: Some(ctx),
            repeat: REPEAT,
            ..TestRunOptions::default()
        })
        .expect("BPF_PROG_TEST_RUN");
    (r.duration.as_nanos() as f64, r.return_value)
}

fn ifaces() -> Vec<Iface> {
    vec![
        Iface {
            name: "liqo-tunnel".into(),
            ifindex: 1,
        },
        Iface {
            name: "liqo.abcdefghij".into(),
            ifindex: 2,
        },
    ]
}

/// The benchmark script, long on purpose: the bare lookup and the classifier at every size in
/// one run, so the ratios compare like with like.
fn main() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("the datapath benchmark needs root (BPF_PROG_TEST_RUN)");
        std::process::exit(2);
    }
    let root = ensure_bpffs().expect("bpffs");
    // `cargo xtask bench breakdown`: only where the time goes.
    if std::env::args().any(|a| a == "breakdown") {
        breakdown_section();
        return;
    }
    let mut rows = Vec::new();
    let sizes = [10usize, 1_000, 100_000, 1_000_000];
    let rule_counts = [1usize, 64, 1023];
    for &n in &sizes {
        let prefixes = hosts(n, 42);
        let target = prefixes[n / 2].network();
        let frame = frame_to(target);
        for &r in &rule_counts {
            let pin = root.join(format!("pwbench-{}-{n}-{r}", std::process::id()));
            let mut b = BpfBackend::load(&pin).expect("load");
            b.set_probe_mode().expect("probe mode");
            b.apply(&policy(&prefixes, r), &ifaces()).expect("apply");
            b.fill_bare(&prefixes).expect("bare trie");
            let c = ctx();
            let mut cls = Vec::new();
            let mut bare = Vec::new();
            let mut ok = true;
            for _ in 0..ROUNDS {
                let (ns, ret) = run_ns(b.tc_program().expect("tc"), &frame, &c);
                ok &= ret == 0;
                cls.push(ns);
                let (ns, ret) = run_ns(b.bare_program().expect("bare"), &frame, &c);
                ok &= ret == 0;
                bare.push(ns);
            }
            let row = Row {
                prefixes: n,
                rules: r,
                classifier_ns: median(cls),
                bare_ns: median(bare),
                verdict_ok: ok,
            };
            eprintln!(
                "N={n:>8} R={r:>5}: classifier {:>7.1} ns, bare {:>6.1} ns, ratio {:.2}{}",
                row.classifier_ns,
                row.bare_ns,
                row.classifier_ns / row.bare_ns,
                if ok { "" } else { "  (UNEXPECTED VERDICT)" }
            );
            rows.push(row);
            drop(b);
            let _ = remove_pins(&pin);
        }
    }
    // Control plane at 100k prefixes.
    let prefixes = hosts(100_000, 43);
    let pin = root.join(format!("pwbench-cp-{}", std::process::id()));
    let mut b = BpfBackend::load(&pin).expect("load");
    let p0 = policy(&prefixes, 64);
    let t = Instant::now();
    let full = b.apply(&p0, &ifaces()).expect("apply");
    let full_load = t.elapsed();
    let mut more = prefixes.clone();
    more.push(Ipv4Net::new(Ipv4Addr::new(10, 255, 255, 1), 32).unwrap_or_default());
    let p1 = policy(&more, 64);
    let t = Instant::now();
    let one = b.apply(&p1, &ifaces()).expect("update");
    let one_update = t.elapsed();
    let mut raw = Vec::new();
    let extra: Vec<Ipv4Net> = (0..200u32)
        .map(|i| Ipv4Net::new(Ipv4Addr::from(0x0aff_fe00 | i), 32).unwrap_or_default())
        .collect();
    for p in &extra {
        let t = Instant::now();
        b.fill_bare(std::slice::from_ref(p)).expect("insert");
        raw.push(t.elapsed().as_nanos() as f64);
    }
    let raw_update = median(raw);
    drop(b);
    let _ = remove_pins(&pin);

    let uname = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .unwrap_or("unknown")
        .trim()
        .to_string();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let date = std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let mut md = String::new();
    md.push_str("## Datapath micro-benchmark (`cargo xtask bench`)\n\n");
    md.push_str(&format!(
        "Generated by `cargo xtask bench` on {date}: kernel {}, {cores} cores ({cpu}).\n\n",
        uname.trim()
    ));
    md.push_str("BPF_PROG_TEST_RUN, kernel-measured mean ns per run over 200k repeats, median of 5 interleaved rounds. \"bare\" is a program doing one LPM lookup on the same N prefixes, measured in the same run; the ratio is what the full classifier costs relative to it. The packet is a forwarded TCP SYN to one of the N destination hosts, decided by the last rule of the chain (all rules before it test ports), the same packet every run (hot caches). Absolute numbers drift between runs on this VM; compare ratios.\n\n");
    md.push_str("| prefixes | rules | classifier ns/pkt | bare LPM ns/pkt | ratio |\n|---:|---:|---:|---:|---:|\n");
    for r in &rows {
        md.push_str(&format!(
            "| {} | {} | {:.1} | {:.1} | {:.2}{} |\n",
            r.prefixes,
            r.rules,
            r.classifier_ns,
            r.bare_ns,
            r.classifier_ns / r.bare_ns,
            if r.verdict_ok {
                ""
            } else {
                " (verdict wrong!)"
            }
        ));
    }
    md.push_str(&format!(
        "\nControl plane at 100k prefixes, 64 rules:\n\n| operation | time |\n|---|---:|\n| full policy load (compile + write the idle slot + switch; {} map entries) | {:.0} ms |\n| offload one more pod: `apply` end to end (compile 100k, diff, {} entry written in place) | {:.0} ms |\n| one trie entry insert (map update syscall, median of 200) | {:.1} µs |\n",
        full.entries_changed,
        full_load.as_secs_f64() * 1e3,
        one.entries_changed,
        one_update.as_secs_f64() * 1e3,
        raw_update / 1e3
    ));
    let overhead = median(rows.iter().map(|r| r.classifier_ns - r.bare_ns).collect());
    md.push_str(&format!("\nReading the table: the classifier's cost is flat in the number of rules (bitmaps are ANDed word by word; 1023 rules are 16 words) and, since host addresses are looked up in an exact-match hash map before the trie (`DSTH`), flat in the number of hosts too, while the bare program's LPM lookup grows with the trie. The classifier's own cost over a bare lookup, about {overhead:.0} ns in this run (median of the differences), is header parsing, two conntrack lookups, per-chain map lookups for the constrained dimensions, counters and bookkeeping. The ratio therefore falls as the bare lookup gets more expensive.\n"));
    doc::write_section("datapath", md.trim_end()).expect("write docs/bench.md");
    print!("{md}");
    breakdown_section();
    assert!(
        rows.iter().all(|r| r.verdict_ok),
        "a benchmark packet got the wrong verdict"
    );
}

/// Where the time goes, at 1k hosts and 64 rules: written to docs/bench.md.
fn breakdown_section() {
    let bd_hosts = hosts(1_000, 44);
    let bd_frame = frame_to(bd_hosts[500].network());
    let parts = breakdown::run(policy(&bd_hosts, 64), bd_hosts, bd_frame);
    let bd = breakdown::markdown(&parts, 1_000, 64);
    doc::write_section("breakdown", bd.trim_end()).expect("write docs/bench.md");
    print!("\n{bd}");
    assert!(
        parts.iter().all(|p| p.ok),
        "a breakdown variant gave an unexpected verdict"
    );
}
