//! Loading, validation and compilation of FirewallConfigurations from arbitrary text: no panic
//! and no hang; an error names where, or the policy is valid IR, which both backends' pure
//! stages take (nftables rendering, bpf map compilation) and on which the bpf map simulation
//! agrees with the reference evaluator for packets drawn from the input.
#![no_main]

use libfuzzer_sys::fuzz_target;
use peerwall_backend_bpf::maps::{self, DatapathPacket, Iface};
use peerwall_backend_nftables::render::{render_policy, RenderOptions};
use peerwall_policy::ir::evaluate;
use peerwall_policy::testgen::{random_packet, IFACES};
use rand::SeedableRng;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let objects = match peerwall_intent::load::parse_documents(text, "fuzz") {
        Ok(o) => o,
        Err(e) => {
            assert!(!e.to_string().is_empty());
            return;
        }
    };
    let compiled = match peerwall_policy::compile::compile(&objects) {
        Ok(c) => c,
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains(':'), "an error without a path: {msg}");
            return;
        }
    };
    let policy = compiled.policy;
    let _ = render_policy(&policy, RenderOptions::default());
    let ifaces: Vec<Iface> = IFACES
        .iter()
        .enumerate()
        .map(|(i, n)| Iface {
            name: n.to_string(),
            ifindex: 10 + i as u32,
        })
        .collect();
    let Ok(bp) = maps::compile(&policy, &ifaces) else {
        return;
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(data.len() as u64);
    for _ in 0..8 {
        let pkt = random_packet(&mut rng);
        let index = |n: &Option<String>| {
            n.as_ref()
                .and_then(|n| ifaces.iter().find(|i| &i.name == n))
                .map_or(0, |i| i.ifindex)
        };
        let dp = DatapathPacket {
            pkt: &pkt,
            iif: index(&pkt.iif),
            oif: index(&pkt.oif),
        };
        assert_eq!(
            maps::simulate(&bp, &dp),
            evaluate(&policy, &pkt),
            "bpf map simulation and reference disagree on {pkt:?}"
        );
    }
});
