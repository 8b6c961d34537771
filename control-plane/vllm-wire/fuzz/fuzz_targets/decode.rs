//! Arbitrary bytes as a batch payload, as live frames and as replay replies:
//! decoding returns a value or an error, never panics, and decoded stores
//! are internally consistent.
#![no_main]

use kvgate_vllm_wire::{Event, cache_salt, decode_batch, decode_frames, decode_replay_reply};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(b) = decode_batch(data) {
        for e in &b.events {
            if let Event::Stored(s) = e {
                assert!(s.block_size > 0);
                let _ = cache_salt(s);
                let _ = s.is_indexable();
            }
        }
    }
    // The same bytes cut into frames at two points taken from the input.
    if data.len() >= 2 {
        let a = usize::from(data[0]) % data.len();
        let b = usize::from(data[1]) % data.len();
        let (a, b) = (a.min(b), a.max(b));
        let frames = [&data[..a], &data[a..b], &data[b..]];
        if let Ok(f) = decode_frames(&frames) {
            let _ = decode_batch(f.payload);
        }
        let _ = decode_replay_reply(&frames);
        let _ = decode_replay_reply(&[&[][..], &data[..a], &data[a..]]);
    }
});
