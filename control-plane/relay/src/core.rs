//! The relay's logic, without sockets: live ZMQ messages and replay replies
//! in, actions out ([`Action::Publish`] a normalized batch on NATS,
//! [`Action::RequestReplay`] from the engine's replay socket).
//!
//! # Sequencing
//!
//! The engine numbers its batches 0, 1, 2, … per process. For each live
//! message with sequence `s`, after the last applied `l`:
//!
//! | case | meaning | action |
//! |---|---|---|
//! | first message, `s = 0` | fresh engine | apply |
//! | first message, `s > 0` | the relay joined late | replay from 0 if a replay socket is configured (vLLM answers with what it still buffers), else apply |
//! | `s = l + 1` | in order | apply |
//! | `s ≤ l`, same bytes as the batch applied as `s` | a duplicate (a retransmitting proxy, a test harness, a PUB connected twice) | count `duplicates`, skip |
//! | `s ≤ l`, other bytes | the engine restarted (sequence back to 0) | publish `AllBlocksCleared`, clear the mirror, `engine_generation += 1`, apply |
//! | `s > l + 1` | batches lost | replay from `l + 1` (live messages are held until the replay ends), else clear and resync |
//! | the event socket reconnected ([`RelayCore::catch_up`]) | batches may be lost, or the engine restarted meanwhile and its new numbering already passed `l` | replay from `l`: batch `l` with the same bytes is the same process; other bytes are a new one: clear, `engine_generation += 1`, replay from 0 |
//!
//! A duplicate is recognized by the fingerprint of its payload among the
//! last [`RECENT`] applied batches: a restarted engine's batch differs (its
//! timestamp alone differs), so the two cannot be confused in practice.
//!
//! [`RelayCore::engine_down`] (the runtime's health probe confirmed the
//! engine gone) clears the mirror and publishes `AllBlocksCleared` at once,
//! and forgets the sequence: whatever the next engine process publishes
//! starts a fresh stream.
//!
//! # Batch size
//!
//! A published batch never exceeds [`RelayCore::set_max_batch_bytes`]
//! (NATS refuses payloads over the server's `max_payload`, 1 MiB by
//! default): larger ones are split into consecutive batches, and a single
//! `BlockStored` of tens of thousands of blocks into chained pieces (each
//! piece's parent is the previous piece's last block).
//!
//! "Clear and resync" publishes `AllBlocksCleared` and empties the mirror: the
//! control planes forget this worker's blocks instead of trusting a state
//! with a hole in it, and the worker's cache becomes known again as blocks
//! are stored. A replay that cannot cover the gap (the engine's buffer moved
//! on) ends the same way.
//!
//! # Normalization
//!
//! Events become `pb::KvEvent`s. Stored blocks get the chain's `cache_salt`:
//! from `extra_keys[0]` for a root, inherited from the parent in the mirror
//! for a child. A stored chain whose parent the mirror does not hold
//! (blocks from before the relay started) cannot be hashed by anyone: it is
//! counted (`orphan_stores`) and not published. Removals of blocks the
//! mirror does not hold are counted (`unknown_removals`) and not published.
//! Blocks of non-indexable KV groups (sliding window, mamba) and unknown
//! event types are counted and skipped.

use std::collections::VecDeque;
use std::hash::BuildHasher as _;
use std::sync::Arc;

use kvgate_protocol::pb::{self, kv_event};
use kvgate_vllm_wire::{Batch, BlockStored, Event, ReplayReply, cache_salt, decode_batch, decode_frames};

use crate::mirror::{Mirror, MirrorBlock};

/// What the relay is relaying for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayConfig {
    /// Worker id on NATS (by default the endpoint Envoy routes to).
    pub worker_id: String,
    /// Served model name.
    pub model: String,
    /// Whether the engine has a replay socket.
    pub replay: bool,
    /// Random per relay process start.
    pub relay_epoch: u64,
}

/// Something the caller must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Publish this batch on `<prefix>.kv.<model>.<worker>`.
    Publish(pb::KvEventBatch),
    /// Ask the replay socket for batches from this sequence on.
    RequestReplay {
        /// First sequence number wanted.
        from_seq: u64,
    },
}

