//! Project orchestration: `cargo xtask <task>`.
//!
//! - `setup`: install what building and testing need on a Debian 12 machine (apt packages,
//!   rustup components, bpf-linker, the Kubernetes binaries). Idempotent; run as root. `lab` and
//!   `test` run it themselves, so a fresh machine needs no separate step.
//! - `test`: setup, formatting and lint checks, then every test (unit, then integration tests
//!   that build their own network namespaces; run as root).
//! - `crd`: regenerate `deploy/common/crd.yaml` from the Rust types.
//! - `kube-build` / `kube-up`: the Kubernetes components (built from Debian's source package into
//!   a version-keyed cache); a kube-apiserver started on loopback, for the tests and by hand.
//!   `xtask/kube/start-node.sh` runs a whole one-node cluster (kubelet, containerd) in a netns.
//! - `image`: OCI images of peerwall, the pause sandbox and the lab's gateway (`xtask/src/image.rs`).

// size: the xtask commands and their install steps; checks live in cycles.rs, sizes.rs and docs.rs.

mod cycles;
mod docs;
mod image;
mod previous;
mod profile;
mod sizes;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

/// bpf-linker release that works with the installed nightly (built against its LLVM, see
/// [`ensure_bpf_linker`]).
const BPF_LINKER_VERSION: &str = "0.13.0";

/// Debian packages the tests and the gateway lab use.
const APT_PACKAGES: &[&str] = &[
    "nftables",
    "iproute2",
    "conntrack",
    "iputils-ping",
    "socat",
    "procps",
    "util-linux",
    "curl",
    "bpftool",
    "wireguard-go",
    "wireguard-tools",
    "openssl",
    "etcd-server",
    "iptables",
    "ipset",
    // The real node of the Kubernetes tests and `cargo xtask image`.
    "containerd",
    "runc",
    "containernetworking-plugins",
    "mmdebstrap",
    "umoci",
    "gcc",
    "libc6-dev",
];

/// kube-apiserver version the Kubernetes tests run against (built from Debian's source).
const KUBE_VERSION: &str = "1.20.2";

/// cargo-fuzz release the fuzz targets run with (installed into the cache, keyed by version).
const CARGO_FUZZ_VERSION: &str = "0.13.2";

/// The fuzz targets (`tests/fuzz/fuzz_targets`) and CI's bounded run of each, in seconds.
const FUZZ_TARGETS: [&str; 2] = ["policy", "datapath"];
const FUZZ_CI_SECS: u64 = 30;

fn root() -> PathBuf {
    // xtask lives in <root>/xtask.
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

/// One step of installing what the project needs: its output (apt's, cargo's, the build
/// scripts') goes to `<cache>/setup.log`, the terminal gets one line. On failure the end of
/// the log is shown.
fn step(what: &str, c: Command) -> Result<()> {
    step_logged("setup.log", what, c)
}

/// [`step`] with its own log in the cache: the Kubernetes build's output (and the end shown
/// on failure) apart from the other steps'.
fn step_logged(log_name: &str, what: &str, mut c: Command) -> Result<()> {
    let log_path = cache_dir().join(log_name);
    std::fs::create_dir_all(cache_dir())?;
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("opening {}", log_path.display()))?;
    let started = std::time::Instant::now();
    let shown = format!("{c:?}");
    {
        use std::io::Write;
        let mut l = &log;
        let _ = writeln!(l, "==== {what}: {shown}");
    }
    let status = c
        .stdout(log.try_clone()?)
        .stderr(log)
        .status()
        .with_context(|| format!("running {shown}"))?;
    if !status.success() {
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(30).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!(
            "{what} failed ({status}); the end of {}:\n{}",
            log_path.display(),
            tail.join("\n")
        );
    }
    println!(
        "setup: {what}: done in {:.0} s (log: {})",
        started.elapsed().as_secs_f64(),
        log_path.display()
    );
    Ok(())
}

fn run(mut c: Command) -> Result<()> {
    let shown = format!("{c:?}");
    let status = c.status().with_context(|| format!("running {shown}"))?;
    if !status.success() {
        bail!("{shown} failed: {status}");
    }
    Ok(())
}

fn output(program: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program} {}", args.join(" ")))?;
    if !out.status.success() {
        bail!(
            "{program} {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Cache for tools built once, outside the repository, keyed by version.
/// Cargo's target directory (`CARGO_TARGET_DIR`, else `target/` at the root).
fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"))
}

fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("PEERWALL_CACHE") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache").join("peerwall")
}

