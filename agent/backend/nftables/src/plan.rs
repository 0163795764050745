//! Pure planning: from what was applied and what is desired to one list of nft commands.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use super::render::RenderedTable;
use super::{ApplyReport, KernelTable, NftError};

/// Commands for one transaction and what they do.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    /// nft JSON commands, in order.
    pub commands: Vec<Value>,
    /// Summary.
    pub report: ApplyReport,
}

fn hook_prios(t: &RenderedTable) -> BTreeSet<(String, i64)> {
    t.chains
        .iter()
        .map(|c| {
            (
                c["hook"].as_str().unwrap_or_default().to_string(),
                c["prio"].as_i64().unwrap_or(0),
            )
        })
        .collect()
}

/// Plan the transaction turning `applied` (what this process installed, by table name) into
/// `desired`, given the tables in the kernel (`kernel`). Tables named in `trusted` are ours even
/// if their marker was removed (drift repair).
///
/// - A desired table whose name is taken by a foreign table in the kernel: error, nothing done.
/// - Same structure as applied: only set element changes.
/// - Otherwise: recreated. Netfilter runs chains of equal hook and priority in reverse
///   registration order, and the evaluator orders them by table name; so every table that sorts
///   before a recreated one and shares a (hook, priority) with it is recreated too, and tables
///   are (re)created in descending name order.
/// - Owned tables in the kernel that are not desired: deleted.
pub fn plan(
    applied: &BTreeMap<String, RenderedTable>,
    desired: &[RenderedTable],
    kernel: &[KernelTable],
    trusted: &[String],
) -> Result<Plan, NftError> {
    for d in desired {
        let foreign = kernel.iter().any(|k| {
            k.name == d.name
                && k.family == d.family.nft()
                && k.owner.is_none()
                && !applied.contains_key(&d.name)
                && !trusted.contains(&d.name)
        });
        if foreign {
            return Err(NftError::NotOwned {
                family: d.family.nft(),
                name: d.name.clone(),
            });
        }
    }
    let mut sorted: Vec<&RenderedTable> = desired.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let in_kernel = |t: &RenderedTable| {
        kernel
            .iter()
            .any(|k| k.name == t.name && k.family == t.family.nft())
    };
    let mut recreate: BTreeSet<String> = BTreeSet::new();
    for t in &sorted {
        let same = applied.get(&t.name).is_some_and(|a| a.same_structure(t));
        if !same || !in_kernel(t) {
            recreate.insert(t.name.clone());
        }
    }
    // Keep the kernel's order of tied chains equal to name order.
    loop {
        let mut grew = false;
        for t in &sorted {
            if recreate.contains(&t.name) {
                continue;
            }
            let prios = hook_prios(t);
            let tied = sorted.iter().any(|r| {
                recreate.contains(&r.name) && r.name > t.name && !hook_prios(r).is_disjoint(&prios)
            });
            if tied {
                recreate.insert(t.name.clone());
                grew = true;
            }
        }
        if !grew {
            break;
        }
    }
    let mut plan = Plan::default();
    let desired_names: BTreeSet<(&str, &str)> = desired
        .iter()
        .map(|t| (t.family.nft(), t.name.as_str()))
        .collect();
    for k in kernel {
        let ours = k.owner.is_some() || trusted.contains(&k.name);
        if ours && !desired_names.contains(&(k.family.as_str(), k.name.as_str())) {
            plan.commands.push(
                serde_json::json!({"delete": {"table": {"family": k.family, "name": k.name}}}),
            );
            plan.report.deleted.push(k.name.clone());
        }
    }
    for t in sorted.iter().rev() {
        if recreate.contains(&t.name) {
            plan.commands.extend(t.recreate_commands());
            plan.report.recreated.push(t.name.clone());
        } else if let Some(old) = applied.get(&t.name) {
            let cmds = t.element_commands(old);
            if !cmds.is_empty() {
                plan.report.element_changes += cmds
                    .iter()
                    .map(|c| {
                        c.as_object()
                            .and_then(|o| o.values().next())
                            .and_then(|v| v["element"]["elem"].as_array())
                            .map_or(0, Vec::len)
                    })
                    .sum::<usize>();
                plan.commands.extend(cmds);
                plan.report.updated.push(t.name.clone());
            }
        }
    }
    plan.report.changed = !plan.commands.is_empty();
    Ok(plan)
}
