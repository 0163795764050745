//! `peerwall lab`: a Liqo-shaped provider cluster in network namespaces on this machine.
//!
//! Three consumer clusters (A: 10.10.0.0/16, B: 10.30.0.0/16, and C with the provider's own
//! 10.20.0.0/16, which Liqo remaps to 10.71.0.0/16 here), each reaching the provider through
//! its own gateway namespace over a REAL WireGuard tunnel (`wireguard-go`; `liqo-tunnel` on the
//! gateway side). Each gateway reaches the provider node through a Geneve-named veth
//! (`liqo.<10 chars>`) and routes by input interface as Liqo's RouteConfigurations do. The
//! node hosts pods offloaded by A (10.20.1.0/24), by B (10.20.2.0/24), by C (10.20.4.0/24)
//! and local provider pods (10.20.3.0/24); one provider pod runs on C (consumer protection).
//!
//! NAT as Liqo does it: C's gateway holds Liqo's remapping table (DNAT 10.71.0.0/16 →
//! 10.20.0.0/16 from the nodes, SNAT of what comes from C's tunnel; the `liqo` module), a table peerwall
//! does not own. The agent reads that object (`--observe`) without applying it, and the
//! controller lists the provider pod on C by the address its packets carry through the tunnel.
//!
//! Each gateway runs `peerwall agent --source dir:...`
//! on the controller's own output: the lab describes its cluster (tenant namespaces, offloaded
//! namespaces, pods) as the controller sees it ([`lab_world`]) and writes what
//! [`protection::sets`] and [`protection::gateway_object`] make of it — default deny from the
//! consumer's tunnels, the consumer's offloaded pods allowed, replies pass — plus the
//! NetworkPolicy tier the controller derives from the provider's own NetworkPolicies
//! ([`lab_cluster`], [`controller_tier`]). No hand-written policy: what the lab enforces is
//! what `peerwall controller` would publish.
//!
//! The lab probes every pair with ICMP, a TCP connect and a UDP exchange, prints the matrix
//! (as the thesis's test scripts do), holds every probe to the reference evaluator's verdict
//! on the gateway's compiled policy, offloads one more pod and times how long until it is
//! reachable. Everything is removed on exit, on failure and on
//! Ctrl-C, unless `--keep`.

// size: the lab's steps (node, tunnels, agents, the matrix, the live offload) in the order they
// run; infrastructure, cluster data and probes are in the modules beside it.
mod admin;
mod cluster;
mod consumers;
mod infra;
mod liqo;
mod matrix;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use peerwall_backend_bpf::loader;
use peerwall_netns::NetNs;

use crate::protection;

use cluster::{
    consumers, gateway_policy, Consumer, CACHE_POD, LOCAL_POD, NEW_POD, OPENED_POD, PROVIDER_CIDR,
    UNOPENED_POD,
};
pub use cluster::{
    controller_policy, controller_slices, controller_tier, lab_cluster, lab_protection_policies,
    lab_world, LAB_PROTECTION_POLICIES,
};
use infra::{in_ns, undo_items, wg_keys, Lab, Registry, Undo};
pub use matrix::Probes;
use matrix::{probe, Pair};

/// Result of one backend's run.
#[derive(Debug)]
pub struct LabRun {
    /// Backend.
    pub backend: &'static str,
    /// `[from] -> [to] || src -> dst` rows: what the probes reached, what was expected.
    pub rows: Vec<(String, Probes, Probes)>,
    /// Milliseconds from offloading one more pod to its first successful ping.
    pub new_pod_ms: Option<f64>,
}

impl LabRun {
    /// One line: matrix as expected or not, and the live offload's delay.
    fn print_summary(&self) {
        println!(
            "{}: matrix equals the expected matrix (protection and NetworkPolicies): {}; new pod reachable after {}",
            self.backend,
            if self.as_expected() { "yes" } else { "NO" },
            self.new_pod_ms
                .map_or("never".to_string(), |ms| format!("{ms:.0} ms"))
        );
    }

    /// Whether every probe behaved as the reference evaluator says.
    pub fn as_expected(&self) -> bool {
        self.rows.iter().all(|(_, got, want)| got == want)
    }
}

/// A gateway as the lab runs it: its namespace, the agent's policy directory, its bpf pins.
type Gateway = (NetNs, PathBuf, PathBuf);

