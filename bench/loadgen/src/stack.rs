//! The local stack on 127.0.0.1, started fresh for every measured cell and
//! stopped (by PID, only what it started) when dropped:
//!
//! - a simulated vLLM fleet: one `kvgate sim` process per worker;
//! - for the kvgate modes: nats-server, a `kvgate relay` beside each worker,
//!   `kvgate serve` in the mode under test, and Envoy 1.40 with the kvgate
//!   filter in front of the workers;
//! - for the peer: `sglang-router launch --policy cache_aware` in front of
//!   the same workers (PyPI `sglang-router`, installed by scripts/setup.sh);
//! - for the disaggregated modes ([`Frontend::Pd`]): the first workers are
//!   prefill workers, the rest decode workers each behind `kvgate
//!   pd-sidecar` (or, for the `_filter` modes, none: the filter runs the
//!   legs), their relays announcing the roles; for `conditional_both`
//!   ([`Frontend::PdBoth`]) every worker is `both`, behind a sidecar.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use kvgate_testkit::{
    Envoy, NatsServer, Proc, RelaySpec, free_port, http_request, render_kvgate_envoy, repo_root, spawn_serve,
    spawn_sim, wait_for_tcp,
};

pub use crate::runner::MODEL;

/// A GET of `path` on `addr` whose answer is JSON (200 only).
pub fn get_json(addr: SocketAddr, path: &str) -> Result<serde_json::Value> {
    let r = http_request(addr, "GET", path, &[], b"")?;
    if r.status != 200 {
        bail!("GET {path}: {}", r.status);
    }
    Ok(serde_json::from_slice(&r.body)?)
}

/// The control plane's `/admin/timing` polled while a cell runs
/// ([`Stack::poll_timing`]): the prices `kv` routed with over the run, not
/// only at its end (`timing.json`). The polls cost CPU (on a 2-core VM
/// host CPU ~30 → ~50 % at 2 a second): read prices from such a run, not
/// its latencies.
pub struct TimingPolls {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<serde_json::Value>>,
}

impl TimingPolls {
    /// Stops polling and writes every poll to `dir/timing-polls.json`:
    /// `[{t, timing}]`, `t` seconds from the first poll, `timing` the
    /// endpoint's whole answer.
    pub fn finish(self, dir: &Path) -> Result<()> {
        self.stop.store(true, Ordering::Relaxed);
        let polls = self.thread.join().map_err(|_| anyhow::anyhow!("the timing poller panicked"))?;
        std::fs::write(dir.join("timing-polls.json"), serde_json::to_vec(&polls)?)?;
        Ok(())
    }
}

/// The simulated fleet.
#[derive(Debug, Clone)]
pub struct FleetSpec {
    /// The fleet's name in reports (`--preset`).
    pub preset: String,
    /// Number of workers of the main kind.
    pub workers: usize,
    /// vLLM timing preset of `kvgate sim` for the main kind.
    pub timing: String,
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV blocks per worker of the main kind.
    pub num_blocks: usize,
    /// Workers of other kinds, after the main ones: (timing preset, KV
    /// blocks) each (a heterogeneous fleet).
    pub extra: Vec<(String, usize)>,
    /// vLLM's `max_num_seqs`.
    pub max_num_seqs: usize,
    /// The filter's Pick timeout (ms).
    pub filter_timeout_ms: u32,
    /// The filter runs the prefill legs itself (`disaggregation.legs:
    /// "filter"`) instead of naming the prefill worker to a sidecar.
    pub filter_legs: bool,
    /// Host-memory KV blocks per worker (CPU offloading); 0 = none.
    pub host_blocks: usize,
    /// vLLM's `max_num_batched_tokens`.
    pub max_num_batched_tokens: usize,
    /// Simulated time runs this many times faster than the wall clock.
    pub speedup: f64,
    /// Output tokens per streamed chunk after the first.
    pub stream_interval: usize,
    /// `[models.kv]` settings of the control plane (`key = value` TOML
    /// lines, e.g. `overlap_weight = 2.0`); empty: its defaults.
    pub kv_settings: Vec<String>,
    /// `[models.disaggregation]` settings for the conditional P/D modes
    /// (TOML lines); empty: the control plane's defaults.
    pub disagg_settings: Vec<String>,
    /// The filter reports a request at its end only, not a stream's first
    /// token as well (`reports.first_token: false`).
    pub end_reports_only: bool,
    /// The `kvgate` binary to run.
    pub kvgate: PathBuf,
}

/// Fleets `--preset` names: the DOKS demo's, and engines the router was
/// not built against (control-plane/sim/src/timing.rs documents each timing).
pub const PRESETS: [&str; 4] = ["h200-llama70b-fp8", "dynamo-mocker", "vllm-v1", "hetero"];

/// KV blocks of 32 tokens for Llama-3.1-8B BF16 (131,072 B of KV per token)
/// on an H100 SXM 80 GB: 90 % of memory (vLLM's default utilization) less
/// 16.06 GB of weights and ~4 GB of activations and CUDA graphs, i.e.
/// 51.9 GB / 131,072 B / 32.
pub const H100_LLAMA8B_BLOCKS: usize = 12_384;
/// The same on an A100 SXM 40 GB: (36 − 16.06 − 3) GB / 131,072 B / 32.
pub const A100_40GB_LLAMA8B_BLOCKS: usize = 4_038;

