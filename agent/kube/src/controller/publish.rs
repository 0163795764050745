//! How the controller writes: every object it keeps (gateway configurations, the NetworkPolicy
//! tier, AddressSet slices, offloaded namespaces' NetworkPolicies, CNI companions) goes through
//! [`publish`]: read into the API's own type (so a field the type does not know fails here,
//! before the API server could prune it), compared with what the cache shows ([`Seen`]: the
//! spec and peerwall's labels; nothing is written when they already say it), written by
//! server-side apply as the controller's field manager ([`apply`]).
//!
//! The pure crates build these objects as JSON (they hold no kube types); reads stay untyped
//! where they are ([`Seen::of_dynamic`]): a FirewallConfiguration edited by hand into
//! something this version cannot parse must still be seen, and overwritten.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::{Resource, ResourceExt};
use serde_json::{json, Value};

/// The field manager of every write of the controller.
pub(super) const FIELD_MANAGER: &str = "peerwall-controller";

/// Why a reconcile failed (retried with backoff).
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// The API server refused a write.
    #[error("{action} {object}: {source}")]
    Api {
        /// What was attempted.
        action: &'static str,
        /// Which object.
        object: String,
        /// Cause.
        source: kube::Error,
    },
    /// A configuration too large for etcd even with every address set moved into
    /// AddressSets (its rules alone): not written; the previous one stays in force.
    #[error("{object}: {bytes} bytes as JSON with every address set in AddressSets, more than etcd stores in one request ({max}); not written, the previous version stays in force", max = peerwall_intent::size::ETCD_REQUEST_MAX)]
    TooLarge {
        /// Which object.
        object: String,
        /// Its size.
        bytes: usize,
    },
    /// An object the controller built does not read as its kind (a bug: nothing is written).
    #[error("building {object}: {source}")]
    Object {
        /// Which object.
        object: String,
        /// Cause.
        source: serde_json::Error,
    },
}

/// The error of `action` on the object `ns/name`.
pub(super) fn api_error<'a>(
    action: &'static str,
    ns: &'a str,
    name: &'a str,
) -> impl FnOnce(kube::Error) -> ReconcileError + 'a {
    move |source| ReconcileError::Api {
        action,
        object: format!("{ns}/{name}"),
        source,
    }
}

/// An owner reference to the namespace `ns` (a peer's tenant namespace, an offloaded
/// namespace): deleting it deletes what the controller wrote for it.
pub(super) fn owned_by_namespace(ns: &Namespace) -> Value {
    json!([{
        "apiVersion": "v1",
        "kind": "Namespace",
        "name": ns.name_any(),
        "uid": ns.uid().unwrap_or_default(),
    }])
}

/// `body` (an object the pure crates built, with `owners` as its owner references) read as a
/// `K`.
pub(super) fn typed<K: serde::de::DeserializeOwned>(
    mut body: Value,
    owners: Option<Value>,
) -> Result<K, ReconcileError> {
    if let Some(o) = owners {
        body["metadata"]["ownerReferences"] = o;
    }
    let object = format!(
        "{}/{}",
        body["metadata"]["namespace"].as_str().unwrap_or_default(),
        body["metadata"]["name"].as_str().unwrap_or_default()
    );
    serde_json::from_value(body).map_err(|source| ReconcileError::Object { object, source })
}

/// What the cache shows of an object: its labels and spec, borrowed from the cache where it
/// reads untyped (a NetworkPolicy tier's spec is 20,000 set elements: a copy of it costs what
/// building it does).
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct Seen<'a> {
    labels: Cow<'a, BTreeMap<String, String>>,
    spec: Option<Cow<'a, Value>>,
}

impl<'a> Seen<'a> {
    /// An object of a kind read untyped.
    pub(super) fn of_dynamic(o: &'a DynamicObject) -> Self {
        Self {
            labels: Cow::Borrowed(o.labels()),
            spec: o.data.get("spec").map(Cow::Borrowed),
        }
    }

    /// An object of a typed kind.
    pub(super) fn of<K: Resource + serde::Serialize>(o: &K) -> Seen<'static> {
        Seen {
            labels: Cow::Owned(o.labels().clone()),
            spec: serde_json::to_value(o)
                .ok()
                .and_then(|mut v| v.get_mut("spec").map(Value::take))
                .map(Cow::Owned),
        }
    }

    /// The same, owning what it shows.
    #[cfg(test)]
    pub(super) fn into_owned(self) -> Seen<'static> {
        Seen {
            labels: Cow::Owned(self.labels.into_owned()),
            spec: self.spec.map(|s| Cow::Owned(s.into_owned())),
        }
    }

    /// Whether it already says what `object` says: the same spec, and every label of
    /// `object` (others' labels may be there too).
    pub(super) fn says<K: Resource + serde::Serialize>(&self, object: &K) -> bool {
        let spec = serde_json::to_value(object)
            .ok()
            .and_then(|v| v.get("spec").cloned());
        spec.is_some()
            && self.spec.as_deref() == spec.as_ref()
            && object
                .labels()
                .iter()
                .all(|(k, v)| self.labels.get(k) == Some(v))
    }

    /// [`says`](Self::says) of an object as the pure crates built it (JSON): the steady
    /// state's check, without reading the object into its type.
    fn says_built(&self, body: &Value) -> bool {
        body.get("spec").is_some()
            && self.spec.as_deref() == body.get("spec")
            && body["metadata"]["labels"]
                .as_object()
                .into_iter()
                .flatten()
                .all(|(k, v)| self.labels.get(k).map(String::as_str) == v.as_str())
    }
}

/// Write `body` (an object the pure crates built, owned by `owners`) as a `K` unless `seen`
/// already says it; returns whether it wrote. Nothing is converted when the cache shows the
/// object as built (every pass that changes nothing); otherwise it is read into `K`
/// ([`typed`]), compared again in that form, and written.
pub(super) async fn publish<K>(
    api: &Api<K>,
    seen: Option<&Seen<'_>>,
    body: Value,
    owners: Option<Value>,
) -> Result<bool, ReconcileError>
where
    K: Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    if seen.is_some_and(|s| s.says_built(&body)) {
        return Ok(false);
    }
    let object: K = typed(body, owners)?;
    if seen.is_some_and(|s| s.says(&object)) {
        return Ok(false);
    }
    apply(api, &object).await?;
    Ok(true)
}

/// Server-side apply of `object` as the controller's field manager (forcing ownership of the
/// fields it sets, so a hand edit of them is reverted); the object as the API server keeps it.
pub(super) async fn apply<K>(api: &Api<K>, object: &K) -> Result<K, ReconcileError>
where
    K: Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let ns = object.namespace().unwrap_or_default();
    let name = object.name_any();
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(object),
    )
    .await
    .map_err(api_error("applying", &ns, &name))
}

#[cfg(test)]
#[path = "publish/tests.rs"]
mod tests;
