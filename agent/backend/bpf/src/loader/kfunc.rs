//! Kernel functions (kfuncs) the datapath calls: the kernel's conntrack lookup and release,
//! and the cast to the kernel's `sk_buff` of the tc entry for every device type ([`KernCtx`]).
//!
//! The eBPF program calls each as a helper with a made-up number
//! ([`peerwall_common::kfunc`]): `call <magic>`, an instruction no relocation touches. Before
//! aya reads the object, [`patch`] rewrites every such call in the object's code sections
//! into a kfunc call (`src_reg` = `BPF_PSEUDO_KFUNC_CALL`, `imm` = the function's BTF id in
//! vmlinux, `off` 0), or, where the kernel cannot offer the function, into `r0 = 0` (the
//! lookup "finds nothing": the datapath then never takes that path, see
//! [`KernelCt`]). Everything else about loading stays aya's.
//!
//! A kfunc of a module (nf_conntrack built as a module) lives in the module's split BTF and
//! needs the module's BTF fd in the program's `fd_array`, which aya 0.14 does not pass: such a
//! kernel gets the datapath's own flow tables, and `peerwall inspect` says why.

use peerwall_common::kfunc::{CAST_TO_KERN_CTX, CT_LOOKUP_SKB, CT_LOOKUP_XDP, CT_RELEASE};

use super::btf::{BtfError, KernelBtf};

/// `BPF_JMP | BPF_CALL`.
const OP_CALL: u8 = 0x85;
/// `BPF_ALU64 | BPF_MOV | BPF_K`.
const OP_MOV64_IMM: u8 = 0xb7;
/// `BPF_PSEUDO_KFUNC_CALL`, in the instruction's source-register nibble.
const PSEUDO_KFUNC_CALL: u8 = 2;

/// The kernel's conntrack as the datapath can read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelCt {
    /// The kfuncs and where `nf_conn`'s status word lies.
    Kernel(CtKfuncs),
    /// Not available here; the datapath keeps its own flow tables. Why.
    Own(String),
}

/// BTF ids of the conntrack kfuncs in vmlinux, and `offsetof(struct nf_conn, status)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CtKfuncs {
    pub skb_lookup: u32,
    pub xdp_lookup: u32,
    pub release: u32,
    pub status_offset: u32,
}

/// The tc entry for every device type reads the kernel's `sk_buff` of its packet
/// (`ebpf/src/l2.rs`): `bpf_cast_to_kern_ctx`'s BTF id in vmlinux and
/// `offsetof(struct sk_buff, mac_len)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernCtx {
    pub cast: u32,
    pub mac_len_offset: u32,
}

impl KernCtx {
    /// What `btf` (vmlinux's) offers; None before the cast (6.3) or without the member.
    pub fn from_btf(btf: &KernelBtf) -> Option<Self> {
        Some(Self {
            cast: btf.func_id("bpf_cast_to_kern_ctx").ok()?,
            mac_len_offset: btf.member_offset("sk_buff", "mac_len").ok()?,
        })
    }

    /// [`from_btf`](Self::from_btf) of this kernel, read once per process.
    pub fn detected() -> Option<Self> {
        detected().1
    }
}

/// What this kernel offers, its vmlinux BTF read once per process (the parsed BTF is dropped
/// afterwards: it is tens of MiB).
fn detected() -> &'static (KernelCt, Option<KernCtx>) {
    static DETECTED: std::sync::OnceLock<(KernelCt, Option<KernCtx>)> = std::sync::OnceLock::new();
    DETECTED.get_or_init(|| match KernelBtf::vmlinux() {
        Err(e) => (
            KernelCt::Own(format!("no kernel BTF (/sys/kernel/btf/vmlinux: {e})")),
            None,
        ),
        Ok(Err(e)) => (
            KernelCt::Own(format!("the kernel's BTF is unreadable: {e}")),
            None,
        ),
        Ok(Ok(btf)) => (KernelCt::from_btf(&btf), KernCtx::from_btf(&btf)),
    })
}

