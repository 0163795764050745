//! The API server's own floor on this machine, measured in two blocks around the one-pod
//! samples: a write (a ConfigMap's data patched, which no peerwall process watches) → a watch
//! of it sees that version. A pod's address crosses two of these before any packet can pass
//! (its status to the controller, the controller's slice to the agent), so twice this floor
//! plus the agent's part bounds from below what the one-pod samples could reach with a
//! controller that costs nothing (its slice, up to `SLICE_FILL` addresses, is a larger write
//! than this one). Watched by label, as the bench watches the slices: a field-selected watch of the
//! same object measured 12–26 ms.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use kube::Client;
use serde_json::json;

const NAME: &str = "peerwall-bench-floor";

/// A ConfigMap and a watch of it, ready for writes ([`Floor::write_seen`]); the watch ends
/// when this is dropped.
pub struct Floor {
    api: Api<ConfigMap>,
    seen: Arc<Mutex<BTreeMap<String, Instant>>>,
    watch: tokio::task::JoinHandle<()>,
    writes: usize,
}

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
        let watch = {
            let (api, seen) = (api.clone(), seen.clone());
            tokio::spawn(async move {
                // Selected by label, as the bench's watch of the slices is.
                let cfg = watcher::Config::default().labels(&format!("{NAME}=1"));
                let mut events = std::pin::pin!(watcher(api, cfg));
                while let Some(ev) = events.next().await {
                    let at = Instant::now();
                    if let Ok(watcher::Event::Apply(cm) | watcher::Event::InitApply(cm)) = ev {
                        let i = cm.data.and_then(|d| d.get("i").cloned());
                        if let (Some(i), Ok(mut s)) = (i, seen.lock()) {
                            s.entry(i).or_insert(at);
                        }
                    }
                }
            })
        };
        tokio::time::sleep(Duration::from_millis(500)).await;
        Self {
            api,
            seen,
            watch,
            writes: 0,
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
        let deadline = t0 + Duration::from_secs(10);
        loop {
            if let Some(at) = self.seen.lock().ok().and_then(|s| s.get(&key).copied()) {
                return at.saturating_duration_since(t0);
            }
            assert!(Instant::now() < deadline, "the watch never saw write {key}");
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    }
}

impl Drop for Floor {
    fn drop(&mut self) {
        self.watch.abort();
    }
}
