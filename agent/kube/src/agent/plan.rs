//! The agent's pure decisions, no kube types: which objects to enforce (valid ones, or an
//! invalid object's last good spec), which a whole-policy compilation refuses together, what
//! each object's condition says, and this host's finalizer.

use std::collections::{BTreeMap, BTreeSet};

use peerwall_intent::types::ConditionType;
use peerwall_policy::compile::{self, PolicyObject};

/// One watched object, reduced to what planning needs (no kube types: [`plan`] is pure).
#[derive(Clone, Debug)]
pub struct Observed {
    /// `namespace/name`.
    pub key: String,
    /// UID (a re-created object does not inherit its predecessor's last good spec).
    pub uid: String,
    /// `metadata.generation`.
    pub generation: i64,
    /// Being deleted.
    pub deleting: bool,
    /// Decoded and validated object, or the message why not.
    pub checked: Result<PolicyObject, String>,
}

/// The spec of an object last enforced successfully.
#[derive(Clone, Debug, PartialEq)]
pub struct Good {
    /// UID of the object it was enforced for.
    pub uid: String,
    /// Its generation.
    pub generation: i64,
    /// The spec.
    pub object: PolicyObject,
}

/// This host's verdict on one object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// Applied or Error.
    pub kind: ConditionType,
    /// Message (errors, or warnings / the spec still in force).
    pub message: Option<String>,
    /// Generation described.
    pub generation: i64,
}

/// The message of an `Applied` condition while the emergency switch is on.
pub const SWITCH_ON_MESSAGE: &str = "applied, but the emergency switch is on: this host lets every packet through until `peerwall allow-all off`";

/// The condition a host reports on a FirewallConfiguration after a round: `Error` with the
/// refusal when the object was refused, `Error` with the apply's failure when the apply
/// failed, else `Applied` (saying so when the emergency switch lets everything through).
pub fn outcome(
    refused: Option<&str>,
    apply_error: Option<&str>,
    switch_on: bool,
    generation: i64,
) -> Outcome {
    match (refused, apply_error) {
        (Some(msg), _) => Outcome {
            kind: ConditionType::Error,
            message: Some(msg.to_string()),
            generation,
        },
        (None, Some(e)) => Outcome {
            kind: ConditionType::Error,
            message: Some(format!("apply failed: {e}")),
            generation,
        },
        (None, None) => Outcome {
            kind: ConditionType::Applied,
            message: switch_on.then(|| SWITCH_ON_MESSAGE.to_string()),
            generation,
        },
    }
}

/// What a round will enforce and report.
#[derive(Debug, Default)]
pub struct Plan {
    /// Objects to enforce (current valid spec or last good one), by key.
    pub enforce: BTreeMap<String, PolicyObject>,
    /// Keys whose *current* spec is in `enforce` (they become `Applied` on success).
    pub current: BTreeSet<String>,
    /// Keys refused, with the reason (they become `Error` whatever the apply does).
    pub refused: BTreeMap<String, String>,
    /// Keys being deleted (left out; finalizer released after a successful apply).
    pub deleting: BTreeSet<String>,
}

/// Table names the controller derives for its own objects: protection (`peerwall_<peer>`, its
/// boot twin `peerwall_boot_<peer>`), the NetworkPolicy tier (`pwnp_<peer>`) and the node's
/// boot table (`peerwall-boot`).
pub fn reserved_table(name: &str) -> bool {
    name.starts_with("peerwall_")
        || name.starts_with(peerwall_netpol::tier::TABLE_PREFIX)
        || name == crate::protection::boot::NODE_BOOT_TABLE
}

/// Whether `key` (`namespace/name`) names one of the controller's own objects: the names it
/// writes in a tenant namespace. The name is the identity the agent can check: another
/// object cannot take it while the controller's exists, and the controller takes it back
/// (server-side apply, forced) when someone writes it.
pub fn controllers_key(key: &str) -> bool {
    let name = key.rsplit('/').next().unwrap_or_default();
    name == crate::protection::GATEWAY_CONFIG || name == peerwall_netpol::tier::TIER_CONFIG
}

