//! The one-line host tables (`HOST_LINES`; layout and invariant:
//! `peerwall_common::lines`): their contents computed from a slot's host maps ([`image`]), and
//! written through the map's memory as single aligned `u64` stores, in one of two ways:
//!
//! - **Whole** ([`whole`]), where no packet reads the lines: a slot not live, or a table that
//!   is off. The header is turned off first and on last, after every line is written.
//! - **In place** ([`in_place`], [`forget`]), on the live slot while packets flow: only stores
//!   that send a lookup to the host map. A changed line first gets its overflow bit, then each
//!   key it no longer holds with the same word is cleared; no word or key is ever written in
//!   place. Run before the host maps change, so every answer is the old host map's or the new
//!   one's. The next whole write of the slot puts the hosts back into their lines.
//!
//! Tables are turned on only on x86-64, where the datapath's ordered reads (`ebpf/src/lines.rs`)
//! see a cleared key's overflow bit; elsewhere they stay off and every lookup asks the host map.
//! The load turns every table off ([`Datapath::lines_off`]), before any program it loads can run:
//! tables an older peerwall left pinned beside host maps it changed may be stale.

use std::collections::HashMap;

use peerwall_common::{
    family, host_line_entries, host_line_entry, host_line_key, host_line_of, host_table, map,
    AddrKeyData, Bitmap, HostLine, HOST_LINES_ON, HOST_LINE_OVERFLOW, HOST_LINE_SLOTS, HOST_TABLES,
};

use ipnet::IpNet;
use peerwall_policy::ir;

use super::entries::KeyBytes;
use super::layout::Addresses;
use super::{map_err, BpfError, Datapath};
use crate::maps::{AddrEntryChange, BpfPolicy};

/// Whether tables may be turned on here (see the module).
const LINES_SOUND: bool = cfg!(target_arch = "x86_64");

/// One store: word `1` of entry `0` is word index 1, word `w` of entry `e` is `e * 8 + w`.
pub(super) type Store = (usize, u64);

/// The table of `lines` lines holding the IPv4 hosts of `hosts` (a slot's host map: key data
/// and bitmap), in key order within each line; a line's hosts past its slots set its overflow
/// bit. Entry 0 stands for the table's header (its word 0), the lines follow from entry 1.
/// The header is on only where at least half the hosts have a slot: a host of an overflowed
/// line costs the line's read and then the host map's lookup, one read more than without the
/// table, which saves two (the bucket and the element's second line) for a host in a slot; a
/// policy with many more hosts than the table has slots (`--host-table-size` filled) keeps it
/// off. None where `lines` is not a power of two.
pub(super) fn image(
    hosts: &HashMap<KeyBytes, (AddrKeyData, Bitmap)>,
    lines: u32,
) -> Option<Vec<HostLine>> {
    let mask = Some(lines).filter(|n| n.is_power_of_two())? - 1;
    let entries = lines + 1;
    let mut keyed: Vec<(u32, u64, u64)> = hosts
        .values()
        .filter(|(k, _)| k.family == u32::from(family::V4).to_be_bytes())
        .map(|(k, b)| {
            let chain = u32::from_be_bytes(k.chain);
            let key = host_line_key(chain, [k.addr[0], k.addr[1], k.addr[2], k.addr[3]]);
            (host_line_of(key, mask), key, b.w[0])
        })
        .collect();
    keyed.sort_unstable();
    let mut out = vec![HostLine::EMPTY; entries as usize];
    let mut used = vec![0usize; entries as usize];
    let total = keyed.len();
    let mut placed = 0;
    for (line, key, word) in keyed {
        let (l, n) = (line as usize, &mut used[line as usize]);
        if *n < HOST_LINE_SLOTS {
            out[l].w[1 + 2 * *n] = key;
            out[l].w[2 + 2 * *n] = word;
            *n += 1;
            placed += 1;
        } else {
            out[l].w[0] |= HOST_LINE_OVERFLOW;
        }
    }
    if placed * 2 >= total {
        out[0].w[0] = HOST_LINES_ON | u64::from(mask);
    }
    Some(out)
}

/// Whether a table's header says it is on.
fn on(t: &[HostLine]) -> bool {
    t.first().is_some_and(|h| h.w[0] & HOST_LINES_ON != 0)
}

