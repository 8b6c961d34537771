//! Encoding text to ids: the direct encoder (`fast`, whole text) against the
//! `tokenizers` library, same tokenizer (DeepSeek-V3), same text, same run.
//! Text: this repository's English documentation (Markdown with code), cut
//! to ~1K, ~8K and ~100K tokens: a chat turn's new text, a long
//! conversation's first message, a long document. `doc_new_question`: the
//! same text followed by a question that changes every iteration, encoded
//! as the control plane does (by cached paragraphs): a RAG prompt or a
//! first turn on a shared starter, after the document was seen once.
//! `fast_regex_splits`: the direct encoder with every piece split by the
//! regex engine (plain ASCII lines split without it is `fast`'s step 5).
//! `added_tokens`: whether a chat turn's text starts or ends with one of the
//! tokenizer's 1,283 added tokens (asked on every new turn), by hash set
//! per distinct length (`set`) against comparing every token (`scan`).
//! `cargo bench -p kvgate-tokenize --bench encode`.

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvgate_tokenize::ChatTokenizer;
use kvgate_tokenize::fast::FastBpe;

fn text(bytes: usize) -> String {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut all = String::new();
    for f in ["docs/DECISIONS.md", "docs/OPERATIONS.md", "docs/INSTALL.md", "README.md", "filter/README.md"] {
        all.push_str(&std::fs::read_to_string(root.join(f)).unwrap_or_default());
    }
    while all.len() < bytes {
        all = all.repeat(2);
    }
    let mut end = bytes;
    while !all.is_char_boundary(end) {
        end -= 1;
    }
    all.truncate(end);
    all
}

fn bench(c: &mut Criterion) {
    let dir = std::env::var_os("KVGATE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.tools/models/deepseek-v3"));
    let tk = ChatTokenizer::from_dir(&dir).unwrap();
    assert!(tk.uses_fast_encoder() && tk.encodes_by_paragraph());
    let fast = FastBpe::from_json(&std::fs::read_to_string(dir.join("tokenizer.json")).unwrap()).unwrap();
    let mut regex_only = FastBpe::from_json(&std::fs::read_to_string(dir.join("tokenizer.json")).unwrap()).unwrap();
    regex_only.set_ascii_splits(false);
    assert!(fast.ascii_splits() && !regex_only.ascii_splits());
    let mut g = c.benchmark_group("encode");
    g.sample_size(20);
    for (label, bytes) in [("1k_tokens", 4_500), ("8k_tokens", 36_000), ("100k_tokens", 450_000)] {
        let t = text(bytes);
        assert_eq!(tk.encode(&t).unwrap(), tk.encode_reference(&t).unwrap());
        assert_eq!(fast.encode_whole(&t), tk.encode_reference(&t).unwrap());
        g.throughput(Throughput::Bytes(t.len() as u64));
        g.bench_with_input(BenchmarkId::new("fast", label), &t, |b, t| b.iter(|| fast.encode_whole(black_box(t))));
        g.bench_with_input(BenchmarkId::new("fast_regex_splits", label), &t, |b, t| {
            b.iter(|| regex_only.encode_whole(black_box(t)))
        });
        let mut n = 0u64;
        g.bench_with_input(BenchmarkId::new("doc_new_question", label), &t, |b, t| {
            b.iter(|| {
                n += 1;
                tk.encode(black_box(&format!("{t}\n\nQuestion {n}: what does the text above decide?"))).unwrap()
            })
        });
        g.bench_with_input(BenchmarkId::new("library", label), &t, |b, t| {
            b.iter(|| tk.encode_reference(black_box(t)).unwrap())
        });
    }
    g.finish();

    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer.json")).unwrap()).unwrap();
    let tokens: Vec<String> = json["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t["content"].as_str().map(str::to_owned))
        .collect();
    let set = kvgate_tokenize::added::AddedTokens::new(tokens.iter().map(String::as_str));
    let turn = "Question 17: what does the text above decide about the cache?";
    let mut g = c.benchmark_group("added_tokens");
    g.bench_function("set", |b| b.iter(|| set.is_prefix_of(black_box(turn)) || set.is_suffix_of(black_box(turn))));
    g.bench_function("scan", |b| {
        b.iter(|| {
            tokens.iter().any(|t| black_box(turn).starts_with(t.as_str()) || black_box(turn).ends_with(t.as_str()))
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
