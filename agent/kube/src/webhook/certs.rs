//! The webhook's certificate, issued by peerwall itself: no manual TLS step after
//! `kubectl apply -k deploy/` (cert-manager is the documented alternative, `deploy/cert-manager`).
//!
//! A CA and a serving certificate signed by it live in one Secret (`peerwall-webhook-tls`:
//! `ca.crt`, `ca.key`, `tls.crt`, `tls.key`, their expiry in annotations). Every webhook replica
//! keeps it current: it creates the Secret when absent, issues a new serving certificate when a
//! third of its validity is left (or its names changed) and a new CA when a third of the CA's is
//! left, writes with the Secret's `resourceVersion` (a replica that loses the race reads the
//! winner's), and keeps the `caBundle` of its ValidatingWebhookConfiguration equal to the CA
//! (the previous CA too, until it expires, so certificates it signed stay trusted while
//! replicas move over). Decisions ([`plan`]) and issuing ([`issue`]) are pure; the Secret and
//! the webhook configuration are the [`Keeper`]'s.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use anyhow::Context;
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::ByteString;
use kube::api::{Api, PostParams};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

/// Annotation holding the CA's expiry (Unix seconds).
pub const CA_NOT_AFTER: &str = "peerwall.io/ca-not-after";
/// Annotation holding the serving certificate's expiry (Unix seconds).
pub const NOT_AFTER: &str = "peerwall.io/not-after";
/// Annotation holding the serving certificate's names, comma-separated.
pub const NAMES: &str = "peerwall.io/names";
/// Annotation holding the previous CA's expiry, while it is still in the bundle.
pub const PREVIOUS_CA_NOT_AFTER: &str = "peerwall.io/previous-ca-not-after";
/// Key of the previous CA in the Secret.
pub const PREVIOUS_CA: &str = "previous-ca.crt";

/// What to issue and where to keep it.
#[derive(Clone, Debug)]
pub struct Issue {
    /// Namespace of the Secret (the webhook's own).
    pub namespace: String,
    /// The Secret.
    pub secret: String,
    /// The ValidatingWebhookConfiguration whose `caBundle` follows the CA.
    pub webhook_configuration: String,
    /// Names of the serving certificate (DNS names, or IP addresses).
    pub names: Vec<String>,
    /// Validity of the CA.
    pub ca_validity: Duration,
    /// Validity of a serving certificate.
    pub validity: Duration,
}

/// The certificates as kept in the Secret.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    /// CA certificate (PEM).
    pub ca: String,
    /// CA key (PEM, PKCS#8).
    pub ca_key: String,
    /// CA expiry, Unix seconds.
    pub ca_not_after: i64,
    /// Serving certificate (PEM).
    pub cert: String,
    /// Its key (PEM, PKCS#8).
    pub key: String,
    /// Its expiry, Unix seconds.
    pub not_after: i64,
    /// Its names.
    pub names: Vec<String>,
    /// The CA before the last CA rotation and its expiry, kept in the bundle until then.
    pub previous_ca: Option<(String, i64)>,
}

impl Stored {
    /// The PEM bundle the API server must trust: the CA, and the previous one until it expires.
    pub fn bundle(&self, now: i64) -> String {
        let mut b = self.ca.clone();
        if let Some((pem, until)) = &self.previous_ca {
            if *until > now {
                b.push_str(pem);
            }
        }
        b
    }
}

/// What the Secret needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Current: nothing to write.
    Keep,
    /// A new serving certificate from the same CA.
    NewCert,
    /// A new CA and a serving certificate from it.
    NewCa,
}

/// Decide at `now` (Unix seconds) what `stored` needs for `want`.
pub fn plan(stored: Option<&Stored>, now: i64, want: &Issue) -> Plan {
    let Some(s) = stored else {
        return Plan::NewCa;
    };
    let third = |d: Duration| (d.as_secs() / 3) as i64;
    if s.ca_not_after - now <= third(want.ca_validity) {
        return Plan::NewCa;
    }
    if s.not_after - now <= third(want.validity) || s.names != want.names {
        return Plan::NewCert;
    }
    Plan::Keep
}

/// Errors of issuing.
#[derive(Debug, thiserror::Error)]
pub enum IssueError {
    /// rcgen refused (a name it cannot encode, a key it cannot read).
    #[error("issuing the webhook certificate: {0}")]
    Rcgen(#[from] rcgen::Error),
    /// A time out of range.
    #[error("certificate validity out of range: {0}")]
    Time(String),
}

fn at(unix: i64) -> Result<time::OffsetDateTime, IssueError> {
    time::OffsetDateTime::from_unix_timestamp(unix).map_err(|e| IssueError::Time(e.to_string()))
}

/// The CA's parameters: the same for every CA this webhook issues, so a CA re-read from the
/// Secret signs with the name its certificate carries.
fn ca_params(not_before: i64, not_after: i64) -> Result<CertificateParams, IssueError> {
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "peerwall");
    dn.push(DnType::CommonName, "peerwall webhook CA");
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    p.not_before = at(not_before)?;
    p.not_after = at(not_after)?;
    Ok(p)
}

