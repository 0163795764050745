//! Attaching the datapath: the tc (tcx) entry a device needs (Ethernet or L3), XDP on
//! Ethernet devices, links pinned so that enforcement outlives this process.

use aya::programs::links::LinkOrder;
use aya::programs::tc::{TcAttachOptions, TcAttachType};
use aya::programs::{SchedClassifier, Xdp, XdpMode};

use super::host::HostIface;
use super::linkinfo::link_state;
use super::pins::{attached_in, link_pin_name, pin_link};
use super::{BpfError, Datapath, TC_ANY_PROGRAM, TC_L3_PROGRAM, TC_PROGRAM, XDP_PROGRAM};

impl Datapath {
    /// The tc entry for an interface: the one for every device type where the kernel offers
    /// it, else by the device's link-layer header length.
    fn tc_entry(&self, iface: &HostIface) -> &'static str {
        if self.tc_any {
            TC_ANY_PROGRAM
        } else if iface.l2_len == 0 {
            TC_L3_PROGRAM
        } else {
            TC_PROGRAM
        }
    }
}

impl Datapath {
    /// A program of the object, loaded (verified) on first use.
    pub(super) fn loaded<'a, P>(&'a mut self, name: &str) -> Result<&'a mut P, BpfError>
    where
        &'a mut P: TryFrom<&'a mut aya::programs::Program, Error = aya::programs::ProgramError>,
        P: ProgramLoad,
    {
        let prog: &mut P = self
            .ebpf
            .program_mut(name)
            .ok_or_else(|| BpfError::MissingProgram(name.into()))?
            .try_into()
            .map_err(|source| BpfError::Program {
                what: format!("{name} program type"),
                source,
            })?;
        let started = std::time::Instant::now();
        // A verification is a load's work too: no spare is made meanwhile (`spare.rs`).
        let _loading = super::spare::Loading::start();
        let verified = prog.ensure_loaded().map_err(|source| BpfError::Program {
            what: format!("loading {name} (verifier)"),
            source,
        })?;
        if let Some(insns) = verified {
            // Once per program and datapath: what a gateway's start waits for.
            tracing::debug!(
                program = name,
                ms = started.elapsed().as_secs_f64() * 1e3,
                verified_insns = insns,
                "program loaded (verified)"
            );
        }
        Ok(prog)
    }
    /// Load (verify) every program `ifaces` need, before any is attached: attachments then
    /// follow each other within microseconds, so no flow starts through an interface still
    /// unfiltered and meets a filtering one on its way back without conntrack having seen it.
    /// An interface whose link is already pinned keeps it ([`attach`](Self::attach) adopts
    /// it) and needs nothing loaded: a restarted agent whose links are all in place verifies
    /// no program (about a second saved).
    pub fn prepare(&mut self, ifaces: &[&HostIface], xdp: bool) -> Result<(), BpfError> {
        let links = self.pin_dir.join("links");
        for iface in ifaces {
            let live = self.tc_link_live(iface);
            if !live {
                let _: &mut SchedClassifier = self.loaded(self.tc_entry(iface))?;
            }
            let xdp_pinned = live && links.join(link_pin_name("xdp", &iface.name)).exists();
            if xdp && iface.l2_len == 14 && !xdp_pinned {
                let _: &mut Xdp = self.loaded(XDP_PROGRAM)?;
            }
        }
        Ok(())
    }
    /// Load (verify) before any policy is known what the next apply will attach: for the
    /// interfaces `targets` that exist, what [`prepare`](Self::prepare) loads (nothing where
    /// their pinned links still run: a restarted agent); with none yet, the tc entries a
    /// later interface needs ([`preload_tc`](Self::preload_tc)) and, with `xdp`, XDP.
    pub fn warm_up(&mut self, targets: &[&HostIface], xdp: bool) -> Result<(), BpfError> {
        if !targets.is_empty() {
            return self.prepare(targets, xdp);
        }
        self.preload_tc()?;
        if xdp {
            let _: &mut Xdp = self.loaded(XDP_PROGRAM)?;
        }
        Ok(())
    }

    /// Load (verify) the tc entries interfaces not there yet need: the one for every device
    /// type, or both, Ethernet and L3, where the kernel does not offer it.
    pub fn preload_tc(&mut self) -> Result<(), BpfError> {
        if self.tc_any {
            let _: &mut SchedClassifier = self.loaded(TC_ANY_PROGRAM)?;
            return Ok(());
        }
        let _: &mut SchedClassifier = self.loaded(TC_PROGRAM)?;
        let _: &mut SchedClassifier = self.loaded(TC_L3_PROGRAM)?;
        Ok(())
    }

    /// Whether the tc link pinned for `iface` runs on it: the link filters the device with
    /// this ifindex and the device's tcx ingress runs the link's program, in this network
    /// namespace. A pin alone proves nothing: an interface deleted and created again under
    /// its name (a restarted tunnel, a replaced pod sandbox whose pins are adopted) leaves a
    /// pin whose link the kernel detached, or that filters the old namespace's device.
    fn tc_link_live(&self, iface: &HostIface) -> bool {
        let pin = self
            .pin_dir
            .join("links")
            .join(link_pin_name("tc", &iface.name));
        let Ok(state) = link_state(&pin) else {
            return false;
        };
        state.ifindex == Some(iface.ifindex)
            && SchedClassifier::query_tcx(&iface.name, TcAttachType::Ingress)
                .is_ok_and(|(_, progs)| progs.iter().any(|p| p.id() == state.prog_id))
    }

    /// Attach the tc program (tcx ingress) to an interface, and XDP when asked; pin the links.
    /// An interface whose pinned link runs on it keeps it (adoption without a gap); pins left
    /// by an earlier device of that name are replaced.
    pub fn attach(&mut self, iface: &HostIface, xdp: bool) -> Result<(), BpfError> {
        self.register_ifaces(std::slice::from_ref(iface))?;
        let links = self.pin_dir.join("links");
        let tc_pin = links.join(link_pin_name("tc", &iface.name));
        if tc_pin.exists() && !self.tc_link_live(iface) {
            // The device this name had is gone (or lives in another namespace): its links
            // go with their pins, the new device gets its own.
            let xdp_pin = links.join(link_pin_name("xdp", &iface.name));
            for pin in [&tc_pin, &xdp_pin] {
                match std::fs::remove_file(pin) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                        return Err(BpfError::Io {
                            path: pin.to_path_buf(),
                            source: e,
                        })
                    }
                    _ => {}
                }
            }
            tracing::warn!(interface = %iface.name, ifindex = iface.ifindex, "interface created again under its name: the pinned link filtered the earlier device; attaching to this one");
        }
        if !tc_pin.exists() {
            let prog: &mut SchedClassifier = self.loaded(self.tc_entry(iface))?;
            let attach_err = |what: String| move |source| BpfError::Program { what, source };
            let id = prog
                .attach_with_options(
                    &iface.name,
                    TcAttachType::Ingress,
                    TcAttachOptions::TcxOrder(LinkOrder::default()),
                )
                .map_err(attach_err(format!(
                    "attaching tcx ingress on {}",
                    iface.name
                )))?;
            let link = prog
                .take_link(id)
                .map_err(attach_err("taking the tc link".into()))?;
            pin_link(link.try_into(), &tc_pin)?;
            tracing::debug!(interface = %iface.name, pin = %tc_pin.display(), "tcx ingress attached");
        } else {
            tracing::debug!(interface = %iface.name, pin = %tc_pin.display(), "tcx ingress already attached (pinned link adopted)");
        }
        let xdp_pin = links.join(link_pin_name("xdp", &iface.name));
        if xdp && iface.l2_len == 14 && !xdp_pin.exists() {
            let prog: &mut Xdp = self.loaded(XDP_PROGRAM)?;
            // Native where the driver has it, generic (skb) otherwise.
            let id = match prog.attach(&iface.name, XdpMode::Driver) {
                Ok(id) => id,
                Err(native) => {
                    // Generic XDP runs once the kernel has built the packet's skb, where tc
                    // runs too: it drops nothing earlier and adds its own cost (see
                    // docs/bench.md, the XDP rows).
                    tracing::warn!(
                        interface = %iface.name,
                        error = %native,
                        "--xdp: no native XDP on this device, attaching generic (skb) XDP, \
                         which drops no earlier than tc and costs more per packet; \
                         leave --xdp off here unless the device gains native XDP"
                    );
                    prog.attach(&iface.name, XdpMode::Skb)
                        .map_err(|source| BpfError::Program {
                            what: format!("attaching XDP on {}", iface.name),
                            source,
                        })?
                }
            };
            let link = prog.take_link(id).map_err(|source| BpfError::Program {
                what: "taking the xdp link".into(),
                source,
            })?;
            pin_link(link.try_into(), &xdp_pin)?;
        }
        Ok(())
    }
    /// Attached programs as `kind:interface` (from the pinned links).
    pub fn attached(&self) -> Vec<String> {
        attached_in(&self.pin_dir)
    }
}

