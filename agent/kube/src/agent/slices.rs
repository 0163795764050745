//! The agent's view of the AddressSets it watches: each slice checked once per
//! `(uid, generation)`, an invalid one keeping its last good addresses in force (or none), and
//! what changed since the last round, so that only changed slices reach the compiled policy.
//! Pure: objects are reduced to [`SliceObserved`] by the caller.

use std::collections::BTreeMap;

use peerwall_intent::Origin;
use peerwall_policy::sliced::CheckedSlice;

/// One watched AddressSet, reduced to what the agent needs.
#[derive(Clone, Debug)]
pub struct SliceObserved {
    /// `namespace/name`.
    pub key: String,
    /// UID.
    pub uid: String,
    /// `metadata.generation`.
    pub generation: i64,
    /// Checked slice, or why not (only computed when `(uid, generation)` moved: [`Slices::needs_check`]).
    pub checked: Option<Result<CheckedSlice, String>>,
}

#[derive(Clone, Debug)]
struct Seen {
    uid: String,
    generation: i64,
    /// The current generation's check.
    checked: Result<CheckedSlice, String>,
    /// What is merged for it: the current slice, or its last good one.
    good: Option<CheckedSlice>,
}

/// Slices as last seen.
#[derive(Debug, Default)]
pub struct Slices {
    seen: BTreeMap<String, Seen>,
}

impl Slices {
    /// Whether an object at `(uid, generation)` must be checked (new, re-created or changed).
    pub fn needs_check(&self, key: &str, uid: &str, generation: i64) -> bool {
        self.seen
            .get(key)
            .is_none_or(|s| s.uid != uid || s.generation != generation || generation == 0)
    }

    /// Take in the current list of slices; returns the slices whose merged content changes:
    /// `(origin, Some(slice))` to merge, `(origin, None)` to withdraw.
    pub fn observe(&mut self, now: Vec<SliceObserved>) -> Vec<(Origin, Option<CheckedSlice>)> {
        let mut out = Vec::new();
        let present: std::collections::BTreeSet<String> =
            now.iter().map(|o| o.key.clone()).collect();
        let gone: Vec<String> = self
            .seen
            .keys()
            .filter(|k| !present.contains(*k))
            .cloned()
            .collect();
        for k in gone {
            if let Some(s) = self.seen.remove(&k) {
                if s.good.is_some() {
                    out.push((Origin(k), None));
                }
            }
        }
        for o in now {
            let Some(checked) = o.checked else {
                continue;
            };
            let previous = self.seen.remove(&o.key).filter(|s| s.uid == o.uid);
            let good = match &checked {
                Ok(c) => Some(c.clone()),
                // Invalid: the last good addresses of this object stay.
                Err(_) => previous.as_ref().and_then(|p| p.good.clone()),
            };
            if previous.as_ref().map(|p| &p.good) != Some(&good) {
                out.push((Origin(o.key.clone()), good.clone()));
            }
            self.seen.insert(
                o.key,
                Seen {
                    uid: o.uid,
                    generation: o.generation,
                    checked,
                    good,
                },
            );
        }
        out
    }

    /// Every slice to merge (for a full build).
    pub fn merged(&self) -> Vec<CheckedSlice> {
        self.seen.values().filter_map(|s| s.good.clone()).collect()
    }

    /// How many slices fill each set, by `(configuration key, set)`: the slices in force
    /// (valid ones, or an invalid one's last good addresses).
    pub fn counts(&self) -> BTreeMap<(String, String), u32> {
        peerwall_policy::sliced::slice_counts(self.seen.values().filter_map(|s| s.good.as_ref()))
    }

    /// Why a slice's current generation is not valid, if it is not.
    pub fn invalid(&self, key: &str) -> Option<String> {
        let s = self.seen.get(key)?;
        let msg = s.checked.as_ref().err()?;
        Some(match &s.good {
            Some(_) => format!("{msg} (not applied; its previous addresses stay in force)"),
            None => format!("{msg} (not applied)"),
        })
    }

    /// Generation of a slice as last seen.
    pub fn generation(&self, key: &str) -> Option<i64> {
        self.seen.get(key).map(|s| s.generation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(key: &str, addrs: &[&str]) -> CheckedSlice {
        let (ns, _) = key.split_once('/').unwrap();
        peerwall_policy::sliced::check_slice(&peerwall_intent::AddressSetObject {
            origin: Origin(key.into()),
            namespace: ns.into(),
            spec: peerwall_intent::AddressSetSpec {
                firewall_configuration: "gw".into(),
                set: "pods".into(),
                addresses: addrs.iter().map(|s| s.to_string()).collect(),
            },
        })
        .unwrap()
    }

    fn obs(key: &str, generation: i64, checked: Result<CheckedSlice, String>) -> SliceObserved {
        SliceObserved {
            key: key.into(),
            uid: "u".into(),
            generation,
            checked: Some(checked),
        }
    }

    #[test]
    fn only_changed_slices_come_back_and_bad_ones_keep_their_last_good_addresses() {
        let mut s = Slices::default();
        let a = slice("t/a", &["10.0.0.1"]);
        let b = slice("t/b", &["10.0.0.2"]);
        let first = s.observe(vec![obs("t/a", 1, Ok(a.clone())), obs("t/b", 1, Ok(b))]);
        assert_eq!(first.len(), 2);
        assert!(!s.needs_check("t/a", "u", 1));
        assert!(s.needs_check("t/a", "u", 2));
        // b unchanged (not checked again), a invalid: nothing to change, a's addresses stay.
        let unchanged = SliceObserved {
            checked: None,
            ..obs("t/b", 1, Err(String::new()))
        };
        let second = s.observe(vec![obs("t/a", 2, Err("bad".into())), unchanged.clone()]);
        assert!(second.is_empty(), "{second:?}");
        assert_eq!(
            s.invalid("t/a").as_deref(),
            Some("bad (not applied; its previous addresses stay in force)")
        );
        assert_eq!(s.merged().len(), 2);
        // a deleted: withdrawn.
        let third = s.observe(vec![unchanged]);
        assert_eq!(third, vec![(Origin("t/a".into()), None)]);
        assert_eq!(s.merged().len(), 1);
    }
}
