//! The directory source (`peerwall agent --source dir:PATH`): keep a directory of
//! FirewallConfiguration and AddressSet YAML enforced.
//!
//! The directory is watched (inotify: a file closed after writing, renamed in or out, deleted)
//! and polled every interval as well. A notified change is read at once, and only the files
//! the notification names are looked at (a directory of 1000 slice files is not listed again
//! for one of them); a change only the poll found is read once the directory looked the same
//! on two polls in a row (a file caught half-written by a non-atomic editor is not reported as
//! invalid). Only files whose size or modification time changed are read again.
//! When the FirewallConfigurations change, every object is validated and compiled into one
//! policy and applied whole; when only AddressSets change, each changed slice is merged into
//! the compiled policy in place and the backend changes just those set elements (O(changes):
//! a pod added to a 100k-pod set is one element). An invalid change is logged and not applied:
//! the last good policy (or slice) stays in force. The enforcement's upkeep (nftables drift repair,
//! counters) runs on every quiet tick.

use std::collections::{BTreeMap, BTreeSet};
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
    /// Each watched directory by its watch descriptor.
    dirs: Vec<(i32, PathBuf)>,
}

/// What a wait for notifications ended with.
enum Wake {
    /// Nothing within the timeout: the poll reads every directory again.
    Quiet,
    /// Only these files were closed after writing, renamed in or out, or deleted.
    Files(BTreeSet<PathBuf>),
    /// Notified, but not only of named files (the queue overflowed): read every directory.
    Everything,
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
        let mut wds = Vec::with_capacity(dirs.len());
        for d in dirs {
            let c = std::ffi::CString::new(d.as_os_str().as_bytes()).ok()?;
            // SAFETY: valid fd and NUL-terminated path.
            let wd = unsafe { libc::inotify_add_watch(fd.as_raw_fd(), c.as_ptr(), mask) };
            if wd < 0 {
                return None;
            }
            wds.push((wd, d.to_path_buf()));
        }
        Some(Self { fd, dirs: wds })
    }

    /// Wait up to `timeout` for a change, and read what was notified.
    fn wait(&self, timeout: Duration) -> Wake {
        use std::os::fd::AsRawFd;
        let mut pfd = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: one valid pollfd.
        if unsafe { libc::poll(&mut pfd, 1, ms) } <= 0 {
            return Wake::Quiet;
        }
        let mut files = BTreeSet::new();
        let mut everything = false;
        let mut buf = [0u8; 4096];
        loop {
            // SAFETY: reading into a buffer we own, of its length (the fd is non-blocking).
            let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            let Ok(n) = usize::try_from(n) else { break };
            if n == 0 {
                break;
            }
            everything |= !self.names(&buf[..n], &mut files);
        }
        if everything || files.is_empty() {
            Wake::Everything
        } else {
            Wake::Files(files)
        }
    }

    /// The files named by the events in `buf` (inotify(7): a header, then `len` bytes of
    /// NUL-padded name), added to `files`; false when an event names no file of a watched
    /// directory (an overflow, or the directory itself).
    fn names(&self, buf: &[u8], files: &mut BTreeSet<PathBuf>) -> bool {
        use std::os::unix::ffi::OsStrExt;
        let header = std::mem::size_of::<libc::inotify_event>();
        let mut all_named = true;
        let mut at = 0;
        while at + header <= buf.len() {
            // SAFETY: `header` bytes lie in `buf` (checked above); an unaligned read of a
            // plain C struct.
            let ev: libc::inotify_event =
                unsafe { std::ptr::read_unaligned(buf[at..].as_ptr().cast()) };
            let start = at + header;
            let end = start + ev.len as usize;
            let Some(raw) = buf.get(start..end) else {
                return false;
            };
            let name = raw.split(|b| *b == 0).next().unwrap_or_default();
            match self.dirs.iter().find(|(wd, _)| *wd == ev.wd) {
                Some((_, dir)) if !name.is_empty() && ev.mask & libc::IN_Q_OVERFLOW == 0 => {
                    files.insert(dir.join(std::ffi::OsStr::from_bytes(name)));
                }
                _ => all_named = false,
            }
            at = end;
        }
        all_named
    }
}

