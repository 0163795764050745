//! Set element edits straight over netlink: the controller's path for one pod (an address
//! joining or leaving a slice) is one or two elements, which the `nft` process makes cost
//! milliseconds to tens of milliseconds beside 100k elements (its start and its cache of the
//! table). The same batch over a netlink socket costs the kernel's work alone. Edits of plain
//! address sets go this way ([`element_edits`]): hash sets element by element, interval sets
//! as `nft` writes them (a range `[lo, hi]` is the element `lo` and the interval end
//! `hi + 1`; ranges from the first address or to the last, which `nft` writes with extra
//! elements and annotations, stay with it), and the address dispatch's verdict maps
//! ([`crate::dispatch`]: an address joining, leaving or changing its class, the element with
//! its jump); everything else, and what does not fit, stays with `nft`.
//!
//! Connections go the same way ([`ctnetlink`]): listed in one dump, ended one request each;
//! and a table is deleted the same way ([`table`]).

pub mod ctnetlink;
pub mod generation;
pub mod message;
pub mod socket;
pub mod table;

use peerwall_policy::ir::addr::addr_to_u128;

use crate::error::NftError;
use crate::model::{Command, Element, TuplePart};

/// Element changes above this go through `nft` (a batch this size is well within a
/// socket's send buffer).
pub const MAX_ELEMENTS: usize = 4096;

/// The commands as netlink element edits, when every one of them adds or deletes addresses
/// of a plain address set (single addresses of a hash set; ranges of an interval set, neither
/// from the first address nor to the last) or elements of a verdict map (an address and the
/// chain it jumps to), or empty a decided-flow cache, and they make at most [`MAX_ELEMENTS`] kernel elements; None otherwise.
pub fn element_edits<'a>(cmds: &[Command<'a>]) -> Option<Vec<message::ElementEdit<'a>>> {
    let mut out = Vec::new();
    let mut total = 0;
    for c in cmds {
        let (table, set, elements, add) = match c {
            // Emptying a decided-flow cache ([`crate::decided`]): a delete without elements.
            Command::FlushSet { table, set } => {
                out.push(message::ElementEdit {
                    family: message::nfproto(table.family),
                    table: &table.name,
                    set,
                    add: false,
                    flush: true,
                    keys: Vec::new(),
                });
                continue;
            }
            Command::AddElements {
                table,
                set,
                elements,
            } => (*table, *set, elements, true),
            Command::DeleteElements {
                table,
                set,
                elements,
            } => (*table, *set, elements, false),
            _ => return None,
        };
        // Sets whose elements carry counters or comments (a merged rule's) are not edited in
        // place anyway.
        let found = table
            .sets
            .iter()
            .find(|s| s.name == set && !s.counter && s.comments.is_empty())?;
        let interval = found.interval;
        let mut keys = Vec::new();
        for e in elements {
            // A verdict map's element: its address (a hash map's key), with the chain it
            // jumps to when added; nothing else is one.
            if found.verdict_map {
                let Element::Jump(a, to) = e else {
                    return None;
                };
                let mut k = key(addr_to_u128(a), a.is_ipv4(), false);
                k.jump = add.then(|| to.name());
                keys.push(k);
                continue;
            }
            // A timeout set's elements are single tuples (the ended table's connections).
            if found.timeout.is_some() {
                keys.push(tuple_key(e)?);
                continue;
            }
            let (lo, hi, v4) = range_of(e)?;
            if !interval {
                if lo != hi {
                    return None;
                }
                keys.push(key(lo, v4, false));
                continue;
            }
            let top = if v4 { u32::MAX as u128 } else { u128::MAX };
            if lo == 0 || hi == top {
                return None;
            }
            keys.push(key(lo, v4, false));
            keys.push(key(hi + 1, v4, true));
        }
        total += keys.len();
        out.push(message::ElementEdit {
            family: message::nfproto(table.family),
            table: &table.name,
            set,
            add,
            flush: false,
            keys,
        });
    }
    (!out.is_empty() && total <= MAX_ELEMENTS).then_some(out)
}

