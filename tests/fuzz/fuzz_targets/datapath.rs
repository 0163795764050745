//! The eBPF datapath against its specification: structured frames (then truncated, flipped,
//! fragmented, with IPv6 extension chains and odd ICMP) through the real tc program under
//! BPF_PROG_TEST_RUN, with seeded random policies in its maps; the verdict must equal the
//! reference evaluator's on the packet `ir::frame::read_frame` says the frame is, and frames
//! it calls not IP or malformed must be passed or dropped unclassified. Needs root (bpf).
#![no_main]

use std::sync::{Mutex, OnceLock};

use libfuzzer_sys::fuzz_target;
use peerwall_fuzz::{policies, FrameInput};
use peerwall_policy::ir::frame::{read_frame, FrameView, ETH_HLEN};
use peerwall_policy::ir::{evaluate, Policy, VerdictAction};
use peerwall_policy::testgen::IFACES;
use peerwall_probe::bpf::{tc_action, BpfProbe};

/// Policies run, each loaded once into its own datapath.
const POLICIES: usize = 4;

struct Loaded {
    policy: Policy,
    probe: BpfProbe,
}

fn loaded() -> &'static Mutex<Vec<Loaded>> {
    static L: OnceLock<Mutex<Vec<Loaded>>> = OnceLock::new();
    L.get_or_init(|| {
        let parent = peerwall_backend_bpf::loader::ensure_bpffs().expect("bpffs (run as root)");
        remove_stale_probes(&parent);
        let ifaces: Vec<String> = IFACES.iter().map(|s| s.to_string()).collect();
        let v = policies(POLICIES)
            .into_iter()
            .map(|policy| Loaded {
                probe: BpfProbe::new(&policy, &ifaces, &parent).expect("loading the datapath"),
                policy,
            })
            .collect();
        Mutex::new(v)
    })
}

/// libFuzzer exits without dropping statics: pins of earlier runs whose process is gone.
fn remove_stale_probes(parent: &std::path::Path) {
    for e in std::fs::read_dir(parent).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix("pwprobe-")
            .and_then(|r| r.split('-').next())
        else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = peerwall_backend_bpf::loader::remove_pins(&e.path());
        }
    }
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
    let l = &mut all[usize::from(input.policy) % n];
    let run = match l.probe.frame_verdict(&frame, iif, oif) {
        Ok(run) => run,
        // Documented refusal: BPF_PROG_TEST_RUN refuses (EINVAL) a frame whose IP header is
        // shorter than its fixed part, so those (malformed: dropped) cannot be checked here.
        Err(_) if ip_header_cut_short(&frame) => return,
        Err(e) => panic!("BPF_PROG_TEST_RUN on {frame:02x?}: {e}"),
    };
    match read_frame(&frame, Some(iif), oif) {
        FrameView::NotIp => {
            assert_eq!(run.verdict, None, "not IP but classified: {frame:02x?}");
            assert_eq!(run.tc_action, tc_action::OK, "not IP but not passed");
        }
        FrameView::Malformed(why) => {
            assert_eq!(
                run.verdict, None,
                "malformed ({why}) but classified: {frame:02x?}"
            );
            assert_eq!(
                run.tc_action,
                tc_action::SHOT,
                "malformed ({why}) but not dropped"
            );
        }
        FrameView::PortlessFragment => {
            assert!(run.verdict.is_some(), "a later fragment was not classified");
        }
        FrameView::Packet(p) => {
            let want = evaluate(&l.policy, &p);
            assert_eq!(
                run.verdict.as_ref(),
                Some(&want),
                "datapath and reference disagree on {p:?} (frame {frame:02x?})"
            );
            let ok = match want.verdict {
                VerdictAction::Accept => run.tc_action == tc_action::OK,
                VerdictAction::Drop => run.tc_action == tc_action::SHOT,
                VerdictAction::Reject => {
                    run.tc_action == tc_action::REDIRECT || run.tc_action == tc_action::SHOT
                }
            };
            assert!(ok, "{:?} but tc action {}", want.verdict, run.tc_action);
        }
    }
});
