//! What peerwall has installed on a host (its nftables tables in this network namespace, a
//! bpf datapath pinned in a directory), and the commands that act on it without opening a
//! backend: remove it, flip its emergency switch, read its counters.

use std::path::Path;

use peerwall_backend::{BackendError, EventSource, RuleCounter};
use peerwall_backend_bpf::{inspect, loader};
use peerwall_backend_nftables::{switch, Nft, NftBackend, Runner};

use crate::BackendKind;

/// What peerwall has installed in this network namespace and pin directory.
#[derive(Debug, Default)]
pub struct Installed {
    /// peerwall's nftables tables here (`family name`).
    pub nft_tables: Vec<String>,
    /// Whether a bpf datapath is pinned in the pin directory.
    pub bpf: bool,
}

impl Installed {
    /// What was found, for logs and errors.
    pub fn describe(&self, pin_dir: &Path) -> String {
        let mut parts = Vec::new();
        if !self.nft_tables.is_empty() {
            parts.push(format!("nftables tables {}", self.nft_tables.join(", ")));
        }
        if self.bpf {
            parts.push(format!("a bpf datapath pinned in {}", pin_dir.display()));
        }
        if parts.is_empty() {
            format!(
                "no peerwall nftables table in this network namespace and no bpf datapath \
                 pinned in {}",
                pin_dir.display()
            )
        } else {
            parts.join(" and ")
        }
    }

    /// The backends found.
    pub fn backends(&self) -> Vec<BackendKind> {
        let mut b = Vec::new();
        if !self.nft_tables.is_empty() {
            b.push(BackendKind::Nftables);
        }
        if self.bpf {
            b.push(BackendKind::Bpf);
        }
        b
    }
}

/// Whether a bpf datapath is pinned in `pin_dir`.
pub fn bpf_pinned(pin_dir: &Path) -> bool {
    pin_dir.join(peerwall_common::map::ALLOW_ALL).exists()
}

/// peerwall's nftables tables in this network namespace (`family name`).
pub fn nft_tables() -> Result<Vec<String>, BackendError> {
    let listing = Nft::host()
        .list_ruleset_terse()
        .map_err(BackendError::host(
            peerwall_backend_nftables::NAME,
            "listing tables",
        ))?;
    Ok(listing
        .kernel_tables()
        .into_iter()
        .filter(|t| t.owner.is_some())
        .map(|t| format!("{} {}", t.family, t.name))
        .collect())
}

/// Find what is installed: peerwall's nftables tables in this network namespace (none when
/// `nft` cannot run, said in a warning) and a bpf datapath pinned in `pin_dir`.
pub fn installed(pin_dir: &Path) -> Installed {
    let nft_tables = match nft_tables() {
        Ok(tables) => tables,
        Err(e) => {
            tracing::warn!(error = %e, "cannot list nftables; looking for a bpf datapath only");
            Vec::new()
        }
    };
    Installed {
        nft_tables,
        bpf: bpf_pinned(pin_dir),
    }
}

/// Remove what `kind` installed here (bpf: the datapath pinned in `pin_dir`, detached with
/// its pins, and the table that kept the kernel tracking connections for it,
/// [`crate::tracking`]). Returns what was removed.
pub fn remove(kind: BackendKind, pin_dir: &Path) -> Result<Vec<String>, BackendError> {
    let name = kind.name();
    match kind {
        BackendKind::Bpf => {
            let gone = loader::remove_pins(pin_dir)
                .map_err(BackendError::host(name, "removing the pins"))?;
            // Not a failure of the removal: the datapath is gone either way.
            if let Err(e) = crate::tracking::Tracking::default().release() {
                tracing::warn!(error = %e, "could not delete the table that kept the kernel tracking connections");
            }
            // Without the datapath the guard would drop everything on the interfaces it
            // filtered.
            crate::guard::remove()?;
            Ok(gone)
        }
        BackendKind::Nftables => NftBackend::new(Nft::host())
            .delete_all()
            .map_err(BackendError::host(name, "deleting peerwall's tables")),
    }
}

/// Remove a datapath pinned in `pin_dir` (detached, its pins and slot metadata gone), whatever
/// backend runs now: gateway-pod mode cleans up after the gateways that left (the table that
/// kept their kernel tracking went with their namespace; this one's is not theirs). Nothing
/// pinned there is not an error.
pub fn forget_pins(pin_dir: &Path) -> Result<Vec<String>, BackendError> {
    loader::remove_pins(pin_dir).map_err(BackendError::host(
        BackendKind::Bpf.name(),
        "removing the pins",
    ))
}

/// Whether a datapath pinned in `pin_dir` still filters a device that exists, in any network
/// namespace ([`loader::filters_a_device`]): its pins must stay while it does (removing a
/// link pin detaches the program from traffic still flowing).
pub fn still_filtering(pin_dir: &Path) -> bool {
    loader::filters_a_device(pin_dir)
}

/// Turn the emergency switch of what `kind` installed here on (every packet passes) or off.
pub fn set_switch(kind: BackendKind, pin_dir: &Path, on: bool) -> Result<(), BackendError> {
    let name = kind.name();
    match kind {
        BackendKind::Bpf => {
            loader::set_allow_all_pinned(pin_dir, on)
                .map_err(BackendError::host(name, "setting the emergency switch"))?;
            // The switch lets everything through, interfaces the datapath is not attached to
            // yet too; the agent puts the guard back once the switch is off.
            if on {
                crate::guard::remove()?;
            }
            Ok(())
        }
        BackendKind::Nftables => switch::set(&Nft::host(), on)
            .map_err(BackendError::host(name, "setting the emergency switch")),
    }
}

