//! Property test: for any sequence of events, the index agrees with a naive
//! model (per worker, a plain map engine hash → (sequence hash, refs)) on
//! what each worker holds and on `find_matches` (each tier, and any tier),
//! and its internal invariants
//! hold after every step.
//!
//! The universe is tiny on purpose (4 workers, 16 engine hashes, 3 distinct
//! token blocks of size 2, chains up to 6 blocks, queries up to 12) so that shared prefixes, aliases (two engine
//! hashes for one sequence hash), duplicates, conflicts, unknown parents and
//! removals of unknown hashes all happen often.

use std::collections::BTreeMap;

use kvgate_index::{Index, IndexConfig, KvEvent, Origin, Overlap, Skip, Stored, Tier, WorkerIdx};
use kvgate_protocol::{BlockSeed, BlockSize, EngineBlockHash, SequenceHash, local_block_hash, next_sequence_hash};
use proptest::prelude::*;

const BS: u32 = 2;
const BLOCKS: [[u32; 2]; 3] = [[1, 2], [3, 4], [5, 6]];
const MAX_REFS: u16 = 3;

#[derive(Debug, Clone)]
enum Op {
    Store {
        worker: usize,
        hashes: Vec<u64>,
        parent: Option<u64>,
        blocks: Vec<usize>,
        salt: bool,
        tier: Tier,
        origin: Origin,
    },
    BadStore {
        worker: usize,
        wrong_size: bool,
    },
    Remove {
        worker: usize,
        hashes: Vec<u64>,
        tier: Tier,
    },
    Clear {
        worker: usize,
    },
    /// `Index::clear_part`: up to `max` of the worker's entries dropped.
    ClearPart {
        worker: usize,
        max: usize,
    },
    RemoveWorker {
        worker: usize,
    },
    Query {
        blocks: Vec<usize>,
        salt: bool,
        tier: Tier,
    },
}

fn tier() -> impl Strategy<Value = Tier> {
    prop_oneof![4 => Just(Tier::Device), 1 => Just(Tier::Host)]
}

fn op() -> impl Strategy<Value = Op> {
    let worker = 0usize..4;
    let hash = 0u64..16;
    prop_oneof![
        6 => (worker.clone(), 1usize..7, proptest::option::weighted(0.6, hash.clone()), any::<bool>(), tier(),
              prop_oneof![Just(Origin::Unspecified), Just(Origin::New), Just(Origin::Reused)],
              proptest::collection::vec(hash.clone(), 6), proptest::collection::vec(0usize..3, 6))
            .prop_map(|(worker, n, parent, salt, tier, origin, hs, bl)| Op::Store {
                worker, hashes: hs[..n].to_vec(), parent, blocks: bl[..n].to_vec(), salt: salt && n == 1, tier, origin,
            }),
        1 => (worker.clone(), any::<bool>()).prop_map(|(worker, wrong_size)| Op::BadStore { worker, wrong_size }),
        4 => (worker.clone(), proptest::collection::vec(hash, 1..3), tier())
            .prop_map(|(worker, hashes, tier)| Op::Remove { worker, hashes, tier }),
        1 => worker.clone().prop_map(|worker| Op::Clear { worker }),
        1 => (worker.clone(), 0usize..4).prop_map(|(worker, max)| Op::ClearPart { worker, max }),
        1 => worker.prop_map(|worker| Op::RemoveWorker { worker }),
        4 => (proptest::collection::vec(0usize..3, 0..13), any::<bool>(), tier())
            .prop_map(|(blocks, salt, tier)| Op::Query { blocks, salt, tier }),
    ]
}

fn seed(salt: bool) -> BlockSeed {
    BlockSeed::new(None, salt.then_some("tenant-a"))
}

/// The naive model of one worker.
#[derive(Default, Debug, Clone)]
struct NaiveWorker {
    held: BTreeMap<(Tier, u64), (SequenceHash, u16)>,
}

