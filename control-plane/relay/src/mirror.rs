//! An exact mirror of one engine's cached blocks, as its events describe
//! them, so that a control plane that starts late can ask for a snapshot.
//!
//! | operation | cost |
//! |---|---|
//! | `store` / `remove` | O(1) expected (plus copying the block's tokens) |
//! | `snapshot` | O(B log B) for B blocks (ordering parents first) |

use std::collections::HashMap;
use std::sync::Arc;

use foldhash::fast::RandomState;
use kvgate_protocol::pb;
use prost::Message;

/// One block of the engine's cache.
#[derive(Debug, Clone, PartialEq)]
pub struct MirrorBlock {
    /// Parent's engine hash; `None` for a root.
    pub parent: Option<u64>,
    /// The block's tokens.
    pub tokens: Box<[u32]>,
    /// LoRA name of its chain.
    pub lora: Option<Arc<str>>,
    /// cache_salt of its chain.
    pub salt: Option<Arc<str>>,
    /// `pb::StorageMedium` value.
    pub medium: i32,
    /// Times stored without a removal (vLLM can hold two copies).
    pub refs: u32,
}

/// The mirror.
#[derive(Debug, Default)]
pub struct Mirror {
    blocks: HashMap<u64, MirrorBlock, RandomState>,
}

impl Mirror {
    /// An empty mirror.
    pub fn new() -> Self {
        Self::default()
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// A held block.
    pub fn get(&self, hash: u64) -> Option<&MirrorBlock> {
        self.blocks.get(&hash)
    }

    /// Stores one block (one more reference if already held).
    pub fn store(&mut self, hash: u64, block: MirrorBlock) {
        self.blocks.entry(hash).and_modify(|b| b.refs += 1).or_insert(MirrorBlock { refs: 1, ..block });
    }

    /// Removes one reference; returns whether the block was held.
    pub fn remove(&mut self, hash: u64) -> bool {
        let Some(b) = self.blocks.get_mut(&hash) else { return false };
        if b.refs > 1 {
            b.refs -= 1;
        } else {
            self.blocks.remove(&hash);
        }
        true
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.blocks.clear();
    }

    /// Held blocks whose whole chain is held, parents before children. A
    /// block whose parent was evicted first cannot be matched by any prefix,
    /// and a consumer could not place it, so it is left out.
    pub fn ordered(&self) -> Vec<(u64, &MirrorBlock)> {
        let mut depth: HashMap<u64, Option<u32>, RandomState> = HashMap::default();
        let mut out = Vec::with_capacity(self.blocks.len());
        for (h, b) in &self.blocks {
            if let Some(d) = self.depth(*h, &mut depth) {
                out.push((d, *h, b));
            }
        }
        out.sort_unstable_by_key(|(d, h, _)| (*d, *h));
        out.into_iter().map(|(_, h, b)| (h, b)).collect()
    }

    /// Depth of a block (root = 0), `None` when its chain is broken.
    fn depth(&self, hash: u64, memo: &mut HashMap<u64, Option<u32>, RandomState>) -> Option<u32> {
        if let Some(d) = memo.get(&hash) {
            return *d;
        }
        // Walk up iteratively (chains can be thousands of blocks long) to a
        // memoized block, a root, or a missing parent.
        let mut path = Vec::new();
        let mut cur = hash;
        let top: Option<u32> = loop {
            if let Some(d) = memo.get(&cur) {
                break d.map(|d| d + 1);
            }
            let Some(b) = self.blocks.get(&cur) else { break None };
            path.push(cur);
            if path.len() > self.blocks.len() {
                break None; // a cycle: never a valid chain
            }
            match b.parent {
                None => break Some(0),
                Some(p) => cur = p,
            }
        };
        let mut d = top;
        for h in path.iter().rev() {
            memo.insert(*h, d);
            d = d.map(|x| x + 1);
        }
        memo.get(&hash).copied().flatten()
    }

    /// The mirror as snapshot chunks of at most `max_chunk_bytes` encoded
    /// bytes each (at least one block per chunk; at least one chunk).
    pub fn snapshot(&self, header: &pb::SnapshotChunk, max_chunk_bytes: usize) -> Vec<pb::SnapshotChunk> {
        let mut chunks: Vec<pb::SnapshotChunk> = Vec::new();
        let mut cur = pb::SnapshotChunk { blocks: Vec::new(), ..header.clone() };
        let base = cur.encoded_len() + 16;
        let mut size = base;
        for (hash, b) in self.ordered() {
            let block = pb::SnapshotBlock {
                engine_hash: hash,
                parent_engine_hash: b.parent,
                token_ids: b.tokens.to_vec(),
                lora_name: b.lora.as_deref().unwrap_or_default().to_owned(),
                cache_salt: b.salt.as_deref().unwrap_or_default().to_owned(),
                medium: b.medium,
                ref_count: b.refs,
            };
            let len = block.encoded_len() + 8;
            if !cur.blocks.is_empty() && size + len > max_chunk_bytes {
                chunks.push(std::mem::replace(&mut cur, pb::SnapshotChunk { blocks: Vec::new(), ..header.clone() }));
                size = base;
            }
            size += len;
            cur.blocks.push(block);
        }
        chunks.push(cur);
        let n = chunks.len() as u32;
        for (i, c) in chunks.iter_mut().enumerate() {
            c.chunk_index = i as u32;
            c.chunk_count = n;
        }
        chunks
    }
}