/// Install bpf-linker linked against the nightly's own LLVM (Debian's LLVM is too old), into
/// a cache directory keyed by bpf-linker version, LLVM major and nightly commit date; then
/// link it into cargo's bin directory so every build finds it on PATH.
fn ensure_bpf_linker() -> Result<()> {
    let sysroot = PathBuf::from(output("rustc", &["+nightly", "--print", "sysroot"])?);
    let vv = output("rustc", &["+nightly", "-vV"])?;
    let field = |k: &str| {
        vv.lines()
            .find_map(|l| l.strip_prefix(k))
            .map(|v| v.trim().to_string())
            .unwrap_or_default()
    };
    let llvm_major = field("LLVM version:")
        .split('.')
        .next()
        .unwrap_or_default()
        .to_string();
    let date = field("commit-date:");
    if llvm_major.is_empty() {
        bail!("cannot read the LLVM version of the nightly toolchain");
    }
    let prefix = cache_dir().join(format!(
        "bpf-linker-{BPF_LINKER_VERSION}-llvm{llvm_major}-nightly-{date}"
    ));
    let bin = prefix.join("bin").join("bpf-linker");
    if !bin.exists() {
        let lib_dir = sysroot.join("lib");
        let lib = std::fs::read_dir(&lib_dir)
            .with_context(|| format!("reading {}", lib_dir.display()))?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .find(|n| n.starts_with("libLLVM.so."))
            .with_context(|| format!("no libLLVM.so.* in {}", lib_dir.display()))?;
        let plib = prefix.join("lib");
        std::fs::create_dir_all(&plib)?;
        for link in ["libLLVM.so".to_string(), lib.clone()] {
            let l = plib.join(link);
            let _ = std::fs::remove_file(&l);
            std::os::unix::fs::symlink(lib_dir.join(&lib), &l)
                .with_context(|| format!("linking {}", l.display()))?;
        }
        println!(
            "building bpf-linker {BPF_LINKER_VERSION} against LLVM {llvm_major} (about 90 s, once)"
        );
        let mut c = Command::new("cargo");
        c.args([
            "install",
            "bpf-linker",
            "--version",
            BPF_LINKER_VERSION,
            "--locked",
            "--no-default-features",
            "--features",
            &format!("llvm-{llvm_major}"),
            "--root",
        ])
        .arg(&prefix)
        .env("LLVM_PREFIX", &prefix);
        step(&format!("building bpf-linker {BPF_LINKER_VERSION}"), c)?;
    }
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .context("neither CARGO_HOME nor HOME is set")?;
    let link = home.join("bin").join("bpf-linker");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&bin, &link)
        .with_context(|| format!("linking {}", link.display()))?;
    println!("bpf-linker: {}", bin.display());
    Ok(())
}

/// What building and running the lab need: apt packages, rustup components, bpf-linker.
/// Idempotent and quick when everything is present.
fn setup_build() -> Result<()> {
    let missing: Vec<&str> = APT_PACKAGES
        .iter()
        .copied()
        .filter(|p| {
            !Command::new("dpkg-query")
                .args(["-W", "-f=${Status}", p])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
                .unwrap_or(false)
        })
        .collect();
    if !missing.is_empty() {
        println!("installing {}", missing.join(" "));
        let mut update = Command::new("apt-get");
        update.args(["update", "-qq"]);
        step("apt-get update", update)?;
        let mut install = Command::new("apt-get");
        install
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive");
        step(&format!("apt-get install {}", missing.join(" ")), install)?;
    }
    let mut comps = Command::new("rustup");
    comps.args(["component", "add", "rustfmt", "clippy"]);
    step("rustup components rustfmt, clippy", comps)?;
    let mut src = Command::new("rustup");
    // rust-src for build-std (the eBPF object), clippy for linting the eBPF crate.
    src.args([
        "component",
        "add",
        "rust-src",
        "clippy",
        "--toolchain",
        "nightly",
    ]);
    step("rustup components rust-src, clippy (nightly)", src)?;
    ensure_bpf_linker()
}

/// What building and the lab need, the Kubernetes binaries built from Debian's source, and the
/// release images (`cargo xtask test` builds its own from the tests' binary:
/// [`image::Binary::Tests`]).
fn setup() -> Result<()> {
    setup_tools()?;
    image::images(image::Binary::Release)?;
    println!("setup done");
    Ok(())
}

