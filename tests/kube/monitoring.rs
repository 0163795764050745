//! deploy/monitoring's alerts and dashboard against what a running controller and agent
//! export: every metric a query selects is exported, and every label it matches on or groups
//! by is one those metrics carry (or one Prometheus adds when it scrapes).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use promql_parser::parser::{self, Expr, LabelModifier};

use crate::support::*;
use peerwall_testkit::prelude::*;

/// Labels Prometheus adds to every scraped series, and the histogram bucket label.
const SCRAPE_LABELS: [&str; 3] = ["instance", "job", "le"];

/// What only the DaemonSet's agent (`--gateway-pods`) exports: the `gateway` label on every
/// series and the `peerwall_gateways` gauge (and, with `--cni-boot`,
/// `peerwall_cni_boot_chained`). An agent enforcing in one namespace has none;
/// `node.rs` checks the queries against the real DaemonSet.
const GATEWAY_MODE: (&str, &str) = ("gateway", "peerwall_gateways");
const CNI_BOOT: &str = "peerwall_cni_boot_chained";

/// The metrics of several `/metrics` texts together.
fn merged(texts: &[String]) -> BTreeMap<String, BTreeSet<String>> {
    let mut metrics: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for t in texts {
        for (k, v) in exposed(t) {
            metrics.entry(k).or_default().extend(v);
        }
    }
    metrics
}

/// The problems of deploy/monitoring's queries against the `/metrics` texts of a controller
/// and an agent; `gateway_mode`: the agent is the DaemonSet's (else what only the DaemonSet
/// exports is assumed).
pub(crate) fn live_problems(texts: &[String], gateway_mode: bool) -> Vec<String> {
    let mut metrics = merged(texts);
    if !gateway_mode {
        metrics.entry(GATEWAY_MODE.1.to_string()).or_default();
        metrics.entry(CNI_BOOT.to_string()).or_default();
        for labels in metrics.values_mut() {
            labels.insert(GATEWAY_MODE.0.to_string());
        }
    }
    let qs = queries();
    assert!(qs.len() >= 15, "{} queries", qs.len());
    check(&qs, &metrics)
}

/// Every (metric, labels it carries) of a Prometheus text exposition; a family declared with
/// no sample yet counts, with no labels.
fn exposed(text: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            if let Some(name) = rest.split_whitespace().next() {
                out.entry(name.to_string()).or_default();
            }
            continue;
        }
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let (name, labels) = match line.split_once('{') {
            Some((n, rest)) => (n, rest.split('}').next().unwrap_or("")),
            None => (line.split_whitespace().next().unwrap_or(""), ""),
        };
        let set = out.entry(name.to_string()).or_default();
        for pair in labels.split("\",") {
            if let Some((k, _)) = pair.split_once('=') {
                set.insert(k.trim().to_string());
            }
        }
    }
    out
}

/// Selectors (metric name, labels matched) and labels grouped by or matched on, in `e`.
fn walk(e: &Expr, sel: &mut Vec<(String, Vec<String>)>, grouped: &mut Vec<String>) {
    let modifier = |m: &Option<LabelModifier>, grouped: &mut Vec<String>| {
        if let Some(m) = m {
            grouped.extend(m.labels().labels.iter().cloned());
        }
    };
    match e {
        Expr::Aggregate(a) => {
            modifier(&a.modifier, grouped);
            walk(&a.expr, sel, grouped);
            if let Some(p) = &a.param {
                walk(p, sel, grouped);
            }
        }
        Expr::Unary(u) => walk(&u.expr, sel, grouped),
        Expr::Binary(b) => {
            if let Some(m) = &b.modifier {
                modifier(&m.matching, grouped);
            }
            walk(&b.lhs, sel, grouped);
            walk(&b.rhs, sel, grouped);
        }
        Expr::Paren(p) => walk(&p.expr, sel, grouped),
        Expr::Subquery(s) => walk(&s.expr, sel, grouped),
        Expr::VectorSelector(v) => sel.push((
            v.name.clone().unwrap_or_default(),
            v.matchers.matchers.iter().map(|m| m.name.clone()).collect(),
        )),
        Expr::MatrixSelector(m) => sel.push((
            m.vs.name.clone().unwrap_or_default(),
            m.vs.matchers
                .matchers
                .iter()
                .map(|m| m.name.clone())
                .collect(),
        )),
        Expr::Call(c) => {
            for a in &c.args.args {
                walk(a, sel, grouped);
            }
        }
        Expr::NumberLiteral(_) | Expr::StringLiteral(_) | Expr::Extension(_) => {}
    }
}

