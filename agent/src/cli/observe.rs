//! `peerwall observe`: the events of what the datapath did to real traffic, live. From a
//! running agent's `/events` (`--agent`), or straight from the kernel when no agent answers
//! (nftables: the NFLOG group; bpf: the pinned ring buffer; names from the ruleset listing or
//! the slot metadata). A ring buffer and an NFLOG group have one reader: while an agent runs,
//! read through it.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use super::{backend_error, input, out, runtime, BackendKind, CliError, Output};
use anyhow::Context;
use peerwall_backend::{Event, EventFilter, EventSource};

/// Arguments of `peerwall observe`.
#[derive(clap::Args, Debug)]
pub struct ObserveArgs {
    /// Only events of this verdict: drop, reject, audit (would-drops) or accept (flow log).
    #[arg(long)]
    pub verdict: Option<String>,
    /// Only events of this rule: `table/chain/rule`, `chain/rule` or `rule` (`policy` for a
    /// chain policy).
    #[arg(long)]
    pub rule: Option<String>,
    /// Only events at most this old: `30s`, `5m`, `1h`.
    #[arg(long)]
    pub since: Option<String>,
    /// Output format: one line per event, or one JSON object per line.
    #[arg(long, value_enum, default_value_t = Output::Text)]
    pub output: Output,
    /// Keep streaming (Ctrl-C stops); without it, print what is there (the agent's recent
    /// events, or what the kernel reports within --wait-ms) and exit.
    #[arg(long)]
    pub follow: bool,
    /// The agent's `/events` address (its --events-addr).
    #[arg(long, default_value = super::DEFAULT_EVENTS_ADDR)]
    pub agent: String,
    /// Read from the kernel even if an agent answers.
    #[arg(long)]
    pub kernel: bool,
    /// Kernel mode: the backend whose events to read (default: the one installed here).
    #[arg(long, value_enum)]
    pub backend: Option<BackendKind>,
    /// Kernel mode, bpf: where the datapath is pinned.
    #[arg(long, default_value = peerwall_backend_select::PIN_DIR)]
    pub pin_dir: PathBuf,
    /// Kernel mode: the network namespace to read in (`ip netns` name or a path).
    #[arg(long)]
    pub netns: Option<String>,
    /// Kernel mode, nftables: the NFLOG group of the agent's log rules.
    #[arg(long, default_value_t = super::DEFAULT_NFLOG_GROUP)]
    pub nflog_group: u16,
    /// Without --follow: how long to wait for events.
    #[arg(long, default_value_t = 1000)]
    pub wait_ms: u64,
    /// Every agent of the cluster, through the API server (each asked as `kubectl exec …
    /// peerwall observe` would: needs `pods/exec` in peerwall-system, and in Liqo's tenant
    /// namespaces for sidecars), in time order, with the pods behind the addresses.
    #[arg(long)]
    pub all_agents: bool,
    /// With --all-agents: only events whose source is this pod (`namespace/name`).
    #[arg(long, requires = "all_agents", value_name = "NAMESPACE/NAME")]
    pub from_pod: Option<String>,
    /// With --all-agents: only events whose destination is this pod (`namespace/name`).
    #[arg(long, requires = "all_agents", value_name = "NAMESPACE/NAME")]
    pub to_pod: Option<String>,
    /// With --all-agents: only events with a pod of this namespace at either end.
    #[arg(long, requires = "all_agents")]
    pub namespace: Option<String>,
    /// With --all-agents: only events of this peer's tables (its cluster id).
    #[arg(long, requires = "all_agents")]
    pub peer: Option<String>,
    /// With --all-agents: prefixes of the tunnel interfaces (which end of an event is remote).
    #[arg(
        long = "tunnel",
        requires = "all_agents",
        default_value = "liqo-tunnel"
    )]
    pub tunnels: Vec<String>,
}

/// `peerwall observe --all-agents`: each agent asked through the API server, the events
/// merged in time order with the pods' names.
fn all_agents(a: &ObserveArgs) -> Result<(), CliError> {
    for (flag, v) in [("--from-pod", &a.from_pod), ("--to-pod", &a.to_pod)] {
        if let Some(v) = v {
            if v.split_once('/')
                .is_none_or(|(ns, n)| ns.is_empty() || n.is_empty())
            {
                return Err(input(anyhow::anyhow!(
                    "{flag} {v:?}: expected namespace/name"
                )));
            }
        }
    }
    if a.kernel {
        return Err(input(anyhow::anyhow!(
            "--all-agents asks the agents, --kernel reads this host's kernel: choose one"
        )));
    }
    let mut agent_args = vec!["--output".to_string(), "json".to_string()];
    for (flag, v) in [
        ("--verdict", &a.verdict),
        ("--rule", &a.rule),
        ("--since", &a.since),
    ] {
        if let Some(v) = v {
            agent_args.extend([flag.to_string(), v.clone()]);
        }
    }
    if a.follow {
        agent_args.push("--follow".into());
    }
    let opts = crate::k8s::observe::Options {
        agent_args,
        follow: a.follow,
        filter: crate::k8s::observe::names::PodFilter {
            from_pod: a.from_pod.clone(),
            to_pod: a.to_pod.clone(),
            namespace: a.namespace.clone(),
            peer: a.peer.clone(),
        },
        tunnels: a.tunnels.clone(),
    };
    let output = a.output;
    crate::k8s::runtime()
        .and_then(|rt| {
            rt.block_on(async {
                let client = crate::k8s::client().await?;
                crate::k8s::observe::run(&client, &opts, |s| {
                    let line = match output {
                        Output::Text => format!(
                            "{:<16} {}",
                            s.node,
                            s.event.text_named(s.src_pod, s.dst_pod)
                        ),
                        Output::Json => {
                            let mut v = serde_json::to_value(s.event)?;
                            v["node"] = s.node.into();
                            v["protocol"] = s.event.protocol_name().into();
                            v["src_pod"] = s.src_pod.into();
                            v["dst_pod"] = s.dst_pod.into();
                            v["peer"] =
                                crate::k8s::observe::names::table_peer(&s.event.table).into();
                            v.to_string()
                        }
                    };
                    let mut o = std::io::stdout().lock();
                    o.write_all(format!("{line}\n").as_bytes())
                        .and_then(|_| o.flush())
                        .context("writing to stdout")
                })
                .await
            })
        })
        .map_err(runtime)
}

