//! Disaggregated serving as vLLM's KV connectors speak it
//! (NixlConnector's `kv_transfer_params`, REFERENCE-RESULTS.md D).
//!
//! - **Prefill leg**: `{"do_remote_decode": true, ...}` — the worker
//!   prefills the prompt as usual (the caller sends `max_tokens` 1) and its
//!   JSON answer carries the parameters the decode side needs:
//!   `do_remote_prefill: true`, `remote_engine_id`, `remote_block_ids`,
//!   `remote_request_id`, `remote_host`, `remote_port`, `tp_size`.
//! - **Decode leg**: `{"do_remote_prefill": true, "remote_engine_id": ...,
//!   "remote_block_ids": [...], ...}` — the worker waits for the prompt's KV
//!   it does not hold (the configured time per token: KV bytes per token over
//!   the link's bandwidth), stores the received blocks in its prefix cache
//!   (with their KV events) and computes only the last prompt token. A
//!   decode leg without a remote engine, or with fewer remote blocks than
//!   its prompt's full blocks (the two legs did not carry the same prompt),
//!   is refused with a 400.
//!
//! The transfer is modelled as a per-request wait: concurrent transfers do
//! not share the link's bandwidth, and the prefill worker does not hold the
//! blocks for the decode side (they stay in its prefix cache like any
//! finished request's).

use axum::http::StatusCode;
use axum::response::Response;
use serde_json::{Value, json};

use super::error;

/// What a request's `kv_transfer_params` ask of this worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) enum Leg {
    /// None given, or neither flag set: an ordinary request.
    #[default]
    Whole,
    /// Prefill for another worker's decode.
    Prefill,
    /// Decode of a prompt another worker prefilled.
    Decode,
}

/// Reads `kv_transfer_params` of a request with `prompt_tokens` tokens on a
/// worker with blocks of `block_size` tokens.
pub(super) fn leg(body: &Value, prompt_tokens: usize, block_size: usize) -> Result<Leg, Box<Response>> {
    let Some(p) = body.get("kv_transfer_params").filter(|p| !p.is_null()) else { return Ok(Leg::Whole) };
    let bad = |why: &str| Box::new(error(StatusCode::BAD_REQUEST, format!("kv_transfer_params: {why}")));
    if !p.is_object() {
        return Err(bad("must be an object"));
    }
    let flag = |k: &str| p.get(k).and_then(Value::as_bool).unwrap_or(false);
    match (flag("do_remote_decode"), flag("do_remote_prefill")) {
        (false, false) => Ok(Leg::Whole),
        (true, true) => Err(bad("do_remote_decode and do_remote_prefill cannot both be true")),
        (true, false) => Ok(Leg::Prefill),
        (false, true) => {
            if p.get("remote_engine_id").and_then(Value::as_str).is_none_or(str::is_empty) {
                return Err(bad("a remote prefill needs remote_engine_id"));
            }
            let blocks = p.get("remote_block_ids").and_then(Value::as_array).map_or(0, Vec::len);
            let needed = prompt_tokens.saturating_sub(1) / block_size.max(1);
            if blocks < needed {
                return Err(bad(&format!(
                    "remote_block_ids has {blocks} blocks, the prompt needs {needed} (was it prefilled for another prompt?)"
                )));
            }
            Ok(Leg::Decode)
        }
    }
}

/// The `kv_transfer_params` of a prefill leg's answer.
pub(super) fn prefill_answer(
    engine_id: &str,
    request_id: &str,
    addr: std::net::SocketAddr,
    prompt_tokens: usize,
    block_size: usize,
) -> Value {
    let blocks: Vec<usize> = (0..prompt_tokens.div_ceil(block_size.max(1))).collect();
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": blocks,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": addr.ip().to_string(),
        "remote_port": addr.port(),
        "tp_size": 1,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_legs_are_read_and_a_mismatched_decode_leg_is_refused() {
        let leg_of = |v: Value| leg(&json!({ "kv_transfer_params": v }), 100, 16).map_err(|r| r.status());
        assert_eq!(leg(&json!({}), 100, 16).map_err(|r| r.status()), Ok(Leg::Whole));
        assert_eq!(leg_of(Value::Null), Ok(Leg::Whole));
        assert_eq!(leg_of(json!({"do_remote_decode": true, "do_remote_prefill": false})), Ok(Leg::Prefill));
        let answer = prefill_answer("w0-dp0", "cmpl-1", "127.0.0.1:8000".parse().unwrap(), 100, 16);
        assert_eq!(answer["remote_block_ids"].as_array().map(Vec::len), Some(7));
        assert_eq!(leg_of(answer.clone()), Ok(Leg::Decode));
        // Fewer blocks than the prompt's 6 full ones (99 tokens before the last).
        let mut short = answer.clone();
        short["remote_block_ids"] = json!([0, 1, 2]);
        assert_eq!(leg_of(short), Err(StatusCode::BAD_REQUEST));
        let mut anonymous = answer;
        anonymous["remote_engine_id"] = Value::Null;
        assert_eq!(leg_of(anonymous), Err(StatusCode::BAD_REQUEST));
        assert_eq!(leg_of(json!({"do_remote_decode": true, "do_remote_prefill": true})), Err(StatusCode::BAD_REQUEST));
        assert_eq!(leg_of(json!("yes")), Err(StatusCode::BAD_REQUEST));
    }
}
