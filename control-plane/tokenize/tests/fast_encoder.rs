//! The direct encoder (`kvgate_tokenize::fast`) against the `tokenizers`
//! library on the real DeepSeek-V3 tokenizer: the same ids for real prompts
//! (the vLLM capture), for this repository's own text files (code, Markdown,
//! YAML: odd whitespace, symbols, Unicode), for every added token, and for
//! generated text mixing scripts, digits, whitespace runs, emoji, combining
//! marks, special tokens and arbitrary characters.

use std::path::{Path, PathBuf};

use kvgate_tokenize::ChatTokenizer;
use kvgate_tokenize::fast::FastBpe;
use proptest::prelude::*;

fn model_dir() -> PathBuf {
    let dir = std::env::var_os("KVGATE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.tools/models/deepseek-v3"));
    assert!(dir.join("tokenizer.json").exists(), "no tokenizer at {} (run scripts/setup.sh)", dir.display());
    dir
}

fn tokenizer() -> &'static ChatTokenizer {
    static TK: std::sync::OnceLock<ChatTokenizer> = std::sync::OnceLock::new();
    TK.get_or_init(|| ChatTokenizer::from_dir(&model_dir()).unwrap())
}

/// The direct encoder built straight from the file: no load-time self-check
/// stands between it and these tests.
fn fast() -> &'static FastBpe {
    static F: std::sync::OnceLock<FastBpe> = std::sync::OnceLock::new();
    F.get_or_init(|| {
        FastBpe::from_json(&std::fs::read_to_string(model_dir().join("tokenizer.json")).unwrap())
            .expect("DeepSeek-V3's tokenizer.json has a shape the direct encoder takes")
    })
}

fn same(text: &str) {
    let tk = tokenizer();
    let fast = fast().encode(text);
    let reference = tk.encode_reference(text).unwrap();
    if fast != reference {
        let at = fast.iter().zip(&reference).position(|(a, b)| a != b).unwrap_or(fast.len().min(reference.len()));
        panic!(
            "ids differ at {at} (fast {:?}, library {:?}) for {:?}",
            fast.get(at..(at + 5).min(fast.len())),
            reference.get(at..(at + 5).min(reference.len())),
            text.chars().take(200).collect::<String>()
        );
    }
}

#[test]
fn deepseek_v3_loads_the_direct_encoder() {
    assert!(tokenizer().uses_fast_encoder(), "the self-check at load must pass for DeepSeek-V3");
    assert!(tokenizer().encodes_by_paragraph(), "and the long self-check, for paragraphs");
    let mut off = ChatTokenizer::from_dir(&model_dir()).unwrap();
    off.set_fast_encoder(false);
    assert!(!off.uses_fast_encoder());
    off.set_fast_encoder(true);
    assert!(off.uses_fast_encoder());
}

#[test]
fn real_prompts_and_the_self_check_text() {
    same(kvgate_tokenize::SELF_CHECK);
    let shared = std::env::var_os("KVGATE_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared"));
    let v: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(shared.join("vectors/block-hash/vllm-sha256-cbor.json")).unwrap(),
    )
    .unwrap();
    let mut n = 0;
    for case in v["real_inst1"].as_array().unwrap() {
        same(case["request"]["rendered_prompt"].as_str().unwrap());
        n += 1;
    }
    assert_eq!(n, 3);
}

#[test]
fn this_repositorys_text_files() {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if p.is_dir() {
                if !name.starts_with('.') && name != "target" && name != "node_modules" {
                    walk(&p, out);
                }
            } else if ["rs", "md", "yaml", "toml", "jinja", "proto", "sh", "html"]
                .iter()
                .any(|x| name.ends_with(&format!(".{x}")))
            {
                out.push(p);
            }
        }
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files = Vec::new();
    for d in ["control-plane", "filter", "docs", "envoy", "deploy", "bench/loadgen", "scripts"] {
        walk(&root.join(d), &mut files);
    }
    assert!(files.len() > 100, "{} files", files.len());
    for f in &files {
        if let Ok(text) = std::fs::read_to_string(f) {
            same(&text);
        }
    }
}

#[test]
fn every_added_token_alone_and_inside_text() {
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model_dir().join("tokenizer.json")).unwrap()).unwrap();
    let added: Vec<String> =
        json["added_tokens"].as_array().unwrap().iter().map(|t| t["content"].as_str().unwrap().to_owned()).collect();
    assert!(added.len() > 1000);
    for t in &added {
        same(t);
        same(&format!("x{t}y {t}\n{t}{t} 12{t}"));
        // A token cut short is ordinary text.
        let cut: String = t.chars().take(t.chars().count().saturating_sub(1)).collect();
        same(&format!("a{cut} b"));
    }
}

