//! The controller's configurations kept storable: a FirewallConfiguration the controller
//! writes (a peer's gateway configuration, its NetworkPolicy tier) carries its address sets
//! inline while the object stays small, and moves its largest sets into AddressSet slices
//! when it would not. etcd takes at most 1.5 MiB per request
//! ([`peerwall_intent::size::ETCD_REQUEST_MAX`]): an object written larger is refused, and the
//! previous one stays in force. For a NetworkPolicy tier that is a silent accept: the pods a
//! new policy isolates are not in the isolation sets of the tier still in force. A gateway's
//! per-namespace sets of 100,000 pods are 2.2 MB as JSON.
//!
//! A moved set is declared `fromAddressSets: true` with `addressSets: n`, the number of slices
//! that fill it. The controller writes the slices first and the configuration after; an agent
//! that sees the configuration before all `n` slices keeps the configuration's previous
//! generation in force (`peerwall agent`'s plan), so an isolation set is never enforced
//! empty. Pure: the controller reads the slices and writes the objects.

use std::collections::BTreeSet;

use peerwall_intent::types as api;

use crate::slices::Slice;

/// How large the controller lets a configuration's JSON grow before it moves sets into
/// slices: 64 KiB. Every change of an inline set is a write of the whole object through the
/// API server, and its cost grows with the object: at 10,000 pods and 1,000 NetworkPolicies
/// (a 670 KB tier) one pod relabelled took 2.9–3.9 s from the label to the kernel (p50),
/// against 0.10–0.18 s with this budget, where it is a write of the slice holding the pod
/// (`cargo xtask bench-netpol`, docs/bench.md). The bound that matters for storage, etcd's
/// request limit ([`WHOLE_OBJECT_BUDGET`]), is far above it.
pub const INLINE_BUDGET: usize = 64 * 1024;

/// The most a configuration's JSON may take and still be stored with room to spare: two
/// thirds of etcd's request limit, leaving room for what the agents write into the object's
/// status (one condition per host) and for the API server's metadata. The default budget
/// before [`INLINE_BUDGET`]; the benchmark compares the two.
pub const WHOLE_OBJECT_BUDGET: usize = peerwall_intent::size::ETCD_REQUEST_MAX * 2 / 3;

/// Label naming the configuration whose moved set a slice fills (the AddressSets of the
/// gateway configuration's pod sets, which the address publisher keeps, carry none).
pub const CONFIGURATION_LABEL: &str = "peerwall.io/configuration";

/// A set moved out of a configuration: its name and elements (set keys as written inline:
/// addresses, CIDRs, `a-b` ranges), in the configuration's order (each once, as a set's
/// elements are): a layout kept from an earlier pass is compared with them as they are, and
/// only a set laid out again sorts them ([`lay_out`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Moved {
    /// Set name.
    pub set: String,
    /// Its elements.
    pub elements: Vec<String>,
}

/// Whether `set` holds addresses that may move into slices: address keys, no data, not
/// filled from slices already.
fn movable(set: &api::Set) -> bool {
    matches!(
        set.key_type,
        Some(
            api::SetDataType::Ipv4Addr
                | api::SetDataType::Ipv6Addr
                | api::SetDataType::Ipv4Cidr
                | api::SetDataType::Ipv6Cidr
        )
    ) && set.data_type.is_none()
        && !set.from_address_sets
        && !set.elements.is_empty()
        && set.elements.iter().all(|e| e.data.is_none())
}

/// The bytes a set's elements take in the configuration's JSON (`{"key":"…"},` each).
fn elements_bytes(set: &api::Set) -> usize {
    set.elements.iter().map(|e| e.key.len() + 11).sum()
}

/// Move the largest address sets of `spec` into slices while its JSON is larger than
/// `budget`: each moved set is declared `fromAddressSets: true` without inline elements (its
/// `addressSets` count is the caller's, once the slices are laid out). Returns the moved sets;
/// nothing when the spec fits.
///
/// `in_slices` names the sets already in slices. They stay there (moved first, whatever their
/// size) unless the whole spec fits in three quarters of the budget: otherwise sets of about
/// the same size would trade places as pods come and go, each swap a rewrite of the
/// configuration and of both sets' slices.
pub fn spill(
    spec: &mut api::FirewallConfigurationSpec,
    budget: usize,
    in_slices: &BTreeSet<String>,
) -> Vec<Moved> {
    let size = peerwall_intent::size::json_len(&spec);
    spill_sized(spec, budget, in_slices, size)
}

