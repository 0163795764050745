//! Where the state is served: `/metrics`, `/healthz`, `/readyz` and `/events` over hyper
//! (the webhook's HTTP stack), from a thread of its own with a small runtime.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};

use super::Exposition;

/// Which endpoints a listener answers: `/events` carries flows with addresses, so it may be
/// served apart (on localhost) from what Prometheus scrapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoints {
    /// `/metrics`, `/healthz`, `/readyz`.
    Metrics,
    /// `/events`.
    Events,
    /// All of them.
    All,
}

/// Answer one request: `/metrics` (Prometheus text), `/healthz`, `/readyz`, `/events`, as far
/// as `endpoints` serves them.
fn respond<M: Exposition>(
    path: &str,
    query: Option<&str>,
    metrics: &Mutex<M>,
    endpoints: Endpoints,
) -> Response<Full<Bytes>> {
    let mut next_mark = None;
    let elsewhere = match (endpoints, path) {
        (Endpoints::Metrics, "/events") => Some("/events is served on the agent's --events-addr"),
        (Endpoints::Events, "/metrics" | "/healthz" | "/readyz") => {
            Some("served on the agent's --metrics-addr")
        }
        _ => None,
    };
    let (status, ctype, body) = match path {
        _ if elsewhere.is_some() => (
            StatusCode::NOT_FOUND,
            "text/plain",
            format!("{}\n", elsewhere.unwrap_or_default()),
        ),
        "/events" => {
            let after = query
                .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("after=")))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            match metrics.lock().ok().and_then(|m| m.events_after(after)) {
                Some((body, next)) => {
                    next_mark = Some(next);
                    (StatusCode::OK, "application/x-ndjson", body)
                }
                None => (
                    StatusCode::NOT_FOUND,
                    "text/plain",
                    "events are off: start the agent with --events\n".into(),
                ),
            }
        }
        "/metrics" => match metrics.lock() {
            Ok(m) => (StatusCode::OK, "text/plain; version=0.0.4", m.render()),
            Err(_) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "text/plain",
                "poisoned\n".into(),
            ),
        },
        "/healthz" => (StatusCode::OK, "text/plain", "ok\n".into()),
        "/readyz" => match metrics.lock() {
            Ok(m) if m.ready() => (StatusCode::OK, "text/plain", "ready\n".into()),
            _ => (
                StatusCode::SERVICE_UNAVAILABLE,
                "text/plain",
                "not ready\n".into(),
            ),
        },
        _ => (StatusCode::NOT_FOUND, "text/plain", "not found\n".into()),
    };
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(ctype),
    );
    if let Some(n) = next_mark {
        r.headers_mut()
            .insert(EVENTS_NEXT_HEADER, hyper::header::HeaderValue::from(n));
    }
    r
}

/// Header of `/events` answers: the mark to ask `after` next time.
pub const EVENTS_NEXT_HEADER: &str = "x-peerwall-next";

/// Serve on `addr` (hyper, HTTP/1.1, the webhook's stack) from a thread of its own with a
/// small runtime, so the synchronous directory source and the async Kubernetes sources serve
/// alike; returns the bound address.
pub fn serve<M: Exposition + Send + 'static>(
    addr: SocketAddr,
    metrics: Arc<Mutex<M>>,
) -> std::io::Result<SocketAddr> {
    serve_endpoints(addr, metrics, Endpoints::All)
}

/// The agent's listeners: `/metrics`, `/healthz`, `/readyz` on `metrics_addr`, `/events` on
/// `events_addr` when events are on (one listener for all when the two are equal). Returns
/// the bound addresses.
pub fn serve_agent<M: Exposition + Send + 'static>(
    metrics_addr: SocketAddr,
    events_addr: Option<SocketAddr>,
    metrics: Arc<Mutex<M>>,
) -> std::io::Result<(SocketAddr, Option<SocketAddr>)> {
    match events_addr {
        Some(e) if e == metrics_addr => {
            let bound = serve_endpoints(metrics_addr, metrics, Endpoints::All)?;
            Ok((bound, Some(bound)))
        }
        Some(e) => {
            let bound = serve_endpoints(metrics_addr, metrics.clone(), Endpoints::Metrics)?;
            let events = serve_endpoints(e, metrics, Endpoints::Events)?;
            Ok((bound, Some(events)))
        }
        None => Ok((
            serve_endpoints(metrics_addr, metrics, Endpoints::Metrics)?,
            None,
        )),
    }
}

/// [`serve`] answering only `endpoints`.
pub fn serve_endpoints<M: Exposition + Send + 'static>(
    addr: SocketAddr,
    metrics: Arc<Mutex<M>>,
    endpoints: Endpoints,
) -> std::io::Result<SocketAddr> {
    let std_listener = std::net::TcpListener::bind(addr)?;
    std_listener.set_nonblocking(true)?;
    let bound = std_listener.local_addr()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            rt.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(std_listener) {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::error!(error = %e, "metrics listener unusable; no metrics served");
                        return;
                    }
                };
                loop {
                    let (stream, _) = match listener.accept().await {
                        Ok(s) => s,
                        Err(e) => {
                            tracing::debug!(error = %e, "metrics accept failed");
                            continue;
                        }
                    };
                    let metrics = metrics.clone();
                    tokio::spawn(async move {
                        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                            let r =
                                respond(req.uri().path(), req.uri().query(), &metrics, endpoints);
                            async move { Ok::<_, std::convert::Infallible>(r) }
                        });
                        if let Err(e) = hyper::server::conn::http1::Builder::new()
                            .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                            .await
                        {
                            tracing::debug!(error = %e, "metrics request failed");
                        }
                    });
                }
            })
        })?;
    Ok(bound)
}