/// Counters for the relay's metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayCounters {
    /// Live messages received.
    pub messages: u64,
    /// Batches published.
    pub published: u64,
    /// Stored blocks published.
    pub blocks_stored: u64,
    /// Removed blocks published.
    pub blocks_removed: u64,
    /// Messages that did not decode, by cause: msgpack, shape, frames.
    pub decode_errors_msgpack: u64,
    /// See `decode_errors_msgpack`.
    pub decode_errors_shape: u64,
    /// See `decode_errors_msgpack`.
    pub decode_errors_frames: u64,
    /// Gaps in the engine sequence.
    pub gaps: u64,
    /// Engine restarts seen.
    pub restarts: u64,
    /// Batches received twice (around a replay, or live with the same
    /// sequence and bytes as one already applied), dropped.
    pub duplicates: u64,
    /// Replays requested.
    pub replays: u64,
    /// Clear-and-resyncs (gaps that replay could not cover).
    pub resyncs: u64,
    /// Stored chains whose parent the mirror did not hold.
    pub orphan_stores: u64,
    /// Removals of blocks the mirror did not hold.
    pub unknown_removals: u64,
    /// Stores of non-indexable KV groups skipped.
    pub non_indexable: u64,
    /// Events of unknown types skipped.
    pub unknown_events: u64,
    /// Stores whose token count was not blocks × block size.
    pub malformed_stores: u64,
    /// Times the engine was confirmed down (mirror cleared).
    pub engine_downs: u64,
    /// Extra batches published because a batch was over the size limit.
    pub split_batches: u64,
}

/// How many applied batches are remembered to recognize a duplicate.
pub const RECENT: usize = 64;

/// Default largest encoded batch: under NATS's default 1 MiB `max_payload`
/// with room for the message's headers.
pub const DEFAULT_MAX_BATCH_BYTES: usize = 900 * 1024;

#[derive(Debug)]
struct Replay {
    next: u64,
    held: Vec<(u64, Vec<u8>)>,
    /// After a reconnect: the last applied batch (sequence, fingerprint),
    /// asked for again to tell the same engine process from a new one.
    verify: Option<(u64, u64)>,
    /// The engine restarted: the rest of this replay is the new process's
    /// from `verify`'s sequence on; ask again from 0 when it ends.
    restarted: bool,
}

/// The relay's state for one engine.
#[derive(Debug)]
pub struct RelayCore {
    config: RelayConfig,
    mirror: Mirror,
    last_seq: Option<u64>,
    relay_seq: u64,
    generation: u32,
    replay: Option<Replay>,
    counters: RelayCounters,
    /// (engine seq, payload fingerprint) of the last applied batches.
    recent: VecDeque<(u64, u64)>,
    max_batch_bytes: usize,
}

fn fingerprint(payload: &[u8]) -> u64 {
    foldhash::quality::FixedState::with_seed(0x6b76_6761_7465).hash_one(payload)
}

impl RelayCore {
    /// A relay that has seen nothing yet.
    pub fn new(config: RelayConfig) -> Self {
        Self {
            config,
            mirror: Mirror::new(),
            last_seq: None,
            relay_seq: 0,
            generation: 0,
            replay: None,
            counters: RelayCounters::default(),
            recent: VecDeque::with_capacity(RECENT),
            max_batch_bytes: DEFAULT_MAX_BATCH_BYTES,
        }
    }

    /// Largest encoded batch to publish (at least 4 KiB); larger ones are
    /// split. The runtime sets it below the NATS server's `max_payload`.
    pub fn set_max_batch_bytes(&mut self, bytes: usize) {
        self.max_batch_bytes = bytes.max(4096);
    }

    /// The engine is confirmed down: clear the mirror, publish
    /// `AllBlocksCleared` (when anything was known), and start a fresh
    /// stream with whatever the next engine process publishes.
    pub fn engine_down(&mut self) -> Vec<Action> {
        let mut out = Vec::new();
        self.counters.engine_downs += 1;
        self.replay = None;
        if self.last_seq.is_some() || !self.mirror.is_empty() {
            self.generation += 1;
            self.clear(&mut out);
        }
        self.last_seq = None;
        self.recent.clear();
        out
    }

    /// The mirror of the engine's cache.
    pub fn mirror(&self) -> &Mirror {
        &self.mirror
    }

    /// The counters.
    pub fn counters(&self) -> &RelayCounters {
        &self.counters
    }

    /// `relay_seq` of the last published batch (0 = none).
    pub fn relay_seq(&self) -> u64 {
        self.relay_seq
    }

    /// Engine restarts seen.
    pub fn generation(&self) -> u32 {
        self.generation
    }