/// The stores that bring `current` to `want` where no packet reads the lines: the header off,
/// every other word that differs, the header last (on only where [`LINES_SOUND`]).
pub(super) fn whole(current: &[HostLine], want: &[HostLine]) -> Vec<Store> {
    let mut out = Vec::new();
    if current.first().is_some_and(|h| h.w[0] != 0) {
        out.push((0, 0));
    }
    for (e, (c, w)) in current.iter().zip(want).enumerate().skip(1) {
        for i in 0..8 {
            if c.w[i] != w.w[i] {
                out.push((e * 8 + i, w.w[i]));
            }
        }
    }
    if LINES_SOUND && current.len() == want.len() {
        if let Some(h) = want.first() {
            out.push((0, h.w[0]));
        }
    }
    out
}

/// The stores that make `current`, live, give no answer `want` would not (see the module):
/// none where the table is off.
pub(super) fn in_place(current: &[HostLine], want: &[HostLine]) -> Vec<Store> {
    let mut out = Vec::new();
    if !on(current) || current.len() != want.len() {
        return out;
    }
    for (e, (c, w)) in current.iter().zip(want).enumerate().skip(1) {
        if c == w {
            continue;
        }
        if c.w[0] & HOST_LINE_OVERFLOW == 0 {
            out.push((e * 8, c.w[0] | HOST_LINE_OVERFLOW));
        }
        for i in 0..HOST_LINE_SLOTS {
            let (key, word) = (c.w[1 + 2 * i], c.w[2 + 2 * i]);
            let kept =
                (0..HOST_LINE_SLOTS).any(|j| w.w[1 + 2 * j] == key && w.w[2 + 2 * j] == word);
            if key != 0 && !kept {
                out.push((e * 8 + 1 + 2 * i, 0));
            }
        }
    }
    out
}

/// The stores that make `current`, live, send each of `keys` (hosts about to change in the
/// host map) to the host map: their lines' overflow bits, then their slots' keys cleared.
pub(super) fn forget(current: &[HostLine], keys: &[u64]) -> Vec<Store> {
    let mut out = Vec::new();
    if !on(current) {
        return out;
    }
    let mask = current[0].w[0] as u32;
    let mut marked = std::collections::HashSet::new();
    for &key in keys {
        let e = host_line_of(key, mask) as usize;
        let Some(c) = current.get(e) else {
            continue;
        };
        if c.w[0] & HOST_LINE_OVERFLOW == 0 && marked.insert(e) {
            out.push((e * 8, c.w[0] | HOST_LINE_OVERFLOW));
        }
        for i in 0..HOST_LINE_SLOTS {
            if c.w[1 + 2 * i] == key {
                out.push((e * 8 + 1 + 2 * i, 0));
            }
        }
    }
    out
}

/// `HOST_LINES` mapped into this process (the datapath creates it `BPF_F_MMAPABLE`), read and
/// written one aligned `u64` at a time; a table of it seen as [`image`] lays one out (its
/// header as entry 0's word 0, then its lines).
pub(super) struct LineTables {
    words: *mut u64,
    entries: usize,
    /// Lines per table; None where the map is not of this layout (its tables stay off).
    lines: Option<u32>,
}

impl LineTables {
    /// Map `HOST_LINES` of `dp`.
    fn map(dp: &mut Datapath) -> Result<Self, BpfError> {
        let name = map::HOST_LINES;
        let d = match dp.map(name)? {
            aya::maps::Map::Array(d) => d,
            _ => return Err(BpfError::MissingMap(name.to_string())),
        };
        let info = d.info().map_err(map_err(name))?;
        if info.value_size() as usize != std::mem::size_of::<HostLine>() {
            return Err(BpfError::MissingMap(name.to_string()));
        }
        let entries = info.max_entries();
        let lines = Some((entries.saturating_sub(1)) / HOST_TABLES)
            .filter(|l| l.is_power_of_two() && host_line_entries(*l) == entries);
        let len = entries as usize * std::mem::size_of::<HostLine>();
        // Unmapped on drop, accessed only through volatile `u64` reads and writes below.
        let p = super::mapping::map_values(d, len, true).map_err(|source| BpfError::Io {
            path: name.into(),
            source,
        })?;
        Ok(Self {
            words: p.cast(),
            entries: entries as usize,
            lines,
        })
    }

