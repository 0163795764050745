//! Pure planning: from what was applied and what is desired to the commands of one transaction,
//! diffed as types (see [`plan`]).

use std::collections::{BTreeMap, BTreeSet, HashSet};

use peerwall_policy::ir::TableFamily;

use crate::error::NftError;
use crate::listing::KernelTable;
use crate::model::{Command, Table};
use crate::report::ApplyReport;

/// Commands for one transaction and what they do.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan<'a> {
    /// Commands, in order.
    pub commands: Vec<Command<'a>>,
    /// Summary.
    pub report: ApplyReport,
}

/// Element changes turning `old`'s set contents into `new`'s (same structure): deletes first,
/// since a merged interval may be replaced by an overlapping one; the table's decided-flow
/// caches flushed ahead of them ([`crate::decided`]). O(elements): 100k-element
/// sets are normal.
pub fn element_commands<'a>(new: &'a Table, old: &Table) -> Vec<Command<'a>> {
    let mut dels = Vec::new();
    let mut adds = Vec::new();
    for (n, o) in new.sets.iter().zip(&old.sets) {
        let (new_keys, old_keys): (HashSet<_>, HashSet<_>) =
            (n.elements.iter().collect(), o.elements.iter().collect());
        let removed: Vec<_> = o
            .elements
            .iter()
            .filter(|e| !new_keys.contains(e))
            .copied()
            .collect();
        let added: Vec<_> = n
            .elements
            .iter()
            .filter(|e| !old_keys.contains(e))
            .copied()
            .collect();
        if !removed.is_empty() {
            dels.push(Command::DeleteElements {
                table: new,
                set: &n.name,
                elements: removed,
            });
        }
        if !added.is_empty() {
            adds.push(Command::AddElements {
                table: new,
                set: &n.name,
                elements: added,
            });
        }
    }
    dels.extend(adds);
    // A set edited empties the table's decided-flow caches in the same transaction.
    if dels.is_empty() {
        return dels;
    }
    let mut out = crate::decided::flushes(new);
    out.extend(dels);
    out
}

