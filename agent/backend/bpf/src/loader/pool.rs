//! Loaders kept for the next load. `aya::EbpfLoader::new` parses the kernel's whole BTF
//! (`/sys/kernel/btf/vmlinux`, 5.5 MB on this VM's 6.18: 34 ms and 20 MiB of memory) on every
//! call, for CO-RE relocations; this datapath's object has none (its `.BTF.ext` says so, checked
//! here at run time and in a test), and its kfunc calls are resolved by [`super::kfunc`]. So a
//! loader is made once, its BTF dropped, and reused by later loads: a node starting fifty
//! gateways parses the BTF once per load running at the same time, not fifty times.
//!
//! A reused loader keeps what earlier loads set. Every load sets the same globals and the pin
//! directory again; the map capacities it asks for are its [`Shape`], and a loader is reused
//! only by loads of the same shape, so no load inherits a capacity it did not ask for.

use std::sync::{Mutex, PoisonError};

use aya::EbpfLoader;

/// The map capacities a load sets (the flow tables', the exact-match maps', the counters', the
/// baselines'): what a loader keeps from one load to the next besides the settings every load
/// repeats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Shape {
    pub flows: Option<u32>,
    pub hosts: Option<u32>,
    pub counters: Option<u32>,
    /// The baseline tables at full size ([`super::LoadOptions::baselines`]).
    pub baselines: bool,
}

/// Loaders between loads, with the shape of the loads that used them.
static IDLE: Mutex<Vec<(Shape, EbpfLoader<'static>)>> = Mutex::new(Vec::new());

/// A loader for a load of `shape` of `object`: a kept one, or a new one. A new one keeps the
/// kernel's BTF only when `object` needs it (CO-RE relocations), and is then not kept.
pub(super) fn take(shape: Shape, object: &[u8]) -> Pooled {
    let needs_btf = needs_kernel_btf(object);
    if !needs_btf {
        let mut idle = IDLE.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(i) = idle.iter().position(|(s, _)| *s == shape) {
            let (_, loader) = idle.swap_remove(i);
            return Pooled {
                shape,
                loader,
                keep: true,
            };
        }
    }
    let mut loader = EbpfLoader::new();
    if !needs_btf {
        loader.btf(None);
        super::btf::return_freed_memory();
    }
    Pooled {
        shape,
        loader,
        keep: !needs_btf,
    }
}

/// A loader taken for one load; [`give_back`](Self::give_back) keeps it for the next.
pub(super) struct Pooled {
    shape: Shape,
    pub loader: EbpfLoader<'static>,
    keep: bool,
}

impl Pooled {
    /// Keep the loader for a later load of the same shape (one without the kernel's BTF only).
    pub fn give_back(self) {
        if self.keep {
            IDLE.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push((self.shape, self.loader));
        }
    }
}

/// A global's value that outlives every loader: the loaders are kept, and aya borrows the
/// values they are given. Interned, so the memory is bounded by the distinct values a process
/// uses (a few: flags, offsets, a mask, a timeout).
pub(super) fn global_u32(v: u32) -> &'static u32 {
    static VALUES: Mutex<Vec<&'static u32>> = Mutex::new(Vec::new());
    intern(&VALUES, v)
}

/// [`global_u32`] for 64-bit globals.
pub(super) fn global_u64(v: u64) -> &'static u64 {
    static VALUES: Mutex<Vec<&'static u64>> = Mutex::new(Vec::new());
    intern(&VALUES, v)
}

/// `v` from `values`, or leaked once and added there.
fn intern<T: PartialEq>(values: &Mutex<Vec<&'static T>>, v: T) -> &'static T {
    let mut values = values.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(&r) = values.iter().find(|&&r| *r == v) {
        return r;
    }
    let r: &'static T = Box::leak(Box::new(v));
    values.push(r);
    r
}

/// Whether the ELF object `object` carries CO-RE relocations (a `.BTF.ext` whose relocation
/// section is not empty), which need the kernel's BTF. Anything unreadable counts as needing
/// it: the loader then parses the BTF as aya does by default.
pub(super) fn needs_kernel_btf(object: &[u8]) -> bool {
    core_relocations(object).is_none_or(|n| n > 0)
}

/// The byte length of `.BTF.ext`'s CO-RE relocation records in the little-endian ELF64 object
/// `o` (0 without `.BTF.ext`); None if it cannot be read.
fn core_relocations(o: &[u8]) -> Option<u32> {
    let u16_at = |at: usize| o.get(at..at + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at = |at: usize| {
        o.get(at..at + 4)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_le_bytes)
    };
    let u64_at = |at: usize| {
        o.get(at..at + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    };
    // ELF64 header: class 2 (64-bit), data 1 (little-endian).
    if o.get(0..4)? != b"\x7fELF" || o.get(4)? != &2 || o.get(5)? != &1 {
        return None;
    }
    let shoff = usize::try_from(u64_at(0x28)?).ok()?;
    let (shentsize, shnum, shstrndx) = (
        usize::from(u16_at(0x3a)?),
        usize::from(u16_at(0x3c)?),
        usize::from(u16_at(0x3e)?),
    );
    // Section header: name (u32) at 0, offset (u64) at 0x18, size (u64) at 0x20.
    let section = |i: usize| {
        let h = shoff.checked_add(i.checked_mul(shentsize)?)?;
        let name = u32_at(h)? as usize;
        let off = usize::try_from(u64_at(h + 0x18)?).ok()?;
        let size = usize::try_from(u64_at(h + 0x20)?).ok()?;
        Some((name, off, size))
    };
    let (_, names, _) = section(shstrndx)?;
    for i in 0..shnum {
        let (name, off, size) = section(i)?;
        let n = o.get(names.checked_add(name)?..)?;
        let n = &n[..n.iter().position(|&c| c == 0)?];
        if n != b".BTF.ext" {
            continue;
        }
        // btf_ext_header: magic u16, version u8, flags u8, hdr_len u32, then func_info
        // off/len, line_info off/len, and (hdr_len >= 32) core_relo off/len.
        let hdr_len = u32_at(off + 4)?;
        if size < 8 || u16_at(off)? != 0xeb9f {
            return None;
        }
        return if hdr_len >= 32 {
            u32_at(off + 28)
        } else {
            Some(0)
        };
    }
    Some(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_datapath_needs_no_kernel_btf() {
        // If this fails, the object gained CO-RE relocations: the loaders then parse the
        // kernel's BTF again (correct, slower); check that is what was meant.
        assert_eq!(core_relocations(super::super::OBJECT), Some(0));
        assert!(!needs_kernel_btf(super::super::OBJECT));
    }

    #[test]
    fn unreadable_objects_count_as_needing_it() {
        assert!(needs_kernel_btf(b""));
        assert!(needs_kernel_btf(b"\x7fELF\x01\x01"));
        let mut o = super::super::OBJECT.to_vec();
        o.truncate(0x40);
        assert!(needs_kernel_btf(&o));
    }

    #[test]
    fn globals_are_interned() {
        assert!(std::ptr::eq(global_u32(7), global_u32(7)));
        assert!(!std::ptr::eq(global_u32(7), global_u32(8)));
        assert_eq!(*global_u64(1 << 40), 1 << 40);
    }
}
