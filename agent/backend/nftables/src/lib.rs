//! The nftables backend (default), in flow order:
//!
//! - [`model`]: typed tables, sets, chains, rules, expressions and transaction commands;
//! - [`render`]: IR → the model, one table per FirewallConfiguration ([`dispatch`]: long runs
//!   of address lookups as one verdict-map jump); [`text`] for humans;
//! - [`mod@plan`]: pure diff of models: unchanged structure → set element add/delete
//!   (O(changes)); changed structure → the table is recreated in the same transaction;
//! - [`runner`]: who executes a transaction: the `nft` process ([`Nft`], the only place the
//!   model becomes libnftables JSON, see [`json`]) or an in-memory fake ([`FakeNft`]);
//! - [`NftBackend`]: checks ownership, applies one transaction, snapshots what it applied,
//!   detects and repairs drift (someone deleted or edited our table), reads rule counters;
//! - [`ended`]: the table that keeps the connections the backend ended ended;
//! - [`listing`]: what `nft -j list` says, as typed objects (parsed by [`json::read`], called by
//!   the runners only): ownership, counters, drift, the switch and adoption are questions asked
//!   of it; [`error`] and [`report`]: what a call gives back.

// size: the backend itself: its state (what it applied, snapshots, the connections it keeps
// ended) and the Backend face over it; every concern it drives lives in its own module.

pub mod conntrack;
pub mod decided;
pub mod dispatch;
pub mod ended;
pub mod error;
pub mod events;
pub mod expr;
pub mod json;
pub mod listing;
pub mod merge;
pub mod model;
pub mod netlink;
pub mod plan;
pub mod render;
pub mod report;
pub mod runner;
pub mod switch;
pub mod text;
mod update;

use std::collections::BTreeMap;

use crate::listing::Listing;

pub use error::NftError;
pub use listing::KernelTable;
pub use model::Table;
pub use peerwall_backend::RuleCounter;
use peerwall_backend::{BackendError, Report};
use peerwall_policy::ir;
pub use plan::{plan, Plan};
pub use render::{render_policy, render_table, EventOptions, RenderOptions, RenderedTable};
pub use report::ApplyReport;
pub use runner::{FakeNft, Nft, Runner};

pub use peerwall_backend::Drift;

/// How often drift checks also compare set elements (a full listing), besides the structure
/// checked on every call.
pub const FULL_DRIFT_CHECK: std::time::Duration = std::time::Duration::from_secs(5);

/// A full drift check waits until no change was applied for this long, so that the listing
/// (about 0.4–1 s at 100k elements, the engine blocked meanwhile) does not delay changes
/// arriving during churn...
pub const QUIET_BEFORE_FULL_CHECK: std::time::Duration = std::time::Duration::from_secs(2);

/// ...but never longer than this after the last full check.
pub const FULL_DRIFT_CHECK_MAX: std::time::Duration = std::time::Duration::from_secs(60);

/// The nftables backend: applies policies, remembers what it applied, detects drift. Generic
/// over who runs the transactions: the `nft` process by default, [`FakeNft`] in tests.
#[derive(Debug, Default)]
pub struct NftBackend<R: Runner = Nft> {
    nft: R,
    applied: BTreeMap<String, RenderedTable>,
    /// Per table, its structure as the kernel listed it right after it was applied (set
    /// elements aside: they are compared with what was applied, so an element update costs
    /// no listing of a 100k-element set).
    snapshots: BTreeMap<String, Listing>,
    last_full_check: Option<std::time::Instant>,
    /// When a policy or set change was last applied.
    last_change: Option<std::time::Instant>,
    events: Option<EventOptions>,
    names: events::Names,
    /// The emergency switch as last seen in the kernel ([`switch`]).
    allow_all: bool,
    /// The connections [`Observe::flows`](peerwall_backend::Observe::flows) listed last, by the forward hook's view it returned
    /// (what the policy judges) → the original tuple a deletion names: they differ where
    /// DNAT rewrote the destination (Liqo's remapping).
    listed: std::collections::HashMap<peerwall_backend::Flow, peerwall_backend::Flow>,
    /// Connections this backend ends stay ended for this many seconds after their last packet
    /// ([`ended`]); None: they are only deleted from conntrack.
    ended: Option<u32>,
    /// The connections put into the ended table.
    kept: peerwall_backend::Kept,
    /// The ended table is in force: created by the first connection ended (a gateway that
    /// never ends one pays nothing for it), or found in the kernel at an apply, or at once
    /// where conntrack's mid-stream pickup cannot be switched off (its `mid_stream` rule).
    ended_in_use: bool,
    /// Whether the first apply with a policy tried switching mid-stream pickup off.
    pickup_checked: bool,
    /// The ruleset (terse) a drift check that found nothing listed, and when: the rule
    /// counters read in the same tick take it instead of listing again (each listing is an
    /// `nft` process; a node of 50 gateways ticking every 200 ms ran 500 a second).
    quiet_listing: Option<(std::time::Instant, Listing)>,
    /// Render without the decided-flow cache ([`decided`]; `--nft-flow-cache off`).
    no_flow_cache: bool,
    /// The ruleset generation at which a drift check last found the kernel as applied
    /// ([`netlink::generation`]): while the kernel reports the same, nothing was committed
    /// since, and a drift check lists nothing. Forgotten at every change this backend makes.
    verified: Option<Verified>,
}

