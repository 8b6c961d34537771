//! # kvgate-index
//!
//! Which worker holds which prompt prefix in its KV cache, built from the KV
//! events of every worker (ARCHITECTURE §2, §5). Synchronous and
//! single-owner: no async runtime, no locks, no I/O (a batch of events may be
//! applied to the index's shards on scoped threads). The control plane owns
//! one [`Index`] per model and feeds it events from NATS.
//!
//! | module | what |
//! |---|---|
//! | [`event`] | [`KvEvent`] borrowed from protobuf batches; [`Tier`], [`Origin`] |
//! | [`index`] | [`Index`]: workers spread over shards, apply events (a batch's shards in parallel), [`Index::find_matches`], counters, invariants |
//! | `shard` | one shard: its workers' engine tables and the prefix tree of what they hold |
//! | `engine` | one worker's engine hash → entry table: a slab of fixed pages and a table of 8-byte buckets (slot and tag), grown with spare buckets made outside the write lock |
//! | `runs` | the prefix tree: every distinct block in runs of consecutive blocks, with its holders per tier |
//! | `types` | what the modules share: [`WorkerIdx`], [`IndexConfig`], [`Skip`], [`Counters`], [`Overlap`] |
//! | `worker_set` | the worker set of one block in 8 bytes, with an O(1) equality fingerprint |
//!
//! See `README.md` for the layout, the policies and the complexity table.
#![warn(missing_docs)]

mod engine;
pub mod event;
pub mod index;
mod paged;
mod probing;
mod runs;
mod shard;
mod types;
mod worker_set;

pub use event::{KvEvent, Origin, Stored, Tier};
pub use index::{Counters, Index, IndexConfig, Overlap, Skip, Spares, WorkerIdx};

/// Approximate heap bytes of a `HashMap` (hashbrown: buckets = capacity ·
/// 8 / 7, one control byte each), for memory accounting.
pub(crate) fn map_heap_bytes<K, V, S>(m: &std::collections::HashMap<K, V, S>) -> usize {
    m.capacity() * 8 / 7 * (std::mem::size_of::<(K, V)>() + 1)
}
