//! A direct byte-level BPE encoder for one common `tokenizer.json` shape,
//! giving the ids the `tokenizers` library gives, several times faster.
//!
//! # Why
//!
//! The control plane tokenizes each request's new text on the request's
//! critical path (a chat turn's reply and question, a conversation's first
//! message). `tokenizers` builds a full `Encoding` (token strings, offsets,
//! alignment maps of every normalized piece) that routing never reads: on a
//! 2-core Xeon it encodes ~8 MB/s of English text (`make bench-cp`).
//!
//! # What it accepts
//!
//! [`FastBpe::from_json`] takes a `tokenizer.json` only when every stage is
//! one this module reproduces, and returns `None` otherwise (the caller then
//! keeps using `tokenizers`):
//!
//! * normalizer: none, or an empty `Sequence`;
//! * pre-tokenizer: `Split` stages with a regex pattern, behaviour
//!   `Isolated`, not inverted, applied in order, then `ByteLevel` with
//!   `add_prefix_space = false` and `use_regex = false` (the shape of
//!   DeepSeek-V3/R1, Qwen2/3 and Llama-3 style tokenizers);
//! * model: `BPE` without dropout, unknown token, subword prefix or suffix,
//!   byte fallback or `ignore_merges`, with every one of the 256 byte
//!   symbols in the vocabulary;
//! * added tokens: none with `lstrip`, `rstrip` or `single_word`.
//!
//! # Algorithm
//!
//! 1. Added tokens are split out first, leftmost-longest: those marked
//!    `normalized = false` on the text, then those marked `normalized = true`
//!    in the gaps (with no normalizer both see the same text), as the
//!    library's added vocabulary does.
//! 2. Each gap goes through the `Split` regexes in order (Oniguruma, the
//!    engine and patterns the library uses, matched within each piece):
//!    matches and the text between them become pieces; empty ones vanish.
//! 3. Each piece's bytes map to their byte symbols' ids, and adjacent pairs
//!    merge by rank, lowest rank first and leftmost among equals, until no
//!    pair has a merge (a binary heap over a linked list of symbols).
//!    Results are cached per piece (bounded; cleared when full).
//!
//! 4. **Long texts go by paragraphs** when the tokenizer's split regexes are
//!    exactly DeepSeek-V3's (below) and no added token holds a line break:
//!    a text of at least [`PARA_MIN_TEXT`] bytes is cut after a `\n` that is
//!    followed by a printable ASCII character other than space, into chunks
//!    of at least [`PARA_MIN_CHUNK`] bytes, and each chunk's ids are cached
//!    by its 128-bit hash. A document sent again with a new question (a RAG
//!    prompt, a conversation's first message on a shared starter) then costs
//!    only its new paragraphs. Why the cut is exact for these regexes: no
//!    pattern has a look-behind, so matching from the cut on depends only
//!    on the text from the cut on; and the match that covers the `\n` ends
//!    at the cut: of the alternatives that can match a `\n`,
//!    ` ?[\p{P}\p{S}]+[\r\n]*` ends with line breaks, `\s*[\r\n]+`, `\s+(?!\S)`
//!    and `\s+` continue only through whitespace, and none other can contain
//!    one (`[^\r\n\p{L}\p{P}\p{S}]?` excludes line breaks; the digit and CJK
//!    patterns match neither side of the cut, so they start afresh after
//!    it). BPE works within pieces. Added tokens cannot span the cut when
//!    none contains a line break. The cut must not be before whitespace:
//!    `\s*[\r\n]+` joins `"\n \n"`, and `\s+(?!\S)` splits a run of spaces
//!    by what follows it.
//!
//! 5. **Plain ASCII without the regex engine**, for the same split regexes:
//!    text of printable ASCII, tab and line breaks is split by
//!    [`crate::ascii_split`], which gives Oniguruma's pieces for these
//!    three patterns on that alphabet; a text that mixes in other
//!    characters is taken line by line (at the cuts of step 4, which are
//!    exact for any chunk length), each line by whichever applies.
//!
//! Equality with the library is checked by differential tests (the real
//! DeepSeek-V3 tokenizer on rendered conversations, generated text in many
//! scripts, and a fuzz target) and by [`crate::ChatTokenizer`] at load time
//! on a fixed sample, which falls back to the library if they differ.
//!
//! # Complexity
//!
//! O(text) for the regexes; O(s log s) per uncached piece of s bytes; one
//! hash lookup per cached piece.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use aho_corasick::{AhoCorasick, MatchKind};
use parking_lot::Mutex;
use serde_json::Value;