/// A drift check that found nothing, by the generation read just before its listing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Verified {
    generation: u32,
    /// Whether it compared set elements too.
    elements: bool,
}

/// How long a drift check's listing serves the counters read after it (`quiet_listing`).
const LISTING_REUSE: std::time::Duration = std::time::Duration::from_millis(100);

impl<R: Runner> NftBackend<R> {
    /// A backend driving `nft` as given.
    pub fn new(nft: R) -> Self {
        Self {
            nft,
            applied: BTreeMap::new(),
            snapshots: BTreeMap::new(),
            last_full_check: None,
            last_change: None,
            events: None,
            names: events::Names::default(),
            allow_all: false,
            listed: std::collections::HashMap::new(),
            ended: None,
            kept: peerwall_backend::Kept::new(ended::CAPACITY / 2),
            ended_in_use: false,
            pickup_checked: false,
            quiet_listing: None,
            no_flow_cache: false,
            verified: None,
        }
    }

    /// Forget what the last drift check listed and verified: this backend is about to change
    /// the kernel.
    fn changing(&mut self) {
        self.quiet_listing = None;
        self.verified = None;
    }

    /// Keep the connections [`peerwall_backend::Revoke::end_flows`] ends ended for `secs` seconds after their
    /// last packet, whichever side sends ([`ended`]); None: only delete them from conntrack.
    pub fn with_ended_connections(mut self, secs: Option<u32>) -> Self {
        self.ended = secs;
        self
    }

    /// Give chains the decided-flow cache where it helps (`on`, the default; [`decided`]), or
    /// render every chain without it: every packet walks, and every rule's counter counts
    /// every packet it decided.
    pub fn with_flow_cache(mut self, on: bool) -> Self {
        self.no_flow_cache = !on;
        self
    }

    /// Whether the emergency switch was on at the last apply or drift check.
    pub fn allow_all(&self) -> bool {
        self.allow_all
    }

    /// Also log events (drops, rejects, would-drops; with `flow_log` accepted flows) to NFLOG
    /// group `ev.group`, read back by [`peerwall_backend::Observe::events`].
    pub fn with_events(mut self, ev: EventOptions) -> Self {
        self.events = Some(ev);
        self
    }

    fn snapshot(listing: &Listing, family: ir::TableFamily, name: &str) -> Listing {
        listing.table(family, name).unwrap_or_default()
    }

    /// Whether the ended-connections table is in use and `desired` takes its name.
    fn reserved_clash(&self, desired: &[RenderedTable]) -> Result<(), NftError> {
        let in_use = self.ended.is_some() && self.ended_in_use && !desired.is_empty();
        if in_use && desired.iter().any(|t| t.name == ended::ENDED_TABLE) {
            return Err(NftError::Reserved(ended::ENDED_TABLE.into()));
        }
        Ok(())
    }

    /// The tables installed for the policy's `desired` (checked by [`Self::reserved_clash`]):
    /// each with the emergency switch as last read (`allow_all`), and the ended-connections
    /// table where it is in use (true: added, last).
    fn complete(&self, desired: Vec<RenderedTable>) -> (Vec<RenderedTable>, bool) {
        let mut desired: Vec<RenderedTable> = desired
            .into_iter()
            .map(|t| switch::with_switch(t, self.allow_all))
            .collect();
        let mut added = false;
        if let Some(secs) = self
            .ended
            .filter(|_| self.ended_in_use && !desired.is_empty())
        {
            desired.push(switch::with_switch(ended::table(secs), self.allow_all));
            added = true;
        }
        (desired, added)
    }