/// The transaction turning `applied` into `desired` when that changes set elements only: the
/// same tables, each of the same structure ([`Table::same_structure`]). Planned from `applied`
/// alone (the kernel is assumed to hold it, and a transaction on a table that is gone fails
/// whole); None for any other change, which [`plan`] decides against the kernel.
pub fn elements_only<'a>(
    applied: &BTreeMap<String, Table>,
    desired: &'a [Table],
) -> Option<Plan<'a>> {
    if desired.len() != applied.len() {
        return None;
    }
    let mut plan = Plan::default();
    for t in desired {
        let old = applied.get(&t.name)?;
        if !old.same_structure(t) {
            return None;
        }
        let cmds = element_commands(t, old);
        if cmds.is_empty() {
            plan.report.kept.push(t.name.clone());
        } else {
            plan.report.element_changes += cmds.iter().map(Command::element_count).sum::<usize>();
            plan.commands.extend(cmds);
            plan.report.updated.push(t.name.clone());
        }
    }
    plan.report.changed = !plan.commands.is_empty();
    Some(plan)
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
pub fn plan<'a>(
    applied: &BTreeMap<String, Table>,
    desired: &'a [Table],
    kernel: &[KernelTable],
    trusted: &[String],
) -> Result<Plan<'a>, NftError> {
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
    let mut sorted: Vec<&'a Table> = desired.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let in_kernel = |t: &Table| {
        kernel
            .iter()
            .any(|k| k.name == t.name && k.family == t.family.nft())
    };
    let mut recreate: BTreeSet<&str> = sorted
        .iter()
        .filter(|t| !applied.get(&t.name).is_some_and(|a| a.same_structure(t)) || !in_kernel(t))
        .map(|t| t.name.as_str())
        .collect();
    // Keep the kernel's order of tied chains equal to name order.
    loop {
        let mut grew = false;
        for t in &sorted {
            if recreate.contains(t.name.as_str()) {
                continue;
            }
            let prios = t.hook_priorities();
            let tied = sorted.iter().any(|r| {
                recreate.contains(r.name.as_str())
                    && r.name > t.name
                    && !r.hook_priorities().is_disjoint(&prios)
            });
            if tied {
                recreate.insert(&t.name);
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
        let family = TableFamily::from_nft(&k.family);
        if let (true, Some(family)) = (ours, family) {
            if !desired_names.contains(&(k.family.as_str(), k.name.as_str())) {
                plan.commands.push(Command::Delete {
                    family,
                    name: k.name.clone(),
                });
                plan.report.deleted.push(k.name.clone());
            }
        }
    }
    for t in sorted.iter().rev() {
        if recreate.contains(t.name.as_str()) {
            plan.commands.push(Command::Recreate(t));
            plan.report.recreated.push(t.name.clone());
        } else if let Some(old) = applied.get(&t.name) {
            let cmds = element_commands(t, old);
            if !cmds.is_empty() {
                plan.report.element_changes +=
                    cmds.iter().map(Command::element_count).sum::<usize>();
                plan.commands.extend(cmds);
                plan.report.updated.push(t.name.clone());
            } else {
                plan.report.kept.push(t.name.clone());
            }
        }
    }
    plan.report.changed = !plan.commands.is_empty();
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Chain, Element, KeyType, Policy, Set};
    use peerwall_policy::ir::{ChainKind, Hook};

    /// A table with one forward chain at `prio` and one set holding `elems`.
    fn table(name: &str, prio: i32, elems: &[&str]) -> Table {
        Table {
            name: name.into(),
            family: TableFamily::Inet,
            owner: format!("ns/{name}"),
            sets: vec![Set {
                name: "s".into(),
                key: KeyType::Ipv4Addr,
                interval: false,
                elements: elems
                    .iter()
                    .map(|e| Element::Addr(e.parse().unwrap()))
                    .collect(),
                counter: false,
                comments: Vec::new(),
                verdict_map: false,
                timeout: None,
            }],
            chains: vec![Chain {
                name: "c".into(),
                kind: ChainKind::Filter,
                hook: Hook::Forward,
                priority: prio,
                policy: Policy::Accept,
            }],
            regular: vec![],
            dispatch_maps: Vec::new(),
            rules: vec![],
            event_limit: None,
        }
    }

    fn ours(t: &Table) -> KernelTable {
        KernelTable {
            family: t.family.nft().into(),
            name: t.name.clone(),
            owner: Some(t.owner.clone()),
        }
    }

    fn applied(ts: &[Table]) -> BTreeMap<String, Table> {
        ts.iter().map(|t| (t.name.clone(), t.clone())).collect()
    }

    /// What a plan does, compactly: `recreate a`, `delete b`, `+s 1`, `-s 2`.
    fn steps(p: &Plan<'_>) -> Vec<String> {
        p.commands
            .iter()
            .map(|c| match c {
                Command::Create(t) => format!("create {}", t.name),
                Command::Recreate(t) => format!("recreate {}", t.name),
                Command::Delete { name, .. } => format!("delete {name}"),
                Command::AddElements {
                    table, elements, ..
                } => format!("{} +{}", table.name, elements.len()),
                Command::DeleteElements {
                    table, elements, ..
                } => format!("{} -{}", table.name, elements.len()),
                other => format!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn planning_cases() {
        let a = table("a", 0, &["10.0.0.1"]);
        let b = table("b", 0, &["10.0.0.2"]);
        let c = table("c", 10, &["10.0.0.3"]);
        struct Case {
            what: &'static str,
            applied: Vec<Table>,
            desired: Vec<Table>,
            kernel: Vec<KernelTable>,
            steps: Vec<&'static str>,
        }
        let cases = vec![
            Case {
                what: "first apply creates every table, highest name first",
                applied: vec![],
                desired: vec![a.clone(), b.clone()],
                kernel: vec![],
                steps: vec!["recreate b", "recreate a"],
            },
            Case {
                what: "nothing changed: no command",
                applied: vec![a.clone(), b.clone()],
                desired: vec![a.clone(), b.clone()],
                kernel: vec![ours(&a), ours(&b)],
                steps: vec![],
            },
            Case {
                what: "set-only change: element updates in place, deletes first",
                applied: vec![a.clone()],
                desired: vec![table("a", 0, &["10.0.0.9", "10.0.0.8"])],
                kernel: vec![ours(&a)],
                steps: vec!["a -1", "a +2"],
            },
            Case {
                what: "structure change recreates the table",
                applied: vec![c.clone()],
                desired: vec![table("c", 20, &["10.0.0.3"])],
                kernel: vec![ours(&c)],
                steps: vec!["recreate c"],
            },
            Case {
                what: "recreating b recreates a too (tied hook and priority, a sorts first)",
                applied: vec![a.clone(), b.clone()],
                desired: vec![a.clone(), {
                    let mut b2 = b.clone();
                    b2.owner = "ns/other".into();
                    b2
                }],
                kernel: vec![ours(&a), ours(&b)],
                steps: vec!["recreate b", "recreate a"],
            },
            Case {
                what: "no tie, no collateral recreation",
                applied: vec![a.clone(), c.clone()],
                desired: vec![a.clone(), {
                    let mut c2 = c.clone();
                    c2.owner = "ns/other".into();
                    c2
                }],
                kernel: vec![ours(&a), ours(&c)],
                steps: vec!["recreate c"],
            },
            Case {
                what: "owned tables no longer desired are deleted; foreign ones left alone",
                applied: vec![a.clone()],
                desired: vec![a.clone()],
                kernel: vec![
                    ours(&a),
                    ours(&b),
                    KernelTable {
                        family: "ip".into(),
                        name: "liqo".into(),
                        owner: None,
                    },
                ],
                steps: vec!["delete b"],
            },
            Case {
                what: "a table missing from the kernel is created again",
                applied: vec![a.clone()],
                desired: vec![a.clone()],
                kernel: vec![],
                steps: vec!["recreate a"],
            },
        ];
        for case in cases {
            let p = plan(&applied(&case.applied), &case.desired, &case.kernel, &[])
                .unwrap_or_else(|e| panic!("{}: {e}", case.what));
            assert_eq!(steps(&p), case.steps, "{}", case.what);
            assert_eq!(p.report.changed, !case.steps.is_empty(), "{}", case.what);
        }
    }

    #[test]
    fn a_foreign_table_with_our_name_is_refused_and_nothing_planned() {
        let a = table("a", 0, &[]);
        let foreign = KernelTable {
            family: "inet".into(),
            name: "a".into(),
            owner: None,
        };
        let desired = [a.clone()];
        let e = plan(
            &BTreeMap::new(),
            &desired,
            std::slice::from_ref(&foreign),
            &[],
        )
        .unwrap_err();
        assert!(matches!(e, NftError::NotOwned { .. }), "{e}");
        // Unless drift repair vouches for it (our marker was removed).
        let p = plan(&BTreeMap::new(), &desired, &[foreign], &["a".into()]).unwrap();
        assert_eq!(steps(&p), ["recreate a"]);
    }

    #[test]
    fn element_updates_are_computed_from_the_difference() {
        let many: Vec<String> = (0..50_000)
            .map(|i| format!("10.{}.{}.1", i / 256, i % 256))
            .collect();
        let refs: Vec<&str> = many.iter().map(String::as_str).collect();
        let old = table("t", 0, &refs);
        let mut more = refs[1..].to_vec();
        more.push("10.250.0.1");
        let new = table("t", 0, &more);
        assert!(new.same_structure(&old));
        let cmds = element_commands(&new, &old);
        let one = |s: &str| vec![Element::Addr(s.parse().unwrap())];
        assert_eq!(cmds.len(), 2, "one delete, one add");
        assert!(
            matches!(&cmds[0], Command::DeleteElements { elements, .. } if *elements == one("10.0.0.1"))
        );
        assert!(
            matches!(&cmds[1], Command::AddElements { elements, .. } if *elements == one("10.250.0.1"))
        );
    }
}
