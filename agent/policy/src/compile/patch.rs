//! A compilation patched where only inline set elements changed: the agent's path for a
//! NetworkPolicy tier after a pod relabel, whose object holds every address of the tier
//! (20,000 at 1,000 policies) while a handful of elements moved. Compiling it whole again
//! costs tens of milliseconds; parsing the changed sets alone costs what they hold.

use peerwall_intent::{Origin, PolicyObject};

use peerwall_intent::types as api;

use super::sets::{key_of, lower_elements};
use super::{Compiled, Cx, ObjectErrors};
use crate::ir::{SetElements, TableFamily};

/// The compilation of `new`, from `old` (taken: a copy of 20,000 addresses would cost more
/// than the patch), the compilation of objects that differ from `new`
/// only in the inline elements of `sets` (as [`peerwall_intent::elements::inline_element_changes`]
/// finds them): each of those sets parsed and validated as [`super::compile`] does, its
/// contents replaced in a copy of `old` (the set and every rule's copy of it).
///
/// None where the sets alone cannot decide it, and the caller compiles the whole: an element
/// with an error or a warning (the whole compilation reports it at its field path), `old`
/// with a warning of the object (its paths may name elements that moved), a set that is not
/// an address set of its table's family, a table not enforced here (observed).
pub fn patch_elements(
    old: Compiled,
    new: &[&PolicyObject],
    sets: &[(Origin, String)],
) -> Option<Compiled> {
    let mut out = old;
    for (origin, name) in sets {
        if out.warnings.iter().any(|(o, _)| o == origin) {
            return None;
        }
        let obj = new.iter().find(|o| &o.origin == origin)?;
        let (i, set) = (obj.spec.table.sets.iter().enumerate()).find(|(_, s)| &s.name == name)?;
        let table = out.policy.tables.iter().find(|t| &t.origin == origin)?;
        let table_name = table.name.clone();
        let (fam, key_name) = key_of(set.key_type?);
        let fam = fam.filter(|f| table.family.sees(*f))?;
        let was = out.policy.addr_set(&table_name, name)?;
        if was.family() != fam {
            return None;
        }
        let mut cx = Cx {
            errors: Vec::new(),
            warnings: Vec::new(),
        };
        let path = format!("spec.table.sets[{i}]");
        let SetElements::Addr(now) = lower_elements(&mut cx, &path, set, Some(fam), key_name)
        else {
            return None;
        };
        if !cx.errors.is_empty() || !cx.warnings.is_empty() {
            return None;
        }
        out.policy.replace_set(&table_name, name, &now).ok()?;
    }
    Some(out)
}

/// [`super::validate`] of `obj`, for an object that differs from one already found valid only
/// in the inline elements of `sets`: those sets' elements checked, with the errors (and field
/// paths, in the same order) the whole validation gives. None where the sets alone cannot
/// decide it (a set missing, without a key type, or in a table of a family this cannot
/// read): the caller validates the whole object.
pub fn validate_sets(obj: &PolicyObject, sets: &[String]) -> Option<Result<(), ObjectErrors>> {
    let t = &obj.spec.table;
    let family = match t.family? {
        api::TableFamily::Inet => TableFamily::Inet,
        api::TableFamily::Ipv4 => TableFamily::Ip,
        api::TableFamily::Ipv6 => TableFamily::Ip6,
        _ => return None,
    };
    let mut cx = Cx {
        errors: Vec::new(),
        warnings: Vec::new(),
    };
    let mut found = 0;
    for (i, set) in t.sets.iter().enumerate() {
        if !sets.contains(&set.name) {
            continue;
        }
        found += 1;
        let (fam, key_name) = key_of(set.key_type?);
        if fam.is_some_and(|f| !family.sees(f)) {
            return None;
        }
        lower_elements(
            &mut cx,
            &format!("spec.table.sets[{i}]"),
            set,
            fam,
            key_name,
        );
    }
    if found != sets.len() {
        return None;
    }
    Some(if cx.errors.is_empty() {
        Ok(())
    } else {
        Err(ObjectErrors {
            origin: obj.origin.0.clone(),
            errors: cx.errors,
        })
    })
}
