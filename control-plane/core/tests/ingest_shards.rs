//! KV batches applied together over a sharded index (`on_batches`, index
//! shards on parallel threads) leave the model as applying them one by one
//! on one shard (`on_batch`) does: the same snapshot needs, counters and
//! matches, through duplicates, a gap in a relay's stream and a store whose
//! parent the index does not hold.

mod common;

use kvgate_core::model::{ModelConfig, ModelState, Need};
use kvgate_index::Tier;
use kvgate_protocol::{BlockSeed, BlockSize, pb, sequence_hashes};
use kvgate_scheduler::Mode;

const WORKERS: u64 = 5;

fn state(index_shards: u16) -> ModelState {
    ModelState::new(ModelConfig { index_shards, ..common::config(Mode::Kv) }, 1)
}

fn tokens(doc: u64, blocks: usize) -> Vec<u32> {
    (0..blocks * 16).map(|i| (doc as u32).wrapping_mul(7919).wrapping_add(i as u32 * 31) % 50_000).collect()
}

fn batch(w: u64, relay_seq: u64, events: Vec<pb::kv_event::Event>) -> pb::KvEventBatch {
    pb::KvEventBatch {
        worker_id: format!("w{w}"),
        model: "m".into(),
        relay_epoch: 1,
        relay_seq,
        events: events.into_iter().map(|e| pb::KvEvent { event: Some(e) }).collect(),
        ..Default::default()
    }
}

fn store(hashes: std::ops::Range<u64>, parent: Option<u64>, token_ids: Vec<u32>) -> pb::kv_event::Event {
    pb::kv_event::Event::Stored(pb::BlockStored {
        engine_hashes: hashes.collect(),
        parent_engine_hash: parent,
        token_ids,
        block_size: 16,
        ..Default::default()
    })
}

fn remove(hashes: std::ops::Range<u64>) -> pb::kv_event::Event {
    pb::kv_event::Event::Removed(pb::BlockRemoved { engine_hashes: hashes.collect(), ..Default::default() })
}

/// Rounds of batches from five workers: each stores a document (some
/// shared between workers), later removes part of it; one batch is sent
/// twice, one worker skips a sequence number, one stores under a parent it
/// never had.
fn batches() -> Vec<pb::KvEventBatch> {
    let mut out = Vec::new();
    let mut seq = [0u64; WORKERS as usize];
    for round in 0..6u64 {
        for k in 0..WORKERS {
            let w = (k * 3 + round) % WORKERS;
            let s = &mut seq[w as usize];
            *s += 1;
            if w == 2 && round == 3 {
                *s += 1; // a gap: the relay's batch before this one was lost
            }
            let base = 1000 * (round + 1) + 100 * w;
            let doc = if w.is_multiple_of(2) { round } else { 100 + round * WORKERS + w };
            let mut events = vec![store(base..base + 8, None, tokens(doc, 8))];
            if round > 0 {
                let old = 1000 * round + 100 * w;
                events.push(remove(old + 4..old + 8));
            }
            if w == 4 && round == 2 {
                events.push(store(base + 50..base + 52, Some(999_999), tokens(7, 2)));
            }
            out.push(batch(w, *s, events));
            if w == 1 && round == 1 {
                out.push(batch(w, *s, vec![store(base..base + 8, None, tokens(doc, 8))]));
            }
        }
    }
    out
}

fn sorted(mut needs: Vec<Need>) -> Vec<Need> {
    needs.sort_by(|a, b| format!("{a:?}").cmp(&format!("{b:?}")));
    needs
}

#[test]
fn batches_applied_together_over_shards_equal_one_by_one() {
    let all = batches();
    let mut one = state(1);
    let want: Vec<Need> = all.iter().filter_map(|b| one.on_batch(b.clone(), 10)).collect();
    let mut sharded = state(3);
    let mut got = Vec::new();
    for group in all.chunks(7) {
        got.extend(sharded.on_batches(group.to_vec(), 10));
    }
    assert!(want.len() >= 2, "the gap and the unknown parent each ask for a snapshot: {want:?}");
    assert_eq!(sorted(got), sorted(want));
    assert_eq!(sharded.counters(), one.counters());
    assert_eq!(sharded.index().counters(), one.index().counters());
    assert!(one.index().counters().blocks_removed > 0);
    let bs = BlockSize::new(16).unwrap();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let name =
        |st: &ModelState, o: &kvgate_index::Overlap| (st.index().worker_name(o.worker).unwrap().to_owned(), o.blocks);
    let mut matched = 0;
    for doc in (0..6).chain(100..140) {
        let seqs = sequence_hashes(&tokens(doc, 8), bs, BlockSeed::BASE);
        one.index().find_matches(&seqs, Tier::Device, &mut a);
        sharded.index().find_matches(&seqs, Tier::Device, &mut b);
        let mut x: Vec<_> = a.iter().map(|o| name(&one, o)).collect();
        let mut y: Vec<_> = b.iter().map(|o| name(&sharded, o)).collect();
        x.sort();
        y.sort();
        assert_eq!(y, x, "document {doc}");
        matched += x.len();
    }
    assert!(matched > 5, "the documents are found: {matched}");
    sharded.index().check_invariants().unwrap();
}
