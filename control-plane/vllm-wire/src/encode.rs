//! Encoding batches in vLLM's wire format: map-encoded events as vLLM ≥ 0.24
//! publishes them (the default), or array-encoded as 0.22/0.23 did. Used by
//! the simulated fleet to publish events exactly like vLLM, and by tests and
//! benchmarks. Field order and presence follow vLLM: in the map era,
//! `block_hashes … lora_name` are always present and later fields only
//! when set; in the array era every field up to `kv_cache_spec_sliding_window`
//! is written.

use crate::msgpack::Value;
use crate::{Batch, BlockRemoved, BlockStored, Event};

/// Event encoding of an era.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// Events as maps tagged under `"type"` (vLLM ≥ 0.24).
    Map,
    /// Events as arrays tagged by their first element (vLLM 0.22–0.23 layout).
    Array,
}

/// Appends one msgpack value.
pub fn write_value(out: &mut Vec<u8>, v: &Value<'_>) {
    match v {
        Value::Nil => out.push(0xc0),
        Value::Bool(b) => out.push(if *b { 0xc3 } else { 0xc2 }),
        Value::UInt(u) => write_uint(out, *u),
        Value::Int(i) => write_int(out, *i),
        Value::Float(f) => {
            out.push(0xcb);
            out.extend_from_slice(&f.to_be_bytes());
        }
        Value::Str(s) => write_str(out, s),
        Value::Bin(b) => {
            write_len(out, b.len(), [0xc4, 0xc5, 0xc6], None);
            out.extend_from_slice(b);
        }
        Value::Array(a) => {
            write_array_len(out, a.len());
            for x in a {
                write_value(out, x);
            }
        }
        Value::UInts(u) => {
            write_array_len(out, u.len());
            for x in u {
                write_uint(out, *x);
            }
        }
        Value::Map(m) => {
            write_map_len(out, m.len());
            for (k, x) in m {
                write_value(out, k);
                write_value(out, x);
            }
        }
        Value::Ext(t, d) => {
            write_len(out, d.len(), [0xc7, 0xc8, 0xc9], None);
            out.push(*t as u8);
            out.extend_from_slice(d);
        }
    }
}

