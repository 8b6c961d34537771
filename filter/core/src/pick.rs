//! `kvgate.v1.Router/Pick`: the request encoded straight from the borrowed
//! extraction (one buffer, sized up front, no intermediate owned message),
//! and the answer turned into the header value the filter sets.
//!
//! The encoding is byte-for-byte what prost produces for the equivalent
//! `pb::PickRequest` (tested), so the control plane sees a normal message.

use kvgate_protocol::SegmentHash;
use kvgate_protocol::pb;
use prost::Message as _;
use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint};

use crate::extract::{Api, Extracted, Prompt};

fn len_field(len: usize) -> usize {
    if len == 0 { 0 } else { 1 + encoded_len_varint(len as u64) + len }
}

fn put_bytes(tag: u32, v: &[u8], buf: &mut Vec<u8>) {
    if !v.is_empty() {
        encode_key(tag, WireType::LengthDelimited, buf);
        encode_varint(v.len() as u64, buf);
        buf.extend_from_slice(v);
    }
}

/// What the filter knows of a request besides its body.
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestMeta<'a> {
    /// `x-request-id`.
    pub request_id: &'a str,
    /// LoRA adapter (when the body's model is an adapter of a base model).
    pub lora_name: &'a str,
    /// The model to ask for (the base model of an adapter, else the body's).
    pub model: &'a str,
    /// Body length.
    pub body_bytes: u32,
    /// The session header's value ("" = none or not configured).
    pub session_id: &'a str,
    /// The tenant header's value ("" = none).
    pub tenant: &'a str,
    /// The priority header's digit (0 when absent).
    pub priority: u32,
}

/// The chained segment hash of every message.
pub fn chain_hashes(e: &Extracted<'_>) -> Vec<u64> {
    let mut h = SegmentHash::context(&e.template_context);
    e.messages
        .iter()
        .map(|m| {
            h = h.chain(m.json);
            h.0
        })
        .collect()
}

