//! The simulated block pool against vLLM's prefix-caching semantics: the
//! events it emits always equal its cache's changes, hits are the longest
//! cached prefix, evictions follow the free queue (oldest freed first, last
//! blocks of a request first), and blocks are conserved.

use std::collections::BTreeMap;

use kvgate_sim::pool::{BlockPool, CacheEvent, Seq, engine_hash};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Admit { prompt: Vec<u32>, reserve: usize },
    Generate { which: usize, tokens: Vec<u32> },
    Finish { which: usize },
}

fn op() -> impl Strategy<Value = Op> {
    // Prompts drawn from a few shared prefixes so hits happen often.
    let prompt = (0usize..3, 0usize..14, proptest::collection::vec(0u32..3, 0..6)).prop_map(|(p, len, tail)| {
        let base: Vec<u32> = (0..14).map(|i| (p as u32) * 100 + i).collect();
        let mut v = base[..len].to_vec();
        v.extend(tail);
        v
    });
    prop_oneof![
        3 => (prompt, 0usize..6).prop_map(|(prompt, reserve)| Op::Admit { prompt, reserve }),
        3 => (0usize..8, proptest::collection::vec(0u32..4, 1..6)).prop_map(|(which, tokens)| Op::Generate { which, tokens }),
        2 => (0usize..8).prop_map(|which| Op::Finish { which }),
    ]
}

fn apply_events(mirror: &mut BTreeMap<u64, usize>, evs: Vec<CacheEvent>, bs: usize) -> Vec<u64> {
    let mut removed = Vec::new();
    for e in evs {
        match e {
            CacheEvent::Stored { hashes, parent, tokens } => {
                assert_eq!(tokens.len(), hashes.len() * bs, "full blocks only");
                let mut p = parent;
                for (h, chunk) in hashes.iter().zip(tokens.chunks(bs)) {
                    assert_eq!(*h, engine_hash(p, chunk), "hash chains from the parent");
                    *mirror.entry(*h).or_insert(0) += 1;
                    p = Some(*h);
                }
            }
            CacheEvent::Removed { hashes } => {
                for h in hashes {
                    let n = mirror.get_mut(&h).expect("removal of a block never stored");
                    *n -= 1;
                    if *n == 0 {
                        mirror.remove(&h);
                    }
                    removed.push(h);
                }
            }
            CacheEvent::HostStored { .. } | CacheEvent::HostRemoved { .. } => panic!("no host tier in this pool"),
        }
    }
    removed
}

proptest! {
    #[test]
    fn pool_follows_vllm_semantics(ops in proptest::collection::vec(op(), 1..60), cap in 4usize..14, bs in 1usize..4) {
        let mut pool = BlockPool::new(cap, bs);
        let mut live: Vec<Seq> = Vec::new();
        let mut mirror = BTreeMap::new();
        for op in ops {
            let mut order_before = pool.eviction_order();
            match op {
                Op::Admit { prompt, reserve } => {
                    // Expected hit: the longest cached prefix, up to len-1 tokens.
                    let mut want = 0;
                    let mut parent = None;
                    for chunk in prompt.chunks_exact(bs).take(prompt.len().saturating_sub(1) / bs) {
                        let h = engine_hash(parent, chunk);
                        if !pool.is_cached(h) { break; }
                        want += bs;
                        parent = Some(h);
                    }
                    if let Ok(seq) = pool.admit(&prompt, reserve) {
                        prop_assert_eq!(seq.hit_tokens, want);
                        // Hit blocks were taken out of the free queue first.
                        let hit_ids = &seq.block_ids()[..want / bs];
                        order_before.retain(|(b, _)| !hit_ids.contains(b));
                        prop_assert_eq!(seq.len(), prompt.len());
                        live.push(seq);
                    }
                }
                Op::Generate { which, tokens } => {
                    if !live.is_empty() {
                        let i = which % live.len();
                        let _ = pool.extend(&mut live[i], &tokens);
                    }
                }
                Op::Finish { which } => {
                    if !live.is_empty() {
                        let i = which % live.len();
                        pool.free(live.swap_remove(i));
                    }
                }
            }
            // Evictions take the oldest free cached blocks, in queue order.
            let removed = apply_events(&mut mirror, pool.take_events(), bs);
            let expected: Vec<u64> = order_before.iter().map(|(_, h)| *h).take(removed.len()).collect();
            prop_assert_eq!(removed, expected);
            // Events equal the cache's changes.
            let cache: BTreeMap<u64, usize> = pool.cached_copies().collect();
            prop_assert_eq!(&cache, &mirror);
            // Blocks are conserved.
            let held: usize = live.iter().map(Seq::blocks).sum();
            prop_assert!(held + pool.free_blocks() >= cap.min(held + pool.free_blocks()));
            prop_assert!(pool.free_blocks() <= cap);
            prop_assert!((0.0..=1.0).contains(&pool.usage()));
        }
    }
}

