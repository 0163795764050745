//! `peerwall webhook`: a validating admission webhook for FirewallConfiguration.
//!
//! It runs exactly the agent's validation ([`super::check`]), so an object the webhook admits
//! is one every agent can enforce, and a refused object is refused with the same field-path
//! message the agent would write into its status. Served over TLS (rustls) on `POST /validate`;
//! `GET /healthz` answers `ok`.
//!
//! Only peerwall's objects (`peerwall.io`) are judged: the webhook configuration in `deploy/`
//! covers that group alone, and an object of any other group that reaches it anyway (Liqo's
//! `networking.liqo.io`, a misconfigured webhook rule) is admitted unchanged. peerwall never
//! stands between Liqo and its own objects.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use kube::api::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Largest admission review accepted (the API server's own request limit is 3 MiB).
const MAX_BODY: usize = 4 << 20;

/// Where and how the webhook listens.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// PEM certificate chain.
    pub cert: PathBuf,
    /// PEM private key.
    pub key: PathBuf,
}

/// Answer one AdmissionReview (JSON in, JSON out). Pure: the HTTP edge only moves bytes.
pub fn review(body: &[u8]) -> serde_json::Value {
    let parsed: Result<AdmissionReview<DynamicObject>, _> = serde_json::from_slice(body);
    let req: AdmissionRequest<DynamicObject> = match parsed.map(|r| r.try_into()) {
        Ok(Ok(req)) => req,
        Ok(Err(e)) => return to_json(AdmissionResponse::invalid(e)),
        Err(e) => {
            return to_json(AdmissionResponse::invalid(format!(
                "not an AdmissionReview: {e}"
            )))
        }
    };
    let resp = AdmissionResponse::from(&req);
    if req.kind.group != peerwall_intent::load::GROUP {
        tracing::debug!(group = %req.kind.group, name = %req.name, "not peerwall's: admitted");
        return to_json(resp);
    }
    let resp = match (&req.operation, &req.object) {
        (Operation::Create | Operation::Update, Some(obj))
            if req.kind.kind == peerwall_intent::load::PROTECTION_POLICY_KIND =>
        {
            match check_protection_policy(obj) {
                Ok(()) => resp,
                Err(e) => {
                    tracing::info!(object = %obj.metadata.name.as_deref().unwrap_or_default(), reason = %e, "refused");
                    resp.deny(e)
                }
            }
        }
        (Operation::Create | Operation::Update, Some(obj))
            if req.kind.kind == peerwall_intent::load::ADDRESS_SET_KIND =>
        {
            match super::check_slice(obj) {
                Ok(_) => resp,
                Err(e) => {
                    tracing::info!(object = %super::key_of(obj), reason = %e, "refused");
                    resp.deny(e.to_string())
                }
            }
        }
        (Operation::Create | Operation::Update, Some(obj)) => match super::check(obj) {
            Ok((_, warnings)) => {
                let mut r = resp;
                if !warnings.is_empty() {
                    r.warnings = Some(warnings);
                }
                r
            }
            Err(e) => {
                tracing::info!(object = %super::key_of(obj), reason = %e, "refused");
                resp.deny(e.to_string())
            }
        },
        _ => resp,
    };
    to_json(resp)
}

/// A ProtectionPolicy as the controller reads it: its spec decoded (unknown or mistyped
/// fields named by path) and checked ([`crate::protection::exceptions::check`]). Names are
/// at most 63 characters: they name gateway rules.
fn check_protection_policy(obj: &DynamicObject) -> Result<(), String> {
    let name = obj.metadata.name.clone().unwrap_or_default();
    let which = format!("ProtectionPolicy {name}");
    if name.len() > 63 {
        return Err(format!(
            "{which}: metadata.name: {} characters: at most 63 (the name becomes gateway rule and set names)",
            name.len()
        ));
    }
    let spec = obj
        .data
        .get("spec")
        .cloned()
        .unwrap_or(serde_json::Value::Object(Default::default()));
    let spec: peerwall_intent::ProtectionPolicySpec = serde_path_to_error::deserialize(spec)
        .map_err(|e| format!("{which}: spec.{}: {}", e.path(), e.inner()))?;
    crate::protection::exceptions::check(&name, &spec)
        .map(|_| ())
        .map_err(|e| format!("{which}: {e}"))
}

fn to_json(resp: AdmissionResponse) -> serde_json::Value {
    serde_json::to_value(resp.into_review()).unwrap_or_default()
}

async fn handle(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, hyper::Error> {
    let reply = |code: StatusCode, body: Vec<u8>, json: bool| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = code;
        if json {
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("application/json"),
            );
        }
        r
    };
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/healthz") => Ok(reply(StatusCode::OK, b"ok\n".to_vec(), false)),
        (&Method::POST, "/validate") => {
            let body = req.into_body().collect().await?.to_bytes();
            if body.len() > MAX_BODY {
                return Ok(reply(StatusCode::PAYLOAD_TOO_LARGE, Vec::new(), false));
            }
            let out = review(&body);
            Ok(reply(StatusCode::OK, out.to_string().into_bytes(), true))
        }
        _ => Ok(reply(StatusCode::NOT_FOUND, b"not found\n".to_vec(), false)),
    }
}

fn tls_config(s: &Settings) -> anyhow::Result<tokio_rustls::rustls::ServerConfig> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&s.cert)
        .with_context(|| format!("reading certificate {}", s.cert.display()))?
        .collect::<Result<_, _>>()
        .with_context(|| format!("parsing certificate {}", s.cert.display()))?;
    let key = PrivateKeyDer::from_pem_file(&s.key)
        .with_context(|| format!("reading private key {}", s.key.display()))?;
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let mut cfg = tokio_rustls::rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .context("certificate and key do not match")?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