/// One backend's run: build the provider node, connect every consumer through a gateway
/// running the agent, judge the reachability matrix, then offload one more pod live.
fn run_backend(backend: &'static str, bin: &Path, keep: bool, reg: &Registry) -> Result<LabRun> {
    let tag = format!("{}-{backend}", std::process::id());
    let mut lab = Lab {
        reg: reg.clone(),
        bin: bin.to_path_buf(),
        children: Vec::new(),
        keep,
        tag: tag.clone(),
    };
    let work = std::env::temp_dir().join(format!("pwlab-{tag}"));
    std::fs::create_dir_all(&work)?;
    if let Ok(mut g) = reg.lock() {
        g.push(Undo::Dir(work.clone()));
    }
    let cs = consumers();
    let node = provider_node(&mut lab, &cs)?;
    let mut consumer_ns = Vec::new();
    let mut gateways: Vec<Gateway> = Vec::new();
    for c in &cs {
        let (cns, gw) = connect(&mut lab, c, &node, &work)?;
        let (dir, pins) = start_agent(&mut lab, backend, &work, c, &gw)?;
        consumer_ns.push(cns);
        gateways.push((gw, dir, pins));
    }
    wait_enforced(backend, &cs, &gateways)?;
    wait_tunnels(&cs, &consumer_ns)?;
    let pairs = pairs(&cs, &consumer_ns, &node)?;
    let rows = judge(backend, &pairs);
    if backend == "bpf" {
        print_views(&lab.bin, &cs, &gateways);
    }
    let new_pod_ms = offload_new_pod(&mut lab, &node, &cs[0], &consumer_ns[0], &gateways[0].1)?;
    if keep {
        let mut names = vec![node.persist()];
        names.extend(consumer_ns.into_iter().map(NetNs::persist));
        names.extend(gateways.into_iter().map(|(g, _, _)| g.persist()));
        eprintln!("kept namespaces: {}", names.join(" "));
    }
    drop(lab);
    Ok(LabRun {
        backend,
        rows,
        new_pod_ms,
    })
}

/// The provider node: its local pod and every pod the consumers offloaded, each answering.
fn provider_node(lab: &mut Lab, cs: &[Consumer]) -> Result<NetNs> {
    let node = lab.netns("node")?;
    node.ip(&["link", "set", "lo", "up"])?;
    let mut pods: Vec<&str> = vec![LOCAL_POD, CACHE_POD, OPENED_POD, UNOPENED_POD];
    for c in cs {
        pods.extend(c.offloaded.iter().map(String::as_str));
    }
    for ip in &pods {
        node.ip(&["addr", "add", &format!("{ip}/32"), "dev", "lo"])?;
        lab.listeners(&node, ip)?;
    }
    Ok(node)
}

