//! `cargo xtask docs`: the documentation as a book (mdbook, installed from crates into the
//! cache), after checking that every relative link of the README and of `docs/` points at a
//! file that exists (and, inside a page, at a heading it has), that every repository path they
//! name in code exists, and that every page is in the book's summary.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

/// mdbook release the book is built with.
const MDBOOK_VERSION: &str = "0.5.4";

/// The anchor GitHub and mdbook give a heading: lower case, spaces to dashes, punctuation
/// other than dashes and underscores dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a page's headings (outside code blocks).
fn anchors(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut code = false;
    for l in text.lines() {
        if l.starts_with("```") {
            code = !code;
        }
        if !code && l.starts_with('#') {
            out.insert(anchor(l.trim_start_matches('#')));
        }
    }
    out
}

/// The targets of a page's Markdown links (outside code blocks and inline code).
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut code = false;
    for l in text.lines() {
        if l.starts_with("```") {
            code = !code;
            continue;
        }
        if code {
            continue;
        }
        // Inline code spans may hold `](` that is no link.
        let prose: String = l.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        let mut rest = prose.as_str();
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].to_string());
            rest = &after[end..];
        }
    }
    out
}

/// Broken relative links of `page` (a file under `root`), as `page: target (why)`.
fn broken(root: &Path, page: &Path) -> Result<Vec<String>> {
    let text =
        std::fs::read_to_string(page).with_context(|| format!("reading {}", page.display()))?;
    let dir = page.parent().unwrap_or(root);
    let mut out = Vec::new();
    for target in links(&text) {
        if target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        let (file, frag) = match target.split_once('#') {
            Some((f, a)) => (f, Some(a)),
            None => (target.as_str(), None),
        };
        let path = if file.is_empty() {
            page.to_path_buf()
        } else {
            dir.join(file)
        };
        let shown = page
            .strip_prefix(root)
            .unwrap_or(page)
            .display()
            .to_string();
        if !path.exists() {
            out.push(format!("{shown}: {target} (no such file)"));
            continue;
        }
        if let Some(a) = frag {
            if path.extension().and_then(|e| e.to_str()) == Some("md") {
                let t = std::fs::read_to_string(&path).unwrap_or_default();
                if !anchors(&t).contains(a) {
                    out.push(format!("{shown}: {target} (no such heading)"));
                }
            }
        }
    }
    Ok(out)
}

/// Where repository paths begin: a word of a page that starts with one of these names a file
/// or directory of the repository.
const REPO_DIRS: [&str; 9] = [
    "agent/",
    "ebpf/",
    "common/",
    "xtask/",
    "tests/",
    "deploy/",
    "examples/",
    "docs/",
    ".ci/",
];

/// The repository path a word of a page names, if it names one: starting with one of
/// [`REPO_DIRS`], without a trailing `:line`, punctuation or `/`, and with no placeholder
/// (`<peer>`, `*`, `{a,b}`, `$VAR`, `…`) that makes it a pattern rather than a path.
fn repo_path(word: &str) -> Option<&str> {
    let w = word.trim_start_matches(['(', '[', '"', '\'', '`']);
    if !REPO_DIRS.iter().any(|d| w.starts_with(d)) {
        return None;
    }
    let w = w.trim_end_matches(['.', ',', ';', ')', ']', '"', '\'', '`', ':']);
    let w = match w.rsplit_once(':') {
        Some((p, line)) if line.chars().all(|c| c.is_ascii_digit()) => p,
        _ => w,
    };
    // Placeholders: `<peer>`, `*`, `$VAR`, `…`, `a|b` and an opening brace (written as an
    // escape: the size check counts braces).
    const PLACEHOLDERS: &str = "<*$…|\x7b";
    if w.chars().any(|c| PLACEHOLDERS.contains(c)) {
        return None;
    }
    Some(w.trim_end_matches('/'))
}

/// What a clean clone of the repository holds: its tracked files and their directories, and
/// the places a `.gitignore` names literally because a tool writes them
/// (`tests/fuzz/artifacts`). A path that exists only in this working tree (an untracked file)
/// is not in it: CI runs on a clean clone. Outside a git checkout (a source archive), every
/// file present counts as tracked.
pub struct CleanClone {
    /// `None` outside a git checkout.
    tracked: Option<BTreeSet<String>>,
    root: PathBuf,
}

