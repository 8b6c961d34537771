//! Arbitrary event sequences (any hashes, parents, token counts, block sizes,
//! tiers, origins, capacities, worker removals) never panic the index and
//! never break its invariants; queries never report a worker twice.
#![no_main]

use kvgate_index::{Index, IndexConfig, KvEvent, Origin, Stored, Tier};
use kvgate_protocol::{BlockSeed, BlockSize, SequenceHash};
use libfuzzer_sys::fuzz_target;

struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(*b)
    }
}

fuzz_target!(|data: &[u8]| {
    let mut b = Bytes(data);
    let Some(bs) = b.byte() else { return };
    let bs = BlockSize::new(u32::from(bs % 4) + 1).unwrap();
    let mut index = Index::new(IndexConfig { block_size: bs, max_refs: 3, shards: 2 });
    let names = ["a", "b", "c"];
    for n in names {
        index.add_worker(n);
    }
    let mut out = Vec::new();
    while let Some(op) = b.byte() {
        let w = index.worker(names[usize::from(op >> 6) % 3]).unwrap();
        let tier = if op & 0x20 != 0 { Tier::Host } else { Tier::Device };
        match op % 8 {
            0..=2 => {
                let n = usize::from(b.byte().unwrap_or(1) % 4);
                let hashes: Vec<u64> = (0..n).map(|_| u64::from(b.byte().unwrap_or(0) % 16)).collect();
                let parent = b.byte().and_then(|p| (p < 128).then_some(u64::from(p % 16)));
                let extra = b.byte().unwrap_or(0);
                let len = n * bs.as_usize() + usize::from(extra % 8 == 0);
                let tokens: Vec<u32> = (0..len).map(|_| u32::from(b.byte().unwrap_or(0) % 4)).collect();
                let block_size = if extra % 16 == 1 { bs.get() + 1 } else { bs.get() };
                let origin = match extra % 3 { 0 => Origin::Unspecified, 1 => Origin::New, _ => Origin::Reused };
                let salt = (extra & 0x40 != 0).then_some("s");
                let ev = KvEvent::Stored(Stored {
                    engine_hashes: &hashes, parent, token_ids: &tokens, block_size,
                    seed: BlockSeed::new(None, salt), tier, origin,
                });
                let _ = index.apply(w, &ev);
            }
            3 | 4 => {
                let hashes: Vec<u64> = (0..usize::from(op % 3)).map(|_| u64::from(b.byte().unwrap_or(0) % 16)).collect();
                let _ = index.apply(w, &KvEvent::Removed { engine_hashes: &hashes, tier });
            }
            5 => {
                let _ = index.apply(w, &KvEvent::Cleared);
            }
            6 => {
                let cap = b.byte().map(|c| usize::from(c % 12));
                index.set_capacity(w, cap);
            }
            _ => {
                if op & 0x10 != 0 {
                    index.remove_worker(w);
                    index.add_worker(names[usize::from(op >> 6) % 3]);
                } else {
                    let hashes: Vec<SequenceHash> =
                        (0..usize::from(b.byte().unwrap_or(0) % 6)).map(|_| SequenceHash(u64::from(b.byte().unwrap_or(0)))).collect();
                    index.find_matches(&hashes, tier, &mut out);
                    let mut seen: Vec<u32> = out.iter().map(|o| o.worker.0).collect();
                    seen.sort_unstable();
                    seen.dedup();
                    assert_eq!(seen.len(), out.len());
                    assert!(out.iter().all(|o| o.blocks >= 1 && o.blocks as usize <= hashes.len()));
                }
            }
        }
        if let Err(e) = index.check_invariants() {
            panic!("invariant broken: {e}");
        }
    }
});
