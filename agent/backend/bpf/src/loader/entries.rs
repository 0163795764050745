//! Map contents of a compiled policy as keys and values, and their O(changes) sync into the
//! kernel maps: tries, hashes and arrays written and deleted only where they differ.

use std::collections::{BTreeMap, HashMap};

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{Array, HashMap as BpfHashMap, MapData};
use aya::Pod;
use ipnet::IpNet;
use peerwall_common::{
    AddrKeyData, Bitmap, ChainInfo, DimMasks, HookChains, IfKey, PortKeyData, ProtoKey, RuleInfo,
    ADDR_KEY_FIXED_BITS, MAX_RULES, PORT_KEY_FIXED_BITS,
};

use crate::maps::{family_code, BpfPolicy, ChainMaps};
use peerwall_policy::ir;

use super::{map_err, BpfError};

pub(super) fn only_trie_entries_differ(a: &BpfPolicy, b: &BpfPolicy) -> bool {
    a.hooks == b.hooks
        && a.views == b.views
        && a.chains.len() == b.chains.len()
        && a.chains.iter().zip(&b.chains).all(|(x, y)| {
            x.rules == y.rules
                && x.proto == y.proto
                && x.iif == y.iif
                && x.oif == y.oif
                && x.ct == y.ct
                && x.masks == y.masks
                && x.policy == y.policy
        })
}

pub(super) fn count_changes(a: &BpfPolicy, b: &BpfPolicy) -> usize {
    let diff = |x: BTreeMap<(u32, IpNet), Bitmap>, y: BTreeMap<(u32, IpNet), Bitmap>| {
        x.iter().filter(|(k, v)| y.get(k) != Some(v)).count()
            + y.keys().filter(|k| !x.contains_key(k)).count()
    };
    let pd = |x: BTreeMap<(u32, u16, u8), Bitmap>, y: BTreeMap<(u32, u16, u8), Bitmap>| {
        x.iter().filter(|(k, v)| y.get(k) != Some(v)).count()
            + y.keys().filter(|k| !x.contains_key(k)).count()
    };
    let am = |p: &BpfPolicy, f: fn(&ChainMaps) -> &Vec<(IpNet, Bitmap)>| {
        p.chains
            .iter()
            .flat_map(|c| f(c).iter().map(move |(n, b)| ((c.id, *n), *b)))
            .collect::<BTreeMap<_, _>>()
    };
    let pm = |p: &BpfPolicy, f: fn(&ChainMaps) -> &Vec<(u16, u8, Bitmap)>| {
        p.chains
            .iter()
            .flat_map(|c| f(c).iter().map(move |(port, l, b)| ((c.id, *port, *l), *b)))
            .collect::<BTreeMap<_, _>>()
    };
    diff(am(a, |c| &c.src), am(b, |c| &c.src))
        + diff(am(a, |c| &c.dst), am(b, |c| &c.dst))
        + pd(pm(a, |c| &c.sport), pm(b, |c| &c.sport))
        + pd(pm(a, |c| &c.dport), pm(b, |c| &c.dport))
}

/// LPM key of an address prefix in a chain.
pub fn addr_key(chain: u32, net: &IpNet) -> Key<AddrKeyData> {
    let mut addr = [0u8; 16];
    let fam = match net {
        IpNet::V4(n) => {
            addr[..4].copy_from_slice(&n.network().octets());
            ir::IpFamily::V4
        }
        IpNet::V6(n) => {
            addr.copy_from_slice(&n.network().octets());
            ir::IpFamily::V6
        }
    };
    Key::new(
        ADDR_KEY_FIXED_BITS + u32::from(net.prefix_len()),
        AddrKeyData {
            chain: chain.to_be_bytes(),
            family: u32::from(family_code(fam)).to_be_bytes(),
            addr,
        },
    )
}

