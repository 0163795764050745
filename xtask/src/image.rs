//! `cargo xtask image`: OCI images built here, without a container engine.
//!
//! - `peerwall:<version>` (`docker.io/library/peerwall`, what `deploy/` names): the release `peerwall` binary
//!   (the tests': see [`Binary`]) over the Debian packages it runs
//!   (`nft` for the nftables backend, `conntrack` for `peerwall verdict --probe` and for
//!   operators (the agent reads and ends connections over ctnetlink itself), `ip`, the C
//!   runtime), entrypoint `peerwall`.
//! - `peerwall.local/pause:<kube version>`: the pod sandbox, the static `pause` binary compiled
//!   from the Kubernetes source tree by `kube-build`.
//! - `peerwall.local/lab-gateway:1`: what the real-node test runs as a Liqo-shaped gateway pod
//!   (wireguard-go, wireguard-tools, iproute2, nftables, a shell). Not shipped.
//!
//! Root filesystems come from `mmdebstrap --variant=extract` (Debian packages unpacked, no
//! maintainer scripts), cached by package list; `umoci` writes the OCI layout, which is then
//! archived as a tar that `ctr images import` (containerd) and `skopeo copy oci-archive:`
//! read. Output: `<target dir>/images/<name>.oci.tar` (`images-tests/` for [`Binary::Tests`]).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use crate::{cache_dir, cargo, kube_bin_dir, output, run, KUBE_VERSION};

/// One image to build.
struct Image {
    /// File stem of the archive.
    file: &'static str,
    /// Repository (imported as `<repo>:<tag>`).
    repo: &'static str,
    tag: String,
    /// Debian packages of the base layer (none: no base layer).
    packages: &'static [&'static str],
    /// Files copied in, as a second layer: (source, path in the image).
    files: Vec<(PathBuf, &'static str)>,
    entrypoint: &'static str,
}

/// Paths dropped from the Debian layer: documentation and locales nobody reads in a pod.
const PRUNE: &[&str] = &[
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "usr/share/lintian",
    "usr/share/bug",
    "var/cache/apt",
    "var/lib/apt/lists",
    "var/log",
];

/// Where images are written: `<cargo target dir>/images`.
pub fn images_dir() -> Result<PathBuf> {
    let meta = output("cargo", &["metadata", "--format-version", "1", "--no-deps"])?;
    let key = "\"target_directory\":\"";
    let start = meta
        .find(key)
        .context("cargo metadata has no target_directory")?
        + key.len();
    let end = meta[start..]
        .find('"')
        .context("cargo metadata: unterminated target_directory")?;
    Ok(PathBuf::from(&meta[start..start + end]).join("images"))
}

fn ensure_tools() -> Result<()> {
    let missing = ["mmdebstrap", "umoci"]
        .iter()
        .any(|t| Command::new(t).arg("--version").output().is_err());
    if missing {
        let install = || {
            let mut c = Command::new("apt-get");
            c.args([
                "install",
                "-y",
                "--no-install-recommends",
                "mmdebstrap",
                "umoci",
            ])
            .env("DEBIAN_FRONTEND", "noninteractive");
            run(c)
        };
        // A machine whose package lists are stale needs an update first.
        if install().is_err() {
            run_cmd("apt-get", &["update", "-qq"])?;
            install()?;
        }
    }
    Ok(())
}

fn run_cmd(program: &str, args: &[&str]) -> Result<()> {
    let mut c = Command::new(program);
    c.args(args);
    run(c)
}

/// The Debian mirror this machine's apt uses.
fn mirror() -> String {
    let sources =
        std::fs::read_to_string("/etc/apt/sources.list.d/debian.sources").unwrap_or_default();
    sources
        .lines()
        .find_map(|l| {
            l.strip_prefix("URIs:")
                .map(|u| u.split_whitespace().next().unwrap_or("").to_string())
        })
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "http://deb.debian.org/debian".into())
}

/// The unpacked Debian packages, as a tarball cached by package list.
fn rootfs(packages: &[&str]) -> Result<PathBuf> {
    let key = packages.join(",");
    let tar = cache_dir()
        .join("rootfs")
        .join(format!("bookworm-{}.tar", key.replace(',', "+")));
    if tar.exists() {
        return Ok(tar);
    }
    std::fs::create_dir_all(tar.parent().context("cache path")?)?;
    let partial = tar.with_extension("partial.tar");
    let mut c = Command::new("mmdebstrap");
    c.args(["--variant=extract", "--mode=root", "--quiet"])
        .arg(format!("--include={key}"))
        .arg("bookworm")
        .arg(&partial)
        .arg(mirror());
    run(c)?;
    std::fs::rename(&partial, &tar)?;
    Ok(tar)
}

