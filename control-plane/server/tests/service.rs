//! The control plane end to end: real nats-server, real gRPC on 127.0.0.1,
//! and the real relay logic (`kvgate_relay::RelayCore` fed vLLM wire frames)
//! publishing batches, heartbeats and snapshots in the relay's format.

mod common;

use kvgate_protocol::pb;
use kvgate_server::App;
use kvgate_testkit::NatsServer;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_change_the_pick_and_cleared_or_dead_workers_lose_overlap() {
    let dir = kvgate_testkit::scratch_dir("cp-events").unwrap();
    let nats = NatsServer::start(&dir).unwrap();
    let (bound, app, handle) = kvgate_server::spawn(config(nats.port, "kv", "cp-a")).await.unwrap();
    let mut c = client(bound.grpc).await;

    let w0 = Arc::new(Mutex::new(TestRelay::start(nats.port, "w0", "127.0.0.1:9000", 10).await));
    let w1 = Arc::new(Mutex::new(TestRelay::start(nats.port, "w1", "127.0.0.1:9001", 11).await));
    let w2 = Arc::new(Mutex::new(TestRelay::start(nats.port, "w2", "127.0.0.1:9002", 12).await));
    let hb_all = heartbeats(vec![w0.clone(), w2.clone()]);
    let hb_w1 = heartbeats(vec![w1.clone()]);
    until(5, "three live workers", || async { ["w0", "w1", "w2"].iter().all(|w| worker_live(&app, w)) }).await;

    let p = prompt(64 * BS as usize, 7);
    // Nothing cached: some worker, zero overlap.
    let r = c.pick(pick_req("r0", &p)).await.unwrap().into_inner();
    assert_eq!((r.matched_blocks, r.total_blocks), (0, 64));
    done(&mut c, "r0", &r.worker_id).await;

    // w1 caches 48 leading blocks.
    w1.lock().await.store(&p[..48 * BS as usize]).await;
    until(5, "w1's blocks indexed", || async { app.index_json()[MODEL]["device_blocks"] == 48 }).await;
    let r = c.pick(pick_req("r1", &p)).await.unwrap().into_inner();
    assert_eq!((r.worker_id.as_str(), r.endpoint.as_str(), r.matched_blocks), ("w1", "127.0.0.1:9001", 48));
    assert_eq!(r.reason, pb::PickReason::Kv as i32);
    assert_eq!(r.mode, "kv");
    assert_eq!(r.fallbacks.len(), 2);
    done(&mut c, "r1", "w1").await;

    // w2 caches all 64: it wins.
    w2.lock().await.store(&p).await;
    until(5, "w2's blocks indexed", || async { app.index_json()[MODEL]["device_blocks"] == 64 }).await;
    let r = c.pick(pick_req("r2", &p)).await.unwrap().into_inner();
    assert_eq!((r.worker_id.as_str(), r.matched_blocks), ("w2", 64));
    done(&mut c, "r2", "w2").await;

    // w2's engine drops everything: back to w1.
    w2.lock().await.clear().await;
    until(5, "w2 cleared", || async { app.workers_json(Some(MODEL))[MODEL][2]["device_blocks"] == 0 }).await;
    let r = c.pick(pick_req("r3", &p)).await.unwrap().into_inner();
    assert_eq!((r.worker_id.as_str(), r.matched_blocks), ("w1", 48));
    done(&mut c, "r3", "w1").await;

    // w1's heartbeats stop: it is removed and its blocks purged.
    hb_w1.abort();
    until(5, "w1 removed", || async { !worker_live(&app, "w1") && app.index_json()[MODEL]["device_blocks"] == 0 })
        .await;
    for i in 0..5 {
        let r = c.pick(pick_req(&format!("r4-{i}"), &p)).await.unwrap().into_inner();
        assert_ne!(r.worker_id, "w1");
        assert_eq!(r.matched_blocks, 0);
        done(&mut c, &format!("r4-{i}"), &r.worker_id).await;
    }
    let m = app.render_metrics();
    assert_eq!(metric(&m, "kvgate_model_events_total{model=\"m\",kind=\"worker_expired\"}"), 1.0);
    assert_eq!(metric(&m, "kvgate_pick_decisions_total{model=\"m\",mode=\"kv\",reason=\"kv\"}"), 3.0);
    assert!(metric(&m, "kvgate_pick_duration_seconds_count{model=\"m\"}") >= 9.0);
    hb_all.abort();
    handle.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_replica_converges_through_snapshots_then_follows_live_events() {
    let dir = kvgate_testkit::scratch_dir("cp-late").unwrap();
    let nats = NatsServer::start(&dir).unwrap();
    let w0 = Arc::new(Mutex::new(TestRelay::start(nats.port, "w0", "127.0.0.1:9000", 20).await));
    let w1 = Arc::new(Mutex::new(TestRelay::start(nats.port, "w1", "127.0.0.1:9001", 21).await));
    let p = prompt(40 * BS as usize, 3);
    let q = prompt(40 * BS as usize, 4);
    // Published before any control plane runs: nobody receives these.
    w1.lock().await.store(&p[..32 * BS as usize]).await;
    w0.lock().await.store(&q[..8 * BS as usize]).await;
    let hb = heartbeats(vec![w0.clone(), w1.clone()]);

    let (bound, app, handle) = kvgate_server::spawn(config(nats.port, "kv", "cp-late")).await.unwrap();
    until(5, "snapshots applied", || async { worker_blocks(&app, "w1") == 32 && worker_blocks(&app, "w0") == 8 }).await;
    let mut c = client(bound.grpc).await;
    let r = c.pick(pick_req("a", &p)).await.unwrap().into_inner();
    assert_eq!((r.worker_id.as_str(), r.matched_blocks), ("w1", 32));
    done(&mut c, "a", "w1").await;

    // Live events continue the snapshot.
    w0.lock().await.store(&p).await;
    until(5, "live batch applied", || async { worker_blocks(&app, "w0") == 48 }).await;
    let r = c.pick(pick_req("b", &p)).await.unwrap().into_inner();
    assert_eq!((r.worker_id.as_str(), r.matched_blocks), ("w0", 40));
    let m = app.render_metrics();
    assert!(metric(&m, "kvgate_model_events_total{model=\"m\",kind=\"snapshot_applied\"}") >= 2.0);
    hb.abort();
    handle.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_restart_mid_run_is_survived_and_the_lost_batches_are_recovered() {
    let dir = kvgate_testkit::scratch_dir("cp-nats-restart").unwrap();
    let mut nats = NatsServer::start(&dir).unwrap();
    let port = nats.port;
    let (bound, app, handle) = kvgate_server::spawn(config(port, "kv", "cp-r")).await.unwrap();
    let w0 = Arc::new(Mutex::new(TestRelay::start(port, "w0", "127.0.0.1:9000", 30).await));
    let w1 = Arc::new(Mutex::new(TestRelay::start(port, "w1", "127.0.0.1:9001", 31).await));
    let hb = heartbeats(vec![w0.clone(), w1.clone()]);
    let p = prompt(40 * BS as usize, 9);
    w1.lock().await.store(&p[..8 * BS as usize]).await;
    until(5, "first batch", || async { app.index_json()[MODEL]["device_blocks"] == 8 }).await;

    // NATS goes away; the engine keeps storing (the batch is lost).
    nats.proc.kill();
    w1.lock().await.online = false;
    w1.lock().await.store(&p[8 * BS as usize..24 * BS as usize]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    nats = NatsServer::start_on(&dir, port).unwrap();
    w1.lock().await.online = true;
    until(10, "control plane reconnected", || async { app.nats_connected() }).await;

    // The next heartbeat shows relay_seq ahead: a snapshot brings the lost
    // blocks back. (The relay's chain after the restart continues.)
    let mut c = client(bound.grpc).await;
    until(10, "lost batch recovered", || async { app.index_json()[MODEL]["device_blocks"] == 24 }).await;
    let r = c.pick(pick_req("x", &p)).await.unwrap().into_inner();
    assert_eq!(r.worker_id, "w1");
    // The first 8 blocks are one chain, the next 16 another (roots): the
    // leading match is the first chain.
    assert_eq!(r.matched_blocks, 8);
    let m = app.render_metrics();
    assert!(metric(&m, "kvgate_model_events_total{model=\"m\",kind=\"gap\"}") >= 1.0);
    hb.abort();
    drop(nats);
    handle.stop().await.unwrap();
}

/// A snapshot no relay answers is a failure, not a snapshot of nothing:
/// the worker keeps the blocks the index has. (NATS answers a request
/// nobody serves with a "no responders" status and an empty payload, which
/// decoded as an empty snapshot and cleared the worker.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_no_relay_answers_fails_and_the_worker_keeps_its_blocks() {
    let dir = kvgate_testkit::scratch_dir("cp-no-snapshot").unwrap();
    let nats = NatsServer::start(&dir).unwrap();
    let (_bound, app, handle) = kvgate_server::spawn(config(nats.port, "kv", "cp-n")).await.unwrap();
    let w0 = Arc::new(Mutex::new(TestRelay::start(nats.port, "w0", "127.0.0.1:9000", 50).await));
    let hb = heartbeats(vec![w0.clone()]);
    let p = prompt(24 * BS as usize, 5);
    w0.lock().await.store(&p[..8 * BS as usize]).await;
    until(5, "first batch", || async { app.index_json()[MODEL]["device_blocks"] == 8 }).await;
    // (A first batch published before the control plane subscribed comes
    // in by a snapshot: count from here.)
    let applied = |m: &str| {
        kvgate_testkit::prom::value(m, "kvgate_model_events_total{model=\"m\",kind=\"snapshot_applied\"}")
            .unwrap_or(0.0)
    };
    let applied_before = applied(&app.render_metrics());

    // The relay stops answering snapshots; a batch is lost, so the next
    // one shows a gap and the control plane asks for a snapshot.
    w0.lock().await.stop_answering_snapshots().await;
    w0.lock().await.online = false;
    w0.lock().await.store(&p[8 * BS as usize..16 * BS as usize]).await;
    w0.lock().await.online = true;
    w0.lock().await.store(&p[16 * BS as usize..]).await;
    until(10, "the snapshot failed", || async {
        metric(&app.render_metrics(), "kvgate_snapshot_failures_total") >= 1.0
    })
    .await;
    assert_eq!(app.index_json()[MODEL]["device_blocks"], 8, "the worker's blocks are kept");
    let m = app.render_metrics();
    assert_eq!(applied(&m), applied_before, "nothing applied as a snapshot");
    assert!(metric(&m, "kvgate_model_events_total{model=\"m\",kind=\"gap\"}") >= 1.0);
    hb.abort();
    handle.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_in_flight_load() {
    let dir = kvgate_testkit::scratch_dir("cp-replicas").unwrap();
    let nats = NatsServer::start(&dir).unwrap();
    let (ba, app_a, ha) = kvgate_server::spawn(config(nats.port, "least_load", "cp-a")).await.unwrap();
    let (bb, app_b, hbh) = kvgate_server::spawn(config(nats.port, "least_load", "cp-b")).await.unwrap();
    let w0 = Arc::new(Mutex::new(TestRelay::start(nats.port, "w0", "127.0.0.1:9000", 40).await));
    let w1 = Arc::new(Mutex::new(TestRelay::start(nats.port, "w1", "127.0.0.1:9001", 41).await));
    let hb = heartbeats(vec![w0.clone(), w1.clone()]);
    until(5, "workers live on both", || async {
        ["w0", "w1"].iter().all(|w| worker_live(&app_a, w) && worker_live(&app_b, w))
    })
    .await;
    let inflight = |app: &App, w: &str| -> u64 {
        app.workers_json(Some(MODEL))[MODEL]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["id"] == w)
            .map(|x| x["inflight"].as_u64().unwrap())
            .unwrap()
    };
    let (mut ca, mut cb) = (client(ba.grpc).await, client(bb.grpc).await);
    for round in 0..4 {
        let ida = format!("a{round}");
        let ra = ca.pick(pick_req(&ida, &prompt(64, round))).await.unwrap().into_inner();
        until(5, "B sees A's request", || async { inflight(&app_b, &ra.worker_id) == 1 }).await;
        let idb = format!("b{round}");
        let rb = cb.pick(pick_req(&idb, &prompt(64, round))).await.unwrap().into_inner();
        assert_ne!(rb.worker_id, ra.worker_id, "round {round}: B must avoid the worker A just loaded");
        until(5, "A sees B's request", || async { inflight(&app_a, &rb.worker_id) == 1 }).await;
        done(&mut ca, &ida, &ra.worker_id).await;
        done(&mut cb, &idb, &rb.worker_id).await;
        until(5, "both see the ends", || async {
            ["w0", "w1"].iter().all(|w| inflight(&app_a, w) == 0 && inflight(&app_b, w) == 0)
        })
        .await;
    }
    hb.abort();
    ha.stop().await.unwrap();
    hbh.stop().await.unwrap();
}

/// Session affinity across replicas: the pin one replica makes reaches the
/// other over NATS (with the in-flight event), so a conversation whose
/// requests Envoy spreads over both replicas stays on one worker, while
/// requests without a session keep rotating.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_keep_a_session_on_one_worker() {
    let dir = kvgate_testkit::scratch_dir("cp-sessions").unwrap();
    let nats = NatsServer::start(&dir).unwrap();
    let with_sessions = |replica: &str| {
        let mut raw = raw_config(nats.port, "round_robin", replica);
        raw.models[0].session = Some(kvgate_server::config::RawSession { enabled: Some(true), ..Default::default() });
        kvgate_server::Config::validate(raw).unwrap()
    };
    let (ba, app_a, ha) = kvgate_server::spawn(with_sessions("cp-a")).await.unwrap();
    let (bb, app_b, hbh) = kvgate_server::spawn(with_sessions("cp-b")).await.unwrap();
    let mut ws = Vec::new();
    for (w, endpoint, epoch) in
        [("w0", "127.0.0.1:9000", 50), ("w1", "127.0.0.1:9001", 51), ("w2", "127.0.0.1:9002", 52)]
    {
        ws.push(Arc::new(Mutex::new(TestRelay::start(nats.port, w, endpoint, epoch).await)));
    }
    let hb = heartbeats(ws.clone());
    until(5, "workers live on both", || async {
        ["w0", "w1", "w2"].iter().all(|w| worker_live(&app_a, w) && worker_live(&app_b, w))
    })
    .await;
    let (mut ca, mut cb) = (client(ba.grpc).await, client(bb.grpc).await);
    let req = |id: &str, session: &str| pb::PickRequest { session_id: session.into(), ..pick_req(id, &prompt(64, 1)) };
    let first = ca.pick(req("a0", "chat-7")).await.unwrap().into_inner();
    done(&mut ca, "a0", &first.worker_id).await;
    let pinned = |app: &App| metric(&app.render_metrics(), "kvgate_sessions{model=\"m\"}");
    until(5, "B learns A's pin", || async { pinned(&app_b) == 1.0 }).await;
    let mut rotated = std::collections::BTreeSet::new();
    for i in 0..6 {
        let id = format!("b{i}");
        let r = cb.pick(req(&id, "chat-7")).await.unwrap().into_inner();
        assert_eq!(r.worker_id, first.worker_id, "request {i} of the session on the other replica");
        done(&mut cb, &id, &r.worker_id).await;
        let id = format!("n{i}");
        let n = cb.pick(req(&id, "")).await.unwrap().into_inner();
        rotated.insert(n.worker_id.clone());
        done(&mut cb, &id, &n.worker_id).await;
    }
    assert_eq!(rotated.len(), 3, "requests without a session rotate: {rotated:?}");
    let m = app_b.render_metrics();
    assert!(metric(&m, "kvgate_pick_decisions_total{model=\"m\",mode=\"round_robin\",reason=\"session\"}") >= 1.0);
    assert_eq!(pinned(&app_a), 1.0);
    hb.abort();
    ha.stop().await.unwrap();
    hbh.stop().await.unwrap();
}

/// Speculative index across replicas: the prompt a replica just routed is
/// credited to its worker on the other replica too (its block hashes ride
/// the in-flight event), before any KV event exists. A replica that knew
/// only the block count would send the same document to the idle worker
/// and compute it twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_credits_the_prompt_another_replica_routed() {
    let dir = kvgate_testkit::scratch_dir("cp-speculation").unwrap();
    let nats = NatsServer::start(&dir).unwrap();
    let (ba, app_a, ha) = kvgate_server::spawn(config(nats.port, "kv", "cp-a")).await.unwrap();
    let (bb, app_b, hbh) = kvgate_server::spawn(config(nats.port, "kv", "cp-b")).await.unwrap();
    let w0 = Arc::new(Mutex::new(TestRelay::start(nats.port, "w0", "127.0.0.1:9000", 60).await));
    let w1 = Arc::new(Mutex::new(TestRelay::start(nats.port, "w1", "127.0.0.1:9001", 61).await));
    let hb = heartbeats(vec![w0.clone(), w1.clone()]);
    until(5, "workers live on both", || async {
        ["w0", "w1"].iter().all(|w| worker_live(&app_a, w) && worker_live(&app_b, w))
    })
    .await;
    let (mut ca, mut cb) = (client(ba.grpc).await, client(bb.grpc).await);
    let doc = prompt(256 * BS as usize, 9);
    let ra = ca.pick(pick_req("a", &doc)).await.unwrap().into_inner();
    // Its first token: the document is computed there (no event sent).
    let first = pb::CompletionReport {
        request_id: "a".into(),
        model: MODEL.into(),
        worker_id: ra.worker_id.clone(),
        status_code: 200,
        ttfb_us: 1000,
        ..Default::default()
    };
    ca.report(pb::CompletionReportBatch { reporter_id: "t".into(), reports: vec![first] }).await.unwrap();
    let m = |app: &App| metric(&app.render_metrics(), "kvgate_model_events_total{model=\"m\",kind=\"replica_event\"}");
    until(5, "B sees A's request and its first token", || async { m(&app_b) >= 2.0 }).await;
    let rb = cb.pick(pick_req("b", &doc)).await.unwrap().into_inner();
    assert_eq!(rb.worker_id, ra.worker_id, "B follows the document A's worker holds");
    assert_eq!(app_b.index_json()[MODEL]["device_blocks"], 0, "no KV event was involved");
    done(&mut ca, "a", &ra.worker_id).await;
    done(&mut cb, "b", &rb.worker_id).await;
    hb.abort();
    ha.stop().await.unwrap();
    hbh.stop().await.unwrap();
}