/// Issue what `plan` asks for at `now`, from `stored` (its CA, for [`Plan::NewCert`]).
pub fn issue(
    plan: Plan,
    stored: Option<&Stored>,
    now: i64,
    want: &Issue,
) -> Result<Option<Stored>, IssueError> {
    // A little before now: clocks of API server and webhook need not agree to the second.
    let not_before = now - 300;
    let (ca, ca_key, ca_not_after, previous_ca) = match (plan, stored) {
        (Plan::Keep, _) => return Ok(None),
        (Plan::NewCert, Some(s)) => (
            s.ca.clone(),
            s.ca_key.clone(),
            s.ca_not_after,
            s.previous_ca.clone(),
        ),
        (Plan::NewCa | Plan::NewCert, _) => {
            let ca_not_after = now + want.ca_validity.as_secs() as i64;
            let key = KeyPair::generate()?;
            let cert = ca_params(not_before, ca_not_after)?.self_signed(&key)?;
            let previous = stored
                .filter(|s| s.ca_not_after > now)
                .map(|s| (s.ca.clone(), s.ca_not_after));
            (cert.pem(), key.serialize_pem(), ca_not_after, previous)
        }
    };
    let ca_keypair = KeyPair::from_pem(&ca_key)?;
    let issuer = Issuer::new(ca_params(not_before, ca_not_after)?, ca_keypair);
    let not_after = (now + want.validity.as_secs() as i64).min(ca_not_after);
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(
        DnType::CommonName,
        want.names.first().cloned().unwrap_or_default(),
    );
    p.distinguished_name = dn;
    p.subject_alt_names = want
        .names
        .iter()
        .map(|n| match n.parse::<IpAddr>() {
            Ok(ip) => Ok(SanType::IpAddress(ip)),
            Err(_) => Ok(SanType::DnsName(n.clone().try_into()?)),
        })
        .collect::<Result<_, rcgen::Error>>()?;
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    p.use_authority_key_identifier_extension = true;
    p.not_before = at(not_before)?;
    p.not_after = at(not_after)?;
    let key = KeyPair::generate()?;
    let cert = p.signed_by(&key, &issuer)?;
    Ok(Some(Stored {
        ca,
        ca_key,
        ca_not_after,
        cert: cert.pem(),
        key: key.serialize_pem(),
        not_after,
        names: want.names.clone(),
        previous_ca,
    }))
}

/// Read the certificates from a Secret; None when they are absent or unreadable (then they
/// are issued anew).
pub fn from_secret(s: &Secret) -> Option<Stored> {
    let data = s.data.as_ref()?;
    let text = |k: &str| {
        data.get(k)
            .and_then(|b| String::from_utf8(b.0.clone()).ok())
            .filter(|t| !t.is_empty())
    };
    let notes = s.metadata.annotations.as_ref()?;
    let num = |k: &str| notes.get(k).and_then(|v| v.parse::<i64>().ok());
    Some(Stored {
        ca: text("ca.crt")?,
        ca_key: text("ca.key")?,
        ca_not_after: num(CA_NOT_AFTER)?,
        cert: text("tls.crt")?,
        key: text("tls.key")?,
        not_after: num(NOT_AFTER)?,
        names: notes
            .get(NAMES)?
            .split(',')
            .filter(|n| !n.is_empty())
            .map(str::to_string)
            .collect(),
        previous_ca: text(PREVIOUS_CA).zip(num(PREVIOUS_CA_NOT_AFTER)),
    })
}

/// `stored` as the Secret's data and annotations (over `base`, which keeps its metadata).
pub fn to_secret(base: Secret, stored: &Stored) -> Secret {
    let mut s = base;
    s.type_ = Some("kubernetes.io/tls".into());
    let mut data = BTreeMap::new();
    let mut put = |k: &str, v: &str| {
        data.insert(k.to_string(), ByteString(v.as_bytes().to_vec()));
    };
    put("ca.crt", &stored.ca);
    put("ca.key", &stored.ca_key);
    put("tls.crt", &stored.cert);
    put("tls.key", &stored.key);
    if let Some((pem, _)) = &stored.previous_ca {
        put(PREVIOUS_CA, pem);
    }
    s.data = Some(data);
    let notes = s.metadata.annotations.get_or_insert_with(BTreeMap::new);
    notes.insert(CA_NOT_AFTER.into(), stored.ca_not_after.to_string());
    notes.insert(NOT_AFTER.into(), stored.not_after.to_string());
    notes.insert(NAMES.into(), stored.names.join(","));
    match &stored.previous_ca {
        Some((_, until)) => {
            notes.insert(PREVIOUS_CA_NOT_AFTER.into(), until.to_string());
        }
        None => {
            notes.remove(PREVIOUS_CA_NOT_AFTER);
        }
    }
    s
}

