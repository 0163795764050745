//! Set element edits straight over netlink: the controller's path for one pod (an address
//! joining or leaving a slice) is one or two elements, which the `nft` process makes cost
//! milliseconds to tens of milliseconds beside 100k elements (its start and its cache of the
//! table). The same batch over a netlink socket costs the kernel's work alone. Only edits of
//! hash sets of addresses go this way ([`element_edits`]); everything else, and what does not
//! fit, stays with `nft`.

pub mod message;
pub mod socket;

use crate::error::NftError;
use crate::model::{Command, Element};

/// Element changes above this go through `nft` (a batch this size is well within a
/// socket's send buffer).
pub const MAX_ELEMENTS: usize = 4096;

/// The commands as netlink element edits, when every one of them adds or deletes single
/// addresses of a hash set (not an interval set) and they are at most [`MAX_ELEMENTS`];
/// None otherwise.
pub fn element_edits<'a>(cmds: &[Command<'a>]) -> Option<Vec<message::ElementEdit<'a>>> {
    let mut out = Vec::new();
    let mut total = 0;
    for c in cmds {
        let (table, set, elements, add) = match c {
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
        // An interval set takes each range as a start and an end element, which only `nft`
        // writes here.
        // Sets whose elements carry counters or comments (a merged rule's) or verdicts are
        // not edited in place anyway.
        let plain = |s: &&crate::model::Set| {
            !s.interval && !s.counter && !s.verdict_map && s.comments.is_empty()
        };
        if !table.sets.iter().filter(plain).any(|s| s.name == set) {
            return None;
        }
        let keys = elements
            .iter()
            .map(|e| match e {
                Element::Addr(std::net::IpAddr::V4(a)) => Some(a.octets().to_vec()),
                Element::Addr(std::net::IpAddr::V6(a)) => Some(a.octets().to_vec()),
                _ => None,
            })
            .collect::<Option<Vec<_>>>()?;
        total += keys.len();
        out.push(message::ElementEdit {
            family: message::nfproto(table.family),
            table: &table.name,
            set,
            add,
            keys,
        });
    }
    (!out.is_empty() && total <= MAX_ELEMENTS).then_some(out)
}

/// Apply `edits` as one kernel transaction in `netns` (None: this thread's namespace).
pub fn apply(netns: Option<&str>, edits: &[message::ElementEdit<'_>]) -> Result<(), NftError> {
    let action = || {
        let n: usize = edits.iter().map(|e| e.keys.len()).sum();
        format!("netlink: {n} set element change(s)")
    };
    let sock = socket::Socket::open(netns).map_err(|source| NftError::Netlink {
        action: action(),
        source,
    })?;
    // Sequence numbers only need to be unique on this socket.
    let (batch, acked) = message::batch(edits, 1);
    sock.transact(&batch, &acked)
        .map_err(|source| NftError::Netlink {
            action: action(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{KeyType, Set, Table};
    use peerwall_policy::ir::TableFamily;

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
            }],
            chains: vec![],
            regular: vec![],
            dispatch_sources: vec![],
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
        assert_eq!(
            edits,
            vec![
                message::ElementEdit {
                    family: 1,
                    table: "peerwall_a",
                    set: "offloaded",
                    add: false,
                    keys: vec![b"\xfd\0\0\0\0\0\0\0\0\0\0\0\0\0\0\x01".to_vec()],
                },
                message::ElementEdit {
                    family: 1,
                    table: "peerwall_a",
                    set: "offloaded",
                    add: true,
                    keys: vec![vec![10, 20, 1, 3]],
                },
            ]
        );
    }

    #[test]
    fn interval_sets_other_sets_prefixes_and_large_edits_stay_with_nft() {
        let a = Element::Addr("10.20.1.3".parse().unwrap());
        let interval = table(true);
        assert!(element_edits(&[add(&interval, vec![a])]).is_none());
        let hash = table(false);
        let other = Command::AddElements {
            table: &hash,
            set: "elsewhere",
            elements: vec![a],
        };
        assert!(element_edits(&[other]).is_none(), "a set the table lacks");
        let prefix = Element::Prefix("10.20.0.0".parse().unwrap(), 16);
        assert!(element_edits(&[add(&hash, vec![prefix])]).is_none());
        assert!(element_edits(&[add(&hash, vec![a; MAX_ELEMENTS + 1])]).is_none());
        assert!(element_edits(&[add(&hash, vec![a; MAX_ELEMENTS])]).is_some());
        assert!(element_edits(&[]).is_none());
    }
}
