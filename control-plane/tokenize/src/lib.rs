//! # kvgate-tokenize
//!
//! Turns an OpenAI chat request into the token ids vLLM computes for it: the
//! model's chat template rendered with minijinja, then the model's tokenizer
//! (`tokenizers`, from a local `tokenizer.json`; no model hub anywhere) with
//! `add_special_tokens = false`, as vLLM does for chat prompts (the
//! template writes the BOS token itself).
//!
//! A model directory holds `tokenizer.json`, `chat_template.jinja` and
//! `tokenizer_config.json` (for `bos_token` / `eos_token`), as vLLM and
//! Hugging Face lay them out.
//!
//! Cost: rendering is O(prompt text); encoding is the tokenizer's BPE,
//! roughly O(text) with a large constant (measured by the control plane's
//! benchmark).
#![warn(missing_docs)]

pub mod added;
pub mod ascii_split;
pub mod fast;
pub mod prompt;

use std::path::Path;

use serde_json::Value;

/// Why a model could not be loaded or a prompt tokenized.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// A file of the model directory could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// `tokenizer.json` did not load.
    #[error("loading tokenizer {path}: {reason}")]
    Tokenizer {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// The chat template did not compile or render.
    #[error("chat template: {0}")]
    Template(String),
    /// Encoding failed.
    #[error("encoding: {0}")]
    Encode(String),
}

/// A model's tokenizer and chat template.
pub struct ChatTokenizer {
    tokenizer: tokenizers::Tokenizer,
    env: minijinja::Environment<'static>,
    bos_token: String,
    eos_token: String,
    add_bos_token: bool,
    /// Contents of the added (special) tokens: the tokenizer splits them
    /// out before BPE, so no merge crosses them.
    added: added::AddedTokens,
    /// The direct encoder, when the tokenizer has a shape it reproduces and
    /// it agreed with `tokenizer` on [`SELF_CHECK`] at load.
    fast: Option<fast::FastBpe>,
}

/// Text both encoders must agree on before the direct one is used: Latin,
/// CJK, kana, digits, punctuation runs, emoji, whitespace runs and line
/// ends, and a DeepSeek-style special token.
pub const SELF_CHECK: &str = "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hello, world!  \
    It's 2026-11-24T03:15:00Z; pi≈3.14159 and 1234567 items... \"quoted\" (parens) [brackets] {braces}\n\n\
    \t\tIndented\r\nWindows line\u{a0}nbsp 你好，世界！こんにちは カタカナ 한국어 Привет мир 🙂👍🏽 café naïve \
    ＡＢＣ１２３    trailing   \n<｜Assistant｜>";

impl std::fmt::Debug for ChatTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTokenizer").field("bos_token", &self.bos_token).field("eos_token", &self.eos_token).finish()
    }
}

fn special(config: &Value, key: &str) -> String {
    match config.get(key) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).unwrap_or_default().to_owned(),
        _ => String::new(),
    }
}

/// The direct encoder for `tokenizer`, if its shape is one the encoder
/// reproduces and both agree on [`SELF_CHECK`].
/// Paragraph encoding (`fast` step 4) stays on only if it also agrees on a
/// long text of [`SELF_CHECK`] paragraphs.
fn load_fast(tokenizer: &tokenizers::Tokenizer) -> Option<fast::FastBpe> {
    let mut f = fast::FastBpe::from_json(&tokenizer.to_string(false).ok()?)?;
    let reference = tokenizer.encode_fast(SELF_CHECK, false).ok()?;
    if reference.get_ids() != f.encode(SELF_CHECK).as_slice() {
        return None;
    }
    if f.paragraphs() {
        let mut long = String::new();
        let mut i = 0u32;
        while long.len() < 3 * fast::PARA_MIN_TEXT {
            i += 1;
            long.push_str(SELF_CHECK);
            long.push_str(if i.is_multiple_of(2) { "\nNext " } else { ".\n\nParagraph " });
        }
        let agrees = tokenizer.encode_fast(long.as_str(), false).ok().is_some_and(|r| r.get_ids() == f.encode(&long));
        if !agrees {
            f.set_paragraphs(false);
        }
    }
    Some(f)
}

fn read(path: &Path) -> Result<String, TokenizeError> {
    std::fs::read_to_string(path).map_err(|source| TokenizeError::Io { path: path.display().to_string(), source })
}

