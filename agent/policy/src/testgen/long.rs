//! Long chains: a random table whose chains are preceded by dozens to hundreds of narrower
//! rules, so that packets are decided past the 64th rule as often as before it (the bpf
//! datapath evaluates chains of up to 64 rules with a one-word body and longer ones with the
//! full bitmap).

use peerwall_intent::types::*;
use rand::rngs::StdRng;
use rand::Rng;

use super::{pick, random_match, random_table};

/// A [`random_table`] whose every chain has 40–200 rules of three random equalities each
/// (most packets pass over them) put before its own. Rules are named `n<position>`:
/// [`rule_position`] reads a deciding rule's index back.
pub fn long_table(rng: &mut StdRng, name: &str) -> FirewallConfigurationSpec {
    let mut spec = random_table(rng, name);
    let family = spec.table.family.unwrap_or(TableFamily::Inet);
    let sets: Vec<(String, bool)> = spec
        .table
        .sets
        .iter()
        .map(|s| (s.name.clone(), s.key_type == Some(SetDataType::Ipv6Addr)))
        .collect();
    for chain in &mut spec.table.chains {
        let hook = chain.hook;
        let own = chain.rules.filter_rules.take().unwrap_or_default();
        let mut rules: Vec<FilterRule> = (0..rng.random_range(40..=200))
            .map(|_| {
                let six = match family {
                    TableFamily::Ipv4 => false,
                    TableFamily::Ipv6 => true,
                    _ => rng.random_bool(0.4),
                };
                let mut action = *pick(
                    rng,
                    &[
                        FilterAction::Accept,
                        FilterAction::Drop,
                        FilterAction::Reject,
                    ],
                );
                if action == FilterAction::Reject && hook == Some(ChainHook::Postrouting) {
                    action = FilterAction::Drop;
                }
                // Three equalities: each holds for a few of the pools' values, all three
                // rarely.
                FilterRule {
                    name: None,
                    r#match: (0..3)
                        .map(|_| Match {
                            op: Some(MatchOperation::Eq),
                            ..random_match(rng, six, &sets)
                        })
                        .collect(),
                    action: Some(action),
                    value: None,
                    counter: Some(rng.random_bool(0.5)),
                }
            })
            .collect();
        rules.extend(own);
        for (i, r) in rules.iter_mut().enumerate() {
            r.name = Some(format!("n{i}"));
        }
        chain.rules.filter_rules = Some(rules);
    }
    spec
}

/// The position in its chain of a rule of a [`long_table`], from its name.
pub fn rule_position(name: &str) -> Option<usize> {
    name.strip_prefix('n')?.parse().ok()
}
