//! The in-flight share and the distinct blocks in flight, kept in a tree
//! of the prompts in flight, against a naive model that walks every live request: random
//! prompts that are prefixes of a few shared chains (or of a chain that
//! leaves another one), routed to random workers with random overlaps, some
//! past their first token, some done, on up to 40 workers.

use kvgate_index::WorkerIdx;
use kvgate_protocol::SequenceHash;
use kvgate_scheduler::{InflightShare, LoadTracker};
use proptest::prelude::*;

/// A live request of the model: worker, prompt, own_from, prefilling.
type Live = (u32, Vec<SequenceHash>, usize, bool);

fn naive(live: &[Live], worker: u32, prompt: &[SequenceHash]) -> InflightShare {
    let on: Vec<&Live> = live.iter().filter(|r| r.0 == worker).collect();
    let mut s = InflightShare::default();
    for h in prompt {
        if !on.iter().any(|r| r.1.contains(h)) {
            break;
        }
        s.blocks += 1;
        s.computing += u32::from(on.iter().any(|r| r.3 && r.1[r.2.min(r.1.len())..].contains(h)));
    }
    s
}

/// Distinct prompt blocks in flight on `worker`.
fn naive_distinct(live: &[Live], worker: u32) -> u64 {
    let mut all: Vec<SequenceHash> = live.iter().filter(|r| r.0 == worker).flat_map(|r| r.1.clone()).collect();
    all.sort_unstable_by_key(|h| h.0);
    all.dedup();
    all.len() as u64
}

/// Chain `c`'s first `n` blocks (a prefix of a chain is what a prompt that
/// extends a shared document looks like). Chains 0–2 share nothing; chain
/// `3 + k` follows chain 0 for its first `7 * k + 1` blocks, then leaves it
/// (a shared system prompt, then another document), as chained hashes do.
fn chain(c: u64, n: usize) -> Vec<SequenceHash> {
    let fork = if c >= 3 { 7 * (c - 3) + 1 } else { 0 };
    (0..n as u64).map(|i| SequenceHash(if i < fork { i } else { c << 32 | i })).collect()
}

/// Replays `ops` on the tracker and on the model, on `workers` workers
/// (each op's worker taken modulo it), then checks every query's shares.
fn check(
    ops: Vec<(u8, u32, u64, usize, usize)>,
    queries: Vec<(u64, usize)>,
    workers: u32,
) -> Result<(), TestCaseError> {
    let mut t = LoadTracker::new();
    let mut live: Vec<(String, Live)> = Vec::new();
    for (k, (op, w, c, n, own)) in ops.into_iter().enumerate() {
        let w = w % workers;
        match op {
            0 | 1 => {
                let id = format!("r{k}");
                let prompt = chain(c, n);
                t.added(&id, WorkerIdx(w), &prompt, own as u32, 1, 0).unwrap();
                live.push((id, (w, prompt, own.min(n), true)));
            }
            2 if !live.is_empty() => {
                let i = n % live.len();
                t.first_token(&live[i].0).unwrap();
                live[i].1.3 = false;
            }
            3 if !live.is_empty() => {
                let i = n % live.len();
                t.done(&live[i].0).unwrap();
                live.remove(i);
            }
            _ => {}
        }
    }
    if live.len() > 3 && workers > 1 {
        // Forget a worker altogether.
        let gone = live[0].1.0;
        t.remove_worker(WorkerIdx(gone));
        live.retain(|r| r.1.0 != gone);
    }
    let model: Vec<Live> = live.into_iter().map(|r| r.1).collect();
    for (c, n) in queries {
        let prompt = chain(c, n);
        let all = t.inflight_shares(&prompt);
        for w in 0..workers {
            let want = naive(&model, w, &prompt);
            let load = t.load(WorkerIdx(w));
            let outputs = model.iter().filter(|r| r.0 == w).count() as u64;
            prop_assert_eq!(load.active_blocks, naive_distinct(&model, w) + outputs);
            prop_assert_eq!(t.inflight_share(WorkerIdx(w), &prompt), want);
            prop_assert_eq!(all.get(w as usize).copied().unwrap_or_default(), want);
        }
    }
    Ok(())
}

proptest! {
    #[test]
    fn inverted_shares_equal_the_naive_walk(
        // Up to 40 workers: nodes with many workers' requests.
        // Prompts up to 100 blocks: chains that part at many places.
        ops in prop::collection::vec((0u8..4, 0u32..40, 0u64..8, 1usize..100, 0usize..100), 1..400),
        queries in prop::collection::vec((0u64..8, 1usize..110), 1..6),
    ) {
        check(ops, queries, 40)?;
    }

    /// Two workers: dozens of requests on one worker through the same
    /// nodes, which split and merge as they come and go.
    #[test]
    fn crowded_shares_equal_the_naive_walk(
        ops in prop::collection::vec((0u8..4, 0u32..2, 0u64..8, 1usize..100, 0usize..100), 1..300),
        queries in prop::collection::vec((0u64..8, 1usize..110), 1..6),
    ) {
        check(ops, queries, 2)?;
    }
}