impl ChatTokenizer {
    /// Loads `tokenizer.json`, `chat_template.jinja` and (if present)
    /// `tokenizer_config.json` from `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizeError> {
        let tk_path = dir.join("tokenizer.json");
        let tokenizer = tokenizers::Tokenizer::from_file(&tk_path)
            .map_err(|e| TokenizeError::Tokenizer { path: tk_path.display().to_string(), reason: e.to_string() })?;
        let template = read(&dir.join("chat_template.jinja"))?;
        let config: Value = match std::fs::read_to_string(dir.join("tokenizer_config.json")) {
            Ok(text) => serde_json::from_str(&text).unwrap_or(Value::Null),
            Err(_) => Value::Null,
        };
        let mut this = Self::new(tokenizer, template, special(&config, "bos_token"), special(&config, "eos_token"))?;
        this.add_bos_token = config.get("add_bos_token").and_then(Value::as_bool).unwrap_or(false);
        Ok(this)
    }

    /// From parts.
    pub fn new(
        tokenizer: tokenizers::Tokenizer,
        template: String,
        bos_token: String,
        eos_token: String,
    ) -> Result<Self, TokenizeError> {
        let mut env = minijinja::Environment::new();
        env.add_template_owned("chat", template).map_err(|e| TokenizeError::Template(e.to_string()))?;
        let added = added::AddedTokens::new(
            tokenizer
                .get_added_tokens_decoder()
                .values()
                .filter(|t| !t.lstrip && !t.rstrip)
                .map(|t| t.content.as_str()),
        );
        let fast = load_fast(&tokenizer);
        Ok(Self { tokenizer, env, bos_token, eos_token, add_bos_token: false, added, fast })
    }

    /// Whether [`Self::encode`] uses the direct encoder ([`fast`]) rather
    /// than the `tokenizers` library (same ids, several times faster).
    pub fn uses_fast_encoder(&self) -> bool {
        self.fast.is_some()
    }

    /// Whether long texts are encoded by cached paragraphs (the direct
    /// encoder's step 4, on for tokenizers where it is exact).
    pub fn encodes_by_paragraph(&self) -> bool {
        self.fast.as_ref().is_some_and(fast::FastBpe::paragraphs)
    }

    /// Turns the direct encoder off (or back on, when it loaded): for
    /// comparisons and as an operator's escape hatch.
    pub fn set_fast_encoder(&mut self, on: bool) {
        if !on {
            self.fast = None;
        } else if self.fast.is_none() {
            self.fast = load_fast(&self.tokenizer);
        }
    }

    /// Token ids of `text` from the `tokenizers` library, whatever
    /// [`Self::encode`] uses (the reference for differential tests).
    pub fn encode_reference(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        let enc = self.tokenizer.encode_fast(text, false).map_err(|e| TokenizeError::Encode(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The chat template applied to `messages` (JSON message objects), with
    /// extra template variables (`tools`, `chat_template_kwargs` entries, ...).
    pub fn render<M: serde::Serialize>(
        &self,
        messages: &[M],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, Value>,
    ) -> Result<String, TokenizeError> {
        self.render_with(&self.render_context(messages, extra), add_generation_prompt, 0)
    }

    /// The template context of `messages` (and the request's extra template
    /// fields), converted once: renders of the same conversation with and
    /// without the generation prompt share it ([`Self::render_with`]).
    /// Borrows the messages: nothing is cloned before the one conversion.
    /// `M` is a message (`Value`, `&Value`, ...): cached parsed messages are
    /// rendered by reference.
    pub fn render_context<M: serde::Serialize>(
        &self,
        messages: &[M],
        extra: &serde_json::Map<String, Value>,
    ) -> minijinja::Value {
        #[derive(serde::Serialize)]
        struct Ctx<'a, M> {
            // First, so that the fields below win over a same-named key.
            #[serde(flatten)]
            extra: &'a serde_json::Map<String, Value>,
            messages: &'a [M],
            bos_token: &'a str,
            eos_token: &'a str,
        }
        minijinja::Value::from_serialize(&Ctx {
            extra,
            messages,
            bos_token: &self.bos_token,
            eos_token: &self.eos_token,
        })
    }

    /// Renders a context from [`Self::render_context`] into a buffer of
    /// `size_hint` bytes (the expected length: a 100K-token prompt rendered
    /// into a growing string spends as long copying as rendering).
    pub fn render_with(
        &self,
        context: &minijinja::Value,
        add_generation_prompt: bool,
        size_hint: usize,
    ) -> Result<String, TokenizeError> {
        let tmpl = self.env.get_template("chat").map_err(|e| TokenizeError::Template(e.to_string()))?;
        let mut out = Vec::with_capacity(size_hint);
        tmpl.render_captured_to(
            minijinja::context! { add_generation_prompt => add_generation_prompt, ..context.clone() },
            &mut out,
        )
        .map_err(|e| TokenizeError::Template(e.to_string()))?;
        String::from_utf8(out).map_err(|e| TokenizeError::Template(e.to_string()))
    }

    /// Token ids of `text`, without adding special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        if let Some(f) = &self.fast {
            return Ok(f.encode(text));
        }
        let enc = self.tokenizer.encode_fast(text, false).map_err(|e| TokenizeError::Encode(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of `text` with the tokenizer's special tokens added (its
    /// post-processor: BOS for most models), as vLLM tokenizes the `prompt`
    /// string of `/v1/completions`.
    /// `tokenizer_config.json`'s `add_bos_token` is honoured when the
    /// post-processor does not add the BOS itself (as transformers does).
    pub fn encode_with_special(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        let enc = self.tokenizer.encode_fast(text, true).map_err(|e| TokenizeError::Encode(e.to_string()))?;
        let mut ids = enc.get_ids().to_vec();
        if self.add_bos_token
            && let Some(bos) = self.tokenizer.token_to_id(&self.bos_token)
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        Ok(ids)
    }

    /// Whether tokenizing `before` and `after` separately gives the ids of
    /// `before + after`, as far as the tokenizer's structure guarantees it:
    /// an added token (split out before any merge) ends `before` or starts
    /// `after`, or one side is empty.
    pub fn boundary_safe(&self, before: &str, after: &str) -> bool {
        before.is_empty() || after.is_empty() || self.added.is_prefix_of(after) || self.added.is_suffix_of(before)
    }

    /// Whether `text` ends with an added token (one side of
    /// [`Self::boundary_safe`]).
    pub fn ends_with_added(&self, text: &str) -> bool {
        self.added.is_suffix_of(text)
    }

    /// Whether `text` starts with an added token.
    pub fn starts_with_added(&self, text: &str) -> bool {
        self.added.is_prefix_of(text)
    }

    /// Token ids of a chat request, as vLLM computes them.
    pub fn encode_chat(&self, messages: &[Value], add_generation_prompt: bool) -> Result<Vec<u32>, TokenizeError> {
        self.encode(&self.render(messages, add_generation_prompt, &serde_json::Map::new())?)
    }

    /// The text of token ids (for the simulator's output).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        self.tokenizer.decode(ids, true).map_err(|e| TokenizeError::Encode(e.to_string()))
    }
}
