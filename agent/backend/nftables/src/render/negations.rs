//! Keeping negated compares of adjacent packet fields apart.
//!
//! nft 1.0.6 (Debian 12's, the one the image ships) joins the compares of adjacent payload
//! fields into one compare of the joined field (`payload_try_merge`), and it does so for `!=`
//! as well as for `==`: `th sport != 80 th dport != 40000` is loaded as
//! `@th,0,32 != 0x509c40`, which is true when *either* port differs, not when both do. An
//! accept rule written that way accepts more than it says. Upstream stopped merging `!=`
//! (netfilter-devel, "Wrong payload merge of rule filter ! --sport xx ! --dport xx", March
//! 2024); the nft peerwall runs with has not.
//!
//! nft never merges a range expression, so a rule with more than one negated single value
//! gets each of them as the one-value range it is (`th sport != 80-80`): the kernel then
//! compares field by field (`range neq reg 1 0x5000 0x5000`). A lone negation stays as it
//! is: there is nothing for nft to join it with.

use ipnet::IpNet;

use crate::model::{Element, Expr, Key, Right};

/// The one-value range a negated single value of a port or address match becomes; None for
/// anything else (a set, a range already, a positive match, another key).
fn negated_single_value(e: &Expr) -> Option<Element> {
    let Expr::Match {
        negate: true,
        left: Key::Port { .. } | Key::Addr { .. },
        right: Right::Element(value),
    } = e
    else {
        return None;
    };
    match *value {
        Element::Port(p) => Some(Element::PortRange(p, p)),
        Element::Addr(a) => Some(Element::AddrRange(a, a)),
        Element::Prefix(a, len) => IpNet::new(a, len)
            .ok()
            .map(|n| Element::AddrRange(n.network(), n.broadcast())),
        _ => None,
    }
}

/// Rewrite the negated single values of one rule's statements as one-value ranges when the
/// rule holds more than one of them.
pub(super) fn keep_negations_apart(exprs: &mut [Expr]) {
    if exprs
        .iter()
        .filter(|e| negated_single_value(e).is_some())
        .count()
        < 2
    {
        return;
    }
    for e in exprs.iter_mut() {
        if let (Some(range), Expr::Match { right, .. }) = (negated_single_value(e), &mut *e) {
            *right = Right::Element(range);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use peerwall_policy::ir::IpFamily;

    fn port(source: bool, negate: bool, p: u16) -> Expr {
        Expr::Match {
            negate,
            left: Key::Port { source },
            right: Right::Element(Element::Port(p)),
        }
    }

    #[test]
    fn two_negated_ports_become_one_value_ranges() {
        let mut v = vec![port(true, true, 80), port(false, true, 40000)];
        keep_negations_apart(&mut v);
        let texts: Vec<String> = v.iter().map(Expr::text).collect();
        assert_eq!(texts, ["th sport != 80-80", "th dport != 40000-40000"]);
    }

    #[test]
    fn a_lone_negation_and_positive_matches_stay() {
        let mut v = vec![port(true, true, 80), port(false, false, 40000)];
        let before = v.clone();
        keep_negations_apart(&mut v);
        assert_eq!(v, before);
    }

    #[test]
    fn negated_addresses_and_prefixes_become_ranges_beside_a_negated_port() {
        let addr = |a: &str| Expr::Match {
            negate: true,
            left: Key::Addr {
                family: IpFamily::V4,
                source: true,
            },
            right: Right::Element(Element::Addr(a.parse().unwrap())),
        };
        let prefix = Expr::Match {
            negate: true,
            left: Key::Addr {
                family: IpFamily::V4,
                source: false,
            },
            right: Right::Element(Element::Prefix("10.1.0.0".parse().unwrap(), 16)),
        };
        let mut v = vec![addr("10.0.0.1"), prefix, port(false, true, 53)];
        keep_negations_apart(&mut v);
        let texts: Vec<String> = v.iter().map(Expr::text).collect();
        assert_eq!(
            texts,
            [
                "ip saddr != 10.0.0.1-10.0.0.1",
                "ip daddr != 10.1.0.0-10.1.255.255",
                "th dport != 53-53"
            ]
        );
    }
}