/// Everything [`setup`] installs but the images.
fn setup_tools() -> Result<()> {
    setup_build()?;
    kube_build()?;
    // The previous release before the images: it builds in the same target directory (in the
    // dev profile, whose dependencies the tests' build then reuses).
    previous::ensure(&root(), &cache_dir(), &target_dir(), step)?;
    Ok(())
}

fn test(extra: &[String]) -> Result<()> {
    check_cycles()?;
    sizes::check(&root())?;
    setup_tools()?;
    let mut fmt = cargo();
    fmt.args(["fmt", "--all", "--", "--check"]);
    run(fmt).context("code is not formatted: run `cargo fmt --all`")?;
    let mut clippy = cargo();
    clippy.args([
        "clippy",
        "--workspace",
        "--exclude",
        "peerwall-ebpf",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]);
    run(clippy)?;
    // The eBPF crate too, on its own target (nightly, build-std), as `build-ebpf` builds it.
    let mut ebpf = ebpf_cargo("clippy");
    ebpf.args(["--", "-D", "warnings"]);
    run(ebpf).context("the eBPF crate has clippy warnings")?;
    // Doc comments must point at things that exist.
    let mut doc = cargo();
    doc.args([
        "doc",
        "--no-deps",
        "--workspace",
        "--exclude",
        "peerwall-ebpf",
    ])
    .env("RUSTDOCFLAGS", "-D warnings");
    run(doc).context("broken documentation links")?;
    // The README and the book: links resolve, every page is in the book, mdbook builds it.
    docs::build(&root(), &cache_dir(), &target_dir().join("book"), step)?;
    // The images of the tests' own binary (see image::Binary::Tests), for the real-node test.
    image::images(image::Binary::Tests)?;
    let mut t = cargo();
    // Leak checks count only what this run left (an interrupted benchmark's pins are not).
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .context("the clock is before 1970")?
        .as_secs();
    t.args(["test", "--workspace", "--exclude", "peerwall-ebpf"])
        .args(extra)
        .env("PEERWALL_TESTS_SINCE", since.to_string())
        .env(
            "PEERWALL_IMAGES",
            image::images_dir_for(image::Binary::Tests)?,
        );
    run(t)?;
    // A bounded run of every fuzz target (a long one by hand: `cargo xtask fuzz TARGET 3600`).
    if extra.is_empty() {
        fuzz(&[])?;
    }
    Ok(())
}

/// No import cycles between the modules of any crate ([`cycles`]).
fn check_cycles() -> Result<()> {
    let mut found = Vec::new();
    for src in cycles::crate_sources(&root()) {
        for c in cycles::crate_cycles(&src)? {
            let krate = src
                .parent()
                .unwrap_or(&src)
                .strip_prefix(root())
                .unwrap_or(&src);
            found.push(format!("{}: {}", krate.display(), c.join(" <-> ")));
        }
    }
    let mut named = Vec::new();
    for src in ["agent/src", "agent/kube/src", "agent/enforce/src"] {
        named.extend(cycles::backend_crates_named(&root().join(src), "lab")?);
    }
    if !named.is_empty() {
        bail!(
            "the binary, peerwall-kube or peerwall-enforce names a backend crate (the binary: outside lab/) (go through peerwall-backend-select: `open`, `rendering`, `installed`; docs/layout.md):\n  {}",
            named.join("\n  ")
        );
    }
    if found.is_empty() {
        println!("module cycles: none; backend crates named only through peerwall-backend-select");
        return Ok(());
    }
    bail!(
        "modules that import each other (make one depend on the other only, or move what they share into a module of its own):\n  {}",
        found.join("\n  ")
    )
}

/// Run the fault tests and write their figures into docs/reliability.md (section `faults`).
fn reliability(args: &[String]) -> Result<()> {
    let rows_dir = target_dir().join("tmp").join("reliability");
    // `--report`: write the tables from the rows the last run left, running nothing.
    if !args.iter().any(|a| a == "--report") {
        run_reliability(&rows_dir)?;
    }
    report_reliability(&rows_dir)
}