    /// Apply `desired` when it changes only set elements of the tables this process applied
    /// (the same tables, each of the same structure, [`plan::elements_only`]): one transaction
    /// planned from what was applied, without listing the kernel (at a thousand
    /// NetworkPolicies the listing costs far more than the change) nor snapshotting it after
    /// (a snapshot holds no elements). `Err(desired)` when the change is more than that, when
    /// nothing changes (the full path checks the kernel still holds the tables) or when the
    /// kernel refuses the transaction (a table deleted or replaced behind this process's
    /// back): the full path lists the kernel and plans against it.
    fn apply_elements_only(
        &mut self,
        desired: Vec<RenderedTable>,
    ) -> Result<ApplyReport, Vec<RenderedTable>> {
        // A reserved name: the full path reports it.
        if self.applied.is_empty() || self.reserved_clash(&desired).is_err() {
            return Err(desired);
        }
        let (completed, added) = self.complete(desired);
        let report = match plan::elements_only(&self.applied, &completed) {
            Some(plan) if !plan.commands.is_empty() => {
                let mut report = plan.report;
                report.over_netlink = self.nft.edits_elements_over_netlink()
                    && netlink::element_edits(&plan.commands).is_some();
                match self.nft.transaction(&plan.commands) {
                    Ok(()) => Some(report),
                    Err(e) => {
                        tracing::debug!(error = %e, "element changes refused; planning against the kernel");
                        None
                    }
                }
            }
            _ => None,
        };
        match report {
            Some(report) => {
                for t in completed {
                    self.applied.insert(t.name.clone(), t);
                }
                Ok(report)
            }
            None => {
                let mut back = completed;
                if added {
                    back.pop();
                }
                Err(back)
            }
        }
    }

    /// The runner.
    pub fn nft(&self) -> &R {
        &self.nft
    }

    /// The runner, for a backend that starts over on the same kernel (a new process).
    pub fn into_nft(self) -> R {
        self.nft
    }

    /// `policy` as this backend renders it (with its events' rules, if any).
    fn render(&self, policy: &ir::Policy) -> Vec<RenderedTable> {
        render_policy(
            policy,
            RenderOptions {
                events: self.events,
                no_flow_cache: self.no_flow_cache,
                ..RenderOptions::default()
            },
        )
    }

    /// Make the kernel's peerwall tables equal `policy`, in one transaction.
    /// Foreign tables are never touched; a name clash with one is an error and changes nothing.
    pub fn apply(&mut self, policy: &ir::Policy) -> Result<ApplyReport, NftError> {
        self.apply_rendered(self.render(policy))
    }

    /// Like [`apply`](Self::apply), with rendering options (the probe forces counters).
    pub fn apply_rendered(&mut self, desired: Vec<RenderedTable>) -> Result<ApplyReport, NftError> {
        self.changing();
        let now = std::time::Instant::now();
        self.last_change = Some(now);
        // What the first apply writes is known: the first element comparison waits its turn
        // instead of blocking the changes that follow a start.
        self.last_full_check.get_or_insert(now);
        // A change of set elements only (a pod relabelled, created or deleted under a
        // NetworkPolicy tier whose sets are named by their selectors): planned from what
        // this process applied, the kernel not listed.
        let desired = match self.apply_elements_only(desired) {
            Ok(report) => return Ok(report),
            Err(desired) => desired,
        };
        let listing = self.nft.list_ruleset_terse()?;
        // The bpf backend's guard, left by a datapath that ran here before (the node switched
        // backends), goes in the same transaction as the policy: it drops what arrives on
        // every interface it names that no datapath is attached to, which is all of them now.
        let guard = if desired.is_empty() {
            Vec::new()
        } else {
            vec![peerwall_backend::GUARD_TABLE.to_string()]
        };
        let (report, desired) = self.transact_against(desired, &listing, &guard)?;
        // One listing after the transaction for every table's snapshot.
        let after = self.nft.list_ruleset_terse()?;
        for t in desired {
            let touched = report.recreated.contains(&t.name) || report.updated.contains(&t.name);
            if touched || !self.snapshots.contains_key(&t.name) {
                let snap = Self::snapshot(&after, t.family, &t.name);
                self.snapshots.insert(t.name.clone(), snap);
            }
            self.applied.insert(t.name.clone(), t);
        }
        let applied: Vec<RenderedTable> = self.applied.values().cloned().collect();
        self.names.set_tables(&applied);
        Ok(report)
    }

