//! Who executes a transaction: [`Nft`], the `nft` process (here or in a named network
//! namespace), or [`FakeNft`], an in-memory kernel for tests that need no root. The typed
//! commands become libnftables JSON only in [`Nft`].

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::process::Stdio;
use std::sync::Mutex;

use serde_json::Value;

use peerwall_policy::ir::TableFamily;

use crate::error::NftError;
use crate::json;
use crate::listing::Listing;
use crate::model::{Command, Table};

/// Executes transactions and lists what the kernel holds (as `nft -j` prints it).
pub trait Runner: Send + std::fmt::Debug {
    /// Run `cmds` as one transaction: all or nothing.
    fn transaction(&self, cmds: &[Command<'_>]) -> Result<(), NftError>;
    /// The whole ruleset without set elements (`nft -j -t list ruleset`).
    fn list_ruleset_terse(&self) -> Result<Listing, NftError>;
    /// The whole ruleset with set elements (`nft -j list ruleset`): one listing for every
    /// table, however many there are (a listing per table would cost each the whole cache).
    fn list_ruleset(&self) -> Result<Listing, NftError>;
    /// One set with its elements (`nft -j list set`): a merged rule's per-rule counters.
    fn list_set(&self, family: &str, table: &str, set: &str) -> Result<Listing, NftError>;
    /// The kernel's connection tracking of the same network namespace; None where there is
    /// no kernel (the in-memory one).
    fn conntrack(&self) -> Option<crate::conntrack::Conntrack>;
    /// Whether [`transaction`](Self::transaction) sends the element edits
    /// [`crate::netlink::element_edits`] takes straight over netlink.
    fn edits_elements_over_netlink(&self) -> bool {
        false
    }
    /// The ruleset's generation ([`crate::netlink::generation`]): it moves with every
    /// committed transaction of the namespace. None when it cannot be read (then every drift
    /// check lists the ruleset).
    fn generation(&self) -> Option<u32> {
        None
    }
}

/// How to invoke `nft`: in this network namespace or in a named one.
#[derive(Clone, Debug, Default)]
pub struct Nft {
    netns: Option<String>,
    /// The netlink socket of element edits, kept open between them.
    netlink: NetlinkSession,
}

/// A [`crate::netlink::Session`] a `&self` runner can use; a clone starts without a socket.
#[derive(Debug, Default)]
struct NetlinkSession(std::sync::Mutex<Option<crate::netlink::Session>>);

impl Clone for NetlinkSession {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl Nft {
    /// `nft` in the current network namespace.
    pub fn host() -> Self {
        Self::default()
    }

    /// `nft` in the named network namespace (`ip netns exec`).
    pub fn in_netns(name: &str) -> Self {
        Self {
            netns: Some(name.to_string()),
            netlink: NetlinkSession::default(),
        }
    }

    fn command(&self) -> std::process::Command {
        match &self.netns {
            Some(ns) => {
                let mut c = std::process::Command::new("ip");
                c.args(["netns", "exec", ns, "nft"]);
                c
            }
            None => std::process::Command::new("nft"),
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
    pub fn apply_json(&self, doc: &Value) -> Result<(), NftError> {
        self.run("-j -f -", &["-j", "-f", "-"], Some(&doc.to_string()))
            .map(|_| ())
    }

    /// Apply a text script in one transaction (helper tables of the probe and tests).
    pub fn apply_text(&self, script: &str) -> Result<(), NftError> {
        self.run("-f -", &["-f", "-"], Some(script)).map(|_| ())
    }
}

impl Nft {
    /// `f` on the kept netlink session of this namespace (opened on first use).
    fn session<T>(&self, f: impl FnOnce(&mut crate::netlink::Session) -> T) -> T {
        let mut session = self
            .netlink
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(session.get_or_insert_with(|| crate::netlink::Session::new(self.netns.as_deref())))
    }
}

impl Runner for Nft {
    fn edits_elements_over_netlink(&self) -> bool {
        true
    }

    /// Element edits of address hash sets over netlink ([`crate::netlink`]), everything else
    /// through `nft -j -f`.
    fn transaction(&self, cmds: &[Command<'_>]) -> Result<(), NftError> {
        if let Some(edits) = crate::netlink::element_edits(cmds) {
            let applied = self.session(|s| s.apply(&edits));
            match applied {
                Ok(()) => return Ok(()),
                // `nft` is the authority on what the kernel takes: a batch refused here goes
                // to it (the kernel applied none of it), and is counted.
                Err(e) => crate::netlink::fell_back(&e),
            }
        }
        self.apply_json(&json::document(cmds))
    }

    /// Milliseconds even when sets hold 100k elements (a full listing takes about 0.4 s there).
    fn list_ruleset_terse(&self) -> Result<Listing, NftError> {
        let out = self.run("list ruleset", &["-j", "-t", "list", "ruleset"], None)?;
        json::read::document(&out)
    }

    fn list_ruleset(&self) -> Result<Listing, NftError> {
        let out = self.run("list ruleset", &["-j", "list", "ruleset"], None)?;
        json::read::document(&out)
    }

    /// As a JSON command: nft's command line refuses tables named like keywords.
    fn list_set(&self, family: &str, table: &str, set: &str) -> Result<Listing, NftError> {
        let doc = serde_json::json!({"nftables": [{"list": {"set":
            {"family": family, "table": table, "name": set}}}]});
        let out = self.run("list set", &["-j", "-f", "-"], Some(&doc.to_string()))?;
        json::read::document(&out)
    }

    fn conntrack(&self) -> Option<crate::conntrack::Conntrack> {
        Some(crate::conntrack::Conntrack::new(self.netns.clone()))
    }

    /// Over the element edits' netlink socket: one request, no process.
    fn generation(&self) -> Option<u32> {
        self.session(crate::netlink::Session::generation)
            .map_err(
                |e| tracing::debug!(error = %e, "no ruleset generation: the drift check lists"),
            )
            .ok()
    }
}

/// An in-memory nftables for tests: applies typed transactions all-or-nothing with nft's
/// refusals (creating a table that exists, deleting what is absent, elements of a missing set)
/// and lists its tables as `nft -j` does, so ownership, counters and drift detection run
/// unchanged on top of it.
#[derive(Debug, Default)]
pub struct FakeNft {
    state: Mutex<FakeState>,
}

#[derive(Clone, Debug, Default)]
struct FakeState {
    tables: BTreeMap<(&'static str, String), Table>,
    foreign: BTreeSet<(String, String)>,
    transactions: usize,
    listings: usize,
    /// The ruleset's generation: one more at every committed transaction, ours or another's.
    generation: u32,
}

fn failed(action: &str, why: &str) -> NftError {
    NftError::Failed {
        action: action.into(),
        status: "exit status: 1".into(),
        stderr: why.into(),
    }
}

impl FakeState {
    /// The listing of every table (foreign ones by name only), set elements when `elements`.
    fn ruleset(&self, elements: bool) -> Result<Listing, NftError> {
        let mut out: Vec<Value> = self
            .foreign
            .iter()
            .map(|(f, n)| serde_json::json!({"table": {"family": f, "name": n}}))
            .collect();
        for t in self.tables.values() {
            out.extend(FakeState::listing(t, elements));
        }
        json::read::listing(&out)
    }

    fn run(&mut self, c: &Command<'_>) -> Result<(), NftError> {
        match c {
            Command::Create(t) => {
                let key = (t.family.nft(), t.name.clone());
                if self.tables.contains_key(&key) || self.is_foreign(t.family, &t.name) {
                    return Err(failed("add table", "File exists"));
                }
                self.tables.insert(key, (*t).clone());
            }
            Command::Recreate(t) => {
                self.foreign
                    .remove(&(t.family.nft().to_string(), t.name.clone()));
                self.tables
                    .insert((t.family.nft(), t.name.clone()), (*t).clone());
            }
            Command::Delete { family, name } => {
                let was_foreign = self
                    .foreign
                    .remove(&(family.nft().to_string(), name.clone()));
                if self.tables.remove(&(family.nft(), name.clone())).is_none() && !was_foreign {
                    return Err(failed("delete table", "No such file or directory"));
                }
            }
            Command::AddTable { family, name } => {
                if !self.tables.contains_key(&(family.nft(), name.clone())) {
                    self.foreign
                        .insert((family.nft().to_string(), name.clone()));
                }
            }
            Command::InsertRule {
                family,
                table,
                rule,
            } => {
                let t = self
                    .tables
                    .get_mut(&(family.nft(), table.clone()))
                    .filter(|t| t.chains.iter().any(|c| c.name == rule.chain))
                    .ok_or_else(|| failed("insert rule", "No such file or directory"))?;
                let at = t.rules.iter().position(|r| r.chain == rule.chain);
                t.rules.insert(at.unwrap_or(t.rules.len()), rule.clone());
            }
            Command::FlushSet { table, set } => {
                let s = self
                    .tables
                    .get_mut(&(table.family.nft(), table.name.clone()))
                    .and_then(|t| t.sets.iter_mut().find(|s| s.name == *set))
                    .ok_or_else(|| failed("flush set", "No such file or directory"))?;
                s.elements.clear();
            }
            // This kernel lists no handles, so no rule can be named by one.
            Command::DeleteRule { .. } => {
                return Err(failed("delete rule", "No such file or directory"));
            }
            Command::AddElements {
                table,
                set,
                elements,
            }
            | Command::DeleteElements {
                table,
                set,
                elements,
            } => {
                let s = self
                    .tables
                    .get_mut(&(table.family.nft(), table.name.clone()))
                    .and_then(|t| t.sets.iter_mut().find(|s| s.name == *set))
                    .ok_or_else(|| failed("element", "No such file or directory"))?;
                if matches!(c, Command::AddElements { .. }) {
                    for e in elements {
                        if !s.elements.contains(e) {
                            s.elements.push(*e);
                        }
                    }
                } else {
                    for e in elements {
                        let at =
                            s.elements.iter().position(|x| x == e).ok_or_else(|| {
                                failed("delete element", "No such file or directory")
                            })?;
                        s.elements.remove(at);
                    }
                }
            }
        }
        Ok(())
    }

    fn is_foreign(&self, family: TableFamily, name: &str) -> bool {
        self.foreign
            .contains(&(family.nft().to_string(), name.to_string()))
    }

    /// The listing of one of our tables: the objects that created it, with or without set
    /// elements, and zeroed counters where nft would print them.
    fn listing(t: &Table, elements: bool) -> Vec<Value> {
        json::command(&Command::Create(t))
            .into_iter()
            .filter_map(|c| c.get("add").cloned())
            .map(|mut o| {
                for kind in ["set", "map"] {
                    if let Some(set) = o.get_mut(kind).and_then(Value::as_object_mut) {
                        if !elements {
                            set.remove("elem");
                        }
                    }
                }
                o
            })
            .collect()
    }
}

impl FakeNft {
    /// An empty fake kernel.
    pub fn new() -> Self {
        Self::default()
    }

    fn with<R>(&self, f: impl FnOnce(&mut FakeState) -> R) -> R {
        // A test that panicked while holding the lock leaves a usable state behind.
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut g)
    }

    /// Put a table that is not peerwall's into the kernel.
    pub fn add_foreign(&self, family: TableFamily, name: &str) {
        self.with(|s| {
            s.generation += 1;
            s.foreign
                .insert((family.nft().to_string(), name.to_string()))
        });
    }

    /// Someone else deletes a table.
    pub fn delete_behind_our_back(&self, family: TableFamily, name: &str) {
        self.with(|s| {
            s.generation += 1;
            s.tables.remove(&(family.nft(), name.to_string()))
        });
    }

    /// Someone else flushes a set.
    pub fn flush_set_behind_our_back(&self, family: TableFamily, table: &str, set: &str) {
        self.with(|s| {
            s.generation += 1;
            if let Some(t) = s.tables.get_mut(&(family.nft(), table.to_string())) {
                for st in t.sets.iter_mut().filter(|st| st.name == set) {
                    st.elements.clear();
                }
            }
        });
    }

    /// Transactions run so far (failed ones included).
    pub fn transactions(&self) -> usize {
        self.with(|s| s.transactions)
    }

    /// Rulesets listed so far (terse or whole).
    pub fn listings(&self) -> usize {
        self.with(|s| s.listings)
    }

    /// Names of the tables in the fake kernel (ours and foreign).
    pub fn tables(&self) -> Vec<String> {
        self.with(|s| {
            let mut v: Vec<String> = s.tables.keys().map(|(_, n)| n.clone()).collect();
            v.extend(s.foreign.iter().map(|(_, n)| n.clone()));
            v.sort();
            v
        })
    }

    /// A table as the fake kernel holds it.
    pub fn table(&self, family: TableFamily, name: &str) -> Option<Table> {
        self.with(|s| s.tables.get(&(family.nft(), name.to_string())).cloned())
    }
}

impl Runner for FakeNft {
    fn conntrack(&self) -> Option<crate::conntrack::Conntrack> {
        None
    }

    fn generation(&self) -> Option<u32> {
        Some(self.with(|s| s.generation))
    }

    fn transaction(&self, cmds: &[Command<'_>]) -> Result<(), NftError> {
        self.with(|s| {
            s.transactions += 1;
            let mut next = s.clone();
            for c in cmds {
                next.run(c)?;
            }
            next.generation += 1;
            *s = next;
            Ok(())
        })
    }

    fn list_ruleset_terse(&self) -> Result<Listing, NftError> {
        self.with(|s| {
            s.listings += 1;
            s.ruleset(false)
        })
    }

    fn list_ruleset(&self) -> Result<Listing, NftError> {
        self.with(|s| {
            s.listings += 1;
            s.ruleset(true)
        })
    }

    fn list_set(&self, family: &str, table: &str, set: &str) -> Result<Listing, NftError> {
        let all = self.with(|s| s.ruleset(true))?;
        Ok(Listing {
            sets: (all.sets.into_iter())
                .filter(|s| s.family == family && s.table == table && s.name == set)
                .collect(),
            ..Listing::default()
        })
    }
}