/// Pieces remembered before the cache is cleared (a bound on its memory:
/// pieces are words, so ~100 bytes each).
const CACHE_PIECES: usize = 65_536;
/// Pieces longer than this (bytes) are not cached.
const CACHE_MAX_PIECE: usize = 256;

/// Texts shorter than this (bytes) are encoded whole.
pub const PARA_MIN_TEXT: usize = 4096;
/// Paragraph chunks are at least this long (bytes), except a text's last.
pub const PARA_MIN_CHUNK: usize = 1024;
/// Token ids held by one generation of the paragraph cache; two
/// generations are kept (~16 MB at most).
const PARA_CACHE_TOKENS: usize = 2 << 20;

/// The split regexes for which cutting at `\n` + printable ASCII is exact
/// (DeepSeek-V3/R1's `tokenizer.json`; see the module documentation).
pub(crate) const PARAGRAPH_SAFE_SPLITS: [&str; 3] = [
    "\\p{N}{1,3}",
    "[\u{4e00}-\u{9fa5}\u{3040}-\u{309f}\u{30a0}-\u{30ff}]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
];

/// Ids of paragraph chunks by 128-bit hash of their bytes, in two
/// generations: lookups promote from the old one; when the new one holds
/// [`PARA_CACHE_TOKENS`] ids it becomes the old one.
#[derive(Default)]
struct ParaCache {
    new: HashMap<u128, std::sync::Arc<[u32]>>,
    old: HashMap<u128, std::sync::Arc<[u32]>>,
    new_tokens: usize,
}

impl ParaCache {
    fn get(&mut self, key: u128) -> Option<std::sync::Arc<[u32]>> {
        if let Some(ids) = self.new.get(&key) {
            return Some(ids.clone());
        }
        let ids = self.old.remove(&key)?;
        self.put(key, ids.clone());
        Some(ids)
    }

    fn put(&mut self, key: u128, ids: std::sync::Arc<[u32]>) {
        if self.new_tokens + ids.len() > PARA_CACHE_TOKENS {
            self.old = std::mem::take(&mut self.new);
            self.new_tokens = 0;
        }
        self.new_tokens += ids.len();
        self.new.insert(key, ids);
    }
}

/// Byte offsets where `text` may be cut into paragraph chunks: after a
/// `\n` followed by a printable ASCII character other than space (a letter,
/// digit or punctuation: `#`, `-`, `|` open Markdown lines), at least [`PARA_MIN_CHUNK`] bytes
/// apart. Deterministic from the left, so a text and its extension share
/// every cut but the last.
pub fn paragraph_cuts(text: &str) -> impl Iterator<Item = usize> + '_ {
    exact_cuts(text, PARA_MIN_CHUNK)
}

/// The cuts of [`paragraph_cuts`], at least `min_chunk` bytes apart.
fn exact_cuts(text: &str, min_chunk: usize) -> impl Iterator<Item = usize> + '_ {
    let bytes = text.as_bytes();
    let mut last = 0usize;
    bytes.iter().enumerate().filter_map(move |(i, b)| {
        let cut = i + 1;
        let ok = *b == b'\n' && bytes.get(cut).is_some_and(u8::is_ascii_graphic) && cut - last >= min_chunk;
        if ok {
            last = cut;
            Some(cut)
        } else {
            None
        }
    })
}

