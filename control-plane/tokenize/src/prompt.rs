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

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::{ChatTokenizer, TokenizeError};
use kvgate_protocol::SegmentHash;
use parking_lot::Mutex;
use serde_json::{Map, Value};
use xxhash_rust::xxh3::xxh3_64;

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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Every message and the generation prompt came from the cache.
    FullHit,
    /// Some leading messages came from the cache.
    PartialHit,
    /// Nothing came from the cache.
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

#[derive(Debug)]
struct Chunk {
    /// Its own key (the chain hash of its last message).
    key: u64,
    prev: Option<u64>,
    rendered_len: usize,
    /// xxh3 of the rendered text up to here; `None` when the chunk was made
    /// by a stand-in render (the real text was never rendered).
    rendered_hash: Option<u64>,
    /// The real rendered text up to here ends with an added token.
    ends_with_added: bool,
    tokens: Box<[u32]>,
    /// The messages this chunk covers, parsed (shared with the chunk that
    /// only adds a generation suffix).
    messages: Arc<[Value]>,
    /// Bytes of those messages' JSON (for the budget).
    message_bytes: usize,
    gen_suffix: Option<Box<[u32]>>,
}

impl Chunk {
    /// Budget units: token ids, plus one per 4 bytes of message JSON.
    fn cost(&self) -> usize {
        self.tokens.len() + self.gen_suffix.as_ref().map_or(0, |s| s.len()) + self.message_bytes / 4 + 16
    }
}

struct Cache {
    lru: lru::LruCache<u64, Arc<Chunk>>,
    used: usize,
    budget: usize,
}

