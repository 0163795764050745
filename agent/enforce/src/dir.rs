//! The directory source (`peerwall agent --source dir:PATH`): keep a directory of
//! FirewallConfiguration and AddressSet YAML enforced.
//!
//! The directory is watched (inotify: a file closed after writing, renamed in or out, deleted)
//! and polled every interval as well. A notified change is read at once; a change only the
//! poll found is read once the directory looked the same on two polls in a row (a file caught
//! half-written by a non-atomic editor is not reported as invalid). Only files whose size or
//! modification time changed are read again.
//! When the FirewallConfigurations change, every object is validated and compiled into one
//! policy and applied whole; when only AddressSets change, each changed slice is merged into
//! the compiled policy in place and the backend changes just those set elements (O(changes):
//! a pod added to a 100k-pod set is one element). An invalid change is logged and not applied:
//! the last good policy (or slice) stays in force. The enforcement's upkeep (nftables drift repair,
//! counters) runs on every quiet tick.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;

use crate::enforcement::{EnforceError, Enforcement};
use peerwall_intent::load::{self, Loaded};
use peerwall_intent::{Origin, PolicyObject};
use peerwall_policy::compile;
use peerwall_policy::sliced::{check_slice, CheckedSlice, Sliced};

type Fingerprint = BTreeMap<PathBuf, (u64, SystemTime)>;

/// Change notifications of directories (inotify). Without them (inotify unavailable), the
/// poll alone finds changes.
struct Watch {
    fd: std::os::fd::OwnedFd,
}

impl Watch {
    fn new(dirs: &[&Path]) -> Option<Self> {
        use std::os::fd::{AsRawFd, FromRawFd};
        use std::os::unix::ffi::OsStrExt;
        // SAFETY: plain inotify_init1(2); the fd is owned below.
        let raw = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if raw < 0 {
            return None;
        }
        // SAFETY: a fresh descriptor we own.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
        let mask = libc::IN_CLOSE_WRITE | libc::IN_MOVED_TO | libc::IN_MOVED_FROM | libc::IN_DELETE;
        for d in dirs {
            let c = std::ffi::CString::new(d.as_os_str().as_bytes()).ok()?;
            // SAFETY: valid fd and NUL-terminated path.
            if unsafe { libc::inotify_add_watch(fd.as_raw_fd(), c.as_ptr(), mask) } < 0 {
                return None;
            }
        }
        Some(Self { fd })
    }

    /// Wait up to `timeout` for a change; whether one was notified.
    fn wait(&self, timeout: Duration) -> bool {
        use std::os::fd::AsRawFd;
        let mut pfd = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: one valid pollfd.
        if unsafe { libc::poll(&mut pfd, 1, ms) } <= 0 {
            return false;
        }
        let mut buf = [0u8; 4096];
        // SAFETY: reading into a buffer we own, of its length (the fd is non-blocking).
        while unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) } > 0 {}
        true
    }
}

/// Fingerprint of a directory: names, sizes and modification times of its YAML files.
fn fingerprint(dir: &Path) -> std::io::Result<Fingerprint> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let p = e.path();
        let yaml = p
            .extension()
            .and_then(|x| x.to_str())
            .is_some_and(|x| x == "yaml" || x == "yml");
        if yaml {
            let m = e.metadata()?;
            out.insert(p, (m.len(), m.modified()?));
        }
    }
    Ok(out)
}

/// What the directory source holds between polls.
#[derive(Default)]
struct DirState {
    /// Each file as last read, with the fingerprint it was read at.
    files: BTreeMap<PathBuf, ((u64, SystemTime), Loaded)>,
    /// Slices as last merged (an invalid one keeps its last good version), by origin.
    slices: BTreeMap<Origin, CheckedSlice>,
    /// The slices each file holds.
    slice_files: BTreeMap<PathBuf, Vec<Origin>>,
    /// The FirewallConfigurations the policy in force was compiled from.
    objects: Option<Vec<PolicyObject>>,
    /// The policy in force, with its slices merged.
    sliced: Option<Sliced>,
}

