//! docs/try.md, run as written: its shell block between `<!-- try:start -->` and
//! `<!-- try:end -->`, in one bash session from the repository's root, against the same
//! kube-apiserver build `cargo xtask kube-up` starts (its build step is the only part replaced:
//! `xtask/kube/start-apiserver.sh` is what it runs then). Its directory and ports are this
//! test's own, in the commands and in the example files they apply. What the page says to look
//! for is checked step by step.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::support::free_port;
use peerwall_testkit::{peerwall, repo};

/// Stops what the page started, whatever happens to the test.
struct Started(PathBuf);

impl Drop for Started {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg("-c")
            .arg(format!(
                "kill $(cat {0}/*.pid) $(cat {0}/jobs 2>/dev/null) 2>/dev/null",
                self.0.display()
            ))
            .status();
    }
}

/// The page's block.
fn page_block() -> String {
    let page = std::fs::read_to_string(repo("docs/try.md")).unwrap();
    let start = page
        .find("<!-- try:start -->")
        .expect("the page's start marker");
    let end = page
        .find("<!-- try:end -->")
        .expect("the page's end marker");
    page[start..end]
        .lines()
        .skip_while(|l| !l.starts_with("```sh"))
        .skip(1)
        .take_while(|l| !l.starts_with("```"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Each step's output (`# N.` comments start them) and each command's exit status, in order.
fn steps(output: &str) -> BTreeMap<u32, (String, Vec<i32>)> {
    let mut out: BTreeMap<u32, (String, Vec<i32>)> = BTreeMap::new();
    let mut step = 0;
    for line in output.lines() {
        if let Some(n) = line.strip_prefix("::step ") {
            step = n.trim().parse().unwrap();
        } else if let Some(rc) = line.strip_prefix("::rc ") {
            out.entry(step)
                .or_default()
                .1
                .push(rc.trim().parse().unwrap());
        } else {
            let e = out.entry(step).or_default();
            e.0.push_str(line);
            e.0.push('\n');
        }
    }
    out
}

/// `text` with the page's directory, ports and example paths replaced by this run's.
fn ours(text: &str, dir: &Path, ports: &[(u16, u16)]) -> String {
    let mut t = text.replace("/tmp/peerwall-try", dir.to_str().unwrap());
    for (page, mine) in ports {
        t = t.replace(&page.to_string(), &mine.to_string());
    }
    t.replace("examples/try/", &format!("{}/examples/", dir.display()))
}

#[test]
fn the_try_page_works_as_written() {
    let dir = std::env::temp_dir().join(format!("peerwall-try-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("examples")).unwrap();
    let _stop = Started(dir.clone());
    // The page's API port: etcd takes it + 10000 and + 10001 (`cargo xtask kube-up`), so
    // all three free and below the kernel's ephemeral range.
    let api_port = loop {
        let p = 20000 + rand::random::<u16>() % 2700;
        let free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
        if free(p) && free(p + 10000) && free(p + 10001) {
            break p;
        }
    };
    let ports = [
        (16443, api_port),
        (16444, free_port()),
        (16445, free_port()),
    ];
    for e in std::fs::read_dir(repo("examples/try")).unwrap() {
        let p = e.unwrap().path();
        let text = std::fs::read_to_string(&p).unwrap();
        std::fs::write(
            dir.join("examples").join(p.file_name().unwrap()),
            ours(&text, &dir, &ports),
        )
        .unwrap();
    }
    // The script: each command's status after it, each step marked, the background jobs'
    // pids kept for the guard above.
    let mut script = String::from("exec 2>&1\n");
    for line in page_block().lines() {
        let l = line.trim();
        if let Some(n) = l.strip_prefix("# ").and_then(|r| r.split_once('.')) {
            if let Ok(n) = n.0.parse::<u32>() {
                script.push_str(&format!("echo '::step {n}'\n"));
            }
            continue;
        }
        if l.is_empty() || l.starts_with('#') {
            continue;
        }
        let l = if l.starts_with("cargo xtask kube-up ") {
            // What kube-up runs once the components are built.
            l.replacen(
                "cargo xtask kube-up",
                &format!(
                    "bash xtask/kube/start-apiserver.sh {}",
                    peerwall_testkit::kube::kube_bin_dir().display()
                ),
                1,
            )
        } else {
            l.to_string()
        };
        let l = ours(&l, &dir, &ports);
        if l.ends_with('&') {
            script.push_str(&format!("{l}\necho $! >> {}/jobs\n", dir.display()));
        } else {
            script.push_str(&format!("{l}\necho \"::rc $?\"\n"));
        }
    }
    let bin = |p: PathBuf| p.parent().unwrap().to_path_buf();
    let path = std::env::join_paths(
        [bin(peerwall()), peerwall_testkit::kube::kube_bin_dir()]
            .into_iter()
            .chain(std::env::split_paths(&std::env::var_os("PATH").unwrap())),
    )
    .unwrap();
    let o = Command::new("bash")
        .arg("-c")
        .arg(&script)
        .current_dir(repo(""))
        .env("PATH", path)
        .env_remove("KUBECONFIG")
        .output()
        .unwrap();
    let all = String::from_utf8_lossy(&o.stdout).into_owned();
    let s = steps(&all);
    let step = |n: u32| s.get(&n).cloned().unwrap_or_default();
    // 1-4: every command succeeds.
    for n in 1..=4 {
        let (text, rcs) = step(n);
        assert!(
            rcs.iter().all(|rc| *rc == 0),
            "step {n}: {rcs:?}\n{text}\n\n{all}"
        );
    }
    // 5: the two configurations of cluster1, and the companion beside the user's policy.
    let (text, rcs) = step(5);
    assert!(rcs.iter().all(|rc| *rc == 0), "step 5: {rcs:?}\n{text}");
    for name in [
        "peerwall-gateway",
        "peerwall-networkpolicy",
        "web-from-api",
        "peerwall-web-from-api",
    ] {
        assert!(
            text.lines().any(|l| l.starts_with(name)),
            "step 5: {name}\n{text}"
        );
    }
    // 6: refused, by its field path and value.
    let (text, rcs) = step(6);
    assert_eq!(rcs, vec![1], "step 6\n{text}");
    assert!(
        text.contains("denied the request")
            && text.contains("spec.table.chains[0].rules.filterRules[0].match[0].ip.value")
            && text.contains("10.20.1.300"),
        "step 6\n{text}"
    );
    // 7: nothing enforces here, and status says so with its exit status.
    let (text, rcs) = step(7);
    assert_eq!(rcs, vec![3], "step 7\n{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("agents") && l.contains("ERROR")),
        "step 7\n{text}"
    );
    assert!(text.contains("cluster1"), "step 7\n{text}");
    // 8: accepted on 8080 by the user's policy, dropped on 22.
    let (text, rcs) = step(8);
    assert_eq!(rcs, vec![0, 0, 0], "step 8\n{text}");
    let verdicts: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("accept") || l.starts_with("drop"))
        .collect();
    assert_eq!(verdicts.len(), 2, "step 8\n{text}");
    assert!(verdicts[0].starts_with("accept"), "step 8\n{text}");
    assert!(
        text.contains("allowed by shop/web-from-api, rule 0"),
        "step 8\n{text}"
    );
    assert!(
        verdicts[1].starts_with("drop") && verdicts[1].contains("shop/web-from-api"),
        "step 8\n{text}"
    );
    // 9: stopped.
    let (text, rcs) = step(9);
    assert_eq!(rcs, vec![0], "step 9\n{text}");
}
