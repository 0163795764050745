//! Reading FirewallConfiguration objects from YAML (files, directories, multi-document streams).
//!
//! Both groups load: peerwall's own objects (`peerwall.io/v1alpha1`) and Liqo's
//! (`networking.liqo.io/v1beta1`, same schema without the extensions). A Liqo object's origin
//! is marked `liqo:namespace/name`, so the two never share a key.
//!
//! Parsing is pure ([`parse_documents`]); [`load_paths`] is the thin filesystem edge.
//! Deserialization errors name the field path, e.g.
//! `spec.table.chains[0].policy: unknown variant `deny`, expected `drop` or `accept``.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::types::{AddressSetSpec, FirewallConfigurationSpec};
use crate::{AddressSetObject, PolicyObject};

mod hints;
mod json;

pub use hints::{explain, near_miss};
pub use json::{
    address_set_from_json, address_set_with_spec, object_from_json, object_with_spec,
    protection_spec_from_json,
};

/// peerwall's group.
pub const GROUP: &str = "peerwall.io";
/// peerwall's version.
pub const VERSION: &str = "v1alpha1";
/// API group/version of peerwall's FirewallConfiguration.
pub const API_VERSION: &str = "peerwall.io/v1alpha1";
/// Liqo's group.
pub const LIQO_GROUP: &str = "networking.liqo.io";
/// Liqo's version.
pub const LIQO_VERSION: &str = "v1beta1";
/// API group/version of Liqo's FirewallConfiguration (read, never written).
pub const LIQO_API_VERSION: &str = "networking.liqo.io/v1beta1";
/// Kind (the same in both groups).
pub const KIND: &str = "FirewallConfiguration";
/// Kind of peerwall's address-set slices (`peerwall.io/v1alpha1` only).
pub const ADDRESS_SET_KIND: &str = "AddressSet";
/// Kind of peerwall's protection policies (cluster-scoped).
pub const PROTECTION_POLICY_KIND: &str = "ProtectionPolicy";

/// Everything read from some input: FirewallConfigurations and AddressSets.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Loaded {
    /// FirewallConfigurations of either group.
    pub objects: Vec<PolicyObject>,
    /// peerwall's AddressSets.
    pub address_sets: Vec<AddressSetObject>,
    /// Where each object was read: origin (`namespace/name`) → `file:line` of its document.
    pub sources: std::collections::BTreeMap<String, String>,
    /// Documents that look meant to be peerwall's or Liqo's objects but were not read (a
    /// near-miss `kind` or `apiVersion`): `file:line` and why. [`Loaded::refuse_near_misses`]
    /// turns them into an error; a caller that skips them says so.
    pub near_misses: Vec<(String, String)>,
}

impl Loaded {
    /// The first near miss as an error (the others are in `near_misses`).
    pub fn refuse_near_misses(&self) -> Result<(), LoadError> {
        match self.near_misses.first() {
            None => Ok(()),
            Some((origin, why)) => Err(LoadError::NearMiss {
                origin: origin.clone(),
                why: why.clone(),
                more: self.near_misses.len() - 1,
            }),
        }
    }
}
/// Origin prefix of objects of Liqo's group.
pub const LIQO_ORIGIN_PREFIX: &str = "liqo:";

/// Which group an object belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Group {
    /// `peerwall.io`: peerwall's own intent.
    Peerwall,
    /// `networking.liqo.io`: Liqo's objects (enforced only on request, never written).
    Liqo,
}

impl Group {
    /// The group of an `apiVersion`, if it is a FirewallConfiguration group.
    pub fn of_api_version(api_version: &str) -> Option<Self> {
        match api_version {
            API_VERSION => Some(Self::Peerwall),
            LIQO_API_VERSION => Some(Self::Liqo),
            _ => None,
        }
    }

    /// `namespace/name` as this group's objects are keyed (Liqo's marked `liqo:`).
    pub fn origin(self, namespace: &str, name: &str) -> String {
        match self {
            Self::Peerwall => format!("{namespace}/{name}"),
            Self::Liqo => format!("{LIQO_ORIGIN_PREFIX}{namespace}/{name}"),
        }
    }
}

