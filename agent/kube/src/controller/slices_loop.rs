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
//! tenant namespace that appears or changes, and a failed or held-back pass tried again
//! (after 2 s, and 0.5 s while an address waits for another tenant to release it).

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::runtime::{reflector, watcher, WatchStreamExt};
use kube::{Api, Client, ResourceExt};

use super::context::Ctx;
use super::tenants::slices_pass;

/// How long a failed pass waits before the next (as the other loops' error policy).
const RETRY_FAILED: Duration = Duration::from_secs(2);
/// How long a pass that held an address back waits before the next.
const RETRY_HELD: Duration = Duration::from_millis(500);

/// Run the slices loop over the namespaces `tenants` selects until its namespace watch ends
/// (never, while the client lives: the watch retries with backoff).
pub(super) async fn run(
    client: Client,
    tenants: watcher::Config,
    changed: Arc<crate::Changes>,
    ctx: Arc<Ctx>,
) {
    let (store, writer) = reflector::store::<Namespace>();
    let namespaces = watcher(Api::<Namespace>::all(client), tenants)
        .default_backoff()
        .reflect(writer);
    futures::pin_mut!(namespaces);
    let mut retry: Option<tokio::time::Instant> = None;
    // Whether the store holds every tenant namespace (after the watch's first list): until
    // then a pass would miss some, and the list's end brings one.
    let mut listed = false;
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
            ev = namespaces.next() => match ev {
                None => return,
                Some(Err(e)) => {
                    tracing::debug!(error = %e, "tenant namespace watch");
                    continue;
                }
                Some(Ok(watcher::Event::InitDone)) => listed = true,
                // A (re)list under way: its end passes over all of them.
                Some(Ok(watcher::Event::Init | watcher::Event::InitApply(_))) => continue,
                Some(Ok(watcher::Event::Apply(_) | watcher::Event::Delete(_))) => {}
            },
            _ = retried => {}
        }
        if !listed {
            continue;
        }
        retry = None;
        let now = tokio::time::Instant::now();
        for ns in store.state() {
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
