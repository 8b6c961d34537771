//! The OpenAI handlers (parse, tokenize with the shared prompt
//! tokenizer, validate as vLLM does) and the simulator's own endpoints.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use kvgate_tokenize::prompt::{SegmentRef, chain_hashes};
use serde_json::{Value, json};

use super::generate::{Parsed, generate};
use super::{Shared, StreamFault, error};

/// Tokenization off the async scheduler's hands on a multi-thread runtime
/// (inline on a current-thread one, where `block_in_place` is not allowed).
fn heavy<T>(f: impl FnOnce() -> T) -> T {
    if tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
    {
        tokio::task::block_in_place(f)
    } else {
        f()
    }
}

/// vLLM's `X-data-parallel-rank`: a number names the rank (one outside the
/// server's ranks is refused with a 400); anything else is ignored.
fn named_rank(sh: &Shared, headers: &HeaderMap) -> Result<Option<usize>, Box<Response>> {
    let Some(r) =
        headers.get(kvgate_protocol::DP_RANK_HEADER).and_then(|v| v.to_str().ok()?.trim().parse::<i64>().ok())
    else {
        return Ok(None);
    };
    let n = sh.ranks.len();
    match usize::try_from(r) {
        Ok(r) if r < n => Ok(Some(r)),
        _ => Err(Box::new(error(StatusCode::BAD_REQUEST, format!("data_parallel_rank {r} is out of range [0, {n}).")))),
    }
}

fn common(sh: &Shared, headers: &HeaderMap, body: &Value, prompt: Vec<u32>) -> Result<Parsed, Box<Response>> {
    let rank = named_rank(sh, headers)?;
    let model = body.get("model").and_then(Value::as_str).unwrap_or_default();
    if model != sh.opts.model {
        return Err(Box::new(error(StatusCode::NOT_FOUND, format!("The model `{model}` does not exist."))));
    }
    let max_tokens = match body.get("max_completion_tokens").or_else(|| body.get("max_tokens")) {
        None | Some(Value::Null) => sh.opts.default_max_tokens,
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => n as usize,
            _ => return Err(Box::new(error(StatusCode::BAD_REQUEST, "max_tokens must be an integer ≥ 1"))),
        },
    };
    if prompt.len() + max_tokens > sh.opts.max_model_len {
        return Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            format!(
                "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the messages, {} in the completion).",
                sh.opts.max_model_len,
                prompt.len() + max_tokens,
                prompt.len(),
                max_tokens
            ),
        )));
    }
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = body.pointer("/stream_options/include_usage").and_then(Value::as_bool).unwrap_or(false);
    let leg = super::kv_transfer::leg(body, prompt.len(), sh.opts.engine.block_size)?;
    Ok(Parsed { prompt, max_tokens, stream, include_usage, rank, leg })
}

pub(super) async fn chat(State(sh): State<Arc<Shared>>, headers: HeaderMap, body: axum::body::Bytes) -> Response {
    let arrived = Instant::now();
    let Ok(body) = serde_json::from_slice::<Value>(&body) else {
        return error(StatusCode::BAD_REQUEST, "request body is not valid JSON");
    };
    let Some(messages) = body.get("messages").and_then(Value::as_array).filter(|m| !m.is_empty()) else {
        return error(StatusCode::BAD_REQUEST, "messages must be a non-empty array");
    };
    let bytes: Vec<Vec<u8>> = messages.iter().map(|m| serde_json::to_vec(m).unwrap_or_default()).collect();
    let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    let mut ctx = serde_json::Map::new();
    for k in ["tools", "documents", "chat_template_kwargs", "add_generation_prompt", "continue_final_message"] {
        if let Some(v) = body.get(k) {
            ctx.insert(k.into(), v.clone());
        }
    }
    let ctx = if ctx.is_empty() { Vec::new() } else { serde_json::to_vec(&ctx).unwrap_or_default() };
    let hashes = chain_hashes(&ctx, &refs);
    let segs: Vec<SegmentRef<'_>> =
        bytes.iter().zip(&hashes).map(|(b, h)| SegmentRef { chain_hash: *h, message_json: b, elided: false }).collect();
    let tk = sh.opts.tokenizer.clone();
    let prompt = match heavy(|| tk.chat(&ctx, &segs)) {
        Ok(t) => t.ids,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string()),
    };
    match common(&sh, &headers, &body, prompt) {
        Ok(p) => generate(sh, p, true, arrived).await,
        Err(r) => *r,
    }
}

