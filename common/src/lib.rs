//! Types shared by the peerwall eBPF datapath and user space.
//!
//! Every type here is `#[repr(C)]` with explicit padding so that the kernel and user space
//! agree on the byte layout. The `user` feature is for user-space-only trait impls.
#![no_std]

/// Verdict codes written by the datapath into per-rule records and used by the agent.
///
/// Kept numerically identical to the policy IR's action order so that both sides agree.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActionCode {
    /// Let the packet continue to the next chain.
    Accept = 0,
    /// Discard silently.
    Drop = 1,
    /// Discard and answer with ICMP/ICMPv6 port unreachable.
    Reject = 2,
    /// A marking action that does not decide (evaluation continues).
    Continue = 3,
}

impl ActionCode {
    /// Decode a raw byte; unknown values decode as `None` (callers fail closed).
    pub const fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Self::Accept),
            1 => Some(Self::Drop),
            2 => Some(Self::Reject),
            3 => Some(Self::Continue),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn action_codes_round_trip() {
        for a in [
            ActionCode::Accept,
            ActionCode::Drop,
            ActionCode::Reject,
            ActionCode::Continue,
        ] {
            assert_eq!(ActionCode::from_u8(a as u8), Some(a));
        }
        assert_eq!(ActionCode::from_u8(9), None);
    }
}