impl KernelCt {
    /// What this kernel offers, its vmlinux BTF read once per process.
    pub fn detected() -> &'static Self {
        &detected().0
    }

    /// What `btf` (vmlinux's) offers.
    pub fn from_btf(btf: &KernelBtf) -> Self {
        let ids = || -> Result<CtKfuncs, BtfError> {
            Ok(CtKfuncs {
                skb_lookup: btf.func_id("bpf_skb_ct_lookup")?,
                xdp_lookup: btf.func_id("bpf_xdp_ct_lookup")?,
                release: btf.func_id("bpf_ct_release")?,
                status_offset: btf.member_offset("nf_conn", "status")?,
            })
        };
        match ids() {
            Ok(k) => Self::Kernel(k),
            Err(BtfError::NoFunc(f)) => Self::Own(format!(
                "{f} is not in vmlinux's BTF (nf_conntrack built as a module, or a kernel before 6.0)"
            )),
            Err(e) => Self::Own(e.to_string()),
        }
    }

    /// The kfuncs, if the kernel's conntrack is used.
    pub fn kfuncs(&self) -> Option<&CtKfuncs> {
        match self {
            Self::Kernel(k) => Some(k),
            Self::Own(_) => None,
        }
    }
}

/// Why an object cannot be patched.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PatchError {
    #[error("the eBPF object is not a readable ELF file: {0}")]
    Elf(String),
    #[error("the eBPF object calls no kfunc {0:#x}: built from another source?")]
    Missing(u32),
}

/// `obj` with every kfunc call of the datapath resolved as `ct` and `kern` say. Each magic
/// number must be called at least once (an object built without them is not this datapath).
pub fn patch(obj: &[u8], ct: &KernelCt, kern: Option<KernCtx>) -> Result<Vec<u8>, PatchError> {
    let k = ct.kfuncs();
    let calls = [
        (CT_LOOKUP_SKB, k.map(|k| k.skb_lookup)),
        (CT_LOOKUP_XDP, k.map(|k| k.xdp_lookup)),
        (CT_RELEASE, k.map(|k| k.release)),
        (CAST_TO_KERN_CTX, kern.map(|k| k.cast)),
    ];
    let mut out = obj.to_vec();
    let mut seen = [0usize; 4];
    for (start, len) in code_sections(obj)? {
        let code = &mut out[start..start + len];
        for insn in code.chunks_exact_mut(8) {
            for (n, (magic, id)) in calls.iter().enumerate() {
                if rewrite(insn, *magic, *id) {
                    seen[n] += 1;
                }
            }
        }
    }
    if let Some(n) = seen.iter().position(|&c| c == 0) {
        return Err(PatchError::Missing(calls[n].0));
    }
    Ok(out)
}

/// Rewrite `insn` if it is `call magic`: into a kfunc call of `id`, or `r0 = 0` without one.
fn rewrite(insn: &mut [u8], magic: u32, id: Option<u32>) -> bool {
    let imm = u32::from_le_bytes([insn[4], insn[5], insn[6], insn[7]]);
    if insn[0] != OP_CALL || insn[1] != 0 || insn[2..4] != [0, 0] || imm != magic {
        return false;
    }
    match id {
        Some(id) => {
            insn[1] = PSEUDO_KFUNC_CALL << 4;
            insn[4..8].copy_from_slice(&id.to_le_bytes());
        }
        None => {
            insn[0] = OP_MOV64_IMM;
            insn[1] = 0;
            insn[4..8].copy_from_slice(&0u32.to_le_bytes());
        }
    }
    true
}

