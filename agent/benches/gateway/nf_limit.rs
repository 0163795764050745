//! The limit of a bpf program that runs *after* conntrack (issue "the eBPF datapath never
//! slower than nftables": `BPF_PROG_TYPE_NETFILTER` at the forward hook, where nftables'
//! chains run): the conntrack state read from the packet (`skb->_nfct`, no lookup), an
//! established packet accepted at once, any other looked up by its destination in one hash and
//! dropped when not there. What nftables' least filter of the same traffic does
//! (`NftSetConntrack`), as a bpf program: the bound for a datapath that takes the kernel's
//! conntrack result instead of finding it from tc, before conntrack ran.
//!
//! aya 0.13 neither loads nor attaches this program type and aya-ebpf has no section for it,
//! so the program is a dozen instructions assembled here and loaded with the `bpf(2)` calls
//! themselves: `BPF_MAP_CREATE`, `BPF_MAP_UPDATE_ELEM`, `BPF_PROG_LOAD` (type 32, expected
//! attach type `BPF_NETFILTER`, 45) and `BPF_LINK_CREATE` (`include/uapi/linux/bpf.h`,
//! `struct bpf_nf_ctx` in `include/net/netfilter/nf_bpf_link.h`). The link lives while its
//! descriptor does (held in [`LINK`] until [`remove`]); it hooks the namespace of the thread
//! that creates it. The packet's destination is read with `bpf_probe_read_kernel` from
//! `skb->data` (the IP header at the forward hook): about what a `bpf_dynptr_slice` costs.

use std::net::Ipv4Addr;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Mutex;

use peerwall_backend_bpf::loader::KernelBtf;

/// The netfilter link of the installed limit (and the map and program it holds).
static LINK: Mutex<Vec<OwnedFd>> = Mutex::new(Vec::new());

const BPF_MAP_CREATE: i64 = 0;
const BPF_MAP_UPDATE_ELEM: i64 = 2;
const BPF_PROG_LOAD: i64 = 5;
const BPF_LINK_CREATE: i64 = 28;
const BPF_MAP_TYPE_HASH: u32 = 1;
const BPF_PROG_TYPE_NETFILTER: u32 = 32;
const BPF_NETFILTER: u32 = 45;
const NFPROTO_IPV4: u32 = 2;
const NF_INET_FORWARD: u32 = 2;
const FUNC_MAP_LOOKUP_ELEM: i32 = 1;
const FUNC_PROBE_READ_KERNEL: i32 = 113;

fn bpf(cmd: i64, attr: &mut [u8]) -> std::io::Result<i64> {
    // SAFETY: `attr` is a zero-padded `union bpf_attr` of the command, alive for the call.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), attr.len()) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn put32(a: &mut [u8], at: usize, v: u32) {
    a[at..at + 4].copy_from_slice(&v.to_ne_bytes());
}

fn put64(a: &mut [u8], at: usize, v: u64) {
    a[at..at + 8].copy_from_slice(&v.to_ne_bytes());
}

/// One instruction (`struct bpf_insn`).
fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[0] = code;
    b[1] = (src << 4) | (dst & 0xf);
    b[2..4].copy_from_slice(&off.to_ne_bytes());
    b[4..8].copy_from_slice(&imm.to_ne_bytes());
    b
}

/// The program: `skb` from the context, its conntrack word, its data pointer; established
/// (`ctinfo` 0 or 3 with an entry) → `NF_ACCEPT`; else the destination looked up in map `fd`.
fn program(map: i32, off_nfct: i16, off_data: i16) -> Vec<u8> {
    const MOV_X: u8 = 0xbf;
    const MOV_K: u8 = 0xb7;
    const ADD_K: u8 = 0x07;
    const AND_K: u8 = 0x57;
    const LDX_DW: u8 = 0x79;
    const JEQ_K: u8 = 0x15;
    const CALL: u8 = 0x85;
    const EXIT: u8 = 0x95;
    let p = [
        insn(MOV_X, 6, 1, 0, 0),                     // 0: r6 = ctx
        insn(LDX_DW, 7, 6, 8, 0),                    // 1: r7 = ctx->skb
        insn(LDX_DW, 8, 7, off_nfct, 0),             // 2: r8 = skb->_nfct
        insn(MOV_X, 2, 8, 0, 0),                     // 3: r2 = r8
        insn(AND_K, 2, 0, 0, 7),                     // 4: r2 &= 7 (ctinfo)
        insn(JEQ_K, 8, 0, 2, 0),                     // 5: no entry: look up (to 8)
        insn(JEQ_K, 2, 0, 13, 0),                    // 6: IP_CT_ESTABLISHED: accept (to 20)
        insn(JEQ_K, 2, 0, 12, 3),                    // 7: IP_CT_ESTABLISHED_REPLY: accept (to 20)
        insn(LDX_DW, 3, 7, off_data, 0),             // 8: r3 = skb->data (the IP header)
        insn(ADD_K, 3, 0, 0, 16),                    // 9: r3 = &iph->daddr
        insn(MOV_X, 1, 10, 0, 0),                    // 10: r1 = fp
        insn(ADD_K, 1, 0, 0, -8),                    // 11: r1 = fp - 8
        insn(MOV_K, 2, 0, 0, 4),                     // 12: r2 = 4
        insn(CALL, 0, 0, 0, FUNC_PROBE_READ_KERNEL), // 13
        insn(0x18, 1, 1, 0, map),                    // 14: r1 = map (BPF_PSEUDO_MAP_FD)
        insn(0, 0, 0, 0, 0),                         // 15: (its upper half)
        insn(MOV_X, 2, 10, 0, 0),                    // 16: r2 = fp
        insn(ADD_K, 2, 0, 0, -8),                    // 17: r2 = fp - 8
        insn(CALL, 0, 0, 0, FUNC_MAP_LOOKUP_ELEM),   // 18
        insn(JEQ_K, 0, 0, 2, 0),                     // 19: not found: drop (to 22)
        insn(MOV_K, 0, 0, 0, 1),                     // 20: NF_ACCEPT
        insn(EXIT, 0, 0, 0, 0),                      // 21
        insn(MOV_K, 0, 0, 0, 0),                     // 22: NF_DROP
        insn(EXIT, 0, 0, 0, 0),                      // 23
    ];
    // Jump offsets count from the next instruction: 5 → 8, 6 and 7 → 20, 19 → 22.
    p.concat()
}