/// Every fault, the node's gateway churn and the event flood; their rows go to `rows_dir`.
fn run_reliability(rows_dir: &Path) -> Result<()> {
    setup_build()?;
    previous::ensure(&root(), &cache_dir(), &target_dir(), step)?;
    let _ = std::fs::remove_dir_all(rows_dir);
    let mut t = cargo();
    t.args([
        "test",
        "-p",
        "peerwall",
        "--test",
        "faults",
        "--",
        "--test-threads",
        "1",
    ]);
    run(t)?;
    // Gateway-pod churn on the real node (the node test, images first).
    setup()?;
    let mut node = cargo();
    node.args([
        "test",
        "-p",
        "peerwall",
        "--test",
        "kube",
        "--",
        "--exact",
        "node::daemonset_enforces_inside_liqo_gateway_pods_on_a_real_node",
    ])
    // 25 gateway-pod recreations per backend (CI runs 5).
    .env("PEERWALL_CHURN", "25");
    run(node)?;
    // The event flood through the API server (minutes per backend: PEERWALL_FLOOD_MINUTES).
    kube_build()?;
    let mut flood = cargo();
    flood.args(["bench", "-p", "peerwall", "--bench", "events"]);
    run(flood)
}

/// docs/reliability.md's tables from the rows in `rows_dir`.
fn report_reliability(rows_dir: &Path) -> Result<()> {
    let mut rows: Vec<serde_json::Value> = Vec::new();
    for e in std::fs::read_dir(rows_dir)
        .with_context(|| format!("reading {}", rows_dir.display()))?
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        let other = name.starts_with("flood-") || name.starts_with("churn-");
        if e.path().extension().is_none_or(|x| x != "json") || other {
            continue;
        }
        let text = std::fs::read_to_string(e.path())?;
        rows.push(serde_json::from_str(&text).with_context(|| format!("{}", e.path().display()))?);
    }
    rows.sort_by_key(|r| (r["fault"].to_string(), r["backend"].to_string()));
    let n = |r: &serde_json::Value, k: &str| r["counts"][k].as_u64().unwrap_or(0);
    let mut md = String::from(
        "| fault | backend | load held | allowed sent | allowed lost (baseline) | denied sent | denied delivered | flipped destination: judged by the policy in force (in transition), wrong | in force again |\n|---|---|---|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in &rows {
        let f = &r["flips"];
        let flips = if f.is_object() {
            let k = |k: &str| f[k].as_u64().unwrap_or(0);
            format!(
                "{} ({}), **{}**",
                k("judged_allowed") + k("judged_denied"),
                k("in_transition"),
                k("delivered_denied") + k("lost_allowed")
            )
        } else {
            "–".to_string()
        };
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} ({}) | {} | **{}** | {flips} | {} |\n",
            r["fault"].as_str().unwrap_or_default(),
            r["backend"].as_str().unwrap_or_default(),
            r["load"].as_str().unwrap_or_default(),
            n(r, "allowed_sent"),
            n(r, "allowed_sent").saturating_sub(n(r, "allowed_got")),
            r["baseline_lost"].as_u64().unwrap_or(0),
            n(r, "denied_sent"),
            n(r, "denied_got"),
            r["recover_ms"]
                .as_u64()
                .map_or("–".to_string(), |ms| format!("{ms} ms")),
        ));
    }
    let path = root().join("docs").join("reliability.md");
    let old =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let (start, end) = ("<!-- faults:start -->", "<!-- faults:end -->");
    let (Some(a), Some(b)) = (old.find(start), old.find(end)) else {
        bail!("{} has no {start} … {end} section", path.display());
    };
    let mut new = format!("{}{start}\n{}{}", &old[..a], md, &old[b..]);
    // The conntrack-pressure test's observation, as measured.
    if let Ok(seen) = std::fs::read_to_string(rows_dir.join("conntrack.txt")) {
        let (start, end) = ("<!-- conntrack:start -->", "<!-- conntrack:end -->");
        if let (Some(a), Some(b)) = (new.find(start), new.find(end)) {
            new = format!("{}{start}\nMeasured: {}{}", &new[..a], seen, &new[b..]);
        }
    }
    // The boot window, one line per backend, as measured.
    let mut boot: Vec<String> = std::fs::read_dir(rows_dir)?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("boot-"))
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .collect();
    boot.sort();
    if !boot.is_empty() {
        let (start, end) = ("<!-- boot:start -->", "<!-- boot:end -->");
        if let (Some(a), Some(b)) = (new.find(start), new.find(end)) {
            new = format!("{}{start}\n{}{}", &new[..a], boot.concat(), &new[b..]);
        }
    }
    let churn = churn_table(rows_dir)?;
    let (start, end) = ("<!-- churn:start -->", "<!-- churn:end -->");
    if let (Some(a), Some(b)) = (new.find(start), new.find(end)) {
        new = format!("{}{start}\n{churn}{}", &new[..a], &new[b..]);
    }
    let flood = flood_table(rows_dir)?;
    let (start, end) = ("<!-- flood:start -->", "<!-- flood:end -->");
    if let (Some(a), Some(b)) = (new.find(start), new.find(end)) {
        new = format!("{}{start}\n{flood}{}", &new[..a], &new[b..]);
    }
    std::fs::write(&path, new)?;
    print!("{md}{flood}");
    Ok(())
}

