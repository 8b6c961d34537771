//! The fuzz driver of one exchange.

use std::sync::Arc;

use kvgate_core::App;
use prost::Message as _;

use crate::EppMetrics;
use crate::exchange::Exchange;
use crate::ext_proc::{self as xp, HeaderValue, ProcessingRequest, processing_request};

/// Drives one ext_proc exchange from arbitrary bytes (the fuzz target
/// `epp_exchange`; tests). `data` is a sequence of parts, each a 2-byte
/// little-endian length and that many bytes, whose first byte selects: an
/// encoded `ProcessingRequest` (decoded; undecodable parts are skipped as the
/// gRPC layer would refuse them), request headers of a routed POST in a body
/// mode, a request body chunk, or a response body chunk. Returns the number
/// of answers; must never panic.
#[doc(hidden)]
pub fn drive_exchange(app: Arc<App>, mut data: &[u8]) -> usize {
    let metrics = EppMetrics::register(&app);
    let mut x = Exchange::new(app, metrics);
    let mut answers = 0;
    while let [a, b, rest @ ..] = data {
        let len = usize::from(u16::from_le_bytes([*a, *b])).min(rest.len());
        let (part, next) = rest.split_at(len);
        data = next;
        let Some((&sel, part)) = part.split_first() else { continue };
        let flag = part.first().copied().unwrap_or(0);
        let msg = match sel % 4 {
            0 => match ProcessingRequest::decode(part) {
                Ok(m) => m,
                Err(_) => continue,
            },
            1 => {
                let hv = |k: &str, v: &str| HeaderValue { key: k.into(), value: String::new(), raw_value: v.into() };
                let path = if flag & 1 == 0 { "/v1/chat/completions" } else { "/v1/completions" };
                ProcessingRequest {
                    request: Some(processing_request::Request::RequestHeaders(xp::HttpHeaders {
                        headers: Some(xp::HeaderMap { headers: vec![hv(":method", "POST"), hv(":path", path)] }),
                        end_of_stream: flag & 2 != 0,
                    })),
                    protocol_config: Some(xp::ProtocolConfiguration {
                        request_body_mode: i32::from(flag >> 2) % 6,
                        response_body_mode: i32::from(flag >> 5) % 6,
                        send_body_without_waiting_for_header_response: false,
                    }),
                    ..Default::default()
                }
            }
            2 => ProcessingRequest {
                request: Some(processing_request::Request::RequestBody(xp::HttpBody {
                    body: part.get(1..).unwrap_or_default().to_vec(),
                    end_of_stream: flag & 1 != 0,
                })),
                ..Default::default()
            },
            _ => ProcessingRequest {
                request: Some(processing_request::Request::ResponseBody(xp::HttpBody {
                    body: part.get(1..).unwrap_or_default().to_vec(),
                    end_of_stream: flag & 1 != 0,
                })),
                ..Default::default()
            },
        };
        answers += x.on_message(msg).len();
    }
    x.finish();
    answers
}