/// The DOKS workload's operating point for the `kv_true_constants` mode:
/// turns resend a history of ~3,750–6,400 tokens (mean ~5,000) of which the
/// last answer and the follow-up (~900 tokens) are new; decoding requests
/// hold and attend to ~5,500 tokens; 40 of them run on each worker (the
/// sweep's middle level, 120 conversations on three workers), on a worker
/// whose KV cache holds `capacity_tokens`.
pub fn doks_operating_point(capacity_tokens: f64) -> kvgate_sim::timing::OperatingPoint {
    kvgate_sim::timing::OperatingPoint {
        context: 5_000.0,
        chunk: 900.0,
        decode_context: 5_500.0,
        running: 40.0,
        capacity_tokens,
    }
}

impl FleetSpec {
    /// The DOKS demo's fleet (REFERENCE-RESULTS.md §A): 3× H200 with
    /// Llama-3.1-70B FP8, block size 32, batch 64, 16,384 batched tokens,
    /// ~11,500 blocks of KV cache per GPU.
    pub fn doks(speedup: f64, stream_interval: usize) -> Self {
        FleetSpec {
            preset: "h200-llama70b-fp8".into(),
            workers: 3,
            timing: "h200-llama70b-fp8".into(),
            block_size: 32,
            num_blocks: 11_500,
            extra: Vec::new(),
            max_num_seqs: 64,
            filter_timeout_ms: 200,
            filter_legs: false,
            host_blocks: 0,
            max_num_batched_tokens: 16_384,
            speedup,
            stream_interval,
            kv_settings: Vec::new(),
            disagg_settings: Vec::new(),
            end_reports_only: false,
            kvgate: kvgate_bin(),
        }
    }

    /// A fleet by name ([`PRESETS`]), with the DOKS fleet's batch limits
    /// and block size: `h200-llama70b-fp8` is [`FleetSpec::doks`];
    /// `dynamo-mocker` the same three workers on Dynamo's published timing;
    /// `vllm-v1` three H100s serving Llama-3.1-8B; `hetero` two of those
    /// and two A100 40 GB (slower, a third of the KV cache).
    pub fn preset(name: &str, speedup: f64, stream_interval: usize) -> Result<Self> {
        let doks = Self::doks(speedup, stream_interval);
        let (timing, num_blocks, extra) = match name {
            "h200-llama70b-fp8" => return Ok(doks),
            "dynamo-mocker" => ("dynamo-mocker", doks.num_blocks, Vec::new()),
            "vllm-v1" => ("vllm-v1", H100_LLAMA8B_BLOCKS, Vec::new()),
            "hetero" => {
                ("vllm-v1", H100_LLAMA8B_BLOCKS, vec![("vllm-v1-a100".to_owned(), A100_40GB_LLAMA8B_BLOCKS); 2])
            }
            _ => bail!("--preset {name:?}: expected one of {}", PRESETS.join(", ")),
        };
        let workers = if extra.is_empty() { 3 } else { 2 };
        Ok(FleetSpec { preset: name.into(), workers, timing: timing.into(), num_blocks, extra, ..doks })
    }

    /// Every worker's (timing preset, KV blocks), in start order.
    pub fn kinds(&self) -> Vec<(String, usize)> {
        let main = std::iter::repeat_n((self.timing.clone(), self.num_blocks), self.workers);
        main.chain(self.extra.iter().cloned()).collect()
    }

    /// The `[models.kv]` lines of the `kv_true_constants` mode: learning
    /// off, and the main kind's marginal costs at the DOKS operating point
    /// (`Timing::linear_equivalent`). The only mode in which the router is
    /// told anything about the engine.
    pub fn true_constants(&self) -> Result<Vec<String>> {
        let t = kvgate_sim::timing::Timing::preset(&self.timing)
            .with_context(|| format!("no timing preset {:?}", self.timing))?;
        let capacity_tokens = (self.num_blocks as f64) * f64::from(self.block_size);
        let (p, s) = t.linear_equivalent(&doks_operating_point(capacity_tokens));
        Ok(vec![
            "learn_timing = false".into(),
            format!("prefill_ms_per_token = {p}"),
            format!("decode_ms_per_seq = {s}"),
        ])
    }
}

/// The `[models.kv]` lines of the `kv_no_speculation` mode.
pub const NO_SPECULATION: [&str; 2] = ["inflight_hit_weight = 0", "inflight_wait_weight = 0"];

/// The `[models.kv]` line of the `kv_lasting_load` mode.
pub const LASTING_LOAD: &str = "fading_load = false";

/// The `[models.kv]` line of the `kv_tier_blind` mode.
pub const TIER_BLIND: &str = "host_hit_weight = 0";

/// The control plane's lines of the `kv_overload` mode.
pub const OVERLOAD: [&str; 3] = ["[models.overload]", "enabled = true", "max_wait_ms = 5000"];
/// The filter's callout timeout in the `kv_overload` mode: above the hold.
pub const OVERLOAD_FILTER_TIMEOUT_MS: u32 = 7000;

