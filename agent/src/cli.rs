//! The `peerwall` command line: the contract other tools rely on.
//!
//! Exit codes: 0 answered, 2 bad input (error on stderr, nothing changed), 1 runtime failure.

// size: the command line's argument definitions (clap derive), one struct per command; the commands
// themselves are in the modules beside it.

mod cluster;
mod host;
mod observe;
mod pins;
mod privileges;
mod render;
mod scope;
mod serve;
mod sidecar;
mod verdict;

use std::io::Write;
use std::net::IpAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};

use peerwall_backend::Enforce;
use peerwall_intent::load;
use peerwall_policy::compile::{self, Compiled};
use peerwall_policy::ir::{self, eval::proto, CtState, Packet};
use peerwall_probe::{self as probe, NftProbe};

/// A failure, classified for the exit code.
#[derive(Debug)]
pub enum CliError {
    /// Bad input: exit 2.
    Input(anyhow::Error),
    /// Anything else: exit 1.
    Runtime(anyhow::Error),
    /// The command worked and found something wrong (`status`: a component down, a peer not
    /// enforced): exit 3.
    Finding(anyhow::Error),
}

impl CliError {
    /// Process exit code.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Input(_) => 2,
            Self::Runtime(_) => 1,
            Self::Finding(_) => 3,
        }
    }

    /// The underlying error.
    pub fn error(&self) -> &anyhow::Error {
        match self {
            Self::Input(e) | Self::Runtime(e) | Self::Finding(e) => e,
        }
    }
}

fn input<E: Into<anyhow::Error>>(e: E) -> CliError {
    CliError::Input(e.into())
}

fn runtime<E: Into<anyhow::Error>>(e: E) -> CliError {
    CliError::Runtime(e.into())
}

/// This build's version and the commit it was built from, as `--version` and `peerwall
/// version` print it.
pub const VERSION: &str = peerwall_enforce::VERSION;

/// peerwall: a gateway firewall for Liqo multi-cluster peering.
#[derive(Parser, Debug)]
#[command(
    name = "peerwall",
    version = VERSION,
    about = "A gateway firewall for Liqo peerings: filters what crosses each peer's tunnel, in \
             nftables or eBPF, from FirewallConfigurations, the NetworkPolicies you already \
             write and what peerwall derives from offloaded pods.",
    long_about = None
)]
pub struct Cli {
    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Read on past documents whose `kind` or `apiVersion` is a near miss of peerwall's or
    /// Liqo's (`FirewallConfigration`, `peerwall.io/v1beta1`), naming each on stderr. Without
    /// it such a document is an error (exit 2): a policy file that silently lost an object
    /// enforces less than it says.
    #[arg(long, global = true)]
    pub skip_unknown_kinds: bool,
    /// The kubeconfig file of the commands that ask the API server (as kubectl's
    /// `--kubeconfig`; default: KUBECONFIG, then ~/.kube/config, then in-cluster).
    #[arg(long, global = true, value_name = "FILE")]
    pub kubeconfig: Option<std::path::PathBuf>,
    /// The kubeconfig context to use (as kubectl's `--context`; default: its current context).
    #[arg(long, global = true, value_name = "NAME")]
    pub context: Option<String>,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Log output format.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum LogFormat {
    /// Human-readable.
    Text,
    /// One JSON object per line.
    Json,
}

/// Enforcement backend (`--backend`), as the backend layer names them.
pub use peerwall_backend_select::BackendKind;

/// Options of the backends (bpf's, and nftables' `--nft-flow-cache`).
#[derive(clap::Args, Debug, Clone)]
pub struct BpfOpts {
    /// Interfaces to attach to (names, or prefixes ending in `*`), comma-separated. The default
    /// covers Liqo's tunnel, the numbered tunnels of multi-tunnel gateways (`liqo-tunnel1`, …;
    /// Liqo's `pkg/gateway/tunnel/netlink.go`) and the Geneve interfaces (`liqo.<id>`; Liqo's
    /// `pkg/liqo-controller-manager/networking/internal-network/interface.go`).
    #[arg(long, value_delimiter = ',', default_value = "liqo-tunnel*,liqo.*")]
    pub interfaces: Vec<String>,
    /// Also attach the XDP early-drop program on Ethernet interfaces.
    #[arg(long)]
    pub xdp: bool,
    /// Entries of the datapath's flow table (its conntrack; default 65536, or 8192 where it
    /// reads the kernel's table, which then holds the TCP and UDP connections). When it is
    /// full, the least recently used flow is evicted and its next packet is classified as new.
    /// Takes effect when the table is created (a fresh pin directory).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1024..=16_777_216))]
    pub flow_table_size: Option<u32>,
    /// Hosts (/32, /128 addresses) each exact-match map of the datapath holds (default 65536;
    /// four maps, whose buckets the kernel allocates up front: 16 bytes per host). A policy
    /// with more hosts in a direction still works: the rest are looked up in the prefix tries,
    /// more slowly, and every change is written into the idle slot whole (`apply` and
    /// `peerwall inspect` say so). Takes effect when the maps are created
    /// (a fresh pin directory).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1024..=16_777_216))]
    pub host_table_size: Option<u32>,
    /// Rule counters of the datapath (default 8192: one per rule and one per chain policy, per
    /// CPU, 16 bytes each). Rules past them are enforced but not counted (`peerwall apply`
    /// and the agent's log say so). Takes effect when the maps are created (a fresh pin
    /// directory).
    #[arg(long, value_parser = clap::value_parser!(u32).range(64..=65_536))]
    pub counter_table_size: Option<u32>,
    /// Whose connection table TCP and UDP packets take their state from: `kernel` reads the
    /// kernel's (the `bpf_skb_ct_lookup` kfunc; one table where the kernel tracks connections
    /// anyway, as on a Liqo gateway with its NAT), `own` keeps the datapath's own tables,
    /// `auto` reads the kernel's for each family the kernel tracks in the namespace when the
    /// datapath loads (and the kfuncs are there), its own otherwise. Where it reads the
    /// kernel's, it keeps the kernel tracking (nftables table `peerwall-conntrack`, never
    /// run). `peerwall inspect` shows which.
    #[arg(long, value_enum, default_value_t = BpfConntrack::Auto)]
    pub bpf_conntrack: BpfConntrack,
    /// Where maps and links are pinned.
    #[arg(long, default_value = peerwall_backend_select::PIN_DIR)]
    pub pin_dir: PathBuf,
    /// nftables: a chain's accepted flows are accepted again by one lookup until the policy
    /// changes (the rules `__pw_decided`; docs/nftables.md). `off`: every packet walks the
    /// chains, and every rule's counter counts every packet it decided.
    #[arg(long, value_enum, default_value_t = OnOff::On)]
    pub nft_flow_cache: OnOff,
}

impl BpfOpts {
    /// The settings of backend `kind` these options (and defaults) describe.
    pub fn settings(&self, kind: BackendKind) -> peerwall_backend_select::Settings {
        peerwall_backend_select::Settings {
            pin_dir: self.pin_dir.clone(),
            interfaces: self.interfaces.clone(),
            xdp: self.xdp,
            flows: self.flow_table_size,
            hosts: self.host_table_size,
            counters: self.counter_table_size,
            conntrack: match self.bpf_conntrack {
                BpfConntrack::Kernel => peerwall_backend_select::Conntrack::Kernel,
                BpfConntrack::Own => peerwall_backend_select::Conntrack::Own,
                BpfConntrack::Auto => peerwall_backend_select::Conntrack::Auto,
            },
            nft_flow_cache: self.nft_flow_cache == OnOff::On,
            ..peerwall_backend_select::Settings::new(kind)
        }
    }
}

/// `--bpf-conntrack`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BpfConntrack {
    /// The kernel's connection table (fails to load where the kernel lacks the kfuncs or
    /// tracks no family here).
    Kernel,
    /// The kernel's for the families it tracks here, where it offers the kfuncs.
    Auto,
    /// The datapath's own tables.
    Own,
}

