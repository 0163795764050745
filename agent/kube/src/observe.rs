//! `peerwall observe --all-agents`: the events of every agent of the cluster, through the API
//! server, in time order and with the pods behind the addresses. Each agent (the DaemonSet's
//! pods, and the `peerwall` sidecars of Liqo's gateway pods) is asked as an operator would by
//! hand, `kubectl exec … -- peerwall observe --output json`, so nothing of an agent is exposed
//! beyond its node: its `/events` stays on the node's localhost, and who may read flows is who
//! may exec into the agents (`pods/exec` in `peerwall-system`). Names come from the cluster as
//! the controller sees it (pods, Liqo's virtual nodes and remapped CIDRs: [`names`]).

pub mod names;

use std::time::{Duration, SystemTime};

use anyhow::Context;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{Api, AttachParams, DynamicObject, ListParams};
use kube::ResourceExt;
use peerwall_backend::Event;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};

use super::status::components::{AGENT_DAEMONSET, INSTALL_NAMESPACE, SIDECAR_CONTAINER};
use names::{AddressBook, Merge, PodFilter, Sourced};

/// The DaemonSet's container.
const AGENT_CONTAINER: &str = "agent";

/// How long an event is held for older ones of other agents to arrive (`--follow`).
const HOLD: Duration = Duration::from_secs(1);

/// How often the names are read again while following.
const NAMES_EVERY: Duration = Duration::from_secs(30);

/// One agent to ask.
#[derive(Clone, Debug)]
struct Agent {
    namespace: String,
    pod: String,
    container: &'static str,
    node: String,
}

/// What `observe --all-agents` asks and shows.
#[derive(Clone, Debug)]
pub struct Options {
    /// Arguments after `peerwall observe` for each agent (its filters: `--verdict`, `--rule`,
    /// `--since`; `--follow`).
    pub agent_args: Vec<String>,
    /// Keep streaming.
    pub follow: bool,
    /// Filters by pod, namespace and peer.
    pub filter: PodFilter,
    /// Prefixes of the tunnel interfaces.
    pub tunnels: Vec<String>,
}

/// One event as shown: where it was seen and the pods behind its addresses.
pub struct Shown<'a> {
    /// The event.
    pub event: &'a Event,
    /// The node of the agent.
    pub node: &'a str,
    /// The source pod, where known.
    pub src_pod: Option<&'a str>,
    /// The destination pod, where known.
    pub dst_pod: Option<&'a str>,
}

/// Every agent pod that runs, the DaemonSet's first.
async fn agents(client: &kube::Client) -> anyhow::Result<Vec<Agent>> {
    let running = |p: &Pod| {
        p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
            && p.metadata.deletion_timestamp.is_none()
    };
    let node = |p: &Pod| {
        p.spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default()
    };
    let mut out = Vec::new();
    let api: Api<Pod> = Api::namespaced(client.clone(), INSTALL_NAMESPACE);
    let ds = api
        .list(&ListParams::default().labels(&format!("app.kubernetes.io/name={AGENT_DAEMONSET}")))
        .await
        .with_context(|| format!("listing the agent pods in {INSTALL_NAMESPACE}"))?;
    for p in ds.items.iter().filter(|p| running(p)) {
        out.push(Agent {
            namespace: INSTALL_NAMESPACE.into(),
            pod: p.name_any(),
            container: AGENT_CONTAINER,
            node: node(p),
        });
    }
    // Sidecars: Liqo's tenant namespaces' pods with a peerwall container.
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let tenants = namespaces
        .list(&ListParams::default().labels(&format!("{}=true", super::TENANT_NAMESPACE)))
        .await
        .context("listing Liqo's tenant namespaces")?;
    for ns in tenants.items {
        let api: Api<Pod> = Api::namespaced(client.clone(), &ns.name_any());
        let pods = api
            .list(&ListParams::default())
            .await
            .with_context(|| format!("listing the pods of {}", ns.name_any()))?;
        for p in pods.items.iter().filter(|p| running(p)) {
            let sidecar = p
                .spec
                .as_ref()
                .is_some_and(|s| s.containers.iter().any(|c| c.name == SIDECAR_CONTAINER));
            if sidecar {
                out.push(Agent {
                    namespace: ns.name_any(),
                    pod: p.name_any(),
                    container: SIDECAR_CONTAINER,
                    node: node(p),
                });
            }
        }
    }
    Ok(out)
}

/// The pods behind addresses, as the controller sees the cluster.
async fn address_book(client: &kube::Client, tunnels: &[String]) -> anyhow::Result<AddressBook> {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let nodes: Api<Node> = Api::all(client.clone());
    let pods: Api<Pod> = Api::all(client.clone());
    let lp = ListParams::default();
    let configs: Api<DynamicObject> =
        Api::all_with(client.clone(), &super::liqo_configuration_resource());
    let configurations = match configs.list(&lp).await {
        // Without Liqo's CRD no CIDR is remapped.
        Err(kube::Error::Api(s)) if s.code == 404 => Vec::new(),
        r => r
            .context("listing Liqo's Configurations")?
            .items
            .into_iter()
            .map(|o| serde_json::to_value(o).unwrap_or_default())
            .collect(),
    };
    let snapshot = super::snapshot::Snapshot {
        namespaces: namespaces
            .list(&lp)
            .await
            .context("listing namespaces")?
            .items,
        nodes: nodes.list(&lp).await.context("listing nodes")?.items,
        pods: pods.list(&lp).await.context("listing pods")?.items,
        configurations,
        ..Default::default()
    };
    let (cluster, _) = snapshot.cluster();
    let tunnels: Vec<&str> = tunnels.iter().map(String::as_str).collect();
    Ok(AddressBook::new(&cluster, &tunnels))
}

