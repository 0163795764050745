//! A datapath made ready before a gateway needs it. Where the agent enforces in many gateway
//! pods (one per Liqo peer), a new peer's gateway waits for its datapath's maps to be created
//! and its programs verified: a few hundred milliseconds of CPU on a node already forwarding
//! for its other peers, while the boot policy drops the new peer's traffic. With spares kept
//! ([`keep_spares`]), once no load runs, the agent loads one datapath ahead (maps created,
//! tc programs verified) and the next load with the same options takes it: its maps are
//! pinned under the gateway's directory and nothing is loaded or verified then.
//!
//! A spare holds no policy and is attached to nothing. Its maps are pinned only while it
//! loads (aya pins them as it creates them), under `<root>/<pid>-<n>` (bpffs refuses names
//! with a dot), and unpinned at once: the agent's descriptors keep them, so a spare the agent
//! never hands out goes with the process, and a crash between the two leaves pins
//! [`keep_spares`] removes at the next start.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use super::{BpfError, Datapath, LoadOptions};

/// Loads running now ([`Loading`]: maps created or a program verified): a spare is made only
/// once none has run for [`QUIET`], so it does not take a CPU from a gateway's start.
static LOADING: AtomicUsize = AtomicUsize::new(0);

/// The spares of this process (None: none are kept).
static SPARES: Mutex<Option<Spares>> = Mutex::new(None);

/// How long no load must have run before a spare is made.
const QUIET: Duration = Duration::from_millis(100);

struct Spares {
    /// Where spares pin their maps while they load.
    root: PathBuf,
    /// The loads spares are for: those whose pin directory is under this one.
    serves: PathBuf,
    /// The spare ready, for loads of these options.
    ready: Option<Spare>,
    /// Whether a spare is being made.
    making: bool,
    /// Spares made so far (their directories' names).
    made: u64,
}

struct Spare {
    opts: LoadOptions,
    datapath: Datapath,
    /// The names its maps were pinned under when it loaded: pinned again under the directory
    /// of the load that takes it.
    pins: Vec<String>,
}

/// A load running (counted in [`LOADING`] until dropped).
pub(super) struct Loading;

impl Loading {
    pub(super) fn start() -> Self {
        LOADING.fetch_add(1, Ordering::SeqCst);
        Loading
    }
}