    /// Whether a replay is in progress (live messages are being held).
    pub fn replaying(&self) -> bool {
        self.replay.is_some()
    }

    /// A snapshot of the mirror in chunks (for `<prefix>.snap.<model>.<worker>`).
    pub fn snapshot(&self, block_size: u32, max_chunk_bytes: usize) -> Vec<pb::SnapshotChunk> {
        let header = pb::SnapshotChunk {
            worker_id: self.config.worker_id.clone(),
            model: self.config.model.clone(),
            relay_epoch: self.config.relay_epoch,
            relay_seq: self.relay_seq,
            block_size,
            ..Default::default()
        };
        self.mirror.snapshot(&header, max_chunk_bytes)
    }

    fn decode_error(&mut self, cause: &str) {
        match cause {
            "msgpack" => self.counters.decode_errors_msgpack += 1,
            "frames" => self.counters.decode_errors_frames += 1,
            _ => self.counters.decode_errors_shape += 1,
        }
    }

    /// Handles one live ZMQ message (its frames).
    pub fn on_live(&mut self, frames: &[&[u8]]) -> Vec<Action> {
        self.counters.messages += 1;
        let f = match decode_frames(frames) {
            Ok(f) => f,
            Err(e) => {
                self.decode_error(e.cause());
                return Vec::new();
            }
        };
        if let Some(r) = &mut self.replay {
            r.held.push((f.seq, f.payload.to_vec()));
            return Vec::new();
        }
        let mut out = Vec::new();
        match self.last_seq {
            None if f.seq > 0 && self.config.replay => {
                self.start_replay(0, f.seq, f.payload, &mut out);
                return out;
            }
            // The same sequence with the same bytes: a duplicate.
            Some(l) if f.seq <= l && self.recent.contains(&(f.seq, fingerprint(f.payload))) => {
                self.counters.duplicates += 1;
                return out;
            }
            // A sequence that does not move forward with other bytes is a
            // new engine process, even when the old one had published only
            // seq 0.
            Some(l) if f.seq <= l => self.restarted(&mut out),
            Some(l) if f.seq > l + 1 => {
                self.counters.gaps += 1;
                if self.config.replay {
                    self.start_replay(l + 1, f.seq, f.payload, &mut out);
                    return out;
                }
                self.counters.resyncs += 1;
                self.clear(&mut out);
            }
            _ => {}
        }
        self.apply(f.seq, f.payload, &mut out);
        out
    }

    /// The event socket was (re)connected: what the engine published before
    /// the subscription reached it is lost to PUB/SUB (ZMQ's slow joiner),
    /// and a new engine process may publish nothing more for a while. With
    /// a replay socket, ask for everything from the last applied batch on
    /// (from 0 on a fresh stream); live messages are held meanwhile. The
    /// last applied batch comes back first: the same bytes mean the same
    /// engine process; other bytes mean a new one that restarted while
    /// the socket was down (its numbering began again and may already
    /// have passed ours), so the mirror is cleared and the replay asked
    /// again from 0.
    pub fn catch_up(&mut self) -> Vec<Action> {
        if !self.config.replay || self.replay.is_some() {
            return Vec::new();
        }
        let verify = self.last_seq.and_then(|l| self.recent.iter().find(|(s, _)| *s == l).copied());
        let from = match (self.last_seq, verify) {
            (_, Some((l, _))) => l,
            (Some(l), None) => l + 1,
            (None, _) => 0,
        };
        self.counters.replays += 1;
        self.replay = Some(Replay { next: from, held: Vec::new(), verify, restarted: false });
        vec![Action::RequestReplay { from_seq: from }]
    }

    fn start_replay(&mut self, from: u64, seq: u64, payload: &[u8], out: &mut Vec<Action>) {
        self.counters.replays += 1;
        self.replay = Some(Replay { next: from, held: vec![(seq, payload.to_vec())], verify: None, restarted: false });
        out.push(Action::RequestReplay { from_seq: from });
    }