/// `Split` stages with behaviour `Isolated`, from stage `level` on: each
/// stage splits every piece of the one before into its matches and the text
/// between them; `leaf` gets the last stage's pieces in order (never empty).
pub(crate) fn split_with(res: &[onig::Regex], level: usize, text: &str, leaf: &mut dyn FnMut(&str)) {
    let Some(re) = res.get(level) else {
        if !text.is_empty() {
            leaf(text);
        }
        return;
    };
    let mut at = 0;
    for (s, e) in re.find_iter(text) {
        if s > at {
            split_with(res, level + 1, text.get(at..s).unwrap_or_default(), leaf);
        }
        if e > s {
            split_with(res, level + 1, text.get(s..e).unwrap_or_default(), leaf);
        }
        at = at.max(e);
    }
    if at < text.len() {
        split_with(res, level + 1, text.get(at..).unwrap_or_default(), leaf);
    }
}

/// A multiplicative hasher for the `u64` pair keys of the merge table.
#[derive(Default, Clone, Copy)]
struct PairHasher(u64);

impl Hasher for PairHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = (x ^ (x >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type PairMap = HashMap<u64, (u32, u32), BuildHasherDefault<PairHasher>>;

fn pair(a: u32, b: u32) -> u64 {
    (u64::from(a) << 32) | u64::from(b)
}

/// The byte-level alphabet: byte `b` is written as this character in the
/// vocabulary (printable Latin-1 stands for itself, the rest for 256 + n).
fn byte_char(b: u8) -> char {
    let printable = |x: u8| (b'!'..=b'~').contains(&x) || (0xA1..=0xAC).contains(&x) || (0xAE..=0xFF).contains(&x);
    if printable(b) {
        return char::from(b);
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).unwrap_or('\u{0}')
}

/// Added tokens split out before BPE.
struct Added {
    matcher: AhoCorasick,
    ids: Vec<u32>,
}

impl Added {
    fn new(tokens: Vec<(String, u32)>) -> Option<Option<Self>> {
        if tokens.is_empty() {
            return Some(None);
        }
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(tokens.iter().map(|(c, _)| c.as_str()))
            .ok()?;
        Some(Some(Self { matcher, ids: tokens.into_iter().map(|(_, id)| id).collect() }))
    }
}

/// The encoder (see the module documentation).
pub struct FastBpe {
    splits: Vec<onig::Regex>,
    byte_ids: [u32; 256],
    merges: PairMap,
    raw_added: Option<Added>,
    normalized_added: Option<Added>,
    cache: Mutex<HashMap<Box<str>, Box<[u32]>>>,
    /// Cutting long texts into paragraphs is exact for this tokenizer.
    paragraphs_exact: bool,
    /// ... and is on.
    paragraphs: bool,
    /// The split regexes are DeepSeek-V3's: plain ASCII text is split by
    /// [`crate::ascii_split`] instead of the regex engine (on unless turned
    /// off, for comparisons).
    ascii_splits: bool,
    /// ... where the patterns are DeepSeek-V3's.
    ascii_splits_exact: bool,
    para_cache: Mutex<ParaCache>,
}

impl std::fmt::Debug for FastBpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastBpe").field("splits", &self.splits.len()).field("merges", &self.merges.len()).finish()
    }
}

