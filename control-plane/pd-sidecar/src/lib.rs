//! kvgate's P/D sidecar: the decode pod's side of a disaggregated request in
//! llm-d's convention. The gateway routes the request to the decode pod
//! (`x-gateway-destination-endpoint`) and names the prefill pod in
//! `x-prefiller-host-port`; this sidecar, in front of the decode pod's vLLM,
//! runs the prefill leg there, then the decode leg on its own vLLM with the
//! returned `kv_transfer_params`, and streams the answer back. Fleets built
//! for llm-d's routing sidecar work unchanged.
//!
//! | module | concern |
//! |---|---|
//! | `proxy.rs` | the HTTP proxy: prefill leg with a timeout, decode leg, fallback to aggregated |
//! | `metrics.rs` | requests by outcome, prefill-leg duration |
//!
//! The two legs' bodies and the fallback causes are `kvgate_protocol::pd`
//! (shared with the filter's own legs).
//!
//! Cost per request: one JSON parse and two serializations of the body, one
//! extra round trip to the prefill worker (bounded by the timeout).

pub mod metrics;
pub mod proxy;

pub use proxy::{METRICS_PATH, Sidecar, SidecarOptions};

/// Serves the sidecar on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    opts: SidecarOptions,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::serve::ListenerExt as _;
    let app = Sidecar::new(opts).router();
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}
