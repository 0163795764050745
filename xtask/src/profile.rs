//! `cargo xtask profile`: where a loaded eBPF program spends its time, by source line.
//!
//! `perf annotate` needs a disassembler (libbfd) that Debian's perf and bpftool are built
//! without, so `perf` alone names only the program's functions. This reads what the kernel
//! keeps of the JIT instead: the address in the JIT image of every BTF line record
//! (`bpf_prog_info.jited_line_info`, parallel to `line_info`, whose `insn_off` is the line's
//! first instruction) and the source text `bpftool prog dump xlated linum` prints for each
//! line. A `perf record -g` sample in the program is then the source line of the last record
//! at or before its address; a sample in a kernel function the program called (a map lookup,
//! a clock) goes to the calling line and that function, so one hash lookup that misses the
//! CPU's caches shows up as its call site.
//!
//! Run it while traffic goes through the program (a flood of the gateway benchmark, a real
//! gateway): it samples every CPU for the given time. Root.

use std::collections::{BTreeMap, HashMap};

use anyhow::{bail, Context, Result};

use crate::output;

/// `BPF_PROG_GET_FD_BY_ID`.
const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
/// `BPF_OBJ_GET_INFO_BY_FD`.
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
/// `sizeof(struct bpf_prog_info)` on kernel 6.18 (the kernel accepts any size and fills what
/// both know).
const INFO_LEN: usize = 232;

/// Byte offsets in `struct bpf_prog_info` (`include/uapi/linux/bpf.h`; checked against
/// `bpftool btf dump file /sys/kernel/btf/vmlinux`).
mod off {
    pub const NR_JITED_KSYMS: usize = 104;
    pub const JITED_KSYMS: usize = 112;
    pub const NR_LINE_INFO: usize = 148;
    pub const LINE_INFO: usize = 152;
    pub const JITED_LINE_INFO: usize = 160;
    pub const NR_JITED_LINE_INFO: usize = 168;
    pub const LINE_INFO_REC_SIZE: usize = 172;
    pub const JITED_LINE_INFO_REC_SIZE: usize = 176;
}

/// What the kernel says of a program's JIT image: its functions' start addresses and, for
/// every line record, its address and first instruction.
#[derive(Debug, Default)]
pub struct LineTable {
    /// (start address, kallsyms name `bpf_prog_<tag>_<function>`), one per function.
    pub functions: Vec<(u64, String)>,
    /// (JIT address, xlated instruction offset), sorted by address.
    pub lines: Vec<(u64, u32)>,
}

fn bpf(cmd: libc::c_long, attr: &mut [u8; 128]) -> Result<i32> {
    // SAFETY: `attr` is a zeroed `union bpf_attr` of 128 bytes for commands that read at most
    // that many.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), attr.len()) };
    if r < 0 {
        bail!("bpf({cmd}): {}", std::io::Error::last_os_error());
    }
    Ok(r as i32)
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_ne_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

fn put_u32(b: &mut [u8], o: usize, v: u32) {
    b[o..o + 4].copy_from_slice(&v.to_ne_bytes());
}

fn put_u64(b: &mut [u8], o: usize, v: u64) {
    b[o..o + 8].copy_from_slice(&v.to_ne_bytes());
}

/// `BPF_OBJ_GET_INFO_BY_FD` of program `fd` into `info`.
fn prog_info(fd: i32, info: &mut [u8; INFO_LEN]) -> Result<()> {
    let mut attr = [0u8; 128];
    put_u32(&mut attr, 0, fd as u32);
    put_u32(&mut attr, 4, INFO_LEN as u32);
    put_u64(&mut attr, 8, info.as_mut_ptr() as u64);
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr).map(|_| ())
}

/// The line table of loaded program `id` (names from `/proc/kallsyms`).
pub fn line_table(id: u32) -> Result<LineTable> {
    let mut attr = [0u8; 128];
    put_u32(&mut attr, 0, id);
    let fd = bpf(BPF_PROG_GET_FD_BY_ID, &mut attr).with_context(|| format!("program {id}"))?;
    let mut info = [0u8; INFO_LEN];
    let got = prog_info(fd, &mut info);
    let result = got.and_then(|()| read_lines(fd, &info));
    // SAFETY: our own descriptor.
    unsafe { libc::close(fd) };
    result
}