    /// A replay after a reconnect checks its first batch against the last
    /// one applied ([`RelayCore::catch_up`]). Returns whether the batch is
    /// consumed by the check (the same batch again, or the rest of a new
    /// process's replay, asked again from 0 at its end).
    fn verified(&mut self, seq: u64, payload: &[u8], out: &mut Vec<Action>) -> bool {
        let Some(r) = self.replay.as_mut() else { return false };
        if r.restarted {
            return true;
        }
        let Some((vs, vf)) = r.verify.take() else { return false };
        if seq != vs {
            // The engine no longer buffers it: nothing to compare.
            r.next = vs + 1;
            return false;
        }
        if fingerprint(payload) == vf {
            r.next = vs + 1;
            self.counters.duplicates += 1;
            return true;
        }
        r.restarted = true;
        self.restarted(out);
        self.last_seq = None;
        true
    }

    /// Handles one reply of the replay socket (its frames after the identity).
    pub fn on_replay(&mut self, frames: &[&[u8]]) -> Vec<Action> {
        let mut out = Vec::new();
        let Some(next) = self.replay.as_ref().map(|r| r.next) else { return out };
        match kvgate_vllm_wire::decode_replay_reply(frames) {
            Err(e) => self.decode_error(e.cause()),
            Ok(ReplayReply::Batch { seq, payload, .. }) => {
                if self.verified(seq, payload, &mut out) {
                    return out;
                }
                let next = self.replay.as_ref().map_or(next, |r| r.next);
                if seq < next {
                    self.counters.duplicates += 1;
                    return out;
                }
                if seq > next {
                    // The engine no longer buffers what we missed.
                    self.counters.resyncs += 1;
                    self.clear(&mut out);
                }
                self.apply(seq, payload, &mut out);
                if let Some(r) = &mut self.replay {
                    r.next = seq + 1;
                }
            }
            Ok(ReplayReply::End) => match self.replay.as_mut() {
                Some(r) if r.restarted => {
                    // The new process's batches, all of them this time.
                    (r.next, r.restarted, r.verify) = (0, false, None);
                    self.counters.replays += 1;
                    out.push(Action::RequestReplay { from_seq: 0 });
                }
                _ => self.finish_replay(&mut out),
            },
        }
        out
    }

    /// The replay socket did not answer in time: clear and resync, then go on
    /// with the held live messages.
    pub fn replay_timed_out(&mut self) -> Vec<Action> {
        let mut out = Vec::new();
        if self.replay.is_some() {
            self.counters.resyncs += 1;
            self.clear(&mut out);
            self.finish_replay(&mut out);
        }
        out
    }

    fn finish_replay(&mut self, out: &mut Vec<Action>) {
        let Some(r) = self.replay.take() else { return };
        for (seq, payload) in r.held {
            match self.last_seq {
                Some(l) if seq <= l => self.counters.duplicates += 1,
                Some(l) if seq > l + 1 => {
                    // Still a hole after the replay: clear and resync.
                    self.counters.resyncs += 1;
                    self.clear(out);
                    self.apply(seq, &payload, out);
                }
                _ => self.apply(seq, &payload, out),
            }
        }
    }

    /// The engine restarted: a new generation, the mirror cleared and
    /// `AllBlocksCleared` published.
    fn restarted(&mut self, out: &mut Vec<Action>) {
        self.counters.restarts += 1;
        self.generation += 1;
        self.clear(out);
    }

    fn clear(&mut self, out: &mut Vec<Action>) {
        self.mirror.clear();
        self.recent.clear();
        let ev = pb::KvEvent { event: Some(kv_event::Event::Cleared(pb::AllBlocksCleared {})) };
        self.publish(self.last_seq.unwrap_or(0), 0.0, None, vec![ev], out);
    }

    fn publish(&mut self, seq: u64, ts: f64, dp_rank: Option<i64>, events: Vec<pb::KvEvent>, out: &mut Vec<Action>) {
        if events.is_empty() {
            return;
        }
        let parts = crate::split::split_events(events, self.max_batch_bytes.saturating_sub(BATCH_OVERHEAD));
        self.counters.split_batches += parts.len().saturating_sub(1) as u64;
        for events in parts {
            self.relay_seq += 1;
            self.counters.published += 1;
            out.push(Action::Publish(pb::KvEventBatch {
                worker_id: self.config.worker_id.clone(),
                model: self.config.model.clone(),
                relay_epoch: self.config.relay_epoch,
                relay_seq: self.relay_seq,
                engine_seq: seq,
                engine_generation: self.generation,
                engine_ts_unix_nanos: if ts.is_finite() && ts > 0.0 { (ts * 1e9) as u64 } else { 0 },
                dp_rank: dp_rank.and_then(|d| u32::try_from(d).ok()).unwrap_or(0),
                events,
            }));
        }
    }

