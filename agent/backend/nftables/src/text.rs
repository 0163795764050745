//! Human-readable nft syntax for a rendered table (what `peerwall compile` prints).
//!
//! Printed from the same typed model that is applied, so the two cannot diverge. Names that
//! nft's text parser would take as keywords are printed as they are; the JSON form is what
//! gets loaded.

use std::fmt::Write as _;

use crate::model::{Element, Expr, Policy, Table, DIGEST_PREFIX, MARKER_CHAIN, MARKER_PREFIX};

/// nft text for one table.
pub fn table_text(t: &Table) -> String {
    text_of(t, true)
}

/// nft text for one table without peerwall's ownership marker: the table as another
/// controller holds it (the lab stands in for Liqo's firewall controller with it; peerwall's
/// backend never touches a table without its marker).
pub fn foreign_table_text(t: &Table) -> String {
    text_of(t, false)
}

fn text_of(t: &Table, marker: bool) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "table {} {} {{", t.family.nft(), t.name);
    // Each object after what it names: sets, the event limit, the chains the maps jump to
    // (with their rules), the maps, the base chains.
    for s in t.sets.iter().filter(|s| !s.verdict_map) {
        set_text(&mut out, s);
    }
    if let Some(l) = &t.event_limit {
        let _ = writeln!(
            out,
            "\tlimit {} {{ rate {}/second burst {} packets }}",
            crate::model::EVENT_LIMIT,
            l.rate,
            l.burst
        );
    }
    for c in &t.regular {
        let _ = writeln!(out, "\tchain {} {{", c.name);
        rules_text(&mut out, t, &c.name);
        let _ = writeln!(out, "\t}}");
    }
    for s in t.sets.iter().filter(|s| s.verdict_map) {
        set_text(&mut out, s);
    }
    for c in &t.chains {
        let _ = writeln!(out, "\tchain {} {{", c.name);
        let _ = writeln!(
            out,
            "\t\ttype {} hook {} priority {}; policy {};",
            c.kind.nft(),
            c.hook.nft(),
            c.priority,
            match c.policy {
                Policy::Accept => "accept",
                Policy::Drop => "drop",
            }
        );
        rules_text(&mut out, t, &c.name);
        let _ = writeln!(out, "\t}}");
    }
    if marker {
        let _ = writeln!(out, "\tchain {MARKER_CHAIN} {{");
        let _ = writeln!(out, "\t\tcounter comment \"{MARKER_PREFIX}{}\"", t.owner);
        let digest = crate::json::digest(t);
        let _ = writeln!(out, "\t\tcounter comment \"{DIGEST_PREFIX}{digest}\"");
        let _ = writeln!(out, "\t}}");
    }
    let _ = writeln!(out, "}}");
    out
}

fn rules_text(out: &mut String, t: &Table, chain: &str) {
    for r in t.rules.iter().filter(|r| r.chain == chain) {
        let mut line: Vec<String> = r.exprs.iter().map(Expr::text).collect();
        if !r.comment.is_empty() {
            line.push(format!("comment {:?}", r.comment));
        }
        let _ = writeln!(out, "\t\t{}", line.join(" "));
    }
}

fn set_text(out: &mut String, s: &crate::model::Set) {
    let kind = if s.verdict_map { "map" } else { "set" };
    let value = if s.verdict_map { " : verdict" } else { "" };
    let _ = writeln!(out, "\t{kind} {} {{", s.name);
    let _ = writeln!(out, "\t\ttype {}{value}", s.key.nft());
    if let Some(size) = s.capacity() {
        let _ = writeln!(out, "\t\tsize {size}");
    }
    if s.interval {
        let _ = writeln!(out, "\t\tflags interval");
    }
    if let Some(secs) = s.timeout {
        let _ = writeln!(out, "\t\tflags dynamic,timeout");
        let _ = writeln!(out, "\t\ttimeout {secs}s");
    }
    if s.counter {
        let _ = writeln!(out, "\t\tcounter");
    }
    if !s.elements.is_empty() {
        let items: Vec<String> = if s.is_merged() {
            s.elements
                .iter()
                .zip(&s.comments)
                .map(|(e, c)| format!("{} comment {c:?}", e.text()))
                .collect()
        } else {
            s.elements.iter().map(Element::text).collect()
        };
        let _ = writeln!(out, "\t\telements = {{ {} }}", items.join(", "));
    }
    let _ = writeln!(out, "\t}}");
}
