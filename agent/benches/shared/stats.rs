//! What the control-plane benchmarks share to read their settings and summarize their samples
//! (`bench-control`, the API-server part of `bench-netpol`).

use std::time::Duration;

/// The number in environment variable `name`, or `default`.
pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The `p` percentile of `v` (nearest rank; zero for no samples).
pub fn percentile(v: &[Duration], p: f64) -> Duration {
    let mut s = v.to_vec();
    s.sort();
    if s.is_empty() {
        return Duration::ZERO;
    }
    s[((s.len() - 1) as f64 * p).round() as usize]
}

/// Milliseconds with one decimal.
pub fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e3)
}