    /// The index in the map's words of word `i` of entry `e` of table `t` as [`image`] lays it
    /// out; None past the map.
    fn word(&self, t: u32, e: usize, i: usize) -> Option<usize> {
        let w = match (e, self.lines) {
            (0, _) if i == 0 && t < HOST_TABLES => t as usize,
            (0, _) => return None,
            (_, Some(l)) => host_line_entry(t, e as u32, l - 1) as usize * 8 + i,
            (_, None) => return None,
        };
        (w < self.entries * 8 && i < 8).then_some(w)
    }

    /// Table `t` as it is now (its header alone where the map is of another layout).
    fn read(&self, t: u32) -> Vec<HostLine> {
        let n = self.lines.map_or(1, |l| l as usize + 1);
        (0..n)
            .map(|e| {
                let mut l = HostLine::EMPTY;
                for (i, w) in l.w.iter_mut().enumerate() {
                    if let Some(at) = self.word(t, e, i) {
                        // SAFETY: within the mapping (`word`), 8-byte aligned.
                        *w = unsafe { std::ptr::read_volatile(self.words.add(at)) };
                    }
                }
                l
            })
            .collect()
    }

    /// Make `stores` to table `t`, in order, each visible before the next (a release fence
    /// between).
    fn write(&self, t: u32, stores: &[Store]) {
        for &(i, v) in stores {
            if let Some(at) = self.word(t, i / 8, i % 8) {
                std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
                // SAFETY: within the mapping (`word`), 8-byte aligned.
                unsafe { std::ptr::write_volatile(self.words.add(at), v) };
            }
        }
    }
}

impl Drop for LineTables {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, not used after this.
        unsafe {
            libc::munmap(
                self.words.cast(),
                self.entries * std::mem::size_of::<HostLine>(),
            )
        };
    }
}

/// A slot's host maps' new contents, source first.
pub(super) type SlotHosts = [HashMap<KeyBytes, (AddrKeyData, Bitmap)>; 2];

impl Datapath {
    /// The host-map contents of `p` (`layout.rs`), source first.
    pub(super) fn slot_hosts(&self, p: &BpfPolicy) -> SlotHosts {
        let (src, dst): (Addresses, Addresses) = (|c| &c.src, |c| &c.dst);
        [
            self.layout.host_entries(p, src),
            self.layout.host_entries(p, dst),
        ]
    }

    /// Turn every table off (the load, before its programs run).
    pub(super) fn lines_off(&mut self) -> Result<(), BpfError> {
        let t = LineTables::map(self)?;
        for table in 0..HOST_TABLES {
            t.write(table, &[(0, 0)]);
        }
        Ok(())
    }

    /// Bring slot `slot`'s tables to `hosts` (its host maps' new contents): in place when
    /// `live`, else whole. Returns the words written.
    pub(super) fn write_lines(
        &mut self,
        slot: u32,
        hosts: &SlotHosts,
        live: bool,
    ) -> Result<usize, BpfError> {
        let t = LineTables::map(self)?;
        let mut n = 0;
        for (dst, h) in [false, true].into_iter().zip(hosts) {
            let table = host_table(slot, dst);
            let current = t.read(table);
            let stores = match t.lines.and_then(|l| image(h, l)) {
                Some(want) if live => in_place(&current, &want),
                Some(want) => whole(&current, &want),
                // Another layout: off, whatever it holds.
                None => vec![(0, 0)],
            };
            t.write(table, &stores);
            n += stores.len();
        }
        Ok(n)
    }

    /// Send the IPv4 hosts `keys` (source first) of live slot `slot`'s tables to the host map.
    pub(super) fn forget_lines(
        &mut self,
        slot: u32,
        keys: &[Vec<u64>; 2],
    ) -> Result<usize, BpfError> {
        if keys.iter().all(Vec::is_empty) {
            return Ok(0);
        }
        let t = LineTables::map(self)?;
        let mut n = 0;
        for (dst, k) in [false, true].into_iter().zip(keys) {
            let table = host_table(slot, dst);
            let stores = forget(&t.read(table), k);
            t.write(table, &stores);
            n += stores.len();
        }
        Ok(n)
    }
}

