//! # kvgate-sim
//!
//! A simulated vLLM fleet that behaves like vLLM at its interfaces (HTTP API,
//! KV events, metrics) and like an H200 in time, so the whole gateway can be
//! tested and benchmarked without a GPU (issue #4).
//!
//! | module | what |
//! |---|---|
//! | [`pool`] | the paged KV cache with vLLM's prefix caching: full blocks only, reference counts, freed blocks in LRU order, evicted oldest first, duplicate physical copies; emits vLLM's KV events |
#![warn(missing_docs)]

pub mod pool;