/// Why input could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A file or directory could not be read.
    #[error("{path}: {source}")]
    Io {
        /// Path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// Not YAML.
    #[error("{origin}: not valid YAML: {source}")]
    Yaml {
        /// File and document.
        origin: String,
        /// Cause.
        source: serde_yaml::Error,
    },
    /// A field has the wrong type or an unknown value.
    #[error("{origin}: {path}: {message}")]
    Field {
        /// File and document.
        origin: String,
        /// Field path.
        path: String,
        /// Deserializer message.
        message: String,
    },
    /// A FirewallConfiguration without metadata.name.
    #[error("{origin}: metadata.name: required field is missing")]
    MissingName {
        /// File and document.
        origin: String,
    },
    /// A document that looks meant to be one of ours, not read ([`near_miss`]).
    #[error("{origin}: {why}; not read{}", if *more > 0 { format!(" ({more} more such documents)") } else { String::new() })]
    NearMiss {
        /// File and document.
        origin: String,
        /// The near-miss field and what is read.
        why: String,
        /// How many more there are.
        more: usize,
    },
    /// Several errors of one input, each with its place (every field error of every
    /// document, [`crate::located`]).
    #[error("{} errors:\n{}", .0.len(), .0.iter().map(|e| format!("  {e}")).collect::<Vec<_>>().join("\n"))]
    Many(Vec<LoadError>),
    /// No FirewallConfiguration or AddressSet in the input.
    #[error(
        "no FirewallConfiguration ({API_VERSION} or {LIQO_API_VERSION}) or AddressSet found in {0}"
    )]
    Nothing(String),
}

/// `apiVersion` and `kind` of a document, read in place (no copy of the document: a slice
/// holds 1000 addresses). Either one present but not a string makes both unknown.
fn head(value: &serde_yaml::Value) -> (Option<String>, Option<String>) {
    use serde_yaml::Value;
    let field = |k: &str| match value.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(()),
    };
    match (field("apiVersion"), field("kind")) {
        (Ok(a), Ok(k)) => (a, k),
        _ => (None, None),
    }
}

/// Where a document (or a List's item) is in its stream: for errors at their real lines.
struct Place<'a> {
    /// The whole stream.
    text: &'a str,
    /// The stream's name (a file).
    file: &'a str,
    /// The document's index in the stream, and whether the stream has several.
    doc: usize,
    several: bool,
    /// The object's path in its document (`items[3]` in a List).
    at: Vec<crate::located::Seg>,
}

impl Place<'_> {
    /// Every field error of the object at this place as `T` reads it, each at its line; the
    /// error `first` (the one reading stopped at) when they cannot be found again.
    fn field_errors<T: serde::de::DeserializeOwned>(&self, first: LoadError) -> Vec<LoadError> {
        use crate::located::{field_errors, line_of, Seg};
        let Some(value) = serde_yaml::Deserializer::from_str(self.text)
            .nth(self.doc)
            .and_then(|d| serde_yaml::Value::deserialize(d).ok())
        else {
            return vec![first];
        };
        let mut object = &value;
        for seg in &self.at {
            let next = match seg {
                Seg::Key(k) => object.get(k.as_str()),
                Seg::Index(i) => object.get(*i),
            };
            match next {
                Some(n) => object = n,
                None => return vec![first],
            }
        }
        let found = field_errors::<T>(object, explain);
        if found.is_empty() {
            return vec![first];
        }
        found
            .into_iter()
            .map(|e| {
                let full: Vec<Seg> = self.at.iter().chain(&e.path).cloned().collect();
                let line =
                    line_of(self.text, self.doc, &full).map_or(String::new(), |l| format!(":{l}"));
                let doc = if self.several {
                    format!(" (document {})", self.doc + 1)
                } else {
                    String::new()
                };
                LoadError::Field {
                    origin: format!("{}{line}{doc}", self.file),
                    path: e.shown,
                    message: e.message,
                }
            })
            .collect()
    }
}

