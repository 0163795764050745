//! Editing a named address set of a compiled policy in place: the set and every rule test that
//! references it (`@name`) change together, and the edit reports the canonical ranges it
//! replaced, which is what a backend must change in the kernel. A membership change of a
//! 100k-address set is then O(log n) here and a few elements in the kernel, with no
//! re-validation or recompilation of anything else.

use super::addr::{AddrRange, AddrSet, IpFamily, RangeEdit};
use super::{Policy, SetElements, Source, TableFamily, Test};

/// One membership operation, applied in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetOp {
    /// The addresses of the range become members.
    Add(AddrRange),
    /// The addresses of the range stop being members.
    Remove(AddrRange),
}

/// The net change of one named address set after a batch of [`SetOp`]s.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SetChange {
    /// Table name.
    pub table: String,
    /// Table family.
    pub family: TableFamily,
    /// Set name.
    pub set: String,
    /// The set's address family.
    pub addr_family: IpFamily,
    /// Canonical ranges removed and added.
    pub edit: RangeEdit,
}

/// `changes` as one change per set, in the order each set first appears: the edits of one
/// set composed in sequence ([`RangeEdit::then`]). Each change of a batch is relative to the
/// set as the one before it left it (one per slice a round saw move), so a backend that writes
/// all deletions before all additions (one kernel transaction) must take them composed: the
/// second of two edits of one range deletes a range the first only adds. Sets whose edits
/// cancel out are left out.
pub fn compose(changes: &[SetChange]) -> Vec<SetChange> {
    let mut out: Vec<SetChange> = Vec::new();
    for c in changes {
        let same = |o: &&mut SetChange| {
            (&o.table, o.family, &o.set, o.addr_family)
                == (&c.table, c.family, &c.set, c.addr_family)
        };
        match out.iter_mut().find(same) {
            Some(o) => o.edit.then(c.edit.clone()),
            None => out.push(c.clone()),
        }
    }
    out.retain(|c| !c.edit.is_empty());
    out
}

/// Why a set could not be edited (nothing changed).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SetEditError {
    /// No table of that name.
    #[error("no table {table:?} in the policy")]
    NoTable {
        /// Table.
        table: String,
    },
    /// No set of that name in the table.
    #[error("table {table:?} has no set {set:?}")]
    NoSet {
        /// Table.
        table: String,
        /// Set.
        set: String,
    },
    /// The set holds ports.
    #[error("set {set:?} of table {table:?} holds ports, not addresses")]
    NotAddresses {
        /// Table.
        table: String,
        /// Set.
        set: String,
    },
}

impl Policy {
    fn addr_set_mut(&mut self, table: &str, set: &str) -> Result<usize, SetEditError> {
        let t = self
            .tables
            .iter()
            .position(|t| t.name == table)
            .ok_or_else(|| SetEditError::NoTable {
                table: table.into(),
            })?;
        let s = self.tables[t]
            .sets
            .iter()
            .find(|s| s.name == set)
            .ok_or_else(|| SetEditError::NoSet {
                table: table.into(),
                set: set.into(),
            })?;
        match s.elements {
            SetElements::Addr(_) => Ok(t),
            SetElements::Port(_) => Err(SetEditError::NotAddresses {
                table: table.into(),
                set: set.into(),
            }),
        }
    }

    /// Every copy of named set `set` in table number `t`: the declaration and the tests that
    /// reference it.
    fn for_each_copy(&mut self, t: usize, set: &str, mut f: impl FnMut(&mut AddrSet)) {
        let table = &mut self.tables[t];
        for s in table.sets.iter_mut().filter(|s| s.name == set) {
            if let SetElements::Addr(a) = &mut s.elements {
                f(a);
            }
        }
        for m in table
            .chains
            .iter_mut()
            .flat_map(|c| c.rules.iter_mut())
            .flat_map(|r| r.matches.iter_mut())
        {
            if let Test::Addr {
                set: a,
                source: Source::Named(n),
                ..
            } = &mut m.test
            {
                if n == set {
                    f(a);
                }
            }
        }
    }

