//! Named sets (`spec.table.sets`, an extension): key types, elements, families.

use std::collections::HashMap;

use peerwall_intent::types as api;

use super::matches::{family_name, table_family_name};
use super::names::check_identifier;
use super::values::{parse_addr_item, parse_port_item};
use super::{Advice, Cx, Problem};
use crate::ir::{AddrSet, IpFamily, NamedSet, PortSet, SetElements, TableFamily};

/// Every named set of the table, its key type fitting the table family, its elements parsed.
pub(super) fn lower_sets(cx: &mut Cx, table: &api::Table, family: TableFamily) -> Vec<NamedSet> {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    let mut out = Vec::new();
    for (i, set) in table.sets.iter().enumerate() {
        let path = format!("spec.table.sets[{i}]");
        check_identifier(cx, &format!("{path}.name"), &set.name);
        if let Some(first) = seen.insert(&set.name, i) {
            cx.err(
                format!("{path}.name"),
                Problem::Duplicate {
                    value: set.name.clone(),
                    first: format!("spec.table.sets[{first}].name"),
                },
            );
        }
        if set.data_type.is_some() {
            cx.warn(format!("{path}.dataType"), Advice::DataTypeIgnored);
        }
        let Some(key_type) = set.key_type else {
            cx.err(format!("{path}.keyType"), Problem::Required);
            continue;
        };
        let (fam, key_name) = key_of(key_type);
        if let Some(f) = fam {
            if !family.sees(f) {
                cx.err(
                    format!("{path}.keyType"),
                    Problem::FamilyNotInTable {
                        value: key_name.to_string(),
                        family: family_name(f),
                        table: table_family_name(family),
                    },
                );
                continue;
            }
        }
        let elements = lower_elements(cx, &path, set, fam, key_name);
        if set.from_address_sets && fam.is_none() {
            cx.err(
                format!("{path}.fromAddressSets"),
                Problem::SlicesNeedAddresses,
            );
        }
        if let (Some(n), false) = (set.address_sets, set.from_address_sets) {
            cx.err(
                format!("{path}.addressSets"),
                Problem::AddressSetsWithoutSlices(n),
            );
        }
        out.push(NamedSet {
            name: set.name.clone(),
            elements,
            from_slices: set.from_address_sets,
        });
    }
    out
}

/// A key type's address family (None: integers, ports) and its name in messages.
pub(super) fn key_of(key_type: api::SetDataType) -> (Option<IpFamily>, &'static str) {
    match key_type {
        api::SetDataType::Integer => (None, "integer"),
        api::SetDataType::Ipv4Addr => (Some(IpFamily::V4), "ipv4_addr"),
        api::SetDataType::Ipv4Cidr => (Some(IpFamily::V4), "ipv4_cidr"),
        api::SetDataType::Ipv6Addr => (Some(IpFamily::V6), "ipv6_addr"),
        api::SetDataType::Ipv6Cidr => (Some(IpFamily::V6), "ipv6_cidr"),
    }
}

/// The elements of `set` (at `path`, `spec.table.sets[i]`), each parsed as its key type
/// (`fam`: the address family, None for ports), canonical.
pub(super) fn lower_elements(
    cx: &mut Cx,
    path: &str,
    set: &api::Set,
    fam: Option<IpFamily>,
    key_name: &'static str,
) -> SetElements {
    let mut addr_ranges = Vec::new();
    let mut port_ranges = Vec::new();
    for (j, el) in set.elements.iter().enumerate() {
        let epath = format!("{path}.elements[{j}].key");
        match fam {
            Some(f) => match parse_addr_item(&el.key) {
                Ok(a) if a.family == f => {
                    if let Some(adv) = a.advice {
                        cx.warn(&epath, adv);
                    }
                    addr_ranges.push(a.range);
                }
                _ => cx.err(
                    &epath,
                    Problem::BadSetElement {
                        value: el.key.clone(),
                        key_type: key_name,
                    },
                ),
            },
            None => match parse_port_item(&el.key) {
                Ok(r) => port_ranges.push(r),
                Err(_) => {
                    // Integer sets may hold values above 65535 for other uses, but
                    // peerwall only uses them as port sets.
                    cx.err(
                        &epath,
                        Problem::BadSetElement {
                            value: el.key.clone(),
                            key_type: "integer (port 0-65535 or range)",
                        },
                    )
                }
            },
        }
    }
    match fam {
        Some(f) => SetElements::Addr(AddrSet::from_ranges(f, addr_ranges)),
        None => SetElements::Port(PortSet::from_ranges(port_ranges)),
    }
}
