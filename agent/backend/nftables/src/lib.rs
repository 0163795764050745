//! The nftables backend (default).
//!
//! - [`render`]: IR → one nftables table per FirewallConfiguration (JSON), [`text`] for humans.
//! - [`plan`]: pure diff between what was applied and what is desired: unchanged structure →
//!   set element add/delete (O(changes)); changed structure → the table is recreated
//!   (`add`+`delete`+definition) in the same transaction. Always one `nft -j -f` call.
//! - [`NftBackend`]: the edge that runs `nft`, checks ownership, snapshots what it applied and
//!   detects drift (someone deleted or edited our table), reads rule counters.

pub mod plan;
pub mod render;
pub mod text;

use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command, Stdio};

use serde::Serialize;
use serde_json::Value;

use peerwall_policy::ir;
pub use plan::{plan, Plan};
pub use render::{render_policy, render_table, RenderOptions, RenderedTable};

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
    /// nft printed JSON we could not read.
    #[error("could not parse `nft -j` output: {0}")]
    Parse(#[from] serde_json::Error),
    /// A table with our name exists and is not ours.
    #[error("table {family} {name} exists and is not owned by peerwall; refusing to touch it (rename the FirewallConfiguration table or remove the foreign table)")]
    NotOwned {
        /// Family.
        family: &'static str,
        /// Name.
        name: String,
    },
}

/// How to invoke `nft`: in this network namespace or in a named one.
#[derive(Clone, Debug, Default)]
pub struct Nft {
    netns: Option<String>,
}

impl Nft {
    /// `nft` in the current network namespace.
    pub fn host() -> Self {
        Self { netns: None }
    }

    /// `nft` in the named network namespace (`ip netns exec`).
    pub fn in_netns(name: &str) -> Self {
        Self {
            netns: Some(name.to_string()),
        }
    }

    fn command(&self) -> Command {
        match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "nft"]);
                c
            }
            None => Command::new("nft"),
        }
    }

    fn run(&self, action: &str, args: &[&str], stdin: Option<&str>) -> Result<String, NftError> {
        let mut cmd = self.command();
        cmd.args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let spawn_err = |source| NftError::Spawn {
            program: "nft".into(),
            source,
        };
        let mut child = cmd.spawn().map_err(spawn_err)?;
        if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
            pipe.write_all(input.as_bytes()).map_err(spawn_err)?;
        }
        let out = child.wait_with_output().map_err(spawn_err)?;
        if !out.status.success() {
            return Err(NftError::Failed {
                action: action.to_string(),
                status: out.status.to_string(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Apply a JSON document in one transaction.
    pub fn apply(&self, doc: &Value) -> Result<(), NftError> {
        self.run("-j -f -", &["-j", "-f", "-"], Some(&doc.to_string()))
            .map(|_| ())
    }

    /// Apply a text script in one transaction (used for helper tables).
    pub fn apply_text(&self, script: &str) -> Result<(), NftError> {
        self.run("-f -", &["-f", "-"], Some(script)).map(|_| ())
    }

    /// The whole ruleset as JSON objects (metainfo dropped).
    pub fn list_ruleset(&self) -> Result<Vec<Value>, NftError> {
        let out = self.run("list ruleset", &["-j", "list", "ruleset"], None)?;
        objects(&out)
    }

    /// The ruleset without set elements (`-t`): tables, chains, rules with their counters and
    /// set declarations. Milliseconds even when sets hold 100k elements (a full listing takes
    /// about 0.4 s there).
    pub fn list_ruleset_terse(&self) -> Result<Vec<Value>, NftError> {
        let out = self.run("list ruleset", &["-j", "-t", "list", "ruleset"], None)?;
        objects(&out)
    }

    /// One table as JSON objects; `Ok(None)` when it does not exist.
    pub fn list_table(
        &self,
        family: ir::TableFamily,
        name: &str,
    ) -> Result<Option<Vec<Value>>, NftError> {
        match self.run(
            "list table",
            &["-j", "list", "table", family.nft(), name],
            None,
        ) {
            Ok(out) => objects(&out).map(Some),
            Err(NftError::Failed { stderr, .. }) if stderr.contains("No such file") => Ok(None),
            Err(e) => Err(e),
        }
    }
}

fn objects(out: &str) -> Result<Vec<Value>, NftError> {
    let v: Value = serde_json::from_str(out)?;
    Ok(v["nftables"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|o| o.get("metainfo").is_none())
                .cloned()
                .collect()
        })
        .unwrap_or_default())
}

/// A table present in the kernel.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KernelTable {
    /// Family keyword.
    pub family: String,
    /// Name.
    pub name: String,
    /// Owner recorded in the marker, when the table is ours.
    pub owner: Option<String>,
}