/// The gateway-pod churn's rows (`tests/kube/churn.rs`) as a table.
fn churn_table(rows_dir: &Path) -> Result<String> {
    let mut md = String::from(
        "| backend | gateway pods recreated | datagrams sent to each pod | offloaded pod received | private pod received | new namespace → enforced, ms (median, max) |\n|---|---:|---:|---:|---:|---:|\n",
    );
    for backend in ["bpf", "nftables"] {
        let f = rows_dir.join(format!("churn-{backend}.json"));
        let Ok(text) = std::fs::read_to_string(&f) else {
            continue;
        };
        let r: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{}", f.display()))?;
        let mut ms: Vec<u64> = r["enforced_ms"]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_u64()).collect())
            .unwrap_or_default();
        ms.sort_unstable();
        md.push_str(&format!(
            "| {backend} | {} | {} | {} | **{}** | {}, {} |\n",
            r["recreations"],
            r["sent_each"],
            r["offloaded_received"],
            r["private_received"],
            ms.get(ms.len() / 2).copied().unwrap_or(0),
            ms.last().copied().unwrap_or(0),
        ));
    }
    Ok(md)
}

/// The event flood's rows (`agent/benches/events`) as a table.
fn flood_table(rows_dir: &Path) -> Result<String> {
    let mut md = String::from(
        "| backend | flood | pods | samples | controller MiB (first → last quarter; slope) | agent MiB (first → last quarter; slope) | one pod to first packet, ms (first → last quarter; slope) | address no pod has reached |\n|---|---|---:|---:|---:|---:|---:|---|\n",
    );
    let mut files: Vec<PathBuf> = std::fs::read_dir(rows_dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("flood-"))
        })
        .collect();
    files.sort();
    for f in files {
        let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&f)?)
            .with_context(|| format!("{}", f.display()))?;
        let pair = |k: &str, per: &str| {
            format!(
                "{:.1} → {:.1}; {:+.2}/min",
                r[k][0].as_f64().unwrap_or(0.0),
                r[k][1].as_f64().unwrap_or(0.0),
                r[per].as_f64().unwrap_or(0.0)
            )
        };
        md.push_str(&format!(
            "| {} | {} API writes in {} min | {} | {} | {} | {} | {} | {} |\n",
            r["backend"].as_str().unwrap_or_default(),
            r["writes"],
            r["minutes"],
            r["pods_at_start"],
            r["samples"].as_array().map_or(0, Vec::len),
            pair("controller_mib", "controller_mib_per_min"),
            pair("agent_mib", "agent_mib_per_min"),
            pair("pod_ms", "pod_ms_per_min"),
            if r["stranger_reached"].as_bool().unwrap_or(true) {
                "**yes**"
            } else {
                "no"
            },
        ));
    }
    Ok(md)
}

/// cargo-fuzz in the cache, installed once per version.
fn ensure_cargo_fuzz() -> Result<PathBuf> {
    let prefix = cache_dir().join(format!("cargo-fuzz-{CARGO_FUZZ_VERSION}"));
    let bin = prefix.join("bin").join("cargo-fuzz");
    if !bin.exists() {
        println!("installing cargo-fuzz {CARGO_FUZZ_VERSION} (about a minute, once)");
        let mut c = Command::new("cargo");
        c.args([
            "install",
            "cargo-fuzz",
            "--version",
            CARGO_FUZZ_VERSION,
            "--locked",
            "--root",
        ])
        .arg(&prefix);
        step(&format!("installing cargo-fuzz {CARGO_FUZZ_VERSION}"), c)?;
    }
    Ok(bin)
}

