//! Where a policy's host addresses go: the exact-match maps (`SRCH<s>`, `DSTH<s>`) hold at most
//! their `max_entries` each, and the kernel allocates a hash map's buckets for all of them up
//! front (16 bytes per power-of-two slot, whether or not a policy fills them), so their size is
//! a memory choice (`--host-table-size`). A dimension with more hosts than that keeps the first
//! ones in key order in the exact-match map and puts the others into the dimension's trie as
//! full-length prefixes: the datapath looks the host map up first and the trie on a miss, and a
//! /32 (/128) entry is the trie's longest match for its address, so the answer is the same
//! bitmap either way; only those hosts' lookups walk the trie.
//!
//! The placement is a pure function of the policy and the capacity, so a slot's old and new
//! contents are compared entry by entry in the same layout. Changes made in place on the live
//! slot move no host between the two maps: they are taken only while every dimension fits
//! ([`Layout::fits`]); otherwise the idle slot is written whole.

use std::collections::HashMap;

use aya::maps::lpm_trie::Key;
use ipnet::IpNet;
use peerwall_common::{AddrKeyData, Bitmap};

use super::entries::{addr_key, bytes_of, is_host, KeyBytes};
use super::{map_err, BpfError};
use crate::maps::{BpfPolicy, ChainMaps};

/// The exact-match host maps of both slots, by pin name (`<SRCH|DSTH><slot>`).
pub(super) const HOST_MAPS: [&str; 4] = ["SRCH0", "SRCH1", "DSTH0", "DSTH1"];
/// The counters of both slots and who counts at each index (`<COUNTERS|OWNERS><slot>`).
pub(super) const COUNTER_MAPS: [&str; 4] = ["COUNTERS0", "COUNTERS1", "OWNERS0", "OWNERS1"];

/// The address entries of one dimension of every chain (source or destination).
pub(super) type Addresses = fn(&ChainMaps) -> &Vec<(IpNet, Bitmap)>;

/// The capacities of the maps the datapath was loaded with whose size is a memory choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Hosts each `SRCH<s>` / `DSTH<s>` map holds (its `max_entries`).
    pub hosts: u32,
    /// Counters each `COUNTERS<s>` (and `OWNERS<s>`) map holds: rules at indices past it are
    /// not counted.
    pub counters: u32,
}

/// The hosts of dimension `f` of every chain, in key order where more than `cap` (then the
/// order decides which fit); as they come otherwise (every one fits: no sort on the common
/// path, which policy changes take).
fn hosts_in_order(
    p: &BpfPolicy,
    f: Addresses,
    cap: u32,
) -> Vec<(KeyBytes, Key<AddrKeyData>, Bitmap)> {
    let mut all: Vec<_> = p
        .chains
        .iter()
        .flat_map(|c| {
            f(c).iter().filter(|(n, _)| is_host(n)).map(move |(n, b)| {
                let k = addr_key(c.id, n);
                (bytes_of(&k.data()), k, *b)
            })
        })
        .collect();
    if all.len() > cap as usize {
        all.sort_by(|a, b| a.0.cmp(&b.0));
    }
    all
}

impl Layout {
    /// Whether every host of both address dimensions of `p` fits the exact-match maps (then
    /// none is in a trie).
    pub(super) fn fits(&self, p: &BpfPolicy) -> bool {
        [p.host_count(true), p.host_count(false)]
            .iter()
            .all(|n| *n <= self.hosts as usize)
    }

    /// Exact-match entries of dimension `f`: its first hosts in key order, as many as the map
    /// holds. A host's bitmap already carries the rules of every enclosing prefix, so "host
    /// map, else trie" is the trie's answer.
    pub(super) fn host_entries(
        &self,
        p: &BpfPolicy,
        f: Addresses,
    ) -> HashMap<KeyBytes, (AddrKeyData, Bitmap)> {
        hosts_in_order(p, f, self.hosts)
            .into_iter()
            .take(self.hosts as usize)
            .map(|(kb, k, b)| (kb, (k.data(), b)))
            .collect()
    }

    /// Trie entries of dimension `f`: every prefix that is not a host, and the hosts the
    /// exact-match map has no room for.
    pub(super) fn trie_entries(
        &self,
        p: &BpfPolicy,
        f: Addresses,
    ) -> HashMap<KeyBytes, (Key<AddrKeyData>, Bitmap)> {
        let prefixes = p.chains.iter().flat_map(|c| {
            f(c).iter().filter(|(n, _)| !is_host(n)).map(move |(n, b)| {
                let k = addr_key(c.id, n);
                (bytes_of(&k), (k, *b))
            })
        });
        let mut out: HashMap<_, _> = prefixes.collect();
        let hosts: usize = p
            .chains
            .iter()
            .map(|c| f(c).iter().filter(|(n, _)| is_host(n)).count())
            .sum();
        if hosts > self.hosts as usize {
            out.extend(
                hosts_in_order(p, f, self.hosts)
                    .into_iter()
                    .skip(self.hosts as usize)
                    .map(|(_, k, b)| (bytes_of(&k), (k, b))),
            );
        }
        out
    }
}

