//! The lab's consumers: their pod CIDRs (one overlapping the provider's, remapped by Liqo),
//! underlay and Geneve addresses, the pods they run and offload, the sources they probe from.

use anyhow::{Context, Result};
use serde_json::Value;

use crate::protection;

/// A second local pod of the provider (`local/twin`), which no probe reaches: what consumer c
/// poses as.
pub(super) const TWIN_POD: &str = "10.20.3.11";

pub(super) struct Consumer {
    pub(super) name: &'static str,
    /// Its own pod CIDR (what crosses the tunnel).
    pub(super) cidr: &'static str,
    /// How the provider sees that CIDR when it overlaps the provider's own (Liqo remaps it:
    /// the provider's pods address the consumer's pods there).
    pub(super) remapped: Option<&'static str>,
    /// A provider pod running on this consumer (offloaded through its virtual node): its
    /// address in the consumer's CIDR.
    pub(super) hosts_ours: Option<&'static str>,
    /// An address outside its CIDR it sends from (anti-spoofing's probe).
    pub(super) spoofed: Option<&'static str>,
    /// One of the provider's local pods' addresses, inside this consumer's CIDR where it
    /// overlaps the provider's: it sends from it, posing as that pod (which a NetworkPolicy
    /// admits by label where the consumer's own pods are not). No probe reaches that pod, so
    /// the address can live on the consumer's side.
    pub(super) poses_as: Option<&'static str>,
    pub(super) pods: [&'static str; 2],
    pub(super) underlay: (&'static str, &'static str),
    pub(super) geneve: &'static str,
    pub(super) link: (&'static str, &'static str),
    pub(super) offloaded: Vec<String>,
}

pub(super) fn consumers() -> Vec<Consumer> {
    vec![
        Consumer {
            name: "a",
            cidr: "10.10.0.0/16",
            pods: ["10.10.1.10", "10.10.1.11"],
            underlay: ("192.168.210.1", "192.168.210.2"),
            geneve: "liqo.a1b2c3d4e5",
            link: ("169.254.10.1", "169.254.10.2"),
            offloaded: vec!["10.20.1.10".into(), "10.20.1.11".into()],
            remapped: None,
            hosts_ours: None,
            spoofed: Some("10.99.1.10"),
            poses_as: None,
        },
        Consumer {
            name: "b",
            cidr: "10.30.0.0/16",
            pods: ["10.30.1.10", "10.30.1.11"],
            underlay: ("192.168.230.1", "192.168.230.2"),
            geneve: "liqo.f6g7h8i9j0",
            link: ("169.254.30.1", "169.254.30.2"),
            offloaded: vec!["10.20.2.10".into()],
            remapped: None,
            hosts_ours: None,
            spoofed: None,
            poses_as: None,
        },
        // Same pod CIDR as the provider: Liqo remaps it to 10.71.0.0/16 here.
        Consumer {
            name: "c",
            cidr: PROVIDER_CIDR,
            pods: ["10.20.9.10", "10.20.9.11"],
            underlay: ("192.168.250.1", "192.168.250.2"),
            geneve: "liqo.k1l2m3n4o5",
            link: ("169.254.50.1", "169.254.50.2"),
            offloaded: vec!["10.20.4.10".into()],
            remapped: Some("10.71.0.0/16"),
            hosts_ours: Some("10.20.9.20"),
            spoofed: None,
            poses_as: Some(TWIN_POD),
        },
    ]
}

/// The provider's pod CIDR.
pub(super) const PROVIDER_CIDR: &str = "10.20.0.0/16";

impl Consumer {
    /// Liqo's remapping FirewallConfiguration in this consumer's gateway, when its CIDR is
    /// remapped here.
    pub(super) fn remap_object(&self) -> Option<Value> {
        Some(super::liqo::remap_object(
            self.name,
            self.cidr,
            self.remapped?,
        ))
    }

    /// The CIDR the provider reaches this consumer's pods by.
    pub(super) fn seen_cidr(&self) -> &'static str {
        self.remapped.unwrap_or(self.cidr)
    }

    /// `ip` (in the consumer's CIDR) as the provider sees it: the host part kept in the
    /// remapped CIDR (Liqo's prefix mapping).
    pub(super) fn seen(&self, ip: &str) -> Result<String> {
        let Some(remapped) = self.remapped else {
            return Ok(ip.to_string());
        };
        let remap = protection::Remap {
            real: self.cidr.parse().context("consumer CIDR")?,
            seen: remapped.parse().context("remapped CIDR")?,
        };
        let ip = ip.parse().context("consumer pod address")?;
        remap
            .to_seen(ip)
            .map(|a| a.to_string())
            .with_context(|| format!("{ip} is not in {}", self.cidr))
    }
}