/// Why `obj` (under `key`) may not be enforced as written: a table name reserved for the
/// controller's objects ([`reserved_table`]) in an object that is not one of them. Such a
/// table would replace a peer's protection or its NetworkPolicy tier.
pub fn reserved_by_controller(key: &str, obj: &PolicyObject) -> Option<String> {
    let table = obj.spec.table.name.as_deref().unwrap_or_default();
    if table == peerwall_backend_select::ENDED_TABLE {
        return Some(format!(
            "spec.table.name: {table:?}: reserved for the table where the agent keeps the \
             connections it ended (nobody's object may name it); name the table otherwise"
        ));
    }
    if table == peerwall_backend_select::guard::TABLE {
        return Some(format!(
            "spec.table.name: {table:?}: reserved for the table that drops what arrives on \
             an interface before the bpf datapath is attached to it (nobody's object may name \
             it); name the table otherwise"
        ));
    }
    if table == peerwall_backend_select::tracking::TABLE {
        return Some(format!(
            "spec.table.name: {table:?}: reserved for the table that keeps the kernel \
             tracking connections where the bpf datapath reads its table (nobody's object may \
             name it); name the table otherwise"
        ));
    }
    (reserved_table(table) && !controllers_key(key)).then(|| {
        format!(
            "spec.table.name: {table:?}: reserved for peerwall's controller (tables named \
             `peerwall_*`, `pwnp_*` and `peerwall-boot` come only from its `{}` and `{}` \
             objects); name the table otherwise",
            crate::protection::GATEWAY_CONFIG,
            peerwall_netpol::tier::TIER_CONFIG
        )
    })
}

/// Decide what to enforce from the observed objects and the last good specs; forget the last
/// good spec of objects that are gone, re-created or being deleted.
pub fn plan(observed: &[Observed], last_good: &mut BTreeMap<String, Good>) -> Plan {
    let mut p = Plan::default();
    let present: BTreeSet<&str> = observed
        .iter()
        .filter(|o| !o.deleting)
        .map(|o| o.key.as_str())
        .collect();
    last_good.retain(|k, _| present.contains(k.as_str()));
    for o in observed {
        if o.deleting {
            p.deleting.insert(o.key.clone());
            continue;
        }
        let checked = match &o.checked {
            Ok(obj) => match reserved_by_controller(&o.key, obj) {
                Some(why) => Err(why),
                None => Ok(obj),
            },
            Err(msg) => Err(msg.clone()),
        };
        match checked {
            Ok(obj) => {
                p.enforce.insert(o.key.clone(), obj.clone());
                p.current.insert(o.key.clone());
            }
            Err(msg) => refuse(&mut p, o, last_good, &msg),
        }
    }
    p
}

/// Hold back the current specs that wait for their slices
/// ([`peerwall_policy::sliced::waiting_for_slices`]): the last
/// good spec of the object stays in force meanwhile (none when it has none), and the object
/// reports why. A set is never enforced with fewer slices than its writer published.
pub fn hold_incomplete(
    p: &mut Plan,
    observed: &[Observed],
    counts: &BTreeMap<(String, String), u32>,
    last_good: &BTreeMap<String, Good>,
) {
    for o in observed {
        if !p.current.contains(&o.key) {
            continue;
        }
        let Some(why) = p
            .enforce
            .get(&o.key)
            .and_then(|obj| peerwall_policy::sliced::waiting_for_slices(&o.key, obj, counts))
        else {
            continue;
        };
        refuse(p, o, last_good, &why);
    }
}