/// on / off.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OnOff {
    /// Enable.
    On,
    /// Disable.
    Off,
}

/// Verdict engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum VerdictEngine {
    /// The reference evaluator over the policy IR.
    Reference,
    /// The real kernel: a scratch namespace with the nftables rendering loaded.
    Nftables,
    /// The real eBPF datapath, loaded with the policy, run on the packet (BPF_PROG_TEST_RUN).
    Bpf,
}

/// Output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Human-readable.
    Text,
    /// JSON.
    Json,
}

/// Output of `compile`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CompileOutput {
    /// Human-readable (nft syntax).
    Text,
    /// JSON.
    Json,
    /// YAML (with --cluster).
    Yaml,
}

/// Protocol of a probe packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ProtoArg {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
    /// SCTP.
    Sctp,
    /// ICMP (ICMPv6 for IPv6 addresses).
    Icmp,
}

impl ProtoArg {
    /// The IP protocol number, for an address of family `v6`.
    pub fn number(self, v6: bool) -> u8 {
        match (self, v6) {
            (Self::Tcp, _) => proto::TCP,
            (Self::Udp, _) => proto::UDP,
            (Self::Sctp, _) => 132,
            (Self::Icmp, false) => proto::ICMP,
            (Self::Icmp, true) => proto::ICMPV6,
        }
    }
}

/// Conntrack state of a probe packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CtArg {
    /// First packet of a flow.
    New,
    /// Part of a flow seen both ways.
    Established,
    /// Related to a flow (an ICMP error).
    Related,
    /// Not tracked.
    Untracked,
    /// Unclassifiable.
    Invalid,
}

impl CtArg {
    /// The IR's state.
    pub fn state(self) -> CtState {
        match self {
            Self::New => CtState::New,
            Self::Established => CtState::Established,
            Self::Related => CtState::Related,
            Self::Untracked => CtState::Untracked,
            Self::Invalid => CtState::Invalid,
        }
    }
}

/// Subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Validate FirewallConfigurations and print what the backend would install.
    Compile {
        /// YAML files (multi-document allowed) or directories of them.
        #[arg(short = 'f', long = "file", num_args = 1.., required_unless_present = "cluster", conflicts_with = "cluster")]
        files: Vec<PathBuf>,
        /// A cluster snapshot (`kubectl get -o yaml` of Namespaces, Nodes, Pods,
        /// NetworkPolicies, Liqo's Configurations): print every object the controller writes
        /// for it (gateway configurations, AddressSets, NetworkPolicy tiers, NetworkPolicies).
        #[arg(long, num_args = 1..)]
        cluster: Vec<PathBuf>,
        /// Backend to render for.
        #[arg(long, value_enum, default_value_t = BackendKind::Nftables)]
        backend: BackendKind,
        /// `text` prints nft syntax; `json` the exact libnftables JSON that `apply` loads;
        /// with --cluster, `yaml` (or `json`) the objects, `text` what each gateway enforces.
        #[arg(long, value_enum, default_value_t = CompileOutput::Text)]
        output: CompileOutput,
    },
    /// The fate of one packet crossing the gateway.
    Verdict(VerdictArgs),
    /// Install the policy on this host (this network namespace, or --netns) and exit.
    /// peerwall's tables become exactly the given ones: owned tables not in the input are
    /// removed, unchanged ones kept (counters included).
    Apply {
        /// YAML files or directories.
        #[arg(short = 'f', long = "file", required = true, num_args = 1..)]
        files: Vec<PathBuf>,
        /// Backend.
        #[arg(long, value_enum, default_value_t = BackendKind::Nftables)]
        backend: BackendKind,
        /// Act in this network namespace (`ip netns` name, or a path such as
        /// `/proc/<pid>/ns/net`) instead of the one the command runs in.
        #[arg(long)]
        netns: Option<String>,
        /// bpf backend options.
        #[command(flatten)]
        bpf: BpfOpts,
    },
    /// The boot policy of a Liqo gateway (the sidecar's init container): the controller's
    /// default deny for `--peer` (from the tunnel, replies and Liqo's tunnel check only) as an
    /// nftables table of its own, in force before Liqo's containers create the tunnel. The
    /// agent started with `--boot-peer` lets it go once the peer's configuration is in force.
    Boot {
        /// The peer (remote cluster id) of this gateway.
        #[arg(long)]
        peer: String,
        /// Tunnel interface: a name, or a prefix ending in `*`.
        #[arg(long, default_value = crate::protection::DEFAULT_TUNNEL)]
        tunnel_interface: String,
        /// The UDP port of Liqo's tunnel check.
        #[arg(long, default_value_t = crate::protection::LIQO_PING_PORT)]
        liqo_ping_port: u16,
        /// Act in this network namespace (`ip netns` name or a path) instead of this one.
        #[arg(long)]
        netns: Option<String>,
    },
    /// Take `peerwall-boot` out of this node's CNI chain and remove its binary (what the
    /// DaemonSet's agent does with `--cni-boot` when peerwall is uninstalled; for a node whose
    /// agent could not).
    CniRemove {
        /// The container runtime's CNI configuration directory.
        #[arg(long, default_value = "/etc/cni/net.d")]
        cni_conf_dir: PathBuf,
        /// The container runtime's CNI binary directory.
        #[arg(long, default_value = "/opt/cni/bin")]
        cni_bin_dir: PathBuf,
    },
    /// Remove what peerwall installed here: its nftables tables and (bpf) its pinned links
    /// (detaching the programs) and maps; whichever is found, or only --backend's.
    Delete {
        /// Only this backend's part (default: whatever is found).
        #[arg(long, value_enum)]
        backend: Option<BackendKind>,
        /// Where and in which namespace.
        #[command(flatten)]
        at: host::HostArgs,
    },
    /// Decode the pinned bpf datapath: live slot, attachments, hooks, chains, rule counters.
    Inspect {
        /// Where and in which namespace.
        #[command(flatten)]
        at: host::HostArgs,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// Stream what the datapath did to real traffic: drops, rejects, would-drops (audit) and,
    /// with the agent's --flow-log, accepted flows, each with the rule that decided.
    Observe(observe::ObserveArgs),
    /// Emergency switch: `on` lets every packet through, `off` enforces again. The agent keeps
    /// it as set (it does not repair it away) and reports it (`peerwall_allow_all`).
    AllowAll {
        /// on or off.
        #[arg(value_enum)]
        state: OnOff,
        /// Only this backend's switch: bpf (the `ALLOW_ALL` map) or nftables (an accept leading
        /// every peerwall chain, recorded by the table `inet peerwall_allow_all`). Default:
        /// every backend found installed here.
        #[arg(long, value_enum)]
        backend: Option<BackendKind>,
        /// Where and in which namespace.
        #[command(flatten)]
        at: host::HostArgs,
    },
    /// Show the rule counters of what peerwall installed here (nftables tables, bpf datapath).
    Counters {
        /// Only this backend's counters (default: whatever is found).
        #[arg(long, value_enum)]
        backend: Option<BackendKind>,
        /// Where and in which namespace.
        #[command(flatten)]
        at: host::HostArgs,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// Print peerwall's CRDs (YAML) generated from the Rust types.
    Crd {
        /// Print the ClusterNetworkPolicy CRD (policy.networking.k8s.io/v1alpha2) instead, as
        /// the controller installs it where the cluster has none.
        #[arg(long)]
        cluster_network_policy: bool,
    },
    /// This build's version and the git commit it was built from (`--output json` for
    /// scripts). The image of a release is tagged with the version (deploy/ names it).
    Version {
        /// Output format.
        #[arg(long, value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// Every peer's protection at a glance, from the API server (KUBECONFIG or in-cluster):
    /// enforced or not, on which hosts and backends, generation, audit, drops in the last
    /// minutes (agents with --events), the last error.
    Status {
        /// Count drops of the last this many minutes.
        #[arg(long, default_value_t = 15)]
        minutes: u64,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// Print the JSON patch that makes peerwall a container of a Liqo gateway template
    /// (sidecar mode), from the template itself: adds the container and its volume, or
    /// replaces them when present (applying it again changes nothing).
    SidecarPatch(sidecar::SidecarArgs),
    /// The gateway lab: three consumer clusters (one whose pod CIDR overlaps the provider's,
    /// behind Liqo's remapping NAT), each over a real WireGuard tunnel to its own gateway
    /// running the agent on the controller's output, a provider node, both backends; prints
    /// the reachability matrix (protection, exceptions, NetworkPolicies, call home,
    /// anti-spoofing) and the time for a newly offloaded pod to become reachable.
    Lab {
        /// Backend (both when omitted).
        #[arg(long, value_enum)]
        backend: Option<BackendKind>,
        /// Leave the namespaces in place afterwards.
        #[arg(long)]
        keep: bool,
    },
    /// Keep a source of FirewallConfigurations enforced on this host (runs until SIGINT/SIGTERM;
    /// enforcement stays in place after it stops).
    Agent(Box<AgentArgs>),
    /// Provider and consumer protection (one per cluster): a default-deny gateway
    /// FirewallConfiguration per peer allowing only offloaded pods, and a NetworkPolicy per
    /// offloaded namespace. Runs until SIGINT/SIGTERM.
    Controller {
        /// Tunnel interface inside the gateway: a name, or a prefix ending in `*` (the default
        /// covers `liqo-tunnel` and the numbered tunnels of multi-tunnel gateways).
        #[arg(long, default_value = crate::protection::DEFAULT_TUNNEL)]
        tunnel_interface: String,
        /// Also drop traffic between our pods offloaded to different providers.
        #[arg(long)]
        block_leaf_to_leaf: bool,
        /// Publish every gateway configuration in audit mode (`spec.audit: true`): what it
        /// would drop is reported as events, not dropped. For rolling out; remove to enforce.
        #[arg(long)]
        audit: bool,
        /// The UDP port of Liqo's tunnel check (Liqo's gateway flag `--ping-port`): the
        /// gateway itself takes it from the tunnel, and nothing else but replies.
        #[arg(long, default_value_t = crate::protection::LIQO_PING_PORT)]
        liqo_ping_port: u16,
        /// Let our pods a peer runs reach every pod here through its tunnel (by default they
        /// reach only pods of their own namespace, plus what a ProtectionPolicy opens).
        #[arg(long)]
        consumer_reaches_every_namespace: bool,
        /// Bytes of JSON a FirewallConfiguration the controller writes may take before its
        /// largest address sets move into AddressSets (etcd takes at most 1.5 MiB per
        /// request; lower it where etcd runs with a smaller `--max-request-bytes`).
        #[arg(long, default_value_t = crate::protection::spill::INLINE_BUDGET)]
        inline_budget_bytes: usize,
        /// Where `/metrics`, `/healthz` and `/readyz` are served.
        #[arg(long, default_value = "0.0.0.0:9091")]
        metrics_addr: std::net::SocketAddr,
        /// Coverage check: label selector of Liqo's active gateway pods.
        #[arg(long, default_value = crate::k8s::gateway_pods::pods::GATEWAY_SELECTOR)]
        gateway_selector: String,
        /// Coverage check: label selector of peerwall's agent pods (the DaemonSet's).
        #[arg(long, default_value = "app.kubernetes.io/name=peerwall-agent")]
        agent_selector: String,
        /// Coverage check: seconds a gateway pod may run with no ready agent on its node and
        /// no sidecar before a Warning Event `Unprotected` names it.
        #[arg(long, default_value_t = 60)]
        unprotected_grace_secs: u64,
    },
    /// Validating admission webhook for FirewallConfiguration (the agent's validation), over TLS.
    Webhook {
        /// Listen address.
        #[arg(long, default_value = "0.0.0.0:8443")]
        listen: std::net::SocketAddr,
        /// PEM certificate (chain) from a file (cert-manager, or a Secret mounted by hand),
        /// reloaded when it changes. Without it, peerwall issues and rotates its own.
        #[arg(long, requires = "tls_key")]
        tls_cert: Option<PathBuf>,
        /// PEM private key of --tls-cert.
        #[arg(long, requires = "tls_cert")]
        tls_key: Option<PathBuf>,
        /// The certificate peerwall issues itself (without --tls-cert).
        #[command(flatten)]
        issue: IssueArgs,
        /// What the agents take: the webhook refuses the rest with the reason.
        #[command(flatten)]
        trust: TrustArgs,
        /// The user peerwall's controller writes as: only it may write the controller's
        /// objects (`peerwall-gateway`, `peerwall-networkpolicy`), tables named
        /// `peerwall_*`/`pwnp_*`/`peerwall-boot`, and AddressSets filling its objects' sets.
        /// Default: `system:serviceaccount:$POD_NAMESPACE:peerwall-controller`.
        #[arg(long)]
        controller_user: Option<String>,
    },
}

/// The webhook's own certificate: a CA and a serving certificate kept in a Secret of its
/// namespace, the webhook configuration's `caBundle` kept equal to the CA.
#[derive(clap::Args, Debug, Clone)]
pub struct IssueArgs {
    /// Secret holding the CA and the serving certificate (in $POD_NAMESPACE, else
    /// `peerwall-system`).
    #[arg(long, default_value = "peerwall-webhook-tls")]
    pub secret: String,
    /// ValidatingWebhookConfiguration whose `caBundle` follows the CA.
    #[arg(long, default_value = "peerwall")]
    pub webhook_configuration: String,
    /// Service in front of the webhook: the certificate names `<service>.<namespace>.svc`
    /// and its other forms.
    #[arg(long, default_value = "peerwall-webhook")]
    pub service: String,
    /// Names of the serving certificate instead (DNS names or IP addresses, comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub tls_names: Vec<String>,
    /// Validity of a serving certificate, seconds (renewed with a third left).
    #[arg(long, default_value_t = 365 * 24 * 3600, value_parser = clap::value_parser!(u64).range(30..))]
    pub cert_validity_secs: u64,
    /// Validity of the CA, seconds (renewed with a third left; the old one stays trusted
    /// until it expires).
    #[arg(long, default_value_t = 10 * 365 * 24 * 3600, value_parser = clap::value_parser!(u64).range(90..))]
    pub ca_validity_secs: u64,
}

impl IssueArgs {
    /// What to issue, in `namespace`.
    pub fn issue(&self, namespace: &str) -> crate::k8s::webhook::certs::Issue {
        let names = if self.tls_names.is_empty() {
            let svc = &self.service;
            vec![
                format!("{svc}.{namespace}.svc"),
                format!("{svc}.{namespace}.svc.cluster.local"),
                format!("{svc}.{namespace}"),
                svc.clone(),
            ]
        } else {
            self.tls_names.clone()
        };
        crate::k8s::webhook::certs::Issue {
            namespace: namespace.to_string(),
            secret: self.secret.clone(),
            webhook_configuration: self.webhook_configuration.clone(),
            names,
            ca_validity: std::time::Duration::from_secs(self.ca_validity_secs),
            validity: std::time::Duration::from_secs(self.cert_validity_secs),
        }
    }
}

/// Arguments of `peerwall verdict`.
#[derive(clap::Args, Debug)]
pub struct VerdictArgs {
    /// YAML files or directories of FirewallConfigurations.
    #[arg(short = 'f', long = "file", num_args = 1.., conflicts_with = "cluster")]
    pub files: Vec<PathBuf>,
    /// A cluster snapshot (`kubectl get -o yaml` of Namespaces, Nodes, Pods,
    /// NetworkPolicies, Liqo's Configurations; files or directories): judge by what the
    /// controller writes for it, between pods named with --from/--to, or --matrix.
    #[arg(long, num_args = 1..)]
    pub cluster: Vec<PathBuf>,
    /// `--cluster`: the source pod, `NAMESPACE/NAME`, or the address of a peer's pod the
    /// snapshot does not hold (as this cluster sees it; the provider asking about a consumer's
    /// pod), behind the peer `--peer` names.
    #[arg(long, requires = "cluster")]
    pub from: Option<String>,
    /// `--cluster`: the destination pod, `NAMESPACE/NAME`, or a peer's pod's address (as
    /// `--from`).
    #[arg(long, requires = "cluster")]
    pub to: Option<String>,
    /// `--cluster` with an address in `--from` or `--to`: the peer (its cluster id) whose pod
    /// has it; needed where the snapshot has several peers.
    #[arg(long, requires = "cluster", conflicts_with = "matrix")]
    pub peer: Option<String>,
    /// `--cluster`: the truth table of every pod pair that crosses a gateway, per probe
    /// (`--proto`/`--dport`, or TCP, UDP and SCTP on ports 80 and 81 as the e2e suite probes).
    #[arg(long, requires = "cluster", conflicts_with_all = ["from", "to"])]
    pub matrix: bool,
    /// `--cluster` with `--from`/`--to`: after the verdict, how each direction was decided (the
    /// source's egress, the destination's ingress: the Admin tier, the NetworkPolicies, the
    /// Baseline tier, each with the policy and rule that acted).
    #[arg(long, requires = "cluster", conflicts_with = "matrix")]
    pub trace: bool,
    /// Input interface (e.g. liqo-tunnel).
    #[arg(long, conflicts_with = "cluster")]
    pub iif: Option<String>,
    /// Output interface; without it the packet is addressed to the gateway itself.
    #[arg(long, conflicts_with = "cluster")]
    pub oif: Option<String>,
    /// Source address.
    #[arg(long, conflicts_with = "cluster")]
    pub src: Option<IpAddr>,
    /// Destination address.
    #[arg(long, conflicts_with = "cluster")]
    pub dst: Option<IpAddr>,
    /// Protocol (default tcp).
    #[arg(long, value_enum)]
    pub proto: Option<ProtoArg>,
    /// Source port (TCP/UDP/SCTP).
    #[arg(long, default_value_t = 40000)]
    pub sport: u16,
    /// Destination port (TCP/UDP/SCTP; default 80).
    #[arg(long)]
    pub dport: Option<u16>,
    /// Conntrack state.
    #[arg(long = "ct-state", value_enum, default_value_t = CtArg::New)]
    pub ct_state: CtArg,
    /// Who judges.
    #[arg(long, value_enum, default_value_t = VerdictEngine::Reference)]
    pub engine: VerdictEngine,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Output::Text)]
    pub output: Output,
}

/// Arguments of `peerwall agent`.
#[derive(clap::Args, Debug)]
pub struct AgentArgs {
    /// Policy source: `dir:PATH` (a directory of YAML files, polled) or `kube` (watch the
    /// API server: in-cluster service account or KUBECONFIG).
    #[arg(long)]
    pub source: crate::enforcement::PolicySource,
    /// `kube` source: label selector of peerwall's FirewallConfigurations
    /// (`firewallconfigurations.peerwall.io`) this host enforces; add
    /// `peerwall.io/remote-cluster-id=<peer>` to take one peer's gateway objects only.
    #[arg(long, default_value = crate::k8s::DEFAULT_SELECTOR)]
    pub selector: String,
    /// `kube` source, opt-in: also enforce Liqo's own FirewallConfigurations
    /// (`networking.liqo.io`) that this label selector picks, e.g.
    /// `networking.liqo.io/firewall-category=gateway,networking.liqo.io/firewall-unique=<peer>`.
    /// Read only: no status, no finalizer on Liqo's objects. Only where Liqo's own firewall
    /// controller does not apply them too (both would claim the same tables).
    #[arg(long)]
    pub liqo_selector: Option<String>,
    /// FirewallConfigurations another enforcer keeps in force where this agent enforces
    /// (Liqo's firewall controller, in its gateways), read for their NAT only: the bpf
    /// datapath classifies at ingress and must see destinations as prerouting rewrites them
    /// (Liqo's remapping of overlapping CIDRs). `dir:PATH` with a `dir:` source; a label
    /// selector of Liqo's FirewallConfigurations with `--source kube`. Repeatable.
    /// `--gateway-pods` with the bpf backend observes each gateway's remapping and IP mapping
    /// objects by itself.
    #[arg(long)]
    pub observe: Vec<String>,
    /// `kube` source: the Liqo entity this agent stands beside, `Pod:<namespace>/<name>` (a
    /// gateway pod), `Node:<name>` (a fabric node) or `InternalNode:<name>`. Where the cluster serves Liqo's
    /// FirewallConfigurationBindings (liqotech/liqo PR #3290), Liqo's FirewallConfigurations
    /// (`--liqo-selector`, `--observe`) count only while a binding names them and this
    /// target, as Liqo applies them. `--gateway-pods` sets it for each gateway.
    #[arg(long, value_parser = peerwall_intent::binding::Target::parse, conflicts_with = "gateway_pods")]
    pub liqo_target: Option<peerwall_intent::binding::Target>,
    /// Enforce in this named network namespace (`ip netns` name, e.g. a gateway's) instead
    /// of the agent's own; the agent's API connection and endpoints stay where it runs.
    #[arg(long, conflicts_with = "gateway_pods")]
    pub netns: Option<String>,
    /// `kube` source, the DaemonSet's mode: find the active Liqo gateway pods on this node
    /// ($NODE_NAME or --host) and enforce inside each one's network namespace, for its peer
    /// only (objects labelled `peerwall.io/remote-cluster-id=<peer>`). Needs `hostPID`.
    #[arg(long)]
    pub gateway_pods: bool,
    /// `--gateway-pods`: label selector of Liqo's gateway pods.
    #[arg(long, default_value = crate::k8s::gateway_pods::pods::GATEWAY_SELECTOR)]
    pub gateway_selector: String,
    /// `--gateway-pods`: the node's procfs (the pods' processes; mounted by `hostPID`).
    #[arg(long, default_value = "/proc")]
    pub proc: PathBuf,
    /// `--gateway-pods` with `--backend bpf`: a gateway that finds no turn to load its
    /// datapath free (the node's CPUs each load one at a time: a reboot with many gateways)
    /// waits behind its boot policy, dropping everything from the tunnel, instead of having
    /// nftables enforce its policy until the datapath is loaded and takes over.
    #[arg(long, requires = "gateway_pods")]
    pub no_start_bridge: bool,
    /// `--gateway-pods` with `--backend bpf`: how many gateways load their datapath at once
    /// (creating its maps, verifying its programs: CPU-bound); default one per CPU the agent
    /// may run on.
    #[arg(long, requires = "gateway_pods", value_parser = clap::value_parser!(u16).range(1..))]
    pub load_turns: Option<u16>,
    /// `--gateway-pods`: chain `peerwall-boot` into the node's CNI configuration, so a new
    /// gateway pod's boot policy is in force from its sandbox's creation, before its
    /// containers, even while no agent runs on the node. Taken out again when the agent's
    /// DaemonSet or namespace is deleted.
    #[command(flatten)]
    pub cni: CniArgs,
    /// `kube` source: this host's name in status conditions and finalizers
    /// (default: $NODE_NAME, $POD_NAME or the hostname).
    #[arg(long)]
    pub host: Option<String>,
    /// Backend.
    #[arg(long, value_enum, default_value_t = BackendKind::Nftables)]
    pub backend: BackendKind,
    /// bpf backend options.
    #[command(flatten)]
    pub bpf: BpfOpts,
    /// How often the source is checked (and nftables drift repaired).
    #[arg(long, default_value_t = 200)]
    pub interval_ms: u64,
    /// A connection the agent ends (a policy change no longer allows it) stays ended,
    /// whichever side sends next, until both sides have been quiet this long (nftables: table
    /// `inet peerwall-ended`; bpf: the flow's `ended` mark, at most 43200); 0: only delete it
    /// from the connection table, so the side nobody filters can open it again.
    #[arg(long, default_value_t = peerwall_backend_select::DEFAULT_ENDED_SECS,
          value_parser = clap::value_parser!(u32).range(0..=43200))]
    pub ended_connection_secs: u32,
    /// Where `/metrics`, `/healthz` and `/readyz` are served (what Prometheus scrapes).
    #[arg(long, default_value = DEFAULT_METRICS_ADDR)]
    pub metrics_addr: std::net::SocketAddr,
    /// Where `/events` is served with --events: flows with addresses, so localhost by
    /// default (`peerwall observe` and `kubectl exec` reach it there). The same address as
    /// --metrics-addr serves both on one listener.
    #[arg(long, default_value = DEFAULT_EVENTS_ADDR)]
    pub events_addr: std::net::SocketAddr,
    /// Events (what `peerwall observe` shows).
    #[command(flatten)]
    pub events: EventArgs,
    /// Enforce every table in audit mode: drops and rejects are accepted and reported as
    /// would-drops (events with `--events`). Remove to enforce.
    #[arg(long)]
    pub audit: bool,
    /// A gateway's agent (sidecar): keep the boot policy of this peer (`peerwall boot
    /// --peer`, default deny from the tunnel) in force until the controller's gateway
    /// configuration for the peer is, and let it go in the same step. `--gateway-pods` does
    /// this for every gateway by itself.
    #[arg(long, conflicts_with = "gateway_pods")]
    pub boot_peer: Option<String>,
    /// Who may steer this agent's gateways.
    #[command(flatten)]
    pub trust: TrustArgs,
}

