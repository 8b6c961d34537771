//! `/metrics` in vLLM's exposition: its metric names, labels and float
//! formatting (`1.0`), which the relay and the benchmark read as they read
//! vLLM's. Hand-written on purpose (docs/DECISIONS.md, #21): a metrics
//! library writes its own format, and this endpoint's job is to look like
//! vLLM's.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;

use super::Shared;

/// Fixed-bucket histogram in vLLM's exposition shape.
#[derive(Debug, Clone)]
pub(super) struct Hist {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    n: u64,
}

const TTFT_BUCKETS: &[f64] =
    &[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
const ITL_BUCKETS: &[f64] =
    &[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
const QUEUE_BUCKETS: &[f64] = &[0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0];
/// vLLM's request latency buckets (`vllm:request_prefill_time_seconds`).
const REQUEST_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
];
/// vLLM's request token buckets (1, 2, 5 times powers of ten).
const TOKEN_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0, 50000.0, 100000.0,
];

impl Hist {
    fn new(bounds: &'static [f64]) -> Self {
        Self { bounds, counts: vec![0; bounds.len()], sum: 0.0, n: 0 }
    }
    pub(super) fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.n += 1;
    }
    /// The samples (buckets, count, sum) under `labels`; the family's
    /// `# TYPE` line is written once by the caller.
    fn render(&self, out: &mut String, name: &str, labels: &str) {
        use std::fmt::Write as _;
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cum += c;
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b:?}\"}} {cum}.0");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}.0", self.n);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}.0", self.n);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
    }
}

/// What `/metrics` shows; updated by the engine task after every step.
#[derive(Debug, Clone)]
pub(super) struct Stats {
    pub(super) running: usize,
    pub(super) waiting: usize,
    pub(super) kv_usage: f64,
    pub(super) queries: u64,
    pub(super) hits: u64,
    /// Prompt tokens loaded back from the host tier.
    pub(super) host_hits: u64,
    pub(super) prompt_tokens: u64,
    pub(super) generation_tokens: u64,
    pub(super) success: u64,
    pub(super) ttft: Hist,
    pub(super) itl: Hist,
    pub(super) queue: Hist,
    /// Scheduled to first token, per finished request.
    pub(super) prefill: Hist,
    /// Prompt tokens computed (not cached), per finished request.
    pub(super) prefill_computed: Hist,
    pub(super) steps: u64,
    pub(super) events_published: u64,
    pub(super) cached_blocks: usize,
    /// Context tokens the decoding requests of the last step that decoded
    /// attended over (the simulator's own; vLLM has no such series).
    pub(super) decode_context_tokens: usize,
}

impl Stats {
    pub(super) fn new() -> Self {
        Self {
            running: 0,
            waiting: 0,
            kv_usage: 0.0,
            queries: 0,
            hits: 0,
            host_hits: 0,
            prompt_tokens: 0,
            generation_tokens: 0,
            success: 0,
            ttft: Hist::new(TTFT_BUCKETS),
            itl: Hist::new(ITL_BUCKETS),
            queue: Hist::new(QUEUE_BUCKETS),
            prefill: Hist::new(REQUEST_BUCKETS),
            prefill_computed: Hist::new(TOKEN_BUCKETS),
            steps: 0,
            events_published: 0,
            cached_blocks: 0,
            decode_context_tokens: 0,
        }
    }
}

/// Which histogram of a rank's stats.
type HistOf = fn(&Stats) -> &Hist;

/// Every rank's series, one family at a time (vLLM labels each rank's
/// series `engine="<rank>"`).
pub(super) async fn metrics(State(sh): State<Arc<Shared>>) -> impl IntoResponse {
    use std::fmt::Write as _;
    let ranks: Vec<Stats> = sh.ranks.iter().map(|r| r.stats.lock().clone()).collect();
    let o = &sh.opts;
    let model = o.model.replace('"', "\\\"");
    let labels: Vec<String> = (0..ranks.len()).map(|r| format!("engine=\"{r}\",model_name=\"{model}\"")).collect();
    let mut s = String::with_capacity(8192 * ranks.len());
    let family = |s: &mut String, name: &str, help: &str, kind: &str, v: &dyn Fn(&Stats) -> String| {
        let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (st, l) in ranks.iter().zip(&labels) {
            let _ = writeln!(s, "{name}{{{l}}} {}", v(st));
        }
    };
    let gauge = |s: &mut String, name: &str, help: &str, v: fn(&Stats) -> f64| {
        family(s, name, help, "gauge", &|st| format!("{:?}", v(st)));
    };
    let counter = |s: &mut String, name: &str, help: &str, v: fn(&Stats) -> u64| {
        family(s, name, help, "counter", &|st| format!("{}.0", v(st)));
    };
    gauge(&mut s, "vllm:num_requests_running", "Number of requests in model execution batches.", |st| {
        st.running as f64
    });
    gauge(&mut s, "vllm:num_requests_waiting", "Number of requests waiting to be processed.", |st| st.waiting as f64);
    gauge(&mut s, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", |st| st.kv_usage);
    gauge(
        &mut s,
        "kvgate_sim_decode_context_tokens",
        "Context tokens the decoding requests of the last decoding step attended over (simulator only).",
        |st| st.decode_context_tokens as f64,
    );
    counter(
        &mut s,
        "vllm:prefix_cache_queries_total",
        "Prefix cache queries, in terms of number of queried tokens.",
        |st| st.queries,
    );
    counter(&mut s, "vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.", |st| {
        st.hits
    });
    counter(
        &mut s,
        "vllm:external_prefix_cache_hits_total",
        "External prefix cache hits (KV connector: the host tier), in terms of number of cached tokens.",
        |st| st.host_hits,
    );
    counter(&mut s, "vllm:prompt_tokens_total", "Number of prefill tokens processed.", |st| st.prompt_tokens);
    counter(&mut s, "vllm:generation_tokens_total", "Number of generation tokens processed.", |st| {
        st.generation_tokens
    });
    let _ = writeln!(
        s,
        "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter"
    );
    for (st, l) in ranks.iter().zip(&labels) {
        let _ = writeln!(s, "vllm:request_success_total{{{l},finished_reason=\"length\"}} {}.0", st.success);
    }
    let _ = writeln!(
        s,
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge"
    );
    for r in 0..ranks.len() {
        let _ = writeln!(
            s,
            "vllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"{r}\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{}\",prefix_caching_hash_algo=\"sha256\"}} 1.0",
            o.engine.block_size, o.engine.num_blocks
        );
    }
    let hists: [(&str, &str, HistOf); 5] = [
        ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", |st| &st.ttft),
        ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", |st| &st.itl),
        ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", |st| &st.queue),
        ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", |st| {
            &st.prefill
        }),
        (
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            |st| &st.prefill_computed,
        ),
    ];
    for (name, help, h) in hists {
        let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (st, l) in ranks.iter().zip(&labels) {
            h(st).render(&mut s, name, l);
        }
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], s)
}
