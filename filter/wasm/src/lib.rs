//! The kvgate Proxy-Wasm filter for Envoy (`wasm32-wasip1`, runtime
//! `envoy.wasm.runtime.v8`).
//!
//! A thin shim: every callback goes to [`kvgate_filter_core`], and [`Envoy`]
//! implements its `Host` trait with `proxy_wasm::hostcalls`. Per Envoy worker
//! thread there is one root context (configuration, metric ids, the
//! completion-report queue and its timer) shared with that thread's HTTP
//! contexts through an `Rc`.
//!
//! Build: `cargo build --profile wasm --target wasm32-wasip1 -p kvgate-filter-wasm`
//! → `target/wasm32-wasip1/wasm/kvgate_filter.wasm`.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing, clippy::unreachable)
)]

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

use kvgate_filter_core::{Action, Config, Host, Metric, MetricKind, ReportQueue, RequestFilter, Retained};
use kvgate_protocol::{REPORT_METHOD, ROUTER_SERVICE, pb};
use prost::Message as _;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action as PwAction, BufferType, ContextType, LogLevel, MapType, MetricType};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

/// State of one Envoy worker thread, shared by its contexts.
struct Shared {
    cfg: Rc<Config>,
    metric_ids: [Option<u32>; Metric::COUNT],
    reports: RefCell<ReportQueue>,
    retained: Rc<Retained>,
}

/// The host: proxy-wasm host calls on the current stream.
pub struct Envoy<'a> {
    metric_ids: &'a [Option<u32>; Metric::COUNT],
}

fn pw(a: Action) -> PwAction {
    match a {
        Action::Continue => PwAction::Continue,
        Action::Pause => PwAction::Pause,
    }
}

fn metric(ids: &[Option<u32>; Metric::COUNT], m: Metric, v: u64) {
    if let Some(Some(id)) = ids.get(m.index()) {
        let _ = match m.kind() {
            MetricKind::Histogram => hostcalls::record_metric(*id, v),
            MetricKind::Counter => hostcalls::increment_metric(*id, i64::try_from(v).unwrap_or(i64::MAX)),
        };
    }
}

impl Host for Envoy<'_> {
    fn now_ns(&self) -> u64 {
        hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
    }
    fn request_header(&self, name: &str) -> Option<String> {
        hostcalls::get_map_value(MapType::HttpRequestHeaders, name).ok().flatten()
    }
    fn set_request_header(&self, name: &str, value: Option<&str>) {
        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, name, value);
    }
    fn request_body(&self, start: usize, len: usize) -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::HttpRequestBody, start, len).ok().flatten()
    }
    fn response_header(&self, name: &str) -> Option<String> {
        hostcalls::get_map_value(MapType::HttpResponseHeaders, name).ok().flatten()
    }
    fn add_response_header(&self, name: &str, value: &str) {
        let _ = hostcalls::add_map_value(MapType::HttpResponseHeaders, name, value);
    }
    fn response_body(&self, start: usize, len: usize) -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::HttpResponseBody, start, len).ok().flatten()
    }
    fn grpc_status_message(&self) -> Option<String> {
        hostcalls::get_grpc_status().ok().and_then(|(_, m)| m)
    }
    fn upstream_address(&self) -> Option<String> {
        let v = hostcalls::get_property(vec!["upstream", "address"]).ok().flatten()?;
        String::from_utf8(v).ok()
    }
    fn dispatch_pick(&self, grpc_service: &[u8], message: &[u8], timeout_ms: u32) -> Option<u32> {
        let service = std::str::from_utf8(grpc_service).ok()?;
        hostcalls::dispatch_grpc_call(
            service,
            ROUTER_SERVICE,
            kvgate_protocol::PICK_METHOD,
            Vec::new(),
            Some(message),
            Duration::from_millis(u64::from(timeout_ms)),
        )
        .ok()
    }
    fn dispatch_http(&self, cluster: &str, headers: &[(&str, &str)], body: &[u8], timeout_ms: u32) -> Option<u32> {
        let timeout = Duration::from_millis(u64::from(timeout_ms));
        hostcalls::dispatch_http_call(cluster, headers.to_vec(), Some(body), Vec::new(), timeout).ok()
    }
    fn replace_request_body(&self, old_len: usize, body: &[u8]) {
        let _ = hostcalls::set_buffer(BufferType::HttpRequestBody, 0, old_len, body);
    }
    fn resume_request(&self) {
        let _ = hostcalls::resume_http_request();
    }
    fn send_local_response(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        let _ = hostcalls::send_http_response(status, headers.to_vec(), Some(body));
    }
    fn metric(&self, m: Metric, v: u64) {
        metric(self.metric_ids, m, v);
    }
}

#[derive(Default)]
struct Root {
    shared: Option<Rc<Shared>>,
    reporter_id: String,
}

