//! The one handle of a process a test or benchmark starts: ended when dropped (also on panic),
//! either stopped as an operator would (SIGTERM, then SIGKILL after 5 s; its log printed when a
//! test fails) or killed at once (traffic generators, echo servers, and agents whose end must
//! leave what they enforce in place).

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

/// How a [`Proc`] ends when dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// SIGTERM, then SIGKILL after 5 s.
    Stop,
    /// SIGKILL.
    Kill,
}

/// A child process, ended on drop.
pub struct Proc {
    /// The process.
    pub child: Child,
    /// Its stderr, when it was sent to a file.
    log: Option<PathBuf>,
    end: End,
}

impl Proc {
    /// A process whose stderr goes to `log`: stopped on drop, its log printed if a test fails.
    pub fn logged(child: Child, log: PathBuf) -> Self {
        Self {
            child,
            log: Some(log),
            end: End::Stop,
        }
    }

    /// A process killed (SIGKILL) on drop.
    pub fn killed_on_drop(child: Child) -> Self {
        Self {
            child,
            log: None,
            end: End::Kill,
        }
    }

    /// A process whose stderr goes to `log`, killed (SIGKILL) on drop: its log printed if a
    /// test fails, removed otherwise (an agent whose end must leave what it enforces in place,
    /// whose log says why it did not act when a test waits for it in vain).
    pub fn killed_on_drop_logged(child: Child, log: PathBuf) -> Self {
        Self {
            child,
            log: Some(log),
            end: End::Kill,
        }
    }

    /// Its log so far (empty without one).
    pub fn log(&self) -> String {
        self.log
            .as_ref()
            .and_then(|l| std::fs::read_to_string(l).ok())
            .unwrap_or_default()
    }

    /// Where its log is.
    pub fn log_path(&self) -> &Path {
        self.log.as_deref().unwrap_or(Path::new("/dev/null"))
    }

    /// SIGTERM, then SIGKILL after 5 s.
    pub fn stop(&mut self) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.kill();
    }

    /// SIGKILL, and reap it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Peak resident memory (VmHWM), MiB.
    pub fn peak_rss_mib(&self) -> f64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| {
                v.split_whitespace()
                    .next()
                    .and_then(|n| n.parse::<f64>().ok())
            })
            .unwrap_or(0.0)
            / 1024.0
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        match self.end {
            End::Kill => self.kill(),
            End::Stop => self.stop(),
        }
        if let Some(l) = &self.log {
            if std::thread::panicking() {
                eprintln!("---- {} ----\n{}", l.display(), self.log());
            } else if self.end == End::Kill {
                // A killed process's log is the kit's own file (`killed_on_drop_logged`); a
                // stopped one's belongs to its caller.
                let _ = std::fs::remove_file(l);
            }
        }
    }
}