/// Overload protection over gRPC: with the only worker at its running
/// limit, a Pick is held (the call does not answer) until a report frees
/// the slot, then routed; one held past its deadline is answered with
/// `retry_after_ms` and no endpoint (the filter's 429).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_fleet_holds_picks_until_a_slot_frees_then_refuses() {
    let dir = kvgate_testkit::scratch_dir("cp-overload").unwrap();
    let nats = NatsServer::start(&dir).unwrap();
    let mut raw = raw_config(nats.port, "kv", "cp-a");
    raw.models[0].overload =
        Some(kvgate_server::config::RawOverload { enabled: Some(true), max_wait_ms: Some(400), ..Default::default() });
    let (bound, app, handle) = kvgate_server::spawn(kvgate_server::Config::validate(raw).unwrap()).await.unwrap();
    let mut relay = TestRelay::start(nats.port, "w0", "127.0.0.1:9000", 70).await;
    relay.max_num_seqs = 1;
    let hb = heartbeats(vec![Arc::new(Mutex::new(relay))]);
    until(5, "w0 live", || async { worker_live(&app, "w0") }).await;
    let mut c = client(bound.grpc).await;
    let first = c.pick(pick_req("a", &prompt(64, 1))).await.unwrap().into_inner();
    assert_eq!(first.worker_id, "w0");
    // The slot is taken: the next Pick waits.
    let mut c2 = c.clone();
    let held = tokio::spawn(async move { c2.pick(pick_req("b", &prompt(64, 2))).await.unwrap().into_inner() });
    let queued = |app: &App| metric(&app.render_metrics(), "kvgate_admission_queued{model=\"m\"}");
    until(5, "b held", || async { queued(&app) == 1.0 }).await;
    assert!(!held.is_finished());
    done(&mut c, "a", "w0").await;
    let b = held.await.unwrap();
    assert_eq!((b.worker_id.as_str(), b.retry_after_ms), ("w0", 0), "released when a's report freed the slot");
    // b holds the slot now and nobody reports: c waits 400 ms, then 429.
    let r = c.pick(pick_req("c", &prompt(64, 3))).await.unwrap().into_inner();
    assert_eq!((r.endpoint.as_str(), r.retry_after_ms), ("", 400));
    let m = app.render_metrics();
    assert_eq!(metric(&m, "kvgate_admission_total{model=\"m\",outcome=\"released\"}"), 1.0);
    assert_eq!(metric(&m, "kvgate_admission_total{model=\"m\",outcome=\"expired\"}"), 1.0);
    hb.abort();
    handle.stop().await.unwrap();
}

