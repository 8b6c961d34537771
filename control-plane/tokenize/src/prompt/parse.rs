//! The request's parts as the template needs them: the context (tools,
//! flags) and the messages.

use serde_json::{Map, Value};

use super::{PromptError, SegmentRef};

pub(super) struct Context {
    pub(super) extra: Map<String, Value>,
    pub(super) add_generation_prompt: bool,
    pub(super) cacheable: bool,
}

pub(super) fn parse_context(json: &[u8]) -> Result<Context, PromptError> {
    let mut ctx = Context { extra: Map::new(), add_generation_prompt: true, cacheable: true };
    if json.is_empty() {
        return Ok(ctx);
    }
    let v: Value = serde_json::from_slice(json).map_err(|e| PromptError::Context(e.to_string()))?;
    let Value::Object(map) = v else { return Err(PromptError::Context("not an object".into())) };
    for (k, v) in map {
        match k.as_str() {
            "add_generation_prompt" => ctx.add_generation_prompt = v.as_bool().unwrap_or(true),
            // Continuing the last message renders it unterminated: not a
            // prefix of anything cached; tokenize whole.
            "continue_final_message" => {
                if v.as_bool() == Some(true) {
                    ctx.cacheable = false;
                    ctx.add_generation_prompt = false;
                }
            }
            "chat_template_kwargs" => {
                if let Value::Object(kw) = v {
                    ctx.extra.extend(kw);
                }
            }
            // A per-request template is refused by vLLM unless
            // --trust-request-chat-template; kvgate renders the model's.
            "chat_template" => {}
            _ => {
                ctx.extra.insert(k, v);
            }
        }
    }
    Ok(ctx)
}

pub(super) fn parse_messages(segments: &[SegmentRef<'_>]) -> Result<Vec<Value>, PromptError> {
    segments
        .iter()
        .enumerate()
        .map(|(index, s)| match serde_json::from_slice::<Value>(s.message_json) {
            Ok(v @ Value::Object(_)) => Ok(v),
            Ok(_) => Err(PromptError::Message { index, reason: "not an object".into() }),
            Err(e) => Err(PromptError::Message { index, reason: e.to_string() }),
        })
        .collect()
}

/// What a cached message renders as in a stand-in render: its role, no
/// content.
pub(super) fn stand_in(m: &Value) -> Value {
    let mut o = Map::new();
    o.insert("role".into(), m.get("role").cloned().unwrap_or(Value::Null));
    o.insert("content".into(), Value::String(String::new()));
    Value::Object(o)
}
