//! How long an engine step takes, by preset.
//!
//! A step runs every running request's next decode token plus a budget of
//! prefill tokens (chunked prefill), as vLLM's scheduler does; its time is a
//! function of the step's [`StepShape`].
//!
//! | preset | step time |
//! |---|---|
//! | `h200-llama70b-fp8` | `13 ms + 0.65 ms × decode_seqs + 0.08 ms × prefill_tokens` |
//! | `dynamo-mocker` | `decode(p) + prefill(T)`: prefill ms = 4.21e-7·T² + 0.01518·T + 16.5 when T > 0; decode ms = max(1, −25.74·p² + 54.01·p + 5.74) for KV fill fraction p |
//! | `vllm-v1` | Llama-3.1-8B BF16 on one H100 SXM 80 GB, from the roofline below |
//! | `vllm-v1-a100` | the same model on one A100 SXM 40 GB |
//!
//! Every preset also has a [`Timing::first_token_overhead_ms`]: time
//! before the engine sees a request (frontend), added by the simulated
//! worker before submission.
//!
//! `h200-llama70b-fp8` is calibrated on the DOKS demo (REFERENCE-RESULTS.md §A:
//! 3× H200, Llama-3.1-70B FP8, max batch 64). Inter-token latency was ~26 ms at ~20
//! running requests and ~52 ms near 60, which fixes 13 ms + 0.65 ms per
//! sequence. Prefill at ~12.5 K tokens/s (0.08 ms/token) is an assumption of
//! this preset: with ~90 % prefix hits on 4–7 K-token prompts it gives time-to-first-token
//! of a few hundred ms at the published concurrencies. `tests/timing.rs` checks
//! the calibration points. `dynamo-mocker` is Dynamo's published model
//! (REFERENCE-RESULTS.md §C).
//!
//! # The `vllm-v1` presets: a roofline of the model on the GPU
//!
//! vLLM V1's step is one forward pass over the decode tokens and the prefill
//! chunks of the step (the engine's scheduler in `engine.rs`: token budget,
//! decode first, chunked prefill, preemption with recompute). Its time, in
//! the [`Timing::Roofline`] form, is the sum of what each part costs on the
//! GPU's binding resource:
//!
//! ```text
//! step = host + weights/(BW·ηm)                         read every weight once
//!      + decode_seqs × flops_tok/(F·ηc)                 each decode token's matmuls
//!      + decode_ctx_tokens × kv_bytes_tok/(BW·ηm)       each decode token reads its KV (attention)
//!      + prefill_tokens × flops_tok/(F·ηc)              each prefill token's matmuls
//!      + prefill_pairs × flops_pair/(F·ηc)              causal attention: query-key pairs of the chunks
//! ```
//!
//! Model (Llama-3.1-8B, its published `config.json`): 8.03 B parameters in
//! BF16 (16.06 GB), 32 layers, 32 query and 8 key-value heads of dimension
//! 128: `flops_tok` = 2 × 8.03e9, KV per token `kv_bytes_tok` = 2 (K, V) × 32
//! × 8 × 128 × 2 B = 131,072 B, attention per query-key pair `flops_pair` =
//! 4 × 32 layers × 32 heads × 128 = 524,288 FLOP. GPUs (NVIDIA datasheets):
//! H100 SXM 3.35 TB/s HBM3, 989 TFLOPS dense BF16; A100 SXM 40 GB 1.555 TB/s,
//! 312 TFLOPS. Assumed efficiencies: ηm = 0.7 of peak bandwidth, ηc = 0.5 of
//! peak FLOPS, and `host` = 2 ms per step (scheduling, sampling, launch).
//! Neither the model nor the GPUs are the ones the router's defaults or
//! tests were written against, and the form (attention that grows with
//! context, per step) is not the router's cost formula.
//!
//! On `vllm-v1` a cold 7,000-token prompt prefills in one step of ~262 ms
//! (9 ms fixed, 227 ms of matmuls, 26 ms of attention); 60 requests decoding
//! at 6 K tokens of context take ~31 ms per step (20 ms of it reading KV).
//! `vllm-v1-a100` is ~3.1× slower to prefill and ~2.1× slower to decode.

