//! Reading Liqo's `Configuration` of a peer (`networking.liqo.io/v1beta1`,
//! `apis/networking/v1beta1/configuration_types.go`): its CIDRs as this cluster sees them,
//! how they are remapped, and the sources its packets may carry through the tunnel.

use crate::Remap;
use crate::REMOTE_CLUSTER_ID;
use serde_json::Value;
use std::collections::BTreeMap;
use std::net::IpAddr;

/// The remaps of one Liqo `Configuration` (its labels and its JSON body): the peer it is for
/// (label `liqo.io/remote-cluster-id`, Liqo's `external-network/route/k8s.go`
/// `GetRemoteClusterID`) and, position by position, `spec.remote.cidr.{pod,external}` against
/// `status.remote.cidr.{pod,external}`. Identity mappings (no overlap) are left out; an entry
/// that does not parse, or whose two prefixes differ in length, is skipped (Liqo never
/// writes one).
pub fn configuration_remaps(
    labels: &BTreeMap<String, String>,
    body: &Value,
) -> Option<(String, Vec<Remap>)> {
    let peer = labels.get(REMOTE_CLUSTER_ID)?.clone();
    let mut out = Vec::new();
    for kind in ["pod", "external"] {
        let list = |side: &str| -> Vec<Option<ipnet::IpNet>> {
            body.pointer(&format!("/{side}/remote/cidr/{kind}"))
                .and_then(Value::as_array)
                .map(|v| {
                    v.iter()
                        .map(|c| c.as_str().and_then(|s| s.parse().ok()))
                        .collect()
                })
                .unwrap_or_default()
        };
        for (real, seen) in list("spec").into_iter().zip(list("status")) {
            if let (Some(real), Some(seen)) = (real, seen) {
                if real != seen && real.prefix_len() == seen.prefix_len() {
                    out.push(Remap { real, seen });
                }
            }
        }
    }
    Some((peer, out))
}

/// The peer a Liqo `Configuration` is for and its pod and external CIDRs as this cluster sees
/// them: `status.remote.cidr.{pod,external}` (remapped where they overlap ours), else
/// `spec.remote.cidr.{pod,external}`. Entries that do not parse are skipped.
pub fn configuration_cidrs(
    labels: &BTreeMap<String, String>,
    body: &Value,
) -> Option<(String, Vec<ipnet::IpNet>)> {
    let peer = labels.get(REMOTE_CLUSTER_ID)?.clone();
    let mut out = Vec::new();
    for kind in ["pod", "external"] {
        let seen = configuration_list(body, "status", kind);
        out.extend(if seen.is_empty() {
            configuration_list(body, "spec", kind)
        } else {
            seen
        });
    }
    out.sort();
    out.dedup();
    Some((peer, out))
}

/// The CIDRs of a `Configuration`'s `{side}.remote.cidr.{kind}` that parse.
pub(crate) fn configuration_list(body: &Value, side: &str, kind: &str) -> Vec<ipnet::IpNet> {
    body.pointer(&format!("/{side}/remote/cidr/{kind}"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|c| c.as_str()?.parse().ok())
        .collect()
}

/// The peer a Liqo `Configuration` is for and the source CIDRs its packets may carry through
/// the tunnel: its pod and external CIDRs, both its own (`spec.remote.cidr`, what the
/// gateway's forward hook sees before Liqo's SNAT at postrouting) and as seen here
/// (`status.remote.cidr`, remapped where they overlap ours). Entries that do not parse are
/// skipped.
pub fn configuration_sources(
    labels: &BTreeMap<String, String>,
    body: &Value,
) -> Option<(String, Vec<ipnet::IpNet>)> {
    let peer = labels.get(REMOTE_CLUSTER_ID)?.clone();
    let mut out: Vec<ipnet::IpNet> = Vec::new();
    for side in ["spec", "status"] {
        for kind in ["pod", "external"] {
            out.extend(configuration_list(body, side, kind));
        }
    }
    out.sort();
    out.dedup();
    Some((peer, out))
}

/// `ip` (as this cluster sees it) as it crosses `remaps`' peer's tunnel.
pub(crate) fn real_address(remaps: &[Remap], ip: IpAddr) -> IpAddr {
    remaps.iter().find_map(|r| r.to_real(ip)).unwrap_or(ip)
}
