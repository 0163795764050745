//! The API server's own floor on this machine, measured in two blocks around the one-pod
//! samples: a write (a ConfigMap's data patched, which no peerwall process watches) → a watch
//! of it sees that version. A pod's address crosses two of these before any packet can pass
//! (its status to the controller, the controller's slice to the agent), so twice this floor
//! plus the agent's part bounds from below what the one-pod samples could reach with a
//! controller that costs nothing (its slice, up to `SLICE_FILL` addresses, is a larger write
//! than this one). Watched by label, as the bench watches the slices: a field-selected watch of the
//! same object measured 12–26 ms.
//!
//! Beside it, the same floor for the largest write the controller makes for one pod: an
//! AddressSet slice of `SLICE_FILL` (1000) addresses, one of them changed, applied as the
//! controller applies its slices (server-side apply) and watched by label. The API server's
//! work grows with the object (it decodes, validates, stores and sends every address), so a
//! pod whose address lands in a full slice waits for this write rather than the first. And
//! the same for a slice of one address: what a pod's own write costs at the least, so that
//! the lower bound of a controller that publishes AddressSets can be read beside the one of
//! two ConfigMap writes.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use serde_json::json;

const NAME: &str = "peerwall-bench-floor";

/// A ConfigMap and a watch of it, ready for writes ([`Floor::write_seen`]); the watch ends
/// when this is dropped.
pub struct Floor {
    api: Api<ConfigMap>,
    slices: Api<DynamicObject>,
    seen: Arc<Mutex<BTreeMap<String, Instant>>>,
    watch: tokio::task::JoinHandle<()>,
    slice_watch: tokio::task::JoinHandle<()>,
    writes: usize,
}

/// Addresses in the floor's slice: as many as a full slice of the controller holds.
const FULL_SLICE: u32 = peerwall::protection::SLICE_FILL as u32;

/// The floor's slice of one address: the least a controller publishing a pod's address as an
/// AddressSet writes.
const SMALL: &str = "peerwall-bench-floor-one";

impl Floor {
    /// Create the ConfigMap (if absent) and start watching it.
    pub async fn start(client: &Client) -> Self {
        let api: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
        let body: ConfigMap = serde_json::from_value(
            json!({"metadata": {"name": NAME, "labels": {NAME: "1"}}, "data": {"i": "start"}}),
        )
        .expect("configmap");
        if api.get_opt(NAME).await.expect("read configmap").is_none() {
            api.create(&PostParams::default(), &body)
                .await
                .expect("create configmap");
        }
        let seen: Arc<Mutex<BTreeMap<String, Instant>>> = Arc::default();
        // Selected by label, as the bench's watch of the slices is.
        let watch = watch_marks(api.clone(), seen.clone(), |cm: ConfigMap| {
            cm.data.and_then(|d| d.get("i").cloned())
        });
        let slices: Api<DynamicObject> = Api::namespaced_with(
            client.clone(),
            "default",
            &peerwall::k8s::address_set_resource(),
        );
        let slice_watch = watch_marks(slices.clone(), seen.clone(), |o: DynamicObject| {
            o.annotations().get(NAME).cloned()
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        Self {
            api,
            slices,
            seen,
            watch,
            slice_watch,
            writes: 0,
        }
    }

    /// One block of `n` writes of each kind, 20 ms apart: the ConfigMap's (`floor`), the
    /// full slice's (`slices`) and the one-address slice's (`small`), the two slices' in
    /// turn. The ConfigMap's writes are the ones next to the samples (`before`: the block
    /// ends with them; after: it starts with them), as they were before the slices' writes
    /// joined the blocks, so that a slice write never precedes one of them or a sample by
    /// 20 ms.
    pub async fn block(
        &mut self,
        n: usize,
        before: bool,
        floor: &mut Vec<Duration>,
        slices: &mut Vec<Duration>,
        small: &mut Vec<Duration>,
    ) {
        for round in 0..2 {
            for _ in 0..n {
                if (round == 0) == before {
                    slices.push(self.slice_seen(FULL_SLICE, NAME).await);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    small.push(self.slice_seen(1, SMALL).await);
                } else {
                    floor.push(self.write_seen().await);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }

    /// One write of slice `name` holding `size` addresses (one of them changed): how long
    /// until the watch saw it.
    async fn slice_seen(&mut self, size: u32, name: &str) -> Duration {
        let key = format!("s{}", self.writes);
        self.writes += 1;
        let changed = self.writes as u32;
        // 10.250.0.0/16 onwards: no pod of the bench has these, and nothing selects the slice.
        let addresses: Vec<String> = (0..size)
            .map(|i| {
                let n = if i == 0 { FULL_SLICE + changed } else { i };
                format!("10.{}.{}.{}", 250 + (n >> 16), (n >> 8) & 255, n & 255)
            })
            .collect();
        let object = json!({
            "apiVersion": "peerwall.io/v1alpha1",
            "kind": "AddressSet",
            "metadata": {
                "name": name,
                "labels": {NAME: "1"},
                "annotations": {NAME: key},
            },
            "spec": {"firewallConfiguration": NAME, "set": "floor", "addresses": addresses},
        });
        let t0 = Instant::now();
        self.slices
            .patch(
                name,
                &PatchParams::apply("peerwall-bench-floor").force(),
                &Patch::Apply(&object),
            )
            .await
            .expect("apply the floor's slice");
        self.wait_seen(&key, t0).await
    }

    /// How long after `t0` the watch saw the write carrying `key`.
    async fn wait_seen(&self, key: &str, t0: Instant) -> Duration {
        let deadline = t0 + Duration::from_secs(10);
        loop {
            if let Some(at) = self.seen.lock().ok().and_then(|s| s.get(key).copied()) {
                return at.saturating_duration_since(t0);
            }
            assert!(Instant::now() < deadline, "the watch never saw write {key}");
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    }

    /// One write: how long until the watch saw it.
    pub async fn write_seen(&mut self) -> Duration {
        let key = format!("w{}", self.writes);
        self.writes += 1;
        let t0 = Instant::now();
        self.api
            .patch(
                NAME,
                &PatchParams::default(),
                &Patch::Merge(&json!({"data": {"i": key}})),
            )
            .await
            .expect("patch configmap");
        self.wait_seen(&key, t0).await
    }
}

/// Watch `api`'s objects labelled `NAME=1`; record in `seen` when each write's mark (`mark`
/// of the object) was first seen.
fn watch_marks<K>(
    api: Api<K>,
    seen: Arc<Mutex<BTreeMap<String, Instant>>>,
    mark: fn(K) -> Option<String>,
) -> tokio::task::JoinHandle<()>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    tokio::spawn(async move {
        let cfg = watcher::Config::default().labels(&format!("{NAME}=1"));
        let mut events = std::pin::pin!(watcher(api, cfg));
        while let Some(ev) = events.next().await {
            let at = Instant::now();
            if let Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) = ev {
                if let (Some(i), Ok(mut s)) = (mark(o), seen.lock()) {
                    s.entry(i).or_insert(at);
                }
            }
        }
    })
}

impl Drop for Floor {
    fn drop(&mut self) {
        self.watch.abort();
        self.slice_watch.abort();
    }
}
