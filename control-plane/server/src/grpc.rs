//! The gRPC adapter: `kvgate.v1.Router` (Pick, Report) over the core, with
//! the core's domain errors mapped to gRPC status codes here and nowhere
//! else, and every response counted by code.
//!
//! | core | gRPC |
//! |---|---|
//! | `Ok` | OK |
//! | `PickError::Resend` | OK with `resend: true` (the filter sends the elided messages) |
//! | `PickError::UnknownModel` | NOT_FOUND |
//! | `PickError::Invalid` | INVALID_ARGUMENT |
//! | `PickError::NoWorkers` | UNAVAILABLE |

use std::sync::Arc;

use kvgate_core::app::{HEAVY_PROMPT_BYTES, prompt_bytes};
use kvgate_core::{App, PickError};
use kvgate_protocol::pb;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tonic::{Code, Request, Response, Status};

use crate::router_server::Router;

/// `{code}` of a gRPC response (the numeric code, as gRPC writes it).
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct CodeLabel {
    code: u8,
}

/// gRPC responses by status code, registered in the app's registry.
#[derive(Debug, Clone)]
pub struct GrpcMetrics {
    responses: Family<CodeLabel, Counter>,
}

impl GrpcMetrics {
    /// Registers `kvgate_grpc_responses_total{code}`.
    pub fn register(app: &App) -> Self {
        let m = Self { responses: Family::default() };
        app.metrics.register("kvgate_grpc_responses", "gRPC responses by status code.", m.responses.clone());
        m
    }

    /// Counts one response.
    pub fn count(&self, code: Code) {
        self.responses.get_or_create(&CodeLabel { code: code as u8 }).inc();
    }
}

/// The core's refusal as a gRPC answer.
pub fn to_grpc(e: PickError) -> Result<pb::PickResponse, Status> {
    match e {
        PickError::Resend => Ok(pb::PickResponse { resend: true, ..Default::default() }),
        PickError::UnknownModel(_) => Err(Status::not_found(e.to_string())),
        PickError::Invalid(_) => Err(Status::invalid_argument(e.to_string())),
        PickError::NoWorkers { .. } => Err(Status::unavailable(e.to_string())),
    }
}

/// The `kvgate.v1.Router` service.
#[derive(Debug, Clone)]
pub struct Service {
    app: Arc<App>,
    metrics: GrpcMetrics,
}

impl Service {
    /// The service over `app`, counting responses in `metrics`.
    pub fn new(app: Arc<App>, metrics: GrpcMetrics) -> Self {
        Self { app, metrics }
    }
}

#[tonic::async_trait]
impl Router for Service {
    async fn pick(&self, request: Request<pb::PickRequest>) -> Result<Response<pb::PickResponse>, Status> {
        let req = request.get_ref();
        // Tokenizing a large prompt is CPU work: off the scheduler's hands.
        let r = kvgate_epp::service::off_scheduler(prompt_bytes(req) > HEAVY_PROMPT_BYTES, || self.app.pick(req));
        // Errors are counted by the response layer (they travel in headers).
        let r = r.or_else(to_grpc);
        if r.is_ok() {
            self.metrics.count(Code::Ok);
        }
        r.map(Response::new)
    }

    async fn report(&self, request: Request<pb::CompletionReportBatch>) -> Result<Response<pb::ReportAck>, Status> {
        self.metrics.count(Code::Ok);
        Ok(Response::new(self.app.report(request.get_ref())))
    }
}
