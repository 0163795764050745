//! `peerwall compile --cluster` and `peerwall verdict --cluster`: what the controller writes
//! for a cluster snapshot ([`crate::k8s::snapshot`]), and the gateway's verdict between two of
//! its pods (or every pair, `--matrix`) under it, judged by the reference evaluator or a real
//! kernel. Interfaces follow from which pod is remote: a pod on a Liqo virtual node is behind
//! its peer's tunnel (`liqo-tunnel`), a local pod behind the Geneve interface.

use std::collections::BTreeMap;

use crate::k8s::snapshot::{self, Snapshot};
use crate::netpol;
use crate::protection::{self, Options};

use super::verdict::{judge, print_verdict};
use super::*;

/// The tunnel and Geneve interface names the verdicts use.
const TUNNEL: &str = "liqo-tunnel";
const GENEVE: &str = "liqo.peerwall00";

fn load(paths: &[PathBuf]) -> Result<Snapshot, CliError> {
    Snapshot::load(paths).map_err(input)
}

fn opts() -> Options {
    Options {
        tunnel: protection::DEFAULT_TUNNEL.into(),
        block_leaf_to_leaf: false,
        audit: false,
        liqo_ping_port: crate::protection::LIQO_PING_PORT,
        own_namespace_only: true,
        inline_budget: peerwall_protection::spill::INLINE_BUDGET,
    }
}

/// `peerwall compile --cluster`.
pub(super) fn compile(
    paths: &[PathBuf],
    backend: BackendKind,
    output: CompileOutput,
) -> Result<(), CliError> {
    if backend == BackendKind::Bpf && output != CompileOutput::Text {
        return Err(input(anyhow::anyhow!(
            "--backend bpf renders what the bpf backend loads (--output text); --output yaml and \
             json print the controller's objects, which both backends enforce alike: leave \
             --backend out"
        )));
    }
    let s = load(paths)?;
    let o = snapshot::output(&s, &opts());
    for u in &o.unenforced {
        tracing::warn!("{u}");
    }
    match output {
        CompileOutput::Yaml => {
            let mut text = String::new();
            for obj in &o.objects {
                text.push_str("---\n");
                text.push_str(&serde_yaml::to_string(obj).map_err(runtime)?);
            }
            out(&text)
        }
        CompileOutput::Json => out(&format!(
            "{}\n",
            serde_json::to_string_pretty(&serde_json::json!({
                "apiVersion": "v1", "kind": "List", "items": o.objects,
            }))
            .map_err(runtime)?
        )),
        CompileOutput::Text => {
            let mut text = String::new();
            for (peer, objs) in &o.enforced {
                let compiled = compile_objects(objs)?;
                text.push_str(&format!("# the gateway of peer {peer}\n"));
                text.push_str(&super::render::rendered(
                    &compiled,
                    backend,
                    peerwall_backend_select::rendering::Format::Text,
                )?);
            }
            out(&text)
        }
    }
}