/// A timing model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Timing {
    /// Linear in decode sequences and prefill tokens.
    Linear {
        /// Fixed cost of a step, ms.
        base_ms: f64,
        /// Per decoding sequence, ms.
        per_seq_ms: f64,
        /// Per prefill token, ms.
        per_prefill_token_ms: f64,
    },
    /// Dynamo's mocker formulas.
    DynamoMocker,
    /// A roofline: fixed, per decode token, per token of decode context,
    /// per prefill token, per million prefill query-key pairs (see the
    /// module comment).
    Roofline {
        /// Fixed cost of a step (weights read once, host work), ms.
        base_ms: f64,
        /// Per decoding sequence, ms.
        per_seq_ms: f64,
        /// Per thousand tokens of decode context (KV read), ms.
        per_decode_ktok_ms: f64,
        /// Per prefill token, ms.
        per_prefill_token_ms: f64,
        /// Per million prefill query-key pairs (attention), ms.
        per_prefill_mpair_ms: f64,
        /// Frontend latency before the engine sees a request, ms.
        overhead_ms: f64,
    },
}

/// A quadratic `a·x² + b·x + c`, the shape of `dynamo-mocker`'s formulas.
#[derive(Debug, Clone, Copy)]
struct Quadratic {
    a: f64,
    b: f64,
    c: f64,
}

impl Quadratic {
    /// The value at `x`.
    fn at(self, x: f64) -> f64 {
        self.a * x * x + self.b * x + self.c
    }

    /// The slope at `x`, `2a·x + b`.
    fn slope(self, x: f64) -> f64 {
        2.0 * self.a * x + self.b
    }
}

/// `dynamo-mocker`'s prefill step in ms for `T` new tokens.
const DM_PREFILL: Quadratic = Quadratic { a: 4.21e-7, b: 0.01518, c: 16.5 };
/// `dynamo-mocker`'s decode step in ms at KV fill `p`.
const DM_DECODE: Quadratic = Quadratic { a: -25.74, b: 54.01, c: 5.74 };

/// Where a preset's marginal costs are read ([`Timing::linear_equivalent`]):
/// a workload's typical prompt and decode on one worker.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OperatingPoint {
    /// Tokens of context already computed before a prefill chunk.
    pub context: f64,
    /// New tokens of the chunk.
    pub chunk: f64,
    /// Tokens of KV a decoding request holds and reads.
    pub decode_context: f64,
    /// Decoding requests on the worker.
    pub running: f64,
    /// The worker's KV cache, tokens.
    pub capacity_tokens: f64,
}

/// What a step computed: the input of every timing model.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepShape {
    /// Requests that decoded a token.
    pub decode_seqs: usize,
    /// Tokens of context those requests attended to (prompt + generated).
    pub decode_context_tokens: usize,
    /// Prompt tokens prefilled.
    pub prefill_tokens: usize,
    /// Query-key pairs of the prefill chunks: a chunk of `n` tokens after
    /// `c` computed ones attends to `n·c + n·(n+1)/2`.
    pub prefill_pairs: f64,
    /// KV fill fraction of the pool.
    pub kv_fill: f64,
}

impl StepShape {
    /// Adds a prefill chunk of `n` tokens after `context` tokens.
    pub fn add_chunk(&mut self, context: usize, n: usize) {
        let (c, n) = (context as f64, n as f64);
        self.prefill_tokens += n as usize;
        self.prefill_pairs += n * c + n * (n + 1.0) / 2.0;
    }
}

/// A GPU's binding resources.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gpu {
    /// Memory bandwidth, bytes/s.
    pub bandwidth: f64,
    /// Dense 16-bit FLOP/s.
    pub flops: f64,
}

/// A model's per-token costs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelShape {
    /// Bytes of weights.
    pub weight_bytes: f64,
    /// FLOPs of the matmuls per token (2 × parameters).
    pub flops_per_token: f64,
    /// KV bytes per token of context.
    pub kv_bytes_per_token: f64,
    /// Attention FLOPs per query-key pair.
    pub flops_per_pair: f64,
}

