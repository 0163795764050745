//! `peerwall lab`: a Liqo-shaped provider cluster in network namespaces on this machine.
//!
//! Two consumer clusters (A: 10.10.0.0/16, B: 10.30.0.0/16), each reaching the provider through
//! its own gateway namespace over a REAL WireGuard tunnel (`wireguard-go`; `liqo-tunnel` on the
//! gateway side). Each gateway reaches the provider node through a Geneve-named veth
//! (`liqo.<10 chars>`). The node hosts pods offloaded by A (10.20.1.0/24), by B (10.20.2.0/24)
//! and local provider pods (10.20.3.0/24). Each gateway runs `peerwall agent --source dir:...`
//! on the controller's own output: the lab describes its cluster (tenant namespaces, offloaded
//! namespaces, pods) as the controller sees it ([`lab_world`]) and writes what
//! [`protection::sets`] and [`protection::gateway_object`] make of it — default deny from the
//! consumer's tunnels, the consumer's offloaded pods allowed, replies pass. No hand-written
//! policy: what the lab enforces is what `peerwall controller` would publish.
//!
//! The lab probes every pair with ICMP, a TCP connect and a UDP exchange, prints the matrix
//! (as the thesis's test scripts do), compares it with the expected one, offloads one more pod
//! and times how long until it is reachable. Everything is removed on exit, on failure and on
//! Ctrl-C, unless `--keep`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::protection;
use peerwall_backend::netns::NetNs;

/// Something the lab must undo.
#[derive(Debug)]
enum Undo {
    Netns(String),
    Pid(u32),
    Dir(PathBuf),
    Pins(PathBuf),
}

type Registry = Arc<Mutex<Vec<Undo>>>;

fn undo_all(reg: &Registry) {
    if let Ok(mut g) = reg.lock() {
        undo_items(&mut g);
    }
}

/// Undo everything registered (the caller holds the registry's lock, so nothing new can be
/// started meanwhile).
fn undo_items(registered: &mut Vec<Undo>) {
    let items: Vec<Undo> = registered.drain(..).rev().collect();
    // Processes first (agents, wireguard-go, listeners), then namespaces and files.
    for u in &items {
        if let Undo::Pid(pid) = u {
            // SAFETY: plain kill(2) on the process group of a child we started.
            unsafe { libc::kill(-(*pid as i32), libc::SIGTERM) };
        }
    }
    std::thread::sleep(Duration::from_millis(200));
    for u in &items {
        match u {
            Undo::Pid(pid) => {
                // SAFETY: as above.
                unsafe { libc::kill(-(*pid as i32), libc::SIGKILL) };
            }
            Undo::Pins(p) => {
                let _ = peerwall_backend_bpf::loader::remove_pins(p);
            }
            Undo::Dir(d) => {
                let _ = std::fs::remove_dir_all(d);
            }
            Undo::Netns(n) => {
                let _ = Command::new("ip")
                    .args(["netns", "del", n])
                    .stderr(Stdio::null())
                    .status();
            }
        }
    }
}

struct Lab {
    reg: Registry,
    bin: PathBuf,
    children: Vec<Child>,
    keep: bool,
    tag: String,
}

impl Drop for Lab {
    fn drop(&mut self) {
        if self.keep {
            eprintln!("--keep: namespaces of lab {} left in place", self.tag);
            return;
        }
        undo_all(&self.reg);
        for c in &mut self.children {
            let _ = c.wait();
        }
    }
}

