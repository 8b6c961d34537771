//! Prompt → token ids, with a bounded cache keyed by the filter's chained
//! segment hashes (ARCHITECTURE §7).
//!
//! # Algorithm
//!
//! A chat prompt is `render(messages, add_generation_prompt)`. For a
//! template that is *prefix-stable* (rendering messages `0..=k` gives a prefix
//! of rendering more messages) and a tokenizer that does not merge across the
//! end of a rendered message, the prompt's ids are the concatenation of the
//! ids of each message's rendered text plus the ids of the generation-prompt
//! suffix. The cache stores *chunks*:
//!
//! ```text
//! key h[k] → Chunk { prev: key of the chunk before (None = starts at 0),
//!                    rendered_len / rendered_hash of render(0..=k),
//!                    tokens of render(0..=k)[prev.rendered_len..],
//!                    messages: the parsed messages prev+1..=k,
//!                    gen_suffix: ids of the generation prompt after k (when seen) }
//! ```
//!
//! * **Full hit** (`h[n-1]` cached with its suffix): ids = chain of chunks +
//!   suffix. No JSON parse, no render; cost O(prompt ids) to copy, plus
//!   re-hashing the message bytes.
//! * **Partial hit, local template** (longest cached `h[k]`, k < n-1, and
//!   the load-time locality test passed): parse only the new messages, render
//!   *stand-ins* (role, empty content) for the cached messages followed by
//!   the new ones, without and with the generation prompt, and take the text
//!   after the stand-ins' own render. Cost O(new messages): the cached text
//!   is never rendered, hashed or compared. Boundary safety uses the flag the
//!   chunk kept (`ends_with_added`). The locality test checks, on the
//!   self-test conversations, that stand-ins change nothing after them; the
//!   sampled verification renders for real.
//! * **Partial hit, other templates**: parse only the new
//!   messages (the cached ones come parsed from their chunks: parsing a
//!   100K-token message costs ~1.5 ms, rendering it ~0.1 ms), render the whole
//!   conversation once without and once with the generation prompt, check
//!   that the render starts with the cached text (xxh3 of the first
//!   `rendered_len` bytes), and tokenize only the new text. A new chunk is
//!   stored at `h[n-1]`.
//! * **Miss**: as a partial hit from nothing; chunks are stored at the first
//!   message (system prompts and shared documents are commonly there) and at
//!   the last.
//!
//! A boundary is used only where the tokenizer cannot merge across it: an
//! added (special) token ends the text before it or starts the text after
//! it (`ChatTokenizer::boundary_safe`). Two system messages rendered back to
//! back without a marker, for instance, are not split.
//!
//! A self-test at model load compares chunked with whole-prompt tokenization
//! on sample conversations; when they differ, the model tokenizes whole
//! prompts (no cache). Every `verify_every`-th chunked result is also checked
//! against a whole-prompt tokenization, and a mismatch switches the model to
//! whole prompts at run time (counted in metrics).
//!
//! # Complexity
//!
//! | path | cost |
//! |---|---|
//! | full hit | O(message bytes) hashing + O(ids) copy |
//! | partial hit, local template | O(new messages) parse + render ×3 + BPE, plus O(prompt ids) copy |
//! | partial hit, other templates | JSON parse of the new messages + O(prompt text) render ×2 + BPE of the new text only |
//! | miss / whole | O(prompt text) render + BPE of everything |
//! | memory | bounded by `budget_tokens` × 4 bytes; cached messages count 1 token per 4 bytes of their JSON |

//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | the public types, the tokenizer's API, self-test and sampled verification |
//! | `chat.rs` | a chat prompt through the cache: chain check, longest cached chain, render, reuse, encode, commit |
//! | `cache.rs` | chunks and the bounded LRU of them |
//! | `parse.rs` | the request's template context and messages |

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::{ChatTokenizer, TokenizeError};
use kvgate_protocol::SegmentHash;
use parking_lot::Mutex;
use serde_json::{Map, Value};

mod cache;
mod chat;
mod parse;

use cache::Cache;
use parse::{parse_context, parse_messages, stand_in};

/// Why a prompt could not be tokenized.
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    /// `template_context_json` is not a JSON object.
    #[error("template context is not a JSON object: {0}")]
    Context(String),
    /// A message is not a JSON object.
    #[error("message {index} is not a JSON object: {reason}")]
    Message {
        /// Position in the request.
        index: usize,
        /// Why.
        reason: String,
    },
    /// Rendering or encoding failed.
    #[error(transparent)]
    Tokenize(#[from] TokenizeError),
    /// Elided messages that the cache no longer holds (or elided messages
    /// that do not lead the conversation): the filter must send them.
    #[error("elided messages are not held here: {0}")]
    NeedText(&'static str),
}

/// How a prompt was tokenized (for metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Outcome {
    /// Every message and the generation prompt came from the cache.
    FullHit,
    /// Some leading messages came from the cache.
    PartialHit,
    /// Nothing came from the cache.
    #[default]
    Miss,
    /// The whole prompt was tokenized at once (cache off for this model or
    /// this request).
    Whole,
    /// Token ids given by the client.
    Given,
}

