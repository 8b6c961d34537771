//! Segment-cached tokenization must give exactly the ids of whole-prompt
//! tokenization, which in turn equal vLLM's (real capture) and the Python
//! `tokenizers` package's (the library vLLM tokenizes with).

use std::path::PathBuf;
use std::sync::atomic::Ordering;

use kvgate_server::tokens::{Outcome, PromptTokenizer, SegmentRef, TokenCacheConfig, chain_hashes};
use proptest::prelude::*;
use serde_json::{Value, json};

fn model_dir() -> PathBuf {
    let dir = std::env::var_os("KVGATE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| kvgate_testkit::repo_root().join(".tools/models/deepseek-v3"));
    assert!(dir.join("tokenizer.json").exists(), "no tokenizer at {} (run scripts/setup.sh)", dir.display());
    dir
}

fn tokenizer(config: TokenCacheConfig) -> PromptTokenizer {
    PromptTokenizer::from_dir(&model_dir(), config).unwrap()
}

struct Req {
    context: Vec<u8>,
    messages: Vec<Vec<u8>>,
    hashes: Vec<u64>,
}

impl Req {
    fn new(context: &[u8], messages: &[Value]) -> Self {
        let messages: Vec<Vec<u8>> = messages.iter().map(|m| serde_json::to_vec(m).unwrap()).collect();
        let refs: Vec<&[u8]> = messages.iter().map(Vec::as_slice).collect();
        let hashes = chain_hashes(context, &refs);
        Self { context: context.to_vec(), messages, hashes }
    }

    fn segs(&self) -> Vec<SegmentRef<'_>> {
        self.messages
            .iter()
            .zip(&self.hashes)
            .map(|(m, h)| SegmentRef { chain_hash: *h, message_json: m, elided: false })
            .collect()
    }
}

fn turn(i: usize) -> String {
    format!("Question {i}: what is {} + {}? Explain step by step, with care. ", i * 7, i * 13)
}

#[test]
fn self_test_passes_for_the_deepseek_template() {
    let tk = tokenizer(TokenCacheConfig::default());
    assert!(tk.segmented(), "{}", tk.self_test_result());
    assert!(tk.self_test_result().starts_with("passed"), "{}", tk.self_test_result());
    // New turns render stand-ins for cached messages (the path every
    // partial-hit test below then takes).
    assert!(tk.self_test_result().contains("local template"), "{}", tk.self_test_result());
}

#[test]
fn multi_turn_conversation_hits_the_cache_and_equals_whole_prompt() {
    let tk = tokenizer(TokenCacheConfig { verify_every: 1, ..Default::default() });
    let system = json!({"role": "system", "content": "You are a careful assistant. ".repeat(200)});
    let mut msgs = vec![system, json!({"role": "user", "content": turn(0)})];
    let mut outcomes = Vec::new();
    for i in 1..8 {
        let r = Req::new(b"", &msgs);
        let t = tk.chat(&r.context, &r.segs()).unwrap();
        let whole = tk.chat_uncached(&r.context, &r.segs()).unwrap();
        assert_eq!(t.ids, whole, "turn {i}");
        outcomes.push(t.outcome);
        // The same request again: everything cached, nothing encoded.
        let again = tk.chat(&r.context, &r.segs()).unwrap();
        assert_eq!(again.ids, whole);
        assert_eq!(again.outcome, Outcome::FullHit);
        assert_eq!(again.encoded_bytes, 0);
        msgs.push(json!({"role": "assistant", "content": format!("The answer is {}.", i * 20)}));
        msgs.push(json!({"role": "user", "content": turn(i)}));
    }
    assert_eq!(outcomes[0], Outcome::Miss);
    assert!(outcomes[1..].iter().all(|o| *o == Outcome::PartialHit), "{outcomes:?}");
    assert_eq!(tk.stats.verify_failures.load(Ordering::Relaxed), 0);

    // Another conversation on the same system prompt reuses its chunk.
    let r = Req::new(b"", &[msgs[0].clone(), json!({"role": "user", "content": "different"})]);
    let t = tk.chat(&r.context, &r.segs()).unwrap();
    assert_eq!(t.outcome, Outcome::PartialHit);
    assert!(t.encoded_bytes < 100, "only the new message and the generation prompt: {}", t.encoded_bytes);
    assert_eq!(t.ids, tk.chat_uncached(&r.context, &r.segs()).unwrap());
}

