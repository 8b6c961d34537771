//! Workloads: what each simulated user sends, deterministically from a seed.
//!
//! **DOKS multi-turn** (`../shared/design/REFERENCE-RESULTS.md` §A): 10
//! conversation starters of ~3,500–4,000 tokens of technical-looking text;
//! each conversation picks a starter, lasts 3–5 turns, and every turn resends
//! the whole history (the replies the server really gave) plus a follow-up
//! question; each turn asks for 655–1,005 output tokens (mean 830, as the
//! published ~830 with 555–1,008 seen). Conversation `n` is the same text in
//! every mode, so modes are compared on one workload.

use kvgate_bench_support::words as bench_words;

/// Mixes a seed and a number into a well-spread 64-bit value (splitmix64).
pub fn mix(seed: u64, n: u64) -> u64 {
    let mut z = seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The DOKS multi-turn workload's shape.
#[derive(Debug, Clone)]
pub struct Doks {
    /// Distinct conversation starters.
    pub starters: usize,
    /// Words per starter, lowest and highest (about 1.07 tokens a word with
    /// the test tokenizer: 3,300–3,750 words give ~3,500–4,000 tokens).
    pub starter_words: (usize, usize),
    /// Turns per conversation, lowest and highest.
    pub turns: (usize, usize),
    /// Output tokens per turn, lowest and highest.
    pub output_tokens: (u32, u32),
    /// Seed of all text.
    pub seed: u64,
}

impl Default for Doks {
    fn default() -> Self {
        Doks { starters: 10, starter_words: (3_300, 3_750), turns: (3, 5), output_tokens: (655, 1_005), seed: 0x5EED }
    }
}

/// One turn of a conversation: the new user message and the output length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Turn {
    /// The user's message of this turn (the starter and a question on turn 1).
    pub user: String,
    /// `max_tokens` of the request.
    pub max_tokens: u32,
}

/// One conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conversation {
    /// Conversation number.
    pub id: u64,
    /// Which starter it opens with.
    pub starter: usize,
    /// Its turns, in order.
    pub turns: Vec<Turn>,
}

fn between(h: u64, (lo, hi): (u64, u64)) -> u64 {
    if hi <= lo { lo } else { lo + h % (hi - lo + 1) }
}

impl Doks {
    /// The text of starter `s`.
    pub fn starter_text(&self, s: usize) -> String {
        let h = mix(self.seed, 0x5747_0000 + s as u64);
        let (lo, hi) = self.starter_words;
        let words = between(h, (lo as u64, hi as u64)) as usize;
        let mut t = String::with_capacity(words * 8 + 64);
        t.push_str("Design document ");
        t.push_str(&s.to_string());
        t.push_str(". Read it, then answer the questions that follow.\n\n");
        t.push_str(&bench_words(h, words));
        t
    }

    /// Conversation `id`: its starter, turns and output lengths.
    pub fn conversation(&self, id: u64) -> Conversation {
        let h = mix(self.seed, id);
        let starter = (h % self.starters.max(1) as u64) as usize;
        let turns = between(h >> 16, (self.turns.0 as u64, self.turns.1 as u64)) as usize;
        let (lo, hi) = self.output_tokens;
        let mut out = Vec::with_capacity(turns);
        for t in 0..turns {
            let ht = mix(h, t as u64 + 1);
            let q = question(ht, id, t);
            let user = if t == 0 { format!("{}\n\n{q}", self.starter_text(starter)) } else { q };
            out.push(Turn { user, max_tokens: between(ht >> 8, (u64::from(lo), u64::from(hi))) as u32 });
        }
        Conversation { id, starter, turns: out }
    }
}

fn question(h: u64, id: u64, turn: usize) -> String {
    const ASK: &[&str] = &[
        "Explain step by step how",
        "What would change if",
        "Compare the trade-offs when",
        "Give a worked example where",
        "List the failure modes when",
        "Summarize, with numbers, how",
    ];
    format!(
        "Question {} of conversation {id}: {} {}?",
        turn + 1,
        ASK[(h % ASK.len() as u64) as usize],
        bench_words(h >> 3, 18 + (h >> 40) as usize % 14)
    )
}

