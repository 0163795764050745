//! `cargo xtask cycles` (and the first step of `cargo xtask test`): no import cycles between
//! modules of a crate.
//!
//! Each source file is a module (`a/b.rs` and `a/b/mod.rs` are `a::b`; `lib.rs` and `main.rs`
//! the root). A reference to a module (`crate::a::b::Item`, `super::c`, `self::d`) from
//! module X to module Y becomes an edge between the two siblings that hold them under their
//! nearest common ancestor: a parent using its children and children using their parent are
//! how a module is built, two siblings (or their subtrees) using each other is a cycle. Test
//! code (`tests.rs` and `testing.rs` files, what follows `#[cfg(test)]`) and comments are left
//! out: tests may use anything, and a doc link is no import.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// A module path inside one crate (`["k8s", "gateways"]`; empty: the crate root).
type ModPath = Vec<String>;

/// The modules of one crate's `src`, each with its source (test code removed).
fn modules(src: &Path) -> Result<BTreeMap<ModPath, String>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
            let p = e?.path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            if p.extension().and_then(|x| x.to_str()) != Some("rs") {
                continue;
            }
            let rel = p.strip_prefix(src).unwrap_or(&p);
            let mut path: ModPath = rel
                .iter()
                .map(|c| c.to_string_lossy().trim_end_matches(".rs").to_string())
                .collect();
            let last = path.last().cloned().unwrap_or_default();
            if last == "tests" || last == "testing" {
                continue;
            }
            if matches!(last.as_str(), "mod" | "lib" | "main") {
                path.pop();
            }
            let text =
                std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
            let code = match text.find("#[cfg(test)]") {
                Some(i) => &text[..i],
                None => &text[..],
            };
            // Comments (doc links included) are not imports.
            let code: String = code
                .lines()
                .map(|l| l.split_once("//").map_or(l, |(c, _)| c))
                .collect::<Vec<_>>()
                .join("\n");
            out.insert(path, code);
        }
    }
    Ok(out)
}

/// The module paths `code` (in module `at`) refers to, resolved to modules that exist.
fn references(at: &ModPath, code: &str, known: &BTreeSet<ModPath>) -> BTreeSet<ModPath> {
    let mut out = BTreeSet::new();
    let bytes = code.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut i = 0;
    while i < bytes.len() {
        if !code.is_char_boundary(i) {
            i += 1;
            continue;
        }
        let start_ok = i == 0 || !ident(bytes[i - 1]);
        let rest = &code[i..];
        let base = if !start_ok {
            None
        } else if let Some(r) = rest.strip_prefix("crate::") {
            Some((Vec::new(), r))
        } else if rest.starts_with("super::") {
            // One or more `super::`.
            let mut up = at.clone();
            let mut r = rest;
            while let Some(next) = r.strip_prefix("super::") {
                up.pop();
                r = next;
            }
            Some((up, r))
        } else {
            rest.strip_prefix("self::").map(|r| (at.clone(), r))
        };
        let Some((mut path, r)) = base else {
            i += 1;
            continue;
        };
        // Follow `a::b::` segments (and the first level of a `{…}` group) while they name
        // modules.
        let mut best = path.clone();
        let mut r = r;
        loop {
            let seg: String = r
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if seg.is_empty() {
                if let Some(group) = r.strip_prefix('{') {
                    let inner: String = group.chars().take_while(|c| *c != '}').collect();
                    for item in inner.split(',') {
                        let name: String = item
                            .trim()
                            .chars()
                            .take_while(|c| c.is_alphanumeric() || *c == '_')
                            .collect();
                        let mut p = path.clone();
                        p.push(name);
                        if known.contains(&p) {
                            out.insert(p);
                        }
                    }
                }
                break;
            }
            path.push(seg.clone());
            if known.contains(&path) {
                best = path.clone();
            } else {
                break;
            }
            r = &r[seg.len()..];
            match r.strip_prefix("::") {
                Some(next) => r = next,
                None => break,
            }
        }
        out.insert(best);
        i += 1;
    }
    out
}

/// Cycles between sibling modules of the crate whose sources are in `src`: each as the
/// modules on it, in order.
pub fn crate_cycles(src: &Path) -> Result<Vec<Vec<String>>> {
    let mods = modules(src)?;
    let known: BTreeSet<ModPath> = mods.keys().cloned().collect();
    // Edges between siblings, per parent.
    let mut edges: BTreeMap<ModPath, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for (at, code) in &mods {
        for to in references(at, code, &known) {
            let common = at.iter().zip(&to).take_while(|(a, b)| a == b).count();
            if common == at.len() || common == to.len() {
                continue; // one holds the other
            }
            edges
                .entry(at[..common].to_vec())
                .or_default()
                .entry(at[common].clone())
                .or_default()
                .insert(to[common].clone());
        }
    }
    let mut cycles = Vec::new();
    for (parent, graph) in &edges {
        for c in strongly_connected(graph) {
            let prefix = if parent.is_empty() {
                String::new()
            } else {
                format!("{}::", parent.join("::"))
            };
            cycles.push(c.into_iter().map(|m| format!("{prefix}{m}")).collect());
        }
    }
    Ok(cycles)
}

