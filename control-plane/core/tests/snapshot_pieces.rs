//! A snapshot applied in pieces (`begin_snapshot`, `snapshot_piece`,
//! `finish_snapshot`, as the server's snapshot task does) leaves what the
//! whole snapshot at once leaves, with the worker's batches held meanwhile
//! and lookups in between that see an exact index; a later snapshot of the
//! same worker, or the worker's removal, stops one under way.

mod common;

use common::tokens;
use kvgate_core::model::ModelState;
use kvgate_core::model::snapshot::Piece;
use kvgate_index::Tier;
use kvgate_protocol::{BlockSeed, BlockSize, pb, sequence_hashes};
use kvgate_scheduler::Mode;

/// `w1` synced at relay_seq 0, holding document 1 (64 blocks, batch 1),
/// then a gap (batch 3): a snapshot is under way, batch 3 held.
fn state() -> ModelState {
    let mut st = ModelState::new(common::config(Mode::Kv), 1);
    assert_eq!(st.on_heartbeat(&common::heartbeat("w1"), 0), None);
    assert_eq!(st.on_batch(common::stored("w1", 1, &tokens(1, 64)), 0), None);
    assert!(st.on_batch(common::stored("w1", 3, &tokens(3, 8)), 0).is_some(), "a gap asks for a snapshot");
    st
}

/// A snapshot of `w1` taken at relay_seq `seq`: document `doc`'s first
/// `blocks` blocks as one chain under engine hashes from `first_hash`, in
/// chunks of 100 blocks, the 10th block stored twice.
fn snapshot(seq: u64, doc: u64, blocks: usize, first_hash: u64) -> Vec<pb::SnapshotChunk> {
    let toks = tokens(doc, blocks);
    let all: Vec<pb::SnapshotBlock> = (0..blocks)
        .map(|i| pb::SnapshotBlock {
            engine_hash: first_hash + i as u64,
            parent_engine_hash: (i > 0).then(|| first_hash + i as u64 - 1),
            token_ids: toks[i * 16..(i + 1) * 16].to_vec(),
            ref_count: if i == 9 { 2 } else { 1 },
            ..Default::default()
        })
        .collect();
    let count = all.chunks(100).count() as u32;
    all.chunks(100)
        .enumerate()
        .map(|(i, c)| pb::SnapshotChunk {
            worker_id: "w1".into(),
            model: "m".into(),
            relay_epoch: 1,
            relay_seq: seq,
            block_size: 16,
            chunk_index: i as u32,
            chunk_count: count,
            blocks: c.to_vec(),
        })
        .collect()
}

/// Blocks of document `doc` (first `blocks`) `w1` holds on its device.
fn matched(st: &ModelState, doc: u64, blocks: usize) -> u32 {
    let seqs = sequence_hashes(&tokens(doc, blocks), BlockSize::new(16).unwrap(), BlockSeed::BASE);
    let mut out = Vec::new();
    st.index().find_matches(&seqs, Tier::Device, &mut out);
    out.first().map_or(0, |o| o.blocks)
}

/// What the index holds for `w1`: device blocks, and each engine hash's
/// (sequence hash, references) for the hashes the tests use.
fn holdings(st: &ModelState) -> (usize, Vec<Option<(kvgate_protocol::SequenceHash, u16)>>) {
    let index = st.index();
    let w = index.worker("w1").unwrap();
    let entries =
        (0..1_500u64).map(|h| index.engine_entry(w, Tier::Device, kvgate_protocol::EngineBlockHash(h))).collect();
    (index.worker_blocks(w, Tier::Device), entries)
}

