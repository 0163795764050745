//! The few facts the loader reads from the kernel's BTF (`/sys/kernel/btf/vmlinux`): the type
//! id of a kernel function (a kfunc the datapath calls) and the byte offset of a struct's
//! member (a field of a kernel object the datapath reads). aya 0.14 relocates neither for us
//! (its BTF reader keeps member offsets private), and these two questions need only the type
//! section walked once: a reader of the format's header, its type records and its strings.
//!
//! Format: `include/uapi/linux/btf.h` and Documentation/bpf/btf.rst. Little-endian only (the
//! targets peerwall runs on); type ids start at 1 (0 is `void`).

use std::collections::HashMap;

const MAGIC: u16 = 0xeb9f;

const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_FUNC: u32 = 12;

/// Why the kernel's BTF cannot answer.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BtfError {
    #[error("not BTF: {0}")]
    Malformed(&'static str),
    #[error("BTF type kind {0} is unknown to this reader")]
    UnknownKind(u32),
    #[error("the kernel's BTF has no function {0:?}")]
    NoFunc(String),
    #[error("the kernel's BTF has no struct {0:?}")]
    NoStruct(String),
    #[error("struct {0} has no member {1:?} (or it is a bit field)")]
    NoMember(String, String),
}

/// One named type record: its kind, and for structs and unions their members
/// (name, bit offset).
#[derive(Debug)]
struct Record {
    id: u32,
    kind: u32,
    members: Vec<(String, u32)>,
}

/// The kernel's BTF, as far as [`func_id`](Self::func_id) and
/// [`member_offset`](Self::member_offset) need it.
#[derive(Debug)]
pub struct KernelBtf {
    by_name: HashMap<String, Vec<Record>>,
}

fn u32_at(b: &[u8], at: usize) -> Result<u32, BtfError> {
    b.get(at..at + 4)
        .and_then(|s| s.try_into().ok())
        .map(u32::from_le_bytes)
        .ok_or(BtfError::Malformed("truncated"))
}

fn str_at(strings: &[u8], off: u32) -> Result<&str, BtfError> {
    let s = strings
        .get(off as usize..)
        .ok_or(BtfError::Malformed("string offset out of range"))?;
    let end = s.iter().position(|&c| c == 0).unwrap_or(s.len());
    std::str::from_utf8(&s[..end]).map_err(|_| BtfError::Malformed("string not UTF-8"))
}

impl KernelBtf {
    /// `/sys/kernel/btf/vmlinux`, read and walked.
    pub fn vmlinux() -> std::io::Result<Result<Self, BtfError>> {
        std::fs::read("/sys/kernel/btf/vmlinux").map(|b| Self::parse(&b))
    }

    /// Walk a (base, not split) BTF blob.
    pub fn parse(b: &[u8]) -> Result<Self, BtfError> {
        let magic = b
            .get(0..2)
            .map(|m| u16::from_le_bytes([m[0], m[1]]))
            .ok_or(BtfError::Malformed("empty"))?;
        if magic != MAGIC {
            return Err(BtfError::Malformed("bad magic (or big-endian)"));
        }
        let hdr_len = u32_at(b, 4)? as usize;
        let (type_off, type_len) = (u32_at(b, 8)? as usize, u32_at(b, 12)? as usize);
        let (str_off, str_len) = (u32_at(b, 16)? as usize, u32_at(b, 20)? as usize);
        let types = b
            .get(hdr_len + type_off..hdr_len + type_off + type_len)
            .ok_or(BtfError::Malformed("type section out of range"))?;
        let strings = b
            .get(hdr_len + str_off..hdr_len + str_off + str_len)
            .ok_or(BtfError::Malformed("string section out of range"))?;
        let mut by_name: HashMap<String, Vec<Record>> = HashMap::new();
        let (mut at, mut id) = (0usize, 1u32);
        while at < types.len() {
            let name_off = u32_at(types, at)?;
            let info = u32_at(types, at + 4)?;
            let (kind, vlen, bitfields) = ((info >> 24) & 0x1f, info & 0xffff, info >> 31 == 1);
            at += 12;
            // The bytes each kind's record carries after its 12-byte common part.
            let extra = match kind {
                1 | 14 | 17 => 4,                      // INT, VAR, DECL_TAG
                3 => 12,                               // ARRAY
                4 | 5 | 15 | 19 => 12 * vlen as usize, // STRUCT, UNION, DATASEC, ENUM64
                6 | 13 => 8 * vlen as usize,           // ENUM, FUNC_PROTO
                2 | 7..=12 | 16 | 18 => 0,
                k => return Err(BtfError::UnknownKind(k)),
            };
            let name = str_at(strings, name_off)?;
            if !name.is_empty() && matches!(kind, KIND_STRUCT | KIND_UNION | KIND_FUNC) {
                let mut members = Vec::new();
                if kind != KIND_FUNC {
                    for m in 0..vlen as usize {
                        let base = at + 12 * m;
                        let mname = str_at(strings, u32_at(types, base)?)?;
                        let off = u32_at(types, base + 8)?;
                        // With the kind flag, the offset's top byte is a bit field's size:
                        // no byte offset to give for one.
                        if bitfields && off >> 24 != 0 {
                            continue;
                        }
                        members.push((mname.to_string(), off & 0x00ff_ffff));
                    }
                }
                by_name
                    .entry(name.to_string())
                    .or_default()
                    .push(Record { id, kind, members });
            }
            at += extra;
            id += 1;
        }
        Ok(Self { by_name })
    }

