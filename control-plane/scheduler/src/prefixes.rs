//! The prompts of the requests in flight as one tree of shared prefixes,
//! with the requests of each worker that pass through every node: what a
//! worker's requests share with a new prompt is how deep the prompt's path
//! goes through nodes that worker's requests pass through.
//!
//! n = prompt blocks, d = nodes on a prompt's path (one per place where
//! prompts in flight part or end along it), W = workers with requests
//! through a node, S = workers with requests through the prompt's first
//! node.
//!
//! | operation | cost |
//! |---|---|
//! | [`Prefixes::add`] | d map lookups + O(n) sequential compares + d worker-list updates (O(log W), a shift when a worker is new there) + at most one node split (copies one worker list) |
//! | [`Prefixes::remove`] | d map lookups + d worker-list updates |
//! | [`Prefixes::shared`] (one worker) | d map lookups + O(n) compares + O(d · log W) |
//! | [`Prefixes::shares`] (every worker) | d map lookups + O(n) compares + the worker lists along the path (O(S) for a system prompt every request holds, then a few per node below it) |
//!
//! **Nodes.** A node is a run of blocks that the same requests in flight
//! hold: a request's prompt is a path from a first node down, and every
//! request ends where a node ends. Nodes are split where a new prompt
//! leaves a node or ends inside it, removed when no request passes through
//! them, and a node that one child continues with the same requests is
//! merged with it when the next prompt passes.
//!
//! **Keys.** A node is found in one map for the whole tree by its
//! parent's id and its first block's hash. Blocks are compared one by one,
//! not taken on trust from their hashes, so any prompts (chained hashes or
//! not, repeated hashes or not) give each worker the longest common prefix
//! with its requests, exactly. A split keeps the old id on the part that
//! keeps the children; a merge gives the merged node its child's id: no
//! child is ever rekeyed.
//!
//! Before this tree, each K-th block of every prompt was indexed with the
//! requests holding it, sorted per worker: a prompt's share was a binary
//! search per worker, 1.5 ms per Pick at 1,000 workers with 64 requests
//! each on one system prompt (docs/DECISIONS.md).

use std::collections::HashMap;

use foldhash::fast::RandomState;
use kvgate_index::WorkerIdx;
use kvgate_protocol::SequenceHash;

type Map<K, V> = HashMap<K, V, RandomState>;

/// A node's key: its parent's id (0 for none) and its first block.
type Key = (u64, SequenceHash);

#[derive(Debug)]
struct Node {
    /// Its children's keys start with it (never 0).
    id: u64,
    /// Position of its first block in every prompt through it.
    start: usize,
    /// Its blocks (at least one).
    blocks: Vec<SequenceHash>,
    /// Requests through it by worker (worker index, count), by worker.
    workers: Vec<(u32, u32)>,
    /// Requests through it (the counts' sum).
    total: u32,
    /// Nodes that continue it.
    children: u32,
}

impl Node {
    fn end(&self) -> usize {
        self.start + self.blocks.len()
    }

    /// How far `prompt` agrees with its blocks, as a position in `prompt`
    /// (from `start`; the prompt's block at `start` was in its key).
    fn agrees_until(&self, prompt: &[SequenceHash]) -> usize {
        let rest = prompt.get(self.start..).unwrap_or_default();
        self.start + self.blocks.iter().zip(rest).take_while(|(a, b)| a == b).count()
    }

    fn count_mut(&mut self, worker: u32) -> &mut u32 {
        let i = match self.workers.binary_search_by_key(&worker, |(w, _)| *w) {
            Ok(i) => i,
            Err(i) => {
                self.workers.insert(i, (worker, 0));
                i
            }
        };
        &mut self.workers[i].1
    }

    fn holds(&self, worker: u32) -> bool {
        self.workers.binary_search_by_key(&worker, |(w, _)| *w).is_ok()
    }
}

/// The tree (see the module documentation).
#[derive(Debug, Default)]
pub(crate) struct Prefixes {
    nodes: Map<Key, Node>,
    /// The last id given.
    last_id: u64,
}

