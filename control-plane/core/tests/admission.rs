//! Overload protection on the synchronous model state: while every worker
//! is at its running limit a request is held, released when a slot frees,
//! refused when the queue is full, expired at its deadline; fairly between
//! tenants; never held when the protection is off or a limit is unknown.

mod common;

use kvgate_core::model::{Admit, ModelConfig, ModelState};
use kvgate_protocol::pb;
use kvgate_scheduler::{FairQueueConfig, Mode};

fn state(overload: Option<FairQueueConfig>) -> ModelState {
    ModelState::new(ModelConfig { heartbeat_timeout_ms: 0, overload, ..common::config(Mode::Kv) }, 1)
}

fn hb(id: &str, running: u32, max_num_seqs: u32) -> pb::WorkerHeartbeat {
    pb::WorkerHeartbeat { interval_ms: 100_000, running, max_num_seqs, ..common::heartbeat(id) }
}

const Q: FairQueueConfig = FairQueueConfig { max_queued: 3, max_wait_ms: 1_000, quantum: 1_000 };

#[test]
fn held_while_saturated_released_as_slots_free_refused_when_full_expired_at_the_deadline() {
    let mut st = state(Some(Q));
    st.on_heartbeat(&hb("w0", 1, 2), 0);
    st.on_heartbeat(&hb("w1", 0, 2), 0);
    assert_eq!(st.admit("a", 0, 100, 1), Admit::Go, "a free slot");
    st.on_heartbeat(&hb("w0", 2, 2), 2);
    st.on_heartbeat(&hb("w1", 2, 2), 2);
    let Admit::Wait(first) = st.admit("a", 0, 100, 3) else { panic!("every worker at its limit: held") };
    let Admit::Wait(second) = st.admit("b", 0, 100, 4) else { panic!("held") };
    let Admit::Wait(third) = st.admit("b", 0, 100, 5) else { panic!("held") };
    assert_eq!(st.admit("c", 0, 100, 6), Admit::Refuse, "the queue holds 3");
    assert_eq!(st.release(10).go, Vec::<u64>::new(), "no slot yet");
    // One slot frees on w1: one request goes, the oldest of the first tenant.
    st.on_heartbeat(&hb("w1", 1, 2), 20);
    assert_eq!(st.release(21).go, vec![first]);
    // Requests arriving while others wait queue behind them, even with a slot.
    assert!(matches!(st.admit("d", 0, 100, 22), Admit::Wait(_)));
    st.on_heartbeat(&hb("w0", 0, 2), 30);
    let r = st.release(31);
    assert_eq!(r.go.len(), 3, "three slots free now: {r:?}");
    assert!(r.go.contains(&second) && r.go.contains(&third));
    // Held past the deadline: expired.
    st.on_heartbeat(&hb("w0", 2, 2), 40);
    st.on_heartbeat(&hb("w1", 2, 2), 40);
    let Admit::Wait(late) = st.admit("a", 0, 100, 50) else { panic!("held") };
    assert_eq!(st.release(1_049).expired, Vec::<u64>::new());
    assert_eq!(st.release(1_050).expired, vec![late]);
    let (queued, c) = st.admission().unwrap();
    assert_eq!((queued, c.held, c.released, c.expired, c.refused), (0, 5, 4, 1, 1));
}

#[test]
fn never_held_when_off_or_when_a_limit_is_unknown() {
    let mut off = state(None);
    off.on_heartbeat(&hb("w0", 2, 2), 0);
    assert_eq!(off.admit("a", 0, 100, 1), Admit::Go);
    assert_eq!(off.admission(), None);
    let mut unknown = state(Some(Q));
    unknown.on_heartbeat(&hb("w0", 2, 2), 0);
    unknown.on_heartbeat(&hb("w1", 50, 0), 0);
    assert_eq!(unknown.admit("a", 0, 100, 1), Admit::Go, "w1's limit is unknown: never saturated");
}