/// H100 SXM (NVIDIA datasheet).
pub const H100_SXM: Gpu = Gpu { bandwidth: 3.35e12, flops: 989e12 };
/// A100 SXM 40 GB (NVIDIA datasheet).
pub const A100_SXM_40GB: Gpu = Gpu { bandwidth: 1.555e12, flops: 312e12 };
/// Llama-3.1-8B in BF16 (its config.json).
pub const LLAMA31_8B_BF16: ModelShape = ModelShape {
    weight_bytes: 8.03e9 * 2.0,
    flops_per_token: 2.0 * 8.03e9,
    kv_bytes_per_token: 2.0 * 32.0 * 8.0 * 128.0 * 2.0,
    flops_per_pair: 4.0 * 32.0 * 32.0 * 128.0,
};
/// Achieved fraction of peak bandwidth (assumed).
const ETA_MEMORY: f64 = 0.7;
/// Achieved fraction of peak FLOPS (assumed).
const ETA_COMPUTE: f64 = 0.5;
/// Host time per step, ms (assumed).
const HOST_MS: f64 = 2.0;
/// Frontend latency of the `vllm-v1` presets, ms (assumed: tokenizing a
/// few thousand tokens and the first scheduling pass).
const VLLM_FRONTEND_MS: f64 = 30.0;

impl Timing {
    /// The H200 / Llama-3.1-70B FP8 preset.
    pub const H200_LLAMA70B_FP8: Timing =
        Timing::Linear { base_ms: 13.0, per_seq_ms: 0.65, per_prefill_token_ms: 0.08 };