// size: plumbing: one `ip` command per link, address and route, in the order Liqo sets them up.
/// A consumer cluster and its gateway: the underlay, the WireGuard tunnel over it
/// (`liqo-tunnel` on the gateway side), the consumer's pods, and the Geneve-named link from
/// the gateway to the provider node. Returns (consumer, gateway) namespaces.
fn connect(lab: &mut Lab, c: &Consumer, node: &NetNs, work: &Path) -> Result<(NetNs, NetNs)> {
    let cns = lab.netns(&format!("c{}", c.name))?;
    let gw = lab.netns(&format!("gw{}", c.name))?;
    gw.sysctl("net.ipv4.ip_forward", "1")?;
    gw.sysctl("net.ipv4.conf.all.rp_filter", "0")?;
    // Underlay between the consumer's gateway and ours, and the tunnel over it.
    cns.veth("underlay", &gw, "underlay")?;
    cns.ip(&[
        "addr",
        "add",
        &format!("{}/30", c.underlay.0),
        "dev",
        "underlay",
    ])?;
    gw.ip(&[
        "addr",
        "add",
        &format!("{}/30", c.underlay.1),
        "dev",
        "underlay",
    ])?;
    let cdev = format!("wg-{}", c.name);
    let (cpriv, cpub) = wg_keys()?;
    let (gpriv, gpub) = wg_keys()?;
    let (ck, gk) = (
        work.join(format!("{}.c.key", c.name)),
        work.join(format!("{}.g.key", c.name)),
    );
    std::fs::write(&ck, cpriv)?;
    std::fs::write(&gk, gpriv)?;
    lab.tunnel_end(
        &cns,
        &cdev,
        &ck,
        &gpub,
        &format!("{}:51820", c.underlay.1),
        PROVIDER_CIDR,
    )?;
    // The gateway's end takes any source from its peer, as Liqo configures it
    // (`pkg/gateway/tunnel/wireguard/device.go`: AllowedIPs 0.0.0.0/0): telling the peer's
    // own addresses from spoofed ones is the firewall's job.
    lab.tunnel_end(
        &gw,
        "liqo-tunnel",
        &gk,
        &cpub,
        &format!("{}:51820", c.underlay.0),
        "0.0.0.0/0",
    )?;
    for p in c
        .pods
        .iter()
        .chain(&c.hosts_ours)
        .chain(&c.spoofed)
        .chain(&c.poses_as)
    {
        cns.ip(&["addr", "add", &format!("{p}/32"), "dev", &cdev])?;
    }
    cns.ip(&["link", "set", &cdev, "up"])?;
    cns.ip(&["route", "add", PROVIDER_CIDR, "dev", &cdev])?;
    gw.ip(&["link", "set", "liqo-tunnel", "up"])?;
    // Geneve-named veth towards the provider node.
    let node_end = format!("gw{}0", c.name);
    gw.veth(c.geneve, node, &node_end)?;
    gw.ip(&["addr", "add", &format!("{}/32", c.link.0), "dev", c.geneve])?;
    node.ip(&["addr", "add", &format!("{}/32", c.link.1), "dev", &node_end])?;
    gw.ip(&["route", "add", c.link.1, "dev", c.geneve])?;
    // Routing by input interface, as Liqo's RouteConfigurations do (the consumer's CIDR may
    // be the provider's own): from a node, the peer's CIDR goes to the tunnel (`<cfg>-gw-ext`:
    // rule iif <geneve> to <remote CIDR>, `external-network/route/k8s.go`); from the tunnel,
    // everything goes to the nodes (`<node>-gw-node`: rule iif liqo-tunnel,
    // `internal-network/route/pod_k8s.go`; one node here, so one prefix for its pods).
    gw.ip(&[
        "rule", "add", "iif", c.geneve, "to", c.cidr, "lookup", "100",
    ])?;
    gw.ip(&["route", "add", c.cidr, "dev", "liqo-tunnel", "table", "100"])?;
    // A source outside the peer's CIDR, routed back through its tunnel like its own (so that
    // only the firewall tells them apart).
    if let Some(sp) = c.spoofed {
        gw.ip(&["rule", "add", "iif", c.geneve, "to", sp, "lookup", "100"])?;
        gw.ip(&["route", "add", sp, "dev", "liqo-tunnel", "table", "100"])?;
    }
    gw.ip(&["rule", "add", "iif", "liqo-tunnel", "lookup", "101"])?;
    gw.ip(&[
        "route",
        "add",
        PROVIDER_CIDR,
        "via",
        c.link.1,
        "dev",
        c.geneve,
        "table",
        "101",
    ])?;
    node.ip(&["route", "add", c.link.0, "dev", &node_end])?;
    if let Some(sp) = c.spoofed {
        node.ip(&["route", "add", sp, "via", c.link.0, "dev", &node_end])?;
    }
    node.ip(&[
        "route",
        "add",
        c.seen_cidr(),
        "via",
        c.link.0,
        "dev",
        &node_end,
    ])?;
    // The remapping Liqo keeps in force in this gateway when the CIDRs overlap.
    if let Some(obj) = c.remap_object() {
        liqo::apply_as_liqo(&gw, &obj)?;
    }
    for p in c.pods.iter().chain(&c.hosts_ours) {
        lab.listeners(&cns, p)?;
    }
    Ok((cns, gw))
}