impl CleanClone {
    /// The clone `root` is the top of, from `git ls-files`.
    pub fn of(root: &Path) -> Result<Self> {
        let tracked = if root.join(".git").exists() {
            let out = Command::new("git")
                .arg("-C")
                .arg(root)
                .args(["ls-files", "-z"])
                .output()
                .context("running git ls-files")?;
            if !out.status.success() {
                bail!(
                    "git ls-files in {}: {}",
                    root.display(),
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
            let mut tracked = BTreeSet::new();
            for f in String::from_utf8_lossy(&out.stdout).split('\0') {
                let mut p = f;
                while !p.is_empty() && tracked.insert(p.to_string()) {
                    p = p.rsplit_once('/').map(|(d, _)| d).unwrap_or("");
                }
            }
            Some(tracked)
        } else {
            None
        };
        Ok(Self {
            tracked,
            root: root.to_path_buf(),
        })
    }

    /// Whether `path` is tracked, or in a place a `.gitignore` of one of its directories names
    /// literally (written by a tool, named by the docs as where output goes).
    fn holds(&self, path: &str) -> bool {
        let tracked = match &self.tracked {
            Some(t) => t.contains(path),
            None => self.root.join(path).exists(),
        };
        tracked || self.ignored(path)
    }

    fn ignored(&self, path: &str) -> bool {
        let mut dir = "";
        loop {
            let rest = path
                .strip_prefix(dir)
                .unwrap_or(path)
                .trim_start_matches('/');
            let ignore =
                std::fs::read_to_string(self.root.join(dir).join(".gitignore")).unwrap_or_default();
            for line in ignore.lines().map(str::trim) {
                let name = line.trim_start_matches('/').trim_end_matches('/');
                if !name.is_empty()
                    && !line.starts_with('#')
                    && (rest == name || rest.starts_with(&format!("{name}/")))
                {
                    return true;
                }
            }
            match rest.split_once('/') {
                Some((next, _)) => {
                    dir = &path[..dir.len() + usize::from(!dir.is_empty()) + next.len()]
                }
                None => return false,
            }
        }
    }
}

/// Repository paths a page names (in code spans and code blocks) that a clean clone does not
/// hold, as `page: path (no such file)`.
fn dead_paths(root: &Path, page: &Path, clone: &CleanClone) -> Result<Vec<String>> {
    let text =
        std::fs::read_to_string(page).with_context(|| format!("reading {}", page.display()))?;
    let shown = page
        .strip_prefix(root)
        .unwrap_or(page)
        .display()
        .to_string();
    let mut out = BTreeSet::new();
    let mut code = false;
    for l in text.lines() {
        if l.starts_with("```") {
            code = !code;
            continue;
        }
        // In a code block every word; in prose, the words of code spans.
        let words: Vec<&str> = if code {
            l.split_whitespace().collect()
        } else {
            l.split('`')
                .skip(1)
                .step_by(2)
                .flat_map(str::split_whitespace)
                .collect()
        };
        // `kubectl … deploy/<name>` names a Deployment, not the directory.
        let kubectl = l.contains("kubectl");
        for w in words {
            if kubectl && w.starts_with("deploy/") {
                continue;
            }
            if let Some(p) = repo_path(w) {
                if !clone.holds(p) {
                    out.insert(format!("{shown}: {p} (no such file)"));
                }
            }
        }
    }
    Ok(out.into_iter().collect())
}

/// Check the README's and the book's links and the repository paths they name, and that
/// `SUMMARY.md` lists every page.
pub fn check(root: &Path) -> Result<()> {
    let docs = root.join("docs");
    let mut pages = vec![root.join("README.md")];
    let mut in_docs: Vec<PathBuf> = std::fs::read_dir(&docs)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().and_then(|e| e.to_str()) == Some("md"))
        .collect();
    in_docs.sort();
    pages.extend(in_docs.iter().cloned());
    let clone = CleanClone::of(root)?;
    let mut problems = Vec::new();
    for p in &pages {
        problems.extend(broken(root, p)?);
        problems.extend(dead_paths(root, p, &clone)?);
    }
    let summary = std::fs::read_to_string(docs.join("SUMMARY.md")).context("docs/SUMMARY.md")?;
    let listed: BTreeSet<String> = links(&summary).into_iter().collect();
    for p in &in_docs {
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        if name != "SUMMARY.md" && !listed.contains(&name) {
            problems.push(format!("docs/{name}: not in docs/SUMMARY.md"));
        }
    }
    if !problems.is_empty() {
        bail!("documentation links:\n  {}", problems.join("\n  "));
    }
    println!("documentation links: {} pages checked", pages.len());
    Ok(())
}

/// mdbook from the cache, installed there once (through `step`: its output to the setup log).
fn ensure_mdbook(cache: &Path, step: Step) -> Result<PathBuf> {
    let prefix = cache.join(format!("mdbook-{MDBOOK_VERSION}"));
    let bin = prefix.join("bin").join("mdbook");
    if !bin.exists() {
        let mut c = Command::new("cargo");
        c.args([
            "install",
            "mdbook",
            "--version",
            MDBOOK_VERSION,
            "--locked",
            "--no-default-features",
            "--features",
            "search",
            "--root",
        ])
        .arg(&prefix);
        step(
            &format!("installing mdbook {MDBOOK_VERSION} (a few minutes, once)"),
            c,
        )?;
    }
    Ok(bin)
}

/// How an install step runs (the setup log, one line on the terminal).
pub type Step = fn(&str, Command) -> Result<()>;

/// Check the links, then build the book into `out`.
pub fn build(root: &Path, cache: &Path, out: &Path, step: Step) -> Result<()> {
    check(root)?;
    let mdbook = ensure_mdbook(cache, step)?;
    let status = Command::new(&mdbook)
        .arg("build")
        .arg(root.join("docs"))
        .arg("--dest-dir")
        .arg(out)
        .status()
        .with_context(|| format!("running {}", mdbook.display()))?;
    if !status.success() {
        bail!("mdbook build failed: {status}");
    }
    println!("the book: {}", out.join("index.html").display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anchors_and_links_are_read_as_mdbook_and_github_make_them() {
        assert_eq!(
            anchor(" The eBPF backend (`--backend bpf`)"),
            "the-ebpf-backend---backend-bpf"
        );
        let text = "# A b\n```\n](x.md)\n```\nsee [x](y.md#a-b) and `](z)`\n";
        assert_eq!(links(text), vec!["y.md#a-b".to_string()]);
        assert!(anchors(text).contains("a-b"));
    }

    /// A path a page names in code that a clean clone does not hold is reported (a planted
    /// one, and a file that exists here but is not tracked); a place git ignores is not, nor
    /// are patterns, line suffixes and prose.
    #[test]
    fn dead_paths_are_found() {
        let dir = std::env::temp_dir().join(format!("xtask-paths-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("agent/src")).unwrap();
        std::fs::write(dir.join("agent/src/lib.rs"), "").unwrap();
        std::fs::write(dir.join("agent/src/untracked.rs"), "").unwrap();
        std::fs::write(dir.join(".gitignore"), "/tests/out\n").unwrap();
        let git = |args: &[&str]| {
            let s = Command::new("git")
                .arg("-C")
                .arg(&dir)
                .args(args)
                .status()
                .unwrap();
            assert!(s.success(), "git {args:?}");
        };
        git(&["init", "-q"]);
        git(&["add", "agent/src/lib.rs", ".gitignore"]);
        std::fs::write(
            dir.join("a.md"),
            "see `agent/src/lib.rs:12`, `agent/src/gone.rs` and tests/kube.rs\n\
             `agent/src/<crate>/x.rs`, `tests/*.rs`, `kubectl logs deploy/peerwall-webhook`\n\
             `agent/src/untracked.rs`, `tests/out/`, `agent/`\n\
             ```sh\ncat agent/src/lib.rs tests/missing.rs\n```\n",
        )
        .unwrap();
        let clone = CleanClone::of(&dir).unwrap();
        let found = dead_paths(&dir, &dir.join("a.md"), &clone).unwrap();
        assert_eq!(
            found,
            vec![
                "a.md: agent/src/gone.rs (no such file)".to_string(),
                "a.md: agent/src/untracked.rs (no such file)".to_string(),
                "a.md: tests/missing.rs (no such file)".to_string()
            ]
        );
        // A source archive: what is there is what the archive holds.
        std::fs::remove_dir_all(dir.join(".git")).unwrap();
        let archive = CleanClone::of(&dir).unwrap();
        assert_eq!(
            dead_paths(&dir, &dir.join("a.md"), &archive).unwrap().len(),
            2
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A page linking to a missing file or heading is reported; fixed, it is not.
    #[test]
    fn broken_links_are_found() {
        let dir = std::env::temp_dir().join(format!("xtask-docs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("a.md"), "# Here\n[b](b.md) [h](#there)\n").unwrap();
        let found = broken(&dir, &dir.join("a.md")).unwrap();
        assert_eq!(found.len(), 2, "{found:?}");
        std::fs::write(dir.join("b.md"), "# B\n").unwrap();
        std::fs::write(dir.join("a.md"), "# Here\n[b](b.md) [h](#here)\n").unwrap();
        assert!(broken(&dir, &dir.join("a.md")).unwrap().is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