impl super::Datapath {
    /// The host maps' capacity as loaded: the smallest `max_entries` of the four (a map an
    /// older peerwall pinned keeps the size it was created with).
    pub(super) fn read_layout(&mut self) -> Result<Layout, BpfError> {
        let mut hosts = u32::MAX;
        for name in HOST_MAPS {
            let info = match self.map(name)? {
                aya::maps::Map::HashMap(d) => d.info().map_err(map_err(name))?,
                _ => return Err(BpfError::MissingMap(name.to_string())),
            };
            hosts = hosts.min(info.max_entries());
        }
        let mut counters = u32::MAX;
        for name in COUNTER_MAPS {
            let info = match self.map(name)? {
                aya::maps::Map::PerCpuArray(d) | aya::maps::Map::Array(d) => {
                    d.info().map_err(map_err(name))?
                }
                _ => return Err(BpfError::MissingMap(name.to_string())),
            };
            counters = counters.min(info.max_entries());
        }
        Ok(Layout { hosts, counters })
    }

    /// How many hosts the exact-match maps and how many counters the counter table hold.
    pub fn layout(&self) -> Layout {
        self.layout
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use peerwall_common::DimMasks;
    use peerwall_policy::ir::{Hook, VerdictAction};

    /// The longest prefix of `entries` holding `a`, as the trie answers.
    fn lpm(entries: &[(IpNet, Bitmap)], a: &std::net::IpAddr) -> Option<Bitmap> {
        entries
            .iter()
            .filter(|(n, _)| n.contains(a))
            .max_by_key(|(n, _)| n.prefix_len())
            .map(|(_, b)| *b)
    }

    /// A policy whose one chain has `hosts` source hosts and one enclosing prefix.
    fn policy(hosts: u8) -> BpfPolicy {
        let none = DimMasks {
            any: Bitmap::EMPTY,
            neg: Bitmap::EMPTY,
        };
        let mut src = vec![("10.0.0.0/8".parse().unwrap(), Bitmap::EMPTY)];
        for i in 0..hosts {
            let mut b = Bitmap::EMPTY;
            b.w[0] = 1 << (i % 64);
            src.push((format!("10.0.0.{i}/32").parse().unwrap(), b));
        }
        let c = ChainMaps {
            id: 0,
            table: "t".into(),
            chain: "c".into(),
            hook: Hook::Forward,
            policy: VerdictAction::Accept,
            audit: false,
            rules: Vec::new(),
            proto: Vec::new(),
            src,
            dst: Vec::new(),
            sport: Vec::new(),
            dport: Vec::new(),
            masks: [none; 4],
            iif: Vec::new(),
            oif: Vec::new(),
            ct: [Bitmap::EMPTY; 5],
            counters: 0,
        };
        BpfPolicy {
            chains: vec![c],
            ..BpfPolicy::default()
        }
    }

    #[test]
    fn hosts_beyond_the_capacity_go_to_the_trie_and_answer_the_same() {
        let p = policy(10);
        let src: Addresses = |c| &c.src;
        for cap in [0, 3, 10, 64] {
            let l = Layout {
                hosts: cap,
                counters: 0,
            };
            let hash = l.host_entries(&p, src);
            let trie = l.trie_entries(&p, src);
            assert_eq!(hash.len(), 10.min(cap as usize), "cap {cap}");
            // Every host in exactly one of the two, the prefix in the trie.
            assert_eq!(hash.len() + trie.len(), 11, "cap {cap}");
            assert_eq!(l.fits(&p), cap >= 10, "cap {cap}");
            // The datapath's lookup (host map, else the trie's longest match) gives each
            // address the bitmap of the whole policy's longest match.
            let trie_v: Vec<(IpNet, Bitmap)> = trie
                .values()
                .map(|(k, b)| {
                    let d = k.data();
                    let a = std::net::Ipv4Addr::new(d.addr[0], d.addr[1], d.addr[2], d.addr[3]);
                    let len = (k.prefix_len() - peerwall_common::ADDR_KEY_FIXED_BITS) as u8;
                    (IpNet::new(a.into(), len).unwrap(), *b)
                })
                .collect();
            for i in 0..12u8 {
                let a: std::net::IpAddr = format!("10.0.0.{i}").parse().unwrap();
                let kd = addr_key(0, &format!("{a}/32").parse().unwrap()).data();
                let got = hash
                    .get(&bytes_of(&kd))
                    .map(|(_, b)| *b)
                    .or_else(|| lpm(&trie_v, &a));
                let want = lpm(&p.chains[0].src, &a);
                assert_eq!(got, want, "cap {cap}, {a}");
            }
        }
    }

    #[test]
    fn host_map_names_are_the_datapaths() {
        use peerwall_common::map;
        let want: Vec<String> = [map::SRCH, map::DSTH]
            .iter()
            .flat_map(|b| (0..2).map(move |s| format!("{b}{s}")))
            .collect();
        assert_eq!(HOST_MAPS.to_vec(), want);
        let want: Vec<String> = [map::COUNTERS, map::OWNERS]
            .iter()
            .flat_map(|b| (0..2).map(move |s| format!("{b}{s}")))
            .collect();
        assert_eq!(COUNTER_MAPS.to_vec(), want);
    }

    #[test]
    fn the_placement_is_the_same_whatever_the_entries_order() {
        let p = policy(20);
        let mut q = p.clone();
        q.chains[0].src.reverse();
        let l = Layout {
            hosts: 7,
            counters: 0,
        };
        let src: Addresses = |c| &c.src;
        let keys = |p: &BpfPolicy| {
            let mut k: Vec<_> = l.host_entries(p, src).into_keys().collect();
            k.sort();
            k
        };
        assert_eq!(keys(&p), keys(&q));
    }
}
