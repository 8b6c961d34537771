//! Borrowed extraction of the fields kvgate routes by, from an OpenAI request
//! body: `model`, `messages` (each message's exact bytes and role) or
//! `prompt`, `stream`, `max_tokens` / `max_completion_tokens`, `cache_salt`,
//! and the request-level fields that reach the chat template.
//!
//! One pass over the body (plus the UTF-8 check); nothing is copied except
//! strings that contain escapes and the small template-context object.
//! Duplicate keys: the last one wins (as Python's `json` does, which vLLM
//! uses).

use std::borrow::Cow;

use crate::json::{JsonError, Kind, Raw, Scanner, key_is};

/// Which OpenAI endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message<'a> {
    /// The message object's bytes, exactly as in the body.
    pub json: &'a [u8],
    /// Its `role` ("" when absent or not a string).
    pub role: Cow<'a, str>,
}

/// The prompt of a `/v1/completions` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt<'a> {
    /// A string (or an array of exactly one string).
    Text(Cow<'a, str>),
    /// An array of token ids (or an array of exactly one such array).
    Tokens(Vec<u32>),
}

/// Fields of the request that reach the chat template besides `messages`,
/// in the order the control plane expects none in particular (it parses the
/// object).
pub const TEMPLATE_CONTEXT_KEYS: [&str; 6] =
    ["tools", "documents", "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message"];

/// What the filter routes by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extracted<'a> {
    /// `model`.
    pub model: Cow<'a, str>,
    /// Chat messages (chat API).
    pub messages: Vec<Message<'a>>,
    /// The prompt (completions API).
    pub prompt: Option<Prompt<'a>>,
    /// `stream`.
    pub stream: bool,
    /// `max_completion_tokens`, else `max_tokens`.
    pub max_tokens: Option<u32>,
    /// `cache_salt` ("" when absent).
    pub cache_salt: Cow<'a, str>,
    /// `{"tools": ..., ...}` built from the body's template fields (empty
    /// when it has none; `null` values are left out).
    pub template_context: Vec<u8>,
}

/// Why a body cannot be routed by its prefix. Each is a fallback cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtractError {
    /// Not JSON.
    Json(JsonError),
    /// JSON, but not an object, or a routing field has the wrong type.
    Shape(&'static str),
    /// A valid request kvgate does not route by prefix (e.g. a batch of
    /// several prompts).
    Unsupported(&'static str),
}

impl std::fmt::Display for ExtractError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExtractError::Json(e) => e.fmt(f),
            ExtractError::Shape(what) => write!(f, "request shape: {what}"),
            ExtractError::Unsupported(what) => write!(f, "not routed by prefix: {what}"),
        }
    }
}

impl std::error::Error for ExtractError {}

impl From<JsonError> for ExtractError {
    fn from(e: JsonError) -> Self {
        ExtractError::Json(e)
    }
}

fn opt_u32(v: &Raw<'_>, field: &'static str) -> Result<Option<u32>, ExtractError> {
    if v.is_null() {
        return Ok(None);
    }
    v.u64().and_then(|n| u32::try_from(n).ok()).map(Some).ok_or(ExtractError::Shape(field))
}

