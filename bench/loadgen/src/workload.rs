//! Workloads: what each simulated user sends, deterministically from a seed.
//!
//! **DOKS multi-turn** (`../shared/design/REFERENCE-RESULTS.md` §A): 10
//! conversation starters of ~3,500–4,000 tokens of technical-looking text;
//! each conversation picks a starter, lasts 3–5 turns, and every turn resends
//! the whole history (the replies the server really gave) plus a follow-up
//! question; each turn asks for 655–1,005 output tokens (mean 830, as the
//! published ~830 with 555–1,008 seen). Conversation `n` is the same text in
//! every mode, so modes are compared on one workload.

use kvgate_e2e::bench_words;

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