fn read_lines(fd: i32, counts: &[u8; INFO_LEN]) -> Result<LineTable> {
    let nks = u32_at(counts, off::NR_JITED_KSYMS) as usize;
    let nli = u32_at(counts, off::NR_LINE_INFO) as usize;
    let njli = u32_at(counts, off::NR_JITED_LINE_INFO) as usize;
    let lrs = u32_at(counts, off::LINE_INFO_REC_SIZE) as usize;
    let jlrs = u32_at(counts, off::JITED_LINE_INFO_REC_SIZE) as usize;
    if nli == 0 || njli != nli || lrs < 4 || jlrs < 8 {
        bail!("the program has no JIT line info (loaded without BTF line records?)");
    }
    let mut ksyms = vec![0u64; nks];
    let mut li = vec![0u8; nli * lrs];
    let mut jli = vec![0u8; njli * jlrs];
    let mut info = [0u8; INFO_LEN];
    put_u32(&mut info, off::NR_JITED_KSYMS, nks as u32);
    put_u64(&mut info, off::JITED_KSYMS, ksyms.as_mut_ptr() as u64);
    put_u32(&mut info, off::NR_LINE_INFO, nli as u32);
    put_u64(&mut info, off::LINE_INFO, li.as_mut_ptr() as u64);
    put_u32(&mut info, off::NR_JITED_LINE_INFO, njli as u32);
    put_u64(&mut info, off::JITED_LINE_INFO, jli.as_mut_ptr() as u64);
    put_u32(&mut info, off::LINE_INFO_REC_SIZE, lrs as u32);
    put_u32(&mut info, off::JITED_LINE_INFO_REC_SIZE, jlrs as u32);
    prog_info(fd, &mut info)?;
    let names = kallsyms_bpf()?;
    let functions = ksyms
        .iter()
        .map(|a| (*a, names.get(a).cloned().unwrap_or_else(|| "?".into())))
        .collect();
    let mut lines: Vec<(u64, u32)> = (0..nli)
        .map(|i| {
            let a = u64::from_ne_bytes(jli[i * jlrs..i * jlrs + 8].try_into().unwrap_or([0; 8]));
            (a, u32_at(&li, i * lrs))
        })
        .collect();
    lines.sort_unstable();
    Ok(LineTable { functions, lines })
}

/// Addresses of the JIT'd eBPF functions in `/proc/kallsyms` (root sees them).
fn kallsyms_bpf() -> Result<HashMap<u64, String>> {
    let text = std::fs::read_to_string("/proc/kallsyms").context("/proc/kallsyms")?;
    Ok(text
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (a, _, n) = (f.next()?, f.next()?, f.next()?);
            n.starts_with("bpf_prog_")
                .then(|| Some((u64::from_str_radix(a, 16).ok()?, n.to_string())))?
        })
        .collect())
}

/// The source line of every annotated instruction in `bpftool prog dump xlated linum`'s
/// output: instruction offset → (whether the file is the datapath's own, `file:line  text`).
pub fn sources(xlated: &str) -> Sources {
    let mut out = BTreeMap::new();
    let mut pending: Option<(bool, String)> = None;
    for l in xlated.lines() {
        if let Some(rest) = l.strip_prefix(';') {
            let (text, loc, own) = match rest.split_once("[file:") {
                Some((t, f)) => {
                    let file = f.split_whitespace().next().unwrap_or("?");
                    let own = file.contains("/ebpf/src/");
                    let file = file.rsplit('/').next().unwrap_or(file);
                    let line = f
                        .split("line_num:")
                        .nth(1)
                        .and_then(|s| s.split_whitespace().next())
                        .unwrap_or("?");
                    (t.trim(), format!("{file}:{line}"), own)
                }
                None => (rest.trim(), "?".into(), false),
            };
            let text: String = text.chars().take(80).collect();
            pending = Some((own, format!("{loc}  {text}")));
            continue;
        }
        let t = l.trim_start();
        if let Some((n, _)) = t.split_once(':') {
            if let (Ok(n), Some(p)) = (n.parse::<u32>(), pending.take()) {
                out.insert(n, p);
            }
        }
    }
    out
}

/// One sample's frames as `perf script -F ip,sym,symoff` prints them, leaf first: (symbol,
/// offset) of each.
pub fn samples(script: &str) -> Vec<Vec<(String, u64)>> {
    script
        .split("\n\n")
        .map(|block| {
            block
                .lines()
                .filter_map(|l| {
                    let mut f = l.split_whitespace();
                    let ip = f.next()?;
                    u64::from_str_radix(ip, 16).ok()?;
                    let sym = f.next()?;
                    let (name, off) = sym.rsplit_once("+0x").unwrap_or((sym, "0"));
                    Some((name.to_string(), u64::from_str_radix(off, 16).unwrap_or(0)))
                })
                .collect::<Vec<_>>()
        })
        .filter(|f| !f.is_empty())
        .collect()
}