/// What fronts the fleet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frontend {
    /// Envoy with the kvgate filter; the control plane in this routing mode.
    Kvgate(String),
    /// sglang-router with this policy.
    Sglang(String),
    /// Envoy with the kvgate filter; the control plane in `kv` mode told the
    /// preset's true constants, learning off ([`FleetSpec::true_constants`]).
    KvTrueConstants,
    /// Envoy with the kvgate filter; the control plane in `kv` mode without
    /// its speculative index: requests in flight lend no overlap
    /// (`inflight_hit_weight = 0`, `inflight_wait_weight = 0`), so a worker
    /// counts as holding a prefix only once its KV events say so, as
    /// Dynamo's router does.
    KvNoSpeculation,
    /// Envoy with the kvgate filter; the control plane in `kv` mode blind to
    /// host-memory blocks (`host_hit_weight = 0`).
    KvTierBlind,
    /// Envoy with the kvgate filter; the control plane in `kv` mode pricing
    /// decode by the running requests now, as if a load difference lasted
    /// ([`LASTING_LOAD`]; before `fading_load`).
    KvLastingLoad,
    /// Envoy with the kvgate filter (callout timeout above the hold); the
    /// control plane in `kv` mode with overload protection on ([`OVERLOAD`]).
    KvOverload,
    /// Envoy with the kvgate filter reporting each request at its end only
    /// (as before first-token reports): the control plane in `kv` mode
    /// counts a stream's prompt as prefill to do until the stream ends.
    KvEndReports,
    /// Envoy with the kvgate filter; the control plane in `kv` mode with a
    /// disaggregated fleet: the first `prefill` workers prefill only, the
    /// other `decode` ones decode behind `kvgate pd-sidecar`. `conditional`:
    /// the control plane's defaults (a request is disaggregated when the
    /// decode worker's own prefill would take 100 ms, simulated, or more at
    /// its learned timing, and a prefill worker would finish it no later);
    /// else every request is (`min_uncached_tokens = 1`,
    /// `only_if_sooner = false`) while a prefill worker is below its
    /// running limit. `filter_legs`: no sidecars, the filter runs the legs
    /// (mode names end in `_filter`). `overflow` (names with
    /// `_overflow` after the shape): `overflow_to_prefill = true`, a
    /// prefill worker takes whole requests while the decode pool is
    /// saturated.
    Pd { prefill: usize, decode: usize, conditional: bool, filter_legs: bool, overflow: bool },
    /// Conditional disaggregation on a uniform fleet (`conditional_both`):
    /// every worker is `both`, behind a `kvgate pd-sidecar`, and the control
    /// plane's defaults plus `prefill_on_both = true` decide per request
    /// whether another worker prefills it. `filter_legs` as for [`Frontend::Pd`].
    PdBoth { filter_legs: bool },
    /// NVIDIA Dynamo's own frontend with this `--router-mode` (`kv` or
    /// `round-robin`) in front of Dynamo's own mocker workers
    /// ([`Stack::start_dynamo`]).
    Dynamo(String),
}

impl Frontend {
    /// The mode name used in reports: `kv`, `round_robin`, …, `sglang_cache_aware`.
    pub fn name(&self) -> String {
        match self {
            Frontend::Kvgate(m) => m.clone(),
            Frontend::Sglang(p) => format!("sglang_{p}"),
            Frontend::KvTrueConstants => "kv_true_constants".into(),
            Frontend::KvNoSpeculation => "kv_no_speculation".into(),
            Frontend::KvTierBlind => "kv_tier_blind".into(),
            Frontend::KvLastingLoad => "kv_lasting_load".into(),
            Frontend::KvOverload => "kv_overload".into(),
            Frontend::KvEndReports => "kv_end_reports".into(),
            Frontend::Pd { prefill, decode, conditional, filter_legs, overflow } => format!(
                "{}_{prefill}p{decode}d{}{}",
                if *conditional { "conditional" } else { "disaggregated" },
                if *overflow { "_overflow" } else { "" },
                if *filter_legs { "_filter" } else { "" }
            ),
            Frontend::PdBoth { filter_legs } => {
                format!("conditional_both{}", if *filter_legs { "_filter" } else { "" })
            }
            Frontend::Dynamo(m) if m == "kv" => "dynamo".into(),
            Frontend::Dynamo(m) => format!("dynamo_{}", m.replace('-', "_")),
        }
    }