/// LPM key of a port prefix in a chain.
pub fn port_key(chain: u32, port: u16, len: u8) -> Key<PortKeyData> {
    Key::new(
        PORT_KEY_FIXED_BITS + u32::from(len),
        PortKeyData {
            chain: chain.to_be_bytes(),
            port: port.to_be_bytes(),
            _pad: [0; 2],
        },
    )
}

pub(super) type KeyBytes = Vec<u8>;

pub(super) use crate::maps::is_host;

pub(super) fn bytes_of<T: Pod>(v: &T) -> Vec<u8> {
    // SAFETY: Pod types are plain bytes.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
        .to_vec()
}

pub(super) fn port_entries(
    p: &BpfPolicy,
    f: fn(&ChainMaps) -> &Vec<(u16, u8, Bitmap)>,
) -> HashMap<KeyBytes, (Key<PortKeyData>, Bitmap)> {
    p.chains
        .iter()
        .flat_map(|c| {
            f(c).iter().map(move |(port, l, b)| {
                let k = port_key(c.id, *port, *l);
                (bytes_of(&k), (k, *b))
            })
        })
        .collect()
}

pub(super) fn proto_entries(p: &BpfPolicy) -> HashMap<KeyBytes, (ProtoKey, Bitmap)> {
    p.chains
        .iter()
        .flat_map(|c| {
            c.proto.iter().map(move |(fam, pr, b)| {
                let k = ProtoKey {
                    chain: c.id,
                    family: *fam,
                    proto: pr.unwrap_or(0),
                    // `_pad[0] = 1` marks the "other protocols" entry of a family.
                    _pad: [u8::from(pr.is_none()), 0],
                };
                (bytes_of(&k), (k, *b))
            })
        })
        .collect()
}

pub(super) fn if_entries(
    p: &BpfPolicy,
    f: fn(&ChainMaps) -> &Vec<(u32, Bitmap)>,
) -> HashMap<KeyBytes, (IfKey, Bitmap)> {
    p.chains
        .iter()
        .flat_map(|c| {
            f(c).iter().map(move |(i, b)| {
                let k = IfKey {
                    chain: c.id,
                    ifindex: *i,
                };
                (bytes_of(&k), (k, *b))
            })
        })
        .collect()
}

/// `CT<s>`: every chain's slots ([`crate::maps::ChainMaps::ct_slots`]).
pub(super) fn ct_entries(p: &BpfPolicy) -> BTreeMap<u32, Bitmap> {
    p.chains
        .iter()
        .flat_map(|c| {
            c.ct_slots()
                .into_iter()
                .enumerate()
                .map(move |(s, b)| (c.id * peerwall_common::ct::SLOTS + s as u32, b))
        })
        .collect()
}

/// `START` entries of policy slot `slot`: the start bitmap of each chain and family where its
/// protocol entries hold one ([`ChainMaps::start`]), at [`peerwall_common::start_index`].
pub(super) fn start_entries(slot: u32, p: &BpfPolicy) -> BTreeMap<u32, Bitmap> {
    p.chains
        .iter()
        .flat_map(|c| {
            (0..2).filter_map(move |f| {
                c.start(f)
                    .map(|b| (peerwall_common::start_index(slot, c.id, f), b))
            })
        })
        .collect()
}

/// Bring slot `slot`'s part of `START` (one map for both slots) from `old`'s start bitmaps to
/// `new`'s; with `old` unknown, every index of the part is written (the other slot's stay).
pub(super) fn sync_start(
    map: &mut aya::maps::Map,
    slot: u32,
    old: Option<&BpfPolicy>,
    new: &BpfPolicy,
) -> Result<usize, BpfError> {
    let name = peerwall_common::map::START;
    let new = start_entries(slot, new);
    let mut m: Array<&mut MapData, Bitmap> = Array::try_from(map).map_err(map_err(name))?;
    let mut n = 0;
    let Some(old) = old.map(|o| start_entries(slot, o)) else {
        let first = peerwall_common::start_index(slot, 0, 0);
        for i in first..first + peerwall_common::MAX_CHAINS * 2 {
            let v = new.get(&i).copied().unwrap_or(Bitmap::EMPTY);
            m.set(i, v, 0).map_err(map_err(name))?;
            n += 1;
        }
        return Ok(n);
    };
    write_changes(&mut m, name, &old, &new, Bitmap::EMPTY)
}

