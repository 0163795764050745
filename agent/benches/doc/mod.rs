//! docs/bench.md holds one section per benchmark, between `<!-- NAME:start -->` and
//! `<!-- NAME:end -->`; each benchmark rewrites only its own.

use std::path::PathBuf;

/// `docs/` of the repository.
pub fn docs_dir() -> PathBuf {
    peerwall_testkit::repo("docs")
}

/// Replace (or append) section `name` of docs/bench.md with `content`.
pub fn write_section(name: &str, content: &str) -> std::io::Result<PathBuf> {
    let path = docs_dir().join("bench.md");
    let old = std::fs::read_to_string(&path).unwrap_or_else(|_| "# Benchmarks\n".to_string());
    let (start, end) = (
        format!("<!-- {name}:start -->"),
        format!("<!-- {name}:end -->"),
    );
    let block = format!("{start}\n{content}\n{end}");
    let new = match (old.find(&start), old.find(&end)) {
        (Some(a), Some(b)) if b > a => format!("{}{}{}", &old[..a], block, &old[b + end.len()..]),
        _ => format!("{}\n{}\n", old.trim_end(), block),
    };
    std::fs::write(&path, new)?;
    Ok(path)
}
