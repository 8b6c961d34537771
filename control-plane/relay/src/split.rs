//! Splitting a batch's events so that no published batch exceeds a byte
//! limit (NATS's `max_payload`).
//!
//! Events are packed greedily in order. An event that alone exceeds the
//! limit is cut first: a `BlockStored` into chained pieces (the parent of
//! each piece is the last block of the one before, so the pieces are the
//! same chain), a `BlockRemoved` into pieces of its hashes. Order is kept,
//! so applying the pieces in order equals applying the original batch.
//!
//! | operation | cost |
//! |---|---|
//! | [`split_events`] | O(events + blocks) |

use kvgate_protocol::pb::{self, kv_event};
use prost::Message as _;

/// Bytes a repeated message field adds to an event's own length (tag and
/// length prefix).
const FIELD_OVERHEAD: usize = 6;

/// The events in groups whose encoded size stays under `max_bytes` (at
/// least one event per group; a single block larger than the limit, which
/// no real block size reaches, still travels alone).
pub fn split_events(events: Vec<pb::KvEvent>, max_bytes: usize) -> Vec<Vec<pb::KvEvent>> {
    let max_bytes = max_bytes.max(1024);
    let total: usize = events.iter().map(|e| e.encoded_len() + FIELD_OVERHEAD).sum();
    if total <= max_bytes {
        return vec![events];
    }
    let mut groups: Vec<Vec<pb::KvEvent>> = Vec::new();
    let mut cur: Vec<pb::KvEvent> = Vec::new();
    let mut cur_bytes = 0usize;
    for ev in events {
        for piece in cut(ev, max_bytes) {
            let n = piece.encoded_len() + FIELD_OVERHEAD;
            if !cur.is_empty() && cur_bytes + n > max_bytes {
                groups.push(std::mem::take(&mut cur));
                cur_bytes = 0;
            }
            cur_bytes += n;
            cur.push(piece);
        }
    }
    if !cur.is_empty() {
        groups.push(cur);
    }
    groups
}

/// One event as pieces of at most about `max_bytes` each.
fn cut(ev: pb::KvEvent, max_bytes: usize) -> Vec<pb::KvEvent> {
    let len = ev.encoded_len() + FIELD_OVERHEAD;
    if len <= max_bytes {
        return vec![ev];
    }
    match ev.event {
        Some(kv_event::Event::Stored(s)) if s.engine_hashes.len() > 1 => cut_stored(s, len, max_bytes),
        Some(kv_event::Event::Removed(r)) if r.engine_hashes.len() > 1 => {
            let per = len.div_ceil(r.engine_hashes.len()).max(1);
            let n = ((max_bytes * 3 / 4) / per).max(1);
            r.engine_hashes
                .chunks(n)
                .map(|hashes| pb::KvEvent {
                    event: Some(kv_event::Event::Removed(pb::BlockRemoved {
                        engine_hashes: hashes.to_vec(),
                        ..r.clone()
                    })),
                })
                .collect()
        }
        other => vec![pb::KvEvent { event: other }],
    }
}

