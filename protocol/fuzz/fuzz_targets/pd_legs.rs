//! The two legs of a disaggregated request from arbitrary bytes (a client's
//! body and a prefill worker's answer): never a panic; a prefill leg always
//! asks for one token and a remote decode; a decode leg always asks for the
//! remote prefill.
#![no_main]

use kvgate_protocol::pd;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let split = data.first().map_or(0, |b| usize::from(*b)).min(data.len().saturating_sub(1));
    let (body, answer) = data.get(1..).unwrap_or_default().split_at(split.min(data.len().saturating_sub(1)));
    let Ok(original) = pd::parse(body) else { return };
    let leg = pd::prefill_body(&original);
    assert_eq!(leg["max_tokens"].as_u64(), Some(1));
    assert_eq!(leg["kv_transfer_params"]["do_remote_decode"].as_bool(), Some(true));
    if let Ok(decode) = pd::decode_body(original, answer) {
        assert_eq!(decode["kv_transfer_params"]["do_remote_prefill"].as_bool(), Some(true));
    }
});
