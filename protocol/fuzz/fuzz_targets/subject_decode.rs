//! Subject tokens and subjects from arbitrary text: decoding never panics,
//! and whatever decodes re-encodes to the same text (the encoding is a
//! bijection onto the tokens it accepts).
#![no_main]

use kvgate_protocol::subject::{Subjects, decode_token, encode_token};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(name) = decode_token(text) {
        assert_eq!(encode_token(&name), text);
    }
    let name_token = encode_token(text);
    assert_eq!(decode_token(&name_token).as_deref(), Ok(text));
    let subjects = Subjects::default();
    if let Ok(p) = subjects.parse(text) {
        let again = match p.worker {
            Some(w) => subjects.worker_subject(p.kind, &p.model, &w),
            None => subjects.inflight(&p.model),
        };
        assert_eq!(again, text);
    }
});