fn sh(program: &str, args: &[&str]) -> Result<String> {
    let o = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {program}"))?;
    if !o.status.success() {
        bail!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&o.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
}

struct Consumer {
    name: &'static str,
    cidr: &'static str,
    pods: [&'static str; 2],
    underlay: (&'static str, &'static str),
    geneve: &'static str,
    link: (&'static str, &'static str),
    offloaded: Vec<String>,
}

fn consumers() -> Vec<Consumer> {
    vec![
        Consumer {
            name: "a",
            cidr: "10.10.0.0/16",
            pods: ["10.10.1.10", "10.10.1.11"],
            underlay: ("192.168.210.1", "192.168.210.2"),
            geneve: "liqo.a1b2c3d4e5",
            link: ("169.254.10.1", "169.254.10.2"),
            offloaded: vec!["10.20.1.10".into(), "10.20.1.11".into()],
        },
        Consumer {
            name: "b",
            cidr: "10.30.0.0/16",
            pods: ["10.30.1.10", "10.30.1.11"],
            underlay: ("192.168.230.1", "192.168.230.2"),
            geneve: "liqo.f6g7h8i9j0",
            link: ("169.254.30.1", "169.254.30.2"),
            offloaded: vec!["10.20.2.10".into()],
        },
    ]
}

const LOCAL_POD: &str = "10.20.3.10";
const NEW_POD: &str = "10.20.1.12";

/// The provider cluster as the controller sees it: a tenant namespace per consumer, a
/// namespace each consumer offloaded (holding its pods), and the provider's local pods.
/// `extra` adds pods offloaded later, as `(consumer, ip)`.
pub fn lab_world(extra: &[(&str, &str)]) -> protection::World {
    use std::collections::BTreeMap;
    let label = |kv: &[(&str, &str)]| -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    let mut w = protection::World::default();
    let pod = |ns: String, name: String, ip: &str| protection::Pod {
        namespace: ns,
        name,
        ips: ip.parse().into_iter().collect(),
        ..Default::default()
    };
    for c in consumers() {
        w.namespaces.push(protection::Namespace {
            name: format!("liqo-tenant-{}", c.name),
            labels: label(&[
                ("liqo.io/tenant-namespace", "true"),
                ("liqo.io/remote-cluster-id", c.name),
            ]),
        });
        let offloaded_ns = format!("app-{}", c.name);
        w.namespaces.push(protection::Namespace {
            name: offloaded_ns.clone(),
            labels: label(&[("liqo.io/remote-cluster-id", c.name)]),
        });
        let more = extra
            .iter()
            .filter(|(who, _)| *who == c.name)
            .map(|(_, ip)| *ip);
        for (i, ip) in c
            .offloaded
            .iter()
            .map(String::as_str)
            .chain(more)
            .enumerate()
        {
            w.pods
                .push(pod(offloaded_ns.clone(), format!("web-{i}"), ip));
        }
    }
    w.namespaces.push(protection::Namespace {
        name: "local".into(),
        labels: Default::default(),
    });
    w.pods
        .push(pod("local".into(), "local-0".into(), LOCAL_POD));
    w
}

/// What the controller would publish for consumer `name` in `world`, as the agent's file.
pub fn controller_policy(world: &protection::World, name: &str) -> Result<String> {
    let peer = protection::peers(world)
        .into_iter()
        .find(|p| p.id == name)
        .with_context(|| format!("no tenant namespace for consumer {name}"))?;
    let sets = protection::sets(world).remove(name).unwrap_or_default();
    let opts = protection::Options {
        tunnel: protection::DEFAULT_TUNNEL.into(),
        block_leaf_to_leaf: false,
    };
    let doc = protection::gateway_object(&peer, &sets, &opts);
    serde_json::to_string_pretty(&doc).context("encoding the gateway FirewallConfiguration")
}

fn wg_keys() -> Result<(String, String)> {
    let private = sh("wg", &["genkey"])?.trim().to_string();
    let mut c = Command::new("wg")
        .arg("pubkey")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("wg pubkey (apt-get install wireguard-tools)")?;
    c.stdin
        .take()
        .context("wg stdin")?
        .write_all(private.as_bytes())?;
    let public = String::from_utf8(c.wait_with_output()?.stdout)?;
    Ok((private, public.trim().to_string()))
}

impl Lab {
    fn netns(&self, role: &str) -> Result<NetNs> {
        let ns = NetNs::new(&format!("pwlab-{}", role))?;
        if let Ok(mut g) = self.reg.lock() {
            g.push(Undo::Netns(ns.name().to_string()));
        }
        Ok(ns)
    }

    fn spawn(&mut self, mut c: Command) -> Result<()> {
        use std::os::unix::process::CommandExt;
        // Registered under the lock: an interrupt (which takes the lock to clean up, then exits)
        // can never miss a process started concurrently.
        let mut g = self
            .reg
            .lock()
            .map_err(|_| anyhow::anyhow!("lab registry poisoned"))?;
        // Own process group: stopping it stops everything it started (a shell's background
        // wireguard-go, socat's per-connection children).
        let child = c
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {c:?}"))?;
        g.push(Undo::Pid(child.id()));
        drop(g);
        self.children.push(child);
        Ok(())
    }

    /// One end of a WireGuard tunnel: `wireguard-go` plus its configuration, in a private mount
    /// namespace so that its control socket (`/var/run/wireguard/<dev>.sock`, a path shared by
    /// all network namespaces) does not collide with the other gateway's `liqo-tunnel`.
    fn tunnel_end(
        &mut self,
        ns: &NetNs,
        dev: &str,
        key: &Path,
        peer: &str,
        endpoint: &str,
        allowed: &str,
    ) -> Result<()> {
        let script = format!(
            "mkdir -p /var/run/wireguard && mount -t tmpfs tmpfs /var/run/wireguard || exit 1
WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD=1 wireguard-go -f {dev} &
pid=$!
for i in $(seq 200); do [ -S /var/run/wireguard/{dev}.sock ] && break; sleep 0.02; done
wg set {dev} listen-port 51820 private-key {key} peer {peer} endpoint {endpoint} allowed-ips {allowed} || {{ kill $pid; exit 1; }}
wait $pid",
            key = key.display()
        );
        let mut c = Command::new("ip");
        c.args([
            "netns",
            "exec",
            ns.name(),
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            &script,
        ]);
        self.spawn(c)?;
        for _ in 0..250 {
            let configured = in_ns(ns.name(), &["ip", "link", "show", dev], None).is_some();
            if configured {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        bail!("wireguard-go did not create {dev} (apt-get install wireguard-go wireguard-tools)")
    }

    fn listeners(&mut self, ns: &NetNs, ip: &str) -> Result<()> {
        let mut tcp = Command::new("ip");
        tcp.args([
            "netns",
            "exec",
            ns.name(),
            "socat",
            &format!("TCP4-LISTEN:8080,bind={ip},reuseaddr,fork"),
            "SYSTEM:echo ok",
        ]);
        self.spawn(tcp)?;
        let mut udp = Command::new("ip");
        udp.args([
            "netns",
            "exec",
            ns.name(),
            "socat",
            &format!("UDP4-RECVFROM:9090,bind={ip},fork"),
            // Echo: no program to start per datagram.
            "PIPE",
        ]);
        self.spawn(udp)
    }
}

/// One probed pair.
#[derive(Clone, Debug)]
struct Pair {
    from: String,
    ns: String,
    src: String,
    to: String,
    dst: String,
    expect: bool,
}

/// Outcome of the three probes of a pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Probes {
    icmp: bool,
    tcp: bool,
    udp: bool,
}

impl Probes {
    fn word(self) -> &'static str {
        match (self.icmp, self.tcp, self.udp) {
            (true, true, true) => "OK",
            (false, false, false) => "FAIL",
            _ => "MIXED",
        }
    }
}

fn in_ns(ns: &str, args: &[&str], stdin: Option<&str>) -> Option<String> {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns]).args(args);
    c.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::null());
    let mut child = c.spawn().ok()?;
    if let (Some(input), Some(mut p)) = (stdin, child.stdin.take()) {
        let _ = p.write_all(input.as_bytes());
    }
    let o = child.wait_with_output().ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).into_owned())
}

