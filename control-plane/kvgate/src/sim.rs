//! `kvgate sim`: simulated vLLM workers.

use std::sync::Arc;

use anyhow::{Context, Result, bail};
use kvgate_sim::server::{Bound, EventSockets, WorkerOptions, run_worker};
use kvgate_tokenize::prompt::PromptTokenizer;

/// `kvgate sim`: a fleet of simulated vLLM workers in one process.
#[derive(clap::Args)]
pub(crate) struct SimArgs {
    /// Served model name.
    #[arg(long, env = "KVGATE_SIM_MODEL", default_value = "deepseek-v3")]
    model: String,
    /// Tokenizer directory (tokenizer.json, chat_template.jinja).
    #[arg(long, env = "KVGATE_TOKENIZER_DIR")]
    tokenizer_dir: std::path::PathBuf,
    /// Number of workers.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Listen host.
    #[arg(long, default_value = "127.0.0.1")]
    host: std::net::IpAddr,
    /// HTTP port of worker 0; worker i listens on port + i (0: ephemeral ports).
    #[arg(long, default_value_t = 8000)]
    http_port: u16,
    /// ZMQ port of worker 0; worker i publishes on port + 2i and replays on
    /// port + 2i + 1. With D data-parallel ranks, worker i's rank r publishes
    /// on port + 2iD + r and replays on port + 2iD + D + r (each socket
    /// offset by the rank, as vLLM offsets them). `any`: each worker picks
    /// and holds 2D consecutive free ports itself (publish P + r, replay
    /// P + D + r) and names them in its line on stderr. `off` or 0: no KV
    /// events.
    #[arg(long, default_value = "5557")]
    zmq_port: ZmqPort,
    /// Data-parallel ranks per worker (vLLM --data-parallel-size): engines
    /// behind the worker's one HTTP port, each with its own KV cache and
    /// event sockets; a request goes to the rank its x-data-parallel-rank
    /// header names.
    #[arg(long, default_value_t = 1)]
    data_parallel_size: usize,
    /// KV event encoding: map (vLLM ≥ 0.24) or array (older).
    #[arg(long, default_value = "map")]
    encoding: String,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV blocks per worker (H200 + Llama-3.1-70B FP8 at block size 16: ~23,000).
    #[arg(long, default_value_t = 23_000)]
    num_blocks: usize,
    /// Host-memory KV blocks per worker (vLLM's CPU offloading connector,
    /// LMCache): evicted device blocks go there and are loaded back on a
    /// hit, published with medium "CPU". 0 = no host tier.
    #[arg(long, default_value_t = 0)]
    host_blocks: usize,
    /// Microseconds to load one token's KV from host memory: Llama-3.1-70B's
    /// KV in FP8 is 160 KiB per token, ~6.5 µs at 25 GB/s host-to-device.
    #[arg(long, default_value_t = 6.5)]
    host_load_us_per_token: f64,
    /// Microseconds to receive one token's KV from a prefill worker (the
    /// decode side of a disaggregated request, `kv_transfer_params` with
    /// `do_remote_prefill`): Llama-3.1-70B's KV in FP8 is 160 KiB per token,
    /// 3.3 µs over an RDMA-class 400 Gb/s link (NIXL over InfiniBand or
    /// RoCE); ~52 µs over 25 Gb/s TCP.
    #[arg(long, default_value_t = 3.3)]
    kv_transfer_us_per_token: f64,
    /// vLLM's max_num_seqs.
    #[arg(long, default_value_t = 64)]
    max_num_seqs: usize,
    /// vLLM's max_num_batched_tokens (chunked prefill budget per step).
    #[arg(long, default_value_t = 8192)]
    max_num_batched_tokens: usize,
    /// Timing preset: h200-llama70b-fp8, dynamo-mocker, vllm-v1 or
    /// vllm-v1-a100 (control-plane/sim/src/timing.rs documents each).
    #[arg(long, default_value = "h200-llama70b-fp8")]
    timing: String,
    /// Simulated time runs this many times faster than real time.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// Output tokens per streamed chunk after the first, as vLLM's
    /// --stream-interval (fewer chunks: less CPU for the gateway under test).
    #[arg(long, default_value_t = 1)]
    stream_interval: usize,
    /// Output tokens when a request has no max_tokens.
    #[arg(long, default_value_t = 256)]
    default_max_tokens: usize,
    /// Longest prompt + output accepted.
    #[arg(long, default_value_t = 131_072)]
    max_model_len: usize,
    /// Runtime threads (1 = everything on one core).
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

/// `--zmq-port`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ZmqPort {
    Off,
    Any,
    From(u16),
}

impl std::str::FromStr for ZmqPort {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" | "0" => Ok(ZmqPort::Off),
            "any" => Ok(ZmqPort::Any),
            n => n.parse().map(ZmqPort::From).map_err(|_| format!("{n:?}: expected a port, any or off")),
        }
    }
}