impl Prefixes {
    /// The nodes along `prompt`, each with where the prompt stops agreeing
    /// with it (its end when the prompt goes on through it).
    fn path<'a>(&'a self, prompt: &'a [SequenceHash]) -> impl Iterator<Item = (&'a Node, usize)> + 'a {
        let mut at = Some((0, 0));
        std::iter::from_fn(move || {
            let (parent, pos) = at.take()?;
            let node = self.nodes.get(&(parent, *prompt.get(pos)?))?;
            let until = node.agrees_until(prompt);
            if until == node.end() {
                at = Some((node.id, until));
            }
            Some((node, until))
        })
    }

    /// What each worker's requests share with `prompt`: `out[w]` becomes
    /// the blocks worker `w` shares, for every worker that shares some
    /// (the vector grows as needed; others are left as they are).
    pub(crate) fn shares(&self, prompt: &[SequenceHash], out: &mut Vec<usize>) {
        for (node, until) in self.path(prompt) {
            for (w, _) in &node.workers {
                let w = *w as usize;
                if out.len() <= w {
                    out.resize(w + 1, 0);
                }
                // Deeper nodes come later and share more.
                out[w] = until;
            }
        }
    }

    /// What `worker`'s requests share with `prompt`.
    pub(crate) fn shared(&self, worker: WorkerIdx, prompt: &[SequenceHash]) -> usize {
        let mut shared = 0;
        for (node, until) in self.path(prompt) {
            if !node.holds(worker.0) {
                break;
            }
            shared = until;
        }
        shared
    }

    fn new_id(&mut self) -> u64 {
        self.last_id += 1;
        self.last_id
    }

    /// A request on `worker` with `prompt`. Returns what `worker`'s other
    /// requests shared with it ([`Prefixes::shared`] before the addition),
    /// read on the same walk.
    pub(crate) fn add(&mut self, worker: WorkerIdx, prompt: &[SequenceHash]) -> usize {
        let mut shared = 0;
        let mut pos = 0;
        let mut parent: Option<Key> = None;
        while let Some(first) = prompt.get(pos).copied() {
            let key = (parent.and_then(|p| self.nodes.get(&p)).map_or(0, |p| p.id), first);
            let Some(node) = self.nodes.get(&key) else {
                // A new branch: the rest of the prompt is one node.
                let blocks = prompt.get(pos..).unwrap_or_default().to_vec();
                let id = self.new_id();
                self.nodes
                    .insert(key, Node { id, start: pos, blocks, workers: vec![(worker.0, 1)], total: 1, children: 0 });
                if let Some(p) = parent.and_then(|p| self.nodes.get_mut(&p)) {
                    p.children += 1;
                }
                return shared;
            };
            let until = node.agrees_until(prompt);
            if until < node.end() {
                // Parts or ends inside: split there.
                self.split(key, until);
            } else if self.merge_into(key, prompt) {
                continue;
            }
            let Some(node) = self.nodes.get_mut(&key) else { return shared };
            if node.holds(worker.0) {
                shared = until;
            }
            *node.count_mut(worker.0) += 1;
            node.total += 1;
            parent = Some(key);
            pos = until;
        }
        shared
    }

    /// Splits the node at `key` at position `at`: its blocks from there
    /// become a child with the same requests, which keeps its id (and so
    /// its children); the head gets a new one.
    fn split(&mut self, key: Key, at: usize) {
        let head_id = self.new_id();
        let Some(node) = self.nodes.get_mut(&key) else { return };
        let blocks = node.blocks.split_off(at.saturating_sub(node.start).min(node.blocks.len()));
        let Some(first) = blocks.first().copied() else { return };
        let tail = Node {
            id: std::mem::replace(&mut node.id, head_id),
            start: at,
            blocks,
            workers: node.workers.clone(),
            total: node.total,
            children: node.children,
        };
        node.children = 1;
        self.nodes.insert((head_id, first), tail);
    }

    /// Merges into the node at `key` its one child on `prompt`'s path if
    /// that child has the same requests (no request ends at the node): the
    /// node takes the child's blocks, requests, children and id. Returns
    /// whether it did.
    fn merge_into(&mut self, key: Key, prompt: &[SequenceHash]) -> bool {
        let Some(node) = self.nodes.get(&key) else { return false };
        let Some(next) = prompt.get(node.end()).copied() else { return false };
        let child_key = (node.id, next);
        let total = node.total;
        if node.children != 1 || self.nodes.get(&child_key).is_none_or(|c| c.total != total) {
            return false;
        }
        let Some(child) = self.nodes.remove(&child_key) else { return false };
        let Some(node) = self.nodes.get_mut(&key) else { return false };
        node.blocks.extend_from_slice(&child.blocks);
        node.id = child.id;
        node.workers = child.workers;
        node.children = child.children;
        true
    }

    /// A request on `worker` with `prompt` is gone. Returns what `worker`'s
    /// other requests still share with it ([`Prefixes::shared`] after the
    /// removal), read on the same walk.
    pub(crate) fn remove(&mut self, worker: WorkerIdx, prompt: &[SequenceHash]) -> usize {
        let mut left = 0;
        let (mut pos, mut parent_id) = (0, 0);
        let mut parent: Option<Key> = None;
        while let Some(first) = prompt.get(pos).copied() {
            let key = (parent_id, first);
            let Some(node) = self.nodes.get_mut(&key).filter(|n| n.end() <= prompt.len()) else { return left };
            if let Ok(i) = node.workers.binary_search_by_key(&worker.0, |(w, _)| *w)
                && let Some((_, count)) = node.workers.get_mut(i)
            {
                *count = count.saturating_sub(1);
                if *count == 0 {
                    node.workers.remove(i);
                }
            }
            node.total = node.total.saturating_sub(1);
            if node.holds(worker.0) {
                left = node.end();
            }
            (pos, parent_id) = (node.end(), node.id);
            if node.total == 0 {
                // No request passes through it, so none through its children.
                self.nodes.remove(&key);
                if let Some(p) = parent.and_then(|p| self.nodes.get_mut(&p)) {
                    p.children = p.children.saturating_sub(1);
                }
            }
            parent = Some(key);
        }
        left
    }

    /// Nodes in the tree.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.nodes.len()
    }
}