/// Extracts the routing fields of a request body for `api`.
///
/// One validating pass over the body: top-level members are scanned once,
/// and `messages` is walked (not skipped and re-read), so each byte of a
/// long conversation is looked at once.
pub fn extract(body: &[u8], api: Api) -> Result<Extracted<'_>, ExtractError> {
    let mut s = Scanner::new(body);
    if s.peek_value() != Some(b'{') {
        // Tell "not JSON" from "JSON, but not an object".
        return match Scanner::document(body) {
            Ok(_) => Err(ExtractError::Shape("body is not a JSON object")),
            Err(e) => Err(ExtractError::Json(e)),
        };
    }
    let mut model = None;
    let mut messages: Option<Result<Vec<Message<'_>>, &'static str>> = None;
    let mut prompt = None;
    let mut stream = None;
    let mut max_tokens = None;
    let mut max_completion_tokens = None;
    let mut cache_salt = None;
    let mut context: [Option<Raw<'_>>; 6] = [None; 6];
    s.object(0, |s, k| {
        if key_is(&k, "messages") && api == Api::Chat && s.peek_value() == Some(b'[') {
            let mut list = Vec::new();
            let mut bad = None;
            s.array(1, |s| {
                if s.peek_value() != Some(b'{') {
                    s.value(2)?;
                    bad = Some("a message must be an object");
                    return Ok(());
                }
                let start = s.pos();
                let mut role = None;
                s.object(2, |s, k| {
                    let v = s.value(3)?;
                    if key_is(&k, "role") {
                        role = Some(v);
                    }
                    Ok(())
                })?;
                let json = body.get(start..s.pos()).unwrap_or(&[]);
                let role = role.and_then(|r| r.str()).unwrap_or(Cow::Borrowed(""));
                list.push(Message { json, role });
                Ok(())
            })?;
            messages = Some(match bad {
                Some(b) => Err(b),
                None => Ok(list),
            });
            return Ok(());
        }
        let v = s.value(1)?;
        if key_is(&k, "model") {
            model = Some(v);
        } else if key_is(&k, "messages") {
            messages = Some(Err("messages must be an array"));
        } else if key_is(&k, "prompt") {
            prompt = Some(v);
        } else if key_is(&k, "stream") {
            stream = Some(v);
        } else if key_is(&k, "max_tokens") {
            max_tokens = Some(v);
        } else if key_is(&k, "max_completion_tokens") {
            max_completion_tokens = Some(v);
        } else if key_is(&k, "cache_salt") {
            cache_salt = Some(v);
        } else {
            for (slot, name) in context.iter_mut().zip(TEMPLATE_CONTEXT_KEYS) {
                if key_is(&k, name) {
                    *slot = (!v.is_null()).then_some(v);
                }
            }
        }
        Ok(())
    })?;
    s.end()?;

    let model = model.ok_or(ExtractError::Shape("no model"))?;
    let model = model.str().ok_or(ExtractError::Shape("model must be a string"))?;
    let stream = match stream {
        None => false,
        Some(v) if v.is_null() => false,
        Some(v) => v.bool().ok_or(ExtractError::Shape("stream must be a boolean"))?,
    };
    let max_tokens = match max_tokens {
        Some(v) => opt_u32(&v, "max_tokens must be a non-negative integer")?,
        None => None,
    };
    let max_completion_tokens = match max_completion_tokens {
        Some(v) => opt_u32(&v, "max_completion_tokens must be a non-negative integer")?,
        None => None,
    };
    let cache_salt = match cache_salt {
        Some(v) if !v.is_null() => v.str().ok_or(ExtractError::Shape("cache_salt must be a string"))?,
        _ => Cow::Borrowed(""),
    };
    let mut out = Extracted {
        model,
        messages: Vec::new(),
        prompt: None,
        stream,
        max_tokens: max_completion_tokens.or(max_tokens),
        cache_salt,
        template_context: Vec::new(),
    };
    match api {
        Api::Chat => {
            out.messages = messages.ok_or(ExtractError::Shape("no messages"))?.map_err(ExtractError::Shape)?;
            if out.messages.is_empty() {
                return Err(ExtractError::Shape("messages is empty"));
            }
            let n = context.iter().flatten().map(|v| v.bytes.len() + 32).sum::<usize>();
            if n > 0 {
                let mut ctx = Vec::with_capacity(n + 2);
                ctx.push(b'{');
                for (v, name) in context.iter().zip(TEMPLATE_CONTEXT_KEYS) {
                    if let Some(v) = v {
                        if ctx.len() > 1 {
                            ctx.push(b',');
                        }
                        ctx.push(b'"');
                        ctx.extend_from_slice(name.as_bytes());
                        ctx.extend_from_slice(b"\":");
                        ctx.extend_from_slice(v.bytes);
                    }
                }
                ctx.push(b'}');
                out.template_context = ctx;
            }
        }
        Api::Completions => {
            let p = prompt.ok_or(ExtractError::Shape("no prompt"))?;
            out.prompt = Some(completion_prompt(&p)?);
        }
    }
    Ok(out)
}

fn token_ids(v: &Raw<'_>) -> Result<Option<Vec<u32>>, ExtractError> {
    let mut ids = Vec::with_capacity(v.bytes.len() / 6);
    for el in v.elements()? {
        match el.u64().and_then(|n| u32::try_from(n).ok()) {
            Some(id) => ids.push(id),
            None => return Ok(None),
        }
    }
    Ok(Some(ids))
}

