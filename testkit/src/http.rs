//! HTTP for tests, over `reqwest`'s blocking client: one request, the whole
//! response (status, headers with lower-case names, body), a new
//! connection each time (no pooling, as a client behind a gateway would
//! open them).

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::Result;

/// A response.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    /// Status code.
    pub status: u16,
    /// Headers, names lower-cased.
    pub headers: Vec<(String, String)>,
    /// Body.
    pub body: Vec<u8>,
}

impl HttpResponse {
    /// First value of header `name` (lower-case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// The shared client: 2 s to connect, 120 s for a whole exchange, no
/// idle connections kept.
pub fn client() -> &'static reqwest::blocking::Client {
    static CLIENT: OnceLock<reqwest::blocking::Client> = OnceLock::new();
    CLIENT.get_or_init(|| {
        reqwest::blocking::Client::builder()
            .connect_timeout(Duration::from_secs(2))
            .timeout(Duration::from_secs(120))
            .pool_max_idle_per_host(0)
            .build()
            .unwrap_or_else(|_| reqwest::blocking::Client::new())
    })
}

/// Starts a request to `http://addr{path}` with these headers and body.
pub fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<reqwest::blocking::Response> {
    let method = reqwest::Method::from_bytes(method.as_bytes())?;
    let mut req = client().request(method, format!("http://{addr}{path}")).body(body.to_vec());
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    Ok(req.send()?)
}

/// One request; the whole response.
pub fn http_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<HttpResponse> {
    let r = send(addr, method, path, headers, body)?;
    let status = r.status().as_u16();
    let headers = r
        .headers()
        .iter()
        .map(|(k, v)| (k.as_str().to_owned(), String::from_utf8_lossy(v.as_bytes()).into_owned()))
        .collect();
    Ok(HttpResponse { status, headers, body: r.bytes()?.to_vec() })
}