impl Drop for Loading {
    fn drop(&mut self) {
        LOADING.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Spares taken by loads so far ([`spares_taken`]).
static TAKEN: AtomicU64 = AtomicU64::new(0);

/// Keep a spare datapath ready from now on for the loads whose pin directory is under
/// `serves` (the gateway-pod mode's `<pin-dir>/gateways`), its maps pinned under `root` while
/// it loads (a directory on bpffs that nothing else uses). Pins a crashed agent left there are
/// removed.
pub fn keep_spares(root: &Path, serves: &Path) -> Result<(), BpfError> {
    let io = |source| BpfError::Io {
        path: root.to_path_buf(),
        source,
    };
    match std::fs::read_dir(root) {
        Ok(entries) => {
            for e in entries {
                let dir = e.map_err(io)?.path();
                super::remove_pins(&dir)?;
                tracing::info!(pins = %dir.display(), "removed a spare datapath an earlier agent left");
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
    }
    let mut spares = SPARES.lock().unwrap_or_else(PoisonError::into_inner);
    *spares = Some(Spares {
        root: root.to_path_buf(),
        serves: serves.to_path_buf(),
        ready: None,
        making: false,
        made: 0,
    });
    Ok(())
}

/// The spare ready for `opts`, its maps pinned under `pin_dir` (which must hold no datapath:
/// one pinned there is adopted instead). None: no spare fits, or pinning failed (then the
/// caller loads as it would without one).
pub(super) fn take(pin_dir: &Path, opts: &LoadOptions) -> Option<Datapath> {
    if pin_dir.join(peerwall_common::map::CONFIG).exists() {
        return None;
    }
    let spare = {
        let mut spares = SPARES.lock().unwrap_or_else(PoisonError::into_inner);
        let s = spares.as_mut()?;
        if !pin_dir.starts_with(&s.serves) || s.ready.as_ref().is_none_or(|r| r.opts != *opts) {
            return None;
        }
        s.ready.take()?
    };
    let started = std::time::Instant::now();
    match pin_under(spare.datapath, &spare.pins, pin_dir) {
        Ok(d) => {
            TAKEN.fetch_add(1, Ordering::SeqCst);
            tracing::debug!(
                ms = started.elapsed().as_secs_f64() * 1e3,
                pins = %pin_dir.display(),
                "took the spare datapath (its maps created and programs verified ahead)"
            );
            Some(d)
        }
        Err(e) => {
            tracing::warn!(error = %e, pins = %pin_dir.display(), "could not pin the spare datapath; loading one");
            None
        }
    }
}

/// `d`'s maps pinned under `pin_dir` by the names in `pins`; `d` now lives there. On failure
/// the pins it made are removed again (and nothing else in `pin_dir`).
fn pin_under(mut d: Datapath, pins: &[String], pin_dir: &Path) -> Result<Datapath, BpfError> {
    std::fs::create_dir_all(pin_dir.join("links")).map_err(|source| BpfError::Io {
        path: pin_dir.to_path_buf(),
        source,
    })?;
    let mut made: Vec<PathBuf> = Vec::new();
    for name in pins {
        let path = pin_dir.join(name);
        let pinned = d.map(name).and_then(|m| {
            m.pin(&path).map_err(|source| BpfError::Pin {
                path: path.clone(),
                source,
            })
        });
        if let Err(e) = pinned {
            for p in &made {
                if let Err(e) = std::fs::remove_file(p) {
                    tracing::warn!(pin = %p.display(), error = %e, "could not remove a pin of the spare");
                }
            }
            return Err(e);
        }
        made.push(path);
    }
    d.pin_dir = pin_dir.to_path_buf();
    Ok(d)
}

/// Make a spare for loads of `opts` on a thread of its own, once no load has run for
/// [`QUIET`], unless one is ready for them or being made (or spares are not kept).
pub(super) fn refill(pin_dir: &Path, opts: &LoadOptions) {
    let (dir, opts) = {
        let mut spares = SPARES.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(s) = spares.as_mut() else {
            return;
        };
        if !pin_dir.starts_with(&s.serves)
            || s.making
            || s.ready.as_ref().is_some_and(|r| r.opts == *opts)
        {
            return;
        }
        s.making = true;
        s.made += 1;
        (
            s.root.join(format!("{}-{}", std::process::id(), s.made)),
            *opts,
        )
    };
    let made = std::thread::Builder::new()
        .name("pw-spare".into())
        .spawn(move || {
            let spare = make(&dir, opts);
            let mut spares = SPARES.lock().unwrap_or_else(PoisonError::into_inner);
            let Some(s) = spares.as_mut() else {
                return;
            };
            s.making = false;
            match spare {
                Ok(spare) => s.ready = Some(spare),
                Err(e) => {
                    tracing::warn!(error = %e, "could not make a spare datapath; the next gateway loads its own")
                }
            }
        });
    if let Err(e) = made {
        tracing::warn!(error = %e, "could not start making a spare datapath");
        if let Some(s) = SPARES
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_mut()
        {
            s.making = false;
        }
    }
}

/// Wait until no load has run for [`QUIET`], then load a datapath for `opts` in `dir`, verify
/// its tc programs and unpin its maps (the descriptors keep them).
fn make(dir: &Path, opts: LoadOptions) -> Result<Spare, BpfError> {
    let mut quiet = std::time::Instant::now();
    while quiet.elapsed() < QUIET {
        std::thread::sleep(QUIET / 4);
        if LOADING.load(Ordering::SeqCst) > 0 {
            quiet = std::time::Instant::now();
        }
    }
    let started = std::time::Instant::now();
    let made = Datapath::load_fresh(dir, &opts).and_then(|mut d| {
        d.preload_tc()?;
        let pins = pinned_names(dir)?;
        Ok((d, pins))
    });
    // Unpinned whatever happened: nothing of a spare outlives the process.
    let removed = super::remove_pins(dir);
    let (datapath, pins) = made?;
    removed?;
    tracing::debug!(
        ms = started.elapsed().as_secs_f64() * 1e3,
        maps = pins.len(),
        "spare datapath ready"
    );
    Ok(Spare {
        opts,
        datapath,
        pins,
    })
}

/// The names of the maps pinned directly in `dir`.
fn pinned_names(dir: &Path) -> Result<Vec<String>, BpfError> {
    let io = |source| BpfError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut names = Vec::new();
    for e in std::fs::read_dir(dir).map_err(io)? {
        let e = e.map_err(io)?;
        if e.file_type().map_err(io)?.is_file() {
            names.push(e.file_name().to_string_lossy().into_owned());
        }
    }
    names.sort();
    Ok(names)
}

/// Whether a spare is ready.
pub fn spare_ready() -> bool {
    SPARES
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .as_ref()
        .is_some_and(|s| s.ready.is_some())
}

/// How many loads of this process took a spare.
pub fn spares_taken() -> u64 {
    TAKEN.load(Ordering::SeqCst)
}
