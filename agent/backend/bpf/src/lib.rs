//! The eBPF backend: tc (tcx) and XDP programs over maps the agent fills.
//!
//! - [`maps`]: pure IR → map contents, plus a datapath simulator for tests;
//! - [`loader`]: the aya edge (load, pin, write slots, attach); [`backend`] is the
//!   [`peerwall_backend::Backend`] the CLI and the agent drive;
//! - [`inspect`]: `peerwall inspect`, decoding what is pinned; [`view`]: the
//!   `compile --backend bpf` view of map contents.

pub mod backend;
pub mod events;
pub mod inspect;
pub mod loader;
pub mod maps;
pub mod view;

pub use backend::BpfBackend;
