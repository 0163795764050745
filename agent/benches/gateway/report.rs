//! The table, the docs section and the plot.

use std::time::Duration;

use super::*;

#[derive(Clone, Debug)]
pub(crate) struct Row {
    pub(crate) policy: String,
    pub(crate) dp: Datapath,
    pub(crate) allowed: Vec<f64>,
    pub(crate) denied: Vec<f64>,
    /// Install times, one per round (none for the baseline).
    pub(crate) loads: Vec<Duration>,
    /// Events the agent read per second while the row was measured (the events rows).
    pub(crate) events_per_sec: Option<f64>,
    /// peerwall bpf against the limits in alternating windows (`limits.rs`), every cycle of
    /// every round.
    pub(crate) limits: Vec<LimitRatios>,
}

impl Row {
    /// The median install time.
    pub(crate) fn load(&self) -> Option<Duration> {
        let mut v = self.loads.clone();
        v.sort();
        v.get(v.len() / 2).copied()
    }
}

/// Ratios of one row's rounds to another's, round by round (both measured in the same round,
/// minutes apart at most): their median and spread.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Paired {
    pub(crate) median: f64,
    pub(crate) lo: f64,
    pub(crate) hi: f64,
}

/// The row of `dp` on `policy`, if the run measured it.
pub(crate) fn find_row<'a>(rows: &'a [Row], policy: &str, dp: Datapath) -> Option<&'a Row> {
    rows.iter().find(|r| r.policy == policy && r.dp == dp)
}

impl Paired {
    /// `row ÷ base` round by round, on allowed or denied traffic.
    pub(crate) fn rows(row: &Row, base: &Row, allowed: bool) -> Paired {
        if allowed {
            Paired::of(&row.allowed, &base.allowed)
        } else {
            Paired::of(&row.denied, &base.denied)
        }
    }

    fn of(v: &[f64], base: &[f64]) -> Paired {
        Paired::ratios(
            v.iter()
                .zip(base)
                .filter(|(_, b)| **b > 0.0)
                .map(|(x, b)| x / b)
                .collect(),
        )
    }

    /// Median and spread of ratios already paired (e.g. the alternating windows' cycles).
    pub(crate) fn ratios(r: Vec<f64>) -> Paired {
        Paired {
            median: median(r.clone()),
            lo: r.iter().cloned().fold(f64::INFINITY, f64::min),
            hi: r.iter().cloned().fold(0.0, f64::max),
        }
    }
}

impl std::fmt::Display for Paired {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}–{})",
            fmt_ratio(self.median),
            fmt_ratio(self.lo),
            fmt_ratio(self.hi)
        )
    }
}

/// peerwall's bpf datapath against the limits of any tc program and against peerwall's
/// nftables, per policy, each ratio taken round by round.
pub(crate) fn limits_section(rows: &[Row], policies: &[String]) -> String {
    let find = |p: &str, dp: Datapath| find_row(rows, p, dp);
    let mut t = String::new();
    for p in policies {
        if find(p, Datapath::PeerwallBpf).is_none() {
            continue;
        }
        // `num ÷ den`, round by round.
        let cell = |num: Datapath, den: Datapath, allowed: bool| match (find(p, num), find(p, den))
        {
            (Some(n), Some(d)) => Paired::rows(n, d, allowed).to_string(),
            _ => "–".into(),
        };
        let alternating = |pick: fn(&LimitRatios) -> f64| match find(p, Datapath::PeerwallBpf) {
            Some(r) if !r.limits.is_empty() => {
                Paired::ratios(r.limits.iter().map(pick).collect()).to_string()
            }
            _ => "–".into(),
        };
        t.push_str(&format!(
            "| {p} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            alternating(|r| r.0),
            alternating(|r| r.1),
            cell(Datapath::PeerwallBpf, Datapath::TcEmpty, true),
            cell(Datapath::PeerwallBpf, Datapath::TcHash, true),
            cell(Datapath::PeerwallBpf, Datapath::PeerwallNft, true),
            cell(Datapath::PeerwallBpf, Datapath::PeerwallNft, false),
            cell(
                Datapath::PeerwallBpfConntrack,
                Datapath::PeerwallNftConntrack,
                true
            ),
            cell(
                Datapath::PeerwallNftConntrack,
                Datapath::ConntrackOnly,
                true
            ),
            cell(
                Datapath::PeerwallNftConntrack,
                Datapath::PeerwallNftNoCacheConntrack,
                true
            ),
        ));
    }
    if t.is_empty() {
        return t;
    }
    format!(
        "\npeerwall bpf (tcx) against the limits and against peerwall nftables, and peerwall \
         nftables against a gateway that already tracks connections (a Liqo gateway does: its \
         remapping NAT chains, installed under both rows, so this is what the nftables filter \
         itself adds there; bpf is compared with nftables on that gateway too); median and \
         spread. *Alternating windows*: \
         peerwall's datapath stays installed and a limit program is attached with tcx in front \
         of it (it passes the packet, which ends tcx's walk) for some windows of one running \
         stream: cycles of bpf, limit, limit, bpf windows, every cycle of every round one \
         ratio. *Separate installs*: the rows above, ratios taken round by round (each \
         datapath installed afresh and measured in its own window, seconds apart, so the VM's \
         shifts between forwarding regimes fall into these ratios). Targets: bpf ≥ 0.95 of the \
         empty tcx program, ≥ 1.0 of nftables. The last column is what nftables' decided-flow \
         cache gives the allowed traffic here (one-way UDP: every packet `new` to conntrack, \
         each flow's first packet walking the chains); – where the policy renders no cache.\n\n\
         | policy | allowed: bpf ÷ empty tcx, alternating windows | allowed: bpf ÷ tcx one hash lookup, alternating windows | allowed: bpf ÷ empty tcx, separate installs | allowed: bpf ÷ tcx one hash lookup, separate installs | allowed: bpf ÷ nftables | denied: bpf ÷ nftables | allowed: bpf ÷ nftables, both conntrack on (Liqo's NAT) | allowed: nftables ÷ conntrack on, both beside Liqo's NAT | allowed: nftables ÷ nftables without its decided-flow cache, both conntrack on |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n{t}"
    )
}

