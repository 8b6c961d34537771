//! The two legs of a disaggregated request as vLLM's KV connectors
//! (NixlConnector) expect them, as pure functions on the JSON body.
//!
//! - Prefill leg: the original request with `max_tokens` (and
//!   `max_completion_tokens`, when given) 1, `stream` false, no
//!   `stream_options` or `min_tokens`, and `kv_transfer_params` =
//!   `{do_remote_decode: true, do_remote_prefill: false, remote_*: null}`.
//! - Decode leg: the original request with the prefill answer's
//!   `kv_transfer_params` (`remote_engine_id`, `remote_block_ids`,
//!   `remote_host`, `remote_port`, ...), `do_remote_prefill` true.
//!
//! Both executors use them: the decode pod's sidecar (`kvgate pd-sidecar`,
//! llm-d's convention) and the Wasm filter itself (its `disaggregation.legs:
//! "filter"`). Feature `pd` (it needs `serde_json` and `std`).

use std::string::String;

use serde_json::{Map, Value, json};

/// The longest prefill answer either executor reads: a one-token completion
/// is a few KB; a larger answer is not a prefill leg's.
pub const MAX_PREFILL_ANSWER: usize = 16 << 20;

/// Why a request is served aggregated although it named a prefill worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Fallback {
    /// The prefiller header is not a plain `host:port`.
    #[error("x-prefiller-host-port is not host:port")]
    BadHeader,
    /// The body is not a JSON object.
    #[error("the request body is not a JSON object")]
    NotJson,
    /// The prefill worker could not be reached, or answered nothing in time.
    #[error("the prefill worker did not answer")]
    Unreachable,
    /// It took longer than the prefill timeout.
    #[error("the prefill leg timed out")]
    Timeout,
    /// It answered with an error status.
    #[error("the prefill worker answered an error")]
    Status,
    /// Its answer carried no usable `kv_transfer_params` (or was larger
    /// than a prefill answer can be, `MAX_ANSWER`).
    #[error("the prefill answer has no kv_transfer_params")]
    NoParams,
}

impl Fallback {
    /// Metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::BadHeader => "bad_header",
            Self::NotJson => "not_json",
            Self::Unreachable => "unreachable",
            Self::Timeout => "timeout",
            Self::Status => "status",
            Self::NoParams => "no_params",
        }
    }

    /// Every cause, for metrics.
    pub const ALL: [Self; 6] =
        [Self::BadHeader, Self::NotJson, Self::Unreachable, Self::Timeout, Self::Status, Self::NoParams];
}

/// The request body parsed as a JSON object.
pub fn parse(body: &[u8]) -> Result<Map<String, Value>, Fallback> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        _ => Err(Fallback::NotJson),
    }
}

/// The prefill leg's body.
pub fn prefill_body(original: &Map<String, Value>) -> Value {
    let mut m = original.clone();
    m.insert("max_tokens".into(), json!(1));
    if m.contains_key("max_completion_tokens") {
        m.insert("max_completion_tokens".into(), json!(1));
    }
    m.insert("stream".into(), json!(false));
    m.remove("stream_options");
    m.remove("min_tokens");
    m.insert(
        "kv_transfer_params".into(),
        json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        }),
    );
    Value::Object(m)
}

/// The decode leg's body from the prefill answer, or why there is none.
pub fn decode_body(original: Map<String, Value>, prefill_answer: &[u8]) -> Result<Value, Fallback> {
    let answer: Value = serde_json::from_slice(prefill_answer).map_err(|_| Fallback::NoParams)?;
    let Some(Value::Object(params)) = answer.get("kv_transfer_params") else { return Err(Fallback::NoParams) };
    if params.get("remote_engine_id").is_none_or(Value::is_null) {
        return Err(Fallback::NoParams);
    }
    let mut params = params.clone();
    params.insert("do_remote_prefill".into(), json!(true));
    params.insert("do_remote_decode".into(), json!(false));
    let mut m = original;
    m.insert("kv_transfer_params".into(), Value::Object(params));
    Ok(Value::Object(m))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::format;

    proptest! {
        /// Any request body and any prefill answer: an answer or a
        /// fallback, never a panic.
        #[test]
        fn any_bytes_are_a_leg_or_a_fallback(body in proptest::collection::vec(any::<u8>(), 0..256),
                                             answer in proptest::collection::vec(any::<u8>(), 0..256)) {
            if let Ok(m) = parse(&body) {
                let p = prefill_body(&m);
                prop_assert_eq!(p["max_tokens"].as_u64(), Some(1));
                let _ = decode_body(m, &answer);
            }
            let wrapped = format!(r#"{{"kv_transfer_params":{}}}"#, String::from_utf8_lossy(&answer));
            let _ = decode_body(Map::new(), wrapped.as_bytes());
        }
    }

    fn original() -> Map<String, Value> {
        parse(br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":200,"min_tokens":5}"#).unwrap()
    }

    #[test]
    fn the_prefill_leg_asks_one_token_for_a_remote_decode() {
        let p = prefill_body(&original());
        assert_eq!((p["max_tokens"].as_u64(), p["stream"].as_bool()), (Some(1), Some(false)));
        assert!(p.get("stream_options").is_none() && p.get("min_tokens").is_none());
        assert!(p.get("max_completion_tokens").is_none(), "not added when absent");
        let k = &p["kv_transfer_params"];
        assert_eq!((k["do_remote_decode"].as_bool(), k["do_remote_prefill"].as_bool()), (Some(true), Some(false)));
        assert!(k["remote_engine_id"].is_null() && k["remote_block_ids"].is_null());
        assert_eq!(p["messages"], original()["messages"]);
        let mut with = original();
        with.insert("max_completion_tokens".into(), json!(300));
        assert_eq!(prefill_body(&with)["max_completion_tokens"].as_u64(), Some(1));
    }

    #[test]
    fn the_decode_leg_carries_the_prefill_answers_parameters() {
        let answer = br#"{"id":"cmpl-1","choices":[],"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"e1","remote_block_ids":[1,2,3],"remote_host":"10.0.0.9","remote_port":5600,"remote_request_id":"r1","tp_size":1}}"#;
        let d = decode_body(original(), answer).unwrap();
        let k = &d["kv_transfer_params"];
        assert_eq!((k["do_remote_prefill"].as_bool(), k["do_remote_decode"].as_bool()), (Some(true), Some(false)));
        assert_eq!((k["remote_engine_id"].as_str(), k["remote_port"].as_u64()), (Some("e1"), Some(5600)));
        // Everything else is the client's request, streaming included.
        assert_eq!((d["max_tokens"].as_u64(), d["stream"].as_bool()), (Some(200), Some(true)));
        assert_eq!(d["stream_options"]["include_usage"].as_bool(), Some(true));
    }

    #[test]
    fn answers_without_parameters_fall_back() {
        for bad in [
            &b"not json"[..],
            br#"{"choices":[]}"#,
            br#"{"kv_transfer_params":null}"#,
            br#"{"kv_transfer_params":{"remote_engine_id":null}}"#,
        ] {
            assert_eq!(decode_body(original(), bad), Err(Fallback::NoParams), "{}", String::from_utf8_lossy(bad));
        }
        assert_eq!(parse(b"[1,2]"), Err(Fallback::NotJson));
        assert_eq!(parse(b"{"), Err(Fallback::NotJson));
    }
}
