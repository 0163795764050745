//! libnftables JSON (`nft -j list …`) read into the typed [`Listing`]: the only place a
//! listing's JSON is interpreted. Verdict maps are read as sets. Objects of kinds the backend
//! has no use for (flowtables, named counters, limits) are skipped; a malformed object of a kind it reads is
//! an error naming the object, never silently a default.

use serde_json::Value;

use crate::error::NftError;
use crate::listing::{
    Counter, ListedChain, ListedElement, ListedRule, ListedSet, ListedTable, Listing, LogStatement,
};

/// A whole `nft -j` output: `{"nftables": [{"metainfo": …}, {"table": …}, …]}`.
pub fn document(out: &str) -> Result<Listing, NftError> {
    let v: Value = serde_json::from_str(out)?;
    let objects = v["nftables"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    listing(objects)
}

/// Listing objects (`{"table": …}`, `{"rule": …}`, …) as a [`Listing`]; `{"metainfo": …}`
/// and kinds not read are skipped.
pub fn listing(objects: &[Value]) -> Result<Listing, NftError> {
    let mut out = Listing::default();
    for o in objects {
        let Some((kind, inner)) = o.as_object().and_then(|m| m.iter().next()) else {
            continue;
        };
        match kind.as_str() {
            "table" => out.tables.push(ListedTable {
                family: text(inner, "family", kind)?,
                name: text(inner, "name", kind)?,
            }),
            "chain" => out.chains.push(chain(inner)?),
            // A verdict map is read as a set: its elements (address and jump) compared as text.
            "set" | "map" => out.sets.push(set(inner)?),
            "rule" => out.rules.push(rule(inner)?),
            _ => {}
        }
    }
    Ok(out)
}

fn malformed(kind: &str, field: &str, obj: &Value) -> NftError {
    NftError::Listing {
        object: format!("{kind}.{field}"),
        value: obj.to_string(),
    }
}

fn text(obj: &Value, field: &str, kind: &str) -> Result<String, NftError> {
    obj[field]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| malformed(kind, field, obj))
}

fn optional_text(obj: &Value, field: &str) -> Option<String> {
    obj[field].as_str().map(str::to_string)
}

/// `v` as canonical text with every counter's values zeroed (they move; the rest does not).
fn canonical(v: &Value) -> String {
    fn zero(v: &mut Value) {
        match v {
            Value::Object(o) => {
                if let Some(Value::Object(c)) = o.get_mut("counter") {
                    c.insert("packets".into(), Value::from(0));
                    c.insert("bytes".into(), Value::from(0));
                }
                o.values_mut().for_each(zero);
            }
            Value::Array(a) => a.iter_mut().for_each(zero),
            _ => {}
        }
    }
    let mut v = v.clone();
    zero(&mut v);
    v.to_string()
}

fn counter(v: &Value) -> Option<Counter> {
    let c = v.get("counter")?;
    Some(Counter {
        packets: c["packets"].as_u64().unwrap_or(0),
        bytes: c["bytes"].as_u64().unwrap_or(0),
    })
}

fn chain(c: &Value) -> Result<ListedChain, NftError> {
    Ok(ListedChain {
        family: text(c, "family", "chain")?,
        table: text(c, "table", "chain")?,
        name: text(c, "name", "chain")?,
        kind: optional_text(c, "type"),
        hook: optional_text(c, "hook"),
        declaration: canonical(&without(c, &["handle"])),
    })
}

fn without(v: &Value, fields: &[&str]) -> Value {
    let mut v = v.clone();
    if let Some(o) = v.as_object_mut() {
        for f in fields {
            o.remove(*f);
        }
    }
    v
}

fn set(s: &Value) -> Result<ListedSet, NftError> {
    let counts = s["stmt"]
        .as_array()
        .is_some_and(|st| st.iter().any(|x| x.get("counter").is_some()));
    let elements = s["elem"]
        .as_array()
        .into_iter()
        .flatten()
        .map(element)
        .collect();
    Ok(ListedSet {
        family: text(s, "family", "set")?,
        table: text(s, "table", "set")?,
        name: text(s, "name", "set")?,
        counts,
        declaration: canonical(&without(s, &["elem", "handle"])),
        elements,
    })
}

/// An element: a plain value, or `{"elem": {"val": …, "comment": …, "counter": …}}`.
fn element(e: &Value) -> ListedElement {
    let inner = e.get("elem");
    let mut bare = e.clone();
    if let Some(x) = bare.get_mut("elem").and_then(Value::as_object_mut) {
        x.remove("counter");
    }
    ListedElement {
        text: bare.to_string(),
        comment: inner.and_then(|x| optional_text(x, "comment")),
        counter: inner.and_then(counter),
    }
}

fn rule(r: &Value) -> Result<ListedRule, NftError> {
    let statements: &[Value] = r["expr"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let lookups = statements
        .iter()
        .filter_map(|e| {
            e.get("match")
                .map(|m| &m["right"])
                .or_else(|| e.get("vmap").map(|m| &m["data"]))?
                .as_str()?
                .strip_prefix('@')
        })
        .map(str::to_string)
        .collect();
    let logs = statements
        .iter()
        .filter_map(|e| e.get("log"))
        .map(|l| LogStatement {
            prefix: optional_text(l, "prefix"),
            group: l["group"].as_u64().and_then(|g| u16::try_from(g).ok()),
        })
        .collect();
    Ok(ListedRule {
        family: text(r, "family", "rule")?,
        table: text(r, "table", "rule")?,
        chain: text(r, "chain", "rule")?,
        handle: r["handle"].as_u64(),
        comment: optional_text(r, "comment"),
        counter: statements.iter().find_map(counter),
        lookups,
        logs,
        statements: statements.iter().map(canonical).collect(),
    })
}
