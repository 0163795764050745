//! What went wrong talking to nftables: [`NftError`].

/// What went wrong talking to nftables.
#[derive(Debug, thiserror::Error)]
pub enum NftError {
    /// `nft` could not be started.
    #[error("could not run {program}: {source} (is the nftables package installed?)")]
    Spawn {
        /// Program.
        program: String,
        /// Cause.
        source: std::io::Error,
    },
    /// `nft` refused the request; its stderr is kept verbatim.
    #[error("nft {action} failed ({status}): {stderr}")]
    Failed {
        /// What was attempted.
        action: String,
        /// Exit status.
        status: String,
        /// nft's message.
        stderr: String,
    },
    /// The kernel refused a batch sent over netlink (nothing of it applied), or the socket
    /// failed.
    #[error("{action} failed: {source}")]
    Netlink {
        /// What was attempted.
        action: String,
        /// The kernel's errno, or the socket's error.
        source: std::io::Error,
    },
    /// A conntrack setting under `/proc/sys` could not be written (read-only in a container).
    #[error("could not write {path}: {source}")]
    Sysctl {
        /// The file.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// nft printed JSON we could not read.
    #[error("could not parse `nft -j` output: {0}")]
    Parse(#[from] serde_json::Error),
    /// nft listed an object without a field every object of its kind has.
    #[error("could not read `nft -j` output: {object} missing or not text in {value}")]
    Listing {
        /// Kind and field (`rule.chain`).
        object: String,
        /// The object as listed.
        value: String,
    },
    /// A table with our name exists and is not ours.
    #[error("table {family} {name} exists and is not owned by peerwall; refusing to touch it (rename the FirewallConfiguration table or remove the foreign table)")]
    NotOwned {
        /// Family.
        family: &'static str,
        /// Name.
        name: String,
    },
    /// A policy names a table the backend keeps for itself.
    #[error("table {0} is the one peerwall keeps ended connections in; rename the FirewallConfiguration's table")]
    Reserved(String),
}