/// Run fuzz targets for a bounded time: `fuzz [TARGET] [SECONDS]`. The corpus grows in the
/// cache (outside the repository); `tests/fuzz/seeds/TARGET` (examples and every finding kept
/// as a regression case) is replayed first, so a fixed bug that comes back fails at once.
fn fuzz(args: &[String]) -> Result<()> {
    setup_build()?;
    let bin = ensure_cargo_fuzz()?;
    let (targets, secs): (Vec<&str>, u64) = match args {
        [] => (FUZZ_TARGETS.to_vec(), FUZZ_CI_SECS),
        [t] => (vec![t.as_str()], FUZZ_CI_SECS),
        [t, s, ..] => (
            vec![t.as_str()],
            s.parse()
                .with_context(|| format!("{s:?} is not a number of seconds"))?,
        ),
    };
    let fuzz_dir = root().join("tests").join("fuzz");
    let target_dir = target_dir().join("fuzz");
    for t in targets {
        if !FUZZ_TARGETS.contains(&t) {
            bail!("unknown fuzz target {t:?}: one of {FUZZ_TARGETS:?}");
        }
        let corpus = cache_dir().join("fuzz-corpus").join(t);
        std::fs::create_dir_all(&corpus)?;
        if t == "policy" {
            // Valid documents to mutate from: the examples users start with.
            for e in std::fs::read_dir(root().join("examples"))?.flatten() {
                let _ = std::fs::copy(e.path(), corpus.join(e.file_name()));
            }
        }
        // Replayed first; created when a target has none yet (libFuzzer refuses a missing dir).
        let seeds = fuzz_dir.join("seeds").join(t);
        std::fs::create_dir_all(&seeds).with_context(|| format!("creating {}", seeds.display()))?;
        let mut c = Command::new("rustup");
        c.current_dir(root())
            .args(["run", "nightly"])
            .arg(&bin)
            .args(["fuzz", "run", "--sanitizer", "none", "--fuzz-dir"])
            .arg(&fuzz_dir)
            .arg("--target-dir")
            .arg(&target_dir)
            .arg(t)
            .arg(&corpus)
            .arg(&seeds)
            .args([
                "--",
                &format!("-max_total_time={secs}"),
                "-timeout=10",
                "-rss_limit_mb=4096",
                "-print_final_stats=1",
            ])
            .env_remove("RUSTC")
            .env_remove("CARGO");
        println!("fuzzing {t} for {secs} s");
        let outcome = run(c);
        // libFuzzer ends the process with `exit` at its time limit: the datapath target's last
        // scratch datapath is never dropped. Its pins and slot metadata go here, not on the
        // next run (`tests/paths.rs` holds every exited process to leaving nothing behind).
        sweep_dead_probes();
        outcome.with_context(|| {
            format!(
                "fuzz target {t} found a failure: the input is in {}/artifacts/{t}; fix it and keep the input in tests/fuzz/seeds/{t}",
                fuzz_dir.display()
            )
        })?;
    }
    Ok(())
}

/// Remove the probe pin directories (`/sys/fs/bpf/pwprobe-<pid>-<n>`), their metadata
/// (`/run/peerwall/sys/fs/bpf/pwprobe-<pid>-<n>`) and the kernel-conntrack probes' namespaces
/// (`pwct-<pid>-<n>`) of processes that no longer exist. Unpinning
/// a link detaches its program; the maps go with their last reference.
fn sweep_dead_probes() {
    for parent in ["/sys/fs/bpf", "/run/peerwall/sys/fs/bpf"] {
        for e in std::fs::read_dir(parent).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let dead = name
                .strip_prefix("pwprobe-")
                .and_then(|r| r.split('-').next())
                .filter(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
                .is_some_and(|pid| !Path::new("/proc").join(pid).exists());
            if dead {
                if let Err(err) = remove_tree(&e.path()) {
                    eprintln!("warning: removing {}: {err}", e.path().display());
                }
            }
        }
    }
    // The kernel-conntrack probes' scratch namespaces (`pwct-<pid>-<n>`).
    for e in std::fs::read_dir("/run/netns")
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        let dead = name
            .strip_prefix("pwct-")
            .and_then(|r| r.split('-').next())
            .filter(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
            .is_some_and(|pid| !Path::new("/proc").join(pid).exists());
        if dead {
            let deleted = Command::new("ip").args(["netns", "del", &name]).status();
            if !deleted.is_ok_and(|s| s.success()) {
                eprintln!("warning: deleting network namespace {name}");
            }
        }
    }
}

/// `rm -r` that also works on bpffs (which has no `rmdir` of non-empty directories either).
fn remove_tree(dir: &Path) -> std::io::Result<()> {
    for e in std::fs::read_dir(dir)?.flatten() {
        let p = e.path();
        if e.file_type()?.is_dir() {
            remove_tree(&p)?;
        } else {
            std::fs::remove_file(&p)?;
        }
    }
    std::fs::remove_dir(dir)
}