/// `30s`, `5m`, `2h`, `1d` → duration.
pub fn parse_age(s: &str) -> Option<Duration> {
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit())?);
    let n: u64 = num.parse().ok()?;
    let secs = match unit {
        "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        "d" => n * 86_400,
        _ => return None,
    };
    Some(Duration::from_secs(secs))
}

fn print(e: &Event, output: Output) -> Result<(), CliError> {
    let line = match output {
        Output::Text => e.text(),
        Output::Json => serde_json::to_string(e).map_err(runtime)?,
    };
    out(&format!("{line}\n"))
}

/// One `GET /events?after=N` of the agent: the events' JSON lines and the next mark; None when
/// nothing answers at `addr`.
fn fetch(addr: &str, after: u64) -> Result<Option<(Vec<Event>, u64)>, CliError> {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return Ok(None);
    };
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(runtime)?;
    write!(
        s,
        "GET /events?after={after} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .map_err(runtime)?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)
        .with_context(|| format!("reading the agent's answer from {addr}"))
        .map_err(runtime)?;
    let (head, body) = resp.split_once("\r\n\r\n").unwrap_or((&resp, ""));
    let status = head.split_whitespace().nth(1).unwrap_or("");
    if status != "200" {
        return Err(CliError::Runtime(anyhow::anyhow!(
            "the agent at {addr} answered {status}: {}",
            body.trim()
        )));
    }
    let next = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case(crate::metrics::EVENTS_NEXT_HEADER)
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(after);
    let events = body
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    Ok(Some((events, next)))
}

/// `peerwall observe`.
pub(super) fn observe(a: ObserveArgs) -> Result<(), CliError> {
    let filter = EventFilter {
        verdict: a.verdict.clone(),
        rule: a.rule.clone(),
        since: match &a.since {
            None => None,
            Some(s) => Some(
                SystemTime::now()
                    - parse_age(s).ok_or_else(|| {
                        input(anyhow::anyhow!(
                            "--since {s:?}: expected a number and s, m, h or d (e.g. 5m)"
                        ))
                    })?,
            ),
        },
    };
    filter.check().map_err(input)?;
    if a.all_agents {
        return all_agents(&a);
    }
    if !a.kernel {
        if let Some((events, mut next)) = fetch(&a.agent, 0)? {
            let show = |events: Vec<Event>| -> Result<(), CliError> {
                for e in events.iter().filter(|e| filter.matches(e)) {
                    print(e, a.output)?;
                }
                Ok(())
            };
            show(events)?;
            if !a.follow {
                return Ok(());
            }
            loop {
                std::thread::sleep(Duration::from_millis(250));
                match fetch(&a.agent, next)? {
                    Some((events, n)) => {
                        next = n;
                        show(events)?;
                    }
                    None => {
                        return Err(CliError::Runtime(anyhow::anyhow!(
                            "the agent at {} stopped answering",
                            a.agent
                        )))
                    }
                }
            }
        }
        tracing::info!(agent = %a.agent, "no agent answers; reading from the kernel");
    }
    super::privileges::require(
        "observe",
        super::privileges::Needs {
            bpf: a.pin_dir.exists(),
            netns: a.netns.is_some(),
        },
    )?;
    super::scope::host_bpffs(&a.pin_dir, false)?;
    if let Some(ns) = &a.netns {
        super::scope::enter_netns(ns)?;
    }
    // No --pin-dir: the pins this namespace's last apply left, if elsewhere.
    let a = ObserveArgs {
        pin_dir: super::pins::resolve(&a.pin_dir),
        ..a
    };
    super::scope::host_bpffs(&a.pin_dir, false)?;
    let found = super::scope::backends_to_act_on(a.backend, &a.pin_dir, "observe")?;
    let backend = match found.as_slice() {
        [one] => *one,
        _ => {
            return Err(input(anyhow::anyhow!(
                "both nftables and bpf are installed here: choose one with --backend"
            )))
        }
    };
    let mut source: Box<dyn EventSource> =
        peerwall_backend_select::installed::events(backend, &a.pin_dir, a.nflog_group)
            .map_err(backend_error)?;
    let deadline = Instant::now() + Duration::from_millis(a.wait_ms);
    loop {
        let batch = source
            .next_batch(Duration::from_millis(200))
            .map_err(runtime)?;
        for e in batch.iter().filter(|e| filter.matches(e)) {
            print(e, a.output)?;
        }
        if !a.follow && Instant::now() >= deadline {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn ages_parse() {
        assert_eq!(super::parse_age("30s").unwrap().as_secs(), 30);
        assert_eq!(super::parse_age("5m").unwrap().as_secs(), 300);
        assert_eq!(super::parse_age("2h").unwrap().as_secs(), 7200);
        assert!(super::parse_age("5").is_none());
        assert!(super::parse_age("m").is_none());
        assert!(super::parse_age("5w").is_none());
    }
}
