//! Where one pod's time went: each "one pod → first packet" sample split at the moments the
//! bench can see, on one clock:
//! - **controller**: the pod's status written → the first slice version holding its address,
//!   seen by the bench's watch;
//! - **agent**: that slice seen → the end of the agent's apply that put it in force (its
//!   `set elements updated` / `policy applied` log line, `--log-format json`, debug level for
//!   `peerwall_enforce::enforcement`);
//! - **after**: that apply → the first probe packet at the pod (0 when the packet came before
//!   the log line).
//!
//! For the slowest samples, also what the agent logged meanwhile (until the first packet, or
//! the apply's line when it came later) (status writes, drift
//! checks, other applies): what held the sample back.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant, SystemTime};

use crate::SliceSeen;

/// One sample: the pod's address, when its status was written, when its first packet came.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    pub ip: Ipv4Addr,
    pub t0: Instant,
    pub first: Instant,
}

/// A line of the agent's JSON log: when, and what.
#[derive(Clone, Debug)]
pub struct LogLine {
    pub at: Instant,
    pub message: String,
    pub fields: String,
    /// An apply's end (`set elements updated`, `policy applied`).
    pub apply: bool,
}

/// One clock for the log's wall-clock stamps and the bench's instants.
#[derive(Clone, Copy)]
pub struct Clock {
    instant: Instant,
    wall: SystemTime,
}

impl Clock {
    pub fn now() -> Self {
        Self {
            instant: Instant::now(),
            wall: SystemTime::now(),
        }
    }

    fn instant_of(&self, unix_nanos: i64) -> Option<Instant> {
        let base = self.wall.duration_since(SystemTime::UNIX_EPOCH).ok()?;
        let at = Duration::from_nanos(u64::try_from(unix_nanos).ok()?);
        if at >= base {
            self.instant.checked_add(at - base)
        } else {
            self.instant.checked_sub(base - at)
        }
    }
}

/// The agent's log lines (JSON), on the bench's clock.
pub fn agent_log(text: &str, clock: Clock) -> Vec<LogLine> {
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| {
            let nanos = chrono::DateTime::parse_from_rfc3339(v["timestamp"].as_str()?)
                .ok()?
                .timestamp_nanos_opt()?;
            let message = v["fields"]["message"].as_str().unwrap_or("").to_string();
            let mut fields = v["fields"].clone();
            if let Some(o) = fields.as_object_mut() {
                o.remove("message");
            }
            Some(LogLine {
                at: clock.instant_of(nanos)?,
                apply: message == "set elements updated" || message == "policy applied",
                message,
                fields: fields.to_string(),
            })
        })
        .collect()
}

/// A sample split into its parts (None where a moment was not seen).
#[derive(Clone, Debug)]
pub struct Split {
    pub sample: Sample,
    pub controller: Option<Duration>,
    pub agent: Option<Duration>,
    pub after: Option<Duration>,
    /// When the apply that put it in force ended (its log line).
    pub applied: Option<Instant>,
}

impl Split {
    pub fn total(&self) -> Duration {
        self.sample.first.saturating_duration_since(self.sample.t0)
    }
}

pub fn split(s: Sample, slices: &[SliceSeen], log: &[LogLine]) -> Split {
    let seen = slices
        .iter()
        .filter(|v| v.at >= s.t0 && v.addresses.contains(&s.ip))
        .map(|v| v.at)
        .min();
    // The apply that put it in force: the first to end after the slice was seen (its log
    // line is written once the kernel took the change, so the first packet may come a little
    // before it: then "after" is 0).
    let applied = seen.and_then(|x| {
        log.iter()
            .filter(|l| l.apply && l.at >= x && l.at <= s.first + Duration::from_millis(50))
            .map(|l| l.at)
            .min()
    });
    Split {
        sample: s,
        controller: seen.map(|x| x.saturating_duration_since(s.t0)),
        agent: seen
            .zip(applied)
            .map(|(x, a)| a.saturating_duration_since(x)),
        after: applied.map(|a| s.first.saturating_duration_since(a)),
        applied,
    }
}

fn ms(d: Option<Duration>) -> String {
    d.map_or("–".into(), |d| format!("{:.1}", d.as_secs_f64() * 1e3))
}

/// The `n` slowest samples, each with its parts and what the agent logged meanwhile.
pub fn slowest(splits: &[Split], log: &[LogLine], n: usize) -> Vec<String> {
    let mut v: Vec<&Split> = splits.iter().collect();
    v.sort_by_key(|s| std::cmp::Reverse(s.total()));
    v.into_iter()
        .take(n)
        .map(|s| {
            let during: Vec<String> = log
                .iter()
                // Up to the first packet, or to the apply's line when that came after it.
                .filter(|l| {
                    l.at >= s.sample.t0
                        && l.at <= s.applied.map_or(s.sample.first, |a| a.max(s.sample.first))
                })
                .map(|l| {
                    format!(
                        "+{:.1} ms {} {}",
                        l.at.saturating_duration_since(s.sample.t0).as_secs_f64() * 1e3,
                        l.message,
                        l.fields
                    )
                })
                .collect();
            format!(
                "{} total {} ms = controller {} + agent {} + after {}; agent log meanwhile: [{}]",
                s.sample.ip,
                ms(Some(s.total())),
                ms(s.controller),
                ms(s.agent),
                ms(s.after),
                during.join("; ")
            )
        })
        .collect()
}

/// Median of one part over the samples where it was seen.
pub fn median_of(splits: &[Split], part: impl Fn(&Split) -> Option<Duration>) -> Option<Duration> {
    let mut v: Vec<Duration> = splits.iter().filter_map(part).collect();
    v.sort_unstable();
    v.get(v.len() / 2).copied()
}
