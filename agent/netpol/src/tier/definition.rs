//! The text of set definitions ([`super::sets::Registry`]: a set is named by the hash of its
//! definition): a policy's selectors and peers written as Rust's derived `Debug` writes them,
//! which is how the names of every deployed tier were made, without the formatting machinery
//! (a tier writes one definition per policy and rule on each computation: at 1,000 policies
//! the derived `Debug` was a fifth of the tier's time). Written out here, the names no longer
//! depend on what a compiler release makes of `Debug`; the tests hold the text to it today.

use std::fmt::Write;

use super::super::{Operator, Peer, Requirement, Selector};

/// `s` as `Debug` writes a string: quoted, escaped where it must be (label keys and values
/// never need it: the API server admits `[A-Za-z0-9._/-]` only).
fn string(out: &mut String, s: &str) {
    if s.bytes()
        .all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\' || b == b' ')
    {
        out.push('"');
        out.push_str(s);
        out.push('"');
    } else {
        let _ = write!(out, "{s:?}");
    }
}

/// `items` each written by `each`, separated by `, ` (as `Debug` separates them).
fn list<T>(out: &mut String, items: impl IntoIterator<Item = T>, each: impl Fn(&mut String, T)) {
    for (i, x) in items.into_iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        each(out, x);
    }
}

fn requirement(out: &mut String, r: &Requirement) {
    out.push_str("Requirement { key: ");
    string(out, &r.key);
    out.push_str(", op: ");
    out.push_str(match r.op {
        Operator::In => "In",
        Operator::NotIn => "NotIn",
        Operator::Exists => "Exists",
        Operator::DoesNotExist => "DoesNotExist",
    });
    out.push_str(", values: [");
    list(out, &r.values, |o, v| string(o, v));
    out.push_str("] }");
}

/// A selector as `{:?}` writes it.
pub(super) fn selector(out: &mut String, s: &Selector) {
    out.push_str("Selector { labels: {");
    list(out, &s.labels, |o, (k, v)| {
        string(o, k);
        o.push_str(": ");
        string(o, v);
    });
    out.push_str("}, exprs: [");
    list(out, &s.exprs, requirement);
    out.push_str("] }");
}

fn optional(out: &mut String, s: Option<&Selector>) {
    match s {
        None => out.push_str("None"),
        Some(s) => {
            out.push_str("Some(");
            selector(out, s);
            out.push(')');
        }
    }
}

/// A rule's peers as `{:?}` writes them.
pub(super) fn peers(out: &mut String, peers: &[Peer]) {
    out.push('[');
    list(out, peers, |out, p| match p {
        Peer::Pods { namespaces, pods } => {
            out.push_str("Pods { namespaces: ");
            optional(out, namespaces.as_ref());
            out.push_str(", pods: ");
            optional(out, pods.as_ref());
            out.push_str(" }");
        }
        // Blocks are few: the derived text as it is.
        Peer::Block(b) => {
            let _ = write!(out, "Block({b:?})");
        }
    });
    out.push(']');
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    use super::super::super::testing::random_cluster;
    use super::super::super::{Operator, Requirement, Selector};
    use super::*;

    fn text(f: impl FnOnce(&mut String)) -> String {
        let mut s = String::new();
        f(&mut s);
        s
    }

    #[test]
    fn definitions_are_the_text_debug_writes() {
        let mut rng = StdRng::seed_from_u64(41);
        let mut rules = 0;
        for _ in 0..300 {
            let c = random_cluster(&mut rng);
            for p in &c.policies {
                let sel = &p.pod_selector;
                assert_eq!(text(|o| selector(o, sel)), format!("{sel:?}"));
                for r in p.ingress.iter().chain(&p.egress).flatten() {
                    assert_eq!(text(|o| peers(o, &r.peers)), format!("{:?}", r.peers));
                    rules += 1;
                }
            }
        }
        assert!(rules > 300, "{rules}");
        // Every operator, a value Debug escapes, an empty selector.
        let odd = Selector {
            labels: [("k".to_string(), "quote\"d \\ é\n".to_string())].into(),
            exprs: [
                Operator::In,
                Operator::NotIn,
                Operator::Exists,
                Operator::DoesNotExist,
            ]
            .into_iter()
            .map(|op| Requirement {
                key: "app.kubernetes.io/name".into(),
                op,
                values: vec!["a".into(), "b-c_d.e".into()],
            })
            .collect(),
        };
        for s in [odd, Selector::default()] {
            assert_eq!(text(|o| selector(o, &s)), format!("{s:?}"));
        }
    }
}