/// Modification times of the certificate and key files.
fn stamp(s: &Settings) -> Option<(std::time::SystemTime, std::time::SystemTime)> {
    let m = |p: &PathBuf| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    Some((m(&s.cert)?, m(&s.key)?))
}

/// The TLS acceptor, reloaded when the certificate or key files change (cert-manager and
/// kubelet rotate Secret-mounted files in place): new connections get the new certificate, a
/// pair that does not load keeps the previous one.
struct Certs {
    settings: Settings,
    stamp: Option<(std::time::SystemTime, std::time::SystemTime)>,
    acceptor: tokio_rustls::TlsAcceptor,
}

impl Certs {
    fn load(settings: Settings) -> anyhow::Result<Self> {
        let stamp = stamp(&settings);
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls_config(&settings)?));
        Ok(Self {
            settings,
            stamp,
            acceptor,
        })
    }

    fn current(&mut self) -> tokio_rustls::TlsAcceptor {
        let now = stamp(&self.settings);
        if now.is_some() && now != self.stamp {
            match tls_config(&self.settings) {
                Ok(cfg) => {
                    self.acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
                    self.stamp = now;
                    tracing::info!("TLS certificate reloaded");
                }
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), "new TLS certificate not loaded; keeping the previous one")
                }
            }
        }
        self.acceptor.clone()
    }
}

/// Serve until `stop` is set.
pub fn run(settings: Settings, stop: Arc<crate::shutdown::Shutdown>) -> anyhow::Result<()> {
    let mut certs = Certs::load(settings.clone())?;
    super::runtime()?.block_on(async move {
        let listener = tokio::net::TcpListener::bind(settings.listen)
            .await
            .with_context(|| format!("listening on {}", settings.listen))?;
        tracing::info!(listen = %listener.local_addr()?, "admission webhook serving /validate");
        loop {
            let accepted = tokio::select! {
                _ = stop.wait() => break,
                a = listener.accept() => a,
            };
            let (tcp, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    continue;
                }
            };
            let acceptor = certs.current();
            tokio::spawn(async move {
                let tls = match acceptor.accept(tcp).await {
                    Ok(t) => t,
                    Err(e) => {
                        tracing::debug!(%peer, error = %e, "TLS handshake failed");
                        return;
                    }
                };
                let io = hyper_util::rt::TokioIo::new(tls);
                if let Err(e) = hyper::server::conn::http1::Builder::new()
                    .serve_connection(io, hyper::service::service_fn(handle))
                    .await
                {
                    tracing::debug!(%peer, error = %e, "connection ended with an error");
                }
            });
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn review_of(spec: serde_json::Value) -> serde_json::Value {
        review_in("peerwall.io", "v1alpha1", spec)
    }

    fn review_in(group: &str, version: &str, spec: serde_json::Value) -> serde_json::Value {
        let body = serde_json::json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "u-1",
                "kind": {"group": group, "version": version, "kind": "FirewallConfiguration"},
                "resource": {"group": group, "version": version, "resource": "firewallconfigurations"},
                "operation": "CREATE",
                "userInfo": {},
                "name": "x",
                "namespace": "ns",
                "object": {
                    "apiVersion": format!("{group}/{version}"),
                    "kind": "FirewallConfiguration",
                    "metadata": {"name": "x", "namespace": "ns"},
                    "spec": spec,
                },
            },
        });
        review(body.to_string().as_bytes())
    }

    #[test]
    fn refuses_with_the_field_path_and_allows_valid() {
        let bad = review_of(
            serde_json::json!({"table": {"name": "t", "family": "INET", "chains": [{
                "name": "c", "type": "filter", "hook": "forward", "priority": 0, "policy": "accept",
                "rules": {"filterRules": [{"action": "drop", "match": [{"op": "eq", "ip": {"value": "10.20.1.300", "position": "dst"}}]}]}
            }]}}),
        );
        assert_eq!(bad["response"]["uid"], "u-1");
        assert_eq!(bad["response"]["allowed"], false);
        let msg = bad["response"]["status"]["message"].as_str().unwrap();
        assert!(
            msg.contains("spec.table.chains[0].rules.filterRules[0].match[0].ip.value")
                && msg.contains("10.20.1.300"),
            "{msg}"
        );
        let good =
            review_of(serde_json::json!({"table": {"name": "t", "family": "INET", "chains": []}}));
        assert_eq!(good["response"]["allowed"], true, "{good}");
    }

    #[test]
    fn liqo_objects_are_never_refused() {
        let bad = serde_json::json!({"table": {"name": "t", "family": "INET", "chains": [{
            "name": "c", "type": "filter", "hook": "forward", "priority": 0, "policy": "accept",
            "rules": {"filterRules": [{"action": "drop", "match": [{"op": "eq", "ip": {"value": "10.20.1.300", "position": "dst"}}]}]}
        }]}});
        assert_eq!(review_of(bad.clone())["response"]["allowed"], false);
        let liqo = review_in("networking.liqo.io", "v1beta1", bad);
        assert_eq!(liqo["response"]["allowed"], true, "{liqo}");
    }

    #[test]
    fn garbage_is_refused() {
        let r = review(b"{\"kind\": 1}");
        assert_eq!(r["response"]["allowed"], false);
    }
}