/// A control plane started in front of a live fleet needs every worker's
/// snapshot at once. The relays here answer one snapshot at a time, 150 ms
/// each (answers slower than asked, as in a storm at fleet scale). Before
/// snapshots were bounded, all 32 were asked at once: the later answers
/// came after the 2 s timeout, each timeout asked again, and the relays
/// answered requests nobody waited for. Now at most four are asked at
/// once, a waiting worker does not time out, and each is asked once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_storm_asks_each_worker_once_and_a_few_at_a_time() {
    use futures_util::StreamExt as _;
    use kvgate_protocol::subject::{SubjectKind, Subjects};
    use prost::Message as _;
    use std::sync::atomic::{AtomicUsize, Ordering};
    const WORKERS: usize = 32;
    let dir = kvgate_testkit::scratch_dir("cp-restart-storm").unwrap();
    let nats = NatsServer::start(&dir).unwrap();
    let mut relays = Vec::new();
    for w in 0..WORKERS {
        let mut r =
            TestRelay::start(nats.port, &format!("w{w}"), &format!("127.0.0.1:{}", 9000 + w), 40 + w as u64).await;
        // Published before any control plane runs.
        r.store(&prompt((4 + w % 3) * BS as usize, w as u32)).await;
        r.stop_answering_snapshots().await;
        relays.push(Arc::new(Mutex::new(r)));
    }
    let cores: std::collections::HashMap<String, _> = futures_util::future::join_all(relays.iter().map(|r| async {
        let r = r.lock().await;
        (r.id.clone(), r.core.clone())
    }))
    .await
    .into_iter()
    .collect();
    // The fleet's answers: one at a time, 150 ms each; how many requests
    // were waiting for theirs at most.
    let (outstanding, most, asked) =
        (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let answering = Arc::new(Mutex::new(()));
    let nc = async_nats::connect(format!("127.0.0.1:{}", nats.port)).await.unwrap();
    let mut requests = nc.subscribe(Subjects::default().model(SubjectKind::Snapshot, MODEL)).await.unwrap();
    nc.flush().await.unwrap();
    let (o2, m2, a2) = (outstanding.clone(), most.clone(), asked.clone());
    let responder = tokio::spawn(async move {
        while let Some(req) = requests.next().await {
            let Some(reply) = req.reply else { continue };
            let Some(core) = Subjects::default()
                .parse(&req.subject)
                .ok()
                .and_then(|p| p.worker)
                .and_then(|w| cores.get(&w).cloned())
            else {
                continue;
            };
            a2.fetch_add(1, Ordering::SeqCst);
            let now = o2.fetch_add(1, Ordering::SeqCst) + 1;
            m2.fetch_max(now, Ordering::SeqCst);
            let (nc, o3, turn) = (nc.clone(), o2.clone(), answering.clone());
            tokio::spawn(async move {
                let _turn = turn.lock().await;
                tokio::time::sleep(Duration::from_millis(150)).await;
                let chunks = core.lock().await.snapshot(BS, 4096);
                // Answered from here: the control plane may ask its next
                // one as soon as these arrive.
                o3.fetch_sub(1, Ordering::SeqCst);
                for c in chunks {
                    let _ = nc.publish(reply.clone(), c.encode_to_vec().into()).await;
                }
                let _ = nc.flush().await;
            });
        }
    });
    let hb = heartbeats(relays.clone());
    let mut raw = raw_config(nats.port, "kv", "cp-storm");
    raw.snapshot_timeout_ms = Some(2000);
    let (_bound, app, handle) = kvgate_server::spawn(kvgate_server::Config::validate(raw).unwrap()).await.unwrap();
    until(60, "every worker synced from its snapshot", || async {
        (0..WORKERS).all(|w| worker_blocks(&app, &format!("w{w}")) == (4 + w % 3) as u64)
    })
    .await;
    let m = app.render_metrics();
    assert_eq!(metric(&m, "kvgate_snapshot_failures_total"), 0.0, "{m}");
    assert_eq!(metric(&m, "kvgate_snapshot_requests_total"), WORKERS as f64, "each worker asked once: {m}");
    assert_eq!(asked.load(Ordering::SeqCst), WORKERS);
    assert_eq!(metric(&m, &format!("kvgate_worker_streams{{model=\"{MODEL}\",state=\"synced\"}}")), WORKERS as f64);
    let most = most.load(Ordering::SeqCst);
    assert!((2..=4).contains(&most), "at most four asked at once, and more than one: {most}");
    hb.abort();
    responder.abort();
    handle.stop().await.unwrap();
}