/// What one agent's stream says.
enum Said {
    Event(String, Box<Event>),
    Done(String, Result<(), String>),
}

/// Run `peerwall observe` in `agent` and send its events on `tx`.
async fn ask(
    client: kube::Client,
    agent: Agent,
    args: Vec<String>,
    tx: tokio::sync::mpsc::Sender<Said>,
) {
    let api: Api<Pod> = Api::namespaced(client, &agent.namespace);
    let mut command = vec!["peerwall".to_string(), "observe".into()];
    command.extend(args);
    let ap = AttachParams::default()
        .container(agent.container)
        .stdin(false)
        .stdout(true)
        .stderr(true);
    let who = format!("{}/{} on {}", agent.namespace, agent.pod, agent.node);
    let mut proc = match api.exec(&agent.pod, command, &ap).await {
        Ok(p) => p,
        Err(e) => {
            let _ = tx
                .send(Said::Done(who, Err(format!("could not exec: {e}"))))
                .await;
            return;
        }
    };
    let mut stderr = proc.stderr();
    let errors = tokio::spawn(async move {
        let mut s = String::new();
        if let Some(e) = stderr.as_mut() {
            let _ = e.read_to_string(&mut s).await;
        }
        s
    });
    if let Some(stdout) = proc.stdout() {
        let mut lines = BufReader::new(stdout).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            if let Ok(e) = serde_json::from_str::<Event>(&line) {
                if tx
                    .send(Said::Event(agent.node.clone(), Box::new(e)))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        }
    }
    let status = match proc.take_status() {
        Some(s) => s.await,
        None => None,
    };
    let stderr = errors.await.unwrap_or_default();
    let result = match status {
        Some(s) if s.status.as_deref() == Some("Failure") => Err(format!(
            "{}{}",
            s.message.unwrap_or_default(),
            if stderr.trim().is_empty() {
                String::new()
            } else {
                format!(": {}", stderr.trim())
            }
        )),
        _ => Ok(()),
    };
    let _ = tx.send(Said::Done(who, result)).await;
}

/// Every agent's events, merged in time order, named, filtered, each passed to `show`; errors
/// of single agents go to the log (warnings), and only if no agent could be asked is it an
/// error.
pub async fn run(
    client: &kube::Client,
    opts: &Options,
    mut show: impl FnMut(Shown<'_>) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let agents = agents(client).await?;
    if agents.is_empty() {
        anyhow::bail!(
            "no running peerwall agent: no pod of the DaemonSet {INSTALL_NAMESPACE}/{AGENT_DAEMONSET} and no `{SIDECAR_CONTAINER}` container in a Liqo gateway pod (`peerwall status` says why)"
        );
    }
    let mut book = address_book(client, &opts.tunnels).await?;
    let mut read_at = tokio::time::Instant::now();
    let (tx, mut rx) = tokio::sync::mpsc::channel(1024);
    let total = agents.len();
    for a in agents {
        tokio::spawn(ask(client.clone(), a, opts.agent_args.clone(), tx.clone()));
    }
    drop(tx);
    let mut merge = Merge::new(if opts.follow { HOLD } else { Duration::ZERO });
    let mut failed = Vec::new();
    let mut emit = |batch: Vec<Sourced>, book: &AddressBook| -> anyhow::Result<()> {
        for s in batch {
            let (src_pod, dst_pod) = book.names(&s.event);
            if opts.filter.keeps(&s.event, src_pod, dst_pod) {
                show(Shown {
                    event: &s.event,
                    node: &s.node,
                    src_pod,
                    dst_pod,
                })?;
            }
        }
        Ok(())
    };
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tokio::select! {
            said = rx.recv() => match said {
                Some(Said::Event(node, e)) => merge.push(&node, *e),
                Some(Said::Done(who, Err(why))) => {
                    tracing::warn!(agent = %who, "{why}");
                    failed.push(who);
                }
                Some(Said::Done(..)) => {}
                None => break,
            },
            _ = tick.tick(), if opts.follow => {
                if read_at.elapsed() >= NAMES_EVERY {
                    match address_book(client, &opts.tunnels).await {
                        Ok(b) => book = b,
                        Err(e) => tracing::warn!("reading the pods' names again: {e:#}"),
                    }
                    read_at = tokio::time::Instant::now();
                }
                emit(merge.ready(SystemTime::now()), &book)?;
            }
        }
    }
    emit(merge.drain(), &book)?;
    if failed.len() == total {
        anyhow::bail!(
            "no agent could be asked ({}); see the warnings above",
            failed.join(", ")
        );
    }
    Ok(())
}