fn object_from_value(
    value: serde_yaml::Value,
    origin: &str,
    place: &Place,
    out: &mut Loaded,
    errors: &mut Vec<LoadError>,
) -> Result<(), LoadError> {
    let (api_version, kind) = head(&value);
    let group = api_version.as_deref().and_then(Group::of_api_version);
    match (group, kind.as_deref()) {
        (_, Some("List"))
        | (Some(_), Some("FirewallConfigurationList"))
        | (Some(Group::Peerwall), Some("AddressSetList")) => {
            if let Some(items) = value.get("items").and_then(|v| v.as_sequence()) {
                for (i, item) in items.iter().enumerate() {
                    let mut at = place.at.clone();
                    at.extend([
                        crate::located::Seg::Key("items".into()),
                        crate::located::Seg::Index(i),
                    ]);
                    let item_place = Place { at, ..*place };
                    object_from_value(
                        item.clone(),
                        &format!("{origin} items[{i}]"),
                        &item_place,
                        out,
                        errors,
                    )?;
                }
            }
            Ok(())
        }
        (Some(group), Some(KIND)) => {
            // Liqo's schema is peerwall's without the extensions: one reader for both.
            match object_from(value, origin, group) {
                Ok(o) => {
                    out.sources.insert(o.origin.0.clone(), origin.to_string());
                    out.objects.push(o);
                }
                Err(e @ LoadError::Field { .. }) => {
                    errors.extend(place.field_errors::<Document>(e))
                }
                Err(e) => errors.push(e),
            }
            Ok(())
        }
        (Some(Group::Peerwall), Some(ADDRESS_SET_KIND)) => {
            match address_set_from(value, origin) {
                Ok(a) => {
                    out.sources.insert(a.origin.0.clone(), origin.to_string());
                    out.address_sets.push(a);
                }
                Err(e @ LoadError::Field { .. }) => {
                    errors.extend(place.field_errors::<SliceDocument>(e))
                }
                Err(e) => errors.push(e),
            }
            Ok(())
        }
        // Other manifests (Namespaces, Pods, ...) may share a file: they are not ours; a
        // near miss of ours is noted.
        _ => {
            if let Some(why) = near_miss(api_version.as_deref(), kind.as_deref()) {
                out.near_misses.push((origin.to_string(), why));
            }
            Ok(())
        }
    }
}

/// What the loader reads of an object: its name and namespace, and the spec. Everything else
/// (labels, status, server bookkeeping) is ignored.
#[derive(Deserialize)]
struct Document {
    #[serde(default)]
    metadata: Metadata,
    spec: FirewallConfigurationSpec,
}

#[derive(Deserialize, Default)]
struct Metadata {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
}

/// Deserialize one FirewallConfiguration (from YAML or JSON), naming the field path on error.
fn object_from<'de, D: serde::Deserializer<'de>>(
    value: D,
    origin: &str,
    group: Group,
) -> Result<PolicyObject, LoadError> {
    let fc: Document = serde_path_to_error::deserialize(value).map_err(|e| LoadError::Field {
        origin: origin.to_string(),
        path: e.path().to_string(),
        message: explain(&e.inner().to_string()),
    })?;
    document_object(fc, origin, group)
}

/// The object a read document describes.
fn document_object(fc: Document, origin: &str, group: Group) -> Result<PolicyObject, LoadError> {
    let name = fc
        .metadata
        .name
        .clone()
        .ok_or_else(|| LoadError::MissingName {
            origin: origin.to_string(),
        })?;
    Ok(object_with_spec(
        fc.metadata.namespace.as_deref(),
        &name,
        fc.spec,
        group,
    ))
}

#[derive(Deserialize)]
struct SliceDocument {
    #[serde(default)]
    metadata: Metadata,
    spec: AddressSetSpec,
}

/// Deserialize one AddressSet (from YAML or JSON), naming the field path on error.
fn address_set_from<'de, D: serde::Deserializer<'de>>(
    value: D,
    origin: &str,
) -> Result<AddressSetObject, LoadError> {
    let doc: SliceDocument =
        serde_path_to_error::deserialize(value).map_err(|e| LoadError::Field {
            origin: origin.to_string(),
            path: e.path().to_string(),
            message: explain(&e.inner().to_string()),
        })?;
    let name = doc.metadata.name.ok_or_else(|| LoadError::MissingName {
        origin: origin.to_string(),
    })?;
    Ok(address_set_with_spec(
        doc.metadata.namespace.as_deref(),
        &name,
        doc.spec,
    ))
}

/// Parse every FirewallConfiguration in a YAML stream. `origin` names the stream in errors.
pub fn parse_documents(text: &str, origin: &str) -> Result<Vec<PolicyObject>, LoadError> {
    Ok(parse_all(text, origin)?.objects)
}

