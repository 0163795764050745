//! What every backend shares: the [`Backend`] interface, the reports it gives back, and
//! [`InNetns`], which runs any backend inside another network namespace.
//! Implementations: `peerwall-backend-nftables` (one atomic nft transaction per apply) and
//! `peerwall-backend-bpf` (tc/XDP programs over maps; the programs themselves are `ebpf/`).
//! The CLI and the agent drive both through this trait only, as `Box<dyn Backend>`
//! (`peerwall-backend-select` opens one by name).

pub mod conntrack_fill;
pub mod error;
pub mod events;
pub mod in_netns;
pub mod kept;
pub mod revoke;

use serde::Serialize;

use peerwall_policy::ir::{Policy, SetChange};

pub use conntrack_fill::kernel_conntrack_fill;
pub use error::{BackendError, Fault, Report};
pub use events::{Event, EventError, EventFilter, EventKind, EventSource, FlowLimiter, IfNames};
pub use in_netns::{InNetns, InNetnsError};
pub use kept::Kept;

/// Packet and byte counts of one rule (`table/chain/rule`), as either backend reads them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RuleCounter {
    /// Table.
    pub table: String,
    /// Chain.
    pub chain: String,
    /// Rule name.
    pub rule: String,
    /// Packets.
    pub packets: u64,
    /// Bytes.
    pub bytes: u64,
}

/// Something that differs in the kernel from what a backend applied.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum Drift {
    /// The table is gone.
    Missing {
        /// Table.
        table: String,
    },
    /// Chains, rules or set elements were changed.
    Modified {
        /// Table.
        table: String,
    },
}

/// A tracked connection by its original direction (the packet that opened it): what
/// [`Observe::flows`] lists and [`Revoke::end_flows`] ends. ICMP echo: the identifier in
/// `sport`, 0 in `dport`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Flow {
    /// Source address.
    pub src: std::net::IpAddr,
    /// Destination address.
    pub dst: std::net::IpAddr,
    /// IP protocol number.
    pub proto: u8,
    /// Source port (ICMP echo: identifier).
    pub sport: u16,
    /// Destination port.
    pub dport: u16,
}

/// An interface of the host as a backend sees it: name and index.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct HostInterface {
    /// Name.
    pub name: String,
    /// Index.
    pub ifindex: u32,
}

/// Putting the policy IR in force in one network namespace: what the agent's engine and
/// `peerwall apply` drive.
///
/// Contract: [`Enforce::apply`] makes `policy` the whole policy in force, in one step that
/// either happens completely or leaves the previous policy in force; applying the same policy
/// twice changes nothing in the kernel.
pub trait Enforce: Send {
    /// `nftables` or `bpf`.
    fn name(&self) -> &'static str;

    /// Make `policy` the whole policy in force.
    fn apply(&mut self, policy: &Policy) -> Result<Report, BackendError>;

    /// Make `policy` the whole policy in force, knowing that it differs from the last one
    /// applied only by `changes` (named address sets edited in place,
    /// [`Policy::edit_set`]): a backend that can change just those elements in the kernel
    /// does so, in O(changes); the default applies `policy` whole. Same contract as
    /// [`Enforce::apply`].
    fn update_sets(
        &mut self,
        policy: &Policy,
        changes: &[SetChange],
    ) -> Result<Report, BackendError> {
        let _ = changes;
        self.apply(policy)
    }

    /// Before the first apply of a process that applied nothing yet (a one-shot `peerwall
    /// apply`): take over what is installed and equal to what `policy` would make, so that
    /// applying it keeps it (and its counters). The default takes nothing over.
    fn adopt(&mut self, policy: &Policy) -> Result<(), BackendError> {
        let _ = policy;
        Ok(())
    }

    /// Do now the part of the first apply that needs no policy and is slow (bpf: verify the
    /// programs interfaces will run), so that work on a node's shared CPUs can be scheduled
    /// apart from the wait for the policy source (`gateway_pods::gate`). The default: nothing.
    fn warm_up(&mut self) -> Result<(), BackendError> {
        Ok(())
    }

    /// Remove everything this backend installed; returns what was removed.
    fn delete(&mut self) -> Result<Vec<String>, BackendError>;

    /// Remove what this enforcer itself applied (its policy's tables), and nothing another
    /// enforcer of the same namespace holds: the hand-over from the nftables enforcer that
    /// keeps a bpf gateway's policy while its datapath loads to the datapath, whose own
    /// nftables tables (boot, guard, tracking) stay. The default: [`Enforce::delete`].
    fn withdraw(&mut self) -> Result<Vec<String>, BackendError> {
        self.delete()
    }

    /// Restore what drifted; returns what was repaired. Called periodically by the agent.
    fn repair(&mut self) -> Result<Vec<Drift>, BackendError> {
        Ok(Vec::new())
    }

    /// The part of the host outside the policy that the backend follows (bpf: the
    /// interfaces it resolves and attaches to). When it changes, the caller applies again.
    fn environment(&self) -> Vec<HostInterface> {
        Vec::new()
    }

    /// Whether the datapath classifies packets before the host's NAT (bpf: at ingress,
    /// before prerouting's DNAT), and so needs the NAT tables in force (Liqo's remapping) to
    /// classify on the addresses the forward hook would see. nftables' forward hook sees
    /// through NAT by itself: false.
    fn classifies_before_nat(&self) -> bool {
        false
    }
}

