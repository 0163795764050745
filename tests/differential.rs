//! Differential test: for random policies and packets, the real kernel running the nftables
//! rendering (`--engine nftables`) must give the reference evaluator's verdict, chain and rule.
//!
//! Seeded and reproducible: `PEERWALL_SEED=<n>` replays a run; `PEERWALL_DIFF_POLICIES` and
//! `PEERWALL_DIFF_PACKETS` scale it. A mismatch is shrunk to a minimal policy and printed as
//! FirewallConfiguration YAML with the packet.

mod common;

use common::require_root;
use peerwall::api::types::*;
use peerwall::compile::compile;
use peerwall::ir::{self, Packet};
use peerwall::probe::NftProbe;
use peerwall::testgen::{as_yaml, objects, random_packet, random_specs, IFACES};
use rand::rngs::StdRng;
use rand::SeedableRng;

/// Whether reference and kernel disagree on `pkt` under `specs` (a probe error counts).
fn mismatch(specs: &[FirewallConfigurationSpec], pkt: &Packet) -> Option<String> {
    let policy = compile(&objects(specs)).ok()?.policy;
    let expected = ir::evaluate(&policy, pkt);
    let ifs: Vec<String> = IFACES.iter().map(|s| s.to_string()).collect();
    let got = NftProbe::new(&policy, &ifs).and_then(|mut p| p.verdict(pkt));
    match got {
        Ok(v) if v == expected => None,
        Ok(v) => Some(format!("reference {expected:?}\nkernel    {v:?}")),
        Err(e) => Some(format!("reference {expected:?}\nkernel    error: {e}")),
    }
}

/// Drop tables, chains, rules and matches while the mismatch persists.
fn shrink(
    mut specs: Vec<FirewallConfigurationSpec>,
    pkt: &Packet,
) -> Vec<FirewallConfigurationSpec> {
    loop {
        let mut candidates: Vec<Vec<FirewallConfigurationSpec>> = Vec::new();
        for t in 0..specs.len() {
            let mut c = specs.clone();
            c.remove(t);
            candidates.push(c);
            for ch in 0..specs[t].table.chains.len() {
                let mut c = specs.clone();
                c[t].table.chains.remove(ch);
                candidates.push(c);
                let n = specs[t].table.chains[ch]
                    .rules
                    .filter_rules
                    .as_ref()
                    .map_or(0, Vec::len);
                for r in 0..n {
                    let mut c = specs.clone();
                    if let Some(rs) = c[t].table.chains[ch].rules.filter_rules.as_mut() {
                        rs.remove(r);
                    }
                    candidates.push(c);
                    let m = specs[t].table.chains[ch]
                        .rules
                        .filter_rules
                        .as_ref()
                        .map_or(0, |rs| rs[r].r#match.len());
                    for k in 0..m {
                        let mut c = specs.clone();
                        if let Some(rs) = c[t].table.chains[ch].rules.filter_rules.as_mut() {
                            rs[r].r#match.remove(k);
                        }
                        candidates.push(c);
                    }
                }
            }
        }
        match candidates.into_iter().find(|c| mismatch(c, pkt).is_some()) {
            Some(smaller) => specs = smaller,
            None => return specs,
        }
    }
}

fn env_num(key: &str, default: u64) -> u64 {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn nftables_kernel_equals_reference() {
    require_root();
    let seed = env_num("PEERWALL_SEED", rand::random::<u32>() as u64);
    let policies = env_num("PEERWALL_DIFF_POLICIES", 12);
    let packets = env_num("PEERWALL_DIFF_PACKETS", 25);
    eprintln!("differential: PEERWALL_SEED={seed} policies={policies} packets={packets}");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut cases = 0;
    let ifs: Vec<String> = IFACES.iter().map(|s| s.to_string()).collect();
    for _ in 0..policies {
        let specs = random_specs(&mut rng);
        let policy = compile(&objects(&specs))
            .unwrap_or_else(|e| panic!("generator made an invalid policy: {e}"))
            .policy;
        let mut probe = NftProbe::new(&policy, &ifs).expect("scratch gateway");
        for _ in 0..packets {
            let pkt = random_packet(&mut rng);
            let expected = ir::evaluate(&policy, &pkt);
            let got = probe.verdict(&pkt);
            let agree = matches!(&got, Ok(v) if *v == expected);
            if !agree {
                let minimal = shrink(specs.clone(), &pkt);
                let yaml: Vec<String> = minimal
                    .iter()
                    .enumerate()
                    .map(|(i, s)| as_yaml(i, s))
                    .collect();
                panic!(
                    "MISMATCH (PEERWALL_SEED={seed})\npacket {pkt:?}\nreference {expected:?}\nkernel    {got:?}\nminimal policy:\n{}\nminimal: {}",
                    yaml.join("---\n"),
                    mismatch(&minimal, &pkt).unwrap_or_default()
                );
            }
            cases += 1;
        }
    }
    eprintln!("differential: {cases} cases, 0 mismatches");
    assert_eq!(cases, policies * packets);
}
