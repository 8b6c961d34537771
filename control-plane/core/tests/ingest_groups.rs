//! The control plane's ingest takes the NATS messages that arrived together
//! at once (`App::on_nats_many`: a model's messages cut into segments with
//! one KV batch per worker, each segment's stream decisions under one hold
//! of the model's lock, its events under one hold of the index's write
//! lock). That leaves the control plane as taking them one at a time
//! (`App::on_nats`) does: the same snapshot needs, counters and matches,
//! with heartbeats between the batches, through duplicates, a gap, a store
//! whose parent the index does not hold, and a heartbeat that announces a
//! batch never seen; on one index shard and on three.

mod common;

use std::sync::Arc;

use common::{WORKERS, batches, tokens};
use kvgate_core::config::{RawConfig, RawModel};
use kvgate_core::{App, Config};
use kvgate_index::Tier;
use kvgate_protocol::{BlockSeed, BlockSize, sequence_hashes};
use prost::Message as _;

fn app(index_shards: u16) -> Arc<App> {
    let raw = RawConfig {
        listen_admin: Some("off".into()),
        models: vec![RawModel {
            name: "m".into(),
            block_size: Some(16),
            index_shards: Some(index_shards),
            ..Default::default()
        }],
        ..Default::default()
    };
    App::new(Config::validate(raw).unwrap()).unwrap()
}

/// Every worker's first heartbeat (nothing published yet), then the
/// batches of [`batches`] with a heartbeat of the batch's worker (in sync)
/// after every third, then one of `w3` announcing five batches it never
/// sent. As (subject, payload).
fn messages(a: &App) -> Vec<(String, Vec<u8>)> {
    let hb = |w: &str, seq: u64| {
        let h = kvgate_protocol::pb::WorkerHeartbeat { relay_seq: seq, ..common::heartbeat(w) };
        (a.subjects.heartbeat("m", w), h.encode_to_vec())
    };
    let mut out: Vec<_> = (0..WORKERS).map(|w| hb(&format!("w{w}"), 0)).collect();
    for (i, b) in batches().into_iter().enumerate() {
        let (w, seq) = (b.worker_id.clone(), b.relay_seq);
        out.push((a.subjects.kv_events("m", &w), b.encode_to_vec()));
        if i % 3 == 2 {
            out.push(hb(&w, seq));
        }
    }
    out.push(hb("w3", 100));
    out
}

/// The families that count what ingest did.
fn counted(a: &App) -> Vec<String> {
    let families = ["kvgate_batches_total", "kvgate_model_events_total", "kvgate_events_skipped_total"];
    a.render_metrics().lines().filter(|l| families.iter().any(|f| l.starts_with(f))).map(str::to_owned).collect()
}

fn needs(got: Vec<(Arc<kvgate_core::Model>, String)>) -> Vec<String> {
    let mut ids: Vec<String> = got.into_iter().map(|(_, w)| w).collect();
    ids.sort();
    ids
}

#[test]
fn messages_taken_together_leave_the_control_plane_as_one_by_one() {
    let one = app(1);
    let msgs = messages(&one);
    let mut want = Vec::new();
    for (s, p) in &msgs {
        want.extend(one.on_nats(s, p));
    }
    let want = needs(want);
    assert!(want.len() >= 3, "the gap, the unknown parent and the heartbeat ahead each ask for a snapshot: {want:?}");
    for shards in [1, 3] {
        let together = app(shards);
        let mut got = Vec::new();
        for group in msgs.chunks(9) {
            got.extend(together.on_nats_many(group.iter().map(|(s, p)| (s.as_str(), p.as_slice()))));
        }
        assert_eq!(needs(got), want, "{shards} shard(s)");
        assert_eq!(counted(&together), counted(&one), "{shards} shard(s)");
        let bs = BlockSize::new(16).unwrap();
        let (x, y) = (one.models["m"].state.lock(), together.models["m"].state.lock());
        let (mut a, mut b) = (Vec::new(), Vec::new());
        let mut matched = 0;
        for doc in (0..6).chain(100..140) {
            let seqs = sequence_hashes(&tokens(doc, 8), bs, BlockSeed::BASE);
            x.index().find_matches(&seqs, Tier::Device, &mut a);
            y.index().find_matches(&seqs, Tier::Device, &mut b);
            let mut p: Vec<_> =
                a.iter().map(|o| (x.index().worker_name(o.worker).unwrap().to_owned(), o.blocks)).collect();
            let mut q: Vec<_> =
                b.iter().map(|o| (y.index().worker_name(o.worker).unwrap().to_owned(), o.blocks)).collect();
            p.sort();
            q.sort();
            assert_eq!(q, p, "document {doc}, {shards} shard(s)");
            matched += p.len();
        }
        assert!(matched > 5, "the documents are found: {matched}");
    }
}