/// The policy IR of FirewallConfiguration objects as the controller publishes them.
fn compile_objects(objs: &[serde_json::Value]) -> Result<ir::Policy, CliError> {
    let objects = objs
        .iter()
        .map(|o| {
            peerwall_intent::load::object_from_json(
                o.clone(),
                peerwall_intent::load::Group::Peerwall,
            )
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(runtime)?;
    compile::compile(&objects).map(|c| c.policy).map_err(|e| {
        runtime(anyhow::anyhow!(
            "the controller's output does not compile: {e}"
        ))
    })
}

/// One probe: protocol and destination port.
#[derive(Clone, Copy)]
struct Probe {
    proto: ProtoArg,
    port: u16,
}

impl Probe {
    fn label(self) -> String {
        let p = match self.proto {
            ProtoArg::Tcp => "TCP",
            ProtoArg::Udp => "UDP",
            ProtoArg::Sctp => "SCTP",
            ProtoArg::Icmp => "ICMP",
        };
        if self.proto == ProtoArg::Icmp {
            p.into()
        } else {
            format!("{p}/{}", self.port)
        }
    }
}

/// How a pod is named in messages: `namespace/name`, or the address of a peer's pod the
/// snapshot does not hold ([`address_end`]).
fn name(p: &netpol::Pod) -> String {
    if p.namespace.is_empty() {
        p.name.clone()
    } else {
        p.key()
    }
}

/// A peer's pod the snapshot does not hold, by its address as this cluster sees it: the
/// gateway sees the peer's own address (a remapped CIDR's address is translated back). Not a
/// member of any namespace here, so no pod or namespace selector of this cluster selects it
/// (only `ipBlock`s and the peer's protection decide).
fn address_end(ip: IpAddr, peer: &str, cluster: &netpol::Cluster) -> netpol::Pod {
    let real = cluster
        .remaps
        .get(peer)
        .and_then(|rs| rs.iter().find_map(|r| r.to_real(ip)))
        .unwrap_or(ip);
    netpol::Pod {
        namespace: String::new(),
        name: format!("{ip} (a pod of peer {peer})"),
        labels: BTreeMap::new(),
        ips: vec![real],
        local_ips: vec![ip],
        ports: Vec::new(),
        peer: Some(peer.to_string()),
    }
}

/// The peer an address endpoint is behind: `--peer`, or the snapshot's only peer.
fn address_peer<'a>(
    flag: &str,
    ip: IpAddr,
    given: Option<&'a str>,
    peers: &'a BTreeMap<String, ir::Policy>,
) -> Result<&'a str, CliError> {
    let known: Vec<&str> = peers.keys().map(String::as_str).collect();
    match given {
        Some(p) if peers.contains_key(p) => Ok(p),
        Some(p) => Err(input(anyhow::anyhow!(
            "--peer {p:?}: no such peer in the snapshot (peers: {})",
            known.join(", ")
        ))),
        None if known.len() == 1 => Ok(known[0]),
        None => Err(input(anyhow::anyhow!(
            "{flag} {ip}: an address is a pod of a peer; name the peer with --peer (peers in the snapshot: {})",
            if known.is_empty() { "none".to_string() } else { known.join(", ") }
        ))),
    }
}

/// The packet from `from` to `to` through the gateway of the remote one's peer; the peer, or
/// why the pair does not cross a gateway.
fn packet(
    from: &netpol::Pod,
    to: &netpol::Pod,
    probe: Probe,
    sport: u16,
    ct: CtState,
) -> Result<(String, Packet), String> {
    let peer = match (&from.peer, &to.peer) {
        (Some(_), Some(_)) => {
            return Err(format!(
                "{} and {} both run on peers: their traffic does not cross this cluster's gateways",
                name(from),
                name(to)
            ))
        }
        (None, None) => {
            return Err(format!(
                "{} and {} both run locally: their traffic does not cross a gateway",
                name(from),
                name(to)
            ))
        }
        (Some(p), None) | (None, Some(p)) => p.clone(),
    };
    let src = from.ips[0];
    let dst = to
        .ip_like(src)
        .ok_or_else(|| format!("{} has no address of {}'s family", name(to), name(from)))?;
    let (iif, oif) = if from.peer.is_some() {
        (TUNNEL, GENEVE)
    } else {
        (GENEVE, TUNNEL)
    };
    Ok((
        peer,
        Packet {
            src,
            dst,
            proto: probe.proto.number(src.is_ipv6()),
            sport,
            dport: if probe.proto == ProtoArg::Icmp {
                0
            } else {
                probe.port
            },
            iif: Some(iif.into()),
            oif: Some(oif.into()),
            ct_state: ct,
        },
    ))
}