fn probe(p: &Pair) -> Probes {
    let icmp = in_ns(
        &p.ns,
        &["ping", "-c", "1", "-W", "0.7", "-I", &p.src, &p.dst],
        None,
    )
    .is_some();
    let tcp = in_ns(
        &p.ns,
        &[
            "timeout",
            "3",
            "socat",
            "-T",
            "1",
            "-",
            &format!("TCP4:{}:8080,bind={},connect-timeout=0.7", p.dst, p.src),
        ],
        None,
    )
    .is_some_and(|o| o.contains("ok"));
    let udp = in_ns(
        &p.ns,
        &[
            "timeout",
            "3",
            "socat",
            "-T",
            "1.5",
            "-",
            &format!("UDP4:{}:9090,bind={}", p.dst, p.src),
        ],
        Some("peerwall-lab\n"),
    )
    .is_some_and(|o| o.contains("peerwall-lab"));
    Probes { icmp, tcp, udp }
}

/// Result of one backend's run.
#[derive(Debug)]
pub struct LabRun {
    /// Backend.
    pub backend: &'static str,
    /// `OK | [from] -> [to] || src -> dst` rows.
    pub rows: Vec<(String, bool, bool)>,
    /// Milliseconds from offloading one more pod to its first successful ping.
    pub new_pod_ms: Option<f64>,
}

