//! What an apply did: [`ApplyReport`], the line `peerwall apply` prints and the agent logs.

use serde::Serialize;

/// What an apply did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ApplyReport {
    /// Tables created or recreated.
    pub recreated: Vec<String>,
    /// Tables whose set elements changed in place.
    pub updated: Vec<String>,
    /// Owned tables removed.
    pub deleted: Vec<String>,
    /// Tables left as they were (nothing to change).
    pub kept: Vec<String>,
    /// Set element additions and deletions sent.
    pub element_changes: usize,
    /// The element changes went straight over netlink, without the `nft` process
    /// ([`crate::netlink`]).
    pub over_netlink: bool,
    /// Whether anything was sent to the kernel.
    pub changed: bool,
}

impl std::fmt::Display for ApplyReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |v: &[String]| {
            if v.is_empty() {
                "-".to_string()
            } else {
                v.join(",")
            }
        };
        write!(
            f,
            "created or recreated {}; updated {} ({} element changes{}); kept {}; removed {}",
            list(&self.recreated),
            list(&self.updated),
            self.element_changes,
            if self.over_netlink { ", netlink" } else { "" },
            list(&self.kept),
            list(&self.deleted)
        )
    }
}
