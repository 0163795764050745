//! The slices loop: every tenant namespace's AddressSet slices ([`super::tenants`]'s slices
//! pass), as soon as a change comes.
//!
//! Its own loop rather than a kube-runtime `Controller`: a controller's scheduler keeps its
//! work in a timer wheel of millisecond ticks, so even without a debounce a pass ran on the
//! next tick after the change (`bench-control` with `PEERWALL_BENCH_LOGS`: a pod's change →
//! its slices pass, 0.9–2.4 ms, the largest part of the controller's own time for one pod
//! after the API server's round trip). Here a change wakes the pass at once. What the
//! controller gave stays: one pass at a time (a pass under way takes every change made
//! meanwhile, and the next waits for it: an event storm is few passes), a pass on every
//! tenant namespace that appears or changes (the context's namespace cache, listed before the
//! loop starts, wakes it like any other change), and a failed or held-back pass tried again
//! (after 2 s, and 0.5 s while an address waits for another tenant to release it).

use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;

use super::context::Ctx;
use super::tenants::slices_pass;

/// How long a failed pass waits before the next (as the other loops' error policy).
const RETRY_FAILED: Duration = Duration::from_secs(2);
/// How long a pass that held an address back waits before the next.
const RETRY_HELD: Duration = Duration::from_millis(500);

/// Run the slices loop over Liqo's tenant namespaces (labelled
/// [`crate::TENANT_NAMESPACE`]`=true`) for as long as the controller runs.
pub(super) async fn run(changed: Arc<crate::Changes>, ctx: Arc<Ctx>) {
    let mut retry: Option<tokio::time::Instant> = None;
    loop {
        let retried = async {
            match retry {
                Some(at) => tokio::time::sleep_until(at).await,
                None => futures::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            _ = changed.notify.notified() => {}
            _ = retried => {}
        }
        retry = None;
        let now = tokio::time::Instant::now();
        let tenants = ctx.namespaces.state().into_iter().filter(|ns| {
            ns.labels()
                .get(crate::TENANT_NAMESPACE)
                .is_some_and(|v| v == "true")
        });
        for ns in tenants {
            let again = match slices_pass(&ns, &ctx).await {
                Ok(0) => continue,
                Ok(_) => RETRY_HELD,
                Err(e) => {
                    ctx.count(|m| m.reconcile_errors += 1);
                    tracing::warn!(object = %ns.name_any(), error = %e, "reconcile failed; retrying");
                    RETRY_FAILED
                }
            };
            let at = now + again;
            retry = Some(retry.map_or(at, |r| r.min(at)));
        }
    }
}