/// The strongly connected components of more than one node (Tarjan's algorithm).
fn strongly_connected(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct State<'a> {
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        s.index.insert(v, s.next);
        s.low.insert(v, s.next);
        s.next += 1;
        s.stack.push(v);
        s.on.insert(v);
        let graph = s.graph;
        for w in graph.get(v).into_iter().flatten() {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low[v];
                s.low.insert(v, lv.min(lw));
            } else if s.on.contains(w) {
                let iw = s.index[w];
                let lv = s.low[v];
                s.low.insert(v, lv.min(iw));
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on.remove(w);
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                s.out.push(comp);
            }
        }
    }
    let mut s = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// The backend crates only `peerwall-backend-select` may name above the backend layer
/// (docs/layout.md).
pub const BACKEND_CRATES: [&str; 2] = ["peerwall_backend_nftables", "peerwall_backend_bpf"];

/// Lines of the binary crate's `src` that name a backend crate ([`BACKEND_CRATES`]) outside
/// the module `allowed` (`src/<allowed>.rs` and `src/<allowed>/`: the lab, which writes Liqo's own tables and reads its pins), as
/// `path:line: text`; comments aside.
pub fn backend_crates_named(src: &Path, allowed: &str) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir)?.flatten() {
            let p = e.path();
            if p.is_dir() {
                if p != src.join(allowed) {
                    stack.push(p);
                }
                continue;
            }
            if p.extension().is_none_or(|x| x != "rs") || p == src.join(format!("{allowed}.rs")) {
                continue;
            }
            let code = std::fs::read_to_string(&p)?;
            for (i, line) in code.lines().enumerate() {
                let t = line.trim_start();
                if !t.starts_with("//") && BACKEND_CRATES.iter().any(|c| t.contains(c)) {
                    out.push(format!("{}:{}: {}", p.display(), i + 1, t));
                }
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Every crate's `src` under `root` (a `Cargo.toml` beside it), fuzz targets left out.
pub fn crate_sources(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
        if dir.join("Cargo.toml").exists() && dir.join("src").is_dir() {
            out.push(dir.join("src"));
        }
        for e in rd.flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().to_string();
            if p.is_dir() && !name.starts_with('.') && name != "target" && name != "fuzz" {
                stack.push(p);
            }
        }
    }
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(edges: &[(&str, &str)]) -> BTreeMap<String, BTreeSet<String>> {
        let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (a, b) in edges {
            g.entry(a.to_string()).or_default().insert(b.to_string());
        }
        g
    }

    #[test]
    fn a_backend_crate_named_outside_the_lab_is_reported() {
        let dir = std::env::temp_dir().join(format!("xtask-layer-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("lab")).expect("mkdir");
        std::fs::create_dir_all(dir.join("cli")).expect("mkdir");
        for lab in ["lab.rs", "lab/liqo.rs"] {
            std::fs::write(dir.join(lab), "use peerwall_backend_bpf::loader;\n").expect("w");
        }
        std::fs::write(
            dir.join("cli/render.rs"),
            "// peerwall_backend_bpf in a comment\nuse peerwall_backend_select::X;\nfn f() { peerwall_backend_nftables::g() }\n",
        )
        .expect("w");
        let found = backend_crates_named(&dir, "lab").expect("reads");
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].ends_with("cli/render.rs:3: fn f() { peerwall_backend_nftables::g() }"));
    }

    #[test]
    fn cycles_are_found_and_chains_are_not() {
        assert!(strongly_connected(&graph(&[("a", "b"), ("b", "c")])).is_empty());
        assert_eq!(
            strongly_connected(&graph(&[("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")])),
            vec![vec!["a".to_string(), "b".into(), "c".into()]]
        );
    }

    #[test]
    fn references_resolve_to_the_deepest_module() {
        let known: BTreeSet<ModPath> = [vec![], vec!["a".into()], vec!["a".into(), "b".into()]]
            .into_iter()
            .collect();
        let at: ModPath = vec!["c".into()];
        let r = references(
            &at,
            "use crate::a::b::Item; fn f() { crate::a::g(); }",
            &known,
        );
        assert!(r.contains(&vec!["a".to_string(), "b".into()]));
        assert!(r.contains(&vec!["a".to_string()]));
        let r = references(
            &vec!["a".into(), "b".into()],
            "use super::super::c::X;",
            &known,
        );
        assert!(r.contains(&vec![]));
    }

    /// A sibling cycle written to disk is reported; parent and child using each other is not.
    #[test]
    fn a_crate_with_a_sibling_cycle_is_reported() {
        let dir = std::env::temp_dir().join(format!("xtask-cycles-{}", std::process::id()));
        let src = dir.join("src");
        std::fs::create_dir_all(src.join("p")).unwrap();
        std::fs::write(src.join("lib.rs"), "mod p; mod q; use p::x;").unwrap();
        std::fs::write(
            src.join("p/mod.rs"),
            "mod r; use super::q::Y; pub fn x() {}",
        )
        .unwrap();
        std::fs::write(src.join("p/r.rs"), "use super::x;").unwrap();
        std::fs::write(src.join("q.rs"), "pub struct Y; use crate::p::r::Z;").unwrap();
        let c = crate_cycles(&src).unwrap();
        assert_eq!(c, vec![vec!["p".to_string(), "q".into()]]);
        std::fs::write(src.join("q.rs"), "pub struct Y;").unwrap();
        assert!(crate_cycles(&src).unwrap().is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