/// `o`'s current spec not enforced, for `why`: its last good spec stays in force instead
/// (when it has one of the same object, not naming a table reserved for the controller), and
/// the object reports both.
fn refuse(p: &mut Plan, o: &Observed, last_good: &BTreeMap<String, Good>, why: &str) {
    p.current.remove(&o.key);
    let kept = last_good
        .get(&o.key)
        .filter(|g| g.uid == o.uid)
        .filter(|g| reserved_by_controller(&o.key, &g.object).is_none());
    let note = match kept {
        Some(g) => {
            p.enforce.insert(o.key.clone(), g.object.clone());
            format!(
                "{why} (not applied; generation {} stays in force)",
                g.generation
            )
        }
        None => {
            p.enforce.remove(&o.key);
            format!("{why} (not applied)")
        }
    };
    p.refused.insert(o.key.clone(), note);
}

/// What a whole-policy compilation made of a plan: the objects it refused (key, message
/// reported in status, and the last good spec kept in force instead, if any) and the compiled
/// policy of the rest.
#[derive(Clone, Debug, Default)]
pub struct Settled {
    /// Refused keys with their status message and what stays in force of them.
    pub refused: Vec<(String, String, Option<PolicyObject>)>,
    /// The policy of everything else.
    pub compiled: compile::Compiled,
}

impl Settled {
    /// Take the refusals into `p` (also when this result is reused for an unchanged plan).
    pub fn mark(&self, p: &mut Plan) {
        for (k, msg, kept) in &self.refused {
            p.current.remove(k);
            match kept {
                Some(o) => {
                    p.enforce.insert(k.clone(), o.clone());
                }
                None => {
                    p.enforce.remove(k);
                }
            }
            p.refused.insert(k.clone(), msg.clone());
        }
    }
}

/// Leave out the objects a whole-policy compilation refuses (for example two objects claiming
/// one table) until the rest compiles; returns the refusals and the compiled rest.
///
/// On a clash the incumbent wins: an object whose table was in force for it (its last good
/// spec names the same table) is compiled first and keeps the name, whatever the keys' order;
/// the newcomer is refused, and keeps its own last good spec in force when it has one that
/// compiles beside the rest. Nobody takes a table from another by choosing a name that sorts
/// first.
pub fn settle(p: &mut Plan, last_good: &BTreeMap<String, Good>) -> Settled {
    let table = |o: &PolicyObject| o.spec.table.name.clone();
    let holds = |k: &str, o: &PolicyObject| {
        last_good
            .get(k)
            .is_some_and(|g| table(&g.object) == table(o))
    };
    let mut out = Settled::default();
    loop {
        let mut order: Vec<(&String, &PolicyObject)> = p.enforce.iter().collect();
        // Stable: incumbents first, each group in key order.
        order.sort_by_key(|(k, o)| !holds(k, o));
        let objs: Vec<PolicyObject> = order.into_iter().map(|(_, o)| o.clone()).collect();
        let e = match compile::compile(&objs) {
            Ok(compiled) => {
                out.compiled = compiled;
                return out;
            }
            Err(e) => e,
        };
        let before = p.enforce.len();
        let mut fell_back = false;
        let round: Vec<(String, String, Option<PolicyObject>)> = e
            .objects
            .iter()
            .filter(|oe| p.enforce.contains_key(&oe.origin))
            .map(|oe| {
                let k = oe.origin.clone();
                // Its last good spec, unless that is what was just refused.
                let kept = last_good
                    .get(&k)
                    .filter(|g| Some(&g.object) != p.enforce.get(&k))
                    .filter(|g| reserved_by_controller(&k, &g.object).is_none());
                match kept {
                    Some(g) => {
                        fell_back = true;
                        let msg = format!(
                            "{oe} (not applied; generation {} stays in force)",
                            g.generation
                        );
                        (k, msg, Some(g.object.clone()))
                    }
                    None => (k, format!("{oe} (not applied)"), None),
                }
            })
            .collect();
        let step = Settled {
            refused: if round.is_empty() {
                // Nothing attributable: refuse everything rather than loop.
                p.enforce
                    .keys()
                    .map(|k| (k.clone(), format!("{e} (not applied)"), None))
                    .collect()
            } else {
                round
            },
            compiled: Default::default(),
        };
        step.mark(p);
        // A key refused again after its fallback is refused for good (its last message).
        for r in step.refused {
            out.refused.retain(|(k, _, _)| k != &r.0);
            out.refused.push(r);
        }
        if (p.enforce.len() == before && !fell_back) || p.enforce.is_empty() {
            return out;
        }
    }
}

