//! Field errors of a YAML document, all of them and each at its real line.
//!
//! serde stops at a document's first error. [`field_errors`] asks again after taking the list
//! element that failed out of the document (a rule, a match, a chain), so that one run names
//! every broken element of a file; paths are given as in the file, whatever was taken out
//! before. [`line_of`] finds the line of a field path in the file: it walks the document down
//! the path and fails on purpose at the node it names, and the YAML parser's error carries
//! that node's position.

use serde::de::{self, DeserializeOwned, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess};
use serde_yaml::Value;

/// At most this many errors are named per document (a file of garbage is not listed whole).
pub const MAX_ERRORS: usize = 20;

/// One step of a field path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Seg {
    /// A mapping's key.
    Key(String),
    /// A sequence's element.
    Index(usize),
}

/// A field error: where (as in the file) and what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    /// The path's steps.
    pub path: Vec<Seg>,
    /// The path as users read it (`spec.table.chains[0].policy`).
    pub shown: String,
    /// The deserializer's message.
    pub message: String,
}

/// The steps of a `serde_path_to_error` path (None: a step it could not name).
fn segs(p: &serde_path_to_error::Path) -> Option<Vec<Seg>> {
    p.iter()
        .map(|s| match s {
            serde_path_to_error::Segment::Seq { index } => Some(Seg::Index(*index)),
            serde_path_to_error::Segment::Map { key } => Some(Seg::Key(key.clone())),
            serde_path_to_error::Segment::Enum { variant } => Some(Seg::Key(variant.clone())),
            serde_path_to_error::Segment::Unknown => None,
        })
        .collect()
}

/// `path` as users read it.
pub fn show(path: &[Seg]) -> String {
    let mut s = String::new();
    for seg in path {
        match seg {
            Seg::Key(k) => {
                if !s.is_empty() {
                    s.push('.');
                }
                s.push_str(k);
            }
            Seg::Index(i) => s.push_str(&format!("[{i}]")),
        }
    }
    if s.is_empty() {
        ".".to_string()
    } else {
        s
    }
}

/// Every error deserializing `value` as `T` finds (at most [`MAX_ERRORS`]), with paths as in
/// `value`: after each, the deepest list element on its path is taken out and `T` read again,
/// until it reads or an error lies in no list. `explain` turns a message into the one shown.
pub fn field_errors<T: DeserializeOwned>(
    value: &Value,
    explain: impl Fn(&str) -> String,
) -> Vec<FieldError> {
    let mut v = value.clone();
    // Per list (its path in `value`), the indices (in `value`) taken out so far, sorted.
    let mut taken: Vec<(Vec<Seg>, Vec<usize>)> = Vec::new();
    let mut out = Vec::new();
    while out.len() < MAX_ERRORS {
        let e = match serde_path_to_error::deserialize::<_, T>(v.clone()) {
            Ok(_) => break,
            Err(e) => e,
        };
        let message = explain(&e.inner().to_string());
        let Some(masked) = segs(e.path()) else {
            out.push(FieldError {
                path: Vec::new(),
                shown: e.path().to_string(),
                message,
            });
            break;
        };
        let path = original(&masked, &taken);
        out.push(FieldError {
            shown: show(&path),
            path: path.clone(),
            message,
        });
        // The deepest list element on the path: taken out of `v`, noted by its index in
        // `value`.
        let Some(at) = masked.iter().rposition(|s| matches!(s, Seg::Index(_))) else {
            break;
        };
        if !remove(&mut v, &masked[..=at]) {
            break;
        }
        let (list, Seg::Index(i)) = (path[..at].to_vec(), &path[at]) else {
            break;
        };
        match taken.iter_mut().find(|(p, _)| *p == list) {
            Some((_, idx)) => {
                idx.push(*i);
                idx.sort_unstable();
            }
            None => taken.push((list, vec![*i])),
        }
    }
    out
}

