//! Chained per-message hashes of a chat request (`Segment.chain_hash`).
//!
//! The filter cannot tokenize (ARCHITECTURE §3: ~250 ms per 100K tokens in
//! Wasm), so it hashes each chat message's raw JSON bytes instead and chains
//! the hashes; the control plane caches tokenization by them, so a new turn of
//! a conversation only tokenizes its new message.
//!
//! ```text
//! h[-1] = 0                                   when template_context_json is empty
//!       = XXH3_64(template_context_json, 1337) otherwise
//! m[i]  = XXH3_64(message_json[i], 1337)
//! h[i]  = XXH3_64(LE64(h[i-1]) ‖ LE64(m[i]), 1337)
//! ```
//!
//! The hash identifies *text*, not tokens: it is unsalted (tokenization does
//! not depend on the tenant). Policies that route by it (`approx`) mix the
//! request's [`crate::BlockSeed`] in themselves, so that tenants stay apart.
//!
//! Cost: O(len(message)) per message, no allocation.

use core::fmt;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::hash::HASH_SEED;

/// Chained hash of a chat message and all messages (and template context)
/// before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[repr(transparent)]
pub struct SegmentHash(pub u64);

impl SegmentHash {
    /// The start of a chain: `h[-1]`.
    pub fn context(template_context_json: &[u8]) -> Self {
        if template_context_json.is_empty() {
            Self(0)
        } else {
            Self(xxh3_64_with_seed(template_context_json, HASH_SEED))
        }
    }

    /// The hash of the next message after `self`.
    #[inline]
    pub fn chain(self, message_json: &[u8]) -> Self {
        let m = xxh3_64_with_seed(message_json, HASH_SEED);
        let mut buf = [0u8; 16];
        let (a, b) = buf.split_at_mut(8);
        a.copy_from_slice(&self.0.to_le_bytes());
        b.copy_from_slice(&m.to_le_bytes());
        Self(xxh3_64_with_seed(&buf, HASH_SEED))
    }
}

impl fmt::Display for SegmentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::ToString;

    #[test]
    fn chain_depends_on_order_context_and_content() {
        let a = br#"{"role":"system","content":"You are helpful."}"#;
        let b = br#"{"role":"user","content":"Hi"}"#;
        let root = SegmentHash::context(b"");
        assert_eq!(root, SegmentHash(0));
        let ab = root.chain(a).chain(b);
        let ba = root.chain(b).chain(a);
        assert_ne!(ab, ba);
        let with_tools = SegmentHash::context(br#"{"tools":[]}"#).chain(a).chain(b);
        assert_ne!(ab, with_tools);
        // Deterministic.
        assert_eq!(ab, SegmentHash::context(b"").chain(a).chain(b));
        assert_eq!(SegmentHash(0xab).to_string(), "00000000000000ab");
    }
}
