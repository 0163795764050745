//! Policies shaped for nftables' decided-flow cache: rules that accept on addresses,
//! destination ports and protocols alone (what the cache keys on) beside rules that drop or
//! reject on what it leaves out (the input interface, the source port, the conntrack state). A
//! cache that let an accept of one packet serve another its key cannot tell apart shows up on
//! these.

use peerwall_intent::types::*;
use rand::rngs::StdRng;
use rand::Rng;

use super::{one_chain_table, pick, IFACES};

/// Prefixes that hold many of [`super::random_packet`]'s addresses.
const V4_PREFIXES: [&str; 3] = ["10.0.0.0/28", "10.1.0.0/28", "10.0.0.0/15"];
const V6_PREFIXES: [&str; 3] = ["fd00::/124", "fd01::/124", "fd00::/15"];

/// A test of one field the cache's key leaves out: the input interface, the source port (with
/// its protocol) or one conntrack state.
fn off_key_match(rng: &mut StdRng) -> Match {
    let mut m = Match {
        op: Some(MatchOperation::Eq),
        ..Match::default()
    };
    match rng.random_range(0..3) {
        0 => {
            m.dev = Some(MatchDev {
                value: pick(rng, &IFACES).to_string(),
                position: Some(MatchDevPosition::In),
                wildcard: false,
            })
        }
        1 => {
            m.port = Some(MatchPort {
                value: pick(rng, &["40000", "80", "1-1024"]).to_string(),
                position: Some(MatchPosition::Src),
            });
            m.proto = Some(MatchProto {
                value: *pick(rng, &[L4Proto::Tcp, L4Proto::Udp]),
            });
        }
        _ => {
            m.ctstate = Some(MatchCtState {
                value: vec![*pick(
                    rng,
                    &[CtState::Established, CtState::Invalid, CtState::Related],
                )],
            })
        }
    }
    m
}

/// Tests of key fields only: a prefix (mostly of the destination), sometimes a destination
/// port with its protocol.
fn key_matches(rng: &mut StdRng, six: bool) -> Vec<Match> {
    let prefixes = if six { &V6_PREFIXES } else { &V4_PREFIXES };
    let mut m = vec![Match {
        op: Some(MatchOperation::Eq),
        ip: Some(MatchIp {
            value: pick(rng, prefixes).to_string(),
            position: Some(if rng.random_bool(0.7) {
                MatchPosition::Dst
            } else {
                MatchPosition::Src
            }),
        }),
        ..Match::default()
    }];
    if rng.random_bool(0.5) {
        m.push(Match {
            op: Some(MatchOperation::Eq),
            port: Some(MatchPort {
                value: pick(rng, &["80", "79-81", "1-1024", "22,443"]).to_string(),
                position: Some(MatchPosition::Dst),
            }),
            proto: Some(MatchProto {
                value: *pick(rng, &[L4Proto::Tcp, L4Proto::Udp, L4Proto::Sctp]),
            }),
            ..Match::default()
        });
    }
    m
}

/// Rule `ri` of a [`cache_table`] of `family`: a drop or reject on a field the key leaves out
/// (sometimes with key fields too), or mostly an accept on key fields alone.
fn cache_rule(rng: &mut StdRng, ri: usize, family: TableFamily) -> FilterRule {
    let pins = rng.random_bool(0.4);
    let mut m = Vec::new();
    if pins {
        m.push(off_key_match(rng));
    }
    if !pins || rng.random_bool(0.3) {
        let six = family == TableFamily::Inet && rng.random_bool(0.3);
        m.extend(key_matches(rng, six));
    }
    let action = if pins {
        *pick(
            rng,
            &[FilterAction::Drop, FilterAction::Drop, FilterAction::Reject],
        )
    } else {
        *pick(
            rng,
            &[
                FilterAction::Accept,
                FilterAction::Accept,
                FilterAction::Accept,
                FilterAction::Drop,
            ],
        )
    };
    FilterRule {
        name: Some(format!("k{ri}")),
        r#match: m,
        action: Some(action),
        value: None,
        counter: Some(rng.random_bool(0.5)),
    }
}

/// A table of one filter chain of 3-7 [`cache_rule`]s.
pub fn cache_table(rng: &mut StdRng, name: &str) -> FirewallConfigurationSpec {
    let family = *pick(
        rng,
        &[TableFamily::Inet, TableFamily::Inet, TableFamily::Ipv4],
    );
    let mut rules: Vec<FilterRule> = (0..rng.random_range(3..8))
        .map(|ri| cache_rule(rng, ri, family))
        .collect();
    // Mostly the drops first, as policies are written (the cache's lookup then goes below
    // them, with the accepts under it); else in any order.
    if rng.random_bool(0.75) {
        rules.sort_by_key(|r| r.action == Some(FilterAction::Accept));
    }
    let policy = *pick(
        rng,
        &[ChainPolicy::Drop, ChainPolicy::Drop, ChainPolicy::Accept],
    );
    let hook = *pick(
        rng,
        &[ChainHook::Forward, ChainHook::Forward, ChainHook::Input],
    );
    one_chain_table(name, family, rules, policy, hook)
}

/// 1-2 tables of [`cache_table`], named t0 and t1.
pub fn cache_specs(rng: &mut StdRng) -> Vec<FirewallConfigurationSpec> {
    let names = ["t0", "t1"];
    (0..rng.random_range(1..3))
        .map(|i| cache_table(rng, names[i]))
        .collect()
}
