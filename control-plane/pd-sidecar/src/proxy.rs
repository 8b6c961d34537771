//! The HTTP side: every request to the sidecar goes to the local vLLM
//! (the decode engine); a generation request that names a prefill worker in
//! `x-prefiller-host-port` first runs its prefill leg there.
//!
//! ```text
//! Envoy ──▶ sidecar ──(x-prefiller-host-port?)──▶ prefill leg: POST prefiller, max_tokens 1, do_remote_decode
//!              │                                        │ kv_transfer_params
//!              └──────────── decode leg (or the original on any failure) ──▶ local vLLM ──▶ streamed back
//! ```
//!
//! A failed, refused or slow prefill leg (past `prefill_timeout`) leaves the
//! request aggregated: the original body goes to the local vLLM, which
//! prefills it itself. No request is lost to the prefill side; the added
//! latency is bounded by the timeout.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvgate_protocol::PREFILLER_HEADER;

use crate::metrics::{Metrics, Outcome};
use kvgate_protocol::pd::{self as legs, Fallback};

/// Largest request body accepted (vLLM sets none; this bounds a runaway
/// client).
pub const MAX_BODY: usize = 256 << 20;

/// Path of the sidecar's own metrics (everything else goes to vLLM).
pub const METRICS_PATH: &str = "/kvgate/pd/metrics";

/// Settings of the sidecar.
#[derive(Debug, Clone)]
pub struct SidecarOptions {
    /// `host:port` of the local vLLM (the decode engine).
    pub decode: String,
    /// Longest wait for a prefill leg's answer.
    pub prefill_timeout: Duration,
}

/// The sidecar's shared state.
pub struct Sidecar {
    opts: SidecarOptions,
    client: Client<HttpConnector, Full<Bytes>>,
    metrics: Metrics,
}

impl Sidecar {
    /// A sidecar with its HTTP client.
    pub fn new(opts: SidecarOptions) -> Arc<Self> {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new()).build(connector);
        Arc::new(Self { opts, client, metrics: Metrics::new() })
    }

    /// The axum router: the metrics path, and everything else proxied.
    pub fn router(self: Arc<Self>) -> axum::Router {
        axum::Router::new().route(METRICS_PATH, axum::routing::get(render_metrics)).fallback(handle).with_state(self)
    }

    /// The prefill leg on `prefiller`; the decode leg's body, or why the
    /// request stays aggregated.
    async fn prefill(&self, headers: &HeaderMap, path: &str, body: &[u8], prefiller: &str) -> Result<Bytes, Fallback> {
        let original = legs::parse(body)?;
        let leg = legs::prefill_body(&original);
        let t0 = Instant::now();
        let send = self.send(Method::POST, prefiller, path, headers, Bytes::from(leg.to_string()));
        let answer = async {
            let r = send.await.map_err(|_| Fallback::Unreachable)?;
            if !r.status().is_success() {
                return Err(Fallback::Status);
            }
            http_body_util::Limited::new(r.into_body(), legs::MAX_PREFILL_ANSWER)
                .collect()
                .await
                .map(|b| b.to_bytes())
                .map_err(|_| Fallback::NoParams)
        };
        let answer = tokio::time::timeout(self.opts.prefill_timeout, answer).await.map_err(|_| Fallback::Timeout)??;
        self.metrics.prefill_seconds.observe(t0.elapsed().as_secs_f64());
        let decode = legs::decode_body(original, &answer)?;
        Ok(Bytes::from(decode.to_string()))
    }

    /// Sends a request to `authority` with the client's headers (hop-by-hop
    /// ones, `host`, `content-length` and the prefiller header removed).
    async fn send(
        &self,
        method: Method,
        authority: &str,
        path: &str,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Result<hyper::Response<hyper::body::Incoming>, String> {
        let uri: Uri = format!("http://{authority}{path}").parse().map_err(|e| format!("{e}"))?;
        let mut req = hyper::Request::builder().method(method).uri(uri);
        if let Some(h) = req.headers_mut() {
            for (k, v) in headers {
                if !skipped(k) {
                    h.append(k.clone(), v.clone());
                }
            }
            if let Ok(v) = HeaderValue::from_str(authority) {
                h.insert(header::HOST, v);
            }
        }
        let req = req.body(Full::new(body)).map_err(|e| e.to_string())?;
        self.client.request(req).await.map_err(|e| e.to_string())
    }
}