impl FastBpe {
    /// From the text of a `tokenizer.json`; `None` when a stage is not one
    /// this encoder reproduces.
    pub fn from_json(text: &str) -> Option<Self> {
        let v: Value = serde_json::from_str(text).ok()?;
        match v.get("normalizer") {
            None | Some(Value::Null) => {}
            Some(n) if n.get("type")? == "Sequence" && n.get("normalizers")?.as_array()?.is_empty() => {}
            Some(_) => return None,
        }
        let pre = v.get("pre_tokenizer")?;
        let stages: Vec<&Value> = match pre.get("type")?.as_str()? {
            "Sequence" => pre.get("pretokenizers")?.as_array()?.iter().collect(),
            _ => vec![pre],
        };
        let (byte_level, splits) = stages.split_last()?;
        if byte_level.get("type")? != "ByteLevel"
            || byte_level.get("add_prefix_space").and_then(Value::as_bool) != Some(false)
            || byte_level.get("use_regex").and_then(Value::as_bool) != Some(false)
        {
            return None;
        }
        let splits = splits
            .iter()
            .map(|s| {
                let ok = s.get("type")? == "Split"
                    && s.get("behavior")? == "Isolated"
                    && s.get("invert").and_then(Value::as_bool) == Some(false);
                let pattern = s.get("pattern")?.get("Regex")?.as_str()?;
                if ok { Some((pattern, onig::Regex::new(pattern).ok()?)) } else { None }
            })
            .collect::<Option<Vec<_>>>()?;
        let paragraph_safe_splits = splits.iter().map(|(p, _)| *p).eq(PARAGRAPH_SAFE_SPLITS);
        let splits: Vec<onig::Regex> = splits.into_iter().map(|(_, re)| re).collect();

        let model = v.get("model")?;
        let null_or = |k: &str, ok: &dyn Fn(&Value) -> bool| model.get(k).is_none_or(|x| x.is_null() || ok(x));
        if model.get("type")? != "BPE"
            || !null_or("dropout", &|_| false)
            || !null_or("unk_token", &|_| false)
            || !null_or("continuing_subword_prefix", &|x| x.as_str() == Some(""))
            || !null_or("end_of_word_suffix", &|x| x.as_str() == Some(""))
            || !null_or("byte_fallback", &|x| x.as_bool() == Some(false))
            || !null_or("ignore_merges", &|x| x.as_bool() == Some(false))
        {
            return None;
        }
        let vocab = model.get("vocab")?.as_object()?;
        let id = |s: &str| vocab.get(s).and_then(Value::as_u64).and_then(|x| u32::try_from(x).ok());
        let mut byte_ids = [0u32; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            *slot = id(byte_char(b as u8).encode_utf8(&mut [0; 4]))?;
        }
        let list = model.get("merges")?.as_array()?;
        let mut merges = PairMap::with_capacity_and_hasher(list.len(), Default::default());
        for (rank, m) in list.iter().enumerate() {
            let (a, b) = match m {
                Value::String(s) => s.split_once(' ')?,
                Value::Array(p) => (p.first()?.as_str()?, p.get(1)?.as_str()?),
                _ => return None,
            };
            let merged = id(&format!("{a}{b}"))?;
            // The first (lowest) rank of a pair is the one that applies.
            merges.entry(pair(id(a)?, id(b)?)).or_insert((u32::try_from(rank).ok()?, merged));
        }

        let mut raw = Vec::new();
        let mut normalized = Vec::new();
        let mut added_line_break = false;
        for t in v.get("added_tokens")?.as_array()? {
            let flag = |k: &str| t.get(k).and_then(Value::as_bool).unwrap_or(false);
            if flag("lstrip") || flag("rstrip") || flag("single_word") {
                return None;
            }
            let content = t.get("content")?.as_str()?.to_owned();
            let tid = u32::try_from(t.get("id")?.as_u64()?).ok()?;
            if content.is_empty() {
                continue;
            }
            added_line_break |= content.contains(['\n', '\r']);
            if flag("normalized") { normalized.push((content, tid)) } else { raw.push((content, tid)) }
        }
        let paragraphs_exact = paragraph_safe_splits && !added_line_break;
        Some(Self {
            splits,
            byte_ids,
            merges,
            raw_added: Added::new(raw)?,
            normalized_added: Added::new(normalized)?,
            cache: Mutex::new(HashMap::new()),
            paragraphs_exact,
            paragraphs: paragraphs_exact,
            ascii_splits: paragraph_safe_splits,
            ascii_splits_exact: paragraph_safe_splits,
            para_cache: Mutex::new(ParaCache::default()),
        })
    }

