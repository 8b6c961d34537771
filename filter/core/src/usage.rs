//! `usage` of an OpenAI response, read from the response's last bytes while
//! the response streams through unchanged.
//!
//! vLLM writes `usage` last: at the end of a non-streaming body, and in the
//! final SSE chunk before `data: [DONE]` when the client asked for
//! `stream_options.include_usage`. The filter keeps only a bounded tail of the
//! response ([`Tail`], default 16 KiB) and, at the end, parses the last
//! `"usage":{...}` object in it. Generated text cannot fake the key: inside a
//! JSON string its quotes are escaped.
//!
//! Cost: O(chunk) copy into the tail per body chunk (only the chunk's last
//! `capacity` bytes are ever read from the host; compaction is amortized),
//! O(capacity) once at the end.

use crate::json::{Kind, Scanner, key_is};

/// The fields of `usage` kvgate reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// `prompt_tokens`.
    pub prompt_tokens: Option<u32>,
    /// `completion_tokens`.
    pub completion_tokens: Option<u32>,
    /// `prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u32>,
}

/// The last `capacity` bytes of a stream.
#[derive(Debug, Clone)]
pub struct Tail {
    buf: Vec<u8>,
    capacity: usize,
}

impl Tail {
    /// An empty tail that keeps at most `capacity` bytes (allocated lazily).
    pub fn new(capacity: usize) -> Self {
        Self { buf: Vec::new(), capacity }
    }

    /// How many of a chunk's last bytes are worth reading.
    pub fn wanted(&self, chunk_len: usize) -> usize {
        chunk_len.min(self.capacity)
    }

    /// Appends (the end of) a chunk. The buffer grows to twice the capacity
    /// before it is compacted, so a stream of small SSE chunks costs O(1)
    /// amortized per byte instead of a memmove of the whole tail per chunk.
    pub fn push(&mut self, bytes: &[u8]) {
        let bytes = bytes.get(bytes.len().saturating_sub(self.capacity)..).unwrap_or(bytes);
        if self.buf.len() + bytes.len() > 2 * self.capacity {
            let drop = self.buf.len().saturating_sub(self.capacity.saturating_sub(bytes.len()));
            self.buf.drain(..drop);
        }
        self.buf.extend_from_slice(bytes);
    }

    /// The last (at most `capacity`) bytes.
    pub fn bytes(&self) -> &[u8] {
        self.buf.get(self.buf.len().saturating_sub(self.capacity)..).unwrap_or(&self.buf)
    }
}

fn find_last(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    (0..=hay.len() - needle.len()).rev().find(|&i| hay.get(i..i + needle.len()) == Some(needle))
}

fn num(v: &crate::json::Raw<'_>) -> Option<u32> {
    v.u64().and_then(|n| u32::try_from(n).ok())
}

/// The last complete `"usage": {...}` object in `tail`, if any.
pub fn find_usage(tail: &[u8]) -> Option<Usage> {
    let mut end = tail.len();
    while let Some(at) = find_last(tail.get(..end)?, b"\"usage\"") {
        end = at;
        let rest = tail.get(at + 7..)?;
        // `"usage"` then optional whitespace, a colon, and the object.
        let colon = rest.iter().position(|&b| !matches!(b, b' ' | b'\t' | b'\r' | b'\n'))?;
        if rest.get(colon) != Some(&b':') {
            continue;
        }
        let value = rest.get(colon + 1..)?;
        let mut s = Scanner::new(value);
        let Ok(obj) = s.value(0) else { continue };
        if obj.kind != Kind::Object {
            continue;
        }
        let mut u = Usage::default();
        for (k, v) in obj.members().ok()? {
            if key_is(&k, "prompt_tokens") {
                u.prompt_tokens = num(&v);
            } else if key_is(&k, "completion_tokens") {
                u.completion_tokens = num(&v);
            } else if key_is(&k, "prompt_tokens_details") && v.kind == Kind::Object {
                for (k2, v2) in v.members().ok()? {
                    if key_is(&k2, "cached_tokens") {
                        u.cached_tokens = num(&v2);
                    }
                }
            }
        }
        return Some(u);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        // The tail always equals the last `capacity` bytes of everything
        // pushed (the naive model), whatever the chunking.
        #[test]
        fn tail_is_the_last_bytes(cap in 1usize..64, chunks in proptest::collection::vec(proptest::collection::vec(proptest::prelude::any::<u8>(), 0..100), 0..40)) {
            let mut t = Tail::new(cap);
            let mut all = Vec::new();
            for c in &chunks {
                let w = t.wanted(c.len());
                t.push(&c[c.len() - w..]);
                all.extend_from_slice(c);
                proptest::prop_assert_eq!(t.bytes(), &all[all.len().saturating_sub(cap)..]);
            }
        }
    }

    #[test]
    fn non_streaming_body() {
        let body = br#"{"id":"x","choices":[{"message":{"content":"say \"usage\": {\"prompt_tokens\":1}"}}],"usage":{"prompt_tokens":120,"completion_tokens":7,"total_tokens":127,"prompt_tokens_details":{"cached_tokens":96}}}"#;
        assert_eq!(
            find_usage(body),
            Some(Usage { prompt_tokens: Some(120), completion_tokens: Some(7), cached_tokens: Some(96) })
        );
        let nulls = br#"{"usage":{"prompt_tokens":5,"completion_tokens":1,"prompt_tokens_details":null}}"#;
        assert_eq!(find_usage(nulls).unwrap().cached_tokens, None);
        assert_eq!(find_usage(br#"{"choices":[]}"#), None);
    }

    #[test]
    fn sse_stream_in_pieces_through_a_small_tail() {
        let mut sse = Vec::new();
        for i in 0..200 {
            sse.extend_from_slice(
                format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"t{i}\"}}}}],\"usage\":null}}\n\n").as_bytes(),
            );
        }
        sse.extend_from_slice(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":64,\"completion_tokens\":200,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\ndata: [DONE]\n\n");
        let mut tail = Tail::new(512);
        for chunk in sse.chunks(37) {
            let w = tail.wanted(chunk.len());
            tail.push(&chunk[chunk.len() - w..]);
        }
        assert!(tail.bytes().len() <= 512);
        assert!(sse.ends_with(tail.bytes()));
        assert_eq!(
            find_usage(tail.bytes()),
            Some(Usage { prompt_tokens: Some(64), completion_tokens: Some(200), cached_tokens: Some(32) })
        );
        // The tail cut the usage object: nothing, not garbage.
        let mut small = Tail::new(40);
        small.push(&sse);
        assert_eq!(find_usage(small.bytes()), None);
    }
}