/// Encodes the PickRequest for an extracted body. `hashes` are
/// [`chain_hashes`]; the messages `0..=i` are sent without their bytes
/// (`Segment.elided`) when `elide_through` is `Some(i)`.
pub fn encode_pick(
    e: &Extracted<'_>,
    api: Api,
    meta: &RequestMeta<'_>,
    hashes: &[u64],
    elide_through: Option<usize>,
) -> Vec<u8> {
    let elided = |i: usize| elide_through.is_some_and(|k| i <= k);
    // Sizes first, so that the buffer is allocated once.
    let seg_len = |i: usize, role: &str, json: &[u8]| {
        9 + len_field(role.len()) + len_field(json.len()) + if elided(i) { 2 } else { 0 }
    };
    let mut n = len_field(meta.request_id.len())
        + len_field(meta.model.len())
        + 2
        + len_field(e.template_context.len())
        + len_field(e.cache_salt.len())
        + len_field(meta.lora_name.len())
        + 6
        + 2
        + 6
        + len_field(meta.session_id.len())
        + len_field(meta.tenant.len())
        + 2;
    for (i, m) in e.messages.iter().enumerate() {
        let l = seg_len(i, &m.role, if elided(i) { &[] } else { m.json });
        n += 1 + encoded_len_varint(l as u64) + l;
    }
    let ids_len = match &e.prompt {
        Some(Prompt::Text(t)) => {
            n += 1 + encoded_len_varint(t.len() as u64) + t.len();
            0
        }
        Some(Prompt::Tokens(ids)) => {
            let l: usize = ids.iter().map(|&i| encoded_len_varint(u64::from(i))).sum();
            n += 2 * (1 + 5) + l;
            l
        }
        None => 0,
    };
    let mut buf = Vec::with_capacity(n);
    put_bytes(1, meta.request_id.as_bytes(), &mut buf);
    put_bytes(2, meta.model.as_bytes(), &mut buf);
    let api_v = match api {
        Api::Chat => pb::ApiKind::ChatCompletions,
        Api::Completions => pb::ApiKind::Completions,
    } as u64;
    encode_key(3, WireType::Varint, &mut buf);
    encode_varint(api_v, &mut buf);
    put_bytes(4, &e.template_context, &mut buf);
    for (i, (m, h)) in e.messages.iter().zip(hashes).enumerate() {
        let j: &[u8] = if elided(i) { &[] } else { m.json };
        encode_key(5, WireType::LengthDelimited, &mut buf);
        encode_varint(seg_len(i, &m.role, j) as u64, &mut buf);
        encode_key(1, WireType::SixtyFourBit, &mut buf);
        buf.extend_from_slice(&h.to_le_bytes());
        put_bytes(2, m.role.as_bytes(), &mut buf);
        put_bytes(3, j, &mut buf);
        if elided(i) {
            encode_key(4, WireType::Varint, &mut buf);
            encode_varint(1, &mut buf);
        }
    }
    match &e.prompt {
        Some(Prompt::Text(t)) => {
            encode_key(6, WireType::LengthDelimited, &mut buf);
            encode_varint(t.len() as u64, &mut buf);
            buf.extend_from_slice(t.as_bytes());
        }
        Some(Prompt::Tokens(ids)) => {
            // TokenIds { repeated uint32 ids = 1 [packed] }
            let inner = if ids.is_empty() { 0 } else { 1 + encoded_len_varint(ids_len as u64) + ids_len };
            encode_key(7, WireType::LengthDelimited, &mut buf);
            encode_varint(inner as u64, &mut buf);
            if !ids.is_empty() {
                encode_key(1, WireType::LengthDelimited, &mut buf);
                encode_varint(ids_len as u64, &mut buf);
                for &i in ids {
                    encode_varint(u64::from(i), &mut buf);
                }
            }
        }
        None => {}
    }
    put_bytes(8, e.cache_salt.as_bytes(), &mut buf);
    put_bytes(9, meta.lora_name.as_bytes(), &mut buf);
    if let Some(mt) = e.max_tokens {
        encode_key(10, WireType::Varint, &mut buf);
        encode_varint(u64::from(mt), &mut buf);
    }
    if e.stream {
        encode_key(11, WireType::Varint, &mut buf);
        encode_varint(1, &mut buf);
    }
    if meta.body_bytes != 0 {
        encode_key(12, WireType::Varint, &mut buf);
        encode_varint(u64::from(meta.body_bytes), &mut buf);
    }
    put_bytes(13, meta.session_id.as_bytes(), &mut buf);
    put_bytes(14, meta.tenant.as_bytes(), &mut buf);
    if meta.priority != 0 {
        encode_key(15, WireType::Varint, &mut buf);
        encode_varint(u64::from(meta.priority), &mut buf);
    }
    buf
}

/// The PickRequest of [`encode_pick`] as a message, for hosts that call the
/// control plane in-process (the endpoint picker) instead of sending bytes.
/// `hashes` are [`chain_hashes`]; nothing is elided. Equal to decoding
/// [`encode_pick`]'s bytes (tested).
pub fn pick_request(e: &Extracted<'_>, api: Api, meta: &RequestMeta<'_>, hashes: &[u64]) -> pb::PickRequest {
    pb::PickRequest {
        request_id: meta.request_id.into(),
        model: meta.model.into(),
        api: match api {
            Api::Chat => pb::ApiKind::ChatCompletions,
            Api::Completions => pb::ApiKind::Completions,
        } as i32,
        template_context_json: e.template_context.clone(),
        segments: e
            .messages
            .iter()
            .zip(hashes)
            .map(|(m, h)| pb::Segment {
                chain_hash: *h,
                role: m.role.to_string(),
                message_json: m.json.to_vec(),
                elided: false,
            })
            .collect(),
        prompt: e.prompt.as_ref().map(|p| match p {
            Prompt::Text(t) => pb::pick_request::Prompt::PromptText(t.to_string()),
            Prompt::Tokens(ids) => pb::pick_request::Prompt::PromptTokenIds(pb::TokenIds { ids: ids.clone() }),
        }),
        cache_salt: e.cache_salt.to_string(),
        lora_name: meta.lora_name.into(),
        max_tokens: e.max_tokens,
        stream: e.stream,
        body_bytes: meta.body_bytes,
        session_id: meta.session_id.into(),
        tenant: meta.tenant.into(),
        priority: meta.priority,
    }
}