/// The node's CNI chain (`--cni-boot`).
#[derive(clap::Args, Debug, Clone)]
pub struct CniArgs {
    /// Chain `peerwall-boot` into the node's CNI configuration (`--gateway-pods`).
    #[arg(long, requires = "gateway_pods")]
    pub cni_boot: bool,
    /// The container runtime's CNI binary directory, as mounted (same path as on the node).
    #[arg(long, default_value = "/opt/cni/bin")]
    pub cni_bin_dir: PathBuf,
    /// The container runtime's CNI configuration directory, as mounted.
    #[arg(long, default_value = "/etc/cni/net.d")]
    pub cni_conf_dir: PathBuf,
    /// Pods whose name starts with one of these get the boot policy at their sandbox's
    /// creation (Liqo names its gateway Deployments `gw-<name>`), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "gw-")]
    pub cni_pod_prefixes: Vec<String>,
}

impl CniArgs {
    /// The installer's settings, when asked for.
    pub fn settings(&self, proc: &std::path::Path) -> Option<crate::cni::install::Settings> {
        self.cni_boot.then(|| crate::cni::install::Settings {
            bin_dir: self.cni_bin_dir.clone(),
            conf_dir: self.cni_conf_dir.clone(),
            pod_name_prefixes: self.cni_pod_prefixes.clone(),
            // The runtime's shim, whose child the agent is: in the node's mount namespace,
            // where the runtime runs CNI plugins (PID 1 may refuse even root its links).
            host_mnt: proc.join(format!("{}/ns/mnt", std::os::unix::process::parent_id())),
        })
    }
}