pub(crate) fn fmt_ratio(v: f64) -> String {
    if v >= 0.1 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

pub(crate) fn fmt_pps(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2} M", v / 1e6)
    } else {
        format!("{:.0} k", v / 1e3)
    }
}

/// The cost of events: each events row against the same datapath without events, measured in
/// the same run. Empty when the run measured no pair.
pub(crate) fn events_section(rows: &[Row]) -> String {
    let mut t = String::new();
    for r in rows {
        let (Some(base_dp), Some(eps)) = (r.dp.without_events(), r.events_per_sec) else {
            continue;
        };
        let Some(b) = find_row(rows, &r.policy, base_dp) else {
            continue;
        };
        let (ra, rd) = (
            Paired::rows(r, b, true).median,
            Paired::rows(r, b, false).median,
        );
        t.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.0} | {} |\n",
            r.policy,
            base_dp.label(),
            fmt_ratio(ra),
            fmt_ratio(rd),
            fmt_pps(median(r.denied.clone())),
            eps,
            if ra.min(rd) >= 0.9 { "meets" } else { "misses" }
        ));
    }
    if t.is_empty() {
        return t;
    }
    let date = run("date", &["-u", "+%Y-%m-%d %H:%M UTC"]);
    format!(
        "## The cost of events (`cargo xtask bench-gateway`, events rows)\n\n\
         Generated on {}. The same gateway, policy and traffic as the table above; the datapath \
         enforced by `peerwall agent --events` (every drop reported: NFLOG `log group` behind a \
         global `limit` for nftables, the ring buffer with its per-flow and per-CPU limits for \
         bpf; the running agent reads, numbers and counts each event) against the same \
         datapath without events, measured in the same rounds (ratios round by round, then their median). Denied traffic runs at full rate over \
         1024 flows, so events run at their rate limit. Target: ≥ 0.9.\n\n\
         | policy | datapath | allowed: events on / off | denied: events on / off | denied pps, events on | events read per second | ≥ 0.9 |\n\
         |---|---|---:|---:|---:|---:|---|\n{t}",
        date.trim()
    )
}

/// Grouped bars on a log scale, one panel per traffic kind.
pub(crate) fn svg(rows: &[Row], policies: &[String]) -> String {
    let dps: Vec<Datapath> = Datapath::ALL
        .iter()
        .copied()
        .filter(|d| *d != Datapath::None && d.without_events().is_none())
        .collect();
    let colors = [
        "#dddddd", "#bbbbbb", "#7f7f7f", "#1f77b4", "#2ca02c", "#17becf", "#d62728", "#ff7f0e",
        "#9467bd",
    ];
    let (w, ph, top, left) = (900.0, 260.0, 40.0, 60.0);
    let mut s = format!("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n", 2.0 * (ph + top + 40.0) + 50.0);
    let y_of = |r: f64, y0: f64| {
        // log10 scale from 0.001 to 2.
        let l = r.clamp(0.001, 2.0).log10();
        y0 + ph - (l + 3.0) / (2f64.log10() + 3.0) * ph
    };
    for (panel, allowed) in [(0, true), (1, false)] {
        let y0 = top + panel as f64 * (ph + top + 40.0);
        s.push_str(&format!("<text x=\"{left}\" y=\"{}\" font-size=\"13\" font-weight=\"bold\">{} traffic: packets per second as a ratio to no filter (log scale)</text>\n", y0 - 12.0, if allowed { "Allowed" } else { "Denied" }));
        for t in [0.001, 0.01, 0.1, 1.0] {
            let y = y_of(t, y0);
            s.push_str(&format!("<line x1=\"{left}\" x2=\"{}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/><text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{t}</text>\n", w - 20.0, left - 5.0, y + 4.0));
        }
        let gw = (w - left - 20.0) / policies.len() as f64;
        let bw = gw * 0.8 / dps.len() as f64;
        for (gi, p) in policies.iter().enumerate() {
            let gx = left + gi as f64 * gw + gw * 0.1;
            s.push_str(&format!(
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{p}</text>\n",
                gx + gw * 0.4,
                y0 + ph + 15.0
            ));
            for (di, dp) in dps.iter().enumerate() {
                let (Some(r), Some(b)) =
                    (find_row(rows, p, *dp), find_row(rows, p, Datapath::None))
                else {
                    continue;
                };
                let ratio = Paired::rows(r, b, allowed).median;
                if ratio <= 0.0 {
                    continue;
                }
                let y = y_of(ratio, y0);
                s.push_str(&format!("<rect x=\"{:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{}\"><title>{}: {}</title></rect>\n", gx + di as f64 * bw, bw * 0.9, y0 + ph - y, colors[di % colors.len()], dp.label(), fmt_ratio(ratio)));
            }
        }
    }
    let ly = 2.0 * (ph + top + 40.0) + 10.0;
    for (di, dp) in dps.iter().enumerate() {
        let x = left + (di % 3) as f64 * 260.0;
        let y = ly + (di / 3) as f64 * 16.0;
        s.push_str(&format!("<rect x=\"{x}\" y=\"{:.1}\" width=\"10\" height=\"10\" fill=\"{}\"/><text x=\"{}\" y=\"{:.1}\">{}</text>\n", y - 9.0, colors[di % colors.len()], x + 14.0, y, dp.label()));
    }
    s.push_str("</svg>\n");
    s
}
