//! The contents of a tokenizer's added (special) tokens, for the prefix and
//! suffix tests of [`crate::ChatTokenizer::boundary_safe`] and the prompt
//! cache.
//!
//! A tokenizer has many added tokens (DeepSeek-V3: 1,283) of few distinct
//! lengths (28). Testing `text.ends_with(token)` for every token costs one
//! comparison per token on every request; here a test looks up the text's
//! last (or first) `len` bytes in a hash set once per distinct length:
//! O(L × ℓ) for L distinct lengths of at most ℓ bytes, independent of the
//! number of tokens.

use std::collections::HashSet;

/// A set of token contents tested against the start or end of a text.
#[derive(Debug, Clone, Default)]
pub struct AddedTokens {
    /// Distinct byte lengths, ascending.
    lens: Vec<usize>,
    set: HashSet<Box<[u8]>>,
}

impl AddedTokens {
    /// The set of `tokens` (empty strings are ignored).
    pub fn new<'a>(tokens: impl IntoIterator<Item = &'a str>) -> Self {
        let set: HashSet<Box<[u8]>> =
            tokens.into_iter().filter(|t| !t.is_empty()).map(|t| t.as_bytes().into()).collect();
        let mut lens: Vec<usize> = set.iter().map(|t| t.len()).collect();
        lens.sort_unstable();
        lens.dedup();
        Self { lens, set }
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.set.len()
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }

    /// Whether `text` starts with one of the tokens.
    pub fn is_prefix_of(&self, text: &str) -> bool {
        let b = text.as_bytes();
        self.lens.iter().take_while(|&&n| n <= b.len()).any(|&n| self.set.contains(&b[..n]))
    }

    /// Whether `text` ends with one of the tokens.
    pub fn is_suffix_of(&self, text: &str) -> bool {
        let b = text.as_bytes();
        self.lens.iter().take_while(|&&n| n <= b.len()).any(|&n| self.set.contains(&b[b.len() - n..]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn finds_tokens_at_either_end_only() {
        let t = AddedTokens::new(["<｜User｜>", "<s>", "", "</s>"]);
        assert_eq!(t.len(), 3);
        assert!(t.is_prefix_of("<｜User｜>hi") && t.is_suffix_of("hi<｜User｜>"));
        assert!(t.is_prefix_of("<s>") && t.is_suffix_of("</s>"));
        assert!(!t.is_prefix_of("x<s>") && !t.is_suffix_of("<s>x") && !t.is_prefix_of("") && !t.is_suffix_of(""));
        // Byte offsets may fall inside a character of the text.
        assert!(!t.is_suffix_of("｜>") && !t.is_prefix_of("｜"));
        assert!(AddedTokens::new([]).is_empty());
    }

    proptest! {
        // Agrees with testing every token in turn.
        #[test]
        fn agrees_with_a_scan(tokens in prop::collection::vec("[ab<>｜]{0,4}", 0..12), text in "[ab<>｜]{0,8}") {
            let set = AddedTokens::new(tokens.iter().map(String::as_str));
            let nonempty = || tokens.iter().filter(|t| !t.is_empty());
            prop_assert_eq!(set.is_prefix_of(&text), nonempty().any(|t| text.starts_with(t.as_str())));
            prop_assert_eq!(set.is_suffix_of(&text), nonempty().any(|t| text.ends_with(t.as_str())));
        }
    }
}