/// [`spill`] for a spec whose JSON is known to take `size` bytes (None: it does not
/// serialize, and nothing moves).
pub fn spill_sized(
    spec: &mut api::FirewallConfigurationSpec,
    budget: usize,
    in_slices: &BTreeSet<String>,
    size: Option<usize>,
) -> Vec<Moved> {
    let Some(mut size) = size else {
        return Vec::new();
    };
    let keep = in_slices.is_empty() || size <= budget / 4 * 3;
    if size <= budget && keep {
        return Vec::new();
    }
    let mut order: Vec<(bool, usize, usize)> = spec
        .table
        .sets
        .iter()
        .enumerate()
        .filter(|(_, s)| movable(s))
        .map(|(i, s)| (!keep && in_slices.contains(&s.name), elements_bytes(s), i))
        .collect();
    // Those staying in slices first, then the largest; ties by position, so the choice is a
    // function of the spec and of what is in slices alone.
    order.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)).then(a.2.cmp(&b.2)));
    let mut moved = Vec::new();
    for (stays, bytes, i) in order {
        if size <= budget && !stays {
            break;
        }
        let set = &mut spec.table.sets[i];
        let elements = std::mem::take(&mut set.elements);
        set.from_address_sets = true;
        size = size.saturating_sub(bytes);
        moved.push(Moved {
            set: set.name.clone(),
            elements: elements.into_iter().map(|e| e.key).collect(),
        });
    }
    moved
}

/// The size of `after`'s JSON, from that of `before` (`before_size` bytes), when the two differ
/// in their sets' elements alone, each changed set holding elements before and after (its
/// `elements` field written both times): the old elements' JSON out, the new one in. None
/// where anything else differs; then the spec is measured whole. A label change under 1,000
/// NetworkPolicies changes one or two of the tier's 170 sets, and measuring the whole spec
/// (its 20,000 addresses serialized to be counted) was a fifth of laying it out.
pub fn size_after(
    before: &api::FirewallConfigurationSpec,
    before_size: usize,
    after: &api::FirewallConfigurationSpec,
) -> Option<usize> {
    let mut size = before_size;
    for i in peerwall_intent::elements::sets_with_other_elements(before, after)? {
        let (x, y) = (
            &before.table.sets[i].elements,
            &after.table.sets[i].elements,
        );
        if x.is_empty() || y.is_empty() {
            return None;
        }
        let out = peerwall_intent::size::json_len(x)?;
        let into = peerwall_intent::size::json_len(y)?;
        size = size.checked_sub(out)?.checked_add(into)?;
    }
    Some(size)
}

