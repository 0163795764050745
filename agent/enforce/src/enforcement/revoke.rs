//! Ending what a policy change no longer allows, and letting go of what it allows again: the
//! connections tracked before a change, judged by the pure rules of
//! [`peerwall_backend::revoke`] and ended (or released) through the backend.

use std::time::Instant;

use super::Enforcement;

impl Enforcement {
    /// After a policy change: end the connections the previous policy allowed and this one
    /// refuses ([`crate::revoke`]); established ones would otherwise pass as replies.
    /// Nothing is ended on the first apply (no previous policy to judge by). A failure is
    /// logged and counted; the policy stays applied.
    pub(super) fn end_revoked(&mut self, policy: &peerwall_policy::ir::Policy) {
        // Unchanged (a re-apply after drift, the same objects again): nothing to judge, and
        // no copy of the policy to keep.
        if self
            .enforced
            .as_ref()
            .is_some_and(|b| b.tables == policy.tables)
        {
            return;
        }
        // Connections kept ended that the policy allows again are let go (a closing taken
        // back, a pod offloaded again): their next packet is judged afresh.
        self.release_allowed(policy);
        let Some(before) = self.enforced.replace(policy.clone()) else {
            return;
        };
        // A change that only lets more through (a pod offloaded) ends nothing: the
        // connections are not listed.
        let Some(why) = peerwall_backend::revoke::narrowing(&before, policy) else {
            return;
        };
        let started = Instant::now();
        let result = self.backend.flows().and_then(|flows| {
            let gone = peerwall_backend::revoke::no_longer_allowed(&before, policy, &flows);
            tracing::debug!(
                tracked = flows.len(),
                ending = gone.len(),
                %why,
                "judging tracked connections after a policy change"
            );
            self.backend.end_flows(&gone).map(|n| (flows.len(), n))
        });
        match result {
            Ok((_, 0)) => {}
            Ok((tracked, ended)) => {
                self.update(|m| m.flows_ended += ended as u64);
                tracing::info!(
                    ended,
                    tracked,
                    ms = started.elapsed().as_secs_f64() * 1e3,
                    "connections the policy no longer allows were ended"
                );
            }
            Err(e) => {
                self.update(|m| m.flow_end_errors += 1);
                tracing::warn!(error = %e, "could not end the connections the policy no longer allows; they last until they close or expire");
            }
        }
    }

    /// Let go of the ended connections `policy` allows again ([`peerwall_backend::revoke::allowed_again`]).
    fn release_allowed(&mut self, policy: &peerwall_policy::ir::Policy) {
        let result = self.backend.ended_flows().and_then(|ended| {
            let back = peerwall_backend::revoke::allowed_again(policy, &ended);
            if back.is_empty() {
                return Ok(0);
            }
            self.backend.release_flows(&back)
        });
        match result {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                released = n,
                "ended connections the policy allows again were let go"
            ),
            Err(e) => {
                tracing::warn!(error = %e, "could not let go of ended connections the policy allows again; they stay ended until both sides are quiet")
            }
        }
    }
}
