//! Whether a new set of objects differs from the one in force only by the inline elements of
//! some named sets: then the agent edits those sets' elements in place (as it does for
//! `AddressSet` slices) instead of applying the whole policy again. A NetworkPolicy tier whose
//! sets are named after their selectors changes this way when a pod is relabelled, created or
//! deleted.

use crate::types::{FirewallConfigurationSpec, Set, Table};
use crate::{Origin, PolicyObject};

/// The sets (by object and set name) whose inline elements are all that differs between `old`
/// and `new`: the same objects in the same order, the same roles, tables, chains and set
/// declarations. None for any other difference, and for an element change of a set that
/// `AddressSet` slices also fill or of a map (its elements carry verdicts or data): the whole
/// policy is applied then. Empty: nothing differs.
pub fn inline_element_changes<'a>(
    old: impl IntoIterator<Item = &'a PolicyObject>,
    new: impl IntoIterator<Item = &'a PolicyObject>,
) -> Option<Vec<(Origin, String)>> {
    let (mut old, mut new) = (old.into_iter(), new.into_iter());
    let mut out = Vec::new();
    loop {
        match (old.next(), new.next()) {
            (None, None) => return Some(out),
            (Some(o), Some(n)) => {
                if o.origin != n.origin || o.role != n.role {
                    return None;
                }
                for set in changed_sets(&o.spec, &n.spec)? {
                    out.push((n.origin.clone(), set));
                }
            }
            // One more object on either side.
            _ => return None,
        }
    }
}

/// The names of the sets of `new` whose elements alone differ from `old`'s (sets `AddressSet`
/// slices fill and maps left out: None).
fn changed_sets(
    old: &FirewallConfigurationSpec,
    new: &FirewallConfigurationSpec,
) -> Option<Vec<String>> {
    let mut out = Vec::new();
    for i in sets_with_other_elements(old, new)? {
        let s = &new.table.sets[i];
        if s.from_address_sets || s.data_type.is_some() {
            return None;
        }
        out.push(s.name.clone());
    }
    Some(out)
}

/// Where `new` differs from `old` in some sets' elements alone, those sets' positions (the
/// same in both); None for any other difference. Empty: nothing differs.
pub fn sets_with_other_elements(
    old: &FirewallConfigurationSpec,
    new: &FirewallConfigurationSpec,
) -> Option<Vec<usize>> {
    // Every field named, so that a field added to the spec is compared here too.
    let FirewallConfigurationSpec {
        table:
            Table {
                name,
                family,
                chains,
                sets,
            },
        audit,
    } = new;
    let o = &old.table;
    if (name, family, chains, audit) != (&o.name, &o.family, &o.chains, &old.audit)
        || sets.len() != o.sets.len()
    {
        return None;
    }
    let mut out = Vec::new();
    for (i, (s, was)) in sets.iter().zip(&o.sets).enumerate() {
        let Set {
            name,
            key_type,
            data_type,
            elements,
            from_address_sets,
            address_sets,
        } = s;
        if (name, key_type, data_type, from_address_sets, address_sets)
            != (
                &was.name,
                &was.key_type,
                &was.data_type,
                &was.from_address_sets,
                &was.address_sets,
            )
        {
            return None;
        }
        if *elements != was.elements {
            out.push(i);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::parse_documents;

    fn objects(elements: &[&str], extra_rule: bool, from_slices: bool) -> Vec<PolicyObject> {
        let elems: String = elements.iter().map(|e| format!("{{key: {e}}},")).collect();
        let rule = if extra_rule {
            "\n        - {name: more, action: drop, match: [{op: eq, ip: {value: 10.9.0.1, position: src}}]}"
        } else {
            ""
        };
        let doc = format!(
            "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {{name: t, namespace: ns}}\nspec:\n  table:\n    name: t\n    family: INET\n    sets: [{{name: pods, keyType: ipv4_addr, fromAddressSets: {from_slices}, elements: [{elems}]}}, {{name: other, keyType: ipv4_addr, elements: [{{key: 10.8.0.1}}]}}]\n    chains:\n    - name: fwd\n      type: filter\n      hook: forward\n      priority: 0\n      policy: accept\n      rules:\n        filterRules:\n        - {{name: allow, action: accept, match: [{{op: eq, ip: {{value: '@pods', position: dst}}}}]}}{rule}\n"
        );
        parse_documents(&doc, "t").unwrap()
    }

    #[test]
    fn only_the_sets_whose_elements_changed_are_named() {
        let old = objects(&["10.0.0.1"], false, false);
        let new = objects(&["10.0.0.1", "10.0.0.2"], false, false);
        let got = inline_element_changes(&old, &new).unwrap();
        assert_eq!(got, [(old[0].origin.clone(), "pods".to_string())]);
        assert_eq!(inline_element_changes(&old, &old), Some(Vec::new()));
    }

    #[test]
    fn a_rule_a_slice_filled_set_or_another_object_is_not_an_element_change() {
        let old = objects(&["10.0.0.1"], false, false);
        assert_eq!(
            inline_element_changes(&old, &objects(&["10.0.0.1"], true, false)),
            None
        );
        let sliced = objects(&["10.0.0.1"], false, true);
        assert_eq!(
            inline_element_changes(&sliced, &objects(&["10.0.0.2"], false, true)),
            None
        );
        assert_eq!(inline_element_changes(&old, &[]), None);
    }
}