/// A usable answer of the control plane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// `x-gateway-destination-endpoint`: primary, then fallbacks, comma
    /// separated.
    pub header: String,
    /// Length of the primary endpoint within `header`.
    pub primary_len: usize,
    /// Worker id of the primary.
    pub worker_id: String,
    /// Matched and total prompt blocks.
    pub matched_blocks: u32,
    /// Total full prompt blocks.
    pub total_blocks: u32,
    /// Why (a short name: "kv", "load", ...).
    pub reason: &'static str,
    /// A larger overlap passed over: (blocks, worker id); blocks 0 = none.
    pub passed_over: (u32, String),
    /// The primary's data-parallel rank at its endpoint, for
    /// `x-data-parallel-rank` (servers that run several ranks).
    pub dp_rank: Option<u32>,
    /// The prefill worker of a disaggregated request, for
    /// `x-prefiller-host-port`; `None` = aggregated (or an unusable
    /// endpoint, which leaves the request aggregated).
    pub prefill: Option<String>,
}

impl Decision {
    /// The primary endpoint.
    pub fn endpoint(&self) -> &str {
        self.header.get(..self.primary_len).unwrap_or("")
    }
}

/// An endpoint is `host:port` made of characters that can appear in an IP
/// address, a DNS name or brackets: nothing that could break the header.
fn endpoint_ok(e: &str) -> bool {
    !e.is_empty()
        && e.len() <= 261
        && e.contains(':')
        && e.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b':' | b'[' | b']' | b'-' | b'_' | b'%'))
}

/// Short name of a pick reason.
pub fn reason_name(r: i32) -> &'static str {
    match pb::PickReason::try_from(r).unwrap_or(pb::PickReason::Unspecified) {
        pb::PickReason::Unspecified | pb::PickReason::Kv => "kv",
        pb::PickReason::Load => "load",
        pb::PickReason::Approximate => "approx",
        pb::PickReason::RoundRobin => "round_robin",
        pb::PickReason::Random => "random",
        pb::PickReason::Fallback => "fallback",
        pb::PickReason::Session => "session",
    }
}

/// What an answer of the control plane means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Route: the decision, and the chain hashes up to which the control
    /// plane now retains the conversation.
    Route(Decision, Vec<u64>),
    /// The control plane does not hold the elided messages: send in full.
    Resend,
    /// The control plane refused the request (fleet saturated): answer 429
    /// with `Retry-After` (milliseconds).
    Refused(u32),
    /// Nothing usable.
    Unusable,
}

/// Turns an encoded PickResponse into an [`Answer`]: unusable when it is
/// undecodable, has no endpoint, or an endpoint that is not `host:port`.
/// Unusable fallbacks are skipped; at most `max_fallbacks` are kept.
pub fn answer(response: &[u8], max_fallbacks: usize) -> Answer {
    let Ok(mut r) = pb::PickResponse::decode(response) else { return Answer::Unusable };
    if r.resend {
        return Answer::Resend;
    }
    if r.retry_after_ms > 0 && r.endpoint.is_empty() {
        return Answer::Refused(r.retry_after_ms);
    }
    let retained = std::mem::take(&mut r.retained_chain_hashes);
    match decide(r, max_fallbacks) {
        Some(d) => Answer::Route(d, retained),
        None => Answer::Unusable,
    }
}