#[cfg(test)]
mod tests {
    use super::{Prefixes, SequenceHash, WorkerIdx};
    use proptest::prelude::*;

    proptest! {
        /// Any prompts, chained or not, repeating hashes or not: each
        /// worker's share is the longest common prefix with one of its
        /// requests, and removing every request leaves no node behind.
        #[test]
        fn shares_are_the_longest_common_prefix_of_any_input(
            ops in prop::collection::vec((any::<bool>(), 0u32..3, prop::collection::vec(0u64..4, 1..10)), 1..80),
            queries in prop::collection::vec(prop::collection::vec(0u64..4, 0..12), 1..8),
        ) {
            let mut t = Prefixes::default();
            let mut live: Vec<(u32, Vec<SequenceHash>)> = Vec::new();
            for (add, w, p) in ops {
                if add || live.is_empty() {
                    let p = seq(&p);
                    let before = t.shared(WorkerIdx(w), &p);
                    prop_assert_eq!(t.add(WorkerIdx(w), &p), before);
                    live.push((w, p));
                } else {
                    let (w, p) = live.remove(p.len() % live.len());
                    let left = t.remove(WorkerIdx(w), &p);
                    prop_assert_eq!(left, t.shared(WorkerIdx(w), &p));
                }
            }
            for q in queries {
                let q = seq(&q);
                let mut all = Vec::new();
                t.shares(&q, &mut all);
                for w in 0..3u32 {
                    let lcp = |r: &Vec<SequenceHash>| r.iter().zip(&q).take_while(|(a, b)| a == b).count();
                    let want = live.iter().filter(|r| r.0 == w).map(|r| lcp(&r.1)).max().unwrap_or(0);
                    prop_assert_eq!(t.shared(WorkerIdx(w), &q), want);
                    prop_assert_eq!(all.get(w as usize).copied().unwrap_or(0), want);
                }
            }
            for (w, p) in live {
                t.remove(WorkerIdx(w), &p);
            }
            prop_assert_eq!(t.len(), 0);
        }
    }

    fn seq(v: &[u64]) -> Vec<SequenceHash> {
        v.iter().copied().map(SequenceHash).collect()
    }

    #[test]
    fn splits_on_parting_and_frees_everything_on_removal() {
        let mut t = Prefixes::default();
        let (a, b, c) = (seq(&[1, 2, 3, 4]), seq(&[1, 2, 5]), seq(&[1, 2]));
        t.add(WorkerIdx(0), &a);
        t.add(WorkerIdx(1), &b);
        t.add(WorkerIdx(2), &c);
        assert_eq!(t.len(), 3, "[1 2], [3 4], [5]");
        let mut out = Vec::new();
        t.shares(&seq(&[1, 2, 3, 9]), &mut out);
        assert_eq!(out, [3, 2, 2]);
        assert_eq!(t.shared(WorkerIdx(1), &seq(&[1, 2, 5, 6])), 3);
        assert_eq!(t.shared(WorkerIdx(3), &a), 0);
        t.remove(WorkerIdx(1), &b);
        t.remove(WorkerIdx(2), &c);
        // [1 2] now continues only into [3 4] with the same request: merged
        // when a prompt passes.
        t.add(WorkerIdx(3), &a);
        assert_eq!(t.len(), 1);
        t.remove(WorkerIdx(0), &a);
        t.remove(WorkerIdx(3), &a);
        assert_eq!(t.len(), 0);
    }

    #[test]
    fn a_hash_repeated_at_another_place_is_another_node() {
        let mut t = Prefixes::default();
        let (twice, short, other) = (seq(&[7, 8, 7, 9]), seq(&[7, 8]), seq(&[7, 8, 7, 6]));
        t.add(WorkerIdx(0), &twice);
        // The tail [7 9] starts with the head's own first hash.
        t.add(WorkerIdx(1), &short);
        t.add(WorkerIdx(2), &other);
        assert_eq!(t.len(), 4, "[7 8], [7], [9], [6]");
        let mut out = Vec::new();
        t.shares(&seq(&[7, 8, 7, 9, 1]), &mut out);
        assert_eq!(out, [4, 2, 3]);
        for (w, p) in [(0, &twice), (1, &short), (2, &other)] {
            t.remove(WorkerIdx(w), p);
        }
        assert_eq!(t.len(), 0);
    }
}