/// The filter elides the messages the tokenizer said it retains: the ids
/// are exactly the whole prompt's, only the new messages are parsed and
/// encoded, and whatever the cache does not hold (or a malformed elision)
/// asks for the text instead of guessing.
#[test]
fn elided_messages_come_from_the_cache_or_are_asked_for() {
    use kvgate_server::tokens::PromptError;
    let tk = tokenizer(TokenCacheConfig { verify_every: 1, ..Default::default() });
    let mut msgs = vec![
        json!({"role": "system", "content": "You are a careful assistant. ".repeat(100)}),
        json!({"role": "user", "content": turn(0)}),
    ];
    let r = Req::new(b"", &msgs);
    let first = tk.chat(&r.context, &r.segs()).unwrap();
    assert_eq!(first.retained, r.hashes, "the system prompt and the whole conversation are retained");
    for i in 1..5 {
        let retained = Req::new(b"", &msgs).hashes.last().copied().unwrap();
        msgs.push(json!({"role": "assistant", "content": format!("The answer is {}.", i * 20)}));
        msgs.push(json!({"role": "user", "content": turn(i)}));
        let r = Req::new(b"", &msgs);
        let k = r.hashes.iter().position(|h| *h == retained).unwrap();
        let segs: Vec<SegmentRef<'_>> = r
            .segs()
            .into_iter()
            .enumerate()
            .map(|(j, s)| if j <= k { SegmentRef { message_json: b"", elided: true, ..s } } else { s })
            .collect();
        let t = tk.chat(&r.context, &segs).unwrap();
        assert_eq!(t.ids, tk.chat_uncached(&r.context, &r.segs()).unwrap(), "turn {i}");
        assert_eq!(t.outcome, Outcome::PartialHit);
        assert!(t.encoded_bytes < 200, "only the new messages: {}", t.encoded_bytes);
        assert_eq!(t.retained, [r.hashes[0], *r.hashes.last().unwrap()]);
        // Elided through the last message: a full hit.
        let all: Vec<SegmentRef<'_>> =
            r.segs().into_iter().map(|s| SegmentRef { message_json: b"", elided: true, ..s }).collect();
        let again = tk.chat(&r.context, &all).unwrap();
        assert_eq!((again.outcome, &again.ids), (Outcome::FullHit, &t.ids));
    }
    assert_eq!(tk.stats.verify_failures.load(Ordering::Relaxed), 0);

    // A tokenizer that never saw the conversation asks for it.
    let fresh = tokenizer(TokenCacheConfig::default());
    let r = Req::new(b"", &msgs);
    let segs: Vec<SegmentRef<'_>> = r
        .segs()
        .into_iter()
        .enumerate()
        .map(|(j, s)| if j < 3 { SegmentRef { message_json: b"", elided: true, ..s } } else { s })
        .collect();
    assert!(matches!(fresh.chat(&r.context, &segs), Err(PromptError::NeedText(_))));
    // An elided message after a sent one is refused, even when cached.
    let mut holes = r.segs();
    holes[2] = SegmentRef { message_json: b"", elided: true, ..holes[2] };
    assert!(matches!(tk.chat(&r.context, &holes), Err(PromptError::NeedText(_))));
    // A cache too small to hold the conversation retains nothing.
    let tiny = tokenizer(TokenCacheConfig { budget_tokens: 64, ..Default::default() });
    assert!(tiny.chat(&r.context, &r.segs()).unwrap().retained.is_empty());
    // Another conversation on the retained system prompt elides it.
    let other = Req::new(b"", &[msgs[0].clone(), json!({"role": "user", "content": "unrelated"})]);
    let mut segs = other.segs();
    segs[0] = SegmentRef { message_json: b"", elided: true, ..segs[0] };
    let t = tk.chat(&other.context, &segs).unwrap();
    assert_eq!((t.outcome, &t.ids), (Outcome::PartialHit, &tk.chat_uncached(&other.context, &other.segs()).unwrap()));
}

/// Regression (found by `cached_equals_whole` in CI): a conversation whose
/// last message is a cached *inner* boundary (no generation-prompt suffix
/// stored) once made a chunk that named itself as its predecessor, and the
/// next lookup walked that cycle forever.
#[test]
fn a_cached_inner_boundary_as_the_last_message_terminates_and_is_exact() {
    let tk = tokenizer(TokenCacheConfig { verify_every: 1, ..Default::default() });
    let a = json!({"role": "system", "content": "Shared instructions for every tenant."});
    let b = json!({"role": "user", "content": "First question"});
    // [a, b] is a miss: chunks at a (inner boundary, no suffix) and at b.
    let r = Req::new(b"", &[a.clone(), b]);
    assert_eq!(tk.chat(&r.context, &r.segs()).unwrap().outcome, Outcome::Miss);
    // [a] alone: cached up to its last message, suffix missing.
    let r = Req::new(b"", std::slice::from_ref(&a));
    let whole = tk.chat_uncached(&r.context, &r.segs()).unwrap();
    let t = tk.chat(&r.context, &r.segs()).unwrap();
    assert_eq!((t.outcome, &t.ids), (Outcome::PartialHit, &whole));
    // Now with its suffix: a full hit, and again after more turns.
    let t = tk.chat(&r.context, &r.segs()).unwrap();
    assert_eq!((t.outcome, &t.ids), (Outcome::FullHit, &whole));
    let r2 = Req::new(b"", &[a, json!({"role": "user", "content": "Second question"})]);
    let t = tk.chat(&r2.context, &r2.segs()).unwrap();
    assert_eq!(t.ids, tk.chat_uncached(&r2.context, &r2.segs()).unwrap());
    assert_eq!(tk.stats.verify_failures.load(Ordering::Relaxed), 0);
}