/// What [`sources`] reads: instruction offset → (whether the file is the datapath's own,
/// `file:line  text`).
pub type Sources = BTreeMap<u32, (bool, String)>;

/// Samples of the profiled programs, attributed.
#[derive(Debug, Default, PartialEq)]
pub struct Profile {
    /// Samples with a frame in the programs.
    pub total: u64,
    /// Samples on every CPU.
    pub all: u64,
    /// Per function (name without `bpf_prog_<tag>_`).
    pub functions: BTreeMap<String, u64>,
    /// Per (function, the datapath's own source line, the kernel function the sample was in
    /// when the program had called one, else empty).
    pub lines: BTreeMap<(String, String, String), u64>,
}

/// The function name of a JIT symbol `bpf_prog_<tag>_<name>`.
fn short(sym: &str) -> &str {
    sym.strip_prefix("bpf_prog_")
        .and_then(|s| s.split_once('_'))
        .map_or(sym, |(_, n)| n)
}

/// The datapath's own source line at `addr` in `t`: the last line record at or before it
/// whose file is the datapath's (an inlined library line, such as a map helper's wrapper, goes
/// to the datapath line it serves).
fn own_line(t: &LineTable, src: &Sources, addr: u64) -> String {
    let i = t.lines.partition_point(|(a, _)| *a <= addr);
    t.lines[..i]
        .iter()
        .rev()
        .take(64)
        .find_map(|(_, insn)| {
            src.get(insn)
                .filter(|(own, _)| *own)
                .map(|(_, s)| s.clone())
        })
        .unwrap_or_else(|| "?".into())
}

/// Attribute `samples` (leaf first) to the functions and lines of the programs in `tables`
/// (each with its xlated sources).
pub fn attribute(samples: &[Vec<(String, u64)>], tables: &[(LineTable, Sources)]) -> Profile {
    let mut starts: HashMap<&str, (usize, u64)> = HashMap::new();
    for (i, (t, _)) in tables.iter().enumerate() {
        for (a, n) in &t.functions {
            starts.insert(n.as_str(), (i, *a));
        }
    }
    let mut p = Profile {
        all: samples.len() as u64,
        ..Profile::default()
    };
    for frames in samples {
        let Some((sym, off)) = frames.iter().find(|(n, _)| starts.contains_key(n.as_str())) else {
            continue;
        };
        let (ti, start) = starts[sym.as_str()];
        let (t, src) = &tables[ti];
        p.total += 1;
        let f = short(sym).to_string();
        *p.functions.entry(f.clone()).or_default() += 1;
        let leaf = &frames[0].0;
        // A return address points past its call: the call's own line is one byte back.
        let called = leaf != sym;
        let at = start + off - u64::from(called);
        let callee = if called { leaf.clone() } else { String::new() };
        *p.lines
            .entry((f, own_line(t, src, at), callee))
            .or_default() += 1;
    }
    p
}

/// The profile as markdown: functions, then the `top` lines.
pub fn markdown(p: &Profile, top: usize) -> String {
    let pct = |n: u64| 100.0 * n as f64 / p.total.max(1) as f64;
    let mut md = format!(
        "{} samples in the programs ({} on all CPUs).\n\n| share | function |\n|---:|---|\n",
        p.total, p.all
    );
    let mut fs: Vec<_> = p.functions.iter().collect();
    fs.sort_by(|a, b| b.1.cmp(a.1));
    for (f, n) in fs {
        md.push_str(&format!("| {:.1}% | {f} |\n", pct(*n)));
    }
    md.push_str("\n| share | function | line | in kernel function |\n|---:|---|---|---|\n");
    let mut ls: Vec<_> = p.lines.iter().collect();
    ls.sort_by(|a, b| b.1.cmp(a.1));
    for ((f, l, c), n) in ls.into_iter().take(top) {
        let l = l.replace('|', "\\|");
        md.push_str(&format!("| {:.1}% | {f} | `{l}` | {c} |\n", pct(*n)));
    }
    md
}

/// Loaded programs whose name starts with `prefix`: their ids.
fn programs(prefix: &str) -> Result<Vec<u32>> {
    let out = output("bpftool", &["-j", "prog", "show"])?;
    let v: serde_json::Value = serde_json::from_str(&out).context("bpftool's JSON")?;
    Ok(v.as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["name"].as_str().is_some_and(|n| n.starts_with(prefix)))
        .filter_map(|p| p["id"].as_u64().map(|i| i as u32))
        .collect())
}

