//! The eBPF backend: tc (tcx) and XDP programs over maps the agent fills.
//!
//! - [`maps`]: pure IR → map contents, plus a datapath simulator for tests;
//! - [`loader`]: the aya edge (load, pin, write slots, attach); [`backend`] is the
//!   [`peerwall_backend::Backend`] the CLI and the agent drive;
//! - [`inspect`]: `peerwall inspect`, decoding what is pinned; [`describe`]: the
//!   `compile --backend bpf` description of map contents;
//! - [`routing`]: the local-address mirror that spares new flows a FIB lookup, and its
//!   route watcher;
//! - [`meta`]: the names behind a slot's chain ids and rule bits; [`error`]: [`BpfError`];
//!   [`events`]: the datapath's ring of drops and flows.

pub mod backend;
pub mod describe;
pub mod error;
pub mod events;
pub mod inspect;
pub mod loader;
pub mod maps;
pub mod memory;
pub mod meta;
pub mod routing;
pub mod sweep;

pub use backend::BpfBackend;
pub use error::BpfError;