pub(super) fn mask_entries(p: &BpfPolicy) -> BTreeMap<u32, DimMasks> {
    p.chains
        .iter()
        .flat_map(|c| {
            c.masks
                .iter()
                .enumerate()
                .map(move |(d, m)| (c.id * 4 + d as u32, *m))
        })
        .collect()
}

pub(super) fn rule_entries(p: &BpfPolicy) -> BTreeMap<u32, RuleInfo> {
    p.chains
        .iter()
        .flat_map(|c| {
            c.rule_infos()
                .into_iter()
                .enumerate()
                .map(move |(r, i)| (c.id * MAX_RULES as u32 + r as u32, i))
        })
        .collect()
}

/// Who counts at each `COUNTERS` index the table holds (below `capacity`): each chain's
/// rules, then its policy.
pub(super) fn owner_entries(p: &BpfPolicy, capacity: u32) -> BTreeMap<u32, u32> {
    p.chains
        .iter()
        .flat_map(|c| {
            let rules = c.rules.len() as u32;
            (0..=rules).map(move |r| {
                let who = (r < rules).then_some(r);
                (c.counters + r, peerwall_common::counter_owner(c.id, who))
            })
        })
        .filter(|(i, _)| *i < capacity)
        .collect()
}

/// `CHAINS` values, the exact-match maps holding `hosts` each. A dimension with more hosts
/// than that keeps the others in its trie ([`super::layout`]), so no chain may skip that trie.
pub(super) fn chain_entries(p: &BpfPolicy, hosts: u32) -> BTreeMap<u32, ChainInfo> {
    use peerwall_common::constrained as c;
    let cap = hosts as usize;
    let mut keep = 0;
    if p.host_count(true) > cap {
        keep |= c::SRC_NO_PREFIXES;
    }
    if p.host_count(false) > cap {
        keep |= c::DST_NO_PREFIXES;
    }
    p.chains
        .iter()
        .map(|ch| {
            let mut i = ch.info();
            i.constrained &= !keep;
            (ch.id, i)
        })
        .collect()
}

pub(super) fn hook_entries(p: &BpfPolicy) -> BTreeMap<u32, HookChains> {
    p.hooks
        .iter()
        .enumerate()
        .map(|(i, h)| (i as u32, *h))
        .collect()
}

/// The operations a keyed map needs for syncing.
trait Keyed<K> {
    fn put(&mut self, k: &K, v: &Bitmap) -> Result<(), aya::maps::MapError>;
    fn del(&mut self, k: &K) -> Result<(), aya::maps::MapError>;
    fn all_keys(&self) -> Vec<K>;
}

impl<K: Pod> Keyed<Key<K>> for LpmTrie<&mut MapData, K, Bitmap> {
    fn put(&mut self, k: &Key<K>, v: &Bitmap) -> Result<(), aya::maps::MapError> {
        self.insert(k, v, 0)
    }
    fn del(&mut self, k: &Key<K>) -> Result<(), aya::maps::MapError> {
        self.remove(k)
    }
    fn all_keys(&self) -> Vec<Key<K>> {
        self.keys().filter_map(Result::ok).collect()
    }
}

impl<K: Pod> Keyed<K> for BpfHashMap<&mut MapData, K, Bitmap> {
    fn put(&mut self, k: &K, v: &Bitmap) -> Result<(), aya::maps::MapError> {
        self.insert(k, v, 0)
    }
    fn del(&mut self, k: &K) -> Result<(), aya::maps::MapError> {
        self.remove(k)
    }
    fn all_keys(&self) -> Vec<K> {
        self.keys().filter_map(Result::ok).collect()
    }
}

