//! nfnetlink messages for set element edits, as bytes: one batch (`NFNL_MSG_BATCH_BEGIN`,
//! one `NFT_MSG_NEWSETELEM` / `NFT_MSG_DELSETELEM` per set and chunk, `NFNL_MSG_BATCH_END`)
//! that the kernel applies as one transaction, and the acknowledgements it answers with. An
//! element of a verdict map carries its verdict (`NFTA_SET_ELEM_DATA` > `NFTA_DATA_VERDICT`:
//! the code, `NFT_JUMP`, and the chain's name), as `nft` sends it.
//! Pure: bytes in, bytes out (`include/uapi/linux/netfilter/nf_tables.h`,
//! `include/uapi/linux/netfilter/nfnetlink.h`, `include/uapi/linux/netlink.h`).
//!
//! Byte order: netlink headers and attribute headers are host order; `nfgenmsg.res_id` and
//! the element keys (addresses) are network order. Attributes are padded to 4 bytes.

/// `struct nlmsghdr`: 16 bytes.
const NLMSG_HDRLEN: usize = 16;
/// `NLMSG_ERROR`: an acknowledgement (error 0) or an error.
pub const NLMSG_ERROR: u16 = 2;
pub(crate) const NLM_F_REQUEST: u16 = 0x1;
pub(crate) const NLM_F_ACK: u16 = 0x4;
const NLM_F_CREATE: u16 = 0x400;
const NLA_F_NESTED: u16 = 0x8000;
/// `NFNL_MSG_BATCH_BEGIN` / `_END`.
const BATCH_BEGIN: u16 = 0x10;
const BATCH_END: u16 = 0x11;
/// `NFNL_SUBSYS_NFTABLES`.
const SUBSYS_NFTABLES: u16 = 10;
/// `NFT_MSG_NEWSETELEM` / `NFT_MSG_DELSETELEM`.
const MSG_NEWSETELEM: u16 = 12;
const MSG_DELSETELEM: u16 = 14;
/// `enum nft_set_elem_list_attributes`.
const SET_ELEM_LIST_TABLE: u16 = 1;
const SET_ELEM_LIST_SET: u16 = 2;
const SET_ELEM_LIST_ELEMENTS: u16 = 3;
/// `NFTA_LIST_ELEM`, `NFTA_SET_ELEM_KEY`, `NFTA_DATA_VALUE`.
const LIST_ELEM: u16 = 1;
const SET_ELEM_KEY: u16 = 1;
const DATA_VALUE: u16 = 1;
/// `NFTA_SET_ELEM_FLAGS` (network-order u32) and `NFT_SET_ELEM_INTERVAL_END`.
const SET_ELEM_FLAGS: u16 = 3;
const ELEM_INTERVAL_END: u32 = 1;
/// `NFTA_SET_ELEM_DATA`, `NFTA_DATA_VERDICT`, `NFTA_VERDICT_CODE` (network-order u32),
/// `NFTA_VERDICT_CHAIN` (a NUL-terminated name) and `NFT_JUMP` (`-3`).
const SET_ELEM_DATA: u16 = 2;
const DATA_VERDICT: u16 = 2;
const VERDICT_CODE: u16 = 1;
const VERDICT_CHAIN: u16 = 2;
const NFT_JUMP: i32 = -3;

/// Elements per message at most (an IPv6 address element takes 28 bytes).
pub const CHUNK: usize = 1024;
/// Bytes of a message's element list at most: a nested attribute's length is 16 bits, and a
/// verdict map's element carries its chain's name (up to 256 bytes).
const LIST_BYTES: usize = 60_000;

/// `NFPROTO_*` of a table family.
pub fn nfproto(family: peerwall_policy::ir::TableFamily) -> u8 {
    use peerwall_policy::ir::TableFamily;
    match family {
        TableFamily::Inet => 1,
        TableFamily::Ip => 2,
        TableFamily::Ip6 => 10,
    }
}

/// One kernel set element: its key, network order (4 bytes for IPv4 addresses, 16 for
/// IPv6), and whether it ends an interval (`NFT_SET_ELEM_INTERVAL_END`: an interval set holds
/// the range `[lo, hi]` as the element `lo` and the end element `hi + 1`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Key {
    /// The key's bytes.
    pub bytes: Vec<u8>,
    /// An interval's end.
    pub end: bool,
    /// The chain a verdict map's element jumps to (an element added to a map; None for a
    /// set's element, and for a deletion, which the key alone names).
    pub jump: Option<String>,
}

impl Key {
    /// A key without data: a set's element, or a map's to delete.
    pub fn plain(bytes: Vec<u8>, end: bool) -> Self {
        Self {
            bytes,
            end,
            jump: None,
        }
    }