impl DirState {
    /// Read the files that changed since the last poll; returns the files changed, added or
    /// removed. On a parse error nothing changes.
    fn read(&mut self, fp: &Fingerprint) -> Result<Vec<PathBuf>, load::LoadError> {
        let mut touched: Vec<PathBuf> = self
            .files
            .keys()
            .filter(|p| !fp.contains_key(*p))
            .cloned()
            .collect();
        // Unchanged files move over as they are (no copy: a slice file holds 1000 addresses).
        let mut old = std::mem::take(&mut self.files);
        let mut next = BTreeMap::new();
        for (path, stamp) in fp {
            match old.remove(path) {
                Some((s, l)) if s == *stamp => {
                    next.insert(path.clone(), (s, l));
                }
                before => {
                    let parsed = std::fs::read_to_string(path)
                        .map_err(|source| load::LoadError::Io {
                            path: path.clone(),
                            source,
                        })
                        .and_then(|text| load::parse_all(&text, &path.display().to_string()))
                        // A near miss is an error here too: the file stays as last read.
                        .and_then(|l| l.refuse_near_misses().map(|()| l));
                    match parsed {
                        Ok(l) => {
                            next.insert(path.clone(), (*stamp, l));
                            touched.push(path.clone());
                        }
                        Err(e) => {
                            // Nothing changes: every file stays as last read.
                            if let Some(b) = before {
                                old.insert(path.clone(), b);
                            }
                            old.extend(next);
                            self.files = old;
                            return Err(e);
                        }
                    }
                }
            }
        }
        if next
            .values()
            .all(|(_, l)| l.objects.is_empty() && l.address_sets.is_empty())
        {
            old.extend(next);
            self.files = old;
            return Err(load::LoadError::Nothing(format!("{} files", fp.len())));
        }
        self.files = next;
        Ok(touched)
    }

    fn objects(&self) -> Vec<PolicyObject> {
        self.files
            .values()
            .flat_map(|(_, l)| l.objects.iter().cloned())
            .collect()
    }

    /// The slices of the `touched` files checked again (only those: a change of one slice file
    /// costs one slice, not the directory), and which differ from what is merged:
    /// `(origin, Some)` to merge, `(origin, None)` to withdraw. An invalid slice keeps its last
    /// good version (logged).
    fn slice_changes(&mut self, touched: &[PathBuf]) -> Vec<(Origin, Option<CheckedSlice>)> {
        let mut changes: BTreeMap<Origin, Option<CheckedSlice>> = BTreeMap::new();
        for path in touched {
            let before = self.slice_files.remove(path).unwrap_or_default();
            let mut now = Vec::new();
            for a in self
                .files
                .get(path)
                .map_or(&[][..], |(_, l)| &l.address_sets)
            {
                now.push(a.origin.clone());
                match check_slice(a) {
                    Ok(c) if self.slices.get(&c.origin) != Some(&c) => {
                        self.slices.insert(c.origin.clone(), c.clone());
                        changes.insert(c.origin.clone(), Some(c));
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::error!(error = %e, "invalid AddressSet not applied; its previous addresses stay")
                    }
                }
            }
            for o in before.into_iter().filter(|o| !now.contains(o)) {
                if self.slices.remove(&o).is_some() {
                    changes.insert(o, None);
                }
            }
            if !now.is_empty() {
                self.slice_files.insert(path.clone(), now);
            }
        }
        changes.into_iter().collect()
    }
}

/// Apply what the directory now holds: the whole policy when its FirewallConfigurations (or
/// the host) changed, else only the slices that changed.
fn enforce(
    state: &mut DirState,
    touched: &[PathBuf],
    observed: Vec<PolicyObject>,
    enforcement: &mut Enforcement,
    env_changed: bool,
) -> Result<(), EnforceError> {
    let started = Instant::now();
    let mut objects = state.objects();
    objects.extend(observed);
    let changes = state.slice_changes(touched);
    let unchanged = state.objects.as_ref() == Some(&objects) && !env_changed;
    if let (true, Some(sliced)) = (unchanged, state.sliced.as_mut()) {
        let mut set_changes = Vec::new();
        for (origin, slice) in &changes {
            let (c, issue) = sliced.update(origin, slice.as_ref());
            if let Some(i) = issue {
                tracing::error!(slice = %origin, error = %i, "AddressSet not applied");
            }
            set_changes.extend(c);
        }
        let r = enforcement
            .update_sets(sliced.policy(), &set_changes, started)
            .or_else(|e| {
                tracing::warn!(error = %e, "set update failed; applying the whole policy");
                enforcement.apply_compiled(sliced.compiled(), started)
            });
        if r.is_err() {
            state.sliced = None;
            state.objects = None;
        }
        return r;
    }
    let compiled = compile::compile(&objects).map_err(|e| {
        enforcement.count_invalid();
        EnforceError::Invalid(e)
    })?;
    let slices: Vec<CheckedSlice> = state.slices.values().cloned().collect();
    let (sliced, issues) = Sliced::new(compiled, &slices);
    for (origin, i) in &issues {
        tracing::error!(slice = %origin, error = %i, "AddressSet not applied");
    }
    enforcement.apply_compiled(sliced.compiled(), started)?;
    state.sliced = Some(sliced);
    state.objects = Some(objects);
    Ok(())
}