/// Nightly cargo `verb` on the eBPF crate, for its own target (build-std), as aya-build
/// builds it.
fn ebpf_cargo(verb: &str) -> Command {
    let mut c = Command::new("rustup");
    c.current_dir(root())
        .args(["run", "nightly", "cargo", verb])
        .args([
            "--package",
            "peerwall-ebpf",
            "--release",
            "--target",
            "bpfel-unknown-none",
            "-Z",
            "build-std=core",
        ])
        .env_remove("RUSTC")
        .env_remove("CARGO");
    c
}

/// Build the eBPF object alone (the agent's build script embeds the same object).
fn build_ebpf() -> Result<()> {
    setup_build()?;
    let mut c = ebpf_cargo("build");
    // Same flags as aya-build: BTF for the loader and bpftool.
    c.env(
        "CARGO_ENCODED_RUSTFLAGS",
        "-Cdebuginfo=2\u{1f}-Clink-arg=--btf",
    );
    run(c)?;
    let obj = root().join("target/bpfel-unknown-none/release/peerwall");
    let size = std::fs::metadata(&obj)
        .with_context(|| format!("reading {}", obj.display()))?
        .len();
    println!(
        "eBPF object: {} ({size} bytes); `cargo build` embeds it in the peerwall binary",
        obj.display()
    );
    Ok(())
}

/// Where the kube-apiserver build lives: a cache keyed by the Kubernetes version.
fn kube_bin_dir() -> PathBuf {
    cache_dir().join(format!("kube-{KUBE_VERSION}"))
}

/// Build kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy and the
/// pause binary from Debian's source package into the version-keyed cache, with kubectl from
/// Debian's binary package of the same source (about 14 minutes, once; only missing binaries
/// are built).
fn kube_build() -> Result<()> {
    let out = kube_bin_dir();
    let missing: Vec<&str> = [
        "kube-apiserver",
        "kube-controller-manager",
        "kubectl",
        "kube-scheduler",
        "kubelet",
        "kube-proxy",
        "pause",
    ]
    .into_iter()
    .filter(|b| !out.join(b).exists())
    .collect();
    if missing.is_empty() {
        return Ok(());
    }
    println!(
        "building {} {KUBE_VERSION} from Debian's source (kubectl: Debian's kubernetes-client) into {} (about 14 minutes, once; its log: kube-build.log in the cache)",
        missing.join(", "),
        out.display()
    );
    let mut c = Command::new("bash");
    c.arg(root().join("xtask/kube/build-apiserver.sh"))
        .arg(&out);
    step_logged(
        "kube-build.log",
        &format!("Kubernetes {KUBE_VERSION} binaries"),
        c,
    )
}

/// Start etcd + kube-apiserver + kube-controller-manager on loopback; prints the kubeconfig.
fn kube_up(args: &[String]) -> Result<()> {
    kube_build()?;
    let run_dir = args
        .first()
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("peerwall-kube"));
    let port = args.get(1).map(String::as_str).unwrap_or("16443");
    let mut c = Command::new("bash");
    c.arg(root().join("xtask/kube/start-apiserver.sh"))
        .arg(kube_bin_dir())
        .arg(&run_dir)
        .arg(port);
    run(c)?;
    println!("stop with: kill $(cat {}/*.pid)", run_dir.display());
    Ok(())
}

