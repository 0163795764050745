//! The emergency switch of the nftables backend (`peerwall allow-all on --backend nftables`),
//! the twin of the bpf datapath's `ALLOW_ALL`: every filter chain of every peerwall table gets
//! an `accept` first (comment [`SWITCH_COMMENT`]), and the table `inet` [`SWITCH_TABLE`] records
//! that the switch is on, all in one transaction. The agent reads the record on every apply and
//! drift check: it keeps the switch's rules in what it applies (new policies too) and never
//! repairs them away, until `allow-all off` removes both. Netfilter runs every base chain, so
//! an accept in another table would not do: the accept must lead each of our chains.

use peerwall_policy::ir::TableFamily;

use crate::listing::Listing;
use crate::model::{Command, Expr, Rule, Table, MARKER_CHAIN};

/// The table whose presence means "the switch is on" (it holds nothing).
pub const SWITCH_TABLE: &str = "peerwall_allow_all";
/// Comment of the switch's accept rules.
pub const SWITCH_COMMENT: &str = "peerwall:allow-all";

/// Whether a listing has the switch on.
pub fn is_on(listing: &Listing) -> bool {
    listing
        .tables
        .iter()
        .any(|t| t.family == "inet" && t.name == SWITCH_TABLE)
}

/// Base filter chains of peerwall's tables in a listing: (family, table, chain).
fn owned_filter_chains(listing: &Listing) -> Vec<(TableFamily, String, String)> {
    let owned: Vec<(String, String)> = listing
        .kernel_tables()
        .into_iter()
        .filter(|t| t.owner.is_some())
        .map(|t| (t.family, t.name))
        .collect();
    listing
        .chains
        .iter()
        .filter(|c| c.kind.as_deref() == Some("filter") && c.hook.is_some())
        .filter(|c| c.name != MARKER_CHAIN)
        .filter(|c| owned.contains(&(c.family.clone(), c.table.clone())))
        .filter_map(|c| {
            let family = TableFamily::from_nft(&c.family)?;
            Some((family, c.table.clone(), c.name.clone()))
        })
        .collect()
}

/// The nft commands that turn the switch on, given the current listing: the record table and
/// an accept leading each chain that has none yet.
pub fn on_commands(listing: &Listing) -> Vec<Command<'static>> {
    let mut cmds = vec![Command::AddTable {
        family: TableFamily::Inet,
        name: SWITCH_TABLE.into(),
    }];
    for (family, table, chain) in owned_filter_chains(listing) {
        let has = listing.rules.iter().any(|r| {
            r.comment.as_deref() == Some(SWITCH_COMMENT)
                && r.family == family.nft()
                && r.table == table
                && r.chain == chain
        });
        if !has {
            cmds.push(Command::InsertRule {
                family,
                table,
                rule: Rule {
                    chain,
                    comment: SWITCH_COMMENT.into(),
                    exprs: vec![Expr::Accept],
                },
            });
        }
    }
    cmds
}

/// The nft commands that turn the switch off: the switch's rules and the record removed.
pub fn off_commands(listing: &Listing) -> Vec<Command<'static>> {
    let mut cmds: Vec<Command<'static>> = listing
        .rules
        .iter()
        .filter(|r| r.comment.as_deref() == Some(SWITCH_COMMENT))
        .filter_map(|r| {
            Some(Command::DeleteRule {
                family: TableFamily::from_nft(&r.family)?,
                table: r.table.clone(),
                chain: r.chain.clone(),
                handle: r.handle?,
            })
        })
        .collect();
    if is_on(listing) {
        cmds.push(Command::Delete {
            family: TableFamily::Inet,
            name: SWITCH_TABLE.into(),
        });
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
pub fn set(nft: &impl crate::Runner, on: bool) -> Result<(), crate::NftError> {
    let listing = nft.list_ruleset_terse()?;
    let cmds = if on {
        on_commands(&listing)
    } else {
        off_commands(&listing)
    };
    if cmds.is_empty() {
        return Ok(());
    }
    nft.transaction(&cmds)
}

#[cfg(test)]
mod tests {
    use super::*;

    use serde_json::json;

    fn listing(on: bool) -> Listing {
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
        crate::json::read::listing(&v).expect("listing")
    }

    #[test]
    fn on_leads_only_our_filter_chains_with_an_accept_and_off_removes_it() {
        let on = on_commands(&listing(false));
        assert_eq!(on.len(), 2, "{on:?}");
        assert!(
            matches!(&on[1], Command::InsertRule { table, rule, .. }
                if table == "t" && rule.chain == "fwd" && rule.exprs == [Expr::Accept]),
            "{on:?}"
        );
        assert!(!is_on(&listing(false)) && is_on(&listing(true)));
        // Idempotent: nothing more to insert once on.
        assert_eq!(on_commands(&listing(true)).len(), 1);
        let off = off_commands(&listing(true));
        assert!(
            matches!(&off[0], Command::DeleteRule { handle: 9, table, .. } if table == "t"),
            "{off:?}"
        );
        assert!(
            matches!(&off[1], Command::Delete { name, .. } if name == SWITCH_TABLE),
            "{off:?}"
        );
        assert!(off_commands(&listing(false)).is_empty());
    }
}