/// The agent in the gateway, on the policy the controller generates for the lab's cluster.
/// Returns its policy directory and pin directory.
fn start_agent(
    lab: &mut Lab,
    backend: &str,
    work: &Path,
    c: &Consumer,
    gw: &NetNs,
) -> Result<(PathBuf, PathBuf)> {
    let tag = lab.tag.clone();
    // The agent, with the policy the controller generates for this world.
    let dir = work.join(format!("policies-{}", c.name));
    std::fs::create_dir_all(&dir)?;
    std::fs::write(
        dir.join("provider-protection.yaml"),
        controller_policy(&lab_world(&[]), c.name)?,
    )?;
    for (slice, text) in controller_slices(&lab_world(&[]), c.name, &[])? {
        std::fs::write(dir.join(format!("{}.yaml", slice.name)), text)?;
    }
    // The NetworkPolicy tier the controller publishes for this peer.
    std::fs::write(
        dir.join("networkpolicy.yaml"),
        serde_json::to_string_pretty(&controller_tier(&lab_world(&[]), &lab_cluster()?, c.name)?)?,
    )?;
    // Liqo's objects in force in this gateway, which the agent reads (never applies).
    let observed = work.join(format!("liqo-{}", c.name));
    std::fs::create_dir_all(&observed)?;
    if let Some(obj) = c.remap_object() {
        std::fs::write(
            observed.join("remap-podcidr.yaml"),
            serde_json::to_string_pretty(&obj)?,
        )?;
    }
    let pins = PathBuf::from(format!("/sys/fs/bpf/pwlab-{tag}-{}", c.name));
    if backend == "bpf" {
        peerwall_backend_select::ensure_bpffs()?;
        if let Ok(mut g) = lab.reg.lock() {
            g.push(Undo::Pins(pins.clone()));
        }
    }
    let mut agent = Command::new("nsenter");
    agent
        .arg(format!("--net=/run/netns/{}", gw.name()))
        .arg(&lab.bin)
        .args(["agent", "--source"])
        .arg(format!("dir:{}", dir.display()))
        .arg("--observe")
        .arg(format!("dir:{}", observed.display()))
        .args(["--backend", backend, "--interval-ms", "20", "--pin-dir"])
        .arg(&pins);
    lab.spawn(agent)?;
    Ok((dir, pins))
}