/// Now, in Unix seconds.
pub fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// Keeps the Secret and the `caBundle` current through the API.
pub struct Keeper {
    /// What to issue.
    pub want: Issue,
    secrets: Api<Secret>,
    configs: Api<ValidatingWebhookConfiguration>,
}

impl Keeper {
    /// A keeper of `want` through `client`.
    pub fn new(client: kube::Client, want: Issue) -> Self {
        Keeper {
            secrets: Api::namespaced(client.clone(), &want.namespace),
            configs: Api::all(client),
            want,
        }
    }

    /// The certificates in force after making the Secret current (several replicas may race:
    /// the loser of a write reads the winner's Secret and uses it).
    pub async fn ensure(&self) -> anyhow::Result<Stored> {
        let name = &self.want.secret;
        for _ in 0..5 {
            let existing = self
                .secrets
                .get_opt(name)
                .await
                .with_context(|| format!("reading Secret {}/{name}", self.want.namespace))?;
            let stored = existing.as_ref().and_then(from_secret);
            let now = now();
            let plan = plan(stored.as_ref(), now, &self.want);
            let Some(next) = issue(plan, stored.as_ref(), now, &self.want)? else {
                if let Some(s) = stored {
                    return Ok(s);
                }
                continue;
            };
            let written = match existing {
                None => {
                    let mut base = Secret::default();
                    base.metadata.name = Some(name.clone());
                    base.metadata.namespace = Some(self.want.namespace.clone());
                    base.metadata.labels = Some(BTreeMap::from([(
                        "app.kubernetes.io/part-of".to_string(),
                        "peerwall".to_string(),
                    )]));
                    self.secrets
                        .create(&PostParams::default(), &to_secret(base, &next))
                        .await
                }
                // Replaced at the resourceVersion read: a concurrent writer makes this fail.
                Some(base) => {
                    self.secrets
                        .replace(name, &PostParams::default(), &to_secret(base, &next))
                        .await
                }
            };
            match written {
                Ok(_) => {
                    tracing::info!(secret = %name, plan = ?plan, not_after = next.not_after, ca_not_after = next.ca_not_after, "webhook certificate issued");
                    return Ok(next);
                }
                Err(kube::Error::Api(e)) if e.code == 409 => {
                    tracing::info!(secret = %name, "another replica wrote the certificate first; reading it");
                }
                Err(e) => {
                    return Err(e)
                        .with_context(|| format!("writing Secret {}/{name}", self.want.namespace))
                }
            }
        }
        anyhow::bail!("Secret {name}: five writes lost to other writers in a row")
    }

    /// Make every webhook of the configuration trust `bundle` (PEM); true when it changed.
    pub async fn publish_bundle(&self, bundle: &str) -> anyhow::Result<bool> {
        let name = &self.want.webhook_configuration;
        let Some(cfg) = self
            .configs
            .get_opt(name)
            .await
            .with_context(|| format!("reading ValidatingWebhookConfiguration {name}"))?
        else {
            tracing::warn!(configuration = %name, "no ValidatingWebhookConfiguration to give the CA to (yet)");
            return Ok(false);
        };
        let want = ByteString(bundle.as_bytes().to_vec());
        let mut next = cfg.clone();
        let mut changed = false;
        for w in next.webhooks.iter_mut().flatten() {
            if w.client_config.ca_bundle.as_ref() != Some(&want) {
                w.client_config.ca_bundle = Some(want.clone());
                changed = true;
            }
        }
        if !changed {
            return Ok(false);
        }
        // Replaced at the resourceVersion read: an edit in between makes this fail, and the
        // next period tries again on the edited object.
        self.configs
            .replace(name, &PostParams::default(), &next)
            .await
            .with_context(|| format!("writing the caBundle of {name}"))?;
        tracing::info!(configuration = %name, "caBundle updated");
        Ok(true)
    }