impl Doks {
    /// Prompt tokens that two first turns on the same starter share (their
    /// questions differ), per starter: what an ideal cache could reuse.
    pub fn starter_shared_tokens(&self, tokenizer_dir: &std::path::Path) -> anyhow::Result<Vec<u64>> {
        use anyhow::Context as _;
        let w = self;
        let tk =
            kvgate_tokenize::ChatTokenizer::from_dir(tokenizer_dir).context("the tokenizer (run scripts/setup.sh)")?;
        let first = |conv: &Conversation| -> anyhow::Result<Vec<u32>> {
            let m = [serde_json::json!({"role": "user", "content": conv.turns[0].user})];
            Ok(tk.encode_chat(&m, true)?)
        };
        let mut shared = vec![0u64; w.starters];
        let mut seen: Vec<Option<Vec<u32>>> = vec![None; w.starters];
        for id in 0..10_000u64 {
            let c = w.conversation(id);
            if shared[c.starter] > 0 {
                continue;
            }
            let ids = first(&c)?;
            match &seen[c.starter] {
                None => seen[c.starter] = Some(ids),
                Some(prev) => {
                    shared[c.starter] = prev.iter().zip(&ids).take_while(|(a, b)| a == b).count() as u64;
                }
            }
            if shared.iter().all(|&s| s > 0) {
                return Ok(shared);
            }
        }
        anyhow::bail!("some starter was not used twice in 10,000 conversations")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversations_are_deterministic_and_in_range() {
        let w = Doks::default();
        assert_eq!(w.conversation(7), w.conversation(7));
        let mut starters = std::collections::BTreeSet::new();
        let mut outs = Vec::new();
        for id in 0..500 {
            let c = w.conversation(id);
            assert!((3..=5).contains(&c.turns.len()));
            starters.insert(c.starter);
            for t in &c.turns {
                assert!((655..=1005).contains(&t.max_tokens));
                outs.push(f64::from(t.max_tokens));
            }
            // Turn 1 opens with the starter; later turns are short questions.
            assert!(c.turns[0].user.starts_with(&w.starter_text(c.starter)));
            assert!(c.turns[1..].iter().all(|t| t.user.len() < 400));
        }
        assert_eq!(starters.len(), 10, "every starter is used");
        let mean = outs.iter().sum::<f64>() / outs.len() as f64;
        assert!((800.0..860.0).contains(&mean), "mean output tokens {mean}");
    }

    #[test]
    fn starters_differ_from_their_first_words() {
        let w = Doks::default();
        let a = w.starter_text(0);
        let b = w.starter_text(1);
        let words = a.split(' ').count();
        assert!((3_300..=3_760).contains(&words), "{words}");
        // Different from the first block on: no accidental shared prefix
        // beyond the fixed heading.
        assert_ne!(a.get(..80), b.get(..80));
    }
}

// ---------------------------------------------------------------------------
// Request-level workloads: independent requests whose prompts share prefixes
// (no history carried between requests).

/// A piece of prompt text: the same `id` is the same text everywhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Identity of the text.
    pub id: u64,
    /// Its length in words ([`TOKENS_PER_WORD`] tokens a word).
    pub words: usize,
}

impl Segment {
    /// A segment of about `tokens` tokens.
    pub fn of_tokens(id: u64, tokens: u64) -> Segment {
        Segment { id, words: ((tokens as f64 / TOKENS_PER_WORD).round() as usize).max(1) }
    }

    /// Its text (starts with a space-free tag, so segments never merge into
    /// one token across a boundary differently from request to request).
    pub fn text(&self) -> String {
        let mut t = format!("[{:x}] ", self.id);
        t.push_str(&bench_words(mix(0x5E6, self.id), self.words));
        t.push('\n');
        t
    }
}