/// Wait until every agent enforces its policy.
fn wait_enforced(backend: &str, cs: &[Consumer], gateways: &[Gateway]) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    for (c, (gw, _, pins)) in cs.iter().zip(gateways) {
        loop {
            let ready = if backend == "bpf" {
                // Both sides: the tunnel and the Geneve interface towards the node.
                let links = loader::attached_in(pins);
                links.iter().any(|l| l == "tc:liqo-tunnel")
                    && links.iter().any(|l| l.starts_with("tc:liqo."))
            } else {
                in_ns(
                    gw.name(),
                    &[
                        "nft",
                        "list",
                        "table",
                        "inet",
                        &protection::table_name(c.name),
                    ],
                    None,
                )
                .is_some()
            };
            if ready {
                break;
            }
            if Instant::now() > deadline {
                bail!("the agent in gateway {} did not apply its policy", c.name);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    Ok(())
}

/// Wait for the WireGuard handshakes: each consumer reaches its own offloaded pod.
fn wait_tunnels(cs: &[Consumer], consumer_ns: &[NetNs]) -> Result<()> {
    for (c, cns) in cs.iter().zip(consumer_ns) {
        let target = &c.offloaded[0];
        let mut up = false;
        for _ in 0..30 {
            if in_ns(
                cns.name(),
                &["ping", "-c", "1", "-W", "0.5", "-I", c.pods[0], target],
                None,
            )
            .is_some()
            {
                up = true;
                break;
            }
        }
        if !up {
            bail!(
                "consumer {} cannot reach its own offloaded pod {target}",
                c.name
            );
        }
    }
    Ok(())
}

// size: data: the matrix's rows, one stanza per kind of pair.
/// Every pair the matrix probes, with what the reference evaluator expects of each probe on
/// the policy the controller generates for the gateway it crosses. `protected`: what provider
/// and consumer protection alone allow; a NetworkPolicy only ever takes away from it (the
/// tiers intersect), which is checked here too.
fn pairs(cs: &[Consumer], consumer_ns: &[NetNs], node: &NetNs) -> Result<Vec<Pair>> {
    let mut pairs = Vec::new();
    for (c, cns) in cs.iter().zip(consumer_ns) {
        let policy = gateway_policy(c)?;
        let mut add = |from: String,
                       ns: &str,
                       src: &str,
                       to: String,
                       dst: String,
                       inbound: bool,
                       protected: bool|
         -> Result<()> {
            let want = Probes::judged(&policy, src, &dst, inbound, c.geneve)?;
            if !protected && (want.icmp || want.tcp || want.udp) {
                bail!("[{from}] -> [{to}]: protection refuses it, yet the gateway's policy lets {} through", want.marks());
            }
            pairs.push(Pair {
                from,
                ns: ns.to_string(),
                src: src.to_string(),
                to,
                dst,
                want,
            });
            Ok(())
        };
        for src in c.pods {
            let from = format!("consumer {} pod {src}", c.name);
            for d in cs {
                for dst in &d.offloaded {
                    add(
                        from.clone(),
                        cns.name(),
                        src,
                        format!("provider offloaded-by-{}", d.name),
                        dst.clone(),
                        true,
                        c.name == d.name,
                    )?;
                }
            }
            add(
                from.clone(),
                cns.name(),
                src,
                "provider local".into(),
                LOCAL_POD.into(),
                true,
                false,
            )?;
            // A provider service a ProtectionPolicy opens (to consumer a only), and the pod
            // beside it that none opens.
            add(
                from.clone(),
                cns.name(),
                src,
                "provider monitoring/prometheus (opened to a)".into(),
                OPENED_POD.into(),
                true,
                c.name == "a",
            )?;
            add(
                from,
                cns.name(),
                src,
                "provider monitoring/grafana".into(),
                UNOPENED_POD.into(),
                true,
                false,
            )?;
        }
        // Anti-spoofing: a source outside the peer's CIDRs, towards its own offloaded pod.
        if let Some(sp) = c.spoofed {
            add(
                format!("consumer {} spoofed source {sp}", c.name),
                cns.name(),
                sp,
                format!("provider offloaded-by-{}", c.name),
                c.offloaded[0].clone(),
                true,
                false,
            )?;
        }
        // Posing: a pod of the consumer sending from a local pod's address (in its own CIDR
        // where it overlaps ours), towards its own offloaded pod whose NetworkPolicy admits
        // that local pod by label: what comes through the tunnel is never a local pod.
        if let Some(posed) = c.poses_as {
            add(
                format!(
                    "consumer {} pod posing as provider local/twin {posed}",
                    c.name
                ),
                cns.name(),
                posed,
                format!("provider offloaded-by-{}", c.name),
                c.offloaded[0].clone(),
                true,
                true,
            )?;
        }
        // Connections the provider opens get their replies back through the tunnel; the
        // provider addresses a remapped consumer in the remapped CIDR.
        add(
            "provider local".into(),
            node.name(),
            LOCAL_POD,
            format!("consumer {} pod", c.name),
            c.seen(c.pods[0])?,
            false,
            true,
        )?;
        // Call home: every consumer's offloaded pod towards this consumer's pod, through this
        // gateway. The NetworkPolicy the controller keeps in the offloaded namespaces (in the
        // tier, as every NetworkPolicy of the cluster) lets a pod reach its own consumer only.
        for d in cs {
            add(
                format!("provider offloaded-by-{}", d.name),
                node.name(),
                &d.offloaded[0],
                format!("consumer {} pod (call home)", c.name),
                c.seen(c.pods[0])?,
                false,
                c.name == d.name,
            )?;
        }
        // Consumer protection: the provider's own pod running on this consumer reaches home,
        // and home reaches it.
        if let Some(ours) = c.hosts_ours {
            add(
                format!("provider pod on consumer {}", c.name),
                cns.name(),
                ours,
                "provider local".into(),
                LOCAL_POD.into(),
                true,
                true,
            )?;
            add(
                "provider local".into(),
                node.name(),
                LOCAL_POD,
                format!("provider pod on consumer {}", c.name),
                c.seen(ours)?,
                false,
                true,
            )?;
            // A pod of its namespace no NetworkPolicy isolates: the Baseline tier decides.
            add(
                format!("provider pod on consumer {}", c.name),
                cns.name(),
                ours,
                "provider local/cache".into(),
                CACHE_POD.into(),
                true,
                true,
            )?;
        }
    }
    Ok(pairs)
}

/// Probe every pair (in parallel), print the matrix; rows of (pair, reached, expected).
fn judge(backend: &str, pairs: &[Pair]) -> Vec<(String, Probes, Probes)> {
    let results: Vec<Probes> = std::thread::scope(|s| {
        let handles: Vec<_> = pairs.iter().map(|p| s.spawn(move || probe(p))).collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or(Probes {
                    icmp: false,
                    tcp: false,
                    udp: false,
                })
            })
            .collect()
    });
    let mut rows = Vec::new();
    println!(
        "\n== {backend}: reachability (ICMP TCP/8080 UDP/9090 per pair: + reached, - refused)"
    );
    for (p, r) in pairs.iter().zip(&results) {
        let line = format!(
            "{:<5} {} | [{}] -> [{}] || {} -> {}",
            r.word(),
            r.marks(),
            p.from,
            p.to,
            p.src,
            p.dst
        );
        println!(
            "{line}{}",
            if *r == p.want {
                String::new()
            } else {
                format!("   <-- UNEXPECTED (expected {})", p.want.marks())
            }
        );
        rows.push((
            format!("[{}] -> [{}] || {} -> {}", p.from, p.to, p.src, p.dst),
            *r,
            p.want,
        ));
    }
    rows
}

