//! peerwall's `FirewallConfiguration` (`peerwall.io/v1alpha1`): Liqo's schema
//! (`networking.liqo.io/v1beta1`) plus filter extensions, in a CRD peerwall owns.
//!
//! Field names and enum spellings are upstream's, so a Liqo object becomes a peerwall object by
//! changing its `apiVersion`, and Liqo's own objects load unchanged (the loader reads both
//! groups; the agent enforces Liqo's objects only when asked to). Our extensions (marked
//! "extension" below) are the ones proposed upstream: `ctstate` matches, table `sets` referenced
//! as `@name`, IPv6 values, plus comma-separated value lists, `icmp`/`icmpv6` protocols and a
//! `message` in status conditions. peerwall never installs or changes Liqo's CRD: a server
//! running Liqo's schema would prune the extensions.
//!
//! Liqo's Go types serialize absent lists as `null` (`match`, `chains`): those read as empty.
//!
//! Scalar fields that upstream declares as pointers are `Option` here: their absence is reported
//! by validation with a field path instead of an opaque deserialization error.

use schemars::JsonSchema;
use serde::{Deserialize, Deserializer, Serialize};

/// A list that Go's encoder may have written as `null` (a nil slice without `omitempty`).
fn null_as_empty<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Ok(Option::<Vec<T>>::deserialize(d)?.unwrap_or_default())
}

/// Spec of a FirewallConfiguration: one nftables table.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[cfg_attr(feature = "kube", derive(kube::CustomResource))]
#[cfg_attr(
    feature = "kube",
    kube(
        group = "peerwall.io",
        version = "v1alpha1",
        kind = "FirewallConfiguration",
        plural = "firewallconfigurations",
        namespaced,
        status = "FirewallConfigurationStatus",
        shortname = "pwfc",
        category = "peerwall",
        printcolumn = r#"{"name":"Peer","type":"string","jsonPath":".metadata.labels.peerwall\\.io/remote-cluster-id"}"#,
        printcolumn = r#"{"name":"Target","type":"string","jsonPath":".metadata.labels.peerwall\\.io/target"}"#,
        printcolumn = r#"{"name":"Audit","type":"boolean","jsonPath":".spec.audit"}"#,
        printcolumn = r#"{"name":"Generation","type":"integer","jsonPath":".metadata.generation"}"#,
        printcolumn = r#"{"name":"Host","type":"string","jsonPath":".status.conditions[0].host","description":"The first host that reports on it (kubectl get -o yaml: every host's condition)"}"#,
        printcolumn = r#"{"name":"State","type":"string","jsonPath":".status.conditions[0].type"}"#,
        printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
    )
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FirewallConfigurationSpec {
    /// The table to enforce.
    pub table: Table,
    /// Extension: audit mode. A `drop` or `reject` of this table (a rule's or a chain
    /// policy's) becomes a *would-drop*: the packet is accepted by that chain, and an event
    /// records the rule that would have dropped it. Setting it back to `false` enforces at once.
    #[serde(default, skip_serializing_if = "is_false")]
    pub audit: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// Observed state: one condition per host that applies the table.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FirewallConfigurationStatus {
    /// Conditions, one per host. A list keyed by `host` for server-side apply, so that every
    /// agent (field manager `peerwall-agent/<host>`) owns its own entry.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["host"]))]
    pub conditions: Vec<FirewallConfigurationStatusCondition>,
}

/// Condition of one host.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FirewallConfigurationStatusCondition {
    /// Host (node or gateway pod) where the configuration was evaluated.
    pub host: String,
    /// `Applied` or `Error` (an agent's), `NotEnforced` (the controller's).
    #[serde(rename = "type")]
    pub type_: ConditionType,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// Last time the condition transitioned (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<String>,
    /// Extension: the validation or kernel message behind an `Error`, or warnings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Extension: the `metadata.generation` this condition describes (an `Applied` condition
    /// with an older generation means the host still enforces a previous spec).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Extension: the backend the host enforces with (`nftables`, `bpf`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
}

/// Condition type.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum ConditionType {
    /// The table is installed.
    Applied,
    /// The table could not be validated or installed.
    Error,
    /// Written by the controller (host `peerwall-controller`): no host has reported the
    /// current generation `Applied` for longer than the grace period, so the peer's traffic
    /// is not filtered by this configuration. Removed once a host applies it.
    NotEnforced,
}

