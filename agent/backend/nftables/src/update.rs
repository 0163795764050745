//! In-place set edits ([`NftBackend::update_sets`]): the AddressSet slice path, one
//! transaction of just the changed elements (over netlink where [`crate::netlink`] takes them).

use peerwall_policy::ir;

use crate::{dispatch, model, netlink, render, ApplyReport, NftBackend, NftError, Runner};

impl<R: Runner> NftBackend<R> {
    /// Make `policy` the policy in force when it differs from the last one applied only by
    /// `changes`: one transaction deleting and adding just the changed elements, nothing
    /// listed or diffed; where a changed set decides a dispatch map ([`crate::dispatch`]),
    /// the map's elements of the addresses that changed too ([`dispatch::edit`]). Falls back
    /// to [`apply`](Self::apply) when a change does not fit what is in the kernel (a table not
    /// applied yet, a set that would render differently now, a dispatch class made or
    /// emptied).
    pub fn update_sets(
        &mut self,
        policy: &ir::Policy,
        changes: &[ir::SetChange],
    ) -> Result<ApplyReport, NftError> {
        self.last_change = Some(std::time::Instant::now());
        self.changing();
        // One transaction writes every deletion before every addition: each set's edits
        // composed first, or a later edit deletes a range only an earlier one adds.
        let changes = ir::compose(changes);
        let mut edits = Vec::new();
        for c in &changes {
            let Some(contents) = policy.addr_set(&c.table, &c.set) else {
                return self.apply(policy);
            };
            let hash = render::renders_as_hash(contents);
            // A hash set's declared size follows its element count: an edit that changes
            // it recreates the set (the kernel refuses elements beyond the size).
            let capacity = hash.then(|| model::capacity_for(render::hash_len(contents)));
            let fits = self.applied.get(&c.table).is_some_and(|t| {
                t.family == c.family
                    && t.sets.iter().any(|s| {
                        s.name == c.set
                            && s.interval != hash
                            && s.key == model::KeyType::of(c.addr_family)
                            && s.capacity() == capacity
                    })
            });
            if !fits {
                return self.apply(policy);
            }
            let (gone, new) = render::edit_elements(c.addr_family, &c.edit, hash);
            edits.push((c.table.clone(), c.set.clone(), gone, new));
        }
        // The dispatch maps' elements that follow from the sets' edits, table by table.
        let mut map_edits = Vec::new();
        for (name, t) in &self.applied {
            if t.dispatch_maps.is_empty() {
                continue;
            }
            let sets: Vec<dispatch::edit::SetEdit<'_>> = edits
                .iter()
                .filter(|(table, ..)| table == name)
                .map(|(_, set, gone, new)| dispatch::edit::SetEdit { set, gone, new })
                .collect();
            if sets.is_empty() {
                continue;
            }
            let Some(maps) = dispatch::edit::map_edits(t, &sets) else {
                return self.apply(policy);
            };
            map_edits.extend(
                maps.into_iter()
                    .map(|m| (name.clone(), m.map, m.gone, m.new)),
            );
        }
        edits.extend(map_edits);
        let mut report = ApplyReport::default();
        {
            let mut dels = Vec::new();
            let mut adds = Vec::new();
            for (table, set, gone, new) in &edits {
                let Some(t) = self.applied.get(table) else {
                    continue;
                };
                if !gone.is_empty() {
                    dels.push(model::Command::DeleteElements {
                        table: t,
                        set,
                        elements: gone.clone(),
                    });
                }
                if !new.is_empty() {
                    adds.push(model::Command::AddElements {
                        table: t,
                        set,
                        elements: new.clone(),
                    });
                }
            }
            dels.extend(adds);
            // Nothing decided before the edit outlives it ([`crate::decided`]).
            let dels = crate::decided::with_flushes(dels);
            report.element_changes = dels.iter().map(model::Command::element_count).sum();
            if !dels.is_empty() {
                report.over_netlink = self.nft.edits_elements_over_netlink()
                    && netlink::element_edits(&dels).is_some();
                self.nft.transaction(&dels)?;
                report.changed = true;
            }
        }
        for (table, set, gone, new) in edits {
            if let Some(s) = self
                .applied
                .get_mut(&table)
                .and_then(|t| t.sets.iter_mut().find(|s| s.name == set))
            {
                if !gone.is_empty() {
                    let gone: std::collections::HashSet<&model::Element> = gone.iter().collect();
                    s.elements.retain(|e| !gone.contains(e));
                }
                s.elements.extend(new);
            }
            if !report.updated.contains(&table) {
                report.updated.push(table);
            }
        }
        Ok(report)
    }
}