#[test]
fn wrong_chain_hash_bypasses_the_cache() {
    let tk = tokenizer(TokenCacheConfig::default());
    let msgs = [json!({"role": "user", "content": "hello"})];
    let r = Req::new(b"", &msgs);
    tk.chat(&r.context, &r.segs()).unwrap();
    // A forged hash naming the cached chunk, with other bytes.
    let other = serde_json::to_vec(&json!({"role": "user", "content": "goodbye"})).unwrap();
    let forged = [SegmentRef { chain_hash: r.hashes[0], message_json: &other, elided: false }];
    let t = tk.chat(b"", &forged).unwrap();
    assert_eq!(t.outcome, Outcome::Whole);
    assert_eq!(t.ids, tk.chat_uncached(b"", &forged).unwrap());
    assert_eq!(tk.stats.hash_mismatches.load(Ordering::Relaxed), 1);
}

#[test]
fn template_context_and_flags() {
    let tk = tokenizer(TokenCacheConfig::default());
    let msgs = [json!({"role": "user", "content": "hi"}), json!({"role": "assistant", "content": "Hel"})];
    for ctx in [
        &br#"{"add_generation_prompt":false}"#[..],
        br#"{"continue_final_message":true,"add_generation_prompt":false}"#,
        br#"{"chat_template_kwargs":{"thinking":true}}"#,
    ] {
        let r = Req::new(ctx, &msgs);
        for _ in 0..2 {
            let t = tk.chat(&r.context, &r.segs()).unwrap();
            assert_eq!(t.ids, tk.chat_uncached(&r.context, &r.segs()).unwrap(), "{}", String::from_utf8_lossy(ctx));
        }
    }
    let bad = Req::new(b"[1]", &msgs);
    assert!(tk.chat(&bad.context, &bad.segs()).unwrap_err().to_string().contains("not a JSON object"));
    let not_obj = [SegmentRef { chain_hash: 0, message_json: b"\"text\"", elided: false }];
    let e = tk.chat(b"", &not_obj).unwrap_err().to_string();
    assert!(e.contains("message 0"), "{e}");
}

