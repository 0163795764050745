//! Verdict cache: the next packets of a flow reuse the verdict its classification gave,
//! instead of routing, conntrack and every chain again. Two levels for IPv4 TCP and UDP, the
//! bulk of a gateway's traffic, which [`known_flow_v4`] serves by reading the few header bytes
//! the key needs straight from the packet, before the full parse:
//!
//! - `VERDICTS4_CPU`: per CPU, two-way set-associative, filled from the second level; a hit
//!   is one inlined array access and a compare.
//! - `VERDICTS4` and `VERDICTS6` (LRU hashes shared by all CPUs, keyed by the packet's own
//!   direction): every cacheable verdict is written there by [`remember`].
//!
//! A cached verdict is served only under the policy epoch it was computed in (`CONFIG.active`:
//! any policy change, a slot switch or an in-place update, gives a new epoch), for the same
//! input interface, under its set's generation (`VERDICT_GENS`: conntrack bumps it when a
//! commit changes the flow's state, [`forget`]; the generation is read before the verdict's
//! conntrack state, so a commit racing with the classification on another CPU also makes it
//! stale), and for at most a second (`ttl.rs`): after that the packet is classified in full
//! again, which also refreshes conntrack and re-reads the route. Only accept and drop are
//! cached, and only for packets whose conntrack state is new or established and cannot be
//! otherwise: TCP with valid flags, UDP, ICMP echo (its type in the key), never fragments or
//! ICMP errors.
//!
//! One concern per file: [`key`] (what is cached and under which key), [`serve`] (the two
//! lookups), [`store`] (writing verdicts), [`invalidate`] (making them stale), [`fresh`]
//! (which sets of the shared level may still serve: a packet of a set none can skips it),
//! [`pair`] (drops that hold for every port of a pair of addresses, served to a flood of new
//! flows between them).

mod fresh;
mod invalidate;
mod key;
mod pair;
mod serve;
mod store;

pub(crate) use invalidate::{forget, outdate};
pub(crate) use pair::remember_pair;
pub(crate) use serve::{cache_on, cached_verdict, direct_cache, known_flow_v4, MISS};
pub(crate) use store::{mark_stored, remember};
