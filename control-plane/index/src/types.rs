//! The index's vocabulary, shared by its modules: a worker's dense index,
//! the settings, why an event was skipped, the counters, and one worker's
//! overlap with a prompt.

use kvgate_protocol::BlockSize;

/// Dense index of a worker within one [`Index`](crate::Index) (reused after removal).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerIdx(pub u32);

/// A slot of `slots` for a new worker: one freed before (from `free`), or
/// a new one at the end. Its content is left as it was (`None`).
pub(crate) fn take_slot<T>(slots: &mut Vec<Option<T>>, free: &mut Vec<WorkerIdx>) -> WorkerIdx {
    free.pop().unwrap_or_else(|| {
        slots.push(None);
        WorkerIdx((slots.len() - 1) as u32)
    })
}

/// Settings of one model's index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexConfig {
    /// Tokens per block for this model. Events with another block size are
    /// skipped and counted ([`Counters::skipped_block_size`]).
    pub block_size: BlockSize,
    /// Most references kept per (worker, engine hash). vLLM holds at most a
    /// few physical copies of one hash (2 in the real captures); a higher
    /// count means re-reports without an origin, and capping it bounds how
    /// long such a block outlives its last real removal. Default 4.
    pub max_refs: u16,
    /// Shards the workers are spread over (at least 1; default 1). Each
    /// shard has its own prefix tree, so [`Index::apply_batch`](crate::Index::apply_batch) applies
    /// the events of workers in different shards on different threads, and
    /// every lookup asks each shard.
    pub shards: u16,
}

impl IndexConfig {
    /// Defaults for a block size.
    pub fn new(block_size: BlockSize) -> Self {
        Self { block_size, max_refs: 4, shards: 1 }
    }
}

/// Why an event was not applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Skip {
    /// The worker is not registered.
    #[error("unknown worker")]
    UnknownWorker,
    /// Inconsistent event: no hashes, or a token count that is not
    /// `hashes * block_size`.
    #[error("malformed event: token count does not match blocks × block size")]
    Malformed,
    /// The event's block size is not the model's.
    #[error("block size {got} differs from the model's {want}")]
    BlockSize {
        /// In the event.
        got: u32,
        /// Configured.
        want: u32,
    },
    /// A stored chain whose parent this worker does not hold: its hashes
    /// cannot be computed. The worker is marked for resync.
    #[error("parent block unknown for this worker; resync needed")]
    UnknownParent,
}

/// What the index did, by cause. Monotonic counters, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Events applied.
    pub events_applied: u64,
    /// Block references added by stores.
    pub blocks_stored: u64,
    /// Block references dropped by removals.
    pub blocks_removed: u64,
    /// `Cleared` events applied.
    pub clears: u64,
    /// Events skipped as malformed.
    pub skipped_malformed: u64,
    /// Events skipped for a block-size mismatch.
    pub skipped_block_size: u64,
    /// Stores skipped because the parent was unknown.
    pub skipped_unknown_parent: u64,
    /// Events for unknown workers.
    pub skipped_unknown_worker: u64,
    /// Removals of hashes the worker did not hold (normal after a late start).
    pub unknown_removals: u64,
    /// Stores of a held hash at the reference cap.
    pub refs_capped: u64,
    /// Re-reported reused blocks (origin REUSED) applied.
    pub reused_reports: u64,
    /// A held engine hash stored again for different tokens: the old mapping
    /// was replaced.
    pub hash_conflicts: u64,
    /// Blocks evicted because a worker held more than its capacity.
    pub capacity_evictions: u64,
}

impl Counters {
    /// Adds every counter of `other` to this one.
    pub fn add(&mut self, other: &Counters) {
        let Counters {
            events_applied,
            blocks_stored,
            blocks_removed,
            clears,
            skipped_malformed,
            skipped_block_size,
            skipped_unknown_parent,
            skipped_unknown_worker,
            unknown_removals,
            refs_capped,
            reused_reports,
            hash_conflicts,
            capacity_evictions,
        } = *other;
        self.events_applied += events_applied;
        self.blocks_stored += blocks_stored;
        self.blocks_removed += blocks_removed;
        self.clears += clears;
        self.skipped_malformed += skipped_malformed;
        self.skipped_block_size += skipped_block_size;
        self.skipped_unknown_parent += skipped_unknown_parent;
        self.skipped_unknown_worker += skipped_unknown_worker;
        self.unknown_removals += unknown_removals;
        self.refs_capped += refs_capped;
        self.reused_reports += reused_reports;
        self.hash_conflicts += hash_conflicts;
        self.capacity_evictions += capacity_evictions;
    }

    /// The counters not exported on their own (`events_applied` and the
    /// `skipped_*` causes are), as (kind, value) for metrics. The struct is
    /// destructured without `..`: a counter added to it does not compile
    /// until it is placed here or exported elsewhere.
    pub fn by_kind(&self) -> [(&'static str, u64); 8] {
        let Self {
            events_applied: _,
            blocks_stored,
            blocks_removed,
            clears,
            skipped_malformed: _,
            skipped_block_size: _,
            skipped_unknown_parent: _,
            skipped_unknown_worker: _,
            unknown_removals,
            refs_capped,
            reused_reports,
            hash_conflicts,
            capacity_evictions,
        } = *self;
        [
            ("block_stored", blocks_stored),
            ("block_removed", blocks_removed),
            ("cleared", clears),
            ("unknown_removal", unknown_removals),
            ("ref_capped", refs_capped),
            ("reused_report", reused_reports),
            ("hash_conflict", hash_conflicts),
            ("capacity_eviction", capacity_evictions),
        ]
    }
}

/// Leading blocks of a prompt that one worker holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overlap {
    /// The worker.
    pub worker: WorkerIdx,
    /// Number of leading blocks of the prompt it holds.
    pub blocks: u32,
}
