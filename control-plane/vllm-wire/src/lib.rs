//! # kvgate-vllm-wire
//!
//! vLLM's KV-event wire format, decoded for every era (ARCHITECTURE §5,
//! `../shared/vectors/vllm-kv-events/`):
//!
//! * live messages are three ZMQ frames: topic, sequence (u64 big-endian),
//!   msgpack batch ([`decode_frames`]);
//! * a batch is an array `[ts, events]` (0.9.0) or `[ts, events, dp_rank]`
//!   ([`decode_batch`]);
//! * events are arrays tagged by their first element up to 0.23, and maps
//!   tagged under `"type"` from 0.24. Fields were only ever appended, so
//!   array events are read by position and shorter or longer arrays are
//!   accepted; map events are read by name and unknown keys are ignored;
//! * block hashes are unsigned ints, negative ints (≤ 0.10.0, taken as two's
//!   complement) or 32-byte `bin` digests (last 8 bytes, big-endian);
//! * replay replies come in the ≤ 0.25 and ≥ 0.30 layouts
//!   ([`decode_replay_reply`]).
//!
//! | module | what |
//! |---|---|
//! | [`msgpack`] | borrowed msgpack reader with offsets in its errors |
//! | [`dp`] | the event endpoint of each data-parallel rank (vLLM's port offset) |
//! | [`encode`] | the reverse: batches in vLLM's map (≥ 0.24) or array encoding, for the simulator and tests |
//! | this file | [`Batch`], [`Event`], [`BlockStored`], [`BlockRemoved`], decoding, [`cache_salt`] |
//!
//! Decoding is O(payload bytes); nothing here panics on any input (fuzzed).
#![warn(missing_docs)]

pub mod dp;
pub mod encode;
pub mod msgpack;

use msgpack::{ReadError, Reader, Value};

/// Why a batch could not be decoded. Callers count these by [`DecodeError::cause`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DecodeError {
    /// Not valid msgpack.
    #[error(transparent)]
    Msgpack(#[from] ReadError),
    /// Valid msgpack, but not the shape of a batch or event.
    #[error("{0}")]
    Shape(String),
    /// The ZMQ message does not have the frames it should.
    #[error("{0}")]
    Frames(String),
}

impl DecodeError {
    /// A short cause label for metrics (`msgpack`, `shape`, `frames`).
    pub fn cause(&self) -> &'static str {
        match self {
            Self::Msgpack(_) => "msgpack",
            Self::Shape(_) => "shape",
            Self::Frames(_) => "frames",
        }
    }
}

fn shape(msg: impl Into<String>) -> DecodeError {
    DecodeError::Shape(msg.into())
}

/// One decoded batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch<'a> {
    /// The engine's timestamp (unix seconds).
    pub ts: f64,
    /// `data_parallel_rank` (absent in 0.9.0's two-element batches; nil allowed).
    pub dp_rank: Option<i64>,
    /// Number of elements of the batch array (2 or 3; more are accepted).
    pub array_len: usize,
    /// The events, in order.
    pub events: Vec<Event<'a>>,
}

/// One event.
#[derive(Debug, Clone, PartialEq)]
pub enum Event<'a> {
    /// `BlockStored`.
    Stored(BlockStored<'a>),
    /// `BlockRemoved`.
    Removed(BlockRemoved<'a>),
    /// `AllBlocksCleared`.
    Cleared,
    /// An event type this decoder does not know (skipped and counted by the relay).
    Unknown(&'a str),
}

/// `BlockStored`, with every field known in any era (`None` when absent).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStored<'a> {
    /// Engine hashes, normalized to u64.
    pub block_hashes: Vec<u64>,
    /// Parent's engine hash; `None` for a root.
    pub parent_block_hash: Option<u64>,
    /// Tokens of all blocks.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// LoRA int id.
    pub lora_id: Option<i64>,
    /// `"GPU"`, `"CPU"`, ... (0.10.2+).
    pub medium: Option<&'a str>,
    /// LoRA name (0.14+).
    pub lora_name: Option<&'a str>,
    /// Per-block extra keys (0.17+): `None` per block without any.
    pub extra_keys: Option<Vec<Value<'a>>>,
    /// KV-cache group (0.22+).
    pub group_idx: Option<i64>,
    /// KV-cache spec kind, e.g. `"full_attention"`, `"sliding_window"`, `"mamba"` (0.22+).
    pub kv_cache_spec_kind: Option<&'a str>,
    /// Sliding window size (0.22+).
    pub kv_cache_spec_sliding_window: Option<i64>,
}

impl BlockStored<'_> {
    /// Whether the blocks belong to a KV-cache group that prefix routing can
    /// use: full attention, or unspecified (engines before hybrid groups).
    pub fn is_indexable(&self) -> bool {
        matches!(self.kv_cache_spec_kind, None | Some("full_attention"))
    }
}

