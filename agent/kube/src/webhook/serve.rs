//! The webhook's HTTPS edge: TLS from files (cert-manager, or a Secret mounted by hand) or
//! from the certificate peerwall issues itself ([`super::certs`]); the tenant namespaces
//! watched for the namespace rule; `POST /validate` answered by [`super::review`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use k8s_openapi::api::core::v1::Namespace;
use kube::runtime::reflector;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

use super::certs::{Issue, Keeper};
use super::{review, Judge};
use crate::trust::{Tenants, Trust};

/// Largest admission review accepted (the API server's own request limit is 3 MiB).
const MAX_BODY: usize = 4 << 20;

/// Where the webhook listens, its certificate, and the agents' trust.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Its certificate.
    pub tls: Tls,
    /// What the agents take (the webhook refuses the rest).
    pub trust: Trust,
    /// The user the controller writes as ([`super::Judge::controller`]).
    pub controller: String,
}

/// Where the serving certificate comes from.
#[derive(Clone, Debug)]
pub enum Tls {
    /// PEM files, reloaded when they change (cert-manager, kubelet's Secret mounts).
    Files {
        /// Certificate chain.
        cert: PathBuf,
        /// Private key.
        key: PathBuf,
    },
    /// Issued and rotated by peerwall, kept in a Secret.
    Issued(Issue),
}

/// What a request needs besides its body.
struct State {
    trust: Trust,
    controller: String,
    tenants: Option<reflector::Store<Namespace>>,
}

impl State {
    fn judge(&self) -> Judge {
        let tenants: Tenants = self
            .tenants
            .as_ref()
            .map(|r| crate::tenants_of(r.state().iter().map(|n| n.as_ref())))
            .unwrap_or_default();
        Judge {
            trust: self.trust.clone(),
            tenants,
            controller: self.controller.clone(),
        }
    }
}

async fn handle(
    req: Request<Incoming>,
    state: Arc<State>,
) -> Result<Response<Full<Bytes>>, hyper::Error> {
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
            let out = review(&body, &state.judge());
            Ok(reply(StatusCode::OK, out.to_string().into_bytes(), true))
        }
        _ => Ok(reply(StatusCode::NOT_FOUND, b"not found\n".to_vec(), false)),
    }
}

/// A server configuration for a PEM certificate chain and key.
fn tls_config(
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> anyhow::Result<tokio_rustls::rustls::ServerConfig> {
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

fn acceptor_of_files(cert: &PathBuf, key: &PathBuf) -> anyhow::Result<tokio_rustls::TlsAcceptor> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .with_context(|| format!("reading certificate {}", cert.display()))?
        .collect::<Result<_, _>>()
        .with_context(|| format!("parsing certificate {}", cert.display()))?;
    let key = PrivateKeyDer::from_pem_file(key)
        .with_context(|| format!("reading private key {}", key.display()))?;
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(tls_config(
        certs, key,
    )?)))
}

fn acceptor_of_pem(cert: &str, key: &str) -> anyhow::Result<tokio_rustls::TlsAcceptor> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert.as_bytes())
        .collect::<Result<_, _>>()
        .context("parsing the issued certificate")?;
    let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).context("reading the issued key")?;
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(tls_config(
        certs, key,
    )?)))
}

/// Modification times of the certificate and key files.
fn stamp(cert: &PathBuf, key: &PathBuf) -> Option<(std::time::SystemTime, std::time::SystemTime)> {
    let m = |p: &PathBuf| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    Some((m(cert)?, m(key)?))
}

/// The TLS acceptor: from files, reloaded when they change (a pair that does not load keeps
/// the previous one); or the issued certificate, replaced by the keeper's task.
enum Certs {
    Files {
        cert: PathBuf,
        key: PathBuf,
        stamp: Option<(std::time::SystemTime, std::time::SystemTime)>,
        acceptor: tokio_rustls::TlsAcceptor,
    },
    Issued(tokio::sync::watch::Receiver<tokio_rustls::TlsAcceptor>),
}

