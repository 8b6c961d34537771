//! The token ids must equal what vLLM computes. Reference: the requests of
//! the real vLLM 0.32 capture (`../shared/vectors/block-hash/vllm-sha256-cbor.json`):
//! their messages, the prompt vLLM rendered and the 325 prompt ids vLLM
//! tokenized (confirmed by the engine's own block hashes in the capture).

use std::path::PathBuf;

use kvgate_tokenize::ChatTokenizer;
use serde_json::Value;

fn model_dir() -> PathBuf {
    let dir = std::env::var_os("KVGATE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.tools/models/deepseek-v3"));
    assert!(dir.join("tokenizer.json").exists(), "no tokenizer at {} (run scripts/setup.sh)", dir.display());
    dir
}

#[test]
fn chat_prompts_tokenize_exactly_like_vllm() {
    let tk = ChatTokenizer::from_dir(&model_dir()).unwrap();
    let shared = std::env::var_os("KVGATE_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared"));
    let v: Value = serde_json::from_str(
        &std::fs::read_to_string(shared.join("vectors/block-hash/vllm-sha256-cbor.json")).unwrap(),
    )
    .unwrap();
    let mut checked = 0;
    for case in v["real_inst1"].as_array().unwrap() {
        let req = &case["request"];
        let messages = req["messages"].as_array().unwrap();
        let rendered = tk.render(messages, true, &serde_json::Map::new()).unwrap();
        assert_eq!(rendered, req["rendered_prompt"].as_str().unwrap());
        let ids = tk.encode_chat(messages, true).unwrap();
        let want: Vec<u32> =
            req["prompt_token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
        assert_eq!(ids.len(), 325);
        assert_eq!(ids, want);
        checked += 1;
    }
    assert_eq!(checked, 3);
}

#[test]
fn errors_name_the_file() {
    let err = ChatTokenizer::from_dir(std::path::Path::new("/nonexistent-model")).unwrap_err();
    assert!(err.to_string().contains("/nonexistent-model/tokenizer.json"), "{err}");
}