    /// Parses a report name back.
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "kv" | "approx" | "least_load" | "round_robin" | "random" => Frontend::Kvgate(s.into()),
            "kv_true_constants" => Frontend::KvTrueConstants,
            "kv_no_speculation" => Frontend::KvNoSpeculation,
            "kv_tier_blind" => Frontend::KvTierBlind,
            "kv_lasting_load" => Frontend::KvLastingLoad,
            "kv_overload" => Frontend::KvOverload,
            "kv_end_reports" => Frontend::KvEndReports,
            "dynamo" => Frontend::Dynamo("kv".into()),
            "dynamo_round_robin" => Frontend::Dynamo("round-robin".into()),
            "conditional_both" => Frontend::PdBoth { filter_legs: false },
            "conditional_both_filter" => Frontend::PdBoth { filter_legs: true },
            _ if s.starts_with("disaggregated_") || s.starts_with("conditional_") => {
                let (kind, shape) = s.split_once('_').unwrap_or_default();
                let (shape, filter_legs) = match shape.strip_suffix("_filter") {
                    Some(x) => (x, true),
                    None => (shape, false),
                };
                let (shape, overflow) = match shape.strip_suffix("_overflow") {
                    Some(x) => (x, true),
                    None => (shape, false),
                };
                let parsed = shape.strip_suffix('d').and_then(|x| x.split_once('p'));
                let Some((Ok(prefill), Ok(decode))) = parsed.map(|(p, d)| (p.parse(), d.parse())) else {
                    bail!("mode {s:?}: expected {kind}_<P>p<D>d, e.g. {kind}_1p3d");
                };
                ensure!(prefill > 0 && decode > 0, "mode {s:?}: at least one prefill and one decode worker");
                Frontend::Pd { prefill, decode, conditional: kind == "conditional", filter_legs, overflow }
            }
            _ => match s.strip_prefix("sglang_") {
                Some(p @ ("cache_aware" | "round_robin" | "power_of_two" | "random")) => Frontend::Sglang(p.into()),
                _ => bail!(
                    "unknown mode {s:?} (expected kv, kv_true_constants, kv_no_speculation, kv_tier_blind, kv_lasting_load, kv_overload, kv_end_reports, approx, least_load, round_robin, random, sglang_cache_aware, dynamo, dynamo_round_robin, disaggregated_<P>p<D>d, conditional_<P>p<D>d[_overflow] or conditional_both, with _filter for the filter's own legs)"
                ),
            },
        })
    }
}

/// The filter's report flush period for a fleet at `speedup`: a second of
/// simulated time, as the filter's default of 1 s is at a real speed of 1×
/// (a wall-clock second would be 8 simulated seconds at 8×, as long as a
/// DOKS turn's decode).
pub fn report_interval_ms(speedup: f64) -> u32 {
    (1000.0 / speedup).round().clamp(10.0, 1000.0) as u32
}

/// `[models.disaggregation]` of a conditional mode: the control plane's own
/// default (100 ms of local prefill) in the wall-clock time it learns in,
/// then the run's `--disagg` settings.
fn conditional_lines(fleet: &FleetSpec) -> Vec<String> {
    let mut lines = vec![format!("max_local_prefill_ms = {:?}", (100.0 / fleet.speedup).max(1.0))];
    lines.extend(fleet.disagg_settings.iter().cloned());
    lines
}

/// What the control plane of a P/D mode is told: the fleet, who runs the
/// legs, and a `[models.disaggregation]` table of `lines`.
fn disaggregation_told(fleet: &FleetSpec, filter_legs: bool, lines: Vec<String>) -> FleetSpec {
    let mut told = fleet.clone();
    told.filter_legs = filter_legs;
    told.kv_settings.push("[models.disaggregation]".into());
    told.kv_settings.extend(lines);
    told
}

/// A running stack.
pub struct Stack {
    /// Where clients send OpenAI requests.
    pub front: SocketAddr,
    /// Each worker's OpenAI address (for `/metrics`; a decode worker's
    /// P/D sidecar, which passes `/metrics` through).
    pub workers: Vec<SocketAddr>,
    /// Each worker's engine (its OpenAI address without a sidecar).
    pub engines: Vec<SocketAddr>,
    /// The control plane's admin address (kvgate modes).
    pub cp_admin: Option<SocketAddr>,
    /// `(role, pid)` of every process, for CPU accounting.
    pub pids: Vec<(String, u32)>,
    /// Logs and configs.
    pub dir: PathBuf,
    // Dropped in reverse start order: the frontend first.
    procs: Vec<Proc>,
    envoy: Option<Envoy>,
    _nats: Option<NatsServer>,
}

impl Drop for Stack {
    fn drop(&mut self) {
        self.envoy.take();
        while let Some(mut p) = self.procs.pop() {
            p.kill();
        }
    }
}

fn tool_path(var: &str, fallback: &str) -> PathBuf {
    std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| repo_root().join(fallback))
}

/// The `kvgate` binary: `KVGATE_BIN`, else the release build.
pub fn kvgate_bin() -> PathBuf {
    tool_path("KVGATE_BIN", "target/release/kvgate")
}

/// The tokenizer directory that scripts/setup.sh prepares.
pub fn tokenizer_dir() -> PathBuf {
    tool_path("KVGATE_TOKENIZER_DIR", ".tools/models/deepseek-v3")
}

/// The sglang-router launcher.
pub fn sglang_router_bin() -> PathBuf {
    tool_path("KVGATE_SGLANG_ROUTER", ".tools/bin/sglang-router")
}

fn kvgate(bin: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(bin);
    c.args(args);
    c
}