/// Finalizer of this host: `peerwall.io/agent-<host>` (name part at most 63 characters).
pub fn finalizer(host: &str) -> String {
    let mut name: String = format!("agent-{host}")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_' {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    while name.ends_with(['-', '.', '_']) {
        name.pop();
    }
    format!("peerwall.io/{name}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use peerwall_intent::load::parse_documents;

    fn object(name: &str, table: &str, policy: &str) -> PolicyObject {
        let y = format!(
            "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {{name: {name}, namespace: ns}}\nspec:\n  table:\n    name: {table}\n    family: INET\n    chains:\n    - name: c\n      type: filter\n      hook: forward\n      priority: 0\n      policy: {policy}\n      rules: {{filterRules: []}}\n"
        );
        parse_documents(&y, "t").unwrap().remove(0)
    }

    fn observed(
        name: &str,
        uid: &str,
        generation: i64,
        checked: Result<PolicyObject, String>,
    ) -> Observed {
        Observed {
            key: format!("ns/{name}"),
            uid: uid.into(),
            generation,
            deleting: false,
            checked,
        }
    }

    #[test]
    fn invalid_object_keeps_its_last_good_spec() {
        let mut good = BTreeMap::new();
        let a1 = object("a", "ta", "accept");
        good.insert(
            "ns/a".to_string(),
            Good {
                uid: "u1".into(),
                generation: 1,
                object: a1.clone(),
            },
        );
        let p = plan(
            &[observed("a", "u1", 2, Err("spec.x: bad".into()))],
            &mut good,
        );
        assert_eq!(p.enforce.get("ns/a"), Some(&a1));
        assert!(p.current.is_empty());
        assert!(
            p.refused["ns/a"].contains("generation 1 stays in force"),
            "{:?}",
            p.refused
        );
    }

    /// `object` with one set filled from `declared` AddressSets.
    fn with_slices(name: &str, declared: u32) -> PolicyObject {
        let mut o = object(name, "ta", "drop");
        o.spec.table.sets.push(peerwall_intent::types::Set {
            name: "pods".into(),
            key_type: Some(peerwall_intent::types::SetDataType::Ipv4Addr),
            from_address_sets: true,
            address_sets: Some(declared),
            ..Default::default()
        });
        o
    }

    #[test]
    fn a_configuration_waits_for_the_slices_it_declares_and_its_last_good_stays() {
        let counts = |n: u32| BTreeMap::from([(("ns/a".to_string(), "pods".to_string()), n)]);
        let (v1, v2) = (with_slices("a", 1), with_slices("a", 3));
        let mut good = BTreeMap::from([(
            "ns/a".to_string(),
            Good {
                uid: "u1".into(),
                generation: 1,
                object: v1.clone(),
            },
        )]);
        let obs = [observed("a", "u1", 2, Ok(v2.clone()))];
        // Two of three slices seen: generation 1 stays, and the object says why.
        let mut p = plan(&obs, &mut good);
        hold_incomplete(&mut p, &obs, &counts(2), &good);
        assert_eq!(p.enforce.get("ns/a"), Some(&v1));
        assert!(p.current.is_empty());
        let why = &p.refused["ns/a"];
        assert!(
            why.contains(
                "spec.table.sets[0] (\"pods\"): 3 AddressSets declared (addressSets), 2 seen"
            ) && why.contains("generation 1 stays in force"),
            "{why}"
        );
        // All three: the current generation.
        let mut p = plan(&obs, &mut good);
        hold_incomplete(&mut p, &obs, &counts(3), &good);
        assert_eq!(p.enforce.get("ns/a"), Some(&v2));
        assert!(p.current.contains("ns/a") && p.refused.is_empty());
        // Nothing good before and a slice missing: nothing of it is enforced.
        let mut none = BTreeMap::new();
        let mut p = plan(&obs, &mut none);
        hold_incomplete(&mut p, &obs, &BTreeMap::new(), &none);
        assert!(p.enforce.is_empty(), "{:?}", p.enforce.keys());
        assert!(p.refused["ns/a"].ends_with("0 seen (not applied)"));
    }

    #[test]
    fn recreated_object_does_not_inherit_last_good() {
        let mut good = BTreeMap::new();
        good.insert(
            "ns/a".to_string(),
            Good {
                uid: "old".into(),
                generation: 1,
                object: object("a", "ta", "accept"),
            },
        );
        let p = plan(&[observed("a", "new", 1, Err("bad".into()))], &mut good);
        assert!(p.enforce.is_empty());
        assert_eq!(p.refused["ns/a"], "bad (not applied)");
    }

    #[test]
    fn deleting_objects_are_left_out_and_forgotten() {
        let mut good = BTreeMap::new();
        good.insert(
            "ns/a".to_string(),
            Good {
                uid: "u".into(),
                generation: 1,
                object: object("a", "ta", "accept"),
            },
        );
        let mut o = observed("a", "u", 1, Ok(object("a", "ta", "accept")));
        o.deleting = true;
        let p = plan(&[o], &mut good);
        assert!(p.enforce.is_empty());
        assert!(p.deleting.contains("ns/a"));
        assert!(good.is_empty());
    }

    #[test]
    fn table_clash_refuses_only_the_clashing_object() {
        let mut good = BTreeMap::new();
        let mut p = plan(
            &[
                observed("a", "ua", 1, Ok(object("a", "shared", "accept"))),
                observed("b", "ub", 1, Ok(object("b", "shared", "drop"))),
                observed("c", "uc", 1, Ok(object("c", "other", "accept"))),
            ],
            &mut good,
        );
        let refused = settle(&mut p, &good).refused;
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert_eq!(refused[0].0, "ns/b");
        assert!(refused[0].1.contains("spec.table.name"), "{refused:?}");
        assert_eq!(p.enforce.keys().collect::<Vec<_>>(), ["ns/a", "ns/c"]);
    }

    /// Applied once: the agent remembers it as the last good spec of its key.
    fn applied(good: &mut BTreeMap<String, Good>, o: &Observed) {
        good.insert(
            o.key.clone(),
            Good {
                uid: o.uid.clone(),
                generation: o.generation,
                object: o.checked.clone().unwrap(),
            },
        );
    }

    #[test]
    fn a_newcomer_never_takes_a_table_in_force_whatever_its_name_sorts() {
        let mut good = BTreeMap::new();
        let holder = observed(
            "z-holder",
            "uz",
            1,
            Ok(object("z-holder", "shared", "drop")),
        );
        applied(&mut good, &holder);
        // "a-new" sorts first: by key order alone it would take the table.
        let newcomer = observed("a-new", "ua", 1, Ok(object("a-new", "shared", "accept")));
        let mut p = plan(&[newcomer.clone(), holder.clone()], &mut good);
        let refused = settle(&mut p, &good).refused;
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert_eq!(refused[0].0, "ns/a-new");
        assert_eq!(
            p.enforce["ns/z-holder"].spec.table.chains[0].policy,
            holder.checked.as_ref().unwrap().spec.table.chains[0].policy
        );
        assert!(
            p.refused["ns/a-new"].contains("spec.table.name"),
            "{:?}",
            p.refused
        );
        // A newcomer that had its own table before keeps it in force.
        let before = observed("a-new", "ua", 1, Ok(object("a-new", "mine", "accept")));
        applied(&mut good, &before);
        let renamed = observed("a-new", "ua", 2, Ok(object("a-new", "shared", "accept")));
        let mut p = plan(&[renamed, holder.clone()], &mut good);
        let s = settle(&mut p, &good);
        assert_eq!(s.refused.len(), 1, "{:?}", s.refused);
        assert_eq!(
            p.enforce["ns/a-new"].spec.table.name.as_deref(),
            Some("mine")
        );
        assert_eq!(
            p.enforce["ns/z-holder"].spec.table.name.as_deref(),
            Some("shared")
        );
        assert!(
            p.refused["ns/a-new"].contains("generation 1 stays in force"),
            "{:?}",
            p.refused
        );
        assert!(!p.current.contains("ns/a-new"));
        // The cached result marks a second plan the same way.
        let renamed = observed("a-new", "ua", 2, Ok(object("a-new", "shared", "accept")));
        let mut p2 = plan(&[renamed, holder], &mut good);
        s.mark(&mut p2);
        assert_eq!(
            p2.enforce["ns/a-new"].spec.table.name.as_deref(),
            Some("mine")
        );
    }

    #[test]
    fn the_controllers_table_names_come_only_from_its_objects() {
        let mut good = BTreeMap::new();
        for table in ["peerwall_a", "peerwall_boot_a", "pwnp_a", "peerwall-boot"] {
            let squatter = observed("aaa", "u1", 1, Ok(object("aaa", table, "accept")));
            let p = plan(&[squatter], &mut good);
            assert!(p.enforce.is_empty(), "{table}");
            assert!(
                p.refused["ns/aaa"].contains("reserved for peerwall's controller"),
                "{:?}",
                p.refused
            );
        }
        for name in [
            crate::protection::GATEWAY_CONFIG,
            peerwall_netpol::tier::TIER_CONFIG,
        ] {
            let own = observed(name, "u2", 1, Ok(object(name, "peerwall_a", "drop")));
            let p = plan(&[own], &mut good);
            assert_eq!(p.enforce.len(), 1, "{name}");
            // The table of ended connections, and the one that keeps the kernel tracking for
            // the bpf datapath, are nobody's, not even the controller's.
            for (table, why) in [
                ("peerwall-ended", "connections it ended"),
                ("peerwall-conntrack", "keeps the kernel tracking"),
                ("peerwall-guard", "before the bpf datapath is attached"),
            ] {
                let o = observed(name, "u3", 1, Ok(object(name, table, "drop")));
                let p = plan(&[o], &mut good);
                assert!(p.enforce.is_empty(), "{name} {table}");
                assert!(
                    p.refused[&format!("ns/{name}")].contains(why),
                    "{:?}",
                    p.refused
                );
            }
        }
        // Any other name is anyone's.
        let p = plan(
            &[observed(
                "x",
                "u3",
                1,
                Ok(object("x", "peerwallx", "accept")),
            )],
            &mut good,
        );
        assert_eq!(p.enforce.len(), 1);
    }

    #[test]
    fn finalizer_names_are_valid() {
        assert_eq!(finalizer("gw-1"), "peerwall.io/agent-gw-1");
        let long = finalizer(&"x".repeat(100));
        assert!(long.len() <= "peerwall.io/".len() + 63);
        assert_eq!(finalizer("Node_A:1"), "peerwall.io/agent-Node_A-1");
    }

    #[test]
    fn a_refusal_wins_then_a_failed_apply_then_applied_with_the_switch_said() {
        let o = outcome(Some("spec.x: bad"), Some("nft failed"), true, 3);
        assert_eq!(
            (o.kind, o.message.as_deref(), o.generation),
            (ConditionType::Error, Some("spec.x: bad"), 3)
        );
        let o = outcome(None, Some("nft failed"), true, 4);
        assert_eq!(o.kind, ConditionType::Error);
        assert_eq!(o.message.as_deref(), Some("apply failed: nft failed"));
        let o = outcome(None, None, false, 5);
        assert_eq!((o.kind, o.message), (ConditionType::Applied, None));
        let o = outcome(None, None, true, 5);
        assert_eq!(o.message.as_deref(), Some(SWITCH_ON_MESSAGE));
    }
}
