//! The table, the docs section and the plot.

use std::time::Duration;

use super::*;

#[derive(Clone, Debug)]
pub(crate) struct Row {
    pub(crate) policy: String,
    pub(crate) dp: Datapath,
    pub(crate) allowed: Vec<f64>,
    pub(crate) denied: Vec<f64>,
    pub(crate) load: Option<Duration>,
    /// Events the agent read per second while the row was measured (the events rows).
    pub(crate) events_per_sec: Option<f64>,
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
        let Some(b) = rows
            .iter()
            .find(|x| x.policy == r.policy && x.dp == base_dp)
        else {
            continue;
        };
        let ratio = |v: &[f64], b: &[f64]| median(v.to_vec()) / median(b.to_vec());
        let (ra, rd) = (ratio(&r.allowed, &b.allowed), ratio(&r.denied, &b.denied));
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
         datapath without events, measured in the same run. Denied traffic runs at full rate over \
         1024 flows, so events run at their rate limit. Target: ≥ 0.9.\n\n\
         | policy | datapath | allowed: events on / off | denied: events on / off | denied pps, events on | events read per second | ≥ 0.9 |\n\
         |---|---|---:|---:|---:|---:|---|\n{t}",
        date.trim()
    )
}

/// Grouped bars on a log scale, one panel per traffic kind.
pub(crate) fn svg(rows: &[Row], policies: &[String], base: &dyn Fn(&str, bool) -> f64) -> String {
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
                let Some(r) = rows.iter().find(|r| &r.policy == p && r.dp == *dp) else {
                    continue;
                };
                let v = median(if allowed {
                    r.allowed.clone()
                } else {
                    r.denied.clone()
                });
                let b = base(p, allowed);
                if b <= 0.0 || v <= 0.0 {
                    continue;
                }
                let ratio = v / b;
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
