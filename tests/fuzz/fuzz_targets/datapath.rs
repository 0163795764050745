//! The eBPF datapath against its specification: structured frames (then truncated, flipped,
//! fragmented, with IPv6 extension chains and odd ICMP) through the real tc program under
//! BPF_PROG_TEST_RUN, with seeded random policies in its maps; the verdict must equal the
//! reference evaluator's on the packet `ir::frame::read_frame` says the frame is, and frames
//! it calls not IP or malformed must be passed or dropped unclassified. Each frame runs twice:
//! as a flow's first packet (no state), and with the verdict cache on right after its
//! undamaged form went through (the known-flow path, which reads headers by hand before the
//! flow lookup). Every policy is loaded twice: with the datapath's own connection tables and
//! reading the kernel's (`--bpf-conntrack kernel`, in a scratch namespace whose table is empty,
//! so every frame's TCP or UDP tuple goes to the kernel's lookup). Needs root (bpf).
#![no_main]

use std::sync::{Mutex, OnceLock};

use libfuzzer_sys::fuzz_target;
use peerwall_fuzz::{policies, FrameInput};
use peerwall_policy::ir::frame::{read_frame, FrameView, ETH_HLEN};
use peerwall_policy::ir::{evaluate, Policy, VerdictAction};
use peerwall_policy::testgen::IFACES;
use peerwall_probe::bpf::{tc_action, BpfProbe, FrameRun};

/// Policies run, each loaded into two datapaths (own connection tables, the kernel's).
const POLICIES: usize = 4;

struct Loaded {
    policy: Policy,
    probe: BpfProbe,
}

fn loaded() -> &'static Mutex<Vec<Loaded>> {
    static L: OnceLock<Mutex<Vec<Loaded>>> = OnceLock::new();
    L.get_or_init(|| {
        // Pins of earlier runs whose process is gone are swept by `BpfProbe::new`.
        let parent = peerwall_backend_bpf::loader::ensure_bpffs().expect("bpffs (run as root)");
        let ifaces: Vec<String> = IFACES.iter().map(|s| s.to_string()).collect();
        let v = policies(POLICIES)
            .into_iter()
            .flat_map(|policy| {
                let own = BpfProbe::new(&policy, &ifaces, &parent).expect("loading the datapath");
                let kernel = BpfProbe::with_kernel_conntrack(&policy, &ifaces, &parent)
                    .expect("loading the datapath reading the kernel's connection table");
                [
                    Loaded {
                        probe: own,
                        policy: policy.clone(),
                    },
                    Loaded {
                        probe: kernel,
                        policy,
                    },
                ]
            })
            .collect();
        Mutex::new(v)
    })
}

/// An IPv4 or IPv6 frame too short for the fixed IP header.
fn ip_header_cut_short(frame: &[u8]) -> bool {
    let fixed = match frame.get(12..14) {
        Some([0x08, 0x00]) => 20,
        Some([0x86, 0xdd]) => 40,
        _ => return frame.len() <= ETH_HLEN,
    };
    frame.len() < ETH_HLEN + fixed
}

/// What the datapath did with `frame` (`run`) against what it should have: the reference
/// evaluator on the packet `read_frame` says the frame is. `cached`: the run followed the
/// flow's first packet with the verdict cache on, so a verdict served from the cache has no
/// record (`run.verdict` is `None`) and only its tc action is held to the reference.
fn check(
    policy: &Policy,
    frame: &[u8],
    iif: &str,
    oif: Option<&str>,
    run: &FrameRun,
    cached: bool,
) {
    let path = if cached { "known flow" } else { "first packet" };
    match read_frame(frame, Some(iif), oif) {
        FrameView::NotIp => {
            assert_eq!(
                run.verdict, None,
                "{path}: not IP but classified: {frame:02x?}"
            );
            assert_eq!(
                run.tc_action,
                tc_action::OK,
                "{path}: not IP but not passed"
            );
        }
        FrameView::Malformed(why) => {
            assert_eq!(
                run.verdict, None,
                "{path}: malformed ({why}) but classified: {frame:02x?}"
            );
            assert_eq!(
                run.tc_action,
                tc_action::SHOT,
                "{path}: malformed ({why}) but not dropped: {frame:02x?}"
            );
        }
        FrameView::PortlessFragment => {
            assert!(
                cached || run.verdict.is_some(),
                "a later fragment was not classified"
            );
        }
        FrameView::Packet(p) => {
            let want = evaluate(policy, &p);
            if run.verdict.is_some() || !cached {
                assert_eq!(
                    run.verdict.as_ref(),
                    Some(&want),
                    "{path}: datapath and reference disagree on {p:?} (frame {frame:02x?})"
                );
            }
            let ok = match want.verdict {
                VerdictAction::Accept => run.tc_action == tc_action::OK,
                VerdictAction::Drop => run.tc_action == tc_action::SHOT,
                VerdictAction::Reject => {
                    run.tc_action == tc_action::REDIRECT || run.tc_action == tc_action::SHOT
                }
            };
            assert!(
                ok,
                "{path}: {:?} but tc action {} on {p:?} (frame {frame:02x?})",
                want.verdict, run.tc_action
            );
        }
    }
}

fuzz_target!(
    init: {
        // Loading and verifying the datapaths takes seconds: not part of any input's time.
        let _ = loaded();
    },
    |input: FrameInput| {
    let frame = input.frame();
    let (iif, oif) = input.ifaces();
    let mut all = loaded().lock().expect("lock");
    let n = all.len();
    // Each input on a policy's two datapaths in turn, by its low bit.
    let l = &mut all[usize::from(input.policy) % n];
    // Documented refusal: BPF_PROG_TEST_RUN refuses (EINVAL) a frame whose IP header is
    // shorter than its fixed part, so those (malformed: dropped) cannot be checked here.
    match l.probe.frame_verdict(&frame, iif, oif) {
        Ok(run) => check(&l.policy, &frame, iif, oif, &run, false),
        Err(_) if ip_header_cut_short(&frame) => return,
        Err(e) => panic!("BPF_PROG_TEST_RUN on {frame:02x?}: {e}"),
    }
    // The known-flow path: the frame undamaged first (classified, its verdict cached), then
    // the damaged one, which the cache must serve only when it is the same flow's packet.
    let first = input.undamaged();
    match l.probe.frame_verdict_after(&first, &frame, iif, oif) {
        Ok((_, run)) => check(&l.policy, &frame, iif, oif, &run, true),
        Err(_) if ip_header_cut_short(&first) => {}
        Err(e) => panic!("BPF_PROG_TEST_RUN on {first:02x?} then {frame:02x?}: {e}"),
    }
});