/// Make a map hold `new`: with the old contents known, only the differences (O(changes));
/// otherwise clear it and write everything.
fn sync_keyed<K, M: Keyed<K>>(
    m: &mut M,
    name: &str,
    old: Option<HashMap<KeyBytes, (K, Bitmap)>>,
    new: HashMap<KeyBytes, (K, Bitmap)>,
) -> Result<usize, BpfError> {
    let mut n = 0;
    match old {
        Some(old) => {
            for (kb, (k, _)) in &old {
                if !new.contains_key(kb) {
                    m.del(k).map_err(map_err(name))?;
                    n += 1;
                }
            }
            for (kb, (k, v)) in &new {
                if old.get(kb).map(|(_, ov)| ov) != Some(v) {
                    m.put(k, v).map_err(map_err(name))?;
                    n += 1;
                }
            }
        }
        None => {
            // A slot about to go live must hold exactly the new policy: a stale entry that
            // cannot be deleted fails the write (the live slot stays in force).
            for k in m.all_keys() {
                m.del(&k).map_err(map_err(name))?;
                n += 1;
            }
            for (k, v) in new.values() {
                m.put(k, v).map_err(map_err(name))?;
                n += 1;
            }
        }
    }
    Ok(n)
}

pub(super) fn sync_trie<K: Pod>(
    map: &mut aya::maps::Map,
    name: &str,
    old: Option<HashMap<KeyBytes, (Key<K>, Bitmap)>>,
    new: HashMap<KeyBytes, (Key<K>, Bitmap)>,
) -> Result<usize, BpfError> {
    let mut m: LpmTrie<&mut MapData, K, Bitmap> = LpmTrie::try_from(map).map_err(map_err(name))?;
    sync_keyed(&mut m, name, old, new)
}

pub(super) fn sync_hash<K: Pod>(
    map: &mut aya::maps::Map,
    name: &str,
    old: Option<HashMap<KeyBytes, (K, Bitmap)>>,
    new: HashMap<KeyBytes, (K, Bitmap)>,
) -> Result<usize, BpfError> {
    let mut m: BpfHashMap<&mut MapData, K, Bitmap> =
        BpfHashMap::try_from(map).map_err(map_err(name))?;
    sync_keyed(&mut m, name, old, new)
}

pub(super) fn sync_array<V: Pod + PartialEq>(
    map: &mut aya::maps::Map,
    name: &str,
    old: Option<BTreeMap<u32, V>>,
    new: BTreeMap<u32, V>,
    empty: V,
) -> Result<usize, BpfError> {
    let Some(old) = old else {
        // Arrays cannot be emptied: reset every slot a previous policy might have used (in one
        // system call, `batch.rs`).
        super::batch::fill_array(map, name, |i| new.get(&i).copied().unwrap_or(empty))?;
        return Ok(new.len());
    };
    let mut m: Array<&mut MapData, V> = Array::try_from(map).map_err(map_err(name))?;
    write_changes(&mut m, name, &old, &new, empty)
}

/// Write into array `m` what differs from `old` in `new` (an index `new` lacks: `empty`);
/// returns the entries written.
fn write_changes<V: Pod + PartialEq>(
    m: &mut Array<&mut MapData, V>,
    name: &str,
    old: &BTreeMap<u32, V>,
    new: &BTreeMap<u32, V>,
    empty: V,
) -> Result<usize, BpfError> {
    let mut n = 0;
    for i in old.keys() {
        if !new.contains_key(i) {
            m.set(*i, empty, 0).map_err(map_err(name))?;
            n += 1;
        }
    }
    for (i, v) in new {
        if old.get(i) != Some(v) {
            m.set(*i, *v, 0).map_err(map_err(name))?;
            n += 1;
        }
    }
    Ok(n)
}

