//! Deleting one table (`NFT_MSG_DELTABLE`) as one transaction: what `nft delete table inet X`
//! asks of the kernel, without starting `nft` (its process start and its cache of the
//! ruleset). The bpf backend lets a gateway's boot table go this way once its tunnel is
//! attached.
//!
//! Kernel side: `nf_tables_deltable` in `net/netfilter/nf_tables_api.c` finds the table by
//! `NFTA_TABLE_NAME` in the message's family and answers `-ENOENT` when there is none; the
//! table goes with its chains, rules and sets. Pure: bytes in, bytes out; byte order as in
//! [`super::message`].

use super::message::{Writer, NLM_F_ACK, NLM_F_REQUEST};

/// `NFNL_SUBSYS_NFTABLES`.
const SUBSYS_NFTABLES: u16 = 10;
/// `NFNL_MSG_BATCH_BEGIN` / `_END`.
const BATCH_BEGIN: u16 = 0x10;
const BATCH_END: u16 = 0x11;
/// `NFT_MSG_DELTABLE`.
const MSG_DELTABLE: u16 = 2;
/// `NFTA_TABLE_NAME`.
const TABLE_NAME: u16 = 1;

/// The batch deleting table `name` of `family` (`NFPROTO_*`), its messages numbered from
/// `seq`: the bytes, and the sequence number of the one message the kernel acknowledges.
pub fn delete(family: u8, name: &str, seq: u32) -> (Vec<u8>, u32) {
    let mut w = Writer::new();
    let begin = w.begin_msg(BATCH_BEGIN, NLM_F_REQUEST, seq, 0, SUBSYS_NFTABLES);
    w.end_msg(begin);
    let del = seq.wrapping_add(1);
    let m = w.begin_msg(
        (SUBSYS_NFTABLES << 8) | MSG_DELTABLE,
        NLM_F_REQUEST | NLM_F_ACK,
        del,
        family,
        0,
    );
    w.attr_str(TABLE_NAME, name);
    w.end_msg(m);
    let end = w.begin_msg(
        BATCH_END,
        NLM_F_REQUEST,
        seq.wrapping_add(2),
        0,
        SUBSYS_NFTABLES,
    );
    w.end_msg(end);
    (w.into_bytes(), del)
}

#[cfg(test)]
mod tests {
    use super::super::message::tests::{u16_at, u32_at};
    use super::*;

    #[test]
    fn a_delete_is_begin_one_deltable_end() {
        let (b, acked) = delete(1, "peerwall_boot_peer_1", 7);
        assert_eq!(acked, 8);
        // Begin: a bare header with nfgenmsg, res_id NFNL_SUBSYS_NFTABLES (network order).
        assert_eq!(u32_at(&b, 0), 20);
        assert_eq!(u16_at(&b, 4), BATCH_BEGIN);
        assert_eq!(u32_at(&b, 8), 7);
        assert_eq!(&b[18..20], &10u16.to_be_bytes());
        // The delete: family inet, the name NUL-terminated and padded to 4 bytes.
        let m = &b[20..];
        let len = u32_at(m, 0) as usize;
        assert_eq!(u16_at(m, 4), 0x0a02);
        assert_eq!(u16_at(m, 6), NLM_F_REQUEST | NLM_F_ACK);
        assert_eq!(u32_at(m, 8), 8);
        assert_eq!(m[16], 1, "NFPROTO_INET");
        let name_len = usize::from(u16_at(m, 20));
        assert_eq!(u16_at(m, 22), TABLE_NAME);
        assert_eq!(&m[24..24 + name_len - 4], b"peerwall_boot_peer_1\0");
        assert_eq!(len, 20 + ((name_len + 3) & !3));
        // End.
        let e = &m[len..];
        assert_eq!(u32_at(e, 0), 20);
        assert_eq!(u16_at(e, 4), BATCH_END);
        assert_eq!(u32_at(e, 8), 9);
        assert_eq!(b.len(), 20 + len + 20);
    }
}