impl Context for Root {
    fn on_grpc_call_response(&mut self, token: u32, status: u32, size: usize) {
        let Some(shared) = self.shared.as_ref() else { return };
        let mut q = shared.reports.borrow_mut();
        if status == 0 {
            let accepted = self
                .get_grpc_call_response_body(0, size)
                .and_then(|b| pb::ReportAck::decode(b.as_slice()).ok())
                .map_or(0, |a| a.accepted);
            if q.acked(token) {
                metric(&shared.metric_ids, Metric::ReportsSent, u64::from(accepted));
            }
        } else {
            metric(&shared.metric_ids, Metric::ReportErrors, 1);
            let dropped = q.failed(Some(token));
            metric(&shared.metric_ids, Metric::ReportsDropped, dropped);
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = self.get_plugin_configuration().unwrap_or_default();
        let cfg = match Config::parse(&bytes) {
            Ok(c) => c,
            Err(e) => {
                proxy_wasm::hostcalls::log(LogLevel::Error, &e.to_string()).ok();
                return false;
            }
        };
        let mut metric_ids = [None; Metric::COUNT];
        for (m, name, kind) in Metric::all() {
            let t = match kind {
                MetricKind::Counter => MetricType::Counter,
                MetricKind::Histogram => MetricType::Histogram,
            };
            if let Some(slot) = metric_ids.get_mut(m.index()) {
                *slot = hostcalls::define_metric(t, name).ok();
            }
        }
        if cfg.reports.enabled {
            let _ = hostcalls::set_tick_period(Duration::from_millis(u64::from(cfg.reports.interval_ms)));
        }
        let node = self
            .get_property(vec!["node", "id"])
            .and_then(|b| String::from_utf8(b).ok())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "envoy".into());
        self.reporter_id = node + "/" + &self.reporter_id_suffix();
        let reports = RefCell::new(ReportQueue::new(cfg.reports.max_queue, cfg.reports.max_batch));
        let retained = Rc::new(Retained::new(cfg.retained_conversations));
        self.shared = Some(Rc::new(Shared { cfg: Rc::new(cfg), metric_ids, reports, retained }));
        true
    }

    fn on_tick(&mut self) {
        let Some(shared) = self.shared.as_ref() else { return };
        let mut q = shared.reports.borrow_mut();
        let Some((bytes, _n)) = q.take_batch(&self.reporter_id) else { return };
        let Ok(service) = std::str::from_utf8(&shared.cfg.grpc_service) else {
            q.failed(None);
            return;
        };
        match hostcalls::dispatch_grpc_call(
            service,
            ROUTER_SERVICE,
            REPORT_METHOD,
            Vec::new(),
            Some(&bytes),
            Duration::from_secs(5),
        ) {
            Ok(token) => q.sent(token),
            Err(_) => {
                metric(&shared.metric_ids, Metric::ReportErrors, 1);
                let dropped = q.failed(None);
                metric(&shared.metric_ids, Metric::ReportsDropped, dropped);
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let shared = self.shared.clone()?;
        let filter = RequestFilter::new(shared.cfg.clone()).with_retained(shared.retained.clone());
        Some(Box::new(Http { shared, filter }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

impl Root {
    /// Distinguishes the worker threads' root contexts of one Envoy (each
    /// thread has its own VM; the start time in nanoseconds is unique enough
    /// for telling reporters apart in metrics).
    fn reporter_id_suffix(&self) -> String {
        let ns = hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.subsec_nanos());
        ns.to_string()
    }
}

struct Http {
    shared: Rc<Shared>,
    filter: RequestFilter,
}

impl Context for Http {
    fn on_grpc_call_response(&mut self, token: u32, status: u32, size: usize) {
        let answer = if status == 0 { self.get_grpc_call_response_body(0, size) } else { None };
        let host = Envoy { metric_ids: &self.shared.metric_ids };
        self.filter.on_pick_response(&host, token, status, answer.as_deref());
    }

    /// The prefill leg's answer (no headers: the call failed).
    fn on_http_call_response(&mut self, token: u32, _headers: usize, size: usize, _trailers: usize) {
        let status = self.get_http_call_response_header(":status").and_then(|s| s.parse().ok()).unwrap_or(0);
        let body = if size <= kvgate_protocol::pd::MAX_PREFILL_ANSWER {
            self.get_http_call_response_body(0, size)
        } else {
            None
        };
        let host = Envoy { metric_ids: &self.shared.metric_ids };
        self.filter.on_prefill_response(&host, token, status, body.as_deref());
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> PwAction {
        let host = Envoy { metric_ids: &self.shared.metric_ids };
        pw(self.filter.on_request_headers(&host, end_of_stream))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> PwAction {
        let host = Envoy { metric_ids: &self.shared.metric_ids };
        pw(self.filter.on_request_body(&host, body_size, end_of_stream))
    }

    fn on_http_response_headers(&mut self, _n: usize, _end_of_stream: bool) -> PwAction {
        let host = Envoy { metric_ids: &self.shared.metric_ids };
        pw(self.filter.on_response_headers(&host))
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> PwAction {
        let host = Envoy { metric_ids: &self.shared.metric_ids };
        let action = self.filter.on_response_body(&host, body_size, end_of_stream);
        if let Some(report) = self.filter.first_token_report(&host) {
            let dropped = self.shared.reports.borrow_mut().push(report);
            metric(&self.shared.metric_ids, Metric::ReportsDropped, dropped);
        }
        pw(action)
    }

    fn on_log(&mut self) {
        let host = Envoy { metric_ids: &self.shared.metric_ids };
        if let Some(report) = self.filter.finish(&host) {
            let dropped = self.shared.reports.borrow_mut().push(report);
            metric(&self.shared.metric_ids, Metric::ReportsDropped, dropped);
        }
    }
}
