//! The bpf backend's boot tables ([`peerwall_backend_bpf::backend::BootTables`]): a gateway's
//! boot policy held as an nftables table until its tunnel is attached
//! ([`crate::installed::hold_boot_in_nftables`]), then deleted over netlink in the namespace
//! the backend's thread is in ([`peerwall_backend_nftables::netlink::table`]), the kernel's
//! work alone rather than an `nft` process per table.

use peerwall_backend::BackendError;
use peerwall_backend_bpf::backend::BootTables;
use peerwall_backend_nftables::netlink::{message::nfproto, Session};
use peerwall_policy::ir::{Policy, TableFamily};

/// nftables, for the boot tables: its netlink socket opened at the first release, kept.
#[derive(Debug)]
pub struct NftBootTables {
    session: Session,
}

impl Default for NftBootTables {
    fn default() -> Self {
        Self {
            session: Session::new(None),
        }
    }
}

impl BootTables for NftBootTables {
    fn hold(&mut self, boot: &Policy) -> Result<bool, BackendError> {
        crate::installed::hold_boot_in_nftables(boot)
    }

    fn release(&mut self, table: &str) -> Result<(), BackendError> {
        self.session
            .delete_table(nfproto(TableFamily::Inet), table)
            .map(|_there| ())
            .map_err(BackendError::host(
                peerwall_backend_nftables::NAME,
                "deleting the boot table",
            ))
    }
}