/// Pieces generated text is made of.
fn piece() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => "[a-zA-Z]{1,12}",
        2 => "[ ]{1,4}",
        1 => "[ \t\r\n]{1,6}",
        1 => "[0-9]{1,9}",
        1 => r#"[!-/:-@\[-`{-~]{1,4}"#,
        1 => "[\u{4e00}-\u{9fa5}]{1,6}",
        1 => "[\u{3040}-\u{30ff}]{1,6}",
        1 => "[\u{ac00}-\u{d7a3}]{1,4}",
        1 => "[\u{0400}-\u{04ff}]{1,8}",
        1 => "[a-z]\u{0301}[a-z]{0,3}",
        1 => "[\u{1f300}-\u{1f6ff}]{1,3}",
        1 => "[\u{a0}\u{2000}-\u{200b}\u{3000}\u{ff01}-\u{ff5e}]{1,3}",
        1 => Just("<｜User｜>".to_owned()),
        1 => Just("<｜Assistant｜>".to_owned()),
        1 => Just("<｜end▁of▁sentence｜>".to_owned()),
        1 => Just("<｜tool▁call▁begin｜>".to_owned()),
        1 => Just("<｜User".to_owned()),
        1 => any::<char>().prop_map(String::from),
    ]
}

/// Long texts are encoded by cached paragraphs for DeepSeek-V3, and the
/// ids are the whole text's: the first time, from the cache, and for a
/// document followed by different questions (the case the cache is for).
#[test]
fn long_texts_go_by_paragraphs_with_the_same_ids() {
    assert!(fast().paragraphs(), "DeepSeek-V3's split regexes are the ones paragraph cuts are exact for");
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let doc = std::fs::read_to_string(root.join("docs/DECISIONS.md")).unwrap();
    assert!(doc.len() > 4 * kvgate_tokenize::fast::PARA_MIN_TEXT);
    let cuts: Vec<usize> = kvgate_tokenize::fast::paragraph_cuts(&doc).collect();
    assert!(cuts.len() > 10, "{} cuts", cuts.len());
    for q in ["\n\nWhat does this decide about NATS?", "\n\nSummarize the benchmark section.", " and 42 more"] {
        let text = format!("{doc}{q}");
        for _ in 0..2 {
            same(&text);
            assert_eq!(fast().encode(&text), fast().encode_whole(&text));
        }
    }
    let mut off = FastBpe::from_json(&std::fs::read_to_string(model_dir().join("tokenizer.json")).unwrap()).unwrap();
    off.set_paragraphs(false);
    assert!(!off.paragraphs());
    assert_eq!(off.encode(&doc), fast().encode(&doc));
}

/// Plain ASCII is split without the regex engine for DeepSeek-V3, line by
/// line in text that mixes in other characters, with the regex engine's
/// ids (the library's: every `same` above runs this path too).
#[test]
fn plain_ascii_splits_without_the_regex_engine_with_the_same_ids() {
    assert!(fast().ascii_splits(), "DeepSeek-V3's split regexes are the ones the ASCII scanner reproduces");
    let mut off = FastBpe::from_json(&std::fs::read_to_string(model_dir().join("tokenizer.json")).unwrap()).unwrap();
    off.set_ascii_splits(false);
    assert!(!off.ascii_splits());
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let doc = std::fs::read_to_string(root.join("docs/DECISIONS.md")).unwrap();
    assert!(!doc.is_ascii(), "a text that mixes in other characters");
    let ascii: String = doc.chars().filter(char::is_ascii).collect();
    for text in [
        doc.as_str(),
        ascii.as_str(),
        "tabs	and
breaks  

  x",
        "caf\u{e9} 123456 \n done",
    ] {
        assert_eq!(fast().encode_whole(text), off.encode_whole(text), "{:?}", &text[..text.len().min(80)]);
        same(text);
    }
}

/// A paragraph of generated text: pieces, then a line break.
fn paragraph() -> impl Strategy<Value = String> {
    (
        proptest::collection::vec(piece(), 1..30),
        prop_oneof![Just("\n"), Just("\n\n"), Just(" \n"), Just(".\n"), Just("\r\n"), Just("\n ")],
    )
        .prop_map(|(p, end)| format!("{}{end}", p.concat()))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Long generated texts of many short paragraphs (every line break
    /// followed by whatever comes next): paragraph encoding gives the
    /// library's ids.
    #[test]
    fn long_generated_texts_by_paragraphs(paras in proptest::collection::vec(paragraph(), 20..120), tail in piece()) {
        let mut text = paras.concat();
        while text.len() < kvgate_tokenize::fast::PARA_MIN_TEXT {
            text = format!("{text}{text}");
        }
        text.push_str(&tail);
        same(&text);
        prop_assert_eq!(fast().encode(&text), fast().encode_whole(&text));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1500, ..ProptestConfig::default() })]

    #[test]
    fn generated_text(pieces in proptest::collection::vec(piece(), 0..40)) {
        same(&pieces.concat());
    }

    #[test]
    fn arbitrary_strings(s in any::<String>()) {
        same(&s);
    }

    #[test]
    fn long_runs(c in prop_oneof![Just(' '), Just('\n'), Just('a'), Just('1'), Just('!'), Just('中')], n in 1usize..3000) {
        same(&std::iter::repeat_n(c, n).collect::<String>());
    }
}