/// What `peerwall inspect` shows of the destination rewrites pinned in remapped gateways.
fn print_views(bin: &Path, cs: &[Consumer], gateways: &[Gateway]) {
    for (c, (_, _, pins)) in cs.iter().zip(gateways) {
        if c.remapped.is_none() {
            continue;
        }
        let out = Command::new(bin)
            .arg("inspect")
            .arg("--pin-dir")
            .arg(pins)
            .output();
        if let Ok(o) = out {
            for line in String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.starts_with("view "))
            {
                println!("gateway {} datapath {line}", c.name);
            }
        }
    }
}

/// Live change: consumer `a` offloads one more pod; the time until it answers through the
/// tunnel (the agent's poll plus one set element), or `None` after 10 s.
fn offload_new_pod(
    lab: &mut Lab,
    node: &NetNs,
    a: &Consumer,
    cns: &NetNs,
    dir_a: &Path,
) -> Result<Option<f64>> {
    node.ip(&["addr", "add", &format!("{NEW_POD}/32"), "dev", "lo"])?;
    lab.listeners(node, NEW_POD)?;
    // The controller rewrites the one slice the new pod joins.
    let current: Vec<protection::Slice> = controller_slices(&lab_world(&[]), a.name, &[])?
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    let changed = controller_slices(&lab_world(&[(a.name, NEW_POD)]), a.name, &current)?;
    let (slice, text) = match changed.as_slice() {
        [one] => one.clone(),
        other => bail!("the new pod should change one slice, not {}", other.len()),
    };
    let tmp = dir_a.join(".next.tmp");
    std::fs::write(&tmp, text)?;
    let started = Instant::now();
    std::fs::rename(&tmp, dir_a.join(format!("{}.yaml", slice.name)))?;
    let mut new_pod_ms = None;
    while started.elapsed() < Duration::from_secs(10) {
        // A short reply timeout bounds the measurement error (plus the agent's 20 ms poll).
        if in_ns(
            cns.name(),
            &["ping", "-c", "1", "-W", "0.02", "-I", a.pods[0], NEW_POD],
            None,
        )
        .is_some()
        {
            new_pod_ms = Some(started.elapsed().as_secs_f64() * 1e3);
            break;
        }
    }
    match new_pod_ms {
        Some(ms) => println!("offloaded {NEW_POD} for consumer a: reachable after {ms:.0} ms"),
        None => println!("offloaded {NEW_POD} for consumer a: NOT reachable within 10 s"),
    }
    Ok(new_pod_ms)
}

/// Run the lab for the given backends; true when every matrix is the expected one, the
/// backends agree and the new pod became reachable.
pub fn run(backends: &[&'static str], bin: &Path, keep: bool) -> Result<bool> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the lab builds network namespaces: run it as root");
    }
    let reg: Registry = Arc::new(Mutex::new(Vec::new()));
    let r2 = reg.clone();
    let _ = ctrlc::set_handler(move || {
        eprintln!("\ninterrupted: removing the lab");
        // Keep the lock until exit: nothing else gets started or registered.
        if let Ok(mut g) = r2.lock() {
            undo_items(&mut g);
            std::process::exit(130);
        }
        std::process::exit(130);
    });
    let mut runs = Vec::new();
    for b in backends {
        runs.push(run_backend(b, bin, keep, &reg)?);
    }
    let expected = runs.iter().all(LabRun::as_expected);
    let live = runs.iter().all(|r| r.new_pod_ms.is_some());
    println!();
    if runs.len() > 1 {
        let agree = runs.windows(2).all(|w| {
            w[0].rows
                .iter()
                .map(|r| r.1)
                .eq(w[1].rows.iter().map(|r| r.1))
        });
        println!("backends agree: {}", if agree { "yes" } else { "NO" });
        runs.iter().for_each(LabRun::print_summary);
        return Ok(agree && expected && live);
    }
    runs.iter().for_each(LabRun::print_summary);
    Ok(expected && live)
}
