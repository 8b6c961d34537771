//! `kvgate pd-sidecar`: the decode pod's P/D sidecar (see `kvgate-pd-sidecar`).

use anyhow::{Context, Result, bail};

/// `kvgate pd-sidecar`: in front of a decode pod's vLLM; runs the prefill
/// leg of a request that names a prefill worker in `x-prefiller-host-port`
/// (llm-d's convention), then its decode leg on the local vLLM.
#[derive(clap::Args)]
pub(crate) struct PdArgs {
    /// Listen address: the decode pod's serving port (the address its relay
    /// announces as the worker's endpoint).
    #[arg(long, env = "KVGATE_PD_LISTEN", default_value = "0.0.0.0:8000")]
    listen: std::net::SocketAddr,
    /// `host:port` of the local vLLM (the decode engine).
    #[arg(long, env = "KVGATE_PD_DECODE", default_value = "127.0.0.1:8200")]
    decode: String,
    /// Longest wait for a prefill leg's answer (ms); past it the request is
    /// served aggregated by the local vLLM.
    #[arg(long, env = "KVGATE_PD_PREFILL_TIMEOUT_MS", default_value_t = 30_000)]
    prefill_timeout_ms: u64,
}

/// `kvgate pd-sidecar`.
pub(crate) fn run(a: PdArgs) -> Result<()> {
    if a.decode.contains('/') || !a.decode.contains(':') {
        bail!("--decode {:?}: expected host:port of the local vLLM", a.decode);
    }
    if a.prefill_timeout_ms == 0 {
        bail!("--prefill-timeout-ms: must be > 0");
    }
    crate::init_logging();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async {
        let listener =
            tokio::net::TcpListener::bind(a.listen).await.with_context(|| format!("--listen {}", a.listen))?;
        tracing::info!(listen = %listener.local_addr()?, decode = %a.decode, "P/D sidecar");
        let opts = kvgate_pd_sidecar::SidecarOptions {
            decode: a.decode,
            prefill_timeout: std::time::Duration::from_millis(a.prefill_timeout_ms),
        };
        kvgate_pd_sidecar::serve(listener, opts, kvgate_server::server::shutdown_signal()).await?;
        Ok(())
    })
}