/// Tokens per word of [`bench_words`] text in long segments with the test
/// tokenizer (measured: a 93,458-word document is 113,3xx tokens; the DOKS
/// starters, shorter, are nearer 1.07).
pub const TOKENS_PER_WORD: f64 = 1.2;

/// One chat message made of segments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub role: &'static str,
    pub parts: Vec<Segment>,
}

/// One request of a request-level workload.
#[derive(Debug, Clone, PartialEq)]
pub struct Req {
    /// Document / group / first block: what it shares its prefix with.
    pub group: usize,
    /// Arrival, simulated seconds from the start (open loop only).
    pub at_s: f64,
    pub messages: Vec<Message>,
    pub max_tokens: u32,
}

impl Req {
    /// The chat messages, as the client sends them.
    pub fn history(&self) -> Vec<(&'static str, String)> {
        self.messages.iter().map(|m| (m.role, m.parts.iter().map(Segment::text).collect::<String>())).collect()
    }

    /// Every segment in prompt order.
    pub fn segments(&self) -> impl Iterator<Item = &Segment> {
        self.messages.iter().flat_map(|m| m.parts.iter())
    }
}

/// The Workato-style long-prefix workload (REFERENCE-RESULTS.md §B): each
/// request is one of `docs` long documents (10K–100K tokens) as the system
/// message plus its own short question. 24 documents (~1.6M tokens in all)
/// do not fit in one worker's cache of the benchmark's fleet (640K tokens),
/// so where a document is sent matters, as with a real RAG corpus; with 8
/// they all fit everywhere after warm-up and every mode hits ~97 %.
#[derive(Debug, Clone)]
pub struct Workato {
    pub docs: usize,
    pub doc_tokens: (u64, u64),
    pub question_tokens: (u64, u64),
    pub output_tokens: (u32, u32),
    pub seed: u64,
}

impl Default for Workato {
    fn default() -> Self {
        Workato {
            docs: 24,
            doc_tokens: (10_000, 100_000),
            question_tokens: (30, 60),
            output_tokens: (300, 700),
            seed: 0x3A70,
        }
    }
}

/// Shared-prefix groups: `groups` system prompts, `users` per group each
/// with a context of their own (none when `context_tokens` is `(0, 0)`),
/// Poisson arrivals at `qps` (simulated).
#[derive(Debug, Clone)]
pub struct Groups {
    /// The file stem of its results.
    pub name: &'static str,
    pub groups: usize,
    pub users: usize,
    pub system_tokens: (u64, u64),
    pub context_tokens: (u64, u64),
    pub question_tokens: (u64, u64),
    pub output_tokens: (u32, u32),
    pub qps: f64,
    pub seed: u64,
    /// Arrival times, simulated seconds (precomputed up to the horizon).
    pub arrivals: std::sync::Arc<Vec<f64>>,
}

impl Groups {
    /// 8 groups × 16 users, system prompts of 2K–4K tokens, contexts of
    /// 300–800 tokens, 200–400 output tokens, arrivals up to `horizon_s`.
    pub fn new(qps: f64, horizon_s: f64) -> Groups {
        let seed = 0x6A0F;
        Groups {
            name: "prefix-groups",
            groups: 8,
            users: 16,
            system_tokens: (2_000, 4_000),
            context_tokens: (300, 800),
            question_tokens: (20, 40),
            output_tokens: (200, 400),
            qps,
            seed,
            arrivals: std::sync::Arc::new(poisson(seed, qps, horizon_s)),
        }
    }

    /// The `cache-pressure` workload, the shape of llm-d's precise-versus-
    /// approximate benchmark (REFERENCE-RESULTS.md): `tenants` tenants with
    /// a shared prefix of 5,500–6,500 tokens each, 5 users per tenant asking
    /// questions of 1,100–1,300 tokens (new text every time), 200–400
    /// output tokens, the tenant of each request uniform at random, Poisson
    /// arrivals at `qps`. Size `tenants` with [`Groups::tenants_for`] so
    /// that the fleet's KV cache holds about a third of all prefixes:
    /// prefixes are evicted and come back.
    pub fn cache_pressure(qps: f64, horizon_s: f64, tenants: usize) -> Groups {
        let seed = 0xCA7E;
        Groups {
            name: "cache-pressure",
            groups: tenants.max(1),
            users: 5,
            system_tokens: (5_500, 6_500),
            context_tokens: (0, 0),
            question_tokens: (1_100, 1_300),
            output_tokens: (200, 400),
            qps,
            seed,
            arrivals: std::sync::Arc::new(poisson(seed, qps, horizon_s)),
        }
    }

