//! The typed model as libnftables JSON: what the `nft` runner sends (`nft -j -f -`).
//!
//! JSON rather than nft's text language because the text parser refuses keyword names (a chain
//! called `drop`), which the JSON parser takes. Only [`crate::Nft`] and `compile --output json`
//! use this; everything else works on the types.

pub mod read;

use serde_json::{json, Value};

use peerwall_policy::ir::TableFamily;

use crate::model::{
    self, Chain, Command, Element, Expr, Policy, Rule, Set, Table, DIGEST_PREFIX, MARKER_CHAIN,
    MARKER_PREFIX,
};

/// A whole transaction as one nft JSON document.
pub fn document(cmds: &[Command<'_>]) -> Value {
    json!({ "nftables": cmds.iter().flat_map(command).collect::<Vec<Value>>() })
}

/// One command as nft JSON commands.
pub fn command(c: &Command<'_>) -> Vec<Value> {
    match c {
        Command::Create(t) => create(t),
        Command::Recreate(t) => {
            // `add table` is a no-op when present, so the delete never fails.
            let mut v = vec![
                json!({"add": table_obj(t.family, &t.name)}),
                json!({"delete": table_obj(t.family, &t.name)}),
            ];
            v.extend(create(t));
            v
        }
        Command::Delete { family, name } => vec![json!({"delete": table_obj(*family, name)})],
        Command::AddTable { family, name } => vec![json!({"add": table_obj(*family, name)})],
        Command::InsertRule {
            family,
            table,
            rule: r,
        } => vec![json!({"insert": {"rule": rule_obj(family.nft(), table, r)}})],
        Command::DeleteRule {
            family,
            table,
            chain,
            handle,
        } => vec![
            json!({"delete": {"rule": {"family": family.nft(), "table": table,
            "chain": chain, "handle": handle}}}),
        ],
        Command::AddElements {
            table,
            set,
            elements,
        } => vec![json!({"add": element_obj(table, set, elements)})],
        Command::DeleteElements {
            table,
            set,
            elements,
        } => vec![json!({"delete": element_obj(table, set, elements)})],
        Command::FlushSet { table, set } => vec![json!({"flush": {"set": {
            "family": table.family.nft(), "table": table.name, "name": set}}})],
    }
}

fn table_obj(family: TableFamily, name: &str) -> Value {
    json!({"table": {"family": family.nft(), "name": name}})
}

fn element_obj(t: &Table, set: &str, elements: &[Element]) -> Value {
    json!({"element": {"family": t.family.nft(), "table": t.name, "name": set,
        "elem": elements.iter().map(Element::json).collect::<Vec<_>>()}})
}

/// What `t`'s creating commands add, read as a listing (no handles, no counter values): what
/// the kernel lists right after [`Command::Create`].
pub fn created_listing(t: &Table) -> Result<crate::listing::Listing, crate::NftError> {
    let added: Vec<Value> = create(t)
        .into_iter()
        .filter_map(|mut c| c.get_mut("add").map(Value::take))
        .collect();
    read::listing(&added)
}

/// Commands that create `t` (it must not exist): the table, its ownership marker and digest,
/// its sets, its chains, its rules.
fn create(t: &Table) -> Vec<Value> {
    let mut cmds = body(t);
    let digest = json!({"add": {"rule": {"family": t.family.nft(), "table": t.name,
        "chain": MARKER_CHAIN, "comment": format!("{DIGEST_PREFIX}{}", digest(t)),
        "expr": [{"counter": null}]}}});
    cmds.insert(3, digest);
    cmds
}

/// What `t` is created as, set elements aside (compared on their own), as 16 hex digits:
/// FNV-1a over the creating commands' JSON text. Equal digests mean equal tables.
pub fn digest(t: &Table) -> String {
    let mut h = fnv::FnvHasher::default();
    for mut c in body(t) {
        for kind in ["/add/set", "/add/map"] {
            if let Some(set) = c.pointer_mut(kind).and_then(Value::as_object_mut) {
                set.remove("elem");
            }
        }
        std::hash::Hasher::write(&mut h, c.to_string().as_bytes());
    }
    format!("{:016x}", std::hash::Hasher::finish(&h))
}

/// [`create`] without the digest rule.
fn body(t: &Table) -> Vec<Value> {
    let fam = t.family.nft();
    let mut cmds = vec![
        json!({"add": table_obj(t.family, &t.name)}),
        json!({"add": {"chain": {"family": fam, "table": t.name, "name": MARKER_CHAIN}}}),
        json!({"add": {"rule": {"family": fam, "table": t.name, "chain": MARKER_CHAIN,
            "comment": format!("{MARKER_PREFIX}{}", t.owner), "expr": [{"counter": null}]}}}),
    ];
    // Regular chains before the maps whose elements jump to them.
    cmds.extend(
        t.regular
            .iter()
            .map(|c| json!({"add": {"chain": {"family": fam, "table": t.name, "name": c.name}}})),
    );
    cmds.extend(t.sets.iter().map(|s| {
        if s.verdict_map {
            json!({"add": {"map": set(t, s)}})
        } else {
            json!({"add": {"set": set(t, s)}})
        }
    }));
    if let Some(l) = &t.event_limit {
        cmds.push(json!({"add": {"limit": {"family": fam, "table": t.name,
            "name": model::EVENT_LIMIT, "rate": l.rate, "per": "second", "burst": l.burst}}}));
    }
    // Netfilter runs base chains of equal hook and priority in reverse registration order (a
    // new hook is inserted before existing ones of the same priority). The evaluator orders
    // ties by name, ascending: so chains are created in descending name order.
    cmds.extend(
        t.chains
            .iter()
            .rev()
            .map(|c| json!({"add": {"chain": chain(t, c)}})),
    );
    cmds.extend(t.rules.iter().map(|r| json!({"add": {"rule": rule(t, r)}})));
    cmds
}

fn set(t: &Table, s: &Set) -> Value {
    let types = s.key.nft_types();
    let ty = match types.as_slice() {
        [one] => json!(one),
        many => json!(many),
    };
    let mut v = json!({"family": t.family.nft(), "table": t.name, "name": s.name, "type": ty});
    if s.verdict_map {
        v["map"] = json!("verdict");
    }
    if s.interval {
        v["flags"] = json!(["interval"]);
    }
    if let Some(secs) = s.timeout {
        // nft marks it `dynamic` itself once a rule updates it (and 1.0.6 takes no
        // `dynamic` in JSON).
        v["flags"] = json!(["timeout"]);
        v["timeout"] = json!(secs);
    }
    if let Some(size) = s.capacity() {
        v["size"] = json!(size);
    }
    if s.counter {
        v["stmt"] = json!([{"counter": null}]);
    }
    if !s.elements.is_empty() {
        v["elem"] = Value::Array(set_elements(s));
    }
    v
}

/// A set's elements as nft takes and lists them: plain values, or for a merged rule's set each
/// value with its rule's name as comment (`{"elem": {"val": …, "comment": …}}`).
pub fn set_elements(s: &Set) -> Vec<Value> {
    if s.is_merged() {
        s.elements
            .iter()
            .zip(&s.comments)
            .map(|(e, c)| json!({"elem": {"val": e.json(), "comment": c}}))
            .collect()
    } else {
        s.elements.iter().map(Element::json).collect()
    }
}

/// A set's elements as [`crate::listing::ListedElement::text`] reads them back, by text
/// sorted: what drift detection compares with [`crate::listing::Listing::elements`].
pub fn element_texts(s: &Set) -> Vec<String> {
    let mut v: Vec<String> = set_elements(s).iter().map(Value::to_string).collect();
    v.sort_unstable();
    v
}

fn chain(t: &Table, c: &Chain) -> Value {
    json!({"family": t.family.nft(), "table": t.name, "name": c.name,
        "type": c.kind.nft(), "hook": c.hook.nft(), "prio": c.priority,
        "policy": match c.policy { Policy::Accept => "accept", Policy::Drop => "drop" }})
}

fn rule(t: &Table, r: &Rule) -> Value {
    rule_obj(t.family.nft(), &t.name, r)
}

fn rule_obj(family: &str, table: &str, r: &Rule) -> Value {
    let mut v = json!({"family": family, "table": table, "chain": r.chain,
        "expr": r.exprs.iter().map(Expr::json).collect::<Vec<_>>()});
    // A chain policy's log rule has no name.
    if !r.comment.is_empty() {
        v["comment"] = json!(r.comment);
    }
    v
}
