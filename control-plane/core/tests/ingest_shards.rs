//! KV batches applied together over a sharded index (`ingest_stream`, index
//! shards on parallel threads) leave the model as applying them one by one
//! on one shard (`on_batch`) does: the same snapshot needs, counters and
//! matches, through duplicates, a gap in a relay's stream and a store whose
//! parent the index does not hold.

mod common;

use common::{batches, tokens};

use kvgate_core::model::stream::{StreamMessage, ingest_stream};
use kvgate_core::model::{ModelConfig, ModelState, Need};
use kvgate_index::Tier;
use kvgate_protocol::{BlockSeed, BlockSize, sequence_hashes};
use kvgate_scheduler::Mode;

fn state(index_shards: u16) -> ModelState {
    ModelState::new(ModelConfig { index_shards, ..common::config(Mode::Kv) }, 1)
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
    let sharded = parking_lot::Mutex::new(state(3));
    let mut got = Vec::new();
    for group in all.chunks(7) {
        let msgs = group.iter().cloned().map(StreamMessage::Kv).collect();
        got.extend(ingest_stream(&sharded, msgs, 10, |_| {}).needs);
    }
    let sharded = sharded.into_inner();
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