/// `kvgate sim`.
pub(crate) fn run(a: SimArgs) -> Result<()> {
    let timing = kvgate_sim::timing::Timing::preset(&a.timing).with_context(|| {
        format!("--timing {:?}: expected one of {}", a.timing, kvgate_sim::timing::Timing::PRESETS.join(", "))
    })?;
    let encoding = match a.encoding.as_str() {
        "map" => kvgate_vllm_wire::encode::Encoding::Map,
        "array" => kvgate_vllm_wire::encode::Encoding::Array,
        e => bail!("--encoding {e:?}: expected map or array"),
    };
    if !(a.host_load_us_per_token.is_finite() && a.host_load_us_per_token >= 0.0) {
        bail!("--host-load-us-per-token {}: must be a finite number ≥ 0", a.host_load_us_per_token);
    }
    if !(a.kv_transfer_us_per_token.is_finite() && a.kv_transfer_us_per_token >= 0.0) {
        bail!("--kv-transfer-us-per-token {}: must be a finite number ≥ 0", a.kv_transfer_us_per_token);
    }
    if a.workers == 0 || a.block_size == 0 || a.num_blocks == 0 || a.max_num_seqs == 0 || a.stream_interval == 0 {
        bail!("--workers, --block-size, --num-blocks, --max-num-seqs and --stream-interval must be > 0");
    }
    if !(1..=64).contains(&a.data_parallel_size) {
        bail!("--data-parallel-size {}: must be 1 to 64", a.data_parallel_size);
    }
    if !(a.speedup.is_finite() && a.speedup > 0.0) {
        bail!("--speedup {}: must be > 0", a.speedup);
    }
    let tokenizer = Arc::new(
        PromptTokenizer::from_dir(&a.tokenizer_dir, Default::default())
            .with_context(|| format!("--tokenizer-dir {}", a.tokenizer_dir.display()))?,
    );
    let workers: Vec<WorkerOptions> =
        (0..a.workers).map(|i| worker_options(&a, i, encoding, timing, tokenizer.clone())).collect::<Result<_>>()?;
    let rt = if a.threads <= 1 {
        tokio::runtime::Builder::new_current_thread().enable_all().build()?
    } else {
        tokio::runtime::Builder::new_multi_thread().worker_threads(a.threads).enable_all().build()?
    };
    rt.block_on(serve(workers))
}

/// Worker `i`'s settings: ports counted from the base ports (HTTP port 0: any).
fn worker_options(
    a: &SimArgs,
    i: usize,
    encoding: kvgate_vllm_wire::encode::Encoding,
    timing: kvgate_sim::timing::Timing,
    tokenizer: Arc<PromptTokenizer>,
) -> Result<WorkerOptions> {
    let port = |base: u16, off: usize| -> Result<u16> {
        if base == 0 {
            return Ok(0);
        }
        u16::try_from(usize::from(base) + off).context("port out of range")
    };
    let http_port = port(a.http_port, i)?;
    let d = a.data_parallel_size;
    let events = match a.zmq_port {
        ZmqPort::Off => EventSockets::Off,
        ZmqPort::Any => EventSockets::Any(a.host),
        ZmqPort::From(base) => {
            // The last rank's sockets must exist too.
            port(base, 2 * i * d + 2 * d - 1)?;
            let at = |off: usize| port(base, off).map(|p| format!("tcp://{}:{p}", a.host));
            EventSockets::At { publish: at(2 * i * d)?, replay: Some(at(2 * i * d + d)?) }
        }
    };
    Ok(WorkerOptions {
        id: format!("w{i}"),
        model: a.model.clone(),
        http: std::net::SocketAddr::new(a.host, http_port),
        events,
        topic: "kv-events".into(),
        encoding,
        engine: kvgate_sim::engine::EngineConfig {
            max_num_seqs: a.max_num_seqs,
            max_num_batched_tokens: a.max_num_batched_tokens,
            num_blocks: a.num_blocks,
            block_size: a.block_size,
            timing,
            host: kvgate_sim::engine::HostTier {
                blocks: a.host_blocks,
                load_ms_per_token: a.host_load_us_per_token / 1000.0,
            },
            kv_transfer_ms_per_token: a.kv_transfer_us_per_token / 1000.0,
        },
        speedup: a.speedup,
        stream_interval: a.stream_interval,
        tokenizer,
        default_max_tokens: a.default_max_tokens,
        max_model_len: a.max_model_len,
        replay_buffer: 10_000,
        data_parallel_size: d,
    })
}

/// Runs every worker until a signal, or until one fails.
async fn serve(workers: Vec<WorkerOptions>) -> Result<()> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut set = tokio::task::JoinSet::new();
    for (i, opts) in workers.into_iter().enumerate() {
        let mut stop = stop_rx.clone();
        set.spawn(run_worker(
            opts,
            async move {
                let _ = stop.changed().await;
            },
            move |b: &Bound| {
                // One machine-readable line per worker for launchers, once
                // every socket is bound (rank 0's endpoints; rank r's are
                // offset by r).
                let off = || "off".to_owned();
                let (zmq, replay) = (b.publish.clone().unwrap_or_else(off), b.replay.clone().unwrap_or_else(off));
                eprintln!("kvgate sim: worker w{i} http={} zmq={zmq} replay={replay}", b.http);
            },
        ));
    }
    tokio::select! {
        _ = kvgate_server::server::shutdown_signal() => {}
        r = set.join_next() => {
            if let Some(Ok(Err(e))) = r {
                return Err(anyhow::anyhow!(e));
            }
        }
    }
    let _ = stop_tx.send(true);
    while set.join_next().await.is_some() {}
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_zmq_port_is_a_port_any_or_off() {
        let cases: [(&str, Result<ZmqPort, ()>); 6] = [
            ("5557", Ok(ZmqPort::From(5557))),
            ("any", Ok(ZmqPort::Any)),
            ("off", Ok(ZmqPort::Off)),
            ("0", Ok(ZmqPort::Off)),
            ("65536", Err(())),
            ("5557x", Err(())),
        ];
        for (s, want) in cases {
            assert_eq!(s.parse::<ZmqPort>().map_err(|_| ()), want, "{s}");
        }
    }
}
