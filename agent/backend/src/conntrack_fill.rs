//! The kernel's connection table of the current network namespace: how full it is.

/// `nf_conntrack_count` of `nf_conntrack_max` of the calling thread's network namespace; None
/// before conntrack is loaded there (or where `/proc/sys/net` cannot be read).
pub fn kernel_conntrack_fill() -> Option<(u64, u64)> {
    let read = |k: &str| {
        std::fs::read_to_string(format!("/proc/sys/net/netfilter/{k}"))
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    read("nf_conntrack_count").zip(read("nf_conntrack_max"))
}
