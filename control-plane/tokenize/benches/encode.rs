//! Encoding text to ids: the direct encoder (`fast`) against the
//! `tokenizers` library, same tokenizer (DeepSeek-V3), same text, same run.
//! Text: this repository's English documentation (Markdown with code), cut
//! to ~1K, ~8K and ~100K tokens: a chat turn's new text, a long
//! conversation's first message, a long document.
//! `cargo bench -p kvgate-tokenize --bench encode`.

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvgate_tokenize::ChatTokenizer;

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
    assert!(tk.uses_fast_encoder());
    let mut g = c.benchmark_group("encode");
    g.sample_size(20);
    for (label, bytes) in [("1k_tokens", 4_500), ("8k_tokens", 36_000), ("100k_tokens", 450_000)] {
        let t = text(bytes);
        assert_eq!(tk.encode(&t).unwrap(), tk.encode_reference(&t).unwrap());
        g.throughput(Throughput::Bytes(t.len() as u64));
        g.bench_with_input(BenchmarkId::new("fast", label), &t, |b, t| b.iter(|| tk.encode(black_box(t)).unwrap()));
        g.bench_with_input(BenchmarkId::new("library", label), &t, |b, t| {
            b.iter(|| tk.encode_reference(black_box(t)).unwrap())
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