#[test]
fn tiny_budget_evicts_but_stays_correct() {
    let tk = tokenizer(TokenCacheConfig { budget_tokens: 64, verify_every: 0 });
    let mut msgs = vec![json!({"role": "system", "content": "word ".repeat(100)})];
    for i in 0..5 {
        msgs.push(json!({"role": "user", "content": turn(i)}));
        let r = Req::new(b"", &msgs);
        let t = tk.chat(&r.context, &r.segs()).unwrap();
        assert_eq!(t.ids, tk.chat_uncached(&r.context, &r.segs()).unwrap());
        assert!(tk.cache_size().0 <= 64);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    /// Random conversations grown turn by turn: cached ids always equal
    /// whole-prompt ids.
    #[test]
    fn cached_equals_whole(turns in proptest::collection::vec(("(system|user|assistant)", "[ -~\n\t\u{e9}\u{4e16}]{0,40}"), 1..8)) {
        // One tokenizer for all cases: the cache carries over between them.
        static TK: std::sync::LazyLock<PromptTokenizer> =
            std::sync::LazyLock::new(|| tokenizer(TokenCacheConfig { budget_tokens: 4096, verify_every: 0 }));
        let tk = &*TK;
        let mut msgs = Vec::new();
        for (role, content) in &turns {
            msgs.push(json!({"role": role, "content": content}));
            let r = Req::new(b"", &msgs);
            let t = tk.chat(&r.context, &r.segs()).unwrap();
            prop_assert_eq!(&t.ids, &tk.chat_uncached(&r.context, &r.segs()).unwrap());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    /// Prefixes of one conversation requested in any order (shorter after
    /// longer, repeats, jumps), with or without the generation prompt:
    /// cached ids always equal whole-prompt ids.
    #[test]
    fn any_order_of_prefixes_equals_whole(
        turns in proptest::collection::vec(("(system|user|assistant)", "[ -~\n\u{e9}]{0,24}"), 1..7),
        order in proptest::collection::vec((0usize..7, any::<bool>()), 1..12),
    ) {
        static TK: std::sync::LazyLock<PromptTokenizer> =
            std::sync::LazyLock::new(|| tokenizer(TokenCacheConfig { budget_tokens: 2048, verify_every: 0 }));
        let tk = &*TK;
        let msgs: Vec<Value> = turns.iter().map(|(r, c)| json!({"role": r, "content": c})).collect();
        for (len, gen_prompt) in order {
            let len = len.min(msgs.len() - 1) + 1;
            let ctx: &[u8] = if gen_prompt { b"" } else { br#"{"add_generation_prompt":false}"# };
            let r = Req::new(ctx, &msgs[..len]);
            let t = tk.chat(&r.context, &r.segs()).unwrap();
            prop_assert_eq!(&t.ids, &tk.chat_uncached(&r.context, &r.segs()).unwrap());
        }
    }
}

/// Reference: the Python `tokenizers` package (what vLLM uses) on the same
/// `tokenizer.json`, for the rendered text of multi-turn conversations built
/// from the real production trace's shapes.
#[test]
fn ids_equal_python_tokenizers_reference() {
    let python = std::env::var("KVGATE_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|_| kvgate_testkit::repo_root().join(".tools/venv/bin/python"));
    let tk = tokenizer(TokenCacheConfig::default());
    let mut cases = Vec::new();
    let mut msgs = vec![json!({"role": "system", "content": "You review code. Be brief.\n\n"})];
    for i in 0..6 {
        msgs.push(json!({"role": "user", "content": format!("File {i}:\n```python\ndef f{i}(x):\n    return x * {i}  # ünïcödé 漢字\n```\n")}));
        let r = Req::new(b"", &msgs);
        let ids = tk.chat(&r.context, &r.segs()).unwrap().ids;
        let text = tk.inner().render(&msgs, true, &serde_json::Map::new()).unwrap();
        cases.push(json!({"text": text, "ids": ids}));
        msgs.push(json!({"role": "assistant", "content": format!("Looks fine; f{i} scales by {i}.")}));
    }
    let dir = kvgate_testkit::scratch_dir("tokens-ref").unwrap();
    let input = dir.join("cases.json");
    std::fs::write(&input, serde_json::to_vec(&cases).unwrap()).unwrap();
    let script = r#"
import json, sys
from tokenizers import Tokenizer
tk = Tokenizer.from_file(sys.argv[1])
cases = json.load(open(sys.argv[2]))
bad = [i for i, c in enumerate(cases) if tk.encode(c["text"], add_special_tokens=False).ids != c["ids"]]
print(json.dumps({"checked": len(cases), "mismatched": bad}))
"#;
    let out = std::process::Command::new(&python)
        .arg("-c")
        .arg(script)
        .arg(model_dir().join("tokenizer.json"))
        .arg(&input)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["checked"], 6);
    assert_eq!(v["mismatched"], json!([]), "{v}");
}

/// The real vLLM 0.32 requests: ids through the cached path equal the ids
/// vLLM computed (and the cache returns them again on a second call).
#[test]
fn ids_equal_real_vllm_prompts() {
    let tk = tokenizer(TokenCacheConfig::default());
    let v: Value = serde_json::from_str(
        &std::fs::read_to_string(
            kvgate_testkit::shared_dir().unwrap().join("vectors/block-hash/vllm-sha256-cbor.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let mut n = 0;
    for case in v["real_inst1"].as_array().unwrap() {
        let req = &case["request"];
        let msgs = req["messages"].as_array().unwrap();
        let want: Vec<u32> =
            req["prompt_token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
        let r = Req::new(b"", msgs);
        assert_eq!(tk.chat(&r.context, &r.segs()).unwrap().ids, want);
        let again = tk.chat(&r.context, &r.segs()).unwrap();
        assert_eq!(again.outcome, Outcome::FullHit);
        assert_eq!(again.ids, want);
        n += 1;
    }
    assert_eq!(n, 3);
}

#[test]
fn completion_prompts_add_special_tokens_like_vllm() {
    let tk = tokenizer(TokenCacheConfig::default());
    let t = tk.completion("Hello world").unwrap();
    let plain = tk.inner().encode("Hello world").unwrap();
    // This tokenizer's post-processor adds nothing and its config says
    // add_bos_token = false, so vLLM (transformers' fast tokenizer) adds no
    // BOS either.
    assert_eq!(t.ids, plain);
    assert_eq!(t.outcome, Outcome::Whole);
}
