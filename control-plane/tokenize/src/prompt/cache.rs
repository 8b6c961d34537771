//! The cache's chunks (a conversation's rendered text and token ids up to
//! one message boundary) and the bounded LRU that holds them.

use std::sync::Arc;

use serde_json::Value;

use super::{Outcome, SegmentRef, Tokenized};

#[derive(Debug)]
pub(super) struct Chunk {
    /// Its own key (the chain hash of its last message).
    pub(super) key: u64,
    pub(super) prev: Option<u64>,
    pub(super) rendered_len: usize,
    /// xxh3 of the rendered text up to here; `None` when the chunk was made
    /// by a stand-in render (the real text was never rendered).
    pub(super) rendered_hash: Option<u64>,
    /// The real rendered text up to here ends with an added token.
    pub(super) ends_with_added: bool,
    pub(super) tokens: Box<[u32]>,
    /// The messages this chunk covers, parsed (shared with the chunk that
    /// only adds a generation suffix).
    pub(super) messages: Arc<[Value]>,
    /// Bytes of those messages' JSON (for the budget).
    pub(super) message_bytes: usize,
    pub(super) gen_suffix: Option<Box<[u32]>>,
}

impl Chunk {
    /// Budget units: token ids, plus one per 4 bytes of message JSON.
    pub(super) fn cost(&self) -> usize {
        self.tokens.len() + self.gen_suffix.as_ref().map_or(0, |s| s.len()) + self.message_bytes / 4 + 16
    }
}

pub(super) struct Cache {
    pub(super) lru: lru::LruCache<u64, Arc<Chunk>>,
    pub(super) used: usize,
    pub(super) budget: usize,
}

impl Cache {
    /// Whether the chunk was kept (it is not when larger than the budget).
    pub(super) fn insert(&mut self, key: u64, chunk: Chunk) -> bool {
        let cost = chunk.cost();
        if cost > self.budget {
            return false;
        }
        if let Some(old) = self.lru.put(key, Arc::new(chunk)) {
            self.used -= old.cost();
        }
        self.used += cost;
        while self.used > self.budget {
            match self.lru.pop_lru() {
                Some((_, c)) => self.used -= c.cost(),
                None => break,
            }
        }
        true
    }

    /// The longest cached prefix of the conversation whose chain of chunks
    /// is complete: (index of its last message, its chunks in order).
    pub(super) fn longest_chain(&mut self, segments: &[SegmentRef<'_>]) -> (Option<usize>, Vec<Arc<Chunk>>) {
        for k in (0..segments.len()).rev() {
            let Some(chunk) = self.lru.get(&segments[k].chain_hash).cloned() else { continue };
            let mut chain = vec![chunk];
            let mut complete = true;
            while let Some(prev) = chain.last().and_then(|c| c.prev) {
                // A chain is never longer than the conversation: a longer
                // one would be a cycle (hash collision).
                if chain.len() > k + 1 {
                    complete = false;
                    break;
                }
                match self.lru.get(&prev).cloned() {
                    Some(c) => chain.push(c),
                    None => {
                        complete = false;
                        break;
                    }
                }
            }
            if complete {
                chain.reverse();
                return (Some(k), chain);
            }
        }
        (None, Vec::new())
    }
}

/// A chat prompt's ids under construction.
#[derive(Default)]
pub(super) struct Build {
    pub(super) ids: Vec<u32>,
    /// Where the reused cached text ends in the render.
    pub(super) start: usize,
    /// The chunk the next one continues.
    pub(super) prev_key: Option<u64>,
    /// Messages before this one are covered by `prev_key`'s chain.
    pub(super) covered: usize,
    pub(super) outcome: Outcome,
    pub(super) encoded: usize,
    pub(super) new_chunks: Vec<(u64, Chunk)>,
}

/// Every message cached: no render needed when the suffix for this flag
/// is known.
pub(super) fn full_hit(chunks: &[Arc<Chunk>], segments: &[SegmentRef<'_>], gen_prompt: bool) -> Option<Tokenized> {
    let last = chunks.last();
    let suffix: &[u32] = if gen_prompt { last.and_then(|c| c.gen_suffix.as_deref())? } else { &[] };
    let total: usize = chunks.iter().map(|c| c.tokens.len()).sum::<usize>() + suffix.len();
    let mut ids = Vec::with_capacity(total);
    for c in chunks {
        ids.extend_from_slice(&c.tokens);
    }
    ids.extend_from_slice(suffix);
    Some(Tokenized {
        ids,
        outcome: Outcome::FullHit,
        encoded_bytes: 0,
        retained: retained_pair(chunks.first().map(|c| c.key), segments[segments.len() - 1].chain_hash),
    })
}

/// The first boundary (when it is not the last) and the last.
pub(super) fn retained_pair(first: Option<u64>, last: u64) -> Vec<u64> {
    match first {
        Some(f) if f != last => vec![f, last],
        _ => vec![last],
    }
}

/// Owned copies of parsed messages, for a chunk.
pub(super) fn own(messages: &[&Value]) -> Arc<[Value]> {
    messages.iter().map(|m| (*m).clone()).collect()
}