fn cut_stored(s: pb::BlockStored, len: usize, max_bytes: usize) -> Vec<pb::KvEvent> {
    let blocks = s.engine_hashes.len();
    let bs = s.block_size as usize;
    // Token ids are varints of up to 5 bytes: size pieces by the average,
    // with a margin for blocks of larger ids.
    let per_block = len.div_ceil(blocks).max(1);
    let per_piece = ((max_bytes * 3 / 4) / per_block).max(1);
    let mut out = Vec::with_capacity(blocks.div_ceil(per_piece));
    let mut parent = s.parent_engine_hash;
    let mut start = 0;
    while start < blocks {
        let end = (start + per_piece).min(blocks);
        let hashes = s.engine_hashes.get(start..end).unwrap_or_default().to_vec();
        let tokens = if bs > 0 && s.token_ids.len() == blocks * bs {
            s.token_ids.get(start * bs..end * bs).unwrap_or_default().to_vec()
        } else {
            // Not a well-formed store (the relay never publishes one): keep
            // it whole rather than cut tokens at a wrong place.
            return vec![pb::KvEvent { event: Some(kv_event::Event::Stored(s)) }];
        };
        let last = hashes.last().copied();
        out.push(pb::KvEvent {
            event: Some(kv_event::Event::Stored(pb::BlockStored {
                engine_hashes: hashes,
                parent_engine_hash: parent,
                token_ids: tokens,
                lora_name: s.lora_name.clone(),
                cache_salt: s.cache_salt.clone(),
                medium_name: s.medium_name.clone(),
                ..s
            })),
        });
        parent = last;
        start = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(first: u64, blocks: usize, bs: usize, parent: Option<u64>) -> pb::KvEvent {
        pb::KvEvent {
            event: Some(kv_event::Event::Stored(pb::BlockStored {
                engine_hashes: (first..first + blocks as u64).collect(),
                parent_engine_hash: parent,
                token_ids: (0..(blocks * bs) as u32).map(|t| 100_000 + t).collect(),
                block_size: bs as u32,
                cache_salt: "tenant-a".into(),
                ..Default::default()
            })),
        }
    }

    fn size(g: &[pb::KvEvent]) -> usize {
        pb::KvEventBatch { events: g.to_vec(), ..Default::default() }.encoded_len()
    }

    /// Every block of the pieces, in order, with its parent and tokens.
    fn chain(groups: &[Vec<pb::KvEvent>]) -> Vec<(u64, Option<u64>, Vec<u32>, String)> {
        let mut out = Vec::new();
        for g in groups {
            for e in g {
                if let Some(kv_event::Event::Stored(s)) = &e.event {
                    let mut parent = s.parent_engine_hash;
                    let bs = s.block_size as usize;
                    for (i, h) in s.engine_hashes.iter().enumerate() {
                        out.push((*h, parent, s.token_ids[i * bs..(i + 1) * bs].to_vec(), s.cache_salt.clone()));
                        parent = Some(*h);
                    }
                }
            }
        }
        out
    }

    #[test]
    fn a_small_batch_is_one_group() {
        let evs = vec![stored(1, 4, 16, None), stored(10, 2, 16, Some(4))];
        let g = split_events(evs.clone(), 900 * 1024);
        assert_eq!(g, vec![evs]);
    }

    /// The 40,000-block batch (2.1 MB) that stopped the relay: pieces under
    /// the limit that form the same chain.
    #[test]
    fn a_huge_store_becomes_a_chain_of_pieces_under_the_limit() {
        let ev = stored(1_000, 40_000, 16, Some(7));
        let whole = chain(&[vec![ev.clone()]]);
        let max = 900 * 1024;
        let groups = split_events(vec![ev], max);
        assert!(groups.len() >= 3, "{} groups", groups.len());
        for g in &groups {
            assert!(size(g) <= max, "{} > {max}", size(g));
        }
        assert_eq!(chain(&groups), whole);
    }

    #[test]
    fn removals_and_mixed_events_keep_their_order() {
        let removed = pb::KvEvent {
            event: Some(kv_event::Event::Removed(pb::BlockRemoved {
                engine_hashes: (0..200_000).collect(),
                ..Default::default()
            })),
        };
        let cleared = pb::KvEvent { event: Some(kv_event::Event::Cleared(pb::AllBlocksCleared {})) };
        let evs = vec![stored(1, 3, 16, None), removed, cleared.clone(), stored(9, 5000, 16, None)];
        let max = 64 * 1024;
        let groups = split_events(evs, max);
        for g in &groups {
            assert!(size(g) <= max, "{} > {max}", size(g));
        }
        let flat: Vec<&pb::KvEvent> = groups.iter().flatten().collect();
        let removed_hashes: Vec<u64> = flat
            .iter()
            .filter_map(|e| {
                if let Some(kv_event::Event::Removed(r)) = &e.event { Some(r.engine_hashes.clone()) } else { None }
            })
            .flatten()
            .collect();
        assert_eq!(removed_hashes, (0..200_000).collect::<Vec<u64>>());
        let kinds: Vec<u8> = flat
            .iter()
            .map(|e| match e.event {
                Some(kv_event::Event::Stored(_)) => 0,
                Some(kv_event::Event::Removed(_)) => 1,
                _ => 2,
            })
            .collect();
        let mut dedup = kinds.clone();
        dedup.dedup();
        assert_eq!(dedup, vec![0, 1, 2, 0], "order kept");
    }
}