/// 32-bit FNV-1a (stable across processes and releases: slice names must not change when the
/// controller restarts).
fn fnv1a32(s: &str) -> u32 {
    s.bytes().fold(0x811c_9dc5, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

/// Name of slice `n` of set `set` of configuration `config`: a valid object name whatever
/// the set is called (set names may hold `_`, `.` and capitals, and up to 63 characters of a
/// namespace's name), told apart from every other set's by the hash of its exact name.
pub fn slice_name(config: &str, set: &str, n: usize) -> String {
    let mut readable: String = set
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .take(40)
        .collect();
    while readable.contains("--") {
        readable = readable.replace("--", "-");
    }
    let readable = readable.trim_matches('-');
    format!("{config}-{readable}-{:08x}-{n:04}", fnv1a32(set))
}

/// An AddressSet filling set `slice.set` of configuration `config` in `namespace`, with the
/// configuration's `labels` (agents select slices as they select configurations) and
/// [`CONFIGURATION_LABEL`].
pub fn slice_object(
    namespace: &str,
    config: &str,
    labels: &std::collections::BTreeMap<String, String>,
    slice: &Slice<String>,
) -> serde_json::Value {
    let mut labels = labels.clone();
    labels.insert(CONFIGURATION_LABEL.into(), config.into());
    peerwall_intent::object::object(
        peerwall_intent::load::ADDRESS_SET_KIND,
        namespace,
        &slice.name,
        &labels,
        api::AddressSetSpec {
            firewall_configuration: config.into(),
            set: slice.set.clone(),
            addresses: slice.addresses.iter().cloned().collect(),
        },
    )
}

/// What keeping one moved set in slices takes, from what the API shows of them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SetSlices {
    /// Slices to write (new or changed, each holding addresses): before the configuration.
    pub write: Vec<Slice<String>>,
    /// Slices emptied: deleted after the configuration.
    pub delete: Vec<String>,
    /// How many slices hold the set's addresses afterwards: its `addressSets`.
    pub count: u32,
}

/// The slices of `moved` (a set of configuration `config`) laid over `current`, its slices as
/// the API shows them ([`crate::layout`]'s rules: an element that stays never moves, a change
/// of k elements rewrites at most k slices). A new slice never takes a name in `taken`: the
/// names of every other set's slices. Set names come from what users write (namespaces,
/// policies' selectors), so two sets' slice names may meet (a long name cut short, a hash
/// collision); a slice written under another set's name would take that set's addresses
/// out of it.
pub fn lay_out(
    config: &str,
    moved: &Moved,
    current: &[Slice<String>],
    taken: &BTreeSet<String>,
) -> SetSlices {
    let desired: BTreeSet<String> = moved.elements.iter().cloned().collect();
    if holds_exactly(current, &desired) {
        // What laying out would find: every slice kept as it is, none written or deleted.
        return SetSlices {
            write: Vec::new(),
            delete: Vec::new(),
            count: u32::try_from(current.len()).unwrap_or(u32::MAX),
        };
    }
    lay_out_changes(config, &moved.set, &desired, current, taken)
}

/// Whether `current` already holds `desired` as laying out keeps it: every slice non-empty,
/// every address of `desired` in exactly one slice, and no other address. Most sets of a
/// configuration are so at every pass (a pod's relabel changes two of 170 in the NetworkPolicy
/// tier at 1,000 policies); this walks them in order, allocating nothing, where laying out
/// copies every slice and address (a sixth of the controller's pass, by perf).
fn holds_exactly(current: &[Slice<String>], desired: &BTreeSet<String>) -> bool {
    if current.iter().any(|s| s.addresses.is_empty())
        || current.iter().map(|s| s.addresses.len()).sum::<usize>() != desired.len()
    {
        return false;
    }
    let mut next: Vec<_> = current
        .iter()
        .map(|s| s.addresses.iter().peekable())
        .collect();
    for d in desired {
        // In exactly one slice: the one whose next address it is (each slice is sorted).
        let mut found = 0;
        for it in &mut next {
            if it.peek() == Some(&d) {
                it.next();
                found += 1;
            }
        }
        if found != 1 {
            return false;
        }
    }
    // The counts are equal and each address was taken once: nothing is left over.
    next.iter_mut().all(|it| it.peek().is_none())
}

/// [`lay_out`] by laying the slices of `set` out ([`crate::slices::layout_named`]) to hold
/// `desired`.
fn lay_out_changes(
    config: &str,
    set: &str,
    desired: &BTreeSet<String>,
    current: &[Slice<String>],
    taken: &BTreeSet<String>,
) -> SetSlices {
    let changed =
        crate::slices::layout_named(set, current, desired, |n| slice_name(config, set, n), taken);
    let mut holding: BTreeSet<&str> = current
        .iter()
        .filter(|s| !s.addresses.is_empty())
        .map(|s| s.name.as_str())
        .collect();
    let mut out = SetSlices::default();
    // An empty slice left behind (a deletion that failed) goes too.
    out.delete.extend(
        current
            .iter()
            .filter(|s| s.addresses.is_empty())
            .map(|s| s.name.clone()),
    );
    for s in &changed {
        if s.addresses.is_empty() {
            holding.remove(s.name.as_str());
            out.delete.push(s.name.clone());
        } else {
            holding.insert(s.name.as_str());
        }
    }
    out.count = u32::try_from(holding.len()).unwrap_or(u32::MAX);
    out.write = changed
        .into_iter()
        .filter(|s| !s.addresses.is_empty())
        .collect();
    out
}

/// Declare each moved set's slice count in `spec` (`addressSets`).
pub fn declare(spec: &mut api::FirewallConfigurationSpec, counts: &[(String, u32)]) {
    for set in &mut spec.table.sets {
        if let Some((_, n)) = counts.iter().find(|(name, _)| *name == set.name) {
            set.address_sets = Some(*n);
        }
    }
}

#[cfg(test)]
#[path = "spill/tests.rs"]
mod tests;