/// Tables in a listed ruleset, with their owner when they carry our marker.
pub fn kernel_tables(objs: &[Value]) -> Vec<KernelTable> {
    let mut tables: Vec<KernelTable> = objs
        .iter()
        .filter_map(|o| o.get("table"))
        .map(|t| KernelTable {
            family: t["family"].as_str().unwrap_or_default().to_string(),
            name: t["name"].as_str().unwrap_or_default().to_string(),
            owner: None,
        })
        .collect();
    for r in objs.iter().filter_map(|o| o.get("rule")) {
        if r["chain"] != render::MARKER_CHAIN {
            continue;
        }
        if let Some(owner) = r["comment"]
            .as_str()
            .and_then(|c| c.strip_prefix(render::MARKER_PREFIX))
        {
            if let Some(t) = tables
                .iter_mut()
                .find(|t| r["table"] == t.name.as_str() && r["family"] == t.family.as_str())
            {
                t.owner = Some(owner.to_string());
            }
        }
    }
    tables
}

pub use peerwall_backend::RuleCounter;

/// Counters of every named rule with a counter in owned tables of a listed ruleset.
pub fn rule_counters(objs: &[Value]) -> Vec<RuleCounter> {
    let owned: Vec<KernelTable> = kernel_tables(objs)
        .into_iter()
        .filter(|t| t.owner.is_some())
        .collect();
    let mut out = Vec::new();
    for r in objs.iter().filter_map(|o| o.get("rule")) {
        let is_owned = owned
            .iter()
            .any(|t| r["table"] == t.name.as_str() && r["family"] == t.family.as_str());
        if !is_owned || r["chain"] == render::MARKER_CHAIN {
            continue;
        }
        let Some(comment) = r["comment"].as_str() else {
            continue;
        };
        let counter = r["expr"]
            .as_array()
            .and_then(|e| e.iter().find_map(|s| s.get("counter")));
        if let Some(c) = counter {
            out.push(RuleCounter {
                table: r["table"].as_str().unwrap_or_default().to_string(),
                chain: r["chain"].as_str().unwrap_or_default().to_string(),
                rule: comment.to_string(),
                packets: c["packets"].as_u64().unwrap_or(0),
                bytes: c["bytes"].as_u64().unwrap_or(0),
            });
        }
    }
    out
}

/// A listed table with counter values zeroed: what drift detection compares.
fn normalize(mut objs: Vec<Value>) -> Vec<Value> {
    fn zero(v: &mut Value) {
        match v {
            Value::Object(o) => {
                if let Some(Value::Object(c)) = o.get_mut("counter") {
                    c.insert("packets".into(), Value::from(0));
                    c.insert("bytes".into(), Value::from(0));
                }
                o.values_mut().for_each(zero);
            }
            Value::Array(a) => a.iter_mut().for_each(zero),
            _ => {}
        }
    }
    objs.iter_mut().for_each(zero);
    objs
}

/// The objects of one table in a ruleset listing (the table itself and everything in it).
fn objects_of_table(objs: &[Value], family: ir::TableFamily, name: &str) -> Vec<Value> {
    objs.iter()
        .filter(|o| {
            o.as_object()
                .and_then(|m| m.values().next())
                .is_some_and(|inner| {
                    let fam = inner["family"] == family.nft();
                    let table = inner
                        .get("table")
                        .map_or(inner["name"] == name, |t| t == name);
                    fam && table
                })
        })
        .cloned()
        .collect()
}

/// How often drift checks also compare set elements (a full listing), besides the structure
/// checked on every call.
pub const FULL_DRIFT_CHECK: std::time::Duration = std::time::Duration::from_secs(5);

/// What was applied to one table, as the kernel listed it right after.
#[derive(Debug, Default, Clone)]
struct Snapshot {
    /// Without set elements.
    terse: Vec<Value>,
    /// Everything (set elements included).
    full: Vec<Value>,
}

pub use peerwall_backend::Drift;

/// What an apply did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ApplyReport {
    /// Tables created or recreated.
    pub recreated: Vec<String>,
    /// Tables whose set elements changed in place.
    pub updated: Vec<String>,
    /// Owned tables removed.
    pub deleted: Vec<String>,
    /// Set element additions and deletions sent.
    pub element_changes: usize,
    /// Whether anything was sent to the kernel.
    pub changed: bool,
}

/// The nftables backend: applies policies, remembers what it applied, detects drift.
#[derive(Debug, Default)]
pub struct NftBackend {
    nft: Nft,
    applied: BTreeMap<String, RenderedTable>,
    snapshots: BTreeMap<String, Snapshot>,
    last_full_check: Option<std::time::Instant>,
}

impl NftBackend {
    /// A backend driving `nft` as given.
    pub fn new(nft: Nft) -> Self {
        Self {
            nft,
            applied: BTreeMap::new(),
            snapshots: BTreeMap::new(),
            last_full_check: None,
        }
    }

    fn snapshot(&self, family: ir::TableFamily, name: &str) -> Result<Snapshot, NftError> {
        let terse = objects_of_table(&self.nft.list_ruleset_terse()?, family, name);
        let full = self.nft.list_table(family, name)?.unwrap_or_default();
        Ok(Snapshot {
            terse: normalize(terse),
            full: normalize(full),
        })
    }

    /// The runner.
    pub fn nft(&self) -> &Nft {
        &self.nft
    }