    /// Apply `ops` in order to named address set `set` of `table` (and to every rule test that
    /// references it). Returns the net change of its canonical ranges.
    pub fn edit_set(
        &mut self,
        table: &str,
        set: &str,
        ops: &[SetOp],
    ) -> Result<SetChange, SetEditError> {
        let t = self.addr_set_mut(table, set)?;
        let mut edit = RangeEdit::default();
        let mut family = IpFamily::V4;
        let mut first = true;
        self.for_each_copy(t, set, |a| {
            family = a.family();
            let mut e = RangeEdit::default();
            for op in ops {
                e.then(match op {
                    SetOp::Add(r) => a.insert_range(*r),
                    SetOp::Remove(r) => a.remove_range(*r),
                });
            }
            // Every copy holds the same ranges, so every copy changes the same way.
            if first {
                edit = e;
                first = false;
            }
        });
        Ok(SetChange {
            table: table.into(),
            family: self.tables[t].family,
            set: set.into(),
            addr_family: family,
            edit,
        })
    }

    /// Replace the contents of named address set `set` of `table` (the bulk form, for a full
    /// compilation: one canonicalization instead of one edit per address).
    pub fn replace_set(
        &mut self,
        table: &str,
        set: &str,
        contents: &AddrSet,
    ) -> Result<(), SetEditError> {
        let t = self.addr_set_mut(table, set)?;
        self.for_each_copy(t, set, |a| {
            if a.family() == contents.family() {
                a.clone_from(contents);
            }
        });
        Ok(())
    }