    /// The part of an apply that follows the kernel's listing: the emergency switch and
    /// conntrack's pickup as found there, name clashes with foreign tables, then the plan
    /// against `listing` in one transaction, deleting too the unmarked tables `foreign_ours`
    /// names. Returns the report and the completed tables.
    fn transact_against(
        &mut self,
        desired: Vec<RenderedTable>,
        listing: &Listing,
        foreign_ours: &[String],
    ) -> Result<(ApplyReport, Vec<RenderedTable>), NftError> {
        // The emergency switch stays on through new policies.
        self.allow_all = switch::is_on(listing);
        // The agent (which ends connections), before its first policy: no TCP connection
        // picked up mid-stream (conntrack makes such a segment `invalid`, as the reference
        // and the bpf datapath do). Where the switch is read-only (a container), the ended
        // table's `mid_stream` rule drops them instead, so the table is in force from the
        // start. One-shot commands leave the namespace's switch as it is.
        if !self.pickup_checked && self.ended.is_some() && !desired.is_empty() {
            self.pickup_checked = true;
            if let Some(Err(e)) = self.nft.conntrack().map(|ct| ct.no_pickup()) {
                tracing::info!(error = %e, "conntrack's mid-stream pickup stays on here (read-only switch): the ended table drops what it would pick up");
                self.ended_in_use = true;
            }
        }
        // Once in use, with any policy in force (none: nothing to keep ended, and no table
        // left behind).
        self.ended_in_use |= listing
            .table(ir::TableFamily::Inet, ended::ENDED_TABLE)
            .is_some();
        self.reserved_clash(&desired)?;
        let (desired, _) = self.complete(desired);
        let kernel = listing.kernel_tables();
        let plan = plan::plan(&self.applied, &desired, &kernel, foreign_ours)?;
        let mut report = plan.report;
        if !plan.commands.is_empty() {
            report.over_netlink = self.nft.edits_elements_over_netlink()
                && netlink::element_edits(&plan.commands).is_some();
            self.nft.transaction(&plan.commands)?;
        }
        for name in &report.deleted {
            self.applied.remove(name);
            self.snapshots.remove(name);
        }
        Ok((report, desired))
    }

    /// Put `policy` in force where peerwall has no table in this namespace yet, from one
    /// listing and one transaction: Ok(false), nothing changed, when an owned table is there.
    /// Asking first and then applying lists the ruleset three times (the question, the
    /// apply's plan, its snapshots after), each an `nft` process. For a backend used once and
    /// dropped: the boot table the CNI plugin and the bpf backend hold until a gateway's own
    /// policy is in force. It records nothing of what it put there (no snapshot, nothing
    /// applied), so a backend that goes on would neither repair that table nor open it with
    /// the emergency switch ([`HoldBoot::hold_boot_alone`](peerwall_backend::HoldBoot::hold_boot_alone);
    /// `hold_boot`, whose backend goes on enforcing, applies instead).
    pub fn hold_where_none(&mut self, policy: &ir::Policy) -> Result<bool, NftError> {
        self.changing();
        let listing = self.nft.list_ruleset_terse()?;
        if listing.kernel_tables().iter().any(|t| t.owner.is_some()) {
            return Ok(false);
        }
        self.transact_against(self.render(policy), &listing, &[])?;
        Ok(true)
    }

    /// For a backend that applied nothing yet (a one-shot `peerwall apply`, a restarted
    /// process): take as applied every owned table in the kernel that already is what `policy`
    /// renders, so that the next [`apply`](Self::apply) keeps it, counters included, instead
    /// of recreating it. A table is taken when the digest it was created with
    /// ([`json::digest`], in its marker chain) is the desired table's and its set elements are
    /// the desired ones; anything else is recreated as before. Returns the tables taken.
    pub fn adopt_unchanged(&mut self, policy: &ir::Policy) -> Result<Vec<String>, NftError> {
        self.changing();
        if !self.applied.is_empty() {
            return Ok(Vec::new());
        }
        let terse = self.nft.list_ruleset_terse()?;
        let allow_all = switch::is_on(&terse);
        let kernel = terse.kernel_tables();
        let mut full: Option<Listing> = None;
        let mut adopted = Vec::new();
        for t in self.render(policy) {
            let t = switch::with_switch(t, allow_all);
            let ours = kernel.iter().any(|k| {
                k.name == t.name
                    && k.family == t.family.nft()
                    && k.owner.as_deref() == Some(&t.owner)
            });
            let Some(now) = terse.table(t.family, &t.name) else {
                continue;
            };
            if !ours || now.digest() != Some(json::digest(&t).as_str()) {
                continue;
            }
            // The digest says what the table was created as; the outline that it still is
            // (a rule deleted, a chain flushed behind peerwall's back: recreated).
            if now.outline() != json::created_listing(&t)?.outline() {
                continue;
            }
            if full.is_none() {
                full = Some(self.nft.list_ruleset()?);
            }
            if !same_elements(full.as_ref(), &t) {
                continue;
            }
            self.snapshots.insert(t.name.clone(), now);
            adopted.push(t.name.clone());
            self.applied.insert(t.name.clone(), t);
        }
        let applied: Vec<RenderedTable> = self.applied.values().cloned().collect();
        self.names.set_tables(&applied);
        Ok(adopted)
    }

