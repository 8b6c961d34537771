//! kvgate's NATS subjects and protobuf payloads through a real nats-server:
//! names with `/`, `.`, `*`, `>`, spaces and non-ASCII become valid subjects,
//! per-model wildcards never leak another model's messages, and a batch
//! decodes to what was published.

use std::time::Duration;

use kvgate_protocol::pb::{self, kv_event};
use kvgate_protocol::subject::{SubjectKind, Subjects};
use kvgate_testkit::{NatsClient, NatsServer, scratch_dir};
use prost::Message;

const MODELS: &[&str] = &[
    "meta-llama/Llama-3.1-70B-Instruct",
    "meta-llama/Llama-3.1-70B-Instruct.v2",
    "meta-llama",
    "Qwen/Qwen3 32B*",
    "a>b",
    "模型/é",
    "",
];

fn batch(model: &str, worker: &str, seq: u64) -> pb::KvEventBatch {
    pb::KvEventBatch {
        worker_id: worker.to_owned(),
        model: model.to_owned(),
        relay_epoch: 0xDEAD_BEEF_0000_0001,
        relay_seq: seq,
        engine_seq: seq + 100,
        events: vec![pb::KvEvent {
            event: Some(kv_event::Event::Stored(pb::BlockStored {
                engine_hashes: vec![u64::MAX, 1],
                parent_engine_hash: None,
                token_ids: (0..64).collect(),
                block_size: 32,
                cache_salt: "tenant-a".into(),
                medium: pb::StorageMedium::Gpu as i32,
                ..Default::default()
            })),
        }],
        ..Default::default()
    }
}

#[test]
fn per_model_wildcards_are_isolated() {
    let dir = scratch_dir("nats-subjects").unwrap();
    let server = NatsServer::start(&dir).unwrap();
    let subjects = Subjects::default();
    let workers = ["10.0.0.7:8000", "[fd00::1]:8000"];

    let mut subs: Vec<NatsClient> = Vec::new();
    for (i, m) in MODELS.iter().enumerate() {
        let mut c = NatsClient::connect(server.port).unwrap();
        c.subscribe(&subjects.model(SubjectKind::KvEvents, m), &format!("m{i}")).unwrap();
        c.flush().unwrap();
        subs.push(c);
    }
    let mut all = NatsClient::connect(server.port).unwrap();
    all.subscribe(&subjects.all(SubjectKind::KvEvents), "all").unwrap();
    all.flush().unwrap();

    let mut publisher = NatsClient::connect(server.port).unwrap();
    let mut seq = 0;
    for m in MODELS {
        for w in workers {
            seq += 1;
            let b = batch(m, w, seq);
            publisher.publish(&subjects.kv_events(m, w), &b.encode_to_vec()).unwrap();
            // A heartbeat must not reach a kv subscription.
            publisher.publish(&subjects.heartbeat(m, w), b"hb").unwrap();
        }
    }
    publisher.flush().unwrap();

    for (i, m) in MODELS.iter().enumerate() {
        let mut got = Vec::new();
        while let Some(msg) = subs[i].next_msg(Duration::from_millis(300)).unwrap() {
            got.push(msg);
        }
        assert_eq!(got.len(), workers.len(), "model {m:?} got {got:?}");
        for msg in got {
            let parsed = subjects.parse(&msg.subject).unwrap();
            assert_eq!(parsed.kind, SubjectKind::KvEvents);
            assert_eq!(parsed.model, *m);
            let b = pb::KvEventBatch::decode(msg.payload.as_slice()).unwrap();
            assert_eq!(b.model, *m);
            assert_eq!(Some(b.worker_id.clone()), parsed.worker);
            assert_eq!(b, batch(m, &b.worker_id, b.relay_seq));
        }
    }
    let mut n = 0;
    while all.next_msg(Duration::from_millis(300)).unwrap().is_some() {
        n += 1;
    }
    assert_eq!(n, MODELS.len() * workers.len());
}

/// Raw names are not usable subject tokens. A `.` in a worker id adds
/// tokens, so `<model>.*` no longer matches and a real server loses the
/// model's own messages; a space is refused by the client library before it
/// reaches the server (on the wire it would end the subject, and `Qwen/Qwen3
/// 8B` and `Qwen/Qwen3 32B` would collide). Encoded subjects deliver exactly
/// the subscribed model's messages.
#[test]
fn raw_names_misroute_or_are_refused_encoded_names_do_not() {
    let dir = scratch_dir("nats-raw").unwrap();
    let server = NatsServer::start(&dir).unwrap();
    let s = Subjects::default();
    // A dot in the worker id: the raw subject has more tokens than `*` matches.
    let mut sub = NatsClient::connect(server.port).unwrap();
    sub.subscribe("kvgate.v1.kv.m.*", "raw").unwrap();
    sub.subscribe(&s.model(SubjectKind::KvEvents, "m"), "enc").unwrap();
    sub.flush().unwrap();
    let mut publisher = NatsClient::connect(server.port).unwrap();
    publisher.publish("kvgate.v1.kv.m.10.0.0.7:8000", b"raw").unwrap();
    publisher.publish(&s.kv_events("m", "10.0.0.7:8000"), b"encoded").unwrap();
    publisher.flush().unwrap();
    let mut got = Vec::new();
    while let Some(m) = sub.next_msg(Duration::from_millis(300)).unwrap() {
        got.push((m.sid, m.payload));
    }
    assert!(!got.iter().any(|(_, p)| p == b"raw"), "the raw subject has too many tokens: lost ({got:?})");
    assert!(got.contains(&("enc".to_owned(), b"encoded".to_vec())), "the encoded one arrives ({got:?})");
    // A space: refused by the client; the encoded names are isolated.
    let mut sub = NatsClient::connect(server.port).unwrap();
    assert!(sub.subscribe("kvgate.v1.kv.Qwen/Qwen3 8B.*", "raw").is_err(), "a space in a subject is refused");
    sub.subscribe(&s.model(SubjectKind::KvEvents, "Qwen/Qwen3 8B"), "enc").unwrap();
    sub.flush().unwrap();
    let mut publisher = NatsClient::connect(server.port).unwrap();
    assert!(publisher.publish("kvgate.v1.kv.Qwen/Qwen3 32B.w", b"raw").is_err());
    publisher.publish(&s.kv_events("Qwen/Qwen3 32B", "w"), b"other model").unwrap();
    publisher.publish(&s.kv_events("Qwen/Qwen3 8B", "w"), b"own model").unwrap();
    publisher.flush().unwrap();
    let mut got = Vec::new();
    while let Some(m) = sub.next_msg(Duration::from_millis(300)).unwrap() {
        got.push(m.payload);
    }
    assert_eq!(got, [b"own model".to_vec()]);
}