/// Who may steer a gateway (`--source kube`): the namespaces gateway objects are taken from and
/// whether they may change packets. Run the webhook with the same values: it refuses what the
/// agents would ignore.
#[derive(clap::Args, Debug, Clone)]
pub struct TrustArgs {
    /// Namespaces whose peerwall objects (FirewallConfigurations, AddressSets) steer any
    /// peer's gateway, comma-separated. Default: peerwall's own namespace ($POD_NAMESPACE,
    /// else `peerwall-system`). Objects elsewhere are ignored, with a warning Event on them.
    #[arg(long, value_delimiter = ',')]
    pub gateway_namespaces: Vec<String>,
    /// Also take a peer's objects from its Liqo tenant namespace (`liqo.io/tenant-namespace=true`,
    /// where the controller writes), only when labelled for that namespace's own peer.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub tenant_namespaces: bool,
    /// Enforce NAT and route chains, NAT rules and the ctmark, metamarkfromctmark,
    /// tcpmssclamp and notrack actions of peerwall's objects (off: such objects are refused,
    /// their last good spec stays). Liqo's own objects are not affected.
    #[arg(long)]
    pub allow_packet_changes: bool,
}

/// peerwall's namespace unless the pod says otherwise.
pub const DEFAULT_NAMESPACE: &str = "peerwall-system";