/// `BlockRemoved`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockRemoved<'a> {
    /// Engine hashes, normalized to u64.
    pub block_hashes: Vec<u64>,
    /// Medium (0.10.2+).
    pub medium: Option<&'a str>,
    /// KV-cache group (0.22+).
    pub group_idx: Option<i64>,
}

/// Normalizes a wire hash to u64 (see the crate docs).
pub fn hash_u64(v: &Value<'_>) -> Result<u64, DecodeError> {
    match v {
        Value::UInt(u) => Ok(*u),
        Value::Int(i) => Ok(*i as u64),
        Value::Bin(b) if b.len() >= 8 => {
            let mut a = [0u8; 8];
            a.copy_from_slice(b.get(b.len() - 8..).unwrap_or(&[0; 8]));
            Ok(u64::from_be_bytes(a))
        }
        other => Err(shape(format!("block hash must be an int or a bin of at least 8 bytes, got {}", kind(other)))),
    }
}

fn kind(v: &Value<'_>) -> &'static str {
    match v {
        Value::Nil => "nil",
        Value::Bool(_) => "bool",
        Value::UInt(_) | Value::Int(_) => "int",
        Value::Float(_) => "float",
        Value::Str(_) => "str",
        Value::Bin(_) => "bin",
        Value::Array(_) | Value::UInts(_) => "array",
        Value::Map(_) => "map",
        Value::Ext(..) => "ext",
    }
}

fn hashes(v: &Value<'_>, field: &str) -> Result<Vec<u64>, DecodeError> {
    match v {
        Value::UInts(u) => Ok(u.clone()),
        Value::Array(a) => a.iter().map(hash_u64).collect(),
        other => Err(shape(format!("{field} must be an array, got {}", kind(other)))),
    }
}

fn opt_hash(v: &Value<'_>) -> Result<Option<u64>, DecodeError> {
    match v {
        Value::Nil => Ok(None),
        other => hash_u64(other).map(Some),
    }
}

fn tokens(v: &Value<'_>) -> Result<Vec<u32>, DecodeError> {
    if let Value::UInts(u) = v {
        return u.iter().map(|t| u32::try_from(*t).map_err(|_| shape(format!("token id {t} exceeds u32")))).collect();
    }
    let Value::Array(a) = v else { return Err(shape(format!("token_ids must be an array, got {}", kind(v)))) };
    a.iter()
        .map(|t| match t {
            Value::UInt(u) => u32::try_from(*u).map_err(|_| shape(format!("token id {u} exceeds u32"))),
            other => Err(shape(format!("token id must be a non-negative int, got {}", kind(other)))),
        })
        .collect()
}

fn opt_int(v: &Value<'_>, field: &str) -> Result<Option<i64>, DecodeError> {
    match v {
        Value::Nil => Ok(None),
        Value::UInt(u) => i64::try_from(*u).map(Some).map_err(|_| shape(format!("{field} out of range"))),
        Value::Int(i) => Ok(Some(*i)),
        other => Err(shape(format!("{field} must be an int or nil, got {}", kind(other)))),
    }
}

fn opt_str<'a>(v: &Value<'a>, field: &str) -> Result<Option<&'a str>, DecodeError> {
    match v {
        Value::Nil => Ok(None),
        Value::Str(s) => Ok(Some(s)),
        other => Err(shape(format!("{field} must be a str or nil, got {}", kind(other)))),
    }
}

fn block_size(v: &Value<'_>) -> Result<u32, DecodeError> {
    match v {
        Value::UInt(u) => u32::try_from(*u).map_err(|_| shape("block_size out of range")),
        other => Err(shape(format!("block_size must be a non-negative int, got {}", kind(other)))),
    }
}

fn extra_keys<'a>(v: &Value<'a>) -> Result<Option<Vec<Value<'a>>>, DecodeError> {
    match v {
        Value::Nil => Ok(None),
        Value::Array(a) => Ok(Some(a.clone())),
        Value::UInts(u) => Ok(Some(u.iter().map(|x| Value::UInt(*x)).collect())),
        other => Err(shape(format!("extra_keys must be an array or nil, got {}", kind(other)))),
    }
}