impl Outcome {
    /// Label value in metrics.
    pub fn name(self) -> &'static str {
        match self {
            Self::FullHit => "full_hit",
            Self::PartialHit => "partial_hit",
            Self::Miss => "miss",
            Self::Whole => "whole",
            Self::Given => "given",
        }
    }
}

/// Token ids of a prompt and how they were obtained.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tokenized {
    /// The ids, as vLLM computes them.
    pub ids: Vec<u32>,
    /// How.
    pub outcome: Outcome,
    /// Bytes of text that went through the tokenizer for this request.
    pub encoded_bytes: usize,
    /// Chain hashes up to which the cache now holds the conversation
    /// (messages and tokens): its first chunk boundary (a shared system
    /// prompt or document) and its last message; empty when it does not
    /// hold it. The filter may elide the messages up to one of them next
    /// time (`PickResponse.retained_chain_hashes`).
    pub retained: Vec<u64>,
}

/// One chat message as received: chained hash and raw JSON.
#[derive(Debug, Clone, Copy)]
pub struct SegmentRef<'a> {
    /// `Segment.chain_hash` from the filter.
    pub chain_hash: u64,
    /// `Segment.message_json` (empty when elided).
    pub message_json: &'a [u8],
    /// `Segment.elided`: the filter left the bytes out because this
    /// tokenizer said it retains the conversation up to here.
    pub elided: bool,
}

/// Cache statistics (monotonic, for metrics).
#[derive(Debug, Default)]
pub struct TokenStats {
    /// Requests per [`Outcome`]: full_hit, partial_hit, miss, whole, given.
    pub outcomes: [AtomicU64; 5],
    /// Requests whose chain hashes did not match their bytes (cache bypassed).
    pub hash_mismatches: AtomicU64,
    /// Cached text that no longer prefixed the render (prefix-unstable template).
    pub prefix_unstable: AtomicU64,
    /// Message boundaries where the tokenizer could merge across (no added
    /// token on either side): not used as chunk boundaries.
    pub unsafe_boundaries: AtomicU64,
    /// Sampled verifications that found chunked ≠ whole tokenization.
    pub verify_failures: AtomicU64,
    /// Bytes through the tokenizer.
    pub encoded_bytes: AtomicU64,
}

impl TokenStats {
    /// The single-valued counters as (metric name after `kvgate_tokenize_`,
    /// help, value), for metrics. The
    /// struct is destructured without `..`: a counter added to it does not
    /// compile until it is listed here.
    pub fn counters(&self) -> [(&'static str, &'static str, u64); 5] {
        let Self { outcomes: _, hash_mismatches, prefix_unstable, unsafe_boundaries, verify_failures, encoded_bytes } =
            self;
        let v = |c: &AtomicU64| c.load(Ordering::Relaxed);
        [
            (
                "hash_mismatches",
                "Requests whose chain hashes did not match their bytes (cache bypassed).",
                v(hash_mismatches),
            ),
            (
                "prefix_unstable",
                "Cached text that no longer prefixed the render (prefix-unstable template).",
                v(prefix_unstable),
            ),
            (
                "unsafe_boundaries",
                "Message boundaries the tokenizer could merge across (not used as chunk boundaries).",
                v(unsafe_boundaries),
            ),
            (
                "verify_failures",
                "Sampled verifications that found chunked tokenization different from whole-prompt tokenization.",
                v(verify_failures),
            ),
            ("bytes", "Prompt text bytes run through the tokenizer.", v(encoded_bytes)),
        ]
    }
}

/// Settings of a [`PromptTokenizer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenCacheConfig {
    /// Token ids kept in the cache (4 bytes each).
    pub budget_tokens: usize,
    /// Every n-th chunked tokenization is checked against a whole-prompt
    /// one (0 = never).
    pub verify_every: u64,
}

impl Default for TokenCacheConfig {
    fn default() -> Self {
        Self { budget_tokens: 8 << 20, verify_every: 1000 }
    }
}

/// A model's tokenizer with the segment cache.
pub struct PromptTokenizer {
    tk: ChatTokenizer,
    cache: Mutex<Cache>,
    segmented: AtomicBool,
    /// The template renders each message independently of the contents of
    /// the messages before it (load-time self-test): a new turn renders
    /// stand-ins for the cached messages instead of their text.
    local: AtomicBool,
    verify_every: u64,
    counter: AtomicU64,
    /// Statistics.
    pub stats: TokenStats,
    self_test: String,
}