/// peerwall's own namespace: $POD_NAMESPACE, else [`DEFAULT_NAMESPACE`].
pub fn own_namespace() -> String {
    std::env::var("POD_NAMESPACE")
        .ok()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| DEFAULT_NAMESPACE.to_string())
}

impl TrustArgs {
    /// The trust these flags describe.
    pub fn trust(&self) -> crate::k8s::trust::Trust {
        let namespaces = if self.gateway_namespaces.is_empty() {
            std::collections::BTreeSet::from([own_namespace()])
        } else {
            self.gateway_namespaces
                .iter()
                .map(|n| n.trim().to_string())
                .filter(|n| !n.is_empty())
                .collect()
        };
        crate::k8s::trust::Trust {
            namespaces,
            tenant_namespaces: self.tenant_namespaces,
            packet_changes: self.allow_packet_changes,
        }
    }
}

/// Event options of the agent.
#[derive(clap::Args, Debug, Clone)]
pub struct EventArgs {
    /// Report drops, rejects and would-drops as events: `/events`, `peerwall observe`,
    /// `peerwall_drops_total`. nftables: log rules to NFLOG; bpf: a ring buffer.
    #[arg(long)]
    pub events: bool,
    /// Also report the first packet of every accepted flow (a flow log; implies --events).
    #[arg(long)]
    pub flow_log: bool,
    /// Events per second at most (nftables: per table; bpf: per CPU); burst twice that. Per
    /// flow, at most one event per second in any case.
    #[arg(long, default_value_t = 100)]
    pub event_rate: u32,
    /// `--source kube`: how often each object whose rules dropped packets gets a Kubernetes
    /// Event summarizing them (at most five per object).
    #[arg(long, default_value_t = 60)]
    pub drop_summary_secs: u64,
    /// nftables: NFLOG group of the log rules (one listener per group and namespace).
    #[arg(long, default_value_t = DEFAULT_NFLOG_GROUP)]
    pub nflog_group: u16,
}

/// The agent's metrics address unless told otherwise: a port no common exporter takes
/// (Prometheus 9090, pushgateway 9091, node exporter 9100, Cilium 9962-9965), since the
/// DaemonSet's agent shares the node's network.
pub const DEFAULT_METRICS_ADDR: &str = "0.0.0.0:9977";

/// The agent's `/events` address unless told otherwise (localhost only).
pub const DEFAULT_EVENTS_ADDR: &str = "127.0.0.1:9978";

/// NFLOG group the agent and `observe` use unless told otherwise.
pub const DEFAULT_NFLOG_GROUP: u16 = 6120;

impl EventArgs {
    /// The backend's event settings; None when events are off.
    pub fn settings(&self) -> Option<peerwall_backend_select::EventSettings> {
        (self.events || self.flow_log).then_some(peerwall_backend_select::EventSettings {
            flow_log: self.flow_log,
            rate: self.event_rate.max(1),
            nflog_group: self.nflog_group,
        })
    }
}

/// SIGINT/SIGTERM trigger the returned signal.
fn stop_flag() -> Result<std::sync::Arc<crate::shutdown::Shutdown>, CliError> {
    let stop = crate::shutdown::Shutdown::new();
    let s = stop.clone();
    ctrlc::set_handler(move || s.trigger())
        .context("installing the signal handler")
        .map_err(runtime)?;
    Ok(stop)
}