impl Certs {
    fn current(&mut self) -> tokio_rustls::TlsAcceptor {
        match self {
            Certs::Files {
                cert,
                key,
                stamp: seen,
                acceptor,
            } => {
                let now = stamp(cert, key);
                if now.is_some() && now != *seen {
                    match acceptor_of_files(cert, key) {
                        Ok(a) => {
                            *acceptor = a;
                            *seen = now;
                            tracing::info!("TLS certificate reloaded");
                        }
                        Err(e) => {
                            tracing::warn!(error = %format!("{e:#}"), "new TLS certificate not loaded; keeping the previous one")
                        }
                    }
                }
                acceptor.clone()
            }
            Certs::Issued(rx) => rx.borrow().clone(),
        }
    }
}

/// Issue (or read) the certificate, publish its CA, and keep both current in a spawned task.
async fn keep_issued(client: kube::Client, issue: Issue) -> anyhow::Result<Certs> {
    let keeper = Keeper::new(client, issue);
    let stored = keeper.ensure().await?;
    if let Err(e) = keeper
        .publish_bundle(&stored.bundle(super::certs::now()))
        .await
    {
        tracing::warn!(error = %format!("{e:#}"), "caBundle not written yet (retried)");
    }
    let (tx, rx) = tokio::sync::watch::channel(acceptor_of_pem(&stored.cert, &stored.key)?);
    tokio::spawn(async move {
        let mut serving = stored;
        loop {
            tokio::time::sleep(keeper.period()).await;
            match keeper.ensure().await {
                Ok(s) => {
                    if s.cert != serving.cert {
                        match acceptor_of_pem(&s.cert, &s.key) {
                            Ok(a) => {
                                tx.send_replace(a);
                                tracing::info!(
                                    not_after = s.not_after,
                                    "serving the new certificate"
                                );
                                serving = s;
                            }
                            Err(e) => {
                                tracing::warn!(error = %format!("{e:#}"), "new certificate not loaded; keeping the previous one")
                            }
                        }
                    }
                    if let Err(e) = keeper
                        .publish_bundle(&serving.bundle(super::certs::now()))
                        .await
                    {
                        tracing::warn!(error = %format!("{e:#}"), "caBundle not written (retried)");
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), "could not check the webhook certificate (retried)")
                }
            }
        }
    });
    Ok(Certs::Issued(rx))
}

/// Serve until `stop` is set.
pub fn run(settings: Settings, stop: Arc<crate::shutdown::Shutdown>) -> anyhow::Result<()> {
    crate::runtime()?.block_on(async move {
        let needs_api = settings.trust.tenant_namespaces || matches!(settings.tls, Tls::Issued(_));
        let client = match needs_api {
            true => Some(crate::client().await?),
            false => None,
        };
        let mut certs = match (&settings.tls, &client) {
            (Tls::Files { cert, key }, _) => Certs::Files {
                stamp: stamp(cert, key),
                acceptor: acceptor_of_files(cert, key)?,
                cert: cert.clone(),
                key: key.clone(),
            },
            (Tls::Issued(issue), Some(c)) => keep_issued(c.clone(), issue.clone()).await?,
            (Tls::Issued(_), None) => anyhow::bail!("issuing a certificate needs the API"),
        };
        let tenants = match (&client, settings.trust.tenant_namespaces) {
            (Some(c), true) => {
                Some(crate::tenant_namespaces(c, Arc::new(crate::Changes::default())).await?)
            }
            _ => None,
        };
        let state = Arc::new(State {
            trust: settings.trust.clone(),
            controller: settings.controller.clone(),
            tenants,
        });
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
            let state = state.clone();
            tokio::spawn(async move {
                let tls = match acceptor.accept(tcp).await {
                    Ok(t) => t,
                    Err(e) => {
                        tracing::debug!(%peer, error = %e, "TLS handshake failed");
                        return;
                    }
                };
                let io = hyper_util::rt::TokioIo::new(tls);
                let service = hyper::service::service_fn(move |req| handle(req, state.clone()));
                if let Err(e) = hyper::server::conn::http1::Builder::new()
                    .serve_connection(io, service)
                    .await
                {
                    tracing::debug!(%peer, error = %e, "connection ended with an error");
                }
            });
        }
        Ok(())
    })
}
