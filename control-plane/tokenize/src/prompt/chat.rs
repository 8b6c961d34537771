//! A chat prompt through the cache (the algorithm in the module's header):
//! chain check, longest cached chain, full hit, new turn on a local
//! template, or render + reuse + encode, then the new chunks stored.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use kvgate_protocol::SegmentHash;
use serde_json::{Map, Value};
use xxhash_rust::xxh3::xxh3_64;

use super::cache::{Build, Chunk, full_hit, own, retained_pair};
use super::parse::{Context, parse_context, parse_messages, stand_in};
use super::{Outcome, PromptError, PromptTokenizer, SegmentRef, Tokenized};

impl PromptTokenizer {
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

    pub(super) fn chat_inner(
        &self,
        context_json: &[u8],
        segments: &[SegmentRef<'_>],
    ) -> Result<Tokenized, PromptError> {
        let ctx = parse_context(context_json)?;
        let elided = self.check_chain(context_json, segments, ctx.cacheable)?;
        let Some(elided) = elided else {
            let messages = parse_messages(segments)?;
            return self.whole_counted(&messages, ctx.add_generation_prompt, &ctx.extra);
        };
        let gen_prompt = ctx.add_generation_prompt;
        let n = segments.len();
        let (hit, chunks) = self.cache.lock().longest_chain(segments);
        if hit == Some(n - 1)
            && let Some(t) = full_hit(&chunks, segments, gen_prompt)
        {
            return Ok(t);
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
        self.render_and_encode(&ctx, segments, &messages, hit, &chunks, from)
    }

    /// Checks the segments' chain hashes against their bytes (a wrong hash
    /// would return another conversation's tokens). Elided messages lead
    /// the conversation; their hashes are the filter's (it computed them
    /// from bytes it saw), the rest are checked. `Some(elided)` when the
    /// cache may be used, `None` when the whole prompt must be tokenized.
    fn check_chain(
        &self,
        context_json: &[u8],
        segments: &[SegmentRef<'_>],
        context_cacheable: bool,
    ) -> Result<Option<usize>, PromptError> {
        let elided = segments.iter().take_while(|s| s.elided).count();
        if segments.iter().skip(elided).any(|s| s.elided) {
            return Err(PromptError::NeedText("elided messages must lead the conversation"));
        }
        let mut h = match elided.checked_sub(1).and_then(|i| segments.get(i)) {
            Some(s) => SegmentHash(s.chain_hash),
            None => SegmentHash::context(context_json),
        };
        let chain_ok = segments.iter().skip(elided).all(|s| {
            h = h.chain(s.message_json);
            h.0 == s.chain_hash
        });
        if !chain_ok {
            self.stats.hash_mismatches.fetch_add(1, Ordering::Relaxed);
        }
        let cacheable = chain_ok && context_cacheable && self.segmented();
        if elided > 0 && !cacheable {
            return Err(PromptError::NeedText("this request cannot use the cache"));
        }
        Ok((cacheable && !segments.is_empty()).then_some(elided))
    }

    /// Renders the conversation (cached messages then new ones), reuses the
    /// cached chunks' tokens where their text still prefixes the render,
    /// encodes the rest, and stores the new chunks.
    fn render_and_encode(
        &self,
        ctx: &Context,
        segments: &[SegmentRef<'_>],
        messages: &[&Value],
        hit: Option<usize>,
        chunks: &[Arc<Chunk>],
        from: usize,
    ) -> Result<Tokenized, PromptError> {
        let gen_prompt = ctx.add_generation_prompt;
        let context = self.tk.render_context(messages, &ctx.extra);
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
        let mut b = self.reuse_prefix(hit, chunks, &no_gen, segments);
        if b.outcome == Outcome::Miss && segments.len() > 1 {
            self.first_message_boundary(&mut b, messages, &no_gen, segments, &ctx.extra)?;
        }
        let rest = no_gen.get(b.start..).unwrap_or_default();
        let toks = self.tk.encode(rest)?;
        b.encoded += rest.len();
        b.ids.extend_from_slice(&toks);
        let suffix = self.tk.encode(suffix_text)?;
        b.encoded += suffix_text.len();
        b.ids.extend_from_slice(&suffix);
        let last = self.last_chunk(&b, chunks, segments, messages, &no_gen, toks, gen_prompt.then(|| suffix.into()));
        b.new_chunks.push(last);
        self.stats.encoded_bytes.fetch_add(b.encoded as u64, Ordering::Relaxed);
        // Sampled verification against the whole prompt.
        if let Some(whole) = self.verify_sample(&b.ids, || Ok(with_gen.clone()))? {
            return Ok(whole);
        }
        Ok(self.commit(b, chunks, segments))
    }

    /// The cached chunks' tokens, when their rendered text still prefixes
    /// the new render at a boundary the tokenizer cannot merge across.
    fn reuse_prefix(
        &self,
        hit: Option<usize>,
        chunks: &[Arc<Chunk>],
        no_gen: &str,
        segments: &[SegmentRef<'_>],
    ) -> Build {
        let mut b = Build::default();
        let (Some(k), Some(last)) = (hit, chunks.last()) else { return b };
        let len = last.rendered_len;
        let matches = no_gen.len() >= len
            && no_gen.is_char_boundary(len)
            && last.rendered_hash == Some(xxh3_64(&no_gen.as_bytes()[..len]));
        let safe = matches && self.tk.boundary_safe(&no_gen[..len], &no_gen[len..]);
        if matches && !safe {
            self.stats.unsafe_boundaries.fetch_add(1, Ordering::Relaxed);
        }
        if safe {
            for c in chunks {
                b.ids.extend_from_slice(&c.tokens);
            }
            b.start = len;
            b.prev_key = Some(segments[k].chain_hash);
            b.covered = k + 1;
            b.outcome = Outcome::PartialHit;
        } else if !matches {
            self.stats.prefix_unstable.fetch_add(1, Ordering::Relaxed);
        }
        b
    }

    /// On a miss, a boundary after the first message too (shared system
    /// prompts and documents), when the template renders it as a prefix.
    fn first_message_boundary(
        &self,
        b: &mut Build,
        messages: &[&Value],
        no_gen: &str,
        segments: &[SegmentRef<'_>],
        extra: &Map<String, Value>,
    ) -> Result<(), PromptError> {
        let first = self.tk.render(&messages[..1], false, extra)?;
        if !(no_gen.starts_with(first.as_str())
            && first.len() > b.start
            && self.tk.boundary_safe(&first, &no_gen[first.len()..]))
        {
            return Ok(());
        }
        let toks = self.tk.encode(&first[b.start..])?;
        b.encoded += first.len() - b.start;
        b.ids.extend_from_slice(&toks);
        let key = segments[0].chain_hash;
        b.new_chunks.push((
            key,
            Chunk {
                key,
                prev: b.prev_key,
                rendered_len: first.len(),
                rendered_hash: Some(xxh3_64(first.as_bytes())),
                ends_with_added: self.tk.ends_with_added(&first),
                tokens: toks.into(),
                messages: own(&messages[..1]),
                message_bytes: segments[0].message_json.len(),
                gen_suffix: None,
            },
        ));
        b.prev_key = Some(key);
        b.covered = 1;
        b.start = first.len();
        Ok(())
    }

    /// The chunk ending at the last message.
    #[allow(clippy::too_many_arguments)]
    fn last_chunk(
        &self,
        b: &Build,
        chunks: &[Arc<Chunk>],
        segments: &[SegmentRef<'_>],
        messages: &[&Value],
        no_gen: &str,
        toks: Vec<u32>,
        gen_suffix: Option<Box<[u32]>>,
    ) -> (u64, Chunk) {
        let last_key = segments[segments.len() - 1].chain_hash;
        match chunks.last() {
            // Cached up to the last message, only the generation prompt was
            // missing (the chunk was a boundary of a longer conversation):
            // the same chunk, now with its suffix. (A new chunk here would
            // name itself as its predecessor.)
            Some(last) if b.outcome == Outcome::PartialHit && b.prev_key == Some(last_key) => (
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
                    gen_suffix,
                },
            ),
            _ => (
                last_key,
                Chunk {
                    key: last_key,
                    prev: b.prev_key,
                    rendered_len: no_gen.len(),
                    rendered_hash: Some(xxh3_64(no_gen.as_bytes())),
                    ends_with_added: self.tk.ends_with_added(no_gen),
                    tokens: toks.into(),
                    messages: own(messages.get(b.covered..).unwrap_or_default()),
                    message_bytes: segments
                        .get(b.covered..)
                        .unwrap_or_default()
                        .iter()
                        .map(|s| s.message_json.len())
                        .sum(),
                    gen_suffix,
                },
            ),
        }
    }

    /// Stores the new chunks; the retained pair names the conversation's
    /// first and last cached chunks (none when one did not fit).
    fn commit(&self, b: Build, chunks: &[Arc<Chunk>], segments: &[SegmentRef<'_>]) -> Tokenized {
        let last_key = segments[segments.len() - 1].chain_hash;
        let mut cache = self.cache.lock();
        let first = chunks.first().filter(|_| b.outcome == Outcome::PartialHit).map(|c| c.key);
        let mut retained = retained_pair(first.or(b.new_chunks.first().map(|c| c.0)), last_key);
        for (key, chunk) in b.new_chunks {
            if !cache.insert(key, chunk) {
                retained.clear();
            }
        }
        Tokenized { ids: b.ids, outcome: b.outcome, encoded_bytes: b.encoded, retained }
    }
}