#[test]
fn pieces_leave_what_the_whole_snapshot_leaves() {
    // Taken at batch 3 (held, a duplicate then); batch 4 arrives meanwhile
    // and is applied after it.
    let chunks = snapshot(3, 2, 250, 1_000);
    let (mut whole, mut pieces) = (state(), state());
    assert_eq!(whole.on_batch(common::stored("w1", 4, &tokens(4, 4)), 0), None);
    assert_eq!(whole.on_snapshot("w1", &chunks, 0), None);

    let mut p = pieces.begin_snapshot("w1", &chunks, 0).unwrap();
    let (mut n, mut seen) = (0, Vec::new());
    loop {
        let piece = pieces.snapshot_piece(&mut p, &chunks, 7);
        n += 1;
        if n == 5 {
            assert_eq!(pieces.on_batch(common::stored("w1", 4, &tokens(4, 4)), 0), None, "held");
        }
        // Between pieces the index is exact, whatever part it holds.
        pieces.index().check_invariants().unwrap();
        seen.push((matched(&pieces, 1, 64), matched(&pieces, 2, 250)));
        match piece {
            Piece::More => {}
            Piece::Done => break,
            Piece::Abandoned => panic!("nothing overtook it"),
        }
    }
    assert_eq!(pieces.finish_snapshot(p, 0), None);
    // 64 old blocks cleared 7 at a time, 250 stored 7 at a time.
    assert_eq!(n, 64usize.div_ceil(7) + 250usize.div_ceil(7));
    // The old blocks go from the chain's end: what is left matches as a prefix.
    assert_eq!(&seen[..3], &[(57, 0), (50, 0), (43, 0)], "part of the old blocks: {seen:?}");
    assert!(seen.iter().any(|&(old, new)| old == 0 && new > 0 && new < 250), "part of the snapshot: {seen:?}");

    assert_eq!(holdings(&pieces), holdings(&whole));
    assert_eq!((matched(&pieces, 1, 64), matched(&pieces, 2, 250), matched(&pieces, 4, 4)), (0, 250, 4));
    assert_eq!(pieces.counters().snapshots_applied, 1);
    assert_eq!(pieces.counters().batches_applied, whole.counters().batches_applied);
    assert_eq!(pieces.counters().batches_duplicate, whole.counters().batches_duplicate);
    assert_eq!(pieces.counters().snapshots_abandoned, 0);
    pieces.index().check_invariants().unwrap();
}

#[test]
fn a_later_snapshot_of_the_worker_overtakes_one_in_pieces() {
    let mut st = state();
    let (old, new) = (snapshot(3, 2, 250, 1_000), snapshot(3, 5, 120, 200));
    let mut first = st.begin_snapshot("w1", &old, 0).unwrap();
    for _ in 0..12 {
        assert_eq!(st.snapshot_piece(&mut first, &old, 10), Piece::More);
    }
    let mut second = st.begin_snapshot("w1", &new, 0).unwrap();
    assert_eq!(st.snapshot_piece(&mut first, &old, 10), Piece::Abandoned);
    while st.snapshot_piece(&mut second, &new, 10) == Piece::More {}
    assert_eq!(st.finish_snapshot(second, 0), None);
    assert_eq!(st.finish_snapshot(first, 0), None, "overtaken: nothing more to do");
    assert_eq!((matched(&st, 2, 250), matched(&st, 5, 120), matched(&st, 1, 64)), (0, 120, 0));
    let (blocks, _) = holdings(&st);
    assert_eq!(blocks, 120);
    assert_eq!((st.counters().snapshots_applied, st.counters().snapshots_abandoned), (1, 2));
    st.index().check_invariants().unwrap();
}

#[test]
fn a_worker_removed_midway_stops_its_snapshot() {
    let mut st = state();
    let chunks = snapshot(3, 2, 250, 1_000);
    let mut p = st.begin_snapshot("w1", &chunks, 0).unwrap();
    for _ in 0..20 {
        assert_eq!(st.snapshot_piece(&mut p, &chunks, 10), Piece::More);
    }
    // `w2` goes on beating (the stream is flowing); `w1` fell silent.
    assert!(st.on_heartbeat(&common::heartbeat("w2"), 9_500).is_none());
    assert_eq!(st.reap(10_000), vec!["w1".to_owned()], "silent past its timeout");
    assert_eq!(st.snapshot_piece(&mut p, &chunks, 10), Piece::Abandoned);
    // Back under the same id: a new worker, with nothing of the old snapshot.
    assert!(st.on_heartbeat(&common::heartbeat("w1"), 10_000).is_none());
    assert_eq!(st.snapshot_piece(&mut p, &chunks, 10), Piece::Abandoned);
    assert_eq!(st.finish_snapshot(p, 10_000), None);
    assert_eq!(holdings(&st).0, 0);
    st.index().check_invariants().unwrap();
}
