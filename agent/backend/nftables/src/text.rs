//! Human-readable nft syntax for a rendered table (what `peerwall compile` prints).
//!
//! Printed from the same JSON that is applied, so the two cannot diverge. Names that nft's text
//! parser would take as keywords are printed as they are; the JSON form is what gets loaded.

use std::fmt::Write as _;

use serde_json::Value;

use super::render::{RenderedTable, MARKER_CHAIN, MARKER_PREFIX};

fn val(v: &Value) -> String {
    match v {
        Value::String(s) if s.starts_with('@') => s.clone(),
        Value::String(s) => {
            if s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-.:/_".contains(c))
                && !s.is_empty()
            {
                s.clone()
            } else {
                format!("{s:?}")
            }
        }
        Value::Number(n) => n.to_string(),
        Value::Null => String::new(),
        Value::Array(items) => items.iter().map(val).collect::<Vec<_>>().join(", "),
        Value::Object(o) => {
            if let Some(p) = o.get("prefix") {
                format!("{}/{}", val(&p["addr"]), val(&p["len"]))
            } else if let Some(Value::Array(r)) = o.get("range") {
                format!("{}-{}", val(&r[0]), val(&r[1]))
            } else if let Some(Value::Array(items)) = o.get("set") {
                format!(
                    "{{ {} }}",
                    items.iter().map(val).collect::<Vec<_>>().join(", ")
                )
            } else if let Some(p) = o.get("payload") {
                format!("{} {}", val(&p["protocol"]), val(&p["field"]))
            } else if let Some(m) = o.get("meta") {
                let k = val(&m["key"]);
                if k == "l4proto" || k == "mark" {
                    format!("meta {k}")
                } else {
                    k
                }
            } else if let Some(c) = o.get("ct") {
                format!("ct {}", val(&c["key"]))
            } else if let Some(r) = o.get("rt") {
                format!("rt {}", val(&r["key"]))
            } else if let Some(t) = o.get("tcp option") {
                format!("tcp option {} {}", val(&t["name"]), val(&t["field"]))
            } else {
                Value::Object(o.clone()).to_string()
            }
        }
        Value::Bool(b) => b.to_string(),
    }
}

fn stmt(s: &Value) -> String {
    let Some((k, v)) = s.as_object().and_then(|o| o.iter().next()) else {
        return s.to_string();
    };
    match k.as_str() {
        "match" => {
            let op = match v["op"].as_str() {
                Some("==") | Some("in") => " ".to_string(),
                Some(op) => format!(" {op} "),
                None => " ".into(),
            };
            let is_ifname = matches!(
                v["left"]["meta"]["key"].as_str(),
                Some("iifname") | Some("oifname")
            );
            let right = match &v["right"] {
                Value::String(s) if is_ifname => format!("{s:?}"),
                other => val(other),
            };
            format!("{}{}{}", val(&v["left"]), op, right)
        }
        "counter" => "counter".into(),
        "reject" => format!("reject with {} {}", val(&v["type"]), val(&v["expr"])),
        "mangle" => format!("{} set {}", val(&v["key"]), val(&v["value"])),
        "dnat" | "snat" => {
            let prefix = if v.get("type_flags").and_then(|f| f.as_str()) == Some("prefix") {
                "prefix "
            } else {
                ""
            };
            match v.get("family") {
                Some(f) => format!("{k} {} {prefix}to {}", val(f), val(&v["addr"])),
                None => format!("{k} {prefix}to {}", val(&v["addr"])),
            }
        }
        other => other.to_string(),
    }
}

/// nft text for one table.
pub fn table_text(t: &RenderedTable) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "table {} {} {{", t.family.nft(), t.name);
    for s in &t.sets {
        let _ = writeln!(out, "\tset {} {{", s.name);
        let _ = writeln!(out, "\t\ttype {}", s.key_type);
        if s.interval {
            let _ = writeln!(out, "\t\tflags interval");
        }
        if !s.elements.is_empty() {
            let _ = writeln!(
                out,
                "\t\telements = {{ {} }}",
                val(&Value::Array(s.elements.clone()))
            );
        }
        let _ = writeln!(out, "\t}}");
    }
    for c in &t.chains {
        let name = val(&c["name"]);
        let _ = writeln!(out, "\tchain {name} {{");
        let _ = writeln!(
            out,
            "\t\ttype {} hook {} priority {}; policy {};",
            val(&c["type"]),
            val(&c["hook"]),
            val(&c["prio"]),
            val(&c["policy"])
        );
        for r in t.rules.iter().filter(|r| r["chain"] == c["name"]) {
            let mut line: Vec<String> = r["expr"]
                .as_array()
                .map(|e| e.iter().map(stmt).collect())
                .unwrap_or_default();
            if let Some(cm) = r["comment"].as_str() {
                line.push(format!("comment {cm:?}"));
            }
            let _ = writeln!(out, "\t\t{}", line.join(" "));
        }
        let _ = writeln!(out, "\t}}");
    }
    let _ = writeln!(out, "\tchain {MARKER_CHAIN} {{");
    let _ = writeln!(out, "\t\tcounter comment \"{MARKER_PREFIX}{}\"", t.owner);
    let _ = writeln!(out, "\t}}");
    let _ = writeln!(out, "}}");
    out
}
