//! A streaming OpenAI chat client on one HTTP/1.1 keep-alive connection,
//! measuring at the client as the published runs do: time to the first
//! content token, end to end, and the usage the server reported.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use tokio::net::TcpStream;

/// What one request measured.
#[derive(Debug, Clone, Default)]
pub struct Reply {
    /// The assistant's text (the next turn sends it back).
    pub text: String,
    /// Time to the first non-empty content delta.
    pub ttft: Option<Duration>,
    /// Time to the end of the stream.
    pub e2e: Duration,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.completion_tokens`.
    pub completion_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u64,
    /// The kvgate filter's debug headers, when it sends them: why the worker
    /// was chosen (`x-kvgate-reason`: `kv`, `approx`, `load`, ...), the
    /// prompt blocks the control plane found cached there (`x-kvgate-blocks`)
    /// and the worker (`x-kvgate-worker`).
    pub route: Option<Route>,
}

/// What a kvgate router said about its choice.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Route {
    pub reason: String,
    pub matched_blocks: u32,
    /// The chosen worker's id (`x-kvgate-worker`).
    #[serde(default)]
    pub worker: String,
    /// More matched blocks on a worker passed over (`x-kvgate-passed-over`),
    /// 0 when none was.
    #[serde(default)]
    pub passed_over_blocks: u32,
}

impl Route {
    /// From the response headers; `None` without `x-kvgate-reason`.
    fn from_headers(h: &hyper::HeaderMap) -> Option<Route> {
        let reason = h.get("x-kvgate-reason")?.to_str().ok()?.to_owned();
        let matched_blocks = h
            .get("x-kvgate-blocks")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split('/').next())
            .and_then(|m| m.parse().ok())
            .unwrap_or(0);
        let worker = h.get("x-kvgate-worker").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
        let passed_over_blocks = h
            .get("x-kvgate-passed-over")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split('@').next())
            .and_then(|b| b.parse().ok())
            .unwrap_or(0);
        Some(Route { reason, matched_blocks, worker, passed_over_blocks })
    }
}

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<Choice>,
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct Choice {
    delta: Option<Delta>,
}

#[derive(Deserialize)]
struct Delta {
    content: Option<String>,
}

#[derive(Deserialize)]
struct Usage {
    prompt_tokens: u64,
    completion_tokens: u64,
    prompt_tokens_details: Option<Details>,
}

#[derive(Deserialize)]
struct Details {
    cached_tokens: Option<u64>,
}

/// One client connection (re-opened after an error).
pub struct ChatClient {
    addr: SocketAddr,
    host: String,
    sender: Option<SendRequest<Full<Bytes>>>,
    /// Sent as `x-tenant-id` when set.
    pub tenant: Option<&'static str>,
}

impl ChatClient {
    /// A client of the OpenAI server at `addr` (not connected yet).
    pub fn new(addr: SocketAddr) -> Self {
        ChatClient { addr, host: addr.to_string(), sender: None, tenant: None }
    }

    async fn connection(&mut self) -> Result<&mut SendRequest<Full<Bytes>>> {
        if let Some(s) = &mut self.sender
            && s.ready().await.is_ok()
        {
            // The borrow checker wants the second lookup.
            return self.sender.as_mut().ok_or_else(|| anyhow!("connection lost"));
        }
        self.sender = None;
        let stream = TcpStream::connect(self.addr).await.with_context(|| format!("connect {}", self.addr))?;
        stream.set_nodelay(true)?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(QuickAck(stream))).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(self.sender.insert(sender))
    }

    /// POSTs `body` (a streaming chat request) to `/v1/chat/completions` and
    /// reads the event stream to its end.
    pub async fn chat(&mut self, body: Vec<u8>) -> Result<Reply> {
        let host = self.host.clone();
        let result = self.chat_inner(&host, body).await;
        if result.is_err() {
            self.sender = None; // never reuse a connection in an unknown state
        }
        result
    }

    async fn chat_inner(&mut self, host: &str, body: Vec<u8>) -> Result<Reply> {
        let mut req = hyper::Request::post("/v1/chat/completions")
            .header("host", host)
            .header("content-type", "application/json")
            .header("accept", "text/event-stream");
        if let Some(t) = self.tenant {
            req = req.header("x-tenant-id", t);
        }
        let req = req.body(Full::new(Bytes::from(body)))?;
        let sender = self.connection().await?;
        let start = Instant::now();
        let resp = sender.send_request(req).await?;
        let status = resp.status();
        let route = Route::from_headers(resp.headers());
        let mut body = resp.into_body();
        if !status.is_success() {
            let bytes = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            bail!("HTTP {status}: {}", String::from_utf8_lossy(&bytes[..bytes.len().min(200)]));
        }
        let mut reply = Reply { route, ..Reply::default() };
        let mut buf: Vec<u8> = Vec::with_capacity(8192);
        let mut done = false;
        while let Some(frame) = body.frame().await {
            let frame = frame?;
            let Some(data) = frame.data_ref() else { continue };
            buf.extend_from_slice(data);
            let mut used = 0;
            while let Some(end) = find(&buf[used..], b"\n\n") {
                let event = &buf[used..used + end];
                used += end + 2;
                done |= on_event(event, &mut reply, start)?;
            }
            buf.drain(..used);
        }
        reply.e2e = start.elapsed();
        if !done {
            bail!("stream ended without [DONE]");
        }
        if reply.completion_tokens == 0 {
            bail!("no usage in the stream");
        }
        Ok(reply)
    }
}

/// A TCP stream that acknowledges every read at once (`TCP_QUICKACK`,
/// which Linux clears as it goes, so it is set again after each read).
///
/// Without it, on a kept-alive connection, a server that writes two small
/// SSE chunks without `TCP_NODELAY` waits for the client's delayed ACK
/// (~40 ms) before the second, the first token. That is a real cost for a
/// real client, but here it is wall-clock time that the speedup would
/// multiply into simulated time (40 ms becomes 320 ms at 8x), so the client
/// takes it away for every frontend alike.
struct QuickAck(TcpStream);

impl tokio::io::AsyncRead for QuickAck {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let r = std::pin::Pin::new(&mut self.0).poll_read(cx, buf);
        if r.is_ready() {
            let _ = socket2::SockRef::from(&self.0).set_tcp_quickack(true);
        }
        r
    }
}

impl tokio::io::AsyncWrite for QuickAck {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

fn find(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).position(|w| w == n)
}

/// Handles one server-sent event; true on `[DONE]`.
fn on_event(event: &[u8], reply: &mut Reply, start: Instant) -> Result<bool> {
    for line in event.split(|&b| b == b'\n') {
        let Some(data) = line.strip_prefix(b"data:") else { continue };
        let data = data.strip_prefix(b" ").unwrap_or(data);
        if data == b"[DONE]" {
            return Ok(true);
        }
        let c: Chunk = serde_json::from_slice(data).context("bad SSE chunk")?;
        for ch in &c.choices {
            if let Some(t) = ch.delta.as_ref().and_then(|d| d.content.as_deref())
                && !t.is_empty()
            {
                if reply.ttft.is_none() {
                    reply.ttft = Some(start.elapsed());
                }
                reply.text.push_str(t);
            }
        }
        if let Some(u) = c.usage {
            reply.prompt_tokens = u.prompt_tokens;
            reply.completion_tokens = u.completion_tokens;
            reply.cached_tokens = u.prompt_tokens_details.and_then(|d| d.cached_tokens).unwrap_or(0);
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_fill_the_reply() {
        let mut r = Reply::default();
        let t = Instant::now();
        let role = br#"data: {"choices":[{"delta":{"role":"assistant","content":""}}]}"#;
        assert!(!on_event(role, &mut r, t).unwrap());
        assert!(r.ttft.is_none(), "an empty delta is not the first token");
        assert!(!on_event(br#"data: {"choices":[{"delta":{"content":" a b"}}]}"#, &mut r, t).unwrap());
        assert!(r.ttft.is_some());
        let usage = br#"data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":8}}}"#;
        assert!(!on_event(usage, &mut r, t).unwrap());
        assert!(on_event(b"data: [DONE]", &mut r, t).unwrap());
        assert_eq!((r.text.as_str(), r.prompt_tokens, r.completion_tokens, r.cached_tokens), (" a b", 9, 2, 8));
        assert!(on_event(b"data: {not json", &mut r, t).is_err());
    }
}