pub(super) async fn completions(
    State(sh): State<Arc<Shared>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let arrived = Instant::now();
    let Ok(body) = serde_json::from_slice::<Value>(&body) else {
        return error(StatusCode::BAD_REQUEST, "request body is not valid JSON");
    };
    let prompt = match body.get("prompt") {
        Some(Value::String(s)) => match sh.opts.tokenizer.completion(s) {
            Ok(t) => t.ids,
            Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string()),
        },
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_u64) => {
            a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect()
        }
        _ => return error(StatusCode::BAD_REQUEST, "prompt must be a string or an array of token ids"),
    };
    match common(&sh, &headers, &body, prompt) {
        Ok(p) => generate(sh, p, false, arrived).await,
        Err(r) => *r,
    }
}

pub(super) async fn models(State(sh): State<Arc<Shared>>) -> impl IntoResponse {
    let m = &sh.opts.model;
    let body = json!({
        "object": "list",
        "data": [{
            "id": m, "object": "model", "created": sh.created, "owned_by": "vllm", "root": m, "parent": null,
            "max_model_len": sh.opts.max_model_len,
            "permission": [{"id": "modelperm-kvgate-sim", "object": "model_permission", "created": sh.created,
                "allow_create_engine": false, "allow_sampling": true, "allow_logprobs": true,
                "allow_search_indices": false, "allow_view": true, "allow_fine_tuning": false,
                "organization": "*", "group": null, "is_blocking": false}],
        }],
    });
    ([(header::CONTENT_TYPE, "application/json")], body.to_string())
}

/// Simulator-only: the engine's cache, for tests that compare it with what
/// the KV events describe.
/// `POST /kvgate/sim/fault?kind=duplicate|garbage|gap`: the next published
/// batch carries that event-stream fault.
pub(super) async fn inject_fault(
    State(sh): State<Arc<Shared>>,
    axum::extract::Query(q): axum::extract::Query<HashMap<String, String>>,
) -> impl IntoResponse {
    match q.get("kind").and_then(|k| StreamFault::parse(k)) {
        Some(f) => {
            sh.faults.lock().push(f);
            (StatusCode::OK, "queued\n")
        }
        None => (StatusCode::BAD_REQUEST, "expected ?kind=duplicate|garbage|gap\n"),
    }
}

/// `POST /kvgate/sim/slowdown?factor=F`: every later step takes `F` times
/// its preset's time (F > 0; 1 restores it).
pub(super) async fn set_slowdown(
    State(sh): State<Arc<Shared>>,
    axum::extract::Query(q): axum::extract::Query<HashMap<String, String>>,
) -> impl IntoResponse {
    match q.get("factor").and_then(|f| f.parse::<f64>().ok()).filter(|f| f.is_finite() && *f > 0.0) {
        Some(f) => {
            sh.slowdown.store(f.to_bits(), std::sync::atomic::Ordering::Relaxed);
            (StatusCode::OK, "set\n")
        }
        None => (StatusCode::BAD_REQUEST, "expected ?factor=F with F a number > 0\n"),
    }
}

pub(super) async fn cache_info(State(sh): State<Arc<Shared>>) -> impl IntoResponse {
    let ranks: Vec<super::metrics::Stats> = sh.ranks.iter().map(|r| r.stats.lock().clone()).collect();
    let n = ranks.len().max(1);
    let capacity = sh.opts.engine.num_blocks;
    let per_rank: Vec<Value> = ranks
        .iter()
        .map(|st| json!({"cached_blocks": st.cached_blocks, "capacity_blocks": capacity, "kv_usage": st.kv_usage}))
        .collect();
    // The whole server: sums over its ranks (one rank: that rank).
    let body = json!({
        "cached_blocks": ranks.iter().map(|s| s.cached_blocks).sum::<usize>(),
        "capacity_blocks": capacity * n,
        "kv_usage": ranks.iter().map(|s| s.kv_usage).sum::<f64>() / n as f64,
        "slowdown": f64::from_bits(sh.slowdown.load(std::sync::atomic::Ordering::Relaxed)),
        "steps": ranks.iter().map(|s| s.steps).sum::<u64>(),
        "event_batches": ranks.iter().map(|s| s.events_published).sum::<u64>(),
        "ranks": per_rank,
    });
    ([(header::CONTENT_TYPE, "application/json")], body.to_string())
}
