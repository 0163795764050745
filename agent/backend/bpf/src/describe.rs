//! Human and JSON views of the datapath's map contents (`compile --backend bpf`).

use serde::Serialize;

use super::maps::{BpfPolicy, ChainMaps};

/// One chain as an operator reads it.
#[derive(Clone, Debug, Serialize)]
pub struct ChainView {
    /// Chain id (key prefix in every per-chain map).
    pub id: u32,
    /// table/chain.
    pub name: String,
    /// Hook.
    pub hook: &'static str,
    /// Policy.
    pub policy: &'static str,
    /// Deciding rules in bit order: `bit name action`.
    pub rules: Vec<String>,
    /// Address trie entries: `src|dst prefix -> bits`.
    pub prefixes: Vec<String>,
    /// Port trie entries.
    pub ports: Vec<String>,
    /// Interface entries (`ifindex -> bits`, 0 = none known here).
    pub interfaces: Vec<String>,
    /// Protocol entries.
    pub protocols: Vec<String>,
    /// ct state bitmaps.
    pub ct: Vec<String>,
}

/// The whole datapath view.
#[derive(Clone, Debug, Serialize)]
pub struct PolicyView {
    /// Chains.
    pub chains: Vec<ChainView>,
    /// `hook/family -> chain ids` in evaluation order.
    pub hooks: Vec<String>,
}

fn bits(b: &peerwall_common::Bitmap) -> String {
    let set: Vec<String> = (0..peerwall_common::MAX_RULES)
        .filter(|r| b.get(*r))
        .map(|r| r.to_string())
        .collect();
    format!("{{{}}}", set.join(","))
}

fn chain_view(c: &ChainMaps) -> ChainView {
    ChainView {
        id: c.id,
        name: format!("{}/{}", c.table, c.chain),
        hook: c.hook.nft(),
        policy: c.policy.as_str(),
        rules: c
            .rules
            .iter()
            .enumerate()
            .map(|(i, r)| format!("{i} {} {}", r.name, r.action.as_str()))
            .collect(),
        prefixes: c
            .src
            .iter()
            .map(|(n, b)| format!("src {n} -> {}", bits(b)))
            .chain(c.dst.iter().map(|(n, b)| format!("dst {n} -> {}", bits(b))))
            .collect(),
        ports: c
            .sport
            .iter()
            .map(|(p, l, b)| format!("sport {p}/{l} -> {}", bits(b)))
            .chain(
                c.dport
                    .iter()
                    .map(|(p, l, b)| format!("dport {p}/{l} -> {}", bits(b))),
            )
            .collect(),
        interfaces: c
            .iif
            .iter()
            .map(|(i, b)| format!("iif {i} -> {}", bits(b)))
            .chain(c.oif.iter().map(|(i, b)| format!("oif {i} -> {}", bits(b))))
            .collect(),
        protocols: c
            .proto
            .iter()
            .map(|(f, p, b)| {
                let p = p.map_or("other".to_string(), |p| p.to_string());
                format!("ipv{f} {p} -> {}", bits(b))
            })
            .collect(),
        ct: ["new", "established", "related", "untracked", "invalid"]
            .iter()
            .zip(&c.ct)
            .map(|(s, b)| format!("{s} -> {}", bits(b)))
            .collect(),
    }
}

/// Describe compiled map contents.
pub fn describe(bp: &BpfPolicy) -> PolicyView {
    let hooks = ["prerouting", "input", "forward", "output", "postrouting"];
    PolicyView {
        chains: bp.chains.iter().map(chain_view).collect(),
        hooks: bp
            .hooks
            .iter()
            .enumerate()
            .filter(|(_, h)| h.count > 0)
            .map(|(i, h)| {
                format!(
                    "{}/ipv{} -> {:?}",
                    hooks[i / 2],
                    if i % 2 == 0 { 4 } else { 6 },
                    &h.chains[..h.count as usize]
                )
            })
            .collect(),
    }
}

/// Text rendering.
pub fn text(v: &PolicyView) -> String {
    let mut s = String::new();
    for h in &v.hooks {
        s.push_str(&format!("hook {h}\n"));
    }
    for c in &v.chains {
        s.push_str(&format!(
            "chain {} {} (hook {}, policy {})\n",
            c.id, c.name, c.hook, c.policy
        ));
        for group in [
            &c.rules,
            &c.protocols,
            &c.interfaces,
            &c.ct,
            &c.prefixes,
            &c.ports,
        ] {
            for l in group {
                s.push_str(&format!("  {l}\n"));
            }
        }
    }
    s
}
