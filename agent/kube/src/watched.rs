//! FirewallConfigurations and AddressSets as the agent's watches read them: the metadata typed,
//! the spec read from the watch's bytes straight into the API's type.
//!
//! An untyped object (`DynamicObject`) holds everything but its metadata in a JSON value: its
//! fields are flattened, so serde first buffers the object, then builds the value, one
//! allocation per string, number and element; the agent then reads the spec from that value
//! into the typed spec. At a NetworkPolicy tier of 20,000 set elements the untyped read was
//! the largest step from a label change to the kernel (`cargo xtask bench-netpol`).
//!
//! A spec that does not read (a field of the wrong type, an unknown field the CRD kept) must
//! still be seen: refused with its field path, the last good one kept in force. So the spec is
//! first taken as the raw JSON text the watch holds (one scan and one copy, no value built),
//! then read from that text into the API's type; only when that fails is the text kept
//! ([`Spec::Unread`]), and [`Watched::to_json`] gives the loader the whole object for the
//! refusal's field path.
//!
//! Top-level fields besides `apiVersion`, `kind`, `metadata`, `spec` and `status` are not
//! kept: a CRD's objects have no others (the API server prunes them, whatever the schema
//! below `spec` preserves).

use std::borrow::Cow;
use std::sync::Arc;

use kube::api::{ApiResource, ObjectMeta, TypeMeta};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::value::RawValue;

use peerwall_intent::{AddressSetSpec, FirewallConfigurationSpec};

/// A FirewallConfiguration (peerwall's or Liqo's) as a watch reads it.
pub type ConfigObject = Watched<FirewallConfigurationSpec>;

/// An AddressSet as a watch reads it.
pub type SliceObject = Watched<AddressSetSpec>;

/// An object as the API server answers a write to it (a status or finalizer patch): read,
/// its spec only scanned, never built.
pub type Answer = Watched<serde::de::IgnoredAny>;

/// An object whose spec is `S`, as a watch reads it.
#[derive(Clone, Debug)]
pub struct Watched<S> {
    /// `apiVersion` and `kind` (list items may come without them).
    pub types: Option<TypeMeta>,
    /// The object's metadata.
    pub metadata: ObjectMeta,
    /// The spec, read or not.
    pub spec: Spec<S>,
    /// The status as sent (this host's condition is read from it).
    pub status: Option<serde_json::Value>,
}

/// A watched object's spec.
#[derive(Clone, Debug)]
pub enum Spec<S> {
    /// The object has none.
    Missing,
    /// Read into the API's type.
    Read(Arc<S>),
    /// Did not read into the API's type: its JSON text, for the refusal's field path.
    Unread(Box<RawValue>),
}

/// The object as it comes: `spec` as text, read in a second step.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Wire {
    api_version: Option<String>,
    kind: Option<String>,
    #[serde(default)]
    metadata: ObjectMeta,
    spec: Option<Box<RawValue>>,
    status: Option<serde_json::Value>,
}

impl<'de, S: DeserializeOwned> Deserialize<'de> for Watched<S> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let w = Wire::deserialize(d)?;
        let types = match (w.api_version, w.kind) {
            (None, None) => None,
            (api_version, kind) => Some(TypeMeta {
                api_version: api_version.unwrap_or_default(),
                kind: kind.unwrap_or_default(),
            }),
        };
        let spec = match w.spec {
            None => Spec::Missing,
            Some(raw) => match serde_json::from_str::<S>(raw.get()) {
                Ok(s) => Spec::Read(Arc::new(s)),
                Err(_) => Spec::Unread(raw),
            },
        };
        Ok(Watched {
            types,
            metadata: w.metadata,
            spec,
            status: w.status,
        })
    }
}

impl<S: serde::Serialize> Watched<S> {
    /// The whole object as a JSON value (a refusal's field path, a binding read whole).
    pub fn to_json(&self) -> Result<serde_json::Value, serde_json::Error> {
        let mut o = serde_json::Map::new();
        if let Some(t) = &self.types {
            o.insert("apiVersion".into(), t.api_version.clone().into());
            o.insert("kind".into(), t.kind.clone().into());
        }
        o.insert("metadata".into(), serde_json::to_value(&self.metadata)?);
        match &self.spec {
            Spec::Missing => {}
            Spec::Read(s) => {
                o.insert("spec".into(), serde_json::to_value(s.as_ref())?);
            }
            Spec::Unread(raw) => {
                o.insert("spec".into(), serde_json::from_str(raw.get())?);
            }
        }
        if let Some(s) = &self.status {
            o.insert("status".into(), s.clone());
        }
        Ok(serde_json::Value::Object(o))
    }
}

impl<S: DeserializeOwned> Watched<S> {
    /// An object read some other way (an admission review's untyped object), read as a watch
    /// reads it: one path from the API's JSON to the spec.
    pub fn from_dynamic(obj: &kube::api::DynamicObject) -> Result<Self, serde_json::Error> {
        serde_json::from_str(&serde_json::to_string(obj)?)
    }
}

impl ConfigObject {
    /// The spec's `table.name` (read from its JSON text where the spec did not read).
    pub fn table_name(&self) -> Option<Cow<'_, str>> {
        match &self.spec {
            Spec::Read(s) => s.table.name.as_deref().map(Cow::Borrowed),
            Spec::Unread(raw) => serde_json::from_str::<serde_json::Value>(raw.get())
                .ok()?
                .pointer("/table/name")?
                .as_str()
                .map(|n| Cow::Owned(n.to_string())),
            Spec::Missing => None,
        }
    }
}

impl<S> Watched<S> {
    /// The object's `apiVersion`, if it came with one.
    pub fn api_version(&self) -> Option<&str> {
        self.types.as_ref().map(|t| t.api_version.as_str())
    }
}

impl<S> kube::Resource for Watched<S> {
    type DynamicType = ApiResource;
    type Scope = kube::core::DynamicResourceScope;

    fn group(dt: &ApiResource) -> Cow<'_, str> {
        dt.group.as_str().into()
    }

    fn version(dt: &ApiResource) -> Cow<'_, str> {
        dt.version.as_str().into()
    }

    fn kind(dt: &ApiResource) -> Cow<'_, str> {
        dt.kind.as_str().into()
    }

    fn api_version(dt: &ApiResource) -> Cow<'_, str> {
        dt.api_version.as_str().into()
    }

    fn plural(dt: &ApiResource) -> Cow<'_, str> {
        dt.plural.as_str().into()
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests;