impl std::fmt::Debug for PromptTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptTokenizer").field("segmented", &self.segmented()).finish()
    }
}

/// Sample conversations for the load-time self-test: boundaries after
/// whitespace, punctuation, digits, non-ASCII text and empty contents.
fn self_test_conversations() -> Vec<Vec<Value>> {
    use serde_json::json;
    let texts = [
        "You are a helpful assistant.",
        "Hello there ",
        "line one\nline two\n\n",
        "1234",
        "",
        "  leading and trailing  ",
        "Grüße, 世界! こんにちは。",
        "ends with a dot.",
        "tab\tseparated\t",
        "```rust\nfn main() {}\n```",
    ];
    let mut out = Vec::new();
    for (i, t) in texts.iter().enumerate() {
        let next = texts[(i + 3) % texts.len()];
        let other = texts[(i + 7) % texts.len()];
        out.push(vec![json!({"role": "user", "content": t})]);
        out.push(vec![json!({"role": "system", "content": t}), json!({"role": "user", "content": next})]);
        out.push(vec![
            json!({"role": "system", "content": other}),
            json!({"role": "user", "content": t}),
            json!({"role": "assistant", "content": next}),
            json!({"role": "user", "content": other}),
        ]);
    }
    out
}

impl PromptTokenizer {
    /// Loads a model directory (see [`ChatTokenizer::from_dir`]) and runs
    /// the self-test.
    pub fn from_dir(dir: &Path, config: TokenCacheConfig) -> Result<Self, TokenizeError> {
        Ok(Self::new(ChatTokenizer::from_dir(dir)?, config))
    }

    /// Wraps a tokenizer and runs the self-test.
    pub fn new(tk: ChatTokenizer, config: TokenCacheConfig) -> Self {
        let mut this = Self {
            tk,
            cache: Mutex::new(Cache { lru: lru::LruCache::unbounded(), used: 0, budget: config.budget_tokens.max(1) }),
            segmented: AtomicBool::new(false),
            local: AtomicBool::new(false),
            verify_every: config.verify_every,
            counter: AtomicU64::new(0),
            stats: TokenStats::default(),
            self_test: String::new(),
        };
        match this.run_self_test() {
            Ok(n) => {
                let local = this.locality_test();
                this.local.store(local.is_ok(), Ordering::Relaxed);
                this.self_test = match local {
                    Ok(()) => format!("passed on {n} conversations; local template: new turns render stand-ins"),
                    Err(why) => {
                        format!("passed on {n} conversations; template not local ({why}): new turns render in full")
                    }
                };
                this.segmented.store(true, Ordering::Relaxed);
            }
            Err(why) => this.self_test = format!("failed ({why}): whole-prompt tokenization"),
        }
        this
    }

    /// The underlying tokenizer.
    pub fn inner(&self) -> &ChatTokenizer {
        &self.tk
    }

    /// Whether the segment cache is in use.
    pub fn segmented(&self) -> bool {
        self.segmented.load(Ordering::Relaxed)
    }

    /// Result of the load-time self-test, for logs and the admin endpoint.
    pub fn self_test_result(&self) -> &str {
        &self.self_test
    }

    /// Cached ids and entries.
    pub fn cache_size(&self) -> (usize, usize) {
        let c = self.cache.lock();
        (c.used, c.lru.len())
    }

    fn run_self_test(&self) -> Result<usize, String> {
        let convs = self_test_conversations();
        for conv in &convs {
            for gen_prompt in [true, false] {
                let whole = self.whole(conv, gen_prompt, &Map::new()).map_err(|e| e.to_string())?;
                let mut chunked = Vec::new();
                let mut prev = String::new();
                for k in 0..conv.len() {
                    let r = self.tk.render(&conv[..=k], false, &Map::new()).map_err(|e| e.to_string())?;
                    let Some(delta) = r.strip_prefix(prev.as_str()) else {
                        return Err(format!("template is not prefix-stable at message {k}"));
                    };
                    chunked.extend(self.tk.encode(delta).map_err(|e| e.to_string())?);
                    prev = r;
                }
                let full = self.tk.render(conv, gen_prompt, &Map::new()).map_err(|e| e.to_string())?;
                let Some(suffix) = full.strip_prefix(prev.as_str()) else {
                    return Err("generation prompt is not a suffix".into());
                };
                chunked.extend(self.tk.encode(suffix).map_err(|e| e.to_string())?);
                if chunked != whole {
                    return Err(format!("chunked ids differ from whole-prompt ids on {conv:?}"));
                }
            }
        }
        Ok(convs.len())
    }