    /// The names of the tables peerwall owns in this namespace (whoever applied them).
    pub fn owned_tables(&self) -> Result<Vec<String>, NftError> {
        Ok(self
            .nft
            .list_ruleset_terse()?
            .kernel_tables()
            .into_iter()
            .filter(|t| t.owner.is_some())
            .map(|t| t.name)
            .collect())
    }

    /// Delete the tables this enforcer applied that are still in the kernel, in one
    /// transaction, and nothing else of peerwall's here (another enforcer's boot, guard or
    /// tracking tables stay). Returns their names.
    pub fn withdraw_applied(&mut self) -> Result<Vec<String>, NftError> {
        self.changing();
        let listing = self.nft.list_ruleset_terse()?.kernel_tables();
        let gone: Vec<(ir::TableFamily, String)> = self
            .applied
            .values()
            .filter(|t| {
                listing
                    .iter()
                    .any(|k| k.name == t.name && k.family == t.family.nft())
            })
            .map(|t| (t.family, t.name.clone()))
            .collect();
        let cmds: Vec<model::Command<'_>> = gone
            .iter()
            .map(|(family, name)| model::Command::Delete {
                family: *family,
                name: name.clone(),
            })
            .collect();
        if !cmds.is_empty() {
            self.nft.transaction(&cmds)?;
        }
        self.applied.clear();
        self.snapshots.clear();
        Ok(gone.into_iter().map(|(_, n)| n).collect())
    }

    /// Delete every table owned by peerwall in this namespace (not only the ones this process
    /// applied). Returns their names.
    pub fn delete_all(&mut self) -> Result<Vec<String>, NftError> {
        self.changing();
        let owned: Vec<KernelTable> = self
            .nft
            .list_ruleset_terse()?
            .kernel_tables()
            .into_iter()
            .filter(|t| t.owner.is_some())
            .collect();
        let cmds: Vec<model::Command<'_>> = owned
            .iter()
            .filter_map(|t| {
                ir::TableFamily::from_nft(&t.family).map(|family| model::Command::Delete {
                    family,
                    name: t.name.clone(),
                })
            })
            .collect();
        if !cmds.is_empty() {
            self.nft.transaction(&cmds)?;
        }
        self.applied.clear();
        self.snapshots.clear();
        Ok(owned.into_iter().map(|t| t.name).collect())
    }

    /// Counters of all rules in owned tables.
    pub fn counters(&self) -> Result<Vec<RuleCounter>, NftError> {
        self.counters_in(&self.nft.list_ruleset_terse()?)
    }

    /// [`counters`](Self::counters), from the listing the drift check of this tick took when
    /// it is that recent and nothing was applied since.
    pub fn counters_this_tick(&mut self) -> Result<Vec<RuleCounter>, NftError> {
        match self.quiet_listing.take() {
            Some((at, terse)) if at.elapsed() < LISTING_REUSE => self.counters_in(&terse),
            _ => self.counters(),
        }
    }

    fn counters_in(&self, terse: &Listing) -> Result<Vec<RuleCounter>, NftError> {
        let mut sets = Vec::new();
        for (family, table, name) in terse.merged_counting_sets() {
            sets.extend(self.nft.list_set(&family, &table, &name)?.sets);
        }
        Ok(terse.rule_counters(&sets))
    }

    /// Compare the kernel with what this backend applied: the structure (chains, rules, set
    /// declarations) on every call, set elements too when `full`.
    pub fn drift_check(&self, full: bool) -> Result<Vec<Drift>, NftError> {
        self.drift_in(&self.list_for_check(full)?, full)
    }

    /// The one listing a drift check (and a repair) works from: with set elements when the
    /// check compares them. A full listing serves the structure too ([`Listing::table`] leaves
    /// elements out), and costs about what a terse one does where there is little to list:
    /// `nft` 1.0.6 fills its whole cache for any listing (7 s either way at 332 tables on the
    /// 2-core CI VM), so one full listing instead of a terse one and then a full one.
    fn list_for_check(&self, full: bool) -> Result<Listing, NftError> {
        if full {
            self.nft.list_ruleset()
        } else {
            self.nft.list_ruleset_terse()
        }
    }

