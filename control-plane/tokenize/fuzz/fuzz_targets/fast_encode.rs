//! The direct encoder against the `tokenizers` library on arbitrary text
//! (the bytes as lossy UTF-8), with the real DeepSeek-V3 tokenizer: the ids
//! must be equal and nothing may panic. The text is also repeated, joined by
//! line breaks that open a paragraph, past the length where the encoder
//! cuts long texts into cached paragraphs, so every input tests the cuts.
#![no_main]

use std::sync::OnceLock;

use kvgate_tokenize::ChatTokenizer;
use kvgate_tokenize::fast::FastBpe;
use libfuzzer_sys::fuzz_target;

fn parts() -> &'static (ChatTokenizer, FastBpe) {
    static P: OnceLock<(ChatTokenizer, FastBpe)> = OnceLock::new();
    P.get_or_init(|| {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../.tools/models/deepseek-v3");
        let tk = ChatTokenizer::from_dir(&dir).expect("the tokenizer (run scripts/setup.sh)");
        let json = std::fs::read_to_string(dir.join("tokenizer.json")).expect("tokenizer.json");
        let fast = FastBpe::from_json(&json).expect("a shape the direct encoder takes");
        (tk, fast)
    })
}

fuzz_target!(|data: &[u8]| {
    let (tk, fast) = parts();
    let text = String::from_utf8_lossy(data);
    let reference = tk.encode_reference(&text).expect("the library encodes any text");
    assert_eq!(fast.encode(&text), reference, "{text:?}");
    if !text.is_empty() {
        let mut long = String::new();
        while long.len() < kvgate_tokenize::fast::PARA_MIN_TEXT + kvgate_tokenize::fast::PARA_MIN_CHUNK {
            long.push_str(&text);
            long.push_str("\nA");
        }
        long.push_str(&text);
        let reference = tk.encode_reference(&long).expect("the library encodes any text");
        assert_eq!(fast.encode(&long), reference, "{long:?}");
    }
});