/// Make a `VIEW` trie hold exactly `views` (a handful of entries: rewritten whole).
pub(super) fn sync_views(
    map: &mut aya::maps::Map,
    name: &str,
    views: &[crate::maps::ViewEntry],
) -> Result<usize, BpfError> {
    let mut m: LpmTrie<&mut MapData, AddrKeyData, peerwall_common::ViewTarget> =
        LpmTrie::try_from(map).map_err(map_err(name))?;
    let mut n = 0;
    let stale: Vec<Key<AddrKeyData>> = m.keys().filter_map(Result::ok).collect();
    for k in stale {
        m.remove(&k).map_err(map_err(name))?;
        n += 1;
    }
    for v in views {
        let mut to = [0u8; 16];
        match v.to {
            IpNet::V4(t) => to[..4].copy_from_slice(&t.network().octets()),
            IpNet::V6(t) => to.copy_from_slice(&t.network().octets()),
        }
        let target = peerwall_common::ViewTarget {
            to,
            prefix_len: u32::from(v.from.prefix_len()),
        };
        m.insert(&addr_key(v.ifindex, &v.from), target, 0)
            .map_err(map_err(name))?;
        n += 1;
    }
    Ok(n)
}

/// Whether a map error says the key was not there (a deletion that is already done).
fn absent(e: &aya::maps::MapError) -> bool {
    match e {
        aya::maps::MapError::KeyNotFound => true,
        aya::maps::MapError::SyscallError(s) => s.io_error.raw_os_error() == Some(libc::ENOENT),
        _ => false,
    }
}

/// Write address-entry changes into the maps of one slot (`slot` as a map-name suffix): hosts
/// to the exact-match maps, other prefixes to the tries (so only while every host fits the
/// exact-match maps: `Layout::fits` in `layout.rs`). Upserts first, deletions after, so an
/// address whose entry moves from a host to an enclosing prefix (or back) is never without
/// one. Returns the entries written or deleted.
pub(super) fn write_addr_changes(
    ebpf: &mut aya::Ebpf,
    slot: &str,
    changes: &[crate::maps::AddrEntryChange],
) -> Result<usize, BpfError> {
    let mut n = 0;
    for deleting in [false, true] {
        for ch in changes.iter().filter(|c| c.value.is_none() == deleting) {
            let host = is_host(&ch.net);
            let base = match (ch.dir, host) {
                (ir::Dir::Src, false) => peerwall_common::map::SRC,
                (ir::Dir::Src, true) => peerwall_common::map::SRCH,
                (ir::Dir::Dst, false) => peerwall_common::map::DST,
                (ir::Dir::Dst, true) => peerwall_common::map::DSTH,
            };
            let name = format!("{base}{slot}");
            let map = ebpf
                .map_mut(&name)
                .ok_or_else(|| BpfError::MissingMap(name.clone()))?;
            let key = addr_key(ch.chain, &ch.net);
            if host {
                let mut m: BpfHashMap<&mut MapData, AddrKeyData, Bitmap> =
                    BpfHashMap::try_from(map).map_err(map_err(&name))?;
                match ch.value {
                    Some(b) => m.insert(key.data(), b, 0).map_err(map_err(&name))?,
                    None => match m.remove(&key.data()) {
                        Err(e) if !absent(&e) => return Err(map_err(&name)(e)),
                        _ => {}
                    },
                }
            } else {
                let mut m: LpmTrie<&mut MapData, AddrKeyData, Bitmap> =
                    LpmTrie::try_from(map).map_err(map_err(&name))?;
                match ch.value {
                    Some(b) => m.insert(&key, b, 0).map_err(map_err(&name))?,
                    None => match m.remove(&key) {
                        Err(e) if !absent(&e) => return Err(map_err(&name)(e)),
                        _ => {}
                    },
                }
            }
            n += 1;
        }
    }
    Ok(n)
}
