use std::net::IpAddr;
use std::time::{Duration, SystemTime};

use peerwall_backend::{Event, EventKind};

use super::*;

fn pod(ns: &str, name: &str, ip: &str, peer: Option<&str>) -> netpol::Pod {
    netpol::Pod {
        namespace: ns.into(),
        name: name.into(),
        ips: vec![ip.parse().unwrap()],
        peer: peer.map(str::to_string),
        ..Default::default()
    }
}

fn event(table: &str, src: &str, dst: &str, iif: &str, oif: &str, at_ms: u64) -> Event {
    Event {
        time: SystemTime::UNIX_EPOCH + Duration::from_millis(at_ms),
        verdict: EventKind::Drop,
        table: table.into(),
        chain: "forward".into(),
        rule: None,
        src: src.parse::<IpAddr>().unwrap(),
        dst: dst.parse::<IpAddr>().unwrap(),
        proto: 6,
        sport: 40000,
        dport: 80,
        iif: iif.into(),
        oif: oif.into(),
        ct_state: None,
        packets: 1,
        bytes: 60,
    }
}

/// Two peers use the same addresses, and so does a pod here: Liqo remaps them, and each end
/// is named by the side it is on.
fn cluster() -> netpol::Cluster {
    netpol::Cluster {
        pods: vec![
            pod("shop", "cart", "10.0.0.5", Some("cluster-a")),
            pod("shop", "cart-b", "10.0.0.5", Some("cluster-b")),
            pod("shop", "db", "10.0.0.5", None),
            pod("shop", "web", "10.20.0.9", None),
        ]
        .into_iter()
        .map(std::sync::Arc::new)
        .collect(),
        ..Default::default()
    }
}

#[test]
fn each_end_is_named_by_the_side_it_is_on_and_its_peer() {
    let book = AddressBook::new(&cluster(), &["liqo-tunnel"]);
    // From peer a's tunnel: the source is a's pod, the destination this cluster's.
    let e = event(
        "peerwall_cluster_a",
        "10.0.0.5",
        "10.0.0.5",
        "liqo-tunnel",
        "liqo.abc",
        0,
    );
    assert_eq!(book.names(&e), (Some("shop/cart"), Some("shop/db")));
    let e = event(
        "pwnp_cluster_b",
        "10.0.0.5",
        "10.20.0.9",
        "liqo-tunnel1",
        "eth0",
        0,
    );
    assert_eq!(book.names(&e), (Some("shop/cart-b"), Some("shop/web")));
    // Towards the tunnel: the other way round.
    let e = event(
        "peerwall_boot_cluster_a",
        "10.20.0.9",
        "10.0.0.5",
        "liqo.abc",
        "liqo-tunnel",
        0,
    );
    assert_eq!(book.names(&e), (Some("shop/web"), Some("shop/cart")));
    // Neither interface a tunnel: only an address one pod holds is named.
    let e = event(
        "peerwall_cluster_a",
        "10.0.0.5",
        "10.20.0.9",
        "eth0",
        "eth1",
        0,
    );
    assert_eq!(book.names(&e), (None, Some("shop/web")));
    // An unknown address, or a remote end whose peer runs nobody there.
    let e = event(
        "peerwall_cluster_c",
        "10.0.0.5",
        "10.99.0.1",
        "liqo-tunnel",
        "x",
        0,
    );
    assert_eq!(book.names(&e), (None, None));
}

#[test]
fn pod_filters_need_the_names() {
    let book = AddressBook::new(&cluster(), &["liqo-tunnel"]);
    let e = event(
        "pwnp_cluster_a",
        "10.0.0.5",
        "10.20.0.9",
        "liqo-tunnel",
        "eth0",
        0,
    );
    let (src, dst) = book.names(&e);
    let keeps = |f: PodFilter| f.keeps(&e, src, dst);
    assert!(keeps(PodFilter::default()));
    assert!(keeps(PodFilter {
        from_pod: Some("shop/cart".into()),
        to_pod: Some("shop/web".into()),
        ..Default::default()
    }));
    assert!(!keeps(PodFilter {
        from_pod: Some("shop/web".into()),
        ..Default::default()
    }));
    assert!(keeps(PodFilter {
        namespace: Some("shop".into()),
        ..Default::default()
    }));
    assert!(!keeps(PodFilter {
        namespace: Some("shopping".into()),
        ..Default::default()
    }));
    // Peers as the user spells them (the table replaces the dash).
    assert!(keeps(PodFilter {
        peer: Some("cluster-a".into()),
        ..Default::default()
    }));
    assert!(!keeps(PodFilter {
        peer: Some("cluster-b".into()),
        ..Default::default()
    }));
}

#[test]
fn events_of_several_agents_come_out_in_time_order() {
    let mut m = Merge::new(Duration::from_secs(1));
    let t = |ms| SystemTime::UNIX_EPOCH + Duration::from_millis(ms);
    m.push("node-b", event("t", "10.0.0.1", "10.0.0.2", "", "", 1_500));
    m.push("node-a", event("t", "10.0.0.1", "10.0.0.3", "", "", 1_200));
    m.push("node-a", event("t", "10.0.0.1", "10.0.0.4", "", "", 1_900));
    // At 2.6 s only what is older than 1.6 s is out, oldest first.
    let out: Vec<(String, u64)> = m
        .ready(t(2_600))
        .into_iter()
        .map(|s| {
            (
                s.node,
                s.event.time.duration_since(t(0)).unwrap().as_millis() as u64,
            )
        })
        .collect();
    assert_eq!(
        out,
        vec![("node-a".into(), 1_200), ("node-b".into(), 1_500)]
    );
    // A late one from another agent, older than what is held, still goes first.
    m.push("node-b", event("t", "10.0.0.1", "10.0.0.5", "", "", 1_700));
    let rest: Vec<u64> = m
        .drain()
        .into_iter()
        .map(|s| s.event.time.duration_since(t(0)).unwrap().as_millis() as u64)
        .collect();
    assert_eq!(rest, vec![1_700, 1_900]);
}
