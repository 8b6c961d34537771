//! A recording [`Host`] for unit tests of the state machine: headers and
//! bodies are set by the test, every effect is recorded as a [`Call`].

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;

use crate::host::{Host, Metric};

/// An effect the filter had on its host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// A request header set or removed.
    SetRequestHeader(String, Option<String>),
    /// A response header added.
    AddResponseHeader(String, String),
    /// A Pick call with its message.
    Pick(Vec<u8>),
    /// An HTTP call: cluster, headers, body.
    Http(String, Vec<(String, String)>, Vec<u8>),
    /// The request body replaced.
    ReplaceBody(Vec<u8>),
    /// The request resumed.
    Resume,
    /// A local reply: status and body.
    Local(u32, Vec<u8>),
    /// A header of the local reply that follows.
    LocalHeader(String, String),
}

/// An HTTP call the filter made: cluster, headers, body.
pub type HttpCall = (String, Vec<(String, String)>, Vec<u8>);

/// The mock host.
#[derive(Debug, Default)]
pub struct MockHost {
    now_ns: Cell<u64>,
    req_headers: RefCell<BTreeMap<String, String>>,
    resp_headers: RefCell<BTreeMap<String, String>>,
    body: RefCell<Vec<u8>>,
    chunk: RefCell<Vec<u8>>,
    calls: RefCell<Vec<Call>>,
    metrics: RefCell<[u64; Metric::COUNT]>,
    refuse: Cell<bool>,
    refuse_http: Cell<bool>,
    next_token: Cell<u32>,
    grpc_message: RefCell<Option<String>>,
    upstream: RefCell<Option<String>>,
}

impl MockHost {
    /// A request with this method and path.
    pub fn new(method: &str, path: &str) -> Self {
        let h = Self { now_ns: Cell::new(1_000_000_000), next_token: Cell::new(1), ..Default::default() };
        h.req_headers.borrow_mut().insert(":method".into(), method.into());
        h.req_headers.borrow_mut().insert(":path".into(), path.into());
        h
    }

    /// A POST to `path`.
    pub fn post(path: &str) -> Self {
        Self::new("POST", path)
    }

    /// Sets the upstream address Envoy reports for the stream.
    pub fn set_upstream_address(&self, a: &str) {
        *self.upstream.borrow_mut() = Some(a.to_owned());
    }

    /// Sets the buffered request body.
    pub fn set_body(&self, b: &[u8]) {
        *self.body.borrow_mut() = b.to_vec();
    }

    /// Sets the current response chunk.
    pub fn set_response_chunk(&self, b: &[u8]) {
        *self.chunk.borrow_mut() = b.to_vec();
    }

    /// Sets a response header.
    pub fn set_response_header(&self, k: &str, v: &str) {
        self.resp_headers.borrow_mut().insert(k.into(), v.into());
    }

    /// Moves the clock.
    pub fn advance_us(&self, us: u64) {
        self.now_ns.set(self.now_ns.get() + us * 1000);
    }

    /// The gRPC status message the next failed call reports.
    pub fn set_grpc_message(&self, m: Option<&str>) {
        *self.grpc_message.borrow_mut() = m.map(str::to_owned);
    }

    /// Makes `dispatch_pick` fail.
    pub fn refuse_dispatch(&self) {
        self.refuse.set(true);
    }

    /// Makes `dispatch_http` fail.
    pub fn refuse_http_calls(&self) {
        self.refuse_http.set(true);
    }

    /// Every recorded effect.
    pub fn calls(&self) -> Vec<Call> {
        self.calls.borrow().clone()
    }

    /// The HTTP calls made: cluster, headers, body.
    pub fn http_calls(&self) -> Vec<HttpCall> {
        self.calls
            .borrow()
            .iter()
            .filter_map(|c| if let Call::Http(a, b, d) = c { Some((a.clone(), b.clone(), d.clone())) } else { None })
            .collect()
    }

    /// The buffered request body as it is now.
    pub fn body(&self) -> Vec<u8> {
        self.body.borrow().clone()
    }