    /// Make the kernel's peerwall tables equal `policy`, in one transaction.
    /// Foreign tables are never touched; a name clash with one is an error and changes nothing.
    pub fn apply(&mut self, policy: &ir::Policy) -> Result<ApplyReport, NftError> {
        self.apply_rendered(render_policy(policy, RenderOptions::default()))
    }

    /// Like [`apply`](Self::apply), with rendering options (the probe forces counters).
    pub fn apply_rendered(&mut self, desired: Vec<RenderedTable>) -> Result<ApplyReport, NftError> {
        let kernel = kernel_tables(&self.nft.list_ruleset_terse()?);
        let plan = plan::plan(&self.applied, &desired, &kernel, &[])?;
        if !plan.commands.is_empty() {
            self.nft.apply(&render::document(plan.commands.clone()))?;
        }
        for name in &plan.report.deleted {
            self.applied.remove(name);
            self.snapshots.remove(name);
        }
        for t in desired {
            let touched =
                plan.report.recreated.contains(&t.name) || plan.report.updated.contains(&t.name);
            if touched || !self.snapshots.contains_key(&t.name) {
                let snap = self.snapshot(t.family, &t.name)?;
                self.snapshots.insert(t.name.clone(), snap);
            }
            self.applied.insert(t.name.clone(), t);
        }
        Ok(plan.report)
    }

    /// Delete every table owned by peerwall in this namespace (not only the ones this process
    /// applied). Returns their names.
    pub fn delete_all(&mut self) -> Result<Vec<String>, NftError> {
        let owned: Vec<KernelTable> = kernel_tables(&self.nft.list_ruleset_terse()?)
            .into_iter()
            .filter(|t| t.owner.is_some())
            .collect();
        if !owned.is_empty() {
            let cmds = owned
                .iter()
                .map(|t| serde_json::json!({"delete": {"table": {"family": t.family, "name": t.name}}}))
                .collect();
            self.nft.apply(&render::document(cmds))?;
        }
        self.applied.clear();
        self.snapshots.clear();
        Ok(owned.into_iter().map(|t| t.name).collect())
    }

    /// Counters of all rules in owned tables.
    pub fn counters(&self) -> Result<Vec<RuleCounter>, NftError> {
        Ok(rule_counters(&self.nft.list_ruleset_terse()?))
    }

    /// Compare the kernel with what this backend applied: the structure (chains, rules, set
    /// declarations) on every call, set elements too when `full`.
    pub fn drift_check(&self, full: bool) -> Result<Vec<Drift>, NftError> {
        let mut out = Vec::new();
        let terse = self.nft.list_ruleset_terse()?;
        for (name, t) in &self.applied {
            let now = objects_of_table(&terse, t.family, name);
            let snap = self.snapshots.get(name);
            if now.is_empty() {
                out.push(Drift::Missing {
                    table: name.clone(),
                });
            } else if snap.map(|s| &s.terse) != Some(&normalize(now))
                || (full
                    && snap.map(|s| &s.full)
                        != Some(&normalize(
                            self.nft.list_table(t.family, name)?.unwrap_or_default(),
                        )))
            {
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
    /// set costs about 0.4 s), the rest on every call.
    pub fn repair(&mut self) -> Result<Vec<Drift>, NftError> {
        let full = self
            .last_full_check
            .is_none_or(|t| t.elapsed() >= FULL_DRIFT_CHECK);
        if full {
            self.last_full_check = Some(std::time::Instant::now());
        }
        let drift = self.drift_check(full)?;
        if drift.is_empty() {
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
        let kernel = kernel_tables(&self.nft.list_ruleset_terse()?);
        let plan = plan::plan(&known, &desired, &kernel, &broken)?;
        if !plan.commands.is_empty() {
            self.nft.apply(&render::document(plan.commands))?;
        }
        for name in plan.report.recreated {
            if let Some(t) = self.applied.get(&name) {
                let snap = self.snapshot(t.family, &name)?;
                self.snapshots.insert(name, snap);
            }
        }
        Ok(drift)
    }
}

impl std::fmt::Display for ApplyReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "recreated={:?} updated={:?} deleted={:?} element_changes={}",
            self.recreated, self.updated, self.deleted, self.element_changes
        )
    }
}

impl peerwall_backend::Backend for NftBackend {
    type Report = ApplyReport;
    type Error = NftError;

    fn name(&self) -> &'static str {
        "nftables"
    }

    fn apply(&mut self, policy: &ir::Policy) -> Result<ApplyReport, NftError> {
        NftBackend::apply(self, policy)
    }

    fn delete(&mut self) -> Result<Vec<String>, NftError> {
        self.delete_all()
    }

    fn counters(&mut self) -> Result<Vec<RuleCounter>, NftError> {
        NftBackend::counters(self)
    }

    fn drift(&mut self) -> Result<Vec<Drift>, NftError> {
        NftBackend::drift(self)
    }

    fn repair(&mut self) -> Result<Vec<Drift>, NftError> {
        NftBackend::repair(self)
    }
}