// size: argument checks, then one judgement per engine; each step names the flag it reads.
/// `peerwall verdict --cluster`.
pub(super) fn verdict(a: VerdictArgs) -> Result<(), CliError> {
    if !a.matrix && (a.from.is_none() || a.to.is_none()) {
        let lacking: Vec<&str> = [("--from", a.from.is_none()), ("--to", a.to.is_none())]
            .into_iter()
            .filter_map(|(flag, absent)| absent.then_some(flag))
            .collect();
        return Err(input(anyhow::anyhow!(
            "verdict --cluster judges between two pods (--from NS/NAME --to NS/NAME) or all \
             pairs (--matrix): this lacks {}",
            lacking.join(" and ")
        )));
    }
    let s = load(&a.cluster)?;
    let o = snapshot::output(&s, &opts());
    for u in &o.unenforced {
        tracing::warn!("{u}");
    }
    let (cluster, _) = s.cluster();
    let probes: Vec<Probe> = match (a.proto, a.dport) {
        (None, None) if a.matrix => [ProtoArg::Tcp, ProtoArg::Udp, ProtoArg::Sctp]
            .into_iter()
            .flat_map(|proto| [80, 81].map(|port| Probe { proto, port }))
            .collect(),
        (p, d) => vec![Probe {
            proto: p.unwrap_or(ProtoArg::Tcp),
            port: d.unwrap_or(80),
        }],
    };
    let policies: BTreeMap<String, ir::Policy> = o
        .enforced
        .iter()
        .map(|(peer, objs)| Ok((peer.clone(), compile_objects(objs)?)))
        .collect::<Result<_, CliError>>()?;
    // A pod of the snapshot, or a peer's pod by its address (then not in the snapshot).
    let pod = |key: &str, flag: &str| -> Result<(netpol::Pod, bool), CliError> {
        if let Ok(ip) = key.parse::<IpAddr>() {
            if let Some(p) = cluster.pods.iter().find(|p| p.local_ips().contains(&ip)) {
                return Ok(((**p).clone(), true));
            }
            let peer = address_peer(flag, ip, a.peer.as_deref(), &policies)?;
            return Ok((address_end(ip, peer, &cluster), false));
        }
        if !key.contains('/') {
            return Err(input(anyhow::anyhow!(
                "{flag} {key:?}: name a pod as NAMESPACE/NAME, or a peer's pod by its address"
            )));
        }
        cluster.pod(key).cloned().map(|p| (p, true)).ok_or_else(|| {
            input(anyhow::anyhow!(
                "{flag} {key:?}: no such pod with an address in the snapshot"
            ))
        })
    };
    if !a.matrix {
        let ((from, from_known), (to, to_known)) = (
            pod(a.from.as_deref().unwrap_or_default(), "--from")?,
            pod(a.to.as_deref().unwrap_or_default(), "--to")?,
        );
        let (from, to) = (&from, &to);
        let (peer, pkt) = packet(from, to, probes[0], a.sport, a.ct_state.state())
            .map_err(|e| input(anyhow::anyhow!(e)))?;
        let policy = policies.get(&peer).ok_or_else(|| {
            input(anyhow::anyhow!(
                "{} runs on peer {peer}, which has no tenant namespace in the snapshot (label liqo.io/tenant-namespace=true, liqo.io/remote-cluster-id={peer})",
                if from.peer.is_some() { name(from) } else { name(to) }
            ))
        })?;
        let v = judge(policy, std::slice::from_ref(&pkt), a.engine)?
            .pop()
            .ok_or_else(|| runtime(anyhow::anyhow!("the engine gave no verdict")))?;
        if !a.trace {
            return print_verdict(&v, a.output);
        }
        let flow = netpol::eval::Flow {
            src: pkt.src,
            dst: pkt.dst,
            proto: pkt.proto,
            dport: pkt.dport,
            src_pod: from_known.then_some(from),
            dst_pod: to_known.then_some(to),
        };
        let (egress, ingress) = netpol::eval::trace(&cluster, &flow);
        let lines = |steps: &[netpol::eval::Step]| -> Vec<String> {
            steps.iter().map(netpol::eval::Step::describe).collect()
        };
        return match a.output {
            Output::Json => out(&format!(
                "{}\n",
                serde_json::json!({
                    "verdict": v,
                    "trace": {
                        "egress": {"pod": name(from), "steps": lines(&egress)},
                        "ingress": {"pod": name(to), "steps": lines(&ingress)},
                    },
                })
            )),
            Output::Text => {
                print_verdict(&v, a.output)?;
                let mut text = String::new();
                for (dir, pod, steps) in [("egress", from, &egress), ("ingress", to, &ingress)] {
                    text.push_str(&format!("{dir} of {}:\n", name(pod)));
                    let steps = lines(steps);
                    if steps.is_empty() && pod.namespace.is_empty() {
                        text.push_str(
                            "  not a pod of this cluster: none of its policies applies\n",
                        );
                    }
                    for l in steps {
                        text.push_str(&format!("  {l}\n"));
                    }
                }
                out(&text)
            }
        };
    }
    // Pods on a peer the controller writes nothing for cross no gateway peerwall enforces in.
    let unmanaged: std::collections::BTreeSet<&str> = cluster
        .pods
        .iter()
        .filter_map(|p| p.peer.as_deref())
        .filter(|p| !policies.contains_key(*p))
        .collect();
    for peer in unmanaged {
        tracing::warn!(
            peer,
            "pods run on peer {peer}, which has no tenant namespace in the snapshot (labels liqo.io/tenant-namespace=true, liqo.io/remote-cluster-id={peer}): the controller writes nothing for it, so its pairs show as -"
        );
    }
    // The matrix: every ordered pair that crosses a gateway, per probe, judged per peer.
    let mut pods: Vec<&netpol::Pod> = cluster.pods.iter().map(|p| &**p).collect();
    pods.sort_by_key(|p| p.key());
    let mut cells: BTreeMap<(usize, usize, usize), ir::Verdict> = BTreeMap::new();
    for (peer, policy) in &policies {
        let mut keys = Vec::new();
        let mut packets = Vec::new();
        for (pi, probe) in probes.iter().enumerate() {
            for (fi, from) in pods.iter().enumerate() {
                for (ti, to) in pods.iter().enumerate() {
                    if let Ok((p, pkt)) = packet(from, to, *probe, a.sport, a.ct_state.state()) {
                        if &p == peer {
                            keys.push((pi, fi, ti));
                            packets.push(pkt);
                        }
                    }
                }
            }
        }
        if packets.is_empty() {
            continue;
        }
        for (k, v) in keys.into_iter().zip(judge(policy, &packets, a.engine)?) {
            cells.insert(k, v);
        }
    }
    match a.output {
        Output::Json => {
            let rows: Vec<serde_json::Value> = cells
                .iter()
                .map(|((pi, fi, ti), v)| {
                    serde_json::json!({
                        "from": pods[*fi].key(), "to": pods[*ti].key(),
                        "probe": probes[*pi].label(),
                        "verdict": v.verdict.as_str(), "table": v.table,
                        "chain": v.chain, "rule": v.rule,
                    })
                })
                .collect();
            out(&format!(
                "{}\n",
                serde_json::to_string(&rows).map_err(runtime)?
            ))
        }
        Output::Text => {
            let keys: Vec<String> = pods.iter().map(|p| p.key()).collect();
            let mut text = String::new();
            for (pi, probe) in probes.iter().enumerate() {
                text.push_str(&truth_table(&probe.label(), &keys, |fi, ti| {
                    match cells.get(&(pi, fi, ti)) {
                        None => "-",
                        Some(v) if v.verdict == ir::VerdictAction::Accept => ".",
                        Some(_) => "X",
                    }
                }));
            }
            out(&text)
        }
    }
}