    /// [`drift_check`](Self::drift_check) against a listing already taken by
    /// [`list_for_check`](Self::list_for_check) with the same `full`.
    fn drift_in(&self, listing: &Listing, full: bool) -> Result<Vec<Drift>, NftError> {
        let mut out = Vec::new();
        for (name, t) in &self.applied {
            let Some(now) = listing.table(t.family, name) else {
                out.push(Drift::Missing {
                    table: name.clone(),
                });
                continue;
            };
            let structure_changed = self.snapshots.get(name) != Some(&now);
            let elements_changed = !structure_changed && full && !same_elements(Some(listing), t);
            if structure_changed || elements_changed {
                out.push(Drift::Modified {
                    table: name.clone(),
                });
            }
        }
        Ok(out)
    }

    /// Full comparison (set elements included).
    pub fn drift(&self) -> Result<Vec<Drift>, NftError> {
        self.drift_check(true)
    }

    /// Restore drifted tables (recreating them, and the tables ordered after them, atomically).
    /// Set elements are compared every [`FULL_DRIFT_CHECK`] (a full listing of a 100k-element
    /// set costs about 0.4 s), once no change was applied for [`QUIET_BEFORE_FULL_CHECK`] or
    /// [`FULL_DRIFT_CHECK_MAX`] passed; the rest on every call.
    pub fn repair(&mut self) -> Result<Vec<Drift>, NftError> {
        let since_full = |d| self.last_full_check.is_none_or(|t| t.elapsed() >= d);
        let quiet = self
            .last_change
            .is_none_or(|t| t.elapsed() >= QUIET_BEFORE_FULL_CHECK);
        let full = since_full(FULL_DRIFT_CHECK) && (quiet || since_full(FULL_DRIFT_CHECK_MAX));
        self.repair_with(full)
    }

    /// [`repair`](Self::repair) comparing set elements now, whatever the schedule.
    pub fn repair_full(&mut self) -> Result<Vec<Drift>, NftError> {
        self.repair_with(true)
    }

    fn repair_with(&mut self, full: bool) -> Result<Vec<Drift>, NftError> {
        if full {
            self.last_full_check = Some(std::time::Instant::now());
        }
        // Nothing committed since a check that found the kernel as applied (with set
        // elements, if this one compares them): the same check again, without listing. A
        // node of 50 gateways, each ticking every 200 ms, ran 250 `nft` processes a second
        // for this alone.
        let generation = self.nft.generation();
        if let (Some(now), Some(v)) = (generation, self.verified) {
            if now == v.generation && (v.elements || !full) {
                return Ok(Vec::new());
            }
        }
        self.changing();
        // One listing per tick serves the switch, the drift check and the repair's plan.
        let listing = self.list_for_check(full)?;
        let on = switch::is_on(&listing);
        if on != self.allow_all {
            // The switch was flipped: what was applied gains or loses its accepts. Not drift,
            // except a table deleted meanwhile (recreated by the same plan, and reported: a
            // repair is a repair, whichever tick it falls on).
            let missing: Vec<Drift> = self
                .applied
                .iter()
                .filter(|(name, t)| listing.table(t.family, name).is_none())
                .map(|(name, _)| Drift::Missing {
                    table: name.clone(),
                })
                .collect();
            let desired: Vec<RenderedTable> = self
                .applied
                .values()
                .map(|t| switch::with_switch(t.clone(), on))
                .collect();
            let names: Vec<String> = self.applied.keys().cloned().collect();
            self.allow_all = on;
            let kernel = listing.kernel_tables();
            let plan = plan::plan(&BTreeMap::new(), &desired, &kernel, &names)?;
            if !plan.commands.is_empty() {
                self.nft.transaction(&plan.commands)?;
            }
            let after = self.nft.list_ruleset_terse()?;
            for t in desired {
                let snap = Self::snapshot(&after, t.family, &t.name);
                self.snapshots.insert(t.name.clone(), snap);
                self.applied.insert(t.name.clone(), t);
            }
            return Ok(missing);
        }
        let drift = self.drift_in(&listing, full)?;
        if drift.is_empty() {
            self.quiet_listing = Some((std::time::Instant::now(), listing));
            // Read before the listing: a commit between the two moves it past this value,
            // and the next check lists again.
            self.verified = generation.map(|generation| Verified {
                generation,
                elements: full,
            });
            return Ok(drift);
        }
        let broken: Vec<String> = drift
            .iter()
            .map(|d| match d {
                Drift::Missing { table } | Drift::Modified { table } => table.clone(),
            })
            .collect();
        let desired: Vec<RenderedTable> = self.applied.values().cloned().collect();
        // Forget the broken tables so the plan recreates them.
        let mut known = self.applied.clone();
        for b in &broken {
            known.remove(b);
        }
        // The tick's listing: a table changed since fails the atomic transaction (nothing
        // applied), and the next tick lists again.
        let kernel = listing.kernel_tables();
        let plan = plan::plan(&known, &desired, &kernel, &broken)?;
        if !plan.commands.is_empty() {
            self.nft.transaction(&plan.commands)?;
        }
        let after = self.nft.list_ruleset_terse()?;
        for name in plan.report.recreated {
            if let Some(t) = self.applied.get(&name) {
                let snap = Self::snapshot(&after, t.family, &name);
                self.snapshots.insert(name, snap);
            }
        }
        Ok(drift)
    }
}

