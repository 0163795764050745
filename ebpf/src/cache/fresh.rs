//! Which sets of the shared verdict cache may still serve (`VERDICTS_FRESH`, one mark per
//! set, [`peerwall_common::FreshLine`]): [`store`](super::store) moves a set's mark on with
//! every verdict it puts there, and [`serve`](super::serve) skips the shared level's lookup
//! for a packet whose set's mark has passed.

use peerwall_common::{verdict_may_serve, VERDICT_FRESH_LANES};

use crate::maps::VERDICTS_FRESH;

/// Set `set`'s mark, in place.
#[inline(always)]
fn mark_at(set: u32) -> Option<*mut u32> {
    let line = VERDICTS_FRESH.get_ptr_mut(set / VERDICT_FRESH_LANES)?;
    let lane = (set % VERDICT_FRESH_LANES) as usize;
    // SAFETY: `lane` < VERDICT_FRESH_LANES (masked again for the verifier), within the entry
    // of a successful lookup.
    Some(unsafe {
        (&raw mut (*line).until)
            .cast::<u32>()
            .add(lane & (VERDICT_FRESH_LANES as usize - 1))
    })
}

/// Whether the shared level may hold a verdict of set `set` that is served at `now`
/// (jiffies): yes when the mark cannot be read.
#[inline(always)]
pub(super) fn may_serve(set: u32, now: u32) -> bool {
    match mark_at(set) {
        // SAFETY: a lane of an entry of a successful lookup; other CPUs write it whole.
        Some(m) => verdict_may_serve(unsafe { core::ptr::read_volatile(m) }, now),
        None => true,
    }
}

/// A verdict of set `set` was put into the shared level, served until `until` (jiffies): the
/// mark moves on to it unless it is already as late. A racing CPU may write an earlier mark
/// over a later one, which costs the later entry its service (its packets are classified),
/// never a wrong verdict.
#[inline(always)]
pub(super) fn extend(set: u32, until: u32) {
    if let Some(m) = mark_at(set) {
        // SAFETY: as above.
        unsafe {
            let cur = core::ptr::read_volatile(m);
            if verdict_may_serve(until, cur) {
                core::ptr::write_volatile(m, until);
            }
        }
    }
}
