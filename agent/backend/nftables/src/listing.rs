//! What `nft -j list` says, read as data: the tables in the kernel and their owners, the rule
//! counters (merged rules' elements added up per rule), and the parts of a table the backend
//! compares with what it applied (outline, digest, set elements). The JSON of a listing is
//! read here and in the runner only.

use crate::error::NftError;
use crate::json;
use crate::model;
use crate::model::Table;
use crate::runner::Runner;
use peerwall_backend::RuleCounter;
use peerwall_policy::ir;
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;

/// A table present in the kernel.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KernelTable {
    /// Family keyword.
    pub family: String,
    /// Name.
    pub name: String,
    /// Owner recorded in the marker, when the table is ours.
    pub owner: Option<String>,
}

/// Tables in a listed ruleset, with their owner when they carry our marker.
pub fn kernel_tables(objs: &[Value]) -> Vec<KernelTable> {
    let mut tables: Vec<KernelTable> = objs
        .iter()
        .filter_map(|o| o.get("table"))
        .map(|t| KernelTable {
            family: t["family"].as_str().unwrap_or_default().to_string(),
            name: t["name"].as_str().unwrap_or_default().to_string(),
            owner: None,
        })
        .collect();
    for r in objs.iter().filter_map(|o| o.get("rule")) {
        if r["chain"] != model::MARKER_CHAIN {
            continue;
        }
        if let Some(owner) = r["comment"]
            .as_str()
            .and_then(|c| c.strip_prefix(model::MARKER_PREFIX))
        {
            if let Some(t) = tables
                .iter_mut()
                .find(|t| r["table"] == t.name.as_str() && r["family"] == t.family.as_str())
            {
                t.owner = Some(owner.to_string());
            }
        }
    }
    tables
}

/// Whether a set name is a merged rule's ([`merge`]): its elements carry the rules' names.
fn is_merged_name(name: &str) -> bool {
    name.strip_prefix(model::AUTO_SET_PREFIX)
        .is_some_and(|n| n.starts_with('m'))
}

/// Whether a listed set is a merged rule's.
fn is_merged_set(set: &Value) -> bool {
    set["name"].as_str().is_some_and(is_merged_name)
}

/// The per-rule counters of a merged rule: its set's element counters added up by the rule
/// named in each element's comment, in the order the rules first appear. `sets` are listings
/// of sets with their elements.
fn merged_counters(rule: &Value, sets: &[Value]) -> Vec<(String, u64, u64)> {
    let lookup = rule["expr"].as_array().and_then(|es| {
        es.iter().find_map(|e| {
            e.get("match")
                .and_then(|m| m["right"].as_str())
                .and_then(|r| r.strip_prefix('@'))
                .filter(|n| is_merged_name(n))
        })
    });
    let Some(name) = lookup else {
        return Vec::new();
    };
    let set = sets.iter().filter_map(|o| o.get("set")).find(|s| {
        s["name"] == name && s["table"] == rule["table"] && s["family"] == rule["family"]
    });
    let mut out: Vec<(String, u64, u64)> = Vec::new();
    for e in set.and_then(|s| s["elem"].as_array()).into_iter().flatten() {
        let e = &e["elem"];
        let Some(rule) = e["comment"].as_str() else {
            continue;
        };
        let (p, b) = (
            e["counter"]["packets"].as_u64().unwrap_or(0),
            e["counter"]["bytes"].as_u64().unwrap_or(0),
        );
        match out.iter_mut().find(|(r, _, _)| r == rule) {
            Some(c) => {
                c.1 += p;
                c.2 += b;
            }
            None => out.push((rule.to_string(), p, b)),
        }
    }
    out
}

/// Whether a listed object (a rule, a set) lies in a table of `objs` that peerwall owns.
fn in_owned_table(objs: &[Value]) -> impl Fn(&Value) -> bool {
    let owned: Vec<KernelTable> = kernel_tables(objs)
        .into_iter()
        .filter(|t| t.owner.is_some())
        .collect();
    move |o: &Value| {
        owned
            .iter()
            .any(|t| o["table"] == t.name.as_str() && o["family"] == t.family.as_str())
    }
}

/// The listings (with elements) of the merged rules' sets in owned tables that count.
pub(crate) fn merged_sets(nft: &impl Runner, terse: &[Value]) -> Result<Vec<Value>, NftError> {
    let is_owned = in_owned_table(terse);
    let mut out = Vec::new();
    for s in terse.iter().filter_map(|o| o.get("set")) {
        let counts = s["stmt"]
            .as_array()
            .is_some_and(|st| st.iter().any(|x| x.get("counter").is_some()));
        if counts && is_owned(s) && is_merged_set(s) {
            out.extend(nft.list_set(
                s["family"].as_str().unwrap_or_default(),
                s["table"].as_str().unwrap_or_default(),
                s["name"].as_str().unwrap_or_default(),
            )?);
        }
    }
    Ok(out)
}

