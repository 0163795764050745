//! Tests only: a kube [`Client`] over an in-process service that records every request and
//! answers it as an API server holding nothing would (an apply returns the object applied, a
//! delete succeeds, a read finds nothing), so a reconcile's writes are asserted as requests
//! (kube-rs's controller-rs does the same with tower-test).

use std::sync::{Arc, Mutex};

use http_body_util::BodyExt;
use kube::client::Body;
use kube::Client;
use serde_json::Value;

/// One request the client sent.
#[derive(Clone, Debug)]
pub(super) struct Request {
    /// `PATCH`, `DELETE`, …
    pub method: String,
    /// Path and query.
    pub uri: String,
    /// Content type, if any.
    pub content_type: String,
    /// The body as JSON (Null when empty).
    pub body: Value,
}

/// A client, and the requests it sent.
pub(super) fn client() -> (Client, Arc<Mutex<Vec<Request>>>) {
    let seen: Arc<Mutex<Vec<Request>>> = Arc::default();
    let log = seen.clone();
    let service = tower::service_fn(move |req: http::Request<Body>| {
        let log = log.clone();
        async move {
            let (parts, body) = req.into_parts();
            let bytes = body.collect().await?.to_bytes();
            let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            let method = parts.method.to_string();
            log.lock().expect("log").push(Request {
                method: method.clone(),
                uri: parts.uri.to_string(),
                content_type: parts
                    .headers
                    .get(http::header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_string(),
                body: body.clone(),
            });
            let (status, answer) = match method.as_str() {
                "PATCH" | "PUT" | "POST" => (200, body),
                "DELETE" => (
                    200,
                    serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Success"}),
                ),
                _ => (
                    404,
                    serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404, "reason": "NotFound", "message": "not found"}),
                ),
            };
            let response = http::Response::builder()
                .status(status)
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(Body::from(serde_json::to_vec(&answer).expect("JSON")))
                .expect("response");
            Ok::<_, kube::Error>(response)
        }
    });
    (Client::new(service, "default"), seen)
}