    /// Whether long texts are encoded by cached paragraphs (step 4 of the
    /// module documentation).
    pub fn paragraphs(&self) -> bool {
        self.paragraphs
    }

    /// Turns paragraph chunking off or on (on only where it is exact).
    pub fn set_paragraphs(&mut self, on: bool) {
        self.paragraphs = on && self.paragraphs_exact;
    }

    /// Whether plain ASCII text is split without the regex engine (only
    /// for DeepSeek-V3's split regexes).
    pub fn ascii_splits(&self) -> bool {
        self.ascii_splits
    }

    /// Turns splitting plain ASCII text without the regex engine off, or
    /// on again where it applies (for comparisons and benchmarks).
    pub fn set_ascii_splits(&mut self, on: bool) {
        self.ascii_splits = on && self.ascii_splits_exact;
    }

    /// Token ids of `text`, without special tokens added around it.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 8);
        // One lock per call; a caller that finds it taken works uncached
        // rather than wait.
        let mut guard = self.cache.try_lock();
        let mut cx = Cx { out: &mut out, cache: guard.as_deref_mut() };
        if self.paragraphs && text.len() >= PARA_MIN_TEXT {
            let mut at = 0;
            for cut in paragraph_cuts(text).chain(std::iter::once(text.len())) {
                self.paragraph(text.get(at..cut).unwrap_or_default(), &mut cx);
                at = cut;
            }
        } else {
            self.whole(text, &mut cx);
        }
        out
    }

    /// Token ids of `text` without paragraph chunking (the reference for
    /// step 4).
    pub fn encode_whole(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 8);
        let mut guard = self.cache.try_lock();
        self.whole(text, &mut Cx { out: &mut out, cache: guard.as_deref_mut() });
        out
    }

    fn whole(&self, text: &str, cx: &mut Cx<'_>) {
        self.split_added(text, self.raw_added.as_ref(), cx, &|this, gap, cx| {
            this.split_added(gap, this.normalized_added.as_ref(), cx, &|this, gap, cx| this.split_gap(gap, cx))
        });
    }

    /// One paragraph chunk, from the paragraph cache when it is there.
    fn paragraph(&self, chunk: &str, cx: &mut Cx<'_>) {
        if chunk.is_empty() {
            return;
        }
        let key = xxhash_rust::xxh3::xxh3_128(chunk.as_bytes());
        if let Some(ids) = self.para_cache.try_lock().and_then(|mut c| c.get(key)) {
            cx.out.extend_from_slice(&ids);
            return;
        }
        let from = cx.out.len();
        self.whole(chunk, cx);
        if let (Some(ids), Some(mut c)) = (cx.out.get(from..), self.para_cache.try_lock()) {
            c.put(key, ids.into());
        }
    }

    fn split_added(&self, text: &str, added: Option<&Added>, cx: &mut Cx<'_>, gap: &dyn Fn(&Self, &str, &mut Cx<'_>)) {
        let Some(added) = added else { return gap(self, text, cx) };
        let mut at = 0;
        for m in added.matcher.find_iter(text) {
            if m.start() > at {
                gap(self, text.get(at..m.start()).unwrap_or_default(), cx);
            }
            if let Some(id) = added.ids.get(m.pattern().as_usize()) {
                cx.out.push(*id);
            }
            at = m.end();
        }
        if at < text.len() {
            gap(self, text.get(at..).unwrap_or_default(), cx);
        }
    }

    /// Text between added tokens through the split stages: plain ASCII
    /// without the regex engine where that is exact, line by line (at the
    /// exact cuts of step 4) when the text mixes in other characters.
    fn split_gap(&self, text: &str, cx: &mut Cx<'_>) {
        if !self.ascii_splits {
            return self.split_regex(0, text, cx);
        }
        if crate::ascii_split::covered(text) {
            return crate::ascii_split::split(text, &mut |p| self.piece(p, cx));
        }
        let mut at = 0;
        for cut in exact_cuts(text, 1).chain(std::iter::once(text.len())) {
            let line = text.get(at..cut).unwrap_or_default();
            if crate::ascii_split::covered(line) {
                crate::ascii_split::split(line, &mut |p| self.piece(p, cx));
            } else {
                self.split_regex(0, line, cx);
            }
            at = cut;
        }
    }

    fn split_regex(&self, level: usize, text: &str, cx: &mut Cx<'_>) {
        split_with(&self.splits, level, text, &mut |p| self.piece(p, cx));
    }

    fn piece(&self, piece: &str, cx: &mut Cx<'_>) {
        if piece.is_empty() {
            return;
        }
        let cacheable = piece.len() <= CACHE_MAX_PIECE;
        if cacheable && let Some(ids) = cx.cache.as_ref().and_then(|c| c.get(piece)) {
            cx.out.extend_from_slice(ids);
            return;
        }
        let from = cx.out.len();
        self.bpe(piece.as_bytes(), cx.out);
        if cacheable && let Some(cache) = cx.cache.as_mut() {
            if cache.len() >= CACHE_PIECES {
                cache.clear();
            }
            if let Some(ids) = cx.out.get(from..) {
                cache.insert(piece.into(), ids.into());
            }
        }
    }

    /// Merges the byte symbols of `bytes` and appends the result to `out`.
    fn bpe(&self, bytes: &[u8], out: &mut Vec<u32>) {
        let n = bytes.len();
        if n == 1 {
            if let Some(b) = bytes.first() {
                out.push(self.byte_ids[usize::from(*b)]);
            }
            return;
        }
        // A doubly linked list of symbols; `len == 0` marks a merged-away one.
        let mut sym: Vec<Sym> = bytes
            .iter()
            .enumerate()
            .map(|(i, b)| Sym {
                id: self.byte_ids[usize::from(*b)],
                prev: i.wrapping_sub(1),
                next: if i + 1 < n { i + 1 } else { usize::MAX },
                len: 1,
            })
            .collect();
        let mut heap: BinaryHeap<Reverse<(u32, usize, u32)>> = BinaryHeap::with_capacity(n);
        for i in 0..n - 1 {
            if let (Some(a), Some(b)) = (sym.get(i), sym.get(i + 1))
                && let Some(&(rank, merged)) = self.merges.get(&pair(a.id, b.id))
            {
                heap.push(Reverse((rank, i, merged)));
            }
        }
        while let Some(Reverse((rank, i, merged))) = heap.pop() {
            // Still valid: the left symbol is alive and the pair it forms
            // with its current right neighbour still merges at this rank.
            let Some(left) = sym.get(i).copied() else { continue };
            if left.len == 0 || left.next == usize::MAX {
                continue;
            }
            let Some(right) = sym.get(left.next).copied() else { continue };
            if self.merges.get(&pair(left.id, right.id)) != Some(&(rank, merged)) {
                continue;
            }
            if let Some(l) = sym.get_mut(i) {
                l.id = merged;
                l.len += right.len;
                l.next = right.next;
            }
            if let Some(r) = sym.get_mut(left.next) {
                r.len = 0;
            }
            if let Some(nn) = sym.get_mut(right.next) {
                nn.prev = i;
            }
            if let Some(p) = sym.get(left.prev)
                && let Some(&(r, m)) = self.merges.get(&pair(p.id, merged))
            {
                heap.push(Reverse((r, left.prev, m)));
            }
            if let Some(nx) = sym.get(right.next)
                && let Some(&(r, m)) = self.merges.get(&pair(merged, nx.id))
            {
                heap.push(Reverse((r, i, m)));
            }
        }
        let mut i = 0;
        while let Some(s) = sym.get(i) {
            out.push(s.id);
            i = s.next;
        }
    }
}

