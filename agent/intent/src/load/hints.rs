//! What the loader tells a user about input it cannot take: "did you mean" for a misspelt
//! field or value ([`explain`]), and documents that look meant to be peerwall's or Liqo's
//! objects but are not read ([`near_miss`]).

use super::{ADDRESS_SET_KIND, API_VERSION, GROUP, KIND, LIQO_API_VERSION, LIQO_GROUP};

/// The kinds the loader reads, with the apiVersions that carry them.
const READ_KINDS: [(&str, &[&str]); 2] = [
    (KIND, &[API_VERSION, LIQO_API_VERSION]),
    (ADDRESS_SET_KIND, &[API_VERSION]),
];

/// Why a document the loader does not read looks meant to be one it reads: a `kind` a
/// near miss of FirewallConfiguration or AddressSet (case, at most two edits) under a group
/// the loader knows or a near one, or one of those kinds under another version of its group
/// or a near-miss group. `None`: someone else's manifest (a Namespace, a Pod, Liqo's other
/// kinds, peerwall's ProtectionPolicies, which the controller reads).
pub fn near_miss(api_version: Option<&str>, kind: Option<&str>) -> Option<String> {
    let (api_version, kind) = (api_version.unwrap_or_default(), kind.unwrap_or_default());
    let group = api_version.rsplit_once('/').map_or("", |(g, _)| g);
    let near_group = [GROUP, LIQO_GROUP]
        .iter()
        .find(|g| edit_distance(&group.to_ascii_lowercase(), g) <= 2)
        .copied();
    let accepted = |k: &str| {
        READ_KINDS
            .iter()
            .find(|(r, _)| *r == k)
            .map(|(_, v)| v.join(" or "))
            .unwrap_or_default()
    };
    let kinds: Vec<String> = READ_KINDS.iter().map(|(k, _)| k.to_string()).collect();
    match did_you_mean(kind, &kinds) {
        // Exactly one of ours, under an apiVersion the loader does not read it at.
        Some(k) if k == kind => (near_group.is_some() || api_version.is_empty()).then(|| {
            format!(
                "apiVersion `{api_version}` of a {kind}: did you mean {}? (a {kind} is read at {})",
                match near_group {
                    Some(g) if g == LIQO_GROUP && k == KIND => LIQO_API_VERSION,
                    _ => API_VERSION,
                },
                accepted(k)
            )
        }),
        // A near-miss kind, under a group of ours or a near one.
        Some(k) => near_group.map(|_| {
            format!(
                "kind `{kind}`: did you mean `{k}`? (read at {})",
                accepted(k)
            )
        }),
        None => None,
    }
}

/// serde's "unknown variant `X`, expected one of `A`, `B`" (or "unknown field") made
/// helpful: values peerwall refuses anyway are not offered
/// ([`crate::types::TableFamily::NOT_ENFORCED`]) and a near miss is named ("did you mean
/// `IPV4`?"). Other messages pass unchanged.
pub fn explain(message: &str) -> String {
    let Some((head, expected)) = message.split_once(", expected ") else {
        return message.to_string();
    };
    let kind = if head.starts_with("unknown variant `") {
        "value"
    } else if head.starts_with("unknown field `") {
        "field"
    } else {
        return message.to_string();
    };
    let ticked = |s: &str| -> Vec<String> {
        s.split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect()
    };
    let Some(given) = ticked(head).into_iter().next() else {
        return message.to_string();
    };
    let offered: Vec<String> = ticked(expected)
        .into_iter()
        .filter(|v| !crate::types::TableFamily::NOT_ENFORCED.contains(&v.as_str()))
        .collect();
    if offered.is_empty() {
        return format!("unknown {kind} `{given}`: {}", expected.trim());
    }
    let list = offered
        .iter()
        .map(|v| format!("`{v}`"))
        .collect::<Vec<_>>()
        .join(", ");
    match did_you_mean(&given, &offered) {
        Some(near) => {
            format!("unknown {kind} `{given}`: did you mean `{near}`? (accepted: {list})")
        }
        None => format!("unknown {kind} `{given}` (accepted: {list})"),
    }
}

/// The accepted value closest to `given`: equal ignoring case, or at most two edits away.
fn did_you_mean<'a>(given: &str, accepted: &'a [String]) -> Option<&'a str> {
    let g = given.to_ascii_lowercase();
    if let Some(same) = accepted.iter().find(|a| a.to_ascii_lowercase() == g) {
        return Some(same);
    }
    accepted
        .iter()
        .map(|a| (edit_distance(&g, &a.to_ascii_lowercase()), a))
        .filter(|(d, _)| *d <= 2)
        .min_by_key(|(d, _)| *d)
        .map(|(_, a)| a.as_str())
}

/// Levenshtein distance (short names only).
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}