    /// The type id of kernel function `name` (what a kfunc call's immediate holds).
    pub fn func_id(&self, name: &str) -> Result<u32, BtfError> {
        self.by_name
            .get(name)
            .and_then(|rs| rs.iter().find(|r| r.kind == KIND_FUNC))
            .map(|r| r.id)
            .ok_or_else(|| BtfError::NoFunc(name.into()))
    }

    /// The byte offset of `member` in `struct name` (a byte-aligned member).
    pub fn member_offset(&self, name: &str, member: &str) -> Result<u32, BtfError> {
        let s = self
            .by_name
            .get(name)
            .and_then(|rs| rs.iter().find(|r| r.kind == KIND_STRUCT))
            .ok_or_else(|| BtfError::NoStruct(name.into()))?;
        s.members
            .iter()
            .find(|(n, off)| n == member && off % 8 == 0)
            .map(|(_, off)| off / 8)
            .ok_or_else(|| BtfError::NoMember(name.into(), member.into()))
    }
}

/// Give the heap memory the load freed back to the system. aya's loader parses the kernel's
/// BTF for every load (`EbpfLoader::new`: tens of MiB, freed with the loader), on the thread
/// that loads; in the gateway-pod mode each gateway loads on a thread of its own, and glibc
/// keeps what a thread's arena freed, so the agent grew by that much per gateway (`cargo
/// xtask bench-peers`).
pub(super) fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only hands free heap pages back; it touches no live allocation.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A BTF blob: `int`, `struct conn { int a; long status; }`, a FUNC_PROTO and
    /// `FUNC lookup`, the strings given.
    fn blob() -> Vec<u8> {
        let strings = b"\0int\0conn\0a\0status\0lookup\0";
        let s = |x: &str| {
            let hay = std::str::from_utf8(strings).unwrap();
            hay.find(&format!("\0{x}\0")).unwrap() as u32 + 1
        };
        let mut t: Vec<u32> = Vec::new();
        // [1] INT "int": size 4, then its encoding word.
        t.extend([s("int"), 1 << 24, 4, 32]);
        // [2] STRUCT "conn", 2 members, size 16: a at bit 0, status at bit 64.
        t.extend([s("conn"), (4 << 24) | 2, 16]);
        t.extend([s("a"), 1, 0, s("status"), 1, 64]);
        // [3] FUNC_PROTO (anon), 1 param.
        t.extend([0, (13 << 24) | 1, 1, 0, 1]);
        // [4] FUNC "lookup" of proto 3.
        t.extend([s("lookup"), 12 << 24, 3]);
        let types: Vec<u8> = t.iter().flat_map(|w| w.to_le_bytes()).collect();
        let mut b = Vec::new();
        b.extend(0xeb9fu16.to_le_bytes());
        b.extend([1, 0]);
        b.extend(24u32.to_le_bytes());
        b.extend(0u32.to_le_bytes());
        b.extend((types.len() as u32).to_le_bytes());
        b.extend((types.len() as u32).to_le_bytes());
        b.extend((strings.len() as u32).to_le_bytes());
        b.extend(types);
        b.extend(strings);
        b
    }

    #[test]
    fn functions_and_member_offsets_are_found_by_name() {
        let btf = KernelBtf::parse(&blob()).unwrap();
        assert_eq!(btf.func_id("lookup"), Ok(4));
        assert_eq!(btf.member_offset("conn", "status"), Ok(8));
        assert_eq!(btf.member_offset("conn", "a"), Ok(0));
        assert_eq!(
            btf.func_id("conn"),
            Err(BtfError::NoFunc("conn".into())),
            "a struct is no function"
        );
        assert!(btf.member_offset("conn", "mark").is_err());
        assert!(btf.member_offset("lookup", "a").is_err());
    }

    #[test]
    fn malformed_blobs_are_refused_not_misread() {
        let b = blob();
        assert!(KernelBtf::parse(&b[..30]).is_err(), "truncated");
        let mut bad = b.clone();
        bad[0] = 0;
        assert!(KernelBtf::parse(&bad).is_err(), "magic");
        let mut kind = b.clone();
        // The INT record's info word: kind 31 does not exist.
        kind[24 + 7] = 31;
        assert_eq!(
            KernelBtf::parse(&kind).err(),
            Some(BtfError::UnknownKind(31))
        );
    }

    #[test]
    fn this_kernels_conntrack_lookup_is_found_when_its_btf_is_there() {
        let Ok(Ok(btf)) = KernelBtf::vmlinux() else {
            return;
        };
        // What `bpftool btf dump file /sys/kernel/btf/vmlinux` names: the ids differ per build.
        if let Ok(id) = btf.func_id("bpf_skb_ct_lookup") {
            assert!(id > 0);
            assert!(btf.func_id("bpf_ct_release").is_ok());
            let off = btf.member_offset("nf_conn", "status").unwrap();
            assert!(off > 0 && off % 8 == 0, "status is a long: {off}");
        }
    }
}