/// An nftables table.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Table {
    /// Table name (nftables table name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Table family.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub family: Option<TableFamily>,
    /// Chains of the table.
    #[serde(
        default,
        deserialize_with = "null_as_empty",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub chains: Vec<Chain>,
    /// Extension: named sets referenced from `ip.value` / `port.value` as `@name`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sets: Vec<Set>,
}

/// Table family (upstream spelling).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum TableFamily {
    /// IPv4 and IPv6.
    #[serde(rename = "INET")]
    Inet,
    /// IPv4 only.
    #[serde(rename = "IPV4")]
    Ipv4,
    /// IPv6 only.
    #[serde(rename = "IPV6")]
    Ipv6,
    /// ARP (not enforced by peerwall).
    #[serde(rename = "ARP")]
    Arp,
    /// netdev (not enforced by peerwall).
    #[serde(rename = "NETDEV")]
    Netdev,
    /// bridge (not enforced by peerwall).
    #[serde(rename = "BRIDGE")]
    Bridge,
}

impl TableFamily {
    /// The spellings of the families Liqo's schema names and peerwall does not enforce (not
    /// offered when a family is misspelt).
    pub const NOT_ENFORCED: [&'static str; 3] = ["ARP", "NETDEV", "BRIDGE"];
}

/// A base chain.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Chain {
    /// Chain name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Rules: exactly one of natRules, filterRules, routeRules.
    #[serde(default)]
    pub rules: RulesSet,
    /// Chain type.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub type_: Option<ChainType>,
    /// Default policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<ChainPolicy>,
    /// Netfilter hook.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hook: Option<ChainHook>,
    /// Priority (default 0, `filter`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
}

/// Chain type.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ChainType {
    /// Filtering chain (decides verdicts).
    Filter,
    /// Route chain.
    Route,
    /// NAT chain.
    Nat,
}

/// Chain policy.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ChainPolicy {
    /// Drop packets no rule decided.
    Drop,
    /// Accept packets no rule decided.
    Accept,
}

/// Netfilter hook.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ChainHook {
    /// prerouting.
    Prerouting,
    /// input.
    Input,
    /// forward.
    Forward,
    /// output.
    Output,
    /// postrouting.
    Postrouting,
    /// ingress (needs a device; refused by validation).
    Ingress,
}

/// The rules of a chain.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RulesSet {
    /// NAT rules.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nat_rules: Option<Vec<NatRule>>,
    /// Filter rules.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filter_rules: Option<Vec<FilterRule>>,
    /// Route rules.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route_rules: Option<Vec<RouteRule>>,
}

/// A filter rule.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FilterRule {
    /// Rule name (required and unique in its chain).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Matches, ANDed.
    #[serde(default, deserialize_with = "null_as_empty")]
    pub r#match: Vec<Match>,
    /// Action.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<FilterAction>,
    /// Value for the action (ctmark value, MSS for tcpmssclamp).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// Count packets and bytes hitting this rule (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counter: Option<bool>,
}

/// Filter action.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum FilterAction {
    /// Set the conntrack mark.
    Ctmark,
    /// Copy the conntrack mark to the packet mark.
    Metamarkfromctmark,
    /// Clamp TCP MSS.
    Tcpmssclamp,
    /// Accept (end this chain).
    Accept,
    /// Drop (final).
    Drop,
    /// Reject with ICMP port unreachable (final).
    Reject,
    /// Disable connection tracking for the packet.
    Notrack,
}

/// A NAT rule.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NatRule {
    /// Rule name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Matches, ANDed.
    #[serde(default, deserialize_with = "null_as_empty")]
    pub r#match: Vec<Match>,
    /// NAT type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nat_type: Option<NatType>,
    /// Address to translate to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
    /// Free-form reference to the object the rule is for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_ref: Option<ObjectReference>,
}

/// Kubernetes' `ObjectReference` (core/v1), as Liqo's NAT rules carry it; informational only.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ObjectReference {
    /// API version of the referent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_version: Option<String>,
    /// Field within the referent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field_path: Option<String>,
    /// Kind of the referent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Name of the referent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Namespace of the referent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Resource version of the referent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_version: Option<String>,
    /// UID of the referent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
}

/// NAT type.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum NatType {
    /// Destination NAT.
    Dnat,
    /// Source NAT.
    Snat,
    /// Masquerade.
    Masquerade,
}