pub(crate) fn wait_until(what: &str, secs: u64, mut f: impl FnMut() -> Result<bool>) -> Result<()> {
    let t = Instant::now();
    loop {
        if f()? {
            return Ok(());
        }
        ensure!(t.elapsed() < Duration::from_secs(secs), "timed out after {secs} s waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Stack {
    /// Starts the fleet and `front` in a fresh `dir`.
    pub fn start(dir: &Path, fleet: &FleetSpec, front: &Frontend) -> Result<Stack> {
        std::fs::create_dir_all(dir)?;
        if let Frontend::Dynamo(router_mode) = front {
            return Stack::start_dynamo(dir, fleet, router_mode);
        }
        let bin = &fleet.kvgate;
        ensure!(bin.exists(), "{} not built: run `cargo build --release -p kvgate`", bin.display());
        let tk = tokenizer_dir();
        let tk = tk.to_str().context("tokenizer dir is not UTF-8")?.to_owned();
        let mut procs = Vec::new();
        let mut pids = Vec::new();
        let (block, speedup) = (fleet.block_size.to_string(), fleet.speedup.to_string());
        let seqs = fleet.max_num_seqs.to_string();
        let (batched, interval) = (fleet.max_num_batched_tokens.to_string(), fleet.stream_interval.to_string());
        let host_blocks = fleet.host_blocks.to_string();
        let mut workers = Vec::new();
        let mut zmq = Vec::new();
        for (w, (timing, blocks)) in fleet.kinds().into_iter().enumerate() {
            let blocks = blocks.to_string();
            // The worker picks and holds its ports itself and names them.
            let sim = kvgate(
                bin,
                &[
                    "sim",
                    "--workers",
                    "1",
                    "--model",
                    MODEL,
                    "--tokenizer-dir",
                    &tk,
                    "--http-port",
                    "0",
                    "--zmq-port",
                    "any",
                    "--timing",
                    &timing,
                    "--block-size",
                    &block,
                    "--num-blocks",
                    &blocks,
                    "--max-num-seqs",
                    &seqs,
                    "--max-num-batched-tokens",
                    &batched,
                    "--speedup",
                    &speedup,
                    "--stream-interval",
                    &interval,
                    "--default-max-tokens",
                    "830",
                    "--host-blocks",
                    &host_blocks,
                    // Tokenizing a long prompt must not stall the engine's steps
                    // (a real vLLM tokenizes in its API server process).
                    "--threads",
                    "2",
                ],
            );
            let (p, bound) = spawn_sim(&format!("sim-{w}"), sim, dir)?;
            pids.push((format!("sim-{w}"), p.pid()));
            procs.push(p);
            workers.push(bound.http);
            zmq.push(bound.zmq_port.context("the sim publishes no KV events")?);
        }
        let mut stack = Stack {
            front: workers[0],
            engines: workers.clone(),
            workers,
            cp_admin: None,
            pids,
            dir: dir.to_owned(),
            procs,
            envoy: None,
            _nats: None,
        };
        let no_roles: &[&str] = &[];
        match front {
            Frontend::Kvgate(mode) => stack.start_kvgate(fleet, mode, &tk, &zmq, no_roles)?,
            Frontend::Sglang(policy) => stack.start_sglang(policy)?,
            Frontend::KvTrueConstants => {
                let mut told = fleet.clone();
                told.kv_settings.extend(fleet.true_constants()?);
                stack.start_kvgate(&told, "kv", &tk, &zmq, no_roles)?
            }
            Frontend::KvNoSpeculation => {
                let mut told = fleet.clone();
                told.kv_settings.extend(NO_SPECULATION.iter().map(|l| (*l).to_owned()));
                stack.start_kvgate(&told, "kv", &tk, &zmq, no_roles)?
            }
            Frontend::KvTierBlind => {
                let mut told = fleet.clone();
                told.kv_settings.push(TIER_BLIND.to_owned());
                stack.start_kvgate(&told, "kv", &tk, &zmq, no_roles)?
            }
            Frontend::KvLastingLoad => {
                let mut told = fleet.clone();
                told.kv_settings.push(LASTING_LOAD.to_owned());
                stack.start_kvgate(&told, "kv", &tk, &zmq, no_roles)?
            }
            Frontend::KvEndReports => {
                let told = FleetSpec { end_reports_only: true, ..fleet.clone() };
                stack.start_kvgate(&told, "kv", &tk, &zmq, no_roles)?
            }
            Frontend::KvOverload => {
                let mut told = fleet.clone();
                // A table after `[models.kv]`'s lines (TOML allows it).
                told.kv_settings.extend(OVERLOAD.iter().map(|l| (*l).to_owned()));
                told.filter_timeout_ms = OVERLOAD_FILTER_TIMEOUT_MS;
                stack.start_kvgate(&told, "kv", &tk, &zmq, no_roles)?
            }
            Frontend::Pd { prefill, decode, conditional, filter_legs, overflow } => {
                let n = stack.workers.len();
                ensure!(prefill + decode == n, "mode {}: {n} workers in the fleet", front.name());
                let roles: Vec<&str> = (0..n).map(|w| if w < *prefill { "prefill" } else { "decode" }).collect();
                if !filter_legs {
                    stack.start_sidecars(fleet, &roles)?;
                }
                let mut lines = match conditional {
                    true => conditional_lines(fleet),
                    false => vec!["min_uncached_tokens = 1".into(), "only_if_sooner = false".into()],
                };
                if *overflow {
                    lines.push("overflow_to_prefill = true".into());
                }
                stack.start_kvgate(&disaggregation_told(fleet, *filter_legs, lines), "kv", &tk, &zmq, &roles)?
            }
            Frontend::PdBoth { filter_legs } => {
                let roles = vec!["both"; stack.workers.len()];
                if !filter_legs {
                    stack.start_sidecars(fleet, &roles)?;
                }
                let mut lines = conditional_lines(fleet);
                lines.push("prefill_on_both = true".into());
                stack.start_kvgate(&disaggregation_told(fleet, *filter_legs, lines), "kv", &tk, &zmq, &roles)?
            }
            Frontend::Dynamo(_) => bail!("the dynamo modes have their own workers (Stack::start_dynamo)"),
        }
        Ok(stack)
    }

    /// A `kvgate pd-sidecar` in front of every `decode` or `both` worker: it
    /// becomes the worker's address (its engine stays in `engines`).
    fn start_sidecars(&mut self, fleet: &FleetSpec, roles: &[&str]) -> Result<()> {
        for (w, role) in roles.iter().enumerate() {
            if *role == "prefill" {
                continue;
            }
            let front = SocketAddr::from(([127, 0, 0, 1], free_port()?));
            let (listen, decode) = (front.to_string(), self.engines[w].to_string());
            let sc = kvgate(&fleet.kvgate, &["pd-sidecar", "--listen", &listen, "--decode", &decode]);
            let p = Proc::spawn(&format!("pd-sidecar-{w}"), sc, &self.dir)?;
            self.pids.push((format!("pd-sidecar-{w}"), p.pid()));
            self.procs.push(p);
            wait_for_tcp(front, Duration::from_secs(30)).with_context(|| format!("pd-sidecar {w}"))?;
            self.workers[w] = front;
        }
        Ok(())
    }

    /// `roles[w]` (when given) is worker `w`'s relay `--role`.
    fn start_kvgate(&mut self, fleet: &FleetSpec, mode: &str, tk: &str, zmq: &[u16], roles: &[&str]) -> Result<()> {
        let nats = NatsServer::start(&self.dir)?;
        self.pids.push(("nats".into(), nats.proc.pid()));
        let nats_url = format!("nats://127.0.0.1:{}", nats.port);
        self._nats = Some(nats);
        let block = fleet.block_size.to_string();
        for (w, (&addr, &zp)) in self.workers.iter().zip(zmq).enumerate() {
            let id = format!("w{w}");
            let spec = RelaySpec {
                zmq_port: zp,
                worker: addr,
                worker_id: &id,
                nats_url: &nats_url,
                model: MODEL,
                block_size: fleet.block_size,
                max_num_seqs: fleet.max_num_seqs,
                data_parallel_size: 1,
                heartbeat_ms: 200,
            };
            let mut args = spec.args();
            // The engine's metrics (a decode worker's address is its sidecar).
            if let Some(i) = args.iter().position(|a| a == "--metrics-url") {
                args[i + 1] = format!("http://{}/metrics", self.engines[w]);
            }
            if let Some(role) = roles.get(w) {
                args.extend(["--role".to_owned(), (*role).to_owned()]);
            }
            let mut relay = Command::new(&fleet.kvgate);
            relay.args(args);
            let p = Proc::spawn(&format!("relay-{w}"), relay, &self.dir)?;
            self.pids.push((format!("relay-{w}"), p.pid()));
            self.procs.push(p);
        }
        // One model, from a file (the only way to give `[models.kv]`).
        let mut toml = format!(
            "[[models]]\nname = {MODEL:?}\ntokenizer_dir = {tk:?}\nblock_size = {block}\nmode = {mode:?}\n[models.kv]\n"
        );
        for kv in &fleet.kv_settings {
            toml.push_str(kv);
            toml.push('\n');
        }
        let cp_config = self.dir.join("control-plane.toml");
        std::fs::write(&cp_config, toml)?;
        let cp_config = cp_config.to_str().context("run dir is not UTF-8")?.to_owned();
        // Port 0: the control plane binds and reports its addresses.
        let mut serve = kvgate(
            &fleet.kvgate,
            &[
                "serve",
                "--config",
                &cp_config,
                "--nats-url",
                &nats_url,
                "--listen-grpc",
                "127.0.0.1:0",
                "--listen-admin",
                "127.0.0.1:0",
                "--replica-id",
                "bench",
            ],
        );
        // KVGATE_TOKENIZER_DIR (for the simulator) is not the control
        // plane's: the file names the model's tokenizer.
        serve.env_remove("KVGATE_TOKENIZER_DIR");
        let (p, addrs) = spawn_serve("serve", serve, &self.dir)?;
        self.pids.push(("control-plane".into(), p.pid()));
        self.procs.push(p);
        let (grpc, admin) = (addrs.grpc.to_string(), addrs.admin);
        let n = self.workers.len();
        wait_until("every worker live in the control plane", 60, || {
            let r = http_request(admin, "GET", "/admin/workers", &[], b"")?;
            let v: serde_json::Value = serde_json::from_slice(&r.body)?;
            Ok(v[MODEL].as_array().is_some_and(|a| a.len() == n && a.iter().all(|w| w["live"] == true)))
        })?;
        self.cp_admin = Some(admin);
        // Debug headers: the client records each decision's reason and
        // matched blocks (for the `mispredicted` count).
        let reports = serde_json::json!({
            "interval_ms": report_interval_ms(fleet.speedup),
            "first_token": !fleet.end_reports_only,
        });
        let mut filter = serde_json::json!({"control_plane": {"timeout_ms": fleet.filter_timeout_ms},
                                            "debug_headers": true, "reports": reports});
        if fleet.filter_legs {
            // The sidecar's own default timeout (30 s).
            filter["disaggregation"] = serde_json::json!({"legs": "filter", "timeout_ms": 30_000});
        }
        let filter = filter.to_string();
        let config = self.dir.join("envoy.yaml");
        std::fs::write(&config, render_kvgate_envoy(0, 0, &self.workers, &[grpc.parse()?], &filter)?)?;
        let envoy = Envoy::start(&config, &self.dir)?;
        self.front = envoy.listen;
        self.pids.push(("envoy".into(), envoy.proc.pid()));
        self.envoy = Some(envoy);
        Ok(())
    }

    /// Dynamo 1.6.1's mocker (`fleet.workers` workers in one process, the
    /// fleet's KV blocks, block size, batch limits and speedup; its own
    /// published timing, which the `dynamo-mocker` preset implements) and
    /// its frontend with `--router-mode router_mode`: file discovery, the
    /// TCP request plane, the ZMQ event plane. Both bind sockets on
    /// 0.0.0.0, so this runs only inside a network namespace whose only
    /// interface is loopback ([`only_loopback`]).
    fn start_dynamo(dir: &Path, fleet: &FleetSpec, router_mode: &str) -> Result<Stack> {
        ensure!(
            only_loopback(),
            "the dynamo modes bind 0.0.0.0: run the benchmark inside a private network namespace \
             (`make bench-cache-pressure` does: unshare -n with loopback up)"
        );
        ensure!(
            fleet.timing == "dynamo-mocker" && fleet.extra.is_empty(),
            "the dynamo modes run Dynamo's own mocker: use --preset dynamo-mocker (not {})",
            fleet.preset
        );
        let python = dynamo_python();
        ensure!(python.exists(), "{} not installed: run scripts/setup-dynamo.sh", python.display());
        let model = tool_path("KVGATE_DYNAMO_MODEL_DIR", ".tools/models/dynamo-mocker");
        let model = model.to_str().context("model dir is not UTF-8")?.to_owned();
        let store = dir.join("dynamo-discovery");
        let _ = std::fs::remove_dir_all(&store);
        std::fs::create_dir_all(&store)?;
        let env = |c: &mut Command| {
            c.env("DYN_FILE_KV", &store).env("DYN_LOG", "warn").env("HF_HUB_OFFLINE", "1");
        };
        let planes = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"];
        let mut mocker = Command::new(&python);
        mocker.args(["-m", "dynamo.mocker", "--model-path", &model, "--model-name", MODEL]);
        mocker.args(["--num-workers", &fleet.workers.to_string()]);
        mocker.args(["--num-gpu-blocks-override", &fleet.num_blocks.to_string()]);
        mocker.args(["--block-size", &fleet.block_size.to_string()]);
        mocker.args(["--max-num-seqs", &fleet.max_num_seqs.to_string()]);
        mocker.args(["--max-num-batched-tokens", &fleet.max_num_batched_tokens.to_string()]);
        mocker.args(["--speedup-ratio", &fleet.speedup.to_string()]);
        mocker.args(planes);
        env(&mut mocker);
        let mp = Proc::spawn("dynamo-mocker", mocker, dir)?;
        let port = free_port()?;
        let mut frontend = Command::new(&python);
        frontend.args(["-m", "dynamo.frontend", "--router-mode", router_mode]);
        frontend.args(["--http-host", "127.0.0.1", "--http-port", &port.to_string()]);
        frontend.args(["--kv-cache-block-size", &fleet.block_size.to_string()]);
        frontend.args(planes);
        env(&mut frontend);
        let fp = Proc::spawn("dynamo-frontend", frontend, dir)?;
        let front = SocketAddr::from(([127, 0, 0, 1], port));
        let mut stack = Stack {
            front,
            workers: Vec::new(),
            engines: Vec::new(),
            cp_admin: None,
            pids: vec![("dynamo-mocker".into(), mp.pid()), ("dynamo-frontend".into(), fp.pid())],
            dir: dir.to_owned(),
            procs: vec![mp, fp],
            envoy: None,
            _nats: None,
        };
        // Every worker registered: the file store holds one instance per
        // worker endpoint; then a request must come back.
        let n = fleet.workers;
        wait_until("Dynamo's workers registered", 120, || {
            stack.check()?;
            Ok(dynamo_instances(&store) >= n
                && http_request(front, "GET", "/v1/models", &[], b"")
                    .is_ok_and(|r| r.status == 200 && String::from_utf8_lossy(&r.body).contains(MODEL)))
        })?;
        let body = crate::runner::chat_body(&[("user", "ready?".to_owned())], 2);
        wait_until("Dynamo's frontend to answer", 60, || {
            stack.check()?;
            Ok(http_request(front, "POST", "/v1/chat/completions", &[("content-type", "application/json")], &body)
                .is_ok_and(|r| r.status == 200))
        })?;
        Ok(stack)
    }

    fn start_sglang(&mut self, policy: &str) -> Result<()> {
        let (p, front) = spawn_sglang(&self.workers, &self.dir, policy)?;
        self.pids.push(("sglang-router".into(), p.pid()));
        self.procs.push(p);
        self.front = front;
        wait_until("sglang-router to route", 60, || {
            self.check()?;
            Ok(http_request(front, "GET", "/v1/models", &[], b"").is_ok_and(|r| r.status == 200))
        })
    }

    /// Polls the control plane's `/admin/timing` every `interval` on a
    /// thread of its own until [`TimingPolls::finish`]; `None` for a mode
    /// without a kvgate control plane.
    pub fn poll_timing(&self, interval: Duration) -> Option<TimingPolls> {
        let admin = self.cp_admin?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let (t0, mut polls) = (Instant::now(), Vec::new());
            while !stopped.load(Ordering::Relaxed) {
                if let Ok(v) = get_json(admin, "/admin/timing") {
                    polls.push(serde_json::json!({"t": t0.elapsed().as_secs_f64(), "timing": v}));
                }
                std::thread::sleep(interval);
            }
            polls
        });
        Some(TimingPolls { stop, thread })
    }

    /// Saves the control plane's own view (its metrics and workers) and
    /// Envoy's kvgate stats into `dir`, for diagnosis. Best effort.
    pub fn save_diagnostics(&self, dir: &Path) {
        if let Some(admin) = self.cp_admin {
            for (path, file) in [
                ("/metrics", "control-plane-metrics.txt"),
                ("/admin/workers", "workers.json"),
                ("/admin/timing", "timing.json"),
            ] {
                if let Ok(r) = http_request(admin, "GET", path, &[], b"") {
                    let _ = std::fs::write(dir.join(file), r.body);
                }
            }
        }
        if let Some(e) = &self.envoy
            && let Ok(r) = http_request(e.admin, "GET", "/stats?filter=kvgate", &[], b"")
        {
            let _ = std::fs::write(dir.join("envoy-kvgate-stats.txt"), r.body);
        }
    }

    /// Fails with the log of the first process that exited.
    pub fn check(&mut self) -> Result<()> {
        for p in &mut self.procs {
            p.ensure_running()?;
        }
        Ok(())
    }
}