/// Reading what is in force: counters, drift, the emergency switch, the connections tracked
/// and the events (the agent's metrics and `/events`, `peerwall status`, `observe`).
pub trait Observe {
    /// Rule counters of what is in force.
    fn counters(&mut self) -> Result<Vec<RuleCounter>, BackendError>;

    /// What in the kernel differs from what was applied (backends that cannot drift: none).
    fn drift(&mut self) -> Result<Vec<Drift>, BackendError> {
        Ok(Vec::new())
    }

    /// Whether the backend's emergency switch (`peerwall allow-all on`) lets everything
    /// through, as last seen; backends without one: false.
    fn allow_all(&mut self) -> Result<bool, BackendError> {
        Ok(false)
    }

    /// How full the connection-tracking table the datapath relies on is: (entries,
    /// capacity). bpf: its own flow table; nftables: the kernel's conntrack of this network
    /// namespace. None when unknown.
    fn conntrack(&mut self) -> Result<Option<(u64, u64)>, BackendError> {
        Ok(None)
    }

    /// The connections the datapath tracks (nftables: the kernel's conntrack of this network
    /// namespace; bpf: its flow table), by original direction.
    fn flows(&mut self) -> Result<Vec<Flow>, BackendError>;

    /// Where the events of what is in force come from (drops, rejects, would-drops, and with
    /// the flow log accepted flows; [`events`]). Call it on the backend's own thread (inside its
    /// network namespace); the source may then be read from any thread. Err([`EventError::Off`])
    /// when the backend was built without events.
    fn events(&mut self) -> Result<Box<dyn EventSource>, EventError> {
        Err(EventError::Off)
    }
}

/// Ending connections the policy no longer allows (the agent's revocation), and letting
/// them go again.
pub trait Revoke {
    /// End these connections: every later packet of them, either way, is `ct state invalid`
    /// and none starts them again mid-stream (a TCP packet other than a SYN opens no flow), so
    /// only the policy in force decides anew. Returns how many were found and ended.
    fn end_flows(&mut self, flows: &[Flow]) -> Result<usize, BackendError>;

    /// The connections this backend keeps ended ([`end_flows`](Self::end_flows): their packets
    /// dropped, either way, while either side sends), by the tuple they were ended by.
    fn ended_flows(&mut self) -> Result<Vec<Flow>, BackendError> {
        Ok(Vec::new())
    }

    /// Let these ended connections go: their next packet is judged afresh by the policy in
    /// force (a change allows them again). Returns how many were held.
    fn release_flows(&mut self, _flows: &[Flow]) -> Result<usize, BackendError> {
        Ok(0)
    }
}

/// The nftables table (family `inet`) by which the bpf backend drops what arrives on an
/// interface its datapath is not attached to yet (`peerwall_backend_bpf::backend::Guard`);
/// the nftables backend deletes one it finds, left by a bpf datapath that ran before it.
pub const GUARD_TABLE: &str = "peerwall-guard";

/// A gateway's boot policy (`peerwall boot`): held before the first apply, let go once the
/// policy in force supersedes it.
pub trait HoldBoot {
    /// Let a gateway's boot table go (`peerwall boot`: an nftables table denying what comes
    /// from the tunnel until the agent's policy is in force), now that the policy applied last
    /// supersedes it. Ok(true): gone (or never there); Ok(false): not yet, ask again later
    /// (bpf: no interface matching `tunnel` is attached yet, and only the boot table's rules,
    /// which match by name, hold for a tunnel created later). nftables: an apply already
    /// deletes every owned table it does not want, in the same transaction.
    fn release_boot(&mut self, table: &str, tunnel: &str) -> Result<bool, BackendError> {
        let _ = (table, tunnel);
        Ok(true)
    }

    /// Put a gateway's boot policy in force now, by means that hold for a tunnel created
    /// later, where nothing of peerwall's enforces yet (a new gateway: before the first apply,
    /// which waits for the policy source). nftables: the boot table alone, replaced by the
    /// first apply. bpf attaches to interfaces that exist, so until an interface matching
    /// `tunnel` is attached (its program verified, at the next interface poll) the boot policy
    /// goes in as an nftables table too, which [`release_boot`](Self::release_boot) lets go
    /// once the tunnel is attached. Ok(true): held now; Ok(false): nothing to do (peerwall
    /// already enforces here, or the backend holds nothing).
    fn hold_boot(&mut self, boot: &Policy, tunnel: &str) -> Result<bool, BackendError> {
        let _ = (boot, tunnel);
        Ok(false)
    }

    /// [`hold_boot`](Self::hold_boot) by a backend opened for it and dropped after (a gateway
    /// waiting for its turn to load the bpf datapath): it need not keep what it put in force
    /// (nftables: one listing and one transaction instead of an apply's three listings).
    fn hold_boot_alone(&mut self, boot: &Policy, tunnel: &str) -> Result<bool, BackendError> {
        self.hold_boot(boot, tunnel)
    }
}

/// An enforcer of the policy IR in one network namespace: the one face of every backend,
/// object-safe (each backend's typed reports and errors travel as [`Report`] and
/// [`BackendError`]), made of what its callers need, each a trait of its own ([`Enforce`],
/// [`Observe`], [`Revoke`], [`HoldBoot`]); a caller that needs one part takes
/// `&mut dyn Observe` (say), which a `&mut dyn Backend` becomes.
pub trait Backend: Enforce + Observe + Revoke + HoldBoot {}

impl<T: Enforce + Observe + Revoke + HoldBoot + ?Sized> Backend for T {}
