//! Validation errors and warnings, each naming the field path and the offending value.

use std::fmt;

/// What is wrong with a field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Problem {
    /// A required field is missing.
    Required,
    /// Not an address, CIDR or range.
    NotAnAddress(String),
    /// A range whose start is after its end.
    RangeReversed(String),
    /// A range whose ends are of different families.
    RangeMixedFamily(String),
    /// A value of a family the table does not carry.
    FamilyNotInTable {
        /// Value.
        value: String,
        /// Value family.
        family: &'static str,
        /// Table family spelling.
        table: &'static str,
    },
    /// A list mixing IPv4 and IPv6.
    MixedFamilies(String),
    /// Not a port or port range.
    NotAPort(String),
    /// A name used twice.
    Duplicate {
        /// The name.
        value: String,
        /// Path of the first use.
        first: String,
    },
    /// A name nftables cannot take.
    BadName {
        /// The name.
        value: String,
        /// Why.
        why: &'static str,
    },
    /// `rules` sets more than one of natRules / filterRules / routeRules.
    RulesNotExactlyOne(usize),
    /// A rule kind that the chain type does not take.
    RulesKindMismatch {
        /// The rules field.
        field: &'static str,
        /// Chain type.
        chain_type: &'static str,
    },
    /// A family peerwall does not enforce.
    UnsupportedFamily(&'static str),
    /// A hook the chain type or family does not take.
    HookNotAllowed {
        /// Hook.
        hook: &'static str,
        /// Chain type.
        chain_type: &'static str,
        /// Explanation.
        why: &'static str,
    },
    /// A priority the chain type does not take.
    PriorityNotAllowed {
        /// Priority.
        value: i32,
        /// Explanation.
        why: &'static str,
    },
    /// A policy the chain type does not take.
    PolicyNotAllowed(&'static str),
    /// `@name` naming no set of the table.
    UnknownSet(String),
    /// A set of the wrong key type for where it is used.
    SetTypeMismatch {
        /// Reference.
        value: String,
        /// What the use needs.
        expected: &'static str,
    },
    /// An action that is not allowed where it is.
    ActionNotAllowed {
        /// Action.
        action: &'static str,
        /// Explanation.
        why: &'static str,
    },
    /// An action value that does not parse.
    BadActionValue {
        /// Value.
        value: String,
        /// Expected form.
        expected: &'static str,
    },
    /// A match entry that tests nothing.
    EmptyMatch,
    /// An empty list or string where a value is needed.
    Empty,
    /// A rule testing both IPv4 and IPv6 addresses (nft refuses it; it could never match).
    RuleMixesFamilies,
    /// `fromAddressSets` on a set that does not hold addresses.
    SlicesNeedAddresses,
    /// `addressSets` on a set that does not take address sets.
    AddressSetsWithoutSlices(u32),
    /// An AddressSet holding more addresses than a slice may.
    TooManyAddresses {
        /// Addresses in it.
        count: usize,
        /// Limit.
        max: usize,
    },
    /// A set element that is not of the set's key type.
    BadSetElement {
        /// Element.
        value: String,
        /// Key type.
        key_type: &'static str,
    },
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Required => write!(f, "required field is missing"),
            Self::NotAnAddress(v) => write!(f, "{v:?} is not an address, CIDR or range"),
            Self::RangeReversed(v) => write!(f, "{v:?} is a range whose start is after its end"),
            Self::RangeMixedFamily(v) => {
                write!(f, "{v:?} is a range between an IPv4 and an IPv6 address")
            }
            Self::FamilyNotInTable {
                value,
                family,
                table,
            } => write!(f, "{value:?} is {family} but the table family is {table}"),
            Self::MixedFamilies(v) => write!(f, "{v:?} mixes IPv4 and IPv6 values in one match"),
            Self::NotAPort(v) => write!(f, "{v:?} is not a port (0-65535) or port range"),
            Self::Duplicate { value, first } => {
                write!(f, "{value:?} is already used at {first}")
            }
            Self::BadName { value, why } => write!(f, "{value:?} is not a valid name: {why}"),
            Self::RulesNotExactlyOne(n) => write!(
                f,
                "{n} of natRules, filterRules, routeRules are set; set exactly one"
            ),
            Self::RulesKindMismatch { field, chain_type } => {
                write!(f, "{field} are not allowed in a chain of type {chain_type:?}")
            }
            Self::UnsupportedFamily(fam) => write!(
                f,
                "{fam:?} is not enforced by peerwall (use INET, IPV4 or IPV6)"
            ),
            Self::HookNotAllowed {
                hook,
                chain_type,
                why,
            } => write!(
                f,
                "{hook:?} is not allowed for a chain of type {chain_type:?}: {why}"
            ),
            Self::PriorityNotAllowed { value, why } => write!(f, "{value} is not allowed: {why}"),
            Self::PolicyNotAllowed(why) => write!(f, "\"drop\" is not allowed: {why}"),
            Self::UnknownSet(v) => write!(f, "{v:?} names no set of this table (spec.table.sets)"),
            Self::SetTypeMismatch { value, expected } => {
                write!(f, "{value:?} is not a set of {expected}")
            }
            Self::ActionNotAllowed { action, why } => {
                write!(f, "{action:?} is not allowed here: {why}")
            }
            Self::BadActionValue { value, expected } => {
                write!(f, "{value:?} is not {expected}")
            }
            Self::EmptyMatch => write!(
                f,
                "match entry tests nothing: set one of ip, port, proto, dev, ctstate"
            ),
            Self::Empty => write!(f, "must not be empty"),
            Self::RuleMixesFamilies => write!(
                f,
                "the rule tests both IPv4 and IPv6 addresses and could never match; split it in two rules"
            ),
            Self::AddressSetsWithoutSlices(n) => write!(
                f,
                "{n}: counts the AddressSets of a set that takes them; set fromAddressSets: true, or remove addressSets"
            ),
            Self::SlicesNeedAddresses => write!(
                f,
                "true is not allowed: address sets fill sets of ipv4_addr, ipv4_cidr, ipv6_addr or ipv6_cidr keys"
            ),
            Self::TooManyAddresses { count, max } => write!(
                f,
                "{count} addresses; an AddressSet holds at most {max} (split them over several)"
            ),
            Self::BadSetElement { value, key_type } => {
                write!(f, "{value:?} is not a valid {key_type} element")
            }
        }
    }
}

