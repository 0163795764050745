//! The user-facing intent API: Liqo's FirewallConfiguration and how to read it from YAML.

pub mod load;
pub mod types;

pub use types::{FirewallConfiguration, FirewallConfigurationSpec};
