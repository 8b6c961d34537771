//! Block identity (ARCHITECTURE §2): the project's own block hashes, computed
//! from token ids, compatible with Dynamo's kv-router (`dynamo-kv-router`
//! 1.6.1, "public-xxh3-v1").
//!
//! * **Block seed** ([`BlockSeed`]): `1337`, plus `XXH3_64(lora, seed 0)` when
//!   a LoRA adapter name is given, plus `XXH3_64(cache_salt, seed 1)` when a
//!   cache salt is given (wrapping additions; an empty string counts as
//!   absent; the different inner seeds keep `lora = "x"` apart from
//!   `salt = "x"`).
//! * **Local block hash** ([`LocalBlockHash`]): `XXH3_64(tokens as LE u32,
//!   block seed)` over one *full* block; a trailing partial block is never
//!   hashed.
//! * **Sequence hash** ([`SequenceHash`]): `seq[0] = local[0]`, `seq[i] =
//!   XXH3_64(LE64(seq[i-1]) ‖ LE64(local[i]), 1337)`: the identity of a block
//!   *and* everything before it. The chain seed is always 1337; LoRA and salt
//!   reach every sequence hash through the local hashes.
//! * **Engine hashes** ([`EngineBlockHash`]) are the engine's own ids from KV
//!   events. They are never compared with ours: they depend on vLLM's version,
//!   hash algorithm and seed. The index keeps them only to apply removals and
//!   parent links.
//!
//! ## LoRA and `cache_salt`
//!
//! Both change every local hash through the seed, so two tenants with
//! different salts (or two adapters) never appear to share a prefix. The
//! request side takes them from the request body (`cache_salt`, the LoRA the
//! `model` names); the event side from vLLM's `lora_name` and from the
//! `cache_salt` that the relay recovers from `extra_keys[0]` of a chain's
//! first block and carries on every `BlockStored` of that chain (see
//! `BlockStored.cache_salt` in `proto/kvgate/v1/events.proto`).
//!
//! | operation | cost |
//! |---|---|
//! | [`BlockSeed::new`] | O(len(lora) + len(salt)) |
//! | [`local_block_hash`] | O(block_size), no allocation |
//! | [`next_sequence_hash`] | O(1) (16 bytes hashed) |
//! | [`sequence_hashes`] | O(tokens), one allocation |
//! | [`SequenceHasher::push`] | O(tokens pushed), amortized no allocation |

use alloc::vec::Vec;
use core::fmt;
use core::num::NonZeroU32;

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The seed of every hash in the scheme (Dynamo's `XXH3_SEED`).
pub const HASH_SEED: u64 = 1337;

/// Inner seed of the LoRA name in [`BlockSeed::new`].
const LORA_SEED: u64 = 0;
/// Inner seed of the cache salt in [`BlockSeed::new`].
const SALT_SEED: u64 = 1;

/// Tokens per KV block: at least 1. Per model, from configuration or from the
/// worker (`vllm:cache_config_info`); never assumed to be 16.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockSize(NonZeroU32);

/// A block size of zero tokens was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSizeError;

impl fmt::Display for BlockSizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("block size must be at least 1 token, got 0")
    }
}

impl core::error::Error for BlockSizeError {}

impl BlockSize {
    /// A block size of `tokens` tokens; zero is an error.
    pub const fn new(tokens: u32) -> Result<Self, BlockSizeError> {
        match NonZeroU32::new(tokens) {
            Some(n) => Ok(Self(n)),
            None => Err(BlockSizeError),
        }
    }

    /// Tokens per block.
    pub const fn get(self) -> u32 {
        self.0.get()
    }

    /// Tokens per block as `usize`.
    pub const fn as_usize(self) -> usize {
        self.0.get() as usize
    }

    /// Number of full blocks in `tokens` tokens.
    pub const fn full_blocks(self, tokens: usize) -> usize {
        tokens / self.as_usize()
    }
}

impl TryFrom<u32> for BlockSize {
    type Error = BlockSizeError;
    fn try_from(tokens: u32) -> Result<Self, BlockSizeError> {
        Self::new(tokens)
    }
}

impl fmt::Display for BlockSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

macro_rules! hash_newtype {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
        #[repr(transparent)]
        pub struct $name(pub u64);

        impl From<u64> for $name {
            fn from(v: u64) -> Self {
                Self(v)
            }
        }

        impl From<$name> for u64 {
            fn from(v: $name) -> u64 {
                v.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }
    };
}

hash_newtype!(
    /// Hash of one full block's tokens alone (no position, no parent), under
    /// a [`BlockSeed`]. Equal local hashes at different positions are
    /// different blocks: compare [`SequenceHash`]es to match prefixes.
    LocalBlockHash
);
hash_newtype!(
    /// Hash of a block and every block before it: the key the index matches
    /// prefixes by.
    SequenceHash
);
hash_newtype!(
    /// The engine's own id of a block from a KV event, normalized to u64
    /// (unsigned as is, negative as two's complement, 32-byte digests as
    /// their last 8 bytes big-endian). Opaque: never compared with ours.
    EngineBlockHash
);

