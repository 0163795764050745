//! Long-running commands: the lab, the agent, the controller, the webhook.

use super::*;

/// `peerwall lab`.
pub(super) fn lab(backend: Option<BackendKind>, keep: bool) -> Result<(), CliError> {
    let backends: Vec<&'static str> = match backend {
        Some(BackendKind::Nftables) => vec!["nftables"],
        Some(BackendKind::Bpf) => vec!["bpf"],
        None => vec!["nftables", "bpf"],
    };
    let bin = std::env::current_exe()
        .context("locating the peerwall binary")
        .map_err(runtime)?;
    let ok = crate::lab::run(&backends, &bin, keep).map_err(runtime)?;
    if ok {
        Ok(())
    } else {
        Err(runtime(anyhow::anyhow!(
            "the lab did not behave as provider protection requires (see above)"
        )))
    }
}

// size: the agent's flags wired into its parts, once each: no decision to cut out.
/// `peerwall agent`: build the backend, serve metrics, run the policy source until stopped.
pub(super) fn agent(a: AgentArgs) -> Result<(), CliError> {
    let AgentArgs {
        source,
        selector,
        liqo_selector,
        observe,
        liqo_target,
        host,
        netns,
        gateway_pods,
        gateway_selector,
        proc,
        no_start_bridge,
        load_turns,
        cni,
        backend,
        bpf,
        interval_ms,
        ended_connection_secs,
        metrics_addr,
        events_addr,
        events,
        audit,
        boot_peer,
        trust,
    } = a;
    let trust = trust.trust();
    let drop_summary = std::time::Duration::from_secs(events.drop_summary_secs.max(1));
    let events_on = events.settings().is_some();
    let events = events.settings();
    let settings = peerwall_backend_select::Settings {
        events,
        ended_secs: Some(ended_connection_secs),
        ..bpf.settings(backend)
    };
    let stop = stop_flag()?;
    if gateway_pods {
        if source != crate::enforcement::PolicySource::Kube {
            return Err(CliError::Input(anyhow::anyhow!(
                "--gateway-pods needs --source kube (gateway pods are found through the API server)"
            )));
        }
        let metrics = std::sync::Arc::new(std::sync::Mutex::new(crate::metrics::GatewayMetrics {
            events: events_on,
            ..Default::default()
        }));
        let (bound, events_at) = crate::metrics::serve_agent(
            metrics_addr,
            events_on.then_some(events_addr),
            metrics.clone(),
        )
        .with_context(|| format!("serving metrics on {metrics_addr} and events on {events_addr}"))
        .map_err(runtime)?;
        tracing::info!(backend = %backend, metrics = %bound, events = ?events_at, "agent started in gateway-pod mode");
        return crate::k8s::gateway_pods::run(
            crate::k8s::gateway_pods::Settings {
                node: host.unwrap_or_else(default_host),
                gateway_selector,
                selector,
                backend: settings,
                interval: std::time::Duration::from_millis(interval_ms),
                cni: cni.settings(&proc),
                proc,
                audit,
                drop_summary: events_on.then_some(drop_summary),
                trust,
                bridge: !no_start_bridge,
                load_turns: load_turns.map(usize::from),
            },
            metrics,
            stop,
        )
        .map_err(runtime);
    }
    let enforcer = peerwall_backend_select::open(&settings, netns.as_deref())
        .context("starting the backend")
        .map_err(runtime)?;
    let name = enforcer.name();
    let metrics = std::sync::Arc::new(std::sync::Mutex::new(crate::metrics::AgentMetrics {
        backend: name,
        ..Default::default()
    }));
    let (bound, events_at) = crate::metrics::serve_agent(
        metrics_addr,
        events.is_some().then_some(events_addr),
        metrics.clone(),
    )
    .with_context(|| format!("serving metrics on {metrics_addr} and events on {events_addr}"))
    .map_err(runtime)?;
    tracing::info!(?source, backend = name, metrics = %bound, events = ?events_at, "agent started");
    let boot = boot_peer
        .as_deref()
        .map(crate::enforcement::Boot::for_peer)
        .transpose()
        .context("compiling the boot policy")
        .map_err(runtime)?;
    let mut enforcement = crate::enforcement::Enforcement::new(enforcer, metrics)
        .audit_all(audit)
        .with_boot(boot);
    if events.is_some() {
        enforcement
            .start_events()
            .context("reading the backend's events")
            .map_err(runtime)?;
    }
    let interval = std::time::Duration::from_millis(interval_ms);
    match source {
        crate::enforcement::PolicySource::Dir(dir) => {
            let mut observed = Vec::new();
            for o in &observe {
                match o.strip_prefix("dir:") {
                    Some(p) => observed.push(PathBuf::from(p)),
                    None => {
                        return Err(CliError::Input(anyhow::anyhow!(
                            "--observe {o:?}: with a dir: source, observed objects come from a directory (dir:PATH)"
                        )))
                    }
                }
            }
            crate::dir::run(&dir, &observed, &mut enforcement, interval, stop)
        }
        crate::enforcement::PolicySource::Kube => crate::k8s::agent::run(
            crate::k8s::agent::Settings {
                liqo_selector,
                observe: observe
                    .iter()
                    .map(|o| match o.strip_prefix("dir:") {
                        Some(_) => Err(CliError::Input(anyhow::anyhow!(
                            "--observe {o:?}: with --source kube, observed objects are Liqo's FirewallConfigurations picked by a label selector"
                        ))),
                        None => Ok(o.clone()),
                    })
                    .collect::<Result<_, _>>()?,
                liqo_target,
                host: host.unwrap_or_else(default_host),
                interval,
                // An agent for one peer (a gateway sidecar) answers only for that peer's
                // objects: agents of other peers on the same node share its host name.
                scope: selector
                    .split(',')
                    .find(|t| t.trim().starts_with(&format!("{}=", crate::k8s::PEER)))
                    .map(|t| t.trim().to_string()),
                selector,
                drop_summary: events_on.then_some(drop_summary),
                trust,
            },
            &mut enforcement,
            stop,
        ),
    }
    .map_err(runtime)
}

