//! Which Liqo gateways nothing enforces in: a gateway pod is covered by a peerwall container
//! of its own (sidecar mode) or by a ready agent on its node (DaemonSet mode). A gateway on a
//! node the DaemonSet does not reach (a nodeSelector, a taint it does not tolerate, an agent
//! that does not start) passes its peer's traffic unfiltered: the controller says so (an
//! Event on the gateway pod, a metric, a log line) once it stayed so for a grace period.
//!
//! Pure: the controller feeds pods in, gets the gateways to warn about out.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// Name of peerwall's container in a gateway pod (sidecar mode).
pub const SIDECAR_CONTAINER: &str = "peerwall";

/// A Liqo gateway pod, as far as coverage goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GatewayPod {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID (a recreated pod is another gateway).
    pub uid: String,
    /// The node it was scheduled on (None: not scheduled yet, nothing to enforce).
    pub node: Option<String>,
    /// Whether it carries a peerwall container (sidecar mode).
    pub sidecar: bool,
}

/// What changed in coverage since the last look.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Findings {
    /// Gateways unprotected for the whole grace period, newly: warn about these.
    pub newly_unprotected: Vec<GatewayPod>,
    /// Gateways warned about before that are protected (or gone) now.
    pub recovered: Vec<String>,
    /// Gateways unprotected past the grace period, now.
    pub unprotected: usize,
}

/// Tracks gateways without enforcement over time.
#[derive(Debug)]
pub struct Coverage {
    grace: Duration,
    /// Since when each unprotected gateway (by UID) has been seen so.
    since: BTreeMap<String, Instant>,
    /// Gateways warned about, by UID, with their `namespace/name`.
    warned: BTreeMap<String, String>,
}

impl Coverage {
    /// A tracker that warns once a gateway stayed unprotected for `grace`.
    pub fn new(grace: Duration) -> Self {
        Self {
            grace,
            since: BTreeMap::new(),
            warned: BTreeMap::new(),
        }
    }

    /// Look at the cluster at `now`: the gateway pods and the nodes with a ready agent.
    pub fn observe(
        &mut self,
        now: Instant,
        gateways: &[GatewayPod],
        agent_nodes: &BTreeSet<String>,
    ) -> Findings {
        let mut f = Findings::default();
        let mut seen = BTreeSet::new();
        for g in gateways {
            let Some(node) = &g.node else { continue };
            if g.sidecar || agent_nodes.contains(node) {
                continue;
            }
            seen.insert(g.uid.clone());
            let since = *self.since.entry(g.uid.clone()).or_insert(now);
            if now.duration_since(since) >= self.grace {
                f.unprotected += 1;
                if !self.warned.contains_key(&g.uid) {
                    self.warned
                        .insert(g.uid.clone(), format!("{}/{}", g.namespace, g.name));
                    f.newly_unprotected.push(g.clone());
                }
            }
        }
        self.since.retain(|uid, _| seen.contains(uid));
        let recovered: Vec<String> = self
            .warned
            .keys()
            .filter(|uid| !seen.contains(*uid))
            .cloned()
            .collect();
        for uid in recovered {
            if let Some(name) = self.warned.remove(&uid) {
                f.recovered.push(name);
            }
        }
        f
    }
}

/// Where each namespace's gateways are enforced now: the nodes of its scheduled gateway pods
/// that a peerwall container of their own (sidecar) or a ready agent on their node covers.
/// Both modes report conditions with `host` = the node's name, so these are the hosts whose
/// `Applied` conditions speak for a gateway that exists; any other host's condition is stale
/// (an agent deleted, a gateway moved away, a node gone).
pub fn live_hosts(
    gateways: &[GatewayPod],
    agent_nodes: &BTreeSet<String>,
) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for g in gateways {
        let Some(node) = &g.node else { continue };
        if g.sidecar || agent_nodes.contains(node) {
            out.entry(g.namespace.clone())
                .or_default()
                .insert(node.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_hosts_are_the_covered_gateways_nodes() {
        let agents: BTreeSet<String> = ["n1".to_string()].into();
        let mut other = gw("b", "n3", false);
        other.namespace = "liqo-tenant-b".into();
        let live = live_hosts(
            &[
                gw("covered", "n1", false),
                gw("bare", "n2", false),
                gw("side", "n4", true),
                other,
            ],
            &agents,
        );
        assert_eq!(
            live.get("liqo-tenant-a").cloned().unwrap_or_default(),
            ["n1".to_string(), "n4".to_string()].into()
        );
        assert!(
            !live.contains_key("liqo-tenant-b"),
            "n3 has no agent: {live:?}"
        );
    }

    fn gw(name: &str, node: &str, sidecar: bool) -> GatewayPod {
        GatewayPod {
            namespace: "liqo-tenant-a".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
            node: Some(node.into()),
            sidecar,
        }
    }

    #[test]
    fn warns_once_after_the_grace_period_and_says_when_it_recovers() {
        let grace = Duration::from_secs(30);
        let mut c = Coverage::new(grace);
        let t0 = Instant::now();
        let agents: BTreeSet<String> = ["n1".to_string()].into();
        let gws = [
            gw("covered", "n1", false),
            gw("bare", "n2", false),
            gw("side", "n2", true),
        ];
        let f = c.observe(t0, &gws, &agents);
        assert!(
            f.newly_unprotected.is_empty(),
            "not before the grace period"
        );
        assert_eq!(f.unprotected, 0);
        let f = c.observe(t0 + grace, &gws, &agents);
        assert_eq!(f.newly_unprotected, vec![gw("bare", "n2", false)]);
        assert_eq!(f.unprotected, 1);
        let f = c.observe(t0 + grace * 2, &gws, &agents);
        assert!(f.newly_unprotected.is_empty(), "once");
        assert_eq!(f.unprotected, 1);
        let agents: BTreeSet<String> = ["n1".to_string(), "n2".to_string()].into();
        let f = c.observe(t0 + grace * 3, &gws, &agents);
        assert_eq!(f.recovered, vec!["liqo-tenant-a/bare".to_string()]);
        assert_eq!(f.unprotected, 0);
    }

    #[test]
    fn a_gateway_covered_within_the_grace_period_is_never_reported() {
        let grace = Duration::from_secs(30);
        let mut c = Coverage::new(grace);
        let t0 = Instant::now();
        let gws = [gw("g", "n2", false)];
        c.observe(t0, &gws, &BTreeSet::new());
        let covered: BTreeSet<String> = ["n2".to_string()].into();
        c.observe(t0 + grace / 2, &gws, &covered);
        // Uncovered again: the clock starts over.
        let f = c.observe(t0 + grace, &gws, &BTreeSet::new());
        assert!(f.newly_unprotected.is_empty());
        let unscheduled = GatewayPod {
            node: None,
            ..gw("p", "x", false)
        };
        let f = c.observe(t0 + grace * 5, &[unscheduled], &BTreeSet::new());
        assert_eq!(f.unprotected, 0);
    }
}