impl NaiveWorker {
    fn parent_seq(&self, parent: u64) -> Option<SequenceHash> {
        Tier::ALL.iter().find_map(|t| self.held.get(&(*t, parent)).map(|e| e.0))
    }
    fn holds(&self, tier: Tier, seq: SequenceHash) -> bool {
        self.held.iter().any(|((t, _), (s, _))| *t == tier && *s == seq)
    }
}

fn names() -> [&'static str; 4] {
    ["w0", "10.0.0.1:8000", "w2", "w3"]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    fn index_equals_naive_model(ops in proptest::collection::vec(op(), 1..80), shards in 1u16..=3) {
        let mut index = Index::new(IndexConfig { block_size: BlockSize::new(BS).unwrap(), max_refs: MAX_REFS, shards });
        let mut model: Vec<NaiveWorker> = vec![NaiveWorker::default(); 4];
        for name in names() {
            index.add_worker(name);
        }
        let mut out = Vec::new();
        for op in ops {
            match op {
                Op::Store { worker, hashes, parent, blocks, salt, tier, origin } => {
                    let w = index.worker(names()[worker]).unwrap();
                    let tokens: Vec<u32> = blocks.iter().flat_map(|b| BLOCKS[*b]).collect();
                    let ev = KvEvent::Stored(Stored {
                        engine_hashes: &hashes, parent, token_ids: &tokens, block_size: BS, seed: seed(salt), tier, origin,
                    });
                    let r = index.apply(w, &ev);
                    let m = &mut model[worker];
                    let mut prev = match parent {
                        None => None,
                        Some(p) => match m.parent_seq(p) {
                            Some(s) => Some(s),
                            None => {
                                prop_assert_eq!(r, Err(Skip::UnknownParent));
                                prop_assert!(index.take_resync(w));
                                continue;
                            }
                        },
                    };
                    prop_assert_eq!(r, Ok(()));
                    for (h, b) in hashes.iter().zip(&blocks) {
                        let seq = next_sequence_hash(prev, local_block_hash(&BLOCKS[*b], seed(salt)));
                        prev = Some(seq);
                        match m.held.get_mut(&(tier, *h)) {
                            Some(e) if e.0 == seq => {
                                if origin != Origin::Reused && e.1 < MAX_REFS { e.1 += 1; }
                            }
                            Some(e) => *e = (seq, 1),
                            None => { m.held.insert((tier, *h), (seq, 1)); }
                        }
                    }
                }
                Op::BadStore { worker, wrong_size } => {
                    let w = index.worker(names()[worker]).unwrap();
                    let (bs, tokens) = if wrong_size { (BS * 2, vec![1, 2, 3, 4]) } else { (BS, vec![1, 2, 3]) };
                    let ev = KvEvent::Stored(Stored {
                        engine_hashes: &[7], parent: None, token_ids: &tokens, block_size: bs,
                        seed: BlockSeed::BASE, tier: Tier::Device, origin: Origin::New,
                    });
                    let r = index.apply(w, &ev);
                    if wrong_size {
                        prop_assert_eq!(r, Err(Skip::BlockSize { got: BS * 2, want: BS }));
                    } else {
                        prop_assert_eq!(r, Err(Skip::Malformed));
                    }
                }
                Op::Remove { worker, hashes, tier } => {
                    let w = index.worker(names()[worker]).unwrap();
                    prop_assert_eq!(index.apply(w, &KvEvent::Removed { engine_hashes: &hashes, tier }), Ok(()));
                    let m = &mut model[worker];
                    for h in hashes {
                        if let Some(e) = m.held.get_mut(&(tier, h)) {
                            e.1 -= 1;
                            if e.1 == 0 { m.held.remove(&(tier, h)); }
                        }
                    }
                }
                Op::Clear { worker } => {
                    let w = index.worker(names()[worker]).unwrap();
                    prop_assert_eq!(index.apply(w, &KvEvent::Cleared), Ok(()));
                    model[worker].held.clear();
                }
                Op::ClearPart { worker, max } => {
                    // The entries dropped are the index's choice: the model
                    // drops those the index no longer holds, as many as asked.
                    let w = index.worker(names()[worker]).unwrap();
                    let m = &mut model[worker];
                    let before = m.held.len();
                    let left = index.clear_part(w, max);
                    m.held.retain(|(t, h), _| index.engine_entry(w, *t, EngineBlockHash(*h)).is_some());
                    prop_assert_eq!(before - m.held.len(), max.min(before));
                    prop_assert_eq!(left, Some(m.held.len()));
                }
                Op::RemoveWorker { worker } => {
                    let w = index.worker(names()[worker]).unwrap();
                    prop_assert!(index.remove_worker(w));
                    prop_assert_eq!(index.apply(w, &KvEvent::Cleared), Err(Skip::UnknownWorker));
                    model[worker].held.clear();
                    index.add_worker(names()[worker]);
                }
                Op::Query { blocks, salt, tier } => {
                    let mut seqs = Vec::new();
                    let mut prev = None;
                    for b in &blocks {
                        let s = next_sequence_hash(prev, local_block_hash(&BLOCKS[*b], seed(salt)));
                        seqs.push(s);
                        prev = Some(s);
                    }
                    let by_name = |out: &[Overlap]| -> BTreeMap<String, u32> {
                        out.iter()
                            .map(|Overlap { worker, blocks }| (index.worker_name(*worker).unwrap().to_owned(), *blocks))
                            .collect()
                    };
                    index.find_matches(&seqs, tier, &mut out);
                    let got = by_name(&out);
                    prop_assert_eq!(got.len(), out.len(), "a worker reported twice");
                    let mut want = BTreeMap::new();
                    for (i, m) in model.iter().enumerate() {
                        let n = seqs.iter().take_while(|s| m.holds(tier, **s)).count() as u32;
                        if n > 0 { want.insert(names()[i].to_owned(), n); }
                    }
                    prop_assert_eq!(got, want);
                    // Any tier: a leading run held block by block in one tier or the other.
                    index.find_matches_any_tier(&seqs, &mut out);
                    let got = by_name(&out);
                    prop_assert_eq!(got.len(), out.len(), "a worker reported twice (any tier)");
                    let mut want = BTreeMap::new();
                    for (i, m) in model.iter().enumerate() {
                        let n = seqs.iter().take_while(|s| Tier::ALL.iter().any(|t| m.holds(*t, **s))).count() as u32;
                        if n > 0 { want.insert(names()[i].to_owned(), n); }
                    }
                    prop_assert_eq!(got, want, "any tier");
                }
            }
            if let Err(e) = index.check_invariants() {
                prop_assert!(false, "invariant: {}", e);
            }
            // Same holdings, entry by entry.
            for (i, m) in model.iter().enumerate() {
                let w = index.worker(names()[i]).unwrap();
                for t in Tier::ALL {
                    let n = m.held.keys().filter(|(tt, _)| *tt == t).count();
                    prop_assert_eq!(index.worker_blocks(w, t), n);
                }
                for ((t, h), (seq, refs)) in &m.held {
                    prop_assert_eq!(index.engine_entry(w, *t, EngineBlockHash(*h)), Some((*seq, *refs)));
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// `apply_batch` over three shards (threads) leaves the same index as
    /// `apply` one event at a time on one shard: the same result for every
    /// event, counters, holdings and answers to every query.
    #[test]
    fn batches_over_shards_equal_events_one_by_one(
        ops in proptest::collection::vec(op(), 1..120),
        cuts in proptest::collection::vec(1usize..40, 1..8),
    ) {
        let config = |shards| IndexConfig { block_size: BlockSize::new(BS).unwrap(), max_refs: MAX_REFS, shards };
        let (mut one, mut sharded) = (Index::new(config(1)), Index::new(config(3)));
        for name in names() {
            one.add_worker(name);
            sharded.add_worker(name);
        }
        let tokens: Vec<Vec<u32>> = ops.iter().map(|op| match op {
            Op::Store { blocks, .. } => blocks.iter().flat_map(|b| BLOCKS[*b]).collect(),
            _ => Vec::new(),
        }).collect();
        let events: Vec<(usize, KvEvent<'_>)> = ops.iter().zip(&tokens).filter_map(|(op, tokens)| match op {
            Op::Store { worker, hashes, parent, salt, tier, origin, .. } => Some((*worker, KvEvent::Stored(Stored {
                engine_hashes: hashes, parent: *parent, token_ids: tokens, block_size: BS, seed: seed(*salt),
                tier: *tier, origin: *origin,
            }))),
            Op::Remove { worker, hashes, tier } => Some((*worker, KvEvent::Removed { engine_hashes: hashes, tier: *tier })),
            Op::Clear { worker } => Some((*worker, KvEvent::Cleared)),
            _ => None,
        }).collect();
        let want: Vec<_> = events.iter().map(|(w, e)| one.apply(one.worker(names()[*w]).unwrap(), e)).collect();
        let mut got = Vec::new();
        let mut rest = events.as_slice();
        for cut in cuts.iter().cycle() {
            if rest.is_empty() { break; }
            let (batch, tail) = rest.split_at((*cut).min(rest.len()));
            let batch: Vec<_> = batch.iter().map(|(w, e)| (sharded.worker(names()[*w]).unwrap(), *e)).collect();
            // Spare buckets made ahead for the tables the batch may grow
            // (as the control plane's ingest does) change no outcome.
            let stores: Vec<_> = batch.iter().filter_map(|(w, e)| match e {
                KvEvent::Stored(s) => Some((*w, s.tier, s.engine_hashes.len())),
                _ => None,
            }).collect();
            let spares = sharded.spares_for(&stores);
            sharded.give_spares(spares);
            got.extend(sharded.apply_batch(&batch));
            rest = tail;
        }
        prop_assert_eq!(got, want);
        prop_assert_eq!(sharded.counters(), one.counters());
        if let Err(e) = sharded.check_invariants() {
            prop_assert!(false, "invariant: {}", e);
        }
        for name in names() {
            let (a, b) = (one.worker(name).unwrap(), sharded.worker(name).unwrap());
            prop_assert_eq!(sharded.worker_name(b), Some(name));
            for t in Tier::ALL {
                prop_assert_eq!(sharded.worker_blocks(b, t), one.worker_blocks(a, t));
                for h in 0..16 {
                    prop_assert_eq!(sharded.engine_entry(b, t, EngineBlockHash(h)), one.engine_entry(a, t, EngineBlockHash(h)));
                }
            }
        }
        let (mut out_one, mut out_sharded) = (Vec::new(), Vec::new());
        let by_name = |index: &Index, out: &[Overlap]| -> Vec<(String, u32)> {
            let mut v: Vec<_> = out.iter().map(|o| (index.worker_name(o.worker).unwrap().to_owned(), o.blocks)).collect();
            v.sort();
            v
        };
        for query in 0..(3usize.pow(4)) {
            for salt in [false, true] {
                let mut seqs = Vec::new();
                let mut prev = None;
                let (mut q, mut depth) = (query, 0);
                while depth < 4 {
                    let s = next_sequence_hash(prev, local_block_hash(&BLOCKS[q % 3], seed(salt)));
                    seqs.push(s);
                    prev = Some(s);
                    q /= 3;
                    depth += 1;
                }
                for tier in Tier::ALL {
                    one.find_matches(&seqs, tier, &mut out_one);
                    sharded.find_matches(&seqs, tier, &mut out_sharded);
                    prop_assert_eq!(by_name(&sharded, &out_sharded), by_name(&one, &out_one));
                }
                one.find_matches_any_tier(&seqs, &mut out_one);
                sharded.find_matches_any_tier(&seqs, &mut out_sharded);
                prop_assert_eq!(by_name(&sharded, &out_sharded), by_name(&one, &out_one), "any tier");
            }
        }
    }
}

/// Real-capture behaviour: one hash stored twice (two physical copies) needs
/// two removals; a REUSED re-report adds no reference; the reference cap
/// bounds re-reports without an origin.
#[test]
fn duplicate_stores_and_reused_reports() {
    let bs = BlockSize::new(2).unwrap();
    let mut index = Index::new(IndexConfig::new(bs));
    let w = index.add_worker("w");
    let tokens = [9, 9];
    let seq = next_sequence_hash(None, local_block_hash(&tokens, BlockSeed::BASE));
    let store = |origin| {
        KvEvent::Stored(Stored {
            engine_hashes: &[42],
            parent: None,
            token_ids: &tokens,
            block_size: 2,
            seed: BlockSeed::BASE,
            tier: Tier::Device,
            origin,
        })
    };
    let removed = KvEvent::Removed { engine_hashes: &[42], tier: Tier::Device };
    let mut out = Vec::new();
    index.apply(w, &store(Origin::Unspecified)).unwrap();
    index.apply(w, &store(Origin::Unspecified)).unwrap();
    index.apply(w, &store(Origin::Reused)).unwrap();
    assert_eq!(index.engine_entry(w, Tier::Device, EngineBlockHash(42)), Some((seq, 2)));
    index.apply(w, &removed).unwrap();
    index.find_matches(&[seq], Tier::Device, &mut out);
    assert_eq!(out, vec![Overlap { worker: w, blocks: 1 }], "one copy left");
    index.apply(w, &removed).unwrap();
    index.find_matches(&[seq], Tier::Device, &mut out);
    assert!(out.is_empty());
    // A removal of a hash never stored is counted, not an error.
    index.apply(w, &removed).unwrap();
    assert_eq!(index.counters().unknown_removals, 1);
    // Re-reports without origin are capped at max_refs (4).
    for _ in 0..10 {
        index.apply(w, &store(Origin::Unspecified)).unwrap();
    }
    assert_eq!(index.engine_entry(w, Tier::Device, EngineBlockHash(42)), Some((seq, 4)));
    assert_eq!(index.counters().refs_capped, 6);
}

/// A host block stored under a parent the worker holds on its device, whose
/// engine hash the host tier holds for another block (an engine hash reused
/// with other content): the host chain has a hole where the device parent
/// is, and a host query stops there. (Found by the sharded property test in
/// CI: the host entry under the parent's hash was taken for the parent, so
/// the host holdings read as prefix-closed and the query galloped past the
/// hole.)
#[test]
fn a_host_chain_under_a_device_parent_stops_where_the_host_lacks_it() {
    let mut index = Index::new(IndexConfig::new(BlockSize::new(BS).unwrap()));
    let w = index.add_worker("w");
    let store = |index: &mut Index, hashes: &[u64], parent: Option<u64>, blocks: &[usize], tier: Tier| {
        let tokens: Vec<u32> = blocks.iter().flat_map(|b| BLOCKS[*b]).collect();
        let ev = KvEvent::Stored(Stored {
            engine_hashes: hashes,
            parent,
            token_ids: &tokens,
            block_size: BS,
            seed: seed(false),
            tier,
            origin: Origin::Unspecified,
        });
        index.apply(w, &ev).unwrap();
    };
    // Host: engine hash 2 is the block [2].
    store(&mut index, &[2, 4], None, &[2, 0], Tier::Host);
    // Device: engine hash 2 is the block [2, 0, 0].
    store(&mut index, &[0, 0, 2], None, &[2, 0, 0], Tier::Device);
    // Host: [2, 0, 0] + [0] and + [0, 0], under the device's block 2.
    store(&mut index, &[5, 0], Some(2), &[0, 0], Tier::Host);
    index.check_invariants().unwrap();
    let mut seqs = Vec::new();
    let mut prev = None;
    for b in [2, 0, 0, 0] {
        let s = next_sequence_hash(prev, local_block_hash(&BLOCKS[b], seed(false)));
        seqs.push(s);
        prev = Some(s);
    }
    let mut out = Vec::new();
    index.find_matches(&seqs, Tier::Host, &mut out);
    assert_eq!(out, vec![Overlap { worker: w, blocks: 2 }], "the host lacks the third block");
    index.find_matches_any_tier(&seqs, &mut out);
    assert_eq!(out, vec![Overlap { worker: w, blocks: 4 }], "the device holds it");
}

/// A worker that reports more device blocks than its capacity is trimmed,
/// oldest stores first.
#[test]
fn capacity_bounds_stale_blocks() {
    let bs = BlockSize::new(1).unwrap();
    let mut index = Index::new(IndexConfig::new(bs));
    let w = index.add_worker("w");
    for i in 0..100u32 {
        let ev = KvEvent::Stored(Stored {
            engine_hashes: &[u64::from(i)],
            parent: None,
            token_ids: &[i],
            block_size: 1,
            seed: BlockSeed::BASE,
            tier: Tier::Device,
            origin: Origin::New,
        });
        index.apply(w, &ev).unwrap();
    }
    index.set_capacity(w, Some(64));
    let held = index.worker_blocks(w, Tier::Device);
    assert!((60..=64).contains(&held), "held {held}");
    // The newest survive.
    assert!(index.engine_entry(w, Tier::Device, EngineBlockHash(99)).is_some());
    assert!(index.engine_entry(w, Tier::Device, EngineBlockHash(0)).is_none());
    assert_eq!(index.counters().capacity_evictions as usize, 100 - held);
    index.check_invariants().unwrap();
}

/// Spare buckets are made only for a table the stores may grow by one
/// doubling, are counted in the index's memory once given, and are not kept
/// beside the grown table.
#[test]
fn spares_are_made_for_tables_about_to_grow() {
    let bs = BlockSize::new(1).unwrap();
    let mut index = Index::new(IndexConfig::new(bs));
    let w = index.add_worker("w");
    assert!(index.spares_for(&[(w, Tier::Device, 1)]).is_empty(), "an empty table is far from its limit");
    assert!(index.spares_for(&[(w, Tier::Device, 1_000)]).is_empty(), "more than one doubling");
    assert!(index.spares_for(&[(WorkerIdx(7), Tier::Device, 8)]).is_empty(), "no such worker");
    let tokens: Vec<u32> = (0..2_000).collect();
    let store = |index: &mut Index, h: u64| {
        let stored = Stored {
            engine_hashes: &[h],
            parent: h.checked_sub(1),
            token_ids: &tokens[h as usize..h as usize + 1],
            block_size: 1,
            seed: BlockSeed::BASE,
            tier: Tier::Device,
            origin: Origin::New,
        };
        index.apply(w, &KvEvent::Stored(stored)).unwrap();
    };
    let mut h = 0;
    while h < 1_000 || index.spares_for(&[(w, Tier::Device, 8)]).is_empty() {
        store(&mut index, h);
        h += 1;
    }
    // One store fewer was within the limit with 8 more; now 4 more are,
    // and two stores of 4 add up to 8.
    assert!(index.spares_for(&[(w, Tier::Device, 4)]).is_empty());
    // The one chain is one run: its heads map has room for two more, so 8
    // stores (each may start a run) get a copy with room, 1 store none.
    assert_eq!(index.spares_for(&[(w, Tier::Device, 8)]).heads(), 1);
    assert_eq!(index.spares_for(&[(w, Tier::Device, 1)]).heads(), 0);
    assert!(index.spares_for(&[(w, Tier::Host, 8)]).is_empty(), "the other tier's table");
    let spares = index.spares_for(&[(w, Tier::Device, 4), (w, Tier::Host, 1), (w, Tier::Device, 4)]);
    assert_eq!(spares.len(), 1);
    let before = index.approx_heap_bytes();
    index.give_spares(spares);
    let given = index.approx_heap_bytes() - before;
    assert!(given >= 2 * h as usize * 8, "{given} bytes for {h} blocks");
    for _ in 0..8 {
        store(&mut index, h);
        h += 1;
    }
    // The table grew within the 8 stores, and the spare is not held beside
    // it: the memory is what it was plus the spare, less the old buckets.
    assert!(index.approx_heap_bytes() < before + given, "grown, and no spare kept beside the table");
    assert_eq!(index.worker_blocks(w, Tier::Device), h as usize);
    if let Err(e) = index.check_invariants() {
        panic!("invariant: {e}");
    }
}
