//! The encoder against vLLM itself: every real vLLM 0.32 payload decodes and
//! re-encodes byte for byte; and decode ∘ encode is the identity for any
//! batch, in both encodings.

use kvgate_vllm_wire::encode::{Encoding, encode_batch};
use kvgate_vllm_wire::msgpack::Value;
use kvgate_vllm_wire::{Batch, BlockRemoved, BlockStored, Event, decode_batch};
use proptest::prelude::*;

fn unhex(s: &str) -> Vec<u8> {
    kvgate_testkit::unhex(s).unwrap()
}

#[test]
fn real_payloads_reencode_byte_for_byte() {
    let dir = kvgate_testkit::shared_dir().unwrap().join("vectors/vllm-kv-events/real-0.32-cpu");
    let mut n = 0;
    for name in ["inst0", "inst1", "inst2", "relay0", "relay1", "relay2"] {
        for line in std::fs::read_to_string(dir.join(format!("{name}.raw.jsonl"))).unwrap().lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let payload = unhex(v["frames_hex"][2].as_str().unwrap());
            let b = decode_batch(&payload).unwrap();
            assert_eq!(encode_batch(&b, Encoding::Map), payload, "{name}");
            n += 1;
        }
    }
    assert_eq!(n, 334);
}

fn stored() -> impl Strategy<Value = BlockStored<'static>> {
    (
        proptest::collection::vec(any::<u64>(), 1..4),
        proptest::option::of(any::<u64>()),
        1u32..5,
        proptest::option::of(-3i64..100),
        proptest::option::of(prop_oneof![Just("GPU"), Just("CPU")]),
        proptest::option::of(Just("sql-lora")),
        any::<bool>(),
        proptest::option::of(0i64..3),
        proptest::option::of(prop_oneof![Just("full_attention"), Just("sliding_window")]),
        any::<u32>(),
    )
        .prop_map(|(h, parent, bs, lora_id, medium, lora_name, extra, group, kind, tok)| {
            let n = h.len();
            BlockStored {
                token_ids: (0..n * bs as usize).map(|i| tok.wrapping_add(i as u32 * 65_537)).collect(),
                block_hashes: h,
                parent_block_hash: parent,
                block_size: bs,
                lora_id,
                medium,
                lora_name,
                extra_keys: extra.then(|| {
                    (0..n).map(|i| if i == 0 { Value::Array(vec![Value::Str("salt-A")]) } else { Value::Nil }).collect()
                }),
                group_idx: group,
                kv_cache_spec_kind: kind,
                kv_cache_spec_sliding_window: None,
            }
        })
}

fn event() -> impl Strategy<Value = Event<'static>> {
    prop_oneof![
        4 => stored().prop_map(Event::Stored),
        3 => (proptest::collection::vec(any::<u64>(), 1..4), proptest::option::of(Just("GPU")), proptest::option::of(0i64..3))
            .prop_map(|(h, medium, group_idx)| Event::Removed(BlockRemoved { block_hashes: h, medium, group_idx })),
        1 => Just(Event::Cleared),
    ]
}

proptest! {
    #[test]
    fn decode_inverts_encode(
        events in proptest::collection::vec(event(), 0..6),
        ts in 0.0f64..2e9,
        dp in proptest::option::of(0i64..8),
        array in any::<bool>(),
    ) {
        let enc = if array { Encoding::Array } else { Encoding::Map };
        let mut batch = Batch { ts, dp_rank: dp, array_len: 3, events };
        if array {
            // The array era writes every field: absent optional group means 0.
            for e in &mut batch.events {
                match e {
                    Event::Stored(s) => s.group_idx = Some(s.group_idx.unwrap_or(0)),
                    Event::Removed(r) => r.group_idx = Some(r.group_idx.unwrap_or(0)),
                    _ => {}
                }
            }
        }
        let bytes = encode_batch(&batch, enc);
        let back = decode_batch(&bytes).unwrap();
        prop_assert_eq!(back, batch);
    }
}
