//! Every protobuf message of the protocol from arbitrary bytes: decoding never
//! panics, and a message that decodes re-encodes to bytes that decode and
//! re-encode to the same bytes. (Bytes, not `==`: a float field can be NaN,
//! which the wire carries faithfully; consumers must validate such values.)
#![no_main]

use kvgate_protocol::pb;
use libfuzzer_sys::fuzz_target;
use prost::Message;

fn roundtrip<M: Message + Default>(data: &[u8]) {
    if let Ok(m) = M::decode(data) {
        let bytes = m.encode_to_vec();
        let again = M::decode(bytes.as_slice()).expect("re-encoded message decodes");
        assert_eq!(bytes, again.encode_to_vec());
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else { return };
    match which % 8 {
        0 => roundtrip::<pb::PickRequest>(rest),
        1 => roundtrip::<pb::PickResponse>(rest),
        2 => roundtrip::<pb::CompletionReportBatch>(rest),
        3 => roundtrip::<pb::KvEventBatch>(rest),
        4 => roundtrip::<pb::WorkerHeartbeat>(rest),
        5 => roundtrip::<pb::SnapshotRequest>(rest),
        6 => roundtrip::<pb::SnapshotChunk>(rest),
        _ => roundtrip::<pb::InflightBatch>(rest),
    }
});