fn decide(r: pb::PickResponse, max_fallbacks: usize) -> Option<Decision> {
    if !endpoint_ok(&r.endpoint) {
        return None;
    }
    let mut header = String::with_capacity(r.endpoint.len() + r.fallbacks.iter().map(|f| f.len() + 1).sum::<usize>());
    header.push_str(&r.endpoint);
    for f in r.fallbacks.iter().filter(|f| endpoint_ok(f) && **f != r.endpoint).take(max_fallbacks) {
        header.push(',');
        header.push_str(f);
    }
    Some(Decision {
        primary_len: r.endpoint.len(),
        header,
        worker_id: r.worker_id,
        matched_blocks: r.matched_blocks,
        total_blocks: r.total_blocks,
        reason: reason_name(r.reason),
        passed_over: (r.best_overlap_blocks, r.best_overlap_worker_id),
        dp_rank: r.data_parallel_rank,
        prefill: endpoint_ok(&r.prefill_endpoint).then_some(r.prefill_endpoint),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::extract::extract;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn encoding_equals_prost(
            msgs in prop::collection::vec(("[a-z]{0,8}", ".{0,300}"), 1..6),
            tools in any::<bool>(), stream in any::<bool>(), mt in prop::option::of(any::<u32>()),
            salt in "[a-z]{0,4}", id in "[a-z0-9-]{0,40}", lora in "[a-z]{0,5}", bytes in any::<u32>(),
            session in "[ -~]{0,20}", tenant in "[a-z0-9]{0,12}", priority in 0u32..10,
            elide in prop::option::of(0usize..7),
            prompt in prop::option::of(prop_oneof![
                ".{0,200}".prop_map(|s| serde_json::json!(s)),
                prop::collection::vec(any::<u32>(), 0..50).prop_map(|v| serde_json::json!(v)),
            ]),
        ) {
            let messages: Vec<_> = msgs.iter().map(|(r, c)| serde_json::json!({"role": r, "content": c})).collect();
            let mut body = serde_json::json!({"model": "m", "messages": messages, "stream": stream, "cache_salt": salt});
            if let Some(mt) = mt { body["max_tokens"] = serde_json::json!(mt); }
            if tools { body["tools"] = serde_json::json!([{"type": "function", "function": {"name": "f"}}]); }
            let api = if let Some(p) = prompt { body["prompt"] = p; Api::Completions } else { Api::Chat };
            let text = serde_json::to_vec(&body).unwrap();
            let e = match extract(&text, api) { Ok(e) => e, Err(_) => return Ok(()) };
            let meta = RequestMeta { request_id: &id, lora_name: &lora, model: "m", body_bytes: bytes, session_id: &session, tenant: &tenant, priority };
            let hashes = chain_hashes(&e);
            let ours = encode_pick(&e, api, &meta, &hashes, elide);
            let mut theirs = pick_request(&e, api, &meta, &hashes);
            for s in theirs.segments.iter_mut().take(elide.map_or(0, |k| k + 1)) {
                s.message_json.clear();
                s.elided = true;
            }
            prop_assert_eq!(&ours, &theirs.encode_to_vec());
            prop_assert_eq!(pb::PickRequest::decode(ours.as_slice()).unwrap(), theirs);
        }
    }

    #[test]
    fn decisions() {
        let enc = |r: pb::PickResponse| r.encode_to_vec();
        let route = |b: &[u8], n: usize| match answer(b, n) {
            Answer::Route(d, _) => Some(d),
            _ => None,
        };
        let d = route(
            &enc(pb::PickResponse {
                endpoint: "10.0.0.1:8000".into(),
                fallbacks: vec!["10.0.0.2:8000".into(), "bad\r\nx:1".into(), "10.0.0.1:8000".into(), "[::1]:9".into()],
                worker_id: "w1".into(),
                matched_blocks: 3,
                total_blocks: 4,
                reason: pb::PickReason::Load as i32,
                mode: "kv".into(),
                best_overlap_blocks: 9,
                best_overlap_worker_id: "w2".into(),
                ..Default::default()
            }),
            4,
        )
        .unwrap();
        assert_eq!(d.passed_over, (9, "w2".to_owned()));
        assert_eq!(d.header, "10.0.0.1:8000,10.0.0.2:8000,[::1]:9");
        assert_eq!(d.endpoint(), "10.0.0.1:8000");
        assert_eq!(d.reason, "load");
        let one = route(
            &enc(pb::PickResponse { endpoint: "a:1".into(), fallbacks: vec!["b:2".into()], ..Default::default() }),
            0,
        );
        assert_eq!(one.unwrap().header, "a:1");
        assert_eq!(answer(&enc(pb::PickResponse::default()), 4), Answer::Unusable);
        assert_eq!(
            answer(&enc(pb::PickResponse { endpoint: "nocolon".into(), ..Default::default() }), 4),
            Answer::Unusable
        );
        assert_eq!(answer(&[0xff, 0xff, 0xff], 4), Answer::Unusable);
        assert_eq!(answer(&enc(pb::PickResponse { resend: true, ..Default::default() }), 4), Answer::Resend);
        let kept =
            enc(pb::PickResponse { endpoint: "a:1".into(), retained_chain_hashes: vec![7, 77], ..Default::default() });
        assert!(matches!(answer(&kept, 0), Answer::Route(_, r) if r == [7, 77]));
    }
}
