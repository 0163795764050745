//! Where the classifier's time goes: the same packet through program variants, one part of the
//! work removed at a time (the datapath's benchmark-only `DIAG_*` flags), next to the limits no
//! tc datapath can beat (a program that does nothing, one hash lookup, one LPM lookup). Unlike
//! the main table this runs *without* probe mode, in a network namespace with forwarding on
//! and routes for the benchmark's destinations, so the FIB lookup is a real one.

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;
use peerwall_backend_bpf::loader::{host_ifaces, remove_pins, Conntrack, Datapath, LoadOptions};
use peerwall_backend_bpf::maps::Iface;
use peerwall_backend_bpf::routing::watch::RouteWatch;
use peerwall_common::flags;
use peerwall_netns::NetNs;
use peerwall_policy::ir::Policy;

use crate::{median, run_ns, run_repeat};

/// Rounds: more than the main table's, since the parts are differences of close numbers.
const ROUNDS: usize = 21;

/// Rounds of this run: `PEERWALL_BENCH_ROUNDS` (quick looks), else [`ROUNDS`].
fn rounds() -> usize {
    std::env::var("PEERWALL_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(ROUNDS)
}

/// New flows run through every variant per round, each a test run of its own; over the rounds
/// and variants, more than `FLOWS_NEW` holds, so that its inserts take occupied slots as in
/// a flood.
const NEW_FLOWS: usize = 16_384;

/// One row of the breakdown.
pub struct Part {
    /// What runs.
    pub what: &'static str,
    /// Median ns per packet, the same packet every run.
    pub ns: f64,
    /// Median ns per packet when every packet is a new flow.
    pub new_ns: f64,
    /// Median ns per packet when every packet is a new flow the policy denies.
    pub denied_ns: f64,
    /// Verdict as expected (accept).
    pub ok: bool,
}

/// Packets of flows never seen before: `frame` with its source address (in 10.128.0.0/9) and
/// port changed, a different pair for every packet of the run (a counter, which the tables'
/// hashes spread as well as random draws would). The classifier reads no checksum.
struct NewFlows {
    frame: Vec<u8>,
    next: u32,
}

impl NewFlows {
    fn new(frame: &[u8]) -> Self {
        Self {
            frame: frame.to_vec(),
            next: 0,
        }
    }

    /// The next packet.
    fn next_frame(&mut self) -> &[u8] {
        let (host, port) = (self.next / 60_000, 1024 + (self.next % 60_000) as u16);
        self.next += 1;
        // Ethernet (14) + IPv4 source (12..16); the TCP source port right after the header.
        let a = 0x0a80_0000 | (host & 0x007f_ffff);
        self.frame[26..30].copy_from_slice(&a.to_be_bytes());
        self.frame[34..36].copy_from_slice(&port.to_be_bytes());
        &self.frame
    }
}

/// [`NEW_FLOWS`] packets of new flows through `prog`, each in a test run of its own: (mean
/// ns, every run returned `expect`).
fn per_new_flow(
    prog: &aya::programs::SchedClassifier,
    flows: &mut NewFlows,
    c: &[u8],
    expect: u32,
) -> (f64, bool) {
    let mut total = 0.0;
    let mut ok = true;
    for _ in 0..NEW_FLOWS {
        let (t, ret) = run_repeat(prog, flows.next_frame(), c, 1);
        total += t;
        ok &= ret == expect;
    }
    (total / NEW_FLOWS as f64, ok)
}

/// `__sk_buff` context: the packet arrived on `ifindex` (no probe marker).
fn ctx(ifindex: u32) -> [u8; 192] {
    let mut c = [0u8; 192];
    // __sk_buff.ingress_ifindex (offset 36) and .ifindex (offset 40).
    c[36..40].copy_from_slice(&ifindex.to_ne_bytes());
    c[40..44].copy_from_slice(&ifindex.to_ne_bytes());
    c
}

/// A network namespace where the benchmark's packets are really routed: a veth pair named like
/// a gateway's (`liqo-tunnel`, `liqo.abcdefghij`), forwarding on, a default route and
/// 10.0.0.0/8 through the Geneve side, and policy-routing rules as Liqo installs in a gateway.
/// Programs run in it see a real FIB lookup.
pub fn routed_namespace() -> NetNs {
    let ns = NetNs::new("pwbench-bd").expect("namespace");
    ns.veth("liqo-tunnel", &ns, "liqo.abcdefghij")
        .expect("veth");
    for args in [
        &["link", "set", "lo", "up"][..],
        &["addr", "add", "192.168.77.1/30", "dev", "liqo.abcdefghij"],
        // A gateway pod's default route (its pod network), without which some destinations
        // would be unroutable and the local-address mirror would not decide their path.
        &[
            "route",
            "add",
            "default",
            "via",
            "192.168.77.2",
            "dev",
            "liqo.abcdefghij",
        ],
        &[
            "route",
            "add",
            "10.0.0.0/8",
            "via",
            "192.168.77.2",
            "dev",
            "liqo.abcdefghij",
        ],
        // Liqo's policy routing (its RouteConfigurations, liqotech/liqo
        // docs/architecture/network/routeconfiguration.md: a gateway's `-extcidr` and
        // `-gw-node` rules by input interface `liqo-tunnel`, `-service-nodeport-routing` by
        // fwmark and destination, `<peer>-gw-ext` by destination, each to a table of its own),
        // so that a FIB lookup walks the rules a gateway has: none of them routes the
        // benchmark's destinations, which fall through to main.
        &[
            "route",
            "add",
            "10.111.0.1/32",
            "via",
            "192.168.77.2",
            "dev",
            "liqo.abcdefghij",
            "table",
            "1001",
        ],
        &["rule", "add", "iif", "liqo-tunnel", "lookup", "1001"],
        &[
            "route",
            "add",
            "default",
            "via",
            "192.168.77.2",
            "dev",
            "liqo.abcdefghij",
            "table",
            "1002",
        ],
        &["rule", "add", "fwmark", "0x10", "lookup", "1002"],
        &[
            "route",
            "add",
            "10.70.0.0/16",
            "dev",
            "liqo-tunnel",
            "table",
            "1003",
        ],
        &["rule", "add", "to", "10.70.0.0/16", "lookup", "1003"],
    ] {
        ns.ip(args).expect("bench namespace setup");
    }
    ns.sysctl("net.ipv4.ip_forward", "1").expect("forwarding");
    ns
}

/// Pins removed on every exit, a failed load or verification included.
pub struct Pins(pub std::path::PathBuf);

impl Drop for Pins {
    fn drop(&mut self) {
        let _ = remove_pins(&self.0);
    }
}

/// In the routed namespace: load the datapath pinned at `pin`, register the namespace's
/// interfaces and apply `policy`; returns it with the tunnel's `__sk_buff` context.
pub fn load_routed(pin: &std::path::Path, policy: &Policy) -> (Datapath, [u8; 192], RouteWatch) {
    load_routed_with(pin, policy, &LoadOptions::with_baselines())
}

/// [`load_routed`] as `opts` says.
fn load_routed_with(
    pin: &std::path::Path,
    policy: &Policy,
    opts: &LoadOptions,
) -> (Datapath, [u8; 192], RouteWatch) {
    let mut b = Datapath::load_with(pin, opts).expect("load");
    let host = host_ifaces().expect("interfaces");
    b.register_ifaces(&host).expect("interfaces");
    let ifaces: Vec<Iface> = host
        .iter()
        .map(|h| Iface {
            name: h.name.clone(),
            ifindex: h.ifindex,
        })
        .collect();
    let tunnel = host
        .iter()
        .find(|h| h.name == "liqo-tunnel")
        .map_or(0, |h| h.ifindex);
    b.apply(policy, &ifaces).expect("apply");
    // As the agent does once its programs are attached (none here: nothing to check).
    assert!(b.arm_flow_seen().expect("FLOW_SEEN"), "shortcut armed");
    // And its route watcher: new flows' paths from the local-address mirror.
    let routes = RouteWatch::start(pin).expect("route watcher");
    (b, ctx(tunnel), routes)
}

/// tc's verdict for a dropped packet.
const TC_ACT_SHOT: u32 = 2;

/// Run the breakdown for `policy` (which accepts `frame` and drops `denied`) over `hosts`.
pub fn run(policy: Policy, hosts: Vec<Ipv4Net>, frame: Vec<u8>, denied: Vec<u8>) -> Vec<Part> {
    let ns = routed_namespace();
    ns.run_in(move || {
        let root = peerwall_backend_bpf::loader::ensure_bpffs().expect("bpffs");
        let pin = root.join(format!("pwbench-bd-{}", std::process::id()));
        let _pins = Pins(pin.clone());
        let (mut b, c, _routes) = load_routed(&pin, &policy);
        b.fill_bare(&hosts).expect("bare trie");
        let addrs: Vec<Ipv4Addr> = hosts.iter().map(Ipv4Net::network).collect();
        b.fill_bare_hash(&addrs).expect("bare hash");
        // (row, diagnostic flags, conntrack's FLOW_SEEN shortcut on).
        let variants: [(&'static str, u32, bool); 12] = [
            ("classifier as deployed (verdict cache on)", 0, true),
            (
                "classifier, classifying in full (no verdict cache)",
                flags::DIAG_NO_CACHE,
                true,
            ),
            (
                "  the FIB lookup instead of the local-address mirror",
                flags::DIAG_NO_CACHE | flags::DIAG_NO_MIRROR,
                true,
            ),
            (
                "  without the FIB lookup or the mirror",
                flags::DIAG_NO_FIB,
                true,
            ),
            (
                "  without the conntrack write",
                flags::DIAG_NO_CT_COMMIT,
                true,
            ),
            (
                "  without conntrack (lookup and write)",
                flags::DIAG_NO_CT,
                true,
            ),
            (
                "  without the FLOW_SEEN shortcut (both flow tables looked up)",
                flags::DIAG_NO_CACHE,
                false,
            ),
            (
                "  every address map looked up (none skipped by the chain's description)",
                flags::DIAG_ALL_ADDR_LOOKUPS,
                true,
            ),
            (
                "  the host maps instead of the one-line host tables",
                flags::DIAG_NO_HOST_LINES,
                true,
            ),
            ("  without rule counters", flags::DIAG_NO_COUNTERS, true),
            (
                "  without the chains (parse, FIB, conntrack)",
                flags::DIAG_NO_CHAINS,
                true,
            ),
            (
                "  parse only (no FIB, conntrack, chains)",
                flags::DIAG_NO_FIB | flags::DIAG_NO_CT | flags::DIAG_NO_CHAINS,
                true,
            ),
        ];
        // The same policy on a datapath reading the kernel's connection table for IPv4 TCP
        // and UDP (`--bpf-conntrack kernel`), its own pins: with the sweep's vouch (as the
        // agent keeps it) and without (every packet asks the kernel).
        let kpin = root.join(format!("pwbench-bd-kct-{}", std::process::id()));
        let _kpins = Pins(kpin.clone());
        let kopts = LoadOptions {
            conntrack: Conntrack::Kernel {
                v4: true,
                v6: false,
            },
            ..LoadOptions::default()
        };
        let (mut k, _, _kroutes) = load_routed_with(&kpin, &policy, &kopts);
        let kernel_rows: [(&'static str, bool); 2] = [
            (
                "classifier as deployed, reading the kernel's table (the sweep vouching)",
                true,
            ),
            (
                "  the kernel asked for every packet (no sweep's vouch)",
                false,
            ),
        ];
        let extra = 3 + kernel_rows.len();
        let mut flows = NewFlows::new(&frame);
        let mut denied_flows = NewFlows::new(&denied);
        let mut samples: Vec<Vec<f64>> = vec![Vec::new(); variants.len() + extra];
        let mut fresh: Vec<Vec<f64>> = vec![Vec::new(); variants.len() + extra];
        let mut dropped: Vec<Vec<f64>> = vec![Vec::new(); variants.len() + extra];
        let mut ok = vec![true; variants.len() + extra];
        for _ in 0..rounds() {
            for (i, (_, diag, seen)) in variants.iter().enumerate() {
                b.set_diagnostic_flags(*diag).expect("flags");
                b.set_flow_seen(*seen).expect("flags");
                let (t, ret) = run_ns(b.tc_program().expect("tc"), &frame, &c);
                ok[i] &= ret == 0;
                samples[i].push(t);
                let (t, all) = per_new_flow(b.tc_program().expect("tc"), &mut flows, &c, 0);
                ok[i] &= all;
                fresh[i].push(t);
                // A gateway whose tracked flows are few (not the allowed flood just measured,
                // which stamped most of FLOW_SEEN): none, every entry idle.
                b.flush_flows().expect("flush conntrack");
                b.forget_flow_seen().expect("FLOW_SEEN");
                // Without the chains nothing drops: those accept.
                let drops = diag & flags::DIAG_NO_CHAINS == 0;
                let (t, all) = per_new_flow(
                    b.tc_program().expect("tc"),
                    &mut denied_flows,
                    &c,
                    if drops { TC_ACT_SHOT } else { 0 },
                );
                ok[i] &= all;
                dropped[i].push(t);
            }
            b.set_diagnostic_flags(0).expect("flags");
            b.set_flow_seen(true).expect("flags");
            let base = variants.len();
            type Limit = fn(
                &mut Datapath,
            ) -> Result<
                &mut aya::programs::SchedClassifier,
                peerwall_backend_bpf::loader::BpfError,
            >;
            let limits: [Limit; 3] = [
                Datapath::empty_program,
                Datapath::hash_program,
                Datapath::bare_program,
            ];
            for (j, limit) in limits.into_iter().enumerate() {
                let p = limit(&mut b).expect("baseline program");
                let (t, ret) = run_ns(p, &frame, &c);
                let (tn, all) = per_new_flow(p, &mut flows, &c, 0);
                // The limits pass everything; only their cost is compared.
                let (td, _) = per_new_flow(p, &mut denied_flows, &c, 0);
                ok[base + j] &= ret == 0 && all;
                samples[base + j].push(t);
                fresh[base + j].push(tn);
                dropped[base + j].push(td);
            }
            for (j, (_, vouched)) in kernel_rows.iter().enumerate() {
                let i = base + 3 + j;
                if *vouched {
                    // The agent's sweep of a table with nothing to stamp: the vouch alone.
                    k.stamp_kernel_flows(&[]).expect("sweep");
                } else {
                    k.forget_kernel_sweep().expect("no sweep");
                }
                let (t, ret) = run_ns(k.tc_program().expect("tc"), &frame, &c);
                ok[i] &= ret == 0;
                samples[i].push(t);
                let (t, all) = per_new_flow(k.tc_program().expect("tc"), &mut flows, &c, 0);
                ok[i] &= all;
                fresh[i].push(t);
                k.flush_flows().expect("flush conntrack");
                k.forget_flow_seen().expect("FLOW_SEEN");
                let (t, all) = per_new_flow(
                    k.tc_program().expect("tc"),
                    &mut denied_flows,
                    &c,
                    TC_ACT_SHOT,
                );
                ok[i] &= all;
                dropped[i].push(t);
            }
        }
        drop(b);
        drop(k);
        let names = variants
            .iter()
            .map(|(n, _, _)| *n)
            .chain([
                "limit: a tc program that does nothing",
                "limit: one hash lookup on the destination",
                "one LPM lookup on the destination (bare)",
            ])
            .chain(kernel_rows.iter().map(|(n, _)| *n));
        names
            .zip(samples)
            .zip(fresh)
            .zip(dropped)
            .zip(ok)
            .map(|((((what, s), f), d), ok)| Part {
                what,
                ns: median(s),
                new_ns: median(f),
                denied_ns: median(d),
                ok,
            })
            .collect()
    })
    .expect("running in the bench namespace")
}

/// The markdown section.
pub fn markdown(parts: &[Part], prefixes: usize, rules: usize) -> String {
    // Row 1: the full classification every variant removes one part from.
    let full = parts.get(1).map_or(0.0, |p| p.ns);
    let full_new = parts.get(1).map_or(0.0, |p| p.new_ns);
    let full_denied = parts.get(1).map_or(0.0, |p| p.denied_ns);
    let date = std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut md = format!(
        "## Where the classifier's time goes (`cargo xtask bench breakdown`)\n\nGenerated on {date} (kernel {}). Absolute numbers drift between runs on this VM; the ratios within one run are what to read.\n\n",
        kernel.trim()
    );
    md.push_str(&format!("{prefixes} destination hosts, {rules} rules, BPF_PROG_TEST_RUN *without* probe mode from a network namespace with forwarding on, a default route, a route for the destinations and policy-routing rules by input interface, mark and destination (each to a table of its own), as a Liqo gateway pod has: the packet's path comes from the agent's mirror of the local routing table (`LOCAL`, kept by its route watcher, running here), and where a row asks for it, from a real FIB lookup. Two kinds of traffic: *the same packet* (a forwarded TCP SYN) every run, 200k runs per measurement, so every table it touches is in the CPU's caches; and *every packet a new flow*: {NEW_FLOWS} packets per round, each of a flow never seen before in the run (source address and port changed), each in a test run of its own, as a flood of new flows arrives: the tables they touch (conntrack, verdict caches) are cold, and once `FLOWS_NEW` is full, each new flow takes the slot of another; and *every packet a new flow the policy denies* (to an address no rule accepts), the same flood towards a denied destination, on a gateway whose flow tables are otherwise empty (flushed before each measurement, so conntrack's `FLOW_SEEN` entries are idle as they are where few flows live).\n\nThe first row is the datapath as deployed. For the same packet, a known flow: its verdict comes from the per-flow cache (the addresses, ports and protocol read straight from the headers, then this CPU's own verdict cache: an array read, no hashing). For new flows: both verdict-cache levels looked up and missed, the full classification, the conntrack insert. The second row is a full classification with the verdict cache off (the path, conntrack, every chain), what the first packet of a flow pays; each variant below it removes one part of that work with the datapath's benchmark-only flags, and *cost* is what the part adds (full − variant); the mirror row, the `FLOW_SEEN` row, the address-maps row and the host-tables row turn a shortcut off instead (the first takes the packet's path from a FIB lookup rather than the mirror; the address-maps row looks up the host map and the trie of every address dimension, where the chain's description says which can answer: here a destination of hosts alone, whose trie a denied destination no longer walks; the host-tables row asks the host map, a hash, for every host, where the one-line host table (`HOST_LINES`) finds an IPv4 host of a chain of at most 64 rules in one cache line), so their cost is negative where the shortcut saves time (a packet whose entry says no live flow can have it skips both flow tables; an accepted one looks them up at its commit, a denied one never). The limits are what no tc datapath can beat; in the new-flow column they also show what a test run of one packet costs by itself (its timer). Medians of {} interleaved rounds.\n\n| program | same packet ns/pkt | cost of the part | ratio to full | every packet a new flow ns/pkt | cost of the part | ratio to full | every packet a new denied flow ns/pkt | cost of the part | ratio to full |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n", rounds()));
    // The variants' rows: after the two full rows, before the limits (then the kernel-table rows).
    let variants_end = parts
        .iter()
        .position(|p| p.what.starts_with("limit:"))
        .unwrap_or(parts.len());
    for (i, p) in parts.iter().enumerate() {
        let cost = |full: f64, ns: f64| {
            if (2..variants_end).contains(&i) {
                format!("{:.0}", full - ns)
            } else {
                "–".into()
            }
        };
        md.push_str(&format!(
            "| {}{} | {:.1} | {} | {:.2} | {:.1} | {} | {:.2} | {:.1} | {} | {:.2} |\n",
            p.what,
            if p.ok { "" } else { " (unexpected verdict)" },
            p.ns,
            cost(full, p.ns),
            p.ns / full,
            p.new_ns,
            cost(full_new, p.new_ns),
            p.new_ns / full_new,
            p.denied_ns,
            cost(full_denied, p.denied_ns),
            p.denied_ns / full_denied
        ));
    }
    // The goal: a first packet (the full classification) at most 4× the datapath's
    // own parse-only cost (issue "the eBPF datapath never slower than nftables on a real
    // gateway's traffic"); and what the mirror saves, the change this row set measures.
    let by = |what: &str| parts.iter().find(|p| p.what.trim_start().starts_with(what));
    if let (Some(parse), Some(fib)) = (by("parse only"), by("the FIB lookup instead")) {
        let r = full / parse.ns;
        md.push_str(&format!(
            "\nGoal (issue \"the eBPF datapath never slower than nftables on a real gateway's traffic\"): the first packet's full classification at most 4× parse only: {r:.2}× ({}). The local-address mirror against the FIB lookup it replaces: a first packet {:.2}× faster, a new allowed flow {:.2}×, a new denied flow {:.2}×.\n",
            if r <= 4.0 { "meets" } else { "misses" },
            fib.ns / full,
            fib.new_ns / full_new,
            fib.denied_ns / full_denied
        ));
    }
    // Reading the kernel's table (`--bpf-conntrack kernel`): what the sweep's vouch saves.
    if let (Some(k), Some(asked)) = (
        by("classifier as deployed, reading the kernel's table"),
        by("the kernel asked for every packet"),
    ) {
        md.push_str(&format!(
            "
The last two rows load the datapath reading the kernel's connection table for IPv4 TCP and UDP (`--bpf-conntrack kernel`), its conntrack lookup the `bpf_skb_ct_lookup` kfunc, in the same namespace: as deployed (the agent's sweep vouching that every connection the kernel holds is stamped in `FLOW_SEEN`, so a packet whose entry is idle is new without asking the kernel), and without the vouch (the kernel asked for every packet, as before the sweep). Their same-packet column does not describe a gateway: BPF_PROG_TEST_RUN passes no packet on to netfilter, so the kernel never holds the flow, and each repeat is the first packet of a flow that the kernel is asked about (on a gateway the kernel holds it after its first packet, and its next ones are served from the verdict cache). The vouch makes a new denied flow {:.2}× as fast ({:.0} against {:.0} ns/pkt), a new allowed flow {:.2}×; against the datapath's own tables (first row): {:.2}× the own tables' cost for a new denied flow, {:.2}× for a new allowed one.\n",
            asked.denied_ns / k.denied_ns,
            k.denied_ns,
            asked.denied_ns,
            asked.new_ns / k.new_ns,
            k.denied_ns / parts[0].denied_ns,
            k.new_ns / parts[0].new_ns,
        ));
    }
    md
}