/// Programs that can be loaded on demand.
pub trait ProgramLoad {
    /// Load (verify) unless already loaded: Some(the instructions the verifier processed, 0
    /// where the kernel does not say) when this call loaded it, None when it was loaded.
    fn ensure_loaded(&mut self) -> Result<Option<u32>, aya::programs::ProgramError>;
}

/// How often a verification interrupted by a signal is started again. The verifier gives up
/// with EAGAIN when a signal is pending for the loading thread (`do_check` in the kernel's
/// `verifier.c`), e.g. SIGCHLD of a child process where a handler is installed; libbpf retries
/// a load on EAGAIN too (`sys_bpf_prog_load`).
const INTERRUPTED_LOADS: usize = 20;

/// `load` again while it fails with EAGAIN.
fn load_retrying(
    mut load: impl FnMut() -> Result<(), aya::programs::ProgramError>,
) -> Result<(), aya::programs::ProgramError> {
    let mut tries = 0;
    loop {
        match load() {
            Err(aya::programs::ProgramError::LoadError { io_error, .. })
                if io_error.kind() == std::io::ErrorKind::WouldBlock
                    && tries < INTERRUPTED_LOADS =>
            {
                tries += 1;
                tracing::debug!(tries, "program verification interrupted by a signal: again");
            }
            r => return r,
        }
    }
}

