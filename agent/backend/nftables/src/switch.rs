//! The emergency switch of the nftables backend (`peerwall allow-all on --backend nftables`),
//! the twin of the bpf datapath's `ALLOW_ALL`: every filter chain of every peerwall table gets
//! an `accept` first (comment [`SWITCH_COMMENT`]), and the table `inet` [`SWITCH_TABLE`] records
//! that the switch is on, all in one transaction. The agent reads the record on every apply and
//! drift check: it keeps the switch's rules in what it applies (new policies too) and never
//! repairs them away, until `allow-all off` removes both. Netfilter runs every base chain, so
//! an accept in another table would not do: the accept must lead each of our chains.

use serde_json::{json, Value};

use crate::model::{Expr, Rule, Table, MARKER_CHAIN};

/// The table whose presence means "the switch is on" (it holds nothing).
pub const SWITCH_TABLE: &str = "peerwall_allow_all";
/// Comment of the switch's accept rules.
pub const SWITCH_COMMENT: &str = "peerwall:allow-all";

/// Whether a ruleset listing has the switch on.
pub fn is_on(objs: &[Value]) -> bool {
    objs.iter()
        .filter_map(|o| o.get("table"))
        .any(|t| t["family"] == "inet" && t["name"] == SWITCH_TABLE)
}

/// Base filter chains of peerwall's tables in a listing: (family, table, chain).
fn owned_filter_chains(objs: &[Value]) -> Vec<(String, String, String)> {
    let owned: Vec<(String, String)> = crate::kernel_tables(objs)
        .into_iter()
        .filter(|t| t.owner.is_some())
        .map(|t| (t.family, t.name))
        .collect();
    objs.iter()
        .filter_map(|o| o.get("chain"))
        .filter(|c| c["type"] == "filter" && c.get("hook").is_some())
        .filter(|c| c["name"] != MARKER_CHAIN)
        .filter_map(|c| {
            let key = (
                c["family"].as_str()?.to_string(),
                c["table"].as_str()?.to_string(),
            );
            let name = c["name"].as_str()?.to_string();
            owned.contains(&key).then_some((key.0, key.1, name))
        })
        .collect()
}

/// Rules of the switch in a listing: (family, table, chain, handle).
fn switch_rules(objs: &[Value]) -> Vec<(String, String, String, u64)> {
    objs.iter()
        .filter_map(|o| o.get("rule"))
        .filter(|r| r["comment"] == SWITCH_COMMENT)
        .filter_map(|r| {
            Some((
                r["family"].as_str()?.to_string(),
                r["table"].as_str()?.to_string(),
                r["chain"].as_str()?.to_string(),
                r["handle"].as_u64()?,
            ))
        })
        .collect()
}

/// The nft JSON commands that turn the switch on, given the current listing: the record table
/// and an accept leading each chain that has none yet.
pub fn on_commands(objs: &[Value]) -> Vec<Value> {
    let mut cmds = vec![json!({"add": {"table": {"family": "inet", "name": SWITCH_TABLE}}})];
    let have = switch_rules(objs);
    for (family, table, chain) in owned_filter_chains(objs) {
        if have
            .iter()
            .any(|(f, t, c, _)| *f == family && *t == table && *c == chain)
        {
            continue;
        }
        cmds.push(
            json!({"insert": {"rule": {"family": family, "table": table, "chain": chain,
            "comment": SWITCH_COMMENT, "expr": [{"accept": null}]}}}),
        );
    }
    cmds
}

/// The nft JSON commands that turn the switch off: the switch's rules and the record removed.
pub fn off_commands(objs: &[Value]) -> Vec<Value> {
    let mut cmds: Vec<Value> = switch_rules(objs)
        .into_iter()
        .map(|(family, table, chain, handle)| {
            json!({"delete": {"rule": {"family": family, "table": table, "chain": chain,
                "handle": handle}}})
        })
        .collect();
    if is_on(objs) {
        cmds.push(json!({"delete": {"table": {"family": "inet", "name": SWITCH_TABLE}}}));
    }
    cmds
}

/// `t` as the agent applies it while the switch is `on`: an accept leading each filter chain.
pub fn with_switch(mut t: Table, on: bool) -> Table {
    t.rules.retain(|r| r.comment != SWITCH_COMMENT);
    if on {
        let lead: Vec<Rule> = t
            .chains
            .iter()
            .filter(|c| c.kind == peerwall_policy::ir::ChainKind::Filter)
            .map(|c| Rule {
                chain: c.name.clone(),
                comment: SWITCH_COMMENT.into(),
                exprs: vec![Expr::Accept],
            })
            .collect();
        t.rules.splice(0..0, lead);
    }
    t
}

/// Flip the switch in the kernel through `nft`: every owned filter chain of this network
/// namespace gets (or loses) its leading accept, in one transaction. Nothing to send is not
/// an error.
pub fn set(nft: &crate::Nft, on: bool) -> Result<(), crate::NftError> {
    use crate::Runner;
    let listing = nft.list_ruleset_terse()?;
    let cmds = if on {
        on_commands(&listing)
    } else {
        off_commands(&listing)
    };
    if cmds.is_empty() {
        return Ok(());
    }
    nft.apply_json(&json!({ "nftables": cmds }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listing(on: bool) -> Vec<Value> {
        let mut v = vec![
            json!({"table": {"family": "inet", "name": "t"}}),
            json!({"table": {"family": "ip", "name": "liqo"}}),
            json!({"chain": {"family": "inet", "table": "t", "name": "fwd", "type": "filter", "hook": "forward"}}),
            json!({"chain": {"family": "inet", "table": "t", "name": MARKER_CHAIN}}),
            json!({"rule": {"family": "inet", "table": "t", "chain": MARKER_CHAIN, "handle": 1,
                "comment": format!("{}ns/x", crate::model::MARKER_PREFIX), "expr": [{"counter": null}]}}),
            json!({"chain": {"family": "ip", "table": "liqo", "name": "fwd", "type": "filter", "hook": "forward"}}),
        ];
        if on {
            v.push(json!({"table": {"family": "inet", "name": SWITCH_TABLE}}));
            v.push(
                json!({"rule": {"family": "inet", "table": "t", "chain": "fwd", "handle": 9,
                "comment": SWITCH_COMMENT, "expr": [{"accept": null}]}}),
            );
        }
        v
    }

    #[test]
    fn on_leads_only_our_filter_chains_with_an_accept_and_off_removes_it() {
        let on = on_commands(&listing(false));
        assert_eq!(on.len(), 2, "{on:?}");
        assert_eq!(on[1]["insert"]["rule"]["table"], "t");
        assert!(!is_on(&listing(false)) && is_on(&listing(true)));
        // Idempotent: nothing more to insert once on.
        assert_eq!(on_commands(&listing(true)).len(), 1);
        let off = off_commands(&listing(true));
        assert_eq!(off[0]["delete"]["rule"]["handle"], 9);
        assert_eq!(off[1]["delete"]["table"]["name"], SWITCH_TABLE);
        assert!(off_commands(&listing(false)).is_empty());
    }
}