/// `cargo xtask profile [PROGRAM_PREFIX] [SECONDS]`: sample every CPU while the programs
/// whose names start with the prefix (default `peerwall_tc`) run, and print where their time
/// goes.
pub fn run(args: &[String]) -> Result<()> {
    let prefix = args.first().map_or("peerwall_tc", String::as_str);
    let secs: u64 = match args.get(1) {
        Some(s) => s.parse().with_context(|| format!("seconds: {s:?}"))?,
        None => 10,
    };
    let ids = programs(prefix)?;
    if ids.is_empty() {
        bail!("no loaded program named {prefix}*");
    }
    let mut tables = Vec::new();
    for id in &ids {
        let id_s = id.to_string();
        let xlated = output("bpftool", &["prog", "dump", "xlated", "id", &id_s, "linum"])?;
        tables.push((line_table(*id)?, sources(&xlated)));
    }
    let dir = std::env::temp_dir().join(format!("peerwall-profile-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let data = dir.join("perf.data").to_string_lossy().into_owned();
    let secs = secs.to_string();
    let recorded = output(
        "perf",
        &[
            "record",
            "-a",
            "-g",
            "-F",
            "2999",
            "-e",
            "cpu-clock",
            "-o",
            &data,
            "--",
            "sleep",
            &secs,
        ],
    )
    .and_then(|_| output("perf", &["script", "-F", "ip,sym,symoff", "-i", &data]));
    let _ = std::fs::remove_dir_all(&dir);
    let script = recorded?;
    let p = attribute(&samples(&script), &tables);
    if p.total == 0 {
        bail!("no sample in the programs: is traffic going through them?");
    }
    print!("{}", markdown(&p, 40));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const XLATED: &str = "\
i32 entry(struct __sk_buff * ctx):
; let x = f(); [file:/w/ebpf/src/main.rs line_num:10 line_col:1]
   0: (7b) *(u64 *)(r10 -16) = r1
; fun(map, key) [file:/r/aya-ebpf/src/helpers.rs line_num:10 line_col:5]
   1: (85) call bpf_map_lookup_elem#1
; if x | y { [file:/w/ebpf/src/main.rs line_num:12 line_col:1]
   2: (95) exit
";

    fn table() -> (LineTable, Sources) {
        (
            LineTable {
                functions: vec![(0x1000, "bpf_prog_ab12_entry".into())],
                lines: vec![(0x1000, 0), (0x1008, 1), (0x1010, 2)],
            },
            sources(XLATED),
        )
    }

    #[test]
    fn sources_keep_each_instructions_line_and_whose_file_it_is() {
        let s = sources(XLATED);
        assert_eq!(s[&0], (true, "main.rs:10  let x = f();".into()));
        assert_eq!(s[&1], (false, "helpers.rs:10  fun(map, key)".into()));
        assert_eq!(s[&2].1, "main.rs:12  if x | y {");
    }

    #[test]
    fn samples_are_frames_leaf_first() {
        let script = "\n\tffffffffc0001009 lookup_nulls_elem_raw+0x1a (k)\n\tffffffffc000100d bpf_prog_ab12_entry+0xd (bpf)\n\n\n\tffffffffc0001011 bpf_prog_ab12_entry+0x11 (bpf)\n";
        let s = samples(script);
        assert_eq!(s.len(), 2);
        assert_eq!(s[0][0], ("lookup_nulls_elem_raw".into(), 0x1a));
        assert_eq!(s[0][1], ("bpf_prog_ab12_entry".into(), 0xd));
    }

    #[test]
    fn a_sample_in_a_callee_goes_to_the_own_line_of_its_call() {
        let t = [table()];
        let s = vec![
            // In the map lookup called at 0x1008 (return address 0x100d): the helper wrapper's
            // line is a library's, so the datapath's line before it takes the sample.
            vec![
                ("lookup_nulls_elem_raw".into(), 0x1a),
                ("bpf_prog_ab12_entry".into(), 0xd),
            ],
            // In the program's own code at 0x1011.
            vec![("bpf_prog_ab12_entry".into(), 0x11)],
            // Elsewhere.
            vec![("do_syscall_64".into(), 0x10)],
        ];
        let p = attribute(&s, &t);
        assert_eq!((p.total, p.all), (2, 3));
        assert_eq!(p.functions["entry"], 2);
        let key = |l: &str, c: &str| ("entry".to_string(), l.to_string(), c.to_string());
        assert_eq!(
            p.lines[&key("main.rs:10  let x = f();", "lookup_nulls_elem_raw")],
            1
        );
        assert_eq!(p.lines[&key("main.rs:12  if x | y {", "")], 1);
        assert!(markdown(&p, 10).contains("| 50.0% | entry | `main.rs:12  if x \\| y {` |  |"));
    }
}