/// [`ProgramLoad`] for program types whose `load` takes no arguments (aya gives them no
/// common trait for `fd`, `load` and `info`).
macro_rules! program_load {
    ($($ty:ty),*) => {$(
        impl ProgramLoad for $ty {
            fn ensure_loaded(&mut self) -> Result<Option<u32>, aya::programs::ProgramError> {
                if self.fd().is_ok() {
                    return Ok(None);
                }
                load_retrying(|| self.load())?;
                let info = self.info().ok();
                Ok(Some(info.and_then(|i| i.verified_instruction_count()).unwrap_or(0)))
            }
        }
    )*};
}

program_load!(SchedClassifier, Xdp);

#[cfg(test)]
mod tests {
    use super::*;

    fn eagain() -> aya::programs::ProgramError {
        aya::programs::ProgramError::LoadError {
            io_error: std::io::Error::from_raw_os_error(11),
            verifier_log: aya_obj::VerifierLog::new(String::new()),
        }
    }

    #[test]
    fn an_interrupted_verification_is_started_again_a_bounded_number_of_times() {
        let mut calls = 0;
        let r = load_retrying(|| {
            calls += 1;
            if calls < 3 {
                Err(eagain())
            } else {
                Ok(())
            }
        });
        assert!(r.is_ok());
        assert_eq!(calls, 3);
        let mut calls = 0;
        let r = load_retrying(|| {
            calls += 1;
            Err(eagain())
        });
        assert!(r.is_err());
        assert_eq!(calls, INTERRUPTED_LOADS + 1);
        // Any other error is final at once.
        let mut calls = 0;
        let r = load_retrying(|| {
            calls += 1;
            Err(aya::programs::ProgramError::AlreadyLoaded)
        });
        assert!(r.is_err());
        assert_eq!(calls, 1);
    }
}
