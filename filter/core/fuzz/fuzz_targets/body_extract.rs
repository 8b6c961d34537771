//! Arbitrary request bodies through the filter's decoders and state machine:
//! the JSON scanner (checked against serde_json as an oracle), extraction for
//! both APIs, the PickRequest encoding (must decode with prost and carry the
//! same messages), the usage finder, and a whole request through the mock
//! host. Nothing may panic.
#![no_main]

use std::rc::Rc;

use kvgate_filter_core::extract::{Api, extract};
use kvgate_filter_core::json::{JsonError, Scanner};
use kvgate_filter_core::mock::MockHost;
use kvgate_filter_core::pick::{RequestMeta, chain_hashes, encode_pick};
use kvgate_filter_core::usage::find_usage;
use kvgate_filter_core::{Config, RequestFilter};
use kvgate_protocol::pb;
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let ours = Scanner::document(data);
    if !matches!(ours, Err(JsonError::TooDeep)) {
        let theirs = serde_json::from_slice::<serde_json::Value>(data);
        if theirs.is_ok() {
            assert!(ours.is_ok(), "serde_json accepts what the scanner rejects: {ours:?}");
        }
    }
    for api in [Api::Chat, Api::Completions] {
        if let Ok(e) = extract(data, api) {
            let meta = RequestMeta { request_id: "r", lora_name: "", model: &e.model, body_bytes: data.len() as u32, session_id: "s", tenant: "t", priority: 3 };
            let hashes = chain_hashes(&e);
            let elide = data.first().map(|b| usize::from(*b % 4));
            let msg = encode_pick(&e, api, &meta, &hashes, elide);
            let decoded = pb::PickRequest::decode(msg.as_slice()).expect("our encoding decodes");
            assert_eq!(decoded.segments.len(), e.messages.len());
            for (i, (s, m)) in decoded.segments.iter().zip(&e.messages).enumerate() {
                let elided = elide.is_some_and(|k| i <= k);
                assert_eq!(s.elided, elided);
                assert_eq!(s.message_json, if elided { &[][..] } else { m.json });
                assert_eq!(s.chain_hash, hashes[i]);
            }
        }
    }
    let _ = find_usage(data);
    // A whole request through the state machine.
    let cfg = Rc::new(Config::parse(br#"{"debug_headers":true}"#).expect("config"));
    let h = MockHost::post(if data.first().is_some_and(|b| b & 1 == 1) { "/v1/completions" } else { "/v1/chat/completions" });
    let mut f = RequestFilter::new(cfg);
    f.on_request_headers(&h, false);
    h.set_body(data);
    f.on_request_body(&h, data.len(), true);
    if let Some(t) = f.pick_token() {
        f.on_pick_response(&h, t, 0, Some(data));
    }
    h.set_response_header(":status", "200");
    f.on_response_headers(&h);
    h.set_response_chunk(data);
    f.on_response_body(&h, data.len(), true);
    let _ = f.finish(&h);
});