/// The per-block xxh3 seed, which folds in the LoRA adapter and cache salt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockSeed(u64);

impl Default for BlockSeed {
    fn default() -> Self {
        Self::BASE
    }
}

impl BlockSeed {
    /// No LoRA, no salt.
    pub const BASE: Self = Self(HASH_SEED);

    /// The seed for a request or event with this LoRA name and cache salt.
    /// `None` and `Some("")` are the same: absent.
    pub fn new(lora_name: Option<&str>, cache_salt: Option<&str>) -> Self {
        let mut seed = HASH_SEED;
        if let Some(lora) = lora_name.filter(|s| !s.is_empty()) {
            seed = seed.wrapping_add(xxh3_64_with_seed(lora.as_bytes(), LORA_SEED));
        }
        if let Some(salt) = cache_salt.filter(|s| !s.is_empty()) {
            seed = seed.wrapping_add(xxh3_64_with_seed(salt.as_bytes(), SALT_SEED));
        }
        Self(seed)
    }

    /// Like [`BlockSeed::new`] for protobuf strings, where "" means absent.
    pub fn from_fields(lora_name: &str, cache_salt: &str) -> Self {
        Self::new(Some(lora_name), Some(cache_salt))
    }

    /// The seed value.
    pub const fn get(self) -> u64 {
        self.0
    }
}

/// Local hash of one block's tokens. Callers pass full blocks (a slice of
/// exactly `block_size` tokens); any length hashes without panicking.
#[inline]
pub fn local_block_hash(block: &[u32], seed: BlockSeed) -> LocalBlockHash {
    LocalBlockHash(hash_tokens_le(block, seed.0))
}

#[cfg(target_endian = "little")]
#[inline]
fn hash_tokens_le(tokens: &[u32], seed: u64) -> u64 {
    // On little-endian targets (x86-64, aarch64, wasm32) the in-memory bytes
    // are already the LE encoding: hash them in place.
    xxh3_64_with_seed(bytemuck::cast_slice(tokens), seed)
}

#[cfg(not(target_endian = "little"))]
#[inline]
fn hash_tokens_le(tokens: &[u32], seed: u64) -> u64 {
    let mut bytes = Vec::with_capacity(tokens.len() * 4);
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(&bytes, seed)
}

/// The sequence hash of a block given its parent's sequence hash (`None` for
/// the first block) and its own local hash.
#[inline]
pub fn next_sequence_hash(parent: Option<SequenceHash>, local: LocalBlockHash) -> SequenceHash {
    match parent {
        None => SequenceHash(local.0),
        Some(p) => {
            let mut buf = [0u8; 16];
            let (a, b) = buf.split_at_mut(8);
            a.copy_from_slice(&p.0.to_le_bytes());
            b.copy_from_slice(&local.0.to_le_bytes());
            SequenceHash(xxh3_64_with_seed(&buf, HASH_SEED))
        }
    }
}

/// Local hashes of every full block of `tokens`.
pub fn local_block_hashes(
    tokens: &[u32],
    block_size: BlockSize,
    seed: BlockSeed,
) -> impl ExactSizeIterator<Item = LocalBlockHash> + '_ {
    tokens.chunks_exact(block_size.as_usize()).map(move |b| local_block_hash(b, seed))
}

/// Sequence hashes of every full block of `tokens`.
pub fn sequence_hashes(tokens: &[u32], block_size: BlockSize, seed: BlockSeed) -> Vec<SequenceHash> {
    let mut out = Vec::with_capacity(block_size.full_blocks(tokens.len()));
    let mut prev = None;
    for local in local_block_hashes(tokens, block_size, seed) {
        let seq = next_sequence_hash(prev, local);
        out.push(seq);
        prev = Some(seq);
    }
    out
}

/// Computes sequence hashes incrementally from tokens that arrive in pieces
/// (per chat message, per generated token), with the same result as
/// [`sequence_hashes`] over the concatenation.
#[derive(Debug, Clone)]
pub struct SequenceHasher {
    block_size: BlockSize,
    seed: BlockSeed,
    pending: Vec<u32>,
    last: Option<SequenceHash>,
    blocks: usize,
}

impl SequenceHasher {
    /// An empty hasher.
    pub fn new(block_size: BlockSize, seed: BlockSeed) -> Self {
        Self { block_size, seed, pending: Vec::new(), last: None, blocks: 0 }
    }

    /// Feeds `tokens`; appends the sequence hash of every block they complete
    /// to `out`.
    pub fn push(&mut self, tokens: &[u32], out: &mut Vec<SequenceHash>) {
        let bs = self.block_size.as_usize();
        let mut rest = tokens;
        if !self.pending.is_empty() {
            let need = bs.saturating_sub(self.pending.len()).min(rest.len());
            let (head, tail) = rest.split_at_checked(need).unwrap_or((rest, &[]));
            self.pending.extend_from_slice(head);
            rest = tail;
            if self.pending.len() < bs {
                return;
            }
            let local = local_block_hash(&self.pending, self.seed);
            self.pending.clear();
            self.emit(local, out);
        }
        let mut chunks = rest.chunks_exact(bs);
        for block in &mut chunks {
            self.emit(local_block_hash(block, self.seed), out);
        }
        let tail = chunks.remainder();
        if !tail.is_empty() {
            if self.pending.capacity() < bs {
                self.pending.reserve_exact(bs);
            }
            self.pending.extend_from_slice(tail);
        }
    }