/// One probe's truth table as the Kubernetes e2e suite prints its own: `.` allowed, `X`
/// denied, `-` for pairs that do not cross a gateway; rows are sources, columns
/// destinations, each column as wide as its pod's name (and two spaces), so it reads aligned
/// whatever the names.
fn truth_table(
    label: &str,
    keys: &[String],
    mark: impl Fn(usize, usize) -> &'static str,
) -> String {
    let first = keys.iter().map(String::len).max().unwrap_or(0).max(1) + 2;
    let row = |head: &str, cells: Vec<&str>| {
        let mut line = format!("{head:<first$}");
        for (i, c) in cells.iter().enumerate() {
            let w = keys[i].len() + 2;
            line.push_str(&format!("{c:<w$}"));
        }
        format!("{}\n", line.trim_end())
    };
    let mut text = format!("{label}\n");
    text.push_str(&row("-", keys.iter().map(String::as_str).collect()));
    for (fi, from) in keys.iter().enumerate() {
        text.push_str(&row(from, (0..keys.len()).map(|ti| mark(fi, ti)).collect()));
    }
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use super::truth_table;

    #[test]
    fn truth_tables_are_aligned_whatever_the_names() {
        let keys = vec!["a/x".to_string(), "frontend/shell".to_string()];
        let t = truth_table("TCP/80", &keys, |f, t| if f == t { "-" } else { "X" });
        assert_eq!(
            t,
            "TCP/80\n\
             -               a/x  frontend/shell\n\
             a/x             -    X\n\
             frontend/shell  X    -\n\n"
        );
    }
}