/// The rule counters of what `kind` installed here.
pub fn counters(kind: BackendKind, pin_dir: &Path) -> Result<Vec<RuleCounter>, BackendError> {
    let name = kind.name();
    match kind {
        BackendKind::Bpf => inspect::inspect(pin_dir)
            .map(|i| i.counters())
            .map_err(BackendError::host(name, "reading the pinned datapath")),
        BackendKind::Nftables => NftBackend::new(Nft::host())
            .counters()
            .map_err(BackendError::host(name, "reading rule counters")),
    }
}

/// Nothing would ever arrive from what is installed here: it reports no events.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct NoEvents(String);

/// Where the events of what `kind` installed here come from (nftables: NFLOG group
/// `nflog_group`; bpf: the ring of the datapath pinned in `pin_dir`). Refused as input when
/// what is installed reports none.
pub fn events(
    kind: BackendKind,
    pin_dir: &Path,
    nflog_group: u16,
) -> Result<Box<dyn EventSource>, BackendError> {
    let name = kind.name();
    match kind {
        BackendKind::Nftables => {
            use peerwall_backend_nftables::events as nft_events;
            let listing = Nft::host()
                .list_ruleset_terse()
                .map_err(BackendError::host(
                    name,
                    "listing the ruleset for rule names",
                ))?;
            if !nft_events::logs_events(&listing, nflog_group) {
                return Err(BackendError::input(name, "reading events")(NoEvents(
                    format!(
                    "no peerwall rule here reports events to NFLOG group {nflog_group}: nothing \
                     would ever arrive. Events come from `peerwall agent --events` (or \
                     --flow-log); a plain `peerwall apply` installs no log rules"
                ),
                )));
            }
            let names = nft_events::Names::default();
            names.set(nft_events::Names::of_listing(&listing));
            let src = nft_events::Nflog::bind(
                nflog_group,
                names,
                peerwall_backend_nftables::EVENT_INTERVAL,
            )
            .map_err(BackendError::host(
                name,
                "listening on the NFLOG group (an agent may hold it: use --agent)",
            ))?;
            Ok(Box::new(src))
        }
        BackendKind::Bpf => {
            let on = peerwall_backend_bpf::events::events_enabled(pin_dir).map_err(
                BackendError::host(name, "reading the datapath's configuration"),
            )?;
            if !on {
                return Err(BackendError::input(name, "reading events")(NoEvents(
                    format!(
                        "the bpf datapath pinned in {} reports no events: nothing would ever \
                     arrive. Events come from `peerwall agent --backend bpf --events` (or \
                     --flow-log); a plain `peerwall apply` turns them off",
                        pin_dir.display()
                    ),
                )));
            }
            let src = peerwall_backend_bpf::events::BpfEvents::open(pin_dir)
                .map_err(BackendError::host(name, "opening the datapath's events"))?;
            Ok(Box::new(src))
        }
    }
}

/// What the bpf datapath pinned in `pin_dir` holds (`peerwall inspect`): its programs and
/// links, maps and their fill, slots, counters, and its guard in this namespace's nftables
/// ([`crate::guard`]), printed in `format` (JSON: one object, the guard under `guard`).
pub fn inspect(pin_dir: &Path, format: crate::rendering::Format) -> Result<String, BackendError> {
    let name = BackendKind::Bpf.name();
    let i = inspect::inspect(pin_dir)
        .map_err(BackendError::host(name, "reading the pinned datapath"))?;
    // The guard lives in nftables, beside the pins (this namespace's ruleset); a host that
    // cannot list it (no `nft`) still gets the datapath, and is told.
    let guard = crate::guard::rules();
    match format {
        crate::rendering::Format::Text => Ok(format!(
            "{}{}",
            inspect::text(&i),
            match &guard {
                Ok(g) => crate::guard::text(g.as_deref(), i.allow_all),
                Err(e) => format!("guard UNKNOWN: {e}\n"),
            }
        )),
        crate::rendering::Format::Json => {
            let mut v =
                serde_json::to_value(&i).map_err(BackendError::host(name, "writing JSON"))?;
            if let Some(o) = v.as_object_mut() {
                match &guard {
                    Ok(g) => o.insert("guard".into(), crate::guard::json(g.as_deref())),
                    Err(e) => o.insert("guard_error".into(), e.to_string().into()),
                };
            }
            Ok(format!("{v}\n"))
        }
    }
}

/// Put `boot` in force as an nftables table here, unless peerwall's tables are here already
/// (its policy, or the boot table of an earlier call): the boot policy `peerwall boot` and the
/// CNI plugin install, and what the bpf backend holds until its tunnel is attached: one
/// listing and one transaction ([`NftBackend::hold_where_none`]). Ok(true): put in force now.
pub fn hold_boot_in_nftables(boot: &peerwall_policy::ir::Policy) -> Result<bool, BackendError> {
    NftBackend::new(Nft::host())
        .hold_where_none(boot)
        .map_err(BackendError::host(
            peerwall_backend_nftables::NAME,
            "holding the boot policy in nftables",
        ))
}
