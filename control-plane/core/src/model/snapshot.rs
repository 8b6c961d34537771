//! Applying a worker's snapshot: its blocks cleared, then the snapshot's
//! stored, then the batches held meanwhile accepted in order.
//!
//! A snapshot is applied in pieces so that Picks are not held up by it:
//! each piece takes the model's lock and the index's write lock for at most
//! [`PIECE_BLOCKS`] blocks, and lookups run between pieces. (Whole, one
//! worker's 40K-block snapshot held both locks 5 ms at 1,000 workers, and
//! 52 ms when every block was held by all 1,000: `docs/DECISIONS.md`.)
//! Between pieces the index holds part of the worker's old blocks, then
//! part of the snapshot's, each matched exactly (a partial clear counts
//! its holes); the worker's KV batches are held as for the whole snapshot.
//!
//! ```text
//! begin_snapshot ──▶ snapshot_piece … (More) … ──▶ Done ──▶ finish_snapshot
//!                         └──▶ Abandoned: a newer snapshot, a failure or
//!                              the worker's removal overtook it; it stops
//! ```
//!
//! A ticket ([`StreamSync::ticket`](super::sync::StreamSync::ticket))
//! names the snapshot being applied: `begin_snapshot` takes a new one, so
//! of two applications of one worker's snapshots only the later goes on.
//!
//! | step | cost under the locks |
//! |---|---|
//! | [`ModelState::begin_snapshot`] | O(chunks) checks |
//! | [`ModelState::snapshot_piece`] | O(b) for b = `max_blocks` cleared or stored |
//! | [`ModelState::finish_snapshot`] | O(held batches' events) |

use kvgate_index::{KvEvent, Origin, Stored, Tier, WorkerIdx};
use kvgate_protocol::{BlockSeed, pb};

use super::sync::Accept;
use super::{ModelState, Need};

/// Blocks cleared or stored per piece by the server's snapshot task.
/// Measured at 1,000 workers × 40K blocks (`docs/DECISIONS.md`, "A snapshot
/// is applied in pieces").
pub const PIECE_BLOCKS: usize = 512;

/// A worker's snapshot being applied in pieces.
#[derive(Debug)]
pub struct SnapshotPieces {
    id: String,
    idx: WorkerIdx,
    ticket: u64,
    epoch: u64,
    seq: u64,
    /// The worker's old blocks are all gone.
    cleared: bool,
    /// The next block to store: chunk, then block within it.
    chunk: usize,
    block: usize,
}

/// What a piece left to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece {
    /// More pieces to apply.
    More,
    /// Every block stored: [`ModelState::finish_snapshot`] next.
    Done,
    /// Overtaken (see [`Piece`]'s module): stop; the blocks stay as they are
    /// for what overtook it to replace.
    Abandoned,
}

impl ModelState {
    /// A complete snapshot (all chunks, in order) of a worker, applied at
    /// once: replaces its blocks, then the batches held meanwhile are
    /// accepted in order. Returns a new need when they do not continue it.
    pub fn on_snapshot(&mut self, id: &str, chunks: &[pb::SnapshotChunk], now_ms: u64) -> Option<Need> {
        let mut pieces = self.begin_snapshot(id, chunks, now_ms)?;
        while self.snapshot_piece(&mut pieces, chunks, usize::MAX) == Piece::More {}
        self.finish_snapshot(pieces, now_ms)
    }