fn build(img: &Image, out: &Path) -> Result<PathBuf> {
    let work = out.join(format!("{}.work", img.file));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;
    let layout = work.join("layout");
    let reference = format!("{}:{}", layout.display(), img.tag);
    run_cmd("umoci", &["init", "--layout", &layout.to_string_lossy()])?;
    run_cmd("umoci", &["new", "--image", &reference])?;
    if !img.packages.is_empty() {
        let fs = work.join("rootfs");
        std::fs::create_dir_all(&fs)?;
        let tar = rootfs(img.packages)?;
        run_cmd(
            "tar",
            &["-C", &fs.to_string_lossy(), "-xf", &tar.to_string_lossy()],
        )?;
        for p in PRUNE {
            let _ = std::fs::remove_dir_all(fs.join(p));
        }
        run_cmd(
            "umoci",
            &["insert", "--image", &reference, &fs.to_string_lossy(), "/"],
        )?;
    }
    for (src, dst) in &img.files {
        run_cmd(
            "umoci",
            &["insert", "--image", &reference, &src.to_string_lossy(), dst],
        )?;
    }
    run_cmd(
        "umoci",
        &[
            "config",
            "--image",
            &reference,
            "--config.entrypoint",
            img.entrypoint,
            "--config.env",
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--author",
            "peerwall xtask image",
        ],
    )?;
    let archive = out.join(format!("{}.oci.tar", img.file));
    run_cmd(
        "tar",
        &[
            "-C",
            &layout.to_string_lossy(),
            "-cf",
            &archive.to_string_lossy(),
            ".",
        ],
    )?;
    std::fs::remove_dir_all(&work)?;
    println!("image {}:{} -> {}", img.repo, img.tag, archive.display());
    Ok(archive)
}

/// Which `peerwall` binary the peerwall image holds.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Binary {
    /// `cargo build --release`: what users deploy (`cargo xtask image`, the benchmarks,
    /// `cargo xtask reliability`). Into `<target>/images`.
    Release,
    /// The dev-profile binary the integration tests run (same source, unoptimised, overflow
    /// checks on; built by `cargo test --no-run`), its debug info stripped: `cargo xtask test`
    /// gets it from the tests' own build instead of compiling every crate a second time
    /// optimised (that release build took 15 minutes of a 62-minute CI run on 2 cores). Into
    /// `<target>/images-tests`, which the tests read through `PEERWALL_IMAGES`, so it never
    /// stands where a release image is looked for.
    Tests,
}

/// Where [`images`] writes for `binary`.
pub fn images_dir_for(binary: Binary) -> Result<PathBuf> {
    let dir = images_dir()?;
    Ok(match binary {
        Binary::Release => dir,
        Binary::Tests => dir.with_file_name("images-tests"),
    })
}

/// Build every image (the peerwall binary first).
pub fn images(binary: Binary) -> Result<()> {
    ensure_tools()?;
    crate::kube_build()?;
    let out = images_dir_for(binary)?;
    std::fs::create_dir_all(&out)?;
    let target = out.parent().context("target dir")?;
    let mut c = cargo();
    let peerwall = match binary {
        Binary::Release => {
            c.args(["build", "--release", "-p", "peerwall"]);
            run(c)?;
            target.join("release/peerwall")
        }
        Binary::Tests => {
            // Built as `cargo xtask test` builds it, so that the test run after it builds
            // nothing again: with the workspace's features unified (`cargo build -p peerwall`
            // resolves fewer, and every crate under it would compile twice).
            c.args([
                "test",
                "--workspace",
                "--exclude",
                "peerwall-ebpf",
                "--no-run",
            ]);
            run(c)?;
            // 180 MB with line tables, 97 MB without: the layer is written, archived and
            // imported by containerd on every run.
            let stripped = out.join("peerwall.stripped");
            let mut strip = Command::new("objcopy");
            strip
                .arg("--strip-debug")
                .arg(target.join("debug/peerwall"))
                .arg(&stripped);
            run(strip)?;
            stripped
        }
    };
    let version = env!("CARGO_PKG_VERSION").to_string();
    let list = [
        Image {
            file: "peerwall",
            repo: "docker.io/library/peerwall",
            tag: version,
            packages: &["libc6", "libgcc-s1", "nftables", "iproute2", "conntrack"],
            files: vec![(peerwall, "/usr/local/bin/peerwall")],
            entrypoint: "/usr/local/bin/peerwall",
        },
        Image {
            file: "pause",
            repo: "peerwall.local/pause",
            tag: KUBE_VERSION.into(),
            packages: &[],
            files: vec![(kube_bin_dir().join("pause"), "/pause")],
            entrypoint: "/pause",
        },
        Image {
            file: "lab-gateway",
            repo: "peerwall.local/lab-gateway",
            tag: "1".into(),
            packages: &[
                "libc6",
                "dash",
                "coreutils",
                "iproute2",
                "nftables",
                "wireguard-go",
                "wireguard-tools",
            ],
            files: vec![],
            entrypoint: "/bin/dash",
        },
    ];
    for img in &list {
        build(img, &out)?;
    }
    // The names to import them under, for `ctr images import --base-name`.
    let names: Vec<String> = list
        .iter()
        .map(|i| format!("{} {}", i.file, i.repo))
        .collect();
    std::fs::write(out.join("names"), names.join("\n") + "\n")?;
    Ok(())
}