/// Run until `stop` is set: apply the directory's policy whenever it changes. Objects in the
/// `observed` directories are another enforcer's, read for their NAT only.
pub fn run(
    dir: &Path,
    observed: &[PathBuf],
    enforcement: &mut Enforcement,
    interval: Duration,
    stop: Arc<crate::shutdown::Shutdown>,
) -> anyhow::Result<()> {
    let mut last = None;
    let mut pending = None;
    let mut state = DirState::default();
    let mut dirs: Vec<&Path> = vec![dir];
    dirs.extend(observed.iter().map(PathBuf::as_path));
    let watch = Watch::new(&dirs);
    if watch.is_none() {
        tracing::warn!("no change notifications (inotify) for the policy directory: changes are found by polling every --interval-ms");
    }
    let mut notified = false;
    let mut last_upkeep = Instant::now();
    while !stop.is_set() {
        let mut fp = fingerprint(dir).with_context(|| format!("reading {}", dir.display()))?;
        let own = fp.clone();
        for o in observed {
            fp.extend(fingerprint(o).with_context(|| format!("reading {}", o.display()))?);
        }
        let env_changed = enforcement.environment_changed();
        // A notified change is complete (closed or renamed in); one only the poll found is
        // read once the directory looked the same on two polls in a row, so a file caught
        // half-written by a non-atomic editor is not reported as invalid.
        let settled = notified || pending.as_ref() == Some(&fp);
        if last.as_ref() != Some(&fp) && !settled {
            pending = Some(fp);
        } else if last.as_ref() != Some(&fp) || env_changed {
            if env_changed {
                tracing::info!("interfaces changed: re-applying");
            }
            let read = state
                .read(&own)
                .map_err(|e| match e {
                    load::LoadError::Nothing(_) => {
                        load::LoadError::Nothing(dir.display().to_string())
                    }
                    e => e,
                })
                .and_then(|touched| Ok((touched, observed_objects(observed)?)));
            match read {
                Ok((touched, seen)) => {
                    match enforce(&mut state, &touched, seen, enforcement, env_changed) {
                        Ok(()) => {}
                        Err(EnforceError::Invalid(e)) => tracing::error!(
                            error = %e,
                            "invalid policy not applied; previous policy stays"
                        ),
                        Err(e) => {
                            tracing::error!(error = %e, "apply failed; previous policy stays")
                        }
                    }
                }
                Err(e) => {
                    enforcement.count_invalid();
                    tracing::error!(error = %e, "invalid policy not applied; previous policy stays")
                }
            }
            last = Some(fp);
        } else if !notified || last_upkeep.elapsed() >= interval {
            // Upkeep on quiet ticks (and at least once an interval under a stream of
            // notifications), not right after a notification that changed nothing: a writer's
            // temporary file announces the rename that follows, which must not wait for it.
            enforcement.maintain();
            last_upkeep = Instant::now();
        }
        notified = match &watch {
            Some(w) => w.wait(interval),
            None => {
                stop.wait_timeout(interval);
                false
            }
        };
    }
    tracing::info!("agent stopping; enforcement stays in place");
    Ok(())
}

/// The objects of the observed directories (an empty one is normal: nothing remapped).
fn observed_objects(observed: &[PathBuf]) -> Result<Vec<PolicyObject>, load::LoadError> {
    let with_files: Vec<PathBuf> = observed
        .iter()
        .filter(|o| fingerprint(o).is_ok_and(|f| !f.is_empty()))
        .cloned()
        .collect();
    if with_files.is_empty() {
        return Ok(Vec::new());
    }
    let mut seen = load::load_paths(&with_files)?;
    for o in &mut seen {
        o.role = peerwall_intent::Role::Observe;
    }
    Ok(seen)
}