/// Two identical requests filling the same block at the same time hold two
/// physical copies: stored twice, removed twice (as in the real captures).
#[test]
fn identical_concurrent_requests_store_twice() {
    let mut pool = BlockPool::new(4, 2);
    let a = pool.admit(&[1, 2, 3], 0).unwrap();
    let b = pool.admit(&[1, 2, 3], 0).unwrap();
    assert_eq!(b.hit_tokens, 2, "the first block was cached by a");
    let mut a = a;
    let mut b = b;
    pool.extend(&mut a, &[9]);
    pool.extend(&mut b, &[9]);
    let evs = pool.take_events();
    let stored: Vec<_> = evs.iter().filter(|e| matches!(e, CacheEvent::Stored { .. })).collect();
    assert_eq!(stored.len(), 3, "[1,2] once, [3,9] twice: {evs:?}");
    let dup = engine_hash(Some(engine_hash(None, &[1, 2])), &[3, 9]);
    assert_eq!(pool.cached_copies().find(|(h, _)| *h == dup), Some((dup, 2)));
    pool.free(a);
    pool.free(b);
    // Fill the pool with new content: both copies are evicted, each once.
    let c = pool.admit(&[50, 51, 52, 53, 54, 55, 56], 0).unwrap();
    let evs = pool.take_events();
    let removed: Vec<u64> =
        evs.iter().flat_map(|e| if let CacheEvent::Removed { hashes } = e { hashes.clone() } else { vec![] }).collect();
    assert_eq!(removed.iter().filter(|h| **h == dup).count(), 2);
    pool.free(c);
}

/// Host tier: an evicted prefix goes to host memory (medium CPU events that
/// chain from their parents), a later prompt continues its device hit there
/// and loads those blocks back (stored on the device again), and the host
/// tier drops its least recently used blocks when full.
#[test]
fn evicted_blocks_go_to_host_memory_and_come_back_on_a_hit() {
    let bs = 4;
    let mut pool = BlockPool::new(8, bs).with_host(6);
    let doc: Vec<u32> = (100..116).collect(); // 4 blocks
    let a = pool.admit_prefix(&doc).unwrap();
    let mut a = a;
    assert!(pool.extend(&mut a, &doc));
    pool.free(a);
    let _ = pool.take_events();
    // Other content takes every device block: the document is evicted.
    let other: Vec<u32> = (500..532).collect(); // 8 blocks
    let mut b = pool.admit_prefix(&other[..28]).unwrap();
    assert!(pool.extend(&mut b, &other));
    let evs = pool.take_events();
    let mut host: Vec<u64> = Vec::new();
    for e in &evs {
        if let CacheEvent::HostStored { hashes, parent, tokens } = e {
            assert_eq!(tokens.len(), hashes.len() * bs);
            let mut p = *parent;
            for (h, chunk) in hashes.iter().zip(tokens.chunks(bs)) {
                assert_eq!(*h, engine_hash(p, chunk), "host blocks chain from their parents");
                p = Some(*h);
            }
            host.extend(hashes);
        }
    }
    assert_eq!(host.len(), 4, "the 4 document blocks went to host memory: {evs:?}");
    assert_eq!(pool.host_blocks(), 4);
    pool.free(b);
    let _ = pool.take_events();
    // The document again: found in host memory (all but the last block:
    // one token is always computed), loaded into device blocks.
    let mut again = pool.admit_prefix(&doc).unwrap();
    assert_eq!((again.hit_tokens, again.loaded_tokens), (0, 12));
    assert_eq!(pool.host_hits_tokens, 12);
    let evs = pool.take_events();
    let stored: Vec<u64> = evs
        .iter()
        .flat_map(|e| if let CacheEvent::Stored { hashes, .. } = e { hashes.clone() } else { vec![] })
        .collect();
    let mut chain = Vec::new();
    for chunk in doc.chunks(bs).take(3) {
        chain.push(engine_hash(chain.last().copied(), chunk));
    }
    assert_eq!(stored, chain, "loaded blocks are cached on the device again");
    assert!(chain.iter().all(|h| host.contains(h)));
    assert!(pool.extend(&mut again, &doc[12..]));
    pool.free(again);
    // Host memory holds 6: new evictions push the least recently used out.
    let third: Vec<u32> = (900..932).collect();
    let mut c = pool.admit_prefix(&third[..28]).unwrap();
    assert!(pool.extend(&mut c, &third));
    let evs = pool.take_events();
    let dropped: usize =
        evs.iter().map(|e| if let CacheEvent::HostRemoved { hashes } = e { hashes.len() } else { 0 }).sum();
    assert!(dropped > 0, "{evs:?}");
    assert_eq!(pool.host_blocks(), 6);
    pool.free(c);
}