fn completion_prompt<'a>(p: &Raw<'a>) -> Result<Prompt<'a>, ExtractError> {
    match p.kind {
        Kind::String => Ok(Prompt::Text(p.str().ok_or(ExtractError::Shape("prompt is not a valid string"))?)),
        Kind::Array => {
            let mut it = p.elements()?;
            let first = it.next().ok_or(ExtractError::Shape("prompt is empty"))?;
            match first.kind {
                Kind::Number => {
                    token_ids(p)?.map(Prompt::Tokens).ok_or(ExtractError::Shape("prompt token ids must be u32"))
                }
                Kind::String | Kind::Array if it.next().is_some() => {
                    Err(ExtractError::Unsupported("a batch of several prompts"))
                }
                Kind::String => {
                    Ok(Prompt::Text(first.str().ok_or(ExtractError::Shape("prompt is not a valid string"))?))
                }
                Kind::Array => {
                    token_ids(&first)?.map(Prompt::Tokens).ok_or(ExtractError::Shape("prompt token ids must be u32"))
                }
                _ => Err(ExtractError::Shape("prompt must be a string or token ids")),
            }
        }
        _ => Err(ExtractError::Shape("prompt must be a string or token ids")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_request() {
        let body = br#"{"model":"deepseek","stream":true,"max_tokens":12,"max_completion_tokens":34,
            "messages":[{"role":"system","content":"be \"brief\""}, {"content":"hi","role":"user"}],
            "tools":[{"type":"function"}],"add_generation_prompt":true,"documents":null,"cache_salt":"t1"}"#;
        let e = extract(body, Api::Chat).unwrap();
        assert_eq!(e.model, "deepseek");
        assert!(e.stream);
        assert_eq!(e.max_tokens, Some(34));
        assert_eq!(e.cache_salt, "t1");
        assert_eq!(e.messages.len(), 2);
        assert_eq!(e.messages[0].json, br#"{"role":"system","content":"be \"brief\""}"#);
        assert_eq!(e.messages[1].role, "user");
        assert_eq!(e.template_context, br#"{"tools":[{"type":"function"}],"add_generation_prompt":true}"#);
        let ctx: serde_json::Value = serde_json::from_slice(&e.template_context).unwrap();
        assert_eq!(ctx["add_generation_prompt"], true);
    }

    #[test]
    fn completions_prompts() {
        fn p(b: &str) -> Result<Prompt<'static>, ExtractError> {
            let b: &'static str = Box::leak(b.to_owned().into_boxed_str());
            extract(b.as_bytes(), Api::Completions).map(|e| e.prompt.unwrap())
        }
        assert_eq!(p(r#"{"model":"m","prompt":"a\nb"}"#).unwrap(), Prompt::Text("a\nb".into()));
        assert_eq!(p(r#"{"model":"m","prompt":["x"]}"#).unwrap(), Prompt::Text("x".into()));
        assert_eq!(p(r#"{"model":"m","prompt":[1,2,3]}"#).unwrap(), Prompt::Tokens(vec![1, 2, 3]));
        assert_eq!(p(r#"{"model":"m","prompt":[[7,8]]}"#).unwrap(), Prompt::Tokens(vec![7, 8]));
        assert!(matches!(p(r#"{"model":"m","prompt":["a","b"]}"#), Err(ExtractError::Unsupported(_))));
        assert!(matches!(p(r#"{"model":"m","prompt":[1,-2]}"#), Err(ExtractError::Shape(_))));
        assert!(matches!(p(r#"{"model":"m","prompt":[]}"#), Err(ExtractError::Shape(_))));
        assert!(matches!(p(r#"{"model":"m"}"#), Err(ExtractError::Shape(_))));
    }

    #[test]
    fn malformed_and_misshaped() {
        let e = |b: &str| extract(b.as_bytes(), Api::Chat).unwrap_err();
        assert!(matches!(e(r#"{"model":"m","messages":[}"#), ExtractError::Json(_)));
        assert!(matches!(e(r#"[1]"#), ExtractError::Shape(_)));
        assert!(matches!(e(r#"{"messages":[{"role":"user"}]}"#), ExtractError::Shape("no model")));
        assert!(matches!(e(r#"{"model":1,"messages":[]}"#), ExtractError::Shape(_)));
        assert!(matches!(e(r#"{"model":"m","messages":[]}"#), ExtractError::Shape(_)));
        assert!(matches!(e(r#"{"model":"m","messages":["x"]}"#), ExtractError::Shape(_)));
        assert!(matches!(e(r#"{"model":"m","messages":[{}],"stream":"yes"}"#), ExtractError::Shape(_)));
        assert!(matches!(e(r#"{"model":"m","messages":[{}],"max_tokens":-1}"#), ExtractError::Shape(_)));
        // Last duplicate wins; null max_tokens is absent.
        let ok = extract(br#"{"model":"a","model":"b","messages":[{}],"max_tokens":null}"#, Api::Chat).unwrap();
        assert_eq!((ok.model.as_ref(), ok.max_tokens, ok.messages[0].role.as_ref()), ("b", None, ""));
    }
}