/// Whether the set elements of `t` in a full listing are the ones applied.
fn same_elements(full: Option<&Listing>, t: &Table) -> bool {
    let listed = full
        .and_then(|l| l.of_table(t.family, &t.name))
        .map(|l| l.elements())
        .unwrap_or_default();
    // The packet path edits the elements of timeout sets (the ended table's): never drift.
    let mut listed = listed;
    listed.retain(|set, _| !ended::is_dynamic(t, set));
    let applied: BTreeMap<String, Vec<String>> = t
        .sets
        .iter()
        .filter(|s| s.timeout.is_none())
        .map(|s| (s.name.clone(), json::element_texts(s)))
        .collect();
    listed == applied
}

impl<R: Runner> peerwall_backend::Enforce for NftBackend<R> {
    fn name(&self) -> &'static str {
        NAME
    }

    fn apply(&mut self, policy: &ir::Policy) -> Result<Report, BackendError> {
        NftBackend::apply(self, policy)
            .map(|r| Report::new(r.to_string()))
            .map_err(BackendError::host(NAME, "applying"))
    }

    fn update_sets(
        &mut self,
        policy: &ir::Policy,
        changes: &[ir::SetChange],
    ) -> Result<Report, BackendError> {
        NftBackend::update_sets(self, policy, changes)
            .map(|r| Report::new(r.to_string()))
            .map_err(BackendError::host(NAME, "updating sets"))
    }

    fn adopt(&mut self, policy: &ir::Policy) -> Result<(), BackendError> {
        self.adopt_unchanged(policy)
            .map(drop)
            .map_err(BackendError::host(
                NAME,
                "reading peerwall's tables in the kernel",
            ))
    }

    fn delete(&mut self) -> Result<Vec<String>, BackendError> {
        self.delete_all()
            .map_err(BackendError::host(NAME, "deleting peerwall's tables"))
    }

    fn withdraw(&mut self) -> Result<Vec<String>, BackendError> {
        self.withdraw_applied().map_err(BackendError::host(
            NAME,
            "withdrawing the tables it applied",
        ))
    }

    fn repair(&mut self) -> Result<Vec<Drift>, BackendError> {
        NftBackend::repair(self).map_err(BackendError::host(NAME, "repairing drift"))
    }
}

impl<R: Runner> peerwall_backend::Observe for NftBackend<R> {
    fn counters(&mut self) -> Result<Vec<RuleCounter>, BackendError> {
        self.counters_this_tick()
            .map_err(BackendError::host(NAME, "reading rule counters"))
    }

    fn drift(&mut self) -> Result<Vec<Drift>, BackendError> {
        NftBackend::drift(self).map_err(BackendError::host(NAME, "reading drift"))
    }

    fn allow_all(&mut self) -> Result<bool, BackendError> {
        Ok(self.allow_all)
    }

    /// The kernel's conntrack table of the current network namespace (`nf_conntrack_count`
    /// of `nf_conntrack_max`); None before conntrack is loaded.
    fn conntrack(&mut self) -> Result<Option<(u64, u64)>, BackendError> {
        Ok(peerwall_backend::kernel_conntrack_fill())
    }

    /// Each connection's original direction as the forward hook saw it (the destination
    /// after DNAT), which is what the rules judged and what a policy change is judged on: a
    /// connection to a remapped address is judged by the pod it reaches.
    fn flows(&mut self) -> Result<Vec<peerwall_backend::Flow>, BackendError> {
        let Some(ct) = self.nft.conntrack() else {
            return Ok(Vec::new());
        };
        let tracked = ct
            .list()
            .map_err(BackendError::host(NAME, "listing connections"))?;
        let (seen, rewritten) = conntrack::as_seen(tracked);
        self.listed = rewritten;
        Ok(seen)
    }