/// The IPv4 hosts (line keys) `delta` changes, source first: those whose lines must send them
/// to the host map before it changes.
pub(super) fn changed_hosts(delta: &[AddrEntryChange]) -> [Vec<u64>; 2] {
    let keys = |dir: ir::Dir| {
        delta
            .iter()
            .filter(|c| c.dir == dir)
            .filter_map(|c| match c.net {
                IpNet::V4(n) if n.prefix_len() == 32 => {
                    Some(host_line_key(c.chain, n.addr().octets()))
                }
                _ => None,
            })
            .collect()
    };
    [keys(ir::Dir::Src), keys(ir::Dir::Dst)]
}

#[cfg(test)]
mod tests {
    use super::*;
    use peerwall_common::HOST_LINES_ON;
    use rand::{Rng, SeedableRng};

    /// What the datapath's lookup (`ebpf/src/lines.rs`) answers for `key`, its keys read from
    /// `keys_at` and the line's overflow bit from `overflow_at` (the same table, the same or a
    /// later moment: the datapath reads them in that order).
    #[derive(Debug, PartialEq)]
    enum Answer {
        Hit(u64),
        Absent,
        Unknown,
    }

    fn answer(keys_at: &[HostLine], overflow_at: &[HostLine], key: u64) -> Answer {
        let h = keys_at[0].w[0];
        if h & HOST_LINES_ON == 0 {
            return Answer::Unknown;
        }
        let e = host_line_of(key, h as u32) as usize;
        for i in 0..HOST_LINE_SLOTS {
            if keys_at[e].w[1 + 2 * i] == key {
                return Answer::Hit(keys_at[e].w[2 + 2 * i]);
            }
        }
        if overflow_at[e].w[0] & HOST_LINE_OVERFLOW != 0 {
            Answer::Unknown
        } else {
            Answer::Absent
        }
    }

    /// A host map of IPv4 hosts `(chain, last octet, word)` in 10.0.0.0/24.
    fn hosts(list: &[(u32, u8, u64)]) -> HashMap<KeyBytes, (AddrKeyData, Bitmap)> {
        list.iter()
            .map(|&(chain, o, word)| {
                let k = AddrKeyData {
                    chain: chain.to_be_bytes(),
                    family: u32::from(family::V4).to_be_bytes(),
                    addr: {
                        let mut a = [0; 16];
                        a[..4].copy_from_slice(&[10, 0, 0, o]);
                        a
                    },
                };
                let mut b = Bitmap::EMPTY;
                b.w[0] = word;
                let mut kb = KeyBytes::default();
                kb.extend_from_slice(&chain.to_be_bytes());
                kb.push(o);
                (kb, (k, b))
            })
            .collect()
    }

    fn key(chain: u32, o: u8) -> u64 {
        host_line_key(chain, [10, 0, 0, o])
    }

    /// The host map's answer for `key`: its word, or none.
    fn held(list: &[(u32, u8, u64)], k: u64) -> Option<u64> {
        list.iter().find(|h| key(h.0, h.1) == k).map(|h| h.2)
    }

    /// Random host maps of up to `n` hosts over 2 chains and 12 addresses.
    fn random(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<(u32, u8, u64)> {
        let mut out: Vec<(u32, u8, u64)> = Vec::new();
        for _ in 0..rng.random_range(0..=n) {
            let (c, o) = (rng.random_range(0..2), rng.random_range(0..12));
            if !out.iter().any(|h| h.0 == c && h.1 == o) {
                out.push((c, o, rng.random_range(1..4)));
            }
        }
        out
    }

    fn all_keys() -> Vec<u64> {
        (0..2)
            .flat_map(|c| (0..12).map(move |o| key(c, o)))
            .collect()
    }

    fn applied(mut t: Vec<HostLine>, stores: &[Store]) -> Vec<HostLine> {
        for &(i, v) in stores {
            t[i / 8].w[i % 8] = v;
        }
        t
    }

    #[test]
    fn a_written_table_answers_as_its_host_map() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for lines in [1, 2, 3, 4] {
            for _ in 0..200 {
                let list = random(&mut rng, 20);
                let Some(t) = image(&hosts(&list), lines) else {
                    assert_eq!(lines, 3, "{lines} is a power of two");
                    continue;
                };
                let slots = (lines as usize * HOST_LINE_SLOTS).min(list.len());
                let mut hits = 0;
                for k in all_keys() {
                    match answer(&t, &t, k) {
                        Answer::Hit(w) => {
                            hits += 1;
                            assert_eq!(held(&list, k), Some(w), "{list:?}");
                        }
                        Answer::Absent => assert_eq!(held(&list, k), None, "{list:?}"),
                        Answer::Unknown => {}
                    }
                }
                // Every line holds as many of its hosts as it has slots.
                let mask = lines - 1;
                let mut per_line = vec![0usize; lines as usize + 1];
                for h in &list {
                    per_line[host_line_of(key(h.0, h.1), mask) as usize] += 1;
                }
                let fit: usize = per_line.iter().map(|n| (*n).min(HOST_LINE_SLOTS)).sum();
                // On where at least half have a slot; off, every answer asks the host map.
                assert!(fit <= slots);
                if fit * 2 >= list.len() {
                    assert_eq!(hits, fit, "{list:?}");
                } else {
                    assert_eq!((t[0].w[0], hits), (0, 0), "{list:?}");
                }
            }
        }
    }