/// An address element as an inclusive range (lowest, highest, IPv4).
fn range_of(e: &Element) -> Option<(u128, u128, bool)> {
    let (lo, hi, v4) = match e {
        Element::Addr(a) => (addr_to_u128(a), addr_to_u128(a), a.is_ipv4()),
        Element::AddrRange(a, b) if a.is_ipv4() == b.is_ipv4() => {
            (addr_to_u128(a), addr_to_u128(b), a.is_ipv4())
        }
        Element::Prefix(a, len) => {
            let bits: u32 = if a.is_ipv4() { 32 } else { 128 };
            let host = bits.checked_sub(u32::from(*len))?;
            let mask = if host == 128 {
                u128::MAX
            } else {
                (1u128 << host) - 1
            };
            let lo = addr_to_u128(a) & !mask;
            (lo, lo | mask, a.is_ipv4())
        }
        _ => return None,
    };
    (lo <= hi).then_some((lo, hi, v4))
}

/// The key of a concatenation of single values, as nft lays it out: each field in network
/// order, padded with zeros to a multiple of 4 bytes (addresses 4 or 16, ports 2 + 2, the
/// protocol 1 + 3). None for a part that is a range or prefix.
fn tuple_key(e: &Element) -> Option<message::Key> {
    let Element::Tuple(t) = e else {
        return None;
    };
    let mut bytes = Vec::new();
    for p in t.parts() {
        match p {
            TuplePart::Proto(n) => bytes.extend([n, 0, 0, 0]),
            TuplePart::Elem(Element::Port(p)) => {
                bytes.extend(p.to_be_bytes());
                bytes.extend([0, 0]);
            }
            TuplePart::Elem(Element::Addr(std::net::IpAddr::V4(a))) => bytes.extend(a.octets()),
            TuplePart::Elem(Element::Addr(std::net::IpAddr::V6(a))) => bytes.extend(a.octets()),
            TuplePart::Elem(_) => return None,
        }
    }
    Some(message::Key::plain(bytes, false))
}

/// A key of `v` (4 bytes for IPv4, 16 for IPv6, network order).
fn key(v: u128, v4: bool, end: bool) -> message::Key {
    let bytes = if v4 {
        (v as u32).to_be_bytes().to_vec()
    } else {
        v.to_be_bytes().to_vec()
    };
    message::Key::plain(bytes, end)
}