/// The expressions of deploy/monitoring: alert rules and dashboard panels, with where from.
fn queries() -> Vec<(String, String)> {
    let mut out = Vec::new();
    let alerts: serde_yaml::Value = serde_yaml::from_str(
        &std::fs::read_to_string(repo("deploy/monitoring/alerts.yaml")).unwrap(),
    )
    .unwrap();
    for g in alerts["spec"]["groups"].as_sequence().unwrap() {
        for r in g["rules"].as_sequence().unwrap() {
            out.push((
                format!("alert {}", r["alert"].as_str().unwrap()),
                r["expr"].as_str().unwrap().to_string(),
            ));
        }
    }
    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo("deploy/monitoring/peerwall.json")).unwrap(),
    )
    .unwrap();
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            out.push((
                format!("panel {}", p["title"].as_str().unwrap()),
                t["expr"].as_str().unwrap().to_string(),
            ));
        }
    }
    out
}

/// The problems of `queries` against `metrics`: unknown metrics, labels none of the query's
/// metrics carry.
fn check(
    queries: &[(String, String)],
    metrics: &BTreeMap<String, BTreeSet<String>>,
) -> Vec<String> {
    let mut problems = Vec::new();
    for (what, q) in queries {
        let e = match parser::parse(q) {
            Ok(e) => e,
            Err(err) => {
                problems.push(format!("{what}: does not parse: {err}"));
                continue;
            }
        };
        let (mut sel, mut grouped) = (Vec::new(), Vec::new());
        walk(&e, &mut sel, &mut grouped);
        let mut carried: BTreeSet<String> = SCRAPE_LABELS.iter().map(|l| l.to_string()).collect();
        for (name, labels) in &sel {
            match metrics.get(name) {
                None => problems.push(format!("{what}: {name} is not exported")),
                Some(have) => {
                    carried.extend(have.iter().cloned());
                    for l in labels {
                        if !have.contains(l) && !SCRAPE_LABELS.contains(&l.as_str()) {
                            problems
                                .push(format!("{what}: {name} has no label {l} (it has {have:?})"));
                        }
                    }
                }
            }
        }
        for l in grouped {
            if !carried.contains(&l) {
                problems.push(format!(
                    "{what}: grouped by {l}, which none of its metrics carries"
                ));
            }
        }
    }
    problems
}

async fn scrape(addr: &str) -> String {
    let url = format!("http://{addr}/metrics");
    tokio::task::spawn_blocking(move || {
        let o = std::process::Command::new("curl")
            .args(["-s", "-m", "2", &url])
            .output()
            .unwrap();
        String::from_utf8_lossy(&o.stdout).into_owned()
    })
    .await
    .unwrap()
}

/// A controller and an agent enforcing peer a's gateway configuration with events on; a
/// denied ping makes drops. Their `/metrics` then hold every family the monitoring uses, with
/// its labels, and every query checks out. The check is shown to bite: a query naming a metric
/// or label that does not exist is reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn monitoring_queries_use_exported_metrics() {
    let t = Topology::new();
    let server = api_server();
    let client = server.client().await;
    server.install_crds();
    let ctl_addr = format!("127.0.0.1:{}", free_port());
    let _controller = server.peerwall("controller", &["controller", "--metrics-addr", &ctl_addr]);
    let agent_addr = format!("127.0.0.1:{}", free_port());
    let _agent = server.peerwall(
        "agent-mon",
        &[
            "agent",
            "--source",
            "kube",
            "--netns",
            t.gateway.name(),
            "--host",
            "gw-mon",
            "--selector",
            "peerwall.io/target=gateway,peerwall.io/remote-cluster-id=a",
            "--metrics-addr",
            &agent_addr,
            "--interval-ms",
            "200",
            "--events",
        ],
    );
    namespace(&client, "liqo-tenant-a", tenant_labels("a")).await;
    liqo_configuration(&client, "a", &["10.10.0.0/16"]).await;
    applied(
        &fwc_api(&client, "liqo-tenant-a"),
        "peerwall-gateway",
        "gw-mon",
    )
    .await;
    // Drops through the tunnel: nothing is offloaded, so the default deny drops the ping.
    let texts = eventually(
        "drops in the agent's metrics",
        Duration::from_secs(30),
        || async {
            let _ = ping(&t.consumer, "10.10.1.67", "10.20.1.2");
            let agent = scrape(&agent_addr).await;
            let ctl = scrape(&ctl_addr).await;
            (agent.contains("peerwall_drops_total{") && ctl.contains("peerwall_controller_peers"))
                .then_some(vec![agent, ctl])
        },
    )
    .await;
    let problems = live_problems(&texts, false);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    let metrics = merged(&texts);
    // Sensitive: a misspelt metric and a label nobody exports are caught.
    let wrong = vec![
        (
            "typo".to_string(),
            "rate(peerwall_drop_total[5m])".to_string(),
        ),
        (
            "label".to_string(),
            "sum by (peer) (rate(peerwall_drops_total{verdict=\"drop\"}[5m]))".to_string(),
        ),
    ];
    let found = check(&wrong, &metrics);
    assert_eq!(found.len(), 2, "{found:?}");
}