    fn events(
        &mut self,
    ) -> Result<Box<dyn peerwall_backend::EventSource>, peerwall_backend::EventError> {
        let ev = self.events.ok_or(peerwall_backend::EventError::Off)?;
        let src = events::Nflog::bind(ev.group, self.names.clone(), EVENT_INTERVAL)?;
        Ok(Box::new(src))
    }
}

impl<R: Runner> peerwall_backend::Revoke for NftBackend<R> {
    /// Ends connections as `flows` listed them: a rewritten one by its original tuple.
    fn end_flows(&mut self, flows: &[peerwall_backend::Flow]) -> Result<usize, BackendError> {
        let Some(ct) = self.nft.conntrack() else {
            return Ok(0);
        };
        let orig: Vec<peerwall_backend::Flow> = flows
            .iter()
            .map(|f| self.listed.get(f).copied().unwrap_or(*f))
            .collect();
        // The ended table comes into force with the first connection to keep ended.
        if self.ended.is_some() && !self.ended_in_use && !flows.is_empty() {
            self.ended_in_use = true;
            let current: Vec<RenderedTable> = self
                .applied
                .values()
                .filter(|t| t.name != ended::ENDED_TABLE)
                .cloned()
                .collect();
            if let Err(e) = self.apply_rendered(current) {
                tracing::warn!(error = %e, "could not create the ended table: ended connections are only deleted from conntrack");
            }
        }
        // Into the ended table first (as the forward hook sees them), so that no packet
        // between the deletion and the insert re-opens them.
        if let Some(t) = self.applied.get(ended::ENDED_TABLE) {
            let edits = ended::elements(flows);
            let cmds = ended::commands(t, &edits, true);
            // Full (its capacity) or gone: these connections are only deleted.
            self.quiet_listing = None;
            self.verified = None;
            match self.nft.transaction(&cmds) {
                Ok(()) => self
                    .kept
                    .record(flows.iter().filter(|f| ended::keeps(f.proto)).copied()),
                Err(e) => {
                    tracing::warn!(error = %e, connections = flows.len(), "could not keep ended connections in the ended table: they are only deleted from conntrack");
                }
            }
        }
        ct.end(&orig)
            .map_err(BackendError::host(NAME, "ending connections"))
    }

    fn ended_flows(&mut self) -> Result<Vec<peerwall_backend::Flow>, BackendError> {
        Ok(self.kept.flows())
    }

    fn release_flows(&mut self, flows: &[peerwall_backend::Flow]) -> Result<usize, BackendError> {
        let held = self.kept.take(flows);
        let Some(t) = self.applied.get(ended::ENDED_TABLE) else {
            return Ok(0);
        };
        // Each set at once; where an element expired meanwhile (nft refuses to delete what is
        // not there, and the whole transaction with it), one element at a time.
        let edits = ended::elements(&held);
        for edit in &edits {
            let all = ended::commands(t, std::slice::from_ref(edit), false);
            if self.nft.transaction(&all).is_err() {
                for e in &edit.1 {
                    let single = [(edit.0.clone(), vec![*e])];
                    let _ = self.nft.transaction(&ended::commands(t, &single, false));
                }
            }
        }
        Ok(held.len())
    }
}

impl<R: Runner> peerwall_backend::HoldBoot for NftBackend<R> {
    /// Where peerwall enforces nothing yet: the boot policy alone, at once (its rules match
    /// the tunnel by name, so they hold for a tunnel created later); the next apply replaces
    /// it in one transaction. Where peerwall's tables are already in force: nothing.
    fn hold_boot(&mut self, boot: &ir::Policy, _tunnel: &str) -> Result<bool, BackendError> {
        let owned = self
            .owned_tables()
            .map_err(BackendError::host(NAME, "reading peerwall's tables"))?;
        if !owned.is_empty() {
            return Ok(false);
        }
        self.apply(boot)
            .map_err(BackendError::host(NAME, "holding the boot policy"))?;
        Ok(true)
    }

    fn hold_boot_alone(&mut self, boot: &ir::Policy, _tunnel: &str) -> Result<bool, BackendError> {
        self.hold_where_none(boot)
            .map_err(BackendError::host(NAME, "holding the boot policy"))
    }
}

/// The backend's name, as `--backend` spells it.
pub const NAME: &str = "nftables";

/// At most one event per flow, kind and rule in this interval.
pub const EVENT_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

#[cfg(test)]
mod tests;