/// What one `encode` call carries through the splits.
struct Cx<'a> {
    out: &'a mut Vec<u32>,
    cache: Option<&'a mut HashMap<Box<str>, Box<[u32]>>>,
}

#[derive(Debug, Clone, Copy)]
struct Sym {
    id: u32,
    prev: usize,
    next: usize,
    len: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_alphabet_is_gpt2s() {
        assert_eq!(byte_char(b'A'), 'A');
        assert_eq!(byte_char(b' '), 'Ġ');
        assert_eq!(byte_char(b'\n'), 'Ċ');
        assert_eq!(byte_char(0), 'Ā');
        assert_eq!(byte_char(0xAD), '\u{143}');
        let all: std::collections::HashSet<char> = (0..=255u8).map(byte_char).collect();
        assert_eq!(all.len(), 256);
    }

    /// A tiny tokenizer.json: bytes a, b, c; merges "a b" (0), "ab c" (1),
    /// "b c" (2).
    fn tiny(extra_added: &str) -> String {
        let mut vocab = serde_json::Map::new();
        for b in 0..=255u8 {
            let n = vocab.len();
            vocab.insert(byte_char(b).to_string(), n.into());
        }
        for t in ["ab", "abc", "bc"] {
            let n = vocab.len();
            vocab.insert(t.into(), n.into());
        }
        format!(
            r#"{{"normalizer": null,
               "pre_tokenizer": {{"type": "Sequence", "pretokenizers": [
                  {{"type": "Split", "pattern": {{"Regex": "\\s+"}}, "behavior": "Isolated", "invert": false}},
                  {{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}}]}},
               "added_tokens": [{{"id": 300, "content": "<x>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}}{extra_added}],
               "model": {{"type": "BPE", "dropout": null, "unk_token": null, "vocab": {}, "merges": ["a b", "ab c", "b c"]}}}}"#,
            serde_json::Value::Object(vocab)
        )
    }

    #[test]
    fn merges_by_rank_and_splits_added_tokens_and_regex_pieces() {
        let f = FastBpe::from_json(&tiny("")).unwrap();
        let id = |s: &str| -> u32 {
            match s {
                "ab" => 256,
                "abc" => 257,
                "bc" => 258,
                _ => f.byte_ids[usize::from(s.as_bytes()[0])],
            }
        };
        // "abc": "a b" (rank 0) before "b c" (rank 2), then "ab c".
        assert_eq!(f.encode("abc"), vec![id("abc")]);
        assert_eq!(f.encode("bca"), vec![id("bc"), id("a")]);
        // Whitespace is its own piece: no merge crosses it.
        assert_eq!(f.encode("ab c"), vec![id("ab"), id(" "), id("c")]);
        // The added token splits, and is its own id.
        assert_eq!(f.encode("a<x>bc"), vec![id("a"), 300, id("bc")]);
        assert_eq!(f.encode(""), Vec::<u32>::new());
        // Cached pieces give the same ids.
        assert_eq!(f.encode("abc abc"), vec![id("abc"), id(" "), id("abc")]);
    }

    #[test]
    fn refuses_shapes_it_does_not_reproduce() {
        let ok = tiny("");
        assert!(FastBpe::from_json(&ok).is_some());
        assert!(FastBpe::from_json(&ok.replace(r#""dropout": null"#, r#""dropout": 0.1"#)).is_none());
        assert!(FastBpe::from_json(&ok.replace(r#""behavior": "Isolated""#, r#""behavior": "Removed""#)).is_none());
        assert!(FastBpe::from_json(&ok.replace(r#""normalizer": null"#, r#""normalizer": {"type": "NFC"}"#)).is_none());
        let lstrip = r#", {"id": 301, "content": "<y>", "single_word": false, "lstrip": true, "rstrip": false, "normalized": false, "special": true}"#;
        assert!(FastBpe::from_json(&tiny(lstrip)).is_none());
        assert!(FastBpe::from_json("not json").is_none());
    }
}