    /// The in-place stores, applied in order under a reader at any moment (keys read at one
    /// store, the overflow bit at the same or a later one): every answer is the old host map's
    /// while it is unchanged, and once all stores are made, one both host maps agree with (the
    /// host map changes entry by entry after them).
    #[test]
    fn in_place_stores_never_answer_what_neither_host_map_holds() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        for _ in 0..300 {
            let (old, new) = (random(&mut rng, 9), random(&mut rng, 9));
            // One line or two.
            let lines = rng.random_range(1..3u32);
            let current = image(&hosts(&old), lines).unwrap();
            let want = image(&hosts(&new), lines).unwrap();
            let stores = in_place(&current, &want);
            let moments: Vec<Vec<HostLine>> = (0..=stores.len())
                .map(|i| applied(current.clone(), &stores[..i]))
                .collect();
            for (i, keys_at) in moments.iter().enumerate() {
                for overflow_at in &moments[i..] {
                    for k in all_keys() {
                        match answer(keys_at, overflow_at, k) {
                            Answer::Hit(w) => assert_eq!(held(&old, k), Some(w)),
                            Answer::Absent => assert_eq!(held(&old, k), None),
                            Answer::Unknown => {}
                        }
                    }
                }
            }
            let last = moments.last().unwrap();
            for k in all_keys() {
                match answer(last, last, k) {
                    Answer::Hit(w) => {
                        assert_eq!((held(&old, k), held(&new, k)), (Some(w), Some(w)))
                    }
                    Answer::Absent => assert_eq!((held(&old, k), held(&new, k)), (None, None)),
                    Answer::Unknown => {}
                }
            }
        }
    }

    #[test]
    fn forgotten_hosts_ask_the_host_map_and_others_keep_their_answer() {
        let list = [(0, 1, 5), (0, 2, 6), (1, 1, 7)];
        let t = image(&hosts(&list), 1).unwrap();
        let after = applied(t.clone(), &forget(&t, &[key(0, 2), key(1, 9)]));
        assert_eq!(answer(&after, &after, key(0, 2)), Answer::Unknown);
        assert_eq!(answer(&after, &after, key(1, 9)), Answer::Unknown);
        assert_eq!(answer(&after, &after, key(0, 1)), Answer::Hit(5));
        assert_eq!(answer(&after, &after, key(1, 1)), Answer::Hit(7));
    }

    #[test]
    fn a_whole_write_turns_the_table_off_first_and_on_last() {
        let t = image(&hosts(&[(0, 1, 5)]), 1).unwrap();
        let u = image(&hosts(&[(0, 2, 6)]), 1).unwrap();
        let stores = whole(&t, &u);
        assert_eq!(stores.first(), Some(&(0, 0)));
        assert_eq!(stores.last(), Some(&(0, HOST_LINES_ON)));
        assert_eq!(applied(t.clone(), &stores), u);
        // Nothing in place where the table is off; nothing where it already holds the image.
        assert!(in_place(&applied(u.clone(), &[(0, 0)]), &t).is_empty());
        assert!(in_place(&u, &u).is_empty());
        // No table but of a power of two of lines.
        assert_eq!(image(&hosts(&[]), 3), None);
        // Off where fewer than half the hosts have a slot: 7 in one line of 3.
        let many: Vec<(u32, u8, u64)> = (0..7).map(|o| (0, o, 1)).collect();
        assert_eq!(image(&hosts(&many), 1).unwrap()[0].w[0], 0);
        assert_eq!(image(&hosts(&many[..6]), 1).unwrap()[0].w[0], HOST_LINES_ON);
    }
}
