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
        match &o.checked {
            Ok(obj) => {
                p.enforce.insert(o.key.clone(), obj.clone());
                p.current.insert(o.key.clone());
            }
            Err(msg) => {
                let kept = last_good.get(&o.key).filter(|g| g.uid == o.uid);
                let note = match kept {
                    Some(g) => {
                        p.enforce.insert(o.key.clone(), g.object.clone());
                        format!(
                            "{msg} (not applied; generation {} stays in force)",
                            g.generation
                        )
                    }
                    None => format!("{msg} (not applied)"),
                };
                p.refused.insert(o.key.clone(), note);
            }
        }
    }
    p
}

/// What a whole-policy compilation made of a plan: the objects it refused (key, message
/// reported in status) and the compiled policy of the rest.
#[derive(Clone, Debug, Default)]
pub struct Settled {
    /// Refused keys with their status message.
    pub refused: Vec<(String, String)>,
    /// The policy of everything else.
    pub compiled: compile::Compiled,
}

impl Settled {
    /// Take the refusals into `p` (also when this result is reused for an unchanged plan).
    pub fn mark(&self, p: &mut Plan) {
        for (k, msg) in &self.refused {
            p.enforce.remove(k);
            p.current.remove(k);
            p.refused.insert(k.clone(), msg.clone());
        }
    }
}

/// Leave out the objects a whole-policy compilation refuses (for example two objects claiming
/// one table) until the rest compiles; returns the refusals and the compiled rest.
pub fn settle(p: &mut Plan) -> Settled {
    let mut out = Settled::default();
    loop {
        let objs: Vec<PolicyObject> = p.enforce.values().cloned().collect();
        let e = match compile::compile(&objs) {
            Ok(compiled) => {
                out.compiled = compiled;
                return out;
            }
            Err(e) => e,
        };
        let before = p.enforce.len();
        let round: Vec<(String, String)> = e
            .objects
            .iter()
            .map(|oe| (oe.origin.clone(), format!("{oe} (not applied)")))
            .filter(|(k, _)| p.enforce.contains_key(k))
            .collect();
        let step = Settled {
            refused: if round.is_empty() {
                // Nothing attributable: refuse everything rather than loop.
                p.enforce
                    .keys()
                    .map(|k| (k.clone(), format!("{e} (not applied)")))
                    .collect()
            } else {
                round
            },
            compiled: Default::default(),
        };
        step.mark(p);
        out.refused.extend(step.refused);
        if p.enforce.len() == before || p.enforce.is_empty() {
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
        let refused = settle(&mut p).refused;
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert_eq!(refused[0].0, "ns/b");
        assert!(refused[0].1.contains("spec.table.name"), "{refused:?}");
        assert_eq!(p.enforce.keys().collect::<Vec<_>>(), ["ns/a", "ns/c"]);
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