    /// How often replicas look at the Secret: often enough to act well within a third of the
    /// serving certificate's validity.
    pub fn period(&self) -> Duration {
        (self.want.validity / 12).clamp(Duration::from_secs(1), Duration::from_secs(600))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn want(validity: u64) -> Issue {
        Issue {
            namespace: "peerwall-system".into(),
            secret: "peerwall-webhook-tls".into(),
            webhook_configuration: "peerwall".into(),
            names: vec![
                "peerwall-webhook.peerwall-system.svc".into(),
                "127.0.0.1".into(),
            ],
            ca_validity: Duration::from_secs(validity * 10),
            validity: Duration::from_secs(validity),
        }
    }

    #[test]
    fn nothing_stored_issues_a_ca_and_a_certificate_that_chain() {
        use tokio_rustls::rustls::client::danger::ServerCertVerifier;
        let w = want(3600);
        let s = issue(plan(None, 1_000_000, &w), None, 1_000_000, &w)
            .unwrap()
            .unwrap();
        assert_eq!(s.not_after, 1_000_000 + 3600);
        assert_eq!(s.ca_not_after, 1_000_000 + 36000);
        assert!(s.cert.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(s.key.contains("PRIVATE KEY"));
        // The serving certificate verifies against the CA, for its DNS name and its address.
        let roots = {
            let mut r = tokio_rustls::rustls::RootCertStore::empty();
            for c in rustls_pem(&s.ca) {
                r.add(c).unwrap();
            }
            r
        };
        let provider = std::sync::Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
        let verifier = tokio_rustls::rustls::client::WebPkiServerVerifier::builder_with_provider(
            std::sync::Arc::new(roots),
            provider,
        )
        .build()
        .unwrap();
        let leaf = rustls_pem(&s.cert).remove(0);
        let when = tokio_rustls::rustls::pki_types::UnixTime::since_unix_epoch(
            Duration::from_secs(1_000_100),
        );
        for name in ["peerwall-webhook.peerwall-system.svc", "127.0.0.1"] {
            let n = tokio_rustls::rustls::pki_types::ServerName::try_from(name).unwrap();
            verifier
                .verify_server_cert(&leaf, &[], &n, &[], when)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        let other = tokio_rustls::rustls::pki_types::ServerName::try_from("evil.example").unwrap();
        assert!(verifier
            .verify_server_cert(&leaf, &[], &other, &[], when)
            .is_err());
    }

    fn rustls_pem(pem: &str) -> Vec<tokio_rustls::rustls::pki_types::CertificateDer<'static>> {
        use tokio_rustls::rustls::pki_types::pem::PemObject;
        tokio_rustls::rustls::pki_types::CertificateDer::pem_slice_iter(pem.as_bytes())
            .collect::<Result<_, _>>()
            .unwrap()
    }

    #[test]
    fn certificates_rotate_at_a_third_of_their_validity_and_the_ca_keeps_signing() {
        let w = want(3000);
        let t0 = 1_000_000;
        let s = issue(Plan::NewCa, None, t0, &w).unwrap().unwrap();
        assert_eq!(plan(Some(&s), t0 + 1000, &w), Plan::Keep);
        assert_eq!(plan(Some(&s), t0 + 2000, &w), Plan::NewCert);
        let s2 = issue(Plan::NewCert, Some(&s), t0 + 2000, &w)
            .unwrap()
            .unwrap();
        assert_eq!(s2.ca, s.ca, "same CA");
        assert_ne!(s2.cert, s.cert, "new certificate");
        assert_eq!(s2.bundle(t0 + 2000), s.ca);
        // Renamed: a new certificate at once.
        let mut w2 = w.clone();
        w2.names.push("peerwall-webhook".into());
        assert_eq!(plan(Some(&s2), t0 + 2001, &w2), Plan::NewCert);
        // The CA near its end: a new one, the old one still trusted until it expires.
        let late = s.ca_not_after - 9000;
        assert_eq!(plan(Some(&s2), late, &w), Plan::NewCa);
        let s3 = issue(Plan::NewCa, Some(&s2), late, &w).unwrap().unwrap();
        assert_ne!(s3.ca, s2.ca);
        assert_eq!(s3.bundle(late), format!("{}{}", s3.ca, s2.ca));
        assert_eq!(s3.bundle(s.ca_not_after + 1), s3.ca);
    }

    #[test]
    fn the_secret_round_trips_and_partial_secrets_are_issued_anew() {
        let w = want(3600);
        let s = issue(Plan::NewCa, None, 1_000_000, &w).unwrap().unwrap();
        let secret = to_secret(Secret::default(), &s);
        assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
        assert_eq!(from_secret(&secret), Some(s));
        let mut partial = secret.clone();
        partial.data.as_mut().unwrap().remove("ca.key");
        assert_eq!(from_secret(&partial), None);
        assert_eq!(
            plan(from_secret(&partial).as_ref(), 1_000_000, &w),
            Plan::NewCa
        );
    }
}