/// Headers that do not travel to the next hop.
fn skipped(k: &HeaderName) -> bool {
    matches!(
        k.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "host"
            | "content-length"
    ) || k.as_str() == PREFILLER_HEADER
}

/// Whether `path` is a generation request that can be disaggregated.
fn generation(path: &str) -> bool {
    let p = path.split('?').next().unwrap_or(path);
    p == "/v1/chat/completions" || p == "/v1/completions"
}

/// An `ip:port` or `name:port`, nothing that could redirect the request
/// elsewhere (no scheme, path or credentials).
fn authority_ok(a: &str) -> bool {
    !a.is_empty()
        && a.len() <= 261
        && a.contains(':')
        && a.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b':' | b'[' | b']' | b'-' | b'_'))
}

async fn handle(State(sc): State<Arc<Sidecar>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let Ok(body) = axum::body::to_bytes(body, MAX_BODY).await else {
        return error(StatusCode::PAYLOAD_TOO_LARGE, "request body too large or unreadable");
    };
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str()).to_owned();
    let prefiller = parts.headers.get(PREFILLER_HEADER).and_then(|v| v.to_str().ok()).map(str::trim);
    // Only generation requests are counted and may be disaggregated; any
    // other path goes to the local vLLM as it came.
    let body = match prefiller {
        _ if parts.method != Method::POST || !generation(&path) => body,
        None => {
            sc.metrics.outcome(Outcome::Aggregated);
            body
        }
        Some(p) => {
            let legs = if authority_ok(p) {
                sc.prefill(&parts.headers, &path, &body, p).await
            } else {
                Err(Fallback::BadHeader)
            };
            match legs {
                Ok(decode) => {
                    sc.metrics.outcome(Outcome::Disaggregated);
                    decode
                }
                Err(why) => {
                    tracing::warn!(prefiller = p, %why, "prefill leg failed; serving the request aggregated");
                    sc.metrics.outcome(Outcome::Fallback(why));
                    body
                }
            }
        }
    };
    match sc.send(parts.method, &sc.opts.decode, &path, &parts.headers, body).await {
        Ok(r) => {
            let (parts, incoming) = r.into_parts();
            Response::from_parts(parts, Body::new(incoming))
        }
        Err(e) => {
            tracing::warn!(decode = %sc.opts.decode, error = %e, "the decode engine did not answer");
            error(StatusCode::BAD_GATEWAY, "the decode engine did not answer")
        }
    }
}

async fn render_metrics(State(sc): State<Arc<Sidecar>>) -> Response {
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], sc.metrics.render())
        .into_response()
}

/// An OpenAI-style error.
fn error(status: StatusCode, message: &str) -> Response {
    let body = serde_json::json!({"object": "error", "message": message, "type": "BadGateway", "param": null, "code": status.as_u16()});
    (status, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_authorities_and_generation_paths_qualify() {
        assert!(authority_ok("10.0.0.9:8000") && authority_ok("[::1]:8000") && authority_ok("prefill-0.svc:8000"));
        for bad in ["", "10.0.0.9", "http://10.0.0.9:8000", "a:1/b", "u@h:1", "h:1\r\nx: y"] {
            assert!(!authority_ok(bad), "{bad:?}");
        }
        assert!(generation("/v1/chat/completions") && generation("/v1/completions?x=1"));
        assert!(!generation("/v1/models") && !generation("/metrics"));
        assert!(skipped(&HeaderName::from_static("x-prefiller-host-port")));
        assert!(skipped(&header::CONTENT_LENGTH) && !skipped(&header::AUTHORIZATION));
    }
}