    /// The contents of named address set `set` of `table`.
    pub fn addr_set(&self, table: &str, set: &str) -> Option<&AddrSet> {
        self.table(table)?
            .sets
            .iter()
            .find(|s| s.name == set)
            .and_then(|s| match &s.elements {
                SetElements::Addr(a) => Some(a),
                SetElements::Port(_) => None,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_of_one_set_compose_in_order() {
        let r = |lo: u128, hi: u128| AddrRange { lo, hi };
        let mut set = AddrSet::from_ranges(IpFamily::V4, [r(0, 9)]);
        let change = |set: &str, edit| SetChange {
            table: "t".into(),
            family: TableFamily::Inet,
            set: set.into(),
            addr_family: IpFamily::V4,
            edit,
        };
        // Two pods appended to one block, a third leaving it, each a change of its own.
        let first = set.insert_range(r(10, 10));
        let other = change("other", AddrSet::empty(IpFamily::V4).insert_range(r(7, 7)));
        let second = set.insert_range(r(11, 11));
        let third = set.remove_range(r(4, 4));
        let composed = compose(&[
            change("pods", first),
            other.clone(),
            change("pods", second),
            change("pods", third),
        ]);
        // One change for the block: [0-9] replaced by [0-3] and [5-11]; never a deletion of
        // [0-10] or [0-11], which only the changes themselves add.
        let mut want = RangeEdit::default();
        want.removed.insert(r(0, 9));
        want.added.extend([r(0, 3), r(5, 11)]);
        assert_eq!(composed, vec![change("pods", want), other]);
        assert_eq!(set.ranges(), &[r(0, 3), r(5, 11)]);
        // An address that comes and goes within the batch changes nothing.
        let came = set.insert_range(r(20, 20));
        let went = set.remove_range(r(20, 20));
        assert!(compose(&[change("pods", came), change("pods", went)]).is_empty());
    }
    use crate::compile;
    use crate::ir::eval::{evaluate, proto, CtState, Packet};

    fn policy() -> Policy {
        let text = r#"
apiVersion: peerwall.io/v1alpha1
kind: FirewallConfiguration
metadata: {name: t, namespace: ns}
spec:
  table:
    name: t
    family: INET
    sets:
    - name: pods
      keyType: ipv4_addr
      elements: [{key: 10.0.0.1}]
    chains:
    - name: fwd
      type: filter
      hook: forward
      priority: 0
      policy: drop
      rules:
        filterRules:
        - name: to_pods
          match: [{op: eq, ip: {value: "@pods", position: dst}}]
          action: accept
"#;
        let objs = peerwall_intent::load::parse_documents(text, "t").unwrap();
        compile::compile(&objs).unwrap().policy
    }

    fn v4(s: &str) -> u128 {
        crate::ir::addr::addr_to_u128(&s.parse().unwrap())
    }

    fn host(s: &str) -> AddrRange {
        AddrRange {
            lo: v4(s),
            hi: v4(s),
        }
    }

    fn verdict(p: &Policy, dst: &str) -> crate::ir::VerdictAction {
        let pkt = Packet {
            src: "10.9.9.9".parse().unwrap(),
            dst: dst.parse().unwrap(),
            proto: proto::TCP,
            sport: 40000,
            dport: 80,
            iif: Some("a".into()),
            oif: Some("b".into()),
            ct_state: CtState::New,
        };
        evaluate(p, &pkt).verdict
    }

    #[test]
    fn the_digest_tells_policies_apart_by_what_they_enforce() {
        let p = policy();
        assert_eq!(
            p.digest(),
            policy().digest(),
            "equal policies, equal digests"
        );
        let mut q = p.clone();
        q.edit_set("t", "pods", &[SetOp::Add(host("10.0.0.7"))])
            .unwrap();
        assert_ne!(p.digest(), q.digest(), "one set element apart");
        q.edit_set("t", "pods", &[SetOp::Remove(host("10.0.0.7"))])
            .unwrap();
        assert_eq!(p.digest(), q.digest(), "the element removed again");
        let mut r = p.clone();
        r.observed = r.tables.clone();
        assert_eq!(p.digest(), r.digest(), "observed tables are not enforced");
    }

    #[test]
    fn an_edit_changes_the_set_and_every_rule_that_names_it() {
        let mut p = policy();
        assert_eq!(verdict(&p, "10.0.0.7"), crate::ir::VerdictAction::Drop);
        let c = p
            .edit_set("t", "pods", &[SetOp::Add(host("10.0.0.7"))])
            .unwrap();
        assert_eq!(c.edit.added.len(), 1);
        assert!(c.edit.removed.is_empty());
        assert_eq!(verdict(&p, "10.0.0.7"), crate::ir::VerdictAction::Accept);
        // Adjacent to 10.0.0.1? No: 10.0.0.2 joins 10.0.0.1 into one canonical range.
        let c = p
            .edit_set("t", "pods", &[SetOp::Add(host("10.0.0.2"))])
            .unwrap();
        assert_eq!(c.edit.removed.len(), 1);
        assert_eq!(c.edit.added.len(), 1);
        let c = p
            .edit_set(
                "t",
                "pods",
                &[
                    SetOp::Remove(host("10.0.0.7")),
                    SetOp::Add(host("10.0.0.7")),
                ],
            )
            .unwrap();
        assert!(c.edit.is_empty(), "{c:?}");
        p.edit_set("t", "pods", &[SetOp::Remove(host("10.0.0.7"))])
            .unwrap();
        assert_eq!(verdict(&p, "10.0.0.7"), crate::ir::VerdictAction::Drop);
        assert_eq!(verdict(&p, "10.0.0.2"), crate::ir::VerdictAction::Accept);
        // The edited policy equals one compiled with those elements.
        let mut q = policy();
        q.replace_set(
            "t",
            "pods",
            &AddrSet::from_ranges(IpFamily::V4, [host("10.0.0.1"), host("10.0.0.2")]),
        )
        .unwrap();
        assert_eq!(p, q);
    }

    #[test]
    fn unknown_tables_and_sets_are_errors() {
        let mut p = policy();
        assert!(matches!(
            p.edit_set("x", "pods", &[]),
            Err(SetEditError::NoTable { .. })
        ));
        assert!(matches!(
            p.edit_set("t", "x", &[]),
            Err(SetEditError::NoSet { .. })
        ));
    }
}
