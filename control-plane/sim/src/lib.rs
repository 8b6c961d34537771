//! # kvgate-sim
//!
//! A simulated vLLM fleet that behaves like vLLM at its interfaces (HTTP API,
//! KV events, metrics) and like an H200 in time, so the whole gateway can be
//! tested and benchmarked without a GPU (issue #4).
//!
//! | module | what |
//! |---|---|
//! | [`engine`] | one engine: vLLM's continuous batching (admission, decode, chunked prefill, preemption) over the pool |
//! | [`timing`] | step time presets: `h200-llama70b-fp8` (calibrated on the DOKS demo), `dynamo-mocker` |
//! | [`pool`] | the paged KV cache with vLLM's prefix caching: full blocks only, reference counts, freed blocks in LRU order, evicted oldest first, duplicate physical copies; emits vLLM's KV events |
#![warn(missing_docs)]

pub mod engine;
pub mod pool;
pub mod timing;

#[cfg(feature = "server")]
pub mod server;