/// (file offset, size) of each executable section of the ELF object.
fn code_sections(obj: &[u8]) -> Result<Vec<(usize, usize)>, PatchError> {
    use object::{Object, ObjectSection, SectionFlags};
    let file = object::File::parse(obj).map_err(|e| PatchError::Elf(e.to_string()))?;
    let mut out = Vec::new();
    for s in file.sections() {
        let exec = matches!(s.flags(), SectionFlags::Elf { sh_flags } if sh_flags & u64::from(object::elf::SHF_EXECINSTR) != 0);
        if !exec {
            continue;
        }
        if let Some((start, len)) = s.file_range() {
            let (start, len) = (start as usize, len as usize);
            if start + len <= obj.len() && len % 8 == 0 {
                out.push((start, len));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(imm: u32) -> [u8; 8] {
        let mut i = [OP_CALL, 0, 0, 0, 0, 0, 0, 0];
        i[4..].copy_from_slice(&imm.to_le_bytes());
        i
    }

    #[test]
    fn a_magic_call_becomes_a_kfunc_call_or_r0_zero() {
        let mut i = call(CT_LOOKUP_SKB);
        assert!(rewrite(&mut i, CT_LOOKUP_SKB, Some(65687)));
        assert_eq!(i[0], OP_CALL);
        assert_eq!(i[1], 0x20, "src_reg 2 (BPF_PSEUDO_KFUNC_CALL), dst 0");
        assert_eq!(u32::from_le_bytes([i[4], i[5], i[6], i[7]]), 65687);
        let mut j = call(CT_RELEASE);
        assert!(rewrite(&mut j, CT_RELEASE, None));
        assert_eq!(j, [OP_MOV64_IMM, 0, 0, 0, 0, 0, 0, 0], "r0 = 0");
    }

    #[test]
    fn other_instructions_are_left_alone() {
        // A helper call (bpf_map_lookup_elem), a bpf-to-bpf call with the magic as its
        // offset, and the magic as a load's immediate.
        for mut i in [
            call(1),
            [OP_CALL, 0x10, 0, 0, 0, 0, 0, 0],
            [0x18, 0x01, 0, 0, 0, 0, 0, 0],
        ] {
            let before = i;
            assert!(!rewrite(&mut i, CT_LOOKUP_SKB, Some(7)));
            assert_eq!(i, before);
        }
        let mut pseudo = call(CT_LOOKUP_SKB);
        pseudo[1] = 0x10;
        assert!(
            !rewrite(&mut pseudo, CT_LOOKUP_SKB, Some(7)),
            "a bpf-to-bpf call"
        );
    }

    #[test]
    fn the_datapath_object_calls_every_kfunc_and_patches_both_ways() {
        let obj = super::super::OBJECT;
        let kernel = KernelCt::Kernel(CtKfuncs {
            skb_lookup: 11,
            xdp_lookup: 12,
            release: 13,
            status_offset: 128,
        });
        let kern = Some(KernCtx {
            cast: 14,
            mac_len_offset: 120,
        });
        let patched = patch(obj, &kernel, kern).expect("every kfunc is called");
        assert_eq!(patched.len(), obj.len());
        assert!(patched != obj, "calls were rewritten");
        // Patched once, nothing is left to patch.
        assert!(matches!(
            patch(&patched, &kernel, kern),
            Err(PatchError::Missing(_))
        ));
        let own = patch(obj, &KernelCt::Own("test".into()), None).expect("patched to r0 = 0");
        assert!(matches!(
            patch(&own, &kernel, kern),
            Err(PatchError::Missing(_))
        ));
        assert!(patch(b"not elf", &kernel, kern).is_err());
    }

    #[test]
    fn a_kernel_without_the_functions_gets_own_tables_with_the_reason() {
        let btf = super::super::btf::KernelBtf::parse(&[
            0x9f, 0xeb, 1, 0, 24, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0,
        ])
        .unwrap();
        match KernelCt::from_btf(&btf) {
            KernelCt::Own(why) => assert!(why.contains("bpf_skb_ct_lookup"), "{why}"),
            k => panic!("{k:?}"),
        }
    }
}