/// Applies one named field to a `BlockStored`. Unknown names are ignored.
fn stored_field<'a>(s: &mut BlockStored<'a>, name: &str, v: &Value<'a>) -> Result<(), DecodeError> {
    match name {
        "block_hashes" => s.block_hashes = hashes(v, "block_hashes")?,
        "parent_block_hash" => s.parent_block_hash = opt_hash(v)?,
        "token_ids" => s.token_ids = tokens(v)?,
        "block_size" => s.block_size = block_size(v)?,
        "lora_id" => s.lora_id = opt_int(v, "lora_id")?,
        "medium" => s.medium = opt_str(v, "medium")?,
        "lora_name" => s.lora_name = opt_str(v, "lora_name")?,
        "extra_keys" => s.extra_keys = extra_keys(v)?,
        "group_idx" => s.group_idx = opt_int(v, "group_idx")?,
        "kv_cache_spec_kind" => s.kv_cache_spec_kind = opt_str(v, "kv_cache_spec_kind")?,
        "kv_cache_spec_sliding_window" => {
            s.kv_cache_spec_sliding_window = opt_int(v, "kv_cache_spec_sliding_window")?;
        }
        _ => {}
    }
    Ok(())
}

fn removed_field<'a>(r: &mut BlockRemoved<'a>, name: &str, v: &Value<'a>) -> Result<(), DecodeError> {
    match name {
        "block_hashes" => r.block_hashes = hashes(v, "block_hashes")?,
        "medium" => r.medium = opt_str(v, "medium")?,
        "group_idx" => r.group_idx = opt_int(v, "group_idx")?,
        _ => {}
    }
    Ok(())
}

/// Field order of array-encoded events (every era appended at the end).
const STORED_FIELDS: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
];
const REMOVED_FIELDS: &[&str] = &["block_hashes", "medium", "group_idx"];

fn check_stored(s: &BlockStored<'_>, fields: &[&str]) -> Result<(), DecodeError> {
    for f in ["block_hashes", "token_ids", "block_size"] {
        if !fields.contains(&f) {
            return Err(shape(format!("BlockStored without {f}")));
        }
    }
    if s.block_size == 0 {
        return Err(shape("BlockStored with block_size 0"));
    }
    Ok(())
}

fn decode_event<'a>(v: &Value<'a>) -> Result<Event<'a>, DecodeError> {
    match v {
        Value::Array(a) => {
            let Some(Value::Str(tag)) = a.first() else {
                return Err(shape("array event must start with its type name"));
            };
            let fields = a.get(1..).unwrap_or(&[]);
            match *tag {
                "BlockStored" => {
                    let mut s = BlockStored::default();
                    let names: Vec<&str> = STORED_FIELDS.iter().copied().take(fields.len()).collect();
                    for (name, v) in names.iter().zip(fields) {
                        stored_field(&mut s, name, v)?;
                    }
                    check_stored(&s, &names)?;
                    Ok(Event::Stored(s))
                }
                "BlockRemoved" => {
                    let mut r = BlockRemoved::default();
                    if fields.is_empty() {
                        return Err(shape("BlockRemoved without block_hashes"));
                    }
                    for (name, v) in REMOVED_FIELDS.iter().zip(fields) {
                        removed_field(&mut r, name, v)?;
                    }
                    Ok(Event::Removed(r))
                }
                "AllBlocksCleared" => Ok(Event::Cleared),
                other => Ok(Event::Unknown(other)),
            }
        }
        Value::Map(m) => {
            let tag = m.iter().find_map(|(k, v)| match (k, v) {
                (Value::Str("type"), Value::Str(t)) => Some(*t),
                _ => None,
            });
            let Some(tag) = tag else { return Err(shape("map event without a \"type\" string")) };
            let named = m.iter().filter_map(|(k, v)| match k {
                Value::Str(k) => Some((*k, v)),
                _ => None,
            });
            match tag {
                "BlockStored" => {
                    let mut s = BlockStored::default();
                    let mut seen = Vec::new();
                    for (k, v) in named {
                        stored_field(&mut s, k, v)?;
                        seen.push(k);
                    }
                    check_stored(&s, &seen)?;
                    Ok(Event::Stored(s))
                }
                "BlockRemoved" => {
                    let mut r = BlockRemoved::default();
                    let mut has_hashes = false;
                    for (k, v) in named {
                        removed_field(&mut r, k, v)?;
                        has_hashes |= k == "block_hashes";
                    }
                    if !has_hashes {
                        return Err(shape("BlockRemoved without block_hashes"));
                    }
                    Ok(Event::Removed(r))
                }
                "AllBlocksCleared" => Ok(Event::Cleared),
                other => Ok(Event::Unknown(other)),
            }
        }
        other => Err(shape(format!("event must be an array or a map, got {}", kind(other)))),
    }
}

