//! The protobuf answers of the picker: the destination (header and
//! dynamic metadata), the body echoed in full-duplex mode, local OpenAI-style
//! errors, and the small readers of what the data plane sends.

use crate::ext_proc::{
    self as xp, BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeaderValue, HeaderValueOption, HttpStatus,
    ImmediateResponse, ProcessingResponse, StreamedBodyResponse, body_mutation, header_value_option,
    processing_response,
};
use crate::{DESTINATION, ECHO_CHUNK, METADATA_NAMESPACE, SUBSET_KEY, SUBSET_NAMESPACE};

pub(crate) fn micros(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

pub(crate) fn answer(r: processing_response::Response) -> ProcessingResponse {
    ProcessingResponse { response: Some(r), dynamic_metadata: None }
}

pub(crate) fn body_continue(request: bool) -> ProcessingResponse {
    let b = BodyResponse::default();
    answer(if request {
        processing_response::Response::RequestBody(b)
    } else {
        processing_response::Response::ResponseBody(b)
    })
}

/// The request body sent back in full-duplex mode, in chunks.
pub(crate) fn echo_request(body: &[u8], end_of_stream: bool) -> Vec<ProcessingResponse> {
    let chunks: Vec<&[u8]> = if body.is_empty() { vec![&[][..]] } else { body.chunks(ECHO_CHUNK).collect() };
    let n = chunks.len();
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let m = BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(StreamedBodyResponse {
                    body: c.to_vec(),
                    end_of_stream: end_of_stream && i + 1 == n,
                })),
            };
            let r = CommonResponse { body_mutation: Some(m), ..Default::default() };
            answer(processing_response::Response::RequestBody(BodyResponse { response: Some(r) }))
        })
        .collect()
}

/// Sets the destination header (a client's own value is replaced), the
/// data-parallel rank header and the prefill worker's header of a
/// disaggregated request (each removed when the decision has none, so that
/// a client's own never reaches the engine).
pub(crate) fn destination(value: &str, dp_rank: Option<u32>, prefill: Option<&str>) -> HeaderMutation {
    let set = |key: &str, value: &[u8]| HeaderValueOption {
        header: Some(HeaderValue { key: key.into(), value: String::new(), raw_value: value.to_vec() }),
        append_action: header_value_option::HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
    };
    let mut set_headers = vec![set(DESTINATION, value.as_bytes())];
    let mut remove_headers = Vec::new();
    match dp_rank {
        Some(r) => set_headers.push(set(kvgate_protocol::DP_RANK_HEADER, r.to_string().as_bytes())),
        None => remove_headers.push(kvgate_protocol::DP_RANK_HEADER.to_owned()),
    }
    match prefill {
        Some(p) => set_headers.push(set(kvgate_protocol::PREFILLER_HEADER, p.as_bytes())),
        None => remove_headers.push(kvgate_protocol::PREFILLER_HEADER.to_owned()),
    }
    HeaderMutation { set_headers, remove_headers }
}

/// `{"envoy.lb": {"x-gateway-destination-endpoint": value}}`.
pub(crate) fn metadata(value: &str) -> prost_types::Struct {
    use prost_types::value::Kind;
    let inner = prost_types::Struct {
        fields: [(DESTINATION.to_owned(), prost_types::Value { kind: Some(Kind::StringValue(value.to_owned())) })]
            .into_iter()
            .collect(),
    };
    prost_types::Struct {
        fields: [(METADATA_NAMESPACE.to_owned(), prost_types::Value { kind: Some(Kind::StructValue(inner)) })]
            .into_iter()
            .collect(),
    }
}

/// The endpoints a data plane allows, when it says.
pub(crate) fn subset_hint(md: Option<&xp::Metadata>) -> Option<Vec<String>> {
    use prost_types::value::Kind;
    let ns = md?.filter_metadata.get(SUBSET_NAMESPACE)?;
    let Kind::ListValue(list) = ns.fields.get(SUBSET_KEY)?.kind.as_ref()? else { return Some(Vec::new()) };
    Some(
        list.values
            .iter()
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(s.clone()),
                _ => None,
            })
            .collect(),
    )
}

/// A header's value: Envoy sends it in `raw_value`.
pub(crate) fn header_text(h: &HeaderValue) -> String {
    if h.raw_value.is_empty() { h.value.clone() } else { String::from_utf8_lossy(&h.raw_value).into_owned() }
}

/// The `model` of a body kvgate does not route by prefix (to balance it
/// over that model's workers).
pub(crate) fn model_of(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct M {
        model: String,
    }
    serde_json::from_slice::<M>(body).ok().map(|m| m.model)
}

/// A local answer with an OpenAI-style JSON error.
pub(crate) fn openai_error(code: u16, kind: &str, message: &str) -> ImmediateResponse {
    let body = serde_json::json!({"error": {"message": message, "type": kind, "code": code}}).to_string();
    ImmediateResponse {
        status: Some(HttpStatus { code: i32::from(code) }),
        headers: Some(HeaderMutation {
            set_headers: vec![HeaderValueOption {
                header: Some(HeaderValue {
                    key: "content-type".into(),
                    value: String::new(),
                    raw_value: b"application/json".to_vec(),
                }),
                append_action: header_value_option::HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
            }],
            remove_headers: Vec::new(),
        }),
        body: body.into_bytes(),
        details: format!("kvgate_epp_{kind}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A data-parallel rank is set beside the destination; without one, a
    /// client's own rank header is removed.
    #[test]
    fn the_rank_header_follows_the_decision() {
        let keys = |m: &HeaderMutation| -> Vec<(String, Vec<u8>)> {
            m.set_headers
                .iter()
                .filter_map(|h| h.header.as_ref())
                .map(|h| (h.key.clone(), h.raw_value.clone()))
                .collect()
        };
        let ranked = destination("10.0.0.1:8000,10.0.0.2:8000", Some(3), Some("10.0.0.9:8000"));
        assert_eq!(
            keys(&ranked),
            vec![
                (DESTINATION.to_owned(), b"10.0.0.1:8000,10.0.0.2:8000".to_vec()),
                (kvgate_protocol::DP_RANK_HEADER.to_owned(), b"3".to_vec()),
                (kvgate_protocol::PREFILLER_HEADER.to_owned(), b"10.0.0.9:8000".to_vec())
            ]
        );
        assert!(ranked.remove_headers.is_empty());
        let plain = destination("10.0.0.1:8000", None, None);
        assert_eq!(keys(&plain).len(), 1);
        let removed = [kvgate_protocol::DP_RANK_HEADER, kvgate_protocol::PREFILLER_HEADER].map(str::to_owned);
        assert_eq!(plain.remove_headers, removed.to_vec());
    }
}
