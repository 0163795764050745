//! What the controller last wrote of each of its FirewallConfigurations
//! ([`super::storable`]), so that a pass which builds the same object writes nothing and
//! compares nothing more.

use std::collections::HashMap;

/// What the controller last wrote of each configuration (or found the cache already showing):
/// the object's uid and spec generation then and the SHA-256 of its JSON, by namespace and
/// name. A pass whose object hashes alike, while the cache shows that object at that
/// generation with the labels, writes nothing and builds nothing more (a NetworkPolicy tier's
/// spec is 20,000 set elements: read back into JSON and compared, it costs twice what the tier
/// does). An edit by hand makes a new generation, a deletion and creation a new uid: both are
/// compared again, and overwritten. A cryptographic digest: the spec is built from what
/// namespace users write, and a chosen collision would keep a stale policy in force.
#[derive(Default)]
pub(super) struct Written(HashMap<(String, String), (String, [u8; 32])>);

impl Written {
    /// Whether `key` at `version` (uid and generation) is known, and then whether it holds
    /// `digest`.
    pub(super) fn check(
        &self,
        key: &(String, String),
        version: Option<&str>,
        digest: &[u8; 32],
    ) -> Option<bool> {
        let (v, d) = self.0.get(key)?;
        (Some(v.as_str()) == version).then(|| d == digest)
    }

    pub(super) fn remember(
        &mut self,
        key: (String, String),
        version: Option<String>,
        digest: [u8; 32],
    ) {
        match version {
            Some(v) => {
                self.0.insert(key, (v, digest));
            }
            None => {
                self.0.remove(&key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Written;

    #[test]
    fn a_pass_writes_nothing_only_at_the_object_generation_and_digest_it_wrote() {
        let key = (
            "liqo-tenant-p1".to_string(),
            "peerwall-networkpolicy".to_string(),
        );
        let mut w = Written::default();
        assert_eq!(w.check(&key, Some("u1/3"), &[1; 32]), None, "nothing known");
        w.remember(key.clone(), Some("u1/3".into()), [1; 32]);
        assert_eq!(w.check(&key, Some("u1/3"), &[1; 32]), Some(true));
        assert_eq!(
            w.check(&key, Some("u1/3"), &[2; 32]),
            Some(false),
            "a new spec"
        );
        assert_eq!(
            w.check(&key, Some("u1/4"), &[1; 32]),
            None,
            "edited by someone"
        );
        assert_eq!(
            w.check(&key, Some("u2/3"), &[1; 32]),
            None,
            "deleted and created again"
        );
        assert_eq!(w.check(&key, None, &[1; 32]), None, "gone from the cache");
        w.remember(key.clone(), None, [1; 32]);
        assert_eq!(w.check(&key, Some("u1/3"), &[1; 32]), None, "forgotten");
    }
}