impl Cache {
    /// Whether the chunk was kept (it is not when larger than the budget).
    fn insert(&mut self, key: u64, chunk: Chunk) -> bool {
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

struct Context {
    extra: Map<String, Value>,
    add_generation_prompt: bool,
    cacheable: bool,
}

fn parse_context(json: &[u8]) -> Result<Context, PromptError> {
    let mut ctx = Context { extra: Map::new(), add_generation_prompt: true, cacheable: true };
    if json.is_empty() {
        return Ok(ctx);
    }
    let v: Value = serde_json::from_slice(json).map_err(|e| PromptError::Context(e.to_string()))?;
    let Value::Object(map) = v else { return Err(PromptError::Context("not an object".into())) };
    for (k, v) in map {
        match k.as_str() {
            "add_generation_prompt" => ctx.add_generation_prompt = v.as_bool().unwrap_or(true),
            // Continuing the last message renders it unterminated: not a
            // prefix of anything cached; tokenize whole.
            "continue_final_message" => {
                if v.as_bool() == Some(true) {
                    ctx.cacheable = false;
                    ctx.add_generation_prompt = false;
                }
            }
            "chat_template_kwargs" => {
                if let Value::Object(kw) = v {
                    ctx.extra.extend(kw);
                }
            }
            // A per-request template is refused by vLLM unless
            // --trust-request-chat-template; kvgate renders the model's.
            "chat_template" => {}
            _ => {
                ctx.extra.insert(k, v);
            }
        }
    }
    Ok(ctx)
}

fn parse_messages(segments: &[SegmentRef<'_>]) -> Result<Vec<Value>, PromptError> {
    segments
        .iter()
        .enumerate()
        .map(|(index, s)| match serde_json::from_slice::<Value>(s.message_json) {
            Ok(v @ Value::Object(_)) => Ok(v),
            Ok(_) => Err(PromptError::Message { index, reason: "not an object".into() }),
            Err(e) => Err(PromptError::Message { index, reason: e.to_string() }),
        })
        .collect()
}

/// What a cached message renders as in a stand-in render: its role, no
/// content.
fn stand_in(m: &Value) -> Value {
    let mut o = Map::new();
    o.insert("role".into(), m.get("role").cloned().unwrap_or(Value::Null));
    o.insert("content".into(), Value::String(String::new()));
    Value::Object(o)
}

/// The first boundary (when it is not the last) and the last.
fn retained_pair(first: Option<u64>, last: u64) -> Vec<u64> {
    match first {
        Some(f) if f != last => vec![f, last],
        _ => vec![last],
    }
}

/// Owned copies of parsed messages, for a chunk.
fn own(messages: &[&Value]) -> Arc<[Value]> {
    messages.iter().map(|m| (*m).clone()).collect()
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

    /// A new turn on a cached prefix 0..=k, rendering stand-ins for the
    /// cached messages: O(new messages). `None` when the render is not
    /// prefix-stable here or a boundary is not safe (the caller renders in
    /// full).
    #[allow(clippy::too_many_arguments)]
    fn new_turn_local(
        &self,
        segments: &[SegmentRef<'_>],
        chunks: &[Arc<Chunk>],
        k: usize,
        cached: &[&Value],
        parsed: &[Value],
        gen_prompt: bool,
        extra: &Map<String, Value>,
    ) -> Result<Option<Tokenized>, PromptError> {
        let Some(last) = chunks.last() else { return Ok(None) };
        let stand: Vec<Value> = cached.iter().map(|m| stand_in(m)).collect();
        let prefix = self.tk.render(&stand, false, extra)?;
        let all: Vec<&Value> = stand.iter().chain(parsed.iter()).collect();
        let context = self.tk.render_context(&all, extra);
        let no_gen = self.tk.render_with(&context, false, prefix.len() + 1024)?;
        let with_gen =
            if gen_prompt { self.tk.render_with(&context, true, no_gen.len() + 256)? } else { no_gen.clone() };
        let (Some(new_text), Some(suffix_text)) =
            (no_gen.strip_prefix(prefix.as_str()), with_gen.strip_prefix(no_gen.as_str()))
        else {
            return Ok(None);
        };
        let end_added = if new_text.is_empty() { last.ends_with_added } else { self.tk.ends_with_added(new_text) };
        let safe_new = new_text.is_empty() || last.ends_with_added || self.tk.starts_with_added(new_text);
        let safe_suffix = suffix_text.is_empty() || end_added || self.tk.starts_with_added(suffix_text);
        if !(safe_new && safe_suffix) {
            self.stats.unsafe_boundaries.fetch_add(1, Ordering::Relaxed);
            return Ok(None);
        }
        let toks = self.tk.encode(new_text)?;
        let suffix = self.tk.encode(suffix_text)?;
        let total = chunks.iter().map(|c| c.tokens.len()).sum::<usize>() + toks.len() + suffix.len();
        let mut ids = Vec::with_capacity(total);
        for c in chunks {
            ids.extend_from_slice(&c.tokens);
        }
        ids.extend_from_slice(&toks);
        ids.extend_from_slice(&suffix);
        let encoded = new_text.len() + suffix_text.len();
        self.stats.encoded_bytes.fetch_add(encoded as u64, Ordering::Relaxed);
        let n = segments.len();
        let last_key = segments.get(n.wrapping_sub(1)).map_or(0, |s| s.chain_hash);
        let prev_key = segments.get(k).map(|s| s.chain_hash);

        // Sampled verification against the whole prompt, rendered for real.
        let real = || {
            let messages: Vec<&Value> = cached.iter().copied().chain(parsed.iter()).collect();
            self.tk.render(&messages, gen_prompt, extra)
        };
        if let Some(whole) = self.verify_sample(&ids, real)? {
            return Ok(Some(whole));
        }

        let chunk = Chunk {
            key: last_key,
            prev: prev_key,
            rendered_len: last.rendered_len + new_text.len(),
            rendered_hash: None,
            ends_with_added: end_added,
            tokens: toks.into(),
            messages: parsed.iter().cloned().collect(),
            message_bytes: segments.get(k + 1..).unwrap_or_default().iter().map(|s| s.message_json.len()).sum(),
            gen_suffix: gen_prompt.then(|| suffix.into()),
        };
        let mut retained = retained_pair(chunks.first().map(|c| c.key), last_key);
        if !self.cache.lock().insert(last_key, chunk) {
            retained.clear();
        }
        Ok(Some(Tokenized { ids, outcome: Outcome::PartialHit, encoded_bytes: encoded, retained }))
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

    fn chat_inner(&self, context_json: &[u8], segments: &[SegmentRef<'_>]) -> Result<Tokenized, PromptError> {
        let ctx = parse_context(context_json)?;
        // The chain must match the bytes: a wrong hash would return another
        // conversation's tokens.
        // Elided messages lead the conversation; their hashes are the
        // filter's (it computed them from bytes it saw), the rest are checked.
        let elided = segments.iter().take_while(|s| s.elided).count();
        if segments.iter().skip(elided).any(|s| s.elided) {
            return Err(PromptError::NeedText("elided messages must lead the conversation"));
        }
        let mut chain_ok = true;
        let mut h = match elided.checked_sub(1).and_then(|i| segments.get(i)) {
            Some(s) => SegmentHash(s.chain_hash),
            None => SegmentHash::context(context_json),
        };
        for s in segments.iter().skip(elided) {
            h = h.chain(s.message_json);
            if h.0 != s.chain_hash {
                chain_ok = false;
                break;
            }
        }
        if !chain_ok {
            self.stats.hash_mismatches.fetch_add(1, Ordering::Relaxed);
        }
        let cacheable = chain_ok && ctx.cacheable && self.segmented();
        if elided > 0 && !cacheable {
            return Err(PromptError::NeedText("this request cannot use the cache"));
        }
        if !cacheable || segments.is_empty() {
            let messages = parse_messages(segments)?;
            return self.whole_counted(&messages, ctx.add_generation_prompt, &ctx.extra);
        }

        // Longest cached prefix and its chain of chunks.
        let gen_prompt = ctx.add_generation_prompt;
        let n = segments.len();
        let (hit, chunks) = {
            let mut cache = self.cache.lock();
            let mut found = None;
            for k in (0..n).rev() {
                let key = segments[k].chain_hash;
                if let Some(chunk) = cache.lru.get(&key).cloned() {
                    let mut chain = vec![chunk];
                    let mut complete = true;
                    while let Some(prev) = chain.last().and_then(|c| c.prev) {
                        // A chain is never longer than the conversation: a
                        // longer one would be a cycle (hash collision).
                        if chain.len() > k + 1 {
                            complete = false;
                            break;
                        }
                        match cache.lru.get(&prev).cloned() {
                            Some(c) => chain.push(c),
                            None => {
                                complete = false;
                                break;
                            }
                        }
                    }
                    if complete {
                        chain.reverse();
                        found = Some((k, chain));
                        break;
                    }
                }
            }
            match found {
                Some((k, chain)) => (Some(k), chain),
                None => (None, Vec::new()),
            }
        };

        // Full hit: no render needed when the suffix for this flag is known.
        if hit == Some(n - 1) {
            let last = chunks.last();
            let suffix: Option<&[u32]> =
                if gen_prompt { last.and_then(|c| c.gen_suffix.as_deref()) } else { Some(&[]) };
            if let Some(suffix) = suffix {
                let total: usize = chunks.iter().map(|c| c.tokens.len()).sum::<usize>() + suffix.len();
                let mut ids = Vec::with_capacity(total);
                for c in &chunks {
                    ids.extend_from_slice(&c.tokens);
                }
                ids.extend_from_slice(suffix);
                return Ok(Tokenized {
                    ids,
                    outcome: Outcome::FullHit,
                    encoded_bytes: 0,
                    retained: retained_pair(chunks.first().map(|c| c.key), segments[n - 1].chain_hash),
                });
            }
        }

        // Cached messages come parsed from their chunks (only a chain that
        // covers exactly 0..=k is used); the rest are parsed now.
        let cached: Vec<&Value> = chunks.iter().flat_map(|c| c.messages.iter()).collect();
        let from = match hit {
            Some(k) if cached.len() == k + 1 => k + 1,
            _ => 0,
        };
        if from < elided {
            return Err(PromptError::NeedText("evicted"));
        }
        let parsed = parse_messages(segments.get(from..).unwrap_or_default()).map_err(|e| match e {
            PromptError::Message { index, reason } => PromptError::Message { index: index + from, reason },
            e => e,
        })?;
        // (At least one new message: a hit on the last message that only
        // lacks the generation suffix takes the full path, which updates
        // that chunk in place.)
        if let Some(k) = hit
            && from == k + 1
            && from < n
            && self.local.load(Ordering::Relaxed)
            && let Some(t) = self.new_turn_local(segments, &chunks, k, &cached, &parsed, gen_prompt, &ctx.extra)?
        {
            return Ok(t);
        }
        let messages: Vec<&Value> = cached.iter().take(from).copied().chain(parsed.iter()).collect();
        let context = self.tk.render_context(&messages, &ctx.extra);
        // The render's size: the cached text plus about the new messages'.
        let hint = chunks.last().map_or(0, |c| c.rendered_len)
            + segments.get(from..).unwrap_or_default().iter().map(|s| s.message_json.len()).sum::<usize>()
            + 1024;
        let no_gen = self.tk.render_with(&context, false, hint)?;
        let with_gen = if gen_prompt { self.tk.render_with(&context, true, hint)? } else { no_gen.clone() };
        let suffix_text = with_gen.strip_prefix(no_gen.as_str());
        if suffix_text.is_some_and(|t| !self.tk.boundary_safe(&no_gen, t)) {
            self.stats.unsafe_boundaries.fetch_add(1, Ordering::Relaxed);
        }
        let Some(suffix_text) = suffix_text.filter(|t| self.tk.boundary_safe(&no_gen, t)) else {
            // The generation prompt changes earlier text: not chunkable.
            self.stats.prefix_unstable.fetch_add(1, Ordering::Relaxed);
            let ids = self.tk.encode(&with_gen)?;
            self.stats.encoded_bytes.fetch_add(with_gen.len() as u64, Ordering::Relaxed);
            return Ok(Tokenized { ids, outcome: Outcome::Whole, encoded_bytes: with_gen.len(), retained: Vec::new() });
        };

        // Where the cached text ends, if it still prefixes the render.
        let mut start = 0usize;
        let mut ids: Vec<u32> = Vec::new();
        let mut prev_key = None;
        // Messages before this one are covered by `prev_key`'s chain.
        let mut covered = 0usize;
        let mut outcome = Outcome::Miss;
        if let (Some(k), Some(last)) = (hit, chunks.last()) {
            let len = last.rendered_len;
            let matches = no_gen.len() >= len
                && no_gen.is_char_boundary(len)
                && last.rendered_hash == Some(xxh3_64(&no_gen.as_bytes()[..len]));
            let safe = matches && self.tk.boundary_safe(&no_gen[..len], &no_gen[len..]);
            if matches && !safe {
                self.stats.unsafe_boundaries.fetch_add(1, Ordering::Relaxed);
            }
            if safe {
                for c in &chunks {
                    ids.extend_from_slice(&c.tokens);
                }
                start = len;
                prev_key = Some(segments[k].chain_hash);
                covered = k + 1;
                outcome = Outcome::PartialHit;
            } else if !matches {
                self.stats.prefix_unstable.fetch_add(1, Ordering::Relaxed);
            }
        }

        let mut encoded = 0usize;
        let mut new_chunks: Vec<(u64, Chunk)> = Vec::new();
        // On a miss, a boundary after the first message too (shared system
        // prompts and documents), when the template renders it as a prefix.
        let first_new = 0;
        if outcome == Outcome::Miss && n > 1 {
            let first = self.tk.render(&messages[..=first_new], false, &ctx.extra)?;
            if no_gen.starts_with(first.as_str())
                && first.len() > start
                && self.tk.boundary_safe(&first, &no_gen[first.len()..])
            {
                let toks = self.tk.encode(&first[start..])?;
                encoded += first.len() - start;
                ids.extend_from_slice(&toks);
                new_chunks.push((
                    segments[first_new].chain_hash,
                    Chunk {
                        key: segments[first_new].chain_hash,
                        prev: prev_key,
                        rendered_len: first.len(),
                        rendered_hash: Some(xxh3_64(first.as_bytes())),
                        ends_with_added: self.tk.ends_with_added(&first),
                        tokens: toks.into(),
                        messages: own(&messages[..=first_new]),
                        message_bytes: segments[first_new].message_json.len(),
                        gen_suffix: None,
                    },
                ));
                prev_key = Some(segments[first_new].chain_hash);
                covered = first_new + 1;
                start = first.len();
            }
        }
        let rest = no_gen.get(start..).unwrap_or_default();
        let toks = self.tk.encode(rest)?;
        encoded += rest.len();
        ids.extend_from_slice(&toks);
        let suffix = self.tk.encode(suffix_text)?;
        encoded += suffix_text.len();
        ids.extend_from_slice(&suffix);
        let last_key = segments[n - 1].chain_hash;
        match chunks.last() {
            // Cached up to the last message, only the generation prompt was
            // missing (the chunk was a boundary of a longer conversation):
            // the same chunk, now with its suffix. (A new chunk here would
            // name itself as its predecessor.)
            Some(last) if outcome == Outcome::PartialHit && prev_key == Some(last_key) => new_chunks.push((
                last_key,
                Chunk {
                    key: last_key,
                    prev: last.prev,
                    rendered_len: last.rendered_len,
                    rendered_hash: last.rendered_hash,
                    ends_with_added: last.ends_with_added,
                    tokens: last.tokens.clone(),
                    messages: last.messages.clone(),
                    message_bytes: last.message_bytes,
                    gen_suffix: gen_prompt.then(|| suffix.into()),
                },
            )),
            _ => new_chunks.push((
                last_key,
                Chunk {
                    key: last_key,
                    prev: prev_key,
                    rendered_len: no_gen.len(),
                    rendered_hash: Some(xxh3_64(no_gen.as_bytes())),
                    ends_with_added: self.tk.ends_with_added(&no_gen),
                    tokens: toks.into(),
                    messages: own(messages.get(covered..).unwrap_or_default()),
                    message_bytes: segments
                        .get(covered..)
                        .unwrap_or_default()
                        .iter()
                        .map(|s| s.message_json.len())
                        .sum(),
                    gen_suffix: gen_prompt.then(|| suffix.into()),
                },
            )),
        }
        self.stats.encoded_bytes.fetch_add(encoded as u64, Ordering::Relaxed);

        // Sampled verification against the whole prompt.
        if let Some(whole) = self.verify_sample(&ids, || Ok(with_gen.clone()))? {
            return Ok(whole);
        }

        let mut cache = self.cache.lock();
        let first = chunks.first().filter(|_| outcome == Outcome::PartialHit).map(|c| c.key);
        let mut retained = retained_pair(first.or(new_chunks.first().map(|c| c.0)), last_key);
        for (key, chunk) in new_chunks {
            if !cache.insert(key, chunk) {
                retained.clear();
            }
        }
        Ok(Tokenized { ids, outcome, encoded_bytes: encoded, retained })
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