    #[inline]
    fn emit(&mut self, local: LocalBlockHash, out: &mut Vec<SequenceHash>) {
        let seq = next_sequence_hash(self.last, local);
        self.last = Some(seq);
        self.blocks += 1;
        out.push(seq);
    }

    /// Full blocks hashed so far.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Tokens waiting for their block to fill.
    pub fn pending_tokens(&self) -> usize {
        self.pending.len()
    }

    /// Sequence hash of the last full block, if any.
    pub fn last(&self) -> Option<SequenceHash> {
        self.last
    }

    /// The block size.
    pub fn block_size(&self) -> BlockSize {
        self.block_size
    }

    /// The block seed.
    pub fn seed(&self) -> BlockSeed {
        self.seed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::ToString;
    use alloc::vec;
    use proptest::prelude::*;

    /// The example from the scheme's description (block size 4, tokens 1..=12).
    #[test]
    fn worked_example() {
        let tokens: Vec<u32> = (1..=12).collect();
        let bs = BlockSize::new(4).unwrap();
        let local: Vec<u64> = local_block_hashes(&tokens, bs, BlockSeed::BASE).map(|h| h.0).collect();
        assert_eq!(local, vec![14643705804678351452, 16777012769546811212, 483935686894639516]);
        let seq: Vec<u64> = sequence_hashes(&tokens, bs, BlockSeed::BASE).iter().map(|h| h.0).collect();
        assert_eq!(seq, vec![14643705804678351452, 4945711292740353085, 12583592247330656132]);
    }

    #[test]
    fn zero_block_size_is_an_error_not_a_panic() {
        assert_eq!(BlockSize::new(0), Err(BlockSizeError));
        assert_eq!(BlockSize::try_from(0u32), Err(BlockSizeError));
        assert!(BlockSize::new(0).unwrap_err().to_string().contains("at least 1"));
    }

    #[test]
    fn empty_strings_are_absent_and_lora_differs_from_salt() {
        assert_eq!(BlockSeed::new(Some(""), Some("")), BlockSeed::BASE);
        assert_eq!(BlockSeed::from_fields("", ""), BlockSeed::BASE);
        assert_ne!(BlockSeed::new(Some("x"), None), BlockSeed::new(None, Some("x")));
        assert_ne!(BlockSeed::new(None, Some("a")), BlockSeed::new(None, Some("b")));
    }

    #[test]
    fn partial_blocks_are_not_hashed() {
        let bs = BlockSize::new(16).unwrap();
        assert!(sequence_hashes(&[1; 15], bs, BlockSeed::BASE).is_empty());
        assert_eq!(sequence_hashes(&[1; 33], bs, BlockSeed::BASE).len(), 2);
        assert!(sequence_hashes(&[], bs, BlockSeed::BASE).is_empty());
    }

    proptest! {
        /// Any split of the tokens into pieces gives the same hashes as one call.
        #[test]
        fn incremental_equals_one_shot(
            tokens in proptest::collection::vec(any::<u32>(), 0..300),
            cuts in proptest::collection::vec(0usize..300, 0..12),
            bs in 1u32..40,
            salt in proptest::option::of("[a-z]{0,4}"),
        ) {
            let bs = BlockSize::new(bs).unwrap();
            let seed = BlockSeed::new(None, salt.as_deref());
            let expected = sequence_hashes(&tokens, bs, seed);
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(tokens.len())).collect();
            cuts.sort_unstable();
            let mut h = SequenceHasher::new(bs, seed);
            let mut out = Vec::new();
            let mut start = 0;
            for c in cuts.into_iter().chain(core::iter::once(tokens.len())) {
                h.push(&tokens[start..c], &mut out);
                start = c;
            }
            prop_assert_eq!(&out, &expected);
            prop_assert_eq!(h.blocks(), expected.len());
            prop_assert_eq!(h.pending_tokens(), tokens.len() % bs.as_usize());
            prop_assert_eq!(h.last(), expected.last().copied());
        }

        /// A prefix of the tokens hashes to a prefix of the hashes.
        #[test]
        fn prefix_stability(tokens in proptest::collection::vec(any::<u32>(), 0..200), n in 0usize..200, bs in 1u32..20) {
            let bs = BlockSize::new(bs).unwrap();
            let n = n.min(tokens.len());
            let all = sequence_hashes(&tokens, bs, BlockSeed::BASE);
            let pre = sequence_hashes(&tokens[..n], bs, BlockSeed::BASE);
            prop_assert_eq!(&all[..pre.len()], &pre[..]);
        }
    }
}
