//! The events the index applies, borrowed from decoded protobuf batches
//! (no copies of hashes or token ids).

use kvgate_protocol::BlockSeed;
use kvgate_protocol::pb::{self, kv_event};

/// Cache tier of a block. The index keeps one prefix map per tier, so the
/// scheduler can score device hits above host-memory (offloaded) hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// Accelerator memory (vLLM medium "GPU", and "unspecified" from old engines).
    Device = 0,
    /// Slower tiers: host memory of an offloading connector ("CPU"), disk, other.
    Host = 1,
}

impl Tier {
    /// Both tiers, in index order.
    pub const ALL: [Tier; 2] = [Tier::Device, Tier::Host];

    /// The tier a protobuf medium maps to.
    pub fn from_medium(medium: i32) -> Self {
        match pb::StorageMedium::try_from(medium) {
            Ok(pb::StorageMedium::Unspecified | pb::StorageMedium::Gpu) | Err(_) => Self::Device,
            Ok(_) => Self::Host,
        }
    }

    pub(crate) fn idx(self) -> usize {
        self as usize
    }
}

/// Whether a stored block is new or a re-report of one the engine holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The engine does not say: counted as a new reference (bounded).
    Unspecified,
    /// A new physical copy: one more reference.
    New,
    /// A re-reported reused block: residency only, no new reference.
    Reused,
}

impl Origin {
    fn from_pb(origin: i32) -> Self {
        match pb::BlockOrigin::try_from(origin) {
            Ok(pb::BlockOrigin::New) => Self::New,
            Ok(pb::BlockOrigin::Reused) => Self::Reused,
            _ => Self::Unspecified,
        }
    }
}

/// Blocks stored by the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stored<'a> {
    /// Engine hashes of the blocks, in chain order (opaque ids).
    pub engine_hashes: &'a [u64],
    /// Engine hash of the parent of the first block; `None` for a root.
    pub parent: Option<u64>,
    /// Tokens of all blocks: `engine_hashes.len() * block_size` of them.
    pub token_ids: &'a [u32],
    /// Block size the engine reported.
    pub block_size: u32,
    /// LoRA + cache salt of the chain.
    pub seed: BlockSeed,
    /// Where the blocks live.
    pub tier: Tier,
    /// New or re-reported.
    pub origin: Origin,
}

/// One KV event of one worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvEvent<'a> {
    /// Blocks stored.
    Stored(Stored<'a>),
    /// One reference of each block removed.
    Removed {
        /// Engine hashes of the blocks.
        engine_hashes: &'a [u64],
        /// Tier they lived in.
        tier: Tier,
    },
    /// All blocks of the worker dropped.
    Cleared,
}

impl<'a> KvEvent<'a> {
    /// Borrows an event from its protobuf form; `None` when the message
    /// carries no event (counted as malformed by the caller).
    pub fn from_pb(ev: &'a pb::KvEvent) -> Option<Self> {
        Some(match ev.event.as_ref()? {
            kv_event::Event::Stored(s) => Self::Stored(Stored {
                engine_hashes: &s.engine_hashes,
                parent: s.parent_engine_hash,
                token_ids: &s.token_ids,
                block_size: s.block_size,
                seed: BlockSeed::from_fields(&s.lora_name, &s.cache_salt),
                tier: Tier::from_medium(s.medium),
                origin: Origin::from_pb(s.origin),
            }),
            kv_event::Event::Removed(r) => {
                Self::Removed { engine_hashes: &r.engine_hashes, tier: Tier::from_medium(r.medium) }
            }
            kv_event::Event::Cleared(_) => Self::Cleared,
        })
    }
}