fn create_map(allowed: &[Ipv4Addr]) -> std::io::Result<OwnedFd> {
    let mut a = [0u8; 72];
    put32(&mut a, 0, BPF_MAP_TYPE_HASH);
    put32(&mut a, 4, 4);
    put32(&mut a, 8, 1);
    put32(&mut a, 12, allowed.len().max(1) as u32);
    // SAFETY: a new descriptor the kernel returned, owned from here.
    let fd = unsafe { OwnedFd::from_raw_fd(bpf(BPF_MAP_CREATE, &mut a)? as i32) };
    let value = [1u8];
    for ip in allowed {
        let key = ip.octets();
        let mut u = [0u8; 32];
        put32(&mut u, 0, std::os::fd::AsRawFd::as_raw_fd(&fd) as u32);
        put64(&mut u, 8, key.as_ptr() as u64);
        put64(&mut u, 16, value.as_ptr() as u64);
        bpf(BPF_MAP_UPDATE_ELEM, &mut u)?;
    }
    Ok(fd)
}

fn load(map: &OwnedFd, btf: &KernelBtf) -> std::io::Result<OwnedFd> {
    let off = |m: &str| {
        btf.member_offset("sk_buff", m)
            .map(|o| o as i16)
            .map_err(|e| std::io::Error::other(e.to_string()))
    };
    let code = program(
        std::os::fd::AsRawFd::as_raw_fd(map),
        off("_nfct")?,
        off("data")?,
    );
    let license = b"GPL\0";
    let mut log = vec![0u8; 1 << 16];
    let mut a = [0u8; 128];
    put32(&mut a, 0, BPF_PROG_TYPE_NETFILTER);
    put32(&mut a, 4, (code.len() / 8) as u32);
    put64(&mut a, 8, code.as_ptr() as u64);
    put64(&mut a, 16, license.as_ptr() as u64);
    put32(&mut a, 24, 1);
    put32(&mut a, 28, log.len() as u32);
    put64(&mut a, 32, log.as_mut_ptr() as u64);
    a[48..59].copy_from_slice(b"pw_nf_limit");
    put32(&mut a, 68, BPF_NETFILTER);
    match bpf(BPF_PROG_LOAD, &mut a) {
        // SAFETY: a new descriptor the kernel returned, owned from here.
        Ok(fd) => Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) }),
        Err(e) => {
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            Err(std::io::Error::other(format!(
                "loading the netfilter limit: {e}\n{}",
                String::from_utf8_lossy(&log[..end])
            )))
        }
    }
}

fn link(prog: &OwnedFd) -> std::io::Result<OwnedFd> {
    let mut a = [0u8; 64];
    put32(&mut a, 0, std::os::fd::AsRawFd::as_raw_fd(prog) as u32);
    put32(&mut a, 8, BPF_NETFILTER);
    put32(&mut a, 16, NFPROTO_IPV4);
    put32(&mut a, 20, NF_INET_FORWARD);
    // Priority 1: just after nftables' filter chains (0; conntrack ran in prerouting, at
    // -200). Not 0 itself: the kernel refuses a bpf link (EBUSY) at a priority another hook
    // holds, and iptables-legacy's filter table, once an earlier row used it in this
    // namespace, keeps its hooks at 0 for the namespace's life.
    put32(&mut a, 24, 1);
    // SAFETY: a new descriptor the kernel returned, owned from here.
    Ok(unsafe { OwnedFd::from_raw_fd(bpf(BPF_LINK_CREATE, &mut a)? as i32) })
}

/// Load the limit for `allowed` destinations and hook it into the forward hook of the
/// namespace of the calling thread.
pub(crate) fn install(allowed: &[Ipv4Addr]) -> std::io::Result<()> {
    let btf = KernelBtf::vmlinux()?.map_err(|e| std::io::Error::other(e.to_string()))?;
    let map = create_map(allowed)?;
    let prog = load(&map, &btf)?;
    let l = link(&prog)?;
    let mut held = LINK.lock().unwrap_or_else(|e| e.into_inner());
    held.extend([l, prog, map]);
    Ok(())
}

/// Unhook the limit: its link's descriptor closed.
pub(crate) fn remove() {
    LINK.lock().unwrap_or_else(|e| e.into_inner()).clear();
}