fn default_host() -> String {
    ["NODE_NAME", "POD_NAME", "HOSTNAME"]
        .iter()
        .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|h| h.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn load_and_compile(files: &[PathBuf]) -> Result<Compiled, CliError> {
    let loaded = load::load_paths_all(files).map_err(input)?;
    near_misses(&loaded)?;
    // Errors and warnings name the file and line each object was read from.
    let at = |origin: &str| loaded.sources.get(origin).cloned();
    // Compiles, but may not be storable in the API server (a warning: local files may stay
    // local).
    for o in &loaded.objects {
        let bytes = peerwall_intent::size::json_len(&o.spec).unwrap_or(0);
        if let Some(w) = peerwall_intent::size::size_warning(bytes) {
            let file = at(&o.origin.to_string()).unwrap_or_default();
            tracing::warn!(object = %o.origin, file, "{w}");
        }
    }
    let compiled =
        compile::compile(&loaded.objects).map_err(|e| input(anyhow::anyhow!(e.located(at))))?;
    for (origin, w) in &compiled.warnings {
        let file = at(&origin.to_string()).unwrap_or_default();
        tracing::warn!(object = %origin, file, "{w}");
    }
    // AddressSet slices fill the sets that take them (`fromAddressSets`), as the agents merge
    // them; one that cannot be merged is an error here, not a silently empty set.
    let mut slices = Vec::new();
    for a in &loaded.address_sets {
        let c = peerwall_policy::sliced::check_slice(a).map_err(|e| {
            input(anyhow::anyhow!(e
                .lines(at(&e.origin).as_deref())
                .join("\n")))
        })?;
        slices.push(c);
    }
    if slices.is_empty() {
        return Ok(compiled);
    }
    let (sliced, issues) = peerwall_policy::sliced::Sliced::new(compiled, &slices);
    if let Some((origin, issue)) = issues.into_iter().next() {
        let file = at(&origin.to_string()).unwrap_or_default();
        return Err(input(anyhow::anyhow!(
            "{file}: AddressSet {origin}: {issue}"
        )));
    }
    Ok(sliced.compiled().clone())
}

/// Marks every object node of a schema `x-kubernetes-preserve-unknown-fields`: the API server
/// then keeps a field the schema does not name instead of pruning it, so the webhook and the
/// agents (whose readers refuse unknown fields, with a did-you-mean) see a misspelt `ctState`
/// and refuse the object. Pruned, it was silently gone, and a match entry that lost its
/// condition matched more (everything from the tunnel).
fn preserve_unknown_fields(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(o) => {
            // Objects with named properties only: a map (`additionalProperties`) keeps
            // every key already.
            if o.get("type").and_then(|t| t.as_str()) == Some("object")
                && o.contains_key("properties")
            {
                o.insert(
                    "x-kubernetes-preserve-unknown-fields".into(),
                    serde_json::Value::Bool(true),
                );
            }
            o.values_mut().for_each(preserve_unknown_fields);
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(preserve_unknown_fields),
        _ => {}
    }
}

/// The CRD as YAML.
///
/// Schema `default`s derived from `#[serde(default)]` are removed: the API server would apply
/// them (and v1.20 rejects an empty-string default as "null"), while peerwall's loader already
/// treats absent fields, and validation reports them with their path. Unknown fields of
/// `spec` are kept (`preserve_unknown_fields`).
pub fn crd_yaml() -> anyhow::Result<String> {
    crd_docs()
}

fn crd_docs() -> anyhow::Result<String> {
    use kube::CustomResourceExt;
    let mut docs = Vec::new();
    for crd in [
        peerwall_intent::FirewallConfiguration::crd(),
        peerwall_intent::AddressSet::crd(),
        peerwall_intent::ProtectionPolicy::crd(),
    ] {
        let mut v = serde_json::to_value(&crd)?;
        if let Some(versions) = v.pointer_mut("/spec/versions") {
            crate::k8s::schema::strip_defaults(versions);
            for version in versions.as_array_mut().into_iter().flatten() {
                if let Some(spec) = version.pointer_mut("/schema/openAPIV3Schema/properties/spec") {
                    preserve_unknown_fields(spec);
                }
            }
        }
        docs.push(serde_yaml::to_string(&v)?);
    }
    Ok(docs.join("---\n"))
}

fn out(s: &str) -> Result<(), CliError> {
    let mut o = std::io::stdout().lock();
    o.write_all(s.as_bytes())
        .and_then(|_| o.flush())
        .context("writing to stdout")
        .map_err(runtime)
}

/// The one apply path of every backend: make `policy` the whole policy in force and log what
/// changed. A policy the backend cannot take is bad input (exit 2); a failure of the host,
/// exit 1.
fn apply_with(b: &mut dyn Enforce, policy: &ir::Policy) -> Result<(), CliError> {
    let name = b.name();
    match b.apply(policy) {
        Ok(report) => {
            for w in &report.warnings {
                tracing::warn!(backend = name, "{w}");
            }
            tracing::info!(backend = name, rules = policy.rule_count(), %report, "policy applied");
            out(&format!("{name}: {report}\n"))
        }
        Err(e) => Err(backend_error(e)),
    }
}

/// A backend's error for the exit code: what was asked cannot be done (2), or the host
/// failed (1).
fn backend_error(e: peerwall_backend::BackendError) -> CliError {
    if e.refused_input() {
        input(e)
    } else {
        runtime(e)
    }
}

/// An error and its causes as one message, each cause once: a cause whose text its parent
/// already quotes (a YAML or I/O error carried both as source and in the message) is not
/// repeated.
pub fn error_text(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let c = cause.to_string();
        if text.contains(c.as_str()) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&c);
    }
    text
}

/// Run a parsed command line.
/// `--skip-unknown-kinds`, as given (read by every command that loads files).
static SKIP_UNKNOWN_KINDS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// Near misses ([`load::Loaded::near_misses`]) refused, or named and skipped with
/// `--skip-unknown-kinds`.
fn near_misses(loaded: &load::Loaded) -> Result<(), CliError> {
    if SKIP_UNKNOWN_KINDS.get().copied().unwrap_or(false) {
        for (origin, why) in &loaded.near_misses {
            tracing::warn!(document = %origin, "{why}; skipped (--skip-unknown-kinds)");
        }
        return Ok(());
    }
    loaded.refuse_near_misses().map_err(|e| {
        input(anyhow::anyhow!(
            "{e} (--skip-unknown-kinds reads on past such documents)"
        ))
    })
}

