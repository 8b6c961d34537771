//! Malformed input on both of the control plane's doors: undecodable
//! protobuf on NATS and on gRPC is counted and rejected, never a crash.

mod common;

use kvgate_protocol::pb;
use kvgate_protocol::subject::Subjects;
use kvgate_testkit::NatsServer;
use prost::Message as _;
use std::sync::Arc;
use tokio::sync::Mutex;

use common::*;

/// Sends raw bytes as a gRPC request body.
#[derive(Debug, Clone, Default)]
struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }
    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl tonic::codec::Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut tonic::codec::EncodeBuf<'_>) -> Result<(), tonic::Status> {
        use bytes::BufMut as _;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(&mut self, src: &mut tonic::codec::DecodeBuf<'_>) -> Result<Option<Vec<u8>>, tonic::Status> {
        use bytes::Buf as _;
        let mut v = vec![0; src.remaining()];
        src.copy_to_slice(&mut v);
        Ok(Some(v))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_protobuf_on_nats_and_grpc_is_counted_and_rejected() {
    let dir = kvgate_testkit::scratch_dir("cp-malformed").unwrap();
    let nats = NatsServer::start(&dir).unwrap();
    let (bound, app, handle) = kvgate_server::spawn(config(nats.port, "kv", "cp-m")).await.unwrap();
    let w0 = Arc::new(Mutex::new(TestRelay::start(nats.port, "w0", "127.0.0.1:9000", 50).await));
    let hb = heartbeats(vec![w0.clone()]);
    until(5, "worker live", || async { worker_live(&app, "w0") }).await;

    let pubc = async_nats::connect(format!("127.0.0.1:{}", nats.port)).await.unwrap();
    let s = Subjects::default();
    for garbage in [&b"\xff\xff\xff"[..], b"\x0a\x05ab", b"not protobuf at all"] {
        pubc.publish(s.kv_events(MODEL, "w0"), garbage.to_vec().into()).await.unwrap();
        pubc.publish(s.heartbeat(MODEL, "w0"), garbage.to_vec().into()).await.unwrap();
        pubc.publish(s.inflight(MODEL), garbage.to_vec().into()).await.unwrap();
    }
    // Valid protobuf, wrong worker for the subject.
    let wrong = pb::KvEventBatch { worker_id: "w9".into(), model: MODEL.into(), ..Default::default() };
    pubc.publish(s.kv_events(MODEL, "w0"), wrong.encode_to_vec().into()).await.unwrap();
    pubc.flush().await.unwrap();
    until(5, "malformed counted", || async {
        let m = app.render_metrics();
        metric(&m, "kvgate_nats_malformed_total{kind=\"kv\"}") == 4.0
            && metric(&m, "kvgate_nats_malformed_total{kind=\"heartbeat\"}") == 3.0
            && metric(&m, "kvgate_nats_malformed_total{kind=\"inflight\"}") == 3.0
    })
    .await;

    // gRPC: undecodable bytes, then invalid requests, each a precise status.
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://{}", bound.grpc)).unwrap().connect().await.unwrap();
    let mut raw = tonic::client::Grpc::new(channel);
    raw.ready().await.unwrap();
    let path = http::uri::PathAndQuery::from_static("/kvgate.v1.Router/Pick");
    let err = raw.unary(tonic::Request::new(vec![0xff, 0xff, 0xff, 0x0f]), path, RawCodec).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Internal, "{err:?}");

    let mut c = client(bound.grpc).await;
    let mut req = pick_req("u", &prompt(32, 1));
    req.model = "nope".into();
    assert_eq!(c.pick(req).await.unwrap_err().code(), tonic::Code::NotFound);
    let mut req = pick_req("v", &[]);
    req.prompt = None;
    let e = c.pick(req).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("without a prompt"), "{}", e.message());
    let req = pb::PickRequest {
        model: MODEL.into(),
        api: pb::ApiKind::ChatCompletions as i32,
        segments: vec![pb::Segment::default(); 5000],
        ..Default::default()
    };
    let e = c.pick(req).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("5000 messages; the limit is 4096"), "{}", e.message());
    // A chat message that is not JSON: routed by load (fail-soft), counted.
    let req = pb::PickRequest {
        model: MODEL.into(),
        api: pb::ApiKind::ChatCompletions as i32,
        segments: vec![pb::Segment {
            chain_hash: 1,
            role: "user".into(),
            message_json: b"{not json".to_vec(),
            elided: false,
        }],
        ..Default::default()
    };
    let r = c.pick(req).await.unwrap().into_inner();
    assert_eq!(r.reason, pb::PickReason::Fallback as i32);

    // Still serving, everything counted.
    let r = c.pick(pick_req("ok", &prompt(32, 1))).await.unwrap().into_inner();
    assert_eq!(r.worker_id, "w0");
    let m = app.render_metrics();
    assert_eq!(metric(&m, "kvgate_grpc_responses_total{code=\"13\"}"), 1.0);
    assert_eq!(metric(&m, "kvgate_grpc_responses_total{code=\"5\"}"), 1.0);
    assert_eq!(metric(&m, "kvgate_grpc_responses_total{code=\"3\"}"), 2.0);
    assert_eq!(metric(&m, "kvgate_tokenize_errors_total"), 1.0);
    assert_eq!(metric(&m, "kvgate_pick_errors_total{cause=\"unknown_model\"}"), 1.0);
    hb.abort();
    handle.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_requests_match_blocks_stored_from_the_same_tokens_and_mode_switches_at_run_time() {
    let dir = kvgate_testkit::scratch_dir("cp-chat").unwrap();
    let nats = NatsServer::start(&dir).unwrap();
    let (bound, app, handle) = kvgate_server::spawn(config(nats.port, "kv", "cp-c")).await.unwrap();
    let w0 = Arc::new(Mutex::new(TestRelay::start(nats.port, "w0", "127.0.0.1:9000", 60).await));
    let w1 = Arc::new(Mutex::new(TestRelay::start(nats.port, "w1", "127.0.0.1:9001", 61).await));
    let hb = heartbeats(vec![w0.clone(), w1.clone()]);
    until(5, "workers live", || async { worker_live(&app, "w0") && worker_live(&app, "w1") }).await;

    let messages = [
        serde_json::json!({"role": "system", "content": "You are a meticulous assistant. ".repeat(40)}),
        serde_json::json!({"role": "user", "content": "Summarize the design in three bullet points."}),
    ];
    let bytes: Vec<Vec<u8>> = messages.iter().map(|m| serde_json::to_vec(m).unwrap()).collect();
    let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    let hashes = kvgate_server::tokens::chain_hashes(b"", &refs);
    let req = pb::PickRequest {
        request_id: "chat-1".into(),
        model: MODEL.into(),
        api: pb::ApiKind::ChatCompletions as i32,
        segments: bytes
            .iter()
            .zip(&hashes)
            .map(|(b, h)| pb::Segment { chain_hash: *h, role: "x".into(), message_json: b.clone(), elided: false })
            .collect(),
        ..Default::default()
    };
    // What vLLM would compute, via the same tokenizer files.
    let tk = kvgate_tokenize::ChatTokenizer::from_dir(&kvgate_testkit::repo_root().join(".tools/models/deepseek-v3"))
        .unwrap();
    let ids = tk.encode_chat(&messages, true).unwrap();
    let full = (ids.len() / BS as usize) as u32;
    w1.lock().await.store(&ids).await;
    until(5, "stored", || async { app.index_json()[MODEL]["device_blocks"] == u64::from(full) }).await;

    let mut c = client(bound.grpc).await;
    let r = c.pick(req.clone()).await.unwrap().into_inner();
    assert_eq!((r.worker_id.as_str(), r.matched_blocks, r.total_blocks), ("w1", full, full));
    done(&mut c, "chat-1", "w1").await;

    // Switch the model to round robin through the admin endpoint.
    let admin = bound.admin.unwrap();
    let resp = http(admin, "POST", "/admin/mode?model=m&mode=round_robin").await;
    assert_eq!(resp.status, 200, "{}", String::from_utf8_lossy(&resp.body));
    let bad = http(admin, "POST", "/admin/mode?model=m&mode=fastest").await;
    assert_eq!(bad.status, 400);
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..4 {
        let mut q = req.clone();
        q.request_id = format!("rr-{i}");
        let r = c.pick(q).await.unwrap().into_inner();
        assert_eq!(r.mode, "round_robin");
        assert_eq!(r.reason, pb::PickReason::RoundRobin as i32);
        seen.insert(r.worker_id);
    }
    assert_eq!(seen.len(), 2);
    let metrics = http(admin, "GET", "/metrics").await;
    let text = String::from_utf8(metrics.body).unwrap();
    assert_eq!(metric(&text, "kvgate_mode{model=\"m\",mode=\"round_robin\"}"), 1.0);
    assert!(metric(&text, "kvgate_tokenize_requests_total{model=\"m\",outcome=\"full_hit\"}") >= 4.0);
    hb.abort();
    handle.stop().await.unwrap();
}