    /// Preset names, for help and errors.
    pub const PRESETS: [&'static str; 4] = ["h200-llama70b-fp8", "dynamo-mocker", "vllm-v1", "vllm-v1-a100"];

    /// A preset by name (see [`Timing::PRESETS`]).
    pub fn preset(name: &str) -> Option<Self> {
        match name {
            "h200-llama70b-fp8" => Some(Self::H200_LLAMA70B_FP8),
            "dynamo-mocker" => Some(Self::DynamoMocker),
            "vllm-v1" => Some(Self::roofline(LLAMA31_8B_BF16, H100_SXM)),
            "vllm-v1-a100" => Some(Self::roofline(LLAMA31_8B_BF16, A100_SXM_40GB)),
            _ => None,
        }
    }

    /// The roofline of `model` on `gpu` (module comment).
    pub fn roofline(model: ModelShape, gpu: Gpu) -> Self {
        let mem_ms = |bytes: f64| bytes / (gpu.bandwidth * ETA_MEMORY) * 1e3;
        let compute_ms = |flops: f64| flops / (gpu.flops * ETA_COMPUTE) * 1e3;
        Timing::Roofline {
            base_ms: HOST_MS + mem_ms(model.weight_bytes),
            per_seq_ms: compute_ms(model.flops_per_token),
            per_decode_ktok_ms: mem_ms(1000.0 * model.kv_bytes_per_token),
            per_prefill_token_ms: compute_ms(model.flops_per_token),
            per_prefill_mpair_ms: compute_ms(1e6 * model.flops_per_pair),
            overhead_ms: VLLM_FRONTEND_MS,
        }
    }

    /// Milliseconds for a step of this shape.
    pub fn step_time(&self, s: &StepShape) -> f64 {
        match *self {
            Timing::Roofline {
                base_ms,
                per_seq_ms,
                per_decode_ktok_ms,
                per_prefill_token_ms,
                per_prefill_mpair_ms,
                overhead_ms: _,
            } => {
                if s.decode_seqs + s.prefill_tokens == 0 {
                    return 0.0;
                }
                base_ms
                    + per_seq_ms * s.decode_seqs as f64
                    + per_decode_ktok_ms * s.decode_context_tokens as f64 / 1000.0
                    + per_prefill_token_ms * s.prefill_tokens as f64
                    + per_prefill_mpair_ms * s.prefill_pairs / 1e6
            }
            _ => self.step_ms(s.decode_seqs, s.prefill_tokens, s.kv_fill),
        }
    }

    /// Milliseconds for a step with `decode_seqs` decoding requests,
    /// `prefill_tokens` new prompt tokens, at KV fill fraction `kv_fill`
    /// (for a roofline: without context, i.e. the first tokens of short
    /// requests).
    pub fn step_ms(&self, decode_seqs: usize, prefill_tokens: usize, kv_fill: f64) -> f64 {
        match *self {
            Timing::Roofline { .. } => {
                let mut s = StepShape { decode_seqs, kv_fill, ..StepShape::default() };
                s.prefill_tokens = prefill_tokens;
                self.step_time(&s)
            }
            Timing::Linear { base_ms, per_seq_ms, per_prefill_token_ms } => {
                base_ms + per_seq_ms * decode_seqs as f64 + per_prefill_token_ms * prefill_tokens as f64
            }
            Timing::DynamoMocker => {
                let prefill = if prefill_tokens > 0 { DM_PREFILL.at(prefill_tokens as f64) } else { 0.0 };
                let p = kv_fill.clamp(0.0, 1.0);
                let decode = if decode_seqs > 0 { DM_DECODE.at(p).max(1.0) } else { 0.0 };
                (prefill + decode).max(if decode_seqs + prefill_tokens > 0 { 1.0 } else { 0.0 })
            }
        }
    }

    /// The preset's marginal costs at an operating point, in the form of
    /// the router's two linear constants: ms each more prefill token of a
    /// chunk adds (a chunk of `op.chunk` tokens after `op.context` computed
    /// ones), and ms each more decoding request adds to a step. A fixed cost
    /// per step (a base, `dynamo-mocker`'s 16.5 ms per prefill step) is not
    /// marginal: every candidate of a choice pays it alike. For the
    /// benchmark's `kv_true_constants` mode, the one place a router is told
    /// a preset.
    ///
    /// A decoding request adds its own token's work and the KV it holds:
    /// `vllm-v1` reads its `op.decode_context` tokens of KV every step;
    /// `dynamo-mocker`'s step grows with the KV fill `p` only, and one more
    /// request adds `op.decode_context / op.capacity_tokens` to it, at the
    /// formula's slope where `op.running` such requests fill the cache.
    pub fn linear_equivalent(&self, op: &OperatingPoint) -> (f64, f64) {
        match *self {
            Timing::Linear { per_seq_ms, per_prefill_token_ms, .. } => (per_prefill_token_ms, per_seq_ms),
            Timing::DynamoMocker => {
                let share = if op.capacity_tokens > 0.0 { op.decode_context / op.capacity_tokens } else { 0.0 };
                let p = (op.running * share).clamp(0.0, 1.0);
                let slope = DM_DECODE.slope(p).max(0.0);
                (DM_PREFILL.slope(op.chunk.max(0.0)), slope * share)
            }
            Timing::Roofline { per_seq_ms, per_decode_ktok_ms, per_prefill_token_ms, per_prefill_mpair_ms, .. } => (
                per_prefill_token_ms + per_prefill_mpair_ms * (op.context + (op.chunk + 1.0) / 2.0) / 1e6,
                per_seq_ms + per_decode_ktok_ms * op.decode_context / 1000.0,
            ),
        }
    }

    /// Latency a request spends before the engine can schedule it (API
    /// server, tokenization, KV block setup), in simulated ms; it does not
    /// occupy the engine. `h200-llama70b-fp8`: 200 ms, fitted so that
    /// TTFT p50 at the DOKS demo's lowest load (60 conversations, ~20 per
    /// worker, ~95 % prefix hits) matches the published 249 ms: with that
    /// many hits the engine's own share of TTFT is ~35 ms
    /// (`tests/calibration.rs`). `dynamo-mocker`: 0 (Dynamo's model has none).
    /// `vllm-v1*`: 30 ms (assumed: the frontend's tokenization of a few
    /// thousand tokens and the first scheduling pass).
    pub fn first_token_overhead_ms(&self) -> f64 {
        match self {
            Timing::Linear { .. } => 200.0,
            Timing::DynamoMocker => 0.0,
            Timing::Roofline { overhead_ms, .. } => *overhead_ms,
        }
    }
}
