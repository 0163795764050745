//! The control-plane section of docs/bench.md, from the rows [`crate::measure`] returns.

use std::time::Duration;

use crate::{doc, ms, percentile, Row};

/// A one-pod lower bound of row `r`: the ConfigMap floor + the p50 of `second` (the second
/// write's floor) + the agent's part, and the one-pod p50 over it; None without the agent's
/// part (its log not read).
fn bound_and_ratio(r: &Row, second: &[Duration]) -> Option<(Duration, f64)> {
    let agent = r.parts[1]?;
    let bound = percentile(&r.floor, 0.5) + percentile(second, 0.5) + agent;
    let v = percentile(&r.one_pod, 0.5);
    Some((bound, v.as_secs_f64() / bound.as_secs_f64()))
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "meets"
    } else {
        "misses"
    }
}

pub fn report(
    pods: u32,
    created: Duration,
    controller_sync: Duration,
    controller_rss: f64,
    rows: &[Row],
    write: bool,
) {
    let mut md = String::new();
    md.push_str(&format!(
        "## Control plane at scale (`cargo xtask bench-control`)\n\n\
         Real etcd + kube-apiserver v1.20 on loopback, {pods} offloaded pods of one peer, \
         `peerwall controller` publishing them as AddressSet slices ({fill} addresses each), one \
         agent per backend (`--source kube --netns`, bpf's host maps sized for the pods with \
         `--host-table-size`) enforcing the peer's gateway configuration in its own gateway \
         namespace; UDP probe streams through the gateway, stamped at the receiver. The {pods} pods \
         were created through the API server in {:.0} s (how fast this VM ran in this run: every \
         row below moves with it, so compare runs by it). Controller: all \
         {pods} addresses published {:.2} s after start; peak RSS {:.0} MiB. The one-pod samples of every \
         backend come first, in {blocks} alternating blocks (A B, B A, …), one agent running at \
         a time, each block with its own API floors; then each backend's churn and restart.\n\n",
        created.as_secs_f64(),
        controller_sync.as_secs_f64(),
        controller_rss,
        fill = peerwall::protection::SLICE_FILL,
        blocks = crate::one_pod::blocks(),
    ));
    md.push_str("| | target | ");
    for r in rows {
        md.push_str(&format!("{} | ", r.backend));
    }
    md.push_str("\n|---|---|");
    for _ in rows {
        md.push_str("---|");
    }
    md.push('\n');
    let line = |md: &mut String, what: &str, target: &str, f: &dyn Fn(&Row) -> String| {
        md.push_str(&format!("| {what} | {target} | "));
        for r in rows {
            md.push_str(&format!("{} | ", f(r)));
        }
        md.push('\n');
    };
    line(
        &mut md,
        "one pod → first packet, p50 (ms)",
        "≤ 10",
        &|r| {
            let v = percentile(&r.one_pod, 0.5);
            let target = Duration::from_millis(10);
            // A target under this run's lower bound cannot be met by the controller or the
            // agent: say so beside the miss.
            let unreachable = match bound_and_ratio(r, &r.floor) {
                Some((bound, _)) if bound > target => {
                    format!("; the lower bound below is already {}", ms(bound))
                }
                _ => String::new(),
            };
            format!("{} ({}{unreachable})", ms(v), verdict(v <= target))
        },
    );
    line(
        &mut md,
        "one pod → first packet, p99 (ms)",
        "≤ 50",
        &|r| {
            let v = percentile(&r.one_pod, 0.99);
            format!("{} ({})", ms(v), verdict(v <= Duration::from_millis(50)))
        },
    );
    line(
        &mut md,
        "one pod → first packet, p50 of each block in the order run (ms)",
        "",
        &|r| {
            r.block_p50
                .iter()
                .map(|d| ms(*d))
                .collect::<Vec<_>>()
                .join(", ")
        },
    );
    line(
        &mut md,
        "one pod, medians of its parts: controller / agent / after the apply (ms)",
        "",
        &|r| {
            let part = |d: Option<Duration>| d.map_or("–".to_string(), ms);
            format!(
                "{} / {} / {}",
                part(r.parts[0]),
                part(r.parts[1]),
                part(r.parts[2])
            )
        },
    );
    line(
        &mut md,
        "the API server's floor: one write seen by a watch, p50 (ms); the controller's part crosses two",
        "",
        &|r| ms(percentile(&r.floor, 0.5)),
    );
    line(
        &mut md,
        "the same floor for a full slice (1000 addresses, one changed; server-side apply), p50 (ms): the controller's write for one pod costs between the two",
        "",
        &|r| ms(percentile(&r.slice_floor, 0.5)),
    );
    line(
        &mut md,
        "one pod, lower bound here: two API floors + the agent's part, p50 (ms)",
        "",
        &|r| {
            let agent = r.parts[1].unwrap_or_default();
            ms(percentile(&r.floor, 0.5) * 2 + agent)
        },
    );
    line(
        &mut md,
        "one pod → first packet, p50 ÷ the lower bound",
        "≤ 1.3",
        &|r| match bound_and_ratio(r, &r.floor) {
            Some((_, ratio)) => format!("{ratio:.2} ({})", verdict(ratio <= 1.3)),
            None => "–".to_string(),
        },
    );
    line(
        &mut md,
        "the same floor for a slice of one address (server-side apply), p50 (ms): the least write a pod's address takes as an AddressSet",
        "",
        &|r| ms(percentile(&r.small_floor, 0.5)),
    );
    line(
        &mut md,
        "one pod, lower bound of a controller publishing AddressSets: the floor + a one-address slice's floor + the agent's part, p50 (ms); p50 ÷ it",
        "",
        &|r| match bound_and_ratio(r, &r.small_floor) {
            Some((bound, ratio)) => format!("{}; {ratio:.2}", ms(bound)),
            None => "–".to_string(),
        },
    );
    line(
        &mut md,
        "one pod → first packet, directory source, p50 / p99 (ms)",
        "p50 ≤ 5",
        &|r| {
            let v = percentile(&r.dir_one_pod, 0.5);
            format!(
                "{} / {} ({})",
                ms(v),
                ms(percentile(&r.dir_one_pod, 0.99)),
                verdict(v <= Duration::from_millis(5))
            )
        },
    );
    line(
        &mut md,
        "churn 1000 pods/10 s: new pod p50 / p99 (ms)",
        "all enforced",
        &|r| {
            format!(
                "{} / {}, {} of 500 never reached",
                ms(percentile(&r.churn_adds, 0.5)),
                ms(percentile(&r.churn_adds, 0.99)),
                r.churn_missing
            )
        },
    );
    line(
        &mut md,
        "churn: deleted pods reached after their removal was reported applied",
        "0",
        &|r| {
            format!(
                "{} (of {} removals whose report the watch saw, {} deleted)",
                r.violations, r.removals_checked, r.removals
            )
        },
    );
    line(
        &mut md,
        "agent restart → full sync in force (ms)",
        "≤ 1000",
        &|r| {
            format!(
                "{} ({})",
                ms(r.restart),
                verdict(r.restart <= Duration::from_secs(1))
            )
        },
    );
    line(&mut md, "agent first start → in force (ms)", "", &|r| {
        ms(r.first_sync)
    });
    line(&mut md, "agent peak RSS (MiB)", "≤ 100", &|r| {
        format!("{:.0} ({})", r.agent_rss, verdict(r.agent_rss <= 100.0))
    });
    md.push_str(&format!(
        "\nThe controller's peak RSS over the run (shared by both agents' rounds, `VmHWM`), \
         target ≤ 400 MiB at 100k pods: {controller_rss:.0} MiB ({}).\n",
        if pods >= 100_000 {
            verdict(controller_rss <= 400.0)
        } else {
            "fewer pods than the target's"
        }
    ));
    md.push_str(
        "\nThe slowest one-pod samples, split where the bench can see (controller: status written → \
         the slice holding the address seen by a watch; agent: → the end of the apply that put it \
         in force, from the agent's JSON log; after: → the first packet), with what the agent \
         logged meanwhile:\n\n",
    );
    for r in rows {
        for s in &r.slowest {
            md.push_str(&format!("- {}: {s}\n", r.backend));
        }
    }
    print!("\n{md}");
    if write {
        let p = doc::write_section("control", md.trim_end()).expect("write docs/bench.md");
        println!("wrote {}", p.display());
    } else {
        println!("(one backend only: docs/bench.md not rewritten)");
    }
}