    /// The bytes this element takes in a message's element list (its attributes, padded).
    fn encoded_len(&self) -> usize {
        let pad = |n: usize| (n + 3) & !3;
        // The element, its key, the key's value.
        let mut n = 4 + 4 + 4 + pad(self.bytes.len());
        if self.end {
            n += 8;
        }
        if let Some(chain) = &self.jump {
            // Data > verdict > code, chain.
            n += 4 + 4 + 8 + 4 + pad(chain.len() + 1);
        }
        n
    }
}

/// Elements of one set to add or delete.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ElementEdit<'a> {
    /// `NFPROTO_*` of the table.
    pub family: u8,
    /// Table name.
    pub table: &'a str,
    /// Set name.
    pub set: &'a str,
    /// Add (`true`) or delete.
    pub add: bool,
    /// Delete every element (`keys` empty): a `DELSETELEM` without an element list, which the
    /// kernel takes as flushing the set (`nf_tables_delsetelem`).
    pub flush: bool,
    /// The elements.
    pub keys: Vec<Key>,
}

/// Netlink messages being written (this module's batches, the NFLOG listener's requests).
pub(crate) struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    pub(crate) fn new() -> Self {
        Self { buf: Vec::new() }
    }
    pub(crate) fn into_bytes(self) -> Vec<u8> {
        self.buf
    }
    fn put_u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_ne_bytes());
    }
    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }
    /// Start a message with its `nfgenmsg` header; returns where its length goes.
    pub(crate) fn begin_msg(
        &mut self,
        kind: u16,
        flags: u16,
        seq: u32,
        family: u8,
        res_id: u16,
    ) -> usize {
        let at = self.buf.len();
        self.buf.extend_from_slice(&0u32.to_ne_bytes());
        self.put_u16(kind);
        self.put_u16(flags);
        self.buf.extend_from_slice(&seq.to_ne_bytes());
        self.buf.extend_from_slice(&0u32.to_ne_bytes());
        // struct nfgenmsg: family, version (NFNETLINK_V0), res_id (network order).
        self.buf.push(family);
        self.buf.push(0);
        self.buf.extend_from_slice(&res_id.to_be_bytes());
        at
    }
    pub(crate) fn end_msg(&mut self, at: usize) {
        let len = (self.buf.len() - at) as u32;
        self.buf[at..at + 4].copy_from_slice(&len.to_ne_bytes());
    }
    pub(crate) fn begin_attr(&mut self, kind: u16) -> usize {
        let at = self.buf.len();
        self.put_u16(0);
        self.put_u16(kind);
        at
    }
    /// Close an attribute: its length excludes the padding that follows.
    pub(crate) fn end_attr(&mut self, at: usize) {
        let len = (self.buf.len() - at) as u16;
        self.buf[at..at + 2].copy_from_slice(&len.to_ne_bytes());
        self.pad();
    }
    pub(crate) fn attr(&mut self, kind: u16, payload: &[u8]) {
        let at = self.begin_attr(kind);
        self.buf.extend_from_slice(payload);
        self.end_attr(at);
    }
    pub(crate) fn attr_str(&mut self, kind: u16, s: &str) {
        let at = self.begin_attr(kind);
        self.buf.extend_from_slice(s.as_bytes());
        self.buf.push(0);
        self.end_attr(at);
    }
}

/// The attributes of a buffer (type without its flags, payload), up to the first one that
/// does not fit.
pub(crate) fn attrs(mut b: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if b.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([b[0], b[1]]) as usize;
        let ty = u16::from_ne_bytes([b[2], b[3]]) & 0x3fff;
        if len < 4 || len > b.len() {
            return None;
        }
        let data = &b[4..len];
        let next = (len + 3) & !3;
        b = if next >= b.len() { &[] } else { &b[next..] };
        Some((ty, data))
    })
}