fn write_len(out: &mut Vec<u8>, n: usize, tags: [u8; 3], fix: Option<(u8, usize)>) {
    match fix {
        Some((base, max)) if n <= max => out.push(base | n as u8),
        _ if n <= 0xff && tags[0] != 0 => {
            out.push(tags[0]);
            out.push(n as u8);
        }
        _ if n <= 0xffff => {
            out.push(tags[1]);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        _ => {
            out.push(tags[2]);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }
}

/// Appends an unsigned int in its shortest form.
pub fn write_uint(out: &mut Vec<u8>, u: u64) {
    if u < 0x80 {
        out.push(u as u8);
    } else if u <= 0xff {
        out.extend_from_slice(&[0xcc, u as u8]);
    } else if u <= 0xffff {
        out.push(0xcd);
        out.extend_from_slice(&(u as u16).to_be_bytes());
    } else if u <= 0xffff_ffff {
        out.push(0xce);
        out.extend_from_slice(&(u as u32).to_be_bytes());
    } else {
        out.push(0xcf);
        out.extend_from_slice(&u.to_be_bytes());
    }
}

fn write_int(out: &mut Vec<u8>, i: i64) {
    if i >= 0 {
        write_uint(out, i as u64);
    } else if i >= -32 {
        out.push(i as i8 as u8);
    } else if i >= i64::from(i8::MIN) {
        out.extend_from_slice(&[0xd0, i as i8 as u8]);
    } else if i >= i64::from(i16::MIN) {
        out.push(0xd1);
        out.extend_from_slice(&(i as i16).to_be_bytes());
    } else if i >= i64::from(i32::MIN) {
        out.push(0xd2);
        out.extend_from_slice(&(i as i32).to_be_bytes());
    } else {
        out.push(0xd3);
        out.extend_from_slice(&i.to_be_bytes());
    }
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    write_len(out, s.len(), [0xd9, 0xda, 0xdb], Some((0xa0, 31)));
    out.extend_from_slice(s.as_bytes());
}

fn write_array_len(out: &mut Vec<u8>, n: usize) {
    write_len(out, n, [0, 0xdc, 0xdd], Some((0x90, 15)));
}

fn write_map_len(out: &mut Vec<u8>, n: usize) {
    write_len(out, n, [0, 0xde, 0xdf], Some((0x80, 15)));
}

fn opt_str(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => write_str(out, s),
        None => out.push(0xc0),
    }
}

fn opt_int(out: &mut Vec<u8>, i: Option<i64>) {
    match i {
        Some(i) => write_int(out, i),
        None => out.push(0xc0),
    }
}

fn hashes(out: &mut Vec<u8>, h: &[u64]) {
    write_array_len(out, h.len());
    for x in h {
        write_uint(out, *x);
    }
}

fn stored(out: &mut Vec<u8>, s: &BlockStored<'_>, enc: Encoding) {
    let tokens = |out: &mut Vec<u8>| {
        write_array_len(out, s.token_ids.len());
        for t in &s.token_ids {
            write_uint(out, u64::from(*t));
        }
    };
    let parent = |out: &mut Vec<u8>| match s.parent_block_hash {
        Some(p) => write_uint(out, p),
        None => out.push(0xc0),
    };
    let extra = |out: &mut Vec<u8>| match &s.extra_keys {
        Some(k) => write_value(out, &Value::Array(k.clone())),
        None => out.push(0xc0),
    };
    match enc {
        Encoding::Array => {
            write_array_len(out, 12);
            write_str(out, "BlockStored");
            hashes(out, &s.block_hashes);
            parent(out);
            tokens(out);
            write_uint(out, u64::from(s.block_size));
            opt_int(out, s.lora_id);
            opt_str(out, s.medium);
            opt_str(out, s.lora_name);
            extra(out);
            write_int(out, s.group_idx.unwrap_or(0));
            opt_str(out, s.kv_cache_spec_kind);
            opt_int(out, s.kv_cache_spec_sliding_window);
        }
        Encoding::Map => {
            let n = 8
                + usize::from(s.extra_keys.is_some())
                + usize::from(s.group_idx.is_some())
                + usize::from(s.kv_cache_spec_kind.is_some())
                + usize::from(s.kv_cache_spec_sliding_window.is_some());
            write_map_len(out, n);
            write_str(out, "type");
            write_str(out, "BlockStored");
            write_str(out, "block_hashes");
            hashes(out, &s.block_hashes);
            write_str(out, "parent_block_hash");
            parent(out);
            write_str(out, "token_ids");
            tokens(out);
            write_str(out, "block_size");
            write_uint(out, u64::from(s.block_size));
            write_str(out, "lora_id");
            opt_int(out, s.lora_id);
            write_str(out, "medium");
            opt_str(out, s.medium);
            write_str(out, "lora_name");
            opt_str(out, s.lora_name);
            if s.extra_keys.is_some() {
                write_str(out, "extra_keys");
                extra(out);
            }
            if let Some(g) = s.group_idx {
                write_str(out, "group_idx");
                write_int(out, g);
            }
            if let Some(k) = s.kv_cache_spec_kind {
                write_str(out, "kv_cache_spec_kind");
                write_str(out, k);
            }
            if let Some(w) = s.kv_cache_spec_sliding_window {
                write_str(out, "kv_cache_spec_sliding_window");
                write_int(out, w);
            }
        }
    }
}

fn removed(out: &mut Vec<u8>, r: &BlockRemoved<'_>, enc: Encoding) {
    match enc {
        Encoding::Array => {
            write_array_len(out, 4);
            write_str(out, "BlockRemoved");
            hashes(out, &r.block_hashes);
            opt_str(out, r.medium);
            write_int(out, r.group_idx.unwrap_or(0));
        }
        Encoding::Map => {
            write_map_len(out, 3 + usize::from(r.group_idx.is_some()));
            write_str(out, "type");
            write_str(out, "BlockRemoved");
            write_str(out, "block_hashes");
            hashes(out, &r.block_hashes);
            write_str(out, "medium");
            opt_str(out, r.medium);
            if let Some(g) = r.group_idx {
                write_str(out, "group_idx");
                write_int(out, g);
            }
        }
    }
}

/// Encodes a batch `[ts, events, dp_rank]` (dp_rank nil when `None`).
pub fn encode_batch(batch: &Batch<'_>, enc: Encoding) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + batch.events.len() * 64);
    write_array_len(&mut out, 3);
    out.push(0xcb);
    out.extend_from_slice(&batch.ts.to_be_bytes());
    write_array_len(&mut out, batch.events.len());
    for e in &batch.events {
        match e {
            Event::Stored(s) => stored(&mut out, s, enc),
            Event::Removed(r) => removed(&mut out, r, enc),
            Event::Cleared => match enc {
                Encoding::Array => {
                    write_array_len(&mut out, 1);
                    write_str(&mut out, "AllBlocksCleared");
                }
                Encoding::Map => {
                    write_map_len(&mut out, 1);
                    write_str(&mut out, "type");
                    write_str(&mut out, "AllBlocksCleared");
                }
            },
            Event::Unknown(t) => {
                write_map_len(&mut out, 1);
                write_str(&mut out, "type");
                write_str(&mut out, t);
            }
        }
    }
    opt_int(&mut out, batch.dp_rank);
    out
}
