use super::*;

fn ev(kind: EventKind, t: u64, sport: u16) -> Event {
    Event {
        time: UNIX_EPOCH + Duration::from_millis(t),
        verdict: kind,
        table: "t".into(),
        chain: "c".into(),
        rule: Some("r".into()),
        src: "10.0.0.1".parse().unwrap(),
        dst: "10.0.0.2".parse().unwrap(),
        proto: 6,
        sport,
        dport: 80,
        iif: "liqo-tunnel".into(),
        oif: "liqo.abc".into(),
        ct_state: Some(CtState::New),
        packets: 1,
        bytes: 60,
    }
}

#[test]
fn one_event_per_flow_and_interval_carries_the_packets_in_between() {
    let mut l = FlowLimiter::new(Duration::from_secs(1), 100);
    let first = l.offer(ev(EventKind::Drop, 0, 1000)).unwrap();
    assert_eq!((first.packets, first.bytes), (1, 60));
    for t in 1..10 {
        assert!(l.offer(ev(EventKind::Drop, t * 100, 1000)).is_none());
    }
    // Another flow and another kind of the same flow are reported at once.
    assert!(l.offer(ev(EventKind::Drop, 500, 1001)).is_some());
    assert!(l.offer(ev(EventKind::AuditDrop, 500, 1000)).is_some());
    let next = l.offer(ev(EventKind::Drop, 1000, 1000)).unwrap();
    assert_eq!((next.packets, next.bytes), (10, 600));
}

#[test]
fn the_end_of_a_burst_is_reported_once_the_flow_is_quiet() {
    let mut l = FlowLimiter::new(Duration::from_secs(1), 100);
    let at = |ms: u64| UNIX_EPOCH + Duration::from_millis(ms);
    // Ten packets in 900 ms: one event at once, nine counted and waiting.
    assert_eq!(l.offer(ev(EventKind::Drop, 0, 1000)).unwrap().packets, 1);
    for t in 1..10 {
        assert!(l.offer(ev(EventKind::Drop, t * 100, 1000)).is_none());
    }
    // Another flow whose one packet was reported: nothing waits for it.
    assert!(l.offer(ev(EventKind::Drop, 0, 1001)).is_some());
    // Not quiet for an interval yet: nothing.
    assert!(l.flush(at(999)).is_empty());
    let rest = l.flush(at(1000));
    assert_eq!(rest.len(), 1, "{rest:?}");
    assert_eq!(
        (rest[0].sport, rest[0].packets, rest[0].bytes),
        (1000, 9, 540)
    );
    // The latest packet's time: when the burst ended.
    assert_eq!(rest[0].time, at(900));
    // Sent once.
    assert!(l.flush(at(5000)).is_empty());
    // The flow's next packet, an interval after the remainder's, is reported at once with
    // only itself.
    assert_eq!(l.offer(ev(EventKind::Drop, 1900, 1000)).unwrap().packets, 1);
    // Every packet counted exactly once: 1 + 9 + 1 events' packets for 11 packets.
}

#[test]
fn memory_stays_bounded_under_a_flood_of_new_flows() {
    let mut l = FlowLimiter::new(Duration::from_secs(1), 64);
    for i in 0..10_000u16 {
        assert!(l.offer(ev(EventKind::Drop, 0, i)).is_some());
        assert!(l.len() <= 64);
    }
}

#[test]
fn filters_select_by_verdict_rule_and_time() {
    let e = ev(EventKind::AuditDrop, 5000, 1);
    let f = |verdict: Option<&str>, rule: Option<&str>, since: Option<u64>| EventFilter {
        verdict: verdict.map(String::from),
        rule: rule.map(String::from),
        since: since.map(|s| UNIX_EPOCH + Duration::from_millis(s)),
    };
    assert!(f(None, None, None).matches(&e));
    assert!(f(Some("audit"), None, None).matches(&e));
    assert!(!f(Some("drop"), None, None).matches(&e));
    assert!(f(None, Some("t/c/r"), None).matches(&e));
    assert!(f(None, Some("c/r"), None).matches(&e));
    assert!(f(None, Some("r"), None).matches(&e));
    assert!(!f(None, Some("x/r"), None).matches(&e));
    assert!(f(None, None, Some(5000)).matches(&e));
    assert!(!f(None, None, Some(5001)).matches(&e));
    assert_eq!(
        f(Some("dropped"), None, None).check(),
        Err(FilterError::Verdict("dropped".into()))
    );
}

#[test]
fn text_names_the_rule_the_flow_and_the_counts() {
    let mut e = ev(EventKind::Drop, 1_700_000_000_123, 40000);
    e.rule = None;
    assert_eq!(
        e.text(),
        "2023-11-14T22:13:20.123000Z drop         tcp 10.0.0.1:40000 -> 10.0.0.2:80 \
         liqo-tunnel -> liqo.abc ct new by t/c/policy (1 pkts, 60 bytes)"
    );
    let json = serde_json::to_value(&e).unwrap();
    let back: Event = serde_json::from_value(json.clone()).unwrap();
    assert_eq!(back, e);
    assert_eq!(
        parse_time("2026-11-23T17:00:00.000001Z"),
        Some(UNIX_EPOCH + Duration::from_secs(1_795_453_200) + Duration::from_micros(1))
    );
    assert_eq!(json["verdict"], "drop");
    assert_eq!(json["time"], "2023-11-14T22:13:20.123000Z");
    assert_eq!(json["ct_state"], "new");
}

#[test]
fn interface_names_come_from_the_kernel() {
    let mut n = IfNames::here().unwrap();
    assert_eq!(n.name(1), "lo");
    assert_eq!(n.name(0), "");
    assert_eq!(n.name(999_999), "if999999");
}
