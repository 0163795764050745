//! Validation and lowering: FirewallConfiguration specs in, policy IR out.
//!
//! One function serves every caller (CLI, agent, admission webhook): [`compile_object`]
//! validates a spec completely, collecting every error with its field path, and only when there
//! are none yields the IR table. [`compile`] adds the checks across objects.
//! Pure: no I/O, no kube client, no kernel.

mod chain;
pub mod errors;
mod matches;
mod names;
mod patch;
mod rules;
mod sets;
pub mod values;

use std::collections::HashMap;

use crate::ir::{self, Origin, SetElements, TableFamily};
use chain::lower_chain;
pub use errors::{Advice, CompileError, FieldError, ObjectErrors, Problem, Warning};
use matches::TableCx;
use names::check_identifier;
use peerwall_intent::types as api;
use sets::lower_sets;

pub use patch::{patch_elements, validate_sets};

pub use peerwall_intent::PolicyObject;

/// A validated table and what to tell the user about it.
#[derive(Clone, Debug, PartialEq)]
pub struct CompiledTable {
    /// The IR table.
    pub table: ir::Table,
    /// Warnings.
    pub warnings: Vec<Warning>,
}

/// A compiled policy with warnings per object.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Compiled {
    /// The policy.
    pub policy: ir::Policy,
    /// Warnings, with the object they came from.
    pub warnings: Vec<(Origin, Warning)>,
}

/// What validation found so far: every error and warning, with field paths.
pub(crate) struct Cx {
    errors: Vec<FieldError>,
    warnings: Vec<Warning>,
}

impl Cx {
    fn err(&mut self, path: impl Into<String>, problem: Problem) {
        self.errors.push(FieldError {
            path: path.into(),
            problem,
        });
    }
    fn warn(&mut self, path: impl Into<String>, advice: Advice) {
        self.warnings.push(Warning {
            path: path.into(),
            advice,
        });
    }
}

/// Validate one object and lower it to an IR table. Every error is collected.
pub fn compile_object(obj: &PolicyObject) -> Result<CompiledTable, ObjectErrors> {
    let mut cx = Cx {
        errors: Vec::new(),
        warnings: Vec::new(),
    };
    let t = &obj.spec.table;
    match &t.name {
        None => cx.err("spec.table.name", Problem::Required),
        Some(n) => check_identifier(&mut cx, "spec.table.name", n),
    }
    let family = match t.family {
        Some(api::TableFamily::Inet) => Some(TableFamily::Inet),
        Some(api::TableFamily::Ipv4) => Some(TableFamily::Ip),
        Some(api::TableFamily::Ipv6) => Some(TableFamily::Ip6),
        Some(f) => {
            let name = match f {
                api::TableFamily::Arp => "ARP",
                api::TableFamily::Netdev => "NETDEV",
                _ => "BRIDGE",
            };
            cx.err("spec.table.family", Problem::UnsupportedFamily(name));
            None
        }
        None => {
            cx.err("spec.table.family", Problem::Required);
            None
        }
    };
    let mut chains = Vec::new();
    let mut sets = Vec::new();
    if let Some(family) = family {
        sets = lower_sets(&mut cx, t, family);
        let set_map: HashMap<String, SetElements> = sets
            .iter()
            .map(|s| (s.name.clone(), s.elements.clone()))
            .collect();
        let tcx = TableCx {
            family,
            sets: &set_map,
            priority: 0,
        };
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for (i, c) in t.chains.iter().enumerate() {
            let path = format!("spec.table.chains[{i}]");
            if let Some(n) = &c.name {
                if let Some(first) = seen.insert(n, i) {
                    cx.err(
                        format!("{path}.name"),
                        Problem::Duplicate {
                            value: n.clone(),
                            first: format!("spec.table.chains[{first}].name"),
                        },
                    );
                }
            }
            chains.extend(lower_chain(&mut cx, &tcx, &path, c));
        }
    }
    if !cx.errors.is_empty() {
        return Err(ObjectErrors {
            origin: obj.origin.0.clone(),
            errors: cx.errors,
        });
    }
    // Sorted by name: the evaluator's tie-break between chains of equal priority (backends
    // register them so that the kernel runs them in this order).
    chains.sort_by(|a, b| a.name.cmp(&b.name));
    match family {
        Some(family) => Ok(CompiledTable {
            table: ir::Table {
                name: t.name.clone().unwrap_or_default(),
                family,
                origin: obj.origin.clone(),
                sets,
                chains,
                audit: obj.spec.audit,
            },
            warnings: cx.warnings,
        }),
        None => Err(ObjectErrors {
            origin: obj.origin.0.clone(),
            errors: vec![FieldError {
                path: "spec.table.family".into(),
                problem: Problem::Required,
            }],
        }),
    }
}

/// Validate one spec (the admission webhook's and the agent's shared entry point).
pub fn validate(obj: &PolicyObject) -> Result<Vec<Warning>, ObjectErrors> {
    compile_object(obj).map(|c| c.warnings)
}

/// Compile a set of objects into one policy. Any invalid object fails the whole compilation
/// (the caller keeps the last good policy).
pub fn compile(objects: &[PolicyObject]) -> Result<Compiled, CompileError> {
    let mut errors = Vec::new();
    let mut tables: Vec<ir::Table> = Vec::new();
    let mut warnings = Vec::new();
    let mut names: HashMap<String, String> = HashMap::new();
    let mut observed = Vec::new();
    for obj in objects {
        if obj.role == peerwall_intent::Role::Observe {
            // Another enforcer's table: checked like ours (a rewrite read from a bad object
            // would be a guess), but its name is its owner's business.
            match compile_object(obj) {
                Ok(ct) => observed.push(ct.table),
                Err(e) => errors.push(e),
            }
            continue;
        }
        match compile_object(obj) {
            Ok(ct) => {
                if let Some(first) = names.get(&ct.table.name) {
                    errors.push(ObjectErrors {
                        origin: obj.origin.0.clone(),
                        errors: vec![FieldError {
                            path: "spec.table.name".into(),
                            problem: Problem::Duplicate {
                                value: ct.table.name.clone(),
                                first: format!("{first} spec.table.name"),
                            },
                        }],
                    });
                    continue;
                }
                names.insert(ct.table.name.clone(), obj.origin.0.clone());
                warnings.extend(ct.warnings.into_iter().map(|w| (obj.origin.clone(), w)));
                tables.push(ct.table);
            }
            Err(e) => errors.push(e),
        }
    }
    if !errors.is_empty() {
        return Err(CompileError { objects: errors });
    }
    tables.sort_by(|a, b| a.name.cmp(&b.name));
    observed.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(Compiled {
        policy: ir::Policy { tables, observed },
        warnings,
    })
}

#[cfg(test)]
mod tests;
