use super::*;

#[test]
fn prefixes_are_short_whatever_the_names_and_name_their_kind() {
    let long = "x".repeat(250);
    let p = prefix(EventKind::AuditDrop, &long, &long, Some(&long));
    assert!(p.len() <= 22, "{p}");
    assert_eq!(parse_prefix(&p), Some(EventKind::AuditDrop));
    assert_ne!(
        prefix(EventKind::Drop, "t", "c", Some("r")),
        prefix(EventKind::Drop, "t", "c", None)
    );
    // Concatenation does not collide: ("ab","c") vs ("a","bc").
    assert_ne!(
        prefix(EventKind::Drop, "ab", "c", None),
        prefix(EventKind::Drop, "a", "bc", None)
    );
    assert_eq!(parse_prefix("pw:zz:0000000000000000"), None);
    assert_eq!(parse_prefix("other"), None);
}

/// A logged packet's message (family IPv4, group 5) with `attrs`.
fn packet_message(attrs: &[(u16, &[u8])]) -> Vec<u8> {
    let mut w = crate::netlink::message::Writer::new();
    let m = w.begin_msg(NFNL_SUBSYS_ULOG << 8, 0, 0, 2, 5);
    for (ty, data) in attrs {
        w.attr(*ty, data);
    }
    w.end_msg(m);
    w.into_bytes()
}

#[test]
fn a_logged_packet_is_decoded_from_its_netlink_message() {
    // IPv4 TCP 10.10.1.67:40000 -> 10.20.1.2:80, 60 bytes.
    let mut ip = vec![0x45, 0, 0, 60, 0, 0, 0x40, 0, 64, 6, 0, 0];
    ip.extend_from_slice(&[10, 10, 1, 67, 10, 20, 1, 2]);
    ip.extend_from_slice(&40000u16.to_be_bytes());
    ip.extend_from_slice(&80u16.to_be_bytes());
    ip.extend_from_slice(&[0; 16]);
    let msg = packet_message(&[
        (NFULA_PREFIX, b"pw:d:00112233445566ff\0"),
        (NFULA_IFINDEX_INDEV, &7u32.to_be_bytes()),
        (NFULA_IFINDEX_OUTDEV, &9u32.to_be_bytes()),
        (NFULA_CT_INFO, &2u32.to_be_bytes()),
        (NFULA_PAYLOAD, &ip),
    ]);
    // Two messages in one datagram.
    let mut two = msg.clone();
    two.extend_from_slice(&msg);
    let got = parse_messages(&two);
    assert_eq!(got.len(), 2);
    let l = &got[0];
    assert_eq!(l.prefix, "pw:d:00112233445566ff");
    assert_eq!((l.iif, l.oif), (7, 9));
    assert_eq!(l.ct_state, Some(CtState::New));
    assert_eq!(l.src, "10.10.1.67".parse::<IpAddr>().unwrap());
    assert_eq!(l.dst, "10.20.1.2".parse::<IpAddr>().unwrap());
    assert_eq!((l.proto, l.sport, l.dport, l.len), (6, 40000, 80, 60));
    // Truncated input yields nothing, never a panic.
    for cut in 0..two.len() {
        let _ = parse_messages(&two[..cut]);
    }
}