    /// Whether rendering stand-ins (role only, empty content) for the first
    /// messages leaves the text of the later messages and of the generation
    /// prompt unchanged, on the self-test conversations.
    fn locality_test(&self) -> Result<(), String> {
        let e = |e: TokenizeError| e.to_string();
        let extra = Map::new();
        for conv in self_test_conversations() {
            for k in 0..conv.len().saturating_sub(1) {
                let stand: Vec<Value> =
                    conv.iter().enumerate().map(|(i, m)| if i <= k { stand_in(m) } else { m.clone() }).collect();
                for gen_prompt in [false, true] {
                    let real_k = self.tk.render(&conv[..=k], false, &extra).map_err(e)?;
                    let real = self.tk.render(&conv, gen_prompt, &extra).map_err(e)?;
                    let stand_k = self.tk.render(&stand[..=k], false, &extra).map_err(e)?;
                    let stand_all = self.tk.render(&stand, gen_prompt, &extra).map_err(e)?;
                    if real.strip_prefix(real_k.as_str()) != stand_all.strip_prefix(stand_k.as_str()) {
                        return Err(format!("message {} renders differently after stand-ins", k + 1));
                    }
                }
            }
        }
        Ok(())
    }

    /// Every `verify_every`-th chunked result: tokenizes the whole prompt
    /// (`render` gives its text) and, when it differs from `ids`, switches
    /// the model to whole prompts, empties the cache and returns the whole
    /// prompt's ids.
    fn verify_sample(
        &self,
        ids: &[u32],
        render: impl FnOnce() -> Result<String, TokenizeError>,
    ) -> Result<Option<Tokenized>, PromptError> {
        let nth = self.counter.fetch_add(1, Ordering::Relaxed) + 1;
        if self.verify_every == 0 || !nth.is_multiple_of(self.verify_every) {
            return Ok(None);
        }
        let text = render()?;
        let whole = self.tk.encode(&text)?;
        if whole == ids {
            return Ok(None);
        }
        self.stats.verify_failures.fetch_add(1, Ordering::Relaxed);
        self.segmented.store(false, Ordering::Relaxed);
        self.cache.lock().lru.clear();
        Ok(Some(Tokenized { ids: whole, outcome: Outcome::Whole, encoded_bytes: text.len(), retained: Vec::new() }))
    }

    fn whole(&self, messages: &[Value], gen_prompt: bool, extra: &Map<String, Value>) -> Result<Vec<u32>, PromptError> {
        Ok(self.whole_counted(messages, gen_prompt, extra)?.ids)
    }

    fn whole_counted(
        &self,
        messages: &[Value],
        gen_prompt: bool,
        extra: &Map<String, Value>,
    ) -> Result<Tokenized, PromptError> {
        let text = self.tk.render(messages, gen_prompt, extra)?;
        self.stats.encoded_bytes.fetch_add(text.len() as u64, Ordering::Relaxed);
        Ok(Tokenized {
            ids: self.tk.encode(&text)?,
            outcome: Outcome::Whole,
            encoded_bytes: text.len(),
            retained: Vec::new(),
        })
    }

    fn count(&self, t: &Tokenized) {
        let i = match t.outcome {
            Outcome::FullHit => 0,
            Outcome::PartialHit => 1,
            Outcome::Miss => 2,
            Outcome::Whole => 3,
            Outcome::Given => 4,
        };
        self.stats.outcomes[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Token ids of a `/v1/completions` text prompt: vLLM tokenizes it with
    /// special tokens (the BOS of models that have one).
    pub fn completion(&self, prompt: &str) -> Result<Tokenized, PromptError> {
        let ids = self.tk.encode_with_special(prompt)?;
        self.stats.encoded_bytes.fetch_add(prompt.len() as u64, Ordering::Relaxed);
        let t = Tokenized { ids, outcome: Outcome::Whole, encoded_bytes: prompt.len(), retained: Vec::new() };
        self.count(&t);
        Ok(t)
    }

    /// Token ids of a chat prompt.
    pub fn chat(&self, context_json: &[u8], segments: &[SegmentRef<'_>]) -> Result<Tokenized, PromptError> {
        let t = self.chat_inner(context_json, segments)?;
        self.count(&t);
        Ok(t)
    }

    /// Whole-prompt ids of a chat request, bypassing the cache (reference
    /// for tests and the benchmark).
    pub fn chat_uncached(&self, context_json: &[u8], segments: &[SegmentRef<'_>]) -> Result<Vec<u32>, PromptError> {
        let ctx = parse_context(context_json)?;
        let messages = parse_messages(segments)?;
        self.whole(&messages, ctx.add_generation_prompt, &ctx.extra)
    }
}

/// Chained hashes for messages (what the filter computes), for tests and
/// benchmarks.
pub fn chain_hashes(context_json: &[u8], messages: &[&[u8]]) -> Vec<u64> {
    let mut h = SegmentHash::context(context_json);
    messages
        .iter()
        .map(|m| {
            h = h.chain(m);
            h.0
        })
        .collect()
}