/// The batch for `edits`, its messages numbered from `seq`: the bytes, and the sequence
/// numbers of the messages the kernel acknowledges (every edit message; not the batch's
/// begin and end).
pub fn batch(edits: &[ElementEdit<'_>], seq: u32) -> (Vec<u8>, Vec<u32>) {
    let mut w = Writer::new();
    let mut next = seq;
    let begin = w.begin_msg(BATCH_BEGIN, NLM_F_REQUEST, next, 0, SUBSYS_NFTABLES);
    w.end_msg(begin);
    let mut acked = Vec::new();
    for e in edits {
        let (kind, flags) = if e.add {
            (MSG_NEWSETELEM, NLM_F_REQUEST | NLM_F_CREATE | NLM_F_ACK)
        } else {
            (MSG_DELSETELEM, NLM_F_REQUEST | NLM_F_ACK)
        };
        if e.flush {
            next = next.wrapping_add(1);
            let m = w.begin_msg((SUBSYS_NFTABLES << 8) | kind, flags, next, e.family, 0);
            w.attr_str(SET_ELEM_LIST_TABLE, e.table);
            w.attr_str(SET_ELEM_LIST_SET, e.set);
            w.end_msg(m);
            acked.push(next);
            continue;
        }
        for chunk in chunks(&e.keys) {
            next = next.wrapping_add(1);
            let m = w.begin_msg((SUBSYS_NFTABLES << 8) | kind, flags, next, e.family, 0);
            w.attr_str(SET_ELEM_LIST_TABLE, e.table);
            w.attr_str(SET_ELEM_LIST_SET, e.set);
            let list = w.begin_attr(SET_ELEM_LIST_ELEMENTS | NLA_F_NESTED);
            for key in chunk {
                let el = w.begin_attr(LIST_ELEM | NLA_F_NESTED);
                let k = w.begin_attr(SET_ELEM_KEY | NLA_F_NESTED);
                w.attr(DATA_VALUE, &key.bytes);
                w.end_attr(k);
                if key.end {
                    w.attr(SET_ELEM_FLAGS, &ELEM_INTERVAL_END.to_be_bytes());
                }
                if let Some(chain) = &key.jump {
                    let data = w.begin_attr(SET_ELEM_DATA | NLA_F_NESTED);
                    let verdict = w.begin_attr(DATA_VERDICT | NLA_F_NESTED);
                    w.attr(VERDICT_CODE, &NFT_JUMP.to_be_bytes());
                    w.attr_str(VERDICT_CHAIN, chain);
                    w.end_attr(verdict);
                    w.end_attr(data);
                }
                w.end_attr(el);
            }
            w.end_attr(list);
            w.end_msg(m);
            acked.push(next);
        }
    }
    next = next.wrapping_add(1);
    let end = w.begin_msg(BATCH_END, NLM_F_REQUEST, next, 0, SUBSYS_NFTABLES);
    w.end_msg(end);
    (w.buf, acked)
}

/// `keys` cut into the element lists of successive messages: at most [`CHUNK`] elements and
/// [`LIST_BYTES`] bytes each.
fn chunks(keys: &[Key]) -> Vec<&[Key]> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, k) in keys.iter().enumerate() {
        let n = k.encoded_len();
        if i > start && (i - start == CHUNK || bytes + n > LIST_BYTES) {
            out.push(&keys[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += n;
    }
    if start < keys.len() {
        out.push(&keys[start..]);
    }
    out
}

/// An `NLMSG_ERROR` answer: the sequence number of the message it answers, and its error
/// (0: acknowledged; else a negative errno).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Answer {
    /// Sequence number of the message answered.
    pub seq: u32,
    /// 0, or `-errno`.
    pub error: i32,
}

/// The `NLMSG_ERROR` answers in a datagram read from the socket (other messages skipped);
/// None when the datagram is cut short.
pub fn answers(buf: &[u8]) -> Option<Vec<Answer>> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + NLMSG_HDRLEN <= buf.len() {
        let len = u32::from_ne_bytes(buf[at..at + 4].try_into().ok()?) as usize;
        let kind = u16::from_ne_bytes(buf[at + 4..at + 6].try_into().ok()?);
        if len < NLMSG_HDRLEN || at + len > buf.len() {
            return None;
        }
        if kind == NLMSG_ERROR {
            // struct nlmsgerr: int error, then the header of the message answered.
            let body = &buf[at + NLMSG_HDRLEN..at + len];
            if body.len() < 4 + NLMSG_HDRLEN {
                return None;
            }
            let error = i32::from_ne_bytes(body[0..4].try_into().ok()?);
            let seq = u32::from_ne_bytes(body[4 + 8..4 + 12].try_into().ok()?);
            out.push(Answer { seq, error });
        }
        at += (len + 3) & !3;
    }
    Some(out)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A host-order u16 / u32 of a message at `at` (the netlink modules' tests read with these).
    pub(in crate::netlink) fn u16_at(b: &[u8], at: usize) -> u16 {
        u16::from_ne_bytes([b[at], b[at + 1]])
    }
    pub(in crate::netlink) fn u32_at(b: &[u8], at: usize) -> u32 {
        u32::from_ne_bytes(b[at..at + 4].try_into().unwrap())
    }

    #[test]
    fn one_element_added_is_begin_one_message_end() {
        let edit = ElementEdit {
            family: 1,
            table: "t",
            set: "offloaded",
            add: true,
            flush: false,
            keys: vec![Key::plain(vec![10, 20, 1, 3], false)],
        };
        let (b, acked) = batch(&[edit], 100);
        assert_eq!(acked, vec![101]);
        // Begin: 20 bytes, subsystem in network order.
        assert_eq!(u32_at(&b, 0), 20);
        assert_eq!(u16_at(&b, 4), BATCH_BEGIN);
        assert_eq!(&b[18..20], &[0, 10]);
        // The element message.
        let m = 20;
        let len = u32_at(&b, m) as usize;
        assert_eq!(u16_at(&b, m + 4), (10 << 8) | 12);
        assert_eq!(u16_at(&b, m + 6), NLM_F_REQUEST | NLM_F_CREATE | NLM_F_ACK);
        assert_eq!(u32_at(&b, m + 8), 101);
        assert_eq!(b[m + 16], 1, "family inet");
        // Table "t\0": 4 + 2 bytes, padded to 8.
        assert_eq!(u16_at(&b, m + 20), 6);
        assert_eq!(u16_at(&b, m + 22), SET_ELEM_LIST_TABLE);
        assert_eq!(&b[m + 24..m + 26], b"t\0");
        // Set "offloaded\0": 4 + 10 bytes, padded to 16.
        assert_eq!(u16_at(&b, m + 28), 14);
        assert_eq!(&b[m + 32..m + 42], b"offloaded\0");
        // Elements > element > key > value (4 bytes): 4 + 4 + 4 + 8.
        let l = m + 44;
        assert_eq!(u16_at(&b, l), 20);
        assert_eq!(u16_at(&b, l + 2), SET_ELEM_LIST_ELEMENTS | NLA_F_NESTED);
        assert_eq!(u16_at(&b, l + 4), 16);
        assert_eq!(u16_at(&b, l + 8), 12);
        assert_eq!(u16_at(&b, l + 12), 8);
        assert_eq!(u16_at(&b, l + 14), DATA_VALUE);
        assert_eq!(&b[l + 16..l + 20], &[10, 20, 1, 3]);
        assert_eq!(len, 64);
        // End.
        assert_eq!(u16_at(&b, m + len + 4), BATCH_END);
        assert_eq!(u32_at(&b, m + len + 8), 102);
        assert_eq!(b.len(), m + len + 20);
    }

    #[test]
    fn deletes_carry_no_create_flag_and_large_edits_are_chunked() {
        let keys: Vec<Key> = (0..CHUNK as u32 + 1)
            .map(|i| Key::plain(i.to_be_bytes().to_vec(), false))
            .collect();
        let edit = ElementEdit {
            family: 2,
            table: "t",
            set: "s",
            add: false,
            flush: false,
            keys,
        };
        let (b, acked) = batch(&[edit], u32::MAX);
        assert_eq!(acked, vec![0, 1], "two messages, numbered across the wrap");
        let m = 20;
        assert_eq!(u16_at(&b, m + 4), (10 << 8) | 14);
        assert_eq!(u16_at(&b, m + 6), NLM_F_REQUEST | NLM_F_ACK);
        let first = u32_at(&b, m) as usize;
        assert_eq!(first, 16 + 4 + 8 + 8 + 4 + CHUNK * 16);
        let second = u32_at(&b, m + first) as usize;
        assert_eq!(second, 16 + 4 + 8 + 8 + 4 + 16);
    }

    #[test]
    fn an_interval_end_carries_its_flag() {
        let edit = ElementEdit {
            family: 1,
            table: "t",
            set: "s",
            add: true,
            flush: false,
            keys: vec![
                Key::plain(vec![10, 0, 0, 5], false),
                Key::plain(vec![10, 0, 0, 10], true),
            ],
        };
        let (b, _) = batch(&[edit], 1);
        // Elements list at 20 + 20 + 8 + 8: start (16 bytes), end (16 + flags 8).
        let l = 20 + 20 + 8 + 8;
        assert_eq!(u16_at(&b, l), 4 + 16 + 24);
        let end = l + 4 + 16;
        assert_eq!(u16_at(&b, end), 24);
        // Element header, key header, value header, the value, then the flags.
        assert_eq!(&b[end + 12..end + 16], &[10, 0, 0, 10]);
        assert_eq!(u16_at(&b, end + 16), 8);
        assert_eq!(u16_at(&b, end + 18), SET_ELEM_FLAGS);
        assert_eq!(&b[end + 20..end + 24], &[0, 0, 0, 1], "network order");
    }

    #[test]
    fn a_map_element_added_carries_its_jump_and_a_deleted_one_its_key_alone() {
        let chain = "__pw_k0_0123456789abcdef";
        let mut key = Key::plain(vec![10, 20, 1, 3], false);
        key.jump = Some(chain.into());
        let edit = |add: bool, keys: Vec<Key>| ElementEdit {
            family: 1,
            table: "t",
            set: "m",
            add,
            flush: false,
            keys,
        };
        let (b, _) = batch(&[edit(true, vec![key.clone()])], 1);
        // Table and set "t\0", "m\0" (8 bytes each), then the list.
        let l = 20 + 20 + 8 + 8;
        assert_eq!(u16_at(&b, l), 4 + 64);
        let el = l + 4;
        assert_eq!(u16_at(&b, el), 64);
        assert_eq!(&b[el + 12..el + 16], &[10, 20, 1, 3]);
        let data = el + 16;
        assert_eq!(u16_at(&b, data), 48);
        assert_eq!(u16_at(&b, data + 2), SET_ELEM_DATA | NLA_F_NESTED);
        assert_eq!(u16_at(&b, data + 4), 44);
        assert_eq!(u16_at(&b, data + 6), DATA_VERDICT | NLA_F_NESTED);
        assert_eq!(u16_at(&b, data + 8), 8);
        assert_eq!(u16_at(&b, data + 10), VERDICT_CODE);
        assert_eq!(
            &b[data + 12..data + 16],
            &[0xff, 0xff, 0xff, 0xfd],
            "NFT_JUMP, network order"
        );
        assert_eq!(u16_at(&b, data + 16), 4 + 25, "the name and its NUL");
        assert_eq!(u16_at(&b, data + 18), VERDICT_CHAIN);
        assert_eq!(&b[data + 20..data + 45], b"__pw_k0_0123456789abcdef\0");
        assert_eq!(key.encoded_len(), 64);
        // A deletion names the key alone.
        let (d, _) = batch(
            &[edit(false, vec![Key::plain(vec![10, 20, 1, 3], false)])],
            1,
        );
        assert_eq!(u16_at(&d, l), 4 + 16);
    }

    #[test]
    fn map_elements_with_long_chain_names_are_cut_where_a_list_would_overflow() {
        let chain = "c".repeat(200);
        let keys: Vec<Key> = (0..1100u32)
            .map(|i| {
                let mut k = Key::plain(i.to_be_bytes().to_vec(), false);
                k.jump = Some(chain.clone());
                k
            })
            .collect();
        assert_eq!(keys[0].encoded_len(), 16 + 4 + 4 + 8 + 4 + 204);
        let (b, acked) = batch(
            &[ElementEdit {
                family: 2,
                table: "t",
                set: "m",
                add: true,
                flush: false,
                keys,
            }],
            1,
        );
        // 250 elements of 240 bytes fit 60,000; 1,100 make five messages.
        assert_eq!(acked.len(), 5);
        let mut at = 20;
        let mut elements = 0;
        for _ in 0..5 {
            let len = u32_at(&b, at) as usize;
            let list = at + 20 + 8 + 8;
            let list_len = u16_at(&b, list) as usize;
            assert!(list_len <= 4 + LIST_BYTES, "{list_len}");
            assert_eq!(
                list_len,
                len - 36,
                "the list is the message's last attribute"
            );
            elements += (list_len - 4) / 240;
            at += len;
        }
        assert_eq!(elements, 1100);
        assert_eq!(u16_at(&b, at + 4), BATCH_END);
    }

    #[test]
    fn answers_read_acks_and_errors() {
        let mut d = Vec::new();
        for (seq, error) in [(7u32, 0i32), (8, -2)] {
            d.extend_from_slice(&36u32.to_ne_bytes());
            d.extend_from_slice(&NLMSG_ERROR.to_ne_bytes());
            d.extend_from_slice(&0u16.to_ne_bytes());
            d.extend_from_slice(&[0; 8]);
            d.extend_from_slice(&error.to_ne_bytes());
            // The answered header: len, type, flags, seq, pid.
            d.extend_from_slice(&[0; 8]);
            d.extend_from_slice(&seq.to_ne_bytes());
            d.extend_from_slice(&[0; 4]);
        }
        assert_eq!(
            answers(&d),
            Some(vec![
                Answer { seq: 7, error: 0 },
                Answer { seq: 8, error: -2 }
            ])
        );
        assert_eq!(answers(&d[..10]), Some(vec![]), "no whole header: nothing");
        assert_eq!(
            answers(&d[..30]),
            None,
            "a message longer than the datagram"
        );
    }
}
