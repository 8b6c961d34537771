//! # kvgate-index
//!
//! Which worker holds which prompt prefix in its KV cache, built from the KV
//! events of every worker (ARCHITECTURE §2, §5). Synchronous and
//! single-owner: no async runtime, no locks, no I/O. The control plane owns
//! one [`Index`] per model and feeds it events from NATS.
//!
//! | module | what |
//! |---|---|
//! | [`event`] | [`KvEvent`] borrowed from protobuf batches; [`Tier`], [`Origin`] |
//! | [`index`] | [`Index`]: apply events, [`Index::find_matches`], counters, invariants |
//! | `engine` | one worker's engine hash → entry table: a slab of fixed pages and a table of 4-byte slots |
//! | `seq_table` | the prefix table: sequence hash → worker set, open addressing that can be prefetched |
//! | `worker_set` | the worker set of one block in 8 bytes, with an O(1) equality fingerprint |
//!
//! See `README.md` for the layout, the policies and the complexity table.
#![warn(missing_docs)]

mod engine;
pub mod event;
pub mod index;
mod probing;
mod seq_table;
mod worker_set;

pub use event::{KvEvent, Origin, Stored, Tier};
pub use index::{Counters, Index, IndexConfig, Overlap, Skip, WorkerIdx};
