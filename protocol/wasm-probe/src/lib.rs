//! A Wasm module that runs the protocol crate's filter-side hot paths, to
//! measure the size and speed of the `wasm` build profile's choices
//! (`scripts/wasm-profile.sh`, results in `docs/wasm-profile.md`).
//!
//! Exports (all deterministic, no host calls):
//! * `probe_setup(tokens, message_bytes)`: fills the inputs once;
//! * `probe_block_hash(block_size) -> u64`: sequence hashes of all tokens;
//! * `probe_segment_hash(messages) -> u64`: chained segment hashes over the
//!   message bytes split into `messages` messages;
//! * `probe_pick_encode(messages) -> u32`: protobuf-encodes a PickRequest
//!   carrying those messages (what the filter sends per request).
//!
//! `#[unsafe(no_mangle)]` exports are the only reason for the allow below.
#![allow(unsafe_code)]

use std::cell::RefCell;

use kvgate_protocol::pb;
use kvgate_protocol::{BlockSeed, BlockSize, SegmentHash, sequence_hashes};
use prost::Message;

thread_local! {
    static TOKENS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    static TEXT: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Fills `tokens` pseudo-random token ids and `message_bytes` bytes of text.
#[unsafe(no_mangle)]
pub extern "C" fn probe_setup(tokens: u32, message_bytes: u32) {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    TOKENS.with(|t| *t.borrow_mut() = (0..tokens).map(|_| (next() % 129_280) as u32).collect());
    TEXT.with(|t| *t.borrow_mut() = (0..message_bytes).map(|_| b' ' + (next() % 90) as u8).collect());
}

/// Last sequence hash of all full blocks of the tokens.
#[unsafe(no_mangle)]
pub extern "C" fn probe_block_hash(block_size: u32) -> u64 {
    let Ok(bs) = BlockSize::new(block_size) else { return 0 };
    TOKENS.with(|t| sequence_hashes(&t.borrow(), bs, BlockSeed::BASE).last().map_or(0, |h| h.0))
}

fn messages(text: &[u8], n: u32) -> impl Iterator<Item = &[u8]> {
    let per = text.len().div_ceil(n.max(1) as usize).max(1);
    text.chunks(per)
}

/// Last chained segment hash over the text split into `n` messages.
#[unsafe(no_mangle)]
pub extern "C" fn probe_segment_hash(n: u32) -> u64 {
    TEXT.with(|t| messages(&t.borrow(), n).fold(SegmentHash::context(b""), |h, m| h.chain(m)).0)
}

/// Encoded length of a PickRequest carrying the text as `n` segments.
#[unsafe(no_mangle)]
pub extern "C" fn probe_pick_encode(n: u32) -> u32 {
    TEXT.with(|t| {
        let text = t.borrow();
        let mut h = SegmentHash::context(b"");
        let segments = messages(&text, n)
            .map(|m| {
                h = h.chain(m);
                pb::Segment { chain_hash: h.0, role: "user".into(), message_json: m.to_vec(), elided: false }
            })
            .collect();
        let req = pb::PickRequest {
            request_id: "probe".into(),
            model: "meta-llama/Llama-3.1-70B-Instruct".into(),
            api: pb::ApiKind::ChatCompletions as i32,
            segments,
            stream: true,
            ..Default::default()
        };
        req.encode_to_vec().len() as u32
    })
}