    /// Starts applying a complete snapshot (all chunks, in order) of a
    /// worker; `None` (and the snapshot counted as failed) when its chunks
    /// do not agree on where in the stream it was taken, or there are none.
    pub fn begin_snapshot(&mut self, id: &str, chunks: &[pb::SnapshotChunk], now_ms: u64) -> Option<SnapshotPieces> {
        let first = chunks.first();
        let Some((epoch, seq)) = first.map(|c| (c.relay_epoch, c.relay_seq)) else {
            self.snapshot_failed(id);
            return None;
        };
        if chunks.iter().any(|c| c.relay_epoch != epoch || c.relay_seq != seq) {
            self.snapshot_failed(id);
            return None;
        }
        self.snapshot_tickets += 1;
        let ticket = self.snapshot_tickets;
        let w = self.worker_entry(id, now_ms);
        w.sync.claim_snapshot(now_ms, ticket);
        Some(SnapshotPieces { id: id.to_owned(), idx: w.idx, ticket, epoch, seq, cleared: false, chunk: 0, block: 0 })
    }

    /// Clears or stores up to `max_blocks` blocks of the snapshot.
    pub fn snapshot_piece(&mut self, p: &mut SnapshotPieces, chunks: &[pb::SnapshotChunk], max_blocks: usize) -> Piece {
        if !self.still_applying(p) {
            self.counters.snapshots_abandoned += 1;
            return Piece::Abandoned;
        }
        let max_blocks = max_blocks.max(1);
        let mut index = self.index.write();
        if !p.cleared {
            let held = index.worker_blocks(p.idx, Tier::Device) + index.worker_blocks(p.idx, Tier::Host);
            if held > 0 {
                let _ = index.clear_part(p.idx, max_blocks);
                return Piece::More;
            }
            p.cleared = true;
        }
        let mut budget = max_blocks;
        while let Some(chunk) = chunks.get(p.chunk) {
            let bs = if chunk.block_size > 0 { chunk.block_size } else { self.config.block_size.get() };
            while let Some(b) = chunk.blocks.get(p.block) {
                if budget == 0 {
                    return Piece::More;
                }
                budget -= 1;
                p.block += 1;
                let hashes = [b.engine_hash];
                let stored = Stored {
                    engine_hashes: &hashes,
                    parent: b.parent_engine_hash,
                    token_ids: &b.token_ids,
                    block_size: bs,
                    seed: BlockSeed::from_fields(&b.lora_name, &b.cache_salt),
                    tier: Tier::from_medium(b.medium),
                    origin: Origin::New,
                };
                for _ in 0..b.ref_count.clamp(1, 16) {
                    let _ = index.apply(p.idx, &KvEvent::Stored(stored));
                }
            }
            (p.chunk, p.block) = (p.chunk + 1, 0);
        }
        // A store the snapshot itself left without its parent is not
        // asked about again.
        let _ = index.take_resync(p.idx);
        Piece::Done
    }

    /// Ends a snapshot whose pieces are all applied: the worker is synced
    /// where it was taken, and the batches held meanwhile are accepted in
    /// order. Returns a new need when they do not continue it.
    pub fn finish_snapshot(&mut self, p: SnapshotPieces, now_ms: u64) -> Option<Need> {
        if !self.still_applying(&p) {
            self.counters.snapshots_abandoned += 1;
            return None;
        }
        let SnapshotPieces { id, idx, epoch, seq, .. } = p;
        let held = self.workers.get_mut(&id)?.sync.snapshot_applied(epoch, seq);
        self.counters.snapshots_applied += 1;
        for batch in held {
            let Some(w) = self.workers.get_mut(&id) else { break };
            match w.sync.accept(batch) {
                Accept::Apply(b) => self.apply_events(idx, &b),
                Accept::Duplicate => self.counters.batches_duplicate += 1,
                Accept::Held => {}
                Accept::Resync(cause, b) => {
                    self.count_resync(cause);
                    return self.start_snapshot(&id, now_ms, Some(b));
                }
            }
        }
        self.resync_if_needed(&id, idx, now_ms)
    }

    /// The worker is still registered under the same index and waits for
    /// this snapshot (its ticket).
    fn still_applying(&self, p: &SnapshotPieces) -> bool {
        self.workers.get(&p.id).is_some_and(|w| w.idx == p.idx && w.sync.ticket() == Some(p.ticket))
    }
}
