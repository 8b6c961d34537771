//! How long an engine step takes, by preset.
//!
//! A step runs every running request's next decode token plus a budget of
//! prefill tokens (chunked prefill), as vLLM's scheduler does.
//!
//! | preset | step time |
//! |---|---|
//! | `h200-llama70b-fp8` | `13 ms + 0.65 ms × decode_seqs + 0.08 ms × prefill_tokens` |
//! | `dynamo-mocker` | `decode(p) + prefill(T)`: prefill ms = 4.21e-7·T² + 0.01518·T + 16.5 when T > 0; decode ms = max(1, −25.74·p² + 54.01·p + 5.74) for KV fill fraction p |
//!
//! Both presets also have a [`Timing::first_token_overhead_ms`]: time
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
}

impl Timing {
    /// The H200 / Llama-3.1-70B FP8 preset.
    pub const H200_LLAMA70B_FP8: Timing =
        Timing::Linear { base_ms: 13.0, per_seq_ms: 0.65, per_prefill_token_ms: 0.08 };

    /// A preset by name (`h200-llama70b-fp8`, `dynamo-mocker`).
    pub fn preset(name: &str) -> Option<Self> {
        match name {
            "h200-llama70b-fp8" => Some(Self::H200_LLAMA70B_FP8),
            "dynamo-mocker" => Some(Self::DynamoMocker),
            _ => None,
        }
    }

    /// Milliseconds for a step with `decode_seqs` decoding requests,
    /// `prefill_tokens` new prompt tokens, at KV fill fraction `kv_fill`.
    pub fn step_ms(&self, decode_seqs: usize, prefill_tokens: usize, kv_fill: f64) -> f64 {
        match *self {
            Timing::Linear { base_ms, per_seq_ms, per_prefill_token_ms } => {
                base_ms + per_seq_ms * decode_seqs as f64 + per_prefill_token_ms * prefill_tokens as f64
            }
            Timing::DynamoMocker => {
                let t = prefill_tokens as f64;
                let prefill = if prefill_tokens > 0 { 4.21e-7 * t * t + 0.01518 * t + 16.5 } else { 0.0 };
                let p = kv_fill.clamp(0.0, 1.0);
                let decode = if decode_seqs > 0 { (-25.74 * p * p + 54.01 * p + 5.74).max(1.0) } else { 0.0 };
                (prefill + decode).max(if decode_seqs + prefill_tokens > 0 { 1.0 } else { 0.0 })
            }
        }
    }

    /// Latency a request spends before the engine can schedule it (API
    /// server, tokenization, KV block setup), in simulated ms; it does not
    /// occupy the engine. `h200-llama70b-fp8`: 200 ms, fitted so that
    /// TTFT p50 at the DOKS demo's lowest load (60 conversations, ~20 per
    /// worker, ~95 % prefix hits) matches the published 249 ms: with that
    /// many hits the engine's own share of TTFT is ~35 ms
    /// (`tests/calibration.rs`). `dynamo-mocker`: 0 (Dynamo's model has none).
    pub fn first_token_overhead_ms(&self) -> f64 {
        match self {
            Timing::Linear { .. } => 200.0,
            Timing::DynamoMocker => 0.0,
        }
    }
}