/// The Python of the Dynamo install (scripts/setup-dynamo.sh).
pub fn dynamo_python() -> PathBuf {
    tool_path("KVGATE_DYNAMO_PYTHON", ".tools/dynamo/bin/python")
}

/// Whether this process's network namespace has no interface but loopback
/// (a private namespace made with `unshare -n`). `/proc/self/net/dev` is
/// the namespace's own list (`/sys/class/net` is the mount's).
pub fn only_loopback() -> bool {
    std::fs::read_to_string("/proc/self/net/dev")
        .is_ok_and(|t| t.lines().skip(2).filter_map(|l| l.split(':').next()).all(|name| name.trim() == "lo"))
}

/// `generate` endpoints registered in Dynamo's file discovery store (one
/// per worker, in `v1/instances`, names URL-encoded).
fn dynamo_instances(store: &Path) -> usize {
    std::fs::read_dir(store.join("v1/instances")).map_or(0, |d| {
        d.filter_map(|e| e.ok()).filter(|e| e.file_name().to_string_lossy().contains("%2Fgenerate%2F")).count()
    })
}

/// Starts sglang-router with `policy` in front of `workers`; returns the
/// process and its address (not yet waited for).
pub fn spawn_sglang(workers: &[SocketAddr], dir: &Path, policy: &str) -> Result<(Proc, SocketAddr)> {
    let bin = sglang_router_bin();
    ensure!(bin.exists(), "{} not installed: run scripts/setup.sh", bin.display());
    let port = free_port()?;
    let mut cmd = Command::new(bin);
    cmd.args(["launch", "--host", "127.0.0.1", "--port", &port.to_string(), "--policy", policy]);
    cmd.arg("--worker-urls");
    for w in workers {
        cmd.arg(format!("http://{w}"));
    }
    // No retries or circuit breaking: a failed request is an error to
    // count. (Envoy in the kvgate modes retries only requests that could
    // not reach their worker: connect failures, refused streams, resets
    // before headers, which a healthy fleet does not produce.)
    cmd.args(["--disable-retries", "--disable-circuit-breaker", "--log-level", "warn"]);
    cmd.args(["--prometheus-port", &free_port()?.to_string(), "--prometheus-host", "127.0.0.1"]);
    let p = Proc::spawn(&format!("sglang-router-{policy}"), cmd, dir)?;
    Ok((p, ([127, 0, 0, 1], port).into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_mode_name_parses_back_and_bad_shapes_are_refused() {
        for name in [
            "kv",
            "round_robin",
            "kv_overload",
            "sglang_cache_aware",
            "dynamo",
            "dynamo_round_robin",
            "disaggregated_1p3d",
            "conditional_2p2d",
            "conditional_1p3d_filter",
            "conditional_both",
            "conditional_both_filter",
            "conditional_2p2d_overflow",
            "conditional_2p2d_overflow_filter",
        ] {
            assert_eq!(Frontend::parse(name).unwrap().name(), name);
        }
        assert_eq!(
            Frontend::parse("disaggregated_1p3d").unwrap(),
            Frontend::Pd { prefill: 1, decode: 3, conditional: false, filter_legs: false, overflow: false }
        );
        assert_eq!(
            Frontend::parse("conditional_2p2d_overflow").unwrap(),
            Frontend::Pd { prefill: 2, decode: 2, conditional: true, filter_legs: false, overflow: true }
        );
        assert_eq!(
            Frontend::parse("conditional_2p2d_filter").unwrap(),
            Frontend::Pd { prefill: 2, decode: 2, conditional: true, filter_legs: true, overflow: false }
        );
        for bad in [
            "disaggregated_",
            "disaggregated_1p",
            "conditional_0p4d",
            "conditional_xpyd",
            "pd",
            "conditional_1p3d_sidecar",
            "conditional_2p2d_filter_overflow",
        ] {
            assert!(Frontend::parse(bad).is_err(), "{bad}");
        }
    }
}