/// A path in the value with elements taken out, as it is in the value before.
fn original(masked: &[Seg], taken: &[(Vec<Seg>, Vec<usize>)]) -> Vec<Seg> {
    let mut out: Vec<Seg> = Vec::with_capacity(masked.len());
    for seg in masked {
        let step = match seg {
            Seg::Index(i) => {
                let mut orig = *i;
                if let Some((_, idx)) = taken.iter().find(|(p, _)| *p == out) {
                    // The n-th element left is the n-th index not taken.
                    for t in idx {
                        if *t <= orig {
                            orig += 1;
                        }
                    }
                }
                Seg::Index(orig)
            }
            k => k.clone(),
        };
        out.push(step);
    }
    out
}

/// Take the element `path` (ending in an index) out of its list in `v`; whether it was there.
fn remove(v: &mut Value, path: &[Seg]) -> bool {
    let Some((Seg::Index(i), parent)) = path.split_last() else {
        return false;
    };
    let mut cur = v;
    for seg in parent {
        let next = match (seg, cur) {
            (Seg::Key(k), Value::Mapping(m)) => m.get_mut(k.as_str()),
            (Seg::Index(i), Value::Sequence(s)) => s.get_mut(*i),
            _ => None,
        };
        match next {
            Some(n) => cur = n,
            None => return false,
        }
    }
    match cur {
        Value::Sequence(s) if *i < s.len() => {
            s.remove(*i);
            true
        }
        _ => false,
    }
}

/// The message [`Seek`] fails with at the node it looks for.
const HERE: &str = "peerwall: the node looked for";

/// Walks a document down a path and fails at the node it names.
struct Seek<'a>(&'a [Seg]);

impl<'de> DeserializeSeed<'de> for Seek<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        match self.0.split_first() {
            // Through the deserializer, so that its error carries the node's position.
            None => d.deserialize_any(Fail),
            Some((Seg::Key(k), rest)) => d.deserialize_map(InMap(k, rest)),
            Some((Seg::Index(i), rest)) => d.deserialize_seq(InSeq(*i, rest)),
        }
    }
}

/// Fails at whatever node it is given.
struct Fail;

impl<'de> de::Visitor<'de> for Fail {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("the node looked for")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Err(E::custom(HERE))
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Err(E::custom(HERE))
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Err(E::custom(HERE))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Err(E::custom(HERE))
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        Err(E::custom(HERE))
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Err(E::custom(HERE))
    }
    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        Err(E::custom(HERE))
    }
    fn visit_some<D: de::Deserializer<'de>>(self, _: D) -> Result<(), D::Error> {
        Err(de::Error::custom(HERE))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        Err(de::Error::custom(HERE))
    }
    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        Err(de::Error::custom(HERE))
    }
    fn visit_enum<A: de::EnumAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        Err(de::Error::custom(HERE))
    }
}

/// Looks for key `.0` in a mapping, then for `.1` below it.
struct InMap<'a>(&'a str, &'a [Seg]);

impl<'de> de::Visitor<'de> for InMap<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a mapping")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<(), A::Error> {
        while let Some(k) = m.next_key::<Value>()? {
            let same = match &k {
                Value::String(s) => s == self.0,
                Value::Number(n) => n.to_string() == self.0,
                Value::Bool(b) => b.to_string() == self.0,
                _ => false,
            };
            if same {
                m.next_value_seed(Seek(self.1))?;
            } else {
                m.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

/// Looks for element `.0` in a sequence, then for `.1` below it.
struct InSeq<'a>(usize, &'a [Seg]);

impl<'de> de::Visitor<'de> for InSeq<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a sequence")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<(), A::Error> {
        let mut i = 0;
        loop {
            let found = if i == self.0 {
                s.next_element_seed(Seek(self.1))?.is_some()
            } else {
                s.next_element::<IgnoredAny>()?.is_some()
            };
            if !found {
                return Ok(());
            }
            i += 1;
        }
    }
}

/// The line (1-based, in `text`) of the node at `path` in the `document`-th YAML document of
/// `text` (0-based), or of the nearest node above it that is there.
pub fn line_of(text: &str, document: usize, path: &[Seg]) -> Option<usize> {
    for depth in (0..=path.len()).rev() {
        let doc = serde_yaml::Deserializer::from_str(text).nth(document)?;
        if let Err(e) = Seek(&path[..depth]).deserialize(doc) {
            if e.to_string().contains(HERE) {
                return e.location().map(|l| l.line());
            }
        }
    }
    None
}

#[cfg(test)]
mod tests;
