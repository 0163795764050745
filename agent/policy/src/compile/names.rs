//! Names: nftables identifiers (tables, chains, sets), rule names (kept as nft comments), and
//! stable names for rules written without one.

use std::collections::HashMap;

use super::values::generated_rule_name;
use super::{Advice, Cx, Problem};

/// Longest nftables table, chain or set name (`NFT_NAME_MAXLEN` is 256 with the NUL).
pub(super) const NFT_NAME_MAX: usize = 255;

/// nftables identifiers: a letter, digit or `_` first, then letters, digits, `_ . - /`. Names
/// are passed to nft as JSON strings, so a leading digit works (Liqo names tables after nodes
/// and resources, which may start with one), as do Kubernetes-length names.
pub(super) fn check_identifier(cx: &mut Cx, path: &str, name: &str) {
    let ok_first = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
    let ok_rest = name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-' | '/'));
    if name.is_empty() {
        cx.err(path, Problem::Empty);
    } else if name.starts_with("__") {
        cx.err(
            path,
            Problem::BadName {
                value: name.into(),
                why: "names starting with \"__\" are reserved for peerwall",
            },
        );
    } else if name.len() > NFT_NAME_MAX {
        cx.err(
            path,
            Problem::BadName {
                value: name.into(),
                why: "longer than 255 characters",
            },
        );
    } else if !ok_first || !ok_rest {
        cx.err(
            path,
            Problem::BadName {
                value: name.into(),
                why: "use a letter, digit or '_' first, then letters, digits, '_', '.', '-', '/'",
            },
        );
    }
}

/// Rule names become nft comments: printable, no quotes or backslashes, at most 120 bytes.
pub(super) fn check_rule_name(cx: &mut Cx, path: &str, name: &str) {
    if name.is_empty() {
        cx.err(path, Problem::Empty);
    } else if name.len() > 120 {
        cx.err(
            path,
            Problem::BadName {
                value: name.into(),
                why: "longer than 120 bytes",
            },
        );
    } else if name
        .chars()
        .any(|c| c.is_control() || c == '"' || c == '\\')
    {
        cx.err(
            path,
            Problem::BadName {
                value: name.into(),
                why: "quotes, backslashes and control characters are not allowed",
            },
        );
    }
}

/// The name of every rule of a chain: its own (checked, unique in the chain), or for a rule
/// without one (Liqo's controllers create them, e.g.
/// `pkg/liqo-controller-manager/networking/external-network/remapping/cidr.go`; its mutating
/// webhook, `pkg/webhooks/firewallconfiguration/rule.go`, names them only where it runs) a stable name from its content, with a warning. Generated names never take a name
/// written elsewhere in the chain.
pub(super) fn rule_names<R: serde::Serialize>(
    cx: &mut Cx,
    rules: &[R],
    name_of: impl Fn(&R) -> Option<&str>,
    path_of: impl Fn(usize) -> String,
) -> Vec<String> {
    let mut taken: HashMap<String, String> = HashMap::new();
    for (j, r) in rules.iter().enumerate() {
        let Some(n) = name_of(r).filter(|n| !n.is_empty()) else {
            continue;
        };
        let npath = format!("{}.name", path_of(j));
        check_rule_name(cx, &npath, n);
        match taken.get(n) {
            Some(first) => cx.err(
                npath,
                Problem::Duplicate {
                    value: n.to_string(),
                    first: first.clone(),
                },
            ),
            None => {
                taken.insert(n.to_string(), npath);
            }
        }
    }
    let mut out = Vec::with_capacity(rules.len());
    for (j, r) in rules.iter().enumerate() {
        if let Some(n) = name_of(r).filter(|n| !n.is_empty()) {
            out.push(n.to_string());
            continue;
        }
        // Serializing plain API data cannot fail; an empty text would still name the rule.
        let base = generated_rule_name(&serde_json::to_string(r).unwrap_or_default());
        let mut name = base.clone();
        let mut k = 2;
        while taken.contains_key(&name) {
            name = format!("{base}-{k}");
            k += 1;
        }
        let npath = format!("{}.name", path_of(j));
        cx.warn(&npath, Advice::NameGenerated(name.clone()));
        taken.insert(name.clone(), npath);
        out.push(name);
    }
    out
}
