//! A Pick looks its prompt up in the index before it takes the model's
//! lock (so it waits for ingest only for that lookup); what it found must
//! still name the right workers when the decision is made.

mod common;

use common::{config, heartbeat, input, stored};
use kvgate_core::model::{Found, ModelState};
use kvgate_protocol::BlockSize;
use kvgate_scheduler::Mode;

/// Workers w1 and w2; w1 holds a 16-block document, looked up (`Found`)
/// as a Pick of it does before it takes the model's lock.
fn looked_up() -> (ModelState, Vec<u32>, Found) {
    let doc: Vec<u32> = (0..16 * 16).collect();
    let mut st = ModelState::new(config(Mode::Kv), 1);
    st.on_heartbeat(&heartbeat("w1"), 0);
    st.on_heartbeat(&heartbeat("w2"), 0);
    st.on_batch(stored("w1", 1, &doc), 0);
    let found = Found::lookup(&st.shared_index(), &input("r1", &doc, None), BlockSize::new(16).unwrap(), true);
    (st, doc, found)
}

/// The lookup made outside the lock is what the decision uses.
#[test]
fn a_pick_decides_with_the_lookup_made_before_it() {
    let (mut st, doc, found) = looked_up();
    let out = st.pick_found(&input("r1", &doc, None), found, 10).unwrap();
    assert_eq!((out.worker_id.as_str(), out.matched_blocks), ("w1", 16));
}

/// A worker removed between the lookup and the decision, its index handed
/// to a newcomer: the Pick looks again, so the newcomer is not credited
/// with the blocks of the worker that left.
#[test]
fn a_lookup_made_before_a_worker_left_is_made_again() {
    let (mut st, doc, found) = looked_up();
    // w1 goes silent and is reaped; w3 joins and gets its index.
    for t in (100..=2_000).step_by(100) {
        st.on_heartbeat(&heartbeat("w2"), t);
    }
    assert_eq!(st.reap(2_000), vec!["w1"]);
    st.on_heartbeat(&heartbeat("w3"), 2_000);
    let out = st.pick_found(&input("r1", &doc, None), found, 2_000).unwrap();
    assert_eq!(out.matched_blocks, 0, "chose {} as if it held the prompt", out.worker_id);
}

/// A lookup skipped because the mode was not `kv` (it switched to `kv`
/// meanwhile) is made when `kv` decides.
#[test]
fn a_lookup_skipped_for_another_mode_is_made_when_kv_decides() {
    let (mut st, doc, _) = looked_up();
    let skipped = Found::lookup(&st.shared_index(), &input("r1", &doc, None), BlockSize::new(16).unwrap(), false);
    let out = st.pick_found(&input("r1", &doc, None), skipped, 10).unwrap();
    assert_eq!((out.worker_id.as_str(), out.matched_blocks), ("w1", 16));
}