/// The first line (1-based) of each YAML document of a stream, in order: documents begin
/// after `---` separators, and the first also without one when content precedes them.
pub fn document_lines(text: &str) -> Vec<usize> {
    let mut starts = Vec::new();
    let mut pending: Option<usize> = Some(1);
    let mut seen_content = false;
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let t = line.trim_end();
        if t == "---" || t.starts_with("--- ") {
            if seen_content {
                if let Some(p) = pending {
                    starts.push(p);
                }
            }
            pending = Some(n + 1);
            seen_content = false;
            continue;
        }
        let content = !t.trim_start().is_empty() && !t.trim_start().starts_with('#');
        if content && !seen_content {
            seen_content = true;
            // The document starts at its first line of content.
            pending = Some(n);
        }
    }
    if seen_content {
        if let Some(p) = pending {
            starts.push(p);
        }
    }
    starts
}

/// Parse every FirewallConfiguration and AddressSet in a YAML stream. `origin` names the
/// stream (a file) in errors, each document as `origin:LINE` of its first line of content.
pub fn parse_all(text: &str, origin: &str) -> Result<Loaded, LoadError> {
    let mut out = Loaded::default();
    let mut errors = Vec::new();
    let lines = document_lines(text);
    for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let doc_origin = match lines.get(i) {
            Some(l) if lines.len() > 1 => format!("{origin}:{l} (document {})", i + 1),
            Some(l) => format!("{origin}:{l}"),
            None => format!("{origin} (document {})", i + 1),
        };
        let value = serde_yaml::Value::deserialize(doc).map_err(|source| LoadError::Yaml {
            origin: doc_origin.clone(),
            source,
        })?;
        if value.is_null() {
            continue;
        }
        let place = Place {
            text,
            file: origin,
            doc: i,
            several: lines.len() > 1,
            at: Vec::new(),
        };
        object_from_value(value, &doc_origin, &place, &mut out, &mut errors)?;
    }
    // Every object's field errors, each at its line; the others as they came.
    match errors.len() {
        0 => Ok(out),
        1 => Err(errors.remove(0)),
        _ => Err(LoadError::Many(errors)),
    }
}

fn yaml_files(dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let io = |source| LoadError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let p = entry.map_err(io)?.path();
        let is_yaml = p
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| e == "yaml" || e == "yml");
        if p.is_file() && is_yaml {
            files.push(p);
        }
    }
    files.sort();
    Ok(files)
}

/// Load every FirewallConfiguration from files and directories (non-recursive, *.yaml/*.yml).
pub fn load_paths(paths: &[PathBuf]) -> Result<Vec<PolicyObject>, LoadError> {
    Ok(load_paths_all(paths)?.objects)
}

