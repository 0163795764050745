//! Loading the object: its maps created (or adopted from `pin_dir`'s pins) with the sizes and
//! globals [`LoadOptions`] asks for, the datapath's state read back from them.

use std::path::Path;

use peerwall_common::map;

use super::options::{self, new_flow_slots, ENDED_IDLE_NS, NEW_FLOW_MASK};
use super::{
    btf, is_bpffs, layout, pins, pool, BpfError, Datapath, KernelCt, Layout, LoadOptions, OBJECT,
};

impl Datapath {
    /// Load the object with its maps pinned in `pin_dir` (reusing maps already pinned there)
    /// as `opts` says: what [`load_with`](Self::load_with) does without a spare.
    pub(super) fn load_fresh(pin_dir: &Path, opts: &LoadOptions) -> Result<Self, BpfError> {
        let flows = opts.flows;
        // The nearest directory that exists must be on bpffs (the rest is created there, e.g.
        // `<pin-dir>/gateways/<peer>_<uid8>` of the gateway-pod mode).
        let existing = pin_dir
            .ancestors()
            .find(|a| a.exists())
            .unwrap_or(Path::new("/"));
        if !is_bpffs(existing) {
            return Err(BpfError::NoBpffs(existing.to_path_buf()));
        }
        std::fs::create_dir_all(pin_dir.join("links")).map_err(|source| BpfError::Io {
            path: pin_dir.to_path_buf(),
            source,
        })?;
        let ncpus = aya::util::nr_cpus().map_err(|(_, source)| BpfError::Io {
            path: "/sys/devices/system/cpu/possible".into(),
            source,
        })?;
        // The kernel's connection table, or the datapath's own, whose tables then hold little
        // (`options.rs`); the loader is a kept one (`pool.rs`) for loads of this shape.
        let (kernel, families) = options::kernel_table(opts)?;
        let flows = flows.or((families != 0).then_some(options::KERNEL_MODE_FLOWS));
        let shape = pool::Shape {
            flows,
            hosts: opts.hosts,
            counters: opts.counters,
            baselines: opts.baselines,
        };
        let mut pooled = pool::take(shape, OBJECT);
        let loader = &mut pooled.loader;
        loader.default_map_pin_directory(pin_dir);
        let (object, tc_any) = options::conntrack_object(&kernel, families, loader)?;
        // FLOWS_NEW is direct-mapped: a power of two of slots, the datapath's mask to match.
        let new_slots = flows.map_or(peerwall_common::NEW_FLOW_SLOTS, new_flow_slots);
        for p in pins::drop_stale_caches(pin_dir, new_slots)? {
            tracing::info!(pin = %p, "dropped a cache or new-flow table of another layout");
        }
        // A `FLOW_SEEN` this load makes (none pinned, or one of another layout dropped above)
        // holds no stamp of the flows the pinned tables and the kernel already track.
        let seen_new = !pin_dir.join(map::FLOW_SEEN).exists();
        let new_mask = new_slots - 1;
        if let Some(n) = flows {
            loader.map_max_entries(map::FLOWS, n);
            loader.map_max_entries(map::FLOWS_NEW, new_slots);
        }
        if let Some(n) = opts.hosts {
            for name in layout::HOST_MAPS {
                loader.map_max_entries(name, n);
            }
            let lines = peerwall_common::host_lines_for(n);
            loader.map_max_entries(map::HOST_LINES, peerwall_common::host_line_entries(lines));
        }
        if let Some(n) = opts.counters {
            for name in layout::COUNTER_MAPS {
                loader.map_max_entries(name, n);
            }
        }
        options::size_baselines(opts, loader);
        loader.override_global(NEW_FLOW_MASK, pool::global_u32(new_mask), true);
        let ended_idle = opts.ended_idle_ns();
        loader.override_global(ENDED_IDLE_NS, pool::global_u64(ended_idle), true);
        options::size_per_cpu_caches(ncpus as u32, loader);
        // Pins of a datapath from before `ENDED_UNTIL` may hold marks it does not cover.
        let ended_until_new = !pin_dir.join(map::ENDED_UNTIL).exists();
        let started = std::time::Instant::now();
        let ebpf = loader.load(&object)?;
        let ms = started.elapsed().as_secs_f64() * 1e3;
        tracing::debug!(ms, "datapath object loaded (its maps)");
        pooled.give_back();
        btf::return_freed_memory();
        let mut b = Self {
            ebpf,
            pin_dir: pin_dir.to_path_buf(),
            slots: [None, None],
            active: 0,
            diagnostics: Vec::new(),
            seen_checked: None,
            conntrack: KernelCt::Own(String::new()),
            kernel_families: 0,
            layout: Layout {
                hosts: 0,
                counters: 0,
            },
            ended_idle_ns: ended_idle,
            tc_any,
        };
        if ended_until_new {
            b.cover_pinned_marks()?;
        }
        b.layout = b.read_layout()?;
        b.lines_off()?;
        if seen_new {
            b.distrust_new_seen()?;
        }
        let mut c = b.config()?;
        b.active = c.active & 1;
        // For `inspect`: which table this program reads (the program reads its global).
        use peerwall_common::{flags, kfunc};
        let mut want = c.flags & !(flags::KERNEL_CT4 | flags::KERNEL_CT6);
        if families & kfunc::KERNEL_CT_V4 != 0 {
            want |= flags::KERNEL_CT4;
        }
        if families & kfunc::KERNEL_CT_V6 != 0 {
            want |= flags::KERNEL_CT6;
        }
        if want != c.flags {
            c.flags = want;
            b.set_config(c)?;
        }
        b.conntrack = kernel;
        b.kernel_families = families;
        Ok(b)
    }
}