/// Counters of every named rule with a counter in owned tables of a listed ruleset; `sets`
/// holds the merged rules' sets with their elements (a merged rule counts per element).
pub fn rule_counters(objs: &[Value], sets: &[Value]) -> Vec<RuleCounter> {
    let is_owned = in_owned_table(objs);
    let mut out = Vec::new();
    for r in objs.iter().filter_map(|o| o.get("rule")) {
        if !is_owned(r) || r["chain"] == model::MARKER_CHAIN {
            continue;
        }
        let merged = merged_counters(r, sets);
        if !merged.is_empty() {
            out.extend(
                merged
                    .into_iter()
                    .map(|(rule, packets, bytes)| RuleCounter {
                        table: r["table"].as_str().unwrap_or_default().to_string(),
                        chain: r["chain"].as_str().unwrap_or_default().to_string(),
                        rule,
                        packets,
                        bytes,
                    }),
            );
            continue;
        }
        let Some(comment) = r["comment"].as_str() else {
            continue;
        };
        let counter = r["expr"]
            .as_array()
            .and_then(|e| e.iter().find_map(|s| s.get("counter")));
        if let Some(c) = counter {
            out.push(RuleCounter {
                table: r["table"].as_str().unwrap_or_default().to_string(),
                chain: r["chain"].as_str().unwrap_or_default().to_string(),
                rule: comment.to_string(),
                packets: c["packets"].as_u64().unwrap_or(0),
                bytes: c["bytes"].as_u64().unwrap_or(0),
            });
        }
    }
    out
}

/// A listed table with counter values zeroed: what drift detection compares.
pub(crate) fn normalize(mut objs: Vec<Value>) -> Vec<Value> {
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
    objs.iter_mut().for_each(zero);
    objs
}

/// The objects of one table in a ruleset listing (the table itself and everything in it).
pub(crate) fn objects_of_table(objs: &[Value], family: ir::TableFamily, name: &str) -> Vec<Value> {
    objs.iter()
        .filter(|o| {
            o.as_object()
                .and_then(|m| m.values().next())
                .is_some_and(|inner| {
                    let fam = inner["family"] == family.nft();
                    let table = inner
                        .get("table")
                        .map_or(inner["name"] == name, |t| t == name);
                    fam && table
                })
        })
        .cloned()
        .collect()
}

/// A table's chains and, per chain, its rules' comments in order: what a listing and the
/// commands that created the table must agree on.
pub(crate) fn outline<'a>(
    objs: impl Iterator<Item = &'a Value>,
) -> BTreeMap<String, Vec<Option<String>>> {
    let mut out: BTreeMap<String, Vec<Option<String>>> = BTreeMap::new();
    for o in objs {
        if let Some(c) = o.get("chain") {
            out.entry(c["name"].as_str().unwrap_or_default().to_string())
                .or_default();
        } else if let Some(r) = o.get("rule") {
            out.entry(r["chain"].as_str().unwrap_or_default().to_string())
                .or_default()
                .push(r["comment"].as_str().map(str::to_string));
        }
    }
    out
}

/// The digest a listed table was created with (its marker chain's digest rule).
pub(crate) fn listed_digest(objs: &[Value]) -> Option<String> {
    objs.iter()
        .filter_map(|o| o.get("rule"))
        .filter(|r| r["chain"] == model::MARKER_CHAIN)
        .find_map(|r| r["comment"].as_str()?.strip_prefix(model::DIGEST_PREFIX))
        .map(str::to_string)
}

/// What was applied to one table, as the kernel listed it right after, without set elements
/// (they are compared with what was applied, [`listed_elements`]: an element update then
/// costs no listing of a 100k-element set).
#[derive(Debug, Default, Clone)]
pub(crate) struct Snapshot {
    pub(crate) terse: Vec<Value>,
}

/// The elements of every set of a listed table, by set name, each as its JSON text, sorted.
pub(crate) fn listed_elements(objs: &[Value]) -> BTreeMap<String, Vec<String>> {
    objs.iter()
        .filter_map(|o| o.get("set"))
        .map(|s| {
            let mut v: Vec<String> = s
                .get("elem")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .map(|e| {
                    // A merged rule's element without its counter, which moves.
                    let mut e = e.clone();
                    if let Some(x) = e.get_mut("elem").and_then(Value::as_object_mut) {
                        x.remove("counter");
                    }
                    e.to_string()
                })
                .collect();
            v.sort_unstable();
            (s["name"].as_str().unwrap_or_default().to_string(), v)
        })
        .collect()
}

/// The elements of every set of a table as applied, in [`listed_elements`]'s form.
pub(crate) fn model_elements(t: &Table) -> BTreeMap<String, Vec<String>> {
    t.sets
        .iter()
        .map(|s| {
            let mut v: Vec<String> = json::set_elements(s).iter().map(Value::to_string).collect();
            v.sort_unstable();
            (s.name.clone(), v)
        })
        .collect()
}
