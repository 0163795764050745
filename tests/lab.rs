//! The gateway lab end to end: real WireGuard tunnels, both backends driven by
//! `peerwall agent --source dir:`, the matrix of provider protection and the provider's
//! NetworkPolicies (with a consumer whose pod CIDR overlaps the provider's, behind Liqo's
//! remapping NAT), the live offload.

use peerwall_testkit::{peerwall, require_root};
use std::process::Command;

#[test]
fn lab_matrices_are_expected_and_equal_for_both_backends() {
    require_root();
    let o = Command::new(peerwall())
        .arg("lab")
        .output()
        .expect("peerwall lab");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains("backends agree: yes"), "{out}");
    assert!(
        out.contains(
            "nftables: matrix equals the expected matrix (protection and NetworkPolicies): yes"
        ),
        "{out}"
    );
    assert!(
        out.contains(
            "bpf: matrix equals the expected matrix (protection and NetworkPolicies): yes"
        ),
        "{out}"
    );
    assert!(!out.contains("UNEXPECTED"), "{out}");
    // Per consumer 18 pairs (7 per pod: the 4 offloaded pods, the provider's local one and
    // its two monitoring pods; the provider-initiated pair; each consumer's offloaded pod
    // calling this consumer home), the provider's pod running on consumer c both ways and
    // towards local/cache, consumer a's spoofed source and consumer c's pod posing as
    // the provider's pod local/twin: 59 per backend.
    assert_eq!(out.matches(" || ").count(), 2 * 59, "{out}");
    // Consumer c's pod CIDR is the provider's own, remapped by Liqo's NAT in c's gateway: the
    // provider reaches c's pod by its remapped address and gets the replies (the bpf datapath
    // classifies them on the addresses the forward hook sees), and the provider's pod running
    // on c reaches home (the controller lists it by the address it has behind the tunnel).
    // The provider's NetworkPolicies (the lab's `lab_cluster`) hold per probe (ICMP, TCP
    // 8080, UDP 9090): a named port from one address, an ipBlock except, an egress allowlist
    // and an ingress rule naming the remote pod on c by label.
    for row in [
        "OK    +++ | [provider local] -> [provider pod on consumer c] || 10.20.3.10 -> 10.71.9.20",
        // The lab's ClusterNetworkPolicies (`lab_cluster_policies`): `local-from-ours` lets
        // only HTTP in from the provider's pod on c; the Admin tier accepts its UDP 9090 too
        // (`ours-echo-home`, over the NetworkPolicy's isolation), hands its HTTP to the
        // NetworkPolicies (`ours-http-to-owners`, a Pass) before denying the rest
        // (`ours-nothing-else`).
        "MIXED -++ | [provider pod on consumer c] -> [provider local] || 10.20.9.20 -> 10.20.3.10",
        // No NetworkPolicy isolates local/cache: the Baseline tier's default refuses HTTP.
        "MIXED +-+ | [provider pod on consumer c] -> [provider local/cache] || 10.20.9.20 -> 10.20.3.12",
        "FAIL  --- | [consumer c pod 10.20.9.10] -> [provider local] || 10.20.9.10 -> 10.20.3.10",
        "OK    +++ | [consumer c pod 10.20.9.10] -> [provider offloaded-by-c] || 10.20.9.10 -> 10.20.4.10",
        "MIXED -+- | [consumer a pod 10.10.1.10] -> [provider offloaded-by-a] || 10.10.1.10 -> 10.20.1.11",
        "FAIL  --- | [consumer a pod 10.10.1.11] -> [provider offloaded-by-a] || 10.10.1.11 -> 10.20.1.11",
        // The lab's ProtectionPolicy `no-echo-from-b` closes UDP 9090 to b's tunnel, even
        // towards the pods b offloaded.
        "MIXED ++- | [consumer b pod 10.30.1.10] -> [provider offloaded-by-b] || 10.30.1.10 -> 10.20.2.10",
        // `open-metrics` opens the provider's prometheus on TCP 8080 to consumer a only; the
        // pod beside it stays closed.
        "MIXED -+- | [consumer a pod 10.10.1.10] -> [provider monitoring/prometheus (opened to a)] || 10.10.1.10 -> 10.20.5.10",
        "FAIL  --- | [consumer a pod 10.10.1.10] -> [provider monitoring/grafana] || 10.10.1.10 -> 10.20.5.11",
        "FAIL  --- | [consumer b pod 10.30.1.10] -> [provider monitoring/prometheus (opened to a)] || 10.30.1.10 -> 10.20.5.10",
        "FAIL  --- | [consumer b pod 10.30.1.11] -> [provider offloaded-by-b] || 10.30.1.11 -> 10.20.2.10",
        // `local-egress` lets local-0 send TCP 8080 and UDP 9090 to a's pods; the Admin tier
        // denies the UDP (`no-echo-to-a`).
        "MIXED -+- | [provider local] -> [consumer a pod] || 10.20.3.10 -> 10.10.1.10",
        "FAIL  --- | [provider local] -> [consumer c pod] || 10.20.3.10 -> 10.71.9.10",
        // Call home: the NetworkPolicy the controller keeps in an offloaded namespace lets its
        // pods reach their own consumer (by the address seen here when remapped), and not
        // another consumer; the gateway's tier holds it, as every NetworkPolicy.
        "OK    +++ | [provider offloaded-by-a] -> [consumer a pod (call home)] || 10.20.1.10 -> 10.10.1.10",
        "OK    +++ | [provider offloaded-by-c] -> [consumer c pod (call home)] || 10.20.4.10 -> 10.71.9.10",
        "FAIL  --- | [provider offloaded-by-a] -> [consumer b pod (call home)] || 10.20.1.10 -> 10.30.1.10",
        "FAIL  --- | [provider offloaded-by-b] -> [consumer a pod (call home)] || 10.20.2.10 -> 10.10.1.10",
        // c's CIDR is the provider's own: a pod of c sending from the provider's local pod's
        // address passes anti-spoofing, but is not that pod, which the NetworkPolicy of c's
        // offloaded pod admits by label (c's own pods by block).
        "FAIL  --- | [consumer c pod posing as provider local/twin 10.20.3.11] -> [provider offloaded-by-c] || 10.20.3.11 -> 10.20.4.10",
        // Anti-spoofing: Liqo's WireGuard takes any source from the peer; the firewall does not.
        "FAIL  --- | [consumer a spoofed source 10.99.1.10] -> [provider offloaded-by-a] || 10.99.1.10 -> 10.20.1.10",
    ] {
        assert_eq!(out.matches(row).count(), 2, "{row}\n{out}");
    }
    // The rewrite is pinned where bpftool and `peerwall inspect` read it: on C's interfaces
    // other than the tunnel (the DNAT excludes it), in C's gateway only.
    let views: Vec<&str> = out
        .lines()
        .filter(|l| l.contains(" datapath view "))
        .collect();
    assert!(!views.is_empty(), "{out}");
    for v in views {
        assert!(v.starts_with("gateway c datapath view ifindex "), "{v}");
        assert!(v.ends_with(": 10.71.0.0/16 -> 10.20.0.0/16"), "{v}");
    }
    // Nothing left behind.
    let ns = Command::new("ip").args(["netns", "list"]).output().unwrap();
    let left: Vec<String> = String::from_utf8_lossy(&ns.stdout)
        .lines()
        .filter(|l| l.starts_with("pwlab-"))
        .map(str::to_string)
        .collect();
    assert!(left.is_empty(), "namespaces left: {left:?}");

    // Ctrl-C in the middle: everything it built is removed too.
    let mut child = Command::new(peerwall())
        .args(["lab", "--backend", "nftables"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1500));
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130), "interrupted lab exits 130");
    let ns = Command::new("ip").args(["netns", "list"]).output().unwrap();
    assert!(
        !String::from_utf8_lossy(&ns.stdout).contains("pwlab-"),
        "namespaces left after Ctrl-C"
    );
    let ps = Command::new("ps")
        .args(["-eo", "stat,args"])
        .output()
        .unwrap();
    let live: Vec<String> = String::from_utf8_lossy(&ps.stdout)
        .lines()
        .filter(|l| {
            !l.starts_with('Z')
                && (l.contains("wireguard-go -f") || l.contains("socat UDP4-RECVFROM:9090"))
        })
        .map(str::to_string)
        .collect();
    assert!(live.is_empty(), "processes left after Ctrl-C: {live:?}");
}