pub fn run(cli: Cli) -> Result<(), CliError> {
    let _ = SKIP_UNKNOWN_KINDS.set(cli.skip_unknown_kinds);
    crate::k8s::connect_with(cli.kubeconfig, cli.context);
    match cli.command {
        Command::Compile {
            files,
            cluster,
            backend,
            output,
        } => match (cluster.is_empty(), output) {
            (false, _) => cluster::compile(&cluster, backend, output),
            (true, CompileOutput::Yaml) => Err(input(anyhow::anyhow!(
                "--output yaml prints a cluster's objects: use it with --cluster"
            ))),
            (true, CompileOutput::Json) => render::compile(&files, backend, Output::Json),
            (true, CompileOutput::Text) => render::compile(&files, backend, Output::Text),
        },
        // A cluster's policy is derived first (`cluster`), then judged the same way.
        Command::Verdict(a) if !a.cluster.is_empty() => cluster::verdict(a),
        Command::Verdict(a) => verdict::verdict(a),
        Command::Apply {
            files,
            backend,
            netns,
            bpf,
        } => host::apply(&files, backend, bpf, netns),
        Command::Delete { backend, at } => host::delete(backend, &at),
        Command::Boot {
            peer,
            tunnel_interface,
            liqo_ping_port,
            netns,
        } => host::boot(&peer, tunnel_interface, liqo_ping_port, netns),
        Command::CniRemove {
            cni_conf_dir,
            cni_bin_dir,
        } => {
            let s = crate::cni::install::Settings {
                bin_dir: cni_bin_dir,
                conf_dir: cni_conf_dir,
                pod_name_prefixes: Vec::new(),
                host_mnt: PathBuf::from("/proc/1/ns/mnt"),
            };
            let files = crate::cni::install::uninstall(&s).map_err(runtime)?;
            out(&format!(
                "peerwall-boot: out of {} ({} changed), {} removed\n",
                s.conf_dir.display(),
                files.len(),
                s.binary().display()
            ))
        }
        Command::Inspect { at, output } => host::inspect(&at, output),
        Command::AllowAll { state, backend, at } => host::allow_all(state, backend, &at),
        Command::Counters {
            backend,
            at,
            output,
        } => host::counters(backend, &at, output),
        Command::Observe(a) => observe::observe(a),
        Command::Crd {
            cluster_network_policy: false,
        } => out(&crd_yaml().map_err(runtime)?),
        Command::Crd {
            cluster_network_policy: true,
        } => out(&crate::k8s::cluster_policy_crd::crd()
            .map_err(anyhow::Error::from)
            .and_then(|c| Ok(serde_yaml::to_string(&c)?))
            .map_err(runtime)?),
        Command::Status { minutes, output } => status(minutes, output),
        Command::Version { output } => match output {
            Output::Text => out(&format!("peerwall {VERSION}\n")),
            Output::Json => out(&format!(
                "{}\n",
                serde_json::json!({
                    "version": env!("CARGO_PKG_VERSION"),
                    "commit": peerwall_enforce::GIT_COMMIT,
                })
            )),
        },
        Command::SidecarPatch(a) => sidecar::sidecar_patch(a),
        Command::Lab { backend, keep } => serve::lab(backend, keep),
        Command::Agent(a) => serve::agent(*a),
        Command::Controller {
            tunnel_interface,
            block_leaf_to_leaf,
            audit,
            liqo_ping_port,
            consumer_reaches_every_namespace,
            inline_budget_bytes,
            metrics_addr,
            gateway_selector,
            agent_selector,
            unprotected_grace_secs,
        } => serve::controller(
            crate::protection::Options {
                tunnel: tunnel_interface,
                block_leaf_to_leaf,
                audit,
                liqo_ping_port,
                own_namespace_only: !consumer_reaches_every_namespace,
                inline_budget: inline_budget_bytes,
            },
            crate::k8s::coverage::Settings {
                gateway_selector,
                agent_selector,
                grace: std::time::Duration::from_secs(unprotected_grace_secs),
            },
            metrics_addr,
        ),
        Command::Webhook {
            listen,
            tls_cert,
            tls_key,
            issue,
            trust,
            controller_user,
        } => serve::webhook(listen, tls_cert.zip(tls_key), issue, trust, controller_user),
    }
}

/// `peerwall status`: fetch, summarize, print: the install's components, then every peer.
/// Exit status: 0 when every component works and every peer is enforced, 3 when not (a
/// finding: scripts and probes tell it from 1, the API server could not be asked).
fn status(minutes: u64, output: Output) -> Result<(), CliError> {
    use crate::k8s::status::components::{self, Health};
    let (peers, install) = crate::k8s::runtime()
        .and_then(|rt| {
            rt.block_on(async {
                let client = crate::k8s::client().await?;
                let peers = crate::k8s::status::fetch(&client).await?;
                let install = crate::k8s::status::fetch_install(&client, peers.0.keys()).await?;
                anyhow::Ok((peers, install))
            })
        })
        .map_err(runtime)?;
    let (tenants, configs, events) = peers;
    let since = crate::k8s::webhook::certs::now() - (minutes * 60) as i64;
    let rows = crate::k8s::status::summarize(&tenants, &configs, &events, since);
    let mut reporting: Vec<String> = rows
        .iter()
        .flat_map(|r| r.hosts.iter())
        .map(|h| h.host.clone())
        .collect();
    reporting.sort();
    reporting.dedup();
    let parts = components::check(&install, &reporting);
    match output {
        Output::Text => {
            let mut text = components::render(&parts);
            text.push('\n');
            if rows.is_empty() {
                text.push_str("no Liqo tenant namespace: no peer to protect\n");
            } else {
                text.push_str(&crate::k8s::status::render(&rows, minutes));
            }
            out(&text)?;
        }
        Output::Json => out(&format!(
            "{}\n",
            serde_json::to_string_pretty(&serde_json::json!({
                "components": parts,
                "peers": rows,
            }))
            .context("rendering JSON")
            .map_err(runtime)?
        ))?,
    }
    let broken = parts.iter().filter(|c| c.health == Health::Error).count();
    let unenforced = rows.iter().filter(|r| !r.enforced).count();
    if broken == 0 && unenforced == 0 {
        return Ok(());
    }
    let mut what = Vec::new();
    if broken > 0 {
        what.push(format!("{broken} component(s) not working"));
    }
    if unenforced > 0 {
        what.push(format!("{unenforced} of {} peers not enforced", rows.len()));
    }
    Err(CliError::Finding(anyhow::anyhow!("{}", what.join(", "))))
}

#[cfg(test)]
mod tests {
    /// clap's own consistency checks over every subcommand: a global flag (`--context`,
    /// `--kubeconfig`) that a subcommand also defined would panic at parse time.
    #[test]
    fn the_command_line_is_consistent() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }

    #[test]
    fn committed_crd_matches_the_types() {
        let committed = include_str!("../../deploy/common/crd.yaml");
        assert_eq!(
            super::crd_yaml().unwrap(),
            committed,
            "deploy/common/crd.yaml is stale: run `cargo xtask crd`"
        );
    }
}