/// One validation error: where and what.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {problem}")]
pub struct FieldError {
    /// Field path, e.g. `spec.table.chains[0].rules.filterRules[2].match[1].ip.value`.
    pub path: String,
    /// What is wrong.
    pub problem: Problem,
}

/// Something accepted but worth telling the user.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Advice {
    /// A CIDR with host bits set was normalized to its network.
    HostBitsSet {
        /// As written.
        value: String,
        /// As enforced.
        normalized: String,
    },
    /// An interface match that cannot see an interface at this hook.
    IfaceUnknownAtHook {
        /// in / out.
        position: &'static str,
        /// Hook.
        hook: &'static str,
        /// eq never holds, neq always holds.
        op: &'static str,
    },
    /// A set's dataType is ignored (peerwall uses sets for membership only).
    DataTypeIgnored,
    /// An action with no effect at this hook.
    NoEffect(&'static str),
    /// A rule without a name was given a stable one.
    NameGenerated(String),
    /// A field that is ignored in this position.
    Ignored(&'static str),
}

impl fmt::Display for Advice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::HostBitsSet { value, normalized } => {
                write!(f, "{value:?} has host bits set; enforced as {normalized:?}")
            }
            Self::IfaceUnknownAtHook { position, hook, op } => write!(
                f,
                "no {position} interface is known at {hook}: this {op} match {}",
                if *op == "eq" {
                    "never holds"
                } else {
                    "always holds"
                }
            ),
            Self::DataTypeIgnored => write!(f, "dataType is ignored: sets are used for membership"),
            Self::NoEffect(why) => write!(f, "{why}"),
            Self::NameGenerated(name) => write!(
                f,
                "missing; named {name:?} from the rule's content (Liqo's mutating webhook names rules only where it runs)"
            ),
            Self::Ignored(why) => write!(f, "ignored: {why}"),
        }
    }
}

/// A warning at a field path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Warning {
    /// Field path.
    pub path: String,
    /// What to know.
    pub advice: Advice,
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.advice)
    }
}

/// All errors of one object: one line per error, each naming the object.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.lines(None).join("\n"))]
pub struct ObjectErrors {
    /// Object (namespace/name or file origin).
    pub origin: String,
    /// Errors, in field order.
    pub errors: Vec<FieldError>,
}

impl ObjectErrors {
    /// One line per error: `[WHERE: ]ORIGIN: PATH: PROBLEM`, `WHERE` being where the object
    /// was read (`file:line`) when known.
    pub fn lines(&self, at: Option<&str>) -> Vec<String> {
        let at = at.map_or(String::new(), |a| format!("{a}: "));
        self.errors
            .iter()
            .map(|e| format!("{at}{}: {e}", self.origin))
            .collect()
    }
}

/// Errors of a whole compilation.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.objects.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
pub struct CompileError {
    /// Per object.
    pub objects: Vec<ObjectErrors>,
}

impl CompileError {
    /// One line per error, each led by where its object was read (`located(origin)`, e.g.
    /// `file:line`) when known.
    pub fn located(&self, located: impl Fn(&str) -> Option<String>) -> String {
        self.objects
            .iter()
            .flat_map(|o| o.lines(located(&o.origin).as_deref()))
            .collect::<Vec<_>>()
            .join("\n")
    }
}
