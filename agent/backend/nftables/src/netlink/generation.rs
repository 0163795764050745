//! The ruleset's generation (`NFT_MSG_GETGEN`): a number the kernel increments at every
//! committed nf_tables transaction of the network namespace, whoever commits it (`nft`,
//! Liqo's firewall controller, an operator's hand edit). Unchanged generation, unchanged
//! ruleset: tables, chains, rules, sets and the elements a transaction writes (not the
//! elements the packet path adds to dynamic sets, nor counters, which no transaction
//! writes). The drift check asks this first and lists the ruleset only when it moved.
//!
//! Kernel side: `nf_tables_getgen` / `nf_tables_fill_gen_info` in
//! `net/netfilter/nf_tables_api.c` answer with `NFT_MSG_NEWGEN`, its `NFTA_GEN_ID` the
//! namespace's `base_seq` (network-order u32). Pure: bytes in, bytes out; byte order as in
//! [`super::message`].

use super::message::{attrs, Writer, NLMSG_ERROR, NLM_F_REQUEST};

/// `NFNL_SUBSYS_NFTABLES`.
const SUBSYS_NFTABLES: u16 = 10;
/// `NFT_MSG_NEWGEN`, `NFT_MSG_GETGEN`.
const MSG_NEWGEN: u16 = 15;
const MSG_GETGEN: u16 = 16;
/// `NFTA_GEN_ID`.
const GEN_ID: u16 = 1;
/// `struct nlmsghdr` + `struct nfgenmsg`.
const HEADERS: usize = 16 + 4;

/// The request for the generation, numbered `seq`.
pub fn request(seq: u32) -> Vec<u8> {
    let mut w = Writer::new();
    let m = w.begin_msg(
        (SUBSYS_NFTABLES << 8) | MSG_GETGEN,
        NLM_F_REQUEST,
        seq,
        0,
        0,
    );
    w.end_msg(m);
    w.into_bytes()
}

/// What a datagram says of the request numbered `seq`: None when it holds no answer to it
/// (read on); the generation; or the kernel's error (`-errno`).
pub fn answer(buf: &[u8], seq: u32) -> Option<Result<u32, i32>> {
    let mut at = 0;
    while at + HEADERS <= buf.len() {
        let word = |o: usize| {
            buf.get(at + o..at + o + 4)
                .map(|b| [b[0], b[1], b[2], b[3]])
        };
        let len = u32::from_ne_bytes(word(0)?) as usize;
        let kind = u16::from_ne_bytes([buf[at + 4], buf[at + 5]]);
        let got = u32::from_ne_bytes(word(8)?);
        if len < 16 || at + len > buf.len() {
            return None;
        }
        let body = &buf[at + 16..at + len];
        if kind == NLMSG_ERROR && body.len() >= 4 + 16 {
            // struct nlmsgerr: the error, then the header of the message answered.
            let answered = u32::from_ne_bytes([body[12], body[13], body[14], body[15]]);
            let error = i32::from_ne_bytes([body[0], body[1], body[2], body[3]]);
            if answered == seq && error != 0 {
                return Some(Err(error));
            }
        } else if kind == (SUBSYS_NFTABLES << 8) | MSG_NEWGEN && got == seq && body.len() >= 4 {
            let id = attrs(&body[4..])
                .find(|(ty, data)| *ty == GEN_ID && data.len() == 4)
                .map(|(_, d)| u32::from_be_bytes([d[0], d[1], d[2], d[3]]));
            return id.map(Ok);
        }
        at += (len + 3) & !3;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `NFT_MSG_NEWGEN` as `nf_tables_fill_gen_info` writes it.
    fn newgen(seq: u32, id: u32) -> Vec<u8> {
        let mut b = Vec::new();
        let attrs: Vec<u8> = [
            // NFTA_GEN_ID
            &8u16.to_ne_bytes()[..],
            &1u16.to_ne_bytes(),
            &id.to_be_bytes(),
            // NFTA_GEN_PROC_PID
            &8u16.to_ne_bytes(),
            &2u16.to_ne_bytes(),
            &77u32.to_be_bytes(),
        ]
        .concat();
        let len = (16 + 4 + attrs.len()) as u32;
        b.extend_from_slice(&len.to_ne_bytes());
        b.extend_from_slice(&((10u16 << 8) | 15).to_ne_bytes());
        b.extend_from_slice(&0u16.to_ne_bytes());
        b.extend_from_slice(&seq.to_ne_bytes());
        b.extend_from_slice(&0u32.to_ne_bytes());
        b.extend_from_slice(&[0, 0]);
        b.extend_from_slice(&(id as u16).to_be_bytes());
        b.extend_from_slice(&attrs);
        b
    }

    #[test]
    fn the_request_is_a_bare_getgen() {
        let r = request(9);
        assert_eq!(r.len(), 20);
        assert_eq!(u32::from_ne_bytes(r[0..4].try_into().unwrap()), 20);
        assert_eq!(u16::from_ne_bytes([r[4], r[5]]), 0x0a10);
        assert_eq!(u16::from_ne_bytes([r[6], r[7]]), NLM_F_REQUEST);
        assert_eq!(u32::from_ne_bytes(r[8..12].try_into().unwrap()), 9);
    }

    #[test]
    fn the_generation_is_read_from_the_answer_to_this_request_only() {
        let id = 0x0102_0304;
        assert_eq!(answer(&newgen(9, id), 9), Some(Ok(id)));
        assert_eq!(answer(&newgen(8, id), 9), None, "another request's answer");
        let two = [newgen(8, 1), newgen(9, id)].concat();
        assert_eq!(answer(&two, 9), Some(Ok(id)));
        assert_eq!(answer(&newgen(9, id)[..19], 9), None, "cut short");
    }

    #[test]
    fn an_error_answer_is_the_kernels_errno() {
        let mut b = Vec::new();
        b.extend_from_slice(&36u32.to_ne_bytes());
        b.extend_from_slice(&NLMSG_ERROR.to_ne_bytes());
        b.extend_from_slice(&[0; 2]);
        b.extend_from_slice(&9u32.to_ne_bytes());
        b.extend_from_slice(&0u32.to_ne_bytes());
        b.extend_from_slice(&(-1i32).to_ne_bytes());
        b.extend_from_slice(&request(9)[..16]);
        assert_eq!(answer(&b, 9), Some(Err(-1)));
    }
}
