//! A chat prompt through the prompt cache, as the control plane tokenizes a
//! Pick: `new_turn` is a cached conversation (a ~3,750-token system prompt
//! and a question, as bench-scale's DOKS mix) plus a new assistant reply and
//! user question, different every iteration (the common case behind a chat
//! product: stand-ins rendered for the cached messages, the new text
//! encoded); `full_hit` is the same conversation again (a retry).
//! `render_stand_ins` is one render of the cached messages' stand-ins.
//! `cargo bench -p kvgate-tokenize --bench chat`.

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use kvgate_tokenize::prompt::{PromptTokenizer, SegmentRef, TokenCacheConfig, chain_hashes};
use serde_json::{Value, json};

fn words(seed: u64, n: usize) -> String {
    kvgate_bench_support::words(seed, n)
}

fn request(messages: &[Value]) -> Request {
    let context = br#"{"add_generation_prompt":true}"#.to_vec();
    let bytes: Vec<Vec<u8>> = messages.iter().map(|m| serde_json::to_vec(m).unwrap_or_default()).collect();
    let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    let hashes = chain_hashes(&context, &refs);
    (context, bytes, hashes)
}

/// A request's context, message bytes and chain hashes (what the filter
/// sends; built outside the timed part).
type Request = (Vec<u8>, Vec<Vec<u8>>, Vec<u64>);

fn chat(pt: &PromptTokenizer, (context, bytes, hashes): &Request) -> usize {
    let segs: Vec<SegmentRef<'_>> =
        bytes.iter().zip(hashes).map(|(b, h)| SegmentRef { chain_hash: *h, message_json: b, elided: false }).collect();
    pt.chat(context, &segs).map(|t| t.ids.len()).unwrap_or(0)
}

fn bench(c: &mut Criterion) {
    let dir = std::env::var_os("KVGATE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.tools/models/deepseek-v3"));
    let config = TokenCacheConfig { verify_every: 0, ..TokenCacheConfig::default() };
    let pt = PromptTokenizer::from_dir(&dir, config).unwrap();
    let base =
        vec![json!({"role": "system", "content": words(1, 3000)}), json!({"role": "user", "content": words(2, 40)})];
    let again = request(&base);
    assert!(chat(&pt, &again) > 3000);
    let mut g = c.benchmark_group("chat");
    let mut i = 0u64;
    g.bench_function("new_turn", |b| {
        b.iter_batched(
            || {
                i += 1;
                let mut m = base.clone();
                m.push(json!({"role": "assistant", "content": words(i * 2 + 100, 60)}));
                m.push(json!({"role": "user", "content": words(i * 2 + 101, 40)}));
                request(&m)
            },
            |r| black_box(chat(&pt, &r)),
            BatchSize::SmallInput,
        )
    });
    g.bench_function("full_hit", |b| b.iter(|| black_box(chat(&pt, &again))));
    let stand: Vec<Value> = base.iter().map(|m| json!({"role": m["role"], "content": ""})).collect();
    let extra = serde_json::Map::new();
    g.bench_function("render_stand_ins", |b| b.iter(|| black_box(pt.inner().render(&stand, false, &extra))));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
