//! `cargo xtask sizes` (and a step of `cargo xtask test`): no source file of the product over
//! [`MAX_FILE_LINES`] lines and no function over [`MAX_FN_LINES`] without a stated reason.
//!
//! A reason is a comment line `// size: why` among the first lines of a file (for the file), or
//! among the comment and attribute lines right above a function (for it). Test code (`tests`
//! directories and files, what follows `#[cfg(test)]`), benchmarks and fuzz targets are left
//! out: they are sequences of cases and measurements.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// Lines a file may have without a stated reason.
pub const MAX_FILE_LINES: usize = 600;
/// Lines a function may have without a stated reason.
pub const MAX_FN_LINES: usize = 120;
/// How far into a file its reason may stand.
const FILE_REASON_WITHIN: usize = 40;
/// The marker of a stated reason.
const MARKER: &str = "// size:";

/// One function: its name, first line (1-based) and length in lines.
#[derive(Debug, PartialEq, Eq)]
struct Function {
    name: String,
    line: usize,
    len: usize,
    reasoned: bool,
}

/// The name of the function a line declares, if it declares one.
fn declares(line: &str) -> Option<String> {
    let mut rest = line.trim_start();
    for prefix in [
        "pub(crate) ",
        "pub(super) ",
        "pub ",
        "const ",
        "async ",
        "unsafe ",
        "extern \"C\" ",
    ] {
        rest = rest.strip_prefix(prefix).unwrap_or(rest);
    }
    let rest = rest.strip_prefix("fn ")?;
    let name: String = rest
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    (!name.is_empty()).then_some(name)
}

/// Whether the comment and attribute lines right above line `i` state a reason.
fn reason_above(lines: &[&str], i: usize) -> bool {
    lines[..i]
        .iter()
        .rev()
        .take_while(|l| {
            let t = l.trim_start();
            t.starts_with("//") || t.starts_with("#[")
        })
        .any(|l| l.trim_start().starts_with(MARKER))
}

/// The functions of `code` (test code already cut), with their lengths: from the declaration
/// to its closing brace, counted by brace depth outside strings and comments well enough for
/// this code base.
fn functions(code: &str) -> Vec<Function> {
    let lines: Vec<&str> = code.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let Some(name) = declares(lines[i]) else {
            i += 1;
            continue;
        };
        let (mut depth, mut opened, mut j) = (0i64, false, i);
        while j < lines.len() {
            let l = lines[j].split("//").next().unwrap_or_default();
            for c in l.chars() {
                match c {
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            if opened && depth <= 0 {
                break;
            }
            if !opened && l.trim_end().ends_with(';') {
                break;
            }
            j += 1;
        }
        if opened {
            out.push(Function {
                name,
                line: i + 1,
                len: j.min(lines.len() - 1) - i + 1,
                reasoned: reason_above(&lines, i),
            });
            // Nested functions are counted within their parent.
            i = j + 1;
        } else {
            i += 1;
        }
    }
    out
}

/// What is over a limit without a reason in the file at `path`, as messages.
fn check_file(root: &Path, path: &Path) -> Result<Vec<String>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let shown = path
        .strip_prefix(root)
        .unwrap_or(path)
        .display()
        .to_string();
    let code = match text.find("#[cfg(test)]") {
        Some(i) => &text[..i],
        None => &text[..],
    };
    let mut out = Vec::new();
    let total = code.lines().count();
    let file_reason = text
        .lines()
        .take(FILE_REASON_WITHIN)
        .any(|l| l.trim_start().starts_with(MARKER) || l.trim_start().starts_with("//! size:"));
    if total > MAX_FILE_LINES && !file_reason {
        out.push(format!(
            "{shown}: {total} lines (over {MAX_FILE_LINES}: split it by concern, or state why not with `{MARKER} …` at its top)"
        ));
    }
    for f in functions(code) {
        if f.len > MAX_FN_LINES && !f.reasoned {
            out.push(format!(
                "{shown}:{}: fn {} has {} lines (over {MAX_FN_LINES}: cut it into decisions and effects, or state why not with `{MARKER} …` above it)",
                f.line, f.name, f.len
            ));
        }
    }
    Ok(out)
}

/// The product's source files under `root`: every `.rs` of a crate's `src` and of `xtask`,
/// without tests, benchmarks and fuzz targets.
fn product_sources(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().to_string();
            if p.is_dir() {
                if !name.starts_with('.')
                    && !matches!(name.as_str(), "target" | "tests" | "benches" | "fuzz")
                {
                    stack.push(p);
                }
            } else if name.ends_with(".rs") && name != "tests.rs" && name != "testing.rs" {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Check every product source file under `root`.
pub fn check(root: &Path) -> Result<()> {
    let mut problems = Vec::new();
    let files = product_sources(root);
    for f in &files {
        problems.extend(check_file(root, f)?);
    }
    if !problems.is_empty() {
        bail!("sizes:\n  {}", problems.join("\n  "));
    }
    println!(
        "sizes: {} files within {MAX_FILE_LINES} lines and functions within {MAX_FN_LINES}, or with a stated reason",
        files.len()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn functions_are_measured_from_declaration_to_closing_brace() {
        let code = "fn a() {\n    let x = 1;\n}\n\n/// doc\npub(crate) async fn b(\n    y: u8,\n) -> u8 {\n    if y > 0 { 1 } else { 0 }\n}\nfn c();\n";
        let f = functions(code);
        assert_eq!(
            f.iter()
                .map(|f| (f.name.as_str(), f.line, f.len))
                .collect::<Vec<_>>(),
            vec![("a", 1, 3), ("b", 6, 5)]
        );
    }

    /// A long function is reported; stated, it is not.
    #[test]
    fn a_long_function_needs_a_reason() {
        let dir = std::env::temp_dir().join(format!("xtask-sizes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let body = "    x();\n".repeat(MAX_FN_LINES + 5);
        let file = dir.join("long.rs");
        std::fs::write(&file, format!("fn long() {{\n{body}}}\n")).unwrap();
        assert_eq!(check_file(&dir, &file).unwrap().len(), 1);
        std::fs::write(
            &file,
            format!("// size: one step per line of the protocol\nfn long() {{\n{body}}}\n"),
        )
        .unwrap();
        assert!(check_file(&dir, &file).unwrap().is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
