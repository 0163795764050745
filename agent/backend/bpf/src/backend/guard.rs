//! The guard of interfaces the datapath is not attached to yet ([`Guard`]): what the backend
//! asks of it after every apply and at upkeep.

use std::fmt;

use peerwall_backend::BackendError;

use super::BpfBackend;
use crate::loader::BpfError;

/// The nftables table (family `inet`) that drops what arrives on an interface the datapath is
/// meant to filter but is not attached to ([`Guard`]).
pub const GUARD_TABLE: &str = peerwall_backend::GUARD_TABLE;

/// What closes the gap between an interface appearing and the datapath attaching to it. The
/// datapath filters an interface once its tc link is attached, at the interface poll after
/// the device appears; a device made again under its name (Liqo's userspace WireGuard makes
/// `liqo-tunnel` anew each time its gateway container starts: `createLinkUserspace` in
/// `pkg/gateway/tunnel/wireguard/netlink.go`) would pass everything until then, and for as
/// long as no agent runs. The guard is an nftables table in the kernel, which holds without
/// the agent: every packet arriving on an interface that matches the backend's patterns and
/// whose ifindex is not one the datapath is attached to is dropped. Given by whoever builds
/// the backend (this crate neither renders nor writes nftables).
pub trait Guard: Send {
    /// Make the guard drop what arrives on interfaces matching `patterns` (names, or prefixes
    /// ending in `*`) other than `attached` (ifindexes): written when it differs from what
    /// was last written or from what the kernel holds. Some: the guard last written for the
    /// same patterns and interfaces was gone or changed behind the agent's back (a deleted
    /// table, a flushed chain, a rule added before the drop), and was put back.
    fn keep(
        &mut self,
        patterns: &[String],
        attached: &[u32],
    ) -> Result<Option<peerwall_backend::Drift>, BackendError>;
    /// Delete the guard, there or not.
    fn release(&mut self) -> Result<(), BackendError>;
}

/// The optional [`Guard`], shown by name in debug output.
pub(super) struct Guards(pub(super) Option<Box<dyn Guard>>);

impl fmt::Debug for Guards {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "Some(Guard)"
        } else {
            "None"
        })
    }
}

impl BpfBackend {
    /// What drops packets on interfaces the patterns pick before the datapath is attached
    /// to them ([`Guard`]); kept after every apply and by upkeep, released by
    /// [`delete`](Self::delete). Without one, such an interface passes everything until the
    /// next interface poll attaches to it.
    pub fn set_guard(&mut self, guard: Box<dyn Guard>) {
        self.guard = Guards(Some(guard));
    }

    /// Keep the guard in step with the interfaces the datapath is attached to (`attached`:
    /// their ifindexes). With the emergency switch on the guard goes: the switch lets
    /// everything through, interfaces not attached yet too.
    pub(super) fn keep_guard(
        &mut self,
        attached: Vec<u32>,
    ) -> Result<Option<peerwall_backend::Drift>, BpfError> {
        let Some(g) = self.guard.0.as_mut() else {
            return Ok(None);
        };
        if self.datapath.allow_all()? {
            g.release().map_err(BpfError::Guard)?;
            self.guarded = Some(attached);
            return Ok(None);
        }
        let drift = g.keep(&self.patterns, &attached).map_err(BpfError::Guard)?;
        self.guarded = Some(attached);
        Ok(drift)
    }

    /// The guard as the last apply left it: put back when someone removed or changed it, taken away
    /// while the emergency switch is on. Interfaces the patterns pick that appeared since
    /// are attached by the next apply, which the interface poll runs. Not before the first
    /// apply: until then the guard would know no attached interface.
    pub(super) fn repair_guard(&mut self) -> Result<Option<peerwall_backend::Drift>, BackendError> {
        let Some(attached) = self.guarded.clone().filter(|_| self.guard.0.is_some()) else {
            return Ok(None);
        };
        self.keep_guard(attached).map_err(super::failed(
            "keeping the guard of interfaces not attached yet",
        ))
    }
}