    fn apply(&mut self, seq: u64, payload: &[u8], out: &mut Vec<Action>) {
        self.last_seq = Some(seq);
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back((seq, fingerprint(payload)));
        let batch: Batch<'_> = match decode_batch(payload) {
            Ok(b) => b,
            Err(e) => {
                self.decode_error(e.cause());
                return;
            }
        };
        let mut events = Vec::with_capacity(batch.events.len());
        for e in &batch.events {
            match e {
                Event::Stored(s) => {
                    if let Some(ev) = self.stored(s) {
                        events.push(ev);
                    }
                }
                Event::Removed(r) => {
                    let held: Vec<u64> = r.block_hashes.iter().copied().filter(|h| self.mirror.remove(*h)).collect();
                    self.counters.unknown_removals += (r.block_hashes.len() - held.len()) as u64;
                    if !held.is_empty() {
                        self.counters.blocks_removed += held.len() as u64;
                        let (medium, medium_name) = medium(r.medium);
                        events.push(pb::KvEvent {
                            event: Some(kv_event::Event::Removed(pb::BlockRemoved {
                                engine_hashes: held,
                                medium,
                                medium_name,
                                group_idx: r.group_idx.and_then(|g| u32::try_from(g).ok()).unwrap_or(0),
                            })),
                        });
                    }
                }
                Event::Cleared => {
                    self.mirror.clear();
                    events.push(pb::KvEvent { event: Some(kv_event::Event::Cleared(pb::AllBlocksCleared {})) });
                }
                Event::Unknown(_) => self.counters.unknown_events += 1,
            }
        }
        self.publish(seq, batch.ts, batch.dp_rank, events, out);
    }

    fn stored(&mut self, s: &BlockStored<'_>) -> Option<pb::KvEvent> {
        if !s.is_indexable() {
            self.counters.non_indexable += 1;
            return None;
        }
        let bs = s.block_size as usize;
        if s.block_hashes.is_empty() || s.token_ids.len() != s.block_hashes.len() * bs {
            self.counters.malformed_stores += 1;
            return None;
        }
        let salt: Option<Arc<str>> = match s.parent_block_hash {
            None => cache_salt(s).map(Arc::from),
            Some(p) => match self.mirror.get(p) {
                Some(parent) => parent.salt.clone(),
                None => {
                    self.counters.orphan_stores += 1;
                    return None;
                }
            },
        };
        let lora: Option<Arc<str>> = s.lora_name.map(Arc::from);
        let (medium, medium_name) = medium(s.medium);
        let mut parent = s.parent_block_hash;
        for (h, tokens) in s.block_hashes.iter().zip(s.token_ids.chunks_exact(bs)) {
            self.mirror.store(
                *h,
                MirrorBlock { parent, tokens: tokens.into(), lora: lora.clone(), salt: salt.clone(), medium, refs: 1 },
            );
            parent = Some(*h);
        }
        self.counters.blocks_stored += s.block_hashes.len() as u64;
        Some(pb::KvEvent {
            event: Some(kv_event::Event::Stored(pb::BlockStored {
                engine_hashes: s.block_hashes.clone(),
                parent_engine_hash: s.parent_block_hash,
                token_ids: s.token_ids.clone(),
                block_size: s.block_size,
                lora_name: s.lora_name.unwrap_or_default().to_owned(),
                cache_salt: salt.as_deref().unwrap_or_default().to_owned(),
                medium,
                medium_name,
                group_idx: s.group_idx.and_then(|g| u32::try_from(g).ok()).unwrap_or(0),
                origin: pb::BlockOrigin::Unspecified as i32,
            })),
        })
    }
}

/// Bytes of a batch besides its events (ids, sequence numbers), with room
/// for long worker ids and model names.
const BATCH_OVERHEAD: usize = 2048;

/// vLLM's medium string as the protobuf enum (+ the name when "other").
fn medium(m: Option<&str>) -> (i32, String) {
    match m {
        None => (pb::StorageMedium::Unspecified as i32, String::new()),
        Some("GPU") => (pb::StorageMedium::Gpu as i32, String::new()),
        Some("CPU") => (pb::StorageMedium::Cpu as i32, String::new()),
        Some("DISK") => (pb::StorageMedium::Disk as i32, String::new()),
        Some(other) => (pb::StorageMedium::Other as i32, other.to_owned()),
    }
}