impl LabRun {
    /// Whether every pair behaved as provider protection says.
    pub fn as_expected(&self) -> bool {
        self.rows.iter().all(|(_, got, want)| got == want)
    }
}

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
    let node = lab.netns("node")?;
    node.ip(&["link", "set", "lo", "up"])?;
    let mut pods: Vec<&str> = vec![LOCAL_POD];
    let cs = consumers();
    for c in &cs {
        pods.extend(c.offloaded.iter().map(String::as_str));
    }
    for ip in &pods {
        node.ip(&["addr", "add", &format!("{ip}/32"), "dev", "lo"])?;
        lab.listeners(&node, ip)?;
    }
    let mut consumer_ns = Vec::new();
    let mut gateways = Vec::new();
    for c in &cs {
        let cns = lab.netns(&format!("c{}", c.name))?;
        let gw = lab.netns(&format!("gw{}", c.name))?;
        gw.sysctl("net.ipv4.ip_forward", "1")?;
        gw.sysctl("net.ipv4.conf.all.rp_filter", "0")?;
        // Underlay between the consumer's gateway and ours, and the tunnel over it.
        cns.ip(&[
            "link",
            "add",
            "underlay",
            "type",
            "veth",
            "peer",
            "name",
            "underlay",
            "netns",
            gw.name(),
        ])?;
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
        cns.ip(&["link", "set", "underlay", "up"])?;
        gw.ip(&["link", "set", "underlay", "up"])?;
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
            "10.20.0.0/16",
        )?;
        lab.tunnel_end(
            &gw,
            "liqo-tunnel",
            &gk,
            &cpub,
            &format!("{}:51820", c.underlay.0),
            c.cidr,
        )?;
        for p in c.pods {
            cns.ip(&["addr", "add", &format!("{p}/32"), "dev", &cdev])?;
        }
        cns.ip(&["link", "set", &cdev, "up"])?;
        cns.ip(&["route", "add", "10.20.0.0/16", "dev", &cdev])?;
        gw.ip(&["link", "set", "liqo-tunnel", "up"])?;
        gw.ip(&["route", "add", c.cidr, "dev", "liqo-tunnel"])?;
        // Geneve-named veth towards the provider node.
        let node_end = format!("gw{}0", c.name);
        gw.ip(&[
            "link",
            "add",
            c.geneve,
            "type",
            "veth",
            "peer",
            "name",
            &node_end,
            "netns",
            node.name(),
        ])?;
        gw.ip(&["addr", "add", &format!("{}/32", c.link.0), "dev", c.geneve])?;
        node.ip(&["addr", "add", &format!("{}/32", c.link.1), "dev", &node_end])?;
        gw.ip(&["link", "set", c.geneve, "up"])?;
        node.ip(&["link", "set", &node_end, "up"])?;
        gw.ip(&["route", "add", c.link.1, "dev", c.geneve])?;
        gw.ip(&[
            "route",
            "add",
            "10.20.0.0/16",
            "via",
            c.link.1,
            "dev",
            c.geneve,
        ])?;
        node.ip(&["route", "add", c.link.0, "dev", &node_end])?;
        node.ip(&["route", "add", c.cidr, "via", c.link.0, "dev", &node_end])?;
        for p in c.pods {
            lab.listeners(&cns, p)?;
        }
        // The agent, with the policy the controller generates for this world.
        let dir = work.join(format!("policies-{}", c.name));
        std::fs::create_dir_all(&dir)?;
        std::fs::write(
            dir.join("provider-protection.yaml"),
            controller_policy(&lab_world(&[]), c.name)?,
        )?;
        let pins = PathBuf::from(format!("/sys/fs/bpf/pwlab-{tag}-{}", c.name));
        if backend == "bpf" {
            peerwall_backend_bpf::loader::ensure_bpffs()?;
            if let Ok(mut g) = reg.lock() {
                g.push(Undo::Pins(pins.clone()));
            }
        }
        let mut agent = Command::new("nsenter");
        agent
            .arg(format!("--net=/run/netns/{}", gw.name()))
            .arg(&lab.bin)
            .args(["agent", "--source"])
            .arg(format!("dir:{}", dir.display()))
            .args(["--backend", backend, "--interval-ms", "20", "--pin-dir"])
            .arg(&pins);
        lab.spawn(agent)?;
        consumer_ns.push(cns);
        gateways.push((gw, dir, pins));
    }
    // Wait until both agents enforce.
    let deadline = Instant::now() + Duration::from_secs(20);
    for (c, (gw, _, pins)) in cs.iter().zip(&gateways) {
        loop {
            let ready = if backend == "bpf" {
                pins.join("links").join("tc-liqo-tunnel").exists()
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
    // Tunnels up (WireGuard handshakes) before judging.
    for (c, cns) in cs.iter().zip(&consumer_ns) {
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
    let mut pairs = Vec::new();
    for (c, cns) in cs.iter().zip(&consumer_ns) {
        for src in c.pods {
            for d in &cs {
                for dst in &d.offloaded {
                    pairs.push(Pair {
                        from: format!("consumer {} pod {src}", c.name),
                        ns: cns.name().to_string(),
                        src: src.to_string(),
                        to: format!("provider offloaded-by-{}", d.name),
                        dst: dst.clone(),
                        expect: c.name == d.name,
                    });
                }
            }
            pairs.push(Pair {
                from: format!("consumer {} pod {src}", c.name),
                ns: cns.name().to_string(),
                src: src.to_string(),
                to: "provider local".into(),
                dst: LOCAL_POD.into(),
                expect: false,
            });
        }
        // Connections the provider opens get their replies back through the tunnel.
        pairs.push(Pair {
            from: "provider local".into(),
            ns: node.name().to_string(),
            src: LOCAL_POD.into(),
            to: format!("consumer {} pod", c.name),
            dst: c.pods[0].to_string(),
            expect: true,
        });
    }
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
    println!("\n== {backend}: reachability (ICMP + TCP + UDP per pair)");
    for (p, r) in pairs.iter().zip(&results) {
        let word = r.word();
        let detail = if word == "MIXED" {
            format!(" (icmp {}, tcp {}, udp {})", r.icmp, r.tcp, r.udp)
        } else {
            String::new()
        };
        let line = format!(
            "{word:<5} | [{}] -> [{}] || {} -> {}{detail}",
            p.from, p.to, p.src, p.dst
        );
        let ok = word == "OK";
        println!(
            "{line}{}",
            if ok == p.expect && word != "MIXED" {
                ""
            } else {
                "   <-- UNEXPECTED"
            }
        );
        rows.push((
            format!("[{}] -> [{}] || {} -> {}", p.from, p.to, p.src, p.dst),
            ok && word != "MIXED",
            p.expect,
        ));
    }
    // Live change: consumer A offloads one more pod.
    node.ip(&["addr", "add", &format!("{NEW_POD}/32"), "dev", "lo"])?;
    lab.listeners(&node, NEW_POD)?;
    let a = &cs[0];
    let (_, dir_a, _) = &gateways[0];
    let tmp = dir_a.join(".next.tmp");
    std::fs::write(
        &tmp,
        controller_policy(&lab_world(&[(a.name, NEW_POD)]), a.name)?,
    )?;
    let started = Instant::now();
    std::fs::rename(&tmp, dir_a.join("provider-protection.yaml"))?;
    let mut new_pod_ms = None;
    while started.elapsed() < Duration::from_secs(10) {
        // A short reply timeout bounds the measurement error (plus the agent's 20 ms poll).
        if in_ns(
            consumer_ns[0].name(),
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
        for r in &runs {
            println!(
                "{}: matrix equals the expected provider-protection matrix: {}; new pod reachable after {}",
                r.backend,
                if r.as_expected() { "yes" } else { "NO" },
                r.new_pod_ms.map_or("never".to_string(), |ms| format!("{ms:.0} ms"))
            );
        }
        return Ok(agree && expected && live);
    }
    for r in &runs {
        println!(
            "{}: matrix equals the expected provider-protection matrix: {}; new pod reachable after {}",
            r.backend,
            if r.as_expected() { "yes" } else { "NO" },
            r.new_pod_ms.map_or("never".to_string(), |ms| format!("{ms:.0} ms"))
        );
    }
    Ok(expected && live)
}