/// Bring `fp`, a fingerprint of `dir`, up to date for the notified `files` (those in `dir`):
/// each is looked at again, not the whole directory.
fn refresh(fp: &mut Fingerprint, dir: &Path, files: &BTreeSet<PathBuf>) -> std::io::Result<()> {
    for p in files.iter().filter(|p| p.parent() == Some(dir)) {
        if !is_yaml(p) {
            continue;
        }
        match std::fs::metadata(p) {
            Ok(m) => {
                fp.insert(p.clone(), (m.len(), m.modified()?));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                fp.remove(p);
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn is_yaml(p: &Path) -> bool {
    p.extension()
        .and_then(|x| x.to_str())
        .is_some_and(|x| x == "yaml" || x == "yml")
}

/// Fingerprint of a directory: names, sizes and modification times of its YAML files.
fn fingerprint(dir: &Path) -> std::io::Result<Fingerprint> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let p = e.path();
        if is_yaml(&p) {
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
        let gone: Vec<PathBuf> = self
            .files
            .keys()
            .filter(|p| !fp.contains_key(*p))
            .cloned()
            .collect();
        // Only files that are new or whose stamp moved are read (lookups, not a copy of the
        // map: a directory of 1000 slice files changes one at a time).
        let mut read = Vec::new();
        for (path, stamp) in fp {
            if self.files.get(path).is_some_and(|(s, _)| s == stamp) {
                continue;
            }
            // A near miss is an error here too. On any error nothing changes: every file
            // stays as last read.
            let l = std::fs::read_to_string(path)
                .map_err(|source| load::LoadError::Io {
                    path: path.clone(),
                    source,
                })
                .and_then(|text| load::parse_all(&text, &path.display().to_string()))
                .and_then(|l| l.refuse_near_misses().map(|()| l))?;
            read.push((path.clone(), *stamp, l));
        }
        // Applied in place, and undone when the directory would hold nothing.
        let mut replaced = Vec::with_capacity(gone.len() + read.len());
        for p in gone {
            let old = self.files.remove(&p);
            replaced.push((p, old));
        }
        for (path, stamp, l) in read {
            let old = self.files.insert(path.clone(), (stamp, l));
            replaced.push((path, old));
        }
        let nothing = self
            .files
            .values()
            .all(|(_, l)| l.objects.is_empty() && l.address_sets.is_empty());
        if nothing {
            for (p, old) in replaced.into_iter().rev() {
                match old {
                    Some(v) => self.files.insert(p, v),
                    None => self.files.remove(&p),
                };
            }
            return Err(load::LoadError::Nothing(format!("{} files", fp.len())));
        }
        let touched = replaced.into_iter().map(|(p, _)| p).collect();
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
    // A set declaring more slices than the directory holds waits for them (a writer copying
    // a configuration and its slices in, in any order): the policy in force stays.
    let counts = peerwall_policy::sliced::slice_counts(state.slices.values());
    if let Some((o, why)) = objects.iter().find_map(|o| {
        peerwall_policy::sliced::waiting_for_slices(&o.origin.0, o, &counts).map(|w| (o, w))
    }) {
        return Err(EnforceError::WaitingForSlices {
            origin: o.origin.0.clone(),
            why,
        });
    }
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
    // The directories' fingerprints: ours and the observed ones. A wake that names its files
    // looks at those again (a change of one slice file among 1000 stats one file); a quiet
    // tick, and at least once an interval, every file.
    let (mut own, mut others) = (Fingerprint::new(), Fingerprint::new());
    let mut wake = Wake::Everything;
    let mut scanned: Option<Instant> = None;
    while !stop.is_set() {
        match std::mem::replace(&mut wake, Wake::Quiet) {
            Wake::Files(files) if scanned.is_some_and(|t| t.elapsed() < interval) => {
                refresh(&mut own, dir, &files)
                    .with_context(|| format!("reading {}", dir.display()))?;
                for o in observed {
                    refresh(&mut others, o, &files)
                        .with_context(|| format!("reading {}", o.display()))?;
                }
            }
            _ => {
                own = fingerprint(dir).with_context(|| format!("reading {}", dir.display()))?;
                others.clear();
                for o in observed {
                    others.extend(
                        fingerprint(o).with_context(|| format!("reading {}", o.display()))?,
                    );
                }
                scanned = Some(Instant::now());
            }
        }
        let mut fp = own.clone();
        fp.extend(others.iter().map(|(p, s)| (p.clone(), *s)));
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
                        Err(e @ EnforceError::WaitingForSlices { .. }) => {
                            tracing::warn!(error = %e, "waiting for AddressSets")
                        }
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
        wake = match &watch {
            Some(w) => w.wait(interval),
            None => {
                stop.wait_timeout(interval);
                Wake::Quiet
            }
        };
        notified = !matches!(wake, Wake::Quiet);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// One inotify event as the kernel lays it out: the header, then the name NUL-padded to
    /// `padded` bytes.
    fn event(wd: i32, mask: u32, name: &str, padded: usize) -> Vec<u8> {
        let ev = libc::inotify_event {
            wd,
            mask,
            cookie: 0,
            len: padded as u32,
        };
        // SAFETY: a plain C struct viewed as its bytes.
        let header = unsafe {
            std::slice::from_raw_parts(
                (&ev as *const libc::inotify_event).cast::<u8>(),
                std::mem::size_of::<libc::inotify_event>(),
            )
        };
        let mut out = header.to_vec();
        let mut n = name.as_bytes().to_vec();
        n.resize(padded, 0);
        out.extend(n);
        out
    }

    fn watch(dirs: &[(i32, &str)]) -> Watch {
        // Any descriptor: `names` only parses.
        let fd = std::fs::File::open("/dev/null").unwrap().into();
        Watch {
            fd,
            dirs: dirs.iter().map(|(w, d)| (*w, PathBuf::from(d))).collect(),
        }
    }

    #[test]
    fn a_notification_names_the_files_of_each_watched_directory() {
        let w = watch(&[(1, "/policy"), (2, "/observed")]);
        let mut buf = event(
            1,
            libc::IN_MOVED_TO,
            "peerwall-gateway-offloaded-0007.yaml",
            48,
        );
        buf.extend(event(2, libc::IN_CLOSE_WRITE, "nat.yaml", 16));
        buf.extend(event(1, libc::IN_DELETE, "old.yaml", 16));
        let mut files = BTreeSet::new();
        assert!(w.names(&buf, &mut files));
        let want: BTreeSet<PathBuf> = [
            "/policy/peerwall-gateway-offloaded-0007.yaml",
            "/observed/nat.yaml",
            "/policy/old.yaml",
        ]
        .into_iter()
        .map(PathBuf::from)
        .collect();
        assert_eq!(files, want);
    }

    #[test]
    fn an_overflow_an_unknown_watch_or_a_cut_event_means_reading_everything() {
        let w = watch(&[(1, "/policy")]);
        let mut files = BTreeSet::new();
        assert!(!w.names(&event(-1, libc::IN_Q_OVERFLOW, "", 0), &mut files));
        assert!(!w.names(&event(9, libc::IN_MOVED_TO, "a.yaml", 16), &mut files));
        let cut = event(1, libc::IN_MOVED_TO, "a.yaml", 16);
        assert!(!w.names(&cut[..cut.len() - 4], &mut files));
        assert!(files.is_empty());
    }

    #[test]
    fn a_refresh_looks_again_at_the_named_yaml_files_of_its_directory_only() {
        let dir = std::env::temp_dir().join(format!("pw-dir-refresh-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (dir.join("a.yaml"), dir.join("b.yaml"));
        std::fs::write(&a, "x").unwrap();
        std::fs::write(&b, "y").unwrap();
        let mut fp = fingerprint(&dir).unwrap();
        std::fs::write(&a, "longer").unwrap();
        std::fs::remove_file(&b).unwrap();
        std::fs::write(dir.join("c.yaml"), "z").unwrap();
        std::fs::write(dir.join(".next.tmp"), "t").unwrap();
        let named: BTreeSet<PathBuf> = [a.clone(), b.clone(), dir.join(".next.tmp")]
            .into_iter()
            .chain([PathBuf::from("/elsewhere/a.yaml")])
            .collect();
        refresh(&mut fp, &dir, &named).unwrap();
        // a re-read, b gone; c was not named, so only the next full listing finds it.
        assert_eq!(fp.get(&a).map(|s| s.0), Some(6));
        assert!(!fp.contains_key(&b));
        assert!(!fp.contains_key(&dir.join("c.yaml")));
        assert_eq!(fp.len(), 1);
        assert_eq!(fingerprint(&dir).unwrap().len(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