fn crd() -> Result<()> {
    let mut c = cargo();
    c.args(["run", "-q", "--bin", "peerwall", "--", "crd"]);
    let out = c.output().context("running peerwall crd")?;
    if !out.status.success() {
        bail!(
            "peerwall crd failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let path = root().join("deploy/common/crd.yaml");
    std::fs::write(&path, out.stdout).with_context(|| format!("writing {}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("setup") => setup(),
        Some("test") => test(&args[1..]),
        Some("cycles") => check_cycles(),
        Some("sizes") => sizes::check(&root()),
        Some("docs") => docs::build(&root(), &cache_dir(), &target_dir().join("book"), step),
        Some("crd") => crd(),
        Some("bpf-linker") => ensure_bpf_linker(),
        Some("kube-build") => kube_build(),
        Some("image") => image::images(if args[1..].iter().any(|a| a == "--tests") {
            image::Binary::Tests
        } else {
            image::Binary::Release
        }),
        Some("kube-up") => kube_up(&args[1..]),
        Some("build-ebpf") => build_ebpf(),
        Some("lab") => {
            setup_build()?;
            let mut c = cargo();
            c.args(["run", "-q", "--bin", "peerwall", "--", "lab"])
                .args(&args[1..]);
            run(c)
        }
        Some("bench") => {
            let mut c = cargo();
            c.args(["bench", "-p", "peerwall", "--bench", "datapath"]);
            // `cargo xtask bench breakdown`: only where the classifier's time goes.
            let rest: Vec<String> = std::env::args().skip(2).collect();
            if !rest.is_empty() {
                c.arg("--").args(rest);
            }
            run(c)
        }
        Some("bench-gateway") => {
            let mut c = cargo();
            c.args(["bench", "-p", "peerwall", "--bench", "gateway"]);
            run(c)
        }
        Some("fuzz") => fuzz(&args[1..]),
        Some("reliability") => reliability(&args[1..]),
        Some("bench-netpol") => {
            setup_build()?;
            let mut c = cargo();
            c.args(["bench", "-p", "peerwall", "--bench", "netpol"]);
            run(c)?;
            // Then the same change through the API server, controller and agent (the
            // release binary under test).
            kube_build()?;
            let mut c = cargo();
            c.args(["build", "--release", "--bin", "peerwall"]);
            run(c)?;
            let mut c = cargo();
            c.args(["bench", "-p", "peerwall", "--bench", "netpol_api"]);
            run(c)
        }
        Some("bench-control") => {
            // The agent and controller under test are the release binary.
            setup_build()?;
            kube_build()?;
            let mut c = cargo();
            c.args(["build", "--release", "--bin", "peerwall"]);
            run(c)?;
            let mut c = cargo();
            c.args(["bench", "-p", "peerwall", "--bench", "control"]);
            run(c)
        }
        Some("profile") => profile::run(&args[1..]),
        Some("bench-peers") => {
            setup_build()?;
            kube_build()?;
            let mut c = cargo();
            c.args(["bench", "-p", "peerwall", "--bench", "peers"]);
            run(c)
        }
        _ => {
            eprintln!(
                "usage: cargo xtask <setup|lab|test|build-ebpf|bench|bench-gateway|profile|bench-control|bench-peers|bench-netpol|crd|docs|cycles|sizes|kube-build|kube-up|image>"
            );
            eprintln!("  setup  install apt packages and rustup components the tests need (root)");
            eprintln!("  test   fmt + clippy checks, then the whole test suite (root)");
            eprintln!("  lab    the gateway lab: [--backend nftables|bpf] [--keep] (root)");
            eprintln!("  build-ebpf  build the eBPF object (installs bpf-linker if missing)");
            eprintln!("  bench  benchmarks (BPF_PROG_TEST_RUN ns/packet, map update latency); `bench breakdown`: where the classifier's time goes");
            eprintln!("  bench-gateway  peerwall vs nft rule-per-IP, iptables, ipset through a gateway netns (root)");
            eprintln!("  bench-peers  N Liqo gateways on one node (1, 10, 50) under the gateway-pod agent: start → all enforced, one more gateway, RSS, kernel memory (root)");
            eprintln!("  profile [PROGRAM_PREFIX] [SECONDS]  where a loaded eBPF program's time goes, by source line (perf + the JIT's line table; root)");
            eprintln!("  bench-control  100k offloaded pods through kube-apiserver, controller and agent: one pod, churn, restart, RSS (root)");
            eprintln!("  bench-netpol  1000 NetworkPolicies over 10k pods: the tier, compile, full apply and one label change per backend, in process, then through kube-apiserver, controller and agent (root)");
            eprintln!("  reliability  the fault tests (tests/faults.rs), the real node's gateway churn, the event flood (agent/benches/events), then their tables in docs/reliability.md; --report: the tables only, from the last run's rows (root)");
            eprintln!("  fuzz   [TARGET] [SECONDS]  the fuzz targets (policy, datapath), 30 s each by default; findings land in tests/fuzz/artifacts (root)");
            eprintln!("  crd    regenerate deploy/common/crd.yaml from the Rust types");
            eprintln!("  docs   check the README's and docs/ links, build the book (mdbook) into <target>/book");
            eprintln!("  cycles  report modules of a crate that import each other");
            eprintln!("  sizes  report files over 600 lines and functions over 120 without a stated reason");
            eprintln!("  kube-build  build kube-apiserver {KUBE_VERSION} into the cache (once)");
            eprintln!("  image       OCI images (peerwall, pause, the lab's gateway) into <target>/images [--tests: the tests' dev binary, into <target>/images-tests]");
            eprintln!(
                "  kube-up [RUN_DIR] [PORT]  start a loopback kube-apiserver; prints kubeconfig"
            );
            bail!("unknown task")
        }
    }
}
