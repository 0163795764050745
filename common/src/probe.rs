//! What the datapath records for a probe packet (`peerwall verdict --engine bpf`).

/// What the datapath decided for a probe packet (probe mode only). `LAST[0]`, per CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProbeRecord {
    /// Incremented per probe.
    pub seq: u32,
    /// [`crate::ActionCode`] of the final verdict.
    pub verdict: u8,
    /// 1 when some chain was on the path.
    pub has_chain: u8,
    /// 1 when a rule (not a policy) decided.
    pub has_rule: u8,
    /// [`crate::ActionCode`] of the first would-drop on the path, or 0 (none).
    pub audit: u8,
    /// Deciding chain id.
    pub chain: u32,
    /// Deciding rule index.
    pub rule: u32,
    /// Chain of the first would-drop.
    pub audit_chain: u32,
    /// Its rule index, or `u32::MAX` for the chain policy.
    pub audit_rule: u32,
}