/// `peerwall controller`.
pub(super) fn controller(
    opts: crate::protection::Options,
    coverage: crate::k8s::coverage::Settings,
    metrics_addr: std::net::SocketAddr,
) -> Result<(), CliError> {
    let stop = stop_flag()?;
    let metrics = std::sync::Arc::new(std::sync::Mutex::new(
        crate::metrics::ControllerMetrics::default(),
    ));
    let bound = crate::metrics::serve(metrics_addr, metrics.clone())
        .with_context(|| format!("serving metrics on {metrics_addr}"))
        .map_err(runtime)?;
    tracing::info!(metrics = %bound, "metrics served; reaching the API server");
    crate::k8s::controller::run(opts, coverage, metrics, stop).map_err(runtime)
}

/// `peerwall webhook`.
pub(super) fn webhook(
    listen: std::net::SocketAddr,
    files: Option<(PathBuf, PathBuf)>,
    issue: IssueArgs,
    trust: TrustArgs,
    controller: Option<String>,
) -> Result<(), CliError> {
    let stop = stop_flag()?;
    let controller = controller.unwrap_or_else(|| {
        format!(
            "system:serviceaccount:{}:{}",
            own_namespace(),
            crate::k8s::webhook::CONTROLLER_SERVICE_ACCOUNT
        )
    });
    let tls = match files {
        Some((cert, key)) => crate::k8s::webhook::Tls::Files { cert, key },
        None => crate::k8s::webhook::Tls::Issued(issue.issue(&own_namespace())),
    };
    crate::k8s::webhook::run(
        crate::k8s::webhook::Settings {
            listen,
            tls,
            trust: trust.trust(),
            controller,
        },
        stop,
    )
    .map_err(runtime)
}