/// Load every FirewallConfiguration and AddressSet from files and directories.
pub fn load_paths_all(paths: &[PathBuf]) -> Result<Loaded, LoadError> {
    let mut out = Loaded::default();
    // A file named twice (`-f dir/ -f dir/a.yaml`) is read once.
    let mut read = std::collections::HashSet::new();
    for p in paths {
        let files = if p.is_dir() {
            yaml_files(p)?
        } else {
            vec![p.clone()]
        };
        for f in files {
            if !read.insert(std::fs::canonicalize(&f).unwrap_or_else(|_| f.clone())) {
                continue;
            }
            let text = std::fs::read_to_string(&f).map_err(|source| LoadError::Io {
                path: f.clone(),
                source,
            })?;
            let more = parse_all(&text, &f.display().to_string())?;
            out.objects.extend(more.objects);
            out.address_sets.extend(more.address_sets);
            out.sources.extend(more.sources);
            out.near_misses.extend(more.near_misses);
        }
    }
    if out.objects.is_empty() && out.address_sets.is_empty() {
        // Nothing read, but something nearly: that is the better answer.
        out.refuse_near_misses()?;
        let mut names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
        // Directories are read one level deep: say which were not.
        let subdirs: Vec<String> = paths
            .iter()
            .filter(|p| p.is_dir())
            .flat_map(|p| std::fs::read_dir(p).into_iter().flatten().flatten())
            .map(|e| e.path())
            .filter(|p| p.is_dir())
            .map(|p| p.display().to_string())
            .collect();
        if !subdirs.is_empty() {
            names.push(format!(
                "only *.yaml and *.yml files directly in a directory are read, not its \
                 subdirectories ({}): name one of them",
                subdirs.join(", ")
            ));
        }
        return Err(LoadError::Nothing(names.join("; ")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_values_name_a_near_miss_and_only_enforced_families() {
        assert_eq!(
            explain("unknown variant `IPv4`, expected one of `INET`, `IPV4`, `IPV6`, `ARP`, `NETDEV`, `BRIDGE`"),
            "unknown value `IPv4`: did you mean `IPV4`? (accepted: `INET`, `IPV4`, `IPV6`)"
        );
        assert_eq!(
            explain("unknown variant `acept`, expected `drop` or `accept`"),
            "unknown value `acept`: did you mean `accept`? (accepted: `drop`, `accept`)"
        );
        assert_eq!(
            explain("unknown field `typ`, expected `value` or `position`"),
            "unknown field `typ` (accepted: `value`, `position`)"
        );
        assert_eq!(explain("invalid type: string"), "invalid type: string");
    }

    #[test]
    fn near_miss_kinds_and_api_versions_are_named_and_others_pass() {
        let doc = |api: &str, kind: &str| {
            format!("apiVersion: {api}\nkind: {kind}\nmetadata: {{name: x, namespace: n}}\nspec: {{table: {{name: t, family: INET, chains: []}}}}\n")
        };
        let good = doc(API_VERSION, KIND);
        for (api, kind, says) in [
            (
                API_VERSION,
                "FirewallConfigration",
                "did you mean `FirewallConfiguration`?",
            ),
            (
                API_VERSION,
                "firewallconfiguration",
                "did you mean `FirewallConfiguration`?",
            ),
            (
                "peerwall.io/v1beta1",
                KIND,
                "did you mean peerwall.io/v1alpha1?",
            ),
            (
                "networking.liqo.io/v1alpha1",
                KIND,
                "did you mean networking.liqo.io/v1beta1?",
            ),
            (
                "peerwal.io/v1alpha1",
                KIND,
                "did you mean peerwall.io/v1alpha1?",
            ),
            (API_VERSION, "AdressSet", "did you mean `AddressSet`?"),
            (
                "networking.liqo.io/v1beta1",
                ADDRESS_SET_KIND,
                "a AddressSet is read at peerwall.io/v1alpha1",
            ),
        ] {
            let text = format!("{good}---\n{}", doc(api, kind));
            let l = parse_all(&text, "f.yaml").unwrap();
            assert_eq!(l.objects.len(), 1, "{api} {kind}");
            assert_eq!(l.near_misses.len(), 1, "{api} {kind}");
            let e = l.refuse_near_misses().unwrap_err().to_string();
            assert!(
                e.starts_with("f.yaml:6 (document 2): ") && e.contains(says),
                "{e}"
            );
        }
        // Other manifests are not near misses.
        for (api, kind) in [
            ("v1", "Namespace"),
            ("v1", "Pod"),
            ("networking.liqo.io/v1beta1", "Configuration"),
            ("networking.liqo.io/v1beta1", "GatewayServer"),
            (API_VERSION, PROTECTION_POLICY_KIND),
            ("networking.k8s.io/v1", "NetworkPolicy"),
            ("example.com/v1", "FirewallConfigurations"),
        ] {
            let l = parse_all(&format!("{good}---\n{}", doc(api, kind)), "f").unwrap();
            assert!(
                l.near_misses.is_empty(),
                "{api} {kind}: {:?}",
                l.near_misses
            );
        }
    }

    #[test]
    fn documents_start_at_their_first_line_of_content() {
        assert_eq!(document_lines("# c\na: 1\n---\nb: 2\n"), [2, 4]);
        assert_eq!(document_lines("---\n# c\n\na: 1\n---\n---\nb: 1\n"), [4, 7]);
        assert_eq!(document_lines("# only a comment\n"), Vec::<usize>::new());
    }

    #[test]
    fn a_file_named_twice_is_read_once_and_objects_know_their_line() {
        let dir = std::env::temp_dir().join(format!("pw-load-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("a.yaml");
        std::fs::write(
            &f,
            "# x\napiVersion: peerwall.io/v1alpha1\nkind: AddressSet\nmetadata: {name: s, namespace: n}\nspec: {firewallConfiguration: g, set: p, addresses: []}\n",
        )
        .unwrap();
        let l = load_paths_all(&[dir.clone(), f.clone()]).unwrap();
        assert_eq!(l.address_sets.len(), 1);
        assert_eq!(l.sources["n/s"], format!("{}:2", f.display()));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