/// Batches refused over netlink and sent through `nft` instead, in this process.
static FALLBACKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many batches went to `nft` after netlink refused them, in this process (0 unless the
/// kernel and this module disagree on an element; tests hold it to 0).
pub fn fallbacks() -> u64 {
    FALLBACKS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Count and log a batch netlink refused, before `nft` gets it.
pub(crate) fn fell_back(e: &NftError) {
    FALLBACKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    tracing::warn!(error = %e, "set element edit refused over netlink; sending it through nft");
}

/// A netlink socket kept between transactions, opened at the first one.
///
/// Kept open rather than closed after each batch: closing a netfilter socket makes the kernel
/// wait for the previous commit's cleanup, an RCU grace period (`nft_rcv_nl_event` flushing
/// the transaction destroy work), 3 to 15 ms on a busy gateway per pod offloaded. The socket
/// stays in the namespace it was opened in (`netns`, or the opening thread's); after any
/// failure it is closed, so no answer of a failed batch is read as one of the next.
pub struct Session {
    netns: Option<String>,
    sock: Option<socket::Socket>,
    /// The next batch's first sequence number (unique on the socket).
    seq: u32,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("netns", &self.netns)
            .field("open", &self.sock.is_some())
            .finish()
    }
}

impl Session {
    /// A session for the network namespace `netns` names (None: the first user's thread's).
    pub fn new(netns: Option<&str>) -> Self {
        Self {
            netns: netns.map(str::to_string),
            sock: None,
            seq: 1,
        }
    }

    /// Apply `edits` as one kernel transaction.
    pub fn apply(&mut self, edits: &[message::ElementEdit<'_>]) -> Result<(), NftError> {
        let action = || {
            let n: usize = edits.iter().map(|e| e.keys.len()).sum();
            format!("netlink: {n} set element change(s)")
        };
        let sock = match self.sock.take() {
            Some(s) => s,
            None => {
                socket::Socket::open(self.netns.as_deref()).map_err(|source| NftError::Netlink {
                    action: action(),
                    source,
                })?
            }
        };
        let (batch, acked) = message::batch(edits, self.seq);
        // The batch used `seq` up to its end message (`acked` holds the ones in between).
        self.seq = acked.last().copied().unwrap_or(self.seq).wrapping_add(2);
        sock.transact(&batch, &acked)
            .map_err(|source| NftError::Netlink {
                action: action(),
                source,
            })?;
        self.sock = Some(sock);
        Ok(())
    }
}

impl Session {
    /// The ruleset's generation in the session's namespace ([`generation`]).
    pub fn generation(&mut self) -> Result<u32, NftError> {
        let action = || "netlink: reading the ruleset generation".to_string();
        let err = |source| NftError::Netlink {
            action: action(),
            source,
        };
        let sock = match self.sock.take() {
            Some(s) => s,
            None => socket::Socket::open(self.netns.as_deref()).map_err(err)?,
        };
        let seq = self.seq;
        self.seq = seq.wrapping_add(1);
        sock.send(&generation::request(seq)).map_err(err)?;
        let mut buf = vec![0u8; 8192];
        // A kept socket holds no other answer, but a stray one is read past (a few at most).
        for _ in 0..16 {
            let n = sock.recv(&mut buf).map_err(err)?;
            match generation::answer(&buf[..n], seq) {
                Some(Ok(id)) => {
                    self.sock = Some(sock);
                    return Ok(id);
                }
                Some(Err(errno)) => return Err(err(std::io::Error::from_raw_os_error(-errno))),
                None => {}
            }
        }
        Err(err(std::io::Error::other(
            "no answer to the generation request",
        )))
    }
}

impl Session {
    /// Delete the table `name` of `family` (`NFPROTO_*`) in the session's namespace, as one
    /// transaction ([`table`]): Ok(true) when it was there, Ok(false) when there was none.
    pub fn delete_table(&mut self, family: u8, name: &str) -> Result<bool, NftError> {
        let err = |source| NftError::Netlink {
            action: format!("netlink: deleting table {name}"),
            source,
        };
        let sock = match self.sock.take() {
            Some(s) => s,
            None => socket::Socket::open(self.netns.as_deref()).map_err(err)?,
        };
        let (batch, acked) = table::delete(family, name, self.seq);
        self.seq = self.seq.wrapping_add(3);
        match sock.transact(&batch, &[acked]) {
            Ok(()) => {
                self.sock = Some(sock);
                Ok(true)
            }
            // The kernel answered that no such table is here: the socket holds nothing more.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                self.sock = Some(sock);
                Ok(false)
            }
            Err(e) => Err(err(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{KeyType, Set, Table};
    use peerwall_policy::ir::TableFamily;

    /// The ended table's elements go over netlink, laid out as nft concatenates: destination,
    /// source, destination port, source port, protocol, each padded to 4 bytes.
    #[test]
    fn an_ended_connection_is_one_concatenated_key() {
        let t = crate::ended::table(600);
        let flow = peerwall_backend::Flow {
            src: "10.10.1.67".parse().unwrap(),
            dst: "10.20.1.2".parse().unwrap(),
            proto: 17,
            sport: 5000,
            dport: 6000,
        };
        let elements = crate::ended::elements(&[flow]);
        let cmds: Vec<Command<'_>> = elements
            .iter()
            .map(|(set, e)| Command::AddElements {
                table: &t,
                set,
                elements: e.clone(),
            })
            .collect();
        let edits = element_edits(&cmds).expect("over netlink");
        assert_eq!(edits[0].set, "ended4");
        assert_eq!(
            edits[0].keys[0].bytes,
            [10, 20, 1, 2, 10, 10, 1, 67, 0x17, 0x70, 0, 0, 0x13, 0x88, 0, 0, 17, 0, 0, 0]
        );
        assert_eq!(edits[0].keys.len(), 2, "both orientations");
    }

    fn table(interval: bool) -> Table {
        Table {
            name: "peerwall_a".into(),
            family: TableFamily::Inet,
            owner: "t".into(),
            sets: vec![Set {
                name: "offloaded".into(),
                key: KeyType::Ipv4Addr,
                interval,
                elements: vec![],
                counter: false,
                comments: vec![],
                verdict_map: false,
                timeout: None,
            }],
            chains: vec![],
            regular: vec![],
            dispatch_maps: Vec::new(),
            rules: vec![],
            event_limit: None,
        }
    }

    fn add<'a>(t: &'a Table, elements: Vec<Element>) -> Command<'a> {
        Command::AddElements {
            table: t,
            set: "offloaded",
            elements,
        }
    }

    fn k(bytes: &[u8], end: bool) -> message::Key {
        message::Key::plain(bytes.to_vec(), end)
    }

    #[test]
    fn addresses_of_a_hash_set_go_over_netlink() {
        let t = table(false);
        let a: std::net::IpAddr = "10.20.1.3".parse().unwrap();
        let b: std::net::IpAddr = "fd00::1".parse().unwrap();
        let cmds = [
            Command::DeleteElements {
                table: &t,
                set: "offloaded",
                elements: vec![Element::Addr(b)],
            },
            add(&t, vec![Element::Addr(a)]),
        ];
        let edits = element_edits(&cmds).expect("netlink");
        let mut v6 = [0u8; 16];
        v6[0] = 0xfd;
        v6[15] = 1;
        assert_eq!(
            edits,
            vec![
                message::ElementEdit {
                    family: 1,
                    table: "peerwall_a",
                    set: "offloaded",
                    add: false,
                    flush: false,
                    keys: vec![k(&v6, false)],
                },
                message::ElementEdit {
                    family: 1,
                    table: "peerwall_a",
                    set: "offloaded",
                    add: true,
                    flush: false,
                    keys: vec![k(&[10, 20, 1, 3], false)],
                },
            ]
        );
    }

    #[test]
    fn ranges_of_an_interval_set_are_a_start_and_an_end_as_nft_writes_them() {
        let t = table(true);
        let cmds = [add(
            &t,
            vec![
                Element::Addr("10.20.1.3".parse().unwrap()),
                Element::Prefix("10.20.0.0".parse().unwrap(), 16),
                Element::AddrRange("10.0.0.5".parse().unwrap(), "10.0.0.9".parse().unwrap()),
            ],
        )];
        let edits = element_edits(&cmds).expect("netlink");
        assert_eq!(
            edits[0].keys,
            vec![
                k(&[10, 20, 1, 3], false),
                k(&[10, 20, 1, 4], true),
                k(&[10, 20, 0, 0], false),
                k(&[10, 21, 0, 0], true),
                k(&[10, 0, 0, 5], false),
                k(&[10, 0, 0, 10], true),
            ]
        );
        // From the first address or to the last: nft adds and annotates elements of its own.
        let low = Element::Prefix("0.0.0.0".parse().unwrap(), 8);
        let top = Element::Prefix("255.255.255.0".parse().unwrap(), 24);
        assert!(element_edits(&[add(&t, vec![low])]).is_none());
        assert!(element_edits(&[add(&t, vec![top])]).is_none());
    }

    #[test]
    fn a_verdict_maps_elements_go_over_netlink_with_their_jump_when_added() {
        use crate::model::ClassChain;
        let mut t = table(false);
        t.sets[0].verdict_map = true;
        let a: std::net::IpAddr = "10.20.1.3".parse().unwrap();
        let (from, to) = (
            ClassChain { run: 0, class: 1 },
            ClassChain { run: 0, class: 2 },
        );
        // The address changes class: its element deleted, then added with the new jump.
        let cmds = [
            Command::DeleteElements {
                table: &t,
                set: "offloaded",
                elements: vec![Element::Jump(a, from)],
            },
            add(&t, vec![Element::Jump(a, to)]),
        ];
        let edits = element_edits(&cmds).expect("netlink");
        assert_eq!(edits[0].keys, vec![k(&[10, 20, 1, 3], false)]);
        assert!(!edits[0].add);
        let mut jumped = k(&[10, 20, 1, 3], false);
        jumped.jump = Some(to.name());
        assert_eq!(edits[1].keys, vec![jumped]);
        // Anything but an address and its jump stays with nft.
        assert!(element_edits(&[add(&t, vec![Element::Addr(a)])]).is_none());
        let mut counted = t.clone();
        counted.sets[0].counter = true;
        assert!(element_edits(&[add(&counted, vec![Element::Jump(a, to)])]).is_none());
    }

    #[test]
    fn other_sets_hash_set_ranges_and_large_edits_stay_with_nft() {
        let a = Element::Addr("10.20.1.3".parse().unwrap());
        let hash = table(false);
        let other = Command::AddElements {
            table: &hash,
            set: "elsewhere",
            elements: vec![a],
        };
        assert!(element_edits(&[other]).is_none(), "a set the table lacks");
        let mut counted = table(false);
        counted.sets[0].counter = true;
        assert!(
            element_edits(&[add(&counted, vec![a])]).is_none(),
            "a merged rule's set"
        );
        let prefix = Element::Prefix("10.20.0.0".parse().unwrap(), 16);
        assert!(element_edits(&[add(&hash, vec![prefix])]).is_none());
        assert!(element_edits(&[add(&hash, vec![a; MAX_ELEMENTS + 1])]).is_none());
        assert!(element_edits(&[add(&hash, vec![a; MAX_ELEMENTS])]).is_some());
        assert!(element_edits(&[]).is_none());
    }
}