    /// The `pd` workload (issue #25): long inputs, 48 documents of 8K–100K
    /// tokens (each asked about ~3 times in a 300 s run at 0.5 request/s, so
    /// a decode worker sometimes holds the document already), a question of
    /// 100–400 tokens, 200–800 output tokens, Poisson arrivals at `qps`.
    pub fn pd(qps: f64, horizon_s: f64) -> Groups {
        let seed = 0xD15A;
        Groups {
            name: "pd",
            groups: 48,
            users: 1,
            system_tokens: (8_000, 100_000),
            context_tokens: (0, 0),
            question_tokens: (100, 400),
            output_tokens: (200, 800),
            qps,
            seed,
            arrivals: std::sync::Arc::new(poisson(seed, qps, horizon_s)),
        }
    }

    /// Tenants whose prefixes (6,000 tokens on average) are `times` the
    /// fleet's KV capacity of `capacity_tokens`.
    pub fn tenants_for(capacity_tokens: u64, times: f64) -> usize {
        ((capacity_tokens as f64 * times / 6_000.0).ceil() as usize).max(1)
    }
}

/// Poisson arrival times (simulated seconds) at `qps` up to `horizon_s`.
fn poisson(seed: u64, qps: f64, horizon_s: f64) -> Vec<f64> {
    let mut arrivals = Vec::new();
    let (mut t, mut i) = (0.0, 0u64);
    while t < horizon_s && qps > 0.0 {
        // Exponential gaps from a uniform in (0, 1].
        let u = ((mix(seed ^ 0xA11, i) >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        t += -u.ln() / qps;
        arrivals.push(t);
        i += 1;
    }
    arrivals
}

/// One request of a trace.
#[derive(Debug, Clone)]
pub struct TraceReq {
    /// Arrival, ms from the start.
    pub ms: f64,
    /// Its prefix-block ids.
    pub blocks: Vec<u64>,
    /// Output tokens.
    pub output: u32,
}

/// A request trace with prefix-block ids (Mooncake's format: `hash_ids` of
/// 512-token blocks, equal ids at equal positions share a prefix).
#[derive(Debug, Clone)]
pub struct Trace {
    /// The trace's requests, in arrival order.
    pub reqs: std::sync::Arc<Vec<TraceReq>>,
    /// Tokens of each block id (512, or less for a request's last block).
    pub block_tokens: std::sync::Arc<std::collections::HashMap<u64, u64>>,
    /// Arrivals are divided by this (time compression).
    pub compress: f64,
    /// Output tokens are capped at this.
    pub max_output: u32,
}

impl Trace {
    /// Reads a Mooncake JSONL trace; keeps requests arriving before `until_ms`.
    pub fn mooncake(path: &std::path::Path, until_ms: f64, compress: f64, max_output: u32) -> anyhow::Result<Trace> {
        use anyhow::Context as _;
        #[derive(serde::Deserialize)]
        struct Line {
            timestamp: f64,
            input_length: u64,
            output_length: u32,
            hash_ids: Vec<u64>,
        }
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut reqs = Vec::new();
        let mut block_tokens = std::collections::HashMap::new();
        for (n, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let l: Line = serde_json::from_str(line).with_context(|| format!("{}:{}", path.display(), n + 1))?;
            if l.timestamp >= until_ms {
                break;
            }
            if l.hash_ids.is_empty() {
                continue;
            }
            let last = l.hash_ids.len() - 1;
            for (k, id) in l.hash_ids.iter().enumerate() {
                let tokens =
                    if k < last { 512 } else { l.input_length.saturating_sub(512 * last as u64).clamp(1, 512) };
                block_tokens.entry(*id).or_insert(tokens);
            }
            reqs.push(TraceReq { ms: l.timestamp, blocks: l.hash_ids, output: l.output_length });
        }
        Ok(Trace {
            reqs: std::sync::Arc::new(reqs),
            block_tokens: std::sync::Arc::new(block_tokens),
            compress: compress.max(1e-9),
            max_output,
        })
    }
}

/// Agent-style fan-out: bursts of `siblings` requests that share a new
/// long prefix (a plan, a retrieved document) and arrive within a few
/// milliseconds, each with a short task of its own; every sibling sends a
/// follow-up on the same prefix and task `followup_s` later. Bursts start
/// as a Poisson process at `bursts_per_min` (simulated). What it shows:
/// where a router sends siblings before the first KV event of their prefix
/// exists.
#[derive(Debug, Clone)]
pub struct Fanout {
    pub bursts_per_min: f64,
    /// Siblings per burst, lowest and highest.
    pub siblings: (u64, u64),
    /// Tokens of the shared prefix, lowest and highest.
    pub prefix_tokens: (u64, u64),
    /// Tokens of each sibling's task.
    pub task_tokens: (u64, u64),
    pub output_tokens: (u32, u32),
    /// Siblings of a burst arrive this far apart, simulated ms.
    pub spacing_ms: f64,
    /// A sibling's follow-up arrives this long after it, simulated s.
    pub followup_s: f64,
    pub seed: u64,
    /// (arrival s, burst, sibling, is follow-up), in arrival order.
    pub arrivals: std::sync::Arc<Vec<(f64, u64, u64, bool)>>,
}

impl Fanout {
    /// 8–64 siblings on a 4K–32K-token prefix, tasks of 100–300 tokens,
    /// 100–300 output tokens, 1 ms apart, follow-ups 20 s later; bursts up
    /// to `horizon_s`.
    pub fn new(bursts_per_min: f64, horizon_s: f64) -> Fanout {
        let seed = 0xFA_0A;
        let siblings = (8, 64);
        let (spacing_ms, followup_s) = (1.0, 20.0);
        let mut arrivals = Vec::new();
        for (b, t) in poisson(seed, bursts_per_min / 60.0, horizon_s).into_iter().enumerate() {
            let n = between(mix(seed ^ 0x5B, b as u64), siblings);
            for k in 0..n {
                let at = t + k as f64 * spacing_ms / 1000.0;
                arrivals.push((at, b as u64, k, false));
                arrivals.push((at + followup_s, b as u64, k, true));
            }
        }
        arrivals.retain(|a| a.0 < horizon_s);
        arrivals.sort_by(|a, b| a.0.total_cmp(&b.0));
        Fanout {
            bursts_per_min,
            siblings,
            prefix_tokens: (4_000, 32_000),
            task_tokens: (100, 300),
            output_tokens: (100, 300),
            spacing_ms,
            followup_s,
            seed,
            arrivals: std::sync::Arc::new(arrivals),
        }
    }
}

/// A request-level workload.
#[derive(Debug, Clone)]
pub enum Requests {
    Workato(Workato),
    Groups(Groups),
    Trace(Trace),
    Fanout(Fanout),
    /// Another workload's requests, each sent by tenant `light` (this share
    /// of them, drawn per request) or `heavy`: the overload cell.
    Tenants(Box<Requests>, f64),
}

/// Segment ids of different kinds never collide (top byte).
fn seg_id(kind: u64, n: u64) -> u64 {
    (kind << 56) | (n & ((1 << 56) - 1))
}

impl Requests {
    /// Request `i`, or `None` past the end of a finite workload.
    pub fn request(&self, i: u64) -> Option<Req> {
        match self {
            Requests::Tenants(inner, _) => inner.request(i),
            Requests::Workato(w) => {
                let h = mix(w.seed, i);
                let doc = (h % w.docs.max(1) as u64) as usize;
                let doc_tokens = between(mix(w.seed, 0xD0C0 + doc as u64), w.doc_tokens);
                let q = Segment::of_tokens(seg_id(2, i), between(h >> 8, w.question_tokens));
                let (lo, hi) = w.output_tokens;
                Some(Req {
                    group: doc,
                    at_s: 0.0,
                    messages: vec![
                        Message { role: "system", parts: vec![Segment::of_tokens(seg_id(1, doc as u64), doc_tokens)] },
                        Message { role: "user", parts: vec![q] },
                    ],
                    max_tokens: between(h >> 24, (u64::from(lo), u64::from(hi))) as u32,
                })
            }
            Requests::Groups(g) => {
                let at_s = *g.arrivals.get(usize::try_from(i).ok()?)?;
                let h = mix(g.seed, i);
                let group = (h % g.groups.max(1) as u64) as usize;
                let user = (h >> 8) % g.users.max(1) as u64;
                let sys = Segment::of_tokens(
                    seg_id(3, group as u64),
                    between(mix(g.seed, 0x5750 + group as u64), g.system_tokens),
                );
                let uid = group as u64 * 1_000_003 + user;
                let q = Segment::of_tokens(seg_id(5, i), between(h >> 16, g.question_tokens));
                let parts = if g.context_tokens.1 == 0 {
                    vec![q]
                } else {
                    let ctx = Segment::of_tokens(seg_id(4, uid), between(mix(g.seed, 0xC070 + uid), g.context_tokens));
                    vec![ctx, q]
                };
                let (lo, hi) = g.output_tokens;
                Some(Req {
                    group,
                    at_s,
                    messages: vec![Message { role: "system", parts: vec![sys] }, Message { role: "user", parts }],
                    max_tokens: between(h >> 32, (u64::from(lo), u64::from(hi))) as u32,
                })
            }
            Requests::Fanout(f) => {
                let &(at_s, burst, sibling, followup) = f.arrivals.get(usize::try_from(i).ok()?)?;
                let prefix = Segment::of_tokens(seg_id(8, burst), between(mix(f.seed, 0xB0 + burst), f.prefix_tokens));
                let sib = burst * 64 + sibling;
                let task = Segment::of_tokens(seg_id(9, sib), between(mix(f.seed, 0x7A5C + sib), f.task_tokens));
                let mut messages =
                    vec![Message { role: "system", parts: vec![prefix] }, Message { role: "user", parts: vec![task] }];
                if followup {
                    // The sibling's earlier exchange, then a new question
                    // (the answer is a stand-in: requests carry no history).
                    let answer = Segment::of_tokens(seg_id(10, sib), 150);
                    messages.push(Message { role: "assistant", parts: vec![answer] });
                    messages.push(Message { role: "user", parts: vec![Segment::of_tokens(seg_id(11, sib), 40)] });
                }
                let (lo, hi) = f.output_tokens;
                Some(Req {
                    group: burst as usize,
                    at_s,
                    messages,
                    max_tokens: between(mix(f.seed ^ u64::from(followup), sib), (u64::from(lo), u64::from(hi))) as u32,
                })
            }
            Requests::Trace(t) => {
                let TraceReq { ms, blocks: ids, output: out } = t.reqs.get(usize::try_from(i).ok()?)?;
                // One message per block: system, then user and assistant in
                // turn (a conversation's transcript), ending with the user.
                let mut messages: Vec<Message> = ids
                    .iter()
                    .enumerate()
                    .map(|(k, id)| Message {
                        role: if k == 0 {
                            "system"
                        } else if k % 2 == 1 {
                            "user"
                        } else {
                            "assistant"
                        },
                        parts: vec![Segment::of_tokens(seg_id(6, *id), t.block_tokens.get(id).copied().unwrap_or(512))],
                    })
                    .collect();
                if messages.last().is_none_or(|m| m.role != "user") {
                    messages.push(Message { role: "user", parts: vec![Segment { id: seg_id(7, 0), words: 2 }] });
                }
                Some(Req {
                    group: ids.first().copied().unwrap_or(0) as usize,
                    at_s: ms / 1000.0 / t.compress,
                    messages,
                    max_tokens: (*out).clamp(1, t.max_output.max(1)),
                })
            }
        }
    }

    /// The file stem of its results.
    pub fn name(&self) -> &'static str {
        match self {
            Requests::Workato(_) => "workato-longprefix",
            Requests::Groups(g) => g.name,
            Requests::Trace(_) => "mooncake",
            Requests::Fanout(_) => "fanout",
            Requests::Tenants(_, _) => "overload",
        }
    }

    /// The tenant that sends request `i` (`None`: no tenant header).
    pub fn tenant(&self, i: u64) -> Option<&'static str> {
        match self {
            Requests::Tenants(_, light) => {
                Some(if ((mix(0x7E7A_0001, i) % 10_000) as f64) < light * 10_000.0 { "light" } else { "heavy" })
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod request_tests {
    use super::*;

    #[test]
    fn workato_requests_share_their_document_and_nothing_else() {
        let w = Requests::Workato(Workato::default());
        let (a, b) = (w.request(1).unwrap(), w.request(1).unwrap());
        assert_eq!(a, b, "deterministic");
        let reqs: Vec<Req> = (0..64).map(|i| w.request(i).unwrap()).collect();
        for r in &reqs {
            assert_eq!(r.messages.len(), 2);
            let doc = r.messages[0].parts[0];
            let tokens = doc.words as f64 * TOKENS_PER_WORD;
            assert!((9_900.0..=100_100.0).contains(&tokens), "{tokens}");
            assert!((300..=700).contains(&r.max_tokens));
        }
        let same_doc: Vec<&Req> = reqs.iter().filter(|r| r.group == reqs[0].group).collect();
        assert!(same_doc.len() > 1);
        assert_eq!(same_doc[0].messages[0], same_doc[1].messages[0]);
        assert_ne!(same_doc[0].messages[1], same_doc[1].messages[1]);
        // The text of a segment is stable and starts with its tag.
        let s = Segment { id: 7, words: 5 };
        assert_eq!(s.text(), s.text());
        assert!(s.text().starts_with("[7] ") && s.text().split_whitespace().count() == 6);
    }

    #[test]
    fn groups_arrive_as_poisson_at_the_rate() {
        let g = Groups::new(10.0, 1_000.0);
        let n = g.arrivals.len() as f64;
        assert!((n - 10_000.0).abs() < 400.0, "{n}");
        let w = Requests::Groups(g);
        let r = w.request(3).unwrap();
        assert_eq!(r.messages[0].role, "system");
        assert_eq!(r.messages[1].parts.len(), 2);
        assert!(w.request(1_000_000).is_none(), "past the horizon");
        let mut prev = 0.0;
        for i in 0..100 {
            let at = w.request(i).unwrap().at_s;
            assert!(at > prev);
            prev = at;
        }
    }

    #[test]
    fn cache_pressure_tenants_share_a_6k_prefix_and_ask_new_1k_questions() {
        assert_eq!(Groups::tenants_for(1_104_000, 3.0), 552);
        let w = Requests::Groups(Groups::cache_pressure(8.0, 100.0, 552));
        assert_eq!(w.name(), "cache-pressure");
        let reqs: Vec<Req> = (0..400).map(|i| w.request(i).unwrap()).collect();
        let tokens = |s: &Segment| s.words as f64 * TOKENS_PER_WORD;
        for r in &reqs {
            assert_eq!(r.messages.len(), 2);
            assert_eq!(r.messages[1].parts.len(), 1, "no per-user context");
            assert!((5_490.0..=6_510.0).contains(&tokens(&r.messages[0].parts[0])));
            assert!((1_090.0..=1_310.0).contains(&tokens(&r.messages[1].parts[0])));
            assert!((200..=400).contains(&r.max_tokens));
        }
        let twice = reqs.iter().find(|a| reqs.iter().filter(|r| r.group == a.group).count() >= 2);
        let a = twice.expect("400 requests over 552 tenants repeat some");
        let same: Vec<&Req> = reqs.iter().filter(|r| r.group == a.group).collect();
        assert_eq!(same[0].messages[0], same[1].messages[0], "the tenant's prefix");
        assert_ne!(same[0].messages[1], same[1].messages[1], "a new question");
        let tenants: std::collections::HashSet<usize> = reqs.iter().map(|r| r.group).collect();
        assert!(tenants.len() > 200 && tenants.iter().all(|t| *t < 552), "{}", tenants.len());
    }

    #[test]
    fn fanout_siblings_arrive_together_on_a_new_prefix_and_follow_up_later() {
        let f = Fanout::new(6.0, 600.0);
        let bursts = f.arrivals.iter().filter(|a| !a.3 && a.2 == 0).count();
        assert!((40..=80).contains(&bursts), "{bursts} bursts in 10 min at 6/min");
        let w = Requests::Fanout(f.clone());
        let reqs: Vec<Req> = (0..f.arrivals.len() as u64).map(|i| w.request(i).unwrap()).collect();
        assert!(reqs.windows(2).all(|p| p[0].at_s <= p[1].at_s), "in arrival order");
        // Burst 0: its siblings within a few ms, on one prefix, tasks of their own.
        let first: Vec<&Req> = reqs.iter().filter(|r| r.group == 0 && r.messages.len() == 2).collect();
        assert!((8..=64).contains(&first.len()), "{}", first.len());
        let span = first.last().unwrap().at_s - first[0].at_s;
        assert!(span < 0.064, "{span}");
        assert!(first.iter().all(|r| r.messages[0] == first[0].messages[0]));
        assert_ne!(first[0].messages[1], first[1].messages[1]);
        let tokens = first[0].messages[0].parts[0].words as f64 * TOKENS_PER_WORD;
        assert!((3_990.0..=32_010.0).contains(&tokens), "{tokens}");
        // Its follow-ups 20 s later share prefix and task.
        let follow: Vec<&Req> = reqs.iter().filter(|r| r.group == 0 && r.messages.len() == 4).collect();
        assert_eq!(follow.len(), first.len());
        assert!((follow[0].at_s - first[0].at_s - 20.0).abs() < 1e-9);
        assert_eq!(follow[0].messages[..2], first[0].messages[..]);
        // Another burst has another prefix.
        let other = reqs.iter().find(|r| r.group == 1).unwrap();
        assert_ne!(other.messages[0], first[0].messages[0]);
        assert_eq!(w.name(), "fanout");
    }

    #[test]
    fn a_trace_becomes_alternating_messages_of_its_blocks() {
        let dir = std::env::temp_dir().join(format!("kvgate-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.jsonl");
        std::fs::write(
            &p,
            "{\"timestamp\": 0, \"input_length\": 1100, \"output_length\": 5, \"hash_ids\": [0, 1, 2]}\n\
             {\"timestamp\": 2000, \"input_length\": 700, \"output_length\": 9000, \"hash_ids\": [0, 3]}\n\
             {\"timestamp\": 9000, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [4]}\n",
        )
        .unwrap();
        let t = Requests::Trace(Trace::mooncake(&p, 5_000.0, 2.0, 1_000).unwrap());
        let a = t.request(0).unwrap();
        let roles: Vec<&str> = a.messages.iter().map(|m| m.role).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"], "ends with the user");
        assert_eq!(a.segments().count(), 4);
        assert_eq!((a.messages[2].parts[0].words as f64 * TOKENS_PER_WORD).round(), 76.0, "the last block's 76 tokens");
        let b = t.request(1).unwrap();
        assert_eq!(b.at_s, 1.0, "2 s compressed 2x");
        assert_eq!(b.max_tokens, 1_000, "capped");
        assert_eq!(a.messages[0], b.messages[0], "block 0 is shared");
        assert!(t.request(2).is_none(), "after the cut");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