    /// Messages of the Pick calls made.
    pub fn picks(&self) -> Vec<Vec<u8>> {
        self.calls.borrow().iter().filter_map(|c| if let Call::Pick(m) = c { Some(m.clone()) } else { None }).collect()
    }

    /// The local reply, if any.
    pub fn local_response(&self) -> Option<(u32, Vec<u8>)> {
        self.calls.borrow().iter().find_map(|c| if let Call::Local(s, b) = c { Some((*s, b.clone())) } else { None })
    }

    /// The value of an added response header.
    pub fn response_headers_added(&self, name: &str) -> Option<String> {
        self.calls.borrow().iter().rev().find_map(|c| match c {
            Call::AddResponseHeader(k, v) if k == name => Some(v.clone()),
            _ => None,
        })
    }

    /// A metric's total (counters) or sum of records (histograms).
    pub fn metric_value(&self, m: Metric) -> u64 {
        self.metrics.borrow().get(m.index()).copied().unwrap_or(0)
    }
}

impl Host for MockHost {
    fn now_ns(&self) -> u64 {
        self.now_ns.get()
    }
    fn request_header(&self, name: &str) -> Option<String> {
        self.req_headers.borrow().get(name).cloned()
    }
    fn set_request_header(&self, name: &str, value: Option<&str>) {
        match value {
            Some(v) => self.req_headers.borrow_mut().insert(name.into(), v.into()),
            None => self.req_headers.borrow_mut().remove(name),
        };
        self.calls.borrow_mut().push(Call::SetRequestHeader(name.into(), value.map(Into::into)));
    }
    fn request_body(&self, start: usize, len: usize) -> Option<Vec<u8>> {
        self.body.borrow().get(start..start.checked_add(len)?).map(<[u8]>::to_vec)
    }
    fn response_header(&self, name: &str) -> Option<String> {
        self.resp_headers.borrow().get(name).cloned()
    }
    fn add_response_header(&self, name: &str, value: &str) {
        self.calls.borrow_mut().push(Call::AddResponseHeader(name.into(), value.into()));
    }
    fn response_body(&self, start: usize, len: usize) -> Option<Vec<u8>> {
        self.chunk.borrow().get(start..start.checked_add(len)?).map(<[u8]>::to_vec)
    }
    fn grpc_status_message(&self) -> Option<String> {
        self.grpc_message.borrow().clone()
    }
    fn upstream_address(&self) -> Option<String> {
        self.upstream.borrow().clone()
    }
    fn dispatch_pick(&self, _svc: &[u8], message: &[u8], _timeout_ms: u32) -> Option<u32> {
        if self.refuse.get() {
            return None;
        }
        self.calls.borrow_mut().push(Call::Pick(message.to_vec()));
        let t = self.next_token.get();
        self.next_token.set(t + 1);
        Some(t)
    }
    fn dispatch_http(&self, cluster: &str, headers: &[(&str, &str)], body: &[u8], _timeout_ms: u32) -> Option<u32> {
        if self.refuse_http.get() {
            return None;
        }
        let h = headers.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        self.calls.borrow_mut().push(Call::Http(cluster.to_owned(), h, body.to_vec()));
        let t = self.next_token.get();
        self.next_token.set(t + 1);
        Some(t)
    }
    fn replace_request_body(&self, old_len: usize, body: &[u8]) {
        let mut b = self.body.borrow_mut();
        let n = old_len.min(b.len());
        b.splice(..n, body.iter().copied());
        self.calls.borrow_mut().push(Call::ReplaceBody(body.to_vec()));
    }
    fn resume_request(&self) {
        self.calls.borrow_mut().push(Call::Resume);
    }
    fn send_local_response(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        let mut calls = self.calls.borrow_mut();
        calls.extend(headers.iter().map(|(k, v)| Call::LocalHeader((*k).to_owned(), (*v).to_owned())));
        calls.push(Call::Local(status, body.to_vec()));
    }
    fn metric(&self, m: Metric, v: u64) {
        if let Some(x) = self.metrics.borrow_mut().get_mut(m.index()) {
            *x += v;
        }
    }
}