/// Decodes a batch payload (the third frame).
pub fn decode_batch(payload: &[u8]) -> Result<Batch<'_>, DecodeError> {
    let mut r = Reader::new(payload);
    let v = r.value()?;
    if !r.at_end() {
        return Err(shape(format!("{} trailing bytes after the batch", payload.len() - r.offset())));
    }
    let Value::Array(items) = v else { return Err(shape("batch must be an array")) };
    let array_len = items.len();
    let mut it = items.into_iter();
    let ts = match it.next() {
        Some(Value::Float(f)) => f,
        Some(Value::UInt(u)) => u as f64,
        Some(Value::Int(i)) => i as f64,
        _ => return Err(shape("batch must start with a timestamp")),
    };
    let events = match it.next() {
        Some(Value::Array(evs)) => evs.iter().map(decode_event).collect::<Result<Vec<_>, _>>()?,
        _ => return Err(shape("batch element 2 must be the event array")),
    };
    let dp_rank = match it.next() {
        None | Some(Value::Nil) => None,
        Some(v) => opt_int(&v, "data_parallel_rank")?,
    };
    Ok(Batch { ts, dp_rank, array_len, events })
}

/// A live message: topic, engine sequence number, payload.
#[derive(Debug, Clone, PartialEq)]
pub struct Frames<'a> {
    /// The topic frame.
    pub topic: &'a [u8],
    /// The engine's sequence number (restarts at 0 with the engine).
    pub seq: u64,
    /// The msgpack batch.
    pub payload: &'a [u8],
}

fn seq_of(frame: &[u8]) -> Result<u64, DecodeError> {
    let a: [u8; 8] = frame
        .try_into()
        .map_err(|_| DecodeError::Frames(format!("sequence frame has {} bytes, not 8", frame.len())))?;
    Ok(u64::from_be_bytes(a))
}

/// Splits a live ZMQ message (exactly three frames).
pub fn decode_frames<'a>(frames: &[&'a [u8]]) -> Result<Frames<'a>, DecodeError> {
    match frames {
        [topic, seq, payload] => Ok(Frames { topic, seq: seq_of(seq)?, payload }),
        _ => Err(DecodeError::Frames(format!("a live message has 3 frames, got {}", frames.len()))),
    }
}

/// The end-of-replay sequence (`-1` as 8 big-endian bytes).
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// One reply of vLLM's replay socket, as a DEALER client receives it.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplayReply<'a> {
    /// A buffered batch.
    Batch {
        /// Topic (≥ 0.30 layout only).
        topic: Option<&'a [u8]>,
        /// Its sequence number.
        seq: u64,
        /// Its payload.
        payload: &'a [u8],
    },
    /// No more batches.
    End,
}

/// Decodes one replay reply: `["", seq, payload]` / `["", ff×8, ""]` up to
/// 0.25, `["", topic, seq, payload]` / `["", "", ff×8, ""]` from 0.30.
pub fn decode_replay_reply<'a>(frames: &[&'a [u8]]) -> Result<ReplayReply<'a>, DecodeError> {
    let bad = |m: &str| DecodeError::Frames(format!("replay reply: {m}"));
    let Some((delim, rest)) = frames.split_first() else { return Err(bad("no frames")) };
    if !delim.is_empty() {
        return Err(bad("first frame must be the empty delimiter"));
    }
    match rest {
        [seq, payload] => {
            if **seq == END_SEQ {
                Ok(ReplayReply::End)
            } else {
                Ok(ReplayReply::Batch { topic: None, seq: seq_of(seq)?, payload })
            }
        }
        [topic, seq, payload] => {
            if **seq == END_SEQ {
                Ok(ReplayReply::End)
            } else {
                Ok(ReplayReply::Batch { topic: Some(topic), seq: seq_of(seq)?, payload })
            }
        }
        _ => Err(bad("expected 3 or 4 frames")),
    }
}

/// The replay request a DEALER sends: `["", start_seq]`.
pub fn replay_request(start_seq: u64) -> [Vec<u8>; 2] {
    [Vec::new(), start_seq.to_be_bytes().to_vec()]
}

/// The `cache_salt` of a root `BlockStored`, from `extra_keys[0]` (vLLM puts
/// the request's salt only on its first block): tagged `["cache_salt", s]`
/// (0.32+ in hash inputs), or untagged, as events publish it — the last
/// string of block 0's keys that is not the LoRA name. `None` for children
/// (the relay inherits their salt from the parent) and for blocks without one.
pub fn cache_salt<'a>(s: &BlockStored<'a>) -> Option<&'a str> {
    if s.parent_block_hash.is_some() {
        return None;
    }
    let Value::Array(keys) = s.extra_keys.as_ref()?.first()? else { return None };
    let mut lora_skipped = false;
    let mut salt = None;
    for k in keys {
        match k {
            Value::Array(t) => {
                if let [Value::Str("cache_salt"), Value::Str(v)] = t.as_slice() {
                    return Some(v);
                }
            }
            Value::Str(v) if Some(*v) == s.lora_name && !lora_skipped => lora_skipped = true,
            Value::Str(v) => salt = Some(*v),
            _ => {}
        }
    }
    salt
}
