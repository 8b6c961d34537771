//! One request's answer: submitted to the engine task, then either one
//! JSON body or SSE chunks as vLLM streams them (the first token at once,
//! later ones `stream_interval` at a time, usage last when asked for).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::kv_transfer::{Leg, prefill_answer};
use super::{Delta, Shared, Submit, error, word};
use crate::engine::Request;

pub(super) struct Parsed {
    pub(super) prompt: Vec<u32>,
    pub(super) max_tokens: usize,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    /// The data-parallel rank the request names (`x-data-parallel-rank`).
    pub(super) rank: Option<usize>,
    /// Its part in a disaggregated request (`kv_transfer_params`).
    pub(super) leg: Leg,
}

/// What every chunk of one answer repeats.
#[derive(Clone)]
struct Answer {
    id: u64,
    rid: String,
    model: String,
    created: u64,
    prompt_tokens: usize,
    chat: bool,
    /// `kv_transfer_params` of the answer (a prefill leg's), else null.
    kv_transfer: Value,
}

impl Answer {
    fn usage(&self, completion: usize, cached: usize) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        })
    }

    fn object(&self) -> &'static str {
        if self.chat { "chat.completion.chunk" } else { "text_completion" }
    }

    fn chunk(&self, choice: Value) -> axum::body::Bytes {
        let c = json!({"id": self.rid, "object": self.object(), "created": self.created, "model": self.model, "choices": [choice]});
        format!("data: {c}\n\n").into()
    }

    fn content(&self, text: &str) -> Value {
        if self.chat {
            json!({"index": 0, "delta": {"content": text}, "logprobs": null, "finish_reason": null})
        } else {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": null, "stop_reason": null})
        }
    }

    fn last(&self) -> Value {
        if self.chat {
            json!({"index": 0, "delta": {"content": ""}, "logprobs": null, "finish_reason": "length", "stop_reason": null})
        } else {
            json!({"index": 0, "text": "", "logprobs": null, "finish_reason": "length", "stop_reason": null})
        }
    }
}

/// Submits the request and answers it.
pub(super) async fn generate(sh: Arc<Shared>, p: Parsed, chat: bool, arrived: Instant) -> Response {
    let id = sh.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (tx, rx) = mpsc::unbounded_channel();
    let prompt_tokens = p.prompt.len();
    let req = Request { id, prompt: p.prompt, max_tokens: p.max_tokens };
    // The frontend's share of time to first token (see the timing preset),
    // counted from arrival: it includes the time this worker really spent
    // parsing and tokenizing (else that time, multiplied by the speedup,
    // would count twice). Time to first token and queue time count from
    // arrival too, as vLLM counts them from the request's arrival at its API
    // server.
    let overhead = sh.opts.engine.timing.first_token_overhead_ms() / 1000.0 / sh.opts.speedup.max(1e-3);
    if overhead > 0.0 {
        tokio::time::sleep_until((arrived + Duration::from_secs_f64(overhead)).into()).await;
    }
    let r = sh.choose_rank(p.rank);
    let rank = &sh.ranks[r];
    rank.stats.lock().prompt_tokens += prompt_tokens as u64;
    rank.inflight.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let remote = p.leg == Leg::Decode;
    if rank.submit.send(Submit { req, tx, at: arrived, remote, received: false }).is_err() {
        rank.inflight.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        return error(StatusCode::SERVICE_UNAVAILABLE, "engine stopped");
    }
    let rid = if chat { format!("chatcmpl-{id:032x}") } else { format!("cmpl-{id:032x}") };
    let kv_transfer = match p.leg {
        Leg::Prefill => {
            let engine_id = format!("{}-dp{r}", sh.opts.id);
            prefill_answer(&engine_id, &rid, sh.addr, prompt_tokens, sh.opts.engine.block_size)
        }
        Leg::Whole | Leg::Decode => Value::Null,
    };
    let a = Answer { id, rid, model: sh.opts.model.clone(), created: sh.created, prompt_tokens, chat, kv_transfer };
    if p.stream {
        let (interval, include_usage) = (sh.opts.stream_interval.max(1), p.include_usage);
        stream(a, rx, interval, include_usage)
    } else {
        whole(a, rx).await
    }
}

/// The answer as one JSON body.
async fn whole(a: Answer, mut rx: mpsc::UnboundedReceiver<Delta>) -> Response {
    let mut text = String::new();
    let (mut n, mut cached) = (0usize, 0usize);
    while let Some(d) = rx.recv().await {
        match d {
            Delta::Token { index, cached: c } => {
                text.push_str(word(a.id, index));
                n += 1;
                cached = c;
            }
            Delta::Done => break,
        }
    }
    let choice = if a.chat {
        json!({"index": 0, "message": {"role": "assistant", "content": text, "refusal": null, "annotations": null, "audio": null, "function_call": null, "tool_calls": [], "reasoning_content": null}, "logprobs": null, "finish_reason": "length", "stop_reason": null})
    } else {
        json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "length", "stop_reason": null, "prompt_logprobs": null})
    };
    let body = json!({
        "id": a.rid,
        "object": if a.chat { "chat.completion" } else { "text_completion" },
        "created": a.created,
        "model": a.model,
        "choices": [choice],
        "usage": a.usage(n, cached),
        "prompt_logprobs": null,
        "kv_transfer_params": a.kv_transfer,
    });
    ([(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

/// The answer as SSE chunks.
fn stream(a: Answer, rx: mpsc::UnboundedReceiver<Delta>, interval: usize, include_usage: bool) -> Response {
    let (out_tx, out_rx) = mpsc::channel::<axum::body::Bytes>(64);
    tokio::spawn(write_chunks(a, rx, out_tx, interval, include_usage));
    let stream = futures_util::stream::unfold(out_rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "stream"))
}

/// Writes the chunks until the engine is done or the client is gone (a
/// closed body drops `rx`: the engine aborts the request).
async fn write_chunks(
    a: Answer,
    mut rx: mpsc::UnboundedReceiver<Delta>,
    out: mpsc::Sender<axum::body::Bytes>,
    interval: usize,
    include_usage: bool,
) {
    // vLLM sends the role chunk in the first iteration over the engine's
    // outputs, i.e. with the first token, not before it: the gateway's time
    // to first byte is the time to first token.
    let mut role_sent = !a.chat;
    let (mut n, mut cached, mut pending, mut text) = (0usize, 0usize, 0usize, String::new());
    loop {
        let delta = rx.recv().await;
        if !role_sent {
            role_sent = true;
            let first = json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null});
            if out.send(a.chunk(first)).await.is_err() {
                return;
            }
        }
        let done = match delta {
            Some(Delta::Token { index, cached: c }) => {
                n += 1;
                cached = c;
                text.push_str(word(a.id, index));
                pending += 1;
                false
            }
            Some(Delta::Done) | None => true,
        };
        // As vLLM's `--stream-interval`: the first token goes out at once,
        // later ones in chunks of `interval` tokens (and the rest at the end).
        if pending > 0 && (done || n == 1 || pending >= interval) {
            if out.send(a.chunk(a.content(&text))).await.is_err() {
                return;
            }
            text.clear();
            pending = 0;
        }
        if done {
            break;
        }
    }
    let _ = out.send(a.chunk(a.last())).await;
    if include_usage {
        let u = json!({"id": a.rid, "object": a.object(), "created": a.created, "model": a.model, "choices": [], "usage": a.usage(n, cached)});
        let _ = out.send(format!("data: {u}\n\n").into()).await;
    }
    let _ = out.send("data: [DONE]\n\n".into()).await;
}
