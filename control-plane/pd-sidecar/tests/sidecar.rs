//! The sidecar over real HTTP on loopback, between two small engines that
//! record what they receive: both legs as vLLM's connector expects them,
//! and every way a prefill leg can fail leaving the request aggregated.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use kvgate_pd_sidecar::{SidecarOptions, serve};
use serde_json::{Value, json};

/// What an engine saw: (path, prefiller header, body).
type Seen = Arc<Mutex<Vec<(String, Option<String>, Value)>>>;

#[derive(Clone, Copy)]
enum Prefill {
    Answers,
    Fails,
    Slow,
    NoParams,
}

async fn engine(behaviour: Prefill) -> (SocketAddr, Seen) {
    let seen: Seen = Arc::default();
    let handler = |State((seen, b)): State<(Seen, Prefill)>,
                   uri: axum::http::Uri,
                   headers: axum::http::HeaderMap,
                   Json(body): Json<Value>| async move {
        let prefiller = headers.get("x-prefiller-host-port").map(|v| v.to_str().unwrap_or("").to_owned());
        seen.lock().unwrap().push((uri.path().to_owned(), prefiller, body.clone()));
        match b {
            Prefill::Fails => return (StatusCode::INTERNAL_SERVER_ERROR, "boom").into_response(),
            Prefill::Slow => tokio::time::sleep(Duration::from_secs(120)).await,
            _ => {}
        }
        let params = if body["kv_transfer_params"]["do_remote_decode"] == json!(true) {
            if matches!(b, Prefill::NoParams) {
                Value::Null
            } else {
                json!({"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "p0", "remote_block_ids": [0, 1], "remote_host": "127.0.0.1", "remote_port": 1, "tp_size": 1})
            }
        } else {
            Value::Null
        };
        let stream = body["stream"] == json!(true);
        if stream {
            let sse = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: [DONE]\n\n";
            return ([("content-type", "text/event-stream")], sse).into_response();
        }
        Json(json!({"choices": [{"text": "x"}], "kv_transfer_params": params})).into_response()
    };
    let app = axum::Router::new()
        .route("/v1/chat/completions", axum::routing::post(handler))
        .route("/v1/models", axum::routing::get(|| async { "models" }))
        .with_state((seen.clone(), behaviour));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    (addr, seen)
}

async fn sidecar(decode: SocketAddr, timeout_ms: u64) -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let opts = SidecarOptions { decode: decode.to_string(), prefill_timeout: Duration::from_millis(timeout_ms) };
    tokio::spawn(serve(l, opts, std::future::pending()));
    addr
}

/// POSTs a streamed chat request through the sidecar; (status, body).
async fn post(sidecar: SocketAddr, prefiller: Option<&str>) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(sidecar).await.unwrap();
    let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":50}"#;
    let extra = prefiller.map(|p| format!("x-prefiller-host-port: {p}\r\n")).unwrap_or_default();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{extra}content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let status = out.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, out)
}

async fn metrics(sidecar: SocketAddr) -> String {
    let mut s = tokio::net::TcpStream::connect(sidecar).await.unwrap();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(b"GET /kvgate/pd/metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_legs_run_and_the_answer_streams_back() {
    let (p, pseen) = engine(Prefill::Answers).await;
    let (d, dseen) = engine(Prefill::Answers).await;
    let sc = sidecar(d, 10_000).await;
    let (status, body) = post(sc, Some(&p.to_string())).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("data: [DONE]"), "the decode leg's stream reaches the client: {body}");
    let pseen = pseen.lock().unwrap().clone();
    assert_eq!(pseen.len(), 1);
    let (path, header, leg) = &pseen[0];
    assert_eq!((path.as_str(), header), ("/v1/chat/completions", &None), "the prefiller header is not forwarded");
    assert_eq!((leg["max_tokens"].as_u64(), leg["stream"].as_bool()), (Some(1), Some(false)));
    assert_eq!(leg["kv_transfer_params"]["do_remote_decode"], json!(true));
    let dseen = dseen.lock().unwrap().clone();
    assert_eq!(dseen.len(), 1);
    let leg = &dseen[0].2;
    assert_eq!(leg["kv_transfer_params"]["remote_engine_id"], json!("p0"));
    assert_eq!(leg["kv_transfer_params"]["do_remote_prefill"], json!(true));
    assert_eq!((leg["max_tokens"].as_u64(), leg["stream"].as_bool()), (Some(50), Some(true)));
    let m = metrics(sc).await;
    assert!(m.contains(r#"kvgate_pd_requests_total{outcome="disaggregated",cause=""} 1"#), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_slow_or_unusable_prefill_leaves_the_request_aggregated() {
    let (d, dseen) = engine(Prefill::Answers).await;
    let sc = sidecar(d, 2_000).await;
    let (failing, _) = engine(Prefill::Fails).await;
    let (slow, _) = engine(Prefill::Slow).await;
    let (no_params, _) = engine(Prefill::NoParams).await;
    // Nothing listens on a port just released.
    let gone = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
    for (prefiller, cause) in [(failing, "status"), (slow, "timeout"), (no_params, "no_params"), (gone, "unreachable")]
    {
        let (status, body) = post(sc, Some(&prefiller.to_string())).await;
        assert_eq!(status, 200, "{cause}: {body}");
        assert!(body.contains("data: [DONE]"), "{cause}");
        let last = dseen.lock().unwrap().last().cloned().unwrap();
        assert!(last.2.get("kv_transfer_params").is_none(), "{cause}: the original request, aggregated");
        let m = metrics(sc).await;
        assert!(m.contains(&format!(r#"kvgate_pd_requests_total{{outcome="fallback",cause="{cause}"}} 1"#)), "{m}");
    }
    // A prefiller that is not host:port: aggregated, counted as such.
    let (status, _) = post(sc, Some("http://10.0.0.9:8000/x")).await;
    assert_eq!(status, 200);
    let m = metrics(sc).await;
    assert!(m.contains(r#"kvgate_pd_requests_total{outcome="fallback",cause="bad_header"} 1"#), "{m}");
    // No prefiller named: straight through.
    let (status, _) = post(sc, None).await;
    assert_eq!(status, 200);
    let m = metrics(sc).await;
    assert!(m.contains(r#"kvgate_pd_requests_total{outcome="aggregated",cause=""} 1"#), "{m}");
    assert!(m.contains(r#"kvgate_pd_requests_total{outcome="fallback",cause="not_json"} 0"#), "{m}");
    assert_eq!(dseen.lock().unwrap().len(), 6);
}
