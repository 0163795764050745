//! Parsing of address and port values (`ip.value`, `port.value`, set elements).

use std::net::IpAddr;

use ipnet::IpNet;

use super::errors::{Advice, Problem};
use crate::ir::addr::{addr_to_u128, AddrRange, IpFamily};
use crate::ir::NatTarget;

/// One parsed address item.
#[derive(Clone, Debug, PartialEq)]
pub struct AddrItem {
    /// Family.
    pub family: IpFamily,
    /// Range covered.
    pub range: AddrRange,
    /// Set when the CIDR had host bits set.
    pub advice: Option<Advice>,
}

/// A CIDR, normalised to its network; host bits set come back as advice (as nft does it).
fn parse_cidr(raw: &str) -> Result<(IpNet, Option<Advice>), Problem> {
    let net: IpNet = raw
        .trim()
        .parse()
        .map_err(|_| Problem::NotAnAddress(raw.to_string()))?;
    let trunc = net.trunc();
    let advice = (trunc != net).then(|| Advice::HostBitsSet {
        value: raw.to_string(),
        normalized: trunc.to_string(),
    });
    Ok((trunc, advice))
}

/// Parse one address, CIDR or `a-b` range.
pub fn parse_addr_item(raw: &str) -> Result<AddrItem, Problem> {
    let s = raw.trim();
    if let Some((a, b)) = s.split_once('-') {
        let a: IpAddr = a
            .trim()
            .parse()
            .map_err(|_| Problem::NotAnAddress(raw.to_string()))?;
        let b: IpAddr = b
            .trim()
            .parse()
            .map_err(|_| Problem::NotAnAddress(raw.to_string()))?;
        if IpFamily::of(&a) != IpFamily::of(&b) {
            return Err(Problem::RangeMixedFamily(raw.to_string()));
        }
        let (lo, hi) = (addr_to_u128(&a), addr_to_u128(&b));
        if lo > hi {
            return Err(Problem::RangeReversed(raw.to_string()));
        }
        return Ok(AddrItem {
            family: IpFamily::of(&a),
            range: AddrRange { lo, hi },
            advice: None,
        });
    }
    if s.contains('/') {
        let (trunc, advice) = parse_cidr(raw)?;
        return Ok(AddrItem {
            family: IpFamily::of(&trunc.addr()),
            range: AddrRange {
                lo: addr_to_u128(&trunc.network()),
                hi: addr_to_u128(&trunc.broadcast()),
            },
            advice,
        });
    }
    let a: IpAddr = s
        .parse()
        .map_err(|_| Problem::NotAnAddress(raw.to_string()))?;
    let v = addr_to_u128(&a);
    Ok(AddrItem {
        family: IpFamily::of(&a),
        range: AddrRange { lo: v, hi: v },
        advice: None,
    })
}

/// Parse one port or `a-b` port range.
pub fn parse_port_item(raw: &str) -> Result<(u16, u16), Problem> {
    let s = raw.trim();
    let bad = || Problem::NotAPort(raw.to_string());
    let parse = |p: &str| -> Result<u16, Problem> {
        let p = p.trim();
        if p.is_empty() || !p.bytes().all(|c| c.is_ascii_digit()) {
            return Err(bad());
        }
        p.parse::<u16>().map_err(|_| bad())
    };
    match s.split_once('-') {
        Some((a, b)) => {
            let (a, b) = (parse(a)?, parse(b)?);
            if a > b {
                return Err(Problem::RangeReversed(raw.to_string()));
            }
            Ok((a, b))
        }
        None => {
            let p = parse(s)?;
            Ok((p, p))
        }
    }
}

/// A NAT `to`: one address, or a CIDR (a prefix mapping; host bits are dropped with advice).
pub fn parse_nat_target(raw: &str) -> Result<(NatTarget, Option<Advice>), Problem> {
    let s = raw.trim();
    if s.contains('/') {
        let (net, advice) = parse_cidr(raw)?;
        return Ok((NatTarget::Prefix(net), advice));
    }
    s.parse::<IpAddr>()
        .map(|a| (NatTarget::Addr(a), None))
        .map_err(|_| Problem::NotAnAddress(raw.to_string()))
}

/// A stable name for a rule written without one: `rule-` and 8 hex digits of an FNV-1a hash of
/// the rule as written (the same rule gets the same name on every host, in every run, and
/// keeps its counters while other rules move).
pub fn generated_rule_name(rule_json: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in rule_json.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("rule-{:08x}", (h >> 32) ^ (h & 0xffff_ffff))
}

/// Split a comma-separated value list, dropping empty items.
pub fn split_list(value: &str) -> Vec<&str> {
    value
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect()
}

/// A parsed integer (decimal or 0x hex) as u32.
pub fn parse_u32(raw: &str) -> Option<u32> {
    let s = raw.trim();
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u32::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert!(parse_addr_item("10.0.0.1").is_ok());
        assert_eq!(
            parse_addr_item("10.0.0.300"),
            Err(Problem::NotAnAddress("10.0.0.300".into()))
        );
        assert_eq!(
            parse_addr_item("10.0.0.9-10.0.0.1"),
            Err(Problem::RangeReversed("10.0.0.9-10.0.0.1".into()))
        );
        assert_eq!(
            parse_addr_item("10.0.0.1-::1"),
            Err(Problem::RangeMixedFamily("10.0.0.1-::1".into()))
        );
        let i = parse_addr_item("10.10.1.67/24").unwrap();
        assert_eq!(
            i.advice,
            Some(Advice::HostBitsSet {
                value: "10.10.1.67/24".into(),
                normalized: "10.10.1.0/24".into()
            })
        );
        assert_eq!(i.family, IpFamily::V4);
        assert_eq!(parse_addr_item("fd00::/64").unwrap().family, IpFamily::V6);
        assert!(parse_addr_item("10.0.0.0/33").is_err());
    }

    #[test]
    fn ports() {
        assert_eq!(parse_port_item("80"), Ok((80, 80)));
        assert_eq!(parse_port_item("3000-4000"), Ok((3000, 4000)));
        assert!(parse_port_item("65536").is_err());
        assert!(parse_port_item("-1").is_err());
        assert!(parse_port_item("4000-3000").is_err());
        assert!(parse_port_item("+80").is_err());
        assert_eq!(parse_port_item("0"), Ok((0, 0)));
    }

    #[test]
    fn nat_targets() {
        assert_eq!(
            parse_nat_target("10.0.0.1"),
            Ok((NatTarget::Addr("10.0.0.1".parse().unwrap()), None))
        );
        let (t, adv) = parse_nat_target("10.70.3.4/16").unwrap();
        assert_eq!(t, NatTarget::Prefix("10.70.0.0/16".parse().unwrap()));
        assert!(adv.is_some());
        assert!(parse_nat_target("10.0.0.1-10.0.0.9").is_err());
    }

    #[test]
    fn generated_names_are_stable_and_distinct() {
        let a = generated_rule_name(r#"{"match":[],"natType":"snat","to":"10.0.0.0/16"}"#);
        assert_eq!(
            a,
            generated_rule_name(r#"{"match":[],"natType":"snat","to":"10.0.0.0/16"}"#)
        );
        assert_ne!(
            a,
            generated_rule_name(r#"{"match":[],"natType":"dnat","to":"10.0.0.0/16"}"#)
        );
        assert!(a.starts_with("rule-") && a.len() == 13, "{a}");
    }

    #[test]
    fn integers() {
        assert_eq!(parse_u32("0x10"), Some(16));
        assert_eq!(parse_u32("65024"), Some(65024));
        assert_eq!(parse_u32("x"), None);
    }
}