/// A route rule (upstream carries only a name).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RouteRule {
    /// Rule name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// One match entry; `op` applies to each present field separately.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Match {
    /// eq or neq.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op: Option<MatchOperation>,
    /// Address match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip: Option<MatchIp>,
    /// Port match (holds only for TCP, UDP and SCTP).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<MatchPort>,
    /// Protocol match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proto: Option<MatchProto>,
    /// Interface match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dev: Option<MatchDev>,
    /// Extension: connection-tracking state match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ctstate: Option<MatchCtState>,
}

/// eq / neq.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum MatchOperation {
    /// Equal / member of.
    Eq,
    /// Not equal / not member of.
    Neq,
}

/// src / dst.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum MatchPosition {
    /// Source.
    Src,
    /// Destination.
    Dst,
}

/// in / out.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum MatchDevPosition {
    /// Input interface.
    In,
    /// Output interface.
    Out,
}

/// Address match: an address, CIDR, range `a-b`, a comma-separated list of those (extension) or `@set` (extension).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MatchIp {
    /// Value.
    #[serde(default)]
    pub value: String,
    /// src or dst.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub position: Option<MatchPosition>,
}

/// Port match: `N`, `A-B`, a comma-separated list (extension) or `@set` (extension).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MatchPort {
    /// Value.
    #[serde(default)]
    pub value: String,
    /// src or dst.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub position: Option<MatchPosition>,
}

/// Interface match.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MatchDev {
    /// Interface name.
    #[serde(default)]
    pub value: String,
    /// in or out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub position: Option<MatchDevPosition>,
    /// Prefix match on the name (upstream `wildcard`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub wildcard: bool,
}

/// Protocol match.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MatchProto {
    /// Protocol.
    pub value: L4Proto,
}

/// Layer-4 protocol (upstream: tcp, udp; extension: sctp, icmp, icmpv6).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum L4Proto {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
    /// SCTP (extension).
    Sctp,
    /// ICMP (extension).
    Icmp,
    /// ICMPv6 (extension).
    Icmpv6,
}

/// Extension: conntrack state match.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MatchCtState {
    /// States; the match holds when the packet's state is one of them.
    #[serde(default)]
    pub value: Vec<CtState>,
}

/// Conntrack state.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum CtState {
    /// First packet of a connection.
    New,
    /// Part of a connection that has seen traffic both ways.
    Established,
    /// Related to an existing connection (e.g. ICMP errors).
    Related,
    /// Not tracked (notrack).
    Untracked,
    /// Could not be tracked.
    Invalid,
}

/// Extension: a named set.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Set {
    /// Set name.
    #[serde(default)]
    pub name: String,
    /// Key type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_type: Option<SetDataType>,
    /// Data type (verdict maps; not used by filtering).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_type: Option<SetDataType>,
    /// Elements.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub elements: Vec<SetElement>,
    /// Extension: the set also holds the addresses of every `AddressSet` in this object's
    /// namespace that names this object (`spec.firewallConfiguration`) and this set
    /// (`spec.set`). Address sets are bounded slices (at most [`MAX_SLICE_ADDRESSES`]
    /// addresses each), so a set of 100k pods is a hundred small objects, each changed on its
    /// own.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub from_address_sets: bool,
    /// Extension: how many `AddressSet`s fill this set (with `fromAddressSets: true`; written
    /// by peerwall's controller, which publishes the slices before the configuration). An
    /// agent that sees fewer keeps this configuration's previous generation in force and
    /// reports why, so a set is never enforced while its addresses are on their way (a
    /// NetworkPolicy's isolation set enforced empty would isolate nothing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address_sets: Option<u32>,
}

/// Set key type (upstream: integer, ipv4_addr, ipv4_cidr; extension: ipv6_addr, ipv6_cidr).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum SetDataType {
    /// Ports / integers.
    #[serde(rename = "integer")]
    Integer,
    /// IPv4 addresses (ranges and CIDRs allowed).
    #[serde(rename = "ipv4_addr")]
    Ipv4Addr,
    /// IPv4 prefixes.
    #[serde(rename = "ipv4_cidr")]
    Ipv4Cidr,
    /// IPv6 addresses (extension).
    #[serde(rename = "ipv6_addr")]
    Ipv6Addr,
    /// IPv6 prefixes (extension).
    #[serde(rename = "ipv6_cidr")]
    Ipv6Cidr,
}

/// A set element.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SetElement {
    /// Key.
    #[serde(default)]
    pub key: String,
    /// Data (unused by filtering).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<String>,
}

mod address_set;
pub use address_set::*;
